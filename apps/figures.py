"""Pure figure functions: result objects in, ``plotly.graph_objects.Figure`` out.

They hold no state and touch no model, so they work the same in the app and in a notebook::

    from steerkit.apps import analysis, data, figures
    prof = analysis.divergence_profile(sm, *data.temporal_pairs(8))
    figures.profile_figure(prof).show()

Every figure can be saved as a standalone HTML page with :func:`to_html` (:func:`figure_page` for a
figure a page sent back). The Tune page draws ``steerkit.probes.tune.tradeoff_figure`` /
``heatmap_figure`` (:func:`tune_figures`); :func:`mark_tune_tradeoff`, :func:`mark_tune_heatmap`,
:func:`tune_point` and :func:`tune_rows` are its selection and table. The Features page draws
``steerkit.probes.plots.sae.feature_figure`` (:func:`feature_figure`), the Circuits page the attribution graph
of :mod:`steerkit.apps.figures_circuits` (:func:`circuit_figure`, :func:`node_positions`; a feature's hover
contexts as :func:`snippet` s) and a supernode's
intervention (:func:`effect_figure`). The two are the app's
modules that import plotly.
"""
from __future__ import annotations

import html as _html
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from steerkit.deprecation import moved
from steerkit.errors import InputError
from steerkit.probes.plots.sae import feature_figure as sae_feature_figure
from steerkit.probes.tune import heatmap_figure, tradeoff_figure

from .figures_circuits import (  # noqa: F401 - re-exported
    HOVER_CHARS, HOVER_CONTEXTS, HOVER_TOKEN_CHARS, circuit_figure, effect_figure, node_positions, snippet,
)

REL_COLOR = "#1f77b4"
COS_COLOR = "#ff7f0e"
AUROC_COLOR = "#2ca02c"
PEAK_COLOR = "#d62728"
TEMPLATE = "plotly_white"
#: activations a Features histogram sends as they are; past that it is binned here (40 bins)
MAX_HISTOGRAM_VALUES = 50_000


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

    Examples:
        >>> from steerkit.apps.figures import profile_figure
        >>> from steerkit.apps.analysis import DivergenceProfile
        >>> prof = DivergenceProfile(layers=[0, 1, 2], rel=[[0.1, 0.4, 0.2], [0.2, 0.6, 0.3]],
        ...                          cos=[[0.99, 0.9, 0.95], [0.98, 0.8, 0.9]], prompts_a=["I love it", "A fine day"],
        ...                          prompts_b=["I hate it", "A grim day"], contrast="sentiment")
        >>> fig = profile_figure(prof)
        >>> [t.name for t in fig.data if not t.name.endswith("sd")], fig.data[-1].x
        (['relative divergence', 'cosine similarity', 'peak'], (1,))
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
    """Per-pair relative divergence and cosine at one layer (bars; hover shows the prompts).

    Examples:
        >>> from steerkit.apps.figures import pairs_figure
        >>> from steerkit.apps.analysis import DivergenceProfile
        >>> prof = DivergenceProfile(layers=[0, 1, 2], rel=[[0.1, 0.4, 0.2], [0.2, 0.6, 0.3]],
        ...                          cos=[[0.99, 0.9, 0.95], [0.98, 0.8, 0.9]], prompts_a=["I love it", "A fine day"],
        ...                          prompts_b=["I hate it", "A grim day"], contrast="sentiment")
        >>> fig = pairs_figure(prof, 1)
        >>> fig.layout.title.text, fig.data[0].y
        ('Per-pair values at layer 1', (0.4, 0.6))
    """
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


