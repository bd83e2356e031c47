"""Configurations of the fused steering edit, and the padded table the kernels read.

A :class:`SteerConfig` describes what to do to the rows of one sequence:

* ``basis`` ``[k, d_model]`` (orthonormal rows, k <= 16), ``strength`` ``[k]`` and
  ``target`` ``[k]``: the projection ``p_i = b_i . h`` becomes
  ``p_i - strength_i * (p_i - target_i)``. Target 0 and strength 1 is directional
  ablation; strength 1 and a target is clamping the projection to that value.
* ``gate_direction`` ``[d_model]``, ``gate_threshold``, ``gate_mode``: the row is
  steered (injection and region steps) only where the cosine between the row and
  its projection on the direction, ``|u . h| / |h|``, is above (``"above"``) or
  below (``"below"``) the threshold.
* ``add`` ``[d_model]`` or ``[n_add, d_model]`` and ``add_scale``: injection of
  ``layer_weight * sum_j add_scale_j * add_j``.
* ``region``: a :class:`Polyhedron` (PCA subspace and polyhedron) the row is moved
  towards, and ``region_strength``: the fraction of the way it moves (1: onto the
  polyhedron's closest point in the subspace).

:class:`SteerTable` stacks several configurations into padded float32 tensors
once (vectors combined, polyhedron rows normalised, step sizes precomputed,
everything validated), so the hook manager can call ``fused_steer(h, table=...,
row_config=idx)`` once per hooked layer per step with no host work and no device
synchronisation. Rows pick their configuration through ``row_config``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Literal, Optional, Sequence, Union

import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.errors import InputError

from .reference import DEFAULT_REGION_MAX_ITER, DEFAULT_REGION_TOL, solve_polyhedron_projection

MAX_K = 16  # directions per basis
MAX_M = 32  # dimensions of a region's subspace
MAX_HALFSPACES = 32  # half-spaces of a region's polyhedron
ORTHO_TOL = 1e-3  # max |B B^T - I| accepted for a basis / the region components (the whole package)

Number = Union[int, float]
#: the tensors of a :class:`SteerTable` the kernels read, in the order they take them
_TAB_FIELDS = ("basis", "strength", "target", "gate_dir", "gate_thr", "gate_sign", "add", "add_scale",
               "region_mean", "region_proj", "region_W", "region_c", "region_s", "region_step")


class SteerConfigError(InputError):
    """A configuration or a table does not have the shape, dtype or values expected.

    Examples:
        >>> try:
        ...     SteerTable.from_configs([SteerConfig.injection(torch.ones(8)), SteerConfig.injection(torch.ones(4))])
        ... except ValueError as e:
        ...     print(type(e).__name__)
        SteerConfigError
    """


def orthonormalize(
    vectors: Union[Float[Tensor, "k d_model"], Float[Tensor, " d_model"]],
) -> Float[Tensor, "r d_model"]:
    """An orthonormal basis (rows) of the span of ``vectors``: QR in float64, rank-revealing.

    A 1-D vector is one direction. Directions that depend on the earlier ones (``|R_ii|`` at most
    ``1e-8`` times the largest) are dropped and the QR is redone without them (a dependent column
    left in would give its row of Q an arbitrary direction, and the later rows would miss part of
    their vectors), so ``r <= k`` rows come back, spanning the vectors, in the order of the
    directions they complete, each oriented so that its dot product with the vector it completes
    is positive (rows multiplied by ``sign(R_ii)``); an all-zero input gives ``[0, d_model]``.
    The result has the input's floating dtype (the default dtype for integer input) and passes
    the orthonormality check of :class:`SteerConfig` (``ORTHO_TOL``).

    Examples:
        >>> B = orthonormalize(torch.tensor([[3.0, 0.0, 0.0], [1.0, 1.0, 0.0], [2.0, 1.0, 0.0]]))
        >>> B.shape[0], torch.allclose(B @ B.T, torch.eye(2), atol=1e-6)  # the third vector adds nothing
        (2, True)
        >>> B.tolist()
        [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
    """
    v = torch.as_tensor(vectors)
    if v.dim() == 1:
        v = v.unsqueeze(0)
    if v.dim() != 2:
        raise SteerConfigError(
            f"orthonormalize expects vectors of shape (k, d_model) or (d_model,); found "
            f"{tuple(v.shape)}. Stack the directions as rows."
        )
    out_dtype = v.dtype if v.is_floating_point() else torch.get_default_dtype()
    x = v.to(torch.float64).T  # columns = directions
    while x.shape[1]:
        q, r = torch.linalg.qr(x)
        diag = r.diagonal().abs()  # min(d_model, columns) entries
        keep = diag > 1e-8 * diag.max().clamp_min(1e-30)
        if bool(keep.all()):
            sign = torch.sign(r.diagonal())
            sign[sign == 0] = 1.0
            return (q.T * sign[:, None]).to(device=v.device, dtype=out_dtype)
        cols = torch.ones(x.shape[1], dtype=torch.bool, device=x.device)
        cols[: keep.numel()] = keep
        x = x[:, cols]
    return torch.zeros(0, v.shape[1], dtype=out_dtype, device=v.device)


def add_terms(add: Tensor, add_scale: Union[Number, Tensor], where: str = "") -> tuple[Tensor, Tensor]:
    """A configuration's injection as rows and one scale per row: ``add`` ``[d]`` or ``[n_add, d]`` and
    ``add_scale`` a number or ``[n_add]`` become ``([n_add, d], [n_add])`` (float32 scales).

    Examples:
        >>> rows, scales = add_terms(torch.ones(2, 4), 0.5)
        >>> tuple(rows.shape), scales.tolist()
        ((2, 4), [0.5, 0.5])
        >>> tuple(add_terms(torch.ones(4), 2.0)[0].shape)
        (1, 4)
    """
    v2 = add if add.dim() == 2 else add[None]
    sc = torch.as_tensor(add_scale, dtype=torch.float32).reshape(-1)
    if sc.numel() == 1:
        sc = sc.expand(v2.shape[0])
    if sc.numel() != v2.shape[0]:
        raise SteerConfigError(
            f"{where + ': ' if where else ''}add_scale must be a number or one per vector "
            f"({v2.shape[0]}); found {sc.numel()} values."
        )
    return v2, sc


def _finite(name: str, t: Tensor) -> None:
    if not torch.isfinite(t).all():
        bad = (~torch.isfinite(t)).nonzero()[0].tolist()
        raise SteerConfigError(
            f"{name} must be finite; found NaN or inf at index {bad}. "
            "Check how the vector was computed (a division by a zero norm is a common cause)."
        )


def _check_orthonormal(name: str, m: Tensor) -> None:
    m64 = m.detach().to(torch.float64)
    gram = m64 @ m64.transpose(-1, -2)
    eye = torch.eye(gram.shape[-1], dtype=torch.float64, device=gram.device)
    err = (gram - eye).abs().amax().item() if gram.numel() else 0.0
    if err > ORTHO_TOL:
        raise SteerConfigError(
            f"{name} must have orthonormal rows (max |B B^T - I| <= {ORTHO_TOL}); "
            f"found max |B B^T - I| = {err:.3g}. Orthonormalise it first, e.g. "
            "steerkit.kernels.orthonormalize(B) (QR), or pass a single unit-norm direction."
        )


@dataclass(eq=False)
class Polyhedron:
    """Polyhedron in a PCA subspace: ``{x : normals @ (projection @ (x - mean)) <= offsets}``.

    ``projection [k, d_model]`` has orthonormal rows (``k <= MAX_M``), ``normals [m, k]`` and
    ``offsets [m]`` are the ``m <= MAX_HALFSPACES`` half-spaces (rows need not be unit vectors).
    The fused edit (``SteerConfig(region=..., region_strength=s)``) moves ``h`` by
    ``s * projection^T (z* - z)``, where ``z = projection @ (h - mean)`` (:meth:`coordinates`) and
    ``z*`` is the closest point of ``{y : normals @ y <= offsets}`` to ``z`` (:meth:`project`).
    Two regions are equal when they are of the same class and their tensors are equal (dtype,
    shape and values).

    Examples:
        >>> region = Polyhedron(mean=torch.zeros(3), projection=torch.eye(3)[:2],  # the (x0, x1) plane
        ...                 normals=torch.tensor([[1.0, 0.0]]), offsets=torch.tensor([1.0]))  # x0 <= 1
        >>> x = torch.tensor([[3.0, 2.0, 5.0]])
        >>> region.coordinates(x).tolist(), region.contains(x).tolist()
        ([[3.0, 2.0]], [False])
        >>> region.project(region.coordinates(x)).round(decimals=4).tolist()
        [[1.0, 2.0]]
    """

    mean: Float[Tensor, " d_model"]
    projection: Float[Tensor, "k d_model"]  # orthonormal rows, k <= 32
    normals: Float[Tensor, "m k"]  # m <= 32 half-spaces
    offsets: Float[Tensor, " m"]

    @property
    def d_model(self) -> int:
        return int(self.mean.shape[0])

    def validate(self, d_model: int) -> None:
        """Check the shapes, limits, finiteness and orthonormality the fused kernel needs."""
        k = self.projection.shape[0] if self.projection.dim() == 2 else -1
        if self.mean.shape != (d_model,):
            raise SteerConfigError(
                f"Polyhedron.mean must have shape ({d_model},); found {tuple(self.mean.shape)}. "
                "Pass the mean of the hidden states the PCA was fitted on."
            )
        if self.projection.dim() != 2 or self.projection.shape[1] != d_model:
            raise SteerConfigError(
                f"Polyhedron.projection must have shape (k, {d_model}); found "
                f"{tuple(self.projection.shape)}."
            )
        if not 1 <= k <= MAX_M:
            raise SteerConfigError(
                f"Polyhedron subspace dimension k must be 1..{MAX_M}; found k={k}. "
                f"Keep the first {MAX_M} principal components."
            )
        if self.normals.dim() != 2 or self.normals.shape[1] != k:
            raise SteerConfigError(
                f"Polyhedron.normals must have shape (m, {k}); found {tuple(self.normals.shape)}."
            )
        m = self.normals.shape[0]
        if not 1 <= m <= MAX_HALFSPACES:
            raise SteerConfigError(
                f"Polyhedron polyhedron must have 1..{MAX_HALFSPACES} half-spaces; found {m}. "
                "Drop redundant half-spaces or split the region."
            )
        if self.offsets.shape != (m,):
            raise SteerConfigError(
                f"Polyhedron.offsets must have shape ({m},) to match normals; found {tuple(self.offsets.shape)}."
            )
        for n, t in (("Polyhedron.mean", self.mean), ("Polyhedron.projection", self.projection),
                     ("Polyhedron.normals", self.normals), ("Polyhedron.offsets", self.offsets)):
            _finite(n, t)
        if (self.normals.detach().norm(dim=1) == 0).any():
            raise SteerConfigError(
                "Polyhedron.normals has a zero row (a half-space with no normal); remove it."
            )
        _check_orthonormal("Polyhedron.projection", self.projection)

    def coordinates(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... k"]:
        """Subspace coordinates ``projection @ (x - mean)``, in ``x``'s dtype and device."""
        return (x - self.mean.to(x)) @ self.projection.to(x).T

    def contains(self, x: Float[Tensor, "... d_model"], tol: float = 0.0) -> Tensor:
        """Whether each ``x`` is inside (every half-space satisfied up to ``tol``)."""
        s = self.coordinates(x) @ self.normals.to(x).T
        return (s <= self.offsets.to(x) + tol).all(dim=-1)

    def project(self, z: Float[Tensor, "... k"], *, tol: Optional[float] = None,
                max_iter: Optional[int] = None) -> Float[Tensor, "... k"]:
        """The closest point of the polyhedron ``{y : normals @ y <= offsets}`` to each ``z``
        (subspace coordinates, see :meth:`coordinates`), solved in float64 by the fused kernel's
        own solver (:func:`steerkit.kernels.solve_polyhedron_projection`, the same row
        normalisation and step), to natural residual ``tol`` in distance units (default the
        kernel's, 1e-4) or ``max_iter`` iterations. Points inside come back unchanged."""
        zt = torch.as_tensor(z)
        if not zt.is_floating_point():
            zt = zt.to(torch.get_default_dtype())
        k = int(self.projection.shape[0])
        if zt.dim() == 0 or zt.shape[-1] != k:
            raise SteerConfigError(
                f"Polyhedron.project expects coordinates [..., {k}] (the region's subspace); found "
                f"{tuple(zt.shape)}. Map points of the model's space with Polyhedron.coordinates first."
            )
        flat = zt.reshape(-1, k).to(torch.float64)
        W = self.normals.detach().to(device=flat.device, dtype=torch.float64)
        c = self.offsets.detach().to(device=flat.device, dtype=torch.float64)
        nrm = W.norm(dim=1).clamp_min(1e-30)
        W, c = W / nrm[:, None], c / nrm
        step = 1.0 / max(torch.linalg.matrix_norm(W, ord=2).item() ** 2, 1e-12)
        n = flat.shape[0]
        out, _ = solve_polyhedron_projection(flat, W.expand(n, *W.shape), c.expand(n, *c.shape),
                                             torch.full((n,), step, dtype=torch.float64, device=flat.device),
                                             DEFAULT_REGION_TOL if tol is None else float(tol),
                                             DEFAULT_REGION_MAX_ITER if max_iter is None else int(max_iter))
        return out.reshape(zt.shape).to(zt.dtype)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Polyhedron) or type(other) is not type(self):
            return NotImplemented
        return all(_same_tensor(getattr(self, n), getattr(other, n))
                   for n in ("mean", "projection", "normals", "offsets"))

    __hash__ = None  # type: ignore[assignment]


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a.detach().cpu(), b.detach().cpu()))


