"""The Patching page's computations: :func:`patching_run` -> :class:`PatchingRun` (activation and / or
attribution patching of a clean into a corrupted prompt as a layer x position or layer x head grid) and
:func:`head_detail` -> :class:`HeadDetail` (one head patched at each position)."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from steerkit.errors import InputError
from steerkit.probes import PatchingResult, activation_patching, attribution_patching, logit_diff_metric

from ..data import (
    IOI_ANSWER, IOI_WRONG, MAX_PATCH_SITES, MAX_PATCH_TOKENS, PATCH_HOOKS, PATCH_METHODS, check_choice, check_int,
    parse_layers,
)
from .common import answer_token, one_prompt, tick

if TYPE_CHECKING:
    from steerkit.model import SteerModel


@dataclass
class PatchingRun:
    """The Patching page's result: a clean and a corrupted prompt, the logit difference ``answer -
    wrong`` at the last position as the metric, and the grid of ``hook`` patched one site at a time
    (``activation``, :func:`steerkit.probes.activation_patching`) and / or its gradient
    approximation (``attribution``, :func:`steerkit.probes.attribution_patching`), each a
    :class:`steerkit.probes.PatchingResult`. ``stopped_at_deadline``: the activation grid holds
    only the layers computed within the time limit (``layers_requested`` were asked for)."""

    clean: str
    corrupted: str
    answer: str
    wrong: str
    hook: str
    tokens: list[str]
    corrupted_tokens: list[str]
    layers_requested: list[int]
    activation: Optional[PatchingResult] = None
    attribution: Optional[PatchingResult] = None
    model_name: str = ""
    seconds: float = 0.0
    stopped_at_deadline: bool = False

    @property
    def results(self) -> dict[str, PatchingResult]:
        """The grids computed, by method (``activation`` first)."""
        return {m: r for m, r in (("activation", self.activation), ("attribution", self.attribution))
                if r is not None}

    @property
    def first(self) -> PatchingResult:
        return next(iter(self.results.values()))

    @property
    def clean_metric(self) -> float:
        return float(self.first.clean_metric)

    @property
    def corrupted_metric(self) -> float:
        return float(self.first.corrupted_metric)

    @property
    def by_head(self) -> bool:
        """The grid is layers x heads (``hook="z"``), else layers x positions."""
        return self.hook == "z"

    @property
    def can_normalize(self) -> bool:
        """The clean and corrupted metrics differ, so values can be shown as the restored fraction."""
        return abs(self.clean_metric - self.corrupted_metric) > 1e-6

    def columns(self) -> list[int]:
        """The grid's column indices: heads for ``z``, else positions."""
        r = self.first
        return list(r.heads or []) if self.by_head else list(r.positions)

    def grid(self, method: str, normalized: bool = False) -> np.ndarray:
        """One method's grid ``[layers, columns]`` in the units both methods share: the metric
        (attribution: the corrupted run's metric plus the predicted change), or with ``normalized``
        the fraction of the clean-vs-corrupted gap restored (1: as clean, 0: as corrupted)."""
        return _shown(self.results[method], normalized)

    def layer_values(self, layer: int, normalized: bool = False) -> dict[str, np.ndarray]:
        """Each grid's row at ``layer`` (a layer some grid holds), by method (units of :meth:`grid`)."""
        out = {}
        for m, r in self.results.items():
            if layer in r.layers:
                out[m] = self.grid(m, normalized)[r.layers.index(layer)]
        if not out:
            raise InputError(f"expected a layer of the grid ({self.layers_requested[0]}..{self.layers_requested[-1]}), "
                             f"found {layer}")
        return out


def _shown(r: PatchingResult, normalized: bool) -> np.ndarray:
    """A result's values as shown: normalised, or the metric (attribution: corrupted + change)."""
    if normalized:
        return r.normalized().values.double().numpy()
    v = r.values.double().numpy()
    return v + float(r.corrupted_metric) if r.method == "attribution" and not r.is_normalized else v


def _stack_results(parts: list[PatchingResult]) -> PatchingResult:
    """Activation-patching grids of consecutive layer chunks as one grid."""
    first = parts[0]
    return dataclasses.replace(first, values=torch.cat([p.values for p in parts], 0),
                               layers=[l for p in parts for l in p.layers])


