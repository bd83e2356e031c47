"""Recording a prompt set into the sharded dataset in one process vs on 1 and 2 Ray workers.

``record_dataset`` of ``--prompts`` prompts (default 512, ``_common.prompts``) of the default model,
``resid_post`` at 6 layers (5, 10, ..., 30 less one), last position, batches of 16, shards of 64, with one
torch thread per process (single process: this one; Ray: each worker, ``--cpus-per-worker 1``). The Ray
conditions start a local cluster once (``ray.init``), then for each worker count time the whole call:
starting the workers (each loads the model), recording, shutting them down; the time to start the workers
is reported apart (``start_s``, a run of one tiny item), so ``record_s`` is the recording alone. Every
dataset is checked equal, bit for bit, to the single-process one.

On this 2-core machine two workers can at best halve the recording time of one; the start (a model load
per worker, about a second for the default model from its cache) is paid once per run. A machine with N
cores or GPUs runs N workers (``--workers N``, ``--gpus-per-worker 1``) the same way.

Usage:  python benchmarks/bench_ray.py              # 512 prompts
        python benchmarks/bench_ray.py --quick      # 64 prompts

Rows go to ``benchmarks/results/ray.csv`` (``--out``).
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 prompts")
    ap.add_argument("--prompts", type=int, default=None, help="prompts (default 512; quick 64)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="Ray worker counts (default 1 2)")
    ap.add_argument("--out", default=str(C.ROOT / "benchmarks" / "results" / "ray.csv"))
    a = ap.parse_args(argv)

    import ray
    import torch

    import steerkit
    from steerkit.executors import ModelSpec, RayExecutor
    from steerkit.recording import record_dataset

    torch.set_num_threads(1)
    n = a.prompts or (64 if a.quick else 512)
    prompts = C.prompts(n)
    hooks = [f"blocks.{l}.hook_resid_post" for l in (4, 9, 14, 19, 24, 29)]
    opts = dict(positions="last", batch_size=16, shard_size=64, progress=False)
    work = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    rows = []
    try:
        sm = steerkit.load_model()
        with C.Clock() as clk:
            ref = record_dataset(sm, prompts, hooks, work / "single", **opts)
        print(f"single process: {clk.wall:.1f} s wall, {n / clk.wall:.1f} prompts/s", flush=True)
        rows.append({"condition": "single process", "workers": 0, "prompts": n, "start_s": 0.0,
                     "record_s": round(clk.wall, 3), "prompts_per_s": round(n / clk.wall, 3), "equal": True})
        del sm
        ray.init(num_cpus=max(a.workers), include_dashboard=False, log_to_driver=False)
        for w in a.workers:
            with RayExecutor(ModelSpec(device="cpu", dtype="float32", threads=1), workers=w) as ex:
                t = time.perf_counter()
                ex.first(lambda sm: sm.n_layers)  # start the workers (each loads the model)
                start = time.perf_counter() - t
                with C.Clock() as clk:
                    ds = record_dataset(None, prompts, hooks, work / f"ray{w}", executor=ex, **opts)
            equal = all(torch.equal(ds.load(h), ref.load(h)) for h in hooks)
            print(f"{w} Ray worker(s): start {start:.1f} s, record {clk.wall:.1f} s, {n / clk.wall:.1f} prompts/s, "
                  f"equal to one process: {equal}", flush=True)
            rows.append({"condition": f"ray, {w} worker(s)", "workers": w, "prompts": n, "start_s": round(start, 3),
                         "record_s": round(clk.wall, 3), "prompts_per_s": round(n / clk.wall, 3), "equal": equal})
        ray.shutdown()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    single = rows[0]["record_s"]
    for r in rows:
        r["x_vs_single_process"] = round(single / r["record_s"], 3)
    print(C.table(["condition", "start s", "record s", "prompts/s", "x vs one process", "equal"],
                  [[r["condition"], r["start_s"], r["record_s"], r["prompts_per_s"], r["x_vs_single_process"],
                    r["equal"]] for r in rows], title=f"recording {n} prompts x {len(hooks)} hooks"))
    print(f"wrote {C.csv_rows(Path(a.out), rows)}")
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