@dataclass
class SteerConfig:
    """What to do to the rows of one sequence (see the module docstring).

    Examples:
        >>> u = torch.eye(8)[0]
        >>> cfg = SteerConfig.ablation(u).with_gate(u, 0.2)
        >>> tuple(cfg.basis.shape), cfg.gate_threshold, cfg.gate_mode
        ((1, 8), 0.2, 'above')
        >>> SteerConfig.clamp(u, 3.0).target, SteerConfig.injection(torch.ones(8), 2.0).add_scale
        (3.0, 2.0)
    """

    basis: Optional[Float[Tensor, "k d_model"]] = None
    strength: Union[Number, Float[Tensor, " k"]] = 1.0
    target: Union[None, Number, Float[Tensor, " k"]] = None
    gate_direction: Optional[Float[Tensor, " d_model"]] = None
    gate_threshold: float = 0.0
    gate_mode: Literal["above", "below"] = "above"
    add: Union[None, Float[Tensor, " d_model"], Float[Tensor, "n_add d_model"]] = None
    add_scale: Union[Number, Float[Tensor, " n_add"]] = 1.0
    region: Optional[Polyhedron] = None
    region_strength: float = 1.0

    @classmethod
    def ablation(cls, basis: Tensor, strength: Union[Number, Tensor] = 1.0) -> "SteerConfig":
        return cls(basis=basis if basis.dim() == 2 else basis[None], strength=strength)

    @classmethod
    def clamp(cls, direction: Tensor, value: Union[Number, Tensor]) -> "SteerConfig":
        b = direction if direction.dim() == 2 else direction[None]
        return cls(basis=b, strength=1.0, target=value)

    @classmethod
    def injection(cls, vector: Tensor, scale: Union[Number, Tensor] = 1.0) -> "SteerConfig":
        return cls(add=vector, add_scale=scale)

    @classmethod
    def identity(cls) -> "SteerConfig":
        return cls()

    def with_gate(self, direction: Tensor, threshold: float,
                  mode: Literal["above", "below"] = "above") -> "SteerConfig":
        return replace(self, gate_direction=direction, gate_threshold=threshold, gate_mode=mode)


