"""Model GGUF rewriting: metadata copied, de-quantisation exact, orthogonalisation correct (synthetic file)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from steerkit.vectors import DirectionSet, ExportError, write_dequantized_gguf, write_orthogonalized_gguf

D, V, FF = 32, 50, 48


@pytest.fixture()
def model_gguf(tmp_path):
    rng = np.random.default_rng(0)
    p = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_uint32("llama.embedding_length", D)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(V)])
    w.add_array("tokenizer.ggml.token_type", list(range(V)))
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_uint32("general.file_type", 2)
    t = {
        "token_embd.weight": rng.standard_normal((V, D)).astype(np.float32),
        "blk.0.attn_norm.weight": rng.standard_normal(D).astype(np.float32),
        "blk.0.attn_output.weight": rng.standard_normal((D, D)).astype(np.float32),
        "blk.0.attn_q.weight": rng.standard_normal((D, D)).astype(np.float32),
        "blk.0.ffn_down.weight": rng.standard_normal((D, FF)).astype(np.float32),
        "blk.0.ffn_up.weight": rng.standard_normal((FF, D)).astype(np.float32),
    }
    q = gguf.quants.quantize(t["blk.0.ffn_up.weight"], gguf.GGMLQuantizationType.Q8_0)
    for name, arr in t.items():
        if name == "blk.0.ffn_up.weight":
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t["blk.0.ffn_up.weight"] = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
    return p, t


def _read(p):
    r = gguf.GGUFReader(str(p))
    tensors = {x.name: np.array(x.data).reshape([int(s) for s in reversed(x.shape.tolist())]) for x in r.tensors}
    return r, tensors


def test_dequantized_copy_keeps_metadata_and_values(model_gguf, tmp_path):
    src, ref = model_gguf
    r, t = _read(write_dequantized_gguf(src, tmp_path / "f32.gguf"))
    assert r.get_field("general.architecture").contents() == "llama"
    assert r.get_field("tokenizer.ggml.tokens").contents() == [f"t{i}" for i in range(V)]
    assert r.get_field("tokenizer.ggml.token_type").contents() == list(range(V))
    assert r.get_field("general.file_type").contents() == 0
    assert r.get_field("tokenizer.ggml.add_bos_token").contents() is False
    for name, arr in ref.items():
        assert t[name].dtype == np.float32 and np.array_equal(t[name], arr), name
    assert "output.weight" not in t


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_orthogonalized_copy(model_gguf, tmp_path, dtype):
    src, ref = model_gguf
    ds = DirectionSet.from_directions(torch.randn(2, D, dtype=torch.float64))
    r, t = _read(write_orthogonalized_gguf(src, ds, tmp_path / "o.gguf", dtype=dtype))
    B = ds.basis.numpy()
    tol = 1e-5 if dtype == "f32" else 5e-2
    assert np.abs(t["token_embd.weight"].astype(np.float64) @ B.T).max() < tol
    assert np.abs(B @ t["blk.0.attn_output.weight"].astype(np.float64)).max() < tol
    assert np.abs(B @ t["blk.0.ffn_down.weight"].astype(np.float64)).max() < tol
    # nothing else changes; the tied head keeps the original embedding
    assert np.allclose(t["output.weight"], ref["token_embd.weight"], atol=tol * 10)
    assert np.array_equal(t["blk.0.attn_norm.weight"], ref["blk.0.attn_norm.weight"])
    assert np.allclose(t["blk.0.attn_q.weight"], ref["blk.0.attn_q.weight"], atol=tol * 10)
    P = np.eye(D) - B.T @ B
    assert np.allclose(t["blk.0.attn_output.weight"], P @ ref["blk.0.attn_output.weight"], atol=tol * 10)
    want = gguf.GGMLQuantizationType.F16 if dtype == "f16" else gguf.GGMLQuantizationType.F32
    types = {x.name: x.tensor_type for x in r.tensors}
    assert types["blk.0.attn_output.weight"] == want and types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32


def test_orthogonalize_refuses_partial_ablation(model_gguf, tmp_path):
    src, _ = model_gguf
    with pytest.raises(ExportError, match="everywhere"):
        write_orthogonalized_gguf(src, DirectionSet.from_directions(torch.randn(1, D), layers=[0]), tmp_path / "x.gguf")
    with pytest.raises(ExportError, match="n_embd=32"):
        write_orthogonalized_gguf(src, DirectionSet.from_directions(torch.randn(1, 16)), tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists() and not list(tmp_path.glob(".x.gguf*"))
