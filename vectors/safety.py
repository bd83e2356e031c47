"""Safe reading and crash-safe writing of artifact files.

How it works
------------
Nothing here unpickles.  Every reader checks the size of a file *before* reading
it, parses headers with explicit bounds (counts, string lengths, dimensions,
offsets) and turns *any* problem into :class:`ArtifactFormatError` with a
message saying what was expected and what was found.  The parsers never loop on
a count read from the file without first checking that the file is long enough
to hold that many items, so a hostile header cannot make them hang or allocate
unbounded memory.

* :func:`read_json_bytes` / :func:`read_json` -- size-bounded JSON, no NaN/Infinity
  constants, nesting depth bounded: :func:`steerkit.storage.documents.parse_json`, the one bounded reader of
  every artifact format's JSON and YAML.
* :func:`parse_safetensors` -- validates the 8-byte header length, the JSON header,
  dtypes, shapes and that the data offsets tile the data section exactly, then
  builds tensors with :func:`torch.frombuffer` (copied, so nothing aliases the file).
  Why steerkit's own validator although ``safetensors`` is a dependency (it writes every file,
  :func:`tensors_to_safetensors`): the files read here come from strangers (imports, shared stores),
  and ``safetensors``' reader (0.8) checks the header length (up to 100 MB) and the offsets but accepts
  any number of tensors, any rank, unknown keys in a tensor entry and dtypes steerkit does not store
  (``F8_E4M3`` ...), and reports problems as ``SafetensorError`` text without what was expected or what
  to do. Every bound here (:data:`MAX_HEADER_BYTES`, :data:`MAX_TENSORS`, rank <= 8, the dtypes of
  ``_ST_DTYPES``, JSON depth and finite numbers) and every message is pinned by
  ``tests/vectors/test_safety.py``.
* :func:`parse_gguf` -- a small bounded GGUF v2/v3 parser (metadata + F32/F16/BF16
  tensors), enough for control-vector files; quantised model files are read with
  ``gguf.GGUFReader`` elsewhere and are trusted inputs.
* :func:`atomic_write_bytes` (from :mod:`steerkit.storage.files`) -- write to a temporary file in the same
  folder, flush, fsync, rename over the target, fsync the folder.
* :func:`check_name` -- artifact names and tags by the one rule set of :mod:`steerkit.storage.naming`
  (ASCII letters, digits, ``._-``, the whole string; no path separators, no ``..``); anything
  else is refused with :class:`UnsafeNameError`.
* :func:`read_head` -- the first bytes of a file (format sniffing reads a bounded prefix only).
"""

from __future__ import annotations

import json
import mmap
import os
import stat
import struct
import warnings
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import safetensors.torch

from steerkit.storage.documents import MAX_DEPTH, parse_json
from steerkit.storage.files import atomic_folder, atomic_path, atomic_write_bytes, fsync_dir
from steerkit.storage.naming import NAME_RE, is_name

from .errors import ArtifactFormatError, ExportError, UnsafeNameError

# the crash-safe writers of steerkit.storage.files are part of this module's interface
__all__ = [
    "MAX_FILE_BYTES", "MAX_JSON_BYTES", "MAX_JSON_DEPTH", "MAX_TENSORS", "MAX_DIMS", "MAX_HEADER_BYTES",
    "MAX_GGUF_KV", "MAX_STRING_BYTES", "NAME_RE", "GGUF_MAGIC",
    "check_name", "check_output_file", "read_bounded", "read_head", "read_json_bytes", "read_json", "dump_json",
    "tensors_to_safetensors", "parse_safetensors", "map_safetensors", "release_pages", "parse_gguf", "parse_gguf_metadata", "write_gguf",
    "atomic_folder", "atomic_path", "atomic_write_bytes", "fsync_dir",
]

MAX_FILE_BYTES = 1 << 30  # 1 GiB for artifact files (model GGUFs are not read here)
MAX_JSON_BYTES = 64 << 20
MAX_JSON_DEPTH = MAX_DEPTH
MAX_TENSORS = 4096
MAX_DIMS = 4
MAX_HEADER_BYTES = 16 << 20
MAX_GGUF_KV = 4096
MAX_STRING_BYTES = 16 << 20

