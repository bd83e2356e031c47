"""Hypothesis-generated shapes and configurations, torch path, against a naive per-row model."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from _kernel_helpers import assert_close_report, naive_row, rand_orthonormal

from steerkit.kernels import fused_steer


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(0, 9), d=st.integers(2, 48), k=st.integers(0, 4), n_cfg=st.integers(1, 3),
    use_add=st.booleans(), use_gate=st.booleans(), use_mask=st.booleans(), norm=st.booleans(),
    lw=st.floats(-2, 2), thr=st.floats(0, 1), mode=st.sampled_from(["above", "below"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_torch_path_matches_naive_model(rows, d, k, n_cfg, use_add, use_gate, use_mask, norm, lw, thr, mode, seed):
    k = min(k, d)
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, d, generator=gen, dtype=torch.float64) + 0.1
    kw = {}
    B = c = t = V = a = u = None
    if k:
        B = torch.stack([rand_orthonormal(k, d, gen) for _ in range(n_cfg)]).double()
        c = torch.rand(n_cfg, k, generator=gen, dtype=torch.float64) * 2 - 0.5
        t = torch.randn(n_cfg, k, generator=gen, dtype=torch.float64)
        kw.update(basis=B, strength=c, target=t)
    if use_add:
        V = torch.randn(n_cfg, d, generator=gen, dtype=torch.float64)
        a = torch.randn(n_cfg, generator=gen, dtype=torch.float64)
        kw.update(add=V, scale=a)
    if use_gate:
        u = torch.randn(d, generator=gen, dtype=torch.float64)
        kw.update(gate_direction=u, gate_threshold=thr, gate_mode=mode)
    n_eff = n_cfg if (k or use_add) else 1  # only per-config tensors define the configurations
    idx = torch.randint(0, n_eff, (rows,), generator=gen)
    m = torch.rand(rows, generator=gen) > 0.3 if use_mask else torch.ones(rows, dtype=torch.bool)
    out = fused_steer(h, **kw, row_config=idx, mask=m if use_mask else None, layer_weight=lw,
                      preserve_norm=norm, impl="torch")
    assert out.shape == h.shape and out.dtype == h.dtype
    for r in range(rows):
        if not m[r]:
            assert torch.equal(out[r], h[r])
            continue
        g = int(idx[r])
        exp = naive_row(h[r], basis=None if B is None else B[g], strength=None if c is None else c[g],
                        target=None if t is None else t[g],
                        gate=None if u is None else (u, thr, mode),
                        add=None if V is None else a[g] * V[g], layer_weight=lw,
                        preserve_norm=norm and bool(k or use_add))
        if norm and not (k or use_add):
            exp = h[r].clone()
        assert_close_report(out[r], exp, 1e-9, 1e-9, f"row {r}")
