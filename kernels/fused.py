"""Public entry points: :func:`fused_steer` and the single-step wrappers.

How a call runs:

1. The inputs become a :class:`~steerkit.kernels.config.SteerTable` (given, or
   built from the keyword tensors by :func:`~steerkit.kernels.config.table_from_tensors`,
   differentiably, with validation that costs a device sync unless ``validate=False``),
   a row -> configuration index and a row mask. Hidden states of any leading shape are flattened to ``[rows, d]``;
   a ``row_config`` of shape ``[batch]`` for ``h [batch, seq, d]`` is broadcast
   over positions.
2. :func:`~steerkit.kernels._backend.resolve_impl` picks the Triton kernel
   (CUDA tensors, or CPU under ``TRITON_INTERPRET=1``) or the torch reference.
3. Without gradients the kernel (``_launch_fused``, tiles from
   :func:`~steerkit.kernels.launch.launch_params` unless ``launch=`` says otherwise)
   or the reference runs once.
   With gradients, ablation + injection (no gate, region or norm rescale) go
   through :class:`_AblateInjectFn`, whose backward is analytic (a Triton
   kernel or the same formulas in torch); any other combination runs the
   forward kernel and, in backward, differentiates the torch reference
   (recompute).

:func:`bind_steer` makes steps 1-2 once for a table that a hook applies at every
step, and returns a :class:`BoundSteer`.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from . import _backend
from .config import SteerConfig  # noqa: F401 - the examples build tables from it
from .config import _TAB_FIELDS, Polyhedron, SteerConfigError, SteerTable, table_from_tensors
from .launch import LaunchParams, _bwd_launch_params, _next_pow2, launch_params, triton_cdiv
from .reference import (DEFAULT_REGION_MAX_ITER, DEFAULT_REGION_TOL, SharedConfig, fused_steer_ref, own_combination,
                        own_coords, shared_config, shared_edit)

Number = Union[int, float]
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_D_MODEL = 32768


# --------------------------------------------------------------------------- launchers
def _launch_fused(h: Tensor, tab, g: Optional[Tensor], mask: Optional[Tensor], layer_weight: float,
                  preserve_norm: bool, tol: float, max_iter: int, launch: Optional[LaunchParams] = None, *,
                  out: Optional[Tensor] = None, residual: Optional[Tensor] = None, flag: Optional[Tensor] = None,
                  row_norm: Optional[Tensor] = None) -> Tensor:
    """Launch the fused kernel on the rows of ``h`` ``[rows, d]``. By default the result is a new tensor;
    ``out=h`` edits ``h`` in place, writing only the rows that change; with ``residual`` (in place only) the
    rows are ``h + residual`` and an edited row becomes ``residual = edited``, ``h = 0``. ``flag``: a device
    int32 scalar; 0 leaves every row untouched. ``row_norm``: norm preservation per configuration (float,
    nonzero: kept), instead of ``preserve_norm`` for every row. Negative entries of ``g`` leave their row
    untouched."""
    from ._triton import _fused_steer_kernel

    rows, d = h.shape
    in_place = out is not None
    if in_place and out is not h:
        raise SteerConfigError("expected out=h (an edit in place) or no out, found another tensor")
    if residual is not None and not in_place:
        raise SteerConfigError("expected out=h with residual= (the pair is edited in place), found no out")
    out = out if out is not None else torch.empty_like(h)
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
    preserve = bool(preserve_norm) or row_norm is not None
    # |x|^2 from dot products gathered in the first pass (no extra pass over d) where the
    # vectors are the same for every row; a per-program guard falls back to the exact pass.
    norm_fast = lp.norm_fast and preserve and row_norm is None and not (tab.has_gate or tab.has_region) \
        and (shared or not tab.has_ablate) and (one_cfg or not tab.has_add)
    grid = (triton_cdiv(rows, lp.block_r),)
    _fused_steer_kernel[grid](
        h, out, dummy if residual is None else residual, dummy if g is None else g,
        dummy if mask is None else mask, dummy if flag is None else flag, dummy if row_norm is None else f(row_norm),
        f(tab.basis), f(tab.strength), f(tab.target),
        f(tab.gate_dir), f(tab.gate_thr), f(tab.gate_sign),
        f(tab.add), f(tab.add_scale),
        f(tab.region_mean), f(tab.region_proj), f(tab.region_W), f(tab.region_c),
        f(tab.region_s), f(tab.region_step),
        rows, d, h.stride(0), out.stride(0), h.stride(0) if residual is None else residual.stride(0),
        float(layer_weight), float(tol), int(max_iter),
        K=K, KB=_next_pow2(K), M=M, MB=_next_pow2(M), NH=NH, NHB=_next_pow2(NH),
        BLOCK_R=lp.block_r, BLOCK_D=lp.block_d,
        HAS_IDX=g is not None, HAS_MASK=mask is not None, SHARED_BASIS=shared,
        ONE_CFG=one_cfg,
        HAS_ABLATE=tab.has_ablate, HAS_GATE=tab.has_gate, HAS_ADD=tab.has_add,
        HAS_REGION=tab.has_region, PRESERVE_NORM=preserve, NORM_FAST=norm_fast,
        IN_PLACE=in_place, RESID=residual is not None, HAS_FLAG=flag is not None, ROW_NORM=row_norm is not None,
        num_warps=lp.num_warps,
    )
    return out


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
        pt = (own_coords(h, flat, n_b, gb) - tab.target.to(acc)[gi]) * act[:, None]
        q = own_coords(go, flat, n_b, gb) * act[:, None]
        dh = go - own_combination(tab.strength.to(acc)[gi] * q, flat, n_b, gb)
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
    (default: :func:`~steerkit.kernels.launch.launch_params`); the torch reference ignores it.

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
    h2 = _rows_of(h)
    if table is not None:
        if any(v is not None for v in (basis, target, add, gate_direction, region)):
            raise SteerConfigError(
                "pass either table= or the keyword tensors (basis, add, gate_direction, region), not both."
            )
        tab = _checked_table(table, h)
        if layer is not None:
            layer_weight = layer_weight * tab.layer_weight(layer)
    else:
        acc = torch.float64 if h.dtype == torch.float64 else torch.float32
        tab = table_from_tensors(h.shape[-1], h.device, acc, basis=basis, strength=strength, target=target,
                                 add=add, scale=scale, gate_direction=gate_direction,
                                 gate_threshold=gate_threshold, gate_mode=gate_mode, region=region,
                                 region_strength=region_strength, validate=validate)
    g = None if row_config is None else _row_index(row_config, h, tab.n_configs, validate)
    mk = None if mask is None else _row_mask(mask, h)
    which = _backend.resolve_impl(impl, h)
    if which == "triton" and h.dtype == torch.float64:
        raise SteerConfigError(
            "impl='triton' supports float32, float16 and bfloat16; found float64. Use impl='torch'."
        )
    out = _run(h2, tab, g, mk, which, layer_weight, preserve_norm, region_tol, region_max_iter, launch)
    return out.reshape(h.shape)


def _rows_of(h: Tensor) -> Tensor:
    """``h`` checked (a float tensor of at most :data:`MAX_D_MODEL` columns) and flattened to
    ``[rows, d]`` with unit column stride."""
    if not isinstance(h, Tensor):
        raise SteerConfigError(f"h must be a torch.Tensor [rows, d_model]; found {type(h).__name__}.")
    if h.dim() < 1:
        raise SteerConfigError("h must have at least one dimension (d_model); found a scalar.")
    if h.dtype not in _FLOAT_DTYPES + (torch.float64,):
        raise SteerConfigError(
            f"h must be float32, float16 or bfloat16; found {h.dtype}. Cast the hidden states first."
        )
    d = h.shape[-1]
    if d > MAX_D_MODEL:
        raise SteerConfigError(f"d_model must be at most {MAX_D_MODEL}; found {d}.")
    h2 = h.reshape(-1, d)
    return h2.contiguous() if h2.stride(-1) != 1 else h2


def _checked_table(table: SteerTable, h: Tensor) -> SteerTable:
    """``table``, checked against ``h``: the same d_model, on the same device."""
    d = h.shape[-1]
    if table.d_model != d:
        raise SteerConfigError(
            f"table is for d_model={table.d_model} but h has d_model={d}; build the table for this model."
        )
    ref = next((getattr(table, f) for f in _TAB_FIELDS if getattr(table, f) is not None), None)
    if ref is not None and ref.device != h.device:
        raise SteerConfigError(
            f"table is on {ref.device} but h is on {h.device}; call table.to(h.device) once."
        )
    return table


def _row_index(row_config: Tensor, h: Tensor, n_configs: int, validate: bool) -> Tensor:
    """Each row's configuration as a flat int32 tensor on ``h``'s device (``[batch]`` for ``h [batch,
    seq, d]`` broadcast over positions); with ``validate``, checked to index the table."""
    lead = h.shape[:-1]
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
    if validate and g.numel():
        lo, hi = int(g.min()), int(g.max())
        if lo < 0 or hi >= n_configs:
            raise SteerConfigError(
                f"row_config values must be in [0, {n_configs}); found range [{lo}, {hi}]. "
                "Index the configurations of the table (or the first dim of the per-config tensors)."
            )
    return g


def _row_mask(mask: Tensor, h: Tensor) -> Tensor:
    """The row mask as a flat int8 tensor on ``h``'s device (one flag per row)."""
    lead = h.shape[:-1]
    if mask.shape != lead:
        raise SteerConfigError(
            f"mask must have shape {tuple(lead)} (one flag per row); found {tuple(mask.shape)}."
        )
    return mask.reshape(-1).to(device=h.device, dtype=torch.int8).contiguous()


