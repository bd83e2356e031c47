"""Per-request steering inside vLLM's compiled mode (``torch.compile``; no ``enforce_eager``).

Each hooked site calls the steering operator (``torch.ops.steerkit.steer_resid_slots_`` /
``steer_slots_``, :mod:`steerkit.kernels.slots`), traced into the graph once; before each step the
plugin writes the step's configurations and per-token slot indices into persistent buffers. The
mixed batch of tests/integration/test_vllm.py must give, row by row, exactly steerkit's own HF greedy tokens,
and the compilation counters must not move while steered steps, requests and artifacts change.
The engine runs with ``STEERKIT_VLLM_RECORD=1``, so its graph also holds the record operator:
steered and unsteered requests record rows equal to steerkit's HF recording. Requests naming a
ConditionalSteering (steered from the host path) give steerkit's HF tokens too, and so do requests naming
transcoder supernodes (two-site latent clamps, steered from the host path: the graph holds the read operator of
each block's MLP input).

vLLM's first compiled start here compiles for several minutes and caches the result under
``~/.cache/vllm``; this module starts one engine.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from steerkit.serving.capture import record_args
from tests.integration.test_vllm import (MIXED_ENGINE, PROMPTS, VLLM_PY, assert_mixed_batch, assert_rows,  # noqa: F401
                             build_setup, cast_batch, mixed_batch, req, run_offline, supernode_rows)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

STEPS = 50
REC_HOOKS = ["blocks.5.hook_resid_post", "blocks.14.hook_mlp_out", "blocks.20.hook_attn_out"]
#: the counters that move when vLLM or Dynamo compiles anything
COMPILE_COUNTERS = ("num_graphs_seen", "num_backend_compilations", "num_inductor_compiles", "num_eager_compiles",
                    "num_aot_compiles", "num_aot_artifacts_loaded", "num_compiled_artifacts_loaded",
                    "num_cache_entries_updated", "dynamo_unique_graphs", "dynamo_frames_ok")


@pytest.fixture(scope="module")
def setup(default_model, scratch):
    return build_setup(default_model, scratch)


@pytest.fixture(scope="module")
def compiled_run(setup):
    """One compiled engine: the mixed batch, then two batches of 50 steered steps (four requests
    with one artifact each, then eight with other artifacts, scales and inline ops)."""
    a = setup["args"]
    p = PROMPTS
    batch, want = mixed_batch(setup)
    vec = [0.05] * setup["sm"].d_model
    first = [req(setup, p[i], a("happy@1", scale=s), STEPS) for i, s in enumerate((0.5, 1.0, 1.5, 2.0))]
    second = [req(setup, p[0], a("calm@1"), STEPS), req(setup, p[1], a("sched@1"), STEPS),
              req(setup, p[2], a("region@1"), STEPS), req(setup, p[3], a("happy@1", "calm@1"), STEPS),
              req(setup, p[4], a(ops=[setup["clamp_op"]]), STEPS),
              req(setup, p[0], a(ops=[{"op": "add", "layers": [3, 20], "vector": vec, "scale": 8.0}]), STEPS),
              req(setup, p[1], None, STEPS),
              req(setup, p[2], a(ops=[{"op": "add", "layers": [7], "vector": vec, "scale": 5.0,
                                       "positions": "generated"}]), STEPS)]
    for r in first + second:
        r["ignore_eos"] = True
    record = [req(setup, p[0], {**a("happy@1"), **record_args(REC_HOOKS, "prompt", run="rc", request="0")}, 4),
              req(setup, p[1], None, 4),
              req(setup, p[2], record_args(REC_HOOKS, "last", run="rc", request="2"), 4)]
    cast_prompts, cast, cast_want = cast_batch(setup)  # conditional steering: each request alone, in one chunk
    nodes = supernode_rows(setup) + [(p[2], None, 1.0)]  # transcoder supernodes and an unsteered row
    node_batch = [req(setup, q, a(ref, scale=s) if ref else None) for q, ref, s in nodes]
    node_want = [setup["hf"](q, ref, s) if ref else setup["hf"](q) for q, ref, s in nodes]
    folder = setup["root"] / "record-compiled"
    folder.mkdir(exist_ok=True)
    res = run_offline(setup, [batch, first, second, record] + [[r] for r in cast] + [node_batch],
                      engine={**MIXED_ENGINE, "enforce_eager": False},
                      name="compiled", full=True, timeout=2000,  # a first start compiles for minutes
                      env={"STEERKIT_VLLM_RECORD": "1", "STEERKIT_RECORD_DIR": str(folder)})
    return {"res": res, "want": want, "first": first, "second": second, "record_dir": folder,
            "cast": (cast_prompts, cast_want), "nodes": (nodes, node_want)}


def test_compiled_mixed_batch_matches_hf_row_by_row(setup, compiled_run):
    """The same mixed batch as the eager test, in a compiled engine: every row equals HF alone."""
    assert_mixed_batch(setup, compiled_run["res"]["batches"][0], compiled_run["want"])


def test_compiled_steering_does_not_recompile(setup, compiled_run):
    """Compilation counters after the mixed batch = after 50 steered steps with one artifact =
    after 50 more with eight other steerings: the graph is compiled once."""
    counts = compiled_run["res"]["compile_counts"]
    # it really is compiled: traced by Dynamo and compiled, or loaded from vLLM's compile cache
    assert counts[0]["dynamo_unique_graphs"] + counts[0]["num_aot_compiles"] + counts[0]["num_aot_artifacts_loaded"] \
        + counts[0]["num_backend_compilations"] >= 1, counts[0]
    for k in COMPILE_COUNTERS:
        assert counts[0][k] == counts[1][k] == counts[2][k], (k, counts)
    for b in (1, 2):
        for o in compiled_run["res"]["batches"][b]:
            assert len(o["token_ids"]) == STEPS, o  # 50 steps each
    for k in COMPILE_COUNTERS:  # nor do recording and conditional steering (steered from the host path)
        assert counts[-1][k] == counts[0][k], (k, counts)


def test_compiled_conditional_steering_matches_hf(setup, compiled_run):
    """Requests naming a ConditionalSteering (tests/integration/test_vllm.py:cast_batch), each alone (one prefill
    chunk), in the compiled engine: every row equals steerkit's own ``sm.steer(cs)`` tokens."""
    prompts, want = compiled_run["cast"]
    out = [b[0] for b in compiled_run["res"]["batches"][4:4 + len(want)]]
    assert_rows(setup, out, want, prompts + prompts[:1] + prompts[3:4])


