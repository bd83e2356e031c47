"""Triton kernel (under TRITON_INTERPRET=1) vs torch reference vs a naive per-row model."""

from __future__ import annotations


import pytest
import torch

from _kernel_helpers import TOLS, assert_close_report, naive_row, rand_orthonormal

import steerkit.kernels as K
from steerkit.kernels import Polyhedron, SteerConfig, SteerConfigError, SteerTable, fused_steer

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(rows, d, dtype, seed=0, n_cfg=3, k=4):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, d, generator=gen).to(dtype)
    B = rand_orthonormal(k, d, gen)
    c = torch.tensor([1.0, 0.5, 0.25, 1.0])[:k]
    t = torch.tensor([0.0, 0.0, 0.0, 2.0])[:k]  # last direction clamped to 2
    V = torch.randn(n_cfg, d, generator=gen) / d**0.5 * 4
    a = torch.linspace(-1.0, 2.0, n_cfg)
    idx = torch.randint(0, n_cfg, (rows,), generator=gen)
    m = torch.rand(rows, generator=gen) > 0.2
    u = torch.randn(d, generator=gen)
    return h, dict(basis=B, strength=c, target=t, add=V, scale=a, row_config=idx, mask=m,
                   gate_direction=u, gate_threshold=0.03)


# ---------------------------------------------------------------- kernel vs reference, all shapes
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("d", [576, 4096])
@pytest.mark.parametrize("rows", [1, 7, 513])
def test_fused_kernel_matches_reference(rows, d, dtype):
    h, kw = _inputs(rows, d, dtype, seed=rows + d)
    for pn in (True, False) if rows == 7 else (True,):
        out_t = fused_steer(h, **kw, layer_weight=0.8, preserve_norm=pn, impl="triton")
        out_r = fused_steer(h, **kw, layer_weight=0.8, preserve_norm=pn, impl="torch")
        assert out_t.dtype == h.dtype and out_t.shape == h.shape
        atol, rtol = TOLS[dtype]
        assert_close_report(out_t, out_r, atol, rtol, f"fused rows={rows} d={d} {dtype} norm={pn}")
        # masked-out rows are bit-identical to the input
        m = kw["mask"]
        assert torch.equal(out_t[~m], h[~m])
        assert torch.equal(out_r[~m], h[~m])
        # and the edit did something on the others
        if m.any():
            assert (out_t[m].float() - h[m].float()).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("op", ["ablate", "clamp", "inject", "gated_inject"])
def test_single_ops_match_reference(op, dtype):
    rows, d = 7, 576
    h, kw = _inputs(rows, d, dtype, seed=3)
    if op == "ablate":
        call = dict(basis=kw["basis"], strength=kw["strength"])
    elif op == "clamp":
        call = dict(basis=kw["basis"][:2], strength=1.0, target=torch.tensor([1.5, -0.5]))
    elif op == "inject":
        call = dict(add=kw["add"], scale=kw["scale"], row_config=kw["row_config"], layer_weight=0.5)
    else:
        call = dict(add=kw["add"], scale=kw["scale"], row_config=kw["row_config"],
                    gate_direction=kw["gate_direction"], gate_threshold=0.03)
    out_t = fused_steer(h, **call, impl="triton")
    out_r = fused_steer(h, **call, impl="torch")
    atol, rtol = TOLS[dtype]
    assert_close_report(out_t, out_r, atol, rtol, f"{op} {dtype}")
    if op == "clamp":  # independent of the reference: the projections now equal the targets
        p = out_t.double() @ call["basis"].double().T
        assert_close_report(p, call["target"].double().expand_as(p), 4 * atol * d**0.5 / 10 + 0.05, 0.02,
                            "clamped projection")


def test_ablation_removes_direction_and_keeps_the_rest():
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(7, 576, generator=gen)
    B = rand_orthonormal(3, 576, gen)
    out = K.ablate(h, B, impl="triton")
    assert (out @ B.T).abs().max() < 1e-5
    resid_in = h - (h @ B.T) @ B
    assert_close_report(out, resid_in, 1e-5, 1e-5, "orthogonal complement unchanged")
    half = K.ablate(h, B, 0.5, impl="triton")
    assert_close_report(half @ B.T, 0.5 * (h @ B.T), 1e-5, 1e-5, "half-strength projection")


