"""Public entry points: :func:`fused_steer` and the single-step wrappers.

How a call runs:

1. The inputs become a :class:`~steerkit.kernels.config.SteerTable` (given, or
   built from the keyword tensors, differentiably, with validation that costs a
   device sync unless ``validate=False``), a row -> configuration index and a
   row mask. Hidden states of any leading shape are flattened to ``[rows, d]``;
   a ``row_config`` of shape ``[batch]`` for ``h [batch, seq, d]`` is broadcast
   over positions.
2. :func:`~steerkit.kernels._backend.resolve_impl` picks the Triton kernel
   (CUDA tensors, or CPU under ``TRITON_INTERPRET=1``) or the torch reference.
3. Without gradients the kernel (``_launch_fused``, tiles from :func:`launch_params`
   unless ``launch=`` says otherwise) or the reference runs once.
   With gradients, ablation + injection (no gate, region or norm rescale) go
   through :class:`_AblateInjectFn`, whose backward is analytic (a Triton
   kernel or the same formulas in torch); any other combination runs the
   forward kernel and, in backward, differentiates the torch reference
   (recompute).

:func:`bind_steer` makes steps 1-2 once for a table that a hook applies at every
step, and returns a :class:`BoundSteer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from . import _backend
from .config import (MAX_K, Polyhedron, SteerConfig, SteerConfigError, SteerTable, _check_orthonormal,
                     _finite)
from .reference import DEFAULT_REGION_MAX_ITER, DEFAULT_REGION_TOL, fused_steer_ref, table_plan

Number = Union[int, float]
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_D_MODEL = 32768



def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# --------------------------------------------------------------------------- launch settings
@dataclass(frozen=True)
class LaunchParams:
    """Tiles of the forward kernel: ``block_r`` rows per program, swept over d in ``block_d``
    columns (a power of two), ``num_warps`` warps; ``norm_fast`` allows the norm rescale to take
    |x|^2 from the first pass's dot products where the table allows it (False: always the exact
    extra pass). Pass one as ``fused_steer(..., launch=LaunchParams(...))`` to override
    :func:`launch_params`.

    Examples:
        >>> LaunchParams(block_d=256, block_r=16)
        LaunchParams(block_d=256, block_r=16, num_warps=4, norm_fast=True)
        >>> LaunchParams(block_d=300, block_r=16)
        Traceback (most recent call last):
        ...
        steerkit.kernels.config.SteerConfigError: LaunchParams.block_d must be a positive power of two; found 300.
    """

    block_d: int
    block_r: int
    num_warps: int = 4
    norm_fast: bool = True

    def __post_init__(self):
        for name in ("block_d", "block_r", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or v & (v - 1):
                raise SteerConfigError(
                    f"LaunchParams.{name} must be a positive power of two; found {v!r}."
                )


def launch_params(d: int, k: int, dtype: torch.dtype, region: bool, interpret: bool = False) -> LaunchParams:
    """The forward kernel's tiles for ``d`` columns, ``k`` padded directions (1 without a basis),
    hidden states of ``dtype``, with or without a region step, on a GPU or (``interpret``) under
    Triton's CPU interpreter.

    Defaults from the H200 sweep in docs/reproductions/kernels.md (bf16, and the same for float16 and float32):
    16 x 512, 4 warps for k <= 8; 16 x 128, 8 warps for more directions, whose per-chunk basis
    vectors cost registers; 4 rows per program with a region (its solver keeps per-row state in
    registers). The interpreter pays per op, not per element: one chunk per row, 32 rows.

    Examples:
        >>> launch_params(576, 1, torch.bfloat16, region=False)
        LaunchParams(block_d=512, block_r=16, num_warps=4, norm_fast=True)
        >>> launch_params(4096, 16, torch.bfloat16, region=False).num_warps, launch_params(576, 1, torch.float32, True).block_r
        (8, 4)
    """
    del dtype  # the sweep found no dtype that wants other tiles
    if interpret:
        return LaunchParams(block_d=_next_pow2(d), block_r=4 if region else 32, num_warps=4)
    return LaunchParams(block_d=min(_next_pow2(d), 512 if k <= 8 else 128), block_r=4 if region else 16,
                        num_warps=8 if k > 8 else 4)


def _bwd_launch_params(d: int, interpret: bool) -> LaunchParams:
    """Tiles of the backward kernel, which holds whole rows: ``block_d >= d``."""
    block_d = _next_pow2(d)
    block_r = 32 if interpret else max(1, min(16, 16384 // block_d))
    tile = block_r * block_d
    return LaunchParams(block_d=block_d, block_r=block_r,
                        num_warps=4 if tile <= 4096 else 8 if tile <= 8192 else 16, norm_fast=False)


# --------------------------------------------------------------------------- launchers
def _launch_fused(h: Tensor, tab, g: Optional[Tensor], mask: Optional[Tensor], layer_weight: float,
                  preserve_norm: bool, tol: float, max_iter: int, launch: Optional[LaunchParams] = None
                  ) -> Tensor:
    from ._triton import _fused_steer_kernel

    rows, d = h.shape
    out = torch.empty_like(h)
    if rows == 0:
        return out
    K = tab.basis.shape[1] if tab.has_ablate else 1
    lp = launch or launch_params(d, K, h.dtype, tab.has_region, _backend.interpret_mode())
    M = tab.region_proj.shape[1] if tab.has_region else 1
    NH = tab.region_W.shape[1] if tab.has_region else 1
    dummy = h

    def f(t):
        return dummy if t is None else t.detach().contiguous()

    shared = tab.has_ablate and tab.basis.shape[0] == 1
    one_cfg = tab.n_configs == 1
    # |x|^2 from dot products gathered in the first pass (no extra pass over d) where the
    # vectors are the same for every row; a per-program guard falls back to the exact pass.
    norm_fast = lp.norm_fast and bool(preserve_norm) and not (tab.has_gate or tab.has_region) \
        and (shared or not tab.has_ablate) and (one_cfg or not tab.has_add)
    grid = (triton_cdiv(rows, lp.block_r),)
    _fused_steer_kernel[grid](
        h, out, dummy if g is None else g, dummy if mask is None else mask,
        f(tab.basis), f(tab.strength), f(tab.target),
        f(tab.gate_dir), f(tab.gate_thr), f(tab.gate_sign),
        f(tab.add), f(tab.add_scale),
        f(tab.region_mean), f(tab.region_proj), f(tab.region_W), f(tab.region_c),
        f(tab.region_s), f(tab.region_step),
        rows, d, h.stride(0), out.stride(0),
        float(layer_weight), float(tol), int(max_iter),
        K=K, KB=_next_pow2(K), M=M, MB=_next_pow2(M), NH=NH, NHB=_next_pow2(NH),
        BLOCK_R=lp.block_r, BLOCK_D=lp.block_d,
        HAS_IDX=g is not None, HAS_MASK=mask is not None, SHARED_BASIS=shared,
        ONE_CFG=one_cfg,
        HAS_ABLATE=tab.has_ablate, HAS_GATE=tab.has_gate, HAS_ADD=tab.has_add,
        HAS_REGION=tab.has_region, PRESERVE_NORM=bool(preserve_norm), NORM_FAST=norm_fast,
        num_warps=lp.num_warps,
    )
    return out


def triton_cdiv(a: int, b: int) -> int:
    """Ceiling division for positive ints: how many tiles of ``b`` cover ``a``.

    Examples:
        >>> triton_cdiv(576, 512), triton_cdiv(512, 512)
        (2, 1)
    """
    return (a + b - 1) // b


def _launch_ablate_inject_bwd(go: Tensor, h: Tensor, tab, g, mask):
    from ._triton import _ablate_inject_bwd_kernel

    rows, d = go.shape
    K = tab.basis.shape[1] if tab.has_ablate else 1
    dh = torch.empty_like(go)
    pt = torch.zeros(rows, K, device=go.device, dtype=torch.float32)
    q = torch.zeros(rows, K, device=go.device, dtype=torch.float32)
    dv = torch.zeros(rows, device=go.device, dtype=torch.float32)
    if rows == 0:
        return dh, pt, q, dv
    lp = _bwd_launch_params(d, _backend.interpret_mode())
    dummy = go

    def f(t):
        return dummy if t is None else t.detach().contiguous()

    _ablate_inject_bwd_kernel[(triton_cdiv(rows, lp.block_r),)](
        go, h, dh, dummy if g is None else g, dummy if mask is None else mask,
        f(tab.basis), f(tab.strength), f(tab.target), f(tab.add),
        pt, q, dv, rows, d, go.stride(0), h.stride(0), dh.stride(0),
        K=K, KB=_next_pow2(K), BLOCK_R=lp.block_r, BLOCK_D=lp.block_d,
        HAS_IDX=g is not None, HAS_MASK=mask is not None,
        SHARED_BASIS=tab.has_ablate and tab.basis.shape[0] == 1,
        HAS_ABLATE=tab.has_ablate, HAS_ADD=tab.has_add, num_warps=lp.num_warps,
    )
    return dh, pt, q, dv


# --------------------------------------------------------------------------- autograd
def _ablate_inject_bwd_torch(go: Tensor, h: Tensor, tab, gi: Tensor, act: Tensor):
    acc = go.dtype
    rows, d = go.shape
    K = tab.basis.shape[1] if tab.has_ablate else 1
    pt = torch.zeros(rows, K, dtype=acc, device=go.device)
    q = torch.zeros_like(pt)
    dh = go
    if tab.has_ablate:
        n_b = tab.basis.shape[0]
        gb = gi if n_b > 1 else torch.zeros_like(gi)
        flat = tab.basis.reshape(n_b * K, d).to(acc)
        ar = torch.arange(rows, device=go.device)
        p = (h @ flat.T).view(rows, n_b, K)[ar, gb]
        qq = (go @ flat.T).view(rows, n_b, K)[ar, gb]
        pt = (p - tab.target.to(acc)[gi]) * act[:, None]
        q = qq * act[:, None]
        u = tab.strength.to(acc)[gi] * q
        onehot = torch.nn.functional.one_hot(gb, n_b).to(acc)
        dh = go - (onehot[:, :, None] * u[:, None, :]).reshape(rows, n_b * K) @ flat
    dv = (go * tab.add.to(acc)[gi]).sum(-1) * act if tab.has_add else torch.zeros(rows, dtype=acc,
                                                                                   device=go.device)
    return dh, pt, q, dv


class _AblateInjectFn(torch.autograd.Function):
    """out = h - B^T(c*(B h - t)) + w*alpha*v on active rows; analytic backward."""

    @staticmethod
    def forward(ctx, impl, h, basis, strength, target, add, add_scale, g, mask, layer_weight,
                n_configs, launch):
        tab = SteerTable(n_configs=n_configs, d_model=h.shape[1], basis=basis, strength=strength, target=target,
                         add=add, add_scale=add_scale)
        rows = h.shape[0]
        gi = g.long() if g is not None else torch.zeros(rows, dtype=torch.long, device=h.device)
        act = mask.bool() if mask is not None else torch.ones(rows, dtype=torch.bool, device=h.device)
        if impl == "triton":
            out = _launch_fused(h, tab, g, mask, layer_weight, False, 0.0, 0, launch)
        else:
            with torch.no_grad():
                out = fused_steer_ref(h, tab, gi, act, layer_weight)
        ctx.impl, ctx.tab, ctx.lw = impl, tab, layer_weight
        ctx.save_for_backward(h, gi, act, g if g is not None else gi, mask if mask is not None else act)
        ctx.has_g, ctx.has_mask = g is not None, mask is not None
        return out

    @staticmethod
    def backward(ctx, go):
        h, gi, act_b, g_raw, mask_raw = ctx.saved_tensors
        tab, w = ctx.tab, ctx.lw
        acc = torch.float64 if h.dtype == torch.float64 else torch.float32
        act = act_b.to(acc)
        go = go.contiguous()
        go_acc, h_acc = go.to(acc), h.to(acc)
        if ctx.impl == "triton":
            dh, pt, q, dv = _launch_ablate_inject_bwd(go, h, tab, g_raw if ctx.has_g else None,
                                                      mask_raw if ctx.has_mask else None)
        else:
            dh, pt, q, dv = _ablate_inject_bwd_torch(go_acc, h_acc, tab, gi, act)
        n = tab.n_configs
        rows, d = go.shape
        dB = dc = dt = dV = da = None
        if tab.has_ablate:
            n_b, K = tab.basis.shape[0], tab.basis.shape[1]
            gb = gi if n_b > 1 else torch.zeros_like(gi)
            cg = tab.strength.to(acc)[gi]
            onehot = torch.nn.functional.one_hot(gb, n_b).to(acc)
            A1 = (onehot[:, :, None] * (-cg * pt)[:, None, :]).reshape(rows, n_b * K)
            A2 = (onehot[:, :, None] * (-cg * q)[:, None, :]).reshape(rows, n_b * K)
            if ctx.needs_input_grad[2]:
                dB = (A1.T @ go_acc + A2.T @ h_acc).view(n_b, K, d).to(tab.basis.dtype)
            if ctx.needs_input_grad[3]:
                dc = torch.zeros(n, K, dtype=acc, device=h.device).index_add_(0, gi, -pt * q)
                dc = dc.to(tab.strength.dtype)
            if ctx.needs_input_grad[4]:
                dt = torch.zeros(n, K, dtype=acc, device=h.device).index_add_(0, gi, cg * q)
                dt = dt.to(tab.target.dtype)
        if tab.has_add:
            if ctx.needs_input_grad[5]:
                coef = tab.add_scale.to(acc)[gi] * w * act
                dV = torch.zeros(n, d, dtype=acc, device=h.device).index_add_(0, gi, go_acc * coef[:, None])
                dV = dV.to(tab.add.dtype)
            if ctx.needs_input_grad[6]:
                da = torch.zeros(n, dtype=acc, device=h.device).index_add_(0, gi, dv.to(acc) * w)
                da = da.to(tab.add_scale.dtype)
        return None, dh.to(h.dtype), dB, dc, dt, dV, da, None, None, None, None, None


_TAB_FIELDS = ("basis", "strength", "target", "gate_dir", "gate_thr", "gate_sign", "add", "add_scale",
               "region_mean", "region_proj", "region_W", "region_c", "region_s", "region_step")


class _RecomputeFn(torch.autograd.Function):
    """Forward with the Triton kernel; backward by differentiating the torch reference."""

    @staticmethod
    def forward(ctx, h, g, active, mask, meta, *tensors):
        tab = SteerTable(n_configs=meta["n_configs"], d_model=h.shape[1],
                         **dict(zip(_TAB_FIELDS, tensors)))
        ctx.meta = meta
        ctx.save_for_backward(h, g, active, *[t if t is not None else torch.empty(0) for t in tensors])
        ctx.present = [t is not None for t in tensors]
        return _launch_fused(h, tab, meta["g_raw"], mask, meta["layer_weight"], meta["preserve_norm"],
                             meta["tol"], meta["max_iter"], meta["launch"])

    @staticmethod
    def backward(ctx, go):
        h, g, active, *ts = ctx.saved_tensors
        ts = [t if p else None for t, p in zip(ts, ctx.present)]
        meta = ctx.meta
        with torch.enable_grad():
            hh = h.detach().requires_grad_(ctx.needs_input_grad[0])
            leaves = [None if t is None else t.detach().requires_grad_(ctx.needs_input_grad[5 + i])
                      for i, t in enumerate(ts)]
            tab = SteerTable(n_configs=meta["n_configs"], d_model=h.shape[1],
                             **dict(zip(_TAB_FIELDS, leaves)))
            out = fused_steer_ref(hh, tab, g, active, meta["layer_weight"], meta["preserve_norm"],
                                  meta["tol"], meta["max_iter"])
            # backward runs only when h or a table tensor requires grad: inputs is never empty
            inputs = [t for t in (hh, *leaves) if t is not None and t.requires_grad]
            grads = torch.autograd.grad(out, inputs, go, allow_unused=True)
        it = iter(grads)
        dh = next(it) if hh.requires_grad else None
        dts = [next(it) if (t is not None and t.requires_grad) else None for t in leaves]
        return (dh, None, None, None, None, *dts)


# --------------------------------------------------------------------------- table from tensors
def _as_f(t, device, dtype) -> Tensor:
    return t.to(device=device, dtype=dtype) if isinstance(t, Tensor) else torch.tensor(
        float(t), device=device, dtype=dtype)


def _n_from(*pairs) -> int:
    n = 1
    for t, dim in pairs:
        if isinstance(t, Tensor) and t.dim() == dim and t.shape[0] != 1:
            if n != 1 and t.shape[0] != n:
                raise SteerConfigError(
                    f"per-configuration tensors disagree on the number of configurations: "
                    f"{n} and {t.shape[0]}. Give every per-configuration tensor the same first dimension."
                )
            n = t.shape[0]
    return n


def table_from_tensors(
    d_model: int, device, dtype=torch.float32, *, basis=None, strength=1.0, target=None, add=None,
    scale=1.0, gate_direction=None, gate_threshold=0.0, gate_mode="above", region=None,
    region_strength=1.0, validate: bool = True,
) -> SteerTable:
    """Build a :class:`SteerTable` from the keyword tensors of :func:`fused_steer`, keeping
    autograd history (so gradients reach ``basis``, ``strength``, ``target``, ``add``, ``scale``).
    ``region_strength`` is a number or one per region.

    Examples:
        >>> t = table_from_tensors(8, "cpu", add=torch.ones(2, 8), scale=torch.tensor([1.0, -1.0]))
        >>> t.n_configs, t.add_scale.tolist()
        (2, [1.0, -1.0])
        >>> v = torch.zeros(8, requires_grad=True)  # a trainable steering vector
        >>> fused_steer(torch.ones(3, 8), table_from_tensors(8, "cpu", add=v), impl="torch").sum().backward()
        >>> v.grad.tolist() == [3.0] * 8
        True
    """
    regions = None if region is None else (list(region) if isinstance(region, (list, tuple)) else [region])
    n = _n_from((basis, 3), (strength, 2), (target, 2), (add, 2), (scale, 1), (gate_direction, 2),
                (gate_threshold, 1))
    if regions is not None and len(regions) > 1:
        if n != 1 and len(regions) != n:
            raise SteerConfigError(
                f"region list has {len(regions)} entries but other tensors give {n} configurations."
            )
        n = len(regions)
    tab = SteerTable(n_configs=n, d_model=d_model)
    if basis is not None:
        B = _as_f(basis, device, dtype)
        if B.dim() == 2:
            B = B[None]
        if B.dim() != 3 or B.shape[-1] != d_model:
            raise SteerConfigError(
                f"basis must have shape (k, {d_model}) or (n_configs, k, {d_model}); found "
                f"{tuple(basis.shape)}. Its last dimension must equal h's d_model."
            )
        K = B.shape[1]
        if K > MAX_K or K == 0:
            raise SteerConfigError(
                f"basis must hold 1..{MAX_K} directions (k); found k={K}. Keep the strongest "
                f"{MAX_K} directions, or apply two calls."
            )
        c = _as_f(strength, device, dtype)
        t = _as_f(0.0 if target is None else target, device, dtype)
        for name, v in (("strength", c), ("target", t)):
            if not (v.dim() == 0 or (v.dim() == 1 and v.shape[0] == K)
                    or (v.dim() == 2 and v.shape[1] == K)):
                raise SteerConfigError(
                    f"{name} must be a number, shape ({K},) or (n_configs, {K}); found {tuple(v.shape)}."
                )
        tab.basis = B.contiguous()
        tab.strength = c.expand(n, K).contiguous()
        tab.target = t.expand(n, K).contiguous()
        if validate:
            _check_orthonormal("basis", B)
            for name, v in (("basis", B), ("strength", c), ("target", t)):
                _finite(name, v.detach())
    if add is not None:
        V = _as_f(add, device, dtype)
        if V.dim() == 1:
            V = V[None]
        if V.dim() != 2 or V.shape[-1] != d_model:
            raise SteerConfigError(
                f"add must have shape ({d_model},) or (n_configs, {d_model}); found {tuple(add.shape)}."
            )
        a = _as_f(scale, device, dtype).reshape(-1)
        tab.add = V.expand(n, d_model).contiguous()
        tab.add_scale = a.expand(n).contiguous()
        if validate:
            _finite("add", V.detach())
            _finite("scale", a.detach())
    if gate_direction is not None:
        u = _as_f(gate_direction, device, dtype)
        if u.dim() == 1:
            u = u[None]
        if u.shape[-1] != d_model:
            raise SteerConfigError(
                f"gate_direction must have shape ({d_model},) or (n_configs, {d_model}); found "
                f"{tuple(gate_direction.shape)}."
            )
        if gate_mode not in ("above", "below"):
            raise SteerConfigError(f"gate_mode must be 'above' or 'below'; found {gate_mode!r}.")
        u = u.detach()
        if validate:
            _finite("gate_direction", u)
            if (u.norm(dim=-1) == 0).any():
                raise SteerConfigError("gate_direction is all zeros; give a direction.")
        tab.gate_dir = (u / u.norm(dim=-1, keepdim=True)).expand(n, d_model).contiguous()
        tab.gate_thr = _as_f(gate_threshold, device, dtype).detach().reshape(-1).expand(n).contiguous()
        tab.gate_sign = torch.full((n,), 1.0 if gate_mode == "above" else -1.0, device=device, dtype=dtype)
    if regions is not None:
        if len(regions) == 1 and n > 1:
            regions = regions * n
        rs = torch.as_tensor(region_strength, dtype=torch.float64).detach().reshape(-1).tolist()
        if len(rs) == 1:
            rs = rs * len(regions)
        if len(rs) != len(regions):
            raise SteerConfigError(
                f"region_strength must be a number or one per region ({len(regions)}); found {len(rs)} values."
            )
        rt = SteerTable.from_configs([SteerConfig(region=r, region_strength=s) for r, s in zip(regions, rs)],
                                     d_model=d_model)
        for f in ("region_mean", "region_proj", "region_W", "region_c", "region_s", "region_step"):
            setattr(tab, f, getattr(rt, f).to(device=device, dtype=dtype))
    return tab


# --------------------------------------------------------------------------- public API
def fused_steer(
    h: Float[Tensor, "*batch d_model"],
    table: Optional[SteerTable] = None,
    *,
    basis: Union[None, Float[Tensor, "k d_model"], Float[Tensor, "n_configs k d_model"]] = None,
    strength: Union[Number, Float[Tensor, " k"], Float[Tensor, "n_configs k"]] = 1.0,
    target: Union[None, Number, Float[Tensor, " k"], Float[Tensor, "n_configs k"]] = None,
    add: Union[None, Float[Tensor, " d_model"], Float[Tensor, "n_configs d_model"]] = None,
    scale: Union[Number, Float[Tensor, " n_configs"]] = 1.0,
    gate_direction: Union[None, Float[Tensor, " d_model"], Float[Tensor, "n_configs d_model"]] = None,
    gate_threshold: Union[Number, Float[Tensor, " n_configs"]] = 0.0,
    gate_mode: str = "above",
    region: Union[None, Polyhedron, Sequence[Optional[Polyhedron]]] = None,
    region_strength: Union[Number, Sequence[Number], Float[Tensor, " n_configs"]] = 1.0,
    row_config: Optional[Int[Tensor, "*batch"]] = None,
    mask: Optional[Bool[Tensor, "*batch"]] = None,
    layer_weight: float = 1.0,
    layer: Optional[int] = None,
    preserve_norm: bool = False,
    impl: str = "auto",
    region_tol: float = DEFAULT_REGION_TOL,
    region_max_iter: int = DEFAULT_REGION_MAX_ITER,
    validate: bool = True,
    launch: Optional[LaunchParams] = None,
) -> Float[Tensor, "*batch d_model"]:
    """Apply, per row and in this order, ablation/clamp, gate, injection, region
    projection and norm preservation, each where asked for; returns a new tensor
    of ``h``'s shape and dtype.

    Either pass a prebuilt ``table`` (the fast path for hooks: no host work, no
    sync) or the keyword tensors (``basis [k, d]`` or ``[n, k, d]`` orthonormal,
    ``strength``/``target`` per direction, ``add [n, d]``, ``scale [n]``, gate,
    ``region`` and ``region_strength``, a number or one per region). ``row_config``
    picks each row's configuration (``[batch]`` is broadcast over the positions of
    ``h [batch, seq, d]``); rows where ``mask``
    is false are returned unchanged. The injection is scaled by ``layer_weight``
    times the table's schedule weight for ``layer``. The region's polyhedron
    projection stops at natural residual ``region_tol`` (distance units) or
    ``region_max_iter`` iterations. ``launch`` overrides the Triton kernel's tiles
    (default: :func:`launch_params`); the torch reference ignores it.

    Examples:
        >>> h = torch.randn(2, 3, 8)
        >>> out = fused_steer(h, basis=torch.eye(8)[:1], add=torch.ones(8), scale=0.5)  # ablate e0, then add
        >>> out[..., 0].unique().tolist(), torch.allclose(out[..., 1:], h[..., 1:] + 0.5)
        ([0.5], True)
        >>> table = SteerTable.from_configs([SteerConfig.injection(torch.ones(8)), SteerConfig.injection(torch.ones(8), -2.0)])
        >>> fused_steer(torch.zeros(3, 8), table, row_config=torch.tensor([0, 1, 1]))[:, 0].tolist()
        [1.0, -2.0, -2.0]
    """
    if (table is not None and not validate and row_config is None and mask is None and layer is None
            and _torch_path(h, table, impl)):
        # the per-step hook path on CPU: no checks (validate=False), straight to the reference
        # (which takes the table's prepared plan when it has one configuration)
        return fused_steer_ref(h.reshape(-1, h.shape[-1]), table, None, None, layer_weight, preserve_norm,
                               region_tol, region_max_iter).reshape(h.shape)
    if not isinstance(h, Tensor):
        raise SteerConfigError(f"h must be a torch.Tensor [rows, d_model]; found {type(h).__name__}.")
    if h.dim() < 1:
        raise SteerConfigError("h must have at least one dimension (d_model); found a scalar.")
    if h.dtype not in _FLOAT_DTYPES + (torch.float64,):
        raise SteerConfigError(
            f"h must be float32, float16 or bfloat16; found {h.dtype}. Cast the hidden states first."
        )
    lead = h.shape[:-1]
    d = h.shape[-1]
    if d > MAX_D_MODEL:
        raise SteerConfigError(f"d_model must be at most {MAX_D_MODEL}; found {d}.")
    h2 = h.reshape(-1, d)
    if h2.stride(-1) != 1:
        h2 = h2.contiguous()
    rows = h2.shape[0]
    acc = torch.float64 if h.dtype == torch.float64 else torch.float32

    kw_given = any(v is not None for v in (basis, target, add, gate_direction, region))
    if table is not None:
        if kw_given:
            raise SteerConfigError(
                "pass either table= or the keyword tensors (basis, add, gate_direction, region), not both."
            )
        if table.d_model != d:
            raise SteerConfigError(
                f"table is for d_model={table.d_model} but h has d_model={d}; build the table for this model."
            )
        tab = table
        ref = next((getattr(tab, f) for f in _TAB_FIELDS if getattr(tab, f) is not None), None)
        if ref is not None and ref.device != h.device:
            raise SteerConfigError(
                f"table is on {ref.device} but h is on {h.device}; call table.to(h.device) once."
            )
        if layer is not None:
            layer_weight = layer_weight * tab.layer_weight(layer)
    else:
        tab = table_from_tensors(d, h.device, acc, basis=basis, strength=strength, target=target,
                                 add=add, scale=scale, gate_direction=gate_direction,
                                 gate_threshold=gate_threshold, gate_mode=gate_mode, region=region,
                                 region_strength=region_strength, validate=validate)

    g = None
    if row_config is not None:
        if row_config.dtype.is_floating_point or row_config.dtype == torch.bool:
            raise SteerConfigError(
                f"row_config must be an integer tensor; found {row_config.dtype}. Use .long()."
            )
        rc = row_config
        if rc.shape != lead:
            if h.dim() == 3 and rc.shape == lead[:1]:
                rc = rc[:, None].expand(lead)
            else:
                raise SteerConfigError(
                    f"row_config must have shape {tuple(lead)} (one index per row) or "
                    f"({lead[0] if len(lead) else 1},) per sequence; found {tuple(row_config.shape)}."
                )
        g = rc.reshape(-1).to(device=h.device, dtype=torch.int32).contiguous()
        if validate and rows:
            lo, hi = int(g.min()), int(g.max())
            if lo < 0 or hi >= tab.n_configs:
                raise SteerConfigError(
                    f"row_config values must be in [0, {tab.n_configs}); found range [{lo}, {hi}]. "
                    "Index the configurations of the table (or the first dim of the per-config tensors)."
                )
    mk = None
    if mask is not None:
        if mask.shape != lead:
            raise SteerConfigError(
                f"mask must have shape {tuple(lead)} (one flag per row); found {tuple(mask.shape)}."
            )
        mk = mask.reshape(-1).to(device=h.device, dtype=torch.int8).contiguous()

    which = _backend.resolve_impl(impl, h)
    if which == "triton" and h.dtype == torch.float64:
        raise SteerConfigError(
            "impl='triton' supports float32, float16 and bfloat16; found float64. Use impl='torch'."
        )
    tensors = [getattr(tab, f) for f in _TAB_FIELDS]
    if which == "triton":
        tensors = [None if t is None else t.to(torch.float32) for t in tensors]
        tab = SteerTable(n_configs=tab.n_configs, d_model=d, **dict(zip(_TAB_FIELDS, tensors)),
                         schedule=tab.schedule)
    needs_grad = torch.is_grad_enabled() and (
        h.requires_grad or any(t is not None and t.requires_grad for t in tensors))
    simple = not (tab.has_gate or tab.has_region or preserve_norm)
    def _gi_active():  # only the torch paths need these (no extra launches on the kernel path)
        gi = g.long() if g is not None else torch.zeros(rows, dtype=torch.long, device=h.device)
        active = mk.bool() if mk is not None else torch.ones(rows, dtype=torch.bool, device=h.device)
        return gi, active

    if not (tab.has_ablate or tab.has_add or tab.has_region or preserve_norm):
        out = h2.clone()  # nothing asked for (a gate alone steers nothing)
    elif needs_grad and simple and (tab.has_ablate or tab.has_add):
        out = _AblateInjectFn.apply(which, h2, tab.basis, tab.strength, tab.target, tab.add,
                                    tab.add_scale, g, mk, float(layer_weight), tab.n_configs, launch)
    elif which == "torch" and g is None and mk is None:
        out = fused_steer_ref(h2, tab, None, None, layer_weight, preserve_norm, region_tol,
                              region_max_iter)
    elif which == "torch":
        gi, active = _gi_active()
        out = fused_steer_ref(h2, tab, gi, active, layer_weight, preserve_norm, region_tol,
                              region_max_iter)
    elif needs_grad:
        gi, active = _gi_active()
        meta = dict(n_configs=tab.n_configs, g_raw=g, layer_weight=float(layer_weight),
                    preserve_norm=preserve_norm, tol=region_tol, max_iter=region_max_iter, launch=launch)
        out = _RecomputeFn.apply(h2, gi, active, mk, meta, *tensors)
    else:
        out = _launch_fused(h2, tab, g, mk, layer_weight, preserve_norm, region_tol, region_max_iter,
                            launch)
    return out.reshape(h.shape)


def _torch_path(h: Tensor, table: SteerTable, impl: str) -> bool:
    """Whether an unvalidated one-table call on ``h`` runs the torch reference (not Triton, no autograd)."""
    if h.is_cuda or (h.requires_grad and torch.is_grad_enabled()) or table.d_model != h.shape[-1]:
        return False
    return (_backend.get_impl() if impl == "auto" else impl) in ("auto", "torch")


class BoundSteer:
    """``f(h, mask=None, row_config=None)`` = ``fused_steer(h, table, mask=mask,
    row_config=row_config, layer_weight=..., preserve_norm=..., impl=<impl>, validate=False)``
    with the implementation chosen once, by :func:`bind_steer`. Made by :func:`bind_steer`.

    Examples:
        >>> f = bind_steer(SteerTable.from_configs([SteerConfig.injection(torch.ones(8), 2.0)]), device="cpu",
        ...                dtype=torch.float32)
        >>> isinstance(f, BoundSteer), f.impl, f(torch.zeros(1, 3, 8))[0, :, 0].tolist()
        (True, 'torch', [2.0, 2.0, 2.0])
        >>> f(torch.zeros(1, 3, 8), mask=torch.tensor([[True, False, True]]))[0, :, 0].tolist()
        [2.0, 0.0, 2.0]
    """

    __slots__ = ("table", "impl", "device", "dtype", "layer_weight", "preserve_norm")

    def __init__(self, table: SteerTable, impl: str, device: torch.device, dtype: torch.dtype,
                 layer_weight: float, preserve_norm: bool):
        self.table, self.impl, self.device, self.dtype = table, impl, device, dtype
        self.layer_weight, self.preserve_norm = float(layer_weight), bool(preserve_norm)

    def __call__(self, h: Float[Tensor, "*batch d_model"], mask: Optional[Bool[Tensor, "*batch"]] = None,
                 row_config: Optional[Int[Tensor, "*batch"]] = None) -> Float[Tensor, "*batch d_model"]:
        return fused_steer(h, self.table, mask=mask, row_config=row_config, layer_weight=self.layer_weight,
                           preserve_norm=self.preserve_norm, impl=self.impl, validate=False)

    def _extra(self) -> str:
        return ""

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(impl={self.impl!r}{self._extra()}, n_configs={self.table.n_configs}, "
                f"d_model={self.table.d_model}, device={str(self.device)!r}, dtype={self.dtype}, "
                f"layer_weight={self.layer_weight}, preserve_norm={self.preserve_norm})")


class _PlannedSteer(BoundSteer):
    """:class:`BoundSteer` whose unmasked calls without ``row_config`` on the bound dtype are the
    table's prepared plan (:class:`~steerkit.kernels.reference.OneConfigPlan`), nothing else."""

    __slots__ = ("plan", "fn")

    def __init__(self, table, impl, device, dtype, layer_weight, preserve_norm, plan):
        super().__init__(table, impl, device, dtype, layer_weight, preserve_norm)
        self.plan, self.fn = plan, plan.fn

    def __call__(self, h: Float[Tensor, "*batch d_model"], mask: Optional[Bool[Tensor, "*batch"]] = None,
                 row_config: Optional[Int[Tensor, "*batch"]] = None) -> Float[Tensor, "*batch d_model"]:
        if mask is None and row_config is None and h.dtype is self.dtype:
            return self.fn(h)
        return fused_steer(h, self.table, mask=mask, row_config=row_config, layer_weight=self.layer_weight,
                           preserve_norm=self.preserve_norm, impl=self.impl, validate=False)

    def _extra(self) -> str:
        return ", plan=OneConfigPlan"


