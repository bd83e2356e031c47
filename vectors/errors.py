"""Exceptions raised by steerkit.vectors.

Every error is a subclass of ``VectorsError`` (itself a
:class:`steerkit.errors.SteerkitError` and a ``ValueError``) so callers can
catch one type.  Messages follow one pattern: what was expected, what was
found, and what to do about it.
"""

from __future__ import annotations

from steerkit.errors import PathExistsError  # noqa: F401  (a write target exists: shared with the core)

from steerkit.errors import SteerkitError


class VectorsError(SteerkitError, ValueError):
    """Base class of every error raised by steerkit.vectors."""


class ArtifactFormatError(VectorsError):
    """A file or payload is malformed, truncated, too large or of the wrong kind."""


class UnsafeNameError(VectorsError):
    """An artifact name or path tries to leave the store or is otherwise not allowed."""


class ModelMismatchError(VectorsError):
    """An artifact was made for a different model (d_model, n_layers or fingerprint)."""


class ExportError(VectorsError):
    """The artifact cannot be expressed in the requested export format."""


class StoreError(VectorsError):
    """A store operation failed (unknown name, version or tag; store corrupted)."""


class StoreIndexError(StoreError, ArtifactFormatError):
    """The store's ``index.json`` is malformed (not JSON, a wrong field, a link): the message says what
    is wrong and how to recover; the artifacts themselves stay on disk."""
