"""Attribution graphs over many prompts (steerkit.probes.attribution_graphs) and graph files (Graph.save / load), on a
tiny random Llama with random transcoders: each prompt's pruned graph is what attribution_graph + prune_graph give
alone; the recurring features on a case built by hand; the same through a LocalExecutor whose state is a
CircuitWorker (what a Ray worker holds; tests/integration/test_ray.py runs it on Ray); the JSON file and the figure;
the inputs refused; a graph saved and loaded back field for field, and files that are not graphs refused."""
from __future__ import annotations

import json

import pytest
import torch

import steerkit
from steerkit.errors import InputError
from steerkit.executors import LocalExecutor, ModelSpec, RayExecutor
from steerkit.probes import (AttributionGraphs, CircuitSpec, Graph, PrunedGraph, attribution_graph, attribution_graphs,
                             compute_graph_scores, prune_graph)
from steerkit.probes.attribution_batch import CircuitWorker, RecurringFeature, _graph_task, recurring_features
from steerkit.probes.graph import compute_influence, normalize_matrix
from tiny_models import random_transcoders

PROMPTS = ["Hello world, it is", "The cat sat on the", "Hello there, the cat"]
OPTIONS = dict(max_feature_nodes=40, batch_size=16)
NODES = 0.95  # the node threshold: these random features carry little of the logits' influence, so 0.8 keeps none


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sm(circuit_sm):
    return circuit_sm


@pytest.fixture(scope="module")
def tc(sm):
    return random_transcoders(sm, d_sae=48, activation="jumprelu", seed=11, scale=3.0)


@pytest.fixture(scope="module")
def result(sm, tc):
    return attribution_graphs(sm, tc, PROMPTS, keep_graphs=True, progress=False, node_threshold=NODES, **OPTIONS)


def same_pruned(a: PrunedGraph, b: PrunedGraph) -> None:
    assert torch.equal(a.nodes, b.nodes) and a.kinds == b.kinds and a.labels == b.labels
    assert torch.equal(a.features, b.features) and torch.equal(a.activations, b.activations)
    assert torch.allclose(a.adjacency, b.adjacency, atol=1e-6) and torch.allclose(a.influence, b.influence, atol=1e-6)
    assert a.logit_targets == b.logit_targets and a.prompt == b.prompt
    assert a.replacement_score == pytest.approx(b.replacement_score, abs=1e-6)
    assert a.completeness_score == pytest.approx(b.completeness_score, abs=1e-6)


def test_each_prompt_is_attribution_graph_then_prune_graph(sm, tc, result):
    assert [g.prompt for g in result.graphs] == [attribution_graph(sm, tc, p, progress=False).input_string
                                                 for p in PROMPTS]
    for prompt, got in zip(PROMPTS, result.graphs):
        alone = attribution_graph(sm, tc, prompt, progress=False, **OPTIONS)
        assert torch.equal(got.graph.adjacency_matrix, alone.adjacency_matrix)
        nodes, edges, _ = prune_graph(alone, NODES)
        kept = torch.where(nodes)[0]
        assert torch.equal(got.nodes, kept) and len(kept) < alone.adjacency_matrix.shape[0]
        assert torch.equal(got.adjacency, (alone.adjacency_matrix * edges)[kept][:, kept])
        assert got.adjacency.count_nonzero() == edges.sum()  # every kept edge joins kept nodes
        n_feat = int((kept < alone.n_features).sum())
        assert got.kinds == [alone.node_kind(int(i)) for i in kept] and got.kinds.count("feature") == n_feat
        assert torch.equal(got.features, alone.active_features[alone.selected_features[kept[:n_feat]]])
        weights = torch.zeros(alone.adjacency_matrix.shape[0])
        weights[-alone.n_logits:] = alone.logit_probabilities
        assert torch.allclose(got.influence, compute_influence(normalize_matrix(alone.adjacency_matrix), weights)[kept])
        assert (got.replacement_score, got.completeness_score) == compute_graph_scores(alone)
        l, p, f = got.features[0].tolist()
        assert got.labels[0] == f"L{l} F{f} @{p}" and got.labels[-1].startswith("logit ")
    assert result.features == recurring_features(result.graphs)
    assert result.recurring() and all(f.n_prompts >= 2 for f in result.recurring())
    assert {f.n_prompts for f in result.features} - {1, 2, 3} == set()


def test_recurring_features_on_a_case_built_by_hand():
    def pruned(feats, influence):
        n = len(feats)
        return PrunedGraph("p", torch.tensor([1]), [], torch.arange(n + 1), ["feature"] * n + ["logit"], [""] * (n + 1),
                           torch.tensor(feats).reshape(-1, 3), torch.ones(n), torch.zeros(n + 1, n + 1),
                           torch.tensor([*influence, 0.0]), [], torch.zeros(1), 1.0, 1.0)
    a = pruned([[1, 2, 5], [1, 4, 5], [0, 3, 9]], [0.25, 0.5, 0.125])  # feature (1, 5) at two positions: 0.75
    b = pruned([[1, 3, 5], [2, 1, 9]], [0.25, 1.0])
    c = pruned([[0, 1, 9], [2, 2, 9]], [0.5, 0.5])  # (0, 9) in a and c; (2, 9) in b and c
    got = recurring_features([a, b, c])
    assert got == [RecurringFeature(2, 9, 2, 0.75), RecurringFeature(1, 5, 2, 0.5),
                   RecurringFeature(0, 9, 2, 0.3125)]
    res = AttributionGraphs([a, b, c], got, 0.8, 0.98, {})
    assert res.recurring(3) == [] and res.recurring(2) == got
    assert recurring_features([pruned([], [])]) == []


