"""Attribution graphs: steerkit's ``steerkit.probes.attribution_graph`` vs circuit-tracer 0.5.0's ``attribute``, same
model, transcoders, prompt and settings, graph time and peak memory.

The default model (SmolLM2-135M-Instruct, float32) with random JumpReLU transcoders at its size (``--d-sae`` 16384
features per block, reading ``mlp.hook_in`` and writing ``hook_mlp_out``; encoder rows of norm 1, thresholds set per
block so that about ``--l0`` features fire per token on the corpus; seed 0), written once by steerkit in
circuit-tracer's cache layout and read from there by both. Prompts of 16, 64 and 256 tokens (the special token in
front included) of the vendored corpus's text; ``max_feature_nodes=8192``, circuit-tracer's other defaults and the
same ``--batch-size`` on both sides; 1 and 2 torch threads; one run each, timed in wall time (``graph_s``, the
speedups) and the process's CPU time (``graph_cpu_s``: on a shared machine, what the work itself cost).

circuit-tracer pins transformers<=4.57.3, so it runs in ``.venv-circuit-tracer`` (``scripts/setup.sh`` with
``STEERKIT_SETUP_EXTRAS=engines``; ``STEERKIT_CIRCUIT_TRACER_PYTHON`` points elsewhere) with its nnsight backend on a
copy of the model written for transformers 4 (``rope_theta`` kept: SmolLM2's is 100000, which circuit-tracer's
TransformerLens backend would drop; that backend also refuses a local folder), loading the transcoders as its own
``load_transcoders_from_cache`` does (decoder rows read from the files on use). Every measurement is its own process
(this script with ``--worker``), so each peak is its own: ``peak_rss_mib`` is the process's peak resident memory over
the whole run (model, transcoders, graph), ``graph_peak_mib`` its peak during the graph over what it held before.

Before anything is timed, both sides compute the logits of every prompt and the script stops (exit 1) unless they
agree to 1e-4 of their largest value with the same argmax everywhere. After each pair of runs, the graphs are compared:
the active features and logit targets (equal), the selected features (their overlap: influence near-ties may order
them differently) and the logit nodes' rows on the features both kept.

Usage:  python benchmarks/bench_circuits.py                 # 16, 64, 256 tokens; 1 and 2 threads
        python benchmarks/bench_circuits.py --quick         # 16 tokens, 1 thread, 2048 features per block
        python benchmarks/bench_circuits.py --tokens 16 --threads 1 --out /tmp/circuits.csv

Rows go to ``benchmarks/results/circuits.csv`` (``--out``): one per side, length and thread count.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, csv_rows, table  # noqa: E402

CT_PY = Path(os.environ.get("STEERKIT_CIRCUIT_TRACER_PYTHON") or ROOT / ".venv-circuit-tracer" / "bin" / "python")


def _rss(key: str) -> float:
    """``VmRSS`` / ``VmHWM`` of this process in MiB."""
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> None:
    """Start a new peak (``VmHWM``) from the current resident memory (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# ---------------------------------------------------------------------------------------------- the workers
def worker_steerkit(job: dict) -> dict:
    import torch

    import steerkit
    from steerkit.probes import attribution_graph

    torch.set_num_threads(job["threads"])
    sm = steerkit.load_model()
    tc = steerkit.load_transcoders(job["transcoders"], model=sm)
    ids = job["ids"]
    if job.get("logits_only"):
        toks = steerkit.Tokens(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
        return {"logits": sm.forward(toks)[0].tolist()}
    before = _rss("VmRSS")
    _reset_peak()
    t0, c0 = time.perf_counter(), time.process_time()
    graph = attribution_graph(sm, tc, ids, max_feature_nodes=job["max_feature_nodes"], batch_size=job["batch_size"],
                              progress=False, **job.get("options", {}))
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return dict(_summary(graph, seconds, before, job), cpu_s=cpu)


def worker_circuit_tracer(job: dict) -> dict:
    import torch
    from circuit_tracer import ReplacementModel, attribute
    from circuit_tracer.utils.caching import load_transcoders_from_cache

    torch.set_num_threads(job["threads"])
    folder = Path(job["transcoders"])
    cpu = torch.device("cpu")
    tcs, _ = load_transcoders_from_cache(folder.name, cache_dir=str(folder.parent), device=cpu, dtype=torch.float32)
    model = ReplacementModel.from_pretrained_and_transcoders(job["model"], tcs, backend="nnsight", device=cpu,
                                                             dtype=torch.float32)
    ids = torch.tensor(job["ids"])
    if job.get("logits_only"):
        logits, _ = model.get_activations(ids[None])
        return {"logits": logits.reshape(len(ids), -1).tolist()}
    before = _rss("VmRSS")
    _reset_peak()
    t0, c0 = time.perf_counter(), time.process_time()
    graph = attribute(ids, model, max_feature_nodes=job["max_feature_nodes"], batch_size=job["batch_size"])
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return dict(_summary(graph, seconds, before, job), cpu_s=cpu)


def _summary(graph, seconds: float, before: float, job: dict) -> dict:
    """What the orchestrator compares and records; the logit rows and selected features go to a file."""
    from safetensors.torch import save_file

    peak = _rss("VmHWM")
    n_logits = len(graph.logit_targets)
    adj = graph.adjacency_matrix
    n_sel = len(graph.selected_features)
    save_file({"selected": graph.selected_features.long().cpu().contiguous(),
               "active": graph.active_features.long().cpu().contiguous(),
               "logit_rows": adj[-n_logits:, :n_sel].cpu().contiguous()}, job["graph_out"])
    return {"seconds": seconds, "graph_peak_mib": peak - before, "peak_rss_mib": _rss("VmHWM"),
            "n_active": int(graph.active_features.shape[0]), "n_features": n_sel, "n_logits": n_logits,
            "logit_targets": [int(t[1]) for t in graph.logit_targets]}


# ---------------------------------------------------------------------------------------------- setting up
def _prompts(tok, lengths: list[int]) -> dict[int, list[int]]:
    """Token ids of ``n`` tokens for each length: the special token circuit-tracer puts in front, then the corpus."""
    from steerkit.probes import read_corpus
    from steerkit.probes.attribution import prompt_ids

    text = " ".join(read_corpus()[:2])
    body = tok(text, add_special_tokens=False)["input_ids"]
    out = {}
    for n in lengths:
        ids = prompt_ids(tok, body[: n - 1])
        assert len(ids) == n, (n, len(ids))
        out[n] = ids
    return out


def _transcoders(sm, d_sae: int, l0: float, seed: int = 0):
    """Random JumpReLU transcoders whose thresholds make about ``l0`` features fire per token (on a corpus sample)."""
    import torch

    from steerkit.vectors import Provenance, Transcoders

    g = torch.Generator().manual_seed(seed)
    L, d = sm.n_layers, sm.d_model
    enc = [torch.randn(d_sae, d, generator=g) / d ** 0.5 for _ in range(L)]
    enc = [e / e.norm(dim=1, keepdim=True) for e in enc]
    dec = [torch.randn(d_sae, d, generator=g) / d ** 0.5 for _ in range(L)]
    b_enc = [torch.zeros(d_sae) for _ in range(L)]
    b_dec = [torch.zeros(d) for _ in range(L)]
    sample = sm.tokenize(" ".join(__import__("steerkit").probes.read_corpus()[2:4])[:4000])
    sample.input_ids, sample.attention_mask = sample.input_ids[:, :256], sample.attention_mask[:, :256]
    names = [f"blocks.{l}.mlp.hook_in" for l in range(L)]
    with sm.record(names) as cache:
        sm.forward(sample)
    thr = []
    for l in range(L):
        pre = cache[names[l]][0, 1:].float() @ enc[l].T  # [tokens, d_sae]
        q = 1 - l0 / d_sae
        t = torch.quantile(pre.flatten()[::7], q)  # one threshold per block: about l0 of d_sae fire
        thr.append(torch.full((d_sae,), float(t)))
    return Transcoders(enc, b_enc, dec, b_dec, activation="jumprelu", threshold=thr, scan="smollm2-random-jumprelu",
                       provenance=Provenance.from_model(sm))


def _model_folder(sm, path: Path) -> str:
    """The default model for transformers 4: steerkit's cached float32 weights (linked), the config with ``rope_theta``
    kept and no GGUF quantisation entry, a tokenizer class transformers 4 has."""
    if (path / "config.json").exists():
        return str(path)
    from steerkit.loading import resolve

    _, source, _ = resolve.resolve(None)  # the default model's float weights, cached as a Hugging Face folder
    path.mkdir(parents=True)
    for f in Path(source).iterdir():
        if f.suffix == ".safetensors":  # the tied embedding under both names: transformers 4 looks for embed_tokens
            from safetensors.torch import load_file, save_file
            w = load_file(f)
            w.setdefault("model.embed_tokens.weight", w["lm_head.weight"].clone())
            save_file(w, str(path / f.name), metadata={"format": "pt"})
        else:
            (path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_theta"] = cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    cfg.pop("quantization_config", None)  # the weights are the GGUF's, de-quantized: plain float32 now
    cfg.setdefault("architectures", ["LlamaForCausalLM"])  # circuit-tracer's nnsight mapping is chosen by it
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    tcfg = json.loads((path / "tokenizer_config.json").read_text())
    tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (path / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=1))
    return str(path)


def _run(side: str, job: dict, work: Path) -> dict:
    py = sys.executable if side == "steerkit" else str(CT_PY)
    path = work / f"job-{side}-{job['tokens']}-{job['threads']}-{int(bool(job.get('logits_only')))}.json"
    path.write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "VIRTUAL_ENV"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(job["threads"]))
    r = subprocess.run([py, __file__, "--worker", side, "--job", str(path)], capture_output=True, text=True, env=env,
                       cwd=work, timeout=6 * 3600)
    if r.returncode != 0:
        raise SystemExit(f"{side} worker failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _compare(work: Path, tokens: int, threads: int) -> dict:
    """The two graphs of one length: active features, selected features' overlap, logit rows on the common ones."""
    import torch

    from safetensors.torch import load_file

    a = load_file(work / f"graph-steerkit-{tokens}-{threads}.safetensors")
    b = load_file(work / f"graph-circuit-tracer-{tokens}-{threads}.safetensors")
    same_active = torch.equal(a["active"], b["active"])
    sa, sb = set(a["selected"].tolist()), set(b["selected"].tolist())
    common = sorted(sa & sb)
    ia = torch.tensor([a["selected"].tolist().index(x) for x in common])
    ib = torch.tensor([b["selected"].tolist().index(x) for x in common])
    ra, rb = a["logit_rows"][:, ia], b["logit_rows"][:, ib]
    return {"same_active_features": same_active, "selected_overlap": round(len(common) / max(len(sb), 1), 4),
            "logit_rows_max_rel_diff": float((ra - rb).abs().max() / rb.abs().max().clamp_min(1e-30))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-feature-nodes", type=int, default=8192)
    ap.add_argument("--d-sae", type=int, default=16384)
    ap.add_argument("--l0", type=float, default=12.0)
    ap.add_argument("--work", default=str(ROOT / ".bench-circuits"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "circuits.csv"))
    ap.add_argument("--quick", action="store_true", help="16 tokens, 1 thread, 2048 features per block")
    ap.add_argument("--worker", choices=["steerkit", "circuit-tracer"])
    ap.add_argument("--job")
    a = ap.parse_args()
    if a.worker:
        job = json.loads(Path(a.job).read_text())
        fn = worker_steerkit if a.worker == "steerkit" else worker_circuit_tracer
        print(json.dumps(fn(job)))
        return
    if a.quick:
        a.tokens, a.threads, a.d_sae = [16], [1], 2048
    if not CT_PY.exists():
        raise SystemExit(f"no circuit-tracer environment at {CT_PY}: STEERKIT_SETUP_EXTRAS=engines bash scripts/setup.sh")
    import torch

    import steerkit

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    sm = steerkit.load_model()
    folder = _model_folder(sm, work / "model")
    tc_path = work / "transcoders" / f"jumprelu-{a.d_sae}-l0-{a.l0:g}"
    if not (tc_path / "config.yaml").exists():
        _transcoders(sm, a.d_sae, a.l0).save(tc_path, "circuit-tracer", overwrite=True)
    prompts = _prompts(sm.tokenizer, a.tokens)
    del sm
    base = dict(model=folder, transcoders=str(tc_path), batch_size=a.batch_size, max_feature_nodes=a.max_feature_nodes)
    logits_diff = {}
    for n, ids in prompts.items():  # the logits first: both sides run the same model
        ours = torch.tensor(_run("steerkit", dict(base, ids=ids, tokens=n, threads=1, logits_only=True), work)["logits"])
        theirs = torch.tensor(_run("circuit-tracer", dict(base, ids=ids, tokens=n, threads=1, logits_only=True),
                                   work)["logits"])
        diff = float((ours - theirs).abs().max())
        if diff > 1e-4 * float(theirs.abs().max()) or not torch.equal(ours.argmax(-1), theirs.argmax(-1)):
            raise SystemExit(f"the two sides' logits differ at {n} tokens (max |diff| {diff:.3g}): not timing")
        logits_diff[n] = diff
        print(f"logits agree at {n} tokens: max |diff| {diff:.2e}", flush=True)
    rows = []
    for n, ids in prompts.items():
        for threads in a.threads:
            res = {}
            for side in ("steerkit", "circuit-tracer"):
                job = dict(base, ids=ids, tokens=n, threads=threads,
                           graph_out=str(work / f"graph-{side}-{n}-{threads}.safetensors"))
                res[side] = _run(side, job, work)
                print(f"{side} {n} tokens, {threads} thread(s): {res[side]['seconds']:.1f} s, peak "
                      f"{res[side]['peak_rss_mib']:.0f} MiB", flush=True)
            agree = _compare(work, n, threads)
            agree["same_logit_targets"] = res["steerkit"]["logit_targets"] == res["circuit-tracer"]["logit_targets"]
            sk, ct = res["steerkit"], res["circuit-tracer"]
            for side, r in res.items():
                rows.append({"mode": "quick" if a.quick else "full", "library": side, "tokens": n, "threads": threads, "batch_size": a.batch_size,
                             "max_feature_nodes": a.max_feature_nodes, "d_sae": a.d_sae, "l0_target": a.l0,
                             "n_active": r["n_active"], "n_features": r["n_features"], "n_logits": r["n_logits"],
                             "graph_s": round(r["seconds"], 2), "graph_cpu_s": round(r.get("cpu_s", float("nan")), 2),
                             "peak_rss_mib": round(r["peak_rss_mib"]),
                             "graph_peak_mib": round(r["graph_peak_mib"]),
                             "speedup_vs_circuit_tracer": round(ct["seconds"] / r["seconds"], 3),
                             "peak_rss_vs_circuit_tracer": round(r["peak_rss_mib"] / ct["peak_rss_mib"], 3),
                             "logits_max_abs_diff": f"{logits_diff[n]:.2e}", **agree})
            del sk
    csv_rows(Path(a.out), rows)
    cols = ["library", "tokens", "threads", "n_active", "graph_s", "peak_rss_mib", "speedup_vs_circuit_tracer",
            "peak_rss_vs_circuit_tracer", "selected_overlap"]
    print(table(cols, [[r[c] for c in cols] for r in rows]))
    print(f"rows written to {a.out}")


if __name__ == "__main__":
    main()
