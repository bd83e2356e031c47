"""Figures of residual norms and attention drift (:mod:`steerkit.probes.methods.norms`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

if TYPE_CHECKING:
    from ..methods.norms import AttentionDrift, NormChain, NormProfile


def profile_figure(prof: "NormProfile", title: Optional[str] = None) -> go.Figure:
    """The per-layer norms, log scale (:meth:`NormProfile.plot`)."""
    x = list(range(prof.n_layers))
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=list(prof.mean), mode="lines+markers", name="all tokens",
                             error_y=dict(type="data", array=list(prof.std))))
    fig.add_trace(go.Scatter(x=x, y=list(prof.mean_no_first), mode="lines", name="without first token"))
    fig.add_trace(go.Scatter(x=x, y=list(prof.first), mode="lines", line_dash="dot", name="first token"))
    fig.update_layout(title=title or f"residual norm per layer ({prof.n_tokens} tokens)", xaxis_title="layer",
                      yaxis_title="||h||", yaxis_type="log")
    return fig


def drift_figure(drift: "AttentionDrift", layers: Optional[Sequence[int]] = None,
                 title: Optional[str] = None) -> go.Figure:
    """Sink / prompt / recent / generated mass per step for a few layers (top), and the sink mass and the
    newest token's norm as layer x step heatmaps (bottom) (:meth:`AttentionDrift.plot`)."""
    L = drift.n_layers
    layers = list(layers) if layers is not None else sorted({0, L // 3, (2 * L) // 3, L - 1})
    fig = make_subplots(rows=2, cols=2, specs=[[{"colspan": 2}, None], [{}, {}]], vertical_spacing=0.15,
                        subplot_titles=("attention mass per step", "sink mass (layer x step)",
                                        "||h|| at the newest token (layer x step)"))
    steps = list(range(drift.n_steps))
    dash = {"sink": "solid", "prompt": "dot", "recent": "dash", "generated": "dashdot"}
    for l in layers:
        for part in ("sink", "prompt", "recent", "generated"):
            fig.add_trace(go.Scatter(x=steps, y=list(getattr(drift, part)[l]), mode="lines",
                                     line_dash=dash[part], name=f"L{l} {part}", legendgroup=f"L{l}"),
                          row=1, col=1)
    fig.add_trace(go.Heatmap(z=drift.sink.tolist(), x=steps, colorscale="Viridis", showscale=False),
                  row=2, col=1)
    fig.add_trace(go.Heatmap(z=np.log10(np.maximum(drift.norm, 1e-6)).tolist(), x=steps, colorscale="Magma",
                             colorbar=dict(title="log10 ||h||", len=0.4, y=0.2)), row=2, col=2)
    fig.update_xaxes(title_text="generation step")
    fig.update_yaxes(title_text="mass", row=1, col=1)
    fig.update_yaxes(title_text="layer", row=2, col=1)
    fig.update_yaxes(title_text="layer", row=2, col=2)
    fig.update_layout(title=title or f"attention drift during generation ({drift.n_prompts} prompts, "
                      f"recent window {drift.window})", height=800)
    return fig


def chain_figure(chain: "NormChain", title: Optional[str] = None) -> go.Figure:
    """The norm along the re-applied blocks, each pass's start marked (:meth:`NormChain.plot`)."""
    x = list(range(len(chain.norms)))
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=list(chain.norms), mode="lines+markers", name="without first token"))
    fig.add_trace(go.Scatter(x=x, y=list(chain.first), mode="lines", line_dash="dot", name="first token"))
    for p in range(1, chain.passes):
        fig.add_vline(x=p * chain.n_layers - 0.5, line_dash="dash", line_color="grey")
    fig.update_layout(title=title or f"norm along {chain.passes} passes through the {chain.n_layers} blocks",
                      xaxis_title="block application", yaxis_title="||h||", yaxis_type="log")
    return fig
