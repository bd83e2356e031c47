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
CONTRAST = {"ioi": " John"}  # the logit difference the patching study measures: logit(IO) - logit(S)


def target_influence(graph, target: int) -> torch.Tensor:
    """Each node's total (direct and indirect) influence on logit node ``target`` (an index among the logits):
    circuit-tracer's ranking, on the absolute normalised adjacency (no sign)."""
    n = graph.adjacency_matrix.shape[0]
    weights = torch.zeros(n)
    weights[n - graph.n_logits + target] = 1.0
    return compute_influence(normalize_matrix(graph.adjacency_matrix), weights)


def direct_effect(graph, targets: list[str], answer: str, contrast) -> torch.Tensor:
    """Each node's signed direct effect on the metric: its edge to the answer's logit node, less its edge to the
    contrast's where one is given (the IOI logit difference). Direct edges run through the frozen attention and
    the residual stream, not through other features."""
    a = graph.adjacency_matrix
    n = a.shape[0]
    row = a[n - graph.n_logits + targets.index(answer)].clone()
    if contrast is not None:
        if contrast not in targets:
            raise SystemExit(f"expected {contrast!r} among the graph's logit targets, found {targets}")
        row -= a[n - graph.n_logits + targets.index(contrast)]
    return row


def feature_rows(graph, tokens: list[str], order: list[int], scores: torch.Tensor, key: str) -> list[dict]:
    rows = []
    for i in order:
        layer, pos, feature = graph.feature_node(i)
        rows.append({"node": i, "block": layer, "position": pos, "token": tokens[pos], "feature": feature,
                     key: round(float(scores[i]), 4)})
    return rows


def breakdown(graph, effect: torch.Tensor, tokens: list[str]) -> dict:
    """Where the metric's direct effect comes from: the feature nodes per block and position (a grid), the error
    nodes per block, the token nodes per position."""
    nf, ne = graph.n_features, graph.n_errors
    grid = torch.zeros(graph.n_layers, graph.n_pos)
    for i in range(nf):
        layer, pos, _ = graph.feature_node(i)
        grid[layer, pos] += effect[i]
    errors = effect[nf:nf + ne].reshape(graph.n_layers, graph.n_pos)
    toks = effect[nf + ne:nf + ne + graph.n_pos]
    return {"features": round(float(effect[:nf].sum()), 4), "errors": round(float(errors.sum()), 4),
            "tokens_total": round(float(toks.sum()), 4), "tokens": tokens,
            "feature_grid": [[round(float(v), 4) for v in row] for row in grid],
            "error_by_block": [round(float(v), 4) for v in errors.sum(1)],
            "error_grid": [[round(float(v), 4) for v in row] for row in errors],
            "token_by_position": [round(float(v), 4) for v in toks]}


def supernode(graph, effect: torch.Tensor, position: int, size: int) -> list[int]:
    """The ``size`` features at ``position`` with the largest positive direct effect on the metric."""
    at = [i for i in range(graph.n_features) if graph.feature_node(i)[1] == position and float(effect[i]) > 0]
    return sorted(at, key=lambda i: -float(effect[i]))[:size]


def control(graph, position: int, size: int, exclude: list[int], seed: int = 0) -> list[int]:
    """``size`` other active features at ``position``, drawn at random (the ablation's control)."""
    at = [i for i in range(graph.n_features) if graph.feature_node(i)[1] == position and i not in exclude]
    pick = torch.randperm(len(at), generator=torch.Generator().manual_seed(seed))[:size]
    return sorted(at[int(j)] for j in pick)


