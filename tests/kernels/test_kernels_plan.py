"""The reference's prepared form of one configuration on every row and ``bind_steer`` (the per-step hook path
on CPU).

The prepared form (``reference.shared_config`` / ``shared_edit``) must mean exactly what the general reference
means; the general reference is forced by passing an explicit row -> configuration index and an all-true
``active`` mask, which the prepared form never takes. Tolerances come from the shared table (``TOLS``): it
uses ``addmm`` (one fused multiply-add) where the general formula subtracts a product, so the
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
from steerkit.kernels.reference import fused_steer_ref, shared_config, shared_edit

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
        shared = shared_config(tab, acc, h.device, 0.8)
        assert shared is not None, name
        got = shared_edit(h, shared, preserve_norm)
        want = fused_steer_ref(h.reshape(-1, d), tab, torch.zeros(rows, dtype=torch.long),
                               torch.ones(rows, dtype=torch.bool), 0.8, preserve_norm).reshape(h.shape)
        assert got.shape == h.shape and got.dtype == h.dtype, name
        assert_close_report(got, want, *TOL[dtype], f"plan {name} {dtype} {shape}")
        assert got.data_ptr() != h.data_ptr() or h.numel() == 0, f"{name}: the plan must return a new tensor"


def test_zero_injection_is_bit_identical_and_input_untouched():
    h = torch.randn(3, 1, 576)
    keep = h.clone()
    tab = SteerTable.from_configs([SteerConfig.injection(torch.zeros(576), 4.0)], d_model=576)
    out = bind_steer(tab, device="cpu", dtype=torch.float32)(h)
    assert torch.equal(out, keep) and torch.equal(h, keep)


def test_bind_steer_equals_fused_steer_with_and_without_mask():
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(4, 3, 40, generator=gen)
    tab = SteerTable.from_configs([SteerConfig(basis=rand_orthonormal(2, 40, gen),
                                               add=torch.randn(40, generator=gen))], d_model=40)
    run = bind_steer(tab, device="cpu", dtype=torch.float32, preserve_norm=True)
    mask = torch.rand(4, 3, generator=gen) > 0.5
    for m in (None, mask):
        want = fused_steer(h, tab, mask=m, preserve_norm=True)
        assert_close_report(run(h, m), want, *TOLS[torch.float32], f"bind_steer mask={m is not None}")
    out = run(h, mask)
    assert torch.equal(out[~mask], h[~mask])  # unmasked rows bit-for-bit


def _count_launches(monkeypatch) -> list:
    launches = []
    real = F._launch_fused

    def counting(*a, **k):
        launches.append(1)
        return real(*a, **k)
    monkeypatch.setattr(F, "_launch_fused", counting)
    return launches


def test_bind_steer_chooses_the_impl_when_it_binds(monkeypatch):
    """The override in force at bind time is the one the bound call keeps (TRITON_INTERPRET=1 in
    these tests: the Triton kernel runs on CPU)."""
    launches = _count_launches(monkeypatch)
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(2, 1, 64, generator=gen)
    tab = SteerTable.from_configs([SteerConfig.ablation(rand_orthonormal(1, 64, gen))], d_model=64)
    with K.use_impl("triton"):
        tri_run = bind_steer(tab, device="cpu", dtype=torch.float32)
    torch_run = bind_steer(tab, device="cpu", dtype=torch.float32)
    assert tri_run.impl == "triton" and torch_run.impl == "torch"
    assert "impl='triton'" in repr(tri_run) and "n_configs=1" in repr(tri_run)
    assert "impl='torch'" in repr(torch_run) and torch_run.shared is not None and tri_run.shared is None

    tri = tri_run(h)  # bound under use_impl("triton"), called after leaving it
    assert launches == [1]
    with K.use_impl("triton"):  # bound outside: the torch plan, whatever the override now
        ref = torch_run(h)
        assert launches == [1]
        torch_run(h, torch.ones(2, 1, dtype=torch.bool))  # the masked call keeps torch too
        assert launches == [1]
    with K.use_impl("torch"):
        tri_run(h, torch.ones(2, 1, dtype=torch.bool))
    assert launches == [1, 1]
    assert_close_report(tri, ref, *TOLS[torch.float32], "triton (bound) vs torch plan (bound)")
    assert_close_report(ref, fused_steer(h, tab, impl="torch"), *TOLS[torch.float32], "plan vs fused_steer")


def test_bind_steer_explicit_impl_and_errors():
    tab = SteerTable.from_configs([SteerConfig.injection(torch.ones(8))], d_model=8)
    assert bind_steer(tab, device="cpu", dtype=torch.float32, impl="torch").impl == "torch"
    with K.use_impl("triton"):
        assert bind_steer(tab, device="cpu", dtype=torch.float32, impl="torch").impl == "torch"
    with pytest.raises(ValueError, match="impl must be one of"):
        bind_steer(tab, device="cpu", dtype=torch.float32, impl="cuda")
    with pytest.raises(ValueError, match=r"supports float32.*found float64"):
        bind_steer(tab, device="cpu", dtype=torch.float64, impl="triton")
    with pytest.raises(ValueError, match=r"dtype must be float32.*found torch.int64"):
        bind_steer(tab, device="cpu", dtype=torch.int64)


@pytest.mark.parametrize("bound", [torch.float32, torch.bfloat16, torch.float64],
                         ids=lambda t: str(t).split(".")[-1])
def test_bind_steer_other_dtype_and_row_config_take_the_general_path(bound):
    gen = torch.Generator().manual_seed(3)
    d = 48
    cfg = SteerConfig(basis=rand_orthonormal(2, d, gen), add=torch.randn(d, generator=gen), add_scale=0.5)
    tab = SteerTable.from_configs([cfg], d_model=d)
    run = bind_steer(tab, device="cpu", dtype=bound, layer_weight=0.7)
    for dt in DTYPES:
        h = (torch.randn(3, 2, d, generator=gen) * 3).to(dt)
        got = run(h)
        want = fused_steer(h, tab, layer_weight=0.7, impl="torch")
        assert got.dtype == dt
        assert_close_report(got, want, *TOL[dt], f"bound {bound} called with {dt}")
    # several configurations, picked per row
    tab3 = SteerTable.from_configs([cfg, SteerConfig.identity(), SteerConfig.injection(torch.ones(d), 2.0)],
                                   d_model=d)
    run3 = bind_steer(tab3, device="cpu", dtype=bound)
    assert run3.shared is None and "n_configs=3" in repr(run3)
    h = (torch.randn(3, 2, d, generator=gen) * 3).to(bound)
    rc = torch.tensor([2, 0, 1])
    assert_close_report(run3(h, row_config=rc), fused_steer(h, tab3, row_config=rc, impl="torch"), *TOL[bound],
                        "bound row_config")
    assert torch.equal(run3(h, row_config=rc)[2], h[2])  # the identity configuration


def test_no_plan_for_trainable_tables_and_gradients_flow():
    v = torch.randn(16, requires_grad=True)
    tab = SteerTable.from_configs([SteerConfig.injection(torch.zeros(16))], d_model=16)
    tab.add = v[None]  # a vector being optimised: its graph must be rebuilt at every call
    assert shared_config(tab, torch.float32, torch.device("cpu")) is None
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
