"""Artifacts as payloads: a ``dict[str, Tensor]`` plus a JSON-able ``dict`` (``kind``, ``fields``,
``provenance``), what the store and the ``safetensors`` export write. :func:`payload_to_artifact`
validates everything it reads (kinds, shapes, dtypes, finiteness) and raises
:class:`~steerkit.vectors.ArtifactFormatError` on anything unexpected; :data:`ARTIFACT_KINDS` is the
registry of every kind.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..errors import ArtifactFormatError, VectorsError
from .base import _Artifact, checked_from_payload
from .condition import ConditionVector
from .conditional import ConditionalSteering
from .directions import DirectionSet, Probe
from .latent import LatentClamp
from .region import Region
from .sae import SAE
from .transcoders import Transcoders
from .vector import LayerSchedule, SteeringVector

ARTIFACT_KINDS: dict[str, type[_Artifact]] = {c.kind: c for c in (SteeringVector, DirectionSet, Probe, Region, LayerSchedule,
                                                                 ConditionVector, ConditionalSteering, SAE, LatentClamp,
                                                                 Transcoders)}
Artifact = (SteeringVector | DirectionSet | Probe | Region | LayerSchedule | ConditionVector | ConditionalSteering | SAE
            | LatentClamp | Transcoders)


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
    return checked_from_payload(cls, tensors, meta)
