"""Edit operations on residual-stream activations.

An :class:`Edit` is a value: an operation (add, ablate, replace, clamp, or any
callable), its tensors, a scale and a position spec. It is validated when it is
built (shape, finiteness, orthonormality) so that a bad vector fails before a
single hook is registered, and ``apply(x, mask)`` edits the rows ``mask``
selects in ``x [batch, pos, d_model]``:

- ``add``     ``x + scale * v``
- ``ablate``  ``x - B^T (B x)`` for an orthonormal basis ``B [k, d_model]``
  (a single vector is normalised first)
- ``replace`` ``x := v``
- ``clamp``   ``x + (value - <x, u>) u`` with ``u`` the unit direction: the
  projection on ``u`` becomes ``value``
- ``fn``      ``fn(x)`` for any callable returning a tensor of the same shape

Unselected rows are returned bit-for-bit unchanged. ``add``, ``ablate`` and
``clamp`` run as one :func:`steerkit.kernels.fused_steer` call (Triton on CUDA,
the torch reference elsewhere) from a configuration table built once per
device and bound once (:func:`steerkit.kernels.bind_steer`: on CPU an unmasked
call goes straight to the table's prepared formulas, which matters at batch 1
where each Python layer costs as much as the edit); ``replace`` and ``fn`` are
plain torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from .errors import InputError
from .positions import PositionSpec, validate_positions

OPS = ("add", "ablate", "replace", "clamp", "fn")
ORTHONORMAL_TOL = 1e-3


def orthonormalize(vectors: Float[Tensor, "k d_model"]) -> Float[Tensor, "k d_model"]:
    """An orthonormal basis (rows) of the span of ``vectors``, via QR in float64."""
    v = torch.as_tensor(vectors)
    if v.dim() == 1:
        v = v.unsqueeze(0)
    q, r = torch.linalg.qr(v.double().T)
    keep = r.diagonal().abs() > 1e-8 * r.diagonal().abs().max().clamp_min(1e-30)
    return q.T[keep].to(v.dtype)


def _check_vector(v, d_model: int, what: str, *, allow_matrix: bool = False) -> Tensor:
    if not isinstance(v, Tensor):
        try:
            v = torch.as_tensor(v)
        except Exception:
            raise InputError(f"expected {what} to be a tensor of shape [{d_model}], found {type(v).__name__}") from None
    if not torch.is_floating_point(v):
        v = v.float()
    if allow_matrix and v.dim() == 2:
        if v.shape[1] != d_model:
            raise InputError(f"expected {what} of shape [k, {d_model}] (d_model of this model), "
                             f"found {tuple(v.shape)}; was it computed on another model?")
    elif v.dim() != 1 or v.shape[0] != d_model:
        shape = f"[{d_model}]" + (f" or [k, {d_model}]" if allow_matrix else "")
        raise InputError(f"expected {what} of shape {shape} (d_model of this model), found "
                         f"{tuple(v.shape)}; was it computed on another model or at another site?")
    if not bool(torch.isfinite(v).all()):
        n = int((~torch.isfinite(v)).sum())
        raise InputError(f"expected {what} with finite values, found {n} NaN/inf entries; "
                         "check how the vector was computed (empty set? division by zero?)")
    return v.detach()


@dataclass
class Edit:
    """One edit operation; build with :meth:`make`, which validates everything."""

    op: str
    tensor: Optional[Tensor] = None
    scale: float = 1.0
    value: float = 0.0
    fn: Optional[Callable[[Tensor], Tensor]] = None
    positions: PositionSpec = "all"
    _cast: dict = field(default_factory=dict, repr=False)

    @classmethod
    def make(cls, op: str, tensor=None, *, d_model: int, scale: float = 1.0, value: float = 0.0,
             fn: Callable | None = None, positions: PositionSpec = "all") -> "Edit":
        if op not in OPS:
            raise InputError(f"expected an edit operation in {OPS}, found {op!r}")
        positions = validate_positions(positions)
        for nm, x in (("scale", scale), ("value", value)):
            if not isinstance(x, (int, float)) or x != x or x in (float("inf"), float("-inf")):
                raise InputError(f"expected {nm} to be a finite number, found {x!r}")
        if op == "fn":
            if not callable(fn):
                raise InputError(f"expected fn to be a callable taking and returning [batch, pos, d_model], found {fn!r}")
            return cls("fn", None, float(scale), float(value), fn, positions)
        if tensor is None:
            raise InputError(f"expected a vector for the {op!r} edit, found None")
        t = _check_vector(tensor, d_model, f"the {op} vector", allow_matrix=(op == "ablate"))
        if op == "ablate":
            if t.dim() == 1:
                t = t.unsqueeze(0)
            norms = t.norm(dim=-1)
            if bool((norms < 1e-12).any()):
                raise InputError("expected nonzero ablation directions, found a zero vector")
            if t.shape[0] == 1:
                t = t / norms.unsqueeze(-1)
            else:
                g = t.double() @ t.double().T
                err = float((g - torch.eye(t.shape[0], dtype=g.dtype)).abs().max())
                if err > ORTHONORMAL_TOL:
                    raise InputError(f"expected an orthonormal basis to ablate (max |B B^T - I| <= "
                                     f"{ORTHONORMAL_TOL}), found {err:.3g}; pass "
                                     "steerkit.orthonormalize(vectors) instead")
        if op == "clamp":
            n = t.norm()
            if float(n) < 1e-12:
                raise InputError("expected a nonzero clamp direction, found a zero vector")
            t = t / n
        return cls(op, t, float(scale), float(value), None, positions)

    def table(self, device: torch.device):
        """The kernel's configuration table for this edit, built once per device."""
        key = ("table", device)
        t = self._cast.get(key)
        if t is None:
            from steerkit.kernels import SteerConfig, SteerTable
            if self.op == "add":
                cfg = SteerConfig.injection(self.tensor.float(), self.scale)
            elif self.op == "ablate":
                cfg = SteerConfig.ablation(self.tensor.float())
            else:
                cfg = SteerConfig.clamp(self.tensor.float(), self.value)
            t = SteerTable.from_configs([cfg], d_model=self.tensor.shape[-1], device=device)
            self._cast[key] = t
        return t

    def runner(self, device: torch.device) -> Callable:
        """``f(x, mask)`` applying this add / ablate / clamp edit: the fused kernel call bound once
        per device (:func:`steerkit.kernels.bind_steer`), what a hook calls at every step."""
        key = ("run", device)
        f = self._cast.get(key)
        if f is None:
            from steerkit.kernels import bind_steer
            f = self._cast[key] = bind_steer(self.table(device))
        return f

    def cast(self, like: Tensor) -> Tensor:
        key = (like.device, like.dtype)
        t = self._cast.get(key)
        if t is None:
            t = self.tensor.to(device=like.device, dtype=like.dtype)
            self._cast[key] = t
        return t

    def apply(self, x: Float[Tensor, "batch pos d_model"],
              mask: Optional[Bool[Tensor, "batch pos"]] = None) -> Float[Tensor, "batch pos d_model"]:
        """The edited activations; rows outside ``mask`` are unchanged."""
        if mask is not None and not bool(mask.any()):
            return x
        if self.op == "fn":
            y = self.fn(x)
            if not isinstance(y, Tensor) or y.shape != x.shape:
                raise InputError(f"expected the edit fn to return a tensor of shape {tuple(x.shape)}, "
                                 f"found {getattr(y, 'shape', type(y).__name__)}")
        elif self.op == "replace":
            y = (self.scale * self.cast(x)).expand_as(x)
        else:  # add / ablate / clamp: one fused kernel call
            return self.runner(x.device)(x, mask)
        if mask is None:
            return y
        return torch.where(mask.unsqueeze(-1), y, x)
