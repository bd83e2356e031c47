"""Figures of the refusal method (:mod:`steerkit.probes.methods.refusal`): the bypass score of every candidate
direction, and the refusal probe's cross-validated AUROC per layer."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import plotly.graph_objects as go

from ..methods.refusal.result import LABEL_KINDS

if TYPE_CHECKING:
    from ..methods.refusal.result import ProbeResult, RefusalResult


def selection_figure(res: "RefusalResult", *, title: Optional[str] = None) -> go.Figure:
    """The bypass score (harmful validation prompts, candidate ablated) per layer, one line per post-instruction
    position, the selected candidate marked and the baseline harmful score dotted (:meth:`RefusalResult.plot`)."""
    fig = go.Figure()
    for p, tok in zip(res.positions, res.position_tokens):
        cs = sorted((c for c in res.selection.table if c.pos == p and not math.isnan(c.bypass)),
                    key=lambda c: c.layer)
        fig.add_trace(go.Scatter(x=[c.layer for c in cs], y=[c.bypass for c in cs], mode="lines+markers",
                                 name=f"position {p} ({tok!r})"))
    b = res.selection.best
    fig.add_trace(go.Scatter(x=[b.layer], y=[b.bypass], mode="markers", name="selected",
                             marker={"size": 14, "symbol": "star"}))
    fig.add_hline(y=res.selection.baseline_harmful, line_dash="dot", annotation_text="baseline harmful score")
    fig.update_layout(title=title or "refusal direction: bypass score per candidate",
                      xaxis_title="layer (resid_pre)", yaxis_title="mean refusal score, ablated")
    return fig


def probe_figure(res: "ProbeResult", *, title: Optional[str] = None) -> go.Figure:
    """Train CV AUROC (error bars: bootstrap 95%) per layer, one line per label kind and position
    (:meth:`ProbeResult.plot`)."""
    fig = go.Figure()
    for kind in LABEL_KINDS:
        for pos in dict.fromkeys(r["position"] for r in res.rows):
            rs = sorted(res.table(kind, pos), key=lambda r: r["layer"])
            if rs:
                fig.add_trace(go.Scatter(x=[r["layer"] for r in rs], y=[r["cv_auroc"] for r in rs],
                                         mode="lines+markers", name=f"{kind} labels, {pos}",
                                         error_y={"type": "data", "symmetric": False,
                                                  "array": [r["cv_ci"][1] - r["cv_auroc"] for r in rs],
                                                  "arrayminus": [r["cv_auroc"] - r["cv_ci"][0] for r in rs]}))
    fig.update_layout(title=title or "refusal probe: train CV AUROC per layer and position",
                      xaxis_title="layer", yaxis_title="AUROC", yaxis_range=[0, 1.05])
    return fig
