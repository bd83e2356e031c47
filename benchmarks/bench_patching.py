"""Activation patching of ``resid_pre`` at every layer x every position of one prompt pair: steerkit
batched vs one patch per forward pass vs TransformerLens 4's ``get_act_patch_resid_pre``.

The pair is an IOI prompt of about 20 tokens (clean: the subject named again; corrupted: the
indirect object named again); the metric is the logit difference " Mary" - " John" at the last
position. Conditions, each timed as a whole call (the clean run, the corrupted run and every
patched run), in rotated order over ``--repeats`` rounds:

* ``steerkit-batched``: ``steerkit.probes.activation_patching(..., batch_size=--batch)``, every
  forward pass runs ``--batch`` copies of the corrupted prompt, each row with its own patch;
* ``steerkit-b1``: the same with ``batch_size=1`` (one patch per forward pass);
* ``tlens``: ``transformer_lens.patching.get_act_patch_resid_pre`` on a ``TransformerBridge`` of the
  same model (built as ``tests/test_tlens_names.py`` does: ``steerkit.wrap(..., backend="tlens")``),
  with the bridge's ``run_with_cache`` of the clean prompt inside the timing, under
  ``torch.inference_mode``.

The three grids are compared (max |difference|). Rows go to ``benchmarks/results/patching.csv``.

Usage:  python benchmarks/bench_patching.py                # 30 layers x all positions, 1 round
        python benchmarks/bench_patching.py --repeats 3    # 3 rounds, rotated order, medians
        python benchmarks/bench_patching.py --quick        # 6 layers, 1 round
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


Clock = C.Clock


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the first 6 layers only, 1 round")
    ap.add_argument("--layers", type=int, default=None, help="patch the first N layers (default all; quick 6)")
    ap.add_argument("--repeats", type=int, default=1, help="rounds (default 1)")
    ap.add_argument("--batch", type=int, default=32, help="patched runs per forward pass when batched (default 32)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0 = torch's default)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--no-tlens", action="store_true", help="skip TransformerLens")
    ap.add_argument("--out", default=str(C.ROOT / "benchmarks" / "results" / "patching.csv"))
    a = ap.parse_args(argv)

    import torch

    import steerkit
    from steerkit.probes import activation_patching, logit_diff_metric

    threads = C.set_threads(a.threads)
    repeats = a.repeats
    t0 = time.perf_counter()
    sm = steerkit.load_model()
    n_layers = a.layers or (6 if a.quick else sm.n_layers)
    layers = list(range(n_layers))
    clean = sm.tokenize([CLEAN], chat=False)
    corrupted = sm.tokenize([CORRUPTED], chat=False)
    n_pos = int(clean.input_ids.shape[1])
    metric = logit_diff_metric(sm, " Mary", " John")
    a_id, w_id = sm.tokenizer(" Mary", add_special_tokens=False)["input_ids"][0], \
        sm.tokenizer(" John", add_special_tokens=False)["input_ids"][0]
    print(f"model {sm.name} loaded in {time.perf_counter() - t0:.1f} s; torch {torch.__version__}, {threads} "
          f"thread(s); {n_layers} layers x {n_pos} positions = {n_layers * n_pos} patches; batch {a.batch}",
          flush=True)

    conds, warm = {}, {}

    def sk(batch, ls=None, ps=None):
        def f():
            return activation_patching(sm, clean, corrupted, metric, "resid_pre", layers=ls or layers, positions=ps,
                                       batch_size=batch, progress=False).values
        return f

    warm["steerkit"] = sk(a.batch, [0], list(range(min(a.batch, n_pos))))

    conds["steerkit-batched"] = sk(a.batch)
    conds["steerkit-b1"] = sk(1)
    tl_note = tl_version = ""
    if not a.no_tlens:
        try:
            import pandas as pd
            from importlib.metadata import version
            from transformer_lens import patching as tlp
            tl_version = version("transformer-lens")
            bridge = steerkit.wrap(sm.hf_model, sm.tokenizer, name=sm.name, backend="tlens").backend.bridge
            index_df = None if n_layers == sm.n_layers else pd.DataFrame(
                [(l, p) for l in layers for p in range(n_pos)], columns=["layer", "pos"])

            def tl_metric(logits):
                return logits[0, -1, a_id] - logits[0, -1, w_id]

            def tl():
                with torch.inference_mode():
                    _, cache = bridge.run_with_cache(clean.input_ids)
                    if index_df is None:
                        return tlp.get_act_patch_resid_pre(bridge, corrupted.input_ids, cache, tl_metric)
                    flat = tlp.get_act_patch_resid_pre(bridge, corrupted.input_ids, cache, tl_metric,
                                                       index_axis_names=None, index_df=index_df)
                    return flat.reshape(n_layers, n_pos)

            conds["tlens"] = tl

            def tl_warm():
                with torch.inference_mode():
                    bridge.run_with_cache(clean.input_ids)
                    return bridge(corrupted.input_ids, return_type="logits")

            warm["tlens"] = tl_warm
        except Exception as e:  # noqa: BLE001 - report and go on without it
            tl_note = f"TransformerLens skipped: {e!r}"
            print(tl_note)

    for name, fn in warm.items():  # warm-up: a few patched runs / one cached run and one forward pass
        with Clock() as c:
            fn()
        print(f"  warm-up {name}: {c.wall:.1f} s wall", flush=True)
    times = {n: {"cpu": [], "wall": []} for n in conds}
    grids = {}
    names = list(conds)
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            with Clock() as c:
                grid = conds[name]()
            times[name]["cpu"].append(c.cpu)
            times[name]["wall"].append(c.wall)
            grids[name] = grid.detach().float().cpu()
            print(f"  round {r + 1}/{repeats} {name}: cpu {c.cpu:.2f} s, wall {c.wall:.2f} s", flush=True)
    ref = grids["steerkit-batched"]
    diffs = {n: float((g - ref).abs().max()) for n, g in grids.items()}
    base = C.median(times["steerkit-batched"][a.clock])
    rows, out = [], []
    for name in names:
        med = C.median(times[name][a.clock])
        other = "wall" if a.clock == "cpu" else "cpu"
        rows.append([name, f"{med:.2f}", f"{C.median(times[name][other]):.2f}", f"{n_layers * n_pos / med:.1f}",
                     f"{med / base:.2f}", f"{diffs[name]:.2e}"])
        out.append({"mode": "quick" if a.quick else "full", "condition": name, "layers": n_layers, "positions": n_pos,
                    "patches": n_layers * n_pos, "batch": a.batch if name == "steerkit-batched" else 1,
                    "repeats": repeats, "clock": a.clock, "median_s": round(med, 3),
                    "median_other_s": round(C.median(times[name][other]), 3),
                    "patches_per_s": round(n_layers * n_pos / med, 2), "time_vs_batched": round(med / base, 3),
                    "max_abs_diff_vs_batched": f"{diffs[name]:.3g}", "transformer_lens": tl_version, "note": tl_note})
    print()
    print(C.table(["condition", f"median {a.clock} s", f"median {'wall' if a.clock == 'cpu' else 'cpu'} s",
                   "patches/s", "time / batched", "max |grid - batched|"], rows,
                  title=f"resid_pre patching, {n_layers} layers x {n_pos} positions, {repeats} round(s)"))
    path = C.csv_rows(Path(a.out), [{**r, "threads": threads} for r in out])
    print(f"wrote {len(out)} rows to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
