"""A crash-safe, concurrent, versioned store of steering artifacts on disk.

How it works
------------
Layout of a store folder (default ``./steerkit-store``, or ``$STEERKIT_STORE``)::

    index.json                      names -> versions (summaries, file hashes), tags, next version
    .lock                           writer lock (filelock; released by the OS if a writer dies)
    objects/<name>/<N>/tensors.safetensors
    objects/<name>/<N>/meta.json    kind, fields, provenance
    tmp/                            staging area of the writer holding the lock

*Writing* (``save``, ``tag``, ``delete``) takes the lock for the whole operation.  A new version
is staged in ``tmp/``: each file is written, flushed and fsynced; the staged folder is renamed
into ``objects/<name>/<N>`` (one atomic rename) and only then is ``index.json`` replaced
atomically (temp file + fsync + rename + fsync of the folder).  The index is the single source
of truth: a writer killed at any point leaves either the old index (the half-written version is
invisible and swept away by the next writer) or the new one (the version is complete).
Versions are immutable and never reused, even after deletion (``next_version`` only grows).

*Reading* needs no lock: ``index.json`` is always a complete file, and each load checks the
SHA-256 of both files against the index, so a corrupted or tampered object is reported, never
half-read.  Names are validated (``[A-Za-z0-9][A-Za-z0-9._-]*``, no ``..``) and every path is
checked to stay inside the store; all files are size-bounded and parsed with the strict
readers of :mod:`steerkit.vectors.safety`.

References: ``name`` or ``name@latest`` (newest version), ``name@3`` (version 3),
``name@prod`` (a tag).
"""

from __future__ import annotations

import builtins
import hashlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator

from filelock import FileLock

from .artifacts import artifact_to_payload, payload_to_artifact
from .errors import ArtifactFormatError, StoreError, UnsafeNameError
from .safety import (
    atomic_write_bytes, check_name, dump_json, fsync_dir, inside, parse_safetensors,
    read_bounded, read_json, read_json_bytes, tensors_to_safetensors,
)

INDEX_FORMAT = "steerkit-store"
INDEX_VERSION = 1
TENSORS_FILE = "tensors.safetensors"
META_FILE = "meta.json"
RESERVED_TAGS = {"latest"}


def default_store_path() -> Path:
    return Path(os.environ.get("STEERKIT_STORE") or "./steerkit-store")


