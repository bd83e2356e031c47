"""``steerkit circuits ...``: attribution graphs through transcoders.

Wiring: :func:`steerkit.cli.build_parser` imports this module and calls :func:`register` with its sub-parsers
object; each verb sets its own function.

* ``steerkit circuits graph "PROMPT" --transcoders T [--json OUT] [--save GRAPH] [--max-feature-nodes N
  --max-n-logits 10 --desired-logit-prob 0.95 --batch-size 512 --node-threshold 0.8 --edge-threshold 0.98
  --offload [DIR] --top 10 --quiet --summary-json]`` computes one prompt's attribution graph
  (:func:`steerkit.probes.attribution_graph`; ``T`` a transcoder folder, file, Hub reference or store reference,
  read by :func:`steerkit.load_transcoders` and checked against the model), prints a summary (nodes, the pruned
  graph's size, the logit targets, the most influential features, the replacement and completeness scores),
  writes circuit-tracer's frontend file with ``--json`` (:meth:`Graph.to_json`: circuit-tracer's local server and
  Neuronpedia open it) and the graph itself with ``--save`` (:meth:`Graph.save`).
* ``steerkit circuits batch PROMPTS_FILE --transcoders T [--ray [ADDRESS] --workers N ...] [--json OUT]`` computes
  every prompt's pruned graph (:func:`steerkit.probes.attribution_graphs`), here or on Ray workers that each load
  the model and the transcoders once, and prints the features that recur across the prompts.
* ``steerkit circuits steer GRAPH --nodes 3,17,42 --transcoders T --save NAME (--scale S | --value V) [--positions
  all|graph|last|3,5 --store S --top 5 --json]`` turns feature nodes of a saved graph into a stored
  :class:`~steerkit.vectors.LatentClamp` over their blocks (:func:`steerkit.probes.supernode_clamp`: a supernode
  scaled, ablated with ``--scale 0``, or clamped), saves it in the store (``sm.steer`` and a served request name it
  like any artifact) and prints the graph's prompt's logit targets and top tokens without and with it.

Exit codes: 0 success, 2 bad input (one ``steerkit: error:`` line), 1 an operating-system error.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from steerkit.cli._common import (add_model_options, add_ray_options, check_min, check_output_path, load_model_from,
                                  model_with_workers, ray_executor, read_prompts)
from steerkit.errors import InputError
from steerkit.executors import ModelSpec, RayExecutor
from steerkit.probes import (CircuitSpec, Graph, PrunedGraph, attribution_graph, attribution_graphs,
                             intervene_graph, supernode_clamp)
from steerkit.vectors import Store, load_transcoders

#: the longest prompt the command line takes, in characters (a graph's memory grows with its length)
MAX_PROMPT_CHARS = 100_000


def _graph_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("graph")
    g.add_argument("--transcoders", required=True, metavar="T", help="the transcoders: a circuit-tracer, sparsify or "
                   "sae-lens folder, a steerkit file, a Hub reference owner/repo[/sub][@rev] or a store reference "
                   "name@N (with --store)")
    g.add_argument("--store", default=None, help="the store a name@N reference is read from (default: "
                   "$STEERKIT_STORE or ~/.steerkit/store)")
    g.add_argument("--max-feature-nodes", type=int, default=None, metavar="N", help="keep the N features most "
                   "influential on the logits (default: every active feature)")
    g.add_argument("--max-n-logits", type=int, default=10, help="logit targets at most (default 10)")
    g.add_argument("--desired-logit-prob", type=float, default=0.95, help="the targets' probability to reach "
                   "(default 0.95)")
    g.add_argument("--batch-size", type=int, default=512, help="sources a backward pass (default 512)")
    g.add_argument("--offload", nargs="?", const=True, default=False, metavar="DIR", help="keep the rows of a "
                   "--max-feature-nodes graph in a temporary file (in DIR, or the system's temporary folder): "
                   "long prompts within a memory bound, the same values")
    g.add_argument("--node-threshold", type=float, default=0.8, help="pruning: the nodes kept make up this share of "
                   "the influence (default 0.8)")
    g.add_argument("--edge-threshold", type=float, default=0.98, help="pruning: the edges kept make up this share "
                   "(default 0.98)")
    g.add_argument("--override", action="store_true", help="transcoders made on another model's weights: warn, not "
                   "fail")
    g.add_argument("--quiet", action="store_true", help="no progress bar")


def register(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("circuits", help="attribution graphs through transcoders: one prompt, many prompts",
                              description="Attribution graphs through transcoders, as circuit-tracer computes them.")
    sub = p.add_subparsers(dest="circuits_cmd", metavar="VERB")
    sub.required = True
    g = sub.add_parser("graph", help="one prompt's attribution graph: a summary, the frontend file, the graph file",
                       description="Compute one prompt's attribution graph, print a summary and write circuit-"
                                   "tracer's frontend file (--json) and the graph (--save).")
    g.add_argument("prompt", metavar="PROMPT", help="the prompt (raw text; a special token is put in front)")
    add_model_options(g)
    _graph_options(g)
    g.add_argument("--json", default=None, metavar="OUT", help="write circuit-tracer's frontend file OUT.json "
                   "(Neuronpedia's format; graph-metadata.json beside it lists it)")
    g.add_argument("--slug", default=None, help="the graph's name in the frontend file (default: OUT's stem)")
    g.add_argument("--save", dest="graph_file", default=None, metavar="GRAPH", help="write the graph (Graph.save: safetensors) to GRAPH")
    g.add_argument("--top", type=int, default=10, help="features listed in the summary (default 10)")
    g.add_argument("--summary-json", action="store_true", help="print the summary as one JSON object")
    g.set_defaults(func=run_graph)
    b = sub.add_parser("batch", help="many prompts' pruned graphs and the features that recur across them",
                       description="Compute the pruned attribution graph of every prompt of a file (one a line, "
                                   "or .jsonl / .json), here or on Ray workers, and list the features that recur.")
    b.add_argument("prompts", metavar="PROMPTS_FILE", help="prompts: one a line, or .jsonl / .json records")
    add_model_options(b)
    _graph_options(b)
    add_ray_options(b, work="compute the graphs", here="the model is loaded here too, to check the workers'")
    b.add_argument("--json", default=None, metavar="OUT", help="write every pruned graph and the recurring features "
                   "as JSON to OUT")
    b.add_argument("--top", type=int, default=20, help="recurring features listed (default 20)")
    b.add_argument("--min-prompts", type=int, default=2, help="list features kept in at least this many prompts "
                   "(default 2)")
    b.set_defaults(func=run_batch)
    s = sub.add_parser("steer", help="a graph's nodes as a stored steering: clamp or scale their features",
                       description="Turn nodes of a saved graph (circuits graph --save) into a LatentClamp over "
                                   "their blocks (steerkit.probes.supernode_clamp), save it in the store, and show "
                                   "the graph's prompt's logits with and without it.")
    s.add_argument("graph", metavar="GRAPH", help="a graph file written by circuits graph --save (Graph.save)")
    add_model_options(s)
    s.add_argument("--transcoders", required=True, metavar="T", help="the graph's transcoders (as for circuits "
                   "graph)")
    s.add_argument("--store", default=None, help="the store the clamp is saved in and a name@N reference is read "
                   "from (default: $STEERKIT_STORE or ~/.steerkit/store)")
    s.add_argument("--nodes", required=True, help="feature nodes, by index in the graph's node order: 3,17,42")
    how = s.add_mutually_exclusive_group(required=True)
    how.add_argument("--scale", type=float, default=None, help="scale the features by S (0 ablates them)")
    how.add_argument("--value", type=float, default=None, help="clamp the features to V")
    s.add_argument("--positions", default="all", help="where the clamp acts: all (wherever the features fire, on "
                   "any prompt), graph (only at the nodes' own positions on the graph's prompt), last, or token "
                   "indices 3,5 (default all)")
    s.add_argument("--save", dest="save_name", required=True, metavar="NAME", help="the store name of the clamp")
    s.add_argument("--top", type=int, default=5, help="top tokens shown before and after (default 5)")
    s.add_argument("--override", action="store_true", help="transcoders made on another model's weights: warn, "
                   "not fail")
    s.add_argument("--json", action="store_true", help="print the result as one JSON object")
    s.set_defaults(func=run_steer)
    return p


def _check(args: argparse.Namespace) -> None:
    if args.max_feature_nodes is not None:
        check_min(args.max_feature_nodes, "--max-feature-nodes", 1)
    check_min(args.max_n_logits, "--max-n-logits", 1)
    check_min(args.batch_size, "--batch-size", 1)
    check_min(args.top, "--top", 0)
    for flag, v in (("--node-threshold", args.node_threshold), ("--edge-threshold", args.edge_threshold),
                    ("--desired-logit-prob", args.desired_logit_prob)):
        if not 0.0 <= v <= 1.0:
            raise InputError(f"expected {flag} between 0 and 1, found {v:g}")
    if args.offload not in (True, False) and not Path(args.offload).is_dir():
        raise InputError(f"expected --offload DIR to be an existing folder, found {args.offload!r}; create it or "
                         "give --offload alone (the system's temporary folder)")
    if getattr(args, "json", None):
        check_output_path(args.json, "--json")
    if getattr(args, "graph_file", None):  # dest names no argparse.Namespace attribute a library may add
        check_output_path(args.graph_file, "--save")


def _options(args: argparse.Namespace) -> dict:
    return dict(max_feature_nodes=args.max_feature_nodes, max_n_logits=args.max_n_logits,
                desired_logit_prob=args.desired_logit_prob, batch_size=args.batch_size, offload=args.offload,
                override=args.override)


def _transcoders(args: argparse.Namespace) -> Any:
    """The transcoders, read before the model loads (a bad reference fails at once; memory-mapped, so cheap); the
    graph checks them against the model."""
    return load_transcoders(args.transcoders, store=Store(args.store) if args.store else None)


def summary(pruned: PrunedGraph, n_nodes: int, top: int) -> dict[str, Any]:
    """What ``circuits graph`` prints: the full graph's node count, the pruned graph's nodes and edges, the logit
    targets, the ``top`` kept features by influence, the scores."""
    n_feat = len(pruned.features)
    order = pruned.influence[:n_feat].argsort(descending=True)[:top].tolist()
    return {"prompt": pruned.prompt, "tokens": len(pruned.input_tokens), "nodes": n_nodes,
            "pruned_nodes": len(pruned.nodes), "pruned_features": n_feat,
            "pruned_edges": int(pruned.adjacency.count_nonzero()),
            "logit_targets": [{"token": t.token_str, "id": t.vocab_idx, "probability": round(float(p), 6)}
                              for t, p in zip(pruned.logit_targets, pruned.logit_probabilities)],
            "top_features": [{"layer": int(pruned.features[i, 0]), "position": int(pruned.features[i, 1]),
                              "feature": int(pruned.features[i, 2]), "activation": float(pruned.activations[i]),
                              "influence": float(pruned.influence[i])} for i in order],
            "replacement_score": round(pruned.replacement_score, 6),
            "completeness_score": round(pruned.completeness_score, 6)}


def _print_summary(s: dict[str, Any]) -> None:
    print(f"attribution graph of {s['tokens']} tokens: {s['nodes']} nodes; pruned to {s['pruned_nodes']} nodes "
          f"({s['pruned_features']} features) and {s['pruned_edges']} edges")
    print("logit targets: " + ", ".join(f"{t['token']!r} {t['probability']:.3f}" for t in s["logit_targets"]))
    print(f"replacement score {s['replacement_score']:.4f}, completeness score {s['completeness_score']:.4f}")
    if s["top_features"]:
        print("most influential features (layer, position, feature: influence, activation):")
        for f in s["top_features"]:
            print(f"  L{f['layer']} @{f['position']} F{f['feature']}: {f['influence']:.4g}, {f['activation']:.4g}")


def run_graph(args: argparse.Namespace) -> int:
    _check(args)
    if not args.prompt or len(args.prompt) > MAX_PROMPT_CHARS:
        raise InputError(f"expected a prompt of 1 to {MAX_PROMPT_CHARS} characters, found {len(args.prompt)}")
    tc = _transcoders(args)
    sm = load_model_from(args)
    graph = attribution_graph(sm, tc, args.prompt, progress=not args.quiet, **_options(args))
    pruned = PrunedGraph.from_graph(graph, args.node_threshold, args.edge_threshold)
    s = summary(pruned, graph.adjacency_matrix.shape[0], args.top)
    if args.json:
        s["json"] = str(graph.to_json(args.json, slug=args.slug, node_threshold=args.node_threshold,
                                      edge_threshold=args.edge_threshold))
    if args.graph_file:
        s["saved"] = str(graph.save(args.graph_file))
    if args.summary_json:
        print(json.dumps(s))
        return 0
    _print_summary(s)
    for key, what in (("json", "frontend file"), ("saved", "graph")):
        if key in s:
            print(f"{what} written to {s[key]}")
    return 0


def _executor(args: argparse.Namespace) -> RayExecutor | None:
    """A Ray executor whose workers load the model and the transcoders (a local path made absolute)."""
    if args.ray is None:
        return None
    base = ray_executor(args)  # the flags checked, the model's spec; nothing starts
    spec = base.spec if isinstance(base.spec, ModelSpec) else ModelSpec()
    tcs = args.transcoders
    if Path(tcs).exists():
        tcs = str(Path(tcs).resolve())
    store = str(Path(args.store).resolve()) if args.store else None
    return RayExecutor(CircuitSpec(spec, tcs, store), workers=base.n_workers, address=base.address,
                       cpus_per_worker=args.cpus_per_worker, gpus_per_worker=args.gpus_per_worker)


def run_batch(args: argparse.Namespace) -> int:
    _check(args)
    check_min(args.min_prompts, "--min-prompts", 1)
    prompts = read_prompts(args.prompts)
    tc = _transcoders(args)
    executor = _executor(args)
    with model_with_workers(args, executor) as sm:
        res = attribution_graphs(sm, tc, prompts, executor, node_threshold=args.node_threshold,
                                 edge_threshold=args.edge_threshold, progress=not args.quiet, **_options(args))
    print(f"{len(res.graphs)} prompts' attribution graphs: " + ", ".join(
        f"{len(g.nodes)} nodes ({len(g.features)} features)" for g in res.graphs[:5])
        + (" ..." if len(res.graphs) > 5 else ""))
    shown = res.recurring(args.min_prompts)[: args.top]
    print(f"features kept in at least {args.min_prompts} prompts' pruned graphs: {len(res.recurring(args.min_prompts))}")
    for f in shown:
        print(f"  L{f.layer} F{f.feature}: {f.n_prompts} prompts, mean influence {f.mean_influence:.4g}")
    if args.json:
        print(f"written to {res.to_json(args.json)}")
    return 0


def _int_list(text: str, flag: str) -> list[int]:
    if not re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*", text or ""):
        raise InputError(f"expected {flag} as comma-separated indices such as 3,17,42, found {text!r:.80}")
    return [int(x) for x in text.split(",")]


def run_steer(args: argparse.Namespace) -> int:
    check_min(args.top, "--top", 1)
    nodes = _int_list(args.nodes, "--nodes")
    positions: Any = args.positions
    if positions not in ("all", "graph", "last", "prompt"):
        positions = _int_list(positions, "--positions (all, graph, last, prompt or token indices)")
    graph = Graph.load(args.graph)
    tc = _transcoders(args)
    store = Store(args.store) if args.store else Store()
    # bad nodes fail before the model loads; intervene_graph makes the same clamp
    clamp = supernode_clamp(graph, tc, nodes, scale=args.scale, value=args.value, positions=positions)
    sm = load_model_from(args)
    effect = intervene_graph(sm, graph, tc, nodes, scale=args.scale, value=args.value, top_k=args.top,
                             positions=positions)
    ref = store.save(args.save_name, clamp)
    how, amount = effect.how, effect.amount
    if args.json:
        print(json.dumps({"saved": ref, "positions": positions, **effect.to_dict()}))
        return 0
    parts = ", ".join(f"{p.sae.output_site}: {list(p.latents)}" for p in clamp.parts)
    print(f"saved {ref}: a latent clamp ({how} {amount:g}) of {len(nodes)} node(s), features {parts}, at positions "
          f"{positions}")
    print("on the graph's prompt, the logit targets:")
    for t in effect.target_changes():
        print(f"  {t['token']!r}: logit {t['logit_before']:.4g} -> {t['logit_after']:.4g} ({t['logit_change']:+.4g}), "
              f"probability {t['prob_before']:.3f} -> {t['prob_after']:.3f}")
    print("top tokens before: " + ", ".join(f"{x['token']!r} {x['prob']:.3f}" for x in effect.top()))
    print("top tokens after:  " + ", ".join(f"{x['token']!r} {x['prob']:.3f}" for x in effect.top(after=True)))
    return 0
