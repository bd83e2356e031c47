"""The store: versions, tags, list/show/search/delete, crash safety, concurrency, hostile input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from steerkit.vectors import (
    ArtifactFormatError, DirectionSet, Provenance, SteeringVector, Store, StoreError, UnsafeNameError,
)


def vec(seed=0, d=16, layers=(3,)):
    g = torch.Generator().manual_seed(seed)
    return SteeringVector({l: torch.randn(d, generator=g) for l in layers}, provenance=Provenance(d_model=d, method=f"m{seed}"))


def test_save_load_versions_latest_and_tags(store):
    a, b = vec(0), vec(1)
    assert store.save("happy", a) == "happy@1"
    assert store.save("happy", b, tags=["prod"]) == "happy@2"
    assert store.load("happy@1") == a
    assert store.load("happy@latest") == b == store.load("happy") == store.load("happy@prod")
    store.tag("happy@1", "prod")
    assert store.load("happy@prod") == a
    rows = store.list()
    assert [r["ref"] for r in rows] == ["happy@1", "happy@2"]
    assert rows[0]["tags"] == ["prod"] and rows[1]["tags"] == ["latest"]
    shown = store.show("happy@2")
    assert shown["meta"]["kind"] == "steering_vector" and shown["latest"] and shown["d_model"] == 16


def test_versions_are_immutable_and_never_reused(store):
    store.save("x", vec(0))
    store.save("x", vec(1))
    assert store.delete("x@2") == ["x@2"]
    assert store.save("x", vec(2)) == "x@3"
    with pytest.raises(StoreError, match="version 2"):
        store.load("x@2")
    assert store.delete("x") == ["x@1", "x@3"]
    assert store.list() == [] and "x" not in store
    assert store.save("x", vec(3)) == "x@4"
    assert not (store.root / "objects" / "x" / "1").exists()


def test_search_and_kinds(store):
    store.save("refusal", DirectionSet.from_directions(torch.randn(2, 16)))
    store.save("happy", vec(0), tags=["prod"])
    assert [r["name"] for r in store.search(kind="direction_set")] == ["refusal"]
    assert [r["name"] for r in store.search("m0")] == ["happy"]
    assert [r["name"] for r in store.search(tag="prod")] == ["happy"]
    assert store.search("nothing-like-this") == []
    assert store.names() == ["happy", "refusal"]


def test_default_root_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("STEERKIT_STORE", str(tmp_path / "envstore"))
    assert Store().root == tmp_path / "envstore"
    monkeypatch.delenv("STEERKIT_STORE")
    monkeypatch.chdir(tmp_path)
    assert Store().root == Path("./steerkit-store")


@pytest.mark.parametrize("bad", ["../evil", "a/b", "..", "/abs", "x\\y", "", ".hidden", "a..b", "n\x00", "a" * 200])
def test_names_that_leave_the_store_are_refused(store, bad):
    with pytest.raises(UnsafeNameError):
        store.save(bad, vec(0))
    with pytest.raises(UnsafeNameError):
        store.load(bad + "@1")


def test_reserved_and_bad_tags(store):
    store.save("x", vec(0))
    for t in ("latest", "7", "../t"):
        with pytest.raises((StoreError, UnsafeNameError)):
            store.tag("x@1", t)


def test_store_of_an_earlier_version_reads_project_as_clamp(store):
    """A clamp saved when the operation was called "project" (meta.json and index as that version wrote
    them) loads, lists, shows and searches as "clamp"."""
    import hashlib

    clamp = SteeringVector({3: torch.randn(16)}, operation="clamp", provenance=Provenance(d_model=16))
    store.save("old", clamp)
    meta_path = store.root / "objects" / "old" / "1" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["fields"]["operation"] = meta["provenance"]["operation"] = "project"
    meta_path.write_text(json.dumps(meta))
    idx = json.loads(store.index_path.read_text())
    info = idx["artifacts"]["old"]["versions"]["1"]
    info["meta_sha256"] = "sha256:" + hashlib.sha256(meta_path.read_bytes()).hexdigest()
    info["operation"] = "project"
    store.index_path.write_text(json.dumps(idx))
    assert store.load("old") == clamp
    assert store.list()[0]["operation"] == store.show("old")["operation"] == "clamp"
    assert [r["name"] for r in store.search("clamp")] == ["old"] and store.search(operation="clamp")


def test_files_is_made_once_per_store(store):
    assert store.files is store.files and store.files.given == store.root


def test_tampered_index_and_objects_are_detected(store):
    store.save("x", vec(0))
    idx = json.loads(store.index_path.read_text())
    idx["artifacts"]["../../etc"] = idx["artifacts"]["x"]
    store.index_path.write_text(json.dumps(idx))
    with pytest.raises(UnsafeNameError):
        store.list()
    store.index_path.write_text(json.dumps({**idx, "artifacts": {"x": idx["artifacts"]["x"]}}))
    f = store.root / "objects" / "x" / "1" / "tensors.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(ArtifactFormatError, match="modified or corrupted"):
        store.load("x@1")
    store.index_path.write_text("{not json")
    with pytest.raises(ArtifactFormatError, match="syntax"):
        store.load("x@1")


def test_unknown_refs_give_clear_errors(store):
    with pytest.raises(StoreError, match="steerkit vectors list"):
        store.load("nope")
    store.save("x", vec(0))
    with pytest.raises(StoreError, match=r"versions \[1\]"):
        store.load("x@9")
    with pytest.raises(StoreError, match="tag"):
        store.load("x@nosuchtag")


# ----------------------------------------------------------------------------- crash safety
WRITER = textwrap.dedent(
    """
    import importlib.util, os, sys, time, types
    # import steerkit.vectors without the core package (keeps start-up light: no transformers)
    vdir = os.environ["SK_VECTORS_DIR"]
    sys.modules["steerkit"] = types.ModuleType("steerkit")
    sys.modules["steerkit"].__path__ = []
    spec = importlib.util.spec_from_file_location("steerkit.vectors", os.path.join(vdir, "__init__.py"),
                                                  submodule_search_locations=[vdir])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["steerkit.vectors"] = mod
    spec.loader.exec_module(mod)
    import torch
    from steerkit.vectors import Store, SteeringVector, Provenance
    root, mode, start, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    s = Store(root)
    if mode == "pause":
        # stop for good right before the index is replaced: files of this version are on disk
        real = Store._write_index
        def paused(self, idx):
            print("READY", flush=True)
            time.sleep(600)
        Store._write_index = paused
    for i in range(start, start + count):
        d = 256 if mode != "big" else 1 << 18
        v = SteeringVector({1: torch.full((d,), float(i))}, provenance=Provenance(method=f"w{i}"))
        ref = s.save(sys.argv[5] if len(sys.argv) > 5 else f"a{i}", v)
        print(ref, flush=True)
    """
)


def _writer(tmp_path, *args):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    import steerkit.vectors

    env = {**os.environ, "SK_VECTORS_DIR": str(Path(steerkit.vectors.__file__).parent)}
    return subprocess.Popen([sys.executable, str(script), *map(str, args)], stdout=subprocess.PIPE, text=True, env=env)


def _check_all_readable(s: Store) -> list[str]:
    refs = [r["ref"] for r in s.list()]
    for r in refs:
        v = s.load(r)
        assert isinstance(v, SteeringVector)
        assert float(v.directions[1][0]) == float(v.provenance.method[1:])
    return refs


def _save_in_process(root, start, count):
    s = Store(root)
    for i in range(start, start + count):
        s.save(f"a{i}", SteeringVector({1: torch.full((256,), float(i))}, provenance=Provenance(method=f"w{i}")))


def test_sigkill_before_index_update_leaves_no_half_artifact(tmp_path):
    root = tmp_path / "store"
    _save_in_process(root, 0, 3)
    p = _writer(tmp_path, root, "pause", 10, 1)
    line = p.stdout.readline()
    assert line.strip() == "READY"
    os.kill(p.pid, signal.SIGKILL)
    p.wait(30)
    s = Store(root, lock_timeout=10)
    assert _check_all_readable(s) == ["a0@1", "a1@1", "a2@1"]
    # the killed writer's version is complete on disk but not listed; the next writer sweeps it
    assert any((root / "objects" / "a10").iterdir())
    _save_in_process(root, 20, 1)  # would time out if the dead writer still held the lock
    assert _check_all_readable(s) == ["a0@1", "a1@1", "a2@1", "a20@1"]
    assert not any((root / "objects" / "a10").iterdir())
    assert not any((root / "tmp").iterdir())


def test_sigkill_at_random_moments_never_corrupts(tmp_path):
    import random

    rng = random.Random(1234)
    root = tmp_path / "store"
    seen: list[str] = []
    for round_ in range(3):
        p = _writer(tmp_path, root, "big", 100 * round_, 50)
        acked = [p.stdout.readline().strip() for _ in range(rng.randint(1, 4))]  # wait for some commits
        time.sleep(rng.uniform(0.0, 0.3))  # then kill somewhere inside a later write
        os.kill(p.pid, signal.SIGKILL)
        p.wait(30)
        refs = _check_all_readable(Store(root))
        assert set(seen) | set(acked) <= set(refs)  # nothing acknowledged is ever lost
        seen = refs
    assert len(seen) >= 3


def test_two_processes_fifty_artifacts_each_lose_nothing(tmp_path):
    root = tmp_path / "store"
    procs = [_writer(tmp_path, root, "plain", 1000 * k, 50, "shared") for k in (1, 2)]
    outs = [p.communicate(timeout=300)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    s = Store(root)
    rows = s.list()
    assert len(rows) == 100
    assert sorted(r["version"] for r in rows) == list(range(1, 101))
    assert sorted(outs[0] + outs[1]) == sorted(r["ref"] for r in rows)
    methods = sorted(s.load(r["ref"]).provenance.method for r in rows)
    assert methods == sorted([f"w{i}" for i in range(1000, 1050)] + [f"w{i}" for i in range(2000, 2050)])
