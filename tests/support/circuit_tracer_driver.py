"""circuit-tracer's side of tests/integration/test_circuit_tracer.py: run in .venv-circuit-tracer, never imports steerkit.

    python circuit_tracer_driver.py JOB.json

``JOB.json`` lists cases ``{"name", "model" (a model folder), "cache_dir" (a folder holding a transcoder folder named
"name" in circuit-tracer's cache layout, as steerkit wrote it), "ids" (the prompt's token ids), "params" (attribute's
keywords), "inputs" (optional: a safetensors file with "x" [n_layers, n, d_model] to encode and decode), "out"}``.
For each case this writes ``out/result.safetensors`` (the graph's tensors, the prune masks and scores, the logits and
transcoder activations on the prompt, encode / decode of the inputs), ``out/result.json`` (targets, scores, time) and
``out/{name}.json`` (``create_graph_files``).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from circuit_tracer import ReplacementModel, attribute
from circuit_tracer.graph import compute_graph_scores, prune_graph
from circuit_tracer.utils.caching import load_transcoders_from_cache
from circuit_tracer.utils.create_graph_files import create_graph_files


def run_case(case: dict) -> None:
    out = Path(case["out"])
    out.mkdir(parents=True, exist_ok=True)
    cpu = torch.device("cpu")
    tcs, _ = load_transcoders_from_cache(case["name"], cache_dir=case["cache_dir"], device=cpu, dtype=torch.float32)
    tensors: dict[str, torch.Tensor] = {}
    if case.get("inputs"):
        x = load_file(case["inputs"])["x"]
        acts = tcs.encode(x)
        tensors["encoded"] = acts
        tensors["decoded"] = tcs.decode(acts, x)
    model = ReplacementModel.from_pretrained_and_transcoders(case["model"], tcs, backend="nnsight", device=cpu,
                                                             dtype=torch.float32)
    ids = torch.tensor(case["ids"])
    logits, activations = model.get_activations(ids[None])
    tensors["logits"] = logits.reshape(len(ids), -1)
    tensors["activations"] = activations.to_dense() if activations.is_sparse else activations
    torch.set_num_threads(int(case.get("threads", 1)))
    t0 = time.perf_counter()
    graph = attribute(ids, model, **case["params"])
    seconds = time.perf_counter() - t0
    node_mask, edge_mask, cumulative = prune_graph(graph)
    tensors.update(adjacency=graph.adjacency_matrix, active_features=graph.active_features.long(),
                   selected_features=graph.selected_features.long(), activation_values=graph.activation_values,
                   logit_probabilities=graph.logit_probabilities, input_tokens=graph.input_tokens.long(),
                   node_mask=node_mask, edge_mask=edge_mask, cumulative_scores=cumulative)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(out / "result.safetensors"))
    scores = compute_graph_scores(graph)
    create_graph_files(graph, slug=case["name"], output_path=str(out), scan=case.get("scan", "tiny"))
    (out / "result.json").write_text(json.dumps({
        "logit_targets": [[t.token_str, int(t.vocab_idx)] for t in graph.logit_targets],
        "input_string": graph.input_string, "scores": list(scores), "seconds": seconds}))


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    for case in job["cases"]:
        run_case(case)
    print("done", len(job["cases"]))


if __name__ == "__main__":
    main()