def parse_ref(ref: str) -> tuple[str, str]:
    """Split ``name[@selector]`` into (name, selector); selector defaults to ``latest``."""
    if not isinstance(ref, str):
        raise UnsafeNameError(f"expected a reference like 'name@3', found {type(ref).__name__}")
    name, _, sel = ref.partition("@")
    check_name(name)
    sel = sel or "latest"
    if not sel.isdigit():
        check_name(sel, "tag")
    return name, sel


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class Store:
    """Versioned artifact store.  See the module docstring for the on-disk contract."""

    def __init__(self, root: str | os.PathLike | None = None, *, lock_timeout: float = 120.0,
                 max_artifact_bytes: int = 1 << 30):
        self.root = Path(root) if root is not None else default_store_path()
        self.lock_timeout = lock_timeout
        self.max_artifact_bytes = max_artifact_bytes

    # ------------------------------------------------------------------ paths & index
    @property
    def index_path(self) -> Path:
        return self.root / "index.json"

    def _lock(self) -> FileLock:
        self.root.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.root / ".lock"), timeout=self.lock_timeout)

    def _object_dir(self, name: str, version: int) -> Path:
        check_name(name)
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise StoreError(f"expected a positive integer version, found {version!r}")
        return inside(self.root, self.root / "objects" / name / str(version))

    def _read_index(self) -> dict:
        if not self.index_path.exists():
            return {"format": INDEX_FORMAT, "version": INDEX_VERSION, "artifacts": {}}
        idx = read_json(self.index_path, "store index")
        if not isinstance(idx, dict) or idx.get("format") != INDEX_FORMAT or not isinstance(idx.get("artifacts"), dict):
            raise StoreError(
                f"expected {self.index_path} to be a steerkit store index, found something else; "
                "point STEERKIT_STORE at a steerkit store or an empty folder"
            )
        if idx.get("version", 0) > INDEX_VERSION:
            raise StoreError(f"expected store index version <= {INDEX_VERSION}, found {idx.get('version')}; upgrade steerkit")
        for name, entry in idx["artifacts"].items():
            check_name(name)
            if (not isinstance(entry, dict) or not isinstance(entry.get("versions"), dict)
                    or not isinstance(entry.get("tags", {}), dict) or not isinstance(entry.get("next_version", 1), int)):
                raise StoreError(f"expected index entry for {name!r} with versions/tags/next_version, found a malformed one")
        return idx

    def _write_index(self, idx: dict) -> None:
        atomic_write_bytes(self.index_path, dump_json(idx))

    def _sweep(self, idx: dict) -> None:
        """Remove staging leftovers and unindexed object folders of crashed writers (lock held)."""
        tmp = self.root / "tmp"
        if tmp.exists():
            for p in tmp.iterdir():
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        objs = self.root / "objects"
        if not objs.exists():
            return
        for ndir in objs.iterdir():
            entry = idx["artifacts"].get(ndir.name)
            known = set(entry["versions"]) if entry else set()
            for vdir in ndir.iterdir() if ndir.is_dir() else []:
                if vdir.name not in known:
                    shutil.rmtree(vdir, ignore_errors=True)

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
        if sel.isdigit():
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
        with self._lock():
            idx = self._read_index()
            self._sweep(idx)
            entry = idx["artifacts"].setdefault(name, {"versions": {}, "tags": {}, "next_version": 1})
            existing = [int(v) for v in entry["versions"]]
            version = max([entry.get("next_version", 1), *[v + 1 for v in existing]])
            stage = self.root / "tmp" / uuid.uuid4().hex
            stage.mkdir(parents=True)
            _write_synced(stage / TENSORS_FILE, tbytes)
            _write_synced(stage / META_FILE, mbytes)
            fsync_dir(stage)
            final = self._object_dir(name, version)
            final.parent.mkdir(parents=True, exist_ok=True)
            if final.exists():  # an unindexed leftover of a crashed writer
                shutil.rmtree(final)
            os.rename(stage, final)
            fsync_dir(final.parent)
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
            for v in versions:
                shutil.rmtree(self._object_dir(name, v), ignore_errors=True)
        return [f"{name}@{v}" for v in versions]

    # ------------------------------------------------------------------ read API
    def load(self, ref: str) -> Any:
        """Load an artifact by reference; exact round trip of what ``save`` stored."""
        idx = self._read_index()
        name, version = self.resolve(ref, idx)
        info = idx["artifacts"][name]["versions"][str(version)]
        d = self._object_dir(name, version)
        tbytes = read_bounded(d / TENSORS_FILE, self.max_artifact_bytes)
        mbytes = read_bounded(d / META_FILE, 64 << 20)
        for label, data, key in (("tensors", tbytes, "tensors_sha256"), ("metadata", mbytes, "meta_sha256")):
            if info.get(key) and _sha256(data) != info[key]:
                raise ArtifactFormatError(
                    f"expected {name}@{version} {label} with hash {info[key]}, found {_sha256(data)}; "
                    "the stored file was modified or corrupted -- delete this version and save it again"
                )
        tensors, _ = parse_safetensors(tbytes, f"{name}@{version} tensors")
        meta = read_json_bytes(mbytes, f"{name}@{version} metadata")
        return payload_to_artifact(tensors, meta)

    def show(self, ref: str) -> dict:
        """Everything known about one version: reference, tags, summary and full metadata."""
        idx = self._read_index()
        name, version = self.resolve(ref, idx)
        entry = idx["artifacts"][name]
        meta = read_json(self._object_dir(name, version) / META_FILE, f"{name}@{version} metadata")
        return {"ref": f"{name}@{version}", "name": name, "version": version,
                "tags": sorted(t for t, v in entry.get("tags", {}).items() if v == version),
                "latest": version == max(int(v) for v in entry["versions"]),
                **entry["versions"][str(version)], "meta": meta}

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
                rows.append({"ref": f"{n}@{v}", "name": n, "version": v, "tags": tags, **entry["versions"][str(v)]})
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
