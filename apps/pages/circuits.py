"""The Circuits page: transcoders from the store (checked against the loaded model with
:meth:`steerkit.vectors.Transcoders.check`), the attribution graph of a prompt through them
(:func:`steerkit.apps.analysis.circuit_run`: :func:`steerkit.probes.attribution_graph` and
:func:`steerkit.probes.prune_graph`, a background job with progress and cancel), drawn by
:func:`steerkit.apps.figures.circuit_figure`; a click selects a node, whose feature's contexts are read over a set of
texts as the Features page reads a latent (:func:`steerkit.apps.analysis.node_report`); selected features are
pinned (a list in the page's state, checked against the graph on the server at every use), pinned features are
grouped into named supernodes; :mod:`.circuits_steer` clamps a supernode and saves it; :mod:`.circuits_hover` reads
every drawn feature over the texts at once, and the figure's hover then shows each feature's top contexts.

The page's state (the graph's result key, the selected node, the pinned nodes, the supernodes) lives in the browser
and is never trusted: each value is checked against the graph kept on the server before it is used.
"""
from __future__ import annotations

import warnings

from dash import Input, Output, State, ctx, html, no_update
from dash.exceptions import PreventUpdate

from steerkit.errors import InputError

from .. import analysis, figures
from .. import data as inputs
from ..data import (
    MAX_CIRCUIT_PINNED, MAX_FEATURE_CONTEXTS, MAX_FIELD_CHARS, MAX_SUPERNODE_NAME_CHARS, MAX_SUPERNODES, check_int,
    check_text,
)
from ..runtime import cache_key, should_stop
from .common import (
    Context, background, cached_reading, count, explain, key_of, note, ok, picker, ticker, time_limit, warn,
)
from .features import MAX_LABEL_CHARS, context_rows

#: the strongest inputs and outputs of the selected node listed under the figure
MAX_NODE_EDGES = 5


def transcoder_options(c: Context) -> list[dict]:
    """The picker's options: the store's newest transcoder sets, each labelled with its blocks and width."""
    out = []
    for row in c.store.list(all_versions=False):
        if row.get("kind") != "transcoders":
            continue
        parts = [str(row.get(k))[:MAX_LABEL_CHARS] for k in ("activation",) if row.get(k)]
        for k, noun in (("n_layers", "blocks"), ("d_sae", "features a block")):
            v = row.get(k)
            if isinstance(v, int) and not isinstance(v, bool):
                parts.append(f"{v} {noun}")
        if row.get("cross_layer") is True:
            parts.append("cross-layer")
        out.append({"label": f"{row['ref']} ({', '.join(parts) or '?'})", "value": row["ref"]})
    return out


def stored_transcoders(c: Context, ref):
    """The stored transcoders ``ref`` checked against the loaded model (:meth:`steerkit.vectors.Transcoders.check`:
    one per block, of its width, at sites it has; made for this model), and the check's notes."""
    ref = check_text(ref, "transcoders", MAX_FIELD_CHARS).strip()
    if not ref:
        raise InputError("expected transcoders from the store, found none; save them first "
                         "(steerkit.load_transcoders(PATH), then Store(FOLDER).save(NAME, transcoders))")
    art = c.store.load(ref)
    if art.kind != "transcoders":
        raise InputError(f"expected transcoders (transcoders), found a {art.kind} ({ref}); pick transcoders from "
                         "the list")
    with warnings.catch_warnings():  # the notes are shown on the page
        warnings.simplefilter("ignore")
        notes = art.check(c.host.get())
    return art, notes


def graph_transcoders(c: Context, run: analysis.CircuitRun, ref):
    """The transcoders ``ref`` picked (:func:`stored_transcoders`), when they are the ones the graph ``run`` was
    computed through."""
    if ref != run.transcoders:
        raise InputError(f"expected the transcoders of the graph ({run.transcoders}), found {str(ref)[:80]!r} "
                         "picked; compute the graph again")
    return stored_transcoders(c, ref)[0]


def current_run(c: Context, data) -> analysis.CircuitRun:
    """The graph the page shows (its result key in ``data``), or an error saying to compute one."""
    run = c.host.result(key_of(data))
    if not isinstance(run, analysis.CircuitRun):
        raise InputError("expected a graph, found none (or it was dropped from the cache); press Compute first")
    return run


def own(state, data, field: str, default):
    """The ``field`` of a page-state store (``{"key": graph key, field: ...}``) when it belongs to the graph of
    ``data``, else ``default`` (a state left from another graph)."""
    if isinstance(state, dict) and key_of(data) is not None and state.get("key") == key_of(data):
        return state.get(field, default)
    return default


