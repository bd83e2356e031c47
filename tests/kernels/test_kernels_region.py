"""Region projection (Polyhedron) against an independent solver (scipy SLSQP), and identity inside."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from _kernel_helpers import TOLS, assert_close_report, rand_orthonormal

import steerkit.kernels as K
from steerkit.kernels import Polyhedron, fused_steer, solve_polyhedron_projection

TOL = K.DEFAULT_REGION_TOL  # natural-residual tolerance the solver promises (distance units)


def random_polyhedron(m, nh, gen):
    """Unit-normal half-spaces W x <= c with c > 0, so 0 is strictly inside (non-empty)."""
    W = torch.randn(nh, m, generator=gen, dtype=torch.float64)
    W = W / W.norm(dim=1, keepdim=True)
    c = torch.rand(nh, generator=gen, dtype=torch.float64) * 2 + 0.2
    return W, c


def scipy_projection(z, W, c):
    z, W, c = (t.numpy() for t in (z, W, c))
    res = minimize(lambda x: 0.5 * np.sum((x - z) ** 2), np.zeros_like(z), jac=lambda x: x - z,
                   constraints=[dict(type="ineq", fun=lambda x: c - W @ x, jac=lambda x: -W)],
                   method="SLSQP", options=dict(ftol=1e-12, maxiter=1000))
    # status 8 ("positive directional derivative in linesearch") is SLSQP stopping at its
    # precision floor; accept it only when its point is feasible.
    assert res.success or (res.status == 8 and (W @ res.x - c).max() <= 1e-7), res.message
    return torch.from_numpy(res.x)


@pytest.mark.parametrize("m,nh", [(2, 3), (8, 16), (16, 32), (32, 32)])
def test_solver_vs_scipy_random_polyhedra(m, nh):
    gen = torch.Generator().manual_seed(m * 100 + nh)
    n_out = 0
    for trial in range(3):
        W, c = random_polyhedron(m, nh, gen)
        z = torch.randn(6, m, generator=gen, dtype=torch.float64) * 3
        step = torch.full((6,), 1.0 / torch.linalg.matrix_norm(W, ord=2).item() ** 2, dtype=torch.float64)
        x, _ = solve_polyhedron_projection(z, W.expand(6, nh, m), c.expand(6, nh), step, tol=TOL,
                                           max_iter=20000)
        for r in range(6):
            inside = bool((W @ z[r] <= c).all())
            n_out += not inside
            viol = (W @ x[r] - c).max().item()
            assert viol <= TOL, f"infeasible output: max(Wx - c) = {viol:.3g} > {TOL}"
            xs = scipy_projection(z[r], W, c)
            obj, obj_s = 0.5 * (x[r] - z[r]).square().sum().item(), 0.5 * (xs - z[r]).square().sum().item()
            assert obj <= obj_s + 1e-3 * max(1.0, obj_s), f"not optimal: {obj} vs scipy {obj_s}"
            dist = (x[r] - xs).norm().item()
            assert dist <= 2e-3 * max(1.0, z[r].norm().item()), (
                f"trial {trial} row {r}: |x - x_scipy| = {dist:.3g} (inside={inside})")
            if inside:
                assert torch.equal(x[r], z[r]), "a point already inside must be returned unchanged"
    assert n_out > 0, "test is vacuous: no point was outside the polyhedron"


def _region_case(d, m, nh, gen):
    P = rand_orthonormal(m, d, gen)
    mu = torch.randn(d, generator=gen) * 0.1
    W, c = random_polyhedron(m, nh, gen)
    return Polyhedron(mean=mu, projection=P, normals=(W * 3).float(), offsets=(c * 3).float())


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("strength", [1.0, 0.5])
def test_kernel_region_projection_vs_scipy(impl, strength):
    gen = torch.Generator().manual_seed(11)
    d, rows, m, nh = 576, 7, 8, 12
    reg = _region_case(d, m, nh, gen)
    P, mu = reg.projection.double(), reg.mean.double()
    h = torch.randn(rows, d, generator=gen) * 2
    out = fused_steer(h, region=reg, region_strength=strength, impl=impl).double()
    z = (h.double() - mu) @ P.T
    z_out = (out - mu) @ P.T
    Wn = reg.normals.double() / reg.normals.double().norm(dim=1, keepdim=True)
    cn = reg.offsets.double() / reg.normals.double().norm(dim=1)
    n_out = 0
    for r in range(rows):
        zs = scipy_projection(z[r], Wn, cn)
        n_out += not bool((Wn @ z[r] <= cn).all())
        expect = z[r] + strength * (zs - z[r])
        err = (z_out[r] - expect).norm().item()
        assert err <= 5e-3, f"row {r}: |z_out - z_expected| = {err:.3g}"
        if strength == 1.0:
            assert (Wn @ z_out[r] - cn).max().item() <= 10 * TOL + 1e-5
    assert n_out > 0
    # the component outside the subspace is untouched
    perp_in = h.double() - (h.double() @ P.T) @ P
    perp_out = out - (out @ P.T) @ P
    assert_close_report(perp_out, perp_in, 1e-4, 1e-5, "orthogonal complement")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_region_identity_inside_and_kernel_matches_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    d, m, nh = 576, 4, 6
    reg = _region_case(d, m, nh, gen)
    reg.offsets = reg.offsets + 50.0  # a large polyhedron: small rows are inside
    h = (torch.randn(7, d, generator=gen) * 0.05).to(dtype)
    for impl in ("triton", "torch"):
        assert torch.equal(fused_steer(h, region=reg, impl=impl), h), f"{impl}: inside point moved"
    # a mix of inside and outside rows, mask, row configs with a region-less config
    reg2 = _region_case(d, m, nh, gen)
    h2 = (torch.randn(7, d, generator=gen) * 3).to(dtype)
    idx = torch.tensor([0, 1, 2, 0, 1, 2, 1])
    msk = torch.tensor([1, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
    kw = dict(region=[reg, reg2, None], row_config=idx, mask=msk)
    out_t = fused_steer(h2, **kw, impl="triton")
    out_r = fused_steer(h2, **kw, impl="torch")
    atol, rtol = TOLS[dtype]
    # solver stops at the tolerance, so the two may differ by ~tol on top of the dtype's rounding
    assert_close_report(out_t, out_r, atol + 1e-3, rtol, f"region kernel vs reference {dtype}")
    assert torch.equal(out_t[~msk], h2[~msk]) and torch.equal(out_t[idx == 2], h2[idx == 2])
    assert not torch.equal(out_t[idx == 1], h2[idx == 1])


def test_region_large_d_single_row():
    gen = torch.Generator().manual_seed(4)
    reg = _region_case(4096, 32, 32, gen)
    h = torch.randn(1, 4096, generator=gen) * 2
    out_t = fused_steer(h, region=reg, impl="triton")
    out_r = fused_steer(h, region=reg, impl="torch")
    assert_close_report(out_t, out_r, 2e-3, 1e-4, "region d=4096 m=32 nh=32")
