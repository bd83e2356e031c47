"""Directions that are read or removed rather than added: :class:`DirectionSet` (an orthonormal basis
to ablate, at given layers or at every write into the residual stream) and :class:`Probe` (a fitted
linear read-out stored as arrays, never as a pickle).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Iterable

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.interventions import ORTHO_TOL, Intervention, ModelFacts, orthonormalize

from ..apply import check_against
from ..errors import ArtifactFormatError, ModelMismatchError, VectorsError
from ..provenance import Provenance, prompts_hash
from .base import HOOK_SITES, _Artifact, _as_tensor, _check_finite, _expect_keys, _fields, _int_layer, _str_field
from .base import _tensors_equal


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
        """Orthonormalise ``directions`` (rows) with :func:`steerkit.orthonormalize` (QR in
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

