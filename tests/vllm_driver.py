"""Runs inside the vLLM test environment (.venv-vllm): one offline job, results as JSON.

``python tests/vllm_driver.py JOB.json OUT.json`` where JOB is::

    {"model": DIR, "batches": [[{"prompt_token_ids": [...], "args": {...} | null, "max_tokens": N,
                                 "cache_salt": null}, ...], ...],
     "prefix_caching": true, "engine": {more LLM(...) arguments, e.g. max_num_seqs}}

Each batch is one ``LLM.generate`` call (greedy); a batch that raises records the error text for
each of its requests, and the next batch still runs (the engine must survive bad requests).
OUT gets ``{"batches": [[{"token_ids": [...]} | {"error": "..."}, ...]], "seconds": [...]}``.
"""
from __future__ import annotations

import json
import sys
import time


def main(job_path: str, out_path: str) -> None:
    job = json.loads(open(job_path).read())
    from vllm import LLM, SamplingParams
    llm = LLM(model=job["model"], enforce_eager=True, dtype="float32", seed=0,
              enable_prefix_caching=job.get("prefix_caching", True), max_model_len=job.get("max_model_len", 2048),
              **job.get("engine", {}))
    out, secs = [], []
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
    with open(out_path, "w") as f:
        json.dump({"batches": out, "seconds": secs}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
