"""Activation patching of one IOI prompt pair, steerkit vs TransformerLens 4, at 1 and 2 threads in one run.

Two grids on the default model (the pair is about 20 tokens; clean: the subject named again;
corrupted: the indirect object named again; metric: the logit difference " Mary" - " John" at the
last position):

* ``resid_pre``: every layer x every position, vs ``transformer_lens.patching.get_act_patch_resid_pre``;
* ``z``: every layer x every head, each head patched at every position, vs
  ``get_act_patch_attn_head_out_all_pos``.

Conditions, each timed as a whole call (the clean run, the corrupted run and every patched run), in
rotated order over ``--repeats`` rounds, for each thread count of ``--threads``:

* ``steerkit``: ``activation_patching(...)`` as it runs by default: each patched run starts from the
  corrupted run's residual at its block and its keys and values before the patched position, up to
  ``--batch`` runs of one block packed end to end in one pass, and only the position the metric
  reads is unembedded;
* ``steerkit-full``: ``reuse=False``: ``--batch`` patched runs per full forward pass over the whole
  prompt (per-row steerings), the metric's position only unembedded;
* ``steerkit-full-all-logits``: the same with a metric that does not say which position it reads,
  so every position is unembedded: the batched path as it ran before prefix reuse;
* ``tlens``: TransformerLens's function on a ``TransformerBridge`` of the same model (built as
  ``tests/core/test_tlens_names.py`` does), with the bridge's ``run_with_cache`` of the clean prompt
  inside the timing, under ``torch.inference_mode``.

The grids are compared (max |difference| against ``steerkit-full-all-logits``). Rows go to
``benchmarks/results/patching.csv``; ``x_vs_tlens`` is TransformerLens's time over the condition's,
``x_vs_full_all_logits`` the old batched path's time over the condition's.

Usage:  python benchmarks/bench_patching.py                      # both grids, 1 and 2 threads, 1 round
        python benchmarks/bench_patching.py --hooks resid_pre     # one grid
        python benchmarks/bench_patching.py --quick               # 6 layers, 1 thread
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # TransformerLens's per-patch progress bar
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

CLEAN = "When Mary and John went to the store on a sunny afternoon, John gave a bottle of cold water to"
CORRUPTED = "When Mary and John went to the store on a sunny afternoon, Mary gave a bottle of cold water to"
TL_FUNCTIONS = {"resid_pre": "get_act_patch_resid_pre", "z": "get_act_patch_attn_head_out_all_pos"}

Clock = C.Clock


def _conditions(sm, clean, corrupted, metric, hook, layers, batch, bridge, tl_metric):
    """name -> callable returning the grid ``[layers, positions or heads]``."""
    import torch

    from steerkit.probes import activation_patching

    def all_logits(logits):  # the same metric, without saying which position it reads
        return metric(logits)

    def sk(m, reuse):
        def f():
            return activation_patching(sm, clean, corrupted, m, hook, layers=layers, batch_size=batch, progress=False,
                                       reuse=reuse).values
        return f

    conds = {"steerkit": sk(metric, True), "steerkit-full": sk(metric, False),
             "steerkit-full-all-logits": sk(all_logits, False)}
    if bridge is not None:
        import pandas as pd
        from transformer_lens import patching as tlp

        fn = getattr(tlp, TL_FUNCTIONS[hook])
        axis = "pos" if hook == "resid_pre" else "head"
        n_axis = clean.input_ids.shape[1] if hook == "resid_pre" else sm.n_heads
        index_df = None if len(layers) == sm.n_layers else pd.DataFrame(
            [(l, i) for l in layers for i in range(n_axis)], columns=["layer", axis])

        def tl():
            with torch.inference_mode():
                _, cache = bridge.run_with_cache(clean.input_ids)
                if index_df is None:
                    return fn(bridge, corrupted.input_ids, cache, tl_metric)
                flat = fn(bridge, corrupted.input_ids, cache, tl_metric, index_axis_names=None, index_df=index_df)
                return flat.reshape(len(layers), n_axis)

        conds["tlens"] = tl
    return conds


def _tl_warm(bridge, clean, corrupted):
    import torch
    with torch.inference_mode():
        bridge.run_with_cache(clean.input_ids)
        return bridge(corrupted.input_ids, return_type="logits")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the first 6 layers, 1 thread")
    ap.add_argument("--layers", type=int, default=None, help="patch the first N layers (default all; quick 6)")
    ap.add_argument("--hooks", nargs="+", default=["resid_pre", "z"], choices=list(TL_FUNCTIONS))
    ap.add_argument("--repeats", type=int, default=1, help="rounds (default 1)")
    ap.add_argument("--batch", type=int, default=32, help="patched runs per pass (default 32)")
    ap.add_argument("--threads", type=int, nargs="+", default=None, help="torch thread counts (default 1 2)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="wall")
    ap.add_argument("--no-tlens", action="store_true", help="skip TransformerLens")
    ap.add_argument("--out", default=str(C.ROOT / "benchmarks" / "results" / "patching.csv"))
    a = ap.parse_args(argv)

    import torch

    import steerkit
    from steerkit.probes import logit_diff_metric

    thread_counts = a.threads or ([1] if a.quick else [1, 2])
    t0 = time.perf_counter()
    sm = steerkit.load_model()
    n_layers = a.layers or (6 if a.quick else sm.n_layers)
    layers = list(range(n_layers))
    clean = sm.tokenize([CLEAN], chat=False)
    corrupted = sm.tokenize([CORRUPTED], chat=False)
    n_pos = int(clean.input_ids.shape[1])
    metric = logit_diff_metric(sm, " Mary", " John")
    a_id, w_id = (sm.tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in (" Mary", " John"))

    def tl_metric(logits):
        return logits[0, -1, a_id] - logits[0, -1, w_id]

    bridge, tl_version, tl_note = None, "", ""
    if not a.no_tlens:
        try:
            from importlib.metadata import version
            tl_version = version("transformer-lens")
            bridge = steerkit.wrap(sm.hf_model, sm.tokenizer, name=sm.name, backend="tlens").backend.bridge
        except Exception as e:  # noqa: BLE001 - report and go on without it
            tl_note = f"TransformerLens skipped: {e!r}"
            print(tl_note)
    print(f"model {sm.name} loaded in {time.perf_counter() - t0:.1f} s; torch {torch.__version__}; {n_layers} layers, "
          f"{n_pos} positions, {sm.n_heads} heads; batch {a.batch}; threads {thread_counts}", flush=True)

    out, rows = [], []
    for threads in thread_counts:
        C.set_threads(threads)
        for hook in a.hooks:
            conds = _conditions(sm, clean, corrupted, metric, hook, layers, a.batch, bridge, tl_metric)
            cells = n_layers * (n_pos if hook == "resid_pre" else sm.n_heads)
            warm = _conditions(sm, clean, corrupted, metric, hook, [0], a.batch, None, tl_metric)
            if bridge is not None:
                warm["tlens"] = lambda: _tl_warm(bridge, clean, corrupted)
            for name, fn in warm.items():  # warm-up: steerkit on the first layer, one TransformerLens forward
                with Clock() as c:
                    fn()
                print(f"  warm-up {hook} {name} ({threads} thread(s)): {c.wall:.1f} s", flush=True)
            times = {n: {"cpu": [], "wall": []} for n in conds}
            grids = {}
            names = list(conds)
            for r in range(a.repeats):
                order = names[r % len(names):] + names[:r % len(names)]
                for name in order:
                    with Clock() as c:
                        grids[name] = conds[name]().detach().float().cpu()
                    times[name]["cpu"].append(c.cpu)
                    times[name]["wall"].append(c.wall)
                    print(f"  {threads} thread(s) {hook} round {r + 1}/{a.repeats} {name}: cpu {c.cpu:.2f} s, "
                          f"wall {c.wall:.2f} s", flush=True)
            ref = grids["steerkit-full-all-logits"]
            med = {n: C.median(times[n][a.clock]) for n in names}
            other = "wall" if a.clock == "cpu" else "cpu"
            for name in names:
                diff = float((grids[name] - ref).abs().max())
                vs_tl = med["tlens"] / med[name] if "tlens" in med else float("nan")
                vs_old = med["steerkit-full-all-logits"] / med[name]
                rows.append([threads, hook, name, f"{med[name]:.2f}", f"{cells / med[name]:.1f}", f"{vs_tl:.2f}",
                             f"{vs_old:.2f}", f"{diff:.2e}"])
                out.append({"mode": "quick" if a.quick else "full", "threads": threads, "hook": hook,
                            "condition": name, "layers": n_layers, "positions": n_pos, "cells": cells,
                            "batch": a.batch, "repeats": a.repeats, "clock": a.clock, "median_s": round(med[name], 3),
                            "median_other_s": round(C.median(times[name][other]), 3),
                            "cells_per_s": round(cells / med[name], 2), "x_vs_tlens": round(vs_tl, 3),
                            "x_vs_full_all_logits": round(vs_old, 3), "max_abs_diff_vs_full_all_logits": f"{diff:.3g}",
                            "transformer_lens": tl_version, "note": tl_note})
    print()
    print(C.table(["threads", "grid", "condition", f"median {a.clock} s", "cells/s", "x vs tlens",
                   "x vs full-all-logits", "max |diff|"], rows,
                  title=f"activation patching, {n_layers} layers x {n_pos} positions / {sm.n_heads} heads, "
                        f"{a.repeats} round(s)"))
    path = C.csv_rows(Path(a.out), out)
    print(f"wrote {len(out)} rows to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
