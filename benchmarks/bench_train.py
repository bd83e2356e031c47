"""One BiPO epoch on the default model: seconds and peak memory.

``steerkit.probes.train_bipo`` on ``--pairs`` templated myopic-reward A/B pairs
(``steerkit.probes.myopic_items``), one epoch at block ``--layer``'s output, batches of ``--batch``
pairs (each step: ``2 * batch`` sequences forward with autograd, backward to the steered layer, one
AdamW step on the vector). Measured: the wall and CPU time of the epoch (the unsteered reference
log-probabilities, computed once before the first step, included), seconds per step, the peak
resident set size during the epoch (psutil, sampled every 10 ms, as ``bench_record.py``) and its
excess over the RSS before the epoch (after a warm-up forward pass, so the memory-mapped weights are
already resident), and the peak of Python-level allocations (tracemalloc). Rows go to
``benchmarks/results/train.csv``.

Usage:  python benchmarks/bench_train.py            # 64 pairs, batch 8, one epoch
        python benchmarks/bench_train.py --quick    # 4 pairs, batch 2
"""
from __future__ import annotations

import argparse
import sys
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from bench_record import RssPeak  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 pairs, batch 2")
    ap.add_argument("--pairs", type=int, default=None, help="training pairs (default 64; quick 4)")
    ap.add_argument("--batch", type=int, default=None, help="pairs per step (default 8; quick 2)")
    ap.add_argument("--layer", type=int, default=15, help="steered block (default 15)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0 = torch's default)")
    ap.add_argument("--out", default=str(C.ROOT / "benchmarks" / "results" / "train.csv"))
    a = ap.parse_args(argv)
    n = a.pairs or (4 if a.quick else 64)
    batch = a.batch or (2 if a.quick else 8)

    import steerkit
    from steerkit.probes import myopic_items, preference_pairs, train_bipo

    threads = C.set_threads(a.threads)
    sm = steerkit.load_model()
    pairs = preference_pairs(myopic_items(n, seed=0))
    tokens = [len(sm.tokenize(p.prompt, chat=True).input_ids[0]) for p in pairs]
    print(f"model {sm.name}; {threads} thread(s); {n} pairs (prompt {min(tokens)}-{max(tokens)} tokens), batch {batch}, "
          f"layer {a.layer}", flush=True)
    sm.forward([p.prompt for p in pairs[:batch]], chat=True)  # warm-up: the weights' pages are resident before the RSS start
    tracemalloc.start()
    with RssPeak() as rss, C.Clock() as clock:
        r = train_bipo(sm, pairs, a.layer, epochs=1, batch_size=batch, lr=0.05, progress=True)
    _, py_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    steps = len(r.history)
    row = {"mode": "quick" if a.quick else "full", "pairs": n, "batch": batch, "layer": a.layer, "steps": steps,
           "threads": threads, "wall_s": round(clock.wall, 2), "cpu_s": round(clock.cpu, 2),
           "s_per_step_wall": round(clock.wall / steps, 2), "s_per_step_cpu": round(clock.cpu / steps, 2),
           "peak_rss_mib": round(rss.peak / 2**20, 1), "peak_minus_start_mib": round((rss.peak - rss.start) / 2**20, 1),
           "tracemalloc_peak_mib": round(py_peak / 2**20, 3), "first_loss": round(r.losses[0], 5),
           "last_loss": round(r.losses[-1], 5), "vector_norm": round(float(r.tensor.norm()), 4)}
    print(C.table(["pairs", "batch", "steps", "wall s", "cpu s", "s/step (cpu)", "peak RSS MiB", "+ over start MiB"],
                  [[n, batch, steps, row["wall_s"], row["cpu_s"], row["s_per_step_cpu"], row["peak_rss_mib"],
                    row["peak_minus_start_mib"]]], title="one BiPO epoch"))
    print(f"wrote {C.csv_rows(Path(a.out), [row])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
