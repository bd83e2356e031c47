"""Figures of induction heads (:mod:`steerkit.probes.methods.induction`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import plotly.graph_objects as go

if TYPE_CHECKING:
    from ..methods.induction import InductionResult


def score_figure(res: "InductionResult", title: Optional[str] = None) -> go.Figure:
    """A heatmap of the induction score per layer (down) and head (across) (:meth:`InductionResult.plot`)."""
    H = res.scores.shape[1]
    fig = go.Figure(go.Heatmap(z=res.scores.tolist(), x=[f"H{h}" for h in range(H)],
                               y=[f"L{l}" for l in res.layers], colorscale="Blues", zmin=0,
                               colorbar=dict(title="score"),
                               hovertemplate="%{y} %{x}: %{z:.3f}<extra></extra>"))
    fig.update_layout(title=title or f"induction score per head ({res.n_seqs} repeated random sequences of "
                      f"{res.seq_len} tokens)", xaxis_title="head", yaxis_title="layer",
                      yaxis=dict(autorange="reversed", type="category"), xaxis=dict(type="category"),
                      template="plotly_white")
    return fig


def loss_figure(res: "InductionResult", title: Optional[str] = None) -> go.Figure:
    """The mean per-token loss by position; the repeat starts at ``seq_len`` (:meth:`InductionResult.loss_plot`)."""
    fig = go.Figure(go.Scatter(x=list(range(len(res.loss))), y=list(res.loss), mode="lines", name="loss"))
    fig.add_vline(x=res.seq_len - 0.5, line_dash="dash", line_color="grey")
    fig.update_layout(title=title or f"per-token loss: first half {res.loss_first:.2f}, repeated half "
                      f"{res.loss_repeated:.2f} nats", xaxis_title="position (predicting the next token)",
                      yaxis_title="loss (nats)", template="plotly_white")
    return fig
