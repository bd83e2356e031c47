"""The forward kernel sweeps d in BLOCK_D chunks with BLOCK_R rows per program; under the
interpreter its default is one chunk per row, so these tests pass small tiles
(``launch=LaunchParams(...)``: several chunks, a ragged last chunk, a ragged last row tile)
and check every pass against the torch reference, including the norm rescale's two routes
(|x|^2 from first-pass dot products, and the exact extra pass its cancellation guard falls
back to)."""

from __future__ import annotations

import pytest
import torch

from _kernel_helpers import TOLS, assert_close_report, rand_orthonormal

from steerkit.kernels import LaunchParams, Polyhedron, fused_steer

SMALL = LaunchParams(block_d=64, block_r=8, num_warps=4)


def _case(rows, d, dtype, seed, n_cfg=1, k=4):
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(rows, d, generator=gen) * 3).to(dtype)
    B = rand_orthonormal(k, d, gen)
    c = torch.linspace(0.5, 1.0, k)
    V = torch.randn(n_cfg, d, generator=gen)
    a = torch.linspace(0.5, 2.0, n_cfg)
    return gen, h, B, c, V, a


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("what", ["ablate4+inject+norm", "ablate16", "inject", "inject cfgs+mask+norm",
                                  "gated+norm", "clamp+norm per-row basis"])
def test_chunked_matches_reference(what, dtype):
    rows, d = 37, 200  # 4 chunks of 64 (last one ragged), 5 row tiles of 8 (last one ragged)
    n_cfg = 3 if ("cfgs" in what or "per-row" in what) else 1
    gen, h, B, c, V, a = _case(rows, d, dtype, seed=len(what), n_cfg=n_cfg, k=16 if what == "ablate16" else 4)
    kw: dict = {}
    pn = "norm" in what
    if "ablate" in what:
        kw.update(basis=B, strength=c)
    if "inject" in what or "gated" in what:
        kw.update(add=V, scale=a)
    if "cfgs" in what or "per-row" in what:
        kw["row_config"] = torch.randint(0, n_cfg, (rows,), generator=gen)
    if "mask" in what:
        kw["mask"] = torch.rand(rows, generator=gen) > 0.3
    if "gated" in what:
        kw.update(basis=B, strength=c, gate_direction=torch.randn(d, generator=gen), gate_threshold=0.05)
    if "clamp" in what:
        Bs = torch.stack([rand_orthonormal(4, d, gen) for _ in range(n_cfg)])
        kw.update(basis=Bs, strength=1.0, target=torch.tensor([1.0, -2.0, 0.0, 3.0]))
    out_t = fused_steer(h, **kw, preserve_norm=pn, impl="triton", launch=SMALL)
    out_r = fused_steer(h, **kw, preserve_norm=pn, impl="torch")
    atol, rtol = TOLS[dtype]
    assert_close_report(out_t, out_r, atol, rtol, f"chunked {what} {dtype}")
    if "mask" in what:
        m = kw["mask"]
        assert torch.equal(out_t[~m], h[~m])


@pytest.mark.parametrize("fast", [True, False])
def test_norm_guard_falls_back_where_the_row_mostly_vanishes(fast):
    """Rows whose energy lies mostly in the ablated span: |x|^2 from the dot products would
    cancel, so the guard must take the exact pass; the other rows take the fast route."""
    rows, d = 24, 200
    gen, h, B, c, V, a = _case(rows, d, torch.float32, seed=11)
    h[::2] = (torch.randn(rows // 2, 4, generator=gen) * 5) @ B + 0.05 * h[::2]
    kw = dict(basis=B, strength=torch.ones(4), add=V * 0.01, scale=a)
    out_t = fused_steer(h, **kw, preserve_norm=True, impl="triton",
                        launch=LaunchParams(block_d=64, block_r=8, num_warps=4, norm_fast=fast))
    out_r = fused_steer(h, **kw, preserve_norm=True, impl="torch")
    assert_close_report(out_t, out_r, *TOLS[torch.float32], f"norm guard fast={fast}")
    torch.testing.assert_close(out_t.norm(dim=-1), h.norm(dim=-1), rtol=1e-5, atol=1e-5)


def test_region_chunked():
    rows, d, m = 9, 130, 3
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(rows, d, generator=gen) * 2
    P = rand_orthonormal(m, d, gen)
    reg = Polyhedron(mean=torch.zeros(d), projection=P, normals=torch.randn(4, m, generator=gen),
                 offsets=torch.rand(4, generator=gen))
    out_t = fused_steer(h, region=reg, preserve_norm=True, impl="triton", launch=SMALL)
    out_r = fused_steer(h, region=reg, preserve_norm=True, impl="torch")
    atol, rtol = TOLS[torch.float32]
    assert_close_report(out_t, out_r, atol + 1e-3, rtol, "region chunked")
