"""What the refusal method returns: the probe's table (:class:`ProbeResult`), the whole run's result
(:class:`RefusalResult`: JSON report, summary rows, figure, store artifacts) and the direction's two artifacts
(:func:`direction_artifacts`). Figures are drawn by :mod:`steerkit.probes.plots.refusal` (plotly, the ``app``
extra), imported when ``plot()`` is called."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence

from steerkit.vectors import DirectionSet, SteeringVector

from ...plots.require import plotly_required
from .config import RefusalConfig
from .select import Selection
from .steering import ablation_artifact, addition_artifact

if TYPE_CHECKING:
    from steerkit.model import SteerModel

POSITIONS = ("first_generated", "last_prompt")  # where first_token_probe reads the residual stream
LABEL_KINDS = ("prompt", "behaviour")  # the probes' label kinds: the prompt's harm label, the model's own refusal


def finite_json(x: Any) -> Any:
    """``x`` with non-finite floats replaced by ``None`` (JSON has no NaN), in dicts, lists and tuples.

    Examples:
        >>> from steerkit.probes.methods.refusal.result import finite_json
        >>> finite_json({"a": [1.0, float("nan")], "b": (float("inf"), "x")})
        {'a': [1.0, None], 'b': [None, 'x']}
    """
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_json(v) for v in x]
    return x


@dataclass
class ProbeResult:
    """A refusal probe's table (``rows``: per label kind, position and layer), the chosen row (``best``),
    the fitted ``probe`` artifact, the judged generations and notes; ``to_json()`` and ``plot()``.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> rows = [{"labels": "prompt", "position": "last_prompt", "layer": l, "cv_auroc": a, "cv_ci": [a - 0.1, a]}
        ...         for l, a in enumerate([0.6, 0.9, float("nan")])]
        >>> pr = R.ProbeResult(rows, rows[1], probe=None, completions={}, refused={})
        >>> [r["layer"] for r in pr.table(position="last_prompt")], pr.to_json()["rows"][2]["cv_auroc"]
        ([0, 1, 2], None)
        >>> len(pr.plot().data)  # one line: prompt labels at last_prompt
        1
    """
    rows: list[dict]
    best: dict
    probe: Any  # steerkit.vectors.Probe: harmful-vs-harmless at the chosen position and layer
    completions: dict
    refused: dict
    notes: list[str] = field(default_factory=list)

    positions: dict = field(default_factory=dict)  # position name -> {"spec": what scoring records, "token": text}

    def table(self, labels: str = "prompt", position: str = "first_generated") -> list[dict]:
        """The rows of one label kind at one position, in layer order."""
        return [r for r in self.rows if r["labels"] == labels and r["position"] == position]

    def to_json(self) -> dict:
        """The numbers (rows, best, completions, verdicts, notes) as JSON-serialisable values."""
        return finite_json({"best": self.best, "rows": self.rows, "completions": self.completions,
                       "refused": self.refused, "notes": self.notes, "positions": self.positions})

    def plot(self, title: str | None = None) -> Any:
        """A plotly ``Figure``: train CV AUROC (band: bootstrap 95%) per layer, one line per label kind and
        position (:func:`steerkit.probes.plots.refusal.probe_figure`)."""
        with plotly_required():
            from ...plots import refusal as figures
        return figures.probe_figure(self, title=title)


def direction_artifacts(sm: "SteerModel", selection: Selection, *, metrics: dict, prompts: Sequence[str] = (),
                        params: dict | None = None) -> tuple[SteeringVector, DirectionSet]:
    """``(SteeringVector, DirectionSet)``: the unnormalised direction added at
    ``blocks.{layer}.hook_resid_pre``, and its unit vector to ablate everywhere
    (:func:`~steerkit.probes.methods.refusal.steering.addition_artifact`,
    :func:`~steerkit.probes.methods.refusal.steering.ablation_artifact`): what the method evaluates on the
    held-out prompts and what it saves.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> best = R.Candidate(-1, 2, bypass=-4.0, induce=0.5, kl=0.01, status="selected")
        >>> sel = R.Selection(torch.randn(1, 4, 64), [-1], [best], best, baseline_harmful=1.0, baseline_harmless=-2.0)
        >>> sv, ds = R.direction_artifacts(tiny, sel, metrics={"bypass": -4.0})
        >>> sv.hook_name(2), bool(torch.allclose(sv.directions[2], sel.direction)), type(ds).__name__
        ('blocks.2.hook_resid_pre', True, 'DirectionSet')
    """
    b = selection.best
    v = selection.direction.clone()
    p = dict(params or {}, layer=b.layer, position=b.pos)
    return (addition_artifact(sm, v, b.layer, prompts=prompts, metrics=metrics, params=p),
            ablation_artifact(sm, v, prompts=prompts, metrics=metrics, params=p))


@dataclass
class RefusalResult:
    """What :func:`run` returns: the :class:`Selection`, the refusal tokens, the positions, notes,
    metrics and samples, and the probe; ``to_json()``, ``plot()`` and the store ``artifacts(sm)``.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> cfg = R.RefusalConfig(n_train=4, n_val=2, n_test=2, max_new_tokens=4, min_keep=1, probe=False,
        ...                       n_positions=2)
        >>> res = R.run(tiny, cfg, progress=False)
        >>> res.to_json()["positions"], len(res.to_json()["candidates"]), len(res.plot().data)
        ([-2, -1], 8, 3)
        >>> store.save("refusal-direction", res.artifacts(tiny)["refusal-direction"]) is not None
        True
    """
    selection: Selection
    refusal_ids: list[int]
    refusal_tokens: list[str]
    positions: list[int]
    position_tokens: list[str]
    notes: list[str]
    metrics: dict
    samples: dict
    first_tokens: dict
    probe: Optional[ProbeResult] = None
    prompts: dict = field(default_factory=dict)
    config: Optional[RefusalConfig] = None

    def summary_rows(self) -> list[tuple[str, str]]:
        m = self.metrics
        rows = [("selected layer (resid_pre)", str(m["layer"])),
                ("selection rule", "paper (induce >= 0)" if m.get("selection_rule", "paper") == "paper"
                 else "relaxed (induce > baseline; nothing passed induce >= 0)"),
                ("selected position", f"{m['position']} ({m['position_token']!r})"),
                ("bypass score (harmful val, ablated)", f"{m['bypass']:.3f} (baseline {m['baseline_harmful_val']:.3f})"),
                ("induce score (harmless val, added)", f"{m['induce']:.3f} (baseline {m['baseline_harmless_val']:.3f})"),
                ("KL under ablation (harmless val)", f"{m['kl']:.4f}")]
        for k in ("harmful", "harmless"):
            for cond in ("baseline", "ablated", "added"):
                key = f"{k}_test_{cond}"
                if key in m["refusal_rate"]:
                    rows.append((f"refusal rate {k} test, {cond}", f"{m['refusal_rate'][key]:.3f}"))
                if key in m["refusal_score"]:
                    rows.append((f"refusal score {k} test, {cond}", f"{m['refusal_score'][key]:.3f}"))
        return rows

    def to_json(self) -> dict:
        """Every number (metrics, notes, candidate table, samples, probe table) as JSON-serialisable values
        (non-finite floats become ``None``)."""
        pr = self.probe
        return finite_json({
            "metrics": self.metrics, "notes": self.notes + (pr.notes if pr is not None else []),
            "refusal_tokens": self.refusal_tokens, "positions": self.positions,
            "position_tokens": self.position_tokens, "first_tokens_test": self.first_tokens,
            "samples": self.samples, "candidates": [c.as_dict() for c in self.selection.table],
            "probe": None if pr is None else {"best": pr.best, "rows": pr.rows, "positions": pr.positions,
                                              "position": pr.probe.provenance.method_params.get("position"),
                                              "completions": pr.completions, "refused": pr.refused},
        })

    def plot(self, title: str | None = None) -> Any:
        """A plotly ``Figure``: the bypass score (harmful validation prompts, candidate ablated) per layer,
        one line per post-instruction position, and the selected candidate marked
        (:func:`steerkit.probes.plots.refusal.selection_figure`)."""
        with plotly_required():
            from ...plots import refusal as figures
        return figures.selection_figure(self, title=title)

    def artifacts(self, sm: "SteerModel") -> dict:
        """``{store name: artifact}``: ``refusal-direction`` (a ``SteeringVector``), ``refusal-ablation``
        (a ``DirectionSet``) and, with the probe, ``refusal-probe``."""
        cfg = self.config or RefusalConfig()
        prompts = [p for k in ("harmful", "harmless") for p in self.prompts.get("train", {}).get(k, [])]
        params = {"n_train": cfg.n_train, "n_val": cfg.n_val, "n_test": cfg.n_test, "seed": cfg.seed,
                  "refusal_words": list(cfg.refusal_words), "kl_max": cfg.kl_max, "prune_frac": cfg.prune_frac}
        m = {k: v for k, v in self.metrics.items() if k not in ("refusal_ids",)}
        sv, ds = direction_artifacts(sm, self.selection, metrics=finite_json(m), prompts=prompts, params=params)
        out = {"refusal-direction": sv, "refusal-ablation": ds}
        if self.probe is not None:
            out["refusal-probe"] = self.probe.probe
        return out
