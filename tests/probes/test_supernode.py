"""From an attribution graph to a steering (steerkit.probes.supernode_clamp, intervene_graph) on a tiny random Llama
with random transcoders and a real attribution graph: ablating a feature at its node's position moves a target's
logit in the direction its direct attribution says; the clamp at the nodes' positions is the transcoders' two-site
clamps there; the stored clamp round-trips with its provenance (prompt, graph, transcoders) and steers identically;
bad node indices get one clear error. The module runs torch on one thread (restored after), as the graph tests do."""
from __future__ import annotations

import json

import pytest
import torch

import steerkit
from steerkit.errors import InputError
from steerkit.probes import GraphIntervention, attribution_graph, intervene_graph, supernode_clamp
from steerkit.vectors import LatentClamp, Store, Transcoders
from tiny_models import random_transcoders, tiny_circuit_llama

PROMPT = "Hello world, it is"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def setup():
    model, tok = tiny_circuit_llama(seed=3)
    sm = steerkit.wrap(model, tok, name="tiny-circuit-llama")
    tc = random_transcoders(sm, d_sae=32)
    return sm, tc, attribution_graph(sm, tc, PROMPT, progress=False)


def logits_of(sm, ids, steering=None):
    tokens = steerkit.Tokens(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
    if steering is None:
        return sm.forward(tokens)[0]
    with sm.steer(steering):
        return sm.forward(tokens)[0]


def test_ablating_a_feature_moves_the_logit_as_its_direct_attribution_says(setup):
    sm, tc, graph = setup
    N, n, L = graph.adjacency_matrix.shape[0], graph.n_features, sm.n_layers
    last = [i for i in range(n) if graph.feature_node(i)[0] == L - 1 and graph.feature_node(i)[1] == graph.n_pos - 1]
    assert len(last) >= 3
    checked = 0
    for t, target in enumerate(graph.logit_targets[:4]):
        row = graph.adjacency_matrix[N - graph.n_logits + t]
        node = max(last, key=lambda i: float(row[i].abs()))  # the last block's feature most direct to this logit
        r = intervene_graph(sm, graph, tc, [node])  # scale 0: ablated at its own position
        assert isinstance(r, GraphIntervention) and r.how == "scale" and r.amount == 0.0
        assert r.positions == [graph.n_pos - 1]
        # the graph's logit nodes are demeaned logits: ablating removes the feature's direct contribution
        change = (r.logits_after[target.vocab_idx] - r.logits_after.mean()) - (
            r.logits_before[target.vocab_idx] - r.logits_before.mean())
        assert float(change) * float(row[node]) < 0, (t, node, float(change), float(row[node]))
        checked += 1
        (changed,) = [c for c in r.target_changes() if c["token_id"] == target.vocab_idx]
        assert changed["logit_change"] == pytest.approx(float(r.logits_after[target.vocab_idx]
                                                              - r.logits_before[target.vocab_idx]))
    assert checked == 4
    before = logits_of(sm, graph.input_tokens.tolist())[-1]
    assert torch.allclose(r.logits_before, before)
    d = r.to_dict()
    json.dumps(d)  # JSON-able
    assert [x["token_id"] for x in d["top_before"]] == before.topk(10).indices.tolist()
    assert len(d["targets"]) == graph.n_logits and d["nodes"] == [node]


def test_the_clamp_at_the_nodes_positions_is_the_transcoders_clamps_there(setup):
    sm, tc, graph = setup
    nodes = [0, 1, 2, graph.n_features - 1, graph.n_features - 2]
    found = [graph.feature_node(i) for i in nodes]
    clamp = supernode_clamp(graph, tc, nodes, value=2.5, positions="graph")
    by_hand = [tc.clamp(l, [f], value=2.5, positions=[p]) for l, p, f in found]
    ids = graph.input_tokens.tolist()
    torch.testing.assert_close(logits_of(sm, ids, clamp), logits_of(sm, ids, by_hand), atol=1e-5, rtol=0)
    # every position (the default): the features wherever they fire, on any prompt
    anywhere = supernode_clamp(graph, tc, nodes, scale=3.0)
    assert {p.positions for p in anywhere.parts} == {"all"}
    assert anywhere.layers == sorted({l for l, _, _ in found})
    other = steerkit.Tokens(torch.tensor([[1, 40, 41, 42, 43, 44]]), torch.ones(1, 6, dtype=torch.long))
    hand = [tc.clamp(l, sorted({f for l2, _, f in found if l2 == l}), scale=3.0) for l in anywhere.layers]
    with sm.steer(anywhere):
        a = sm.forward(other)
    with sm.steer(hand):
        b = sm.forward(other)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # one value per node
    per_node = supernode_clamp(graph, tc, [nodes[0], nodes[-1]], value=[1.0, -1.0], positions="graph")
    (l0, p0, f0), (l1, p1, f1) = found[0], found[-1]
    hand = [tc.clamp(l0, [f0], value=1.0, positions=[p0]), tc.clamp(l1, [f1], value=-1.0, positions=[p1])]
    torch.testing.assert_close(logits_of(sm, ids, per_node), logits_of(sm, ids, hand), atol=1e-5, rtol=0)


def test_the_stored_clamp_round_trips_and_steers_identically(setup, tmp_path):
    sm, tc, graph = setup
    store = Store(tmp_path / "store")
    for positions in ("all", "graph"):
        clamp = supernode_clamp(graph, tc, [3, 5, graph.n_features - 1], positions=positions)
        back = store.load(store.save(f"supernode-{positions}", clamp))
        assert isinstance(back, LatentClamp) and back == clamp
        params = back.provenance.method_params
        assert back.provenance.method == "supernode_clamp"
        assert params["prompt"] == graph.input_string and params["prompt_tokens"] == graph.input_tokens.tolist()
        assert params["graph"] == graph.fingerprint() and params["transcoders"] == tc.fingerprint()
        assert params["nodes"] == [3, 5, graph.n_features - 1]
        assert back.provenance.model_fingerprint == tc.provenance.model_fingerprint
        ids = graph.input_tokens.tolist()
        assert torch.equal(logits_of(sm, ids, back), logits_of(sm, ids, clamp))
        assert not torch.allclose(logits_of(sm, ids, back), logits_of(sm, ids), atol=1e-5)


def test_bad_nodes_get_one_clear_error(setup):
    sm, tc, graph = setup
    n, N = graph.n_features, graph.adjacency_matrix.shape[0]
    with pytest.raises(InputError) as e:
        supernode_clamp(graph, tc, [0, n, n + graph.n_errors, N - 1, N + 5])
    msg = str(e.value)
    assert msg.startswith(f"expected feature nodes (indices 0..{n - 1} of {N} nodes")
    for part in (f"{n} (an error node)", f"{n + graph.n_errors} (a token node)", f"{N - 1} (a logit node)",
                 f"{N + 5} (out of range"):
        assert part in msg
    with pytest.raises(InputError, match="expected node indices"):
        supernode_clamp(graph, tc, "0,1")
    with pytest.raises(InputError, match="expected 1..4096 node indices, found 0"):
        supernode_clamp(graph, tc, [])
    with pytest.raises(InputError, match="one finite number, or one per node"):
        supernode_clamp(graph, tc, [0, 1], value=[1.0, 2.0, 3.0])
    fewer = Transcoders(tc.W_enc[:2], tc.b_enc[:2], tc.W_dec[:2], tc.b_dec[:2], activation="jumprelu",
                        threshold=tc.threshold[:2])
    with pytest.raises(InputError, match="expected the transcoders the graph was computed with"):
        supernode_clamp(graph, fewer, [0])
    with pytest.raises(InputError, match="top_k as an integer"):
        intervene_graph(sm, graph, tc, [0], top_k=0)
    assert sm.hook_count() == 0


def test_a_cross_layer_graphs_nodes_clamp_every_block_their_features_write(setup):
    sm, _, _ = setup
    clt = random_transcoders(sm, d_sae=16, cross_layer=True)
    graph = attribution_graph(sm, clt, PROMPT, progress=False)
    nodes = [0, graph.n_features - 1]
    found = [graph.feature_node(i) for i in nodes]
    clamp = supernode_clamp(graph, clt, nodes, value=[2.0, -1.0], positions="graph")
    assert len(clamp.parts) == sum(sm.n_layers - l for l, _, _ in found)
    hand = [iv for (l, p, f), v in zip(found, [2.0, -1.0]) for iv in clt.clamp_layers(l, [f], value=v, positions=[p])]
    ids = graph.input_tokens.tolist()
    torch.testing.assert_close(logits_of(sm, ids, clamp), logits_of(sm, ids, hand), atol=1e-5, rtol=0)
