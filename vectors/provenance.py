"""Provenance of steering artifacts and the model fingerprint.

How it works
------------
Every artifact carries a :class:`Provenance` record: which model it was made
for (name, architecture, a *fingerprint*, ``d_model``, ``n_layers``), where it
acts (hook site and the layer-index convention), what it does (operation), how
it was made (method and its parameters, a hash of the prompts, metrics), when,
and with which steerkit and schema version.  Provenance is plain JSON-able data;
it is written next to the tensors in the store and into every export format
that can hold it.

Layer-index convention (``LAYER_BASE``): layer ``l`` is the 0-based index of a
transformer block, and a vector at layer ``l`` acts on the *output* of that
block, i.e. ``blocks.{l}.hook_resid_post`` (what ``model.model.layers[l]``
returns in Hugging Face).  This is also llama.cpp's ``direction.{l}`` convention.

:func:`model_fingerprint` hashes the model config (minus keys that do not change
the computation) together with a few weight tensors (the embedding, the first
and last block's attention output and MLP down projection, the final norm).
The tensors are cast to bfloat16 before hashing so the same weights loaded in
float32 or bfloat16 give the same fingerprint; genuinely different weights
(another fine-tune, another quantisation) give a different one.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
from typing import Any, Iterable

from steerkit.loading.fingerprint import _unwrap, folder_fingerprint, model_fingerprint

from .errors import ArtifactFormatError
from importlib.metadata import version

# the fingerprints of steerkit.loading.fingerprint are part of this module's interface
__all__ = ["SCHEMA_VERSION", "LAYER_BASE", "Provenance", "steerkit_version", "utc_now", "prompts_hash",
           "model_fingerprint", "folder_fingerprint"]

SCHEMA_VERSION = 1
LAYER_BASE = "0-based block index; the vector acts on the output of block l (blocks.{l}.hook_resid_post)"

def steerkit_version() -> str:
    """Installed steerkit version, or ``"0+unknown"`` when running from a bare checkout.

    Examples:
        >>> from steerkit.vectors.provenance import steerkit_version
        >>> steerkit_version() == steerkit.__version__
        True
    """
    try:

        return version("steerkit")
    except Exception:
        return "0+unknown"


def utc_now() -> str:
    """The current UTC time as an ISO 8601 string to the second (``Provenance.created_at``).

    Examples:
        >>> from steerkit.vectors.provenance import utc_now
        >>> stamp = utc_now()
        >>> len(stamp), stamp.endswith("+00:00")
        (25, True)
    """
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def prompts_hash(prompts: Iterable[str] | None) -> str | None:
    """SHA-256 over the prompts (length-prefixed, so ``["ab"]`` != ``["a", "b"]``).

    Examples:
        >>> from steerkit.vectors import prompts_hash
        >>> prompts_hash(["ab"]) == prompts_hash(["a", "b"]), prompts_hash(["a", "b"])[:7]
        (False, 'sha256:')
        >>> prompts_hash(None) is None
        True
    """
    if prompts is None:
        return None
    h = hashlib.sha256()
    for p in prompts:
        b = str(p).encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return "sha256:" + h.hexdigest()


@dataclasses.dataclass
class Provenance:
    """Where an artifact comes from and what it is for.  Plain, JSON-able data.

    Examples:
        >>> from steerkit.vectors import Provenance
        >>> p = Provenance.from_model(tiny, method="diff_of_means")
        >>> p.model_name, p.d_model, p.n_layers, p.model_arch
        ('tiny-llama', 64, 4, 'llama')
        >>> Provenance.from_dict(p.to_dict()) == p
        True
    """

    model_name: str | None = None
    model_fingerprint: str | None = None
    model_arch: str | None = None  # HF model_type, e.g. "llama"
    d_model: int | None = None
    n_layers: int | None = None
    hook_site: str = "hook_resid_post"
    layer_base: str = LAYER_BASE
    operation: str = "add"
    method: str | None = None
    method_params: dict = dataclasses.field(default_factory=dict)
    prompts_hash: str | None = None
    metrics: dict = dataclasses.field(default_factory=dict)
    created_at: str = dataclasses.field(default_factory=utc_now)
    steerkit_version: str = dataclasses.field(default_factory=steerkit_version)
    schema_version: int = SCHEMA_VERSION
    notes: str | None = None

    @classmethod
    def from_model(cls, model: Any, **kw: Any) -> "Provenance":
        """Fill the model fields from a SteerModel-like object or a HF model."""
        hf = _unwrap(model)
        cfg = getattr(hf, "config", None)
        name = getattr(model, "name", None) or getattr(cfg, "_name_or_path", None) or None
        d_model = getattr(model, "d_model", None) or getattr(cfg, "hidden_size", None)
        n_layers = getattr(model, "n_layers", None) or getattr(cfg, "num_hidden_layers", None)
        fp = None
        try:
            fp = model_fingerprint(hf)
        except Exception:  # a duck-typed model without parameters
            fp = None
        return cls(
            model_name=str(name) if name else None,
            model_fingerprint=fp,
            model_arch=getattr(cfg, "model_type", None),
            d_model=int(d_model) if d_model else None,
            n_layers=int(n_layers) if n_layers else None,
            **kw,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> "Provenance":
        if not isinstance(d, dict):
            raise ArtifactFormatError(
                f"expected provenance to be a JSON object, found {type(d).__name__}; "
                "the file is not a steerkit artifact or is corrupted"
            )
        known = {f.name: f for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        for key in ("d_model", "n_layers", "schema_version"):
            if key in kw and kw[key] is not None and (not isinstance(kw[key], int) or isinstance(kw[key], bool)):
                raise ArtifactFormatError(f"expected provenance.{key} to be an integer, found {kw[key]!r}")
        for key in ("method_params", "metrics"):
            if key in kw and not isinstance(kw[key], dict):
                raise ArtifactFormatError(f"expected provenance.{key} to be an object, found {type(kw[key]).__name__}")
        for key in ("model_name", "model_fingerprint", "model_arch", "hook_site", "layer_base", "operation",
                    "method", "prompts_hash", "created_at", "steerkit_version", "notes"):
            if key in kw and kw[key] is not None and not isinstance(kw[key], str):
                raise ArtifactFormatError(f"expected provenance.{key} to be a string, found {type(kw[key]).__name__}")
        if kw.get("schema_version", SCHEMA_VERSION) > SCHEMA_VERSION:
            raise ArtifactFormatError(
                f"artifact schema version {kw['schema_version']} is newer than this steerkit understands "
                f"({SCHEMA_VERSION}); upgrade steerkit to read it"
            )
        return cls(**kw)

    def replace(self, **kw: Any) -> "Provenance":
        return dataclasses.replace(self, **kw)
