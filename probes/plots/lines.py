"""Line figures shared by several methods' plots: one line per layer of a sweep's rows."""
from __future__ import annotations

from typing import Optional

import plotly.graph_objects as go


def line_per_layer(rows: list, layers, x: str, y: str, *, title: str, x_title: str, y_title: str,
                   y_range: Optional[list] = None) -> go.Figure:
    """One line per layer of ``rows`` (dicts with ``"layer"``, ``x`` and ``y``), sorted by ``x``."""
    fig = go.Figure()
    for l in layers:
        rs = sorted((r for r in rows if r["layer"] == l), key=lambda r: r[x])
        fig.add_trace(go.Scatter(x=[r[x] for r in rs], y=[r[y] for r in rs], mode="lines+markers",
                                 name=f"layer {l}"))
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title=y_title, yaxis_range=y_range)
    return fig
