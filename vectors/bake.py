"""Weight orthogonalisation ("bake"): directional ablation folded into the weights, once for every format.

How it works
------------
Ablating an orthonormal basis ``B`` (``[k, d_model]``, :class:`~steerkit.vectors.DirectionSet`'s
``basis``) from the residual stream everywhere is ``x <- P x`` with ``P = I - B^T B`` at every block
input, attention output and MLP output. The residual stream is the sum of the token embedding and of
what every attention and MLP sub-layer writes, so the same result is reached with no run-time edit by
projecting the weights that write it:

* the **embedding** ``E`` (``[vocab, d_model]``, one residual vector per row): ``E <- E P``;
* every **residual writer** (the attention output projection and the MLP down projection,
  ``[d_model, d_in]``, and its bias ``[d_model]`` if any): ``W <- P W``, ``b <- P b``.

:func:`bake_tensors` is that projection over named tensors (computed in float64, returned in each
tensor's dtype). Its two callers only say which tensors play which role:

* :func:`bake_model` -- a Hugging Face model: the adapter names the embedding
  (``Adapter.embed_module``) and the residual writers (``Adapter.residual_writer``); a tied unembedding
  is untied first so the head keeps its weights. ``steerkit.probes.methods.refusal`` saves the result
  as a loadable folder.
* :func:`steerkit.vectors.gguf_models.orthogonalize_tensors` -- a llama.cpp model GGUF, by tensor name
  (``token_embd.weight``, ``blk.N.attn_output.*``, ``blk.N.ffn_down.*``); a tied head (no
  ``output.weight``) keeps the original embedding.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Mapping

import torch
from jaxtyping import Float
from torch import Tensor, nn

from steerkit.loading.adapters import Adapter, adapter_for
from steerkit.errors import InputError, UnsupportedArchitectureError
from steerkit.interventions import ORTHO_TOL

from .errors import ExportError

__all__ = ["check_basis", "bake_tensors", "bake_model"]


def check_basis(basis: Float[Tensor, "k d_model"] | Float[Tensor, " d_model"], d_model: int | None = None
                ) -> Float[Tensor, "k d_model"]:
    """``basis`` as float64 rows ``[k, d_model]`` (a 1-D tensor is one row) after checking it is orthonormal
    (``|B B^T - I| <= ORTHO_TOL``), finite and ``d_model`` wide.

    Examples:
        >>> from steerkit.vectors.bake import check_basis
        >>> check_basis(torch.tensor([0.0, 1.0, 0.0])).tolist()
        [[0.0, 1.0, 0.0]]
        >>> check_basis(torch.tensor([[2.0, 0.0]]))
        Traceback (most recent call last):
        ...
        steerkit.vectors.errors.ExportError: expected orthonormal directions (|B B^T - I| <= 0.001), found ...
    """
    B = torch.as_tensor(basis).detach().to("cpu", torch.float64)
    if B.dim() == 1:
        B = B[None]
    if B.dim() != 2 or B.shape[0] == 0:
        raise ExportError(f"expected directions of shape [k, d_model] (k >= 1), found {tuple(B.shape)}")
    if d_model is not None and B.shape[1] != d_model:
        raise ExportError(f"expected directions of n_embd={d_model}, found d_model={B.shape[1]}")
    if not bool(torch.isfinite(B).all()):
        raise ExportError("expected finite directions, found NaN or inf")
    err = float((B @ B.T - torch.eye(B.shape[0], dtype=torch.float64)).abs().max())
    if err > ORTHO_TOL:
        raise ExportError(f"expected orthonormal directions (|B B^T - I| <= {ORTHO_TOL}), found an error of "
                          f"{err:.3g}; orthonormalise them first (steerkit.orthonormalize)")
    return B


def _project(t: Tensor, B: Tensor, residual_axis: int) -> Tensor:
    """``t`` with ``span(B)`` projected out of its ``residual_axis`` (0 or -1), in float64."""
    x = t.detach().to(torch.float64)
    if residual_axis == 0 and x.dim() == 2:
        return x - B.T @ (B @ x)
    return x - (x @ B.T) @ B


def bake_tensors(tensors: Mapping[str, Tensor], basis: Float[Tensor, "k d_model"], *,
                 embedding: Iterable[str] = (), writers: Iterable[str] = ()) -> dict[str, Tensor]:
    """The baked tensors: ``{name: tensor}`` for each name in ``embedding`` (rows are residual vectors:
    ``E <- E P``) and in ``writers`` (residual-stream writers ``[d_model, d_in]`` or their biases
    ``[d_model]``: ``W <- P W``), with ``P = I - B^T B`` (``basis``: orthonormal rows, :func:`check_basis`).
    Computed in float64, returned in each tensor's own dtype on its device; the inputs are not modified.

    Examples:
        >>> from steerkit.vectors.bake import bake_tensors
        >>> B = torch.tensor([[1.0, 0.0, 0.0]])  # ablate the first axis
        >>> out = bake_tensors({"embed": torch.ones(2, 3), "o_proj": torch.ones(3, 5), "bias": torch.ones(3)}, B,
        ...                    embedding=["embed"], writers=["o_proj", "bias"])
        >>> out["embed"].tolist(), out["o_proj"][:, 0].tolist(), out["bias"].tolist()
        ([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]], [0.0, 1.0, 1.0], [0.0, 1.0, 1.0])
    """
    B = check_basis(basis)
    d = B.shape[1]
    out: dict[str, Tensor] = {}
    for names, axis in ((embedding, -1), (writers, 0)):
        for name in names:
            if name not in tensors:
                raise ExportError(f"expected a tensor named {name!r} to bake, found only {sorted(tensors)[:8]}")
            t = tensors[name]
            if t.dim() not in (1, 2) or t.shape[axis] != d:
                what = "embedding rows" if axis == -1 else "rows (a residual writer)"
                raise ExportError(f"expected {name} to have n_embd={d} {what}, found shape {tuple(t.shape)}")
            out[name] = _project(t, B.to(t.device), axis).to(t.dtype)
    return out


def _check_bakeable(model: nn.Module, adapter: Adapter) -> None:
    cfg = adapter.text_config(model)
    if getattr(cfg, "position_embedding_type", "rotary") not in ("rotary", None) or adapter.name == "gpt2":
        raise UnsupportedArchitectureError(f"adapter {adapter.name!r}: learned absolute position embeddings "
                                           "also write into the residual stream; not supported")


def _untie_head(model: nn.Module, adapter: Adapter) -> None:
    """Give a tied unembedding its own copy of the weights (and say so in the configs), so baking the
    embedding leaves the head as it was."""
    emb = adapter.embed_module(model)
    try:
        unemb: Any = adapter.unembed_module(model)
    except AttributeError:
        return
    if unemb.weight is emb.weight:
        unemb.weight = nn.Parameter(emb.weight.detach().clone())
        model_cfg: Any = model.config
        for c in {id(model_cfg): model_cfg, id(adapter.text_config(model)): adapter.text_config(model)}.values():
            c.tie_word_embeddings = False


def _weight_and_bias(lin: nn.Module) -> list[tuple[str, Tensor]]:
    return [(k, p) for k in ("weight", "bias") if (p := getattr(lin, k, None)) is not None]


@torch.no_grad()
def bake_model(model: nn.Module, basis: Float[Tensor, "k d_model"], adapter: Adapter | None = None, *,
               inplace: bool = False) -> nn.Module:
    """A Hugging Face model (a copy unless ``inplace``) whose embedding and residual writers
    (``Adapter.residual_writer``: attention output and MLP output projections, with their biases) have
    ``span(basis)`` projected out (:func:`bake_tensors`): the run-time ablation of ``basis`` at every block
    input, attention output and MLP output, with no hook. A tied unembedding is untied and keeps its
    weights. :class:`UnsupportedArchitectureError` for learned absolute position embeddings and where the
    adapter has no plain residual writer (post-sub-layer norms, sparse MoE MLPs).

    Examples:
        >>> from steerkit.vectors.bake import bake_model
        >>> u = torch.nn.functional.normalize(torch.randn(64), dim=0)
        >>> m = bake_model(tiny.hf_model, u)  # a copy: tiny keeps its weights
        >>> float((m.model.embed_tokens.weight.detach() @ u).abs().max()) < 1e-5, m is tiny.hf_model
        (True, False)
    """
    if hasattr(model, "hf_model"):
        raise InputError("expected a Hugging Face model, found a SteerModel; pass sm.hf_model")
    adapter = adapter or adapter_for(model)
    _check_bakeable(model, adapter)
    B = check_basis(basis, adapter.d_model(model))
    m = model if inplace else copy.deepcopy(model)
    _untie_head(m, adapter)
    emb: Tensor = adapter.embed_module(m).weight  # type: ignore[assignment]  # an nn.Embedding's Parameter
    emb.copy_(bake_tensors({"embed": emb}, B, embedding=["embed"])["embed"])
    for layer in range(adapter.n_layers(m)):  # one block at a time: one block's float64 copy at most
        params = {f"{which}.{kind}": p for which in ("attn", "mlp")
                  for kind, p in _weight_and_bias(adapter.residual_writer(m, layer, which))}
        baked = bake_tensors(params, B, writers=list(params))
        for name, p in params.items():
            p.copy_(baked[name])
    return m
