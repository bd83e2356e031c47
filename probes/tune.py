"""Tuning a steering direction: which layer, how strong, and what does it break?

:func:`tune` runs a grid of cells, one per (layer, scale), on a set of prompts and measures, for each
cell, how much of the concept the steered generations show and what the steering costs:

* **concept** (higher is more of the concept), the mean over prompts of a per-generation score, with a
  bootstrap percentile interval (``concept_ci``, 95 % by default) over prompts. The score comes from

  - a stored :class:`~steerkit.vectors.Probe`: its decision value (a logistic probe's probability of its
    positive class ``probe.classes[-1]``, other probes' raw score) on the activations of the prompt plus
    the steered completion re-run through the UNSTEERED model, at the probe's own layer and hook site
    and at its position (``"last"``: the last token of the completion; ``"mean"``: the mean over the
    completion's tokens; ``"first_generated"``: the first completion token; an ``int``: an index among
    the row's real tokens, prompt and completion, ``-1`` the last); a row with an empty completion
    reads its last prompt token;
  - a callable ``fn(prompts, completions) -> scores`` (one finite number per generation);
  - substring rules: ``{"contains": [...], "absent": [...]}`` (a generation scores 1 when it contains
    at least one ``contains`` string and none of the ``absent`` ones, else 0; case-insensitive unless
    ``"case": True``), or a list of strings / one string (``contains`` only).

* **perplexity**: ``exp`` of the mean negative log-likelihood of the cell's completion tokens (every
  token of every completion of the cell, pooled) under the UNSTEERED model; ``None`` when every
  completion of the cell is empty. The rule reads the
  ratio to the baseline's perplexity (``ppl_ratio``).
* **kl**: the next-token KL divergence ``KL(unsteered || steered)`` in nats at the last position of each
  ``neutral`` prompt (the distribution of the first response token), averaged over the neutral prompts.
* **repetition**: the fraction of the cell's generations that are *degenerate*: a generation of
  completion tokens ``t`` has ``m = len(t) - n + 1`` token n-grams (``n = 3`` by default); its repeated
  n-gram share is ``1 - distinct / m`` (0 when ``m < 1``), and it is degenerate when that share is above
  ``repetition_bound`` (0.5 by default).

What a scale means: for a :class:`~steerkit.vectors.SteeringVector` (operation ``"add"``), the cell at
``(l, s)`` adds ``s * v_l`` at ``blocks.{l}.{hook_site}`` at every position (``v_l`` its direction at
layer ``l``, or its one direction at every grid layer when it has only one; the vector's own ``scale``
and schedule are not used: the grid's scale replaces them); for a raw tensor ``[d_model]`` it adds
``s * v`` at ``blocks.{l}.hook_resid_post``; for a :class:`~steerkit.vectors.DirectionSet` it ablates the
basis at ``blocks.{l}.{hook_site}`` with strength ``s`` (1 removes the span's component, 0 does nothing).
``normalize="unit"`` divides added vectors by their norm first (a scale is then a length in the residual
stream); ``normalize="resid"`` also multiplies by the layer's mean residual norm over the prompts' tokens
(a scale is then a fraction of a typical residual vector: ``s = 0.5`` adds half of one). Scale 0 is the
unsteered model: such cells reuse the baseline.

Batched: the prompts are tokenized once; every generation of every cell (and the baseline, generated once)
is one row of a per-row steering (``sm.generate(tokens, steering=[...])``, ``batch_size`` rows per call);
the perplexity comes from unsteered passes in which each prompt's KV cache is computed once and shared
by every row that continues it (each row feeds only its completion; with a probe concept, which reads
activations along the whole row, one forward of prompt plus completion per row), and the KL from
per-row steered forwards of the neutral prompts (only the last position unembedded).

A cell is on the **Pareto front** when no other cell has a concept at least as high and every damage
(``kl``, ``perplexity``, ``repetition``; ``None`` counts as infinitely bad) at most as high, one of
them strictly. The **recommended** cell follows a :class:`Rule`: the highest concept (or its CI's lower
bound, ``objective="concept_lo"``) among cells whose KL, perplexity ratio and repetition are within the
rule's bounds (defaults: KL <= 1 nat, perplexity ratio <= 1.5, repetition <= 0.25). It is chosen among
front cells: that gives the same concept (a feasible dominated cell is dominated by a feasible front
cell) and puts the pick on the front, so a cell that another beats on damage at an equal concept is
never picked; among front cells of equal concept, the smaller ``|scale|`` wins, then the lower KL, then
the lower layer. When no cell meets the bounds, ``recommended`` is ``None``.

JSON schema of :meth:`TuneResult.to_json` (``format`` ``"steerkit.tune/1"``)::

    {"format": "steerkit.tune/1",
     "layers": [int, ...], "scales": [float, ...], "prompts": [str, ...], "neutral": [str, ...],
     "baseline": {"generations": [str, ...], "concept": float, "concept_ci": [lo, hi],
                  "scores": [float, ...], "perplexity": float | null, "repetition": float},
     "cells": [{"layer": int, "scale": float, "concept": float, "concept_ci": [lo, hi],
                "scores": [float, ...], "perplexity": float | null, "ppl_ratio": float | null,
                "kl": float, "repetition": float, "pareto": bool, "generations": [str, ...]}, ...],
     "recommended": {"layer": int, "scale": float} | null,
     "rule": {"objective": str, "max_kl": float | null, "max_ppl_ratio": float | null,
              "max_repetition": float | null},
     "concept_kind": "probe" | "callable" | "substring",
     "settings": {"artifact": str, "model": str, "max_new_tokens": int, "batch_size": int, "n_boot": int,
                  "alpha": float, "seed": int, "normalize": str | null, "chat": bool, "repetition_n": int,
                  "repetition_bound": float, "concept": str, "site": str, "operation": "add" | "ablate",
                  "batched": bool, "resid_norms": {str(layer): float} | null}}

Cells are layer-major (every scale of the first layer, then the next layer). :func:`tradeoff_figure`
and :func:`heatmap_figure` draw such a document (the app's Tune page uses them); :meth:`TuneResult.plot`
is the trade-off figure.
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from steerkit.errors import InputError
from steerkit.generation import continuation_logprobs
from steerkit.interventions import Intervention
from steerkit.model import Tokens
from steerkit.vectors import DirectionSet, Probe, SteeringVector
from steerkit.vectors import ModelMismatchError, check_compatible

from .patching import json_document

if TYPE_CHECKING:
    from steerkit.model import SteerModel

__all__ = ["tune", "TuneResult", "Rule", "pareto_front", "recommend", "repetition_share", "bootstrap_mean_ci",
           "tradeoff_figure", "heatmap_figure", "NEUTRAL_PROMPTS", "FORMAT", "METRICS", "DAMAGES"]

FORMAT = "steerkit.tune/1"
#: the per-cell metrics (keys of every cell of a result), as :func:`heatmap_figure` takes them
METRICS = ("concept", "perplexity", "ppl_ratio", "kl", "repetition")
#: the damage metrics: lower is better; the Pareto front and :func:`tradeoff_figure` read them
DAMAGES = ("kl", "perplexity", "repetition")
NORMALIZE = (None, "unit", "resid")
OBJECTIVES = ("concept", "concept_lo")

#: neutral prompts for the next-token KL when none are given
NEUTRAL_PROMPTS = (
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Explain how a rainbow forms.",
    "Write a short email asking a colleague for a meeting.",
    "What is 12 times 7?",
    "Name a few common kitchen tools.",
    "How do I boil an egg?",
    "Summarize the water cycle in two sentences.",
)


# ----------------------------------------------------------------------------- small checks
def _is_num(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _finite_or_none(x) -> Optional[float]:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _bad(x) -> float:
    """A damage value for comparisons: ``None`` is infinitely bad."""
    return math.inf if x is None else float(x)


# ----------------------------------------------------------------------------- the rule
@dataclasses.dataclass(frozen=True)
class Rule:
    """How :func:`tune` picks its recommended cell: the highest ``objective`` (``"concept"``, or
    ``"concept_lo"``: the lower end of its bootstrap interval) among Pareto-front cells with
    ``kl <= max_kl``, ``perplexity / baseline perplexity <= max_ppl_ratio`` and
    ``repetition <= max_repetition`` (a bound of ``None`` is no bound); ties go to the smaller
    ``|scale|``, then the lower KL, then the lower layer (:func:`recommend`).

    Examples:
        >>> from steerkit.probes.tune import Rule
        >>> Rule(max_kl=0.5).to_dict()
        {'objective': 'concept', 'max_kl': 0.5, 'max_ppl_ratio': 1.5, 'max_repetition': 0.25}
        >>> Rule.of({"max_ppl_ratio": None}).max_ppl_ratio is None
        True
    """

    max_kl: Optional[float] = 1.0
    max_ppl_ratio: Optional[float] = 1.5
    max_repetition: Optional[float] = 0.25
    objective: str = "concept"

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise InputError(f"expected the rule's objective in {OBJECTIVES}, found {self.objective!r}")
        for name in ("max_kl", "max_ppl_ratio", "max_repetition"):
            v = getattr(self, name)
            if v is not None and (not _is_num(v) or not math.isfinite(float(v)) or float(v) < 0):
                raise InputError(f"expected the rule's {name} as a number >= 0 or None (no bound), found {v!r}")
            object.__setattr__(self, name, None if v is None else float(v))

    @classmethod
    def of(cls, rule: Union["Rule", Mapping, None]) -> "Rule":
        """A rule from a :class:`Rule`, a dict of its fields (others are refused) or ``None`` (the defaults)."""
        if rule is None:
            return cls()
        if isinstance(rule, Rule):
            return rule
        if isinstance(rule, Mapping):
            names = {f.name for f in dataclasses.fields(cls)}
            extra = sorted(set(rule) - names)
            if extra:
                raise InputError(f"expected rule keys among {sorted(names)}, found {extra}")
            return cls(**dict(rule))
        raise InputError(f"expected rule= as a steerkit.probes.tune.Rule, a dict of its fields or None, found "
                         f"{type(rule).__name__}")

    def to_dict(self) -> dict:
        """The rule as a JSON-safe dict (its fields, objective first)."""
        return {"objective": self.objective, "max_kl": self.max_kl, "max_ppl_ratio": self.max_ppl_ratio,
                "max_repetition": self.max_repetition}

    def admits(self, cell: Mapping) -> bool:
        """Whether a cell (a dict with ``kl``, ``ppl_ratio``, ``repetition``) is within every bound."""
        for key, bound in (("kl", self.max_kl), ("ppl_ratio", self.max_ppl_ratio),
                           ("repetition", self.max_repetition)):
            if bound is not None and not _bad(cell.get(key)) <= bound:
                return False
        return True

    def value(self, cell: Mapping) -> float:
        """The cell's objective value."""
        if self.objective == "concept_lo":
            return float(cell["concept_ci"][0])
        return float(cell["concept"])