def _per_dir(name: str, v, k: int, default: float) -> Tensor:
    if v is None:
        return torch.full((k,), default, dtype=torch.float32)
    t = torch.as_tensor(v, dtype=torch.float32)
    if t.dim() == 0:
        return t.expand(k).clone()
    if t.shape != (k,):
        raise SteerConfigError(
            f"{name} must be a number or have shape ({k},) to match the basis; found {tuple(t.shape)}."
        )
    return t


@dataclass
class SteerTable:
    """Configurations stacked and padded into tensors; built once, reused every step.

    Shapes (n = number of configurations, K = padded basis size, M/NH = padded
    region sizes): ``basis [n_b, K, d]`` with ``n_b`` 1 (shared) or n,
    ``strength/target [n, K]``, ``gate_dir [n, d]``, ``gate_thr [n]``,
    ``gate_sign [n]`` (+1 above, -1 below, 0 no gate), ``add [n, d]``,
    ``add_scale [n]``, ``region_mean [n, d]``, ``region_proj [n, M, d]``,
    ``region_W [n, NH, M]`` (unit rows), ``region_c [n, NH]``,
    ``region_s [n]``, ``region_step [n]`` (1 / ||W||_2^2). ``schedule`` holds
    per-layer weights ``w_l`` for the injection, read by :meth:`layer_weight`.

    Examples:
        >>> t = SteerTable.from_configs([SteerConfig.injection(torch.ones(8)), SteerConfig.ablation(torch.eye(8)[:2])])
        >>> t.n_configs, t.d_model, t.has_add, t.has_ablate, t.has_gate, t.k
        (2, 8, True, True, False, 2)
        >>> t.add[1].abs().sum().item()  # the second configuration adds nothing
        0.0
    """

    n_configs: int
    d_model: int
    basis: Optional[Tensor] = None
    strength: Optional[Tensor] = None
    target: Optional[Tensor] = None
    gate_dir: Optional[Tensor] = None
    gate_thr: Optional[Tensor] = None
    gate_sign: Optional[Tensor] = None
    add: Optional[Tensor] = None
    add_scale: Optional[Tensor] = None
    region_mean: Optional[Tensor] = None
    region_proj: Optional[Tensor] = None
    region_W: Optional[Tensor] = None
    region_c: Optional[Tensor] = None
    region_s: Optional[Tensor] = None
    region_step: Optional[Tensor] = None
    schedule: Optional[Tensor] = None
    meta: dict = field(default_factory=dict)

    # -- flags ---------------------------------------------------------------
    @property
    def has_ablate(self) -> bool:
        return self.basis is not None

    @property
    def has_gate(self) -> bool:
        return self.gate_dir is not None

    @property
    def has_add(self) -> bool:
        return self.add is not None

    @property
    def has_region(self) -> bool:
        return self.region_W is not None

    @property
    def k(self) -> int:
        return 0 if self.basis is None else self.basis.shape[1]

    @cached_property
    def _plans(self) -> dict:
        """The torch reference's prepared forms of this table, by settings (filled by
        :func:`~steerkit.kernels.reference.shared_config`; a copy made by :meth:`to` starts empty)."""
        return {}

    def layer_weight(self, layer: int) -> float:
        """Schedule weight ``w_l`` for ``layer`` (1.0 when the table has no schedule)."""
        if self.schedule is None:
            return 1.0
        if not 0 <= layer < len(self.schedule):
            raise SteerConfigError(
                f"layer {layer} is outside the schedule of {len(self.schedule)} layers; "
                "give a weight for every hooked layer."
            )
        return float(self.schedule[layer])

    def to(self, device=None) -> "SteerTable":
        def mv(t: Optional[Tensor]) -> Optional[Tensor]:
            return None if t is None else t.to(device)

        moved: dict[str, Any] = {f: mv(getattr(self, f)) for f in _TAB_FIELDS}
        return replace(self, **moved)

    # -- construction --------------------------------------------------------
    @classmethod
    def from_configs(
        cls,
        configs: Sequence[SteerConfig],
        *,
        d_model: Optional[int] = None,
        device: Union[str, torch.device, None] = None,
        schedule: Optional[Sequence[float]] = None,
        validate: bool = True,
    ) -> "SteerTable":
        """Validate ``configs`` and stack them (one row of each tensor per config). ``validate=False`` stacks
        configurations whose values were validated where they were made (finite numbers, orthonormal bases,
        sound regions: :class:`steerkit.Intervention`'s constructors), checking shapes only."""
        if len(configs) == 0:
            raise SteerConfigError("SteerTable needs at least one SteerConfig; found none.")
        if d_model is None:
            d_model = _infer_d_model(configs)
        n = len(configs)
        def vec(t: Tensor, name: str) -> Tensor:
            if not (t.requires_grad and torch.is_grad_enabled()):
                t = t.detach()  # a trainable vector keeps its autograd link into the table
            t = t.to(torch.float32).cpu()
            if t.shape[-1] != d_model:
                raise SteerConfigError(
                    f"{name} must end in d_model={d_model}; found shape {tuple(t.shape)}. "
                    "All configurations of a table must be for the same model."
                )
            if validate:
                _finite(name, t)
            return t

        tab = cls(n_configs=n, d_model=d_model)
        # ablation / clamp
        ks = [0 if cf.basis is None else cf.basis.shape[0] for cf in configs]
        if max(ks) > 0:
            K = max(ks)
            if K > MAX_K:
                raise SteerConfigError(
                    f"a basis may hold at most {MAX_K} directions; found k={K}. "
                    "Keep the strongest directions or split them over two layers."
                )
            basis = torch.zeros(n, K, d_model, dtype=torch.float32)
            strength = torch.zeros(n, K, dtype=torch.float32)
            target = torch.zeros(n, K, dtype=torch.float32)
            for i, cf in enumerate(configs):
                if cf.basis is None:
                    continue
                if cf.basis.dim() != 2:
                    raise SteerConfigError(
                        f"config {i}: basis must have shape (k, {d_model}); found {tuple(cf.basis.shape)}."
                    )
                b = vec(cf.basis, f"config {i} basis")
                if validate:
                    _check_orthonormal(f"config {i} basis", b)
                k = b.shape[0]
                basis[i, :k] = b
                strength[i, :k] = _per_dir(f"config {i} strength", cf.strength, k, 1.0)
                target[i, :k] = _per_dir(f"config {i} target", cf.target, k, 0.0)
                if validate:
                    _finite(f"config {i} strength", strength[i])
                    _finite(f"config {i} target", target[i])
            if all(configs[0].basis is not None and cf.basis is not None
                   and cf.basis.shape == configs[0].basis.shape
                   and torch.equal(cf.basis, configs[0].basis) for cf in configs):
                basis = basis[:1].contiguous()  # shared basis: one load per program
            tab.basis, tab.strength, tab.target = basis, strength, target
        # gate
        if any(cf.gate_direction is not None for cf in configs):
            gd = torch.zeros(n, d_model, dtype=torch.float32)
            thr = torch.zeros(n, dtype=torch.float32)
            sign = torch.zeros(n, dtype=torch.float32)
            for i, cf in enumerate(configs):
                if cf.gate_direction is None:
                    continue
                u = vec(cf.gate_direction.reshape(-1), f"config {i} gate_direction")
                nu = u.norm()
                if nu == 0:
                    raise SteerConfigError(f"config {i}: gate_direction is all zeros; give a direction.")
                if cf.gate_mode not in ("above", "below"):
                    raise SteerConfigError(
                        f"config {i}: gate_mode must be 'above' or 'below'; found {cf.gate_mode!r}."
                    )
                gd[i] = u / nu
                thr[i] = float(cf.gate_threshold)
                sign[i] = 1.0 if cf.gate_mode == "above" else -1.0
            tab.gate_dir, tab.gate_thr, tab.gate_sign = gd, thr, sign
        # injection
        if any(cf.add is not None for cf in configs):
            add = torch.zeros(n, d_model, dtype=torch.float32)
            for i, cf in enumerate(configs):
                if cf.add is None:
                    continue
                v2, sc = add_terms(vec(cf.add, f"config {i} add"), cf.add_scale, f"config {i}")
                if validate:
                    _finite(f"config {i} add_scale", sc)
                add[i] = (sc[:, None] * v2).sum(0)
            tab.add, tab.add_scale = add, torch.ones(n, dtype=torch.float32)
        if any(cf.region is not None for cf in configs):
            _fill_regions(tab, configs, validate)
        if schedule is not None:
            tab.schedule = torch.as_tensor(schedule, dtype=torch.float32)
            _finite("schedule", tab.schedule)
        return tab.to(device) if device is not None else tab


