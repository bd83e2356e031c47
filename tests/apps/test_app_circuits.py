"""The Circuits page without a browser: its computations, figure, bounds and callbacks.

The computations run on a tiny random model (tests/support/tiny_models.py) with random ReLU transcoders built here:
the page's graph against ``steerkit.probes.attribution_graph`` and ``prune_graph`` called directly, a feature
node's report against ``steerkit.probes.feature_report`` of the block's transcoder as an SAE, every drawn feature read
at once (``graph_contexts``, the figure's hover) against each node's report. The callbacks run
through Flask's test client on an app over the tiny model and a temporary store holding its transcoders, transcoders
of another model and an SAE.
"""
from __future__ import annotations

import time

import pytest

pytest.importorskip("plotly", reason="the app extra (plotly, dash) is not installed")
pytest.importorskip("dash", reason="the app extra (plotly, dash) is not installed")

import torch  # noqa: E402

from steerkit.apps import analysis, figures  # noqa: E402
from steerkit.apps import data as limits  # noqa: E402
from steerkit.apps.analysis import Cancelled  # noqa: E402
from steerkit.errors import InputError  # noqa: E402
from steerkit.probes import attribution_graph, feature_report, intervene_graph, prune_graph  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from dash_requests import callback_key, callbacks_of, fuzz_callbacks, post, strings, text_of  # noqa: E402

pytestmark = pytest.mark.timeout(600)

PROMPT = "The cat sat on the mat"
TEXTS = ["the cat sat on the mat", "a dog ran far away", "hello there", "one two three four", "x y z"]


def random_transcoders(sm, n=32, seed=0, n_layers=None):
    """Random ReLU transcoders of ``sm`` (provenance: ``sm``), ``n`` features a block; features fire on most tokens."""
    from steerkit.vectors import Provenance, Transcoders
    L, d = n_layers or sm.n_layers, sm.d_model
    g = torch.Generator().manual_seed(seed)
    return Transcoders([torch.randn(n, d, generator=g) for _ in range(L)], [torch.full((n,), -2.0)] * L,
                       [torch.randn(n, d, generator=g) / 8 for _ in range(L)], [torch.zeros(d)] * L,
                       provenance=Provenance.from_model(sm) if n_layers is None else Provenance())


@pytest.fixture(scope="module")
def tc(tiny):
    return random_transcoders(tiny)


@pytest.fixture(scope="module")
def run(tiny, tc):
    return analysis.circuit_run(tiny, tc, PROMPT, max_feature_nodes=40, max_n_logits=3, ref="tiny-tc@1")


def features_of(run):
    return [n for n in run.nodes if n.kind == "feature"]


# ------------------------------------------------------------------ the computations
def test_the_graph_is_attribution_graph_pruned(tiny, tc, run):
    want = attribution_graph(tiny, tc, PROMPT, max_feature_nodes=40, max_n_logits=3, batch_size=64, progress=False)
    torch.testing.assert_close(run.graph.adjacency_matrix, want.adjacency_matrix)
    assert torch.equal(run.graph.selected_features, want.selected_features)
    nodes, edges, scores = prune_graph(want)
    assert torch.equal(run.pruned.node_mask, nodes) and torch.equal(run.pruned.edge_mask, edges)
    # every kept node is drawn (a few dozen here), each described as what it is
    assert [n.node for n in run.nodes] == torch.where(nodes)[0].tolist() and run.n_kept == len(run.nodes)
    assert len(features_of(run)) >= 3, "the pruned graph keeps features: the page has something to pin"
    for n in run.nodes:
        assert n.kind == want.node_kind(n.node) and n.influence == pytest.approx(float(scores[n.node]))
        if n.kind == "feature":
            a = int(want.selected_features[n.node])
            assert [n.layer, n.position, n.feature] == want.active_features[a].tolist()
            assert n.activation == pytest.approx(float(want.activation_values[a]))
    logits = [n for n in run.nodes if n.kind == "logit"]
    assert [n.probability for n in logits] == pytest.approx(want.logit_probabilities.tolist())
    assert [n.label.split("'")[1] for n in logits] == [t.token_str.strip("'") for t in want.logit_targets]
    # the edges drawn: every kept edge (fewer than the bound), strongest first, with the graph's weights
    assert run.n_kept_edges == int(edges.sum()) == len(run.edges)
    assert all(bool(edges[t, s]) and w == pytest.approx(float(want.adjacency_matrix[t, s])) for s, t, w in run.edges)
    assert [abs(w) for _, _, w in run.edges] == sorted((abs(w) for _, _, w in run.edges), reverse=True)


def test_drawing_keeps_tokens_logits_and_the_most_influential(run):
    nodes, edges, n_kept, n_edges = analysis.drawn(run.graph, run.pruned, max_nodes=run.graph.n_pos + 5, max_edges=7)
    kinds = [n.kind for n in nodes]
    assert kinds.count("token") == run.graph.n_pos and kinds.count("logit") == run.graph.n_logits
    inner = [n for n in nodes if n.kind in ("feature", "error")]
    best = sorted((n for n in run.nodes if n.kind in ("feature", "error")), key=lambda n: n.influence)
    assert len(nodes) == run.graph.n_pos + 5 and {n.node for n in inner} == {n.node for n in best[:5 - run.graph.n_logits]}
    assert len(edges) == 7 and n_kept == run.n_kept and n_edges == run.n_kept_edges
    drawn_ids = {n.node for n in nodes}
    assert all(s in drawn_ids and t in drawn_ids for s, t, _ in edges)


def test_progress_ticks_and_cancel(tiny, tc):
    ticks = []
    analysis.circuit_run(tiny, tc, PROMPT, max_feature_nodes=20, batch_size=8, progress=lambda d, t: ticks.append((d, t)))
    assert ticks[0] == (0, 20) and ticks[-1] == (20, 20) and len(ticks) == 4  # 8, 16, 20
    calls = []
    with pytest.raises(Cancelled):
        analysis.circuit_run(tiny, tc, PROMPT, max_feature_nodes=20, batch_size=8,
                             should_stop=lambda: calls.append(1) or len(calls) > 2)
    assert len(calls) == 3  # stopped inside the graph, after its second batch of rows