def pareto_front(cells: Sequence[Mapping], damages: Sequence[str] = DAMAGES) -> list[bool]:
    """For each cell, whether no other cell has ``concept`` >= and every damage <= (``None`` counts as
    infinitely bad), one of them strictly.

    Examples:
        >>> from steerkit.probes.tune import pareto_front
        >>> cells = [dict(concept=0.1, kl=0.0, perplexity=5.0, repetition=0.0),
        ...          dict(concept=0.5, kl=0.2, perplexity=6.0, repetition=0.0),
        ...          dict(concept=0.4, kl=0.3, perplexity=7.0, repetition=0.0)]
        >>> pareto_front(cells)
        [True, True, False]
    """
    pts = [(float(c["concept"]), [_bad(c.get(d)) for d in damages]) for c in cells]
    out = []
    for i, (ci, di) in enumerate(pts):
        dominated = False
        for j, (cj, dj) in enumerate(pts):
            if j == i:
                continue
            if cj >= ci and all(a <= b for a, b in zip(dj, di)) and (cj > ci or any(a < b for a, b in zip(dj, di))):
                dominated = True
                break
        out.append(not dominated)
    return out


def recommend(cells: Sequence[Mapping], rule: Union[Rule, Mapping, None] = None) -> Optional[dict]:
    """The recommended ``{"layer", "scale"}`` among ``cells`` (dicts with ``layer``, ``scale``, ``concept``,
    ``concept_ci``, ``kl``, ``ppl_ratio``, ``repetition`` and ``pareto``) by ``rule`` (see :class:`Rule`), or
    ``None`` when no cell meets its bounds.

    Examples:
        >>> from steerkit.probes.tune import recommend
        >>> cells = [dict(layer=3, scale=s, concept=c, concept_ci=[c, c], kl=k, ppl_ratio=1.0, repetition=0.0,
        ...               pareto=True) for s, c, k in [(1.0, 0.2, 0.1), (2.0, 0.6, 0.4), (4.0, 0.9, 3.0)]]
        >>> recommend(cells, {"max_kl": 1.0})
        {'layer': 3, 'scale': 2.0}
        >>> recommend(cells, {"max_kl": 0.01}) is None
        True
    """
    rule = Rule.of(rule)
    ok = [c for c in cells if c.get("pareto", True) and rule.admits(c)]
    if not ok:
        return None
    best = min(ok, key=lambda c: (-rule.value(c), abs(float(c["scale"])), _bad(c.get("kl")), int(c["layer"])))
    return {"layer": int(best["layer"]), "scale": float(best["scale"])}


