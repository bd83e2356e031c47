"""What :func:`steerkit.probes.tune` measured, and how a cell is picked: the result, its JSON, the
Pareto front and the rule.

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

Cells are layer-major (every scale of the first layer, then the next layer). The figures of such a
document are in :mod:`steerkit.probes.plots.tune` (:func:`~steerkit.probes.plots.tune.tradeoff_figure`,
:func:`~steerkit.probes.plots.tune.heatmap_figure`; the app's Tune page uses them);
:meth:`TuneResult.plot` is the trade-off figure.
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

import numpy as np

from steerkit.errors import InputError

from .patching import json_document

__all__ = ["TuneResult", "Rule", "pareto_front", "recommend", "repetition_share", "bootstrap_mean_ci",
           "tune_document", "damage_value", "FORMAT", "METRICS", "DAMAGES", "OBJECTIVES"]

FORMAT = "steerkit.tune/1"
#: the per-cell metrics (keys of every cell of a result), as :func:`steerkit.probes.plots.tune.heatmap_figure`
#: takes them
METRICS = ("concept", "perplexity", "ppl_ratio", "kl", "repetition")
#: the damage metrics: lower is better; the Pareto front and the trade-off figure read them
DAMAGES = ("kl", "perplexity", "repetition")
OBJECTIVES = ("concept", "concept_lo")


# ----------------------------------------------------------------------------- small checks
def _is_num(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _finite_or_none(x) -> Optional[float]:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def damage_value(x) -> float:
    """A damage value for comparisons: ``None`` is infinitely bad.

    Examples:
        >>> from steerkit.probes.tune_result import damage_value
        >>> damage_value(0.25), damage_value(None)
        (0.25, inf)
    """
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
        >>> from steerkit.probes.tune_result import Rule
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
            if bound is not None and not damage_value(cell.get(key)) <= bound:
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
        >>> from steerkit.probes.tune_result import pareto_front
        >>> cells = [dict(concept=0.1, kl=0.0, perplexity=5.0, repetition=0.0),
        ...          dict(concept=0.5, kl=0.2, perplexity=6.0, repetition=0.0),
        ...          dict(concept=0.4, kl=0.3, perplexity=7.0, repetition=0.0)]
        >>> pareto_front(cells)
        [True, True, False]
    """
    pts = [(float(c["concept"]), [damage_value(c.get(d)) for d in damages]) for c in cells]
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
        >>> from steerkit.probes.tune_result import recommend
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
    best = min(ok, key=lambda c: (-rule.value(c), abs(float(c["scale"])), damage_value(c.get("kl")), int(c["layer"])))
    return {"layer": int(best["layer"]), "scale": float(best["scale"])}


def repetition_share(tokens: Sequence[int], n: int = 3) -> float:
    """The repeated n-gram share of a token sequence: ``1 - distinct n-grams / n-grams`` (0 when it has
    no n-gram).

    Examples:
        >>> from steerkit.probes.tune_result import repetition_share
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
        >>> from steerkit.probes.tune_result import bootstrap_mean_ci
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
        >>> from steerkit.probes.tune_result import TuneResult
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
        d = tune_document(doc)
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
        """The trade-off figure (:func:`steerkit.probes.plots.tune.tradeoff_figure`): concept against
        ``damage`` per layer across scales (plotly, the ``app`` extra, is imported here).

        Examples:
            >>> from steerkit.probes.tune_result import TuneResult
            >>> fig = TuneResult.example().plot()
            >>> fig.layout.xaxis.title.text
            'kl (next-token KL on neutral prompts, nats)'
        """
        from .plots.tune import tradeoff_figure
        return tradeoff_figure(self.to_json(), damage=damage)


def tune_document(doc) -> dict:
    """A tune document: the dict itself, its JSON text, a path to it, or a :class:`TuneResult`.

    Examples:
        >>> from steerkit.probes.tune_result import FORMAT, tune_document
        >>> doc = {"format": FORMAT, "layers": [3], "scales": [4.0], "cells": [], "baseline": {}}
        >>> tune_document(doc) == doc
        True
        >>> try:
        ...     tune_document({"format": "other"})
        ... except ValueError as e:
        ...     print(str(e)[:40])
        expected a steerkit tune document (forma
    """
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