def test_a_local_executor_on_a_worker_state_gives_the_same(sm, tc, result):
    spread = attribution_graphs(sm, "unused: the workers hold the transcoders", PROMPTS,
                                LocalExecutor(CircuitWorker(sm, tc)), progress=False, node_threshold=NODES, **OPTIONS)
    for a, b in zip(spread.graphs, result.graphs):
        same_pruned(a, b)
        assert a.graph is None
    assert spread.features == result.features
    here = attribution_graphs(sm, tc, PROMPTS, LocalExecutor(sm), progress=False, node_threshold=NODES, **OPTIONS)
    assert [torch.equal(a.nodes, b.nodes) for a, b in zip(here.graphs, result.graphs)] == [True] * 3


def test_transcoders_by_reference_are_loaded(sm, tc, result, tmp_path):
    path = tc.save(tmp_path / "tc.safetensors")
    by_path = attribution_graphs(sm, str(path), PROMPTS[:1], progress=False, node_threshold=NODES, **OPTIONS)
    same_pruned(by_path.graphs[0], result.graphs[0])


def test_json_file_and_figure(result, tmp_path):
    doc = json.loads(result.to_json(tmp_path / "out" / "graphs.json").read_text())
    assert len(doc["graphs"]) == 3 and doc["options"] == OPTIONS and doc["node_threshold"] == NODES
    g0, p0 = doc["graphs"][0], result.graphs[0]
    assert [n["label"] for n in g0["nodes"]] == p0.labels
    assert len(g0["edges"]) == int(p0.adjacency.count_nonzero())
    t, s, w = g0["edges"][0]
    assert p0.adjacency[t, s].item() == pytest.approx(w)
    assert g0["nodes"][0]["layer"] == p0.features[0, 0].item() and "layer" not in g0["nodes"][-1]
    assert doc["features"][0] == result.features[0]._asdict()
    pytest.importorskip("plotly")
    fig = result.plot(top=5)
    bar = fig.data[0]
    assert list(bar.y) == [f.n_prompts for f in result.features[:5]]
    assert list(bar.x) == [f"L{f.layer} F{f.feature}" for f in result.features[:5]]


def test_inputs_refused(sm, tc):
    with pytest.raises(InputError, match="list of strings"):
        attribution_graphs(sm, tc, "one prompt")
    with pytest.raises(InputError, match="between 1 and"):
        attribution_graphs(sm, tc, [])
    with pytest.raises(InputError, match="node_threshold"):
        attribution_graphs(sm, tc, PROMPTS, node_threshold=1.5)
    with pytest.raises(InputError, match="progress="):
        attribution_graphs(sm, tc, PROMPTS, prompt="x")
    with pytest.raises(InputError, match="CircuitSpec"):
        attribution_graphs(sm, tc, PROMPTS, RayExecutor(ModelSpec()))  # refused before any worker starts
    with pytest.raises(InputError, match="CircuitSpec"):  # a worker holding a bare model has no transcoders
        _graph_task(sm, PROMPTS[0], transcoders=None, node_threshold=0.8, edge_threshold=0.98, keep_graphs=False,
                    options=OPTIONS)
    with pytest.raises(InputError, match="empty name"):
        CircuitSpec(ModelSpec()).load()


def test_a_graph_saved_and_loaded_back(result, tmp_path):
    g: Graph = result.graphs[1].graph
    back = Graph.load(g.save(tmp_path / "g" / "graph.safetensors"))
    for k in ("input_tokens", "active_features", "activation_values", "selected_features", "logit_probabilities",
              "adjacency_matrix"):
        assert torch.equal(getattr(back, k), getattr(g, k)) and getattr(back, k).dtype == getattr(g, k).dtype, k
    assert (back.logit_targets, back.n_layers, back.vocab_size, back.scan, back.prompt_tokens, back.input_string) == \
        (g.logit_targets, g.n_layers, g.vocab_size, g.scan, g.prompt_tokens, g.input_string)
    same = PrunedGraph.from_graph(back, NODES)
    assert torch.equal(same.nodes, result.graphs[1].nodes)
    assert [p.name for p in (tmp_path / "g").iterdir()] == ["graph.safetensors"]


def test_files_that_are_not_graphs_are_refused(result, tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(InputError, match="without"):
        Graph.load(tmp_path / "other.safetensors")
    g = result.graphs[0].graph
    path = g.save(tmp_path / "g.safetensors")
    with pytest.raises(steerkit.SteerkitError, match="at most"):
        Graph.load(path, max_bytes=100)
    meta = json.dumps({"format": "steerkit.graph/1", "logit_targets": "nope", "n_layers": 1, "vocab_size": 2,
                       "scan": None, "prompt_tokens": None, "input_string": ""}).encode()
    tensors = {k: getattr(g, k) for k in ("input_tokens", "active_features", "activation_values", "selected_features",
                                          "logit_probabilities", "adjacency_matrix")}
    save_file({**tensors, "meta_json": torch.frombuffer(bytearray(meta), dtype=torch.uint8)},
              str(tmp_path / "bad.safetensors"))
    with pytest.raises(InputError, match="fields"):
        Graph.load(tmp_path / "bad.safetensors")
    deep = b"[" * 10_000 + b"]" * 10_000
    save_file({**tensors, "meta_json": torch.frombuffer(bytearray(deep), dtype=torch.uint8)},
              str(tmp_path / "deep.safetensors"))
    with pytest.raises(steerkit.SteerkitError):
        Graph.load(tmp_path / "deep.safetensors")