def repetition_share(tokens: Sequence[int], n: int = 3) -> float:
    """The repeated n-gram share of a token sequence: ``1 - distinct n-grams / n-grams`` (0 when it has
    no n-gram).

    Examples:
        >>> from steerkit.probes.tune import repetition_share
        >>> repetition_share([1, 2, 3, 4, 5])
        0.0
        >>> round(repetition_share([7, 8, 7, 8, 7, 8, 7, 8]), 3)
        0.667
    """
    m = len(tokens) - n + 1
    if m < 1:
        return 0.0
    grams = {tuple(tokens[i:i + n]) for i in range(m)}
    return 1.0 - len(grams) / m


def bootstrap_mean_ci(scores: Sequence[float], *, n_boot: int = 1000, alpha: float = 0.05, seed: int = 0
                      ) -> tuple[float, float]:
    """Percentile ``1 - alpha`` interval of the mean of ``scores`` over ``n_boot`` bootstrap resamples
    (a seeded generator; ``(x, x)`` for one score).

    Examples:
        >>> from steerkit.probes.tune import bootstrap_mean_ci
        >>> lo, hi = bootstrap_mean_ci([0.0, 1.0, 1.0, 0.0, 1.0], n_boot=200)
        >>> 0.0 <= lo <= 0.6 <= hi <= 1.0
        True
    """
    x = np.asarray(scores, dtype=np.float64)
    if x.size == 0:
        raise InputError("expected at least one score to bootstrap, found none")
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 1:
        raise InputError(f"expected n_boot as an int >= 1, found {n_boot!r}")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(1)
    lo, hi = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


# ----------------------------------------------------------------------------- the result
@dataclasses.dataclass(frozen=True, eq=False)
class TuneResult:
    """What :func:`tune` measured: the grid (``layers`` x ``scales``), the prompts, the baseline (the
    unsteered model on the prompts), one dict per cell (layer-major; the keys of the module docstring's
    schema), the ``recommended`` cell (``{"layer", "scale"}`` or ``None``), the :class:`Rule`, what scored
    the concept (``concept_kind``) and the settings. ``to_json()`` / ``from_json()`` / ``plot()``.

    Examples:
        >>> from steerkit.probes.tune import TuneResult
        >>> res = TuneResult.from_json(TuneResult.example().to_json())
        >>> res.recommended, res.cell(5, 2.0)["pareto"]
        ({'layer': 5, 'scale': 2.0}, True)
    """

    layers: tuple
    scales: tuple
    prompts: tuple
    neutral: tuple
    baseline: dict
    cells: tuple
    recommended: Optional[dict]
    rule: Rule
    concept_kind: str
    settings: dict

    def __repr__(self):
        return (f"TuneResult({len(self.layers)} layers x {len(self.scales)} scales on {len(self.prompts)} prompts, "
                f"concept {self.concept_kind}, recommended={self.recommended})")

    def cell(self, layer: int, scale: float) -> dict:
        """The cell at ``(layer, scale)``."""
        for c in self.cells:
            if c["layer"] == layer and c["scale"] == float(scale):
                return c
        raise InputError(f"expected a cell of the grid (layers {list(self.layers)}, scales {list(self.scales)}), "
                         f"found ({layer}, {scale})")

    @property
    def front(self) -> list[dict]:
        """The Pareto-front cells."""
        return [c for c in self.cells if c["pareto"]]

    def to_json(self) -> dict:
        """The result as a JSON-safe dict (schema in the module docstring); ``json.dumps`` it as it is."""
        return {"format": FORMAT, "layers": list(self.layers), "scales": list(self.scales),
                "prompts": list(self.prompts), "neutral": list(self.neutral), "baseline": dict(self.baseline),
                "cells": [dict(c) for c in self.cells],
                "recommended": None if self.recommended is None else dict(self.recommended),
                "rule": self.rule.to_dict(), "concept_kind": self.concept_kind, "settings": dict(self.settings)}

    def save(self, path) -> Path:
        """Write :meth:`to_json` to ``path`` (UTF-8 JSON text); :meth:`from_json` reads it back."""
        p = Path(path)
        p.write_text(json.dumps(self.to_json(), allow_nan=False), encoding="utf-8")
        return p

    @classmethod
    def from_json(cls, doc) -> "TuneResult":
        """A result from :meth:`to_json`'s dict, its JSON text, or a path to a file holding it."""
        d = _document(doc)
        try:
            return cls(layers=tuple(int(l) for l in d["layers"]), scales=tuple(float(s) for s in d["scales"]),
                       prompts=tuple(str(p) for p in d["prompts"]), neutral=tuple(str(p) for p in d.get("neutral", [])),
                       baseline=dict(d["baseline"]), cells=tuple(dict(c) for c in d["cells"]),
                       recommended=None if d.get("recommended") is None else
                       {"layer": int(d["recommended"]["layer"]), "scale": float(d["recommended"]["scale"])},
                       rule=Rule.of(d.get("rule")), concept_kind=str(d["concept_kind"]),
                       settings=dict(d.get("settings", {})))
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"expected a complete steerkit tune JSON, found a malformed one ({e!r:.120})") from None

    @classmethod
    def example(cls) -> "TuneResult":
        """A small made-up result (2 layers x 3 scales) for examples and figure previews."""
        layers, scales = (5, 10), (0.0, 2.0, 4.0)
        cells = []
        for l in layers:
            for s in scales:
                c = 0.1 + s * (0.15 if l == 5 else 0.1)
                kl = s * s * (0.05 if l == 5 else 0.1)
                cells.append({"layer": l, "scale": s, "concept": c, "concept_ci": [c - 0.05, c + 0.05],
                              "scores": [c, c], "perplexity": 4.0 * (1 + kl), "ppl_ratio": 1 + kl, "kl": kl,
                              "repetition": 0.0 if s < 4 else 0.5, "pareto": False, "generations": ["...", "..."]})
        for c, p in zip(cells, pareto_front(cells)):
            c["pareto"] = p
        rule = Rule()
        base = {"generations": ["...", "..."], "concept": 0.1, "concept_ci": [0.05, 0.15], "scores": [0.1, 0.1],
                "perplexity": 4.0, "repetition": 0.0}
        return cls(layers=layers, scales=scales, prompts=("a", "b"), neutral=("n",), baseline=base, cells=tuple(cells),
                   recommended=recommend(cells, rule), rule=rule, concept_kind="substring",
                   settings={"artifact": "example", "model": "none"})

    def plot(self, *, damage: str = "kl"):
        """The trade-off figure (:func:`tradeoff_figure`): concept against ``damage`` per layer across scales.

        Examples:
            >>> from steerkit.probes.tune import TuneResult
            >>> fig = TuneResult.example().plot()
            >>> fig.layout.xaxis.title.text
            'kl (next-token KL on neutral prompts, nats)'
        """
        return tradeoff_figure(self.to_json(), damage=damage)