def _infer_d_model(configs: Sequence[SteerConfig]) -> int:
    """The width of the first vector any configuration holds."""
    for cf in configs:
        for t in (cf.basis, cf.gate_direction, cf.add):
            if t is not None:
                return int(t.shape[-1])
        if cf.region is not None:
            return int(cf.region.mean.shape[0])
    raise SteerConfigError("cannot infer d_model: no configuration holds a vector; pass d_model=.")


def _fill_regions(tab: "SteerTable", configs: Sequence[SteerConfig], validate: bool) -> None:
    """Stack the configurations' regions into ``tab`` (normals normalised, the projection step per row)."""
    d_model, n = tab.d_model, tab.n_configs
    regs = [cf.region for cf in configs]
    for i, r in enumerate(regs):
        if r is not None and validate:
            try:
                r.validate(d_model)
            except SteerConfigError as e:
                raise SteerConfigError(f"config {i}: {e}") from None
    M = max(r.projection.shape[0] for r in regs if r is not None)
    NH = max(r.normals.shape[0] for r in regs if r is not None)
    tab.region_mean = torch.zeros(n, d_model, dtype=torch.float32)
    tab.region_proj = torch.zeros(n, M, d_model, dtype=torch.float32)
    tab.region_W = torch.zeros(n, NH, M, dtype=torch.float32)
    tab.region_c = torch.zeros(n, NH, dtype=torch.float32)
    tab.region_s = torch.zeros(n, dtype=torch.float32)
    tab.region_step = torch.ones(n, dtype=torch.float32)
    for i, (cf, r) in enumerate(zip(configs, regs)):
        if r is None:
            continue
        m, nh = r.projection.shape[0], r.normals.shape[0]
        W = r.normals.detach().to(torch.float32).cpu()
        c = r.offsets.detach().to(torch.float32).cpu()
        nrm = W.norm(dim=1)
        tab.region_mean[i] = r.mean.detach().float().cpu()
        tab.region_proj[i, :m] = r.projection.detach().float().cpu()
        tab.region_W[i, :nh, :m] = W / nrm[:, None]
        tab.region_c[i, :nh] = c / nrm
        try:
            s = float(cf.region_strength)
        except (TypeError, ValueError, RuntimeError):
            s = math.nan
        if not math.isfinite(s):
            raise SteerConfigError(
                f"config {i}: region_strength must be a finite number; found "
                f"{cf.region_strength!r:.60}. Pass the fraction of the way to the region (1.0: onto it)."
            )
        tab.region_s[i] = s
        L = torch.linalg.matrix_norm(tab.region_W[i].double(), ord=2).item() ** 2
        tab.region_step[i] = 1.0 / max(L, 1e-12)


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


