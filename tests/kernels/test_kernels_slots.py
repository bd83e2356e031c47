"""The steering slots (steerkit.kernels.slots): one table of fixed capacity, refilled in place, and
``steer_slots_``, which steers a site's rows in place by it.

The Triton implementation (what a CUDA engine runs; here through Triton's interpreter) equals the torch reference
on every operation (add, ablate, clamp, gate, region, per-row norm preservation, per-row configurations), for a
site's output and for a decoder layer's (hidden, residual) pair; rows with -1 and every row under a zero flag
are left bit for bit; the accelerator form of the reference (every row, no host read) equals its host form.
"""
from __future__ import annotations

import pytest
import torch

from steerkit.kernels import Polyhedron, SteerConfig, SteerTable, fused_steer_ref, orthonormalize
from steerkit.kernels.slots import FIELDS, GRAPH_STAGES, SlotShape, SteerSlots, _steer_dense_, steer_slots_

D = 64
ON, OFF = torch.tensor(1, dtype=torch.int32), torch.tensor(0, dtype=torch.int32)


def _configs(g):
    u = orthonormalize(torch.randn(3, D, generator=g))
    region = Polyhedron(mean=torch.randn(D, generator=g) * 0.1, projection=orthonormalize(torch.randn(2, D, generator=g)),
                        normals=torch.eye(2), offsets=torch.tensor([0.5, 0.5]))
    return {"add": SteerConfig.injection(torch.randn(D, generator=g), 2.0),
            "ablate": SteerConfig.ablation(u[:2], 0.8),
            "clamp": SteerConfig.clamp(u[2], 1.5),
            "gate": SteerConfig.injection(torch.randn(D, generator=g), 3.0).with_gate(u[0], 0.05),
            "region": SteerConfig(region=region, region_strength=0.7),
            "mixed": SteerConfig(basis=u[:1], add=torch.randn(D, generator=g), add_scale=0.5)}


@pytest.fixture(scope="module")
def loaded():
    """Slots with two steerings loaded at offsets (one keeping norms), rows indexed at random (-1: untouched)."""
    g = torch.Generator().manual_seed(0)
    c = _configs(g)
    slots = SteerSlots(16, D, basis=4, region=4, halfspaces=4)
    first = SteerTable.from_configs([c["add"], c["ablate"], c["clamp"], c["gate"], c["mixed"]], d_model=D)
    second = SteerTable.from_configs([c["add"], c["ablate"], c["region"]], d_model=D)
    st1 = slots.load(first, offset=2)
    st2 = slots.load(second, offset=9, preserve_norm=True)
    rows = torch.tensor([2, 3, 4, 5, 6, -1, 9, 10, 11, -1, 4, 6, 10, 2])  # slot rows: first 2..6, second 9..11
    cfg = torch.full((32,), -1, dtype=torch.long)
    cfg[:rows.numel()] = rows
    return slots, first, second, cfg, tuple(a or b for a, b in zip(st1, st2))


def _want(x, loaded):
    """Row by row: the table each row's slot came from, through the reference (norm kept for the second)."""
    slots, first, second, cfg, _ = loaded
    out = x.clone()
    for i in range(x.shape[0]):
        j = int(cfg[i])
        if j < 0:
            continue
        table, k, pn = (first, j - 2, False) if j < 9 else (second, j - 9, True)
        out[i] = fused_steer_ref(x[i:i + 1], table, torch.tensor([k]), None, preserve_norm=pn)[0]
    return out


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_every_operation_equals_the_reference_row_by_row(loaded, impl):
    slots, _, _, cfg, stages = loaded
    g = torch.Generator().manual_seed(1)
    x = torch.randn(14, D, generator=g) * 3
    got = x.clone()
    steer_slots_(got, None, cfg, ON, slots, stages=stages, impl=impl)
    want = _want(x, loaded)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    untouched = cfg[:14] < 0
    assert torch.equal(got[untouched], x[untouched])
    assert not torch.equal(got[~untouched], x[~untouched])


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_the_output_pair_is_edited_in_place(loaded, impl):
    """(hidden, residual) -> (0, steered(hidden + residual)) on steered rows; other rows keep their bits."""
    slots, _, _, cfg, stages = loaded
    g = torch.Generator().manual_seed(2)
    h, r = torch.randn(14, D, generator=g), torch.randn(14, D, generator=g)
    h0, r0 = h.clone(), r.clone()
    steer_slots_(h, r, cfg, ON, slots, stages=stages, impl=impl)
    act = cfg[:14] >= 0
    torch.testing.assert_close(r[act], _want(h0 + r0, loaded)[act], atol=2e-5, rtol=2e-5)
    assert torch.equal(h[act], torch.zeros_like(h[act]))
    assert torch.equal(h[~act], h0[~act]) and torch.equal(r[~act], r0[~act])


def test_a_zero_flag_leaves_every_row_and_the_graph_stages_skip_only_the_region(loaded):
    slots, _, _, cfg, stages = loaded
    x = torch.randn(14, D)
    for impl in ("torch", "triton"):
        got = x.clone()
        steer_slots_(got, None, cfg, OFF, slots, stages=stages, impl=impl)
        assert torch.equal(got, x)
    assert GRAPH_STAGES == (True, True, True, False)
    no_region = torch.tensor([-1] * 14 + [-1] * 18)
    no_region[:5] = cfg[:5]  # rows of the first table: no region there
    a, b = x.clone(), x.clone()
    steer_slots_(a, None, no_region, ON, slots, impl="triton")  # the stages a captured graph runs
    steer_slots_(b, None, no_region, ON, slots, stages=stages, impl="torch")
    torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


def test_the_accelerator_form_equals_the_host_form(loaded):
    """Every row through the reference, the untouched ones selected back, no host read: what an accelerator
    without Triton runs (and what could be captured in a graph there)."""
    slots, _, _, cfg, stages = loaded
    x, r = torch.randn(14, D) * 2, torch.randn(14, D)
    for residual in (None, r):
        host_x, dense_x = x.clone(), x.clone()
        host_r = dense_r = None
        if residual is not None:
            host_r, dense_r = residual.clone(), residual.clone()
        steer_slots_(host_x, host_r, cfg, ON, slots, stages=stages, impl="torch")
        _steer_dense_(dense_x, dense_r, cfg[:14], ON, slots, stages)
        torch.testing.assert_close(dense_x, host_x, atol=2e-5, rtol=2e-5)
        if residual is not None:
            torch.testing.assert_close(dense_r, host_r, atol=2e-5, rtol=2e-5)
    assert len(slots.tensors) == len(FIELDS) + 1


def test_slot_shape_refuses_what_does_not_fit():
    g = torch.Generator().manual_seed(3)
    c = _configs(g)
    shape = SlotShape(D, configs=2, basis=1, region=1, halfspaces=1)
    big = SteerTable.from_configs(list(c.values()), d_model=D)
    assert "configurations" in shape.fits(big)
    assert "a basis of 2 directions" in SlotShape(D, basis=1).fits(SteerTable.from_configs([c["ablate"]]))
    assert "d_model" in SlotShape(D + 1).fits(big)
    slots = SteerSlots(4, D)
    with pytest.raises(Exception, match="raise the capacity"):
        slots.load(SteerTable.from_configs([SteerConfig.injection(torch.ones(D))] * 3), offset=2)
    slots.load(SteerTable.from_configs([SteerConfig.injection(torch.ones(D))]), offset=1, preserve_norm=True)
    slots.clear(1, 1)
    assert float(slots.table.add.abs().sum()) == 0 and float(slots.norm.sum()) == 0
