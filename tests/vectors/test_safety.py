"""Loading files from strangers: no pickle, bounded sizes, malformed input -> clear errors (fuzzed)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from steerkit.vectors import (
    ArtifactFormatError, DirectionSet, Provenance, SteeringVector, VectorsError, export, import_artifact, save_artifact,
)
from steerkit.vectors.safety import parse_gguf, parse_safetensors, read_bounded, read_json_bytes

FUZZ = settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _vec():
    g = torch.Generator().manual_seed(0)
    return SteeringVector({1: torch.randn(8, generator=g), 2: torch.randn(8, generator=g)},
                          provenance=Provenance(d_model=8, n_layers=4, model_arch="llama"))


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("samples")
    v = _vec()
    out = {}
    for fmt, name in [("llama.cpp", "v.gguf"), ("tlens", "v.json"), ("svec", "v.svec"), ("safetensors", "v.safetensors")]:
        export(v, fmt, d / name)
        out[fmt] = (d / name).read_bytes()
    return out


def test_no_pickle_anywhere():
    import steerkit.vectors as pkg

    for f in Path(pkg.__file__).parent.rglob("*.py"):
        src = f.read_text()
        for banned in ("import pickle", "torch.load(", "np.load(", "allow_pickle=True", "weights_only=False"):
            assert banned not in src, f"{f.name} uses {banned}"


def test_pickle_file_is_refused_clearly(tmp_path):
    p = tmp_path / "evil.safetensors"
    torch.save({"direction.1": torch.zeros(4)}, p)  # a zip/pickle file
    with pytest.raises(ArtifactFormatError, match="header length|truncated|not safetensors"):
        import_artifact(p)


def test_size_bound_is_checked_before_reading(tmp_path):
    p = tmp_path / "big.safetensors"
    save_artifact(_vec(), p)
    with pytest.raises(ArtifactFormatError, match="at most 100 bytes"):
        import_artifact(p, max_bytes=100)
    with pytest.raises(ArtifactFormatError, match="readable file"):
        read_bounded(tmp_path / "missing")


def test_hostile_counts_do_not_hang_or_allocate():
    # GGUF header claiming 2^63 metadata entries / a 2^60-element array
    hdr = b"GGUF" + struct.pack("<IQQ", 3, 0, 2**63)
    with pytest.raises(ArtifactFormatError, match="metadata keys"):
        parse_gguf(hdr)
    arr = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 4, 2**60)
    with pytest.raises(ArtifactFormatError, match="array of"):
        parse_gguf(arr)
    st_hdr = struct.pack("<Q", 2**62) + b"{}"
    with pytest.raises(ArtifactFormatError, match="header length"):
        parse_safetensors(st_hdr)
    deep = b"[" * 100000 + b"]" * 100000
    with pytest.raises(ArtifactFormatError, match="nested|deep"):
        read_json_bytes(deep)
    with pytest.raises(ArtifactFormatError, match="finite"):
        read_json_bytes(b'{"a": NaN}')


def test_overlapping_or_short_safetensors_offsets_are_refused():
    header = {"direction.1": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
              "direction.2": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    h = json.dumps(header).encode()
    data = struct.pack("<Q", len(h)) + h + b"\0" * 16
    with pytest.raises(ArtifactFormatError, match="contiguous"):
        parse_safetensors(data)
    header = {"direction.1": {"dtype": "F32", "shape": [5], "data_offsets": [0, 16]}}
    h = json.dumps(header).encode()
    with pytest.raises(ArtifactFormatError, match="take 20 bytes"):
        parse_safetensors(struct.pack("<Q", len(h)) + h + b"\0" * 16)


def _st(header: dict, body: bytes = b"") -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + body


def test_safetensors_bounds_the_library_reader_does_not_enforce():
    """What steerkit's reader refuses and safetensors.torch.load accepts: the reason it is kept."""
    from safetensors.torch import load

    cases = [
        (_st({f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(4097)}),
         "at most 4096 tensors"),
        (_st({"a": {"dtype": "F32", "shape": [1] * 9, "data_offsets": [0, 4]}}, bytes(4)), "shape as a list"),
        (_st({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}}, bytes(4)),
         "dtype/shape/data_offsets"),
        (_st({"a": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]}}, bytes(4)), "dtype in"),
    ]
    for data, message in cases:
        load(data)  # the library's reader takes it
        with pytest.raises(ArtifactFormatError, match=message):
            parse_safetensors(data)
    # and the bounds both enforce come with steerkit's message
    with pytest.raises(ArtifactFormatError, match="header length <= "):
        parse_safetensors(struct.pack("<Q", 2**62) + b"{}")
    with pytest.raises(ArtifactFormatError, match="__metadata__ to map strings to strings"):
        parse_safetensors(_st({"__metadata__": {"a": 1}}))


def test_model_gguf_is_not_a_steering_vector(tmp_path):
    from steerkit.vectors.safety import write_gguf

    write_gguf(tmp_path / "m.gguf", "llama", {"llama.block_count": 2}, {"blk.0.attn_norm.weight": np.ones(4, np.float32)})
    with pytest.raises(ArtifactFormatError, match="model GGUF is not a steering vector"):
        import_artifact(tmp_path / "m.gguf")


