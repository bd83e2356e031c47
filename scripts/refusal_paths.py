"""The refusal direction of Arditi et al. recomputed on the model loading paths: float32, int8 and int4
weight-only (torchao) and disk offload (accelerate, a ``max_memory`` a third of the weights).

At the cell the full method selects on the default model (docs/reproductions/refusal.md: block 9's input, the last
post-instruction token), each path's direction is the difference of means of the harmful and harmless
train prompts (the method's split, seed 0); reported: its cosine with the float32 direction, and the
bypass score (mean refusal log-odds of the harmful validation prompts with the direction ablated at
every block input, attention and MLP output, the method's ablation) next to that path's baseline.

    .venv/bin/python scripts/refusal_paths.py     # writes benchmarks/results/refusal_paths.csv
"""
from __future__ import annotations

import csv
import sys
import tempfile
from pathlib import Path

import torch

import steerkit
from steerkit.probes.methods import refusal as R

ROOT = Path(__file__).resolve().parents[1]
LAYER = 9


def direction_and_bypass(sm, splits, ids) -> tuple[torch.Tensor, float, float]:
    pos = [R.post_instruction_positions(sm)[0][-1]]
    harmful, _ = R.record_resid_pre(sm, splits["train"]["harmful"], pos)
    harmless, _ = R.record_resid_pre(sm, splits["train"]["harmless"], pos)
    r = R.mean_diff(harmful, harmless)[0, LAYER]
    val = splits["val"]["harmful"]
    base = float(R.refusal_scores(sm, val, ids).mean())
    with R.ablation(sm, r):
        bypass = float(R.refusal_scores(sm, val, ids).mean())
    return r, base, bypass


def main() -> None:
    splits = R.sample_splits(32, 16, 32, seed=0)  # the full method's draw (its train prompts depend on n_test)
    rows = []
    ref = None
    with tempfile.TemporaryDirectory() as off:
        paths = {"float32": {}, "int8": {"quantize": "int8"}, "int4": {"quantize": "int4"},
                 "disk offload": {"device_map": "auto", "max_memory": {"cpu": 180 * 2**20}, "offload_folder": off}}
        for name, kw in paths.items():
            sm = steerkit.load_model(**kw)
            ids = R.refusal_token_ids(sm.tokenizer)
            r, base, bypass = direction_and_bypass(sm, splits, ids)
            ref = r if ref is None else ref
            cos = float(torch.nn.functional.cosine_similarity(r, ref, dim=0))
            rows.append({"path": name, "cosine_with_float32": round(cos, 4), "norm": round(float(r.norm()), 3),
                         "harmful_val_score": round(base, 3), "bypass_score": round(bypass, 3)})
            print(rows[-1], flush=True)
            del sm
    out = ROOT / "benchmarks" / "results" / "refusal_paths.csv"
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
