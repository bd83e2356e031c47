"""The steering operator and its persistent buffers (steerkit.kernels.slots, steerkit.serving.plan.StepSlots).

What an engine's compiled graph calls at every steered site must equal what the eager programs do
(``StepPlan.apply``, the path the local backends share), for mixed steps of several requests; its
dense (CUDA-graph) path must equal its host path; a graph compiled once with the operator must
follow refilled buffers without recompiling.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from steerkit.kernels import Polyhedron, SteerConfig, SteerTable, fused_steer_ref, orthonormalize
from steerkit.kernels.slots import (FIELDS, SlotShape, SteerSlots, _dense, set_host_fallback, slot_info,
                                    steer_resid_slots_, steer_slots_)
from steerkit.serving.plan import Block, SteeringCache, StepSlots, plan_step, slot_capacity
from steerkit.serving.spec import parse_spec, resolve
from tests.test_serving import _facts, _Store
from tests.tiny_models import tiny_model

D = 64


@pytest.fixture(scope="module")
def tiny():
    import steerkit
    m, tok = tiny_model("llama")
    return steerkit.wrap(m, tok)


def _configs(g):
    u = orthonormalize(torch.randn(3, D, generator=g))
    region = Polyhedron(mean=torch.randn(D, generator=g) * 0.1, projection=orthonormalize(torch.randn(2, D, generator=g)),
                    normals=torch.eye(2), offsets=torch.tensor([0.5, 0.5]))
    return [SteerConfig.injection(torch.randn(D, generator=g), 2.0),
            SteerConfig.ablation(u[:2]),
            SteerConfig.clamp(u[2], 1.5).with_gate(torch.randn(D, generator=g), 0.1),
            SteerConfig(region=region, region_strength=0.7),
            SteerConfig(basis=u[:1], add=torch.randn(D, generator=g), add_scale=0.5)]


def test_slots_host_path_equals_the_table_it_was_loaded_from():
    """Each configuration loaded at an offset, rows indexed at random (-1: untouched): the operator
    gives fused_steer_ref of the original table, row by row; untouched rows keep their bits."""
    g = torch.Generator().manual_seed(0)
    table = SteerTable.from_configs(_configs(g), d_model=D)
    slots = SteerSlots(16, D, basis=4, region=4, halfspaces=4)
    stages = slots.load(table, offset=5)
    assert stages == (True, True, True, True)
    x = torch.randn(12, D, generator=g) * 3
    rc = torch.tensor([0, 1, 2, 3, 4, -1, 4, 3, 2, 1, 0, -1])
    cfg = torch.full((32,), -1, dtype=torch.long)
    cfg[:12] = torch.where(rc >= 0, rc + 5, rc)
    out = x.clone()
    steer_slots_(out, cfg, slot_info(stages, offset=5, n=table.n_configs), torch.tensor(False), slots)
    act = rc >= 0
    want = fused_steer_ref(x[act], table, rc[act], None)
    torch.testing.assert_close(out[act], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[~act], x[~act])
    # the pair form: (hidden, residual) -> (0, steered(hidden + residual)) on steered rows only
    h, r = x.clone(), torch.randn(12, D, generator=g)
    h0, r0 = h.clone(), r.clone()
    steer_resid_slots_(h, r, cfg, slot_info(stages, offset=5, n=table.n_configs), torch.tensor(False), slots)
    torch.testing.assert_close(r[act], fused_steer_ref((h0 + r0)[act], table, rc[act], None), atol=1e-5, rtol=1e-5)
    assert torch.equal(h[act], torch.zeros_like(h[act])) and torch.equal(h[~act], h0[~act])
    assert torch.equal(r[~act], r0[~act])


def test_dense_path_equals_the_host_path_without_regions():
    """The CUDA-graph path (no host branch: every row through the whole slots table) equals the host
    path, norm preservation included; run here on CPU tensors."""
    g = torch.Generator().manual_seed(1)
    table = SteerTable.from_configs([c for c in _configs(g) if c.region is None], d_model=D)
    slots = SteerSlots(8, D, basis=4)
    stages = slots.load(table, offset=2)
    x = torch.randn(10, D, generator=g) * 3
    cfg = torch.tensor([2, 3, -1, 4, 5, 2, -1, 3, 4, 5])
    for pn in (False, True):
        host = x.clone()
        steer_slots_(host, cfg, slot_info(stages, pn, offset=2, n=table.n_configs), torch.tensor(pn), slots)
        active, new = _dense(x, cfg, torch.tensor(pn), slots.tensors)
        dense = torch.where(active[:, None], new, x)
        torch.testing.assert_close(dense, host, atol=1e-5, rtol=1e-5)
    assert len(slots.tensors) == len(FIELDS)


def test_slot_shape_refuses_what_does_not_fit_and_capacity_parses():
    g = torch.Generator().manual_seed(2)
    shape = SlotShape(D, configs=2, basis=1, region=1, halfspaces=1)
    big = SteerTable.from_configs(_configs(g), d_model=D)
    assert "configurations" in shape.fits(big)
    assert "a basis of 2 directions" in SlotShape(D, basis=1).fits(SteerTable.from_configs([_configs(g)[1]]))
    assert "d_model" in SlotShape(D + 1).fits(big)
    slots = SteerSlots(4, D)
    with pytest.raises(Exception, match="raise the capacity"):
        slots.load(SteerTable.from_configs([SteerConfig.injection(torch.ones(D))] * 3), offset=2)
    assert slot_capacity(None) == {"configs": 512, "basis": 8, "region": 8, "halfspaces": 16}


def _mixed_plan(tiny):
    """Three requests in one flattened step: A (add 3x everywhere, clamp on its last prompt token,
    ablation at block 0), an unsteered one, B (add on generated tokens, clamp on prompt indices -2
    and 5)."""
    d = tiny.d_model
    g = torch.Generator().manual_seed(0)
    va, vb, u = torch.randn(d, generator=g), torch.randn(d, generator=g), torch.randn(d, generator=g)
    u = u / u.norm()
    facts = _facts(tiny)
    ra = resolve(parse_spec({"ops": [{"op": "add", "layers": [1], "vector": va.tolist(), "scale": 3.0},
                                     {"op": "clamp", "layers": [1], "vector": u.tolist(), "value": 2.0,
                                      "positions": "last"},
                                     {"op": "ablate", "layers": [0], "vectors": [u.tolist()]}]}),
                 store=_Store({}), facts=facts)
    rb = resolve(parse_spec({"ops": [{"op": "add", "layers": [1], "vector": vb.tolist(), "positions": "generated"},
                                     {"op": "clamp", "layers": [1], "vector": u.tolist(), "value": -1.0,
                                      "positions": [-2, 5]}]}), store=_Store({}), facts=facts)
    blocks = [Block(0, 4, np.arange(4), 4, ra), Block(4, 6, np.arange(2), 2, None),
              Block(6, 9, np.array([4, 5, 6]), 6, rb)]
    return plan_step(blocks, SteeringCache(tiny.facts, None))


def _sites(tiny):
    return [f"blocks.{l}.hook_resid_post" for l in range(tiny.n_layers)]


def test_step_slots_equal_the_eager_programs_on_a_mixed_step(tiny):
    """StepSlots.fill of a mixed step, then the operator at each site = StepPlan.apply (the eager
    programs); a second fill of the same steering reuses the loaded tables; clear() untouches all."""
    plan = _mixed_plan(tiny)
    slots = StepSlots(_sites(tiny), d_model=tiny.d_model, max_tokens=16, configs=32, basis=4)
    assert slots.fill(plan)
    g = torch.Generator().manual_seed(3)
    for site in plan.sites:
        i = slots.index[site]
        h = torch.randn(9, tiny.d_model, generator=g) * 2
        want = plan.apply(site, h)
        got = h.clone()
        steer_slots_(got, slots.cfg[i], slots.info[i], slots.preserve[i], slots.slots)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert not torch.equal(got, h)
    loaded = slots._loaded
    assert slots.fill(plan) and slots._loaded is loaded
    slots.clear()
    assert int((slots.cfg >= 0).sum()) == 0 and int(slots.info[:, 6].abs().sum()) == 0


def test_a_step_too_big_for_the_slots_is_steered_by_the_host_fallback(tiny):
    """Slots with room for one configuration: fill() says no, fallback() hands the sites to the
    engine's fallback, which steers them from the plan (nothing is lost)."""
    plan = _mixed_plan(tiny)
    slots = StepSlots(_sites(tiny), d_model=tiny.d_model, max_tokens=16, configs=1, basis=4)
    assert not slots.fill(plan)
    slots.fallback(plan)

    def fallback(i, x, residual):
        site = slots.sites[i]
        rows = plan.rows(site)
        new = plan.steered(site, x[rows])
        if new is not None:
            x[rows] = new
    set_host_fallback(fallback)
    try:
        site = "blocks.1.hook_resid_post"
        i = slots.index[site]
        h = torch.randn(9, tiny.d_model)
        got = h.clone()
        steer_slots_(got, slots.cfg[i], slots.info[i], slots.preserve[i], slots.slots)
        assert torch.equal(got, plan.apply(site, h))
    finally:
        set_host_fallback(None)


