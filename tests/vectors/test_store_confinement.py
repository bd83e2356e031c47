"""The store never touches what is outside its folder, and names/refs follow one rule set.

For every store operation, a symbolic link planted inside the store (at ``tmp``, ``objects/<name>``,
``objects/<name>/<version>``, a file of a version, ``index.json``, ``.lock``) pointing outside must leave
the outside content byte-identical, and the operation either works (ignoring or removing the link
itself) or raises a clean :class:`SteerkitError`; it never returns outside content. Then the
hostile-input regressions: names and refs, malformed indexes, stray index temp files, huge shapes
and numbers, ragged bases, bounded format sniffing, exports into a missing folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
import tracemalloc
from pathlib import Path

import pytest
import torch

from steerkit.errors import SteerkitError
from steerkit.vectors import (
    ArtifactFormatError, DirectionSet, ExportError, Provenance, SteeringVector, Store, StoreError, UnsafeNameError,
    export, import_artifact, parse_ref, save_artifact,
)
from steerkit.vectors.errors import StoreIndexError
from steerkit.vectors.exports import detect_format
from steerkit.vectors.safety import NAME_RE, check_name, parse_safetensors

MARKER = "OUTSIDE-SENTINEL-7f3a"


def vec(seed=0, d=8):
    """A small vector with a fixed creation time, so two calls with one seed are equal artifacts."""
    g = torch.Generator().manual_seed(seed)
    return SteeringVector({2: torch.randn(d, generator=g)},
                          provenance=Provenance(d_model=d, method=f"m{seed}", created_at="2026-01-01T00:00:00+00:00"))


def _sha(b: bytes) -> str:
    return "sha256:" + hashlib.sha256(b).hexdigest()


def _snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every entry below ``folder`` (links are recorded as their own target text, never followed)."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            rel = str(p.relative_to(folder))
            if p.is_symlink():
                out[rel] = b"link:" + os.readlink(p).encode()
            elif p.is_file():
                out[rel] = p.read_bytes()
            else:
                out[rel] = None
    return out


# ============================================================================ links planted in the store
LOCATIONS = ["tmp", "objects/x", "objects/x/1", "objects/x/1/meta.json", "objects/x/1/tensors.safetensors",
             "index.json", ".lock", "objects/ghost"]


def _setup(tmp_path: Path, where: str) -> tuple[Store, Path]:
    """A store with x@1, x@2 (tag prod -> 1) and a link at ``where`` to a folder or file outside,
    filled with content that would pass the store's checks if it were followed."""
    s = Store(tmp_path / "S", lock_timeout=10)
    s.save("x", vec(0), tags=["prod"])
    s.save("x", vec(1))
    root, out = s.root, tmp_path / "outside"
    out.mkdir()
    (out / "sentinel.txt").write_text(MARKER)
    idx = json.loads((root / "index.json").read_text())
    v1 = root / "objects" / "x" / "1"
    target: Path
    if where in ("tmp", "objects/ghost"):
        target = out / "dir"
        target.mkdir()
        (target / "keep.txt").write_text(MARKER)
        (target / "sub").mkdir()
        (target / "sub" / "deep.txt").write_text(MARKER)
    elif where in ("objects/x", "objects/x/1"):
        # an outside copy of the store's own objects with a marked meta.json whose hash the index is
        # made to carry: following the link would read it as valid
        target = out / "dir"
        src = root / "objects" / "x" if where == "objects/x" else v1
        os.system(f"cp -r '{src}' '{target}'")
        meta_dir = target / "1" if where == "objects/x" else target
        meta = json.loads((meta_dir / "meta.json").read_text())
        meta["provenance"]["method"] = MARKER
        mbytes = json.dumps(meta).encode()
        (meta_dir / "meta.json").write_bytes(mbytes)
        idx["artifacts"]["x"]["versions"]["1"]["meta_sha256"] = _sha(mbytes)
        (target / "keep.txt").write_text(MARKER)
    elif where.startswith("objects/x/1/"):
        fname = where.rsplit("/", 1)[1]
        target = out / fname
        if fname == "meta.json":
            meta = json.loads((v1 / fname).read_text())
            meta["provenance"]["method"] = MARKER
            data = json.dumps(meta).encode()
            idx["artifacts"]["x"]["versions"]["1"]["meta_sha256"] = _sha(data)
        else:
            data = (v1 / fname).read_bytes()
        target.write_bytes(data)
    elif where == "index.json":
        target = out / "index.json"
        marked = json.loads(json.dumps(idx))
        marked["artifacts"]["x"]["versions"]["1"]["method"] = MARKER
        target.write_text(json.dumps(marked))
    else:  # .lock
        target = out / "lock.txt"
        target.write_text(MARKER)
    (root / "index.json").write_text(json.dumps(idx))  # the hashes of the planted content, if any
    link = root / where
    if link.is_dir() and not link.is_symlink():
        os.system(f"rm -rf '{link}'")
    elif link.exists() or link.is_symlink():
        link.unlink()
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target, target_is_directory=target.is_dir())
    return s, out