def test_against_naive_per_row_model_with_table_and_schedule():
    """SteerTable of mixed configs vs a float64 per-row model written from the issue's formulas."""
    gen = torch.Generator().manual_seed(5)
    d, rows = 96, 11
    h = torch.randn(rows, d, generator=gen) * 2
    B1, B2 = rand_orthonormal(2, d, gen), rand_orthonormal(5, d, gen)
    u = torch.randn(d, generator=gen)
    v1, v2, v3 = (torch.randn(d, generator=gen) for _ in range(3))
    cfgs = [
        SteerConfig.ablation(B1, strength=torch.tensor([1.0, 0.3])),
        SteerConfig(basis=B2, strength=0.7, target=torch.linspace(-1, 1, 5), add=torch.stack([v1, v2]),
                    add_scale=torch.tensor([0.5, -1.0])),
        SteerConfig.injection(v3, 2.0).with_gate(u, 0.1, "above"),
        SteerConfig.injection(v3, 2.0).with_gate(u, 0.1, "below"),
        SteerConfig.identity(),
    ]
    table = SteerTable.from_configs(cfgs, schedule=[1.0, 0.5, 0.25])
    idx = torch.arange(rows) % len(cfgs)
    for impl in ("torch", "triton"):
        for pn in (False, True):
            out = fused_steer(h, table, row_config=idx, layer=2, preserve_norm=pn, impl=impl)
            for r in range(rows):
                cf = cfgs[int(idx[r])]
                kw = {}
                if cf.basis is not None:
                    k = cf.basis.shape[0]
                    kw.update(basis=cf.basis, strength=torch.as_tensor(cf.strength).expand(k),
                              target=torch.zeros(k) if cf.target is None else torch.as_tensor(cf.target).expand(k))
                if cf.add is not None:
                    v = cf.add if cf.add.dim() == 2 else cf.add[None]
                    kw["add"] = (torch.as_tensor(cf.add_scale).reshape(-1, 1) * v).sum(0)
                if cf.gate_direction is not None:
                    kw["gate"] = (cf.gate_direction, cf.gate_threshold, cf.gate_mode)
                exp = naive_row(h[r], layer_weight=0.25, preserve_norm=pn, **kw)
                assert_close_report(out[r], exp, 1e-4, 1e-4, f"{impl} row {r} config {int(idx[r])} norm={pn}")
    # the two gated configs are complementary: exactly one of rows 2/3 patterns fires per row
    out = fused_steer(h, table, row_config=torch.full((rows,), 2), impl="torch")
    out2 = fused_steer(h, table, row_config=torch.full((rows,), 3), impl="torch")
    fired = (out != h).any(-1) ^ (out2 != h).any(-1)
    assert fired.all()


def test_batched_3d_input_with_per_sequence_config():
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(3, 5, 64, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    V = torch.randn(3, 64, generator=gen)
    seq = torch.tensor([2, 0, 1])
    pos_mask = torch.zeros(3, 5, dtype=torch.bool)
    pos_mask[:, 3:] = True  # e.g. generated tokens only
    out_t = fused_steer(h, add=V, scale=torch.ones(3), row_config=seq, mask=pos_mask, impl="triton")
    exp = h.float() + pos_mask[..., None] * V[seq][:, None, :]
    assert_close_report(out_t, exp.to(torch.bfloat16), *TOLS[torch.bfloat16], "3d per-sequence inject")


# ---------------------------------------------------------------- gradients
def _grad_inputs(dtype, n_b):
    gen = torch.Generator().manual_seed(7)
    d, rows, k = 24, 6, 3
    h = torch.randn(rows, d, generator=gen, dtype=torch.float64)
    B = torch.stack([rand_orthonormal(k, d, gen) for _ in range(n_b)]).double()
    c = torch.rand(2, k, generator=gen, dtype=torch.float64)
    t = torch.randn(2, k, generator=gen, dtype=torch.float64)
    V = torch.randn(2, d, generator=gen, dtype=torch.float64)
    a = torch.tensor([0.7, -1.3], dtype=torch.float64)
    idx = torch.tensor([0, 1, 1, 0, 1, 0])
    m = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.bool)
    return [x.to(dtype).requires_grad_() for x in (h, B, c, t, V, a)], idx, m


@pytest.mark.parametrize("n_b", [1, 2], ids=["shared_basis", "per_config_basis"])
def test_gradcheck_torch_path_float64(n_b):
    args, idx, m = _grad_inputs(torch.float64, n_b)

    def f(h, B, c, t, V, a):
        return fused_steer(h, basis=B, strength=c, target=t, add=V, scale=a, row_config=idx, mask=m,
                           layer_weight=0.6, impl="torch", validate=False)

    assert torch.autograd.gradcheck(f, tuple(args), eps=1e-6, atol=1e-7, fast_mode=True)


