"""Steered generation on the default model, CPU: overhead of each fused operation, and per-row steering.

Prints, side by side in one run (interleaved repeats, medians):
- for each operation (add, ablate, clamp, gate+add, region, add+norm preservation) at batch 1 and 8:
  steered / unsteered generation time (target: overhead <= 3% for add and ablate);
- a batch of 8 with 8 different configurations vs the same batch with one shared configuration
  (target: throughput >= 0.9 of shared), and vs 8 sequential single-row runs.

Times are CPU seconds of this single-threaded process (``--threads 1``, ``time.process_time``) per
decoding step: a steered row may stop at EOS earlier or later than the unsteered one, so each run's
time is divided by its number of steps (the longest row's new tokens).

Usage: python benchmarks/bench_steering.py [--quick] [--tokens N] [--repeats R] [--threads 1]

Rows go to ``benchmarks/results/steering.csv`` (``--out``: one per operation and batch) and
``steering_per_row.csv`` next to it (the per-row comparison).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 new tokens, 1 repeat")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layer", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CPU-time ratios need 1)")
    ap.add_argument("--out", default=str(C.ROOT / "benchmarks" / "results" / "steering.csv"),
                    help="CSV of the per-operation rows; the per-row comparison goes to <stem>_per_row.csv next to it")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.repeats = 8, 1
    import steerkit
    from steerkit import Gate, Intervention, Polyhedron

    sm = steerkit.load_model()
    d, L = sm.d_model, args.layer
    g = torch.Generator().manual_seed(0)
    v = torch.randn(d, generator=g)
    u = steerkit.orthonormalize(torch.randn(1, d, generator=g))
    comps = steerkit.orthonormalize(torch.randn(8, d, generator=g))
    reg = Polyhedron(mean=torch.zeros(d), projection=comps, normals=torch.randn(8, 8, generator=g), offsets=torch.ones(8))
    hook = f"blocks.{L}.hook_resid_post"
    every = [f"blocks.{l}.hook_resid_pre" for l in range(sm.n_layers)]
    ops = {
        "add (1 layer)": ([Intervention.add(hook, v, 4.0)], False),
        "ablate (every layer)": ([Intervention.ablate(h, u) for h in every], False),
        "clamp (1 layer)": ([Intervention.clamp(hook, u[0], 1.0)], False),
        "gate+add (1 layer)": ([Intervention.add(hook, v, 4.0, gate=Gate(u[0], 0.05))], False),
        "region (1 layer)": ([Intervention.project(hook, reg)], False),
        "add+norm (1 layer)": ([Intervention.add(hook, v, 4.0)], True),
    }
    base_prompts = ["Tell me about your weekend.", "Describe the city you live in.", "Write about Mondays.",
                    "What is a good breakfast?", "Explain rain to a child.", "Name a famous painter.",
                    "How do birds fly?", "Give me a tip for learning."]

    C.set_threads(args.threads)

    def run(prompts, steering=None, preserve_norm=False, rows=None):
        """CPU seconds per decoding step of one greedy generation."""
        t = time.process_time()
        out = sm.generate(prompts, max_new_tokens=args.tokens, steering=steering, steer_rows=rows,
                          preserve_norm=preserve_norm, return_tokens=True, chat=True)
        return (time.process_time() - t) / max(1, max(len(o) for o in out))

    results = []
    for bs in (1, 8):
        prompts = base_prompts[:bs]
        run(prompts)  # warm-up
        for name, (spec, pn) in ops.items():
            base, steered = [], []
            for _ in range(args.repeats):
                base.append(run(prompts))
                steered.append(run(prompts, spec, pn))
            r = statistics.median(steered) / statistics.median(base)
            results.append({"op": name, "batch": bs, "unsteered_s": statistics.median(base),
                            "steered_s": statistics.median(steered), "overhead_pct": 100 * (r - 1)})
            print(f"batch {bs}  {name:22s} unsteered {1e3 * statistics.median(base):7.2f} ms/step  steered "
                  f"{1e3 * statistics.median(steered):7.2f} ms/step  overhead {100 * (r - 1):+6.1f}%", flush=True)
    # per-row configurations
    prompts = base_prompts
    per_row = [[Intervention.add(hook, torch.randn(d, generator=g), 4.0)] for _ in prompts]
    shared = per_row[0]
    t_shared, t_rows, t_seq = [], [], []
    for _ in range(args.repeats):
        t_shared.append(run(prompts, shared))
        t_rows.append(run(prompts, rows=per_row))
        t_seq.append(sum(run([p], s) for p, s in zip(prompts, per_row)))  # per step of each run, summed
    ms, mr, mq = (statistics.median(x) for x in (t_shared, t_rows, t_seq))
    print(f"\nbatch 8, 8 different configs vs 1 shared: throughput ratio {ms / mr:.3f} (target >= 0.9)")
    print(f"batch 8, 8 different configs vs 8 sequential single-row runs: speed-up {mq / mr:.2f}x")
    results.append({"per_row_vs_shared_throughput": ms / mr, "per_row_vs_sequential_speedup": mq / mr,
                    "shared_s": ms, "per_row_s": mr, "sequential_s": mq})
    print(json.dumps(results))
    mode = "quick" if args.quick else "full"
    out = Path(args.out)
    ops_rows = [{"mode": mode, "op": r["op"], "batch": r["batch"],
                 "unsteered_ms_per_step": round(1e3 * r["unsteered_s"], 3),
                 "steered_ms_per_step": round(1e3 * r["steered_s"], 3), "overhead_pct": round(r["overhead_pct"], 2),
                 "tokens": args.tokens, "repeats": args.repeats} for r in results if "op" in r]
    print(f"wrote {C.csv_rows(out, ops_rows)}")
    per_row = [{"mode": mode, "batch": len(prompts), "configs": len(prompts), "shared_ms_per_step": round(1e3 * ms, 3),
                "per_row_ms_per_step": round(1e3 * mr, 3), "sequential_ms_per_step": round(1e3 * mq, 3),
                "per_row_vs_shared_throughput": round(ms / mr, 4), "per_row_vs_sequential_speedup": round(mq / mr, 3),
                "tokens": args.tokens, "repeats": args.repeats}]
    print(f"wrote {C.csv_rows(out.with_name(out.stem + '_per_row.csv'), per_row)}")


if __name__ == "__main__":
    main()