def _run(h2: Tensor, tab: SteerTable, g: Optional[Tensor], mk: Optional[Tensor], which: str, layer_weight: float,
         preserve_norm: bool, region_tol: float, region_max_iter: int, launch: Optional[LaunchParams]) -> Tensor:
    """The edit of the rows ``h2 [rows, d]`` by ``which`` implementation: the kernel (through the
    autograd functions when gradients are wanted) or the torch reference."""
    rows, d = h2.shape
    tensors = [getattr(tab, f) for f in _TAB_FIELDS]
    if which == "triton":
        tensors = [None if t is None else t.to(torch.float32) for t in tensors]
        tab = SteerTable(n_configs=tab.n_configs, d_model=d, **dict(zip(_TAB_FIELDS, tensors)),
                         schedule=tab.schedule)
    needs_grad = torch.is_grad_enabled() and (
        h2.requires_grad or any(t is not None and t.requires_grad for t in tensors))
    simple = not (tab.has_gate or tab.has_region or preserve_norm)

    def _gi_active():  # only the torch paths need these (no extra launches on the kernel path)
        gi = g.long() if g is not None else torch.zeros(rows, dtype=torch.long, device=h2.device)
        active = mk.bool() if mk is not None else torch.ones(rows, dtype=torch.bool, device=h2.device)
        return gi, active

    if not (tab.has_ablate or tab.has_add or tab.has_region or preserve_norm):
        return h2.clone()  # nothing asked for (a gate alone steers nothing)
    if needs_grad and simple and (tab.has_ablate or tab.has_add):
        return _AblateInjectFn.apply(which, h2, tab.basis, tab.strength, tab.target, tab.add,
                                     tab.add_scale, g, mk, float(layer_weight), tab.n_configs, launch)
    if which == "torch" and g is None and mk is None:
        return fused_steer_ref(h2, tab, None, None, layer_weight, preserve_norm, region_tol, region_max_iter)
    if which == "torch":
        gi, active = _gi_active()
        return fused_steer_ref(h2, tab, gi, active, layer_weight, preserve_norm, region_tol, region_max_iter)
    if needs_grad:
        gi, active = _gi_active()
        meta = dict(n_configs=tab.n_configs, g_raw=g, layer_weight=float(layer_weight),
                    preserve_norm=preserve_norm, tol=region_tol, max_iter=region_max_iter, launch=launch)
        return _RecomputeFn.apply(h2, gi, active, mk, meta, *tensors)
    return _launch_fused(h2, tab, g, mk, layer_weight, preserve_norm, region_tol, region_max_iter, launch)


