"""Refusal-direction candidate scoring: one candidate at a time vs many per pass (per-row steering), with and without prefix reuse.

The candidates are those ``steerkit refusal`` builds (difference of means of ``resid_pre`` on the
harmful and harmless train prompts at the post-instruction positions and every layer), recorded once
and not timed. Then ``select_direction`` scores them on the validation prompts twice, in the same
run, timed as a whole call (wall and this process's CPU time, ``_common.Clock``):

* ``one-at-a-time-full``: ``batched=False, reuse=False``: one candidate's edits installed per forward
  pass (its ablation at every block input, attention output and MLP output, or its addition at its
  block), the validation prompts in passes of ``batch_size``, every pass over the whole model;
* ``batched-full``: ``batched=True, reuse=False``: (candidate, prompt) rows, ``--score-rows`` per forward
  pass (default ``refusal.score_rows``: ``--batch-size`` on a CPU, 256 on a GPU), each row with its own
  steering in one per-row steering, the rows sorted by prompt length;
* ``batched``: the defaults (``batched=True, reuse=True``): as ``batched-full``, and the induce
  (addition) rows, sorted by layer, start from one unsteered run of the harmless prompts at the lowest
  block among them; bypass and KL rows (ablations act at every block) keep full passes;
* ``one-at-a-time``: ``batched=False, reuse=True``.

All use the default lazy search and fallback. Each candidate table is compared with the first path's
(largest |difference| of any score, same NaN pattern) and the selected (position, layer) must be the
same (the script exits 1 otherwise). Rows go to ``benchmarks/results/refusal_scoring.csv`` with each
path's time over the first path's, and ``new_over_old``: its CPU time over ``one-at-a-time-full``'s.

Usage:  python benchmarks/bench_refusal.py            # the defaults of `steerkit refusal`: 6 positions x 24 layers
        python benchmarks/bench_refusal.py --quick    # 2 positions x 3 layers, 8 + 8 train, 4 + 4 val prompts

``--quick`` selects with ``kl_max=1.0``: with 8 + 8 train prompts no candidate of its 6 keeps the KL
under the default 0.1.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 positions x 3 layers, 8 + 8 train, 4 + 4 val prompts, "
                    "kl_max 1.0")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default 0 = torch's default)")
    ap.add_argument("--batch-size", type=int, default=16, help="prompts per pass (one at a time; default 16)")
    ap.add_argument("--score-rows", type=int, default=None, help="rows per pass of the batched path (default: "
                    "--batch-size on a CPU, 256 on a GPU)")
    C.add_model_args(ap)
    ap.add_argument("--paths", nargs="+", default=["one-at-a-time-full", "batched-full", "batched", "one-at-a-time"],
                    choices=["one-at-a-time-full", "one-at-a-time", "batched-full", "batched"],
                    help="scoring paths, timed in this order (the first is the reference)")
    ap.add_argument("--out", default=str(C.ROOT / "benchmarks" / "results" / "refusal_scoring.csv"))
    a = ap.parse_args(argv)

    from steerkit.probes.methods import refusal as R

    threads = C.set_threads(a.threads)
    cfg = R.RefusalConfig()
    n_train, n_val = (8, 4) if a.quick else (cfg.n_train, cfg.n_val)
    sm = C.default_model(a.device, a.skeleton)
    data = R.sample_splits(n_train, n_val, 1, seed=cfg.seed)
    ids = R.refusal_token_ids(sm.tokenizer, cfg.refusal_words)
    positions = R.post_instruction_positions(sm)[0]
    cut = int(sm.n_layers * (1 - cfg.prune_frac))
    layers = list(range(cut))
    if a.quick:
        positions, layers = positions[-2:], [3, 9, 15]
    acts = {k: R.record_resid_pre(sm, data["train"][k], positions, None, batch_size=a.batch_size)[0]
            for k in ("harmful", "harmless")}
    cands = R.mean_diff(acts["harmful"], acts["harmless"])
    args = (sm, cands, positions, data["val"]["harmful"], data["val"]["harmless"], ids)
    kw = dict(prune_frac=cfg.prune_frac, kl_max=1.0 if a.quick else cfg.kl_max, induce_min=cfg.induce_min, lazy=cfg.lazy,
              fallback=cfg.fallback, batch_size=a.batch_size, layers=layers, rows=a.score_rows)
    rows_per_pass = R.score_rows(sm.device, a.batch_size, a.score_rows)
    n_cand = len(positions) * len(layers)
    print(f"{sm.name}: {n_cand} candidates ({len(positions)} positions x {len(layers)} layers), "
          f"{n_val} + {n_val} validation prompts, batch {a.batch_size} (batched: {rows_per_pass} rows a pass), "
          f"{threads} threads", flush=True)
    res, clocks = {}, {}
    every = {"one-at-a-time-full": (False, False), "one-at-a-time": (False, True), "batched-full": (True, False),
             "batched": (True, True)}
    for path in a.paths:
        batched, reuse = every[path]
        with C.Clock() as clk:
            res[path] = R.select_direction(*args, batched=batched, reuse=reuse, **kw)
        clocks[path] = clk
        b = res[path].best
        print(f"  {path:18s} wall {clk.wall:8.1f} s  cpu {clk.cpu:8.1f} s  selected pos {b.pos} layer {b.layer} "
              f"({res[path].rule} rule)", flush=True)
    ref = a.paths[0]
    rows = []
    same_all = True
    for path in res:
        old, new = res[ref], res[path]
        same = (old.best.pos, old.best.layer, old.rule) == (new.best.pos, new.best.layer, new.rule)
        diff, same_nan = 0.0, True
        for x, y in zip(old.table, new.table):
            for k in ("bypass", "induce", "kl"):
                u, v = getattr(x, k), getattr(y, k)
                same_nan &= math.isnan(u) == math.isnan(v)
                if not (math.isnan(u) or math.isnan(v)):
                    diff = max(diff, abs(u - v))
        same_all &= same and same_nan
        n_scored = sum(not math.isnan(getattr(c, k)) for c in new.table for k in ("bypass", "induce", "kl"))
        clk, b = clocks[path], new.best
        rows.append({"mode": "quick" if a.quick else "full", "device": a.device, "weights": C.weights_kind(a.skeleton),
                     "path": path, "n_candidates": n_cand,
                     "n_positions": len(positions), "n_layers": len(layers), "n_val_per_side": n_val,
                     "batch_size": a.batch_size, "score_rows": rows_per_pass if path.startswith("batched") else "",
                     "threads": threads, "wall_s": round(clk.wall, 3), "cpu_s": round(clk.cpu, 3),
                     "scores_computed": n_scored, "selected_pos": b.pos, "selected_layer": b.layer, "rule": new.rule,
                     "same_selection_as_" + ref: same, "table_max_abs_diff": f"{diff:.3g}",
                     "same_nan_pattern": same_nan, "over_" + ref + "_wall": round(clk.wall / clocks[ref].wall, 4),
                     "over_" + ref + "_cpu": round(clk.cpu / clocks[ref].cpu, 4),
                     "new_over_old": round(clk.cpu / clocks["one-at-a-time-full"].cpu, 4)
                     if "one-at-a-time-full" in clocks else ""})
    print(C.table(["path", "wall s", "cpu s", "scores", "selected", f"same selection as {ref}", "max |diff|",
                   f"wall / {ref}"],
                  [[r["path"], r["wall_s"], r["cpu_s"], r["scores_computed"],
                    f"pos {r['selected_pos']} layer {r['selected_layer']}", r["same_selection_as_" + ref],
                    r["table_max_abs_diff"], r["over_" + ref + "_wall"]] for r in rows]))
    print(f"wrote {C.csv_rows(Path(a.out), rows)}")
    return 0 if same_all else 1


if __name__ == "__main__":
    sys.exit(main())
