"""The checks every intervention value passes through: numbers, tensors, vectors, orthonormal bases
and index lists, each refused with a message saying what was expected and what was found.

Examples:
    >>> from steerkit.interventions.checks import _basis
    >>> tuple(_basis(torch.ones(4), "a direction").shape)
    (1, 4)
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from steerkit.errors import InputError
from steerkit.kernels import ORTHO_TOL


def _number(x, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        if isinstance(x, Tensor) and x.numel() == 1:
            x = float(x)
        else:
            raise InputError(f"expected {what} to be a finite number, found {type(x).__name__} {x!r:.60}")
    x = float(x)
    if not math.isfinite(x):
        raise InputError(f"expected {what} to be a finite number, found {x}")
    return x


def _tensor(v, what: str) -> Tensor:
    if not isinstance(v, Tensor):
        try:
            v = torch.as_tensor(v)
        except Exception:
            raise InputError(f"expected {what} as a tensor, found {type(v).__name__}") from None
    if not torch.is_floating_point(v):
        v = v.float()
    if not (v.requires_grad and torch.is_grad_enabled()):
        v = v.detach()  # a trainable vector (requires grad, grad mode on) keeps its autograd link
    if v.numel() and not bool(torch.isfinite(v.detach()).all()):
        n = int((~torch.isfinite(v)).sum())
        raise InputError(f"expected {what} with finite values, found {n} NaN/inf entries; check how the "
                         "vector was computed (empty set? division by zero?)")
    return v


def _indices(v, what: str) -> tuple:
    if isinstance(v, (int,)) and not isinstance(v, bool):
        v = [v]
    try:
        out = tuple(int(i) for i in v)
    except (TypeError, ValueError):
        raise InputError(f"expected {what} as a list of indices, found {v!r:.60}") from None
    if not out or len(set(out)) != len(out) or min(out) < 0:
        raise InputError(f"expected {what} as distinct non-negative indices, found {list(out)}")
    return out


def _vector(v, what: str) -> Tensor:
    t = _tensor(v, what)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1 or t.shape[0] == 0:
        raise InputError(f"expected {what} of shape [d_model], found {tuple(t.shape)}")
    return t


def _basis(v, what: str) -> Tensor:
    """Rows of an orthonormal basis ``[k, d_model]``: one vector is normalised; several must already
    be orthonormal (say ``steerkit.orthonormalize(vectors)`` otherwise)."""
    t = _tensor(v, what)
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2 or t.shape[1] == 0 or t.shape[0] == 0:
        raise InputError(f"expected {what} of shape [d_model] or [k, d_model], found {tuple(t.shape)}")
    norms = t.norm(dim=-1)
    if bool((norms < 1e-12).any()):
        raise InputError(f"expected nonzero directions in {what}, found a zero vector")
    if t.shape[0] == 1:
        return t / norms.unsqueeze(-1)
    g = t.double() @ t.double().T
    err = float((g - torch.eye(t.shape[0], dtype=g.dtype)).abs().max())
    if err > ORTHO_TOL:
        raise InputError(f"expected an orthonormal basis in {what} (max |B B^T - I| <= {ORTHO_TOL}), found "
                         f"{err:.3g}; pass steerkit.orthonormalize(vectors) instead")
    return t
