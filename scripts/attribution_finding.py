"""Attribution graphs of the default model through its trained transcoders: the IOI prompt and a factual recall.

For each prompt: the attribution graph (``steerkit.probes.attribution_graph``) and its pruning, the replacement
and completeness scores, the features that carry most influence to the target logit (block, position, token,
feature, influence) -- the main path, then a supernode of the most influential features at one position ablated
on the graph's own prompt (``steerkit.probes.intervene_graph``, ``scale=0``), with the target logit's change and
the new top tokens. For the IOI prompt the blocks where the S2 and last-token features sit are set beside the
activation-patching figures of ``docs/reproductions/ioi.md`` (``docs/reproductions/data/ioi.json``).

    python scripts/attribution_finding.py --transcoders transcoders-smollm2 \
        --json docs/reproductions/data/attribution-graphs.json --html docs/reproductions/figures/attribution-graphs.html
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import steerkit
from steerkit.probes import attribution_graph, compute_graph_scores, intervene_graph, prune_graph
from steerkit.probes.graph import compute_influence, normalize_matrix

PROMPTS = {
    "ioi": ("When Mary and John went to the store, John gave a drink to", " Mary"),
    "capital": ("The capital of France is", " Paris"),
}


def target_influence(graph, target: int) -> torch.Tensor:
    """Each node's total (direct and indirect) influence on logit node ``target`` (an index among the logits)."""
    n = graph.adjacency_matrix.shape[0]
    weights = torch.zeros(n)
    weights[n - graph.n_logits + target] = 1.0
    return compute_influence(normalize_matrix(graph.adjacency_matrix), weights)


def main_path(sm, graph, influence: torch.Tensor, top: int) -> list[dict]:
    tokens = [sm.tokenizer.decode([int(t)]) for t in graph.input_tokens]
    feats = influence[: graph.n_features]
    order = torch.argsort(feats, descending=True)[:top]
    rows = []
    for i in order.tolist():
        layer, pos, feature = graph.feature_node(i)
        rows.append({"node": i, "block": layer, "position": pos, "token": tokens[pos], "feature": feature,
                     "influence": round(float(feats[i]), 4)})
    return rows


def supernode(graph, influence: torch.Tensor, position: int, size: int) -> list[int]:
    """The ``size`` features at ``position`` with the most influence on the target, as node indices."""
    at = [i for i in range(graph.n_features) if graph.feature_node(i)[1] == position]
    return sorted(at, key=lambda i: -float(influence[i]))[:size]


def study(sm, tc, name: str, prompt: str, answer: str, args) -> dict:
    start = time.perf_counter()
    graph = attribution_graph(sm, tc, prompt, max_feature_nodes=args.max_feature_nodes, progress=True)
    seconds = time.perf_counter() - start
    targets = [t.token_str for t in graph.logit_targets]
    if answer not in targets:
        raise SystemExit(f"{name}: expected {answer!r} among the graph's logit targets, found {targets}")
    t = targets.index(answer)
    influence = target_influence(graph, t)
    path = main_path(sm, graph, influence, args.top)
    pruned = prune_graph(graph)
    replacement, completeness = compute_graph_scores(graph)
    last = graph.n_pos - 1
    result = {"prompt": prompt, "answer": answer, "graph_seconds": round(seconds, 1), "n_features": graph.n_features,
              "pruned_nodes": int(pruned.node_mask.sum()), "replacement_score": round(replacement, 4),
              "completeness_score": round(completeness, 4), "targets": targets, "main_path": path,
              "supernodes": {}}
    positions = {"last": last}
    if name == "ioi":  # the second mention of the subject (S2)
        s2 = [i for i, tok in enumerate(graph.input_tokens.tolist())
              if sm.tokenizer.decode([tok]) == " John"][-1]
        positions["s2"] = s2
    for where, pos in positions.items():
        nodes = supernode(graph, influence, pos, args.supernode)
        if not nodes:
            result["supernodes"][where] = {"nodes": [], "note": "no influential feature at this position"}
            continue
        r = intervene_graph(sm, graph, tc, nodes, scale=0.0, top_k=5)
        change = [c for c in r.target_changes() if c["token"] == answer][0]
        result["supernodes"][where] = {"position": pos, "nodes": nodes,
                                       "blocks": sorted({graph.feature_node(i)[0] for i in nodes}),
                                       "target_logit_change": round(change["logit_change"], 4),
                                       "target": change, "top_after": r.top(after=True)}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transcoders", required=True, help="a trained transcoder folder (steerkit sae train --transcoder)")
    ap.add_argument("--max-feature-nodes", type=int, default=4096)
    ap.add_argument("--top", type=int, default=20, help="features listed on the main path")
    ap.add_argument("--supernode", type=int, default=5, help="features in each ablated supernode")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sm = steerkit.load_model(device="cpu", dtype="float32")
    tc = steerkit.load_transcoders(args.transcoders, model=sm)
    out = {name: study(sm, tc, name, prompt, answer, args) for name, (prompt, answer) in PROMPTS.items()}
    ioi = Path(__file__).resolve().parents[1] / "docs" / "reproductions" / "data" / "ioi.json"
    if ioi.is_file():
        out["ioi_patching_reference"] = str(ioi.relative_to(ioi.parents[3]))
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
