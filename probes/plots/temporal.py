"""Figures of the temporal divergence profile (:mod:`steerkit.probes.methods.temporal`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import plotly.graph_objects as go

if TYPE_CHECKING:
    from ..methods.temporal import Profile

__all__ = ["profile_figure"]


def profile_figure(prof: "Profile", *, title: Optional[str] = None) -> go.Figure:
    """``rel_l`` with a +-1 std band, ``cos_l`` on a second axis, the peak layer marked
    (:meth:`~steerkit.probes.methods.temporal.Profile.plot`).

    Examples:
        >>> from steerkit.probes.methods.temporal import profile_from_states
        >>> from steerkit.probes.plots.temporal import profile_figure
        >>> prof = profile_from_states(torch.ones(3, 2, 4), torch.ones(3, 2, 4) * 0.5)
        >>> [t.name for t in profile_figure(prof).data]
        ['+-1 std', 'rel = ||tau|| / ||h||', 'cos(h(x), h(x_rev))']
    """
    x = list(range(prof.n_layers))
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x + x[::-1], y=list(prof.rel + prof.rel_std) + list((prof.rel - prof.rel_std)[::-1]),
                             fill="toself", line=dict(width=0), opacity=0.2, name="+-1 std", hoverinfo="skip"))
    fig.add_trace(go.Scatter(x=x, y=list(prof.rel), mode="lines+markers", name="rel = ||tau|| / ||h||"))
    fig.add_trace(go.Scatter(x=x, y=list(prof.cos), mode="lines", name="cos(h(x), h(x_rev))", yaxis="y2"))
    fig.add_vline(x=prof.peak_layer, line_dash="dash", line_color="gray")
    fig.update_layout(title=title or f"temporal divergence (n={prof.n_pairs}, peak layer {prof.peak_layer})",
                      xaxis_title="layer", yaxis_title="rel", yaxis2=dict(title="cos", overlaying="y", side="right"))
    return fig
