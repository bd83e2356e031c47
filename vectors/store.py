"""A crash-safe, concurrent, versioned store of steering artifacts on disk.

How it works
------------
Layout of a store folder (default ``./steerkit-store``, or ``$STEERKIT_STORE``)::

    index.json                      names -> versions (summaries, file hashes), tags, next version
    .lock                           writer lock (``flock``; released by the OS if a writer dies)
    objects/<name>/<N>/tensors.safetensors
    objects/<name>/<N>/meta.json    kind, fields, provenance
    tmp/                            staging area of the writer holding the lock

*Writing* (``save``, ``tag``, ``untag``, ``delete``) takes the lock for the whole operation.  A new
version is staged in ``tmp/``: each file is written, fsynced and renamed into place; the staged
folder is renamed into ``objects/<name>/<N>`` (one atomic rename) and only then is ``index.json``
replaced atomically (temp file + fsync + rename + fsync of the folder).  The index is the single
source of truth: a writer killed at any point leaves either the old index (the half-written version
is invisible and swept away by the next writer) or the new one (the version is complete).
Versions are immutable and never reused, even after deletion (``next_version`` only grows).

*Reading* needs no lock: ``index.json`` is always a complete file, and ``load`` and ``show`` check
the SHA-256 of what they read against the index, so a corrupted or tampered object is reported,
never half-read.  A malformed index is reported as :class:`StoreIndexError`, with what is wrong in it.

*Confinement*: every file access goes through :class:`steerkit.storage.files.Folder`, which walks each
path from the store folder one component at a time without following symbolic links.  A link
planted anywhere below the store is never read, written or deleted through: reads refuse it, the
clean-up of leftovers (``tmp/``, unindexed folders under ``objects/``, stray index temp files)
removes the link itself and never its target.  Names, tags and versions follow the one rule set of
:mod:`steerkit.storage.naming`; all files are size-bounded and parsed with the strict readers of
:mod:`steerkit.vectors.safety`.

References: ``name`` or ``name@latest`` (newest version), ``name@3`` (version 3),
``name@prod`` (a tag).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import functools
import hashlib
import os
import stat
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

from steerkit.storage.files import ConfinementError, Folder, fsync_dir
from steerkit.storage.naming import MAX_INDEX, is_index, is_name, parse_index

from .artifacts import SteeringVector, artifact_to_payload, canonical_operation, payload_to_artifact
from .errors import ArtifactFormatError, StoreError, StoreIndexError, UnsafeNameError
from .safety import MAX_JSON_BYTES, check_name, dump_json, parse_safetensors, read_json_bytes, tensors_to_safetensors

INDEX_FORMAT = "steerkit-store"
INDEX_VERSION = 1
INDEX_FILE = "index.json"
LOCK_FILE = ".lock"
TENSORS_FILE = "tensors.safetensors"
META_FILE = "meta.json"
META_MAX_BYTES = 64 << 20
RESERVED_TAGS = {"latest"}
STRAY_TMP_AGE_S = 5.0  # index temp files older than this, found under the lock, belong to dead writers
_HASH_KEYS = ("tensors_sha256", "meta_sha256")


def _summary(info: dict) -> dict:
    """A version's index entry as today's names read it: the operation of a steering vector saved when
    the clamp was called ``"project"`` reads ``"clamp"``."""
    if info.get("kind") != SteeringVector.kind or "operation" not in info:
        return info
    return {**info, "operation": canonical_operation(info["operation"])}


def default_store_path() -> Path:
    """The store folder used when none is given: ``$STEERKIT_STORE``, else ``./steerkit-store``.

    Examples:
        >>> from steerkit.vectors.store import default_store_path
        >>> default_store_path() == Path(os.environ.get("STEERKIT_STORE") or "steerkit-store")
        True
    """
    return Path(os.environ.get("STEERKIT_STORE") or "./steerkit-store")


def parse_ref(ref: str) -> tuple[str, str]:
    """Split ``name[@selector]`` into (name, selector); selector defaults to ``latest``.

    A selector made of digits is a version and must be an index by :mod:`steerkit.storage.naming` (ASCII
    digits, no leading zero: ``x@01`` and ``x@١`` are refused); anything else is a tag name.

    Examples:
        >>> from steerkit.vectors import parse_ref
        >>> parse_ref("happy"), parse_ref("happy@3"), parse_ref("happy@prod")
        (('happy', 'latest'), ('happy', '3'), ('happy', 'prod'))
    """
    if not isinstance(ref, str):
        raise UnsafeNameError(f"expected a reference like 'name@3', found {type(ref).__name__}")
    name, _, sel = ref.partition("@")
    check_name(name)
    sel = sel or "latest"
    if sel.isdigit():
        v = parse_index(sel, f"the version in {ref!r:.80}", StoreError)
        if v < 1:
            raise StoreError(f"expected a version of at least 1 in {ref!r:.80}, found {v}; versions start at 1")
    else:
        check_name(sel, "tag")
    return name, sel


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _bad_index(path: Path, found: str) -> StoreIndexError:
    return StoreIndexError(
        f"expected {path} to be a steerkit store index, found {found}; the artifacts stay on disk under "
        f"objects/ -- restore index.json from a backup, or move the store folder aside and save the "
        "artifacts again (or point STEERKIT_STORE at a steerkit store or an empty folder)"
    )


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class Store:
    """Versioned artifact store.  See the module docstring for the on-disk contract.

    Examples:
        >>> from steerkit.vectors import SteeringVector
        >>> v = SteeringVector.from_direction(torch.ones(64), layer=2, model=tiny)
        >>> store.save("happy", v), store.save("happy", 2 * v, tags=["prod"])
        ('happy@1', 'happy@2')
        >>> float(store.load("happy@prod").directions[2][0]), store.resolve("happy"), "happy@3" in store
        (2.0, ('happy', 2), False)
        >>> [(r["ref"], r["tags"]) for r in store.list()]
        [('happy@1', []), ('happy@2', ['latest', 'prod'])]
    """

    def __init__(self, root: str | os.PathLike | None = None, *, lock_timeout: float = 120.0,
                 max_artifact_bytes: int = 1 << 30):
        self._root = Path(root) if root is not None else default_store_path()
        self.lock_timeout = lock_timeout
        self.max_artifact_bytes = max_artifact_bytes

    # ------------------------------------------------------------------ paths & index
    @property
    def root(self) -> Path:
        """The store folder, fixed when the store is made (a store for another folder is another ``Store``)."""
        return self._root

    @functools.cached_property
    def files(self) -> Folder:
        """The store folder as a :class:`steerkit.storage.files.Folder` (every file access goes through it),
        made on first use."""
        return Folder(self.root)

    @property
    def index_path(self) -> Path:
        return self.root / INDEX_FILE

    @contextlib.contextmanager
    def _confined(self) -> Iterator[None]:
        """Turn a refused path (a symbolic link or a non-regular file inside the store) into a StoreError."""
        try:
            yield
        except ConfinementError as e:
            raise StoreError(f"{e}; remove that entry from the store folder {self.files.root} "
                             "(the store only reads and writes its own plain files and folders)") from None

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        """Hold the writer lock (``flock`` on ``.lock``, opened without following a link)."""
        files = self.files
        files.root.mkdir(parents=True, exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        for attempt in range(2):
            try:
                fd = os.open(files.path(LOCK_FILE), flags, 0o666)
                break
            except ConfinementError:
                if attempt:
                    raise
                files.remove(LOCK_FILE)  # a link planted at .lock: drop the link, never touch its target
            except OSError as e:
                if e.errno != errno.ELOOP or attempt:
                    raise StoreError(f"expected to open the lock file {files.root / LOCK_FILE}, found an error "
                                     f"({e.strerror}); check the store folder's permissions") from None
                files.remove(LOCK_FILE)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise StoreError(f"expected a regular lock file at {files.root / LOCK_FILE}, found another kind "
                                 "of file; remove it")
            deadline = time.monotonic() + self.lock_timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise StoreError(f"expected to take the writer lock of {files.root} within "
                                         f"{self.lock_timeout:g} s, found it held by another writer; retry later or "
                                         "raise lock_timeout") from None
                    time.sleep(0.02)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _object_rel(self, name: str, version: int) -> str:
        check_name(name)
        if not _is_int(version) or not 1 <= version < MAX_INDEX:
            raise StoreError(f"expected a positive integer version, found {version!r}")
        return f"objects/{name}/{version}"

    def _read_index(self) -> dict:
        files = self.files
        path = self.index_path
        with self._confined():
            st = files.lstat(INDEX_FILE)
        if st is None:
            return {"format": INDEX_FORMAT, "version": INDEX_VERSION, "artifacts": {}}
        if stat.S_ISLNK(st.st_mode):
            raise _bad_index(path, "a symbolic link (the store never reads through links)")
        try:
            data = files.read_bytes(INDEX_FILE, MAX_JSON_BYTES)
        except FileNotFoundError:  # removed between the two calls: nothing stored
            return {"format": INDEX_FORMAT, "version": INDEX_VERSION, "artifacts": {}}
        except ConfinementError as e:
            raise _bad_index(path, str(e)) from None
        try:
            idx = read_json_bytes(data, f"store index ({path})")
        except ArtifactFormatError as e:
            raise _bad_index(path, f"invalid JSON ({e})") from None
        self._check_index(idx, path)
        return idx

    def _check_index(self, idx: Any, path: Path) -> None:
        """Every field the store reads, checked: a malformed index is a StoreIndexError, never a crash."""
        if not isinstance(idx, dict) or idx.get("format") != INDEX_FORMAT:
            raise _bad_index(path, f"a JSON {type(idx).__name__} without format {INDEX_FORMAT!r}")
        ver = idx.get("version", INDEX_VERSION)
        if not _is_int(ver) or ver < 1:
            raise _bad_index(path, f"index version {ver!r:.40}")
        if ver > INDEX_VERSION:
            raise StoreError(f"expected store index version <= {INDEX_VERSION}, found {ver}; upgrade steerkit")
        arts = idx.get("artifacts")
        if not isinstance(arts, dict):
            raise _bad_index(path, f"'artifacts' as {type(arts).__name__} instead of an object")
        for name, entry in arts.items():
            check_name(name)  # a name that leaves the store is an UnsafeNameError
            if not isinstance(entry, dict):
                raise _bad_index(path, f"the entry of {name!r} as {type(entry).__name__} instead of an object")
            versions, tags = entry.get("versions"), entry.setdefault("tags", {})
            nxt = entry.setdefault("next_version", 1)
            if not isinstance(versions, dict) or not isinstance(tags, dict) or not _is_int(nxt):
                raise _bad_index(path, f"the entry of {name!r} without versions/tags objects and an integer "
                                       "next_version")
            for v, info in versions.items():
                if not is_index(v) or int(v) < 1:
                    raise _bad_index(path, f"version key {v!r:.40} of {name!r} (expected 1, 2, ...)")
                if not isinstance(info, dict) or not all(isinstance(info.get(k), str) for k in _HASH_KEYS):
                    raise _bad_index(path, f"version {v} of {name!r} without its file hashes")
            for t, tv in tags.items():
                if not is_name(t) or t in RESERVED_TAGS or t.isdigit() or not _is_int(tv) or str(tv) not in versions:
                    raise _bad_index(path, f"tag {t!r:.40} of {name!r} pointing at {tv!r:.40}, not at a "
                                           "stored version")

    def _write_index(self, idx: dict) -> None:
        with self._confined():
            self.files.write_bytes(INDEX_FILE, dump_json(idx))

    def _sweep(self, idx: dict) -> None:
        """Remove leftovers of crashed writers (lock held): everything in ``tmp/``, unindexed version
        folders under ``objects/``, stray index temp files and any symbolic link found on the way.
        Each removal goes through :meth:`Folder.remove`, which unlinks a link and never its target."""
        files = self.files
        with self._confined():
            st = files.lstat("tmp")
            if st is not None:
                if stat.S_ISDIR(st.st_mode):
                    for n in files.listdir("tmp"):
                        files.remove(f"tmp/{n}")
                else:  # a link or a file: not a staging area
                    files.remove("tmp")
            now = time.time()
            for n in files.listdir(""):
                if n.startswith(f".{INDEX_FILE}.") and n.endswith(".tmp"):
                    est = files.lstat(n)
                    if est is not None and (stat.S_ISLNK(est.st_mode) or now - est.st_mtime > STRAY_TMP_AGE_S):
                        files.remove(n)
            st = files.lstat("objects")
            if st is None:
                return
            if not stat.S_ISDIR(st.st_mode):
                raise StoreError(f"expected a folder at {files.root / 'objects'}, found "
                                 f"{'a symbolic link' if stat.S_ISLNK(st.st_mode) else 'a file'}; the store keeps its "
                                 "objects in a plain folder -- move it back there")
            for n in files.listdir("objects"):
                entry = idx["artifacts"].get(n) if is_name(n) else None
                nst = files.lstat(f"objects/{n}")
                if nst is None:
                    continue
                if not stat.S_ISDIR(nst.st_mode):
                    files.remove(f"objects/{n}")
                    continue
                known = set(entry["versions"]) if entry else set()
                for v in files.listdir(f"objects/{n}"):
                    vst = files.lstat(f"objects/{n}/{v}")
                    if v not in known or (vst is not None and not stat.S_ISDIR(vst.st_mode)):
                        files.remove(f"objects/{n}/{v}")

    def _mkdir(self, rel: str) -> None:
        """Create the folder ``rel`` (an existing entry must be a plain folder, not a link)."""
        with self._confined():
            self.files.mkdir(rel)

    # ------------------------------------------------------------------ resolution
    def resolve(self, ref: str, idx: dict | None = None) -> tuple[str, int]:
        """Turn ``name[@sel]`` into (name, version); raise StoreError if it does not exist."""
        name, sel = parse_ref(ref)
        idx = idx if idx is not None else self._read_index()
        entry = idx["artifacts"].get(name)
        if not entry or not entry["versions"]:
            known = ", ".join(sorted(n for n, e in idx["artifacts"].items() if e["versions"])[:10]) or "none"
            raise StoreError(f"expected an artifact named {name!r} in {self.root}, found none (known: {known}); run 'steerkit vectors list'")
        versions = sorted(int(v) for v in entry["versions"])
        if sel == "latest":
            return name, versions[-1]
        if is_index(sel):
            v = int(sel)
            if str(v) not in entry["versions"]:
                raise StoreError(f"expected version {v} of {name!r}, found versions {versions}")
            return name, v
        tags = entry.get("tags", {})
        if sel not in tags:
            raise StoreError(f"expected a version number, 'latest' or a tag of {name!r} ({sorted(tags) or 'no tags'}), found {sel!r}")
        return name, int(tags[sel])

    # ------------------------------------------------------------------ write API
    def save(self, name: str, artifact: Any, *, tags: list[str] | tuple[str, ...] = ()) -> str:
        """Store ``artifact`` as the next version of ``name``; returns ``"name@N"``."""
        check_name(name)
        for t in tags:
            self._check_tag(t)
        tensors, meta = artifact_to_payload(artifact)
        tbytes = tensors_to_safetensors(tensors, metadata={"steerkit_kind": meta["kind"]})
        mbytes = dump_json(meta)
        files = self.files
        with self._lock():
            idx = self._read_index()
            self._sweep(idx)
            entry = idx["artifacts"].setdefault(name, {"versions": {}, "tags": {}, "next_version": 1})
            existing = [int(v) for v in entry["versions"]]
            version = max([entry.get("next_version", 1), *[v + 1 for v in existing]])
            stage = f"tmp/{uuid.uuid4().hex}"
            final = self._object_rel(name, version)
            with self._confined():
                files.write_bytes(f"{stage}/{TENSORS_FILE}", tbytes)  # each fsynced, then its folder
                files.write_bytes(f"{stage}/{META_FILE}", mbytes)
                self._mkdir("objects")
                self._mkdir(f"objects/{name}")
                if files.lstat(final) is not None:  # an unindexed leftover of a crashed writer
                    files.remove(final)
                src, parent = files.path(stage), files.path(f"objects/{name}")  # no component is a link
                os.replace(src, parent / str(version))  # one atomic rename; a link at the target is replaced
                fsync_dir(parent)
            summary = artifact.summary()
            entry["versions"][str(version)] = {
                **summary,
                "saved_at": meta["provenance"].get("created_at"),
                "tensors_sha256": _sha256(tbytes),
                "meta_sha256": _sha256(mbytes),
                "bytes": len(tbytes) + len(mbytes),
            }
            entry["next_version"] = version + 1
            for t in tags:
                entry["tags"][t] = version
            self._write_index(idx)
        return f"{name}@{version}"

    def _check_tag(self, tag: str) -> None:
        check_name(tag, "tag")
        if tag in RESERVED_TAGS or tag.isdigit():
            raise StoreError(f"expected a tag that is not a number or one of {sorted(RESERVED_TAGS)}, found {tag!r}")

    def tag(self, ref: str, tag: str) -> str:
        """Point ``tag`` at the version ``ref`` resolves to (tags are mutable, versions are not)."""
        self._check_tag(tag)
        with self._lock():
            idx = self._read_index()
            name, version = self.resolve(ref, idx)
            idx["artifacts"][name]["tags"][tag] = version
            self._write_index(idx)
        return f"{name}@{version}"

    def untag(self, name: str, tag: str) -> None:
        check_name(name)
        check_name(tag, "tag")
        with self._lock():
            idx = self._read_index()
            entry = idx["artifacts"].get(name)
            if not entry or tag not in entry.get("tags", {}):
                raise StoreError(f"expected tag {tag!r} on {name!r}, found none")
            del entry["tags"][tag]
            self._write_index(idx)

    def delete(self, ref: str) -> list[str]:
        """Delete one version (``name@3``) or, with a bare name, every version.  Returns refs removed."""
        name, sel = parse_ref(ref)
        with self._lock():
            idx = self._read_index()
            entry = idx["artifacts"].get(name)
            if not entry or not entry["versions"]:
                raise StoreError(f"expected an artifact named {name!r} in {self.root}, found none")
            if "@" in ref:
                _, v = self.resolve(ref, idx)
                versions = [v]
            else:
                versions = sorted(int(v) for v in entry["versions"])
            for v in versions:
                entry["versions"].pop(str(v), None)
            entry["tags"] = {t: v for t, v in entry["tags"].items() if str(v) in entry["versions"]}
            self._write_index(idx)  # invisible first, then removed from disk
            self._sweep(idx)  # removes the unindexed version folders (and any link in their place)
        return [f"{name}@{v}" for v in versions]

    # ------------------------------------------------------------------ read API
    def _read_object(self, name: str, version: int, info: dict, file: str, max_bytes: int) -> bytes:
        """One file of a stored version, read through the store folder and checked against its hash."""
        label, key = ("tensors", "tensors_sha256") if file == TENSORS_FILE else ("metadata", "meta_sha256")
        rel = f"{self._object_rel(name, version)}/{file}"
        try:
            data = self.files.read_bytes(rel, max_bytes)
        except ConfinementError as e:
            raise ArtifactFormatError(f"expected {name}@{version} {label} as a plain file inside the store, found: {e}; "
                                      "delete this version and save it again") from None
        except OSError as e:
            raise ArtifactFormatError(f"expected {name}@{version} {label} at {self.files.root / rel}, found none "
                                      f"({e.strerror}); the store is damaged -- delete this version and save it again") from None
        if _sha256(data) != info[key]:
            raise ArtifactFormatError(
                f"expected {name}@{version} {label} with hash {info[key]}, found {_sha256(data)}; "
                "the stored file was modified or corrupted -- delete this version and save it again"
            )
        return data

    def load(self, ref: str) -> Any:
        """Load an artifact by reference; exact round trip of what ``save`` stored."""
        idx = self._read_index()
        name, version = self.resolve(ref, idx)
        info = idx["artifacts"][name]["versions"][str(version)]
        tbytes = self._read_object(name, version, info, TENSORS_FILE, self.max_artifact_bytes)
        mbytes = self._read_object(name, version, info, META_FILE, META_MAX_BYTES)
        tensors, _ = parse_safetensors(tbytes, f"{name}@{version} tensors")
        meta = read_json_bytes(mbytes, f"{name}@{version} metadata")
        return payload_to_artifact(tensors, meta)

    def show(self, ref: str) -> dict:
        """Everything known about one version: reference, tags, summary and full metadata."""
        idx = self._read_index()
        name, version = self.resolve(ref, idx)
        entry = idx["artifacts"][name]
        info = entry["versions"][str(version)]
        meta = read_json_bytes(self._read_object(name, version, info, META_FILE, META_MAX_BYTES),
                               f"{name}@{version} metadata")
        return {"ref": f"{name}@{version}", "name": name, "version": version,
                "tags": sorted(t for t, v in entry.get("tags", {}).items() if v == version),
                "latest": version == max(int(v) for v in entry["versions"]),
                **_summary(info), "meta": meta}

    def list(self, name: str | None = None, *, all_versions: bool = True) -> list[dict]:
        """Rows ``{ref, name, version, kind, tags, ...}`` sorted by name then version."""
        idx = self._read_index()
        rows = []
        for n, entry in sorted(idx["artifacts"].items()):
            if name is not None and n != name:
                continue
            versions = sorted(int(v) for v in entry["versions"])
            if not all_versions:
                versions = versions[-1:]
            for v in versions:
                tags = sorted(t for t, tv in entry.get("tags", {}).items() if tv == v)
                if v == max(int(x) for x in entry["versions"]):
                    tags = ["latest", *tags]
                rows.append({"ref": f"{n}@{v}", "name": n, "version": v, "tags": tags,
                             **_summary(entry["versions"][str(v)])})
        return rows

    def search(self, text: str | None = None, **filters: Any) -> builtins.list[dict]:  # Store.list shadows the builtin
        """Rows whose name/method/model/tags contain ``text`` and whose fields equal ``filters``
        (e.g. ``kind="steering_vector"``, ``model_name=...``, ``tag="prod"``)."""
        tag = filters.pop("tag", None)
        out = []
        for row in self.list():
            hay = " ".join(str(row.get(k) or "") for k in ("name", "method", "model_name", "kind", "operation")) + " " + " ".join(row["tags"])
            if text and text.lower() not in hay.lower():
                continue
            if tag and tag not in row["tags"]:
                continue
            if any(row.get(k) != v for k, v in filters.items()):
                continue
            out.append(row)
        return out

    def names(self) -> builtins.list[str]:
        return [n for n, e in sorted(self._read_index()["artifacts"].items()) if e["versions"]]

    def __iter__(self) -> Iterator[dict]:
        return iter(self.list())

    def __contains__(self, ref: str) -> bool:
        try:
            self.resolve(ref)
            return True
        except (StoreError, UnsafeNameError):
            return False
