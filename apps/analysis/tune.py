"""The Tune page's computation: :func:`tune_run` -> :class:`TuneRun`, :func:`steerkit.probes.tune.tune`
over a layers x scales grid one layer per call (progress, cancel and the time limit between layers),
merged into one tune result by :func:`merge_tunes`."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence

from steerkit.errors import InputError
from steerkit.probes.tune import Rule, pareto_front, recommend
from steerkit.probes.tune import tune as probes_tune

from .common import read_chunks

if TYPE_CHECKING:
    from steerkit.model import SteerModel


@dataclass
class TuneRun:
    """The Tune page's result: a tune result document (``result``, the JSON of
    :meth:`steerkit.probes.tune.TuneResult.to_json`) with where it came from (``source``: ``"computed"``
    or the saved file's name), the layers asked for and whether the time limit cut the grid short
    (``stopped_at_deadline``: ``result`` holds the layers finished by then).

    Examples:
        >>> from steerkit.apps.analysis import TuneRun
        >>> from steerkit.probes.tune import TuneResult
        >>> run = TuneRun(TuneResult.example().to_json(), source="example")
        >>> run.n_cells, run.recommended
        (6, {'layer': 5, 'scale': 2.0})
    """

    result: dict
    source: str = "computed"
    layers_requested: list = field(default_factory=list)
    stopped_at_deadline: bool = False
    seconds: float = 0.0

    @property
    def n_cells(self) -> int:
        return len(self.result["cells"])

    @property
    def recommended(self) -> Optional[dict]:
        return self.result.get("recommended")


def merge_tunes(parts: Sequence[dict]) -> dict:
    """Tune results of the same prompts, scales, concept and settings on different layers (one
    :func:`steerkit.probes.tune.tune` call each, as :meth:`TuneResult.to_json`) as one result over
    every layer: their cells in order, the Pareto front and the recommended cell found again over all
    of them (:func:`steerkit.probes.tune.pareto_front`, :func:`steerkit.probes.tune.recommend` with the
    first part's rule); the baseline is the first part's (greedy generation: the same in each).

    Examples:
        >>> from steerkit.apps.analysis import merge_tunes
        >>> from steerkit.probes.tune import TuneResult
        >>> doc = TuneResult.example().to_json()
        >>> one = lambda l: {**doc, "layers": [l], "cells": [c for c in doc["cells"] if c["layer"] == l]}
        >>> merged = merge_tunes([one(5), one(10)])
        >>> merged["layers"], merged["recommended"] == doc["recommended"]
        ([5, 10], True)
    """
    if not parts:
        raise InputError("expected at least one tune result to merge, found none")
    first = parts[0]
    cells = [dict(c) for p in parts for c in p["cells"]]
    for c, on_front in zip(cells, pareto_front(cells)):
        c["pareto"] = on_front
    layers = [l for p in parts for l in p["layers"]]
    return {**first, "layers": layers, "cells": cells, "recommended": recommend(cells, Rule.of(first.get("rule")))}


def tune_run(sm: SteerModel, artifact: Any, prompts: Sequence[str], *, layers: Sequence[int],
             scales: Sequence[float], concept: Any, neutral: Optional[Sequence[str]] = None,
             max_new_tokens: int = 16, normalize: Optional[str] = None, progress=None, should_stop=None,
             deadline: Optional[float] = None, **tune_kw) -> TuneRun:
    """:func:`steerkit.probes.tune.tune` of ``artifact`` on ``prompts`` over ``layers`` x ``scales``, one
    layer per call so that ``progress(done, total)`` advances and ``should_stop()`` cancels between
    layers, merged by :func:`merge_tunes`; past ``deadline`` seconds it stops with the layers it has
    (``stopped_at_deadline``). ``tune_kw`` goes to every call (``rule``, ``n_boot``, ``chat``, ...).

    Examples:
        >>> from steerkit.apps.analysis import tune_run
        >>> run = tune_run(tiny, torch.ones(tiny.d_model), ["Hi"], layers=[1, 2], scales=[0, 4], concept=["the"],
        ...                neutral=["Hello"], max_new_tokens=3, n_boot=20)
        >>> run.result["layers"], run.n_cells, run.stopped_at_deadline
        ([1, 2], 4, False)
    """
    t0 = time.perf_counter()
    layers = [int(l) for l in layers]
    if not layers:
        raise InputError("expected at least one layer to tune, found none")

    def one_layer(layer: int) -> dict:
        return probes_tune(sm, artifact, prompts, layers=[layer], scales=list(scales), concept=concept,
                           neutral=None if neutral is None else list(neutral), max_new_tokens=max_new_tokens,
                           normalize=normalize, progress=False, **tune_kw).to_json()
    parts, stopped = read_chunks(layers, one_layer, progress=progress, should_stop=should_stop, deadline=deadline)
    return TuneRun(merge_tunes(parts), layers_requested=layers, stopped_at_deadline=stopped,
                   seconds=time.perf_counter() - t0)