def _document(doc) -> dict:
    """A tune document: the dict itself, its JSON text, a path to it, or a :class:`TuneResult`."""
    if isinstance(doc, TuneResult):
        return doc.to_json()
    if isinstance(doc, (str, Path)):
        doc = json_document(doc, FORMAT, "tune")
    if not isinstance(doc, Mapping) or doc.get("format") != FORMAT:
        raise InputError(f"expected a steerkit tune document (format {FORMAT!r}), found "
                         f"{str(doc.get('format') if isinstance(doc, Mapping) else type(doc).__name__)[:80]!r}")
    for key in ("layers", "scales", "cells", "baseline"):
        if key not in doc:
            raise InputError(f"expected the key {key!r} in a tune document, found only {sorted(doc)[:12]}")
    return dict(doc)


# ----------------------------------------------------------------------------- figures
_AXIS = {"kl": "kl (next-token KL on neutral prompts, nats)",
         "perplexity": "perplexity (unsteered model on the steered generations)",
         "ppl_ratio": "perplexity ratio (to the baseline)",
         "repetition": "repetition (share of degenerate generations)",
         "concept": "concept score"}


def _go():
    try:
        import plotly.graph_objects as go
    except ImportError:
        raise InputError("expected plotly to be installed to plot, found it missing; pip install plotly") from None
    return go


def tradeoff_figure(result_json: dict, *, damage: str = "kl"):
    """Trade-off curves of a tune document (:meth:`TuneResult.to_json`, its text or a path): one line per
    layer through its scales, concept up the y axis against ``damage`` (``"kl"``, ``"perplexity"``,
    ``"ppl_ratio"`` or ``"repetition"``) along x, each point labelled with its scale and with its concept
    interval as an error bar; Pareto-front cells ringed, the recommended cell a star, the baseline a
    dashed line at its concept. Returns a plotly figure.

    Examples:
        >>> from steerkit.probes.tune import TuneResult, tradeoff_figure
        >>> fig = tradeoff_figure(TuneResult.example().to_json(), damage="perplexity")
        >>> [t.name for t in fig.data]
        ['layer 5', 'layer 10', 'Pareto front', 'recommended']
    """
    d = _document(result_json)
    if damage not in _AXIS or damage == "concept":
        raise InputError(f"expected damage in {tuple(k for k in _AXIS if k != 'concept')}, found {damage!r}")
    go = _go()
    fig = go.Figure()
    cells = d["cells"]

    def xval(c):
        v = c.get(damage)
        return None if v is None else float(v)

    for layer in d["layers"]:
        row = sorted((c for c in cells if c["layer"] == layer), key=lambda c: c["scale"])
        if not row:
            continue
        fig.add_trace(go.Scatter(
            x=[xval(c) for c in row], y=[c["concept"] for c in row], mode="lines+markers+text",
            name=f"layer {layer}", text=[f"{c['scale']:g}" for c in row], textposition="top center",
            error_y=dict(type="data", symmetric=False, array=[c["concept_ci"][1] - c["concept"] for c in row],
                         arrayminus=[c["concept"] - c["concept_ci"][0] for c in row], thickness=1),
            customdata=[[c["scale"], c.get("kl"), c.get("perplexity"), c.get("repetition")] for c in row],
            hovertemplate=(f"layer {layer}, scale %{{customdata[0]}}<br>concept %{{y:.3g}}<br>kl %{{customdata[1]:.3g}}"
                           "<br>perplexity %{customdata[2]:.3g}<br>repetition %{customdata[3]:.2f}<extra></extra>")))
    front = sorted((c for c in cells if c.get("pareto")), key=lambda c: _bad(xval(c)))
    fig.add_trace(go.Scatter(x=[xval(c) for c in front], y=[c["concept"] for c in front], mode="markers",
                             name="Pareto front", marker=dict(size=16, symbol="circle-open", color="black",
                                                              line=dict(width=2)),
                             hovertemplate="Pareto: concept %{y:.3g}<extra></extra>"))
    rec = d.get("recommended")
    if rec is not None:
        rc = [c for c in cells if c["layer"] == rec["layer"] and float(c["scale"]) == float(rec["scale"])]
        if rc:
            fig.add_trace(go.Scatter(x=[xval(rc[0])], y=[rc[0]["concept"]], mode="markers", name="recommended",
                                     marker=dict(size=20, symbol="star", color="gold", line=dict(width=1, color="black")),
                                     hovertemplate=(f"recommended: layer {rec['layer']}, scale {rec['scale']:g}"
                                                    "<extra></extra>")))
    base = d["baseline"].get("concept")
    if base is not None:
        fig.add_hline(y=float(base), line_dash="dash", line_color="gray", annotation_text="unsteered")
    fig.update_layout(title=f"concept vs {damage} per layer across scales ({d.get('concept_kind', '')} concept)",
                      xaxis_title=_AXIS[damage], yaxis_title=_AXIS["concept"], template="plotly_white",
                      legend_title="layer")
    return fig


def heatmap_figure(result_json: dict, metric: str):
    """A heatmap of one per-cell ``metric`` of a tune document (``"concept"``, ``"perplexity"``,
    ``"ppl_ratio"``, ``"kl"`` or ``"repetition"``): layers down, scales across, the recommended cell
    marked with a star. Returns a plotly figure.

    Examples:
        >>> from steerkit.probes.tune import TuneResult, heatmap_figure
        >>> fig = heatmap_figure(TuneResult.example().to_json(), "kl")
        >>> [list(row) for row in fig.data[0].z]
        [[0.0, 0.2, 0.8], [0.0, 0.4, 1.6]]
    """
    d = _document(result_json)
    if metric not in METRICS:
        raise InputError(f"expected metric in {METRICS}, found {metric!r}")
    go = _go()
    layers, scales = list(d["layers"]), [float(s) for s in d["scales"]]
    z: list[list] = [[None] * len(scales) for _ in layers]
    for c in d["cells"]:
        if c["layer"] in layers and float(c["scale"]) in scales:
            v = c.get(metric)
            z[layers.index(c["layer"])][scales.index(float(c["scale"]))] = None if v is None else float(v)
    x, y = [f"{s:g}" for s in scales], [f"L{l}" for l in layers]
    fig = go.Figure(go.Heatmap(z=z, x=x, y=y, colorscale="Viridis" if metric == "concept" else "Reds",
                               colorbar=dict(title=metric),
                               hovertemplate="%{y}, scale %{x}: %{z:.4g}<extra></extra>"))
    rec = d.get("recommended")
    if rec is not None and rec["layer"] in layers and float(rec["scale"]) in scales:
        fig.add_trace(go.Scatter(x=[f"{float(rec['scale']):g}"], y=[f"L{rec['layer']}"], mode="markers",
                                 name="recommended", marker=dict(symbol="star", size=18, color="gold",
                                                                 line=dict(width=1, color="black"))))
    fig.update_layout(title=f"{_AXIS.get(metric, metric)} per layer and scale", xaxis_title="scale",
                      yaxis_title="layer", xaxis=dict(type="category"),
                      yaxis=dict(type="category", autorange="reversed"), template="plotly_white")
    return fig


