"""The plotly figure of a probe sweep (:mod:`steerkit.probes.sweep`); :mod:`.sweep_matplotlib` draws the
same figure where plotly is missing."""
from __future__ import annotations

from typing import TYPE_CHECKING

import plotly.graph_objects as go

if TYPE_CHECKING:
    from ..sweep import SweepResult


def sweep_figure(res: "SweepResult", metric: str = "auroc", *, title: str) -> go.Figure:
    """``metric`` per layer, one line per position and method, with the AUROC's confidence band
    (:meth:`SweepResult.plot`)."""
    fig = go.Figure()
    for (pos, m), rs in res.series().items():
        x = [r["layer"] for r in rs]
        name = f"{m} @ {pos}"
        if metric == "auroc":
            fig.add_trace(go.Scatter(x=x + x[::-1], y=[r["auroc_ci_high"] for r in rs]
                                     + [r["auroc_ci_low"] for r in rs][::-1], fill="toself",
                                     opacity=0.2, line=dict(width=0), showlegend=False,
                                     hoverinfo="skip", legendgroup=name))
        fig.add_trace(go.Scatter(x=x, y=[r[metric] for r in rs], mode="lines+markers", name=name,
                                 legendgroup=name))
    fig.update_layout(title=title, xaxis_title="layer", yaxis_title=metric, template="plotly_white")
    return fig