def test_compiled_transcoder_supernodes_match_hf(setup, compiled_run):
    """Requests naming transcoder supernodes (tests/integration/test_vllm.py:supernode_rows: clamped, at scale 0.5,
    at generated positions only, ablated, on a long prompt) with an unsteered one, in the compiled engine (the last
    batch; the counters of :func:`test_compiled_steering_does_not_recompile` include it): every row equals
    steerkit's own ``sm.steer(clamp, scale)`` tokens."""
    rows, want = compiled_run["nodes"]
    assert_rows(setup, compiled_run["res"]["batches"][-1], want, [f"{ref} x{s}" for _, ref, s in rows])


def test_compiled_long_steered_rows_match_hf(setup, compiled_run):
    """The 50-step rows with one artifact at four scales against HF alone (HF stops at EOS; vLLM was
    told to ignore it, so HF's tokens are a prefix of vLLM's)."""
    from steerkit.vectors import Store
    sm = setup["sm"]
    art = Store(setup["store"]).load("happy@1")
    got = [o["token_ids"] for o in compiled_run["res"]["batches"][1]]
    wants = []
    for i, s in enumerate((0.5, 1.0, 1.5, 2.0)):
        with sm.steer(art, scale=s):
            want = [int(x) for x in sm.generate([PROMPTS[i]], STEPS, return_tokens=True, chat=True)[0]]
        assert got[i][:len(want)] == want, (i, s)
        wants.append(want)
    assert len({tuple(w) for w in wants}) > 1  # the scale matters


def test_compiled_engine_records_rows_equal_to_hf(setup, compiled_run):
    """Recording in the compiled engine: a steered request's prompt rows and an unsteered request's
    last prompt token equal steerkit's own HF recording (float32, 1e-4 relative); the unrecorded
    request in between records nothing."""
    from steerkit.storage.files import Folder
    from steerkit.serving.capture import _read_run
    from steerkit.vectors import Store
    sm = setup["sm"]
    rows = _read_run(Folder(compiled_run["record_dir"]), "rc")
    assert sorted(rows) == ["0", "2"]
    art = Store(setup["store"]).load("happy@1")
    for req_id, prompt, positions, steer in (("0", PROMPTS[0], "prompt", True), ("2", PROMPTS[2], "last", False)):
        toks = sm.pad([setup["ids"][prompt]])
        with (sm.steer(art) if steer else contextlib.nullcontext()), sm.record(REC_HOOKS, positions=positions) as c:
            sm.forward(toks)
        for h in REC_HOOKS:
            got = rows[req_id][h]
            want = c[h][0] if positions == "prompt" else c[h]
            vals = torch.stack([got[p] for p in sorted(got)])
            assert vals.shape == want.shape, (req_id, h, vals.shape, want.shape)
            rel = float((vals - want).norm() / want.norm())
            assert rel < 1e-4, (req_id, h, rel)