def vector_lens_figure(top, bottom=None, *, layer: Optional[int] = None) -> go.Figure:
    """The logit lens of a vector (:func:`steerkit.probes.lens.vector_lens`) as horizontal bars: ``top`` /
    ``bottom`` are lists of ``(token, logit)``. (Its old name, ``lens_figure``, still works and warns;
    :func:`steerkit.probes.plots.lens.lens_figure` draws a :class:`~steerkit.probes.LensResult`.)

    Examples:
        >>> from steerkit.apps.figures import vector_lens_figure
        >>> fig = vector_lens_figure([(" good", 3.2), (" great", 2.9)], [(" bad", -2.5)], layer=12)
        >>> [t.name for t in fig.data], fig.layout.title.text
        (['promoted', 'suppressed'], 'Logit lens of the mean difference at layer 12')
    """
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
    """Layer x position AUROC heatmap; hover shows the confidence interval when the sweep has one.

    Examples:
        >>> from steerkit.apps.figures import probe_heatmap
        >>> from types import SimpleNamespace
        >>> sweep = SimpleNamespace(auroc=[[0.6, 0.7], [0.9, 0.95]], ci_low=None, ci_high=None, positions=[-2, -1],
        ...                         layers=[3, 6], name="sentiment")
        >>> fig = probe_heatmap(sweep)
        >>> fig.data[0].type, fig.layout.title.text
        ('heatmap', 'Probe AUROC by layer and position — sentiment')
    """
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
    """Residual-stream norm per layer (positions >= 1, and position 0 separately).

    Examples:
        >>> from steerkit.apps.figures import norm_figure
        >>> from steerkit.apps.analysis import LayerDiagnostics
        >>> diag = LayerDiagnostics(layers=[0, 1, 2], resid_norm=np.array([2.0, 4.0, 9.0]),
        ...                         resid_norm_pos0=np.array([3.0, 40.0, 45.0]), sink=np.array([0.1, 0.7, 0.8]),
        ...                         sink_heads=np.array([[0.0, 0.2], [0.6, 0.8], [0.7, 0.9]]), n_prompts=2)
        >>> [t.name for t in norm_figure(diag).data]
        ['mean ‖h‖ (pos ≥ 1)', '‖h‖ at pos 0']
    """
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
    """Attention mass on position 0 per layer (mean over heads) with the per-head spread.

    Examples:
        >>> from steerkit.apps.figures import sink_figure
        >>> from steerkit.apps.analysis import LayerDiagnostics
        >>> diag = LayerDiagnostics(layers=[0, 1, 2], resid_norm=np.array([2.0, 4.0, 9.0]),
        ...                         resid_norm_pos0=np.array([3.0, 40.0, 45.0]), sink=np.array([0.1, 0.7, 0.8]),
        ...                         sink_heads=np.array([[0.0, 0.2], [0.6, 0.8], [0.7, 0.9]]), n_prompts=2)
        >>> [t.name for t in sink_figure(diag).data]
        ['head min–max', 'mean over heads']
    """
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
    """MI per generation step, peaks marked with their tokens.

    Examples:
        >>> from steerkit.apps.figures import mi_figure
        >>> from steerkit.apps.io import MIProfile
        >>> mi = MIProfile(steps=[0, 1, 2, 3], mi=np.array([0.1, 0.9, 0.2, 0.3]), tokens=["The", " eggs", " cost", "."],
        ...                peaks=[1], name="question 0")
        >>> fig = mi_figure(mi)
        >>> [t.name for t in fig.data], fig.data[1].text
        (['MI', 'peaks'], ("' eggs'",))
    """
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


# ------------------------------------------------------------------ patching and attention
METHOD_COLORS = {"activation": REL_COLOR, "attribution": COS_COLOR}


def token_label(token: str, position: Optional[int] = None) -> str:
    """A token as an axis label: its ``repr`` (leading spaces visible), with its position when given.

    Examples:
        >>> from steerkit.apps.figures import token_label
        >>> token_label(" Mary"), token_label(" Mary", 3)
        ("' Mary'", "3 ' Mary'")
    """
    t = repr(token)
    t = t if len(t) <= 24 else t[:21] + "…"
    return t if position is None else f"{position} {t}"


def _value_name(normalized: bool) -> str:
    return "restored fraction" if normalized else "logit difference"


