"""The one reader of the JSON and YAML files that come with artifacts: bounded, strict, and never running code.

Every artifact format steerkit reads keeps its settings in a small JSON or YAML document: a stored artifact's
metadata and the store's index, an SAE folder's ``cfg.json``, a transcoder folder's ``config.yaml``, the JSON
exports. They all go through :func:`parse_json` / :func:`parse_yaml` (or :func:`read_document` for a file), which

- refuse a document larger than ``max_bytes`` before parsing it (a file's size is checked before it is read);
- refuse a document nested deeper than ``max_depth`` (64) with a steerkit error, never Python's own
  ``RecursionError``: YAML's nesting is counted while the document is composed, JSON's is caught where the
  parser gives up and checked on the result;
- read JSON strictly: UTF-8, finite numbers only (``NaN`` / ``Infinity`` are refused), whole numbers of any
  length reported as malformed rather than as ``int()``'s digit limit;
- read YAML with PyYAML's safe loader (plain data: no tags that build Python objects) and refuse aliases
  (``*name``), so a small document cannot expand into a huge one.

Each caller names the error class its own layer raises (``error=``): an artifact reader raises
:class:`~steerkit.vectors.ArtifactFormatError`, an SAE folder :class:`~steerkit.sae.SAEFormatError`; by default
:class:`DocumentError`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from steerkit.errors import InputError, SteerkitError

#: the largest document read by default (64 MiB)
MAX_DOCUMENT_BYTES = 64 << 20
#: the deepest nesting of lists and objects read
MAX_DEPTH = 64


class DocumentError(InputError):
    """A JSON or YAML document that is too large, too deep, malformed or holds what steerkit does not read.

    Examples:
        >>> from steerkit.storage.documents import DocumentError, parse_json
        >>> try:
        ...     parse_json(b"[" * 100 + b"]" * 100)
        ... except DocumentError as e:
        ...     print(e)
        expected JSON nested at most 64 deep, found deeper; refusing it
    """


class _Stop(SteerkitError):
    """Internal: carries a message out of a parser callback (always turned into the caller's ``error``)."""


def _reject_constant(name: str) -> Any:
    raise _Stop(f"expected finite JSON numbers, found {name}; the file is not valid steerkit JSON")


def _parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:  # only the digit limit: the scanner passes well-formed digits
        raise _Stop(f"expected whole numbers of at most 4300 digits, found one of {len(text.lstrip('-'))}") from None


def _check_depth(obj: Any, limit: int, what: str, error: type[Exception]) -> None:
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if d > limit:
            raise error(f"expected {what} nested at most {limit} deep, found deeper; refusing it")
        if isinstance(o, dict):
            stack.extend((v, d + 1) for v in o.values())
        elif isinstance(o, list):
            stack.extend((v, d + 1) for v in o)


def _text(data: bytes | str, what: str, max_bytes: int, error: type[Exception]) -> str:
    n = len(data.encode("utf-8")) if isinstance(data, str) else len(data)
    if n > max_bytes:
        raise error(f"expected {what} of at most {max_bytes} bytes, found {n}")
    if isinstance(data, str):
        return data
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"expected {what} in UTF-8, found undecodable bytes at offset {e.start}") from None


def parse_json(data: bytes | str, what: str = "JSON", *, max_bytes: int = MAX_DOCUMENT_BYTES,
               max_depth: int = MAX_DEPTH, error: type[Exception] = DocumentError) -> Any:
    """Parse a JSON document strictly (see the module docstring); any problem raises ``error``.

    Examples:
        >>> from steerkit.storage.documents import parse_json
        >>> parse_json(b'{"scale": 4.0, "layers": [3, 5]}')
        {'scale': 4.0, 'layers': [3, 5]}
        >>> parse_json(b'{"scale": NaN}')
        Traceback (most recent call last):
        ...
        steerkit.storage.documents.DocumentError: expected finite JSON numbers, found NaN; the file is not valid steerkit JSON
    """
    text = _text(data, what, max_bytes, error)
    try:
        obj = json.loads(text, parse_constant=_reject_constant, parse_int=_parse_int)
    except _Stop as e:
        raise error(str(e)) from None
    except RecursionError:
        raise error(f"expected {what} nested at most {max_depth} deep, found deeper; refusing it") from None
    except ValueError as e:
        raise error(f"expected valid {what}, found a syntax error: {e}") from None
    _check_depth(obj, max_depth, what, error)
    return obj