def ablate(sm, tc, graph, nodes: list[int], effect: torch.Tensor, answer: str, contrast) -> dict:
    """Ablate ``nodes`` at their positions on the graph's prompt (``intervene_graph``, scale 0): the metric before
    and after (the answer's logit less the contrast's where given, else less the mean logit, as the graph's logit
    nodes are), the change the graph's direct edges predict
    (minus the nodes' summed direct effect), the answer's logit and probability, and the new top tokens."""
    r = intervene_graph(sm, graph, tc, nodes, scale=0.0, top_k=5)
    a = sm.tokenizer.encode(answer, add_special_tokens=False)[0]
    c = None if contrast is None else sm.tokenizer.encode(contrast, add_special_tokens=False)[0]

    def metric(lg):  # the graph's logit nodes are demeaned logits (the mean cancels in a difference)
        return float(lg[a] - (lg[c] if c is not None else lg.mean()))
    before, after = metric(r.logits_before), metric(r.logits_after)
    change = [t for t in r.target_changes() if t["token"] == answer][0]
    return {"nodes": nodes, "blocks": sorted({graph.feature_node(i)[0] for i in nodes}),
            "metric_before": round(before, 4), "metric_after": round(after, 4),
            "metric_change": round(after - before, 4),
            "predicted_direct_change": round(-float(effect[nodes].sum()), 4),
            "target": change, "top_after": r.top(after=True)}


def study(sm, tc, name: str, prompt: str, answer: str, args) -> dict:
    start = time.perf_counter()
    graph = attribution_graph(sm, tc, prompt, max_feature_nodes=args.max_feature_nodes, progress=True)
    seconds = time.perf_counter() - start
    targets = [t.token_str for t in graph.logit_targets]
    if answer not in targets:
        raise SystemExit(f"{name}: expected {answer!r} among the graph's logit targets, found {targets}")
    tokens = [sm.tokenizer.decode([int(t)]) for t in graph.input_tokens]
    contrast = CONTRAST.get(name)
    influence = target_influence(graph, targets.index(answer))
    effect = direct_effect(graph, targets, answer, contrast)
    pruned = prune_graph(graph)
    replacement, completeness = compute_graph_scores(graph)
    by_influence = torch.argsort(influence[:graph.n_features], descending=True)[:args.top].tolist()
    by_effect = torch.argsort(effect[:graph.n_features].abs(), descending=True)[:args.top].tolist()
    result = {"prompt": prompt, "answer": answer, "contrast": contrast, "graph_seconds": round(seconds, 1),
              "n_features": graph.n_features, "pruned_nodes": int(pruned.node_mask.sum()),
              "replacement_score": round(replacement, 4), "completeness_score": round(completeness, 4),
              "targets": targets, "main_path": feature_rows(graph, tokens, by_influence, influence, "influence"),
              "direct": feature_rows(graph, tokens, by_effect, effect, "direct_effect"),
              "direct_effect": breakdown(graph, effect, tokens), "supernodes": {}}
    positions = {"last": graph.n_pos - 1}
    if name == "ioi":  # the second mention of the subject (S2)
        positions["s2"] = [i for i, tok in enumerate(tokens) if tok == " John"][-1]
    if name == "capital":  # the subject
        positions["subject"] = tokens.index(" France")
    result["influence_by_block"] = influence_by_block(graph, influence, positions)
    for where, pos in positions.items():
        nodes = supernode(graph, effect, pos, args.supernode)
        if not nodes:
            result["supernodes"][where] = {"position": pos, "nodes": [], "note": "no feature with a positive effect"}
            continue
        result["supernodes"][where] = {"position": pos, "token": tokens[pos],
                                       **ablate(sm, tc, graph, nodes, effect, answer, contrast),
                                       "control": ablate(sm, tc, graph, control(graph, pos, len(nodes), nodes),
                                                         effect, answer, contrast)}
    return result


def influence_by_block(graph, influence: torch.Tensor, positions: dict[str, int]) -> dict[str, list[float]]:
    """The target influence of the feature nodes summed per block: at each named position, and at all others."""
    out = {name: [0.0] * graph.n_layers for name in [*positions, "other"]}
    named = {pos: name for name, pos in positions.items()}
    for i in range(graph.n_features):
        layer, pos, _ = graph.feature_node(i)
        out[named.get(pos, "other")][layer] += float(influence[i])
    return {k: [round(v, 4) for v in vals] for k, vals in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transcoders", required=True, help="a trained transcoder folder (steerkit sae train --transcoder)")
    ap.add_argument("--max-feature-nodes", type=int, default=4096)
    ap.add_argument("--top", type=int, default=20, help="features listed on the main path")
    ap.add_argument("--supernode", type=int, default=10, help="features in each ablated supernode")
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