def hover_contexts(c: Context, run: analysis.CircuitRun, data, hover):
    """The features' reading the figure's hover shows (``hover``: the page's ``circ-hover-key``,
    ``{"key": graph key, "contexts": result key}``, :mod:`.circuits_hover`) when it belongs to the graph of ``data``
    and fits ``run`` (:meth:`~steerkit.apps.analysis.GraphContexts.fits`), else ``None``."""
    read = c.host.result(key_of({"key": own(hover, data, "contexts", None)}))
    return read if isinstance(read, analysis.GraphContexts) and read.fits(run) else None


def checked_groups(run: analysis.CircuitRun, groups) -> list[dict]:
    """The supernodes of a page-state value: at most ``MAX_SUPERNODES`` of ``{"name", "nodes"}``, each name a text
    of at most ``MAX_SUPERNODE_NAME_CHARS`` characters, its nodes checked by :func:`analysis.pinned_nodes`."""
    if not isinstance(groups, list):
        raise InputError(f"expected the supernodes as a list, found {type(groups).__name__}")
    if len(groups) > MAX_SUPERNODES:
        raise InputError(f"expected at most {MAX_SUPERNODES} supernodes, found {len(groups)}")
    out = []
    for g in groups:
        if not isinstance(g, dict):
            raise InputError(f"expected a supernode as a name and its nodes, found {type(g).__name__}")
        name = check_text(g.get("name"), "a supernode's name", MAX_SUPERNODE_NAME_CHARS, allow_none=False).strip()
        out.append({"name": name, "nodes": analysis.pinned_nodes(run, g.get("nodes"))})
    return out


def node_text(run: analysis.CircuitRun, index: int):
    """The selected node described, with its strongest inputs and outputs among the edges drawn."""
    n = run.node(index)
    what = {"feature": f"feature {n.feature} of block {n.layer} at position {n.position}, activation "
                       f"{n.activation:.4g}",
            "error": f"the error of block {n.layer} at position {n.position}",
            "token": f"input token at position {n.position}",
            "logit": f"logit target, probability {n.probability or 0.0:.3g}"}[n.kind]
    ins = sorted(((w, s) for s, t, w in run.edges if t == index), key=lambda e: -abs(e[0]))[:MAX_NODE_EDGES]
    outs = sorted(((w, t) for s, t, w in run.edges if s == index), key=lambda e: -abs(e[0]))[:MAX_NODE_EDGES]

    def listed(edges):
        return "; ".join(f"{run.by_node[j].label} ({w:+.3g})" for w, j in edges) or "none drawn"
    return html.Div([html.B(f"node {n.node}: {n.label}"), html.Span(f"  {what}, influence {n.influence:.3g}"),
                     html.Div(f"strongest inputs: {listed(ins)}"), html.Div(f"strongest outputs: {listed(outs)}")],
                    className="circ-node")


def register(app, c: Context) -> None:
    """Wire the Circuits page."""
    register_transcoders(app, c)
    register_graph(app, c)
    register_pins(app, c)
    register_report(app, c)


def register_transcoders(app, c: Context) -> None:
    """The transcoder picker and its check against the loaded model."""

    @app.callback(Output("circ-tc", "options"), Output("circ-tc", "value"),
                  Input("url", "pathname"), Input("circ-rescan", "n_clicks"), Input("store-refresh", "n_clicks"),
                  State("circ-tc", "value"))
    def circuit_transcoders(path, _, __, current):
        return picker(lambda: transcoder_options(c), current)

    @app.callback(Output("circ-tc-status", "children"), Input("circ-tc", "value"), Input("model-label", "children"))
    def circuit_transcoders_status(ref, _):
        if not ref:
            return note("No transcoders in the store yet: save some (steerkit.load_transcoders(PATH), then "
                        "Store(FOLDER).save(NAME, transcoders)) and press Rescan.")
        try:
            tc, notes = stored_transcoders(c, ref)
            k = f", k={tc.k}" if tc.k else ""
            kind = "cross-layer transcoder" if tc.cross_layer else "transcoders"
            return ok(f"{ref}: {tc.activation}{k} {kind}, {tc.n_layers} blocks of {tc.d_sae} features reading "
                      f"{tc.input_hook}; they fit {c.host.get().name}." + "".join(f" Note: {n}" for n in notes))
        except Exception as e:  # noqa: BLE001
            return explain(e)