def _loader(max_depth: int):
    """A PyYAML safe loader that counts nesting as it composes and refuses aliases."""
    class BoundedLoader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent, index):  # type: ignore[no-untyped-def]
            if self.check_event(yaml.AliasEvent):
                raise _Stop("expected YAML without aliases (*name), found one; write the value out")
            self.depth += 1
            try:
                if self.depth > max_depth:
                    raise _Stop(f"nested at most {max_depth} deep, found deeper")
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1
    return BoundedLoader


def parse_yaml(data: bytes | str, what: str = "YAML", *, max_bytes: int = MAX_DOCUMENT_BYTES,
               max_depth: int = MAX_DEPTH, error: type[Exception] = DocumentError) -> Any:
    """Parse a YAML document as plain data (PyYAML's safe loader, no aliases, bounded; see the module
    docstring); any problem raises ``error``.

    Examples:
        >>> from steerkit.storage.documents import parse_yaml
        >>> parse_yaml("model_kind: transcoder_set\\nfeature_input_hook: mlp.hook_in\\n")
        {'model_kind': 'transcoder_set', 'feature_input_hook': 'mlp.hook_in'}
        >>> parse_yaml("a: &x [1, 2]\\nb: *x\\n")
        Traceback (most recent call last):
        ...
        steerkit.storage.documents.DocumentError: expected YAML without aliases (*name), found one; write the value out
        >>> parse_yaml("!!python/object/apply:os.system ['echo hi']")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        steerkit.storage.documents.DocumentError: expected plain YAML data, found could not determine a constructor ...
    """
    text = _text(data, what, max_bytes, error)
    loader = _loader(max_depth)(text)
    try:
        obj = loader.get_single_data()
    except _Stop as e:
        msg = str(e)
        raise error(msg if msg.startswith("expected") else f"expected {what} {msg}; refusing it") from None
    except RecursionError:
        raise error(f"expected {what} nested at most {max_depth} deep, found deeper; refusing it") from None
    except yaml.YAMLError as e:
        kind = "plain YAML data" if isinstance(e, yaml.constructor.ConstructorError) else f"valid {what}"
        raise error(f"expected {kind}, found {' '.join(str(e).split())[:300]}") from None
    finally:
        loader.dispose()
    _check_depth(obj, max_depth, what, error)
    return obj


def read_document(path: str | os.PathLike, what: str | None = None, *, fmt: str | None = None,
                  max_bytes: int = MAX_DOCUMENT_BYTES, max_depth: int = MAX_DEPTH,
                  error: type[Exception] = DocumentError) -> Any:
    """The JSON or YAML document in the file ``path`` (``fmt`` "json" / "yaml", by default from the suffix:
    ``.yaml`` / ``.yml`` are YAML, anything else JSON), its size checked before it is read.

    Examples:
        >>> from steerkit.storage.documents import read_document
        >>> _ = (tmp_dir / "config.yaml").write_text("scan: tiny\\ntranscoders: [a.safetensors]\\n")
        >>> read_document(tmp_dir / "config.yaml")
        {'scan': 'tiny', 'transcoders': ['a.safetensors']}
    """
    p = Path(path)
    what = what or p.name
    if fmt is None:
        fmt = "yaml" if p.suffix.lower() in (".yaml", ".yml") else "json"
    if fmt not in ("json", "yaml"):
        raise InputError(f"expected fmt 'json' or 'yaml', found {fmt!r}")
    try:
        size = p.stat().st_size
        if not p.is_file():
            raise error(f"expected {what} as a file at {p}, found a folder or something else; check the path")
    except OSError as e:
        raise error(f"expected {what} at {p}, found none ({e.strerror}); check the path") from None
    if size > max_bytes:
        raise error(f"expected {what} of at most {max_bytes} bytes at {p}, found {size}")
    with open(p, "rb") as f:
        data = f.read(max_bytes + 1)
    label = f"{what} ({p})" if what != str(p) else what
    parse = parse_yaml if fmt == "yaml" else parse_json
    return parse(data, label, max_bytes=max_bytes, max_depth=max_depth, error=error)
