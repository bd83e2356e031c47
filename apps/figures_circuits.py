"""The Circuits page's figures: :func:`circuit_figure` draws a pruned attribution graph
(:class:`steerkit.apps.analysis.CircuitRun`), nodes by block (y) and position (x), edges by weight;
:func:`effect_figure` a supernode's intervention (:class:`steerkit.probes.GraphIntervention`). A figure module (it
imports plotly), re-exported by :mod:`steerkit.apps.figures`.

Rows, bottom to top: the prompt's tokens (labelled along the x axis), one row per block (its features and its error
node at each position, side by side within the position's column), the logit targets at the top (each labelled with
its token and probability). Features are circles coloured by activation, errors grey squares, tokens green
diamonds, logits red triangles; pinned nodes get a gold ring, the selected node a black one. Edges are lines, blue
where the source raises the target, red where it lowers it, wider and more opaque the larger ``|weight|`` is (five
widths, relative to the largest edge drawn). Every node carries its node index as ``customdata`` (a click on it
names it) and its description on hover; with the features read over a set of texts (``contexts=``), a feature's
hover also shows its density and its strongest contexts, each a short :func:`snippet` with the firing token marked
«so» (every text escaped: plotly reads some HTML in hover text).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Mapping, Optional, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

#: how each node kind is drawn: trace name, marker symbol, colour
NODE_STYLE = {"feature": ("features", "circle", None), "error": ("errors", "square", "#9e9e9e"),
              "token": ("tokens", "diamond", "#2ca02c"), "logit": ("logits", "triangle-up", "#d62728")}
EDGE_COLORS = {True: "31,119,180", False: "214,39,40"}  # raises, lowers
#: edge widths (pixels) and opacities of the five weight bins, weakest first
EDGE_BINS = ((0.6, 0.25), (1.0, 0.35), (1.6, 0.5), (2.4, 0.65), (3.6, 0.85))
PIN_COLOR = "#f5b700"
#: a feature node's hover (with ``contexts=``): its strongest contexts shown, the characters of each around its
#: firing token, and of the firing token itself
HOVER_CONTEXTS = 3
HOVER_CHARS = 72
HOVER_TOKEN_CHARS = 24


def node_positions(run: Any) -> dict[int, tuple[float, float]]:
    """``{node index: (x, y)}`` of the drawn nodes of ``run``: y is 0 for tokens, ``layer + 1`` for a block's
    features and errors, ``n_layers + 1`` for logits; x is the position, nodes sharing a block and a position spread
    across the column (features by index, then the error); the logits spread over the last columns, one each.

    Examples:
        >>> from steerkit.apps.analysis import CircuitNode
        >>> from steerkit.apps.figures import node_positions
        >>> class Run:
        ...     graph = type("G", (), {"n_layers": 2, "n_pos": 3})()
        ...     nodes = [CircuitNode(0, "feature", 1, 2, 5, 1.0, 0.1, "a"), CircuitNode(1, "feature", 1, 2, 9, 1.0, 0.2, "b"),
        ...              CircuitNode(7, "token", -1, 0, None, 0.0, 0.0, "t"), CircuitNode(9, "logit", 2, 2, None, 0.0, 0.0, "l")]
        >>> {k: (round(x, 2), y) for k, (x, y) in node_positions(Run()).items()}
        {0: (1.91, 2), 1: (2.09, 2), 7: (0.0, 0), 9: (2.0, 3)}
    """
    L, P = run.graph.n_layers, run.graph.n_pos
    cells: dict[tuple[int, int], list] = defaultdict(list)
    logits = []
    for n in run.nodes:
        if n.kind == "logit":
            logits.append(n)
        else:
            cells[(n.layer + 1, n.position)].append(n)
    out: dict[int, tuple[float, float]] = {}
    for (row, pos), ns in cells.items():
        ns.sort(key=lambda n: (n.kind != "feature", n.feature if n.feature is not None else 0))
        m = len(ns)
        step = min(0.18, 0.8 / m)
        for k, n in enumerate(ns):
            out[n.node] = (pos + (k - (m - 1) / 2) * step, row)
    step = 1.0 if len(logits) < 2 else min(1.0, (P - 1) / (len(logits) - 1)) if P > 1 else 0.8 / len(logits)
    for k, n in enumerate(logits):
        out[n.node] = (P - 1 - (len(logits) - 1 - k) * step, L + 1)
    return out


def _hover(n: Any, contexts: Optional[Mapping[int, Any]] = None) -> str:
    what = {"feature": f"feature {n.feature} of block {n.layer}<br>activation {n.activation:.3g}",
            "error": f"error of block {n.layer}", "token": "input token",
            "logit": f"logit target, probability {n.probability or 0.0:.3g}"}[n.kind]
    text = f"<b>{_esc(n.label)}</b><br>node {n.node}, position {n.position}<br>{what}<br>influence {n.influence:.3g}"
    reading = None if contexts is None or n.kind != "feature" else contexts.get(n.node)
    if reading is None:
        return text
    text += f"<br>density {reading.density:.3g} ({reading.n_active} of {reading.n_tokens} tokens)"
    shown = reading.contexts[:HOVER_CONTEXTS]
    return text + ("".join(f"<br>{snippet(c)}" for c in shown) if shown else "<br>fires on none of the texts read")


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


#: line breaks shown as a mark, tabs as a space, other control characters dropped: a hover line stays one line
_VISIBLE = str.maketrans({**{chr(i): None for i in range(32)}, "\n": "↵", "\t": " ", "\x7f": None})


def snippet(context: Mapping[str, Any], chars: int = HOVER_CHARS) -> str:
    """One context of a feature (an entry of the ``contexts`` of :class:`steerkit.probes.FeatureReport` or
    :class:`steerkit.probes.sae_features.LatentContexts`) as one short line for a hover label: its activation and
    about ``chars`` characters of text around the firing token, which is marked «so» (at most ``HOVER_TOKEN_CHARS``
    of it); ``…`` where the text was cut, ``↵`` for a line break; markup escaped.

    Examples:
        >>> from steerkit.apps.figures_circuits import snippet
        >>> snippet({"tokens": ["<b>", " the", " cat", " sat"], "index": 2, "value": 1.25})
        '1.25: &lt;b&gt; the «cat» sat'
        >>> snippet({"tokens": ["x" * 50, " cat", "\\n" + "y" * 50], "index": 1, "value": 3.0}, chars=24)
        '3: …xxxxxxxxxxxxxxx «cat»↵yyyy…'
    """
    toks = [str(t).translate(_VISIBLE) for t in context["tokens"]] or [""]
    i = min(max(0, int(context["index"])), len(toks) - 1)
    token = toks[i].lstrip() or toks[i]  # a word's leading space goes before the mark: « cat» reads as «cat»
    lead, token = toks[i][:len(toks[i]) - len(token)], token[:HOVER_TOKEN_CHARS]
    room = max(0, chars - len(token))
    before, after = "".join(toks[:i]) + lead, "".join(toks[i + 1:])
    n_after = min(len(after), room // 4)  # the text before the token gets the most room, as a report's window does
    n_before = min(len(before), room - n_after)
    n_after = min(len(after), room - n_before)
    if n_before < len(before):
        before = "…" + before[len(before) - n_before:]
    if n_after < len(after):
        after = after[:n_after] + "…"
    return f"{float(context['value']):.3g}: {_esc(before)}«{_esc(token)}»{_esc(after)}"


def _edge_traces(run: Any, xy: dict) -> list[go.Scatter]:
    edges = [(s, t, w) for s, t, w in run.edges if s in xy and t in xy]
    top = max((abs(w) for _, _, w in edges), default=0.0) or 1.0
    lines: dict[tuple[bool, int], tuple[list, list]] = defaultdict(lambda: ([], []))
    for s, t, w in edges:
        b = min(len(EDGE_BINS) - 1, int(abs(w) / top * len(EDGE_BINS)))
        xs, ys = lines[(w >= 0, b)]
        xs += [xy[s][0], xy[t][0], None]
        ys += [xy[s][1], xy[t][1], None]
    out = []
    for (positive, b), (xs, ys) in sorted(lines.items()):
        width, alpha = EDGE_BINS[b]
        out.append(go.Scatter(x=xs, y=ys, mode="lines", hoverinfo="skip", showlegend=False,
                              name=f"edges {'+' if positive else '-'}{b}",
                              line=dict(width=width, color=f"rgba({EDGE_COLORS[positive]},{alpha})")))
    return out


def _node_trace(kind: str, nodes: list, xy: dict, contexts: Optional[Mapping[int, Any]]) -> go.Scatter:
    name, symbol, color = NODE_STYLE[kind]
    marker: dict[str, Any] = dict(symbol=symbol, size=9 if kind == "feature" else 11, line=dict(width=0.5, color="#333"))
    if color is None:  # features: coloured by activation
        marker.update(color=[n.activation for n in nodes], colorscale="Oranges", cmin=0, showscale=False)
    else:
        marker["color"] = color
    text = [_esc(n.label) for n in nodes] if kind == "logit" else None
    return go.Scatter(x=[xy[n.node][0] for n in nodes], y=[xy[n.node][1] for n in nodes], name=name,
                      mode="markers+text" if text else "markers", text=text, textposition="top center",
                      textfont=dict(size=10), marker=marker, customdata=[n.node for n in nodes],
                      hovertext=[_hover(n, contexts) for n in nodes], hoverinfo="text", hoverlabel=dict(align="left"))


def _ring(name: str, nodes: Iterable[int], xy: dict, run: Any, color: str, size: int,
          contexts: Optional[Mapping[int, Any]]) -> Optional[go.Scatter]:
    shown = [i for i in nodes if i in xy]
    if not shown:
        return None
    return go.Scatter(x=[xy[i][0] for i in shown], y=[xy[i][1] for i in shown], name=name, mode="markers",
                      marker=dict(symbol="circle-open", size=size, line=dict(width=3, color=color), color=color),
                      customdata=shown, hovertext=[_hover(run.by_node[i], contexts) for i in shown], hoverinfo="text",
                      hoverlabel=dict(align="left"))


def circuit_figure(run: Any, *, pinned: Sequence[int] = (), selected: Optional[int] = None,
                   contexts: Optional[Mapping[int, Any]] = None) -> go.Figure:
    """The pruned graph of ``run`` (:class:`steerkit.apps.analysis.CircuitRun`) as the module docstring describes,
    with the nodes of ``pinned`` ringed in gold and ``selected`` in black. ``contexts`` (``{node: reading}``, the
    ``nodes`` of :class:`steerkit.apps.analysis.GraphContexts`): a feature node's hover then adds its feature's
    density and its ``HOVER_CONTEXTS`` strongest contexts over the texts read, each a :func:`snippet`.

    Examples:
        >>> from steerkit.vectors import Transcoders
        >>> from steerkit.apps.analysis import circuit_run
        >>> from steerkit.apps.figures import circuit_figure
        >>> g = torch.Generator().manual_seed(0)
        >>> L, d, n = tiny.n_layers, tiny.d_model, 32
        >>> tc = Transcoders([torch.randn(n, d, generator=g) for _ in range(L)], [torch.full((n,), -2.0)] * L,
        ...                  [torch.randn(n, d, generator=g) / 8 for _ in range(L)], [torch.zeros(d)] * L)
        >>> run = circuit_run(tiny, tc, "The cat sat", max_feature_nodes=16)
        >>> fig = circuit_figure(run, pinned=[run.nodes[0].node])
        >>> {t.name for t in fig.data} >= {"tokens", "logits", "pinned"}
        True
        >>> run.tokens[0], fig.layout.xaxis.ticktext[0]  # the tokens, as text (markup escaped)
        ('<|im_start|>', '&lt;|im_start|&gt;')
        >>> from steerkit.apps.analysis import graph_contexts
        >>> read = graph_contexts(tiny, tc, run, ["the <b>cat</b> sat", "a dog ran"])
        >>> hover = next(t for t in circuit_figure(run, contexts=read.nodes).data if t.name == "features").hovertext
        >>> all("density" in h for h in hover), any("\u00ab" in h for h in hover), any("<b>cat" in h for h in hover)
        (True, True, False)
    """
    L, P = run.graph.n_layers, run.graph.n_pos
    xy = node_positions(run)
    traces: list[go.Scatter] = _edge_traces(run, xy)
    for kind in ("error", "token", "feature", "logit"):
        nodes = [n for n in run.nodes if n.kind == kind]
        if nodes:
            traces.append(_node_trace(kind, nodes, xy, contexts))
    for ring in (_ring("pinned", pinned, xy, run, PIN_COLOR, 17, contexts),
                 _ring("selected", [] if selected is None else [selected], xy, run, "#000", 21, contexts)):
        if ring is not None:
            traces.append(ring)
    fig = go.Figure(traces)
    n_features = sum(n.kind == "feature" for n in run.nodes)
    shown = "" if len(run.nodes) == run.n_kept else f" (the {len(run.nodes)} most influential drawn)"
    fig.update_layout(
        template="plotly_white", height=max(420, 90 + 26 * (L + 2)), margin=dict(l=60, r=20, t=70, b=80),
        title=dict(text=f"attribution graph of {_esc(run.prompt[:80])!r}: {run.n_kept} nodes kept{shown}, "
                        f"{n_features} features, {len(run.edges)} of {run.n_kept_edges} edges",
                   font=dict(size=13)),
        hovermode="closest", clickmode="event", dragmode="pan",
        legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1.0),
        xaxis=dict(tickmode="array", tickvals=list(range(P)), ticktext=[_esc(t) for t in run.tokens], tickangle=-45,
                   range=[-0.7, P - 0.3], showgrid=False, zeroline=False, title="position (token)"),
        yaxis=dict(tickmode="array", tickvals=list(range(L + 2)),
                   ticktext=["emb"] + [f"L{l}" for l in range(L)] + ["logits"], range=[-0.6, L + 1.9],
                   showgrid=True, gridcolor="#f0f0f0", zeroline=False, title="block"))
    return fig


def effect_figure(effect: Any, title: str = "") -> go.Figure:
    """A supernode's intervention (:class:`steerkit.probes.GraphIntervention`): left, the top next tokens before and
    after (their probabilities, the tokens of both lists); right, each logit target's logit change.

    Examples:
        >>> from steerkit.probes import GraphIntervention, LogitTarget
        >>> from steerkit.apps.figures import effect_figure
        >>> r = GraphIntervention([0], "scale", 0.0, torch.tensor([2.0, 1.0]), torch.tensor([1.0, 2.0]),
        ...                       [LogitTarget("a", 0)], {0: "a", 1: "b"}, top_k=1)
        >>> fig = effect_figure(r)
        >>> [t.name for t in fig.data], list(fig.data[2].y)
        (['before', 'after', 'logit change'], [-1.0])
    """
    before, after = effect.top(), effect.top(after=True)
    ids = list(dict.fromkeys([r["token_id"] for r in before] + [r["token_id"] for r in after]))
    pb, pa = effect.probs_before, effect.probs_after
    labels = [_esc(repr(effect.texts.get(i, str(i)))) for i in ids]
    changes = effect.target_changes()
    fig = make_subplots(rows=1, cols=2, column_widths=[0.6, 0.4], horizontal_spacing=0.12,
                        subplot_titles=("next-token probability", "logit targets: logit change"))
    fig.add_trace(go.Bar(x=labels, y=[float(pb[i]) for i in ids], name="before", marker_color="#9e9e9e"), 1, 1)
    fig.add_trace(go.Bar(x=labels, y=[float(pa[i]) for i in ids], name="after", marker_color="#1f77b4"), 1, 1)
    fig.add_trace(go.Bar(x=[_esc(repr(c["token"])) for c in changes], y=[c["logit_change"] for c in changes],
                         name="logit change", marker_color=["#1f77b4" if c["logit_change"] >= 0 else "#d62728"
                                                            for c in changes],
                         hovertext=[f"{c['logit_before']:.3f} -> {c['logit_after']:.3f} (p {c['prob_before']:.3f} -> "
                                    f"{c['prob_after']:.3f})" for c in changes]), 1, 2)
    fig.update_layout(template="plotly_white", height=340, barmode="group", margin=dict(l=50, r=20, t=60, b=80),
                      title=dict(text=_esc(title), font=dict(size=13)),
                      legend=dict(orientation="h", yanchor="bottom", y=1.08, xanchor="right", x=1.0))
    fig.update_xaxes(tickangle=-45)
    return fig
