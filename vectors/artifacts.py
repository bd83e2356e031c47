"""Steering artifacts as plain values.

How it works
------------
Five dataclasses, each holding tensors plus a :class:`~steerkit.vectors.provenance.Provenance`:

* :class:`SteeringVector` -- one direction per layer (``directions[l]`` of shape ``[d_model]``),
  a hook site (default ``hook_resid_post``: the output of block ``l``), an operation
  (``"add"``: ``h + scale * v``; ``"project"``: set the component of ``h`` along ``v`` to
  ``scale * |v|``), a scale, optional token positions and an optional :class:`LayerSchedule`.
  Supports ``+ - * /`` and negation; ``.to()`` returns a new object.
* :class:`DirectionSet` -- an orthonormal basis ``[k, d_model]`` to ablate, either at given
  layers or "everywhere" (``layers=None``: every write into the residual stream -- the
  embedding, each attention output and each MLP output -- which is exactly what
  orthogonalising the weights does).
* :class:`Probe` -- a fitted linear pipeline stored as arrays (centre, scale, optional PCA
  projection, weight, bias, class names), never as a pickle.
* :class:`Region` -- a polyhedron in a PCA subspace: ``mean``, ``projection [k, d]``,
  half-space ``normals [m, k]`` and ``offsets [m]``; ``x`` is inside when
  ``normals @ projection @ (x - mean) <= offsets``. It is a :class:`steerkit.Polyhedron`
  (the geometry: coordinates, membership, the projection QP, what the fused kernel reads) with a
  layer, a hook site and a provenance.
* :class:`LayerSchedule` -- per-layer weights (as Temporal Activation Injection uses) and an
  optional per-token weight list.

Every class converts to and from a *payload*: a ``dict[str, Tensor]`` plus a JSON-able
``dict`` (``kind``, ``fields``, ``provenance``).  The store and the ``safetensors`` export
write payloads; :func:`payload_to_artifact` validates everything it reads (kinds, shapes,
dtypes, finiteness) and raises :class:`ArtifactFormatError` on anything unexpected.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Iterable

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from steerkit.interventions import Condition, Intervention, ModelFacts, When
from steerkit.interventions import compile as compile_steering
from steerkit.interventions import ORTHO_TOL, orthonormalize
from steerkit.interventions import Polyhedron as KernelRegion

from .apply import check_against
from .errors import ArtifactFormatError, ModelMismatchError, VectorsError
from .provenance import Provenance, prompts_hash

if TYPE_CHECKING:
    from steerkit.model import SteerModel

HOOK_SITES = ("hook_resid_post", "hook_resid_pre")
VECTOR_OPERATIONS = ("add", "project")


def _as_tensor(x: Any, what: str) -> Tensor:
    if isinstance(x, Tensor):
        t = x.detach()
    elif isinstance(x, np.ndarray):
        t = torch.from_numpy(np.array(x, copy=True))
    elif isinstance(x, (list, tuple)):
        t = torch.tensor(x, dtype=torch.float32)
    else:
        raise VectorsError(f"expected {what} as a torch.Tensor, numpy array or list, found {type(x).__name__}")
    if not t.is_floating_point():
        t = t.to(torch.float32)
    return t


def _check_finite(t: Tensor, what: str) -> None:
    if t.numel() and not bool(torch.isfinite(t).all()):
        raise ArtifactFormatError(f"expected finite values in {what}, found NaN or infinity; the artifact is corrupted")


def _int_layer(k: Any, what: str) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        try:
            if isinstance(k, str) and k.strip().lstrip("-").isdigit():
                k = int(k)
            else:
                raise ValueError
        except ValueError:
            raise ArtifactFormatError(f"expected an integer layer index in {what}, found {k!r}") from None
    k = int(k)
    if k < 0 or k > 100_000:
        raise ArtifactFormatError(f"expected a layer index between 0 and 100000 in {what}, found {k}")
    return k


def _tensors_equal(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))


class _Artifact:
    """Shared behaviour: payload conversion, ``.to()``, provenance access."""

    kind: ClassVar[str] = ""
    provenance: Provenance

    def _tensor_fields(self) -> dict[str, Tensor]:  # overridden
        raise NotImplementedError

    def _map_tensors(self, fn) -> "_Artifact":
        raise NotImplementedError

    def to_payload(self) -> tuple[dict[str, Tensor], dict]:  # overridden
        raise NotImplementedError

    @classmethod
    def from_payload(cls, tensors: dict[str, Tensor], meta: dict) -> "_Artifact":  # overridden
        raise NotImplementedError

    def to(self, *args: Any, **kwargs: Any):
        """Return a new artifact with every tensor moved/cast like ``Tensor.to``."""
        return self._map_tensors(lambda t: t.to(*args, **kwargs))

    def clone(self):
        return self._map_tensors(lambda t: t.clone())

    @property
    def d_model(self) -> int:
        raise NotImplementedError

    def summary(self) -> dict:
        p = self.provenance
        return {
            "kind": self.kind, "model_name": p.model_name, "model_fingerprint": p.model_fingerprint,
            "d_model": self.d_model, "n_layers": p.n_layers, "hook_site": p.hook_site,
            "operation": p.operation, "method": p.method, "created_at": p.created_at,
        }


# --------------------------------------------------------------------------- LayerSchedule
@dataclasses.dataclass(eq=False)
class LayerSchedule(_Artifact):
    """Per-layer weights (and optionally per-token weights) for injecting a vector.

    Examples:
        >>> from steerkit.vectors import LayerSchedule, SteeringVector
        >>> sched = LayerSchedule({1: 0.5, 2: 1.0})
        >>> sched.weight(1), sched.weight(3)  # a layer it does not list gets 0
        (0.5, 0.0)
        >>> v = SteeringVector({1: torch.ones(64), 2: torch.ones(64)}, scale=2.0, schedule=sched)
        >>> {l: float(d[0]) for l, d in v.effective().directions.items()}
        {1: 1.0, 2: 2.0}
    """

    weights: dict[int, float]
    position_weights: list[float] | None = None
    provenance: Provenance = dataclasses.field(default_factory=lambda: Provenance(operation="schedule"))
    kind: ClassVar[str] = "layer_schedule"

    def __post_init__(self) -> None:
        w = {}
        for k, v in dict(self.weights).items():
            fv = float(v)
            if not math.isfinite(fv):
                raise ArtifactFormatError(f"expected finite layer weights, found {v!r} at layer {k}")
            w[_int_layer(k, "LayerSchedule.weights")] = fv
        self.weights = dict(sorted(w.items()))
        if self.position_weights is not None:
            pw = [float(x) for x in self.position_weights]
            if not all(math.isfinite(x) for x in pw):
                raise ArtifactFormatError("expected finite position weights, found NaN or infinity")
            self.position_weights = pw

    @property
    def d_model(self) -> int:  # a schedule has no width
        return self.provenance.d_model or 0

    def weight(self, layer: int) -> float:
        return self.weights.get(layer, 0.0)

    def _map_tensors(self, fn) -> "LayerSchedule":
        return dataclasses.replace(self)

    def to_payload(self) -> tuple[dict[str, Tensor], dict]:
        layers = list(self.weights)
        tensors = {
            "layers": torch.tensor(layers, dtype=torch.int64),
            "weights": torch.tensor([self.weights[l] for l in layers], dtype=torch.float64),
        }
        if self.position_weights is not None:
            tensors["position_weights"] = torch.tensor(self.position_weights, dtype=torch.float64)
        return tensors, {"kind": self.kind, "fields": {}, "provenance": self.provenance.to_dict()}

    @classmethod
    def from_payload(cls, tensors: dict[str, Tensor], meta: dict) -> "LayerSchedule":
        _expect_keys(tensors, {"layers", "weights"}, {"position_weights"}, cls.kind)
        layers, weights = tensors["layers"], tensors["weights"]
        if layers.ndim != 1 or weights.shape != layers.shape:
            raise ArtifactFormatError(f"expected layer_schedule layers and weights of equal 1-D shape, found {tuple(layers.shape)} and {tuple(weights.shape)}")
        pw = tensors.get("position_weights")
        return cls(
            weights={int(l): float(w) for l, w in zip(layers.tolist(), weights.tolist())},
            position_weights=None if pw is None else [float(x) for x in pw.reshape(-1).tolist()],
            provenance=Provenance.from_dict(meta.get("provenance", {})),
        )

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, LayerSchedule) and self.weights == other.weights
                and self.position_weights == other.position_weights and self.provenance == other.provenance)


# --------------------------------------------------------------------------- SteeringVector
@dataclasses.dataclass(eq=False)
class SteeringVector(_Artifact):
    """One direction per layer, applied at ``blocks.{l}.{hook_site}``.

    ``directions[l]`` has shape ``[d_model]``; ``l`` is the 0-based block index and the default
    hook site ``hook_resid_post`` is the block's output.

    Examples:
        >>> from steerkit.vectors import SteeringVector
        >>> v = SteeringVector.from_direction(torch.randn(64), layer=2, model=tiny, scale=4.0)
        >>> v.layers, v.d_model, v.hook_name(2), v.provenance.model_name
        ([2], 64, 'blocks.2.hook_resid_post', 'tiny-llama')
        >>> with tiny.steer(v):  # adds 4 * v to the output of block 2
        ...     steered = tiny("Hello")
        >>> bool((steered - tiny("Hello")).abs().max() > 0)
        True
    """

    directions: dict[int, Float[Tensor, " d_model"]]
    scale: float = 1.0
    operation: str = "add"
    hook_site: str = "hook_resid_post"
    positions: list[int] | None = None
    schedule: LayerSchedule | None = None
    provenance: Provenance = dataclasses.field(default_factory=Provenance)
    kind: ClassVar[str] = "steering_vector"

    def __post_init__(self) -> None:
        if not isinstance(self.directions, dict) or not self.directions:
            raise VectorsError("expected directions as a non-empty dict {layer: tensor[d_model]}, found "
                               f"{type(self.directions).__name__} of length {len(self.directions) if hasattr(self.directions, '__len__') else '?'}")
        dirs: dict[int, Tensor] = {}
        width = None
        for k, v in self.directions.items():
            layer = _int_layer(k, "SteeringVector.directions")
            t = _as_tensor(v, f"direction for layer {layer}")
            if t.ndim != 1:
                raise ArtifactFormatError(f"expected a 1-D direction [d_model] for layer {layer}, found shape {tuple(t.shape)}")
            if width is None:
                width = t.shape[0]
            elif t.shape[0] != width:
                raise ArtifactFormatError(f"expected every direction to have d_model={width}, found {t.shape[0]} at layer {layer}")
            _check_finite(t, f"the direction for layer {layer}")
            dirs[layer] = t
        self.directions = dict(sorted(dirs.items()))
        self.scale = float(self.scale)
        if not math.isfinite(self.scale):
            raise ArtifactFormatError(f"expected a finite scale, found {self.scale}")
        if self.operation not in VECTOR_OPERATIONS:
            raise VectorsError(f"expected operation in {VECTOR_OPERATIONS}, found {self.operation!r}")
        if self.hook_site not in HOOK_SITES:
            raise VectorsError(f"expected hook_site in {HOOK_SITES}, found {self.hook_site!r}")
        if self.positions is not None:
            self.positions = [int(p) for p in self.positions]
        if self.provenance.d_model is not None and self.provenance.d_model != width:
            raise ModelMismatchError(
                f"expected directions of d_model={self.provenance.d_model} (from the provenance), found {width}; "
                "the vector does not belong to this model"
            )
        if self.provenance.n_layers is not None:
            bad = [l for l in self.directions if l >= self.provenance.n_layers]
            if bad:
                raise ModelMismatchError(
                    f"expected layers below n_layers={self.provenance.n_layers}, found {bad}; check the layer indices (0-based)"
                )
        self.provenance = self.provenance.replace(hook_site=self.hook_site, operation=self.operation)

    # ---- construction
    @classmethod
    def from_direction(
        cls,
        v: Float[Tensor, " d_model"] | np.ndarray,
        layer: int | Iterable[int],
        model: Any = None,
        *,
        scale: float = 1.0,
        operation: str = "add",
        hook_site: str = "hook_resid_post",
        method: str | None = None,
        method_params: dict | None = None,
        prompts: Iterable[str] | None = None,
        metrics: dict | None = None,
        positions: list[int] | None = None,
    ) -> "SteeringVector":
        """Build a vector that applies ``v`` at ``layer`` (one index or several)."""
        t = _as_tensor(v, "v")
        if t.ndim == 2 and t.shape[0] == 1:
            t = t[0]
        layers = [layer] if isinstance(layer, (int, np.integer)) else list(layer)
        kw: dict[str, Any] = dict(method=method, method_params=dict(method_params or {}), prompts_hash=prompts_hash(prompts),
                  metrics=dict(metrics or {}), hook_site=hook_site, operation=operation)
        prov = Provenance.from_model(model, **kw) if model is not None else Provenance(d_model=int(t.shape[-1]) if t.ndim else None, **kw)
        if t.ndim != 1:
            raise VectorsError(f"expected v of shape [d_model], found {tuple(t.shape)}; pass one direction")
        return cls({int(l): t.clone() for l in layers}, scale=scale, operation=operation, hook_site=hook_site,
                   positions=positions, provenance=prov)

    # ---- properties
    @property
    def d_model(self) -> int:
        return int(next(iter(self.directions.values())).shape[0])

    @property
    def layers(self) -> list[int]:
        return list(self.directions)

    def hook_name(self, layer: int) -> str:
        return f"blocks.{layer}.{self.hook_site}"

    def effective(self) -> "SteeringVector":
        """The same intervention with ``scale`` and the per-layer schedule folded into the directions."""
        dirs = {}
        for l, d in self.directions.items():
            w = self.scale * (self.schedule.weight(l) if self.schedule is not None else 1.0)
            dirs[l] = d * w if w != 1.0 else d.clone()
        sched = None
        if self.schedule is not None and self.schedule.position_weights is not None:
            sched = LayerSchedule({l: 1.0 for l in dirs}, self.schedule.position_weights, self.schedule.provenance)
        return dataclasses.replace(self, directions=dirs, scale=1.0, schedule=sched)

    def to_interventions(self, facts: ModelFacts, *, scale: float = 1.0, override: bool = False) -> list[Intervention]:
        """What this vector does, as interventions (checked against ``facts`` first): ``add`` puts
        ``scale * self.scale * w_l * v_l`` at each layer ``l`` (``w_l`` the schedule's weight);
        ``project`` clamps the component along ``v_l`` to ``scale * self.scale * w_l * |v_l|``."""
        check_against(self, facts, override=override)
        if self.schedule is not None and self.schedule.position_weights is not None:
            raise VectorsError("expected a schedule without per-token weights, found position_weights; drop "
                               "them or apply the vector per position with sm.edit(..., positions=...)")
        eff = self.effective()
        pos = self.positions if self.positions is not None else "all"
        if self.operation == "add":
            return [Intervention.add(self.hook_name(l), d, scale, positions=pos) for l, d in eff.directions.items()]
        return [Intervention.clamp(self.hook_name(l), d / d.norm(), float(scale * d.norm()), positions=pos)
                for l, d in eff.directions.items()]

    def _map_tensors(self, fn) -> "SteeringVector":
        return dataclasses.replace(self, directions={l: fn(d) for l, d in self.directions.items()})

    # ---- arithmetic
    def _combine(self, other: "SteeringVector", sign: float) -> "SteeringVector":
        if not isinstance(other, SteeringVector):
            return NotImplemented
        if other.d_model != self.d_model:
            raise ModelMismatchError(f"expected vectors of equal d_model, found {self.d_model} and {other.d_model}")
        if (self.operation, self.hook_site) != (other.operation, other.hook_site) or self.operation != "add":
            raise VectorsError(
                f"expected two 'add' vectors at the same hook site, found {self.operation}@{self.hook_site} and "
                f"{other.operation}@{other.hook_site}; only additive vectors at one site can be combined"
            )
        fa, fb = self.provenance.model_fingerprint, other.provenance.model_fingerprint
        if fa and fb and fa != fb:
            raise ModelMismatchError(f"expected vectors for the same model, found fingerprints {fa} and {fb}")
        if self.positions != other.positions:
            raise VectorsError(f"expected equal positions, found {self.positions} and {other.positions}")
        a, b = self.effective(), other.effective()
        dirs = dict(a.directions)
        for l, d in b.directions.items():
            dirs[l] = dirs[l] + sign * d if l in dirs else sign * d
        prov = self.provenance.replace(
            method="combination",
            method_params={"op": "+" if sign > 0 else "-", "left": self.provenance.method, "right": other.provenance.method},
            model_fingerprint=fa or fb,
        )
        return SteeringVector(dirs, scale=1.0, operation="add", hook_site=self.hook_site, positions=self.positions, provenance=prov)

    def __add__(self, other: "SteeringVector") -> "SteeringVector":
        return self._combine(other, 1.0)

    def __radd__(self, other: Any) -> "SteeringVector":
        if isinstance(other, (int, float)) and other == 0:  # sum([...])
            return self
        return NotImplemented

    def __sub__(self, other: "SteeringVector") -> "SteeringVector":
        return self._combine(other, -1.0)

    def __mul__(self, k: float) -> "SteeringVector":
        if not isinstance(k, (int, float, np.floating, np.integer)) or isinstance(k, bool):
            return NotImplemented
        return dataclasses.replace(self, directions={l: d * float(k) for l, d in self.directions.items()})

    __rmul__ = __mul__

    def __truediv__(self, k: float) -> "SteeringVector":
        if not isinstance(k, (int, float, np.floating, np.integer)) or isinstance(k, bool):
            return NotImplemented
        if float(k) == 0.0:
            raise VectorsError("expected a nonzero divisor for a steering vector, found 0; scale it with * instead")
        return dataclasses.replace(self, directions={l: d / float(k) for l, d in self.directions.items()})

    def __neg__(self) -> "SteeringVector":
        return dataclasses.replace(self, directions={l: -d for l, d in self.directions.items()})

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SteeringVector):
            return NotImplemented
        return (self.directions.keys() == other.directions.keys()
                and all(_tensors_equal(self.directions[l], other.directions[l]) for l in self.directions)
                and (self.scale, self.operation, self.hook_site, self.positions) == (other.scale, other.operation, other.hook_site, other.positions)
                and self.schedule == other.schedule and self.provenance == other.provenance)

    __hash__ = None  # type: ignore[assignment]

    # ---- payload
    def to_payload(self) -> tuple[dict[str, Tensor], dict]:
        tensors = {f"direction.{l}": d.detach().cpu().contiguous() for l, d in self.directions.items()}
        fields = {"scale": self.scale, "operation": self.operation, "hook_site": self.hook_site, "positions": self.positions}
        if self.schedule is not None:
            st, sm = self.schedule.to_payload()
            tensors.update({f"schedule.{k}": v for k, v in st.items()})
            fields["schedule_provenance"] = sm["provenance"]
        return tensors, {"kind": self.kind, "fields": fields, "provenance": self.provenance.to_dict()}

    @classmethod
    def from_payload(cls, tensors: dict[str, Tensor], meta: dict) -> "SteeringVector":
        fields = _fields(meta, cls.kind)
        dirs, sched = {}, {}
        for k, v in tensors.items():
            if k.startswith("direction."):
                dirs[_int_layer(k.split(".", 1)[1], f"tensor name {k!r}")] = v
            elif k.startswith("schedule."):
                sched[k.split(".", 1)[1]] = v
            else:
                raise ArtifactFormatError(f"expected tensors named direction.N or schedule.*, found {k!r}")
        if not dirs:
            raise ArtifactFormatError("expected at least one direction.N tensor, found none")
        for l, d in dirs.items():
            if not d.is_floating_point():
                raise ArtifactFormatError(f"expected a floating-point direction for layer {l}, found {d.dtype}")
        schedule = None
        if sched:
            schedule = LayerSchedule.from_payload(sched, {"provenance": fields.get("schedule_provenance", {})})
        positions = fields.get("positions")
        if positions is not None and (not isinstance(positions, list) or not all(isinstance(p, int) and not isinstance(p, bool) for p in positions)):
            raise ArtifactFormatError(f"expected positions as a list of integers, found {positions!r:.100}")
        scale = fields.get("scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise ArtifactFormatError(f"expected a numeric scale, found {scale!r:.100}")
        return cls(dirs, scale=float(scale), operation=_str_field(fields, "operation", "add"),
                   hook_site=_str_field(fields, "hook_site", "hook_resid_post"), positions=positions,
                   schedule=schedule, provenance=Provenance.from_dict(meta.get("provenance", {})))


# --------------------------------------------------------------------------- DirectionSet
@dataclasses.dataclass(eq=False)
class DirectionSet(_Artifact):
    """An orthonormal basis ``[k, d_model]`` to ablate (project out of the residual stream).

    ``layers=None`` ablates everywhere: the embedding output and every attention and MLP
    output (equivalently the residual stream before, inside and after every block), which is
    what weight orthogonalisation bakes in.  With a list of layers it ablates only at
    ``blocks.{l}.{hook_site}``.

    Examples:
        >>> from steerkit.vectors import DirectionSet
        >>> ablation = DirectionSet.from_directions(torch.randn(2, 64), tiny)
        >>> ablation.k, ablation.d_model, ablation.layers
        (2, 64, None)
        >>> x = torch.randn(3, 64)
        >>> round(float((ablation.project_out(x) @ ablation.basis.T).abs().max()), 5)
        0.0
        >>> with tiny.steer(ablation):  # every write into the residual stream loses both directions
        ...     logits = tiny("Hello")
    """

    basis: Float[Tensor, "k d_model"]
    layers: list[int] | None = None
    hook_site: str = "hook_resid_post"
    provenance: Provenance = dataclasses.field(default_factory=lambda: Provenance(operation="ablate"))
    kind: ClassVar[str] = "direction_set"

    def __post_init__(self) -> None:
        b = _as_tensor(self.basis, "basis")
        if b.ndim == 1:
            b = b[None, :]
        if b.ndim != 2 or b.shape[0] < 1 or b.shape[0] > b.shape[1]:
            raise ArtifactFormatError(f"expected a basis of shape [k, d_model] with 1 <= k <= d_model, found {tuple(b.shape)}")
        _check_finite(b, "the basis")
        gram = b.double() @ b.double().T
        err = float((gram - torch.eye(b.shape[0], dtype=torch.float64)).abs().max())
        if err > ORTHO_TOL:
            raise ArtifactFormatError(
                f"expected an orthonormal basis (|B B^T - I| <= {ORTHO_TOL}), found deviation {err:.3g}; "
                "build it with DirectionSet.from_directions(...), which orthonormalises"
            )
        self.basis = b
        if self.layers is not None:
            self.layers = sorted({_int_layer(l, "DirectionSet.layers") for l in self.layers})
        if self.hook_site not in HOOK_SITES:
            raise VectorsError(f"expected hook_site in {HOOK_SITES}, found {self.hook_site!r}")
        if self.provenance.d_model is not None and self.provenance.d_model != b.shape[1]:
            raise ModelMismatchError(f"expected a basis of d_model={self.provenance.d_model}, found {b.shape[1]}")
        self.provenance = self.provenance.replace(operation="ablate", hook_site=self.hook_site)

    @classmethod
    def from_directions(cls, directions: Float[Tensor, "k d_model"] | np.ndarray, model: Any = None,
                        layers: list[int] | None = None, *, method: str | None = None,
                        prompts: Iterable[str] | None = None, metrics: dict | None = None) -> "DirectionSet":
        """Orthonormalise ``directions`` (rows) with :func:`steerkit.kernels.orthonormalize` (QR in
        float64; row ``i`` has a positive dot product with direction ``i``) and wrap them."""
        d = _as_tensor(directions, "directions")
        if d.ndim == 1:
            d = d[None, :]
        if d.ndim != 2:
            raise VectorsError(f"expected directions of shape [k, d_model] or [d_model], found {tuple(d.shape)}; "
                               "stack the directions as rows")
        basis = orthonormalize(d)
        if basis.shape[0] < d.shape[0]:
            raise VectorsError(f"expected {d.shape[0]} linearly independent directions, found a dependent set "
                               f"(rank {basis.shape[0]}); drop redundant rows")
        kw: dict[str, Any] = dict(method=method, prompts_hash=prompts_hash(prompts), metrics=dict(metrics or {}),
                                  operation="ablate")
        prov = Provenance.from_model(model, **kw) if model is not None else Provenance(d_model=int(d.shape[1]), **kw)
        return cls(basis, layers=layers, provenance=prov)

    @property
    def d_model(self) -> int:
        return int(self.basis.shape[1])

    @property
    def k(self) -> int:
        return int(self.basis.shape[0])

    def hook_names(self, n_layers: int) -> list[str]:
        """Where the basis is ablated: ``blocks.{l}.{hook_site}`` for each layer, or everywhere
        (``layers=None``): the embedding output and every attention and MLP output."""
        if self.layers is None:
            return ["blocks.0.hook_resid_pre"] + [f"blocks.{l}.{h}" for l in range(n_layers)
                                                  for h in ("hook_attn_out", "hook_mlp_out")]
        return [f"blocks.{l}.{self.hook_site}" for l in self.layers]

    def to_interventions(self, facts: ModelFacts, *, scale: float = 1.0, override: bool = False) -> list[Intervention]:
        """The ablation as interventions (checked against ``facts`` first); ``scale`` is its strength
        (1: the component in the basis' span is removed, 0.5: halved)."""
        check_against(self, facts, override=override)
        return [Intervention.ablate(h, self.basis, scale) for h in self.hook_names(facts.n_layers)]

    def project_out(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        b = self.basis.to(x.device, x.dtype)
        return x - (x @ b.T) @ b

    def _map_tensors(self, fn) -> "DirectionSet":
        return dataclasses.replace(self, basis=fn(self.basis))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DirectionSet):
            return NotImplemented
        return (_tensors_equal(self.basis, other.basis) and self.layers == other.layers
                and self.hook_site == other.hook_site and self.provenance == other.provenance)

    __hash__ = None  # type: ignore[assignment]

    def to_payload(self) -> tuple[dict[str, Tensor], dict]:
        return ({"basis": self.basis.detach().cpu().contiguous()},
                {"kind": self.kind, "fields": {"layers": self.layers, "hook_site": self.hook_site},
                 "provenance": self.provenance.to_dict()})

    @classmethod
    def from_payload(cls, tensors: dict[str, Tensor], meta: dict) -> "DirectionSet":
        fields = _fields(meta, cls.kind)
        _expect_keys(tensors, {"basis"}, set(), cls.kind)
        layers = fields.get("layers")
        if layers is not None and not isinstance(layers, list):
            raise ArtifactFormatError(f"expected layers as a list or null, found {layers!r:.100}")
        if not tensors["basis"].is_floating_point():
            raise ArtifactFormatError(f"expected a floating-point basis, found {tensors['basis'].dtype}")
        return cls(tensors["basis"], layers=layers, hook_site=_str_field(fields, "hook_site", "hook_resid_post"),
                   provenance=Provenance.from_dict(meta.get("provenance", {})))


# --------------------------------------------------------------------------- Probe
@dataclasses.dataclass(eq=False)
class Probe(_Artifact):
    """A fitted linear probe stored as arrays: ``z = ((x - mean) / scale) @ projection.T``,
    ``logits = z @ weight.T + bias`` (``projection`` optional; ``mean``/``scale`` optional).

    Examples:
        >>> from steerkit.vectors import Probe
        >>> probe = Probe(weight=torch.tensor([[1.0, -1.0]]), bias=torch.tensor([0.0]), layer=3,
        ...               classes=["neg", "pos"])
        >>> probe.decision_function(torch.tensor([[2.0, 0.0]]))
        tensor([[2.]])
        >>> probe.predict_proba(torch.tensor([[2.0, 0.0]])).round(decimals=3)
        tensor([[0.1190, 0.8810]])
    """

    weight: Float[Tensor, "n_out k"]
    bias: Float[Tensor, " n_out"]
    layer: int
    classes: list[str] = dataclasses.field(default_factory=list)
    mean: Float[Tensor, " d_model"] | None = None
    scale: Float[Tensor, " d_model"] | None = None
    projection: Float[Tensor, "k d_model"] | None = None
    hook_site: str = "hook_resid_post"
    probe_kind: str = "logistic"
    provenance: Provenance = dataclasses.field(default_factory=lambda: Provenance(operation="read"))
    kind: ClassVar[str] = "probe"
    _OPTIONAL: ClassVar[tuple[str, ...]] = ("mean", "scale", "projection")

    def __post_init__(self) -> None:
        self.weight = _as_tensor(self.weight, "weight")
        if self.weight.ndim == 1:
            self.weight = self.weight[None, :]
        self.bias = _as_tensor(self.bias, "bias").reshape(-1)
        for name in self._OPTIONAL:
            v = getattr(self, name)
            if v is not None:
                setattr(self, name, _as_tensor(v, name))
        if self.weight.ndim != 2 or self.bias.shape[0] != self.weight.shape[0]:
            raise ArtifactFormatError(f"expected weight [n_out, k] and bias [n_out], found {tuple(self.weight.shape)} and {tuple(self.bias.shape)}")
        d = self.d_model
        k = self.weight.shape[1]
        if self.projection is not None and (self.projection.ndim != 2 or self.projection.shape[0] != k):
            raise ArtifactFormatError(f"expected projection [k={k}, d_model], found {tuple(self.projection.shape)}")
        for name in ("mean", "scale"):
            v = getattr(self, name)
            if v is not None and tuple(v.shape) != (d,):
                raise ArtifactFormatError(f"expected {name} of shape [{d}], found {tuple(v.shape)}")
        for name in ("weight", "bias", *self._OPTIONAL):
            v = getattr(self, name)
            if v is not None:
                _check_finite(v, f"probe {name}")
        self.layer = _int_layer(self.layer, "Probe.layer")
        self.classes = [str(c) for c in self.classes]
        self.provenance = self.provenance.replace(operation="read", hook_site=self.hook_site)

    @property
    def d_model(self) -> int:
        return int(self.projection.shape[1] if self.projection is not None else self.weight.shape[1])

    def features(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... k"]:
        z = x
        if self.mean is not None:
            z = z - self.mean.to(z)
        if self.scale is not None:
            z = z / self.scale.to(z)
        if self.projection is not None:
            z = z @ self.projection.to(z).T
        return z

    def decision_function(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... n_out"]:
        return self.features(x) @ self.weight.to(x).T + self.bias.to(x)

    def predict_proba(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... n_classes"]:
        s = self.decision_function(x)
        if s.shape[-1] == 1:
            p = torch.sigmoid(s)
            return torch.cat([1 - p, p], dim=-1)
        return torch.softmax(s, dim=-1)

    def _map_tensors(self, fn) -> "Probe":
        def opt(t: Tensor | None) -> Tensor | None:
            return fn(t) if t is not None else None

        # the optional tensors are the fields named in _OPTIONAL
        return dataclasses.replace(self, weight=fn(self.weight), bias=fn(self.bias), mean=opt(self.mean),
                                   scale=opt(self.scale), projection=opt(self.projection))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Probe):
            return NotImplemented
        return (all(_tensors_equal(getattr(self, n), getattr(other, n)) for n in ("weight", "bias", *self._OPTIONAL))
                and (self.layer, self.classes, self.hook_site, self.probe_kind, self.provenance)
                == (other.layer, other.classes, other.hook_site, other.probe_kind, other.provenance))

    __hash__ = None  # type: ignore[assignment]

    def to_payload(self) -> tuple[dict[str, Tensor], dict]:
        tensors = {"weight": self.weight, "bias": self.bias}
        tensors.update({n: getattr(self, n) for n in self._OPTIONAL if getattr(self, n) is not None})
        return ({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                {"kind": self.kind, "fields": {"layer": self.layer, "classes": self.classes, "hook_site": self.hook_site,
                                               "probe_kind": self.probe_kind},
                 "provenance": self.provenance.to_dict()})

    @classmethod
    def from_payload(cls, tensors: dict[str, Tensor], meta: dict) -> "Probe":
        fields = _fields(meta, cls.kind)
        _expect_keys(tensors, {"weight", "bias"}, set(cls._OPTIONAL), cls.kind)
        classes = fields.get("classes", [])
        if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
            raise ArtifactFormatError(f"expected classes as a list of strings, found {classes!r:.100}")
        return cls(tensors["weight"], tensors["bias"], layer=fields.get("layer", 0), classes=classes,
                   hook_site=_str_field(fields, "hook_site", "hook_resid_post"),
                   probe_kind=_str_field(fields, "probe_kind", "logistic"),
                   provenance=Provenance.from_dict(meta.get("provenance", {})),
                   **{n: tensors.get(n) for n in cls._OPTIONAL})


# --------------------------------------------------------------------------- Region
@dataclasses.dataclass(eq=False)
class Region(KernelRegion, _Artifact):
    """A polyhedron in a PCA subspace: inside iff ``normals @ (projection @ (x - mean)) <= offsets``.

    A :class:`steerkit.Polyhedron` (``coordinates``, ``contains``, ``project``, ``validate``; pass
    it to ``SteerConfig(region=...)`` or :func:`steerkit.kernels.fused_steer` as it is) stored at
    ``blocks.{layer}.{hook_site}`` with a provenance.

    Examples:
        >>> from steerkit.vectors import Provenance, Region
        >>> box = Region(mean=torch.zeros(64), projection=torch.eye(64)[:1],  # x[0] <= 1
        ...              normals=torch.tensor([[1.0]]), offsets=torch.tensor([1.0]), layer=2,
        ...              provenance=Provenance.from_model(tiny))
        >>> x = torch.zeros(2, 64)
        >>> x[:, 0] = torch.tensor([0.5, 3.0])
        >>> box.contains(x)
        tensor([ True, False])
        >>> with tiny.steer(box):  # projects the output of block 2 into the region
        ...     logits = tiny("Hello")
    """

    layer: int
    hook_site: str = "hook_resid_post"
    provenance: Provenance = dataclasses.field(default_factory=lambda: Provenance(operation="read"))
    kind: ClassVar[str] = "region"

    def __post_init__(self) -> None:
        self.mean = _as_tensor(self.mean, "mean")
        self.projection = _as_tensor(self.projection, "projection")
        self.normals = _as_tensor(self.normals, "normals")
        self.offsets = _as_tensor(self.offsets, "offsets")
        d = self.mean.shape[0] if self.mean.ndim == 1 else -1
        if (self.mean.ndim != 1 or self.projection.ndim != 2 or self.projection.shape[1] != d
                or self.normals.ndim != 2 or self.normals.shape[1] != self.projection.shape[0]
                or tuple(self.offsets.shape) != (self.normals.shape[0],)):
            raise ArtifactFormatError(
                "expected mean [d], projection [k, d], normals [m, k], offsets [m]; found "
                f"{tuple(self.mean.shape)}, {tuple(self.projection.shape)}, {tuple(self.normals.shape)}, {tuple(self.offsets.shape)}"
            )
        for n in ("mean", "projection", "normals", "offsets"):
            _check_finite(getattr(self, n), f"region {n}")
        self.layer = _int_layer(self.layer, "Region.layer")
        self.provenance = self.provenance.replace(operation="read", hook_site=self.hook_site)

    @property
    def d_model(self) -> int:
        return int(self.mean.shape[0])

    def to_interventions(self, facts: ModelFacts, *, scale: float = 1.0, override: bool = False) -> list[Intervention]:
        """The projection into this region at ``blocks.{layer}.{hook_site}`` (checked against ``facts``
        first); ``scale`` is its strength."""
        check_against(self, facts, override=override)
        return [Intervention.project(f"blocks.{self.layer}.{self.hook_site}", self, scale)]

    def _map_tensors(self, fn) -> "Region":
        return dataclasses.replace(self, mean=fn(self.mean), projection=fn(self.projection),
                                   normals=fn(self.normals), offsets=fn(self.offsets))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Region):
            return NotImplemented
        return (all(_tensors_equal(getattr(self, n), getattr(other, n)) for n in ("mean", "projection", "normals", "offsets"))
                and (self.layer, self.hook_site, self.provenance) == (other.layer, other.hook_site, other.provenance))

    __hash__ = None  # type: ignore[assignment]

    def to_payload(self) -> tuple[dict[str, Tensor], dict]:
        return ({n: getattr(self, n).detach().cpu().contiguous() for n in ("mean", "projection", "normals", "offsets")},
                {"kind": self.kind, "fields": {"layer": self.layer, "hook_site": self.hook_site},
                 "provenance": self.provenance.to_dict()})

    @classmethod
    def from_payload(cls, tensors: dict[str, Tensor], meta: dict) -> "Region":
        fields = _fields(meta, cls.kind)
        _expect_keys(tensors, {"mean", "projection", "normals", "offsets"}, set(), cls.kind)
        return cls(**{n: tensors[n] for n in ("mean", "projection", "normals", "offsets")}, layer=fields.get("layer", 0),
                   hook_site=_str_field(fields, "hook_site", "hook_resid_post"),
                   provenance=Provenance.from_dict(meta.get("provenance", {})))


# --------------------------------------------------------------------------- ConditionVector
CONDITION_SITES = ("hook_resid_pre", "hook_resid_mid", "hook_resid_post")


def _finite_number(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise ArtifactFormatError(f"expected {what} as a number, found {v!r:.100}")
    f = float(v)
    if not math.isfinite(f):
        raise ArtifactFormatError(f"expected a finite {what}, found {f}")
    return f


def _choice(v: Any, allowed: tuple, what: str) -> str:
    if v not in allowed:
        raise ArtifactFormatError(f"expected {what} in {allowed}, found {v!r:.100}")
    return v


def _check_report(report: Any) -> dict:
    """A condition fit report, validated: JSON-able scalars, lists of numbers, and its F1 grid
    ``[comparators, layers, thresholds]`` (a float64 tensor)."""
    if not isinstance(report, dict):
        raise ArtifactFormatError(f"expected the condition fit report as a dict, found {type(report).__name__}")
    out: dict = {}
    for k, v in report.items():
        if not isinstance(k, str):
            raise ArtifactFormatError(f"expected string keys in the condition fit report, found {k!r:.60}")
        if k == "grid":
            t = _as_tensor(v, "the report's F1 grid").to(torch.float64)
            if t.ndim != 3:
                raise ArtifactFormatError(f"expected the report's F1 grid as [comparators, layers, thresholds], "
                                          f"found shape {tuple(t.shape)}")
            _check_finite(t, "the report's F1 grid")
            out[k] = t
        elif isinstance(v, (bool, str)) or v is None:
            out[k] = v
        elif isinstance(v, (int, float, np.integer, np.floating)):
            out[k] = int(v) if isinstance(v, (int, np.integer)) else _finite_number(v, f"report[{k!r}]")
        elif isinstance(v, (list, tuple)):
            if not all(isinstance(x, (int, float, str, np.integer, np.floating)) and not isinstance(x, bool) for x in v):
                raise ArtifactFormatError(f"expected report[{k!r}] as a list of numbers or strings, found {v!r:.100}")
            out[k] = [x if isinstance(x, str) else int(x) if isinstance(x, (int, np.integer))
                      else _finite_number(x, f"report[{k!r}]") for x in v]
        elif isinstance(v, dict):
            if not all(isinstance(a, str) and isinstance(b, (int, np.integer)) and not isinstance(b, bool)
                       for a, b in v.items()):
                raise ArtifactFormatError(f"expected report[{k!r}] as {{name: count}}, found {v!r:.100}")
            out[k] = {a: int(b) for a, b in v.items()}
        else:
            raise ArtifactFormatError(f"expected JSON-able values in the condition fit report, found "
                                      f"{type(v).__name__} at {k!r}")
    g = out.get("grid")
    if g is not None:
        want = (len(out.get("comparators", [])), len(out.get("layers", [])), len(out.get("thresholds", [])))
        if tuple(g.shape) != want:
            raise ArtifactFormatError(f"expected the report's F1 grid of shape {want} (comparators, layers, "
                                      f"thresholds), found {tuple(g.shape)}")
    return out


def _report_equal(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(_tensors_equal(a[k], b[k]) if isinstance(a[k], Tensor) or isinstance(b[k], Tensor) else a[k] == b[k]
               for k in a)


@dataclasses.dataclass(eq=False)
class ConditionVector(_Artifact):
    """A CAST condition (Lee et al. 2024) as a stored artifact: a unit ``direction`` read at
    ``blocks.{layer}.{hook_site}``, the ``threshold`` and ``comparator`` its similarity is compared with,
    how the prompt is ``aggregate``-d and ``measure``-d (see :class:`steerkit.Condition`), whether prompts
    get the chat template (``chat``), and the fit ``report`` of :func:`steerkit.probes.fit_condition`
    (F1, precision, recall, the confusion counts and the F1 of every layer x threshold x comparator
    searched, as ``report["grid"]``). Conditions do not steer: pair one with a behaviour in a
    :class:`ConditionalSteering`.

    Examples:
        >>> from steerkit.vectors import ConditionVector
        >>> cv = ConditionVector(torch.ones(64), layer=1, threshold=0.2)
        >>> cv.to_condition()
        Condition('blocks.1.hook_resid_pre', [64], above 0.2, aggregate='mean', measure='cast')
        >>> fired = cv.fires(tiny, ["Hello", "How do I bake bread?"])  # one bool per prompt
        >>> len(fired), cv.report
        (2, {})
        >>> ConditionVector(torch.ones(64), layer=1, threshold=-1.0).fires(tiny, ["Hello"]) == [True]  # cos > -1
        True
    """

    direction: Float[Tensor, " d_model"]
    layer: int
    threshold: float
    comparator: str = "above"
    aggregate: str = "mean"
    measure: str = "cast"
    hook_site: str = "hook_resid_pre"
    chat: bool = True
    report: dict = dataclasses.field(default_factory=dict)
    provenance: Provenance = dataclasses.field(default_factory=lambda: Provenance(operation="condition"))
    kind: ClassVar[str] = "condition_vector"

    def __post_init__(self) -> None:
        t = _as_tensor(self.direction, "the condition direction")
        if t.ndim == 2 and t.shape[0] == 1:
            t = t[0]
        if t.ndim != 1 or t.shape[0] == 0:
            raise ArtifactFormatError(f"expected a condition direction of shape [d_model], found {tuple(t.shape)}")
        _check_finite(t, "the condition direction")
        n = float(t.double().norm())
        if n < 1e-12:
            raise ArtifactFormatError("expected a nonzero condition direction, found a zero vector")
        self.direction = t if abs(n - 1.0) < 1e-6 else t / n
        self.layer = _int_layer(self.layer, "ConditionVector.layer")
        self.threshold = _finite_number(self.threshold, "condition threshold")
        self.comparator = _choice(self.comparator, ("above", "below"), "the comparator")
        self.aggregate = _choice(self.aggregate, ("mean", "last"), "the aggregate")
        self.measure = _choice(self.measure, ("cast", "cosine"), "the measure")
        self.hook_site = _choice(self.hook_site, CONDITION_SITES, "the hook site")
        if not isinstance(self.chat, bool):
            raise ArtifactFormatError(f"expected chat as a bool, found {self.chat!r:.60}")
        self.report = _check_report(self.report)
        if self.provenance.d_model is not None and self.provenance.d_model != t.shape[0]:
            raise ModelMismatchError(f"expected a condition direction of d_model={self.provenance.d_model} (from the "
                                     f"provenance), found {t.shape[0]}")
        self.provenance = self.provenance.replace(operation="condition", hook_site=self.hook_site)

    @property
    def d_model(self) -> int:
        return int(self.direction.shape[0])

    @property
    def site(self) -> str:
        """The hook name the condition reads: ``blocks.{layer}.{hook_site}``."""
        return f"blocks.{self.layer}.{self.hook_site}"

    def to_condition(self) -> "Condition":
        """This artifact as the :class:`steerkit.Condition` compiled steering evaluates."""
        return Condition(self.site, self.direction, self.threshold, self.comparator, self.aggregate, self.measure)

    def _run(self, sm: "SteerModel", prompts, batch_size: int, progress: bool) -> tuple[list[bool], list[float]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise VectorsError("expected at least one prompt to test the condition on, found none")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise VectorsError(f"expected batch_size as a positive int, found {batch_size!r:.60}")
        check_against(self, sm.facts)
        cond = self.to_condition()
        # the same compiled evaluator a conditional steering uses: a steering with this condition only
        compiled = compile_steering([], sm.facts, device=sm.device, dtype=sm.dtype, conditions=[cond])
        fired: list[bool] = []
        sims: list[float] = []
        with sm.hooks.install(compiled, label=f"condition {cond.site}"):
            starts = range(0, len(prompts), batch_size)
            for i in tqdm(starts, desc="condition", disable=not progress or len(starts) < 2):
                sm.forward(prompts[i:i + batch_size], chat=self.chat)
                fired += [bool(b) for b in compiled.decisions[cond].tolist()]
                sims += [float(s) for s in compiled.similarities[cond].tolist()]
        return fired, sims

    def fires(self, sm: "SteerModel", prompts, *, batch_size: int = 16, progress: bool = True) -> list[bool]:
        """Whether the condition fires on each prompt, decided by the compiled evaluator conditional
        steering runs (a steering with this condition alone, one forward pass per batch; a progress bar
        over the batches when there are several)."""
        return self._run(sm, prompts, batch_size, progress)[0]

    def similarities(self, sm: "SteerModel", prompts, *, batch_size: int = 16, progress: bool = True) -> list[float]:
        """Each prompt's similarity (what :meth:`fires` compares with ``threshold``)."""
        return self._run(sm, prompts, batch_size, progress)[1]

    def _map_tensors(self, fn) -> "ConditionVector":
        return dataclasses.replace(self, direction=fn(self.direction))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ConditionVector):
            return NotImplemented
        return (_tensors_equal(self.direction, other.direction)
                and (self.layer, self.threshold, self.comparator, self.aggregate, self.measure, self.hook_site,
                     self.chat, self.provenance)
                == (other.layer, other.threshold, other.comparator, other.aggregate, other.measure, other.hook_site,
                    other.chat, other.provenance)
                and _report_equal(self.report, other.report))

    __hash__ = None  # type: ignore[assignment]

    def to_payload(self) -> tuple[dict[str, Tensor], dict]:
        tensors = {"direction": self.direction.detach().cpu().contiguous()}
        report = {k: v for k, v in self.report.items() if k != "grid"}
        if "grid" in self.report:
            tensors["report.grid"] = self.report["grid"].detach().cpu().contiguous()
        fields = {"layer": self.layer, "threshold": self.threshold, "comparator": self.comparator,
                  "aggregate": self.aggregate, "measure": self.measure, "hook_site": self.hook_site, "chat": self.chat,
                  "report": report}
        return tensors, {"kind": self.kind, "fields": fields, "provenance": self.provenance.to_dict()}

    @classmethod
    def from_payload(cls, tensors: dict[str, Tensor], meta: dict) -> "ConditionVector":
        fields = _fields(meta, cls.kind)
        _expect_keys(tensors, {"direction"}, {"report.grid"}, cls.kind)
        if not tensors["direction"].is_floating_point():
            raise ArtifactFormatError(f"expected a floating-point condition direction, found {tensors['direction'].dtype}")
        report = fields.get("report", {})
        if not isinstance(report, dict) or "grid" in report:
            raise ArtifactFormatError(f"expected the condition report as an object without 'grid', found {report!r:.100}")
        report = dict(report)
        if "report.grid" in tensors:
            report["grid"] = tensors["report.grid"]
        if "threshold" not in fields or "layer" not in fields:
            raise ArtifactFormatError(f"expected 'layer' and 'threshold' in a {cls.kind}, found {sorted(fields)[:20]}")
        layer = fields["layer"]
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise ArtifactFormatError(f"expected an integer layer, found {layer!r:.60}")
        return cls(tensors["direction"], layer=layer, threshold=_finite_number(fields["threshold"], "threshold"),
                   comparator=_str_field(fields, "comparator", "above"), aggregate=_str_field(fields, "aggregate", "mean"),
                   measure=_str_field(fields, "measure", "cast"), hook_site=_str_field(fields, "hook_site", "hook_resid_pre"),
                   chat=fields.get("chat", True), report=report, provenance=Provenance.from_dict(meta.get("provenance", {})))

    # ---- the fit report
    def to_json(self, path=None) -> str:
        """The condition point and its fit report (the F1 grid as nested lists) as JSON text, written to
        ``path`` when given."""
        rep = {k: (v.tolist() if isinstance(v, Tensor) else v) for k, v in self.report.items()}
        doc = {"format": "steerkit.condition/1", "site": self.site, "layer": self.layer, "threshold": self.threshold,
               "comparator": self.comparator, "aggregate": self.aggregate, "measure": self.measure, "chat": self.chat,
               "report": rep, "provenance": self.provenance.to_dict()}
        text = json.dumps(doc, indent=1, allow_nan=False)
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    def plot(self, *, title: str | None = None):
        """A plotly heatmap of the fit's F1 over layer x threshold, one panel per comparator, with the
        chosen condition point marked."""
        grid = self.report.get("grid")
        if grid is None:
            raise VectorsError("expected a fit report with an F1 grid to plot, found none; fit the condition with "
                               "steerkit.probes.fit_condition")
        try:
            from plotly.subplots import make_subplots
            import plotly.graph_objects as go
        except ImportError:  # pragma: no cover - plotly is a dependency
            raise VectorsError("expected plotly to be installed to plot, found it missing; pip install plotly") from None
        comps, layers, thr = self.report["comparators"], self.report["layers"], self.report["thresholds"]
        fig = make_subplots(rows=1, cols=len(comps), subplot_titles=[f"fires when {c}" for c in comps],
                            shared_yaxes=True)
        for i, c in enumerate(comps):
            fig.add_trace(go.Heatmap(z=grid[i].tolist(), x=[round(t, 4) for t in thr], y=layers, zmin=0, zmax=1,
                                     colorscale="Viridis", coloraxis="coloraxis", name=c,
                                     hovertemplate="layer %{y}<br>threshold %{x}<br>F1 %{z:.3f}<extra></extra>"),
                          row=1, col=i + 1)
            if c == self.comparator:
                fig.add_trace(go.Scatter(x=[self.threshold], y=[self.layer], mode="markers", name="chosen",
                                         marker=dict(symbol="x", size=12, color="red")), row=1, col=i + 1)
            fig.update_xaxes(title_text="threshold", row=1, col=i + 1)
        fig.update_yaxes(title_text="layer", row=1, col=1)
        f1 = self.report.get("f1")
        fig.update_layout(coloraxis=dict(colorscale="Viridis", cmin=0, cmax=1, colorbar=dict(title="F1")),
                          title=title or f"condition point: layer {self.layer}, {self.comparator} {self.threshold:.4g}"
                          + (f", F1 {f1:.3f}" if isinstance(f1, float) else ""))
        return fig


# --------------------------------------------------------------------------- ConditionalSteering
BEHAVIOR_KINDS = ("steering_vector", "direction_set", "region")
RULE_MODES = ("any", "all")


@dataclasses.dataclass(eq=False)
class ConditionalRule:
    """One rule of a :class:`ConditionalSteering`: apply ``behavior`` (a steering artifact) on rows where
    ``"any"`` / ``"all"`` of ``conditions`` fire (the opposite with ``negate``).

    Examples:
        >>> from steerkit.vectors import ConditionVector, ConditionalRule, SteeringVector
        >>> c1 = ConditionVector(torch.ones(64), layer=1, threshold=0.2)
        >>> c2 = ConditionVector(-torch.ones(64), layer=2, threshold=0.1)
        >>> r = ConditionalRule([c1, c2], SteeringVector.from_direction(torch.ones(64), layer=3), mode="all")
        >>> len(r.conditions), r.mode, r.negate
        (2, 'all', False)
    """

    conditions: list
    behavior: Any
    mode: str = "any"
    negate: bool = False

    def __post_init__(self) -> None:
        cs = [self.conditions] if isinstance(self.conditions, ConditionVector) else self.conditions
        if not isinstance(cs, (list, tuple)) or not cs or not all(isinstance(c, ConditionVector) for c in cs):
            raise VectorsError(f"expected a rule's conditions as one or more ConditionVector values, found "
                               f"{self.conditions!r:.100}")
        self.conditions = list(cs)
        if getattr(self.behavior, "kind", None) not in BEHAVIOR_KINDS:
            raise VectorsError(f"expected a rule's behavior as a steering artifact ({', '.join(BEHAVIOR_KINDS)}), "
                               f"found {type(self.behavior).__name__}")
        if self.mode not in RULE_MODES:
            raise VectorsError(f"expected a rule mode in {RULE_MODES}, found {self.mode!r:.60}")
        if not isinstance(self.negate, bool):
            raise VectorsError(f"expected negate as a bool, found {self.negate!r:.60}")
        widths = {c.d_model for c in self.conditions} | {self.behavior.d_model}
        if len(widths) != 1:
            raise ModelMismatchError(f"expected the conditions and the behavior of a rule to have one d_model, "
                                     f"found {sorted(widths)}")

    def when(self) -> When:
        """The :class:`steerkit.When` this rule lowers to."""
        return When(tuple(c.to_condition() for c in self.conditions), self.mode, self.negate)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ConditionalRule):
            return NotImplemented
        return ((self.mode, self.negate) == (other.mode, other.negate) and len(self.conditions) == len(other.conditions)
                and all(a == b for a, b in zip(self.conditions, other.conditions)) and self.behavior == other.behavior)

    __hash__ = None  # type: ignore[assignment]


class ConditionalSteering(_Artifact):
    """Conditional activation steering (CAST, Lee et al. 2024) as one artifact: rules "if these
    conditions fire, apply this behaviour", each decided per row on the prompt and held for the whole
    generation. ``ConditionalSteering(condition=c, behavior=v)`` is one rule;
    ``ConditionalSteering(rules=[ConditionalRule([c1, c2], v1, mode="any"), ConditionalRule([c3], v2)])`` several.
    ``sm.steer(cs)`` / ``sm.generate(..., steering=cs)`` apply it; ``cs * k`` scales every behaviour.

    Examples:
        >>> from steerkit.vectors import ConditionalSteering, ConditionVector, SteeringVector
        >>> cv = ConditionVector(torch.ones(64), layer=1, threshold=-1.0)  # fires on every prompt
        >>> cs = ConditionalSteering(condition=cv, behavior=SteeringVector.from_direction(torch.ones(64), layer=2))
        >>> ivs = cs.to_interventions(tiny.facts)  # the behaviour's interventions, each with the rule's when
        >>> len(ivs), ivs[0].when is not None
        (1, True)
        >>> with tiny.steer(cs) as handle:
        ...     logits = tiny("Hello")
        >>> bool(list(handle.decisions.values())[0].all())  # the row fired: it was steered
        True
    """

    kind: ClassVar[str] = "conditional_steering"

    def __init__(self, condition: ConditionVector | list | None = None, behavior: Any = None, *,
                 rules: list | None = None, mode: str = "any", negate: bool = False,
                 provenance: Provenance | None = None):
        if rules is not None and (condition is not None or behavior is not None):
            raise VectorsError("expected either condition= and behavior= (one rule) or rules=[...], found both")
        if rules is None:
            if condition is None or behavior is None:
                raise VectorsError("expected condition= and behavior= (or rules=[ConditionalRule(...), ...]), found "
                                   f"condition={type(condition).__name__}, behavior={type(behavior).__name__}")
            rules = [ConditionalRule(condition if isinstance(condition, list) else [condition], behavior, mode, negate)]
        if not isinstance(rules, (list, tuple)) or not rules or not all(isinstance(r, ConditionalRule) for r in rules):
            raise VectorsError(f"expected rules as a non-empty list of ConditionalRule values, found {rules!r:.100}")
        self.rules: list[ConditionalRule] = list(rules)
        widths = {r.behavior.d_model for r in self.rules}
        if len(widths) != 1:
            raise ModelMismatchError(f"expected every rule of a conditional steering to have one d_model, found "
                                     f"{sorted(widths)}")
        if provenance is None:
            p = self.rules[0].behavior.provenance
            provenance = Provenance(model_name=p.model_name, model_fingerprint=p.model_fingerprint,
                                    model_arch=p.model_arch, d_model=self.d_model, n_layers=p.n_layers, method="cast")
        if not isinstance(provenance, Provenance):
            raise VectorsError(f"expected a Provenance, found {type(provenance).__name__}")
        if provenance.d_model is not None and provenance.d_model != self.d_model:
            raise ModelMismatchError(f"expected a conditional steering of d_model={provenance.d_model} (from the "
                                     f"provenance), found {self.d_model}")
        self.provenance = provenance.replace(operation="conditional")

    @property
    def d_model(self) -> int:
        return int(self.rules[0].behavior.d_model)

    @property
    def conditions(self) -> list[ConditionVector]:
        """Every condition of every rule, in order (repeats removed)."""
        out: list[ConditionVector] = []
        for r in self.rules:
            out += [c for c in r.conditions if not any(c == o for o in out)]
        return out

    def to_interventions(self, facts: ModelFacts, *, scale: float = 1.0, override: bool = False) -> list[Intervention]:
        """Every rule's behaviour lowered (``behavior.to_interventions``, with ``scale``) and given the
        rule's ``when``; every nested artifact is checked against ``facts`` first."""
        check_against(self, facts, override=override)
        out: list[Intervention] = []
        for r in self.rules:
            for c in r.conditions:
                check_against(c, facts, override=override)
            when = r.when()
            out += [dataclasses.replace(iv, when=when)
                    for iv in r.behavior.to_interventions(facts, scale=scale, override=override)]
        return out

    def _map_rules(self, behavior_fn, tensor_fn=None) -> "ConditionalSteering":
        rules = [ConditionalRule([c._map_tensors(tensor_fn) if tensor_fn else c for c in r.conditions], behavior_fn(r.behavior),
                      r.mode, r.negate) for r in self.rules]
        return ConditionalSteering(rules=rules, provenance=self.provenance)

    def _map_tensors(self, fn) -> "ConditionalSteering":
        return self._map_rules(lambda b: b._map_tensors(fn), fn)

    def _scaled(self, op) -> "ConditionalSteering":
        def scale(b):
            y = op(b)
            if y is NotImplemented:
                raise VectorsError(f"expected behaviours that scale (steering vectors), found a {b.kind}")
            return y
        return self._map_rules(scale)

    def __mul__(self, k: float) -> "ConditionalSteering":
        if not isinstance(k, (int, float, np.floating, np.integer)) or isinstance(k, bool):
            return NotImplemented
        return self._scaled(lambda b: b.__mul__(k))

    __rmul__ = __mul__

    def __truediv__(self, k: float) -> "ConditionalSteering":
        if not isinstance(k, (int, float, np.floating, np.integer)) or isinstance(k, bool):
            return NotImplemented
        return self._scaled(lambda b: b.__truediv__(k))

    def __neg__(self) -> "ConditionalSteering":
        return self._scaled(lambda b: b.__neg__() if hasattr(b, "__neg__") else NotImplemented)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ConditionalSteering):
            return NotImplemented
        return (len(self.rules) == len(other.rules) and all(a == b for a, b in zip(self.rules, other.rules))
                and self.provenance == other.provenance)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self):
        rules = "; ".join(f"if {r.mode}({', '.join(c.site for c in r.conditions)}){' negated' if r.negate else ''} "
                          f"then {r.behavior.kind}" for r in self.rules)
        return f"ConditionalSteering({rules})"

    def to_payload(self) -> tuple[dict[str, Tensor], dict]:
        tensors: dict[str, Tensor] = {}
        rules = []
        for i, r in enumerate(self.rules):
            conds = []
            for j, c in enumerate(r.conditions):
                t, m = c.to_payload()
                tensors.update({f"rule.{i}.condition.{j}.{k}": v for k, v in t.items()})
                conds.append(m)
            t, m = r.behavior.to_payload()
            tensors.update({f"rule.{i}.behavior.{k}": v for k, v in t.items()})
            rules.append({"mode": r.mode, "negate": r.negate, "conditions": conds, "behavior": m})
        return tensors, {"kind": self.kind, "fields": {"rules": rules}, "provenance": self.provenance.to_dict()}

    @classmethod
    def from_payload(cls, tensors: dict[str, Tensor], meta: dict) -> "ConditionalSteering":
        fields = _fields(meta, cls.kind)
        specs = fields.get("rules")
        if not isinstance(specs, list) or not specs or len(specs) > 1000:
            raise ArtifactFormatError(f"expected 'rules' as a non-empty list in a {cls.kind}, found {specs!r:.100}")
        used: set = set()

        def nested(prefix: str, m: Any, kinds: tuple) -> Any:
            if not isinstance(m, dict) or m.get("kind") not in kinds:
                raise ArtifactFormatError(f"expected a nested artifact of kind {kinds} at {prefix!r}, found "
                                          f"{(m.get('kind') if isinstance(m, dict) else m)!r:.100}")
            sub = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            used.update(prefix + k for k in sub)
            return payload_to_artifact(sub, m)

        rules = []
        for i, spec in enumerate(specs):
            if not isinstance(spec, dict) or set(spec) != {"mode", "negate", "conditions", "behavior"}:
                raise ArtifactFormatError(f"expected rule {i} as {{mode, negate, conditions, behavior}}, found "
                                          f"{spec!r:.100}")
            cs = spec["conditions"]
            if not isinstance(cs, list) or not cs or len(cs) > 1000:
                raise ArtifactFormatError(f"expected rule {i}'s conditions as a non-empty list, found {cs!r:.100}")
            conds = [nested(f"rule.{i}.condition.{j}.", m, (ConditionVector.kind,)) for j, m in enumerate(cs)]
            behavior = nested(f"rule.{i}.behavior.", spec["behavior"], BEHAVIOR_KINDS)
            try:
                rules.append(ConditionalRule(conds, behavior, spec["mode"], spec["negate"]))
            except VectorsError as e:
                raise ArtifactFormatError(f"expected a valid rule {i}, found: {e}") from None
        extra = sorted(set(tensors) - used)
        if extra:
            raise ArtifactFormatError(f"expected only rule.N.condition.M.* and rule.N.behavior.* tensors in a {cls.kind}, "
                                      f"found {extra[:10]}")
        return cls(rules=rules, provenance=Provenance.from_dict(meta.get("provenance", {})))


# --------------------------------------------------------------------------- payload helpers
ARTIFACT_KINDS: dict[str, type[_Artifact]] = {c.kind: c for c in (SteeringVector, DirectionSet, Probe, Region, LayerSchedule,
                                                                 ConditionVector, ConditionalSteering)}
Artifact = SteeringVector | DirectionSet | Probe | Region | LayerSchedule | ConditionVector | ConditionalSteering


def _fields(meta: Any, kind: str) -> dict:
    if not isinstance(meta, dict):
        raise ArtifactFormatError(f"expected artifact metadata as a JSON object, found {type(meta).__name__}")
    f = meta.get("fields", {})
    if not isinstance(f, dict):
        raise ArtifactFormatError(f"expected 'fields' of a {kind} to be an object, found {type(f).__name__}")
    return f


def _str_field(fields: dict, key: str, default: str) -> str:
    v = fields.get(key, default)
    if not isinstance(v, str):
        raise ArtifactFormatError(f"expected field {key!r} to be a string, found {v!r:.100}")
    return v


def _expect_keys(tensors: dict, required: set, optional: set, kind: str) -> None:
    keys = set(tensors)
    missing, extra = required - keys, keys - required - optional
    if missing or extra:
        raise ArtifactFormatError(
            f"expected tensors {sorted(required)} (optional {sorted(optional)}) in a {kind}, found {sorted(keys)[:20]}"
        )


def artifact_to_payload(obj: Any) -> tuple[dict[str, Tensor], dict]:
    """An artifact as ``(tensors, meta)``: what the store and the safetensors export write.

    Examples:
        >>> from steerkit.vectors import SteeringVector
        >>> from steerkit.vectors.artifacts import artifact_to_payload
        >>> tensors, meta = artifact_to_payload(SteeringVector.from_direction(torch.ones(64), layer=2))
        >>> sorted(tensors), meta["kind"]
        (['direction.2'], 'steering_vector')
    """
    # (every registered kind is an _Artifact; the first test tells the type checker so)
    if not (isinstance(obj, _Artifact) and isinstance(obj, tuple(ARTIFACT_KINDS.values()))):
        raise VectorsError(f"expected a steerkit artifact ({', '.join(ARTIFACT_KINDS)}), found {type(obj).__name__}")
    return obj.to_payload()


def payload_to_artifact(tensors: dict[str, Tensor], meta: Any) -> Any:
    """Rebuild an artifact from tensors and metadata, validating everything.

    Examples:
        >>> from steerkit.vectors import SteeringVector
        >>> from steerkit.vectors.artifacts import artifact_to_payload, payload_to_artifact
        >>> v = SteeringVector.from_direction(torch.ones(64), layer=2, scale=3.0)
        >>> payload_to_artifact(*artifact_to_payload(v)) == v
        True
    """
    if not isinstance(meta, dict):
        raise ArtifactFormatError(f"expected artifact metadata as a JSON object, found {type(meta).__name__}")
    kind = meta.get("kind")
    cls = ARTIFACT_KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ArtifactFormatError(f"expected artifact kind in {sorted(ARTIFACT_KINDS)}, found {kind!r:.100}")
    try:
        return cls.from_payload(tensors, meta)
    except VectorsError:
        raise
    except (TypeError, ValueError, RuntimeError, KeyError, IndexError, OverflowError) as e:
        raise ArtifactFormatError(f"expected a valid {kind} payload, found an inconsistent one ({type(e).__name__}: {e})") from e