_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


# --------------------------------------------------------------------------- names
def check_name(name: Any, what: str = "artifact name") -> str:
    """Return ``name`` if it is a safe artifact name, else raise :class:`UnsafeNameError`.

    Examples:
        >>> from steerkit.vectors.safety import check_name
        >>> check_name("refusal-dir.v2")
        'refusal-dir.v2'
        >>> check_name("../etc/passwd")
        Traceback (most recent call last):
        ...
        steerkit.vectors.errors.UnsafeNameError: expected artifact name made of ASCII letters, ...
    """
    if not is_name(name):
        raise UnsafeNameError(
            f"expected {what} made of ASCII letters, digits, '.', '_' or '-' (1-128 characters, "
            f"starting with a letter or digit, no '..', no path separators, no whitespace), found {name!r:.200}; "
            "choose another name"
        )
    return name


# --------------------------------------------------------------------------- files
def read_bounded(path: str | os.PathLike, max_bytes: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of the regular file ``path``, refused (:class:`ArtifactFormatError`) past ``max_bytes``.

    Examples:
        >>> from steerkit.vectors.safety import read_bounded
        >>> _ = (tmp_dir / "a.bin").write_bytes(b"0123456789")
        >>> read_bounded(tmp_dir / "a.bin")
        b'0123456789'
        >>> read_bounded(tmp_dir / "a.bin", max_bytes=4)
        Traceback (most recent call last):
        ...
        steerkit.vectors.errors.ArtifactFormatError: expected at most 4 bytes in ...
    """
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        raise ArtifactFormatError(f"expected a readable file at {p}, found none ({e.strerror}); check the path") from e
    if not p.is_file():
        raise ArtifactFormatError(f"expected a regular file at {p}, found something else; check the path")
    if st.st_size > max_bytes:
        raise ArtifactFormatError(
            f"expected at most {max_bytes} bytes in {p}, found {st.st_size}; "
            "raise max_bytes if you trust this file"
        )
    with open(p, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ArtifactFormatError(f"{p} grew past {max_bytes} bytes while reading; refusing it")
    return data


def read_head(path: str | os.PathLike, n: int = 4096) -> bytes:
    """The first ``n`` bytes (or fewer) of the regular file ``path``; ``b""`` for anything else. Only
    those bytes are read, however large the file (format detection sniffs headers with it).

    Examples:
        >>> from steerkit.vectors.safety import read_head
        >>> _ = (tmp_dir / "a.bin").write_bytes(b"GGUF" + bytes(100))
        >>> read_head(tmp_dir / "a.bin", 4), read_head(tmp_dir)  # a folder reads as nothing
        (b'GGUF', b'')
    """
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return b""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b""
        chunks, got = [], 0
        while got < n:
            b = os.read(fd, n - got)
            if not b:
                break
            chunks.append(b)
            got += len(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def check_output_file(path: str | os.PathLike, what: str = "output") -> Path:
    """``path`` as a :class:`Path` if a file can be written there: its folder exists (it is never
    created on the writer's behalf) and ``path`` is not itself a folder; else :class:`ExportError`.

    Examples:
        >>> from steerkit.vectors.safety import check_output_file
        >>> check_output_file(tmp_dir / "v.gguf") == tmp_dir / "v.gguf"
        True
        >>> check_output_file(tmp_dir / "missing" / "v.gguf")
        Traceback (most recent call last):
        ...
        steerkit.vectors.errors.ExportError: expected an existing folder ...
    """
    p = Path(path)
    parent = p.parent
    if not parent.is_dir():
        found = "a file" if parent.exists() else "no such folder"
        raise ExportError(f"expected an existing folder {parent} to write the {what} {p.name!r} into, found {found}; "
                          f"create the folder first (mkdir -p {parent}) or choose another path")
    if p.is_dir():
        raise ExportError(f"expected a file path for the {what}, found the folder {p}; give a file name inside it")
    return p


# --------------------------------------------------------------------------- JSON
def read_json_bytes(data: bytes, what: str = "JSON", max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Parse JSON bytes strictly: UTF-8, finite numbers, bounded size and depth (else :class:`ArtifactFormatError`);
    the one bounded reader of :mod:`steerkit.storage.documents`.

    Examples:
        >>> from steerkit.vectors.safety import read_json_bytes
        >>> read_json_bytes(b'{"scale": 4.0}')
        {'scale': 4.0}
        >>> read_json_bytes(b'{"scale": NaN}')
        Traceback (most recent call last):
        ...
        steerkit.vectors.errors.ArtifactFormatError: expected finite JSON numbers, found NaN; ...
    """
    return parse_json(data, what, max_bytes=max_bytes, max_depth=MAX_JSON_DEPTH, error=ArtifactFormatError)


def read_json(path: str | os.PathLike, what: str = "JSON", max_bytes: int = MAX_JSON_BYTES) -> Any:
    """:func:`read_json_bytes` of the file ``path``, read with :func:`read_bounded`.

    Examples:
        >>> from steerkit.vectors.safety import dump_json, read_json
        >>> _ = (tmp_dir / "meta.json").write_bytes(dump_json({"layers": [3, 5]}))
        >>> read_json(tmp_dir / "meta.json")
        {'layers': [3, 5]}
    """
    return read_json_bytes(read_bounded(path, max_bytes), f"{what} ({path})", max_bytes)


def dump_json(obj: Any) -> bytes:
    """``obj`` as UTF-8 JSON bytes, keys sorted, NaN and infinities refused (``ValueError``).

    Examples:
        >>> from steerkit.vectors.safety import dump_json
        >>> print(dump_json({"b": 1, "a": 2.5}).decode())
        {
         "a": 2.5,
         "b": 1
        }
    """
    return json.dumps(obj, indent=1, sort_keys=True, allow_nan=False).encode("utf-8")


# --------------------------------------------------------------------------- safetensors
def tensors_to_safetensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """Serialise tensors in the safetensors layout (bytes are identical to what the library writes).

    Examples:
        >>> from steerkit.vectors.safety import parse_safetensors, tensors_to_safetensors
        >>> data = tensors_to_safetensors({"v": torch.arange(3.0)}, metadata={"note": "hi"})
        >>> parse_safetensors(data)
        ({'v': tensor([0., 1., 2.])}, {'note': 'hi'})
    """
    clean, seen = {}, set()
    for k, v in tensors.items():
        t = v.detach().to("cpu").contiguous()
        if t.untyped_storage().data_ptr() in seen:  # the same vector at two layers: store each on its own
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        clean[k] = t
    return safetensors.torch.save(clean, metadata=metadata)


def _safetensors_entries(head: bytes, n: int, what: str, max_tensors: int
                         ) -> tuple[int, list[tuple[str, torch.dtype, list[int], int, int]], dict[str, str]]:
    """Validate a safetensors header (``head``: at least its first ``8 + header length`` bytes; ``n``: the file's
    size): ``(data start, [(name, dtype, shape, begin, end)], metadata)``, offsets relative to the data section,
    which they tile exactly."""
    if n < 8 or len(head) < 8:
        raise ArtifactFormatError(f"expected a {what} of at least 8 bytes, found {n}; the file is truncated")
    (hlen,) = struct.unpack("<Q", head[:8])
    if hlen > MAX_HEADER_BYTES or hlen > n - 8 or hlen > len(head) - 8:
        raise ArtifactFormatError(
            f"expected a {what} header length <= {min(MAX_HEADER_BYTES, n - 8)}, found {hlen}; "
            "the file is truncated or not safetensors"
        )
    header = read_json_bytes(bytes(head[8 : 8 + hlen]), f"{what} header")
    if not isinstance(header, dict):
        raise ArtifactFormatError(f"expected the {what} header to be a JSON object, found {type(header).__name__}")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise ArtifactFormatError(f"expected {what} __metadata__ to map strings to strings, found {meta!r:.200}")
    if len(header) > max_tensors:
        raise ArtifactFormatError(f"expected at most {max_tensors} tensors in the {what}, found {len(header)}")
    body_len = n - 8 - hlen
    entries = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) - {"dtype", "shape", "data_offsets"}:
            raise ArtifactFormatError(f"expected tensor entry {name!r} with dtype/shape/data_offsets, found {info!r:.200}")
        dt = info.get("dtype")
        shape = info.get("shape")
        offs = info.get("data_offsets")
        if dt not in _ST_DTYPES:
            raise ArtifactFormatError(f"expected tensor {name!r} dtype in {sorted(_ST_DTYPES)}, found {dt!r}")
        if (not isinstance(shape, list) or len(shape) > 8
                or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**40 for s in shape)):
            raise ArtifactFormatError(f"expected tensor {name!r} shape as a list of non-negative ints, found {shape!r:.200}")
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
                or not 0 <= offs[0] <= offs[1] <= body_len):
            raise ArtifactFormatError(
                f"expected tensor {name!r} data_offsets [begin, end] within the {body_len}-byte data section, found {offs!r:.200}"
            )
        torch_dt = _ST_DTYPES[dt]
        numel, span = 1, 1
        for s in shape:
            numel *= s
            span *= max(s, 1)
        if span >= 2**40:  # even an empty tensor's shape must be one torch can describe
            raise ArtifactFormatError(
                f"expected tensor {name!r} shape whose non-zero dimensions multiply to fewer than 2^40 elements, "
                f"found {shape!r:.200}; the file is corrupted or hostile"
            )
        nbytes = numel * torch.empty((), dtype=torch_dt).element_size()
        if offs[1] - offs[0] != nbytes:
            raise ArtifactFormatError(
                f"expected tensor {name!r} of shape {shape} {dt} to take {nbytes} bytes, found {offs[1] - offs[0]}"
            )
        entries.append((name, torch_dt, shape, offs[0], offs[1]))
    pos = 0
    for b, e in sorted((b, e) for _, _, _, b, e in entries):
        if b != pos:
            raise ArtifactFormatError(f"expected tensor data in the {what} to be contiguous, found a gap or overlap at byte {b}")
        pos = e
    if pos != body_len:
        raise ArtifactFormatError(f"expected the {what} data section to end at byte {pos}, found {body_len} bytes")
    return 8 + hlen, entries, meta


