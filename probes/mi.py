"""MI peaks (Qian et al., NeurIPS 2025, "Demystifying reasoning dynamics with mutual information").

:func:`hsic_mi` is the paper's estimator (MI-Peaks ``estimate_mi_hsic`` / ``hsic_normalized_cca``):
each vector is reshaped to ``[-1, 1]`` (its coordinates are the samples), Gaussian kernel
``exp(-D / (2 sigma^2 * dim))`` on squared distances ``D``, right-centred ``K H``, and
``sum((Kx (Kx + eps m I)^-1) * (Ky (Ky + eps m I)^-1)^T)``, in float32 as the reference code.

:func:`mi_trajectory` generates greedily and, at every step t, estimates the MI between a layer's
output at the newest token and the representation of the reference solution (its last token at
the same layer, as MI-Peaks' ``reps[layer][0]`` of the reference pass); :func:`find_peaks` marks the
steps above ``mean + k * std``. Representation recycling and thinking-token continuation are not
implemented.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch


def _distmat(X: torch.Tensor) -> torch.Tensor:
    r = (X * X).sum(1).view(-1, 1)
    a = X @ X.T
    return (r.expand_as(a) - 2 * a + r.T.expand_as(a)).abs()


def _kernelmat(X: torch.Tensor, sigma: float) -> torch.Tensor:
    m = X.shape[0]
    H = torch.eye(m, dtype=X.dtype) - (1.0 / m) * torch.ones(m, m, dtype=X.dtype)
    Kx = torch.exp(-_distmat(X) / (2.0 * sigma * sigma * X.shape[1]))
    return Kx @ H


def hsic_mi(x, y, sigma: float = 50.0, eps: float = 1e-5, *, dtype=torch.float32) -> float:
    """Normalised HSIC estimate of the MI between ``x`` and ``y`` (vectors of equal length, or
    ``[m, d]`` sample matrices with equal ``m``)."""
    x = torch.as_tensor(x).detach().to("cpu", dtype)
    y = torch.as_tensor(y).detach().to("cpu", dtype)
    if x.dim() == 1:
        x = x.reshape(-1, 1)
    if y.dim() == 1:
        y = y.reshape(-1, 1)
    if x.shape[0] != y.shape[0]:
        from steerkit.errors import InputError
        raise InputError(f"expected x and y with the same number of samples, found {x.shape[0]} and {y.shape[0]}")
    m = x.shape[0]
    Kxc, Kyc = _kernelmat(x, sigma), _kernelmat(y, sigma)
    I = torch.eye(m, dtype=dtype)
    Rx = Kxc @ torch.inverse(Kxc + eps * m * I)
    Ry = Kyc @ torch.inverse(Kyc + eps * m * I)
    return float((Rx * Ry.T).sum())


def find_peaks(values: Sequence[float], k: float = 2.0) -> list[int]:
    """Indices whose value exceeds ``mean + k * std`` (population std)."""
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return []
    thr = v.mean() + k * v.std()
    return [int(i) for i in np.nonzero(v > thr)[0]]


@dataclass
class MITrajectory:
    layer: int
    mi: np.ndarray  # [steps]
    tokens: list[str]
    peaks: list[int]
    text: str = ""
    threshold_k: float = 2.0

    @property
    def peak_tokens(self) -> list[str]:
        return [self.tokens[i] for i in self.peaks]

    def to_dict(self) -> dict:
        return {"layer": self.layer, "mi": [float(x) for x in self.mi], "tokens": self.tokens, "peaks": self.peaks,
                "peak_tokens": self.peak_tokens, "text": self.text, "k": self.threshold_k}

    def plot(self, title: str | None = None):
        """A plotly ``Figure``: MI per step, peaks marked with their tokens."""
        import plotly.graph_objects as go
        fig = go.Figure()
        fig.add_trace(go.Scatter(y=list(self.mi), mode="lines", name="MI", text=self.tokens))
        fig.add_trace(go.Scatter(x=self.peaks, y=[float(self.mi[p]) for p in self.peaks], mode="markers+text",
                                 text=self.peak_tokens, textposition="top center", name="peaks"))
        fig.update_layout(title=title or f"MI per generation step (layer {self.layer})", xaxis_title="step",
                          yaxis_title="MI (HSIC)")
        return fig


def reference_rep(sm, reference: str, layer: int, *, chat: bool = False) -> torch.Tensor:
    """The reference solution's representation: block ``layer``'s output at its last token."""
    name = f"blocks.{layer}.hook_resid_post"
    with sm.record(name, positions="last") as cache:
        sm.forward([reference], chat=chat)
    return cache[name][0].float().cpu()


def mi_trajectory(sm, prompt: str, reference: str, layer: int, *, max_new_tokens: int = 64, chat: bool = True,
                  k: float = 2.0, sigma: float = 50.0, eps: float = 1e-5) -> MITrajectory:
    """Greedy generation from ``prompt``; MI per step between block ``layer``'s output at the newest
    token and the reference representation. Step t's state is the one that produced token t (the
    last prompt token for t = 0, then each generated token)."""
    name = f"blocks.{layer}.hook_resid_post"
    ref = reference_rep(sm, reference, layer)
    with sm.record(name, positions="all") as cache:
        out = sm.generate([prompt], max_new_tokens=max_new_tokens, chat=chat, return_tokens=True)
    acts, pos = cache[name][0], cache.positions(name)[0]
    P = sm.tokenize([prompt], chat=chat).input_ids.shape[1]
    keep = pos >= P - 1
    states = acts[keep].float()
    ids = _new_ids(out)
    text = sm.tokenizer.decode(ids)
    tokens = [sm.tokenizer.decode([t]) for t in ids]
    n = min(len(tokens), states.shape[0])
    mi = np.array([hsic_mi(states[t], ref, sigma=sigma, eps=eps) for t in range(n)])
    return MITrajectory(layer, mi, tokens[:n], find_peaks(mi, k), text, k)


def _new_ids(out) -> list[int]:
    """Generated token ids of row 0 from ``generate(..., return_tokens=True)``."""
    if isinstance(out, tuple) and len(out) == 2:
        out = out[1]
    if isinstance(out, dict):
        out = out.get("tokens", out.get("ids"))
    x = out[0] if isinstance(out, (list, tuple)) else out
    if isinstance(x, torch.Tensor):
        x = x.reshape(-1).tolist()
    return [int(t) for t in x]
