"""Figures of a tune document (:func:`steerkit.probes.tune`, :meth:`~steerkit.probes.tune_result.TuneResult.to_json`):
trade-off curves of concept against a damage per layer (:func:`tradeoff_figure`) and a heatmap of one
metric over layers x scales (:func:`heatmap_figure`). The app's Tune page draws them."""
from __future__ import annotations

import plotly.graph_objects as go

from steerkit.errors import InputError

from ..tune_result import METRICS, damage_value, tune_document

__all__ = ["tradeoff_figure", "heatmap_figure"]

_AXIS = {"kl": "kl (next-token KL on neutral prompts, nats)",
         "perplexity": "perplexity (unsteered model on the steered generations)",
         "ppl_ratio": "perplexity ratio (to the baseline)",
         "repetition": "repetition (share of degenerate generations)",
         "concept": "concept score"}


def tradeoff_figure(result_json: dict, *, damage: str = "kl"):
    """Trade-off curves of a tune document (:meth:`~steerkit.probes.tune_result.TuneResult.to_json`, its
    text or a path): one line per
    layer through its scales, concept up the y axis against ``damage`` (``"kl"``, ``"perplexity"``,
    ``"ppl_ratio"`` or ``"repetition"``) along x, each point labelled with its scale and with its concept
    interval as an error bar; Pareto-front cells ringed, the recommended cell a star, the baseline a
    dashed line at its concept. Returns a plotly figure.

    Examples:
        >>> from steerkit.probes.plots.tune import tradeoff_figure
        >>> from steerkit.probes.tune_result import TuneResult
        >>> fig = tradeoff_figure(TuneResult.example().to_json(), damage="perplexity")
        >>> [t.name for t in fig.data]
        ['layer 5', 'layer 10', 'Pareto front', 'recommended']
    """
    d = tune_document(result_json)
    if damage not in _AXIS or damage == "concept":
        raise InputError(f"expected damage in {tuple(k for k in _AXIS if k != 'concept')}, found {damage!r}")
    fig = go.Figure()
    cells = d["cells"]

    def xval(c):
        v = c.get(damage)
        return None if v is None else float(v)

    for layer in d["layers"]:
        row = sorted((c for c in cells if c["layer"] == layer), key=lambda c: c["scale"])
        if not row:
            continue
        fig.add_trace(go.Scatter(
            x=[xval(c) for c in row], y=[c["concept"] for c in row], mode="lines+markers+text",
            name=f"layer {layer}", text=[f"{c['scale']:g}" for c in row], textposition="top center",
            error_y=dict(type="data", symmetric=False, array=[c["concept_ci"][1] - c["concept"] for c in row],
                         arrayminus=[c["concept"] - c["concept_ci"][0] for c in row], thickness=1),
            customdata=[[c["scale"], c.get("kl"), c.get("perplexity"), c.get("repetition")] for c in row],
            hovertemplate=(f"layer {layer}, scale %{{customdata[0]}}<br>concept %{{y:.3g}}<br>kl %{{customdata[1]:.3g}}"
                           "<br>perplexity %{customdata[2]:.3g}<br>repetition %{customdata[3]:.2f}<extra></extra>")))
    front = sorted((c for c in cells if c.get("pareto")), key=lambda c: damage_value(xval(c)))
    fig.add_trace(go.Scatter(x=[xval(c) for c in front], y=[c["concept"] for c in front], mode="markers",
                             name="Pareto front", marker=dict(size=16, symbol="circle-open", color="black",
                                                              line=dict(width=2)),
                             hovertemplate="Pareto: concept %{y:.3g}<extra></extra>"))
    rec = d.get("recommended")
    if rec is not None:
        rc = [c for c in cells if c["layer"] == rec["layer"] and float(c["scale"]) == float(rec["scale"])]
        if rc:
            fig.add_trace(go.Scatter(x=[xval(rc[0])], y=[rc[0]["concept"]], mode="markers", name="recommended",
                                     marker=dict(size=20, symbol="star", color="gold", line=dict(width=1, color="black")),
                                     hovertemplate=(f"recommended: layer {rec['layer']}, scale {rec['scale']:g}"
                                                    "<extra></extra>")))
    base = d["baseline"].get("concept")
    if base is not None:
        fig.add_hline(y=float(base), line_dash="dash", line_color="gray", annotation_text="unsteered")
    fig.update_layout(title=f"concept vs {damage} per layer across scales ({d.get('concept_kind', '')} concept)",
                      xaxis_title=_AXIS[damage], yaxis_title=_AXIS["concept"], template="plotly_white",
                      legend_title="layer")
    return fig


def heatmap_figure(result_json: dict, metric: str):
    """A heatmap of one per-cell ``metric`` of a tune document (``"concept"``, ``"perplexity"``,
    ``"ppl_ratio"``, ``"kl"`` or ``"repetition"``): layers down, scales across, the recommended cell
    marked with a star. Returns a plotly figure.

    Examples:
        >>> from steerkit.probes.plots.tune import heatmap_figure
        >>> from steerkit.probes.tune_result import TuneResult
        >>> fig = heatmap_figure(TuneResult.example().to_json(), "kl")
        >>> [list(row) for row in fig.data[0].z]
        [[0.0, 0.2, 0.8], [0.0, 0.4, 1.6]]
    """
    d = tune_document(result_json)
    if metric not in METRICS:
        raise InputError(f"expected metric in {METRICS}, found {metric!r}")
    layers, scales = list(d["layers"]), [float(s) for s in d["scales"]]
    z: list[list] = [[None] * len(scales) for _ in layers]
    for c in d["cells"]:
        if c["layer"] in layers and float(c["scale"]) in scales:
            v = c.get(metric)
            z[layers.index(c["layer"])][scales.index(float(c["scale"]))] = None if v is None else float(v)
    x, y = [f"{s:g}" for s in scales], [f"L{l}" for l in layers]
    fig = go.Figure(go.Heatmap(z=z, x=x, y=y, colorscale="Viridis" if metric == "concept" else "Reds",
                               colorbar=dict(title=metric),
                               hovertemplate="%{y}, scale %{x}: %{z:.4g}<extra></extra>"))
    rec = d.get("recommended")
    if rec is not None and rec["layer"] in layers and float(rec["scale"]) in scales:
        fig.add_trace(go.Scatter(x=[f"{float(rec['scale']):g}"], y=[f"L{rec['layer']}"], mode="markers",
                                 name="recommended", marker=dict(symbol="star", size=18, color="gold",
                                                                 line=dict(width=1, color="black"))))
    fig.update_layout(title=f"{_AXIS.get(metric, metric)} per layer and scale", xaxis_title="scale",
                      yaxis_title="layer", xaxis=dict(type="category"),
                      yaxis=dict(type="category", autorange="reversed"), template="plotly_white")
    return fig
