"""Figures of mutual information along a generation (:mod:`steerkit.probes.methods.mi`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import plotly.graph_objects as go

if TYPE_CHECKING:
    from ..methods.mi import MIResult, MITrajectory


def _add(fig: go.Figure, tr: "MITrajectory", line: str, peaks: str, *, peaks_legend: bool) -> None:
    fig.add_trace(go.Scatter(y=list(tr.mi), mode="lines", name=line, text=tr.tokens))
    fig.add_trace(go.Scatter(x=tr.peaks, y=[float(tr.mi[p]) for p in tr.peaks], mode="markers+text",
                             text=tr.peak_tokens, textposition="top center", name=peaks, showlegend=peaks_legend))


def mi_figure(trajectories: Sequence["MITrajectory"], layer: int, title: Optional[str] = None, *,
              single: bool = False) -> go.Figure:
    """MI per generation step, one line per trajectory (``question i``; ``single``: one line named MI and its
    peaks in the legend), peaks marked with their tokens."""
    fig = go.Figure()
    for i, tr in enumerate(trajectories):
        _add(fig, tr, "MI" if single else f"question {i}", "peaks" if single else f"peaks {i}", peaks_legend=single)
    fig.update_layout(title=title or f"MI per generation step (layer {layer})", xaxis_title="step",
                      yaxis_title="MI (HSIC)")
    return fig


def trajectory_figure(tr: "MITrajectory", title: Optional[str] = None) -> go.Figure:
    """One trajectory's MI per step, peaks marked with their tokens (:meth:`MITrajectory.plot`)."""
    return mi_figure([tr], tr.layer, title, single=True)


def result_figure(res: "MIResult", title: Optional[str] = None) -> go.Figure:
    """Every question's trajectory (:meth:`MIResult.plot`)."""
    return mi_figure(res.trajectories, res.layer, title)
