"""Pure figure functions: result objects in, ``plotly.graph_objects.Figure`` out.

They hold no state and touch no model, so they work the same in the app and in a notebook::

    from steerkit.apps import analysis, data, figures
    prof = analysis.divergence_profile(sm, *data.temporal_pairs(8))
    figures.profile_figure(prof).show()

Every figure can be saved as a standalone HTML page with :func:`to_html`.
"""
from __future__ import annotations

import html as _html
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

REL_COLOR = "#1f77b4"
COS_COLOR = "#ff7f0e"
AUROC_COLOR = "#2ca02c"
PEAK_COLOR = "#d62728"
TEMPLATE = "plotly_white"


def _rgba(hex_color: str, alpha: float) -> str:
    h = hex_color.lstrip("#")
    r, g, b = (int(h[i:i + 2], 16) for i in (0, 2, 4))
    return f"rgba({r},{g},{b},{alpha})"


def _band(x, lo, hi, color, name, yaxis="y"):
    return go.Scatter(x=list(x) + list(x)[::-1], y=list(hi) + list(lo)[::-1], fill="toself",
                      fillcolor=_rgba(color, 0.18), line=dict(width=0), hoverinfo="skip", showlegend=True,
                      name=name, yaxis=yaxis)


def _cos_range(cos, auroc=None):
    lo = float(np.min(cos.mean(0) - cos.std(0)))
    if auroc is not None:
        lo = min(lo, float(np.nanmin(np.asarray(auroc, dtype=float))))
    lo = max(-1.0, lo - 0.1 * max(1e-3, 1.0 - lo))
    return [lo, 1.0 + 0.05 * (1.0 - lo)]


