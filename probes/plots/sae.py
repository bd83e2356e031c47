"""Figures of a sparse autoencoder's latents (:mod:`steerkit.probes.sae_features`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import plotly.graph_objects as go
from plotly.subplots import make_subplots

if TYPE_CHECKING:
    from ..sae_features import FeatureReport, LatentAttribution


def feature_figure(rep: "FeatureReport", *, title: Optional[str] = None) -> go.Figure:
    """Three panels: the histogram of the latent's nonzero activations, its logit effects (the top and
    bottom tokens) and its nearest latents by decoder cosine (:meth:`FeatureReport.plot`)."""
    fig = make_subplots(rows=1, cols=3, subplot_titles=(f"activations (density {rep.density:.3g})",
                                                        "logit effect (W_U @ W_dec)", "nearest latents (cosine)"))
    fig.add_trace(go.Histogram(x=rep.values.tolist(), nbinsx=40, name="activation", showlegend=False), 1, 1)
    logits = rep.bottom_logits[::-1] + rep.top_logits[::-1]
    fig.add_trace(go.Bar(x=[v for _, v in logits], y=[f"{t!r}" for t, _ in logits], orientation="h",
                         marker_color=["#c0392b" if v < 0 else "#2471a3" for _, v in logits], showlegend=False),
                  1, 2)
    fig.add_trace(go.Bar(x=[c for _, c in rep.neighbours[::-1]], y=[f"#{i}" for i, _ in rep.neighbours[::-1]],
                         orientation="h", showlegend=False), 1, 3)
    fig.update_layout(title=title or f"latent {rep.latent} at {rep.site}", template="plotly_white", height=420,
                      bargap=0.15)
    fig.update_yaxes(type="category", row=1, col=2)
    fig.update_yaxes(type="category", row=1, col=3)
    return fig


def attribution_figure(res: "LatentAttribution", *, title: Optional[str] = None) -> go.Figure:
    """Attribution (x) against activation patching (y) for the checked latents, one point each, with the
    line y = x (:meth:`LatentAttribution.plot`)."""
    x = [float(res.values[i]) for i in res.checked]
    y = res.patching
    lim = max([abs(v) for v in x + y] + [1e-9])
    fig = go.Figure(go.Scatter(x=x, y=y, mode="markers+text", text=[f"#{i}" for i in res.checked],
                               textposition="top center", name="latent"))
    fig.add_trace(go.Scatter(x=[-lim, lim], y=[-lim, lim], mode="lines", line=dict(dash="dot", color="grey"),
                             name="y = x"))
    r = "" if res.pearson_r is None else f" (Pearson r {res.pearson_r:.2f})"
    fig.update_layout(title=title or f"latent attribution vs patching{r}", xaxis_title="attribution (predicted change)",
                      yaxis_title="activation patching (change)", template="plotly_white")
    return fig
