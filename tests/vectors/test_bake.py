"""Weight orthogonalisation ("bake") is one projection: the Hugging Face path (modules named by the adapter) and the
GGUF path (tensors named by llama.cpp) give the same baked weights from the same tensors, bit for bit."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from steerkit.loading.adapters import adapter_for
from steerkit.vectors import DirectionSet, ExportError, write_orthogonalized_gguf
from steerkit.vectors.bake import bake_model, bake_tensors, check_basis
from steerkit.vectors.gguf_models import orthogonalize_tensors
from steerkit.vectors.safety import write_gguf
from tiny_models import tiny_model


def _gguf_tensors(model) -> dict[str, np.ndarray]:
    """The model's embedding and residual writers under their llama.cpp names (float32 copies)."""
    ad = adapter_for(model)
    out = {"token_embd.weight": ad.embed_module(model).weight.detach().float().numpy().copy()}
    for layer in range(ad.n_layers(model)):
        for which, name in (("attn", "attn_output"), ("mlp", "ffn_down")):
            lin = ad.residual_writer(model, layer, which)
            for kind in ("weight", "bias"):
                p = getattr(lin, kind, None)
                if p is not None:
                    out[f"blk.{layer}.{name}.{kind}"] = p.detach().float().numpy().copy()
    return out


@pytest.mark.parametrize("arch,kw", [("llama", {"tie_word_embeddings": True}), ("gpt_neox", {})])
def test_hf_and_gguf_paths_bake_the_same_weights(arch, kw, tmp_path):
    """gpt_neox has biases on its residual writers: both paths project them."""
    model, _ = tiny_model(arch, **kw)
    d = adapter_for(model).d_model(model)
    ds = DirectionSet.from_directions(torch.randn(2, d, generator=torch.Generator().manual_seed(0)))
    before = _gguf_tensors(model)
    assert any(n.endswith(".bias") for n in before) == (arch == "gpt_neox")
    hf = _gguf_tensors(bake_model(model, ds.basis))
    assert np.array_equal(_gguf_tensors(model)["token_embd.weight"], before["token_embd.weight"])  # a copy was baked
    direct = orthogonalize_tensors(before, ds.basis.double().numpy())
    for name, arr in hf.items():
        assert direct[name].dtype == np.float32 and np.array_equal(direct[name], arr), name
        if name != "token_embd.weight" and arr.ndim == 2:
            assert np.abs(ds.basis.double().numpy() @ arr.astype(np.float64)).max() < 1e-5, name
    # the whole GGUF writer (a file in, a file out) bakes the same numbers
    write_gguf(tmp_path / "m.gguf", "llama", {"llama.block_count": 2}, before)
    r = gguf.GGUFReader(str(write_orthogonalized_gguf(tmp_path / "m.gguf", ds, tmp_path / "o.gguf")))
    written = {t.name: np.array(t.data).reshape([int(s) for s in reversed(t.shape.tolist())]) for t in r.tensors}
    for name, arr in hf.items():
        assert np.array_equal(written[name], arr), name
    # a tied head keeps the original embedding in both paths
    assert np.array_equal(written["output.weight"], before["token_embd.weight"])


def test_bake_tensors_projects_rows_of_the_embedding_and_columns_of_the_writers():
    B = check_basis(torch.tensor([[0.6, 0.8, 0.0]]))
    E, W, b = torch.randn(5, 3), torch.randn(3, 7), torch.randn(3)
    out = bake_tensors({"E": E, "W": W, "b": b}, B, embedding=["E"], writers=["W", "b"])
    P = torch.eye(3, dtype=torch.float64) - B.T @ B
    torch.testing.assert_close(out["E"].double(), E.double() @ P, atol=1e-6, rtol=0)
    torch.testing.assert_close(out["W"].double(), P @ W.double(), atol=1e-6, rtol=0)
    torch.testing.assert_close(out["b"].double(), P @ b.double(), atol=1e-6, rtol=0)
    assert out["W"].dtype == W.dtype and set(out) == {"E", "W", "b"}


def test_bake_refuses_bad_bases_and_shapes():
    with pytest.raises(ExportError, match="orthonormal"):
        check_basis(torch.tensor([[1.0, 1.0]]))
    with pytest.raises(ExportError, match="finite"):
        check_basis(torch.tensor([[float("nan"), 0.0]]))
    with pytest.raises(ExportError, match="n_embd=3"):
        check_basis(torch.tensor([[1.0, 0.0]]), 3)
    with pytest.raises(ExportError, match=r"found shape \(2, 7\)"):
        bake_tensors({"W": torch.randn(2, 7)}, torch.tensor([[1.0, 0.0, 0.0]]), writers=["W"])
    with pytest.raises(ExportError, match="named 'X'"):
        bake_tensors({"W": torch.randn(3, 7)}, torch.tensor([[1.0, 0.0, 0.0]]), writers=["X"])