def _torch_path(h: Tensor, table: SteerTable, impl: str) -> bool:
    """Whether an unvalidated one-table call on ``h`` runs the torch reference (not Triton, no autograd)."""
    if h.is_cuda or (h.requires_grad and torch.is_grad_enabled()) or table.d_model != h.shape[-1]:
        return False
    return (_backend.get_impl() if impl == "auto" else impl) in ("auto", "torch")


class BoundSteer:
    """``f(h, mask=None, row_config=None)`` = ``fused_steer(h, table, mask=mask,
    row_config=row_config, layer_weight=..., preserve_norm=..., impl=<impl>, validate=False)``
    with the implementation chosen once, by :func:`bind_steer`. Made by :func:`bind_steer`. Where the
    choice is the torch reference and the table holds one configuration without gate or region, an unmasked
    call without ``row_config`` on the bound dtype is the reference's prepared form of it
    (:func:`~steerkit.kernels.reference.shared_edit`) and nothing else.

    Examples:
        >>> f = bind_steer(SteerTable.from_configs([SteerConfig.injection(torch.ones(8), 2.0)]), device="cpu",
        ...                dtype=torch.float32)
        >>> isinstance(f, BoundSteer), f.impl, f(torch.zeros(1, 3, 8))[0, :, 0].tolist()
        (True, 'torch', [2.0, 2.0, 2.0])
        >>> f(torch.zeros(1, 3, 8), mask=torch.tensor([[True, False, True]]))[0, :, 0].tolist()
        [2.0, 0.0, 2.0]
    """

    __slots__ = ("table", "impl", "device", "dtype", "layer_weight", "preserve_norm", "shared")

    def __init__(self, table: SteerTable, impl: str, device: torch.device, dtype: torch.dtype,
                 layer_weight: float, preserve_norm: bool, shared: Optional[SharedConfig] = None):
        self.table, self.impl, self.device, self.dtype = table, impl, device, dtype
        self.layer_weight, self.preserve_norm = float(layer_weight), bool(preserve_norm)
        self.shared = shared

    def __call__(self, h: Float[Tensor, "*batch d_model"], mask: Optional[Bool[Tensor, "*batch"]] = None,
                 row_config: Optional[Int[Tensor, "*batch"]] = None) -> Float[Tensor, "*batch d_model"]:
        shared = self.shared
        if shared is not None and mask is None and row_config is None and h.dtype is self.dtype:
            return shared_edit(h, shared, self.preserve_norm)
        return fused_steer(h, self.table, mask=mask, row_config=row_config, layer_weight=self.layer_weight,
                           preserve_norm=self.preserve_norm, impl=self.impl, validate=False)

    def __repr__(self) -> str:
        prepared = ", shared" if self.shared is not None else ""
        return (f"{type(self).__name__}(impl={self.impl!r}{prepared}, n_configs={self.table.n_configs}, "
                f"d_model={self.table.d_model}, device={str(self.device)!r}, dtype={self.dtype}, "
                f"layer_weight={self.layer_weight}, preserve_norm={self.preserve_norm})")


