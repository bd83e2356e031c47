"""The prepared one-configuration plan and ``bind_steer`` (the per-step hook path on CPU).

The plan (``reference.OneConfigPlan``) must mean exactly what the general reference means; the
general reference is forced by passing an explicit row -> configuration index and an all-true
``active`` mask, which the plan never takes. Tolerances come from the shared table (``TOLS``): the
plan uses ``addmm`` (one fused multiply-add) where the general formula subtracts a product, so the
two differ by float32 rounding and then by one rounding to the output dtype, the same argument as
kernel vs reference; float64 inputs are compared at 1e-12.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _kernel_helpers import TOLS, assert_close_report, rand_orthonormal

import steerkit.kernels as K
import steerkit.kernels.fused as F
from steerkit.kernels import SteerConfig, SteerTable, bind_steer, fused_steer
from steerkit.kernels.reference import fused_steer_ref, table_plan

TOL = {**TOLS, torch.float64: (1e-12, 1e-12)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _configs(d: int, gen: torch.Generator) -> dict:
    B1 = rand_orthonormal(1, d, gen)
    B4 = rand_orthonormal(min(4, d), d, gen)
    v = torch.randn(d, generator=gen)
    return {
        "ablate1": SteerConfig.ablation(B1),
        "ablate4": SteerConfig.ablation(B4),
        "clamp": SteerConfig.clamp(B1[0], 1.5),
        "partial": SteerConfig(basis=B4, strength=0.5, target=torch.linspace(-1, 1, B4.shape[0])),
        "inject": SteerConfig.injection(v, 2.5),
        "ablate+inject": SteerConfig(basis=B1, add=v, add_scale=-0.7),
        "identity": SteerConfig.identity(),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("shape", [(1, 576), (3, 1, 576), (7, 13), (2, 5, 33), (0, 8), (24,)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("preserve_norm", [False, True], ids=["", "norm"])
def test_plan_matches_general_reference(shape, dtype, preserve_norm):
    d = shape[-1]
    gen = torch.Generator().manual_seed(d)
    h = (torch.randn(shape, generator=gen) * 3).to(dtype)
    rows = h.reshape(-1, d).shape[0]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    for name, cfg in _configs(d, gen).items():
        tab = SteerTable.from_configs([cfg], d_model=d)
        if dtype == torch.float64:
            tab = dataclasses.replace(tab, **{f.name: getattr(tab, f.name).double()
                                              for f in dataclasses.fields(tab) if torch.is_tensor(getattr(tab, f.name))})
        plan = table_plan(tab, acc, h.device, 0.8, preserve_norm)
        assert plan is not None, name
        got = plan(h)
        want = fused_steer_ref(h.reshape(-1, d), tab, torch.zeros(rows, dtype=torch.long),
                               torch.ones(rows, dtype=torch.bool), 0.8, preserve_norm).reshape(h.shape)
        assert got.shape == h.shape and got.dtype == h.dtype, name
        assert_close_report(got, want, *TOL[dtype], f"plan {name} {dtype} {shape}")
        assert got.data_ptr() != h.data_ptr() or h.numel() == 0, f"{name}: the plan must return a new tensor"


def test_zero_injection_is_bit_identical_and_input_untouched():
    h = torch.randn(3, 1, 576)
    keep = h.clone()
    tab = SteerTable.from_configs([SteerConfig.injection(torch.zeros(576), 4.0)], d_model=576)
    out = bind_steer(tab)(h)
    assert torch.equal(out, keep) and torch.equal(h, keep)


def test_bind_steer_equals_fused_steer_with_and_without_mask():
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(4, 3, 40, generator=gen)
    tab = SteerTable.from_configs([SteerConfig(basis=rand_orthonormal(2, 40, gen),
                                               add=torch.randn(40, generator=gen))], d_model=40)
    run = bind_steer(tab, preserve_norm=True)
    mask = torch.rand(4, 3, generator=gen) > 0.5
    for m in (None, mask):
        want = fused_steer(h, tab, mask=m, preserve_norm=True)
        assert_close_report(run(h, m), want, *TOLS[torch.float32], f"bind_steer mask={m is not None}")
    out = run(h, mask)
    assert torch.equal(out[~mask], h[~mask])  # unmasked rows bit-for-bit


def test_bind_steer_redecides_when_the_impl_override_changes(monkeypatch):
    """The cached CPU choice must not outlive a ``use_impl`` override (tests force Triton that way)."""
    launches = []
    real = F._launch_fused

    def counting(*a, **k):
        launches.append(1)
        return real(*a, **k)
    monkeypatch.setattr(F, "_launch_fused", counting)
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(2, 1, 64, generator=gen)
    tab = SteerTable.from_configs([SteerConfig.ablation(rand_orthonormal(1, 64, gen))], d_model=64)
    run = bind_steer(tab)
    ref = run(h)  # torch path, now cached
    assert launches == []
    with K.use_impl("triton"):  # TRITON_INTERPRET=1 in these tests: the kernel runs on CPU
        tri = run(h)
    assert launches == [1]
    assert_close_report(tri, ref, *TOLS[torch.float32], "triton vs cached plan")
    run(h)
    assert launches == [1]  # back to the cached torch plan


def test_no_plan_for_trainable_tables_and_gradients_flow():
    v = torch.randn(16, requires_grad=True)
    tab = SteerTable.from_configs([SteerConfig.injection(torch.zeros(16))], d_model=16)
    tab.add = v[None]  # a vector being optimised: its graph must be rebuilt at every call
    assert table_plan(tab, torch.float32, torch.device("cpu")) is None
    for _ in range(2):  # twice: a plan built once would fail the second backward
        out = fused_steer(torch.randn(3, 16), tab)
        out.sum().backward()
    assert torch.allclose(v.grad, torch.full((16,), 6.0))


def test_plan_is_rebuilt_when_the_table_changes():
    tab = SteerTable.from_configs([SteerConfig.injection(torch.ones(8), 1.0)], d_model=8)
    h = torch.zeros(1, 8)
    assert torch.equal(fused_steer(h, tab, validate=False), torch.ones(1, 8))
    tab.add = torch.full((1, 8), 2.0)
    assert torch.equal(fused_steer(h, tab, validate=False), torch.full((1, 8), 2.0))