@pytest.mark.parametrize("change, message", [
    ({"prompt": "x" * (limits.MAX_CIRCUIT_PROMPT_CHARS + 1)}, f"at most {limits.MAX_CIRCUIT_PROMPT_CHARS} characters"),
    ({"prompt": "one " * 80}, f"a prompt of at most {limits.MAX_CIRCUIT_TOKENS} tokens"),
    ({"prompt": "  "}, "expected a prompt to trace, found nothing"),
    ({"prompt": ["a"]}, "the prompt as text, found list"),
    ({"max_feature_nodes": limits.MAX_CIRCUIT_FEATURE_NODES + 1}, f"feature nodes from 1 to {limits.MAX_CIRCUIT_FEATURE_NODES}"),
    ({"max_feature_nodes": 0}, "feature nodes from 1 to"),
    ({"max_feature_nodes": True}, "feature nodes from 1 to"),
    ({"max_feature_nodes": "5"}, "feature nodes from 1 to"),
    ({"max_n_logits": limits.MAX_CIRCUIT_LOGITS + 1}, f"logit targets from 1 to {limits.MAX_CIRCUIT_LOGITS}"),
    ({"node_threshold": 1.5}, "a node threshold from 0 to 1"),
    ({"edge_threshold": -0.1}, "an edge threshold from 0 to 1"),
    ({"edge_threshold": float("nan")}, "an edge threshold from 0 to 1"),
])
def test_graph_bounds(tiny, tc, change, message):
    args = dict(prompt=PROMPT, max_feature_nodes=8, max_n_logits=2, node_threshold=0.8, edge_threshold=0.98)
    args.update(change)
    prompt = args.pop("prompt")
    with pytest.raises(InputError, match=message):
        analysis.circuit_run(tiny, tc, prompt, **args)


def test_a_feature_nodes_report_is_feature_report_through_its_block(tiny, tc, run):
    node = features_of(run)[0]
    got = analysis.node_report(tiny, tc, run, node.node, TEXTS, top=3).report
    want = feature_report(tiny, tc.layer_sae(node.layer), node.feature, TEXTS, top=3, progress=False)
    assert got.site == f"blocks.{node.layer}.mlp.hook_in" and got.latent == node.feature
    assert got.contexts == want.contexts and got.density == want.density and got.top_logits == want.top_logits
    assert want.n_tokens > 0
    # the SAE view encodes as the transcoders do
    x = torch.randn(3, tiny.d_model)
    torch.testing.assert_close(tc.layer_sae(node.layer).encode(x), tc.encode_layer(x, node.layer))
    error = next(n for n in run.nodes if n.kind == "error")
    with pytest.raises(InputError, match="expected a feature node to read over the texts, found error node"):
        analysis.node_report(tiny, tc, run, error.node, TEXTS)


def test_every_drawn_feature_read_at_once_is_its_node_report(tiny, tc, run):
    read = analysis.graph_contexts(tiny, tc, run, TEXTS, top=3)
    feats = features_of(run)
    assert sorted(read.nodes) == [n.node for n in feats] and read.fits(run) and not read.stopped_at_deadline
    assert (read.n_read, read.n_texts, read.top, read.transcoders) == (5, 5, 3, "tiny-tc@1")
    assert read.n_features == len({(n.layer, n.feature) for n in feats})
    for a in feats:  # the nodes of one feature (at several positions) share its one reading
        assert all(read.nodes[a.node] is read.nodes[b.node] for b in feats if (b.layer, b.feature) == (a.layer, a.feature))
    fired = 0
    for n in feats:
        want = analysis.node_report(tiny, tc, run, n.node, TEXTS, top=3).report
        got = read.nodes[n.node]
        assert (got.site, got.latent) == (want.site, want.latent) == (f"blocks.{n.layer}.mlp.hook_in", n.feature)
        assert got.contexts == want.contexts and got.density == want.density and got.n_tokens == want.n_tokens
        fired += len(got.contexts) == 3
    assert fired >= 3, "features that fire on the texts: their contexts are compared"
    # a chunk of texts per call (progress, cancel, the deadline): merged as the Features page merges a latent's calls
    ticks = []
    chunked = analysis.graph_contexts(tiny, tc, run, TEXTS, top=2, batch_size=2,
                                      progress=lambda done, total: ticks.append((done, total)))
    assert ticks == [(0, 3), (1, 3), (2, 3), (3, 3)]
    for n in feats:
        want = analysis.feature_run(tiny, tc.layer_sae(n.layer), n.feature, TEXTS, top=2, batch_size=2).report
        assert chunked.nodes[n.node].contexts == want.contexts and chunked.nodes[n.node].density == want.density
    with pytest.raises(Cancelled):
        analysis.graph_contexts(tiny, tc, run, TEXTS, batch_size=2, should_stop=lambda: len(ticks) > 5,
                                progress=lambda done, total: ticks.append(done))
    cut = analysis.graph_contexts(tiny, tc, run, TEXTS, batch_size=2, deadline=0.0)
    assert cut.stopped_at_deadline and cut.texts == TEXTS[:2] and cut.n_texts == 5 and cut.fits(run)
    assert all(r.n_tokens < read.nodes[i].n_tokens for i, r in cut.nodes.items())


