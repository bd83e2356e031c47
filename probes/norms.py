"""Residual norm growth per layer (the norm part of Eldenk et al.'s diagnostic).

:func:`norm_profile` records the output of every block (``blocks.{l}.hook_resid_post``) at every real
prompt token and returns a :class:`NormProfile`: per layer the mean and std of ``||h||`` over tokens,
the same without the first token (the attention sink, whose norm is often an outlier), and the
growth ratio between consecutive layers. Attention-mass drift during generation and the
re-applied-blocks chain are not implemented here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from steerkit.errors import InputError


@dataclass
class NormProfile:
    mean: np.ndarray  # [n_layers] mean ||h_l|| over all real prompt tokens
    std: np.ndarray  # [n_layers] its spread
    mean_no_first: np.ndarray  # [n_layers] without each prompt's first token
    first: np.ndarray  # [n_layers] mean norm at the first token
    n_tokens: int
    model_name: str = ""

    @property
    def n_layers(self) -> int:
        return int(len(self.mean))

    @property
    def spread(self) -> np.ndarray:
        return self.std

    @property
    def growth(self) -> np.ndarray:
        """``mean[l] / mean[l-1]`` for l >= 1 (length n_layers - 1)."""
        return self.mean[1:] / np.maximum(self.mean[:-1], 1e-12)

    def to_dict(self) -> dict:
        f = lambda a: [float(x) for x in a]
        return {"model": self.model_name, "n_tokens": self.n_tokens, "mean": f(self.mean), "std": f(self.std),
                "mean_no_first": f(self.mean_no_first), "first": f(self.first), "growth": f(self.growth)}

    def plot(self, title: str | None = None):
        """A plotly ``Figure`` of the per-layer norms (log scale)."""
        import plotly.graph_objects as go
        x = list(range(self.n_layers))
        fig = go.Figure()
        fig.add_trace(go.Scatter(x=x, y=list(self.mean), mode="lines+markers", name="all tokens",
                                 error_y=dict(type="data", array=list(self.std))))
        fig.add_trace(go.Scatter(x=x, y=list(self.mean_no_first), mode="lines", name="without first token"))
        fig.add_trace(go.Scatter(x=x, y=list(self.first), mode="lines", line_dash="dot", name="first token"))
        fig.update_layout(title=title or f"residual norm per layer ({self.n_tokens} tokens)", xaxis_title="layer",
                          yaxis_title="||h||", yaxis_type="log")
        return fig


def norm_profile(sm, prompts: Sequence[str], *, batch_size: int = 16, chat: bool = True) -> NormProfile:
    """Per-layer residual norms of ``prompts`` on ``sm``."""
    from steerkit.hooknames import resid_post
    if isinstance(prompts, str):
        prompts = [prompts]
    if not prompts:
        raise InputError("expected at least one prompt, found none")
    names = resid_post(range(sm.n_layers))
    alls, firsts, rests = [[] for _ in names], [[] for _ in names], [[] for _ in names]
    for i in range(0, len(prompts), batch_size):
        with sm.record(names, positions="prompt") as cache:
            sm.forward(list(prompts[i:i + batch_size]), chat=chat)
        for j, n in enumerate(names):
            x, lens = cache[n].float(), cache.lengths(n)
            norms = x.norm(dim=-1)
            for r in range(x.shape[0]):
                v = norms[r, : int(lens[r])]
                alls[j].append(v)
                firsts[j].append(v[:1])
                rests[j].append(v[1:])
    cat = lambda ls: torch.cat(ls) if ls else torch.zeros(0)
    A = [cat(a) for a in alls]
    R = [cat(a) for a in rests]
    F = [cat(a) for a in firsts]
    mean_of = lambda t: float(t.mean()) if t.numel() else float("nan")
    return NormProfile(mean=np.array([mean_of(a) for a in A]),
                       std=np.array([float(a.std()) if a.numel() > 1 else 0.0 for a in A]),
                       mean_no_first=np.array([mean_of(a) for a in R]), first=np.array([mean_of(a) for a in F]),
                       n_tokens=int(A[0].numel()), model_name=getattr(sm, "name", ""))