def bind_steer(table: SteerTable, *, device: Union[str, torch.device], dtype: torch.dtype, impl: str = "auto",
               layer_weight: float = 1.0, preserve_norm: bool = False) -> BoundSteer:
    """``table`` bound for hidden states on ``device`` in ``dtype``, for a hook that applies it at
    every step: ``f(h, mask=None, row_config=None)`` is ``fused_steer(h, table, mask=mask,
    row_config=row_config, layer_weight=layer_weight, preserve_norm=preserve_norm, validate=False)``.

    The implementation is chosen here, once (:func:`~steerkit.kernels._backend.resolve_impl_for`:
    ``impl``, or for "auto" the :func:`use_impl` / :func:`set_impl` override in force now, then the
    device), and the bound call keeps it whatever override is in force when it runs. The table is
    moved to ``device`` here. When the choice is the torch reference and the table holds one
    configuration without gate or region and no tensor that requires grad, its plan
    (:class:`~steerkit.kernels.reference.OneConfigPlan`, accumulating in float64 for float64,
    float32 otherwise) is prepared here, and an unmasked call without ``row_config`` on ``dtype``
    is that plan and nothing else: inside a CPU decode step at batch 1 the general entry point's
    argument handling costs as much as the edit itself. Inputs of another dtype, masks and
    ``row_config`` take :func:`fused_steer` with the bound choice.

    Examples:
        >>> table = SteerTable.from_configs([SteerConfig.injection(torch.ones(8), 2.0)])
        >>> f = bind_steer(table, device="cpu", dtype=torch.float32, layer_weight=0.5)
        >>> f(torch.zeros(2, 8))[:, 0].tolist(), f.impl
        ([1.0, 1.0], 'torch')
    """
    if not isinstance(table, SteerTable):
        raise SteerConfigError(f"bind_steer needs a SteerTable; found {type(table).__name__}. "
                               "Build one with SteerTable.from_configs(...).")
    if dtype not in _FLOAT_DTYPES + (torch.float64,):
        raise SteerConfigError(
            f"bind_steer dtype must be float32, float16, bfloat16 or float64; found {dtype}. "
            "Pass the dtype of the hidden states the hook will see."
        )
    dev = device if isinstance(device, torch.device) else torch.device(device)
    which = _backend.resolve_impl_for(impl, dev)
    if which == "triton" and dtype == torch.float64:
        raise SteerConfigError(
            "impl='triton' supports float32, float16 and bfloat16; found float64. Use impl='torch'."
        )
    ref = next((getattr(table, f) for f in _TAB_FIELDS if getattr(table, f) is not None), None)
    tab = table if ref is None or ref.device == dev else table.to(dev)
    if which == "torch":
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        plan = table_plan(tab, acc, dev, float(layer_weight), bool(preserve_norm))
        if plan is not None:
            return _PlannedSteer(tab, which, dev, dtype, layer_weight, preserve_norm, plan)
    return BoundSteer(tab, which, dev, dtype, layer_weight, preserve_norm)