def patching_run_figure(run, *, normalized: bool = True, selected: Optional[tuple[int, int]] = None) -> go.Figure:
    """The patching grid(s) of a :class:`~steerkit.apps.analysis.PatchingRun` as heatmaps, one per
    method side by side (activation, attribution): layers down, positions (token labels) or heads
    across, diverging around 0 on one colour axis. ``normalized``: the restored fraction, else the
    logit difference. ``selected``: ``(layer, column)`` outlined. Each cell's ``x`` / ``y`` are the
    column index (position or head) and the layer, which a click reports. (Its old name, ``patching_figure``,
    still works and warns; :func:`steerkit.probes.plots.patching.patching_figure` draws a
    :class:`~steerkit.probes.PatchingResult`.)

    Examples:
        >>> from steerkit.apps.figures import patching_run_figure
        >>> from steerkit.apps.analysis import patching_run
        >>> run = patching_run(tiny, "When Mary and John went to the store, John gave a drink to",
        ...                    "When John and Mary went to the store, Mary gave a drink to", " Mary", " John")
        >>> fig = patching_run_figure(run, selected=(2, 13))
        >>> fig.data[0].type, len(fig.data[0].y), len(fig.data[0].x), len(fig.layout.shapes)
        ('heatmap', 4, 14, 1)
    """
    results = run.results
    methods = list(results)
    grids = {m: run.grid(m, normalized) for m in methods}
    fig = make_subplots(rows=1, cols=len(methods), shared_yaxes=True, horizontal_spacing=0.06,
                        subplot_titles=[f"{m} patching" for m in methods])
    cols = run.columns()
    if run.by_head:
        ticktext = [f"H{h}" for h in cols]
        what = "head"
    else:
        ticktext = [token_label(run.tokens[p], p) for p in cols]
        what = "position"
    m_abs = max([float(np.nanmax(np.abs(g))) for g in grids.values() if g.size] + [1e-9])
    if normalized:
        m_abs = max(m_abs, 1.0)
    for i, m in enumerate(methods):
        r = results[m]
        g = grids[m]
        labels = [[ticktext[j] for j in range(len(cols))] for _ in r.layers]
        fig.add_trace(go.Heatmap(
            z=g.tolist(), x=cols, y=list(r.layers), customdata=labels, coloraxis="coloraxis", name=m,
            hovertemplate=f"layer %{{y}}, {what} %{{customdata}}<br>{_value_name(normalized)} %{{z:.4g}}"
                          f"<extra>{m}</extra>"), 1, i + 1)
        fig.update_xaxes(tickmode="array", tickvals=cols, ticktext=ticktext, tickangle=-50 if not run.by_head else 0,
                         title_text=what, row=1, col=i + 1)
        if selected is not None and selected[0] in r.layers:
            ref = "" if i == 0 else str(i + 1)
            l, c = selected
            fig.add_shape(type="rect", xref=f"x{ref}", yref=f"y{ref}", x0=c - 0.5, x1=c + 0.5, y0=l - 0.5,
                          y1=l + 0.5, line=dict(color="#222", width=2))
    n_layers = max(len(r.layers) for r in results.values())
    shown = sorted({l for r in results.values() for l in r.layers})
    fig.update_yaxes(autorange="reversed", tickmode="array", tickvals=shown[::max(1, len(shown) // 30)])
    fig.update_yaxes(title_text="layer", row=1, col=1)
    grid_name = {"z": "attention heads (attn.hook_z, every position)"}.get(run.hook, f"{run.hook}, one position")
    fig.update_layout(
        template=TEMPLATE, coloraxis=dict(colorscale="RdBu", cmid=0, cmin=-m_abs, cmax=m_abs,
                                          colorbar=dict(title=_value_name(normalized))),
        title=f"Patching {grid_name}: logit({run.answer!r}) − logit({run.wrong!r}); clean {run.clean_metric:.3g}, "
              f"corrupted {run.corrupted_metric:.3g}"
              + (" (stopped at the time limit)" if run.stopped_at_deadline else ""),
        height=max(360, min(900, 18 * n_layers + 200)), margin=dict(l=60, r=20, t=80, b=110), clickmode="event")
    return fig


def _detail_bars(fig, tokens, values: dict, positions=None):
    pos = list(range(len(tokens))) if positions is None else list(positions)
    for m, v in values.items():
        fig.add_trace(go.Bar(x=pos, y=list(map(float, v)), name=m, marker_color=METHOD_COLORS.get(m, REL_COLOR),
                             customdata=[token_label(tokens[p]) for p in pos],
                             hovertemplate="position %{x} %{customdata}: %{y:.4g}<extra>" + m + "</extra>"))
    fig.update_xaxes(tickmode="array", tickvals=pos, ticktext=[token_label(tokens[p], p) for p in pos],
                     tickangle=-50, title_text="position")


def patching_detail_figure(run, layer: int, *, normalized: bool = True) -> go.Figure:
    """One layer of a layers x positions grid: its value at each position as bars (token labels), one
    series per method.

    Examples:
        >>> from steerkit.apps.figures import patching_detail_figure
        >>> from steerkit.apps.analysis import patching_run
        >>> run = patching_run(tiny, "When Mary and John went to the store, John gave a drink to",
        ...                    "When John and Mary went to the store, Mary gave a drink to", " Mary", " John")
        >>> fig = patching_detail_figure(run, 3)
        >>> fig.data[0].name, len(fig.data[0].y), fig.layout.title.text
        ('activation', 14, 'Layer 3: resid_pre patched at each position')
    """
    values = run.layer_values(layer, normalized)
    fig = go.Figure()
    _detail_bars(fig, run.tokens, values, run.first.positions)
    fig.update_layout(template=TEMPLATE, title=f"Layer {layer}: {run.hook} patched at each position", barmode="group",
                      yaxis_title=_value_name(normalized), margin=dict(l=60, r=20, t=60, b=110), height=360,
                      legend=dict(orientation="h", y=1.08))
    return fig


def head_detail_figure(detail, *, normalized: bool = True) -> go.Figure:
    """One head (a :class:`~steerkit.apps.analysis.HeadDetail`) patched at each position separately, as bars.

    Examples:
        >>> from steerkit.apps.figures import head_detail_figure
        >>> from steerkit.apps.analysis import head_detail, patching_run
        >>> run = patching_run(tiny, "When Mary and John went to the store, John gave a drink to",
        ...                    "When John and Mary went to the store, Mary gave a drink to", " Mary", " John", "z")
        >>> fig = head_detail_figure(head_detail(tiny, run, 1, 2))
        >>> fig.data[0].name, len(fig.data[0].y), fig.layout.title.text
        ('activation', 14, 'Head L1H2: attn.hook_z patched at each position separately')
    """
    fig = go.Figure()
    _detail_bars(fig, detail.tokens, detail.values(normalized))
    fig.update_layout(template=TEMPLATE, title=f"Head L{detail.layer}H{detail.head}: attn.hook_z patched at each "
                      "position separately", barmode="group", yaxis_title=_value_name(normalized),
                      margin=dict(l=60, r=20, t=60, b=110), height=360, legend=dict(orientation="h", y=1.08))
    return fig


def attention_figure(att, head: Optional[int] = None) -> go.Figure:
    """Attention patterns of an :class:`~steerkit.apps.analysis.AttentionPatterns`: head ``head`` as one
    heatmap (query tokens down, key tokens across), or with ``head=None`` every head of the layer as a
    grid of small multiples on one colour scale.

    Examples:
        >>> from steerkit.apps.figures import attention_figure
        >>> from steerkit.apps.analysis import attention_patterns
        >>> att = attention_patterns(tiny, "Hello there, friend", 1)
        >>> one, every = attention_figure(att, head=0), attention_figure(att)
        >>> len(one.data), len(every.data), one.layout.title.text
        (1, 4, 'Attention pattern, layer 1 head 0')
    """
    toks = list(att.tokens)
    n = len(toks)
    idx = list(range(n))
    labels = [token_label(t, i) for i, t in enumerate(toks)]
    cd = [[[labels[q], labels[k]] for k in idx] for q in idx]
    ht = "query %{customdata[0]}<br>key %{customdata[1]}<br>attention %{z:.3f}<extra>%{meta}</extra>"
    if head is not None:
        if not 0 <= head < att.n_heads:
            raise ValueError(f"expected a head in 0..{att.n_heads - 1}, found {head}")
        fig = go.Figure(go.Heatmap(z=att.pattern[head].tolist(), x=idx, y=idx, customdata=cd,
                                   meta=f"L{att.layer}H{head}", hovertemplate=ht, colorscale="Blues", zmin=0,
                                   colorbar=dict(title="attention"),
                                   name=f"L{att.layer}H{head}"))
        fig.update_xaxes(tickmode="array", tickvals=idx, ticktext=labels, tickangle=-50, title_text="key (attended to)")
        fig.update_yaxes(tickmode="array", tickvals=idx, ticktext=labels, autorange="reversed", title_text="query")
        fig.update_layout(template=TEMPLATE, title=f"Attention pattern, layer {att.layer} head {head}",
                          height=max(420, min(900, 16 * n + 220)), width=None, margin=dict(l=140, r=20, t=60, b=140))
        return fig
    H = att.n_heads
    ncols = int(np.ceil(np.sqrt(H)))
    nrows = int(np.ceil(H / ncols))
    fig = make_subplots(rows=nrows, cols=ncols, subplot_titles=[f"H{h}" for h in range(H)], horizontal_spacing=0.03,
                        vertical_spacing=0.06 if nrows > 1 else 0.1)
    show_ticks = n <= 24
    for h in range(H):
        r, c = h // ncols + 1, h % ncols + 1
        fig.add_trace(go.Heatmap(z=att.pattern[h].tolist(), x=idx, y=idx, customdata=cd, meta=f"L{att.layer}H{h}",
                                 hovertemplate=ht, coloraxis="coloraxis", name=f"L{att.layer}H{h}"), r, c)
        short = [token_label(t) for t in toks]
        fig.update_xaxes(tickmode="array", tickvals=idx, ticktext=short, showticklabels=show_ticks and r == nrows,
                         tickfont=dict(size=8), tickangle=-60, row=r, col=c)
        fig.update_yaxes(tickmode="array", tickvals=idx, ticktext=short, autorange="reversed",
                         showticklabels=show_ticks and c == 1, tickfont=dict(size=8), row=r, col=c)
    top = float(np.max(att.pattern)) if att.pattern.size else 1.0
    fig.update_layout(template=TEMPLATE,
                      title=f"Attention patterns, layer {att.layer}, all {H} heads (query down, key across)",
                      coloraxis=dict(colorscale="Blues", cmin=0, cmax=top, colorbar=dict(title="attention")),
                      height=max(420, min(1400, 230 * nrows + 160)), margin=dict(l=90, r=20, t=70, b=90))
    return fig


# ------------------------------------------------------------------ tune (the figures are steerkit.probes.tune's)
SELECTED_COLOR = "#222"


def _scale_label(scale) -> str:
    """A scale as :func:`steerkit.probes.tune.heatmap_figure` labels its columns."""
    return f"{float(scale):g}"


def mark_tune_heatmap(fig: go.Figure, result: dict, layer: int, scale: float) -> go.Figure:
    """Outline the cell ``(layer, scale)`` of a tune heatmap (:func:`steerkit.probes.tune.heatmap_figure`
    of ``result``: layers down as ``L{layer}``, scales across); ``fig`` itself, changed in place.

    Examples:
        >>> from steerkit.apps.figures import mark_tune_heatmap
        >>> from steerkit.probes.tune import TuneResult, heatmap_figure
        >>> res = TuneResult.example().to_json()
        >>> fig = mark_tune_heatmap(heatmap_figure(res, "kl"), res, 10, 4.0)
        >>> [(s.x0, s.x1, s.y0, s.y1) for s in fig.layout.shapes]
        [(1.5, 2.5, 0.5, 1.5)]
    """
    layers = list(result["layers"])
    scales = [_scale_label(s) for s in result["scales"]]
    if layer in layers and _scale_label(scale) in scales:
        i, j = layers.index(layer), scales.index(_scale_label(scale))
        fig.add_shape(type="rect", x0=j - 0.5, x1=j + 0.5, y0=i - 0.5, y1=i + 0.5, xref="x", yref="y",
                      line=dict(color=SELECTED_COLOR, width=3), name="selected")
    return fig


def mark_tune_tradeoff(fig: go.Figure, result: dict, layer: int, scale: float, damage: str = "kl") -> go.Figure:
    """Ring the point ``(layer, scale)`` of a trade-off figure (:func:`steerkit.probes.tune.tradeoff_figure`
    of ``result`` with this ``damage``) with a ``selected`` marker; ``fig`` itself, changed in place.

    Examples:
        >>> from steerkit.apps.figures import mark_tune_tradeoff
        >>> from steerkit.probes.tune import TuneResult, tradeoff_figure
        >>> res = TuneResult.example().to_json()
        >>> fig = mark_tune_tradeoff(tradeoff_figure(res), res, 5, 2.0)
        >>> fig.data[-1].name, round(fig.data[-1].y[0], 3)
        ('selected', 0.4)
    """
    for c in result["cells"]:
        if c["layer"] == layer and _scale_label(c["scale"]) == _scale_label(scale):
            x = c.get(damage)
            fig.add_trace(go.Scatter(x=[None if x is None else float(x)], y=[float(c["concept"])], mode="markers",
                                     name="selected", marker=dict(size=24, symbol="square-open", color=SELECTED_COLOR,
                                                                  line=dict(width=2)),
                                     hovertemplate=f"selected: layer {layer}, scale {_scale_label(scale)}"
                                                   "<extra></extra>"))
            break
    return fig


def tune_point(result: dict, point, damage: str = "kl") -> Optional[tuple[int, float]]:
    """The ``(layer, scale)`` of a clicked point of a tune figure of ``result`` (a Dash ``clickData``
    point), or ``None``: a heatmap cell (``x`` the scale's label, ``y`` ``"L{layer}"``); a trade-off
    point of a ``layer N`` line (its scale in ``customdata[0]``); or a marker drawn over a cell (the
    Pareto ring, the recommended star, the selection) found by its concept and ``damage`` value.

    Examples:
        >>> from steerkit.apps.figures import tune_point
        >>> from steerkit.probes.tune import TuneResult
        >>> res = TuneResult.example().to_json()
        >>> tune_point(res, {"x": "4", "y": "L10"}), tune_point(res, {"x": 0.2, "y": 0.4, "curveNumber": 9})
        ((10, 4.0), (5, 2.0))
        >>> tune_point(res, {"x": "99", "y": "L10"}) is None
        True
    """
    if not isinstance(point, dict) or not isinstance(result, dict):
        return None
    try:
        return _tune_point(result, point, damage)
    except (OverflowError, ValueError, TypeError, KeyError):  # a number no cell has (or no number at all)
        return None


def _tune_point(result: dict, point: dict, damage: str) -> Optional[tuple[int, float]]:
    layers = list(result.get("layers") or ())
    scales = [float(s) for s in result.get("scales") or ()]
    x, y = point.get("x"), point.get("y")
    if isinstance(y, str) and y.startswith("L") and isinstance(x, str):
        labels = [_scale_label(s) for s in scales]
        try:
            layer = int(y[1:])
        except ValueError:
            return None
        if layer in layers and x in labels:
            return layer, scales[labels.index(x)]
        return None
    cd = point.get("customdata")
    cells = result.get("cells") or ()
    if isinstance(cd, list) and cd and isinstance(cd[0], (int, float)) and not isinstance(cd[0], bool) \
            and isinstance(y, (int, float)) and not isinstance(y, bool):
        for c in cells:  # the scale and the concept name one cell of a layer's line
            if _scale_label(c["scale"]) == _scale_label(cd[0]) and abs(float(c["concept"]) - y) <= 1e-9 * max(1, abs(y)):
                if x is None or c.get(damage) is None or (isinstance(x, (int, float)) and abs(float(c[damage]) - x)
                                                          <= 1e-9 * max(1, abs(x))):
                    return int(c["layer"]), float(c["scale"])
    if isinstance(x, (int, float)) and isinstance(y, (int, float)) and not isinstance(x, bool) \
            and not isinstance(y, bool):
        for c in cells:
            d = c.get(damage)
            if d is not None and abs(float(d) - x) <= 1e-9 * max(1, abs(x)) \
                    and abs(float(c["concept"]) - y) <= 1e-9 * max(1, abs(y)):
                return int(c["layer"]), float(c["scale"])
    return None


def tune_rows(result: dict, layer: int, scale: float) -> list[dict]:
    """The generations of the cell ``(layer, scale)`` of a tune result next to the baseline's, one row
    per prompt: ``{"prompt", "baseline", "steered"}`` (no rows when the result has no such cell).

    Examples:
        >>> from steerkit.apps.figures import tune_rows
        >>> from steerkit.probes.tune import TuneResult
        >>> tune_rows(TuneResult.example().to_json(), 5, 2.0)[0]
        {'prompt': 'a', 'baseline': '...', 'steered': '...'}
    """
    for c in result.get("cells") or ():
        if c["layer"] == layer and _scale_label(c["scale"]) == _scale_label(scale):
            base = result["baseline"]["generations"]
            return [{"prompt": p, "baseline": b, "steered": g}
                    for p, b, g in zip(result["prompts"], base, c["generations"])]
    return []


def empty_figure(message: str) -> go.Figure:
    """A figure without data showing ``message`` in its middle (what a page shows before it has a result).

    Examples:
        >>> from steerkit.apps.figures import empty_figure
        >>> fig = empty_figure("Run a profile first")
        >>> fig.layout.annotations[0].text, len(fig.data)
        ('Run a profile first', 0)
    """
    fig = go.Figure()
    fig.update_layout(template=TEMPLATE, xaxis=dict(visible=False), yaxis=dict(visible=False), height=300,
                      annotations=[dict(text=message, showarrow=False, font=dict(size=14, color="#666"))])
    return fig


def token_colors(values: Sequence[float], scale: Optional[float] = None) -> list[str]:
    """Diverging background colours (blue negative, red positive) for token projections.

    Examples:
        >>> from steerkit.apps.figures import token_colors
        >>> token_colors([1.0, -0.5, 0.0])
        ['rgba(214,39,40,0.60)', 'rgba(31,119,180,0.30)', 'rgba(214,39,40,0.00)']
    """
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
    """Tokens as HTML spans coloured by their projection (for notebooks: ``IPython.display.HTML``).

    Examples:
        >>> from steerkit.apps.figures import tokens_html
        >>> print(tokens_html(["Hi", " <there>"], [1.0, -1.0]).replace("</span><", "</span>\\n<"))
        <span title="1.000" style="background:rgba(214,39,40,0.60)">Hi</span>
        <span title="-1.000" style="background:rgba(31,119,180,0.60)"> &lt;there&gt;</span>
    """
    cols = token_colors(values, scale)
    return "".join(f'<span title="{v:.3f}" style="background:{c}">{_html.escape(t)}</span>'
                   for t, v, c in zip(tokens, values, cols))


def to_html(fig: go.Figure, path=None) -> str:
    """The figure as a standalone HTML page (plotly.js embedded; works offline). Writes ``path`` if given.

    Examples:
        >>> from steerkit.apps.figures import to_html
        >>> page = to_html(empty_figure("nothing yet"), tmp_dir / "figure.html")
        >>> page.startswith("<!doctype html>"), (tmp_dir / "figure.html").read_text(encoding="utf-8") == page
        (True, True)
    """
    s = fig.to_html(include_plotlyjs=True, full_html=True)
    if path is not None:
        Path(path).write_text(s, encoding="utf-8")
    return s


def figure_page(fig: dict) -> Optional[str]:
    """A figure a page holds (its JSON, as Dash sends it back) as a standalone HTML page, or ``None``
    when it is not a figure this app drew.

    Examples:
        >>> from steerkit.apps.figures import figure_page
        >>> figure_page(empty_figure("nothing yet").to_dict()).startswith("<!doctype html>")
        True
        >>> figure_page({"data": [{"type": "no such trace"}]}) is None
        True
    """
    try:
        return to_html(go.Figure(fig))
    except (ValueError, TypeError, KeyError):
        return None


def tune_figures(result: dict, damage: str, metric: str, *, selected: Optional[tuple[int, float]] = None,
                 stopped: bool = False) -> tuple[go.Figure, go.Figure]:
    """The Tune page's trade-off curves (concept against ``damage``) and ``metric`` heatmap of a tune
    result, with the ``selected`` cell ``(layer, scale)`` marked; ``stopped``: the grid was cut at the
    time limit (the titles say so). A result these figures cannot draw gives two empty figures saying why.

    Examples:
        >>> from steerkit.apps.figures import tune_figures
        >>> from steerkit.probes.tune import TuneResult
        >>> curves, heat = tune_figures(TuneResult.example().to_json(), "kl", "concept", selected=(5, 2.0))
        >>> curves.data[-1].name, heat.data[0].type, heat.layout.height
        ('selected', 'heatmap', 420)
        >>> tune_figures({"cells": []}, "kl", "concept")[0].layout.annotations[0].text[:30]
        'Could not draw this tune resul'
    """
    try:
        curves, heat = tradeoff_figure(result, damage=damage), heatmap_figure(result, metric)
    except (InputError, ValueError, TypeError, KeyError) as e:
        m = f"Could not draw this tune result ({type(e).__name__}: {str(e)[:200]})"
        return empty_figure(m), empty_figure(m)
    if selected is not None:
        mark_tune_tradeoff(curves, result, *selected, damage=damage)
        mark_tune_heatmap(heat, result, *selected)
    for f in (curves, heat):
        if stopped:
            f.update_layout(title=f"{f.layout.title.text} (stopped at the time limit)")
        f.update_layout(clickmode="event", height=420)
    return curves, heat


# ------------------------------------------------------------------ features (the figure is steerkit.probes.plots.sae's)
def feature_figure(report, *, stopped: bool = False, max_values: int = MAX_HISTOGRAM_VALUES) -> go.Figure:
    """The Features page's figure of a :class:`steerkit.probes.FeatureReport`: its own
    :meth:`~steerkit.probes.FeatureReport.plot` (the activation histogram, the logit effects, the nearest
    latents by decoder cosine). A report of more than ``max_values`` activations has its histogram binned
    here (40 equal bins, one bar each), so the page and its download stay small; ``stopped``: the
    reading was cut at the time limit (the title says so).

    Examples:
        >>> from steerkit.apps.figures import feature_figure
        >>> from steerkit.probes import FeatureReport
        >>> rep = FeatureReport(3, "blocks.1.hook_resid_post", 10, 0.3, torch.tensor([0.5, 1.0, 2.0]), [],
        ...                     [(" a", 1.0)], [(" b", -1.0)], [(7, 0.5)])
        >>> [t.type for t in feature_figure(rep).data]
        ['histogram', 'bar', 'bar']
        >>> binned = feature_figure(rep, max_values=2)
        >>> binned.data[0].type, sum(binned.data[0].y), binned.layout.title.text
        ('bar', 3, 'latent 3 at blocks.1.hook_resid_post')
    """
    fig = sae_feature_figure(report)
    values = report.values.reshape(-1).double().numpy()
    if values.size > max_values:
        counts, edges = np.histogram(values, bins=40)
        fig.data = fig.data[1:]  # plotly lets a figure's traces be dropped and reordered, not replaced
        fig.add_trace(go.Bar(x=((edges[:-1] + edges[1:]) / 2).tolist(), y=counts.tolist(),
                             width=float(edges[1] - edges[0]), name="activation", showlegend=False), 1, 1)
        fig.data = (fig.data[-1], *fig.data[:-1])
    if stopped:
        fig.update_layout(title=f"{fig.layout.title.text} (stopped at the time limit)")
    return fig


#: renamed figures: the probes' figure functions keep these names for their own results
_RENAMED = {"lens_figure": "vector_lens_figure", "patching_figure": "patching_run_figure"}


def __getattr__(name: str):
    if name in _RENAMED:  # the probes' figure functions keep the old names for their own results
        return moved(__name__, name, __name__, _RENAMED[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
