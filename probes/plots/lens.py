"""Figures of the logit lens and of direct logit attribution (:mod:`steerkit.probes.lens`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import plotly.graph_objects as go

from steerkit.errors import InputError

if TYPE_CHECKING:
    from ..lens import DLAResult, LensResult


def lens_figure(res: "LensResult", *, title: Optional[str] = None) -> go.Figure:
    """A heatmap: layers down, positions across, each cell's top token written in it and coloured by its
    probability (:meth:`LensResult.plot`)."""
    x = [f"{p} {res.tokens[p]!r}" if 0 <= p < len(res.tokens) else str(p) for p in res.positions]
    y = [f"L{l}" for l in res.layers]
    text = [[cell[0] for cell in row] for row in res.top_tokens]
    hover = [["<br>".join(f"{t!r}: {float(pr):.3f}" for t, pr in zip(cell, probs))
              for cell, probs in zip(row, prow)] for row, prow in zip(res.top_tokens, res.top_probs)]
    fig = go.Figure(go.Heatmap(z=res.top_probs[..., 0].tolist(), x=x, y=y, text=text, texttemplate="%{text}",
                               customdata=hover, hovertemplate="%{y} %{x}<br>%{customdata}<extra></extra>",
                               colorscale="Blues", zmin=0, zmax=1, colorbar=dict(title="top-1 prob")))
    fig.update_layout(title=title or "logit lens (resid_post through the final norm)", xaxis_title="position",
                      yaxis_title="layer", yaxis=dict(autorange="reversed", type="category"),
                      xaxis=dict(type="category"), template="plotly_white")
    return fig


def dla_figure(res: "DLAResult", kind: str = "components", *, title: Optional[str] = None) -> go.Figure:
    """``kind="components"``: a bar per part (embed, each layer's attn and mlp); ``kind="heads"``: a heatmap
    of the heads (layers down, heads across) (:meth:`DLAResult.plot`)."""
    what = f"{res.answer!r}" + (f" - {res.wrong!r}" if res.wrong is not None else "")
    if kind == "components":
        names, vals = zip(*res.components())
        fig = go.Figure(go.Bar(x=list(names), y=list(vals)))
        fig.update_layout(xaxis_title="component", yaxis_title="direct logit contribution")
    elif kind == "heads":
        fig = go.Figure(go.Heatmap(z=res.heads.tolist(), x=[f"H{h}" for h in range(res.heads.shape[1])],
                                   y=[f"L{l}" for l in range(res.heads.shape[0])], colorscale="RdBu", zmid=0))
        fig.update_layout(xaxis_title="head", yaxis_title="layer", yaxis=dict(autorange="reversed"))
    else:
        raise InputError(f"expected kind 'components' or 'heads', found {kind!r}")
    fig.update_layout(title=title or f"direct logit attribution of {what} at position {res.position} "
                      f"(logit diff {res.logit_diff:.3g})", template="plotly_white")
    return fig
