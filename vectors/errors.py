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
    """Base class of every error raised by steerkit.vectors.

    Examples:
        >>> from steerkit.vectors import VectorsError
        >>> try:
        ...     store.load("no-such-vector")
        ... except VectorsError as e:
        ...     print(type(e).__name__, isinstance(e, ValueError))
        StoreError True
    """


class ArtifactFormatError(VectorsError):
    """A file or payload is malformed, truncated, too large or of the wrong kind.

    Examples:
        >>> from steerkit.vectors import ArtifactFormatError, SteeringVector
        >>> try:
        ...     SteeringVector({0: torch.tensor([1.0, float("nan")])})
        ... except ArtifactFormatError as e:
        ...     print("NaN" in str(e))
        True
    """


class UnsafeNameError(VectorsError):
    """An artifact name or path tries to leave the store or is otherwise not allowed.

    Examples:
        >>> from steerkit.vectors import UnsafeNameError, parse_ref
        >>> try:
        ...     parse_ref("../outside@1")
        ... except UnsafeNameError:
        ...     print("refused")
        refused
    """


class ModelMismatchError(VectorsError):
    """An artifact was made for a different model (d_model, n_layers or fingerprint).

    Examples:
        >>> from steerkit.vectors import ModelMismatchError, SteeringVector
        >>> v = SteeringVector.from_direction(torch.ones(32), layer=0)  # 32 wide; tiny is 64
        >>> try:
        ...     tiny.steer(v)
        ... except ModelMismatchError as e:
        ...     print("d_model=64" in str(e))
        True
    """


class ExportError(VectorsError):
    """The artifact cannot be expressed in the requested export format.

    Examples:
        >>> from steerkit.vectors import DirectionSet, ExportError, export
        >>> ablation = DirectionSet.from_directions(torch.randn(1, 64), tiny)
        >>> try:
        ...     export(ablation, "llamacpp", tmp_dir / "ablate.gguf")
        ... except ExportError:
        ...     print("llama.cpp control vectors add; they cannot ablate")
        llama.cpp control vectors add; they cannot ablate
    """


class StoreError(VectorsError):
    """A store operation failed (unknown name, version or tag; store corrupted).

    Examples:
        >>> from steerkit.vectors import SteeringVector, StoreError
        >>> store.save("v", SteeringVector.from_direction(torch.ones(64), layer=1))
        'v@1'
        >>> try:
        ...     store.load("v@2")
        ... except StoreError as e:
        ...     print(e)
        expected version 2 of 'v', found versions [1]
    """


class StoreIndexError(StoreError, ArtifactFormatError):
    """The store's ``index.json`` is malformed (not JSON, a wrong field, a link): the message says what
    is wrong and how to recover; the artifacts themselves stay on disk.

    Examples:
        >>> from steerkit.vectors.errors import StoreIndexError
        >>> store.root.mkdir(parents=True, exist_ok=True)
        >>> _ = store.index_path.write_text("not json")
        >>> try:
        ...     store.list()
        ... except StoreIndexError:
        ...     print("index.json is damaged")
        index.json is damaged
    """
