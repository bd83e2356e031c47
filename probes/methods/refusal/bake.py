"""Weight orthogonalisation of the refusal direction: the model with the direction folded into its weights
(:func:`steerkit.vectors.bake.bake_model`, the one projection of every format) and a loadable Hugging Face folder
of it."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
from jaxtyping import Float
from torch import Tensor, nn

from steerkit.loading.adapters import Adapter, adapter_for
from steerkit.errors import InputError
from steerkit.loading.export_hf import export_hf
from steerkit.vectors.bake import bake_model

from .steering import unit

if TYPE_CHECKING:
    from steerkit.model import SteerModel


def orthogonalize_weights(model: nn.Module, direction: Float[Tensor, " d_model"], adapter: Adapter | None = None, *,
                          inplace: bool = False) -> nn.Module:
    """A model (a copy unless ``inplace``) whose embedding, attention-output and MLP-output weights
    have ``direction`` projected out: ``W <- (I - r r^T) W`` on the output side, so no block ever
    writes along ``r`` -- exactly run-time :func:`ablation` (the saved ``DirectionSet``, which ablates at the
    embedding output and every attention and MLP output). Tied input/output embeddings are untied (the unembedding keeps its weights). The
    projection is :func:`steerkit.vectors.bake.bake_model`, the one the GGUF export uses too.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> r = torch.randn(64)
        >>> m = R.orthogonalize_weights(tiny.hf_model, r)  # a copy: tiny keeps its weights
        >>> float((m.model.embed_tokens.weight.detach() @ (r / r.norm())).abs().max()) < 1e-5, m is tiny.hf_model
        (True, False)
    """
    if hasattr(model, "hf_model"):
        raise InputError("expected a Hugging Face model, found a SteerModel; pass sm.hf_model")
    adapter = adapter or adapter_for(model)
    return bake_model(model, unit(direction, adapter.d_model(model))[None], adapter, inplace=inplace)


def save_orthogonalized(sm: "SteerModel", direction: Float[Tensor, " d_model"], out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Write a loadable Hugging Face folder (weights + tokenizer) with ``direction`` orthogonalised out.

    Written with :func:`steerkit.loading.export_hf.export_hf` (atomic; works for the GGUF-loaded default
    model, which ``save_pretrained`` refuses); ``steerkit_orthogonalized.json`` in the folder
    records the source model and the direction's norm. Load it with ``steerkit.load_model(out_dir)``.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> r = torch.randn(64)
        >>> ortho = steerkit.load_model(R.save_orthogonalized(tiny, r, tmp_dir / "tiny-ortho"))
        >>> with R.ablation(tiny, r):  # the saved weights give the run-time ablation's logits
        ...     ablated = R.last_logits(tiny, ["bake bread"])
        >>> bool(torch.allclose(R.last_logits(ortho, ["bake bread"]), ablated, atol=1e-4))
        True
    """
    m = orthogonalize_weights(sm.hf_model, direction, sm.adapter)
    view = SimpleNamespace(hf_model=m, tokenizer=sm.tokenizer, name=f"{sm.name} (refusal direction orthogonalised)",
                           source_gguf=None, n_layers=sm.n_layers, d_model=sm.d_model)
    note = json.dumps({"method": "refusal direction weight orthogonalisation (Arditi et al. 2024)",
                       "source_model": sm.name, "direction_norm": float(torch.as_tensor(direction).norm())}, indent=1)
    return export_hf(view, out_dir, overwrite=overwrite, extra_files={"steerkit_orthogonalized.json": note})