def bind_steer(table: SteerTable, *, device: Union[str, torch.device], dtype: torch.dtype, impl: str = "auto",
               layer_weight: float = 1.0, preserve_norm: bool = False) -> BoundSteer:
    """``table`` bound for hidden states on ``device`` in ``dtype``, for a hook that applies it at
    every step: ``f(h, mask=None, row_config=None)`` is ``fused_steer(h, table, mask=mask,
    row_config=row_config, layer_weight=layer_weight, preserve_norm=preserve_norm, validate=False)``.

    The implementation is chosen here, once (:func:`~steerkit.kernels._backend.resolve_impl_for`:
    ``impl``, or for "auto" the :func:`use_impl` override in force now, then the
    device), and the bound call keeps it whatever override is in force when it runs. The table is
    moved to ``device`` here. When the choice is the torch reference and the table holds one
    configuration without gate or region and no tensor that requires grad, its prepared tensors
    (:func:`~steerkit.kernels.reference.shared_config`, accumulating in float64 for float64,
    float32 otherwise) are made here, and an unmasked call without ``row_config`` on ``dtype``
    runs from them and nothing else: inside a CPU decode step at batch 1 the general entry point's
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
    shared = None
    if which == "torch":
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        shared = shared_config(tab, acc, dev, float(layer_weight))
    return BoundSteer(tab, which, dev, dtype, layer_weight, preserve_norm, shared)


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