def profile_figure(profile, *, spread: str = "std", auroc: Optional[Sequence[float]] = None,
                   auroc_layers: Optional[Sequence[int]] = None, selected_layer: Optional[int] = None,
                   title: Optional[str] = None) -> go.Figure:
    """Relative divergence (left axis) and cosine similarity (right axis) per layer.

    ``spread``: ``"std"`` (mean +/- one standard deviation over pairs), ``"range"`` (min..max) or
    ``"none"``. The peak layer of the mean relative divergence gets a marker and a dashed line.
    ``auroc``: a probe AUROC per layer (``auroc_layers``, default the profile's layers), drawn on
    the cosine axis (both live in [0, 1]).
    Traces (by name): ``relative divergence``, ``cosine similarity``, ``peak``, and the bands.
    """
    x = list(profile.layers)
    rel, cos = profile.rel, profile.cos
    rm, cm = rel.mean(0), cos.mean(0)
    fig = go.Figure()
    if spread == "std":
        fig.add_trace(_band(x, rm - rel.std(0), rm + rel.std(0), REL_COLOR, "divergence ± 1 sd"))
        fig.add_trace(_band(x, cm - cos.std(0), cm + cos.std(0), COS_COLOR, "cosine ± 1 sd", "y2"))
    elif spread == "range":
        fig.add_trace(_band(x, rel.min(0), rel.max(0), REL_COLOR, "divergence min–max"))
        fig.add_trace(_band(x, cos.min(0), cos.max(0), COS_COLOR, "cosine min–max", "y2"))
    n = profile.rel.shape[0]
    fig.add_trace(go.Scatter(
        x=x, y=rm, mode="lines+markers", name="relative divergence", line=dict(color=REL_COLOR, width=2.5),
        customdata=np.stack([rel.std(0), rel.min(0), rel.max(0)], -1),
        hovertemplate="layer %{x}<br>‖h(a)−h(b)‖/‖h(a)‖ = %{y:.4f}<br>sd %{customdata[0]:.4f}, "
                      "min %{customdata[1]:.4f}, max %{customdata[2]:.4f}<extra>" + f"{n} pairs</extra>"))
    fig.add_trace(go.Scatter(
        x=x, y=cm, mode="lines+markers", name="cosine similarity", yaxis="y2",
        line=dict(color=COS_COLOR, width=2, dash="dot"), customdata=cos.std(0),
        hovertemplate="layer %{x}<br>cos = %{y:.4f} (sd %{customdata:.4f})<extra></extra>"))
    if auroc is not None:
        al = list(auroc_layers) if auroc_layers is not None else x
        fig.add_trace(go.Scatter(x=al, y=list(auroc), mode="lines+markers", name="probe AUROC", yaxis="y2",
                                 line=dict(color=AUROC_COLOR, width=2),
                                 hovertemplate="layer %{x}<br>AUROC = %{y:.3f}<extra></extra>"))
    pi = int(np.argmax(rm))
    peak = x[pi]
    fig.add_trace(go.Scatter(x=[peak], y=[rm[pi]], mode="markers+text", name="peak",
                             marker=dict(color=PEAK_COLOR, size=14, symbol="star"),
                             text=[f"peak L{peak}"], textposition="top center",
                             hovertemplate="peak layer %{x}: %{y:.4f}<extra></extra>"))
    fig.add_vline(x=peak, line=dict(color=PEAK_COLOR, dash="dash", width=1))
    if selected_layer is not None:
        fig.add_vline(x=selected_layer, line=dict(color="#555", width=1))
    fig.update_layout(
        template=TEMPLATE, title=title or f"Divergence profile — {profile.contrast}, {n} pairs"
                                          + (f" ({profile.model_name})" if profile.model_name else ""),
        xaxis=dict(title="layer", dtick=max(1, len(x) // 15)),
        yaxis=dict(title="relative divergence ‖h(a)−h(b)‖ / ‖h(a)‖", rangemode="tozero", color=REL_COLOR),
        yaxis2=dict(title="cosine similarity" + (" / AUROC" if auroc is not None else ""), overlaying="y",
                    side="right", color=COS_COLOR, range=_cos_range(cos, auroc), showgrid=False),
        legend=dict(orientation="h", y=-0.2), hovermode="closest", margin=dict(l=60, r=60, t=60, b=60), height=440,
        clickmode="event")
    return fig


def pairs_figure(profile, layer: int) -> go.Figure:
    """Per-pair relative divergence and cosine at one layer (bars; hover shows the prompts)."""
    d = profile.at_layer(layer)
    idx = list(range(len(d["rel"])))

    def short(s):
        return (s[:70] + "…") if len(s) > 70 else s
    cd = [[short(a), short(b)] for a, b in zip(d["a"], d["b"])] if d["a"] else None
    fig = make_subplots(rows=1, cols=2, subplot_titles=("relative divergence", "cosine similarity"))
    ht = "pair %{x}: %{y:.4f}" + ("<br>A: %{customdata[0]}<br>B: %{customdata[1]}" if cd else "") + "<extra></extra>"
    fig.add_trace(go.Bar(x=idx, y=d["rel"], name="relative divergence", marker_color=REL_COLOR, customdata=cd,
                         hovertemplate=ht), 1, 1)
    fig.add_trace(go.Bar(x=idx, y=d["cos"], name="cosine similarity", marker_color=COS_COLOR, customdata=cd,
                         hovertemplate=ht), 1, 2)
    fig.update_layout(template=TEMPLATE, title=f"Per-pair values at layer {layer}", showlegend=False,
                      margin=dict(l=50, r=20, t=70, b=40), height=320)
    fig.update_xaxes(title_text="pair")
    return fig


def lens_figure(top, bottom=None, *, layer: Optional[int] = None) -> go.Figure:
    """Logit-lens tokens as horizontal bars: ``top``/``bottom`` are lists of ``(token, logit)``."""
    fig = go.Figure()
    rows = list(top) + (list(bottom) if bottom else [])
    if top:
        fig.add_trace(go.Bar(y=[repr(t) for t, _ in top][::-1], x=[s for _, s in top][::-1], orientation="h",
                             name="promoted", marker_color=REL_COLOR))
    if bottom:
        fig.add_trace(go.Bar(y=[repr(t) for t, _ in bottom][::-1], x=[s for _, s in bottom][::-1],
                             orientation="h", name="suppressed", marker_color=PEAK_COLOR))
    fig.update_layout(template=TEMPLATE, title="Logit lens of the mean difference"
                      + (f" at layer {layer}" if layer is not None else ""), xaxis_title="logit",
                      height=max(300, 18 * len(rows) + 110), margin=dict(l=130, r=20, t=60, b=40),
                      legend=dict(orientation="h", y=-0.12), bargap=0.15)
    return fig


def probe_heatmap(sweep) -> go.Figure:
    """Layer x position AUROC heatmap; hover shows the confidence interval when the sweep has one."""
    A = np.asarray(sweep.auroc, dtype=float)
    if sweep.ci_low is not None and sweep.ci_high is not None:
        cd = np.stack([sweep.ci_low, sweep.ci_high], -1)
        ht = ("layer %{y}, position %{x}<br>AUROC %{z:.3f}<br>95% CI [%{customdata[0]:.3f}, "
              "%{customdata[1]:.3f}]<extra></extra>")
    else:
        cd = None
        ht = "layer %{y}, position %{x}<br>AUROC %{z:.3f}<extra></extra>"
    fig = go.Figure(go.Heatmap(z=A, x=list(sweep.positions), y=list(sweep.layers), customdata=cd,
                               hovertemplate=ht, colorscale="Viridis", zmin=0.5, zmax=1.0,
                               colorbar=dict(title="AUROC")))
    fig.update_layout(template=TEMPLATE, title=f"Probe AUROC by layer and position — {sweep.name}",
                      xaxis=dict(title="position", type="category"), yaxis=dict(title="layer"),
                      margin=dict(l=60, r=20, t=60, b=50), height=520)
    return fig


def norm_figure(diag) -> go.Figure:
    """Residual-stream norm per layer (positions >= 1, and position 0 separately)."""
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=diag.layers, y=diag.resid_norm, mode="lines+markers", name="mean ‖h‖ (pos ≥ 1)",
                             line=dict(color=REL_COLOR)))
    fig.add_trace(go.Scatter(x=diag.layers, y=diag.resid_norm_pos0, mode="lines+markers", name="‖h‖ at pos 0",
                             line=dict(color=PEAK_COLOR, dash="dot")))
    fig.update_layout(template=TEMPLATE, title=f"Residual norm per layer ({diag.n_prompts} prompts)",
                      xaxis_title="layer", yaxis=dict(title="L2 norm", type="log"), legend=dict(orientation="h", y=-0.2),
                      margin=dict(l=60, r=20, t=60, b=60), height=380)
    return fig


