"""The figure of indirect-object identification (:mod:`steerkit.probes.methods.ioi`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .patching import patching_figure

if TYPE_CHECKING:
    from ..methods.ioi import IOIResult


def ioi_figure(res: "IOIResult", title: Optional[str] = None) -> go.Figure:
    """Two heatmaps side by side: ``resid_pre`` of the first template and ``z`` over every pair (whichever
    were computed) (:meth:`IOIResult.plot`)."""
    grids = ([("resid_pre, template 0", res.resid_pre[0])] if res.resid_pre else []) + \
        ([("z, every pair", res.z)] if res.z is not None else [])
    fig = make_subplots(rows=1, cols=len(grids), subplot_titles=[t for t, _ in grids], horizontal_spacing=0.12)
    for c, (_, g) in enumerate(grids, start=1):
        heatmap = patching_figure(g).data[0]  # the grid's own heatmap (labels and values), on a shared colour axis
        heatmap.update(coloraxis="coloraxis", showscale=None)
        fig.add_trace(heatmap, row=1, col=c)
        fig.update_yaxes(autorange="reversed", type="category", row=1, col=c)
        fig.update_xaxes(type="category", row=1, col=c)
    fig.update_layout(title=title or f"IOI activation patching on {res.model_name or 'the model'} ({len(res.pairs)} "
                      f"pairs; clean logit diff {res.clean_logit_diff:.2f}, corrupted {res.corrupted_logit_diff:.2f})",
                      coloraxis=dict(colorscale="RdBu", cmid=0, colorbar=dict(title="restored")),
                      template="plotly_white", width=1200, height=700)
    return fig
