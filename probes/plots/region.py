"""Figures of the concise-reasoning region method (:mod:`steerkit.probes.methods.region`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import plotly.graph_objects as go
from plotly.subplots import make_subplots

if TYPE_CHECKING:
    from ..methods.region import RegionResult

__all__ = ["result_figure"]


def result_figure(res: "RegionResult", *, title: Optional[str] = None) -> go.Figure:
    """Mean generated tokens and accuracy of the training solutions (verbose, concise) and, with an
    evaluation, of the held-out ones (baseline, projected), side by side
    (:meth:`~steerkit.probes.methods.region.RegionResult.plot`).

    Examples:
        >>> from types import SimpleNamespace
        >>> from steerkit.probes.plots.region import result_figure
        >>> res = SimpleNamespace(layer=3, eval=None, train_summary={
        ...     "verbose": {"tokens_mean": 80.0, "accuracy": 0.5}, "concise": {"tokens_mean": 30.0, "accuracy": 0.5}})
        >>> [t.name for t in result_figure(res).data]
        ['tokens', 'accuracy']
    """
    bars = {f"train {s}": res.train_summary[s] for s in ("verbose", "concise") if s in res.train_summary}
    if res.eval is not None:
        bars.update({f"held-out {k}": res.eval[k] for k in ("baseline", "projected") if k in res.eval})
    names = list(bars)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("generated tokens (mean)", "accuracy"))
    fig.add_trace(go.Bar(x=names, y=[bars[k]["tokens_mean"] for k in names], name="tokens"), row=1, col=1)
    fig.add_trace(go.Bar(x=names, y=[bars[k]["accuracy"] for k in names], name="accuracy"), row=1, col=2)
    fig.update_yaxes(range=[0, 1], row=1, col=2)
    fig.update_layout(title=title or f"concise region at layer {res.layer}", showlegend=False)
    return fig