@pytest.mark.parametrize("n_b", [1, 2], ids=["shared_basis", "per_config_basis"])
def test_triton_backward_matches_reference_autograd(n_b):
    args, idx, m = _grad_inputs(torch.float32, n_b)
    out = fused_steer(args[0], basis=args[1], strength=args[2], target=args[3], add=args[4], scale=args[5],
                      row_config=idx, mask=m, layer_weight=0.6, impl="triton", validate=False)
    go = torch.randn_like(out)
    got = torch.autograd.grad(out, args, go)
    leaves = [x.detach().clone().requires_grad_() for x in args]
    tab = K.table_from_tensors(24, "cpu", basis=leaves[1], strength=leaves[2], target=leaves[3],
                               add=leaves[4], scale=leaves[5], validate=False)
    ref = K.fused_steer_ref(leaves[0], tab, idx, m, 0.6)
    exp = torch.autograd.grad(ref, leaves, go)
    for name, g1, g2 in zip(("h", "basis", "strength", "target", "add", "scale"), got, exp):
        assert_close_report(g1, g2, 1e-5, 1e-5, f"grad {name}")
    assert got[0][~m].equal(go[~m])  # untouched rows pass the gradient straight through


def test_recompute_backward_for_norm_and_gate():
    args, idx, m = _grad_inputs(torch.float32, 1)
    h, V = args[0], args[4]
    u = torch.randn(24, dtype=torch.float32)
    kw = dict(add=V, scale=torch.tensor([1.0, 2.0]), row_config=idx, mask=m, preserve_norm=True,
              gate_direction=u, gate_threshold=0.05)
    out = fused_steer(h, **kw, impl="triton")
    go = torch.randn_like(out)
    got = torch.autograd.grad(out, [h, V], go)
    h2, V2 = h.detach().clone().requires_grad_(), V.detach().clone().requires_grad_()
    exp = torch.autograd.grad(fused_steer(h2, **{**kw, "add": V2}, impl="torch"), [h2, V2], go)
    for g1, g2 in zip(got, exp):
        assert_close_report(g1, g2, 1e-5, 1e-5, "recompute grad")
    # and the norm preservation is differentiated: the gradient is not the identity
    assert not torch.allclose(got[0][m], go[m])


# ---------------------------------------------------------------- backend choice
def test_impl_choice_and_override():
    h = torch.randn(2, 8)
    assert K.resolve_impl("auto", h) == "torch"  # CPU tensors -> torch
    with K.use_impl("triton"):
        assert K.resolve_impl("auto", h) == "triton"
        assert K.resolve_impl("torch", h) == "torch"  # explicit wins
    assert K.resolve_impl("auto", h) == "torch"
    with pytest.raises(ValueError, match="impl must be one of"):
        K.resolve_impl("cuda", h)


def test_impl_choice_for_a_device():
    assert K.resolve_impl_for("auto", "cpu") == "torch"
    assert K.resolve_impl_for("auto", torch.device("cpu")) == "torch"
    with K.use_impl("triton"):  # TRITON_INTERPRET=1 here: Triton on CPU is allowed
        assert K.resolve_impl_for("auto", "cpu") == "triton"
        assert K.resolve_impl_for("torch", "cpu") == "torch"
    with pytest.raises(ValueError, match="impl must be one of"):
        K.resolve_impl_for("gpu", "cpu")


def test_impl_triton_without_interpreter_says_what_to_do(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match=r"needs CUDA tensors; found tensors on cpu.*impl='torch'"):
        K.resolve_impl_for("triton", "cpu")
    with pytest.raises(RuntimeError, match=r"needs CUDA tensors"):
        K.resolve_impl("triton", torch.zeros(2))


