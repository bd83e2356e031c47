"""The figure of the hidden critique vector (:mod:`steerkit.probes.methods.critique`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import plotly.graph_objects as go

from .lines import line_per_layer

if TYPE_CHECKING:
    from ..methods.critique import CritiqueResult


def f1_figure(res: "CritiqueResult", title: Optional[str] = None) -> go.Figure:
    """Error-detection F1 against alpha, one line per layer (:meth:`CritiqueResult.plot`)."""
    return line_per_layer(res.rows, res.layers, "alpha", "f1",
                          title=title or f"error-detection F1 vs alpha ({res.contrast} contrast)",
                          x_title="alpha", y_title="F1", y_range=[0, 1])
