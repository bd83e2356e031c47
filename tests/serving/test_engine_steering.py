"""One object per engine (steerkit.serving.engine): its hooks, its own steering operators, its slots and its
requests' steerings, on a model laid out as a vLLM worker's (tests/support/tiny_models.py: ``pair_engine_model``).

What a step steers through the slots (one kernel call per site) equals the same step steered on the host from
each request's own program (:class:`StepPlan`), for every kind of site; two engines in one process steer
independently; a request's steering is validated and compiled once, whatever the number of steps or of
concurrent requests; a decoding token's indices are computed once per steering; a compiled graph follows the
refilled buffers without recompiling.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from steerkit.interventions import SiteProgram
from steerkit.serving import engine as E
from steerkit.serving import spec as S
from steerkit.serving.engine import EngineSteering, FrontEnd
from steerkit.serving.plan import slot_capacity
from tiny_models import pair_engine_model, tiny_model

D, L, VOCAB = 64, 3, 97


class _Store:
    def load(self, ref):
        raise KeyError(f"no {ref}")


def _vec(seed: int, scale: float = 1.0) -> list:
    return (torch.randn(D, generator=torch.Generator().manual_seed(seed)) * scale).tolist()


def _unit(seed: int) -> list:
    v = torch.randn(D, generator=torch.Generator().manual_seed(seed))
    return (v / v.norm()).tolist()


SPEC_A = json.dumps({"ops": [{"op": "add", "layers": [1], "vector": _vec(1), "scale": 3.0},
                             {"op": "clamp", "layers": [1], "vector": _unit(2), "value": 2.0, "positions": "last"},
                             {"op": "ablate", "layers": [0], "vectors": [_unit(3)]}]})
SPEC_B = json.dumps({"ops": [{"op": "add", "layers": [2], "vector": _vec(4), "positions": "generated"},
                             {"op": "clamp", "layers": [1], "vector": _unit(2), "value": -1.0, "positions": [-2, 5]}]})
SPEC_C = json.dumps({"ops": [{"op": "add", "layers": [0, 2], "vector": _vec(5, 0.5), "scale": -2.0}]})


def _engine(seed: int = 0, **capacity):
    model, facts = pair_engine_model(D, L, VOCAB, seed=seed)
    cap = {**slot_capacity(None), "configs": 32, "basis": 4, **capacity}
    return model, EngineSteering(model, facts, max_tokens=32, capacity=cap, store=_Store())


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _run(model, engine, requests, ids):
    """One step: ``requests`` as (id, start, end, first position, prompt length, spec or None)."""
    reqs = [(r, a, b, np.arange(p, p + b - a), n, raw) for r, a, b, p, n, raw in requests if raw is not None]
    engine.begin_step(reqs, total=ids.shape[0], live={r[0] for r in requests})
    try:
        with torch.no_grad():
            return model(ids)
    finally:
        engine.end_step()


MIXED = [  # a prefill of A, an unsteered request, B with two prompt tokens and a generated one, C decoding
    [("a", 0, 4, 0, 4, SPEC_A), ("u", 4, 6, 0, 2, None), ("b", 6, 9, 4, 6, SPEC_B), ("c", 9, 10, 7, 5, SPEC_C)],
    [("a", 0, 1, 4, 4, SPEC_A), ("u", 1, 2, 2, 2, None), ("b", 2, 3, 7, 6, SPEC_B), ("c", 3, 4, 8, 5, SPEC_C)],
]


def test_the_slots_equal_the_host_plan_at_every_kind_of_site():
    model, slotted = _engine()
    ref_model, hosted = _engine(configs=1)  # room for one configuration: every step goes to the host plan
    plain, _ = pair_engine_model(D, L, VOCAB)
    for step in MIXED:
        ids = _ids(step[-1][2], seed=len(step))
        reqs = [(r, a, b, np.arange(p, p + b - a), n, raw) for r, a, b, p, n, raw in step if raw is not None]
        slotted.begin_step(reqs, total=ids.shape[0])
        hosted.begin_step(reqs, total=ids.shape[0])
        assert slotted.plan is None and hosted.plan is not None
        with torch.no_grad():
            got, want, base = model(ids), ref_model(ids), plain(ids)
        slotted.end_step()
        hosted.end_step()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for r, a, b, *_rest, raw in step:  # steered rows moved, the unsteered request's did not
            assert torch.equal(got[a:b], base[a:b]) == (raw is None), r
    assert not slotted.slots.stages.any()  # cleared after the step


def test_an_add_on_generated_tokens_moves_the_stream_by_exactly_its_vector():
    model, engine = _engine()
    plain, _ = pair_engine_model(D, L, VOCAB)
    v = torch.tensor(_vec(7))
    raw = json.dumps({"ops": [{"op": "add", "layers": [L - 1], "vector": v.tolist(), "scale": 2.0,
                               "positions": "generated"}]})
    ids = _ids(4)
    got = _run(model, engine, [("x", 0, 3, 0, 3, raw), ("y", 3, 4, 9, 5, raw)], ids)
    with torch.no_grad():
        base = plain(ids)
    assert torch.equal(got[:3], base[:3])  # the prompt
    torch.testing.assert_close(got[3], base[3] + 2.0 * v, atol=1e-5, rtol=1e-5)


def test_two_engines_in_one_process_steer_independently():
    m1, e1 = _engine(seed=0)
    m2, e2 = _engine(seed=0)
    r1, h1 = _engine(seed=0, configs=1)
    r2, h2 = _engine(seed=0, configs=1)
    plain, _ = pair_engine_model(D, L, VOCAB)
    assert set(e1._ops.names).isdisjoint(e2._ops.names)
    ids = _ids(5)
    steps = [(e1, m1, SPEC_A, h1, r1), (e2, m2, SPEC_C, h2, r2)]
    for engine, _model, raw, host, _ref in steps:  # both prepared before either runs
        engine.begin_step([("q", 0, 5, np.arange(5), 5, raw)], total=5)
        host.begin_step([("q", 0, 5, np.arange(5), 5, raw)], total=5)
    with torch.no_grad():
        out1, out2, want1, want2 = m1(ids), m2(ids), r1(ids), r2(ids)
    torch.testing.assert_close(out1, want1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out2, want2, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out1, out2)
    for engine in (e1, e2, h1, h2):
        engine.end_step()
    e1.close()
    with torch.no_grad():
        assert torch.equal(m1(ids), plain(ids))  # hooks and operators gone
    assert torch.allclose(_run(m2, e2, [("q", 0, 5, 0, 5, SPEC_C)], ids), out2, atol=1e-6)


def _counting(monkeypatch):
    counts = {"resolve": 0, "compile": 0}
    resolve, compile_ = E.resolve, S.compile_steering

    def counted_resolve(*a, **k):
        counts["resolve"] += 1
        return resolve(*a, **k)

    def counted_compile(*a, **k):
        counts["compile"] += 1
        return compile_(*a, **k)
    monkeypatch.setattr(E, "resolve", counted_resolve)
    monkeypatch.setattr(S, "compile_steering", counted_compile)
    return counts


def test_a_request_is_validated_and_compiled_once(monkeypatch):
    """The front end checks each spec once however often it is asked (its middleware and vLLM's input processor
    share it), the CUDA-graph refusal reads that same compile; a worker resolves and compiles each spec once,
    whatever the steps and the mix of concurrent requests."""
    counts = _counting(monkeypatch)
    hf, _ = tiny_model("llama", num_hidden_layers=L)
    config = SimpleNamespace(hf_config=hf.config, model="/nonexistent", served_model_name="tiny")
    front = FrontEnd(config, graphs=True, store=_Store())
    for _ in range(3):
        for raw in (SPEC_A, SPEC_B, SPEC_C):
            front.check(raw)
    assert counts == {"resolve": 3, "compile": 3}
    model, engine = _engine()
    counts.update(resolve=0, compile=0)
    combos = [[SPEC_A], [SPEC_A, SPEC_B], [SPEC_B, SPEC_C, SPEC_A], [SPEC_C], [SPEC_A, SPEC_C]]
    for k, specs in enumerate(combos * 2):
        step = [(f"r{i}", i, i + 1, 9 + k, 4, raw) for i, raw in enumerate(specs)]
        _run(model, engine, step, _ids(len(specs), seed=k))
    assert counts == {"resolve": 3, "compile": 3}


def test_a_decoding_tokens_indices_are_computed_once_per_steering(monkeypatch):
    model, engine = _engine()
    calls = {"n": 0}
    kernel_rows = SiteProgram.kernel_rows

    def counted(self, *a, **k):
        calls["n"] += 1
        return kernel_rows(self, *a, **k)
    monkeypatch.setattr(SiteProgram, "kernel_rows", counted)
    _run(model, engine, [("a", 0, 1, 6, 4, SPEC_A), ("c", 1, 2, 6, 4, SPEC_C)], _ids(2))
    first = calls["n"]
    assert first > 0
    for k in range(4):  # a steady decode batch, and the same requests in another order
        order = [("a", 0, 1, 7 + k, 4, SPEC_A), ("c", 1, 2, 7 + k, 4, SPEC_C)]
        _run(model, engine, order if k % 2 else order[::-1], _ids(2, seed=k))
    assert calls["n"] == first


def test_steerings_that_no_longer_fit_are_evicted_and_reloaded():
    """Slots with room for two steerings' tables: three requests in turn, each step's output equal to the host
    plan's, the least recently used steering making room."""
    model, engine = _engine(configs=4)
    ref, host = _engine(configs=1)
    ids = _ids(3)
    for raw in (SPEC_A, SPEC_B, SPEC_C, SPEC_A, SPEC_B):
        step = [("q", 0, 3, 3, 5, raw)]
        got, want = _run(model, engine, step, ids), _run(ref, host, step, ids)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(engine.slots._placed) <= 2


def test_a_compiled_graph_follows_the_refilled_buffers_without_recompiling():
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]  # other tests of the process may have compiled
    model, engine = _engine()
    ref, host = _engine(configs=1)
    compiled = torch.compile(model, dynamic=True, fullgraph=True)
    steps = [[("a", 0, 4, 0, 4, SPEC_A)], [("b", 0, 1, 7, 6, SPEC_B), ("c", 1, 2, 7, 5, SPEC_C)], [],
             [("c", 0, 6, 0, 6, SPEC_C)]]
    for k, step in enumerate(steps):
        ids = _ids(max([b for _, _, b, *_ in step] or [3]), seed=k)
        got = _run(compiled, engine, step, ids)
        torch.testing.assert_close(got, _run(ref, host, step, ids), atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] - before == 1


def test_slot_capacity_parses_and_says_what_is_wrong():
    assert slot_capacity(None) == {"configs": 512, "basis": 8, "region": 8, "halfspaces": 16}
    assert slot_capacity("configs=64, basis=4")["basis"] == 4
    with pytest.raises(ValueError, match="name=count pairs"):
        slot_capacity("rows=3")