def sink_figure(diag) -> go.Figure:
    """Attention mass on position 0 per layer (mean over heads) with the per-head spread."""
    fig = go.Figure()
    if diag.sink is None:
        fig.update_layout(template=TEMPLATE, title="Sink attention unavailable",
                          annotations=[dict(text=diag.note or "no attention weights", showarrow=False)])
        return fig
    sh = np.asarray(diag.sink_heads)
    fig.add_trace(_band(diag.layers, sh.min(1), sh.max(1), COS_COLOR, "head min–max"))
    fig.add_trace(go.Scatter(x=diag.layers, y=diag.sink, mode="lines+markers", name="mean over heads",
                             line=dict(color=COS_COLOR, width=2.5),
                             hovertemplate="layer %{x}: %{y:.3f} of attention on position 0<extra></extra>"))
    fig.update_layout(template=TEMPLATE, title="Sink attention: mass on position 0 per layer",
                      xaxis_title="layer", yaxis=dict(title="attention on position 0", range=[0, 1.02]),
                      legend=dict(orientation="h", y=-0.2), margin=dict(l=60, r=20, t=60, b=60), height=380)
    return fig


def mi_figure(mi) -> go.Figure:
    """MI per generation step, peaks marked with their tokens."""
    fig = go.Figure()
    text = mi.tokens if mi.tokens else None
    fig.add_trace(go.Scatter(x=mi.steps, y=mi.mi, mode="lines+markers", name="MI", text=text,
                             line=dict(color=REL_COLOR),
                             hovertemplate="step %{x}: %{y:.4f}" + (" %{text}" if text else "") + "<extra></extra>"))
    if mi.peaks:
        ys = [float(mi.mi[mi.steps.index(p)]) for p in mi.peaks if p in mi.steps]
        ps = [p for p in mi.peaks if p in mi.steps]
        lab = [repr(mi.tokens[mi.steps.index(p)]) if mi.tokens else f"step {p}" for p in ps]
        fig.add_trace(go.Scatter(x=ps, y=ys, mode="markers+text", name="peaks", text=lab, textposition="top center",
                                 marker=dict(color=PEAK_COLOR, size=11, symbol="star")))
    fig.update_layout(template=TEMPLATE, title=f"Mutual information per generation step — {mi.name}",
                      xaxis_title="generation step",
                      yaxis_title=("MI estimate (HSIC)" if getattr(mi, "measure", "MI") == "HSIC" else "MI (nats)"), margin=dict(l=60, r=20, t=60, b=50),
                      height=360)
    return fig


def empty_figure(message: str) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(template=TEMPLATE, xaxis=dict(visible=False), yaxis=dict(visible=False), height=300,
                      annotations=[dict(text=message, showarrow=False, font=dict(size=14, color="#666"))])
    return fig


def token_colors(values: Sequence[float], scale: Optional[float] = None) -> list[str]:
    """Diverging background colours (blue negative, red positive) for token projections."""
    v = np.asarray(list(values), dtype=float)
    if v.size == 0:
        return []
    m = scale if scale else (float(np.abs(v).max()) or 1.0)
    out = []
    for x in v:
        a = min(1.0, abs(x) / m) * 0.6
        out.append(f"rgba(214,39,40,{a:.2f})" if x >= 0 else f"rgba(31,119,180,{a:.2f})")
    return out


def tokens_html(tokens: Sequence[str], values: Sequence[float], scale: Optional[float] = None) -> str:
    """Tokens as HTML spans coloured by their projection (for notebooks: ``IPython.display.HTML``)."""
    cols = token_colors(values, scale)
    return "".join(f'<span title="{v:.3f}" style="background:{c}">{_html.escape(t)}</span>'
                   for t, v, c in zip(tokens, values, cols))


def to_html(fig: go.Figure, path=None) -> str:
    """The figure as a standalone HTML page (plotly.js embedded; works offline). Writes ``path`` if given."""
    s = fig.to_html(include_plotlyjs=True, full_html=True)
    if path is not None:
        Path(path).write_text(s, encoding="utf-8")
    return s
