"""The loss curve of a trained steering vector (:mod:`steerkit.probes.train`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import plotly.graph_objects as go

if TYPE_CHECKING:
    from ..train import TrainResult


def loss_figure(res: "TrainResult", title: Optional[str] = None) -> go.Figure:
    """The loss of every step and the mean of each epoch (:meth:`TrainResult.plot`)."""
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=[r["step"] for r in res.history], y=res.losses, mode="lines",
                             name="step loss", opacity=0.5))
    ends = {}
    for r in res.history:
        ends[r["epoch"]] = r["step"]
    fig.add_trace(go.Scatter(x=[ends[e] for e in sorted(ends)], y=res.epoch_losses(), mode="lines+markers",
                             name="epoch mean"))
    fig.update_layout(title=title or f"{res.method} training loss (layer {res.layer})", xaxis_title="step",
                      yaxis_title="loss")
    return fig
