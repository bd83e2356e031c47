"""``steerkit circuits graph`` and ``steerkit circuits batch`` through the in-process CLI (run_main) on a tiny random
Llama saved as a folder and random transcoders saved as a steerkit file and in a store: the printed summary equals
the library's graph and pruning on the same model and transcoders, the frontend file is circuit-tracer's, the saved
graph loads back equal, the batch lists the recurring features attribution_graphs finds, and bad input exits 2 with
one ``steerkit: error:`` line. (``--ray`` for the batch runs in tests/integration/test_ray.py's way: the library call
is checked there.)"""
from __future__ import annotations

import argparse

import json

import pytest
import torch

import steerkit
from steerkit.probes import Graph, PrunedGraph, attribution_graph, attribution_graphs, intervene_graph
from steerkit.vectors import Store

from cli_runs import assert_one_error_line, run_main
from tiny_models import random_transcoders, tiny_model

CPU = ["--device", "cpu", "--dtype", "float32"]
PROMPT = "Hello world, it is"
GRAPH = ["--max-feature-nodes", "40", "--batch-size", "16", "--node-threshold", "0.95", "--quiet"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("circuits_cli")
    model, tok = tiny_model("llama")
    model.save_pretrained(root / "tiny")
    tok.save_pretrained(root / "tiny")
    sm = steerkit.load_model(str(root / "tiny"), device="cpu", dtype="float32")
    tc = random_transcoders(sm, d_sae=48, seed=11, scale=3.0)
    tc.save(root / "tc.safetensors")
    Store(root / "store").save("tc", tc)
    (root / "prompts.txt").write_text("Hello world, it is\nThe cat sat on the\nHello there, the cat\n")
    return root, sm, tc


def test_graph_summary_files_and_saved_graph(setup, capsys, tmp_path):
    root, sm, tc = setup
    model = ["--model", root / "tiny", *CPU, "--transcoders", root / "tc.safetensors"]
    code, out, err = run_main(capsys, "circuits", "graph", PROMPT, *model, *GRAPH, "--summary-json",
                              "--json", tmp_path / "g" / "hello.json", "--save", tmp_path / "hello.graph")
    assert code == 0, err
    s = json.loads(out)
    graph = attribution_graph(sm, tc, PROMPT, max_feature_nodes=40, batch_size=16, progress=False)
    pruned = PrunedGraph.from_graph(graph, 0.95)
    assert s["nodes"] == graph.adjacency_matrix.shape[0] and s["pruned_nodes"] == len(pruned.nodes)
    assert s["pruned_features"] == len(pruned.features) > 0
    assert [t["id"] for t in s["logit_targets"]] == [t.vocab_idx for t in graph.logit_targets]
    assert s["replacement_score"] == pytest.approx(pruned.replacement_score, abs=1e-6)
    best = int(pruned.influence[: len(pruned.features)].argmax())
    assert s["top_features"][0]["feature"] == int(pruned.features[best, 2])
    assert s["top_features"][0]["influence"] == pytest.approx(float(pruned.influence[best]))
    doc = json.loads((tmp_path / "g" / "hello.json").read_text())
    assert doc["metadata"]["slug"] == "hello" and len(doc["nodes"]) == len(pruned.nodes)
    listed = json.loads((tmp_path / "g" / "graph-metadata.json").read_text())
    assert [g["slug"] for g in listed["graphs"]] == ["hello"]
    saved = Graph.load(tmp_path / "hello.graph")
    assert torch.equal(saved.adjacency_matrix, graph.adjacency_matrix) and saved.logit_targets == graph.logit_targets
    # the text summary; transcoders from the store
    code, out, err = run_main(capsys, "circuits", "graph", PROMPT, "--model", root / "tiny", *CPU, "--transcoders",
                              "tc@1", "--store", root / "store", *GRAPH, "--top", "3")
    assert code == 0, err
    assert f"{s['nodes']} nodes; pruned to {s['pruned_nodes']} nodes" in out
    assert "replacement score" in out and out.count("\n  L") == 3


def test_batch_lists_the_recurring_features(setup, capsys, tmp_path):
    root, sm, tc = setup
    code, out, err = run_main(capsys, "circuits", "batch", root / "prompts.txt", "--model", root / "tiny", *CPU,
                              "--transcoders", root / "tc.safetensors", *GRAPH, "--json", tmp_path / "b.json")
    assert code == 0, err
    prompts = (root / "prompts.txt").read_text().splitlines()
    res = attribution_graphs(sm, tc, prompts, max_feature_nodes=40, batch_size=16, node_threshold=0.95,
                             progress=False)
    assert res.recurring()
    for f in res.recurring()[:20]:
        assert f"L{f.layer} F{f.feature}: {f.n_prompts} prompts" in out
    doc = json.loads((tmp_path / "b.json").read_text())
    assert [len(g["nodes"]) for g in doc["graphs"]] == [len(g.nodes) for g in res.graphs]
    assert [(f["layer"], f["feature"], f["n_prompts"]) for f in doc["features"]] == \
        [(f.layer, f.feature, f.n_prompts) for f in res.features]


@pytest.mark.parametrize("argv,fragments", [
    (["graph", PROMPT, "--transcoders", "{root}/missing"], ["missing"]),
    (["graph", PROMPT, "--transcoders", "{root}/tc.safetensors", "--node-threshold", "2"], ["--node-threshold"]),
    (["graph", PROMPT, "--transcoders", "{root}/tc.safetensors", "--max-feature-nodes", "0"], ["--max-feature-nodes"]),
    (["graph", PROMPT, "--transcoders", "{root}/tc.safetensors", "--offload", "{root}/nowhere"], ["--offload"]),
    (["graph", PROMPT, "--transcoders", "{root}/tc.safetensors", "--json", "{root}"], ["--json", "folder"]),
    (["batch", "{root}/none.txt", "--transcoders", "{root}/tc.safetensors"], ["prompts file"]),
    (["batch", "{root}/prompts.txt", "--transcoders", "{root}/tc.safetensors", "--workers", "0", "--ray"],
     ["--workers"]),
], ids=["transcoders", "threshold", "nodes", "offload", "json-folder", "prompts", "workers"])
def test_bad_input_is_one_error_line(setup, capsys, monkeypatch, argv, fragments):
    root, _, _ = setup
    # nnsight, once imported, gives argparse.Namespace a `save` method: no option may rely on that name being free
    monkeypatch.setattr(argparse.Namespace, "save", lambda self: None, raising=False)
    args = [a.format(root=root) for a in argv]
    code, _, err = run_main(capsys, "circuits", *args, "--model", root / "tiny", *CPU, "--quiet")
    assert_one_error_line(code, err, *fragments, what=argv)


def test_steer_saves_the_supernode_and_shows_its_effect(setup, capsys, tmp_path):
    root, sm, tc = setup
    model = ["--model", root / "tiny", *CPU, "--transcoders", root / "tc.safetensors"]
    code, _, err = run_main(capsys, "circuits", "graph", PROMPT, *model, *GRAPH, "--save", tmp_path / "g.graph")
    assert code == 0, err
    graph = Graph.load(tmp_path / "g.graph")
    assert graph.n_features >= 2
    store = tmp_path / "store"
    code, out, err = run_main(capsys, "circuits", "steer", tmp_path / "g.graph", *model, "--nodes", "0,1", "--scale",
                              "0", "--positions", "graph", "--save", "sn", "--store", store, "--json")
    assert code == 0, err
    got = json.loads(out)
    want = intervene_graph(sm, graph, tc, [0, 1], scale=0.0, top_k=5)
    assert got["saved"] == "sn@1" and got["nodes"] == [0, 1] and got["how"] == "scale"
    for g, w in zip(got["targets"], want.target_changes(), strict=True):
        assert g["token_id"] == w["token_id"] and g["logit_change"] == pytest.approx(w["logit_change"], abs=1e-5)
    assert [t["token_id"] for t in got["top_after"]] == [t["token_id"] for t in want.top(after=True)]
    clamp = Store(store).load("sn@1")
    assert clamp.provenance.method == "supernode_clamp" and clamp.provenance.method_params["nodes"] == [0, 1]
    # the text form, clamped to a value wherever the features fire
    code, out, err = run_main(capsys, "circuits", "steer", tmp_path / "g.graph", *model, "--nodes", "1", "--value",
                              "2.5", "--save", "sn", "--store", store)
    assert code == 0, err
    assert out.startswith("saved sn@2: a latent clamp (value 2.5) of 1 node(s)") and "top tokens after" in out
    for argv, fragments in (([*model, "--nodes", "0,x", "--scale", "0", "--save", "a"], ["--nodes"]),
                            ([*model, "--nodes", str(graph.n_features), "--scale", "0", "--save", "a"],
                             ["feature nodes"]),
                            ([*model, "--nodes", "0", "--scale", "0", "--save", "a", "--positions", "x"],
                             ["--positions"])):
        code, _, err = run_main(capsys, "circuits", "steer", tmp_path / "g.graph", *argv, "--store", store)
        assert_one_error_line(code, err, *fragments, what=argv)
    code, _, err = run_main(capsys, "circuits", "steer", tmp_path / "missing.graph", *model, "--nodes", "0",
                            "--scale", "0", "--save", "a")
    assert_one_error_line(code, err, "missing.graph")
