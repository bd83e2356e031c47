"""The stored region: :class:`Region`, a :class:`steerkit.Polyhedron` (the one geometry class of the
kernels: coordinates, membership, the projection QP) placed at ``blocks.{layer}.{hook_site}`` with a
provenance. ``steerkit.vectors.Region`` is this artifact; the bare geometry is ``steerkit.Polyhedron``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from torch import Tensor

from steerkit.interventions import Intervention, ModelFacts, Polyhedron

from ..apply import check_against
from ..errors import ArtifactFormatError
from ..provenance import Provenance
from .base import _Artifact, _as_tensor, _check_finite, _expect_keys, _fields, _int_layer, _str_field, _tensors_equal


# --------------------------------------------------------------------------- Region
@dataclasses.dataclass(eq=False)
class Region(Polyhedron, _Artifact):
    """A polyhedron in a PCA subspace: inside iff ``normals @ (projection @ (x - mean)) <= offsets``.

    A :class:`steerkit.Polyhedron` (the kernels' geometry: ``coordinates``, ``contains``, ``project``,
    ``validate``) stored at ``blocks.{layer}.{hook_site}`` with a provenance; it steers as
    ``Intervention.project`` (:meth:`to_interventions`, ``sm.steer(region)``).

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

