"""Shared helpers for the kernel tests: tolerance table, reporting comparison, naive per-row model."""

from __future__ import annotations

import numpy as np
import torch

# (dtype) -> (atol, rtol) for Triton kernel vs torch reference on the same inputs.
# Both compute in float32 and round once to the output dtype, so the differences are
#  * float32: reduction order of d_model-long dot products (~sqrt(d) * 2^-24 * |h| |b|,
#    a few 1e-6 for |h| ~ 3, d = 4096); 1e-4 / 1e-5 leaves a margin of ~10x.
#  * float16: a float32 difference that crosses a rounding boundary flips one fp16 ulp
#    (2^-11 relative, 2^-10 absolute at |x| in [1, 2)); allow 2 ulps.
#  * bfloat16: same argument with bf16's 8-bit mantissa (2^-8 relative); allow 2 ulps.
TOLS = {
    torch.float32: (1e-4, 1e-5),
    torch.float16: (2e-3, 2 * 2.0**-11),
    torch.bfloat16: (1.6e-2, 2 * 2.0**-8),
}


def assert_close_report(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str = ""):
    """Like torch.testing.assert_close, but on failure names the worst element and its values."""
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    err = (a - e).abs()
    allowed = atol + rtol * e.abs()
    excess = err - allowed
    if a.numel() and (excess > 0).any() or not torch.isfinite(a).all():
        idx = np.unravel_index(int(torch.nan_to_num(excess, nan=1e30).argmax()), tuple(a.shape))
        raise AssertionError(
            f"{what}: {(excess > 0).sum().item()} of {a.numel()} elements out of tolerance "
            f"(atol={atol}, rtol={rtol}); worst at index {tuple(int(i) for i in idx)}: "
            f"actual={a[idx].item():.8g} expected={e[idx].item():.8g} |diff|={err[idx].item():.3g}"
        )


def rand_orthonormal(k: int, d: int, gen: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(d, k, generator=gen, dtype=torch.float64))
    return q.T.contiguous().float()


def naive_row(h, *, basis=None, strength=None, target=None, gate=None, add=None, layer_weight=1.0,
              region_delta=None, preserve_norm=False):
    """Per-row float64 model written from the issue's formulas, independent of reference.py.

    gate: (u, thr, mode) or None; region_delta: callable x -> delta in d_model space or None.
    """
    x = h.double().clone()
    if basis is not None:
        B = basis.double()
        p = B @ x
        x = x - B.T @ (strength.double() * (p - target.double()))
    fire = True
    if gate is not None:
        u, thr, mode = gate
        u = u.double() / u.double().norm()
        cos = (u @ x).abs() / x.norm().clamp_min(1e-12)
        fire = bool(cos > thr) if mode == "above" else bool(cos < thr)
    if add is not None and fire:
        x = x + layer_weight * add.double()
    if region_delta is not None and fire:
        x = x + region_delta(x)
    if preserve_norm:
        x = x * (h.double().norm() / x.norm())
    return x