def patching_run(sm: SteerModel, clean: str, corrupted: str, answer: str = IOI_ANSWER, wrong: str = IOI_WRONG,
                 hook: str = "resid_pre", *, layers=None, method: str = "activation", batch_size: int = 32,
                 progress=None, should_stop=None, deadline: Optional[float] = None) -> PatchingRun:
    """Patch ``clean`` into ``corrupted`` (prompts of equal token length) at every site of ``hook``
    (``PATCH_HOOKS``: ``resid_pre`` / ``attn_out`` / ``mlp_out`` per layer and position, ``z`` per layer
    and head) with the metric ``logits[answer] - logits[wrong]`` at the last position.

    ``layers``: a selection for :func:`~steerkit.apps.data.parse_layers` (``None``: all). ``method``:
    ``PATCH_METHODS``. Activation patching runs a few layers per call of
    :func:`steerkit.probes.activation_patching` (about ``batch_size`` patched rows per forward pass),
    so ``progress(done, total)`` advances and ``should_stop()`` cancels between them; past
    ``deadline`` seconds it stops with the layers it has (``stopped_at_deadline``).
    """
    t0 = time.perf_counter()
    end = None if deadline is None else time.monotonic() + float(deadline)
    hook = check_choice(hook, "a hook grid", PATCH_HOOKS)
    method = check_choice(method, "a method", PATCH_METHODS)
    ct, tokens = one_prompt(sm, clean, "the clean prompt", MAX_PATCH_TOKENS)
    kt, ktokens = one_prompt(sm, corrupted, "the corrupted prompt", MAX_PATCH_TOKENS)
    if len(tokens) != len(ktokens):
        raise InputError(f"expected the clean and corrupted prompts to have the same number of tokens (patching maps "
                         f"each position to the same position), found {len(tokens)} and {len(ktokens)}: "
                         f"{tokens!r} vs {ktokens!r}; change the corruption so that every token count stays (e.g. "
                         "swap one-token names)")
    answer, wrong = answer_token(answer, "the answer"), answer_token(wrong, "the wrong answer")
    metric = logit_diff_metric(sm, answer, wrong)
    ls = list(range(sm.n_layers)) if layers is None else parse_layers(layers, sm.n_layers)
    n_cols = int(sm.facts.n_heads) if hook == "z" else len(tokens)
    if len(ls) * n_cols > MAX_PATCH_SITES:
        raise InputError(f"expected a grid of at most {MAX_PATCH_SITES} cells, found {len(ls)} layers x {n_cols} "
                         f"{'heads' if hook == 'z' else 'positions'} = {len(ls) * n_cols}; choose fewer layers or a "
                         "shorter prompt")
    per_call = max(1, batch_size // n_cols)
    chunks = [ls[i:i + per_call] for i in range(0, len(ls), per_call)] if method != "attribution" else []
    total = len(chunks) + (method != "activation")
    done = 0
    tick(progress, should_stop, 0, total)
    attribution = None
    if method != "activation":
        attribution = attribution_patching(sm, ct, kt, metric, hook, layers=ls, progress=False)
        done += 1
        tick(progress, should_stop, done, total)
    parts: list[PatchingResult] = []
    stopped = False
    for chunk in chunks:
        if parts and end is not None and time.monotonic() > end:
            stopped = True
            break
        parts.append(activation_patching(sm, ct, kt, metric, hook, layers=chunk, batch_size=batch_size,
                                         progress=False))
        done += 1
        tick(progress, should_stop, done, total)
    return PatchingRun(clean=clean, corrupted=corrupted, answer=answer, wrong=wrong, hook=hook, tokens=tokens,
                       corrupted_tokens=ktokens, layers_requested=ls,
                       activation=_stack_results(parts) if parts else None, attribution=attribution,
                       model_name=sm.name, seconds=time.perf_counter() - t0, stopped_at_deadline=stopped)


@dataclass
class HeadDetail:
    """One head of a ``z`` grid patched at each position separately (``hook="z_pos"``), by method:
    ``results[m].values`` is ``[1, n_pos, 1]``."""

    layer: int
    head: int
    tokens: list[str]
    results: dict[str, PatchingResult]

    def values(self, normalized: bool = False) -> dict[str, np.ndarray]:
        """Each method's values over positions (units of :meth:`PatchingRun.grid`)."""
        return {m: _shown(r, normalized).reshape(-1) for m, r in self.results.items()}


def head_detail(sm: SteerModel, run: PatchingRun, layer: int, head: int) -> HeadDetail:
    """Head ``head`` of layer ``layer`` (a cell of ``run``'s ``z`` grid) patched from the clean run at
    each position on its own, with the run's prompts, metric and methods."""
    if not run.by_head:
        raise InputError(f"expected a run of the z (heads) grid, found one of {run.hook}")
    n_heads = int(sm.facts.n_heads)
    layer = check_int(layer, "a layer", 0, sm.n_layers - 1)
    head = check_int(head, "a head", 0, n_heads - 1)
    if layer not in run.layers_requested:
        raise InputError(f"expected a layer of the grid {run.layers_requested}, found {layer}")
    metric = logit_diff_metric(sm, run.answer, run.wrong)
    ct, _ = one_prompt(sm, run.clean, "the clean prompt", MAX_PATCH_TOKENS)
    kt, _ = one_prompt(sm, run.corrupted, "the corrupted prompt", MAX_PATCH_TOKENS)
    out = {}
    for m in run.results:
        fn = activation_patching if m == "activation" else attribution_patching
        out[m] = fn(sm, ct, kt, metric, "z_pos", layers=[layer], heads=[head], progress=False)
    return HeadDetail(layer=layer, head=head, tokens=list(run.tokens), results=out)