# ----------------------------------------------------------------------------- what a cell does
@dataclasses.dataclass(frozen=True)
class _Source:
    """The artifact as the grid uses it: what one cell at ``(layer, scale)`` applies."""

    op: str  # "add" or "ablate"
    site: str  # the hook inside a block: "hook_resid_post" or "hook_resid_pre"
    vectors: dict  # layer -> tensor ([d_model] to add, [k, d_model] basis to ablate); key None: every layer
    positions: Any
    label: str

    def tensor(self, layer: int) -> Tensor:
        v = self.vectors.get(layer, self.vectors.get(None))
        if v is None:
            raise InputError(f"expected the artifact to have a direction at every grid layer, found none at layer "
                             f"{layer} (it has layers {sorted(k for k in self.vectors if k is not None)}); pass "
                             "layers= among those, or a vector with one direction (used at every layer)")
        return v

    def hook(self, layer: int) -> str:
        return f"blocks.{layer}.{self.site}"


def _source(sm: "SteerModel", artifact, override: bool) -> _Source:
    if isinstance(artifact, (SteeringVector, DirectionSet)):
        try:
            check_compatible(artifact, sm, override=override)
        except ModelMismatchError as e:
            raise InputError(f"{e}") from None
    if isinstance(artifact, SteeringVector):
        if artifact.operation != "add":
            raise InputError(f"expected a steering vector with operation 'add' to tune, found {artifact.operation!r}; "
                             "tune its direction as a tensor (vec.directions[layer]) instead")
        dirs = dict(artifact.directions)
        vectors = dirs if len(dirs) > 1 else {None: next(iter(dirs.values()))}
        pos = artifact.positions if artifact.positions is not None else "all"
        label = f"steering_vector ({artifact.provenance.method or 'unnamed'}, layers {list(dirs)})"
        return _Source("add", artifact.hook_site, {k: v.float() for k, v in vectors.items()}, pos, label)
    if isinstance(artifact, DirectionSet):
        return _Source("ablate", artifact.hook_site, {None: artifact.basis.float()}, "all",
                       f"direction_set (k={artifact.k})")
    if isinstance(artifact, (Tensor, np.ndarray)):
        t = torch.as_tensor(artifact).detach().float().cpu()
        if t.dim() == 2 and t.shape[0] == 1:
            t = t[0]
        if t.dim() != 1 or t.shape[0] != sm.d_model:
            raise InputError(f"expected a direction tensor of shape [d_model={sm.d_model}], found {tuple(t.shape)}")
        if not bool(torch.isfinite(t).all()) or float(t.norm()) == 0.0:
            raise InputError("expected a nonzero direction with finite values, found zeros or NaN/inf")
        return _Source("add", "hook_resid_post", {None: t}, "all", f"tensor [d_model={sm.d_model}]")
    raise InputError(f"expected the artifact as a SteeringVector, a DirectionSet or a direction tensor [d_model], "
                     f"found {type(artifact).__name__}; load a stored one with Store().load(name)")


def _intervention(src: _Source, layer: int, scale: float, factor: float) -> Intervention:
    """The cell ``(layer, scale)``'s intervention (``factor``: the normalisation of an added vector)."""
    v = src.tensor(layer)
    if src.op == "ablate":
        return Intervention.ablate(src.hook(layer), v, scale)
    return Intervention.add(src.hook(layer), v, scale * factor, positions=src.positions)


# ----------------------------------------------------------------------------- the concept score
@dataclasses.dataclass(frozen=True)
class _Concept:
    kind: str  # "probe" | "callable" | "substring"
    label: str
    probe: Optional[Probe] = None
    fn: Optional[Callable] = None
    contains: tuple = ()
    absent: tuple = ()
    case: bool = False

    def substring_score(self, text: str) -> float:
        t = text if self.case else text.lower()
        norm = (lambda s: s) if self.case else (lambda s: s.lower())
        hit = not self.contains or any(norm(w) in t for w in self.contains)
        return 1.0 if hit and not any(norm(w) in t for w in self.absent) else 0.0


def _words(v, what: str) -> tuple:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, (list, tuple)) or not all(isinstance(w, str) and w for w in v):
        raise InputError(f"expected {what} as a list of non-empty strings, found {v!r:.80}")
    return tuple(v)


def _concept(sm: "SteerModel", concept, override: bool) -> _Concept:
    if isinstance(concept, Probe):
        try:
            check_compatible(concept, sm, override=override)
        except ModelMismatchError as e:
            raise InputError(f"{e}") from None
        if concept.weight.shape[0] != 1:
            raise InputError(f"expected a binary probe with one output, found {concept.weight.shape[0]} outputs")
        pos = (concept.provenance.method_params or {}).get("position", "last")
        if not (pos in ("last", "mean", "first_generated") or (isinstance(pos, int) and not isinstance(pos, bool))
                or (isinstance(pos, str) and pos.lstrip("-").isdigit())):
            raise InputError(f"expected the probe's position as 'last', 'mean', 'first_generated' or an int, "
                             f"found {pos!r}")
        name = concept.classes[-1] if concept.classes else "positive"
        what = "probability" if concept.probe_kind == "logistic" else "score"
        return _Concept("probe", f"probe {concept.probe_kind} at blocks.{concept.layer}.{concept.hook_site}, "
                                 f"position {pos}: {what} of {name!r}", probe=concept)
    if isinstance(concept, Mapping):
        extra = sorted(set(concept) - {"contains", "absent", "case"})
        if extra or not ({"contains", "absent"} & set(concept)):
            raise InputError(f"expected substring rules as {{'contains': [...], 'absent': [...], 'case': bool}}, "
                             f"found keys {sorted(concept)}")
        c = _Concept("substring", "", contains=_words(concept.get("contains", []) or [], "'contains'")
                     if concept.get("contains") else (),
                     absent=_words(concept.get("absent"), "'absent'") if concept.get("absent") else (),
                     case=bool(concept.get("case", False)))
        if not c.contains and not c.absent:
            raise InputError("expected at least one 'contains' or 'absent' string in the substring rules, found none")
        return dataclasses.replace(c, label=f"contains any of {list(c.contains)}, none of {list(c.absent)}"
                                           + (" (case-sensitive)" if c.case else ""))
    if isinstance(concept, (str, list, tuple)):
        words = _words(concept, "the concept substrings")
        return _Concept("substring", f"contains any of {list(words)}, none of []", contains=words)
    if callable(concept):
        return _Concept("callable", f"callable {getattr(concept, '__name__', type(concept).__name__)}", fn=concept)
    raise InputError(f"expected concept= as a Probe, a callable fn(prompts, completions) -> scores, substring rules "
                     f"{{'contains': [...], 'absent': [...]}} or a list of substrings, found {type(concept).__name__}")