OPERATIONS = {
    "save_new": lambda s: s.save("y", vec(5)),
    "save_same": lambda s: s.save("x", vec(6)),
    "load_1": lambda s: s.load("x@1"),
    "load_2": lambda s: s.load("x@2"),
    "load_tag": lambda s: s.load("x@prod"),
    "show_1": lambda s: s.show("x@1"),
    "show_latest": lambda s: s.show("x"),
    "list": lambda s: s.list(),
    "search": lambda s: s.search("m"),
    "tag": lambda s: s.tag("x@2", "stable"),
    "untag": lambda s: s.untag("x", "prod"),
    "delete_version": lambda s: s.delete("x@1"),
    "delete_all": lambda s: s.delete("x"),
    "resolve": lambda s: s.resolve("x@prod"),
    "names": lambda s: s.names(),
    "contains": lambda s: "x@1" in s,
}


@pytest.mark.parametrize("op", sorted(OPERATIONS))
@pytest.mark.parametrize("where", LOCATIONS)
def test_a_planted_link_never_reaches_outside(tmp_path, where, op):
    s, out = _setup(tmp_path, where)
    before = _snapshot(out)
    try:
        result = OPERATIONS[op](s)
    except SteerkitError as e:
        result = e
        assert MARKER not in str(e)
    else:
        assert MARKER not in repr(result), f"{op} returned content read through the link at {where}"
    assert _snapshot(out) == before, f"{op} changed the content outside the store (link at {where})"
    if where == "index.json":  # the index is never read through a link
        assert result is False if op == "contains" else isinstance(result, StoreError) and "symbolic link" in str(result)
    if where in ("objects/x", "objects/x/1", "objects/x/1/meta.json") and op in ("show_1", "load_1", "load_tag"):
        assert isinstance(result, SteerkitError), f"{op} read version 1 through the link at {where}"
    if where == "objects/x/1/tensors.safetensors" and op in ("load_1", "load_tag"):
        assert isinstance(result, SteerkitError)
    if where in ("tmp", "objects/ghost", ".lock", "objects/x/1") and op.startswith("save"):
        assert isinstance(result, str) and "@" in result  # the clean-up removed the link itself
        if where in ("tmp", "objects/ghost"):
            assert not (s.root / where).is_symlink()
    if op.startswith("save") and not isinstance(result, Exception):
        seed = 5 if op == "save_new" else 6
        assert torch.equal(s.load(result).directions[2], vec(seed).directions[2])


def test_the_clean_up_on_save_removes_links_and_unindexed_folders_only(tmp_path):
    s = Store(tmp_path / "S")
    s.save("x", vec(0))
    out = tmp_path / "outside"
    (out / "d").mkdir(parents=True)
    (out / "d" / "f.txt").write_text(MARKER)
    (out / "file.txt").write_text(MARKER)
    before = _snapshot(out)
    root = s.root
    (root / "tmp").mkdir(exist_ok=True)
    (root / "tmp" / "a-link").symlink_to(out / "d")
    (root / "tmp" / "staged").mkdir()
    (root / "tmp" / "staged" / "inner-link").symlink_to(out / "d")
    (root / "tmp" / "staged" / "file-link").symlink_to(out / "file.txt")
    (root / "objects" / "x" / "7").symlink_to(out / "d")  # unindexed version: a link
    (root / "objects" / "x" / "8").mkdir()  # unindexed version: a real leftover
    (root / "objects" / "x" / "8" / "meta.json").symlink_to(out / "file.txt")
    (root / "objects" / "x" / "1" / "extra-link").symlink_to(out / "d")  # inside an indexed version: left alone
    (root / "objects" / "loose-file").symlink_to(out / "file.txt")
    assert s.save("y", vec(1)) == "y@1"
    assert _snapshot(out) == before
    assert list((root / "tmp").iterdir()) == []
    assert sorted(p.name for p in (root / "objects" / "x").iterdir()) == ["1"]
    assert not (root / "objects" / "loose-file").is_symlink()
    assert s.load("x@1") == vec(0) and s.load("y@1") == vec(1)


