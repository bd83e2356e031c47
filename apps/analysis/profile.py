"""The Profiles page's computation: :func:`divergence_profile` -> :class:`DivergenceProfile`, per layer
the relative divergence and cosine of paired prompts at the last prompt token, and the logit-lens tokens
of their mean difference (:func:`steerkit.probes.lens.vector_lens`)."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np
import torch

from steerkit.errors import InputError
from steerkit.hooks.names import resid_post
from steerkit.probes.lens import vector_lens

from ..data import check_pairs
from .common import tick

if TYPE_CHECKING:
    from steerkit.model import SteerModel


@dataclass
class DivergenceProfile:
    """Per-layer divergence between paired prompts, at the last prompt token.

    ``rel[i, l] = ||h_l(a_i) - h_l(b_i)|| / ||h_l(a_i)||`` and ``cos[i, l] = cos(h_l(a_i), h_l(b_i))``
    (``h_l`` = ``blocks.{l}.hook_resid_post``). ``mean_diff[l]`` is the mean of ``h_l(a) - h_l(b)``
    over pairs; ``lens_top[l]`` / ``lens_bottom[l]`` its logit-lens top and bottom tokens.
    """

    layers: list[int]
    rel: np.ndarray
    cos: np.ndarray
    prompts_a: list[str] = field(default_factory=list)
    prompts_b: list[str] = field(default_factory=list)
    mean_diff: Optional[np.ndarray] = None
    lens_top: list = field(default_factory=list)
    lens_bottom: list = field(default_factory=list)
    model_name: str = ""
    contrast: str = "custom"
    seconds: float = 0.0

    def __post_init__(self):
        self.rel = np.asarray(self.rel, dtype=np.float64)
        self.cos = np.asarray(self.cos, dtype=np.float64)
        if self.rel.ndim != 2 or self.rel.shape != self.cos.shape or self.rel.shape[1] != len(self.layers):
            raise InputError(f"expected rel and cos of shape [n_pairs, {len(self.layers)}], found "
                             f"{self.rel.shape} and {self.cos.shape}")

    @property
    def n_pairs(self) -> int:
        return int(self.rel.shape[0])

    @property
    def rel_mean(self) -> np.ndarray:
        return self.rel.mean(0)

    @property
    def rel_std(self) -> np.ndarray:
        return self.rel.std(0)

    @property
    def cos_mean(self) -> np.ndarray:
        return self.cos.mean(0)

    @property
    def cos_std(self) -> np.ndarray:
        return self.cos.std(0)

    @property
    def peak_index(self) -> int:
        return int(np.argmax(self.rel_mean))

    @property
    def peak_layer(self) -> int:
        """The layer where the mean relative divergence is largest."""
        return int(self.layers[self.peak_index])

    def at_layer(self, layer: int) -> dict:
        """Per-pair values at one layer: ``{"rel": [...], "cos": [...], "a": [...], "b": [...]}``."""
        if layer not in self.layers:
            raise InputError(f"expected a layer in {self.layers[0]}..{self.layers[-1]}, found {layer}")
        j = self.layers.index(layer)
        return {"layer": layer, "rel": self.rel[:, j].tolist(), "cos": self.cos[:, j].tolist(),
                "a": list(self.prompts_a), "b": list(self.prompts_b)}

    def summary(self) -> dict:
        return {"model": self.model_name, "contrast": self.contrast, "n_pairs": self.n_pairs,
                "n_layers": len(self.layers), "peak_layer": self.peak_layer,
                "peak_rel": float(self.rel_mean[self.peak_index]), "seconds": round(self.seconds, 2)}


def divergence_profile(sm: SteerModel, prompts_a: Sequence[str], prompts_b: Sequence[str], *, batch_size: int = 8,
                       layers: Optional[Sequence[int]] = None, lens_k: int = 10, contrast: str = "custom",
                       edit_a: Optional[Callable] = None, progress=None, should_stop=None) -> DivergenceProfile:
    """The divergence profile of paired prompts on ``sm`` (see :class:`DivergenceProfile`).

    ``edit_a``: a context-manager factory applied while recording the A side (for a
    steered-vs-unsteered contrast, A and B are then the same prompts).
    """
    t0 = time.perf_counter()
    a, b = check_pairs(prompts_a, prompts_b)
    layers = list(range(sm.n_layers)) if layers is None else [int(l) for l in layers]
    hooks = resid_post(layers)
    n = len(a)
    batches = [(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]
    total = 2 * len(batches)
    ha, hb = [], []
    done = 0
    tick(progress, should_stop, 0, total)
    for side, prompts, out in (("a", a, ha), ("b", b, hb)):
        for i, j in batches:
            ctx = edit_a() if (side == "a" and edit_a is not None) else contextlib.nullcontext()
            with ctx, sm.record(hooks, positions="last") as cache:
                sm.forward(prompts[i:j], chat=True)
            out.append(cache.stack().float().cpu())  # [L, batch, d]
            done += 1
            tick(progress, should_stop, done, total)
    HA = torch.cat(ha, 1)
    HB = torch.cat(hb, 1)
    diff = HA - HB
    rel = (diff.norm(dim=-1) / HA.norm(dim=-1).clamp_min(1e-12)).T.numpy()  # [n, L]
    cos = torch.nn.functional.cosine_similarity(HA, HB, dim=-1).T.numpy()
    mean_diff = diff.mean(1)  # [L, d]
    lens_top, lens_bottom = [], []
    if lens_k:
        for l in range(len(layers)):
            t, bo = vector_lens(sm, mean_diff[l], lens_k)
            lens_top.append(t)
            lens_bottom.append(bo)
    return DivergenceProfile(layers=layers, rel=rel, cos=cos, prompts_a=a, prompts_b=b,
                             mean_diff=mean_diff.numpy(), lens_top=lens_top, lens_bottom=lens_bottom,
                             model_name=sm.name, contrast=contrast, seconds=time.perf_counter() - t0)