def _probe_row(probe: Probe, acts: Tensor, n_prompt: int, n_real: int) -> Tensor:
    """The activation the probe reads in one row of the scoring forward (``acts``: its real tokens)."""
    pos = (probe.provenance.method_params or {}).get("position", "last")
    n_gen = n_real - n_prompt
    if pos == "last" or (pos in ("mean", "first_generated") and n_gen == 0):
        return acts[n_real - 1]
    if pos == "mean":
        return acts[n_prompt:n_real].mean(0)
    if pos == "first_generated":
        return acts[n_prompt]
    i = int(pos)
    if not -n_real <= i < n_real:
        raise InputError(f"expected the probe's position {i} inside every scored row, found a row of {n_real} tokens")
    return acts[i % n_real]


def _callable_scores(fn, prompts: list[str], completions: list[str]) -> list[float]:
    out = fn(list(prompts), list(completions))
    try:
        arr = np.asarray(out, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise InputError(f"expected the concept callable to return numbers, found {type(out).__name__}") from None
    if arr.shape[0] != len(prompts):
        raise InputError(f"expected the concept callable to return one score per generation ({len(prompts)}), "
                         f"found {arr.shape[0]}")
    if not bool(np.isfinite(arr).all()):
        raise InputError("expected finite concept scores from the callable, found NaN/inf")
    return arr.tolist()


# ----------------------------------------------------------------------------- argument checks
def _prompt_list(prompts, what: str) -> list[str]:
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise InputError(f"expected {what} as a non-empty list of strings, found {prompts!r:.80}")
    for i, p in enumerate(prompts):
        if not isinstance(p, str) or not p.strip():
            raise InputError(f"expected {what} as non-empty strings, found {p!r:.60} at index {i}")
    return list(prompts)


def _int_arg(v, what: str, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < minimum:
        raise InputError(f"expected {what} as an int >= {minimum}, found {v!r}")
    return int(v)


def _layers(sm: "SteerModel", layers, src: _Source) -> list[int]:
    if layers is None:
        have = sorted(k for k in src.vectors if k is not None)
        if not have:
            raise InputError("expected layers=[...] (the grid's layers), found None; the artifact has one direction, "
                             "so say where to try it, e.g. layers=[6, 10, 14]")
        layers = have
    if isinstance(layers, numbers.Integral) and not isinstance(layers, bool):
        layers = [layers]
    if isinstance(layers, range):
        layers = list(layers)
    if not isinstance(layers, (list, tuple)) or not layers or not all(
            isinstance(l, numbers.Integral) and not isinstance(l, bool) for l in layers):
        raise InputError(f"expected layers as a non-empty list of ints, found {layers!r:.80}")
    out = [int(l) for l in layers]
    bad = [l for l in out if not 0 <= l < sm.n_layers]
    if bad:
        raise InputError(f"expected layers in 0..{sm.n_layers - 1}, found {bad}")
    if len(set(out)) != len(out):
        raise InputError(f"expected distinct layers, found repeats in {out}")
    return out


def _scales(scales) -> list[float]:
    if _is_num(scales):
        scales = [scales]
    if not isinstance(scales, (list, tuple, np.ndarray)) or len(scales) == 0 or not all(_is_num(s) for s in scales):
        raise InputError(f"expected scales as a non-empty list of numbers, found {scales!r:.80}")
    out = [float(s) for s in scales]
    if not all(math.isfinite(s) for s in out):
        raise InputError(f"expected finite scales, found {out}")
    if len(set(out)) != len(out):
        raise InputError(f"expected distinct scales, found repeats in {out}")
    return out


# ----------------------------------------------------------------------------- the runs
def _chunks(n: int, size: int):
    for i in range(0, n, size):
        yield range(i, min(i + size, n))


def _prompt_ids(toks: Tokens) -> list[list[int]]:
    return [toks.input_ids[b][toks.attention_mask[b].bool()].tolist() for b in range(len(toks))]


def _resid_norms(sm: "SteerModel", src: _Source, layers: list[int], ids: list[list[int]], batch_size: int
                 ) -> dict[int, float]:
    """Each grid layer's mean residual norm at the steered site over the prompts' tokens (each row's first
    token, an attention sink with an outsized norm, left out)."""
    sites = [src.hook(l) for l in layers]
    tot = {s: 0.0 for s in sites}
    cnt = 0
    for rows in _chunks(len(ids), batch_size):
        with sm.record(sites, positions="all", device="cpu") as cache:
            sm.forward(sm.pad([ids[i] for i in rows]))
        lens = cache.lengths(sites[0])
        keep = torch.arange(cache[sites[0]].shape[1])[None, :]
        m = (keep >= 1) & (keep < lens[:, None])
        cnt += int(m.sum())
        for s in sites:
            tot[s] += float(cache[s].float().norm(dim=-1)[m].sum())
    if cnt == 0:
        raise InputError("expected prompts of at least two tokens to measure residual norms, found shorter ones")
    return {l: tot[s] / cnt for l, s in zip(layers, sites)}


@dataclasses.dataclass
class _Rows:
    """Every generation of a tune: row ``r`` is prompt ``prompt[r]`` under cell ``cell[r]`` (None: baseline)."""

    prompt: list
    cell: list
    tokens: list  # completion token ids per row
    texts: list


def _generate_rows(sm: "SteerModel", ids: list[list[int]], plan: list, steer_of, *, max_new_tokens: int,
                   batch_size: int, batched: bool, bar) -> _Rows:
    """Generate every row of ``plan`` ((prompt index, cell index or None) pairs)."""
    toks: list = [None] * len(plan)
    if batched:
        for rows in _chunks(len(plan), batch_size):
            steering = [None if plan[r][1] is None else [steer_of(plan[r][1])] for r in rows]
            out = sm.generate(sm.pad([ids[plan[r][0]] for r in rows]), max_new_tokens=max_new_tokens,
                              steering=None if all(s is None for s in steering) else steering, return_tokens=True)
            for r, t in zip(rows, out):
                toks[r] = list(t)
            bar.update(len(rows))
    else:  # one sm.generate per cell (the baseline is a cell), the cell's steering on every row
        groups: dict = {}
        for r, (_, c) in enumerate(plan):
            groups.setdefault(c, []).append(r)
        for c, rs in groups.items():
            for part in _chunks(len(rs), batch_size):
                sel = [rs[i] for i in part]
                out = sm.generate(sm.pad([ids[plan[r][0]] for r in sel]), max_new_tokens=max_new_tokens,
                                  steering=None if c is None else [steer_of(c)], return_tokens=True)
                for r, t in zip(sel, out):
                    toks[r] = list(t)
                bar.update(len(sel))
    texts = [sm.tokenizer.decode(t, skip_special_tokens=True) for t in toks]
    return _Rows([p for p, _ in plan], [c for _, c in plan], toks, texts)


def _score_rows(sm: "SteerModel", ids: list[list[int]], rows: _Rows, probe: Optional[Probe], *, batch_size: int,
                bar) -> tuple[list[float], list[int], list]:
    """Unsteered forwards of prompt + completion: per row the completion's summed NLL, its token count and
    (with a probe) the probe's input activation. Without a probe, each prompt's KV cache is computed once
    and every row feeds only its completion (:func:`~steerkit.generation.continuation_logprobs`); a probe
    reads activations along the whole row, so its rows go through one full forward each."""
    count = [len(t) for t in rows.tokens]
    if probe is None:
        lps = continuation_logprobs(sm, ids, list(zip(rows.prompt, rows.tokens)), batch_size=batch_size,
                                    progress=bar.update)
        return [float(-lp.double().sum()) for lp in lps], count, [None] * len(lps)
    vocab = int(sm.adapter.unembed_module(sm.hf_model).weight.shape[0])
    seqs = [ids[p] + t for p, t in zip(rows.prompt, rows.tokens)]
    longest = max(len(s) for s in seqs)
    size = max(1, min(batch_size, (1 << 27) // max(1, longest * vocab)))
    nll: list[float] = [0.0] * len(seqs)
    acts: list = [None] * len(seqs)
    hook = f"blocks.{probe.layer}.{probe.hook_site}"
    for part in _chunks(len(seqs), size):
        batch = sm.pad([seqs[r] for r in part])
        with sm.record([hook], positions="all", device="cpu") as cache:
            logits = sm.forward(batch)
        rec = cache[hook]
        P = batch.input_ids.shape[1]
        for i, r in enumerate(part):
            k = count[r]
            if k:
                lp = torch.log_softmax(logits[i, P - k - 1:P - 1].float(), dim=-1)
                tgt = batch.input_ids[i, P - k:].to(lp.device)
                nll[r] = float(-lp.gather(-1, tgt[:, None]).sum())
            acts[r] = _probe_row(probe, rec[i], len(ids[rows.prompt[r]]), len(seqs[r]))
        bar.update(len(part))
    return nll, count, acts


def _kl_cells(sm: "SteerModel", neutral_ids: list[list[int]], cells: list, steer_of, *, batch_size: int,
              batched: bool, bar) -> dict:
    """``KL(unsteered || steered)`` at the last position, averaged over the neutral prompts, per cell index."""
    def last_logp(steering, id_rows):
        toks = sm.pad(id_rows)
        if steering is None:
            logits = sm.forward(toks, logits_to_keep=1)
        else:
            with sm.steer(steering, label=f"tune kl x{len(id_rows)}"):
                logits = sm.forward(toks, logits_to_keep=1)
        return torch.log_softmax(logits[:, -1].float(), dim=-1)

    n = len(neutral_ids)
    base = torch.cat([last_logp(None, [neutral_ids[j] for j in part]) for part in _chunks(n, batch_size)])
    bar.update(n)
    plan = [(c, j) for c in cells for j in range(n)]
    kl_sum = {c: 0.0 for c in cells}
    if batched:
        for part in _chunks(len(plan), batch_size):
            rows = [plan[r] for r in part]
            lq = last_logp([[steer_of(c)] for c, _ in rows], [neutral_ids[j] for _, j in rows])
            for i, (c, j) in enumerate(rows):
                p = base[j]
                kl_sum[c] += float((p.exp() * (p - lq[i])).sum())
            bar.update(len(rows))
    else:
        for c in cells:
            for part in _chunks(n, batch_size):
                lq = last_logp([steer_of(c)], [neutral_ids[j] for j in part])
                for i, j in enumerate(part):
                    p = base[j]
                    kl_sum[c] += float((p.exp() * (p - lq[i])).sum())
                bar.update(len(part))
    return {c: max(0.0, kl_sum[c] / n) for c in cells}


def tune(sm: "SteerModel", artifact, prompts: Sequence[str], *, layers: Optional[Sequence[int]] = None,
         scales: Sequence[float] = (0.0, 2.0, 4.0, 8.0), concept, neutral: Optional[Sequence[str]] = None,
         max_new_tokens: int = 32, batch_size: int = 64, rule: Union[Rule, Mapping, None] = None,
         n_boot: int = 1000, alpha: float = 0.05, seed: int = 0, normalize: Optional[str] = None,
         chat: bool = True, repetition_n: int = 3, repetition_bound: float = 0.5, batched: bool = True,
         override: bool = False, progress: bool = True) -> TuneResult:
    """Steer ``prompts`` with ``artifact`` at every ``layers`` x ``scales`` cell; score the concept and the
    damage of each cell, find the Pareto front and recommend a cell (the module docstring defines every
    score, the scale, the front and the rule).

    ``artifact``: a :class:`~steerkit.vectors.SteeringVector` (``"add"``), a
    :class:`~steerkit.vectors.DirectionSet` or a direction tensor ``[d_model]``. ``layers``: the grid's
    layers (default: the vector's own layers, when it has several). ``scales``: the strengths (0 is the
    unsteered baseline). ``concept``: a :class:`~steerkit.vectors.Probe`, a callable
    ``fn(prompts, completions) -> scores`` or substring rules (``{"contains": [...], "absent": [...]}`` or
    a list of strings). ``neutral``: prompts for the KL (default :data:`NEUTRAL_PROMPTS`). Generations are
    greedy, ``max_new_tokens`` long at most, with the chat template when ``chat``; ``batch_size`` rows share
    one generate / forward call. ``rule``: a :class:`Rule` or a dict of its fields. ``n_boot`` / ``alpha`` /
    ``seed``: the concept's bootstrap interval. ``normalize``: ``None`` (the vector as it is), ``"unit"``
    or ``"resid"`` (see the module docstring). ``batched=False`` runs each cell as its own
    ``sm.generate`` / forward calls with the cell's steering on every row (the reference the batched path
    equals). ``override`` skips the artifact's model check; ``progress`` shows a tqdm bar over rows.

    Examples:
        >>> from steerkit.probes import tune
        >>> v = torch.ones(tiny.d_model)
        >>> res = tune(tiny, v, ["Hi", "Tell me a joke"], layers=[1, 2], scales=[0, 4], concept=["the"],
        ...            neutral=["Hello"], max_new_tokens=4, n_boot=50, progress=False)
        >>> len(res.cells), res.cell(1, 0.0)["kl"], res.cell(2, 4.0)["kl"] > 0
        (4, 0.0, True)
    """
    prompts = _prompt_list(prompts, "prompts")
    neutral = _prompt_list(list(NEUTRAL_PROMPTS) if neutral is None else neutral, "neutral prompts")
    max_new_tokens = _int_arg(max_new_tokens, "max_new_tokens", 1)
    batch_size = _int_arg(batch_size, "batch_size", 1)
    n_boot = _int_arg(n_boot, "n_boot", 1)
    repetition_n = _int_arg(repetition_n, "repetition_n", 1)
    seed = _int_arg(seed, "seed", 0)
    if not _is_num(alpha) or not 0.0 < float(alpha) < 1.0:
        raise InputError(f"expected alpha in (0, 1) (0.05: a 95% interval), found {alpha!r}")
    if not _is_num(repetition_bound) or not 0.0 <= float(repetition_bound) < 1.0:
        raise InputError(f"expected repetition_bound in [0, 1), found {repetition_bound!r}")
    if normalize not in NORMALIZE:
        raise InputError(f"expected normalize in {NORMALIZE}, found {normalize!r}")
    if chat not in (True, False) or batched not in (True, False):
        raise InputError(f"expected chat and batched as True or False, found {chat!r} / {batched!r}")
    rule = Rule.of(rule)
    src = _source(sm, artifact, override)
    layers = _layers(sm, layers, src)
    scales = _scales(scales)
    for l in layers:
        src.tensor(l)  # every grid layer has a direction
    con = _concept(sm, concept, override)
    if normalize is not None and src.op == "ablate":
        raise InputError(f"expected normalize=None with a DirectionSet (its scale is the ablation strength), found "
                         f"{normalize!r}")

    ids = _prompt_ids(sm.tokenize(prompts, chat=chat))
    neutral_ids = _prompt_ids(sm.tokenize(neutral, chat=chat))
    resid = _resid_norms(sm, src, layers, ids, batch_size) if normalize == "resid" else None

    def factor(layer: int) -> float:
        if normalize is None or src.op == "ablate":
            return 1.0
        f = 1.0 / float(src.tensor(layer).norm())
        return f * resid[layer] if resid is not None else f

    grid = [(l, s) for l in layers for s in scales]
    steered = [i for i, (_, s) in enumerate(grid) if s != 0.0]
    ivs = {i: _intervention(src, grid[i][0], grid[i][1], factor(grid[i][0])) for i in steered}
    steer_of = ivs.__getitem__
    plan = [(p, None) for p in range(len(prompts))] + [(p, c) for c in steered for p in range(len(prompts))]
    n_kl = len(neutral) * (1 + len(steered))
    with tqdm(total=2 * len(plan) + n_kl, desc="tune", unit="row", disable=not progress, leave=False) as bar:
        bar.set_postfix_str("generate")
        rows = _generate_rows(sm, ids, plan, steer_of, max_new_tokens=max_new_tokens, batch_size=batch_size,
                              batched=batched, bar=bar)
        bar.set_postfix_str("score")
        nll, count, acts = _score_rows(sm, ids, rows, con.probe, batch_size=batch_size, bar=bar)
        bar.set_postfix_str("kl")
        kl = _kl_cells(sm, neutral_ids, steered, steer_of, batch_size=batch_size, batched=batched, bar=bar)

    if con.kind == "probe" and con.probe is not None:
        probe = con.probe
        s = probe.decision_function(torch.stack(acts).float())[:, 0].double()
        scores = (torch.sigmoid(s) if probe.probe_kind == "logistic" else s).tolist()
    elif con.kind == "callable":
        scores = _callable_scores(con.fn, [prompts[p] for p in rows.prompt], rows.texts)
    else:
        scores = [con.substring_score(t) for t in rows.texts]

    by_cell: dict = {}
    for r, c in enumerate(rows.cell):
        by_cell.setdefault(c, []).append(r)

    def summary(rs: list[int]) -> dict:
        sc = [float(scores[r]) for r in rs]
        tok = sum(count[r] for r in rs)
        ppl = math.exp(sum(nll[r] for r in rs) / tok) if tok else None
        rep = float(np.mean([repetition_share(rows.tokens[r], repetition_n) > repetition_bound for r in rs]))
        lo, hi = bootstrap_mean_ci(sc, n_boot=n_boot, alpha=float(alpha), seed=seed)
        return {"generations": [rows.texts[r] for r in rs], "concept": float(np.mean(sc)), "concept_ci": [lo, hi],
                "scores": sc, "perplexity": _finite_or_none(ppl), "repetition": rep}

    baseline = summary(by_cell[None])
    cells = []
    for i, (l, s) in enumerate(grid):
        m = summary(by_cell[i]) if i in by_cell else dict(baseline)
        ppl, bppl = m["perplexity"], baseline["perplexity"]
        ratio = None if ppl is None or bppl is None or bppl == 0 else ppl / bppl
        cells.append({"layer": l, "scale": s, "concept": m["concept"], "concept_ci": m["concept_ci"],
                      "scores": m["scores"], "perplexity": ppl, "ppl_ratio": _finite_or_none(ratio),
                      "kl": kl.get(i, 0.0), "repetition": m["repetition"], "pareto": False,
                      "generations": m["generations"]})
    for c, p in zip(cells, pareto_front(cells)):
        c["pareto"] = p
    settings = {"artifact": src.label, "model": sm.name, "max_new_tokens": max_new_tokens, "batch_size": batch_size,
                "n_boot": n_boot, "alpha": float(alpha), "seed": seed, "normalize": normalize, "chat": chat,
                "repetition_n": repetition_n, "repetition_bound": float(repetition_bound), "concept": con.label,
                "site": src.site, "operation": src.op, "batched": batched,
                "resid_norms": None if resid is None else {str(l): v for l, v in resid.items()}}
    return TuneResult(layers=tuple(layers), scales=tuple(scales), prompts=tuple(prompts), neutral=tuple(neutral),
                      baseline=baseline, cells=tuple(cells), recommended=recommend(cells, rule), rule=rule,
                      concept_kind=con.kind, settings=settings)
