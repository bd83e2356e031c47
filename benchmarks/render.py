"""Render the benchmark CSVs into a Markdown page, with each script's stated bound beside its figure, and figures.

Reads every ``*.csv`` in ``benchmarks/results/`` (written by the scripts through
``_common.csv_rows``: each row carries the machine, CPU count, Python, torch and transformers
versions and the commit) and writes:

* ``docs/benchmarks_data.md``: a table of every bound in :data:`TARGETS` with the measured figure
  (the worst matching row of its CSV), then one section per CSV with the machine, versions and commit
  stated once, its bounds and measured figures, and the rows as a table;
* one plotly figure per CSV in ``docs/benchmarks_figures/``: PNG when kaleido is installed, else
  HTML (plotly.js from its CDN). Without plotly the page is written without figures.

Usage (repository root)::

    .venv/bin/python benchmarks/render.py
    .venv/bin/python benchmarks/render.py --results DIR --out PAGE.md --figures DIR [--no-figures]
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks_data.md"
FIGURES = ROOT / "docs" / "benchmarks_figures"

#: columns every row carries (``_common.run_facts``); stated once per section when all rows agree
FACTS = ("machine", "cpus", "python", "torch", "transformers", "commit")


@dataclass(frozen=True)
class Target:
    """A stated target: ``column`` of ``csv`` (its file stem) must be ``op`` ``value`` on every row
    that matches ``where``; the measured figure is the worst such row, named by its ``label`` columns."""

    csv: str
    column: str
    op: str  # "<=" or ">="
    value: float
    unit: str
    source: str
    where: tuple[tuple[str, tuple[str, ...]], ...] = ()
    label: tuple[str, ...] = ()

    def met(self, x: float) -> bool:
        return x <= self.value if self.op == "<=" else x >= self.value


#: metric -> its target, the CSV column that measures it, and where the project states it
TARGETS: dict[str, Target] = {
    "steering overhead per decoding step (add at 1 block, ablate at 30)": Target(
        "step_overhead", "overhead_pct", "<=", 3.0, "%",
        "docs/BENCHMARKS.md (Steered generation overhead)",
        where=(("condition", ("add", "ablate")),), label=("batch", "condition")),
    "steered generation overhead, end to end (steerkit, paired median)": Target(
        "generation", "paired_overhead_pct", "<=", 3.0, "%",
        "docs/BENCHMARKS.md (End to end); bench_generation.py",
        where=(("library", ("steerkit",)), ("edit", ("add", "ablate"))), label=("edit", "batch")),
    "fused operations overhead in generation (add, ablate)": Target(
        "steering", "overhead_pct", "<=", 3.0, "%",
        "bench_steering.py (overhead <= 3% for add and ablate)",
        where=(("op", ("add (1 layer)", "ablate (every layer)")),), label=("op", "batch")),
    "per-row configurations vs one shared, throughput": Target(
        "steering_per_row", "per_row_vs_shared_throughput", ">=", 0.9, "x",
        "bench_steering.py (8 different configurations: throughput >= 0.9 of shared)", label=("batch",)),
    "recording throughput, record / bare": Target(
        "record", "throughput_ratio", ">=", 0.9, "x",
        "benchmarks/README.md and bench_record.py (throughput ratio >= 0.9)", label=("prompts", "batch")),
    "vLLM per-request steering in a compiled engine, steered / unsteered throughput": Target(
        "vllm", "ratio_steered_over_unsteered", ">=", 0.95, "x",
        "bench_vllm.py (compiled vLLM, 16 requests, 8 artifacts: steered >= 0.95 of unsteered)",
        where=(("engine", ("vllm compiled",)),), label=("engine",)),
    "vLLM per-request steering in an eager engine, steered / unsteered throughput": Target(
        "vllm", "ratio_steered_over_unsteered", ">=", 0.9, "x",
        "bench_vllm.py (eager vLLM: steered >= 0.9 of unsteered)",
        where=(("engine", ("vllm eager",)),), label=("engine",)),
    "tuning grid, batched vs one generate call per cell": Target(
        "tune", "speedup", ">=", 3.0, "x",
        "benchmarks/README.md and bench_tune.py (per-cell time / batched time >= 3x)",
        where=(("condition", ("per-cell",)),), label=("mode", "cells", "prompts", "tokens")),
    "refusal candidate scoring, batched / one at a time (CPU time)": Target(
        "refusal_scoring", "new_over_old", "<=", 0.333, "x",
        "benchmarks/README.md and bench_refusal.py (batched <= 1/3 of one candidate at a time)",
        where=(("path", ("batched",)),), label=("mode",)),
    "refusal candidate scoring at the defaults / one at a time with full passes (CPU time)": Target(
        "refusal_scoring", "new_over_old", "<=", 0.85, "x",
        "bench_refusal.py (induce passes from the unsteered run: batched <= 0.85 of one candidate at a time)",
        where=(("path", ("batched",)),), label=("mode",)),
    "activation patching of resid_pre, x TransformerLens's get_act_patch_resid_pre": Target(
        "patching", "x_vs_tlens", ">=", 6.0, "x",
        "bench_patching.py (prefix reuse: >= 6x TransformerLens at 1 and 2 threads)",
        where=(("hook", ("resid_pre",)), ("condition", ("steerkit",))), label=("threads",)),
    "activation patching of resid_pre, x the batched full passes (every position unembedded)": Target(
        "patching", "x_vs_full_all_logits", ">=", 2.5, "x",
        "bench_patching.py (prefix reuse: >= 2.5x the batched path of full passes)",
        where=(("hook", ("resid_pre",)), ("condition", ("steerkit",))), label=("threads",)),
    "head patching (z, every position), x TransformerLens's get_act_patch_attn_head_out_all_pos": Target(
        "patching", "x_vs_tlens", ">=", 4.0, "x",
        "bench_patching.py (prefix reuse: >= 4x TransformerLens)",
        where=(("hook", ("z",)), ("condition", ("steerkit",))), label=("threads",)),
    "tuning grid batched (the default), x the same with full prompt passes": Target(
        "tune", "x_vs_full_passes", ">=", 1.2, "x",
        "bench_tune.py (prompt passes from the steered block: >= 1.2x)",
        where=(("condition", ("batched",)),), label=("mode", "cells", "prompts", "tokens")),
    "tuning grid cell by cell, x the same with full prompt passes": Target(
        "tune", "x_vs_full_passes", ">=", 1.2, "x",
        "bench_tune.py (prompt passes from the steered block: >= 1.2x cell by cell)",
        where=(("condition", ("per-cell",)),), label=("mode", "cells", "prompts", "tokens")),
    "fused GPU kernel, fraction of a device copy's bandwidth (headline case)": Target(
        "gpu_kernels", "frac_of_copy", ">=", 0.8, "x",
        "gpu_kernels.py and docs/RESULTS.md (bandwidth >= 0.8 of a device copy)",
        where=(("case", ("ablate4+inject+norm",)),), label=("case", "dtype")),
    "SAE training on the default model at one layer, minutes for 2M tokens (extrapolated)": Target(
        "sae_train", "minutes_for_2m_tokens", "<=", 45.0, "min", "docs/sae_training.md (2M tokens in 45 minutes)",
        where=(("kind", ("train",)),), label=("mode", "tokens")),
    "fused GPU kernel, speed-up over eager torch (headline case)": Target(
        "gpu_kernels", "speedup_vs_naive", ">=", 3.0, "x",
        "gpu_kernels.py and docs/RESULTS.md (speed-up over eager torch >= 3x)",
        where=(("case", ("ablate4+inject+norm",)),), label=("case", "dtype")),
}

TARGETS.update({
    "attribution graph, speedup over circuit-tracer (every length, 1 and 2 threads)": Target(
        "circuits", "speedup_vs_circuit_tracer", ">=", 1.0, "x",
        "docs/circuits.md and bench_circuits.py (at least as fast at every length)",
        where=(("library", ("steerkit",)),), label=("tokens", "threads")),
    "attribution graph at 64 tokens, speedup over circuit-tracer": Target(
        "circuits", "speedup_vs_circuit_tracer", ">=", 2.0, "x", "docs/circuits.md and bench_circuits.py (2x at 64 tokens)",
        where=(("library", ("steerkit",)), ("tokens", ("64",))), label=("tokens", "threads")),
    "attribution graph at 512 tokens, 8192 features, offloaded rows: peak memory": Target(
        "circuits_memory", "peak_rss_mib", "<=", 6144.0, "MiB",
        "docs/circuits.md and bench_circuits_memory.py (at most 6 GiB at 512 tokens)",
        where=(("library", ("steerkit",)), ("tokens", ("512",)), ("options", ('{"offload": true}',))),
        label=("tokens", "options")),
    "transcoders for all 30 blocks: training tokens": Target(
        "transcoder_train", "tokens", ">=", 500_000.0, "tokens",
        "docs/sae_training.md and bench_transcoder_train.py (at least 500k tokens)",
        where=(("kind", ("summary",)),), label=("blocks", "d_sae")),
    "transcoders for all 30 blocks: wall-clock minutes": Target(
        "transcoder_train", "wall_minutes", "<=", 90.0, "min",
        "docs/sae_training.md and bench_transcoder_train.py (at most 90 minutes)",
        where=(("kind", ("summary",)),), label=("blocks", "d_sae")),
    "attribution graph, peak memory over circuit-tracer's": Target(
        "circuits", "peak_rss_vs_circuit_tracer", "<=", 1.0, "x",
        "docs/circuits.md and bench_circuits.py (at most its memory at every length)",
        where=(("library", ("steerkit",)),), label=("tokens", "threads")),
})

#: CSV stem -> the script that writes it and what it measures
SOURCES: dict[str, tuple[str, str]] = {
    "app": ("benchmarks/bench_app.py", "the explorer's latency in a headless browser"),
    "backend_memory": ("benchmarks/bench_backend_memory.py", "resident memory, one backend vs three"),
    "batch_scaling": ("benchmarks/bench_batch_scaling.py", "cost per row of per-row steered generation and "
                                                           "scoring passes against rows per call"),
    "continuation": ("benchmarks/bench_continuation.py", "scoring continuations: each prompt's KV cache "
                                                         "shared vs one full forward per row"),
    "circuits": ("benchmarks/bench_circuits.py", "attribution graphs: steerkit's attribution_graph vs circuit-tracer "
                                                 "0.5.0's attribute, same model, transcoders, prompt and settings: "
                                                 "graph time and peak memory, with the graphs' agreement"),
    "circuits_memory": ("benchmarks/bench_circuits_memory.py", "attribution graphs of long prompts: the peak "
                        "resident memory of steerkit's attribution_graph and of circuit-tracer 0.5.0's attribute "
                        "(stopped by a time limit or a memory cap: a lower bound of its peak)"),
    "transcoder_train": ("benchmarks/bench_transcoder_train.py", "training a TopK transcoder for every block of the "
                         "default model: tokens, seconds and tokens per second, wall-clock minutes of the whole run, "
                         "the replacement model's CE losses; per block FVU, L0 and dead latents on held-out tokens"),
    "dtype": ("benchmarks/bench_dtype.py", "bfloat16 vs float32 on the default model: decoding and recording"),
    "generation": ("benchmarks/bench_generation.py", "steered vs unsteered greedy generation, per library"),
    "gpu_kernels": ("benchmarks/gpu_kernels.py", "the fused Triton steering kernel on a CUDA GPU, per case"),
    "gpu_kernels_sweep": ("benchmarks/gpu_kernels.py", "the fused kernel's launch-parameter sweep"),
    "hook_cost": ("benchmarks/bench_hook_cost.py", "one steerkit hook call in a tight loop vs a decode step"),
    "load": ("benchmarks/bench_load.py", "cached load vs first GGUF conversion"),
    "patching": ("benchmarks/bench_patching.py", "activation patching with prefix reuse vs full passes vs "
                                                 "TransformerLens"),
    "pattern_record": ("benchmarks/bench_pattern_record.py", "recording attention patterns vs the residual stream"),
    "plan": ("benchmarks/bench_plan.py", "the vLLM plugin's planning cost per engine step"),
    "slots_op": ("benchmarks/bench_slots_op.py", "the steering operator's cost per call, as defined vs through "
                                                 "torch.library.custom_op"),
    "quantized_decode": ("benchmarks/bench_quantized.py", "steered decode speed, float32 vs int8 weights"),
    "ray": ("benchmarks/bench_ray.py", "recording a prompt set in one process vs on 1 and 2 Ray workers"),
    "real_size": ("benchmarks/bench_real_size.py", "Llama-3.2-1B's and 3B's shapes in bfloat16 (the 3B offloaded): "
                                                   "each step beside plain transformers, with peak RSS"),
    "record": ("benchmarks/bench_record.py", "recording throughput"),
    "record_memory": ("benchmarks/bench_record.py", "peak memory of one record scope vs a bare pass"),
    "refusal_paths": ("scripts/refusal_paths.py", "the refusal direction on quantised and offloaded loads"),
    "refusal_scoring": ("benchmarks/bench_refusal.py", "refusal-direction candidate scoring, batched vs one "
                                                       "candidate at a time, with and without prefix reuse"),
    "steering": ("benchmarks/bench_steering.py", "overhead of each fused operation in generation"),
    "steering_per_row": ("benchmarks/bench_steering.py", "per-row configurations vs one shared configuration"),
    "step_overhead": ("benchmarks/bench_step_overhead.py", "what steering adds to one decoding step"),
    "step_vs_ref": ("benchmarks/bench_step_vs_ref.py", "per-step overhead of this tree against a reference commit"),
    "tune": ("benchmarks/bench_tune.py", "tuning a direction: the batched layer x strength grid vs one generate "
                                         "call per cell, with and without prefix reuse"),
    "train": ("benchmarks/bench_train.py", "one BiPO training epoch on the default model: seconds and peak memory"),
    "sae_train": ("benchmarks/bench_sae_train.py", "training an SAE with sparsify on the default model: training "
                                                   "tokens per second; the forward up to the layer vs the full one"),
    "sae_record": ("benchmarks/bench_sae_record.py", "recording SAE latents in the forward pass: steerkit's "
                                                     "record vs sae-lens's HookedSAETransformer.run_with_cache, same "
                                                     "model and SAE, with their agreement"),
    "sae_steer": ("benchmarks/bench_sae_steer.py", "steered greedy decoding with an SAE latent: a clamp (TopK, "
                                                   "ReLU restricted to the latent) vs a plain add of its decoder row "
                                                   "vs unsteered"),
    "soak_app": ("benchmarks/soak_app.py", "4 headless Chromium browsers driving the app for 10 minutes: actions, "
                 "errors, response times, background jobs, the app's RSS every 10 s (docs/SECURITY.md, Load)"),
    "soak_serve": ("benchmarks/soak_serve.py", "8 openai clients against steerkit serve for 10 minutes: requests per "
                   "kind, latency, errors by class, the HF re-check (docs/SECURITY.md, Load)"),
    "soak_serve_resources": ("benchmarks/soak_serve.py", "the serve soak's summed RSS and open files of the "
                             "server's processes every 10 s"),
    "vectors_store": ("benchmarks/vectors_store.py", "store and export throughput"),
    "vllm": ("benchmarks/bench_vllm.py", "per-request steering in vLLM (compiled and eager) vs steerkit's HF "
                                         "generation"),
    "gpu_steer_graph": ("benchmarks/gpu_steer_graph.py", "the steering operator inside a CUDA-graph replay"),
    "vllm_record": ("benchmarks/bench_vllm_record.py", "recording a data set through vLLM vs steerkit's HF path"),
    "vllm_plugin": ("benchmarks/bench_vllm_plugin.py", "a decoding vLLM engine with the steerkit plugin: nothing "
                                                       "steered, one request steered, 8 distinct steerings, against "
                                                       "the engine without the plugin"),
}

#: CSV stem -> (y column, columns naming each bar, column that colours the bars or None)
PLOTS: dict[str, tuple[str, tuple[str, ...], str | None]] = {
    "app": ("value", ("measure",), "unit"),
    "backend_memory": ("model_mib", ("condition",), None),
    "batch_scaling": ("gain_vs_ref", ("rows",), "kind"),
    "continuation": ("median_s", ("condition",), "mode"),
    "circuits": ("graph_s", ("tokens", "threads"), "library"),
    "circuits_memory": ("peak_rss_mib", ("tokens", "options"), "library"),
    "dtype": ("cpu_ms", ("work",), "dtype"),
    "transcoder_train": ("fvu", ("layer",), None),
    "generation": ("paired_overhead_pct", ("library", "edit"), "batch"),
    "gpu_kernels": ("frac_of_copy", ("case", "dtype"), None),
    "gpu_kernels_sweep": ("frac_of_copy", ("block_r", "block_d", "num_warps"), "case"),
    "hook_cost": ("hook_us_per_call", ("edit",), "batch"),
    "load": ("wall_s", ("load",), None),
    "patching": ("median_s", ("hook", "condition"), "threads"),
    "pattern_record": ("throughput_vs_bare", ("condition",), None),
    "plan": ("median_us_per_step", ("step",), "requests"),
    "slots_op": ("us_per_call", ("case",), "registration"),
    "quantized_decode": ("overhead_pct", ("weights", "condition"), "batch"),
    "ray": ("prompts_per_s", ("condition",), None),
    "real_size": ("wall_s", ("size", "step"), "condition"),
    "record": ("throughput_ratio", ("prompts", "batch"), None),
    "record_memory": ("record_minus_bare_mib", ("prompts",), None),
    "refusal_paths": ("cosine_with_float32", ("path",), None),
    "refusal_scoring": ("cpu_s", ("path",), "mode"),
    "steering": ("overhead_pct", ("op",), "batch"),
    "steering_per_row": ("per_row_vs_shared_throughput", ("batch",), None),
    "step_overhead": ("overhead_pct", ("condition",), "batch"),
    "step_vs_ref": ("overhead_pct", ("batch", "condition", "run"), "version"),
    "train": ("s_per_step_cpu", ("pairs", "batch"), "mode"),
    "sae_train": ("minutes_for_2m_tokens", ("mode", "tokens"), None),
    "sae_record": ("tokens_per_s", ("library", "condition"), None),
    "sae_steer": ("ms_per_step", ("condition",), None),
    "tune": ("median_s", ("condition",), "mode"),
    "vectors_store": ("per_s", ("operation", "format"), None),
    "vllm": ("ratio_steered_over_unsteered", ("engine",), None),
    "gpu_steer_graph": ("overhead_pct", ("condition",), None),
    "vllm_record": ("prompts_per_s", ("engine",), None),
    "vllm_plugin": ("vs_no_plugin", ("condition",), "mode"),
}


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="", encoding="utf-8") as f:
        r = csv.DictReader(f)
        rows = list(r)
        return list(r.fieldnames or []), rows


def number(s) -> float | None:
    """The float in ``s``, or None when it is empty or not a finite number."""
    try:
        x = float(str(s).strip().rstrip("%"))
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def evaluate(t: Target, rows: list[dict[str, str]]) -> dict:
    """The measured figure for ``t``: the worst matching row, and whether it is within the bound."""
    ok = [r for r in rows if all(r.get(c, "") in vals for c, vals in t.where) and number(r.get(t.column)) is not None]
    if not ok:
        return {"status": "no data", "value": None, "row": "", "mode": ""}
    pick = max if t.op == "<=" else min
    worst = pick(ok, key=lambda r: number(r[t.column]))
    x = number(worst[t.column])
    return {"status": "pass" if t.met(x) else "fail", "value": x,
            "row": ", ".join(f"{c} {worst[c]}" for c in t.label if c in worst), "mode": worst.get("mode", "")}


def fmt_value(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    return f"{x:+.2f}%" if unit == "%" else f"{x:.3g}"


def fmt_target(t: Target) -> str:
    return f"{t.op} {t.value:g}%" if t.unit == "%" else f"{t.op} {t.value:g}"


def cell(s) -> str:
    """A table cell: ``|`` escaped, and a float written with more than 6 decimals cut to 4 significant digits."""
    s = str(s)
    if "." in s and len(s.split(".", 1)[1].rstrip("%")) > 6 and number(s) is not None:
        s = f"{float(s):.4g}"
    return s.replace("|", "\\|").replace("\n", " ")


def md_table(headers: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return out


def facts_line(cols: list[str], rows: list[dict[str, str]]) -> tuple[str, list[str]]:
    """The sentence stating the run facts, and the fact columns that differ between rows (kept in the table)."""
    names = {"machine": "machine", "cpus": "CPUs", "python": "Python", "torch": "torch",
             "transformers": "transformers", "commit": "commit"}
    parts, varying = [], []
    for k in FACTS:
        if k not in cols:
            continue
        vals = list(dict.fromkeys(r.get(k, "") or "" for r in rows))
        shown = [v for v in vals if v]
        if len(vals) > 1:
            varying.append(k)
            parts.append(f"{names[k]} {', '.join(f'`{v}`' if k == 'commit' else v for v in shown)} (per row)")
        elif shown:
            parts.append(f"{names[k]} `{shown[0]}`" if k == "commit" else f"{names[k]} {shown[0]}")
    missing = [names[k] for k in FACTS if k not in cols]
    s = ("Run on: " + "; ".join(parts) + ".") if parts else ""
    if missing:
        s += (" " if s else "") + f"Not recorded: {', '.join(missing)}."
    return s, varying


def figure(stem: str, cols: list[str], rows: list[dict[str, str]], targets: list[Target]):
    """A plotly bar chart of the CSV's main column, with the target as a dashed line; None without data."""
    spec = PLOTS.get(stem)
    numeric = [c for c in cols if c not in FACTS and rows and all(number(r.get(c)) is not None
                                                                    for r in rows if r.get(c, "") != "")
               and any(r.get(c, "") != "" for r in rows)]
    if spec and spec[0] in cols:
        y, xs, color = spec
    else:  # a CSV without a plot spec: its first numeric column that varies, bars named by the others
        vary = [c for c in numeric if len({r.get(c) for r in rows}) > 1]
        if not vary:
            return None
        y, color = vary[0], None
        xs = tuple(c for c in cols if c not in FACTS and c not in numeric and c != "mode") or (cols[0],)
    xs = tuple(c for c in xs if c in cols)
    color = color if color in cols else None
    pts = [r for r in rows if number(r.get(y)) is not None]
    if not pts:
        return None
    import plotly.graph_objects as go

    fig = go.Figure()
    groups = list(dict.fromkeys(r.get(color, "") for r in pts)) if color else [None]
    for g in groups:
        sel = [r for r in pts if color is None or r.get(color, "") == g]
        fig.add_trace(go.Bar(x=[" / ".join(r.get(c, "") for c in xs) or str(i) for i, r in enumerate(sel)],
                             y=[number(r[y]) for r in sel], name=f"{color} {g}" if color else y))
    for t in targets:
        if t.column == y:
            fig.add_hline(y=t.value, line_dash="dash", annotation_text=f"target {fmt_target(t)}")
    fig.update_layout(title=f"{stem}: {y}", barmode="group", xaxis_title=" / ".join(xs), yaxis_title=y,
                      template="plotly_white", showlegend=bool(color))
    return fig


