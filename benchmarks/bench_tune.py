"""``steerkit.probes.tune`` on a layers x strengths grid: every cell as per-row steering in shared generate
calls (batched) vs the same grid as one ``sm.generate`` call per cell (``batched=False``).

The grid: ``--layers`` layers spread over the model (default 6: blocks 4, 8, 12, 16, 20, 24) x ``--scales``
strengths (default 8: 0.5, 1, ..., 4 times the benchmarks' fixed norm-4 vector ``_common.steering_vectors``),
on ``--prompts`` prompts (default 32, ``_common.prompts``) x ``--tokens`` new tokens (default 32), the
concept scored by a substring rule, the KL on the 8 built-in neutral prompts. Conditions, each timed as
the whole ``tune`` call (generation, the unsteered scoring forward and the KL forwards), in rotated order
over ``--repeats`` rounds:

* ``batched``: ``tune(..., batch_size=--batch)``: the baseline and every cell's generations as rows of
  per-row steered generate calls of ``--batch`` rows (default 64, ``tune``'s own default: on this
  2-core CPU a call of 32 to 128 rows costs the least per row, 256 costs more, see
  ``bench_batch_scaling.py``), in layer order; the prompts run once unsteered, and each call's prompt
  pass (and each KL pass) starts at the lowest steered block among its rows (``reuse=True``, the default);
* ``batched-full``: the same with ``reuse=False``: every prompt pass runs the whole model;
* ``per-cell``: ``tune(..., batched=False, batch_size=--prompts)``: one generate call per cell (48 for
  the default grid, plus one for the baseline), the cell's steering shared by its rows, its prompt pass
  from the cell's block; one KL pass per cell;
* ``per-cell-full``: the same with ``reuse=False``.

All must give identical generations (checked against the first condition). Rows go to
``benchmarks/results/tune.csv``; ``x_vs_full_passes`` is the ``-full`` condition's time over the
condition's; ``speedup`` the condition's time over ``batched``'s. ``--conditions`` picks some of them.

Usage:  python benchmarks/bench_tune.py                # 6 layers x 8 strengths, 32 prompts x 32 tokens
        python benchmarks/bench_tune.py --quick        # 2 layers x 3 strengths, 4 prompts x 8 tokens
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

Clock = C.Clock


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 layers x 3 strengths on 4 prompts x 8 tokens")
    ap.add_argument("--layers", type=int, default=None, help="grid layers (default 6; quick 2)")
    ap.add_argument("--scales", type=int, default=None, help="grid strengths (default 8; quick 3)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts (default 32; quick 4)")
    ap.add_argument("--tokens", type=int, default=None, help="new tokens per generation (default 32; quick 8)")
    ap.add_argument("--batch", type=int, default=64, help="rows per generate call when batched (default 64, tune's "
                    "default; on a GPU try 256)")
    ap.add_argument("--repeats", type=int, default=1, help="rounds (default 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0 = torch's default)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    C.add_model_args(ap)
    ap.add_argument("--conditions", nargs="+", default=["batched", "batched-full", "per-cell", "per-cell-full"],
                    choices=["batched", "batched-full", "per-cell", "per-cell-full"])
    ap.add_argument("--out", default=str(C.ROOT / "benchmarks" / "results" / "tune.csv"))
    a = ap.parse_args(argv)

    import torch

    from steerkit.probes import tune

    threads = C.set_threads(a.threads)
    n_layers = a.layers or (2 if a.quick else 6)
    n_scales = a.scales or (3 if a.quick else 8)
    n_prompts = a.prompts or (4 if a.quick else 32)
    tokens = a.tokens or (8 if a.quick else 32)
    sm = C.default_model(a.device, a.skeleton)
    layers = [4 * (i + 1) for i in range(n_layers)] if n_layers <= 7 else list(range(n_layers))
    scales = [0.5 * (i + 1) for i in range(n_scales)]
    v, _ = C.steering_vectors(sm.d_model)
    prompts = C.prompts(n_prompts)
    cells = n_layers * n_scales
    print(f"model {sm.name}; torch {torch.__version__}, {threads} thread(s); {n_layers} layers x {n_scales} "
          f"strengths = {cells} cells on {n_prompts} prompts x {tokens} tokens ({(cells + 1) * n_prompts} "
          f"generations); batch {a.batch}", flush=True)

    def run(batched: bool, reuse: bool):
        return tune(sm, v, prompts, layers=layers, scales=scales, concept=["the"], max_new_tokens=tokens,
                    batch_size=a.batch if batched else n_prompts, batched=batched, n_boot=200, progress=False,
                    reuse=reuse)

    every = {"batched": (True, True), "batched-full": (True, False), "per-cell": (False, True),
             "per-cell-full": (False, False)}
    conds = {n: (lambda b=b, r=r: run(b, r)) for n, (b, r) in every.items() if n in a.conditions}
    with Clock() as c:  # warm-up: one small tune
        tune(sm, v, prompts[:2], layers=layers[:1], scales=scales[:1], concept=["the"], max_new_tokens=2,
             n_boot=10, progress=False)
    print(f"  warm-up: {c.wall:.1f} s wall", flush=True)
    times = {n: {"cpu": [], "wall": []} for n in conds}
    results = {}
    names = list(conds)
    for r in range(a.repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            with Clock() as c:
                results[name] = conds[name]()
            times[name]["cpu"].append(c.cpu)
            times[name]["wall"].append(c.wall)
            print(f"  round {r + 1}/{a.repeats} {name}: cpu {c.cpu:.2f} s, wall {c.wall:.2f} s", flush=True)
    ref_name = names[0]
    gens = {n: [c["generations"] for c in res.cells] for n, res in results.items()}
    other = "wall" if a.clock == "cpu" else "cpu"
    med = {n: C.median(times[n][a.clock]) for n in names}
    rows, out = [], []
    for name in names:
        full = name if name.endswith("-full") else f"{name}-full"
        vs_full = med[full] / med[name] if full in med else float("nan")
        same = gens[name] == gens[ref_name]
        kl_diff = max(abs(x["kl"] - y["kl"]) for x, y in zip(results[name].cells, results[ref_name].cells))
        rows.append([name, f"{med[name]:.2f}", f"{C.median(times[name][other]):.2f}", f"{cells / med[name]:.3f}",
                     f"{vs_full:.2f}", same, f"{kl_diff:.2g}"])
        out.append({"mode": "quick" if a.quick else "full", "device": a.device, "weights": C.weights_kind(a.skeleton),
                    "condition": name, "layers": n_layers,
                    "scales": n_scales, "cells": cells, "prompts": n_prompts, "tokens": tokens,
                    "batch": a.batch if name.startswith("batched") else n_prompts, "repeats": a.repeats,
                    "clock": a.clock, "median_s": round(med[name], 3),
                    "median_other_s": round(C.median(times[name][other]), 3),
                    "cells_per_s": round(cells / med[name], 3), "x_vs_full_passes": round(vs_full, 3),
                    "speedup": round(med[name] / med["batched"], 3) if "batched" in med else "",
                    "identical_generations_vs_" + ref_name: same, "max_kl_diff": f"{kl_diff:.3g}"})
    print()
    print(C.table(["condition", f"median {a.clock} s", f"median {other} s", "cells/s", "x vs its full passes",
                   f"same generations as {ref_name}", "max |kl diff|"], rows,
                  title=f"tune, {n_layers} layers x {n_scales} strengths, {n_prompts} prompts x {tokens} tokens, "
                        f"{a.repeats} round(s)"))
    same = all(g == gens[ref_name] for g in gens.values())
    path = C.csv_rows(Path(a.out), [{**r, "threads": threads} for r in out])
    print(f"wrote {len(out)} rows to {path}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
