"""Runs inside the vLLM test environment (.venv-vllm): one engine, several recording jobs.

``python tests/support/vllm_record_driver.py JOB.json OUT.json ROWS.safetensors`` where JOB is::

    {"model": DIR, "engine": {LLM(...) arguments}, "jobs": [
        {"kind": "generate", "name": N, "hooks": [...], "positions": P,
         "requests": [{"prompt_token_ids": [...], "max_tokens": M, "args": {...} | null,
                       "record": true | false | {"hooks": [...], "positions": P}}, ...]},
        {"kind": "errors", "name": N, "prompt_token_ids": [...], "specs": [raw record spec, ...]},
        {"kind": "dataset", "name": N, "prompts": [...], "hooks": [...], "positions": P, "out": DIR,
         "shard_size": S, "remove_after_first": [shard file names]}]}

The engine starts through :func:`steerkit.serving.capture.start_llm` (greedy, float32, eager).
OUT gets ``{name: {"token_ids": [[...], ...]} | {"errors": [...]} | {"first": [...], "second": [...]}}``
(for a data set: the shard files each run wrote); ROWS gets every recorded tensor as
``{name}/{request}/{hook}``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def _dataset_run(capture, llm, model: str, j: dict) -> list:
    """Record a data set job; the shard files this run wrote."""
    d = Path(j["out"])
    before = {p.name: p.stat().st_mtime_ns for p in d.glob("shard-*.safetensors")}
    capture.record_dataset_vllm(llm, model, j["prompts"], j["hooks"], d, positions=j.get("positions", "last"),
                                shard_size=j["shard_size"], batch_size=j.get("batch_size", 64),
                                chat=j.get("chat", True), progress=False)
    return sorted(p.name for p in d.glob("shard-*.safetensors") if before.get(p.name) != p.stat().st_mtime_ns)


def main(job_path: str, out_path: str, rows_path: str) -> None:
    job = json.loads(open(job_path).read())
    from safetensors.torch import save_file
    from vllm import SamplingParams

    from steerkit.serving import capture

    llm = capture.start_llm(job["model"], dtype="float32", seed=0, max_model_len=2048, **job.get("engine", {}))
    out: dict = {}
    tensors: dict = {}
    for j in job["jobs"]:
        name = j["name"]
        if j["kind"] == "generate":
            reqs = j["requests"]
            prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
            params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, extra_args=r.get("args"))
                      for r in reqs]
            outputs, rows = capture.record_generate(llm, prompts, params, hooks=j.get("hooks", []),
                                                    positions=j.get("positions", "all"),
                                                    record=[r.get("record", True) for r in reqs], use_tqdm=False)
            out[name] = {"token_ids": [list(o.outputs[0].token_ids) for o in outputs],
                         "recorded": [r is not None for r in rows]}
            for i, r in enumerate(rows):
                for h, t in (r or {}).items():
                    tensors[f"{name}/{i}/{h}"] = t.contiguous()
        elif j["kind"] == "errors":
            errs = []
            for spec in j["specs"]:
                sp = SamplingParams(max_tokens=2, temperature=0.0, extra_args={capture.KEY: spec})
                try:
                    llm.generate([{"prompt_token_ids": j["prompt_token_ids"]}], sp, use_tqdm=False)
                    errs.append("")
                except Exception as e:  # noqa: BLE001 - the test reads the message
                    errs.append(f"{type(e).__name__}: {e}")
            out[name] = {"errors": errs}
        elif j["kind"] == "dataset":
            first = _dataset_run(capture, llm, job["model"], j)
            for f in j.get("remove_after_first", []):
                (Path(j["out"]) / f).unlink()
            out[name] = {"first": first, "second": _dataset_run(capture, llm, job["model"], j)}
    save_file(tensors, rows_path)
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