def test_a_compiled_graph_follows_refilled_buffers_without_recompiling(tiny):
    """torch.compile over a module whose hook calls the operator: one graph for every step, any
    number of tokens, and outputs that follow what fill() wrote (steered, other steering, none)."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    d = tiny.d_model
    plan = _mixed_plan(tiny)
    site = "blocks.1.hook_resid_post"
    slots = StepSlots(_sites(tiny), d_model=d, max_tokens=16, configs=32, basis=4)
    i = slots.index[site]

    class Block2(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(d, d)

        def forward(self, x):
            return self.lin(x)
    torch.manual_seed(0)
    m = torch.nn.Sequential(Block2(), Block2()).requires_grad_(False)
    m[0].register_forward_hook(lambda _m, _a, out: steer_slots_(out, slots.cfg[i], slots.info[i],
                                                                  slots.preserve[i], slots.slots))
    cm = torch.compile(m, dynamic=True, fullgraph=True)
    x = torch.randn(9, d)
    with torch.no_grad():
        slots.fill(None)
        assert torch.allclose(cm(x), m[1](m[0].lin(x)), atol=1e-5)  # nothing steered
        slots.fill(plan)
        want = m[1](plan.apply(site, m[0].lin(x)))
        torch.testing.assert_close(cm(x), want, atol=1e-5, rtol=1e-5)
        slots.fill(None)
        assert torch.allclose(cm(x[:5]), m[1](m[0].lin(x[:5])), atol=1e-5)
        slots.fill(plan)
        torch.testing.assert_close(cm(x), want, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1


def test_a_steady_batch_reuses_its_slot_indices_and_a_reordered_one_does_not(tiny):
    """Two requests steered at every position: the second fill of the same step reuses the indices
    (same rows, same steering), a step with the requests' rows swapped recomputes them; each equals
    the eager programs."""
    d = tiny.d_model
    g = torch.Generator().manual_seed(5)
    facts = _facts(tiny)
    ra = resolve(parse_spec({"ops": [{"op": "add", "layers": [1], "vector": torch.randn(d, generator=g).tolist()}]}),
                 store=_Store({}), facts=facts)
    rb = resolve(parse_spec({"ops": [{"op": "add", "layers": [1], "vector": torch.randn(d, generator=g).tolist(),
                                      "scale": -2.0}]}), store=_Store({}), facts=facts)
    cache = SteeringCache(tiny.facts, None)
    site = "blocks.1.hook_resid_post"
    slots = StepSlots(_sites(tiny), d_model=d, max_tokens=16, configs=8)
    i = slots.index[site]
    h = torch.randn(3, d, generator=g)
    steps = [[(0, 1, 5, 4, ra), (1, 2, 7, 6, None), (2, 3, 3, 2, rb)],   # a decode step
             [(0, 1, 6, 4, ra), (1, 2, 8, 6, None), (2, 3, 4, 2, rb)],   # the next one: same rows
             [(0, 1, 4, 2, rb), (1, 2, 8, 6, None), (2, 3, 7, 4, ra)]]   # the requests' rows swapped
    for step in steps:
        blocks = [Block(a, b, np.array([pos]), n, r) for a, b, pos, n, r in step]
        plan = plan_step(blocks, cache)
        assert slots.fill(plan)
        got = h.clone()
        steer_slots_(got, slots.cfg[i], slots.info[i], slots.preserve[i], slots.slots)
        torch.testing.assert_close(got, plan.apply(site, h), atol=1e-6, rtol=1e-6)
        slots.clear()
    assert site in slots._idx  # the steady steps took the cached indices