def ablate(
    h: Float[Tensor, "*batch d_model"],
    basis: Union[Float[Tensor, "k d_model"], Float[Tensor, "n_configs k d_model"]],
    strength: Union[Number, Float[Tensor, " k"], Float[Tensor, "n_configs k"]] = 1.0,
    *,
    row_config: Optional[Int[Tensor, "*batch"]] = None,
    mask: Optional[Bool[Tensor, "*batch"]] = None,
    preserve_norm: bool = False,
    impl: str = "auto",
) -> Float[Tensor, "*batch d_model"]:
    """Directional ablation ``h - B^T (c * (B h))`` (see :func:`fused_steer`).

    Examples:
        >>> h, u = torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[0.0, 1.0, 0.0]])
        >>> ablate(h, u).tolist(), ablate(h, u, 0.5).tolist()
        ([[1.0, 0.0, 3.0]], [[1.0, 1.0, 3.0]])
    """
    return fused_steer(h, basis=basis, strength=strength, row_config=row_config, mask=mask,
                       preserve_norm=preserve_norm, impl=impl)


def clamp(
    h: Float[Tensor, "*batch d_model"],
    directions: Union[Float[Tensor, " d_model"], Float[Tensor, "k d_model"]],
    value: Union[Number, Float[Tensor, " k"], Float[Tensor, "n_configs k"]],
    *,
    row_config: Optional[Int[Tensor, "*batch"]] = None,
    mask: Optional[Bool[Tensor, "*batch"]] = None,
    impl: str = "auto",
) -> Float[Tensor, "*batch d_model"]:
    """Set the projection of each row on each (orthonormal) direction to ``value``.

    Examples:
        >>> clamp(torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([1.0, 0.0, 0.0]), 5.0).tolist()
        [[5.0, 2.0, 3.0]]
    """
    B = directions if directions.dim() >= 2 else directions[None]
    return fused_steer(h, basis=B, strength=1.0, target=value, row_config=row_config, mask=mask,
                       impl=impl)


