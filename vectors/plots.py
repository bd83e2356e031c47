"""Figures of the steering artifacts (plotly, the ``app`` extra, imported here at the top).

Nothing else in :mod:`steerkit.vectors` imports plotly: an artifact's ``plot()`` imports this module
when it is called.

* :func:`condition_f1` -- a CAST condition's fit: F1 over layer x threshold, one panel per comparator,
  the chosen condition point marked (:meth:`steerkit.vectors.ConditionVector.plot`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .errors import VectorsError

if TYPE_CHECKING:
    from .artifacts import ConditionVector


def condition_f1(cv: "ConditionVector", *, title: str | None = None) -> go.Figure:
    """A heatmap of ``cv.report``'s F1 grid over layer x threshold, one panel per comparator, with the
    chosen condition point (``cv.layer``, ``cv.threshold``) marked on its comparator's panel.

    Examples:
        >>> from steerkit.vectors import ConditionVector
        >>> from steerkit.vectors.plots import condition_f1
        >>> report = {"comparators": ["above"], "layers": [1, 2], "thresholds": [0.1, 0.2, 0.3],
        ...           "grid": torch.rand(1, 2, 3), "f1": 0.5}
        >>> fig = condition_f1(ConditionVector(torch.ones(64), layer=1, threshold=0.2, report=report))
        >>> [t.type for t in fig.data], fig.layout.title.text
        (['heatmap', 'scatter'], 'condition point: layer 1, above 0.2, F1 0.500')
    """
    grid = cv.report.get("grid")
    if grid is None:
        raise VectorsError("expected a fit report with an F1 grid to plot, found none; fit the condition with "
                           "steerkit.probes.fit_condition")
    comps, layers, thr = cv.report["comparators"], cv.report["layers"], cv.report["thresholds"]
    fig = make_subplots(rows=1, cols=len(comps), subplot_titles=[f"fires when {c}" for c in comps],
                        shared_yaxes=True)
    for i, c in enumerate(comps):
        fig.add_trace(go.Heatmap(z=grid[i].tolist(), x=[round(t, 4) for t in thr], y=layers, zmin=0, zmax=1,
                                 colorscale="Viridis", coloraxis="coloraxis", name=c,
                                 hovertemplate="layer %{y}<br>threshold %{x}<br>F1 %{z:.3f}<extra></extra>"),
                      row=1, col=i + 1)
        if c == cv.comparator:
            fig.add_trace(go.Scatter(x=[cv.threshold], y=[cv.layer], mode="markers", name="chosen",
                                     marker=dict(symbol="x", size=12, color="red")), row=1, col=i + 1)
        fig.update_xaxes(title_text="threshold", row=1, col=i + 1)
    fig.update_yaxes(title_text="layer", row=1, col=1)
    f1 = cv.report.get("f1")
    fig.update_layout(coloraxis=dict(colorscale="Viridis", cmin=0, cmax=1, colorbar=dict(title="F1")),
                      title=title or f"condition point: layer {cv.layer}, {cv.comparator} {cv.threshold:.4g}"
                      + (f", F1 {f1:.3f}" if isinstance(f1, float) else ""))
    return fig