def test_reading_the_drawn_features_is_bounded(tiny, tc, run):
    import dataclasses

    from steerkit.errors import SteerkitError
    from steerkit.vectors import Transcoders
    for kwargs, message in [({"top": 0}, "a number of contexts from 1 to 50"),
                            ({"top": limits.MAX_FEATURE_CONTEXTS + 1}, "a number of contexts from 1 to 50"),
                            ({"top": True}, "a number of contexts"), ({"batch_size": 0}, "a batch size from 1 to"),
                            ({"texts": "one text"}, "the texts as a list of texts, found str"),
                            ({"texts": ["a", 3]}, "the texts as a list of texts, found other values"),
                            ({"texts": [" ", ""]}, "expected at least one text"),
                            ({"texts": ["x"] * (limits.MAX_FEATURE_TEXTS + 1)}, f"at most {limits.MAX_FEATURE_TEXTS}"),
                            ({"texts": ["x" * (limits.MAX_FEATURE_DOC_CHARS + 1)]},
                             f"at most {limits.MAX_FEATURE_DOC_CHARS} characters")]:
        args = {"texts": TEXTS, **kwargs}
        with pytest.raises(InputError, match=message):
            analysis.graph_contexts(tiny, tc, run, args.pop("texts"), **args)
    bare = dataclasses.replace(run, nodes=[n for n in run.nodes if n.kind != "feature"])
    with pytest.raises(InputError, match="expected feature nodes in the graph drawn"):
        analysis.graph_contexts(tiny, tc, bare, TEXTS)
    L, d, n = tiny.n_layers, tiny.d_model, 32  # a cross-layer transcoder: refused as a node's report refuses it
    clt = Transcoders([torch.randn(n, d)] * L, [torch.zeros(n)] * L, [torch.randn(n, L - l, d) for l in range(L)],
                      [torch.zeros(d)] * L, cross_layer=True)
    with pytest.raises(SteerkitError, match="cross-layer transcoder"):
        analysis.graph_contexts(tiny, clt, run, TEXTS)
    with pytest.raises(SteerkitError, match="cross-layer transcoder"):
        analysis.node_report(tiny, clt, run, features_of(run)[0].node, TEXTS)
    # a reading fits only the graph it read
    read = analysis.graph_contexts(tiny, tc, run, TEXTS[:2])
    other = dataclasses.replace(run, nodes=[n for n in run.nodes if n.node != features_of(run)[0].node])
    assert read.fits(run) and not read.fits(other)


def test_pinned_nodes_are_checked_against_the_graph(run):
    f = [n.node for n in features_of(run)]
    assert analysis.pinned_nodes(run, [f[1], f[0], f[1]]) == [f[1], f[0]]
    logit = run.nodes[-1]
    for nodes, message in [("1,2", "the pinned nodes as a list, found str"), ([True], "a node of the graph drawn"),
                           ([10 ** 9], "a node of the graph drawn"), (["3"], "a node of the graph drawn"),
                           ([logit.node], "expected feature nodes (what a supernode clamps), found logit node"),
                           ([f[0]] * (limits.MAX_CIRCUIT_PINNED + 1), f"at most {limits.MAX_CIRCUIT_PINNED} pinned")]:
        with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
            analysis.pinned_nodes(run, nodes)


def forward_last(sm, graph, steering=None):
    from steerkit.model import Tokens
    ids = graph.input_tokens.reshape(1, -1)
    toks = Tokens(ids, torch.ones_like(ids))
    with torch.no_grad():
        if steering is None:
            return sm.forward(toks)[0, -1].float()
        with sm.steer(steering):
            return sm.forward(toks)[0, -1].float()


def test_a_supernode_clamped_changes_the_logits_through_its_artifact(tiny, tc, run):
    nodes = [n.node for n in features_of(run)[:3]]
    effect = analysis.supernode_effect(tiny, tc, run, nodes, mode="scale", amount=0.0)
    want = intervene_graph(tiny, run.graph, tc, nodes, scale=0.0, top_k=10)
    torch.testing.assert_close(effect.logits_after, want.logits_after)
    torch.testing.assert_close(effect.logits_before, forward_last(tiny, run.graph))
    assert (effect.logits_after - effect.logits_before).abs().max() > 1e-4, "ablating the supernode moves the logits"
    # the artifact the page saves, at the nodes' positions, steers the prompt to the same logits (sm.steer(artifact))
    clamp = analysis.supernode_artifact(tc, run, nodes, mode="scale", amount=0.0, positions="graph")
    torch.testing.assert_close(forward_last(tiny, run.graph, clamp), effect.logits_after)
    assert clamp.provenance.method_params["nodes"] == nodes
    assert clamp.provenance.method_params["transcoders"] == tc.fingerprint()
    # everywhere: at least the nodes' positions, so here at least as large a change
    wide = analysis.supernode_artifact(tc, run, nodes, positions="all")
    assert all(p.positions == "all" for p in wide.parts)
    value = analysis.supernode_effect(tiny, tc, run, nodes, mode="value", amount=5.0)
    assert value.how == "value" and not torch.allclose(value.logits_after, effect.logits_after)


@pytest.mark.parametrize("nodes, mode, amount, message", [
    ([], "scale", 0.0, "expected a supernode of at least one feature node, found none"),
    (None, "scale", 0.0, "expected the pinned nodes as a list"),
    ("logit", "scale", 0.0, "expected feature nodes (what a supernode clamps), found logit node"),
    ("f", "mean", 0.0, "expected a clamp in ['scale', 'value']"),
    ("f", "scale", limits.MAX_CIRCUIT_SCALE + 1, f"a scale as a finite number from -{limits.MAX_CIRCUIT_SCALE:g} to"),
    ("f", "value", limits.MAX_CIRCUIT_VALUE * 2, f"a value as a finite number from -{limits.MAX_CIRCUIT_VALUE:g} to"),
    ("f", "scale", float("nan"), "a scale as a finite number"),
    ("f", "scale", "0", "a scale as a finite number"),
    ("f", "scale", True, "a scale as a finite number"),
])
def test_intervention_bounds(tiny, tc, run, nodes, mode, amount, message):
    nodes = {"logit": [run.nodes[-1].node], "f": [features_of(run)[0].node]}.get(nodes, nodes) \
        if isinstance(nodes, str) else nodes
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        analysis.supernode_effect(tiny, tc, run, nodes, mode=mode, amount=amount)
    with pytest.raises(InputError):
        analysis.supernode_artifact(tc, run, nodes, mode=mode, amount=amount)
    with pytest.raises(InputError, match="where the clamp acts"):
        analysis.supernode_artifact(tc, run, [features_of(run)[0].node], positions="everywhere")