def _config_rows(name: str, t, d_model: int, device, dtype) -> Tensor:
    """``t`` (``[d_model]`` or ``[n_configs, d_model]``) as ``[1 or n_configs, d_model]`` on ``device`` in ``dtype``."""
    v = _as_f(t, device, dtype)
    found = tuple(v.shape)
    if v.dim() == 1:
        v = v[None]
    if v.dim() != 2 or v.shape[-1] != d_model:
        raise SteerConfigError(f"{name} must have shape ({d_model},) or (n_configs, {d_model}); found {found}.")
    return v


def _basis_terms(basis, strength, target, n: int, d_model: int, device, dtype,
                 validate: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(basis [1 or n, K, d], strength [n, K], target [n, K])`` of :func:`table_from_tensors`."""
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
    if validate:
        _check_orthonormal("basis", B)
        for name, v in (("basis", B), ("strength", c), ("target", t)):
            _finite(name, v.detach())
    return B.contiguous(), c.expand(n, K).contiguous(), t.expand(n, K).contiguous()


def table_from_tensors(
    d_model: int, device, dtype=torch.float32, *, basis=None, strength=1.0, target=None, add=None,
    scale=1.0, gate_direction=None, gate_threshold=0.0, gate_mode="above", region=None,
    region_strength=1.0, validate: bool = True,
) -> SteerTable:
    """Build a :class:`SteerTable` from the keyword tensors of :func:`~steerkit.kernels.fused.fused_steer`, keeping
    autograd history (so gradients reach ``basis``, ``strength``, ``target``, ``add``, ``scale``).
    ``region_strength`` is a number or one per region.

    Examples:
        >>> t = table_from_tensors(8, "cpu", add=torch.ones(2, 8), scale=torch.tensor([1.0, -1.0]))
        >>> t.n_configs, t.add_scale.tolist()
        (2, [1.0, -1.0])
        >>> from steerkit.kernels import fused_steer
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
        tab.basis, tab.strength, tab.target = _basis_terms(basis, strength, target, n, d_model, device, dtype,
                                                           validate)
    if add is not None:
        V = _config_rows("add", add, d_model, device, dtype)
        a = _as_f(scale, device, dtype).reshape(-1)
        tab.add = V.expand(n, d_model).contiguous()
        tab.add_scale = a.expand(n).contiguous()
        if validate:
            _finite("add", V.detach())
            _finite("scale", a.detach())
    if gate_direction is not None:
        u = _config_rows("gate_direction", gate_direction, d_model, device, dtype)
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
