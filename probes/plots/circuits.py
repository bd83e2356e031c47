"""The figures of attribution graphs over many prompts (:mod:`steerkit.probes.attribution_batch`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import plotly.graph_objects as go

if TYPE_CHECKING:
    from ..attribution_batch import AttributionGraphs


def recurring_figure(res: "AttributionGraphs", *, top: int = 30, min_prompts: int = 1,
                     title: Optional[str] = None) -> go.Figure:
    """Bars of the ``top`` features kept in the most prompts' pruned graphs (at least ``min_prompts``), one bar a
    feature (``L{block} F{index}``), its height the number of prompts, its colour the mean influence
    (:meth:`AttributionGraphs.plot`)."""
    feats = res.recurring(min_prompts)[:top]
    names = [f"L{f.layer} F{f.feature}" for f in feats]
    fig = go.Figure(go.Bar(x=names, y=[f.n_prompts for f in feats],
                           marker=dict(color=[f.mean_influence for f in feats], colorscale="Viridis",
                                       colorbar=dict(title="mean influence")),
                           customdata=[f.mean_influence for f in feats],
                           hovertemplate="%{x}: %{y} prompts, mean influence %{customdata:.4g}<extra></extra>"))
    fig.update_layout(title=title or f"features kept in the pruned graphs of {len(res.graphs)} prompts",
                      xaxis_title="feature (block, index)", yaxis_title="prompts", xaxis=dict(type="category"),
                      template="plotly_white")
    return fig
