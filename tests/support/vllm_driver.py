"""Runs inside the vLLM test environment (.venv-vllm): one offline job, results as JSON.

``python tests/support/vllm_driver.py JOB.json OUT.json`` where JOB is::

    {"model": DIR, "batches": [[{"prompt_token_ids": [...], "args": {...} | null, "max_tokens": N,
                                 "cache_salt": null}, ...], ...],
     "prefix_caching": true, "engine": {more LLM(...) arguments, e.g. max_num_seqs}}

Each batch is one ``LLM.generate`` call (greedy); a batch that raises records the error text for
each of its requests, and the next batch still runs (the engine must survive bad requests).
OUT gets ``{"batches": [[{"token_ids": [...]} | {"error": "..."}, ...]], "seconds": [...], "compile_counts": [...]}``
(vLLM's and Dynamo's compilation counters after each batch). ``engine`` overrides the defaults
(``enforce_eager=True``, float32, seed 0): ``{"enforce_eager": false}`` runs vLLM's compiled mode.
"""
from __future__ import annotations

import json
import sys
import time


def main(job_path: str, out_path: str) -> None:
    job = json.loads(open(job_path).read())
    from vllm import LLM, SamplingParams
    kw = {"enforce_eager": True, "dtype": "float32", "seed": 0, "enable_prefix_caching": job.get("prefix_caching", True),
          "max_model_len": job.get("max_model_len", 2048)}
    kw.update(job.get("engine", {}))  # e.g. enforce_eager=False: vLLM's compiled mode
    llm = LLM(model=job["model"], **kw)
    out, secs, counts = [], [], []
    for batch in job["batches"]:
        prompts, params = [], []
        for r in batch:
            p = {"prompt_token_ids": r["prompt_token_ids"]}
            if r.get("cache_salt"):
                p["cache_salt"] = r["cache_salt"]
            prompts.append(p)
            params.append(SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, extra_args=r.get("args"),
                                         ignore_eos=bool(r.get("ignore_eos", False))))
        t = time.perf_counter()
        try:
            res = llm.generate(prompts, params, use_tqdm=False)
            out.append([{"token_ids": list(o.outputs[0].token_ids)} for o in res])
        except Exception as e:  # noqa: BLE001 - the test reads the message
            out.append([{"error": f"{type(e).__name__}: {e}"} for _ in batch])
        secs.append(time.perf_counter() - t)
        counts.append(compile_counts())
    with open(out_path, "w") as f:
        json.dump({"batches": out, "seconds": secs, "compile_counts": counts}, f)


def compile_counts() -> dict:
    """vLLM's compilation counters and Dynamo's graph count in this process (the engine runs in it
    with VLLM_ENABLE_V1_MULTIPROCESSING=0), read after each batch."""
    import dataclasses

    from torch._dynamo.utils import counters
    from vllm.compilation.counter import compilation_counter
    out = {k: v for k, v in dataclasses.asdict(compilation_counter).items() if isinstance(v, int)}
    out["dynamo_unique_graphs"] = int(counters["stats"]["unique_graphs"])
    out["dynamo_frames_ok"] = int(counters["frames"]["ok"])
    return out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
