"""The Diagnostics page's computation: :func:`layer_diagnostics` -> :class:`LayerDiagnostics`, the
residual norm and the sink attention of every layer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import torch

from steerkit.errors import InputError
from steerkit.hooks.names import resid_post

from ..data import MAX_DIAG_PROMPTS
from .common import tick

if TYPE_CHECKING:
    from steerkit.model import SteerModel


@dataclass
class LayerDiagnostics:
    """Residual norm (mean over positions >= 1, and at position 0) and sink attention per layer.

    ``sink[l]`` is the attention mass on position 0, averaged over heads, query positions >= 1 and
    prompts; ``sink_heads[l, h]`` the same per head.
    """

    layers: list[int]
    resid_norm: np.ndarray
    resid_norm_pos0: np.ndarray
    sink: Optional[np.ndarray] = None
    sink_heads: Optional[np.ndarray] = None
    model_name: str = ""
    n_prompts: int = 0
    note: str = ""


def layer_diagnostics(sm: SteerModel, prompts: Sequence[str], *, progress=None,
                      should_stop=None) -> LayerDiagnostics:
    """Residual norms and sink attention of every layer over ``prompts`` (at most 64)."""
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise InputError("expected at least one prompt, found none")
    if len(prompts) > MAX_DIAG_PROMPTS:
        raise InputError(f"expected at most {MAX_DIAG_PROMPTS} prompts for diagnostics, found {len(prompts)}")
    L = sm.n_layers
    hooks = resid_post(range(L))
    norms, norms0, sink_heads = [], [], []
    total = 2 * len(prompts)
    note = ""
    tick(progress, should_stop, 0, total)
    for i, p in enumerate(prompts):
        with sm.record(hooks, positions="all") as cache:
            sm.forward([p], chat=True)
        h = cache.stack()[:, 0].float()  # [L, pos, d]
        n = h.norm(dim=-1)
        norms0.append(n[:, 0])
        norms.append(n[:, 1:].mean(1) if n.shape[1] > 1 else n[:, 0])
        tick(progress, should_stop, 2 * i + 1, total)
        att = _attentions(sm, p)
        if att is None:
            note = "sink attention unavailable: this model does not return attention weights"
        else:
            a0 = torch.stack([a[0, :, 1:, 0].float().mean(-1) if a.shape[-2] > 1 else a[0, :, :, 0].float().mean(-1)
                              for a in att])  # [L, H]
            sink_heads.append(a0)
        tick(progress, should_stop, 2 * i + 2, total)
    res = LayerDiagnostics(layers=list(range(L)), resid_norm=torch.stack(norms).mean(0).numpy(),
                           resid_norm_pos0=torch.stack(norms0).mean(0).numpy(), model_name=sm.name,
                           n_prompts=len(prompts), note=note)
    if sink_heads:
        sh = torch.stack(sink_heads).mean(0).numpy()
        res.sink_heads = sh
        res.sink = sh.mean(1)
    return res


def _attentions(sm: SteerModel, prompt):
    """Attention weights of every layer for one prompt (eager attention, switched back afterwards)."""
    hf = sm.hf_model
    toks = sm.tokenize([prompt], chat=True)
    cfg = getattr(hf, "config", None)
    before = getattr(cfg, "_attn_implementation", None)
    switched = False
    try:
        if before not in (None, "eager") and hasattr(hf, "set_attn_implementation"):
            hf.set_attn_implementation("eager")
            switched = True
        with torch.inference_mode():
            out = hf(input_ids=toks.input_ids, attention_mask=toks.attention_mask, output_attentions=True,
                     use_cache=False)
        att = getattr(out, "attentions", None)
        if not att or any(a is None for a in att):
            return None
        return att
    finally:
        if switched:
            hf.set_attn_implementation(before)



