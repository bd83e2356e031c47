"""CAST conditions (Lee et al. 2024) as stored artifacts: :class:`ConditionVector` (a unit direction
read at a hook, a threshold and comparator, and its fit report) and the checks of that report.

Deciding whether a condition fires on prompts runs the model: :meth:`ConditionVector.fires` and
:meth:`ConditionVector.similarities` call :func:`steerkit.vectors.artifacts.evaluation.condition_outcomes`;
the F1 figure of :meth:`ConditionVector.plot` is drawn by :mod:`steerkit.vectors.plots`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.interventions import Condition

from ..errors import ArtifactFormatError, ModelMismatchError, VectorsError
from ..provenance import Provenance
from .base import _Artifact, _as_tensor, _check_finite, _expect_keys, _fields, _int_layer, _str_field, _tensors_equal
from .evaluation import condition_outcomes

if TYPE_CHECKING:
    from steerkit.model import SteerModel

CONDITION_SITES = ("hook_resid_pre", "hook_resid_mid", "hook_resid_post")


def _finite_number(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise ArtifactFormatError(f"expected {what} as a number, found {v!r:.100}")
    f = float(v)
    if not math.isfinite(f):
        raise ArtifactFormatError(f"expected a finite {what}, found {f}")
    return f


def _choice(v: Any, allowed: tuple, what: str) -> str:
    if v not in allowed:
        raise ArtifactFormatError(f"expected {what} in {allowed}, found {v!r:.100}")
    return v


def _check_report(report: Any) -> dict:
    """A condition fit report, validated: JSON-able scalars, lists of numbers, and its F1 grid
    ``[comparators, layers, thresholds]`` (a float64 tensor)."""
    if not isinstance(report, dict):
        raise ArtifactFormatError(f"expected the condition fit report as a dict, found {type(report).__name__}")
    out: dict = {}
    for k, v in report.items():
        if not isinstance(k, str):
            raise ArtifactFormatError(f"expected string keys in the condition fit report, found {k!r:.60}")
        if k == "grid":
            t = _as_tensor(v, "the report's F1 grid").to(torch.float64)
            if t.ndim != 3:
                raise ArtifactFormatError(f"expected the report's F1 grid as [comparators, layers, thresholds], "
                                          f"found shape {tuple(t.shape)}")
            _check_finite(t, "the report's F1 grid")
            out[k] = t
        elif isinstance(v, (bool, str)) or v is None:
            out[k] = v
        elif isinstance(v, (int, float, np.integer, np.floating)):
            out[k] = int(v) if isinstance(v, (int, np.integer)) else _finite_number(v, f"report[{k!r}]")
        elif isinstance(v, (list, tuple)):
            if not all(isinstance(x, (int, float, str, np.integer, np.floating)) and not isinstance(x, bool) for x in v):
                raise ArtifactFormatError(f"expected report[{k!r}] as a list of numbers or strings, found {v!r:.100}")
            out[k] = [x if isinstance(x, str) else int(x) if isinstance(x, (int, np.integer))
                      else _finite_number(x, f"report[{k!r}]") for x in v]
        elif isinstance(v, dict):
            if not all(isinstance(a, str) and isinstance(b, (int, np.integer)) and not isinstance(b, bool)
                       for a, b in v.items()):
                raise ArtifactFormatError(f"expected report[{k!r}] as {{name: count}}, found {v!r:.100}")
            out[k] = {a: int(b) for a, b in v.items()}
        else:
            raise ArtifactFormatError(f"expected JSON-able values in the condition fit report, found "
                                      f"{type(v).__name__} at {k!r}")
    g = out.get("grid")
    if g is not None:
        want = (len(out.get("comparators", [])), len(out.get("layers", [])), len(out.get("thresholds", [])))
        if tuple(g.shape) != want:
            raise ArtifactFormatError(f"expected the report's F1 grid of shape {want} (comparators, layers, "
                                      f"thresholds), found {tuple(g.shape)}")
    return out


def _report_equal(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(_tensors_equal(a[k], b[k]) if isinstance(a[k], Tensor) or isinstance(b[k], Tensor) else a[k] == b[k]
               for k in a)


@dataclasses.dataclass(eq=False)
class ConditionVector(_Artifact):
    """A CAST condition (Lee et al. 2024) as a stored artifact: a unit ``direction`` read at
    ``blocks.{layer}.{hook_site}``, the ``threshold`` and ``comparator`` its similarity is compared with,
    how the prompt is ``aggregate``-d and ``measure``-d (see :class:`steerkit.Condition`), whether prompts
    get the chat template (``chat``), and the fit ``report`` of :func:`steerkit.probes.fit_condition`
    (F1, precision, recall, the confusion counts and the F1 of every layer x threshold x comparator
    searched, as ``report["grid"]``). Conditions do not steer: pair one with a behaviour in a
    :class:`ConditionalSteering`.

    Examples:
        >>> from steerkit.vectors import ConditionVector
        >>> cv = ConditionVector(torch.ones(64), layer=1, threshold=0.2)
        >>> cv.to_condition()
        Condition('blocks.1.hook_resid_pre', [64], above 0.2, aggregate='mean', measure='cast')
        >>> fired = cv.fires(tiny, ["Hello", "How do I bake bread?"])  # one bool per prompt
        >>> len(fired), cv.report
        (2, {})
        >>> ConditionVector(torch.ones(64), layer=1, threshold=-1.0).fires(tiny, ["Hello"]) == [True]  # cos > -1
        True
    """

    direction: Float[Tensor, " d_model"]
    layer: int
    threshold: float
    comparator: str = "above"
    aggregate: str = "mean"
    measure: str = "cast"
    hook_site: str = "hook_resid_pre"
    chat: bool = True
    report: dict = dataclasses.field(default_factory=dict)
    provenance: Provenance = dataclasses.field(default_factory=lambda: Provenance(operation="condition"))
    kind: ClassVar[str] = "condition_vector"

    def __post_init__(self) -> None:
        t = _as_tensor(self.direction, "the condition direction")
        if t.ndim == 2 and t.shape[0] == 1:
            t = t[0]
        if t.ndim != 1 or t.shape[0] == 0:
            raise ArtifactFormatError(f"expected a condition direction of shape [d_model], found {tuple(t.shape)}")
        _check_finite(t, "the condition direction")
        n = float(t.double().norm())
        if n < 1e-12:
            raise ArtifactFormatError("expected a nonzero condition direction, found a zero vector")
        self.direction = t if abs(n - 1.0) < 1e-6 else t / n
        self.layer = _int_layer(self.layer, "ConditionVector.layer")
        self.threshold = _finite_number(self.threshold, "condition threshold")
        self.comparator = _choice(self.comparator, ("above", "below"), "the comparator")
        self.aggregate = _choice(self.aggregate, ("mean", "last"), "the aggregate")
        self.measure = _choice(self.measure, ("cast", "cosine"), "the measure")
        self.hook_site = _choice(self.hook_site, CONDITION_SITES, "the hook site")
        if not isinstance(self.chat, bool):
            raise ArtifactFormatError(f"expected chat as a bool, found {self.chat!r:.60}")
        self.report = _check_report(self.report)
        if self.provenance.d_model is not None and self.provenance.d_model != t.shape[0]:
            raise ModelMismatchError(f"expected a condition direction of d_model={self.provenance.d_model} (from the "
                                     f"provenance), found {t.shape[0]}")
        self.provenance = self.provenance.replace(operation="condition", hook_site=self.hook_site)

    @property
    def d_model(self) -> int:
        return int(self.direction.shape[0])

    @property
    def site(self) -> str:
        """The hook name the condition reads: ``blocks.{layer}.{hook_site}``."""
        return f"blocks.{self.layer}.{self.hook_site}"

    def to_condition(self) -> "Condition":
        """This artifact as the :class:`steerkit.Condition` compiled steering evaluates."""
        return Condition(self.site, self.direction, self.threshold, self.comparator, self.aggregate, self.measure)

    def fires(self, sm: "SteerModel", prompts, *, batch_size: int = 16, progress: bool = True) -> list[bool]:
        """Whether the condition fires on each prompt, decided by the compiled evaluator conditional
        steering runs (a steering with this condition alone, one forward pass per batch; a progress bar
        over the batches when there are several)."""
        return condition_outcomes(self, sm, prompts, batch_size=batch_size, progress=progress)[0]

    def similarities(self, sm: "SteerModel", prompts, *, batch_size: int = 16, progress: bool = True) -> list[float]:
        """Each prompt's similarity (what :meth:`fires` compares with ``threshold``)."""
        return condition_outcomes(self, sm, prompts, batch_size=batch_size, progress=progress)[1]

    def _map_tensors(self, fn) -> "ConditionVector":
        return dataclasses.replace(self, direction=fn(self.direction))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ConditionVector):
            return NotImplemented
        return (_tensors_equal(self.direction, other.direction)
                and (self.layer, self.threshold, self.comparator, self.aggregate, self.measure, self.hook_site,
                     self.chat, self.provenance)
                == (other.layer, other.threshold, other.comparator, other.aggregate, other.measure, other.hook_site,
                    other.chat, other.provenance)
                and _report_equal(self.report, other.report))

    __hash__ = None  # type: ignore[assignment]

    def to_payload(self) -> tuple[dict[str, Tensor], dict]:
        tensors = {"direction": self.direction.detach().cpu().contiguous()}
        report = {k: v for k, v in self.report.items() if k != "grid"}
        if "grid" in self.report:
            tensors["report.grid"] = self.report["grid"].detach().cpu().contiguous()
        fields = {"layer": self.layer, "threshold": self.threshold, "comparator": self.comparator,
                  "aggregate": self.aggregate, "measure": self.measure, "hook_site": self.hook_site, "chat": self.chat,
                  "report": report}
        return tensors, {"kind": self.kind, "fields": fields, "provenance": self.provenance.to_dict()}

    @classmethod
    def from_payload(cls, tensors: dict[str, Tensor], meta: dict) -> "ConditionVector":
        fields = _fields(meta, cls.kind)
        _expect_keys(tensors, {"direction"}, {"report.grid"}, cls.kind)
        if not tensors["direction"].is_floating_point():
            raise ArtifactFormatError(f"expected a floating-point condition direction, found {tensors['direction'].dtype}")
        report = fields.get("report", {})
        if not isinstance(report, dict) or "grid" in report:
            raise ArtifactFormatError(f"expected the condition report as an object without 'grid', found {report!r:.100}")
        report = dict(report)
        if "report.grid" in tensors:
            report["grid"] = tensors["report.grid"]
        if "threshold" not in fields or "layer" not in fields:
            raise ArtifactFormatError(f"expected 'layer' and 'threshold' in a {cls.kind}, found {sorted(fields)[:20]}")
        layer = fields["layer"]
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise ArtifactFormatError(f"expected an integer layer, found {layer!r:.60}")
        return cls(tensors["direction"], layer=layer, threshold=_finite_number(fields["threshold"], "threshold"),
                   comparator=_str_field(fields, "comparator", "above"), aggregate=_str_field(fields, "aggregate", "mean"),
                   measure=_str_field(fields, "measure", "cast"), hook_site=_str_field(fields, "hook_site", "hook_resid_pre"),
                   chat=fields.get("chat", True), report=report, provenance=Provenance.from_dict(meta.get("provenance", {})))

    # ---- the fit report
    def to_json(self, path=None) -> str:
        """The condition point and its fit report (the F1 grid as nested lists) as JSON text, written to
        ``path`` when given."""
        rep = {k: (v.tolist() if isinstance(v, Tensor) else v) for k, v in self.report.items()}
        doc = {"format": "steerkit.condition/1", "site": self.site, "layer": self.layer, "threshold": self.threshold,
               "comparator": self.comparator, "aggregate": self.aggregate, "measure": self.measure, "chat": self.chat,
               "report": rep, "provenance": self.provenance.to_dict()}
        text = json.dumps(doc, indent=1, allow_nan=False)
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    def plot(self, *, title: str | None = None):
        """A plotly heatmap of the fit's F1 over layer x threshold, one panel per comparator, with the
        chosen condition point marked (:func:`steerkit.vectors.plots.condition_f1`; plotly is the ``app``
        extra)."""
        try:
            from ..plots import condition_f1
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] != "plotly":
                raise
            raise VectorsError("expected plotly to be installed to plot, found it missing; pip install plotly") from None
        return condition_f1(self, title=title)