def test_objects_folder_as_a_link_is_refused_not_followed(tmp_path):
    s = Store(tmp_path / "S")
    s.save("x", vec(0))
    out = tmp_path / "outside"
    os.rename(s.root / "objects", out)
    (s.root / "objects").symlink_to(out, target_is_directory=True)
    before = _snapshot(out)
    for op in (lambda: s.save("y", vec(1)), lambda: s.load("x"), lambda: s.show("x"), lambda: s.delete("x")):
        with pytest.raises(SteerkitError):
            op()
    assert _snapshot(out) == before
    assert (s.root / "objects").is_symlink()


def test_a_fifo_in_the_store_is_refused_without_blocking(tmp_path):
    s = Store(tmp_path / "S")
    s.save("x", vec(0))
    meta = s.root / "objects" / "x" / "1" / "meta.json"
    meta.unlink()
    os.mkfifo(meta)
    t = time.monotonic()
    with pytest.raises(SteerkitError):
        s.show("x@1")
    with pytest.raises(SteerkitError):
        s.load("x@1")
    assert time.monotonic() - t < 5


def test_show_verifies_the_hash_of_what_it_reads(store):
    store.save("x", vec(0))
    f = store.root / "objects" / "x" / "1" / "meta.json"
    meta = json.loads(f.read_text())
    meta["provenance"]["method"] = "tampered"
    f.write_text(json.dumps(meta))
    with pytest.raises(ArtifactFormatError, match="modified or corrupted"):
        store.show("x@1")


def test_a_missing_object_file_is_a_clean_error(store):
    store.save("x", vec(0))
    (store.root / "objects" / "x" / "1" / "tensors.safetensors").unlink()
    with pytest.raises(ArtifactFormatError, match="found none"):
        store.load("x@1")


# ============================================================================ names and refs
@pytest.mark.parametrize("bad", ["a\n", "a\r", " a", "a b", "ok\x00", "é", "a/b", "..", "a..b", ".x", "-x", ""])
def test_names_follow_the_one_rule_set(store, bad):
    with pytest.raises(UnsafeNameError):
        check_name(bad)
    with pytest.raises(UnsafeNameError):
        store.save(bad, vec(0))
    assert NAME_RE.match(bad) is None or ".." in bad


@pytest.mark.parametrize("ref", ["ok@١", "ok@01", "ok@1\n", "ok@00", "ok@0", "ok@\u0663", "ok@1 ", "ok\n@1",
                                 "ok@99999999999", "ok@prod\n", "ok@a@b", "ok@" + "9" * 5000])
def test_refs_with_odd_versions_are_refused(store, ref):
    store.save("ok", vec(0), tags=["prod"])
    with pytest.raises((UnsafeNameError, StoreError)) as e:
        parse_ref(ref)
    assert "expected" in str(e.value)
    with pytest.raises((UnsafeNameError, StoreError)):
        store.load(ref)
    assert ref not in store


def test_good_refs_still_resolve(store):
    store.save("ok", vec(0), tags=["prod"])
    store.save("ok", vec(1))
    assert parse_ref("ok@1") == ("ok", "1") and parse_ref("ok") == ("ok", "latest")
    assert store.resolve("ok@1") == ("ok", 1) and store.resolve("ok@prod") == ("ok", 1)
    assert store.resolve("ok@latest") == ("ok", 2)
    for t in ("07", "١", "prod\n", "latest"):
        with pytest.raises((UnsafeNameError, StoreError)):
            store.tag("ok@1", t)