def have_kaleido() -> bool:
    try:
        import kaleido  # noqa: F401
    except ImportError:
        return False
    return True


def write_figure(fig, stem: str, folder: Path, png: bool) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if png:
        path = folder / f"{stem}.png"
        fig.write_image(str(path), width=1000, height=500)
    else:
        path = folder / f"{stem}.html"
        fig.write_html(str(path), include_plotlyjs="cdn", full_html=True, div_id=f"benchmark-{stem}")  # same data, same file
    return path


def render(results: Path = RESULTS, out: Path = PAGE, figures: Path | None = FIGURES) -> Path:
    """Write the page ``out`` (and, with ``figures``, one figure per CSV there) from ``results/*.csv``."""
    results, out = Path(results), Path(out)
    csvs = sorted(results.glob("*.csv"))
    data = {p.stem: read_csv(p) for p in csvs}
    plot = figures is not None
    if plot:
        try:
            import plotly  # noqa: F401
        except ImportError:
            print("plotly is not installed: writing the page without figures", file=sys.stderr)
            plot = False
    png = plot and have_kaleido()

    try:
        where = results.resolve().relative_to(ROOT).as_posix() + "/"
    except ValueError:
        where = results.name + "/"
    lines = ["# Benchmark data", "",
             f"Generated by `benchmarks/render.py` from the CSV files in `{where}`; rerun the benchmarks "
             "and render again rather than editing this page. What each benchmark "
             "measures, and how to read its figures, is in [Benchmark results](BENCHMARKS.md).", "",
             "## Stated bounds", "",
             "Each benchmark script states a bound for its headline figure. The measured figure is the worst "
             "row of the CSV that the bound applies to.", ""]
    trows = []
    for metric, t in TARGETS.items():
        ev = evaluate(t, data[t.csv][1]) if t.csv in data else {"status": "no data", "value": None, "row": "",
                                                                 "mode": ""}
        row = ev["row"] + (f" ({ev['mode']} run)" if ev["mode"] and ev["mode"] != "full" else "")
        measured = fmt_value(ev["value"], t.unit) if ev["status"] != "no data" else "no data"
        trows.append([metric, fmt_target(t), measured, row or "-", f"`{t.csv}.csv` `{t.column}`", t.source])
    lines += md_table(["metric", "bound", "measured", "worst row", "measured by", "stated in"], trows)
    lines.append("")
    if not csvs:
        lines += [f"No CSV files in `{where}` yet.", ""]
    for stem, (cols, rows) in data.items():
        script, what = SOURCES.get(stem, ("", ""))
        lines += [f"## `{stem}.csv`", ""]
        intro = f"Written by `{script}`: {what}." if script else f"`{stem}.csv` (no script registered in render.py)."
        facts, varying = facts_line(cols, rows)
        lines += [intro + (" " + facts if facts else ""), ""]
        mine = [(m, t) for m, t in TARGETS.items() if t.csv == stem]
        for m, t in mine:
            ev = evaluate(t, rows)
            measured = (f"{fmt_value(ev['value'], t.unit)}{' (' + ev['row'] + ')' if ev['row'] else ''}"
                        if ev["status"] != "no data" else "no data")
            lines.append(f"- Bound: {m}, `{t.column}` {fmt_target(t)}; measured {measured}")
        if mine:
            lines.append("")
        shown = [c for c in cols if c not in FACTS or c in varying]
        if rows:
            lines += md_table(shown, [[r.get(c, "") for c in shown] for r in rows])
        else:
            lines.append("No rows.")
        lines.append("")
        if plot and rows:
            fig = figure(stem, cols, rows, [t for _, t in mine])
            if fig is not None:
                path = write_figure(fig, stem, Path(figures), png)
                rel = Path(os.path.relpath(path, out.parent)).as_posix()
                lines += [f"![{stem}]({rel})" if png else f"Figure: [{path.name}]({rel})", ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=str(RESULTS), help="folder of the CSV files (default benchmarks/results)")
    ap.add_argument("--out", default=str(PAGE), help="the Markdown page to write (default docs/benchmarks_data.md)")
    ap.add_argument("--figures", default=None,
                    help="folder for the figures (default: benchmarks_figures/ next to --out)")
    ap.add_argument("--no-figures", action="store_true", help="write the page only")
    a = ap.parse_args(argv)
    out = Path(a.out)
    figs = None if a.no_figures else Path(a.figures) if a.figures else out.parent / FIGURES.name
    path = render(Path(a.results), out, figs)
    print(f"wrote {path}" + ("" if figs is None else f" and its figures in {figs}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
