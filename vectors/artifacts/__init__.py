"""Steering artifacts as plain values.

How it works
------------
Ten kinds, each holding tensors plus a :class:`~steerkit.vectors.provenance.Provenance`:

* :class:`SteeringVector` (:mod:`.vector`) -- one direction per layer (``directions[l]`` of shape
  ``[d_model]``), a hook site (default ``hook_resid_post``: the output of block ``l``), an operation
  (``"add"``: ``h + scale * v``; ``"clamp"``: set the component of ``h`` along ``v`` to
  ``scale * |v|``; ``"project"``, the clamp's name in earlier versions, still loads as ``"clamp"``),
  a scale, optional token positions and an optional :class:`LayerSchedule`. Supports ``+ - * /`` and
  negation; ``.to()`` returns a new object.
* :class:`LayerSchedule` (:mod:`.vector`) -- per-layer weights (as Temporal Activation Injection uses)
  and an optional per-token weight list.
* :class:`DirectionSet` (:mod:`.directions`) -- an orthonormal basis ``[k, d_model]`` to ablate, either
  at given layers or "everywhere" (``layers=None``: every write into the residual stream -- the
  embedding, each attention output and each MLP output -- which is exactly what orthogonalising the
  weights does).
* :class:`Probe` (:mod:`.directions`) -- a fitted linear pipeline stored as arrays (centre, scale,
  optional PCA projection, weight, bias, class names), never as a pickle.
* :class:`Region` (:mod:`.region`) -- a polyhedron in a PCA subspace: ``mean``, ``projection [k, d]``,
  half-space ``normals [m, k]`` and ``offsets [m]``; ``x`` is inside when
  ``normals @ projection @ (x - mean) <= offsets``. It is a :class:`steerkit.Polyhedron` (the kernels'
  geometry class: coordinates, membership, the projection QP) with a layer, a hook site and a
  provenance; ``steerkit.Polyhedron`` is the geometry alone, ``steerkit.vectors.Region`` the artifact.
* :class:`ConditionVector` (:mod:`.condition`) and :class:`ConditionalSteering` of
  :class:`ConditionalRule` values (:mod:`.conditional`) -- CAST's conditions and rules.
* :class:`SAE` (:mod:`.sae`) -- a sparse autoencoder or transcoder (:class:`steerkit.sae.SAEWeights`,
  whose torch code encodes and decodes) at a hook site; it saves as a steerkit file, a sae-lens folder
  or a sparsify folder.
* :class:`Transcoders` (:mod:`.transcoders`) -- a transcoder for every block of a model (a per-layer set or a
  cross-layer transcoder), in circuit-tracer's layout; what an attribution graph traces through.
* :class:`LatentClamp` (:mod:`.latent`) -- a clamp of an SAE's latents (the SAE restricted to them, or a
  TopK SAE's whole encoder) to a value or a multiple of themselves, with the error term kept: what a
  server request names to clamp a latent.

Every kind lowers itself with ``to_interventions(facts, scale=, override=)`` and converts to and from a
*payload* (:mod:`.payload`): a ``dict[str, Tensor]`` plus a JSON-able ``dict`` (``kind``, ``fields``,
``provenance``). The store and the ``safetensors`` export write payloads; :func:`payload_to_artifact`
validates everything it reads (kinds, shapes, dtypes, finiteness) and raises
:class:`ArtifactFormatError` on anything unexpected.

The artifacts are values: the one thing here that runs a model, a condition's decisions on prompts,
is :mod:`.evaluation`; figures are in :mod:`steerkit.vectors.plots`.
"""

from ..errors import ArtifactFormatError, ModelMismatchError, VectorsError
from ..provenance import Provenance, prompts_hash
from .base import HOOK_SITES, _Artifact as _Artifact, checked_from_payload as checked_from_payload
from .base import _as_tensor, _check_finite, _expect_keys, _fields, _int_layer, _str_field, _tensors_equal  # noqa: F401
from .condition import CONDITION_SITES, ConditionVector
from .condition import _check_report, _choice, _finite_number, _report_equal  # noqa: F401
from .conditional import BEHAVIOR_KINDS, NESTED_KINDS, RULE_MODES, ConditionalRule, ConditionalSteering
from .directions import DirectionSet, Probe
from .payload import ARTIFACT_KINDS, Artifact, artifact_to_payload, payload_to_artifact
from .region import Region
from .sae import SAE, SAE_SAVE_FORMATS
from . import latent as _latent
from .latent import ClampPart, LatentClamp
from .transcoders import TRANSCODER_ACTIVATIONS, TRANSCODER_SAVE_FORMATS, TRANSCODER_SITES, Transcoders
from .vector import LEGACY_OPERATIONS, VECTOR_OPERATIONS, LayerSchedule, SteeringVector, canonical_operation

__all__ = [
    "SteeringVector", "LayerSchedule", "DirectionSet", "Probe", "Region", "ConditionVector", "ConditionalRule",
    "ConditionalSteering", "Artifact", "ARTIFACT_KINDS", "artifact_to_payload", "payload_to_artifact",
    "canonical_operation", "HOOK_SITES", "VECTOR_OPERATIONS", "LEGACY_OPERATIONS",
    "CONDITION_SITES", "BEHAVIOR_KINDS", "RULE_MODES", "NESTED_KINDS", "Provenance", "prompts_hash",
    "ArtifactFormatError", "ModelMismatchError", "VectorsError", "SAE", "SAE_SAVE_FORMATS",
    "LatentClamp", "ClampPart", "Transcoders", "TRANSCODER_ACTIVATIONS", "TRANSCODER_SAVE_FORMATS", "TRANSCODER_SITES",
]


def __getattr__(name: str):
    if name == "CLAMP_POSITIONS":  # renamed: the one list of position names is the core's (it warns there)
        return _latent.__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
