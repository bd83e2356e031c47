"""Steered decode speed, float32 vs int8 weight-only (torchao), default model, in one run.

For each model (``steerkit.load_model()`` and ``steerkit.load_model(quantize="int8")``) the steerkit
half of ``bench_generation.py`` runs: greedy generation unsteered, with an injection at block 15
(``add``) and with a direction ablated at all 30 blocks (``ablate``), repeats interleaved. Reported per
model and batch: tokens/s of each condition, and the steering overhead (median over repeats of
``steered / base`` CPU time of the same repeat; ``base-2``, unsteered again, is the A/A control: its
"overhead" is what noise alone gives in the same run). The int8 model de-quantises its weights inside each
matmul on this CPU build (no int8 kernels), so it is slower than float32 here; the figure that matters
for steering is the overhead, which must stay what it is on the float model.

    .venv/bin/python benchmarks/bench_quantized.py            # 32 tokens, batches 1 and 8, 3 repeats
    .venv/bin/python benchmarks/bench_quantized.py --quick    # 4 tokens, batch 1, 1 repeat
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from bench_generation import bench_steerkit  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(C.ROOT / "benchmarks" / "results" / "quantized_decode.csv"))
    args = ap.parse_args()
    import torch

    import steerkit
    torch.set_num_threads(1)
    cfg = {"tokens": 4 if args.quick else args.tokens, "batches": [1] if args.quick else [1, 8],
           "repeats": 1 if args.quick else args.repeats}
    rows = []
    for scheme in (None, "int8"):
        sm = steerkit.load_model(quantize=scheme)
        ids = [sm.tokenize(p, chat=True).input_ids[0].tolist() for p in C.prompts(max(cfg["batches"]))]
        res = bench_steerkit(sm, ids, cfg, log=print)
        for B in cfg["batches"]:
            base = res[f"base@{B}"]
            for cond in ("base", "add", "ablate", "base-2"):
                r = res[f"{cond}@{B}"]
                tps = statistics.median(s * B / w for s, w in zip(r["steps"], r["wall"]))
                ratio = statistics.median(c / b for c, b in zip(r["cpu"], base["cpu"]))
                rows.append({"weights": scheme or "float32", "batch": B, "condition": cond,
                             "tokens_per_s": round(tps, 2), "overhead_pct": round(100 * (ratio - 1), 2),
                             "tokens": cfg["tokens"], "repeats": cfg["repeats"]})
        del sm
    print(C.table(list(rows[0]), [list(r.values()) for r in rows], title="steered decode, float32 vs int8"))
    print(f"wrote {C.csv_rows(Path(args.out), rows)}")


if __name__ == "__main__":
    main()
