"""The heatmap of an activation / attribution patching grid (:mod:`steerkit.probes.patching`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import plotly.graph_objects as go

if TYPE_CHECKING:
    from ..patching import PatchingResult


def patching_figure(res: "PatchingResult", *, title: Optional[str] = None) -> go.Figure:
    """A diverging heatmap centred at 0: layers down, positions (with their tokens) or heads across; rows
    ``L{l}H{h}`` by positions for ``z_pos`` (:meth:`PatchingResult.plot`)."""
    x, y, z = res.labelled_grid()
    what = "restored fraction" if res.is_normalized else "metric"
    fig = go.Figure(go.Heatmap(z=z.float().tolist(), x=x, y=y, colorscale="RdBu", zmid=0,
                               colorbar=dict(title=what),
                               hovertemplate="%{y} %{x}: %{z:.4g}<extra></extra>"))
    xt = {"pos": "position", "head": "head", "neuron": "neuron"}[res.axes[-1] if res.hook != "z_pos" else "pos"]
    fig.update_layout(title=title or f"{res.method} patching of {res.hook} ({what}; clean "
                      f"{res.clean_metric:.3g}, corrupted {res.corrupted_metric:.3g})",
                      xaxis_title=xt, yaxis_title="layer" if res.hook != "z_pos" else "layer, head",
                      yaxis=dict(autorange="reversed", type="category"), xaxis=dict(type="category"),
                      template="plotly_white")
    return fig