# ---------------------------------------------------------------- orthonormalize / launch settings
def test_orthonormalize_drops_dependent_directions():
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randn(2, 20, generator=gen, dtype=torch.float64)
    assert K.orthonormalize(torch.stack([a, 2 * a, b, a - 3 * b])).shape == (2, 20)
    a, b = a.float(), b.float()
    B = K.orthonormalize(torch.stack([a, 2 * a, b]))  # 2a is exact in float32
    assert B.shape == (2, 20) and B.dtype == torch.float32
    gram = B.double() @ B.double().T
    assert (gram - torch.eye(2, dtype=torch.float64)).abs().max() < K.ORTHO_TOL
    # the span is kept: a and b are reproduced by their projections
    for v in (a, b):
        assert torch.allclose((v @ B.T) @ B, v, atol=1e-5)
    # each row has a positive dot product with the direction it completes
    assert float(B[0] @ a) > 0 and float(B[1] @ b) > 0
    assert (K.orthonormalize(torch.stack([-a, b])) @ torch.stack([-a, b]).T).diagonal().gt(0).all()
    u = K.orthonormalize(a)  # one direction, 1-D
    assert u.shape == (1, 20) and torch.allclose(u[0].abs(), (a / a.norm()).abs(), atol=1e-6)
    assert torch.allclose(u[0], a / a.norm(), atol=1e-6) and torch.allclose(K.orthonormalize(-a)[0], -a / a.norm(),
                                                                             atol=1e-6)
    assert K.orthonormalize(torch.zeros(3, 20)).shape == (0, 20)
    assert K.orthonormalize(torch.zeros(0, 20)).shape == (0, 20)
    full = K.orthonormalize(torch.stack([a[:2], 2 * a[:2], b[:2]]))  # more vectors than dimensions
    assert full.shape == (2, 2) and torch.allclose(full @ full.T, torch.eye(2), atol=1e-6)
    assert K.orthonormalize(a.double()).dtype == torch.float64
    assert K.orthonormalize([[1, 0, 0], [0, 2, 0]]).dtype == torch.get_default_dtype()
    assert torch.allclose(K.orthonormalize([[1.0, 0, 0], [0, 2, 0]]), torch.eye(3)[:2])
    assert K.config.orthonormalize is K.orthonormalize
    SteerTable.from_configs([SteerConfig.ablation(B)])  # passes the table's orthonormality check
    with pytest.raises(ValueError, match=r"shape \(k, d_model\) or \(d_model,\); found \(2, 3, 4\)"):
        K.orthonormalize(torch.zeros(2, 3, 4))


def test_launch_params_are_a_pure_function():
    lp = K.launch_params(4096, 4, torch.bfloat16, False)
    assert lp == K.LaunchParams(block_d=512, block_r=16, num_warps=4, norm_fast=True)
    assert K.launch_params(4096, 16, torch.float32, False) == K.LaunchParams(128, 16, 8)
    assert K.launch_params(4096, 1, torch.float16, True).block_r == 4
    assert K.launch_params(200, 4, torch.float32, False, interpret=True) == K.LaunchParams(256, 32, 4)
    assert K.launch_params(4096, 4, torch.bfloat16, False) == lp  # same inputs, same answer
    with pytest.raises(ValueError, match=r"block_d must be a positive power of two; found 100"):
        K.LaunchParams(block_d=100, block_r=8)


# ---------------------------------------------------------------- errors say expected / found / what to do
def test_error_messages():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(4, 32, generator=gen)
    B = rand_orthonormal(2, 32, gen)
    with pytest.raises(SteerConfigError, match=r"orthonormal.*found.*orthonormalize"):
        fused_steer(h, basis=B * 2)
    with pytest.raises(SteerConfigError, match=r"1\.\.16 directions.*found k=17"):
        fused_steer(h, basis=torch.eye(32)[:17])
    with pytest.raises(SteerConfigError, match=r"last dimension must equal"):
        fused_steer(h, basis=torch.eye(16)[:2])
    with pytest.raises(SteerConfigError, match=r"add must have shape \(32,\)"):
        fused_steer(h, add=torch.randn(3, 31))
    bad = torch.randn(32)
    bad[3] = float("nan")
    with pytest.raises(SteerConfigError, match=r"finite; found NaN.*index \[(0, )?3\]"):
        fused_steer(h, add=bad)
    with pytest.raises(SteerConfigError, match=r"row_config must be an integer tensor; found torch.float32"):
        fused_steer(h, add=torch.randn(32), row_config=torch.zeros(4))
    with pytest.raises(SteerConfigError, match=r"row_config values must be in \[0, 2\); found range \[0, 5\]"):
        fused_steer(h, add=torch.randn(2, 32), row_config=torch.tensor([0, 1, 5, 0]))
    with pytest.raises(SteerConfigError, match=r"h must be float32, float16 or bfloat16; found torch.int64"):
        fused_steer(torch.zeros(4, 32, dtype=torch.long), add=torch.randn(32))
    with pytest.raises(SteerConfigError, match=r"supports float32.*found float64"):
        fused_steer(h.double(), add=torch.randn(32), impl="triton")
    with pytest.raises(SteerConfigError, match=r"mask must have shape \(4,\)"):
        fused_steer(h, add=torch.randn(32), mask=torch.ones(5, dtype=torch.bool))
    P = torch.eye(40)[:33, :32]
    with pytest.raises(SteerConfigError, match=r"k must be 1\.\.32; found k=33"):
        fused_steer(h, region=Polyhedron(mean=torch.zeros(32), projection=P, normals=torch.randn(2, 33),
                                     offsets=torch.ones(2)))
    with pytest.raises(SteerConfigError, match=r"table is for d_model=32 but h has d_model=16"):
        fused_steer(torch.randn(2, 16), SteerTable.from_configs([SteerConfig.injection(torch.randn(32))]))
