"""Pure-torch references of the fused steering edit, one function per step.

Each function is the meaning of the matching part of ``_fused_steer_kernel``:
same inputs (the padded :class:`~steerkit.kernels.config.SteerTable` tensors, a
row -> configuration index ``g`` and an ``active`` row mask), same order, same
float32 accumulation (float64 when the hidden states are float64, which the
gradient checks use). They are differentiable by torch autograd, and they are
what ``impl="torch"`` runs.

Per-row configurations are handled without materialising ``basis[g]``
(``rows x K x d``): the row is multiplied by every configuration's directions
at once and the columns of its own configuration are gathered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

DEFAULT_REGION_TOL = 1e-4
DEFAULT_REGION_MAX_ITER = 1000


def _acc_dtype(h: Tensor) -> torch.dtype:
    return torch.float64 if h.dtype == torch.float64 else torch.float32

def own_coords(x: Float[Tensor, "rows d"], flat: Float[Tensor, "n_k d"], n: int,
               g: Int[Tensor, " rows"]) -> Float[Tensor, "rows k"]:
    """Each row's coordinates along the ``k`` vectors of its own configuration, where ``flat`` stacks
    the ``n`` configurations' vectors (``[n * k, d]``): the row is multiplied by every configuration's
    vectors at once and its own columns are gathered (no ``[rows, k, d]`` gather of the vectors).

    Examples:
        >>> flat = torch.eye(3)  # configuration 0: e0; 1: e1; 2: e2 (k = 1)
        >>> own_coords(torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]), flat, 3, torch.tensor([0, 2])).tolist()
        [[1.0], [3.0]]
    """
    rows = x.shape[0]
    return (x @ flat.T).view(rows, n, flat.shape[0] // n)[torch.arange(rows, device=x.device), g]


def own_combination(u: Float[Tensor, "rows k"], flat: Float[Tensor, "n_k d"], n: int,
                    g: Int[Tensor, " rows"]) -> Float[Tensor, "rows d"]:
    """``sum_i u[:, i] v_i`` over the ``k`` vectors ``v_i`` of each row's own configuration (``flat``
    as for :func:`own_coords`), by one matmul.

    Examples:
        >>> own_combination(torch.tensor([[2.0], [5.0]]), torch.eye(3), 3, torch.tensor([0, 2])).tolist()
        [[2.0, 0.0, 0.0], [0.0, 0.0, 5.0]]
    """
    rows, k = u.shape
    onehot = torch.nn.functional.one_hot(g, n).to(u.dtype)  # [rows, n]
    return (onehot[:, :, None] * u[:, None, :]).reshape(rows, n * k) @ flat


def ablate_ref(
    x: Float[Tensor, "rows d"],
    basis: Float[Tensor, "n_b K d"],
    strength: Float[Tensor, "n K"],
    target: Float[Tensor, "n K"],
    g: Int[Tensor, " rows"],
) -> Float[Tensor, "rows d"]:
    """``x - sum_i strength_i (b_i . x - target_i) b_i`` with the row's own configuration.

    Examples:
        >>> x, g = torch.tensor([[1.0, 2.0, 3.0]]), torch.zeros(1, dtype=torch.long)
        >>> ablate_ref(x, torch.eye(3)[None, :1], torch.ones(1, 1), torch.zeros(1, 1), g).tolist()
        [[0.0, 2.0, 3.0]]
        >>> ablate_ref(x, torch.eye(3)[None, :1], torch.ones(1, 1), torch.full((1, 1), 7.0), g).tolist()  # clamp
        [[7.0, 2.0, 3.0]]
    """
    n_b, K, d = basis.shape
    if n_b == 1:
        p = x @ basis[0].T  # [rows, K]
        u = strength[g] * (p - target[g])
        return x - u @ basis[0]
    flat = basis.reshape(n_b * K, d)
    u = strength[g] * (own_coords(x, flat, n_b, g) - target[g])
    return x - own_combination(u, flat, n_b, g)


def gate_ref(
    x: Float[Tensor, "rows d"],
    gate_dir: Float[Tensor, "n d"],
    gate_thr: Float[Tensor, " n"],
    gate_sign: Float[Tensor, " n"],
    g: Int[Tensor, " rows"],
) -> Float[Tensor, " rows"]:
    """1.0 where the row's gate fires, else 0.0 (no gradient flows through the test).

    Examples:
        >>> x = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])  # cos with e0: 1, 0.71, 0
        >>> g = torch.zeros(3, dtype=torch.long)
        >>> gate_ref(x, torch.tensor([[1.0, 0.0]]), torch.tensor([0.5]), torch.tensor([1.0]), g).tolist()
        [1.0, 1.0, 0.0]
        >>> gate_ref(x, torch.tensor([[1.0, 0.0]]), torch.tensor([0.5]), torch.tensor([-1.0]), g).tolist()  # below
        [0.0, 0.0, 1.0]
    """
    dot = (x * gate_dir[g]).sum(-1)
    nrm = x.norm(dim=-1)
    cos = dot.abs() / nrm.clamp_min(1e-12)
    thr, sgn = gate_thr[g], gate_sign[g]
    fire = (sgn == 0) | ((sgn > 0) & (cos > thr)) | ((sgn < 0) & (cos < thr))
    return fire.to(x.dtype).detach()


def inject_ref(
    x: Float[Tensor, "rows d"],
    add: Float[Tensor, "n d"],
    add_scale: Float[Tensor, " n"],
    layer_weight: float,
    g: Int[Tensor, " rows"],
    fire: Optional[Float[Tensor, " rows"]] = None,
) -> Float[Tensor, "rows d"]:
    """``x + layer_weight * add_scale[g] * add[g]`` on rows where the gate fires.

    Examples:
        >>> inject_ref(torch.zeros(2, 3), torch.eye(3)[:2], torch.tensor([1.0, 2.0]), 1.0, torch.tensor([0, 1])).tolist()
        [[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]]
    """
    a = add_scale[g] * layer_weight
    if fire is not None:
        a = a * fire
    return x + a[:, None] * add[g]


def solve_polyhedron_projection(
    z: Float[Tensor, "rows M"],
    W: Float[Tensor, "rows NH M"],
    c: Float[Tensor, "rows NH"],
    step: Float[Tensor, " rows"],
    tol: float = DEFAULT_REGION_TOL,
    max_iter: int = DEFAULT_REGION_MAX_ITER,
    live: Optional[Tensor] = None,
) -> Tuple[Float[Tensor, "rows M"], int]:
    """Closest point of ``{x : W x <= c}`` to each ``z``: accelerated projected gradient
    (FISTA with gradient restart) on the dual ``min_{lam >= 0} 1/2 |W^T lam|^2 - lam.(W z - c)``,
    with ``x = z - W^T lam`` and step ``1 / ||W||_2^2``.

    Stops when the natural residual ``max |lam - max(0, lam + W x - c)|`` is at most
    ``tol`` for every live row (W's rows are unit vectors, so this bounds the
    constraint violation and the complementarity gap in distance units), or after
    ``max_iter`` iterations. Points already inside give ``lam = 0`` and are returned
    unchanged. Returns the points and the iteration count.

    Examples:
        >>> z = torch.tensor([[3.0, 2.0], [0.5, 0.5]])
        >>> W = torch.eye(2).expand(2, 2, 2)  # the box x <= 1, y <= 1
        >>> x, iters = solve_polyhedron_projection(z, W, torch.ones(2, 2), torch.ones(2))
        >>> x.round(decimals=4).tolist(), iters <= 10
        ([[1.0, 1.0], [0.5, 0.5]], True)
    """
    lam = torch.zeros_like(c)
    y = lam
    t = torch.ones_like(step)
    st = step[:, None]

    def cons(l: Tensor) -> Tuple[Tensor, Tensor]:
        x = z - (W * l[:, :, None]).sum(1)
        return x, (W * x[:, None, :]).sum(2) - c

    def residual(l: Tensor) -> Tensor:
        _, gl = cons(l)
        r = (l - torch.clamp(l + gl, min=0)).abs().amax(-1)
        return r if live is None else torch.where(live, r, torch.zeros_like(r))

    it = 0
    res = residual(lam).amax() if lam.numel() else torch.zeros(())
    while it < max_iter and float(res) > tol:
        _, gy = cons(y)
        lam_new = torch.clamp(y + st * gy, min=0)
        t_new = (1 + torch.sqrt(1 + 4 * t * t)) / 2
        # gradient restart (O'Donoghue & Candes): momentum off where it points uphill
        restart = ((-gy) * (lam_new - lam)).sum(-1) > 0
        beta = torch.where(restart, torch.zeros_like(t), (t - 1) / t_new)
        t_new = torch.where(restart, torch.ones_like(t_new), t_new)
        y = lam_new + beta[:, None] * (lam_new - lam)
        lam, t = lam_new, t_new
        res = residual(lam).amax()
        it += 1
    x, _ = cons(lam)
    return x, it


def region_ref(
    x: Float[Tensor, "rows d"],
    mean: Float[Tensor, "n d"],
    proj: Float[Tensor, "n M d"],
    W: Float[Tensor, "n NH M"],
    c: Float[Tensor, "n NH"],
    s: Float[Tensor, " n"],
    step: Float[Tensor, " n"],
    g: Int[Tensor, " rows"],
    fire: Optional[Float[Tensor, " rows"]] = None,
    live: Optional[Bool[Tensor, " rows"]] = None,
    tol: float = DEFAULT_REGION_TOL,
    max_iter: int = DEFAULT_REGION_MAX_ITER,
) -> Float[Tensor, "rows d"]:
    """``x + s * P^T (z* - z)`` with ``z = P (x - mean)`` and ``z*`` from
    :func:`solve_polyhedron_projection` (solved without gradient: the step is
    treated as a constant offset by autograd).

    Examples:
        >>> x = torch.tensor([[3.0, 2.0, 5.0]])
        >>> mean, proj = torch.zeros(1, 3), torch.eye(3)[None, :2]  # the (x0, x1) plane
        >>> W, c = torch.tensor([[[1.0, 0.0]]]), torch.tensor([[1.0]])  # x0 <= 1
        >>> out = region_ref(x, mean, proj, W, c, torch.ones(1), torch.ones(1), torch.zeros(1, dtype=torch.long))
        >>> out.round(decimals=4).tolist()
        [[1.0, 2.0, 5.0]]
    """
    n, M, d = proj.shape
    flat = proj.reshape(n * M, d)
    z = own_coords(x - mean[g], flat, n, g)
    if fire is not None:
        live = fire > 0 if live is None else (live & (fire > 0))
    with torch.no_grad():
        zs, _ = solve_polyhedron_projection(z.detach(), W[g].to(x.dtype), c[g].to(x.dtype),
                                            step[g].to(x.dtype), tol, max_iter, live)
    delta = s[g][:, None] * (zs - z)
    if fire is not None:
        delta = delta * fire[:, None]
    return x + own_combination(delta, flat, n, g)


def fused_steer_ref(
    h: Float[Tensor, "rows d"],
    table,
    g: Optional[Int[Tensor, " rows"]],
    active: Optional[Bool[Tensor, " rows"]],
    layer_weight: float = 1.0,
    preserve_norm: Union[bool, Bool[Tensor, " rows"]] = False,
    region_tol: float = DEFAULT_REGION_TOL,
    region_max_iter: int = DEFAULT_REGION_MAX_ITER,
) -> Float[Tensor, "rows d"]:
    """The whole fused edit in torch: ablate/clamp, gate, inject, region, norm; rows
    where ``active`` is false are returned unchanged. ``g=None`` means configuration 0
    for every row and ``active=None`` every row active; ``preserve_norm`` for every row, or per row
    (a bool tensor). One configuration on every row without gate or region (what a hook applies at every
    decoding step) runs from the table's prepared tensors (:func:`shared_config`), without gathers.

    Examples:
        >>> from steerkit.kernels import SteerConfig, SteerTable, fused_steer
        >>> table = SteerTable.from_configs([SteerConfig.injection(torch.ones(4), 2.0)])
        >>> h = torch.randn(3, 4)
        >>> torch.allclose(fused_steer_ref(h, table, None, None), h + 2.0)
        True
        >>> torch.equal(fused_steer_ref(h, table, None, torch.tensor([True, False, True]))[1], h[1])
        True
        >>> torch.allclose(fused_steer(h, table, impl="torch"), fused_steer_ref(h, table, None, None))
        True
    """
    acc = _acc_dtype(h)
    per_row_norm = isinstance(preserve_norm, Tensor)
    shared = shared_config(table, acc, h.device, layer_weight) \
        if g is None and active is None and not per_row_norm else None
    if shared is not None:
        return shared_edit(h, shared, bool(preserve_norm))
    x0 = h if h.dtype == acc else h.to(acc)
    if g is None:
        g = torch.zeros(h.shape[0], dtype=torch.long, device=h.device)
    every_row = active is None
    if active is None:
        active = torch.ones(h.shape[0], dtype=torch.bool, device=h.device)
    g = g.long()
    active = active.bool()
    x = x0

    def T(t):
        return None if t is None else t.to(acc)

    if table.has_ablate:
        x = ablate_ref(x, T(table.basis), T(table.strength), T(table.target), g)
    fire = None
    if table.has_gate:
        fire = gate_ref(x, T(table.gate_dir), T(table.gate_thr), T(table.gate_sign), g)
    if table.has_add:
        x = inject_ref(x, T(table.add), T(table.add_scale), layer_weight, g, fire)
    if table.has_region:
        x = region_ref(x, T(table.region_mean), T(table.region_proj), T(table.region_W),
                       T(table.region_c), T(table.region_s), T(table.region_step), g, fire,
                       active, region_tol, region_max_iter)
    if per_row_norm or preserve_norm:
        x = norm_ref(x0, x, preserve_norm if isinstance(preserve_norm, Tensor) else None)
    if every_row:  # no row to keep: skip the select (a new tensor all the same)
        return x.to(h.dtype) if x is not h else h.clone()
    return torch.where(active[:, None], x, x0).to(h.dtype)


def norm_ref(x0: Float[Tensor, "*rows d"], x: Float[Tensor, "*rows d"],
             rows: Optional[Bool[Tensor, " rows"]] = None) -> Float[Tensor, "*rows d"]:
    """``x`` rescaled to the norm of ``x0``, row by row (unchanged where ``x`` is 0, or outside ``rows``).

    Examples:
        >>> norm_ref(torch.tensor([[3.0, 4.0]]), torch.tensor([[1.0, 0.0]])).tolist()
        [[5.0, 0.0]]
    """
    n0 = x0.norm(dim=-1, keepdim=True)
    n1 = x.norm(dim=-1, keepdim=True)
    f = torch.where(n1 > 0, n0 / n1.clamp_min(1e-30), torch.ones_like(n1))
    if rows is not None:
        f = torch.where(rows.to(f.device)[:, None], f, torch.ones_like(f))
    return x * f


@dataclass(frozen=True)
class SharedConfig:
    """One configuration's tensors prepared for every row (:func:`shared_config`): the basis ``B`` ``[K, d]``
    and its transpose ``BT``, the target and strength (``None`` where they are 0 and 1: subtracting 0 and
    multiplying by 1 are exact, so they are skipped), the injection ``scale * w * add`` as one vector, the
    accumulation dtype, and the table tensors they were made from.

    Examples:
        >>> from steerkit.kernels import SteerConfig, SteerTable
        >>> basis = torch.eye(4)[:1]
        >>> table = SteerTable.from_configs([SteerConfig.ablation(basis)])
        >>> shared = shared_config(table, torch.float32, torch.device("cpu"))
        >>> shared.d, tuple(shared.B.shape), shared.target, shared.strength, shared.add
        (4, (1, 4), None, None, None)
    """

    acc: torch.dtype
    d: int
    B: Optional[Tensor]
    BT: Optional[Tensor]
    target: Optional[Tensor]
    strength: Optional[Tensor]
    add: Optional[Tensor]
    src: tuple


def _shared_sources(table) -> tuple:
    return (table.basis, table.strength, table.target, table.add, table.add_scale)


def shared_config(table, acc: torch.dtype, device, layer_weight: float = 1.0) -> Optional[SharedConfig]:
    """The table's one configuration prepared for every row, made on first use and kept on the table (made
    again if the table's tensors were replaced since); ``None`` when the table holds more than one
    configuration, a gate or a region, or tensors that require grad.

    Examples:
        >>> from steerkit.kernels import SteerConfig, SteerTable
        >>> table = SteerTable.from_configs([SteerConfig.injection(torch.ones(4), 2.0)])
        >>> shared = shared_config(table, torch.float32, torch.device("cpu"))
        >>> shared.add.tolist(), shared is shared_config(table, torch.float32, torch.device("cpu"))
        ([2.0, 2.0, 2.0, 2.0], True)
        >>> shared_config(SteerTable.from_configs([SteerConfig.injection(torch.ones(4))] * 2), torch.float32, "cpu")
    """
    key = (acc, str(device), float(layer_weight))
    plans = table._plans
    hit = plans.get(key, False)
    if hit is not False and (hit is None or all(a is b for a, b in zip(hit.src, _shared_sources(table)))):
        return hit
    ok = table.n_configs == 1 and not table.has_gate and not table.has_region \
        and not any(t is not None and t.requires_grad for t in _shared_sources(table))
    plans[key] = _prepare(table, acc, device, layer_weight) if ok else None
    return plans[key]


def _prepare(table, acc: torch.dtype, device, layer_weight: float) -> SharedConfig:
    def c(t):
        return t.to(device=device, dtype=acc)
    B = BT = target = strength = add = None
    if table.has_ablate:
        b = c(table.basis[0])
        B, BT = b.contiguous(), b.T.contiguous()
        t, s = c(table.target[0]), c(table.strength[0])
        target = None if bool((t == 0).all()) else t
        strength = None if bool((s == 1).all()) else s
    if table.has_add:
        add = (c(table.add_scale[0]) * layer_weight) * c(table.add[0])
    return SharedConfig(acc, table.d_model, B, BT, target, strength, add, _shared_sources(table))


def shared_edit(h: Float[Tensor, "*rows d"], s: SharedConfig, preserve_norm: bool = False) -> Float[Tensor, "*rows d"]:
    """:func:`fused_steer_ref` of one prepared configuration on every row of ``h`` (any leading shape):
    ``x - ((x B^T - target) * strength) B + scale * w * add``, then the optional norm preservation, in
    ``s.acc``: the projection is one matmul and the removal one ``addmm`` (inside a decoding step on the CPU
    each torch call costs microseconds).

    Examples:
        >>> from steerkit.kernels import SteerConfig, SteerTable
        >>> s = shared_config(SteerTable.from_configs([SteerConfig.ablation(torch.eye(4)[:1])]), torch.float32, "cpu")
        >>> shared_edit(torch.ones(2, 1, 4), s).tolist()
        [[[0.0, 1.0, 1.0, 1.0]], [[0.0, 1.0, 1.0, 1.0]]]
    """
    x = h if h.dtype == s.acc else h.to(s.acc)
    if s.B is not None and s.BT is not None:
        x2 = x.reshape(-1, s.d)
        p = x2 @ s.BT  # [rows, K]
        if s.target is not None:
            p = p - s.target
        if s.strength is not None:
            p = p * s.strength
        y = torch.addmm(x2, p, s.B, alpha=-1).view(x.shape)
        if s.add is not None:
            y.add_(s.add)  # y is a new tensor: in place is safe
    elif s.add is not None:
        y = x + s.add
    else:
        y = x.clone() if x is h else x
    if preserve_norm:
        y = norm_ref(x, y)
    return y if y.dtype == h.dtype else y.to(h.dtype)
