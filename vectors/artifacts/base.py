"""What every artifact shares: the :class:`_Artifact` base (payload conversion, ``.to()``,
``clone()``, ``summary()``), the hook sites a stored artifact may name, and the checks every
constructor and every payload reader uses (tensors from tensors / arrays / lists, finiteness,
layer indices, payload fields). Values only: nothing here runs a model or draws.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from ..errors import ArtifactFormatError, VectorsError
from ..provenance import Provenance
from ..safety import tensors_to_safetensors

#: the residual-stream hooks a steering vector or a direction set may be stored at
# the d_model-wide sites an artifact may act at: the residual stream, and what attention / the MLP add to it
HOOK_SITES = ("hook_resid_post", "hook_resid_pre", "hook_resid_mid", "hook_attn_out", "hook_mlp_out")


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


# --------------------------------------------------------------------------- payload fields
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


def checked_from_payload(cls: type[_Artifact], tensors: dict[str, Tensor], meta: dict) -> Any:
    """``cls.from_payload(tensors, meta)`` with every slip of an inconsistent payload (a wrong type, a
    shape torch refuses) reported as :class:`ArtifactFormatError` naming the kind."""
    try:
        return cls.from_payload(tensors, meta)
    except VectorsError:
        raise
    except (TypeError, ValueError, RuntimeError, KeyError, IndexError, OverflowError) as e:
        raise ArtifactFormatError(f"expected a valid {cls.kind} payload, found an inconsistent one "
                                  f"({type(e).__name__}: {e})") from e


def payload_file_bytes(tensors: dict[str, Tensor], meta: dict) -> bytes:
    """A payload as the one safetensors file steerkit writes for an artifact: the tensors, and the metadata JSON
    under ``__metadata__["steerkit"]`` (what ``save_artifact`` writes and ``import_artifact`` reads).

    Examples:
        >>> from steerkit.vectors import SteeringVector
        >>> from steerkit.vectors.artifacts.base import payload_file_bytes
        >>> data = payload_file_bytes(*SteeringVector.from_direction(torch.ones(64), layer=2).to_payload())
        >>> b'"steerkit"' in data[:2000]
        True
    """
    return tensors_to_safetensors(tensors, metadata={"steerkit": json.dumps(meta, sort_keys=True, allow_nan=False)})
