"""``steerkit circuits graph`` and ``steerkit circuits batch`` through the in-process CLI (run_main) on a tiny random
Llama saved as a folder and random transcoders saved as a steerkit file and in a store: the printed summary equals
the library's graph and pruning on the same model and transcoders, the frontend file is circuit-tracer's, the saved
graph loads back equal, the batch lists the recurring features attribution_graphs finds, and bad input exits 2 with
one ``steerkit: error:`` line. (``--ray`` for the batch runs in tests/integration/test_ray.py's way: the library call
is checked there.)"""
from __future__ import annotations

import json

import pytest
import torch

import steerkit
from steerkit.probes import Graph, PrunedGraph, attribution_graph, attribution_graphs
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
def test_bad_input_is_one_error_line(setup, capsys, argv, fragments):
    root, _, _ = setup
    args = [a.format(root=root) for a in argv]
    code, _, err = run_main(capsys, "circuits", *args, "--model", root / "tiny", *CPU, "--quiet")
    assert_one_error_line(code, err, *fragments, what=argv)