def register_graph(app, c: Context) -> None:
    """The graph (a background job), its figure, and the node a click selects."""
    host, env = c.host, c.env

    @app.callback(
        Output("circ-key", "data"), Output("circ-status", "children"),
        Input("circ-run", "n_clicks"), State("circ-tc", "value"), State("circ-prompt", "value"),
        State("circ-features", "value"), State("circ-logits", "value"), State("circ-node-threshold", "value"),
        State("circ-edge-threshold", "value"), **background("circ", interval=500))
    def run_circuit(set_progress, _, ref, prompt, n_features, n_logits, node_threshold, edge_threshold):
        """``analysis.circuit_run`` on the loaded model: progress, cancel and the time limit between batches."""
        try:
            tc, _ = stored_transcoders(c, ref)
            sm = host.get()
            key = cache_key("circuit", sm.name, ref, prompt, n_features, n_logits, node_threshold, edge_threshold)
            run, hit = host.cached(key, lambda: analysis.circuit_run(
                sm, tc, prompt, max_feature_nodes=n_features, max_n_logits=n_logits, node_threshold=node_threshold,
                edge_threshold=edge_threshold, progress=ticker(set_progress), ref=ref,
                should_stop=time_limit(env.deadline, "the graph", "ask for fewer feature nodes or a shorter prompt")))
            g = run.graph
            top = ", ".join(f"{t.token_str!r} {float(p):.1%}" for t, p in zip(g.logit_targets, g.logit_probabilities))
            return {"key": key}, ok(
                f"{count(run.tokens, 'token')}, {g.n_features} of {len(g.active_features)} active features visited; "
                f"{run.n_kept} nodes and {run.n_kept_edges} edges kept; top logits {top}; "
                + ("from the cache." if hit else f"computed in {run.seconds:.1f}s."))
        except Exception as e:  # noqa: BLE001
            return no_update, explain(e)

    @app.callback(Output("circ-graph", "figure"), Input("circ-key", "data"), Input("circ-pinned", "data"),
                  Input("circ-selected", "data"), Input("circ-hover-key", "data"))
    def draw_circuit(data, pinned, selected, hover):
        run = host.result(key_of(data))
        if not isinstance(run, analysis.CircuitRun):
            return figures.empty_figure("Pick transcoders, type a prompt and press Compute.")
        try:
            nodes = analysis.pinned_nodes(run, own(pinned, data, "nodes", []))
        except InputError:
            nodes = []
        sel = own(selected, data, "node", None)
        read = hover_contexts(c, run, data, hover)
        return figures.circuit_figure(run, pinned=nodes, selected=sel if sel in run.by_node else None,
                                      contexts=None if read is None else read.nodes)

    @app.callback(Output("circ-selected", "data"), Input("circ-graph", "clickData"), State("circ-key", "data"),
                  prevent_initial_call=True)
    def select_node(click, data):
        """The node a click names (its ``customdata``), checked against the graph on the server."""
        run = host.result(key_of(data))
        if not isinstance(run, analysis.CircuitRun) or not isinstance(click, dict):
            raise PreventUpdate
        points = click.get("points")
        if not isinstance(points, list) or not points or not isinstance(points[0], dict):
            raise PreventUpdate
        node = points[0].get("customdata")
        if isinstance(node, bool) or not isinstance(node, int) or node not in run.by_node:
            raise PreventUpdate
        return {"key": key_of(data), "node": node}

    @app.callback(Output("circ-node-info", "children"), Input("circ-selected", "data"), State("circ-key", "data"))
    def show_node(selected, data):
        run = host.result(key_of(data))
        node = own(selected, data, "node", None)
        if not isinstance(run, analysis.CircuitRun) or node not in run.by_node:
            return note("Click a node of the graph to select it.")
        return node_text(run, node)


