"""Steering vectors: :class:`SteeringVector` (one direction per layer at a hook site, with an operation,
a scale, optional token positions) and the :class:`LayerSchedule` that weights it per layer.

Operations (:data:`VECTOR_OPERATIONS`): ``"add"`` puts ``h + scale * v`` at each layer; ``"clamp"``
sets the component of ``h`` along ``v`` to ``scale * |v|`` (``Intervention.clamp``). ``"project"``
is the name earlier versions gave the clamp (:data:`LEGACY_OPERATIONS`): stored artifacts and imported
files with it load as ``"clamp"``; a new vector built with it warns and is a clamp. (A projection into
a region is a :class:`~steerkit.vectors.Region`, ``Intervention.project``.)
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, ClassVar, Iterable

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.interventions import Intervention, ModelFacts

from ..apply import check_against
from ..errors import ArtifactFormatError, ModelMismatchError, VectorsError
from ..provenance import Provenance, prompts_hash
from .base import HOOK_SITES, _Artifact, _as_tensor, _check_finite, _expect_keys, _fields, _int_layer, _str_field
from .base import _tensors_equal

VECTOR_OPERATIONS = ("add", "clamp")
#: operation names of earlier versions -> today's: files and stores written with them still load
LEGACY_OPERATIONS = {"project": "clamp"}


def canonical_operation(op: Any) -> Any:
    """A steering vector's operation under today's name (``"project"``, the clamp's old name, is
    ``"clamp"``); anything else unchanged.

    Examples:
        >>> from steerkit.vectors.artifacts import canonical_operation
        >>> canonical_operation("project"), canonical_operation("add")
        ('clamp', 'add')
    """
    return LEGACY_OPERATIONS.get(op, op) if isinstance(op, str) else op


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
        if self.operation in LEGACY_OPERATIONS:
            warnings.warn(f"SteeringVector(operation={self.operation!r}) is deprecated: the operation is called "
                          f"{LEGACY_OPERATIONS[self.operation]!r}", DeprecationWarning, stacklevel=3)
            self.operation = LEGACY_OPERATIONS[self.operation]
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

    @classmethod
    def from_sae_latent(cls, sae: Any, latent: int, strength: float = 1.0) -> "SteeringVector":
        """A sparse autoencoder's latent as a plain vector: its decoder row ``W_dec[latent]`` at the site
        it writes (an autoencoder's own, a transcoder's output site), applied as ``h + strength * row``,
        which is :meth:`steerkit.Intervention.sae_latent` with ``mode="add"``. As a plain vector it
        exports unchanged to llama.cpp, repeng, EasySteer and vLLM; the provenance is the SAE's, with the
        latent in its method parameters.

        Examples:
            >>> from steerkit.sae import SAEWeights
            >>> from steerkit.vectors import SAE, Provenance
            >>> g = torch.Generator().manual_seed(0)
            >>> W = torch.randn(64, 256, generator=g) / 8
            >>> sae = SAE(SAEWeights(W, torch.zeros(256), W.T.clone(), torch.zeros(64)), site="blocks.2.hook_resid_post",
            ...           provenance=Provenance.from_model(tiny))
            >>> v = SteeringVector.from_sae_latent(sae, 17, strength=6.0)
            >>> v.layers, v.scale, torch.equal(v.directions[2], sae.weights.W_dec[17])
            ([2], 6.0, True)
            >>> v.provenance.method, v.provenance.method_params["latent"]
            ('sae_latent', 17)
        """
        weights, site = getattr(sae, "weights", None), getattr(sae, "output_site", None) or getattr(sae, "site", None)
        if weights is None or not isinstance(site, str):
            raise VectorsError(f"expected a stored SAE (steerkit.load_sae(...)) with its site, found "
                               f"{type(sae).__name__}; load it with steerkit.load_sae or wrap its weights in "
                               "steerkit.vectors.SAE(weights, site=...)")
        layer, _, hook_site = site.partition(".")[2].partition(".")
        if not site.startswith("blocks.") or hook_site not in HOOK_SITES:
            raise VectorsError(f"expected an SAE that writes a block's {HOOK_SITES} site to make a steering vector, "
                               f"found {site!r}; steer at other sites with Intervention.sae_latent(..., mode='add')")
        idx = Intervention.sae_latent(site, weights, latent, scale=strength, mode="add").tensor
        assert idx is not None
        prov = getattr(sae, "provenance", None) or Provenance()
        params = {"latent": int(latent), "d_sae": int(weights.d_sae), "sae_site": getattr(sae, "site", site),
                  "architecture": weights.architecture}
        prov = prov.replace(method="sae_latent", method_params=params, operation="add", hook_site=hook_site,
                            d_model=int(idx.shape[0]))
        return cls({int(layer): idx.clone()}, scale=float(strength), operation="add", hook_site=hook_site,
                   provenance=prov)

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
        ``clamp`` clamps the component along ``v_l`` to ``scale * self.scale * w_l * |v_l|``."""
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
        return cls(dirs, scale=float(scale), operation=canonical_operation(_str_field(fields, "operation", "add")),
                   hook_site=_str_field(fields, "hook_site", "hook_resid_post"), positions=positions,
                   schedule=schedule, provenance=Provenance.from_dict(meta.get("provenance", {})))

