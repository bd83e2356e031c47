"""Triton kernels and their host launchers.

``_fused_steer_kernel`` takes ``BLOCK_R`` rows per program and sweeps d in
``BLOCK_D`` chunks, in float32: pass 1 gathers the row's dot products with its
basis (and ``|h|^2``; with ``NORM_FAST`` also ``h.v`` and the row-independent Gram
matrix, ``B v`` and ``|v|^2``, from which ``|x|^2`` follows); optional passes gather the
gate's cosine, the region's coordinates (then FISTA on the dual, in registers, for the
whole tile until the natural residual is below ``tol``) and, where needed, ``|x|^2``
exactly; the last pass writes the edited rows (ablation/clamp, gated injection, region
step, norm rescale, in the order of the issue). Each basis chunk is loaded once per
chunk and shared by the ``BLOCK_R`` rows; later passes re-read h (from L2). Each pass is a
``@triton.jit`` function of its own (``_dots_pass``, ``_gate_fire``, ``_region_step``,
``_norm_scale``), which Triton inlines into the kernel.

``_ablate_inject_bwd_kernel`` is the backward of ablation + injection: it writes
``dh = g - B^T (c * (B g))`` for active rows and the per-row dot products the
host reduces (with two matmuls) into the gradients of the basis, strengths,
targets, added vectors and scales. Both kernels find their rows with ``_program_rows`` and read
vectors with ``_vec``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _program_rows(idx_ptr, mask_ptr, rows, BLOCK_R: tl.constexpr, HAS_IDX: tl.constexpr, HAS_MASK: tl.constexpr):
    """This program's ``BLOCK_R`` rows: their indices ``r``, ``rmask`` (the rows that exist), each row's
    configuration ``g`` (int64; 0 without ``HAS_IDX``) and ``active`` (existing, not masked out, and with a
    configuration: a negative index leaves its row untouched)."""
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < rows
    active = rmask
    if HAS_IDX:
        g = tl.load(idx_ptr + r, mask=rmask, other=0).to(tl.int64)
        active = active & (g >= 0)
        g = tl.maximum(g, 0)
    else:
        g = tl.zeros([BLOCK_R], dtype=tl.int64)
    if HAS_MASK:
        active = active & (tl.load(mask_ptr + r, mask=rmask, other=0) != 0)
    return r, rmask, g, active


@triton.jit
def _load_chunk(hrow, rrow, d0, ar, d, rmask, RESID: tl.constexpr):
    """Columns ``d0 + ar`` (``ar = tl.arange(0, BLOCK_D)``) of the rows at ``hrow``: ``cols``, ``cmask``
    (the columns that exist), the tile's mask ``m2`` and the chunk of h as float32 ``[BLOCK_R, BLOCK_D]``;
    with ``RESID`` h is the sum of the rows at ``hrow`` and at ``rrow`` (a decoder layer's output pair)."""
    cols = d0 + ar
    cmask = cols < d
    m2 = rmask[:, None] & cmask[None, :]
    h = tl.load(hrow + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    if RESID:
        h += tl.load(rrow + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    return cols, cmask, m2, h


@triton.jit
def _vec(ptr, g, i, K: tl.constexpr, d, cols, cmask, m2, SHARED: tl.constexpr):
    """Vector ``i`` of the row's configuration (``ptr[g, i, :]``, or ``ptr[0, i, :]`` when
    ``SHARED``), columns ``cols``, as float32 ``[1 or BLOCK_R, BLOCK_D]``."""
    if SHARED:
        v = tl.load(ptr + i * d + cols, mask=cmask, other=0.0)[None, :]
    else:
        v = tl.load(ptr + (g[:, None] * K + i) * d + cols[None, :], mask=m2, other=0.0)
    return v.to(tl.float32)


@triton.jit
def _minus_basis_combination(x, U, kc, g, basis_ptr, d, cols, cmask, m2, K: tl.constexpr,
                             SHARED_BASIS: tl.constexpr):
    """``x - sum_i U[:, i] b_i`` over the row's basis vectors, on the columns ``cols``."""
    for i in tl.static_range(K):
        b = _vec(basis_ptr, g, i, K, d, cols, cmask, m2, SHARED_BASIS)
        ui = tl.sum(tl.where(kc[None, :] == i, U, 0.0), axis=1)
        x = x - ui[:, None] * b
    return x


@triton.jit
def _steered_chunk(h, g, cols, cmask, m2, d, U, a, dz, kc, mc,
                   basis_ptr, add_ptr, rproj_ptr,
                   K: tl.constexpr, M: tl.constexpr,
                   SHARED_BASIS: tl.constexpr, ONE_CFG: tl.constexpr,
                   HAS_ABLATE: tl.constexpr, HAS_ADD: tl.constexpr, WITH_REGION: tl.constexpr):
    """One ``[BLOCK_R, BLOCK_D]`` chunk of the edited rows, before the norm rescale:
    ``h - sum_i U_i b_i + a v (+ sum_j dz_j p_j)``."""
    x = h
    if HAS_ABLATE:
        x = _minus_basis_combination(x, U, kc, g, basis_ptr, d, cols, cmask, m2, K, SHARED_BASIS)
    if HAS_ADD:
        v = _vec(add_ptr, g, 0, 1, d, cols, cmask, m2, ONE_CFG)
        x = x + a[:, None] * v
    if WITH_REGION:
        for j in tl.static_range(M):
            pj = _vec(rproj_ptr, g, j, M, d, cols, cmask, m2, False)
            dj = tl.sum(tl.where(mc[None, :] == j, dz, 0.0), axis=1)
            x = x + dj[:, None] * pj
    return x


@triton.jit
def _dots_pass(hrow, rrow, g, rmask, d, basis_ptr, add_ptr,
               K: tl.constexpr, KB: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
               SHARED_BASIS: tl.constexpr, HAS_ABLATE: tl.constexpr, HAS_ADD: tl.constexpr,
               PRESERVE_NORM: tl.constexpr, NORM_FAST: tl.constexpr, RESID: tl.constexpr):
    """Pass 1 over d: ``P = B h`` and ``|h|^2``; with ``NORM_FAST`` also ``h.v`` and the
    (row-independent) Gram matrix ``B B^T``, ``B v`` and ``|v|^2`` (in every entry of a vector),
    from which ``|x|^2`` follows without another pass. Returns ``(P, n0sq, hv, G, bv, vv)``."""
    kc = tl.arange(0, KB)
    P = tl.zeros([BLOCK_R, KB], dtype=tl.float32)
    ar = tl.arange(0, BLOCK_D)
    n0sq = tl.zeros([BLOCK_R], dtype=tl.float32)
    hv = tl.zeros([BLOCK_R], dtype=tl.float32)
    G = tl.zeros([KB, KB], dtype=tl.float32)
    bv = tl.zeros([KB], dtype=tl.float32)
    vv = tl.zeros([KB], dtype=tl.float32)  # |v|^2 in every entry (kept as a vector)
    if HAS_ABLATE or PRESERVE_NORM:
        for d0 in range(0, d, BLOCK_D):
            cols, cmask, m2, h = _load_chunk(hrow, rrow, d0, ar, d, rmask, RESID)
            if PRESERVE_NORM:
                n0sq += tl.sum(h * h, axis=1)
            if HAS_ABLATE:
                for i in tl.static_range(K):
                    b = _vec(basis_ptr, g, i, K, d, cols, cmask, m2, SHARED_BASIS)
                    P += tl.where(kc[None, :] == i, tl.sum(h * b, axis=1)[:, None], 0.0)
            if NORM_FAST:
                if HAS_ADD:
                    v1 = tl.load(add_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
                    hv += tl.sum(h * v1[None, :], axis=1)
                    vv += tl.sum(v1 * v1, axis=0)
                if HAS_ABLATE:
                    Bt = tl.load(basis_ptr + kc[:, None] * d + cols[None, :],
                                 mask=(kc[:, None] < K) & cmask[None, :], other=0.0).to(tl.float32)
                    for i in tl.static_range(K):
                        bi = tl.load(basis_ptr + i * d + cols, mask=cmask, other=0.0).to(tl.float32)
                        G += tl.where(kc[:, None] == i, tl.sum(Bt * bi[None, :], axis=1)[None, :], 0.0)
                    if HAS_ADD:
                        v2 = tl.load(add_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
                        bv += tl.sum(Bt * v2[None, :], axis=1)
    return P, n0sq, hv, G, bv, vv


@triton.jit
def _gate_fire(hrow, rrow, g, rmask, active, d, U, fire, dz, kc, mc, basis_ptr, add_ptr, rproj_ptr, gdir_ptr,
               gthr_ptr, gsign_ptr, K: tl.constexpr, M: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_D: tl.constexpr, SHARED_BASIS: tl.constexpr, ONE_CFG: tl.constexpr, HAS_ABLATE: tl.constexpr,
               RESID: tl.constexpr):
    """The gate: 1.0 where ``cos(x, proj_u x) = |u.x| / |x|`` of the ablated row passes the row's
    threshold (above or below, by its sign), else 0.0. A tile with no active gated row (sign 0: no gate)
    skips the pass over d."""
    thr = tl.load(gthr_ptr + g, mask=rmask, other=0.0)
    sgn = tl.load(gsign_ptr + g, mask=rmask, other=0.0)
    gd = tl.zeros([BLOCK_R], dtype=tl.float32)
    nx = tl.zeros([BLOCK_R], dtype=tl.float32)
    ar = tl.arange(0, BLOCK_D)
    if tl.max(tl.where(active & (sgn != 0.0), 1, 0), axis=0) > 0:
        for d0 in range(0, d, BLOCK_D):
            cols, cmask, m2, h = _load_chunk(hrow, rrow, d0, ar, d, rmask, RESID)
            x = _steered_chunk(h, g, cols, cmask, m2, d, U, fire, dz, kc, mc, basis_ptr, add_ptr,
                               rproj_ptr, K, M, SHARED_BASIS, ONE_CFG, HAS_ABLATE, False, False)
            gu = _vec(gdir_ptr, g, 0, 1, d, cols, cmask, m2, ONE_CFG)
            gd += tl.sum(x * gu, axis=1)
            nx += tl.sum(x * x, axis=1)
    cos = tl.abs(gd) / tl.maximum(tl.sqrt(nx), 1e-12)
    ok = (sgn == 0.0) | ((sgn > 0.0) & (cos > thr)) | ((sgn < 0.0) & (cos < thr))
    return tl.where(ok, 1.0, 0.0)


@triton.jit
def _dual_projection(Z, Wt, cc, step, live, tol, max_iter, BLOCK_R: tl.constexpr, NHB: tl.constexpr):
    """The multipliers ``lam`` of the closest point of ``{y : W y <= c}`` to each row's ``Z``: FISTA
    with gradient restart on the dual, for the whole tile, until the natural residual of every live
    row is at most ``tol`` or after ``max_iter`` iterations (the meaning is
    :func:`~steerkit.kernels.reference.solve_polyhedron_projection`)."""
    lam = tl.zeros([BLOCK_R, NHB], dtype=tl.float32)
    y = lam
    tk = tl.full([BLOCK_R], 1.0, tl.float32)
    # residual at lam = 0: the violation max(W z - c, 0)
    g0 = tl.sum(Wt * Z[:, None, :], axis=2) - cc
    res_r = tl.max(tl.abs(lam - tl.maximum(lam + g0, 0.0)), axis=1)
    res = tl.max(tl.where(live, res_r, 0.0), axis=0)
    it = 0
    while (it < max_iter) & (res > tol):
        xy = Z - tl.sum(Wt * y[:, :, None], axis=1)
        gy = tl.sum(Wt * xy[:, None, :], axis=2) - cc
        lam_new = tl.maximum(y + step[:, None] * gy, 0.0)
        t_new = (1.0 + tl.sqrt(1.0 + 4.0 * tk * tk)) * 0.5
        restart = tl.sum(-gy * (lam_new - lam), axis=1) > 0.0
        beta = tl.where(restart, 0.0, (tk - 1.0) / t_new)
        t_new = tl.where(restart, 1.0, t_new)
        y = lam_new + beta[:, None] * (lam_new - lam)
        lam = lam_new
        tk = t_new
        xl = Z - tl.sum(Wt * lam[:, :, None], axis=1)
        gl = tl.sum(Wt * xl[:, None, :], axis=2) - cc
        res_r = tl.max(tl.abs(lam - tl.maximum(lam + gl, 0.0)), axis=1)
        res = tl.max(tl.where(live, res_r, 0.0), axis=0)
        it += 1
    return lam


@triton.jit
def _region_step(hrow, rrow, g, rmask, active, fire, d, U, a, dz, kc, mc, tol, max_iter,
                 basis_ptr, add_ptr, rmean_ptr, rproj_ptr, rW_ptr, rc_ptr, rs_ptr, rstep_ptr,
                 K: tl.constexpr, M: tl.constexpr, MB: tl.constexpr, NH: tl.constexpr, NHB: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, SHARED_BASIS: tl.constexpr,
                 ONE_CFG: tl.constexpr, HAS_ABLATE: tl.constexpr, HAS_ADD: tl.constexpr, RESID: tl.constexpr):
    """The region's step in its subspace: ``z = P (x - mu)``, ``z* = argmin_{W y <= c} |y - z|``;
    returns ``s (z* - z)`` (0 where the gate did not fire), which the later passes add as ``P^T dz``."""
    nc = tl.arange(0, NHB)
    Z = tl.zeros([BLOCK_R, MB], dtype=tl.float32)
    ar = tl.arange(0, BLOCK_D)
    for d0 in range(0, d, BLOCK_D):
        cols, cmask, m2, h = _load_chunk(hrow, rrow, d0, ar, d, rmask, RESID)
        x = _steered_chunk(h, g, cols, cmask, m2, d, U, a, dz, kc, mc, basis_ptr, add_ptr,
                           rproj_ptr, K, M, SHARED_BASIS, ONE_CFG, HAS_ABLATE, HAS_ADD, False)
        xc = x - _vec(rmean_ptr, g, 0, 1, d, cols, cmask, m2, False)
        for j in tl.static_range(M):
            pj = _vec(rproj_ptr, g, j, M, d, cols, cmask, m2, False)
            Z += tl.where(mc[None, :] == j, tl.sum(xc * pj, axis=1)[:, None], 0.0)
    wmask = rmask[:, None, None] & (nc[None, :, None] < NH) & (mc[None, None, :] < M)
    Wt = tl.load(rW_ptr + g[:, None, None] * (NH * M) + nc[None, :, None] * M + mc[None, None, :],
                 mask=wmask, other=0.0)
    cc = tl.load(rc_ptr + g[:, None] * NH + nc[None, :], mask=rmask[:, None] & (nc[None, :] < NH),
                 other=0.0)
    step = tl.load(rstep_ptr + g, mask=rmask, other=1.0)
    live = active & (fire > 0.0)
    lam = _dual_projection(Z, Wt, cc, step, live, tol, max_iter, BLOCK_R, NHB)
    dz = -tl.sum(Wt * lam[:, :, None], axis=1)  # z* - z
    s = tl.load(rs_ptr + g, mask=rmask, other=0.0) * fire
    return dz * s[:, None]


@triton.jit
def _norm_scale(hrow, rrow, g, rmask, active, d, U, P, G, bv, vv, n0sq, hv, a, dz, kc, mc,
                basis_ptr, add_ptr, rproj_ptr,
                K: tl.constexpr, M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                SHARED_BASIS: tl.constexpr, ONE_CFG: tl.constexpr, HAS_ABLATE: tl.constexpr,
                HAS_ADD: tl.constexpr, HAS_REGION: tl.constexpr, NORM_FAST: tl.constexpr, RESID: tl.constexpr):
    """The norm preservation's factor ``|h| / |x|`` per row (1 where the edited row is 0), with
    ``|x|^2`` from pass 1's dot products (``NORM_FAST``) unless a row of the tile risks cancellation,
    else from one more pass over d; ``active``: the rows whose norm is kept (a tile with none skips it)."""
    n1sq = tl.zeros([BLOCK_R], dtype=tl.float32)
    exact = tl.max(tl.where(active, 1, 0), axis=0)
    ar = tl.arange(0, BLOCK_D)
    if NORM_FAST:
        # |h - B^T u + a v|^2 = |h|^2 - 2 u.p + u^T G u + 2a (h.v - u.Bv) + a^2 |v|^2
        up = tl.sum(U * P, axis=1)
        uGu = tl.sum(tl.sum(U[:, :, None] * G[None, :, :], axis=1) * U, axis=1)
        ubv = tl.sum(U * bv[None, :], axis=1)
        vv1 = tl.max(vv, axis=0)
        n1sq = n0sq - 2.0 * up + uGu + 2.0 * a * (hv - ubv) + a * a * vv1
        mag = n0sq + 2.0 * tl.abs(up) + tl.abs(uGu) + 2.0 * tl.abs(a) * (tl.abs(hv) + tl.abs(ubv)) \
            + a * a * vv1
        # cancellation guard: where |x|^2 is small against its terms, sum it over d instead
        bad = active & (n1sq * 8.0 < mag)
        exact = tl.max(tl.where(bad, 1, 0), axis=0)
    if exact > 0:
        n1sq = tl.zeros([BLOCK_R], dtype=tl.float32)
        for d0 in range(0, d, BLOCK_D):
            cols, cmask, m2, h = _load_chunk(hrow, rrow, d0, ar, d, rmask, RESID)
            x = _steered_chunk(h, g, cols, cmask, m2, d, U, a, dz, kc, mc, basis_ptr, add_ptr,
                               rproj_ptr, K, M, SHARED_BASIS, ONE_CFG, HAS_ABLATE, HAS_ADD,
                               HAS_REGION)
            n1sq += tl.sum(x * x, axis=1)
    n0 = tl.sqrt(n0sq)
    n1 = tl.sqrt(tl.maximum(n1sq, 0.0))
    return tl.where(n1 > 0.0, n0 / tl.maximum(n1, 1e-30), 1.0)


@triton.jit
def _fused_steer_kernel(
    h_ptr, out_ptr, res_ptr, idx_ptr, mask_ptr, flag_ptr, pnorm_ptr,
    basis_ptr, strength_ptr, target_ptr,
    gdir_ptr, gthr_ptr, gsign_ptr,
    add_ptr, ascale_ptr,
    rmean_ptr, rproj_ptr, rW_ptr, rc_ptr, rs_ptr, rstep_ptr,
    rows, d, stride_h, stride_o, stride_r,
    layer_weight, tol, max_iter,
    K: tl.constexpr, KB: tl.constexpr,
    M: tl.constexpr, MB: tl.constexpr, NH: tl.constexpr, NHB: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_IDX: tl.constexpr, HAS_MASK: tl.constexpr, SHARED_BASIS: tl.constexpr,
    ONE_CFG: tl.constexpr,
    HAS_ABLATE: tl.constexpr, HAS_GATE: tl.constexpr, HAS_ADD: tl.constexpr,
    HAS_REGION: tl.constexpr, PRESERVE_NORM: tl.constexpr, NORM_FAST: tl.constexpr,
    IN_PLACE: tl.constexpr, RESID: tl.constexpr, HAS_FLAG: tl.constexpr, ROW_NORM: tl.constexpr,
):
    """The fused edit of ``BLOCK_R`` rows. ``IN_PLACE``: ``out`` is ``h`` and only the active rows are
    written (a tile without one reads nothing more); ``RESID``: the rows are ``h + res`` (a decoder layer's
    output pair) and an edited row is written as ``res = edited``, ``h = 0``; ``HAS_FLAG``: a device flag
    (int32) that, when 0, leaves every row untouched (a site with no steered row in the step costs one read);
    ``ROW_NORM``: norm preservation per configuration (``pnorm[g] != 0``)."""
    r, rmask, g, active = _program_rows(idx_ptr, mask_ptr, rows, BLOCK_R, HAS_IDX, HAS_MASK)
    if HAS_FLAG:
        active = active & (tl.load(flag_ptr) != 0)
    live = 1
    if IN_PLACE:
        live = tl.max(tl.where(active, 1, 0), axis=0)
    if live > 0:
        r64 = r.to(tl.int64)
        hrow = h_ptr + r64[:, None] * stride_h
        orow = out_ptr + r64[:, None] * stride_o
        rrow = res_ptr + r64[:, None] * stride_r
        kc = tl.arange(0, KB)
        ar = tl.arange(0, BLOCK_D)
        mc = tl.arange(0, MB)

        # ---- pass 1 over d: p = B h, |h|^2 (and, with NORM_FAST, what |x|^2 follows from)
        P, n0sq, hv, G, bv, vv = _dots_pass(hrow, rrow, g, rmask, d, basis_ptr, add_ptr, K, KB, BLOCK_R, BLOCK_D,
                                            SHARED_BASIS, HAS_ABLATE, HAS_ADD, PRESERVE_NORM, NORM_FAST, RESID)

        # ---- per-row coefficients of the ablation: U_i = c_i (p_i - t_i)
        U = tl.zeros([BLOCK_R, KB], dtype=tl.float32)
        if HAS_ABLATE:
            kmask = rmask[:, None] & (kc[None, :] < K)
            c = tl.load(strength_ptr + g[:, None] * K + kc[None, :], mask=kmask, other=0.0)
            t = tl.load(target_ptr + g[:, None] * K + kc[None, :], mask=kmask, other=0.0)
            U = c * (P - t)
        dz = tl.zeros([BLOCK_R, MB], dtype=tl.float32)

        # ---- gate: cos(x, proj_u x) = |u.x| / |x| of the ablated row, against the threshold
        fire = tl.full([BLOCK_R], 1.0, tl.float32)
        if HAS_GATE:
            fire = _gate_fire(hrow, rrow, g, rmask, active, d, U, fire, dz, kc, mc, basis_ptr, add_ptr, rproj_ptr,
                              gdir_ptr, gthr_ptr, gsign_ptr, K, M, BLOCK_R, BLOCK_D, SHARED_BASIS, ONE_CFG,
                              HAS_ABLATE, RESID)

        # ---- injection coefficient: w_l * alpha_g (* fire)
        a = tl.zeros([BLOCK_R], dtype=tl.float32)
        if HAS_ADD:
            a = tl.load(ascale_ptr + g, mask=rmask, other=0.0) * layer_weight * fire

        # ---- region: z = P (x - mu); z* = argmin_{W y <= c} |y - z|; x += s P^T (z* - z)
        if HAS_REGION:
            dz = _region_step(hrow, rrow, g, rmask, active, fire, d, U, a, dz, kc, mc, tol, max_iter,
                              basis_ptr, add_ptr, rmean_ptr, rproj_ptr, rW_ptr, rc_ptr, rs_ptr, rstep_ptr,
                              K, M, MB, NH, NHB, BLOCK_R, BLOCK_D, SHARED_BASIS, ONE_CFG, HAS_ABLATE, HAS_ADD,
                              RESID)

        # ---- norm preservation: |x|^2 of the edited row (ROW_NORM: the rows whose configuration keeps it)
        scale = tl.full([BLOCK_R], 1.0, tl.float32)
        keep = active
        if ROW_NORM:
            keep = active & (tl.load(pnorm_ptr + g, mask=rmask, other=0.0) != 0.0)
        if PRESERVE_NORM:
            scale = _norm_scale(hrow, rrow, g, rmask, keep, d, U, P, G, bv, vv, n0sq, hv, a, dz, kc, mc,
                                basis_ptr, add_ptr, rproj_ptr, K, M, BLOCK_R, BLOCK_D, SHARED_BASIS, ONE_CFG,
                                HAS_ABLATE, HAS_ADD, HAS_REGION, NORM_FAST, RESID)
            scale = tl.where(keep, scale, 1.0)

        # ---- final pass: write the edited rows (inactive rows unchanged, and not written in place)
        for d0 in range(0, d, BLOCK_D):
            cols, cmask, m2, h = _load_chunk(hrow, rrow, d0, ar, d, rmask, RESID)
            x = _steered_chunk(h, g, cols, cmask, m2, d, U, a, dz, kc, mc, basis_ptr, add_ptr,
                               rproj_ptr, K, M, SHARED_BASIS, ONE_CFG, HAS_ABLATE, HAS_ADD, HAS_REGION)
            if PRESERVE_NORM:
                x = x * scale[:, None]
            if IN_PLACE:
                w2 = m2 & (active[:, None] != 0)
                if RESID:
                    tl.store(rrow + cols[None, :], x.to(res_ptr.dtype.element_ty), mask=w2)
                    tl.store(orow + cols[None, :], tl.zeros_like(x).to(out_ptr.dtype.element_ty), mask=w2)
                else:
                    tl.store(orow + cols[None, :], x.to(out_ptr.dtype.element_ty), mask=w2)
            else:
                x = tl.where(active[:, None], x, h)
                tl.store(orow + cols[None, :], x.to(out_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _ablate_inject_bwd_kernel(
    go_ptr, h_ptr, dh_ptr, idx_ptr, mask_ptr,
    basis_ptr, strength_ptr, target_ptr, add_ptr,
    pt_ptr, q_ptr, dv_ptr,
    rows, d, stride_g, stride_h, stride_dh,
    K: tl.constexpr, KB: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_IDX: tl.constexpr, HAS_MASK: tl.constexpr, SHARED_BASIS: tl.constexpr,
    HAS_ABLATE: tl.constexpr, HAS_ADD: tl.constexpr,
):
    r, rmask, g, active = _program_rows(idx_ptr, mask_ptr, rows, BLOCK_R, HAS_IDX, HAS_MASK)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < d
    m2 = rmask[:, None] & cmask[None, :]
    r64 = r.to(tl.int64)
    go = tl.load(go_ptr + r64[:, None] * stride_g + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    act = tl.where(active, 1.0, 0.0)
    dh = go
    if HAS_ABLATE:
        h = tl.load(h_ptr + r64[:, None] * stride_h + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        kc = tl.arange(0, KB)
        U = tl.zeros([BLOCK_R, KB], dtype=tl.float32)
        for i in tl.static_range(K):
            b = _vec(basis_ptr, g, i, K, d, cols, cmask, m2, SHARED_BASIS)
            p = tl.sum(h * b, axis=1)
            q = tl.sum(go * b, axis=1)
            c = tl.load(strength_ptr + g * K + i, mask=rmask, other=0.0)
            t = tl.load(target_ptr + g * K + i, mask=rmask, other=0.0)
            tl.store(pt_ptr + r64 * K + i, (p - t) * act, mask=rmask)
            tl.store(q_ptr + r64 * K + i, q * act, mask=rmask)
            U = tl.where(kc[None, :] == i, (c * q * act)[:, None], U)
        dh = _minus_basis_combination(dh, U, kc, g, basis_ptr, d, cols, cmask, m2, K, SHARED_BASIS)
    if HAS_ADD:
        v = _vec(add_ptr, g, 0, 1, d, cols, cmask, m2, False)
        tl.store(dv_ptr + r64, tl.sum(go * v, axis=1) * act, mask=rmask)
    tl.store(dh_ptr + r64[:, None] * stride_dh + cols[None, :], dh.to(dh_ptr.dtype.element_ty), mask=m2)