# ============================================================================ malformed index
GOOD_VERSION = {"kind": "steering_vector", "tensors_sha256": "sha256:0", "meta_sha256": "sha256:0"}
MALFORMED = {
    "not json": "{not json",
    "a list": "[]",
    "no format": json.dumps({"artifacts": {}}),
    "artifacts a list": json.dumps({"format": "steerkit-store", "artifacts": []}),
    "version a string": json.dumps({"format": "steerkit-store", "version": "1", "artifacts": {}}),
    "entry a number": json.dumps({"format": "steerkit-store", "artifacts": {"x": 3}}),
    "version key not a number": json.dumps({"format": "steerkit-store", "artifacts": {
        "x": {"versions": {"abc": GOOD_VERSION}, "tags": {}, "next_version": 2}}}),
    "version key with a leading zero": json.dumps({"format": "steerkit-store", "artifacts": {
        "x": {"versions": {"01": GOOD_VERSION}, "tags": {}, "next_version": 2}}}),
    "version info a list": json.dumps({"format": "steerkit-store", "artifacts": {
        "x": {"versions": {"1": []}, "tags": {}, "next_version": 2}}}),
    "no hashes": json.dumps({"format": "steerkit-store", "artifacts": {
        "x": {"versions": {"1": {"kind": "steering_vector"}}, "tags": {}, "next_version": 2}}}),
    "tag to a missing version": json.dumps({"format": "steerkit-store", "artifacts": {
        "x": {"versions": {"1": GOOD_VERSION}, "tags": {"prod": 9}, "next_version": 2}}}),
    "tag value a string": json.dumps({"format": "steerkit-store", "artifacts": {
        "x": {"versions": {"1": GOOD_VERSION}, "tags": {"prod": "1"}, "next_version": 2}}}),
    "next_version a float": json.dumps({"format": "steerkit-store", "artifacts": {
        "x": {"versions": {"1": GOOD_VERSION}, "tags": {}, "next_version": 2.5}}}),
    "not UTF-8": b"\xff\xfe{}",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_index_is_a_store_error_saying_how_to_recover(store, case):
    store.root.mkdir(parents=True)
    data = MALFORMED[case]
    store.index_path.write_bytes(data if isinstance(data, bytes) else data.encode())
    for op in (store.list, store.names, lambda: store.show("x@1"), lambda: store.load("x"),
               lambda: store.save("y", vec(0)), lambda: store.search("x"), lambda: store.tag("x@1", "t")):
        with pytest.raises(StoreIndexError) as e:
            op()
        assert isinstance(e.value, StoreError) and "index.json" in str(e.value) and "backup" in str(e.value)


def test_stray_index_temp_files_are_cleaned_up_under_the_lock(store, tmp_path):
    store.save("x", vec(0))
    old = store.root / ".index.json.1234.deadbeef.tmp"
    old.write_bytes(b"half an index")
    os.utime(old, (time.time() - 60, time.time() - 60))
    fresh = store.root / ".index.json.abcdefgh.tmp"
    fresh.write_bytes(b"being written")
    outside = tmp_path / "outside.txt"
    outside.write_text(MARKER)
    link = store.root / ".index.json.link.tmp"
    link.symlink_to(outside)
    store.save("x", vec(1))
    assert not old.exists() and fresh.exists() and not link.is_symlink()
    assert outside.read_text() == MARKER
    store.delete("x@1")
    assert store.list()[0]["ref"] == "x@2"


# ============================================================================ hostile files
def _safetensors(header: dict, body: bytes = b"") -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + body


@pytest.mark.parametrize("shape", [[2**39, 2**39, 0], [0, 2**39, 2**39, 2**39], [2**20, 2**20, 0, 1]])
def test_safetensors_huge_empty_shapes_are_refused_quickly(shape):
    data = _safetensors({"t": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}})
    t = time.monotonic()
    with pytest.raises(ArtifactFormatError, match="2\\^40"):
        parse_safetensors(data)
    assert time.monotonic() - t < 1.0
    ok, _ = parse_safetensors(_safetensors({"t": {"dtype": "F32", "shape": [3, 0], "data_offsets": [0, 0]}}))
    assert ok["t"].shape == (3, 0)