# ------------------------------------------------------------------ the figure
def test_the_figure_draws_every_node_and_edge(run):
    f = [n.node for n in features_of(run)]
    fig = figures.circuit_figure(run, pinned=f[:2], selected=f[0])
    by_name = {t.name: t for t in fig.data}
    for kind, name in (("feature", "features"), ("error", "errors"), ("token", "tokens"), ("logit", "logits")):
        want = [n.node for n in run.nodes if n.kind == kind]
        assert list(by_name[name].customdata) == want, kind
    assert list(by_name["pinned"].customdata) == f[:2] and list(by_name["selected"].customdata) == [f[0]]
    xy = figures.node_positions(run)
    for n in run.nodes:  # y: the block (tokens at 0, logits at the top); x: within the position's column
        assert xy[n.node][1] == {"token": 0, "logit": run.graph.n_layers + 1}.get(n.kind, n.layer + 1)
        if n.kind != "logit":
            assert abs(xy[n.node][0] - n.position) <= 0.45
    segments = sum(len(t.x) // 3 for t in fig.data if t.name.startswith("edges"))
    assert segments == len(run.edges)
    widths = {t.name: t.line.width for t in fig.data if t.name.startswith("edges")}
    strongest = max(run.edges, key=lambda e: abs(e[2]))
    assert widths[f"edges {'+' if strongest[2] >= 0 else '-'}4"] == max(widths.values())
    assert list(fig.layout.xaxis.ticktext)[1:] == run.tokens[1:] and len(fig.layout.xaxis.ticktext) == run.graph.n_pos
    logit_text = list(by_name["logits"].text)
    assert all("%" in t for t in logit_text) and len(logit_text) == run.graph.n_logits


def test_markup_in_tokens_is_shown_as_text(tiny, tc):
    run = analysis.circuit_run(tiny, tc, "<b>x</b> & y", max_feature_nodes=8)
    fig = figures.circuit_figure(run)
    assert "<b>" in "".join(run.tokens) and "<b>" not in "".join(fig.layout.xaxis.ticktext)
    assert "&lt;b&gt;" in "".join(fig.layout.xaxis.ticktext)


MARKUP = ["the <b>cat</b> sat on the mat", "a <i>dog</i> ran far & away", "<script>x</script> hello there",
          "one <b>two</b> three four", "x y <br> z"]


def test_the_hover_shows_each_features_contexts_escaped_and_bounded(tiny, tc, run):
    import html

    read = analysis.graph_contexts(tiny, tc, run, MARKUP)
    feats = features_of(run)
    fig = figures.circuit_figure(run, selected=feats[0].node, contexts=read.nodes)
    by_name = {t.name: t for t in fig.data}
    hovers = dict(zip(by_name["features"].customdata, by_name["features"].hovertext))
    for n in feats:
        h, r = hovers[n.node], read.nodes[n.node]
        assert h.startswith(f"<b>{html.escape(n.label, quote=False)}</b>")
        assert f"density {r.density:.3g} ({r.n_active} of {r.n_tokens} tokens)" in h
        lines = h.split("<br>")
        shown = r.contexts[:figures.HOVER_CONTEXTS]
        if not shown:
            assert lines[-1] == "fires on none of the texts read"
            continue
        assert lines[-len(shown):] == [figures.snippet(c) for c in shown]
        assert h.count("<b>") == h.count("</b>") == 1, h  # the label's; every markup of the texts escaped
        assert "<i>" not in h and "<script" not in h and "<br> z" not in h
        for line in lines[-len(shown):]:
            text = html.unescape(line)  # the value, the text around the token and the marks: about HOVER_CHARS
            assert "«" in text and "»" in text and len(text) <= figures.HOVER_CHARS + 16, text
    assert any("&lt;b&gt;" in h or "&lt;script&gt;" in h or "&lt;i&gt;" in h for h in hovers.values())
    assert sum(len(read.nodes[n.node].contexts) == 3 for n in feats) >= 3
    ring = by_name["selected"]
    assert list(ring.hovertext) == [hovers[feats[0].node]]  # the selected node's ring hovers as its node
    # the other nodes' hovers are as before, and without contexts= no feature's hover reads any
    plain = {t.name: t for t in figures.circuit_figure(run).data}
    assert list(plain["tokens"].hovertext) == list(by_name["tokens"].hovertext)
    assert not any("density" in h for h in plain["features"].hovertext)


def test_a_snippet_is_one_short_line_around_its_token():
    long = {"tokens": ["a" * 500, "\n<b>" + "t" * 300, "z\r\x00\tq" * 100], "index": 1, "value": 2.5}
    text = figures.snippet(long)
    assert text.startswith("2.5: …a") and text.endswith("…") and "<" not in text and "\n" not in text
    assert "«↵&lt;b&gt;" + "t" * (figures.HOVER_TOKEN_CHARS - 4) + "»" in text  # the token cut to its bound
    assert len(text) <= figures.HOVER_CHARS + 30 and "\x00" not in text and "\r" not in text
    assert figures.snippet({"tokens": ["x"], "index": 0, "value": 1.0}) == "1: «x»"


def test_the_page_has_its_inputs_figures_and_bounds():
    from steerkit.apps import layout

    def walk(c):
        yield c
        kids = getattr(c, "children", None)
        for k in kids if isinstance(kids, list) else [kids] if kids is not None and not isinstance(kids, str) else []:
            yield from walk(k)
    assert ("/circuits", "Circuits") in layout.PAGES
    assert layout.FIGURES["circ-graph"] == "attribution_graph" and layout.FIGURES["circ-effect"] == "supernode_effect"
    comps = list(walk(layout.circuits_page()))
    ids = {getattr(c, "id", None) for c in comps}
    assert {"circ-tc", "circ-rescan", "circ-prompt", "circ-features", "circ-logits", "circ-node-threshold",
            "circ-edge-threshold", "circ-run", "circ-cancel", "circ-progress", "circ-graph", "dl-circ-graph",
            "circ-pin", "circ-unpin", "circ-clear", "circ-supernode-name", "circ-group", "circ-supernode", "circ-mode",
            "circ-scale", "circ-int-run", "circ-effect", "circ-positions", "circ-save-name", "circ-save",
            "circ-dataset", "circ-texts", "circ-top", "circ-report-run", "circ-contexts", "circ-hover-run",
            "circ-hover-cancel", "circ-hover-progress", "circ-hover-status"} <= ids
    text = " ".join(str(getattr(c, "children", "")) for c in comps)
    for bound in (f"at most {limits.MAX_CIRCUIT_TOKENS} tokens", f"1 to {limits.MAX_CIRCUIT_FEATURE_NODES}",
                  f"1 to {limits.MAX_CIRCUIT_LOGITS}", f"At most {limits.MAX_CIRCUIT_PINNED} pinned features"):
        assert bound in text, bound
    shell_ids = {getattr(c, "id", None) for c in walk(layout.shell("m", 2, "s", "r"))}
    assert {"circ-key", "circ-selected", "circ-pinned", "circ-supernodes", "circ-report-key",
            "circ-effect-key", "circ-hover-key", "page-circuits"} <= shell_ids
    assert "Read the drawn features" in text


# ------------------------------------------------------------------ the callbacks (Flask test client)
@pytest.fixture(scope="module")
def app(tiny, tc, tmp_path_factory):
    from steerkit.apps.app import create_app
    from steerkit.sae import SAEWeights
    from steerkit.vectors import SAE, Store
    root = tmp_path_factory.mktemp("circuits")
    store = Store(root / "store")
    store.save("tiny-tc", tc)
    store.save("short-tc", random_transcoders(tiny, n_layers=tiny.n_layers + 1))
    W = torch.randn(16, tiny.d_model)
    store.save("tiny-sae", SAE(SAEWeights(W.T.clone(), torch.zeros(16), W, torch.zeros(tiny.d_model)),
                               "blocks.1.hook_resid_post"))
    (root / "results").mkdir()
    return create_app(tiny, store=str(root / "store"), results=str(root / "results"), cache_dir=str(root / "cache"),
                      port=8050, deadline=30.0)


@pytest.fixture()
def client(app):
    return app.server.test_client()


GOOD = {"circ-run.n_clicks": 1, "circ-tc.value": "tiny-tc@1", "circ-prompt.value": PROMPT, "circ-features.value": 40,
        "circ-logits.value": 3, "circ-node-threshold.value": 0.8, "circ-edge-threshold.value": 0.98}


def response(r, component, prop):
    return r.get_json()["response"][component][prop]


def compute(app, client, **changes):
    vals = dict(GOOD, **{f"circ-{k.replace('_', '-')}.value": v for k, v in changes.items()})
    r = post(client, app, callback_key(app, "circ-key.data"), vals)
    assert r.status_code == 200, r.data[:300]
    return r


@pytest.fixture()
def graph_key(app, client):
    r = compute(app, client)
    return response(r, "circ-key", "data")


def test_the_picker_lists_the_stores_transcoders(app, client, tiny):
    r = post(client, app, callback_key(app, "circ-tc.options"), {"url.pathname": "/circuits"})
    opts = response(r, "circ-tc", "options")
    assert [o["value"] for o in opts] == ["short-tc@1", "tiny-tc@1"]  # not the SAE
    L = tiny.n_layers
    assert opts[1]["label"] == f"tiny-tc@1 (relu, {L} blocks, 32 features a block)"
    key = callback_key(app, "circ-tc-status.children")
    assert f"relu transcoders, {L} blocks of 32 features reading mlp.hook_in; they fit {tiny.name}" in text_of(
        post(client, app, key, {"circ-tc.value": "tiny-tc@1"}))
    msg = text_of(post(client, app, key, {"circ-tc.value": "short-tc@1"}))
    assert f"expected a transcoder for each of the model's {L} blocks, found {L + 1}" in msg and "⚠" in msg
    assert "expected transcoders (transcoders), found a sae (tiny-sae@1)" in text_of(
        post(client, app, key, {"circ-tc.value": "tiny-sae@1"}))
    assert "No transcoders in the store yet" in text_of(post(client, app, key, {"circ-tc.value": None}))


def test_a_graph_computes_draws_and_is_the_analysis_one(app, client, tiny, tc, run):
    r = compute(app, client)
    msg = text_of(r)
    assert "nodes and" in msg and "edges kept; top logits" in msg and "⚠" not in msg, msg[:400]
    key = response(r, "circ-key", "data")
    got = app.steerkit_env.host.result(key["key"])
    assert [n.node for n in got.nodes] == [n.node for n in run.nodes] and got.edges == run.edges
    r = post(client, app, callback_key(app, "circ-graph.figure"), {"circ-key.data": key})
    fig = response(r, "circ-graph", "figure")
    assert {"features", "errors", "tokens", "logits"} <= {t["name"] for t in fig["data"]}
    assert "from the cache" in text_of(compute(app, client))
    # the figure downloads as standalone HTML through the app's download callback
    r = post(client, app, callback_key(app, "download-fig.data"), {"dl-circ-graph.n_clicks": 1,
                                                                   "circ-graph.figure": fig},
             changed="dl-circ-graph.n_clicks")
    dl = response(r, "download-fig", "data")
    assert dl["filename"] == "attribution_graph.html" and "attribution graph of" in dl["content"]


@pytest.mark.parametrize("field, value, message", [
    ("prompt", "one " * 80, f"at most {limits.MAX_CIRCUIT_TOKENS} tokens"),
    ("prompt", "x" * (limits.MAX_CIRCUIT_PROMPT_CHARS + 1), f"at most {limits.MAX_CIRCUIT_PROMPT_CHARS} characters"),
    ("prompt", None, "expected a prompt to trace, found nothing"),
    ("features", 10 ** 9, f"feature nodes from 1 to {limits.MAX_CIRCUIT_FEATURE_NODES}"),
    ("features", None, "feature nodes from 1 to"),
    ("logits", 99, f"logit targets from 1 to {limits.MAX_CIRCUIT_LOGITS}"),
    ("node_threshold", 7, "a node threshold from 0 to 1"),
    ("edge_threshold", "x", "an edge threshold from 0 to 1"),
    ("tc", "short-tc@1", "expected a transcoder for each of the model's"),
    ("tc", "tiny-sae@1", "expected transcoders (transcoders), found a sae"),
    ("tc", "../../etc/passwd", "expected"),
    ("tc", None, "expected transcoders from the store, found none"),
])
def test_graph_request_values_are_bounded(app, client, field, value, message):
    t = time.monotonic()
    r = compute(app, client, **{field: value})
    msg = text_of(r)
    assert message in msg, msg[:400]
    assert "circ-key" not in r.get_json().get("response", {}) and "Traceback" not in msg
    assert time.monotonic() - t < 30


def test_the_time_limit_stops_a_graph_with_a_message(app, client, monkeypatch):
    env = app.steerkit_env
    monkeypatch.setattr(env, "deadline", 0.0)
    r = compute(app, client, features=41)  # settings not cached
    msg = text_of(r)
    assert "expected the graph to finish within the time limit of 0 s per request" in msg, msg[:400]
    assert "fewer feature nodes or a shorter prompt" in msg and "circ-key" not in r.get_json()["response"]


def click(app, client, key, node):
    r = post(client, app, callback_key(app, "circ-selected.data"),
             {"circ-graph.clickData": {"points": [{"customdata": node}]}, "circ-key.data": key})
    return r


def test_a_click_selects_a_node_and_describes_it(app, client, graph_key):
    run = app.steerkit_env.host.result(graph_key["key"])
    f = features_of(run)[0]
    r = click(app, client, graph_key, f.node)
    selected = response(r, "circ-selected", "data")
    assert selected == {"key": graph_key["key"], "node": f.node}
    r = post(client, app, callback_key(app, "circ-node-info.children"), {"circ-selected.data": selected,
                                                                        "circ-key.data": graph_key})
    msg = text_of(r)
    assert f"node {f.node}: {f.label}" in msg and f"feature {f.feature} of block {f.layer}" in msg
    assert "strongest inputs:" in msg and "strongest outputs:" in msg
    for junk in (10 ** 9, True, "3", None, [1], -1):
        assert click(app, client, graph_key, junk).status_code == 204, junk
    for data in ({"points": []}, {"points": "x"}, "x", None, {"points": [3]}):
        r = post(client, app, callback_key(app, "circ-selected.data"), {"circ-graph.clickData": data,
                                                                       "circ-key.data": graph_key})
        assert r.status_code == 204, data
    assert click(app, client, {"key": "0" * 24}, f.node).status_code == 204  # no such graph


def pin(app, client, key, button, selected, pinned):
    vals = {f"{button}.n_clicks": 1, "circ-selected.data": selected, "circ-pinned.data": pinned, "circ-key.data": key}
    return post(client, app, callback_key(app, "circ-pinned.data"), vals, changed=f"{button}.n_clicks")


def test_pin_unpin_clear_and_group(app, client, graph_key):
    run = app.steerkit_env.host.result(graph_key["key"])
    k = graph_key["key"]
    f = [n.node for n in features_of(run)]
    pinned = None
    for node in f[:3]:
        r = pin(app, client, graph_key, "circ-pin", {"key": k, "node": node}, pinned)
        pinned = response(r, "circ-pinned", "data")
    assert pinned == {"key": k, "nodes": f[:3]} and "3 pinned nodes" in text_of(r)
    r = pin(app, client, graph_key, "circ-unpin", {"key": k, "node": f[1]}, pinned)
    pinned = response(r, "circ-pinned", "data")
    assert pinned["nodes"] == [f[0], f[2]]
    # a logit cannot be pinned; a state from another graph is not this graph's
    r = pin(app, client, graph_key, "circ-pin", {"key": k, "node": run.nodes[-1].node}, pinned)
    assert "expected feature nodes (what a supernode clamps), found logit node" in text_of(r)
    r = pin(app, client, graph_key, "circ-pin", {"key": "other", "node": f[1]}, pinned)
    assert "expected a selected node, found none" in text_of(r)
    r = pin(app, client, graph_key, "circ-pin", {"key": k, "node": f[1]}, {"key": k, "nodes": [10 ** 9]})
    assert "a node of the graph drawn" in text_of(r) and "circ-pinned" not in r.get_json()["response"]
    # group the pinned features into a supernode; the list shows it and the picker offers it
    group = callback_key(app, "circ-supernodes.data")
    r = post(client, app, group, {"circ-group.n_clicks": 1, "circ-supernode-name.value": "cats", "circ-pinned.data": pinned,
                                  "circ-supernodes.data": None, "circ-key.data": graph_key})
    groups = response(r, "circ-supernodes", "data")
    assert groups == {"key": k, "groups": [{"name": "cats", "nodes": [f[0], f[2]]}]}
    r = post(client, app, callback_key(app, "circ-pinned-list.children"), {
        "circ-pinned.data": pinned, "circ-supernodes.data": groups, "circ-key.data": graph_key})
    assert f"supernode 'cats': {run.by_node[f[0]].label}" in text_of(r)
    assert response(r, "circ-supernode", "options") == [{"label": "cats", "value": "cats"}]
    assert response(r, "circ-supernode", "value") == "cats"
    for name, groups_in, message in [("x" * (limits.MAX_SUPERNODE_NAME_CHARS + 1), None, "at most 64 characters"),
                                     ("y", {"key": k, "groups": [{"name": f"g{i}", "nodes": [f[0]]}
                                                                  for i in range(limits.MAX_SUPERNODES)]},
                                      f"at most {limits.MAX_SUPERNODES} supernodes"),
                                     ("y", {"key": k, "groups": [{"name": "g", "nodes": [run.nodes[-1].node]}]},
                                      "expected feature nodes")]:
        r = post(client, app, group, {"circ-group.n_clicks": 1, "circ-supernode-name.value": name,
                                      "circ-pinned.data": pinned, "circ-supernodes.data": groups_in,
                                      "circ-key.data": graph_key})
        assert message in text_of(r) and "circ-supernodes" not in r.get_json()["response"], message
    r = pin(app, client, graph_key, "circ-clear", None, pinned)
    assert response(r, "circ-pinned", "data") == {"key": k, "nodes": []}


def test_a_selected_feature_reads_its_contexts(app, client, graph_key, tiny, tc):
    run = app.steerkit_env.host.result(graph_key["key"])
    f = features_of(run)[0]
    vals = {"circ-selected.data": {"key": graph_key["key"], "node": f.node}, "circ-key.data": graph_key,
            "circ-tc.value": "tiny-tc@1", "circ-dataset.value": "custom", "circ-texts.value": "\n".join(TEXTS),
            "circ-top.value": 3}
    r = post(client, app, callback_key(app, "circ-report-key.data"), vals, changed="circ-selected.data")
    msg = text_of(r)
    assert f"{f.label}: density" in msg and "5 texts" in msg, msg[:400]
    key = response(r, "circ-report-key", "data")
    want = feature_report(tiny, tc.layer_sae(f.layer), f.feature, TEXTS, top=3, progress=False)
    assert app.steerkit_env.host.result(key["key"]).report.contexts == want.contexts
    r = post(client, app, callback_key(app, "circ-contexts.children"), {"circ-report-key.data": key})
    kids = r.get_json()["response"]["circ-contexts"]["children"]
    assert len(kids) == 1 + len(want.contexts) and "density" in strings(kids[0])
    for field, value, message in [("circ-top.value", 10 ** 6, "a number of contexts from 1 to 50"),
                                  ("circ-texts.value", "x" * (limits.MAX_FEATURE_DOC_CHARS + 1), "at most 2000"),
                                  ("circ-tc.value", "short-tc@1", "expected the transcoders of the graph")]:
        r = post(client, app, callback_key(app, "circ-report-key.data"), dict(vals, **{field: value}),
                 changed="circ-selected.data")
        assert message in text_of(r) and "circ-report-key" not in r.get_json()["response"], message
    error = next(n for n in run.nodes if n.kind == "error")
    r = post(client, app, callback_key(app, "circ-report-key.data"),
             dict(vals, **{"circ-selected.data": {"key": graph_key["key"], "node": error.node}}),
             changed="circ-selected.data")
    assert "Select a feature node" in text_of(r)


def test_read_the_drawn_features_and_hover(app, client, graph_key, tiny, tc):
    run = app.steerkit_env.host.result(graph_key["key"])
    vals = {"circ-hover-run.n_clicks": 1, "circ-key.data": graph_key, "circ-tc.value": "tiny-tc@1",
            "circ-dataset.value": "custom", "circ-texts.value": "\n".join(MARKUP)}
    read_key = callback_key(app, "circ-hover-key.data")
    r = post(client, app, read_key, vals)
    msg = text_of(r)
    want = analysis.graph_contexts(tiny, tc, run, MARKUP, top=figures.HOVER_CONTEXTS)
    assert (f"Read {want.n_features} features ({len(want.nodes)} drawn feature nodes) over 5 texts: hover a feature "
            "node") in msg and "⚠" not in msg, msg[:400]
    hover = response(r, "circ-hover-key", "data")
    assert hover["key"] == graph_key["key"]
    read = app.steerkit_env.host.result(hover["contexts"])
    assert all(read.nodes[i].contexts == want.nodes[i].contexts for i in want.nodes)
    assert "from the cache" in text_of(post(client, app, read_key, vals))
    # the graph redrawn with the key: each feature's hover carries its contexts, escaped
    draw = callback_key(app, "circ-graph.figure")
    fig = response(post(client, app, draw, {"circ-key.data": graph_key, "circ-hover-key.data": hover}),
                   "circ-graph", "figure")
    trace = next(t for t in fig["data"] if t["name"] == "features")
    hovers = dict(zip(trace["customdata"], trace["hovertext"]))
    for i, r in want.nodes.items():
        assert f"density {r.density:.3g}" in hovers[i]
        assert all(figures.snippet(c) in hovers[i] for c in r.contexts[:figures.HOVER_CONTEXTS])
    assert any("&lt;" in h for h in hovers.values()) and all(h.count("<b>") == 1 for h in hovers.values())
    # a key of another graph, a forged one, or none: the hover without contexts
    for other in ({"key": "0" * 24, "contexts": hover["contexts"]}, {"key": graph_key["key"], "contexts": "x" * 100},
                  {"key": graph_key["key"], "contexts": graph_key["key"]}, None, "x"):
        fig = response(post(client, app, draw, {"circ-key.data": graph_key, "circ-hover-key.data": other}),
                       "circ-graph", "figure")
        trace = next(t for t in fig["data"] if t["name"] == "features")
        assert not any("density" in h for h in trace["hovertext"]), other
    # a click still selects the node and reads its full report
    f = features_of(run)[0]
    assert response(click(app, client, graph_key, f.node), "circ-selected", "data") == {"key": graph_key["key"],
                                                                                         "node": f.node}
    for field, value, message in [("circ-texts.value", "x" * (limits.MAX_FEATURE_DOC_CHARS + 1), "at most 2000"),
                                  ("circ-texts.value", "", "expected"),
                                  ("circ-dataset.value", "nope", "expected"),
                                  ("circ-tc.value", "short-tc@1", "expected the transcoders of the graph"),
                                  ("circ-key.data", {"key": "0" * 24}, "press Compute first"),
                                  ("circ-key.data", None, "press Compute first")]:
        r = post(client, app, read_key, dict(vals, **{field: value}))
        assert message in text_of(r) and "circ-hover-key" not in r.get_json()["response"], (field, text_of(r)[:300])


def test_the_time_limit_keeps_the_features_read_so_far(app, client, graph_key, monkeypatch):
    monkeypatch.setattr(app.steerkit_env, "deadline", 0.0)
    texts = [f"text number {i} about cats" for i in range(40)]
    r = post(client, app, callback_key(app, "circ-hover-key.data"), {
        "circ-hover-run.n_clicks": 1, "circ-key.data": graph_key, "circ-tc.value": "tiny-tc@1",
        "circ-dataset.value": "custom", "circ-texts.value": "\n".join(texts)})
    msg = text_of(r)
    assert "over 16 texts" in msg and "Stopped at the time limit of 0 s per request after 16 of 40 texts" in msg, msg
    hover = response(r, "circ-hover-key", "data")
    read = app.steerkit_env.host.result(hover["contexts"])
    assert read.stopped_at_deadline and read.texts == texts[:16]


def supernode_state(run, key, name="cats", n=2):
    nodes = [f.node for f in features_of(run)[:n]]
    return nodes, {"key": key, "groups": [{"name": name, "nodes": nodes}]}


def test_intervene_on_a_supernode_and_save_it(app, client, graph_key, tiny, tc):
    from steerkit.vectors import Store
    run = app.steerkit_env.host.result(graph_key["key"])
    nodes, groups = supernode_state(run, graph_key["key"])
    vals = {"circ-int-run.n_clicks": 1, "circ-key.data": graph_key, "circ-supernode.value": "cats",
            "circ-supernodes.data": groups, "circ-mode.value": "scale", "circ-scale.value": 0, "circ-tc.value": "tiny-tc@1"}
    r = post(client, app, callback_key(app, "circ-effect-key.data"), vals)
    msg = text_of(r)
    assert "Supernode 'cats' (2 features scaled by 0 at their positions): top next token" in msg, msg[:400]
    key = response(r, "circ-effect-key", "data")
    effect = app.steerkit_env.host.result(key["key"])
    want = intervene_graph(tiny, run.graph, tc, nodes, scale=0.0)
    torch.testing.assert_close(effect.logits_after, want.logits_after)
    for c in effect.target_changes():
        assert f"{c['token']!r} {c['logit_change']:+.3f}" in msg
    r = post(client, app, callback_key(app, "circ-effect.figure"), {"circ-effect-key.data": key})
    fig = response(r, "circ-effect", "figure")
    assert [t["name"] for t in fig["data"]] == ["before", "after", "logit change"]
    assert fig["layout"]["title"]["text"] == "supernode 'cats' clamped"
    # save: the store keeps the supernode's clamp; loaded, it steers the prompt as the page did (at the nodes)
    save = callback_key(app, "circ-save-status.children")
    svals = {"circ-save.n_clicks": 1, "circ-save-name.value": "cats-off", "circ-key.data": graph_key,
             "circ-supernode.value": "cats", "circ-supernodes.data": groups, "circ-mode.value": "scale",
             "circ-scale.value": 0, "circ-positions.value": "graph", "circ-tc.value": "tiny-tc@1"}
    msg = text_of(post(client, app, save, svals))
    assert "Saved supernode 'cats' as cats-off@1: a latent clamp of 2 features" in msg, msg[:400]
    loaded = Store(app.steerkit_env.store_path).load("cats-off@1")
    assert loaded.kind == "latent_clamp" and loaded.provenance.method_params["nodes"] == nodes
    torch.testing.assert_close(forward_last(tiny, run.graph, loaded), effect.logits_after)
    for field, value, message in [("circ-save-name.value", "", "expected a store name for the clamp"),
                                  ("circ-save-name.value", "bad/name", "expected"),
                                  ("circ-supernode.value", "dogs", "expected a supernode of this graph, found 'dogs'"),
                                  ("circ-positions.value", "x", "expected where the clamp acts in ['all', 'graph']"),
                                  ("circ-scale.value", 1e9, "a scale as a finite number from -100 to 100"),
                                  ("circ-mode.value", None, "expected a clamp in ['scale', 'value']"),
                                  ("circ-tc.value", "short-tc@1", "expected the transcoders of the graph")]:
        msg = text_of(post(client, app, save, dict(svals, **{field: value})))
        assert message in msg and "Saved" not in msg, (field, msg[:300])
    assert [v["ref"] for v in Store(app.steerkit_env.store_path).list("cats-off")] == ["cats-off@1"]
    for field, value, message in [("circ-scale.value", -101, "a scale as a finite number from -100 to 100"),
                                  ("circ-supernodes.data", {"key": graph_key["key"], "groups": "x"},
                                   "expected the supernodes as a list"),
                                  ("circ-supernodes.data", None, "expected a supernode of this graph")]:
        r = post(client, app, callback_key(app, "circ-effect-key.data"), dict(vals, **{field: value}))
        assert message in text_of(r) and "circ-effect-key" not in r.get_json()["response"], field


@pytest.mark.parametrize("headers", [{"Host": "evil.example:8050"},
                                     {"Host": "127.0.0.1:8050", "Origin": "http://evil.example"}])
def test_the_host_check_covers_the_circuit_callbacks(app, client, headers, monkeypatch):
    called = []
    monkeypatch.setattr(analysis, "circuit_run", lambda *a, **k: called.append(1))
    assert post(client, app, callback_key(app, "circ-key.data"), GOOD, headers=headers).status_code == 403
    assert post(client, app, callback_key(app, "circ-tc-status.children"), {"circ-tc.value": "tiny-tc@1"},
                headers=headers).status_code == 403
    assert not called


def test_fuzz_the_circuit_callbacks(app, client, graph_key):
    """Random values for every input of the Circuits page's callbacks: never a server error, never a traceback."""
    keys = callbacks_of(app, "circ-")
    assert len(keys) >= 12
    run = app.steerkit_env.host.result(graph_key["key"])
    _, groups = supernode_state(run, graph_key["key"])

    def real_graph(values, data):
        if "circ-key.data" in values and data.draw(st.booleans(), label="the real graph"):
            values["circ-key.data"] = graph_key
        if "circ-tc.value" in values and data.draw(st.booleans(), label="stored transcoders"):
            values["circ-tc.value"] = "tiny-tc@1"
        if "circ-supernodes.data" in values and data.draw(st.booleans(), label="a real supernode"):
            values["circ-supernodes.data"], values["circ-supernode.value"] = groups, "cats"
    fuzz_callbacks(app, client, keys, seconds=40, examples=150, tweak=real_graph)
