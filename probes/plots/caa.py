"""The figure of contrastive activation addition (:mod:`steerkit.probes.methods.caa`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import plotly.graph_objects as go

from .lines import line_per_layer

if TYPE_CHECKING:
    from ..methods.caa import CAAResult


def caa_figure(res: "CAAResult", title: Optional[str] = None) -> go.Figure:
    """p(matching letter) against the multiplier, one line per layer (:meth:`CAAResult.plot`)."""
    return line_per_layer(res.rows, res.layers, "multiplier", "p_matching",
                          title=title or f"CAA: p(matching) vs multiplier ({res.n_items} A/B items)",
                          x_title="multiplier", y_title="p(matching letter)", y_range=[0, 1])
