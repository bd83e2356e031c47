"""Model fingerprints: one definition, shared with the artifacts' provenance.

See :func:`steerkit.vectors.provenance.model_fingerprint`: a hash of the config
and a few weight tensors (cast so float32 and bfloat16 loads agree), cheap
enough to compute on every load.
"""
from __future__ import annotations

from steerkit.vectors.provenance import model_fingerprint

__all__ = ["model_fingerprint"]