def parse_safetensors(
    data: bytes, what: str = "safetensors file", max_tensors: int = MAX_TENSORS
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Parse safetensors bytes with strict validation.  Returns (tensors, metadata).

    Examples:
        >>> from steerkit.vectors.safety import parse_safetensors, tensors_to_safetensors
        >>> data = tensors_to_safetensors({"v": torch.ones(2, 3)})
        >>> tensors, meta = parse_safetensors(data)
        >>> tuple(tensors["v"].shape), meta
        ((2, 3), {})
        >>> parse_safetensors(data[:20])
        Traceback (most recent call last):
        ...
        steerkit.vectors.errors.ArtifactFormatError: expected a safetensors file header length ...
    """
    start, entries, meta = _safetensors_entries(data, len(data), what, max_tensors)
    body = memoryview(data)[start:]
    out: dict[str, torch.Tensor] = {}
    for name, dt, shape, b, e in entries:
        if b == e:
            out[name] = torch.empty(shape, dtype=dt)
        else:
            out[name] = torch.frombuffer(bytearray(body[b:e]), dtype=dt).reshape(shape).clone()
    return out, meta


def map_safetensors(path: str | os.PathLike, what: str = "safetensors file", max_bytes: int = MAX_FILE_BYTES,
                    max_tensors: int = MAX_TENSORS) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, validated as :func:`parse_safetensors` validates them, without reading their
    data: each is a view of a private memory map of the file (copy on write), so only the parts read take memory
    (the map asks the system for random access: no read-ahead). For large weights of which a few rows are used.

    Examples:
        >>> from steerkit.vectors.safety import map_safetensors
        >>> import safetensors.torch
        >>> safetensors.torch.save_file({"W": torch.arange(6.0).reshape(2, 3)}, str(tmp_dir / "w.safetensors"))
        >>> map_safetensors(tmp_dir / "w.safetensors")["W"][1]
        tensor([3., 4., 5.])
    """
    p = Path(path)
    if not p.is_file():
        raise ArtifactFormatError(f"expected a regular file at {p}, found {'something else' if p.exists() else 'none'}; "
                                  "check the path")
    size = p.stat().st_size
    if size > max_bytes:
        raise ArtifactFormatError(f"expected at most {max_bytes} bytes in {p}, found {size}; raise max_bytes if you "
                                  "trust this file")
    head = read_head(p, min(size, 8 + MAX_HEADER_BYTES))
    if len(head) >= 8:
        (hlen,) = struct.unpack("<Q", head[:8])
        head = head[: 8 + hlen] if hlen <= len(head) - 8 else head
    start, entries, _ = _safetensors_entries(head, size, f"{what} ({p})", max_tensors)
    if size == 0 or not entries:
        return {}
    with open(p, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        mm.madvise(mmap.MADV_RANDOM)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = torch.frombuffer(mm, dtype=torch.uint8)  # the tensor keeps the map alive
    setattr(base.untyped_storage(), _MAP_ATTR, mm)  # every view of the map finds it there (release_pages)
    out: dict[str, torch.Tensor] = {}
    for name, dt, shape, b, e in entries:
        raw = base[start + b: start + e]
        item = torch.empty((), dtype=dt).element_size()
        if (start + b) % item:  # a misaligned tensor (not what safetensors writes): read it
            out[name] = torch.frombuffer(bytearray(raw.numpy().tobytes()), dtype=dt).reshape(shape)
        else:
            out[name] = raw.view(dt).reshape(shape) if e > b else torch.empty(shape, dtype=dt)
    return out


#: the attribute of a mapped file's storage that holds its map (torch keeps a storage's Python object, and so its
#: attributes, as long as any tensor viewing it lives)
_MAP_ATTR = "_steerkit_file_map"
_MADV_PAGEOUT = 21  # Linux 5.4+: reclaim the pages now (a page written since stays: it has no file to come back from)


def release_pages(t: torch.Tensor) -> bool:
    """Give back the memory of a tensor that :func:`map_safetensors` mapped: its pages leave the process's resident
    memory and are read from the file again when next used (pages written to stay). ``False`` (nothing done) for
    any other tensor, or where the system cannot.

    Examples:
        >>> from steerkit.vectors.safety import map_safetensors, release_pages
        >>> import safetensors.torch
        >>> safetensors.torch.save_file({"W": torch.ones(1024, 64)}, str(tmp_dir / "w.safetensors"))
        >>> W = map_safetensors(tmp_dir / "w.safetensors")["W"]
        >>> float(W.sum()), release_pages(W), float(W.sum()), release_pages(torch.ones(3))
        (65536.0, True, 65536.0, False)
    """
    storage = t.untyped_storage()
    mm = getattr(storage, _MAP_ATTR, None)
    if mm is None or t.numel() == 0 or mm.closed:
        return False
    start, length = storage.data_ptr(), storage.nbytes()
    # the bytes the view spans (a strided view reaches past numel * element size)
    span = (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()
    page = mmap.PAGESIZE
    lo = (t.data_ptr() - start) // page * page
    hi = min(-(-(t.data_ptr() - start + span) // page) * page, length)
    try:
        mm.madvise(_MADV_PAGEOUT, lo, hi - lo)
    except (OSError, ValueError, AttributeError):  # an older system: the pages stay
        return False
    return True


# --------------------------------------------------------------------------- GGUF
GGUF_MAGIC = b"GGUF"
# value types
_GT_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GT_STRING, _GT_ARRAY = 8, 9
# tensor types we accept in artifact GGUFs: F32, F16, BF16
_GGML_DT = {0: (np.float32, 4), 1: (np.float16, 2), 30: (None, 2)}


class _Cursor:
    def __init__(self, data: bytes, what: str):
        self.data, self.pos, self.what = data, 0, what

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise ArtifactFormatError(
                f"expected {n} more bytes at offset {self.pos} of the {self.what}, found {len(self.data) - self.pos}; "
                "the file is truncated or corrupted"
            )
        b = self.data[self.pos : self.pos + n]
        self.pos += n
        return b

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > MAX_STRING_BYTES:
            raise ArtifactFormatError(f"expected a string of at most {MAX_STRING_BYTES} bytes in the {self.what}, found length {n}")
        raw = self.take(n)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ArtifactFormatError(f"expected UTF-8 strings in the {self.what}, found undecodable bytes") from e

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in _GT_FMT:
            return self.unpack(_GT_FMT[vtype])
        if vtype == _GT_STRING:
            return self.string()
        if vtype == _GT_ARRAY:
            if depth > 2:
                raise ArtifactFormatError(f"expected GGUF arrays nested at most 2 deep in the {self.what}")
            sub = self.unpack("<I")
            n = self.unpack("<Q")
            min_item = struct.calcsize(_GT_FMT[sub]) if sub in _GT_FMT else 8 if sub in (_GT_STRING, _GT_ARRAY) else None
            if min_item is None:
                raise ArtifactFormatError(f"expected a known GGUF array element type in the {self.what}, found {sub}")
            if n * min_item > len(self.data) - self.pos:
                raise ArtifactFormatError(
                    f"expected a GGUF array of {n} elements to fit in the {len(self.data) - self.pos} remaining bytes "
                    f"of the {self.what}; the file is truncated or corrupted"
                )
            if sub in _GT_FMT:
                fmt = _GT_FMT[sub]
                raw = self.take(n * struct.calcsize(fmt))
                return list(np.frombuffer(raw, dtype=np.dtype(fmt)).tolist())
            return [self.value(sub, depth + 1) for _ in range(n)]
        raise ArtifactFormatError(f"expected a known GGUF value type in the {self.what}, found {vtype}")


def _gguf_head(c: _Cursor, what: str) -> tuple[int, dict[str, Any]]:
    """Magic, version, tensor count and the metadata key/values of a GGUF (the cursor ends after them)."""
    magic = c.take(4)
    if magic != GGUF_MAGIC:
        raise ArtifactFormatError(f"expected a {what} starting with b'GGUF', found {magic!r}; this is not a GGUF file")
    version = c.unpack("<I")
    if version not in (2, 3):
        raise ArtifactFormatError(f"expected GGUF version 2 or 3, found {version}")
    n_tensors = c.unpack("<Q")
    n_kv = c.unpack("<Q")
    if n_tensors > MAX_TENSORS or n_kv > MAX_GGUF_KV:
        raise ArtifactFormatError(
            f"expected at most {MAX_TENSORS} tensors and {MAX_GGUF_KV} metadata keys in the {what}, "
            f"found {n_tensors} and {n_kv}"
        )
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        vtype = c.unpack("<I")
        if key in meta:
            raise ArtifactFormatError(f"expected unique metadata keys in the {what}, found {key!r} twice")
        meta[key] = c.value(vtype)
    return n_tensors, meta


def parse_gguf_metadata(data: bytes, what: str = "GGUF file") -> dict[str, Any]:
    """The metadata key/values of a GGUF from its first bytes (``data`` may be a prefix of the file);
    :class:`ArtifactFormatError` if they do not fit in ``data`` or are malformed.

    Examples:
        >>> from steerkit.vectors.safety import parse_gguf_metadata, read_head, write_gguf
        >>> write_gguf(tmp_dir / "v.gguf", "controlvector", {"controlvector.layer_count": 1},
        ...            {"direction.1": np.ones(64, dtype=np.float32)})
        >>> parse_gguf_metadata(read_head(tmp_dir / "v.gguf", 4096))["controlvector.layer_count"]
        1
    """
    return _gguf_head(_Cursor(data, what), what)[1]


def parse_gguf(data: bytes, what: str = "GGUF file") -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Parse a small GGUF file (v2/v3, little endian, F32/F16/BF16 tensors).

    Returns ``(metadata, tensors)`` with tensors as float32 numpy arrays in
    numpy (row-major, reversed ggml) shape order.

    Examples:
        >>> from steerkit.vectors.safety import parse_gguf, write_gguf
        >>> write_gguf(tmp_dir / "v.gguf", "controlvector", {"controlvector.layer_count": 1},
        ...            {"direction.1": np.full((2, 3), 0.5, dtype=np.float32)})
        >>> meta, tensors = parse_gguf((tmp_dir / "v.gguf").read_bytes())
        >>> meta["general.architecture"], tensors["direction.1"].shape, float(tensors["direction.1"].sum())
        ('controlvector', (2, 3), 3.0)
    """
    c = _Cursor(data, what)
    n_tensors, meta = _gguf_head(c, what)
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        nd = c.unpack("<I")
        if nd < 1 or nd > MAX_DIMS:
            raise ArtifactFormatError(f"expected 1-{MAX_DIMS} dimensions for tensor {name!r}, found {nd}")
        dims = [c.unpack("<Q") for _ in range(nd)]
        ttype = c.unpack("<I")
        off = c.unpack("<Q")
        if ttype not in _GGML_DT:
            raise ArtifactFormatError(
                f"expected tensor {name!r} of type F32, F16 or BF16, found ggml type {ttype}; "
                "quantised tensors are not valid in steering-vector files"
            )
        span = 1
        for d in dims:
            span *= max(d, 1)
        if any(d > 2**31 for d in dims) or span >= 2**40:
            raise ArtifactFormatError(f"expected tensor {name!r} dimensions below 2^31 whose non-zero values multiply "
                                      f"to fewer than 2^40 elements, found {dims}")
        infos.append((name, dims, ttype, off))
    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1) or align > 1 << 16:
        raise ArtifactFormatError(f"expected general.alignment to be a power of two, found {align!r}")
    start = (c.pos + align - 1) // align * align
    tensors: dict[str, np.ndarray] = {}
    for name, dims, ttype, off in infos:
        if name in tensors:
            raise ArtifactFormatError(f"expected unique tensor names in the {what}, found {name!r} twice")
        numel = 1
        for d in dims:
            numel *= d
        np_dt, size = _GGML_DT[ttype]
        b, e = start + off, start + off + numel * size
        if off % align or e > len(data):
            raise ArtifactFormatError(
                f"expected tensor {name!r} data within the {len(data)}-byte {what}, found bytes {b}..{e}; "
                "the file is truncated or corrupted"
            )
        raw = data[b:e]
        if ttype == 30:  # BF16
            arr = (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(raw, dtype=np_dt).astype(np.float32)
        tensors[name] = arr.reshape(list(reversed(dims))).copy()
    return meta, tensors


def write_gguf(path: str | os.PathLike, arch: str, kv: dict[str, Any], tensors: dict[str, np.ndarray]) -> None:
    """Write a GGUF (float32 tensors, typed metadata) atomically via ``gguf.GGUFWriter``.

    ``kv`` values: ``str``, ``bool``, ``int`` (uint32 if 0 <= v < 2^32, else int64), ``float``
    (float32 when exactly representable, else float64) or lists of those.

    Examples:
        >>> from steerkit.vectors.safety import parse_gguf, write_gguf
        >>> write_gguf(tmp_dir / "v.gguf", "controlvector", {"controlvector.model_hint": "llama", "x": 0.5},
        ...            {"direction.3": np.zeros(64, dtype=np.float32)})
        >>> meta, tensors = parse_gguf((tmp_dir / "v.gguf").read_bytes())
        >>> meta["controlvector.model_hint"], meta["x"], list(tensors)
        ('llama', 0.5, ['direction.3'])
    """
    with atomic_path(path) as tmp:
        w = gguf.GGUFWriter(tmp, arch)
        for k, v in kv.items():
            if isinstance(v, bool):
                w.add_bool(k, v)
            elif isinstance(v, int):
                if 0 <= v < 2**32:
                    w.add_uint32(k, v)
                else:
                    w.add_int64(k, v)
            elif isinstance(v, float):
                if float(np.float32(v)) == v:
                    w.add_float32(k, v)
                else:
                    w.add_float64(k, v)
            elif isinstance(v, str):
                w.add_string(k, v)
            elif isinstance(v, (list, tuple)):
                w.add_array(k, list(v))
            else:
                raise ExportError(f"expected GGUF metadata {k!r} as str, bool, int, float or a list of those, "
                                  f"found {type(v).__name__}; convert it before writing")
        for name, arr in tensors.items():
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