def inject(
    h: Float[Tensor, "*batch d_model"],
    add: Union[Float[Tensor, " d_model"], Float[Tensor, "n_configs d_model"]],
    scale: Union[Number, Float[Tensor, " n_configs"]] = 1.0,
    *,
    layer_weight: float = 1.0,
    row_config: Optional[Int[Tensor, "*batch"]] = None,
    mask: Optional[Bool[Tensor, "*batch"]] = None,
    gate_direction: Optional[Tensor] = None,
    gate_threshold: Union[Number, Tensor] = 0.0,
    gate_mode: str = "above",
    preserve_norm: bool = False,
    impl: str = "auto",
) -> Float[Tensor, "*batch d_model"]:
    """Injection ``h + layer_weight * scale * add`` (optionally gated; see :func:`fused_steer`).

    Examples:
        >>> inject(torch.zeros(2, 3), torch.tensor([1.0, 0.0, 0.0]), 4.0).tolist()
        [[4.0, 0.0, 0.0], [4.0, 0.0, 0.0]]
        >>> h = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])  # only rows along e0 get e2
        >>> inject(h, torch.tensor([0.0, 0.0, 1.0]), gate_direction=torch.tensor([1.0, 0.0, 0.0]),
        ...        gate_threshold=0.5).tolist()
        [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]
    """
    return fused_steer(h, add=add, scale=scale, layer_weight=layer_weight, row_config=row_config,
                       mask=mask, gate_direction=gate_direction, gate_threshold=gate_threshold,
                       gate_mode=gate_mode, preserve_norm=preserve_norm, impl=impl)