def test_huge_json_numbers_in_vectors_are_refused(tmp_path):
    big = 10**400
    svec = tmp_path / "v.svec"
    svec.write_text(json.dumps({"model_type": "llama", "directions": {"1": [1.0, big]}}))
    with pytest.raises(ArtifactFormatError, match="finite"):
        import_artifact(svec)
    svec.write_text(json.dumps({"model_type": "llama", "directions": {"1": [1.0, 1e39]}}))
    with pytest.raises(ArtifactFormatError, match="range of float32"):
        import_artifact(svec)
    svec.write_text(json.dumps({"model_type": "llama", "directions": {"1": [1.0]}, "steerkit": {"scale": big}}))
    with pytest.raises(ArtifactFormatError, match="scale"):
        import_artifact(svec)
    svec.write_text(json.dumps({"model_type": "llama", "directions": {"١": [1.0]}}))
    with pytest.raises(ArtifactFormatError, match="layer keys"):
        import_artifact(svec)
    svec.write_text(json.dumps({"model_type": "llama", "directions": {"1": [1.0], "2": [1.0, 2.0]}}))
    with pytest.raises(ArtifactFormatError, match="one length"):
        import_artifact(svec)
    tl = tmp_path / "t.json"
    for entry in ({"op": "add", "value": [big, 1.0], "pos": None, "scale": 1.0},
                  {"op": "add", "value": [1.0, 1.0], "pos": None, "scale": big},
                  {"op": "add", "value": [1.0, 1.0], "pos": [big], "scale": 1.0}):
        tl.write_text(json.dumps({"blocks.3.hook_resid_post": entry}))
        with pytest.raises(ArtifactFormatError):
            import_artifact(tl)
    for hook in ("blocks.03.hook_resid_post", "blocks.3.hook_resid_post\n", "blocks.\u0663.hook_resid_post"):
        tl.write_text(json.dumps({hook: {"op": "add", "value": [1.0], "pos": None}}))
        with pytest.raises(ArtifactFormatError, match="blocks.N"):
            import_artifact(tl)


@pytest.mark.parametrize("basis", [[[1.0, 0.0], [1.0]], [[1.0], []], [[]], [[1.0, 2.0], "x"], [[10**400, 1.0]]])
def test_ragged_or_bad_ablation_bases_are_refused(tmp_path, basis):
    f = tmp_path / "ablate.json"
    f.write_text(json.dumps({"blocks.1.hook_resid_post": {"op": "ablate", "value": basis, "pos": None}}))
    with pytest.raises(ArtifactFormatError):
        import_artifact(f)


def test_a_good_ablation_basis_still_imports(tmp_path):
    ds = DirectionSet.from_directions(torch.randn(2, 8), layers=[1])
    f = tmp_path / "ablate.json"
    export(ds, "tlens", f)
    back = import_artifact(f)
    assert torch.equal(back.basis, ds.basis) and back.layers == [1]


def _model_gguf_header(arch: str = "llama") -> bytes:
    key, val = b"general.architecture", arch.encode()
    return (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 8)
            + struct.pack("<Q", len(val)) + val)


def test_format_detection_reads_only_a_bounded_prefix(tmp_path):
    big = tmp_path / "model.gguf"
    with open(big, "wb") as f:
        f.write(_model_gguf_header())
        f.truncate(1 << 30)  # a sparse 1 GiB file
    tracemalloc.start()
    try:
        t = time.monotonic()
        assert detect_format(big) == "gguf"
        _, peak = tracemalloc.get_traced_memory()
        assert peak < 1 << 20, f"format detection allocated {peak} bytes"
        tracemalloc.reset_peak()
        with pytest.raises(ArtifactFormatError, match="model GGUF is not a steering vector"):
            import_artifact(big)
        _, peak = tracemalloc.get_traced_memory()
        assert peak < 8 << 20, f"refusing a model GGUF allocated {peak} bytes"
        assert time.monotonic() - t < 5
    finally:
        tracemalloc.stop()


def test_detection_of_other_kinds_still_works(tmp_path):
    v = vec(0)
    for fmt, name, kind in (("svec", "a.svec", "svec"), ("safetensors", "a.bin", "safetensors"),
                            ("tlens", "a.json", "json"), ("repeng", "a.gguf", "gguf")):
        p = tmp_path / name
        export(v, fmt, p)
        assert detect_format(p) == kind
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    assert detect_format(fifo) == "json"  # by its name; the FIFO is never opened for a blocking read


def test_export_into_a_missing_folder_is_refused(tmp_path):
    missing = tmp_path / "missing_dir"
    for fmt in ("svec", "tlens", "safetensors", "repeng", "easysteer"):
        with pytest.raises(ExportError, match=f"existing folder {missing}"):
            export(vec(0), fmt, missing / "x")
    with pytest.raises(ExportError, match="mkdir"):
        save_artifact(vec(0), missing / "y.safetensors")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ExportError, match="a file"):
        export(vec(0), "svec", tmp_path / "afile" / "x.svec")
    with pytest.raises(ExportError, match="folder"):
        export(vec(0), "svec", tmp_path)
    assert not missing.exists()