def register_pins(app, c: Context) -> None:
    """Pinning the selected feature, and grouping the pinned features into supernodes."""
    host = c.host

    @app.callback(Output("circ-pinned", "data"), Output("circ-pin-status", "children"),
                  Input("circ-pin", "n_clicks"), Input("circ-unpin", "n_clicks"), Input("circ-clear", "n_clicks"),
                  State("circ-selected", "data"), State("circ-pinned", "data"), State("circ-key", "data"),
                  prevent_initial_call=True)
    def pin(_, __, ___, selected, pinned, data):
        try:
            run = current_run(c, data)
            nodes = analysis.pinned_nodes(run, own(pinned, data, "nodes", []))
            what = ctx.triggered_id
            if what == "circ-clear":
                return {"key": key_of(data), "nodes": []}, ok("No pinned nodes.")
            node = own(selected, data, "node", None)
            if node is None:
                raise InputError("expected a selected node, found none; click a feature node of the graph first")
            n = run.node(node)
            if what == "circ-unpin":
                nodes = [i for i in nodes if i != n.node]
            elif n.node not in nodes:
                if len(nodes) >= MAX_CIRCUIT_PINNED:
                    raise InputError(f"expected at most {MAX_CIRCUIT_PINNED} pinned nodes, found that many already; "
                                     "unpin some")
                nodes = analysis.pinned_nodes(run, nodes + [n.node])
            return {"key": key_of(data), "nodes": nodes}, ok(f"{count(nodes, 'pinned node')}.")
        except Exception as e:  # noqa: BLE001
            return no_update, explain(e)

    @app.callback(Output("circ-supernodes", "data"), Output("circ-group-status", "children"),
                  Input("circ-group", "n_clicks"), State("circ-supernode-name", "value"), State("circ-pinned", "data"),
                  State("circ-supernodes", "data"), State("circ-key", "data"), prevent_initial_call=True)
    def group(_, name, pinned, groups, data):
        try:
            run = current_run(c, data)
            nodes = analysis.pinned_nodes(run, own(pinned, data, "nodes", []))
            if not nodes:
                raise InputError("expected pinned feature nodes to group, found none; select features and press Pin")
            groups = checked_groups(run, own(groups, data, "groups", []))
            name = check_text(name, "a supernode's name", MAX_SUPERNODE_NAME_CHARS).strip()
            name = name or f"supernode {len(groups) + 1}"
            groups = [g for g in groups if g["name"] != name]  # the same name again: regrouped
            if len(groups) >= MAX_SUPERNODES:
                raise InputError(f"expected at most {MAX_SUPERNODES} supernodes, found that many already")
            groups.append({"name": name, "nodes": nodes})
            return {"key": key_of(data), "groups": groups}, ok(f"Supernode {name!r}: {count(nodes, 'feature')}.")
        except Exception as e:  # noqa: BLE001
            return no_update, explain(e)

    @app.callback(Output("circ-pinned-list", "children"), Output("circ-supernode", "options"),
                  Output("circ-supernode", "value"), Input("circ-pinned", "data"), Input("circ-supernodes", "data"),
                  State("circ-supernode", "value"), State("circ-key", "data"))
    def list_pins(pinned, groups, current, data):
        run = host.result(key_of(data))
        if not isinstance(run, analysis.CircuitRun):
            return note("No pinned nodes."), [], None
        try:
            nodes = analysis.pinned_nodes(run, own(pinned, data, "nodes", []))
            groups = checked_groups(run, own(groups, data, "groups", []))
        except InputError as e:
            return warn(str(e)), [], None
        rows = [html.Div("pinned: " + ("; ".join(run.by_node[i].label for i in nodes) or "none"), id="circ-pins")]
        rows += [html.Div(f"supernode {g['name']!r}: " + "; ".join(run.by_node[i].label for i in g["nodes"]),
                          className="circ-supernode-row") for g in groups]
        names = [g["name"] for g in groups]
        return rows, [{"label": n, "value": n} for n in names], current if current in names else (
            names[-1] if names else None)


def register_report(app, c: Context) -> None:
    """The selected feature's contexts over a set of texts (a background job)."""
    host, env = c.host, c.env

    @app.callback(
        Output("circ-report-key", "data"), Output("circ-report-status", "children"),
        Input("circ-selected", "data"), Input("circ-report-run", "n_clicks"), State("circ-key", "data"),
        State("circ-tc", "value"), State("circ-dataset", "value"), State("circ-texts", "value"),
        State("circ-top", "value"), **background("circ-report", interval=500))
    def run_report(set_progress, selected, _, data, ref, dataset, texts, top):
        try:
            run = current_run(c, data)
            node = own(selected, data, "node", None)
            if node is None or run.node(node).kind != "feature":
                return no_update, note("Select a feature node (a circle) to read its contexts.")
            top = check_int(top, "a number of contexts", 1, MAX_FEATURE_CONTEXTS)
            texts = inputs.feature_texts(dataset, texts)
            tc = graph_transcoders(c, run, ref)
            sm = host.get()
            key = cache_key("circuit-report", sm.name, ref, key_of(data), node, texts, top)
            rep, hit, key, cut = cached_reading(host, key, lambda: analysis.node_report(
                sm, tc, run, node, texts, top=top, progress=ticker(set_progress), should_stop=should_stop,
                deadline=env.deadline), env.deadline)
            return {"key": key}, ok(f"{run.node(node).label}: density {rep.report.density:.3g} over "
                                    f"{count(rep.texts, 'text')}; " + ("from the cache." if hit else
                                                                      f"computed in {rep.seconds:.1f}s.") + cut)
        except Exception as e:  # noqa: BLE001
            return no_update, explain(e)

    @app.callback(Output("circ-contexts", "children"), Input("circ-report-key", "data"))
    def draw_report(data):
        rep = host.result(key_of(data))
        if not isinstance(rep, analysis.FeatureRun):
            return note("Select a feature node to read its contexts over the texts.")
        return context_rows(rep)