def project_region(
    h: Float[Tensor, "*batch d_model"],
    region: Union[Polyhedron, Sequence[Optional[Polyhedron]]],
    strength: Union[Number, Sequence[Number], Float[Tensor, " n_configs"]] = 1.0,
    *,
    row_config: Optional[Int[Tensor, "*batch"]] = None,
    mask: Optional[Bool[Tensor, "*batch"]] = None,
    tol: float = DEFAULT_REGION_TOL,
    max_iter: int = DEFAULT_REGION_MAX_ITER,
    impl: str = "auto",
) -> Float[Tensor, "*batch d_model"]:
    """Move each row towards its region: ``h + s P^T (z* - z)`` with ``s = strength`` (a number or
    one per region; see :class:`Polyhedron`).

    Examples:
        >>> region = Polyhedron(torch.zeros(3), torch.eye(3)[:2], normals=torch.tensor([[1.0, 0.0]]),
        ...                 offsets=torch.tensor([1.0]))  # x0 <= 1 in the (x0, x1) plane
        >>> project_region(torch.tensor([[3.0, 2.0, 5.0]]), region).round(decimals=4).tolist()
        [[1.0, 2.0, 5.0]]
        >>> project_region(torch.tensor([[3.0, 2.0, 5.0]]), region, 0.5).round(decimals=4).tolist()
        [[2.0, 2.0, 5.0]]
    """
    return fused_steer(h, region=region, region_strength=strength, row_config=row_config, mask=mask, region_tol=tol,
                       region_max_iter=max_iter, impl=impl)