def _mutate(data: bytes, ops) -> bytes:
    b = bytearray(data)
    for kind, pos, val in ops:
        if not b:
            break
        i = pos % len(b)
        if kind == 0:
            b[i] = val
        elif kind == 1:
            del b[i:]
        elif kind == 2:
            b[i:i] = bytes([val]) * (val % 7 + 1)
        else:
            b[i] ^= 0xFF
    return bytes(b)


mutations = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1 << 30), st.integers(0, 255)), min_size=1, max_size=6)


@pytest.mark.parametrize("fmt,suffix", [("llama.cpp", ".gguf"), ("tlens", ".json"), ("svec", ".svec"), ("safetensors", ".safetensors")])
@FUZZ
@given(ops=mutations)
def test_fuzz_mutated_files_give_clear_errors(samples, tmp_path_factory, fmt, suffix, ops):
    p = tmp_path_factory.mktemp("fuzz") / ("x" + suffix)
    p.write_bytes(_mutate(samples[fmt], ops))
    try:
        a = import_artifact(p)
    except VectorsError as e:
        assert str(e)  # a message, not a crash
    else:
        assert isinstance(a, (SteeringVector, DirectionSet))  # survived mutation: still a valid value
        assert all(torch.isfinite(d).all() for d in getattr(a, "directions", {}).values())


@FUZZ
@given(data=st.binary(max_size=512))
def test_fuzz_random_bytes_in_every_parser(data):
    for parse in (parse_gguf, parse_safetensors, read_json_bytes):
        try:
            parse(data)
        except ArtifactFormatError as e:
            assert str(e)


@FUZZ
@given(payload=st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
                            lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=20))
def test_fuzz_structured_json_importers(tmp_path_factory, payload):
    p = tmp_path_factory.mktemp("json") / "x.json"
    for doc in (payload, {"directions": payload, "model_type": "llama"}, {"blocks.1.hook_resid_post": payload},
                {"steer_vector_local_path": payload}):
        p.write_text(json.dumps(doc))
        try:
            import_artifact(p)
        except VectorsError as e:
            assert str(e)


def test_atomic_folder_publishes_whole_folders_only(tmp_path):
    from steerkit.vectors.safety import atomic_folder
    dst = tmp_path / "out"
    with atomic_folder(dst) as t:
        (t / "a").write_text("1")
    assert (dst / "a").read_text() == "1" and oct(dst.stat().st_mode & 0o777) != oct(0o700)
    with pytest.raises(RuntimeError):  # a failure leaves the published folder as it was, and no temp
        with atomic_folder(dst, if_exists="replace") as t:
            (t / "a").write_text("2")
            raise RuntimeError("boom")
    assert (dst / "a").read_text() == "1"
    with atomic_folder(dst, if_exists="keep") as t:
        (t / "a").write_text("3")
    assert (dst / "a").read_text() == "1"
    with atomic_folder(dst, if_exists="replace") as t:
        (t / "b").write_text("4")
    assert not (dst / "a").exists() and (dst / "b").read_text() == "4"
    with pytest.raises(FileExistsError):
        with atomic_folder(dst) as t:
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _resident_bytes() -> int:
    """This process's resident memory (Linux: /proc/self/statm)."""
    import resource
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident memory from /proc (Linux)")
def test_a_mapped_tensor_gives_its_pages_back_through_any_view(tmp_path):
    """map_safetensors' tensors, and every view made of them later (a row, a slice, a detached or same-dtype
    copy-free conversion), give their pages back; a copy and an ordinary tensor do nothing."""
    from safetensors.torch import save_file

    from steerkit.vectors.safety import map_safetensors, release_pages

    n = 64 * 2**20 // 4  # 64 MiB of float32
    save_file({"W": torch.arange(n, dtype=torch.float32).reshape(-1, 1024)}, str(tmp_path / "w.safetensors"))
    W = map_safetensors(tmp_path / "w.safetensors")["W"]
    views = [W, W[3], W[100:200, ::2], W.detach().to(torch.float32), W.reshape(-1, 2048)]
    for v in views:
        assert release_pages(v), v.shape
    assert not release_pages(W[3].clone()) and not release_pages(torch.ones(3)) and not release_pages(W[:0])
    before = _resident_bytes()
    total = float(W.sum())  # reads every page
    read = _resident_bytes()
    assert read - before > 48 * 2**20, "expected reading the map to take its pages"
    assert release_pages(W.detach()[10:])  # the pages of rows 10.. go back
    assert read - _resident_bytes() > 48 * 2**20, "expected the pages given back"
    assert float(W.sum()) == total and W[5, 7] == 5 * 1024 + 7  # read from the file again
    W[0, 0] = -1.0  # a written page stays (copy on write: it has no file to come back from)
    release_pages(W)
    assert float(W[0, 0]) == -1.0
