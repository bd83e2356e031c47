"""circuit-tracer's frontend file of an attribution graph: :func:`write_graph_json` (what :meth:`Graph.to_json
<steerkit.probes.Graph.to_json>` calls), :func:`frontend_graph` (the document as a dict) and Neuronpedia's schema
(:func:`graph_schema`, :func:`validate_graph_json`).

How it works
------------
The file is what circuit-tracer's ``create_graph_files`` writes (its local graph server and Neuronpedia open it):
the nodes :func:`~steerkit.probes.prune_graph` keeps, with their influence (the cumulative influence score) and
activation, the kept edges between them, the metadata (``slug``, ``scan``, the prompt and its tokens) and
Neuronpedia's query parameters. Each document is checked against Neuronpedia's attribution-graph JSON schema (the
schema vendored in ``steerkit/data/neuronpedia/``) before it is written, and the folder's ``graph-metadata.json``
lists it (read back through the bounded JSON reader of :mod:`steerkit.storage.documents`).
"""
from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

from steerkit.errors import InputError
from steerkit.storage.documents import parse_json, read_document
from steerkit.storage.files import atomic_write_bytes

if TYPE_CHECKING:  # graph.py imports this module: Graph.to_json writes through it
    from .graph import Graph, PruneResult

#: the largest ``graph-metadata.json`` read back (it lists one small entry per graph)
MAX_METADATA_BYTES = 16 << 20


def write_graph_json(graph: Graph, pruned: PruneResult, path: str | os.PathLike, *, slug: str | None = None,
                     scan: str | None = None, node_threshold: float = 0.8) -> Path:
    """Write ``graph``, pruned as ``pruned`` says (:func:`~steerkit.probes.prune_graph`'s result, made with
    ``node_threshold``), in circuit-tracer's frontend format at ``path`` and list it in ``graph-metadata.json``
    beside it (see :meth:`Graph.to_json <steerkit.probes.Graph.to_json>`, which calls this).

    Examples:
        >>> import json, torch
        >>> from steerkit.probes import Graph, LogitTarget, prune_graph
        >>> from steerkit.probes.graph_json import write_graph_json
        >>> adj = torch.zeros(6, 6)
        >>> adj[0, 3], adj[5, 0] = 1.0, 2.0
        >>> g = Graph(torch.tensor([2, 40]), torch.tensor([[0, 1, 7]]), torch.tensor([1.5]), torch.tensor([0]),
        ...           [LogitTarget("!", 5)], torch.tensor([0.9]), adj, n_layers=1, vocab_size=100)
        >>> path = write_graph_json(g, prune_graph(g), tmp_dir / "g.json", scan="tiny")
        >>> json.loads((tmp_dir / "graph-metadata.json").read_text())["graphs"][0]["slug"]
        'g'
    """
    p = Path(path)
    slug = slug or p.stem
    scan = scan or graph.scan
    if not scan:
        raise InputError("expected scan= (which transcoders made the graph: a Neuronpedia model id or a transcoder "
                         "set's name), found none on the graph; pass scan=")
    doc = frontend_graph(graph, pruned, slug=slug, scan=scan, node_threshold=node_threshold)
    validate_graph_json(doc)
    listing = p.parent / "graph-metadata.json"
    graphs = _graph_metadata(listing, doc["metadata"])  # read first: a malformed listing stops before any write
    atomic_write_bytes(p, json.dumps(doc, indent=2, allow_nan=False).encode("utf-8"))
    atomic_write_bytes(listing, json.dumps({"graphs": graphs}, indent=2).encode("utf-8"))
    return p


def _graph_metadata(path: Path, meta: dict) -> list:
    """circuit-tracer's ``graph-metadata.json`` entries with ``meta`` in (one entry per slug); an existing file is
    read through the bounded reader (a malformed one raises, it is never overwritten silently)."""
    graphs: list = []
    if path.exists():
        old = read_document(path, "graph-metadata.json", fmt="json", max_bytes=MAX_METADATA_BYTES, error=InputError)
        graphs = old.get("graphs", []) if isinstance(old, dict) else []
        graphs = [g for g in graphs if isinstance(g, dict) and g.get("slug") != meta["slug"]]
    return graphs + [meta]


# ---------------------------------------------------------------------------------------------- the frontend file
def _cantor(x: int, y: int) -> int:
    return (x + y) * (x + y + 1) // 2 + y


def _node(node_id: str, feature: int, layer: str, ctx_idx: int, feature_type: str, js: str, *, token_prob: float = 0.0,
          target: bool = False, clerp: str = "", influence: float | None = None, activation: float | None = None) -> dict:
    """One node as circuit-tracer's ``Node`` model dumps it (its fields, in its order)."""
    return {"node_id": node_id, "feature": feature, "layer": layer, "ctx_idx": ctx_idx, "feature_type": feature_type,
            "token_prob": token_prob, "is_target_logit": target, "run_idx": 0, "reverse_ctx_idx": 0, "jsNodeId": js,
            "clerp": clerp, "influence": influence, "activation": activation}


def _nodes(graph: Graph, node_mask: Tensor, scores: Tensor) -> dict[int, dict]:
    n_features, L = graph.n_features, graph.n_layers
    error_end = n_features + graph.n_pos * L
    token_end = error_end + graph.n_pos
    nodes: dict[int, dict] = {}
    for i in node_mask.nonzero().flatten().tolist():
        influence = float(scores[i])
        if i < n_features:
            f = int(graph.selected_features[i])
            layer, pos, feat = (int(v) for v in graph.active_features[f].tolist())
            nodes[i] = _node(f"{layer}_{feat}_{pos}", _cantor(layer, feat), str(layer), pos, "cross layer transcoder",
                             f"{layer}_{feat}-0", influence=influence, activation=float(graph.activation_values[f]))
        elif i < error_end:
            layer, pos = divmod(i - n_features, graph.n_pos)
            nodes[i] = _node(f"0_{layer}_{pos}", -1, str(layer), pos, "mlp reconstruction error", f"{layer}_{pos}-0",
                             influence=influence)
        elif i < token_end:
            pos = i - error_end
            tok = int(graph.input_tokens[pos])
            nodes[i] = _node(f"E_{tok}_{pos}", pos, "E", pos, "embedding", f"E_{tok}-{pos}", influence=influence)
        else:
            j = i - token_end
            token, vocab_idx = graph.logit_targets[j]
            prob = float(graph.logit_probabilities[j])
            pos = graph.n_pos - 1
            nodes[i] = _node(f"{L + 1}_{vocab_idx}_{pos}", int(vocab_idx), str(L + 1), pos, "logit", f"L_{vocab_idx}-{pos}",
                             token_prob=prob, target=j == 0, clerp=f'Output "{token}" (p={prob:.3f})')
    return nodes


def frontend_graph(graph: Graph, pruned: PruneResult, *, slug: str, scan: str, node_threshold: float = 0.8) -> dict:
    """The frontend document :meth:`Graph.to_json` writes, as a dict (circuit-tracer's ``create_graph_files``):
    ``metadata``, ``qParams``, the nodes ``pruned`` keeps (:func:`~steerkit.probes.prune_graph`'s result, made with
    ``node_threshold``) that have an edge (every token and logit node too) and the kept ``links`` between them, in
    circuit-tracer's order (by target, then source).

    Examples:
        >>> from steerkit.probes import Graph, LogitTarget, prune_graph
        >>> from steerkit.probes.graph_json import frontend_graph
        >>> adj = torch.zeros(6, 6)
        >>> adj[0, 3], adj[5, 0] = 1.0, 2.0
        >>> g = Graph(torch.tensor([2, 40]), torch.tensor([[0, 1, 7]]), torch.tensor([1.5]), torch.tensor([0]),
        ...           [LogitTarget("!", 5)], torch.tensor([0.9]), adj, n_layers=1, vocab_size=100,
        ...           prompt_tokens=["<s>", "a"], input_string="<s>a")
        >>> doc = frontend_graph(g, prune_graph(g), slug="demo", scan="tiny")
        >>> doc["metadata"]["prompt_tokens"], len(doc["links"]), doc["nodes"][-1]["clerp"]
        (['<s>', 'a'], 2, 'Output "!" (p=0.900)')
    """
    node_mask, edge_mask, scores = (t.cpu() for t in pruned)
    nodes = _nodes(graph, node_mask, scores)
    dsts, srcs = edge_mask.nonzero(as_tuple=True)
    weights = graph.adjacency_matrix.cpu()[dsts, srcs].tolist()
    links = [{"source": nodes[s]["node_id"], "target": nodes[d]["node_id"], "weight": w}
             for s, d, w in zip(srcs.tolist(), dsts.tolist(), weights) if s in nodes and d in nodes]
    connected = {x for link in links for x in (link["source"], link["target"])}
    used = [n for n in nodes.values() if n["node_id"] in connected or n["feature_type"] in ("embedding", "logit")]
    tokens = graph.prompt_tokens if graph.prompt_tokens is not None else [str(int(t)) for t in graph.input_tokens]
    meta = {"slug": slug, "scan": scan, "transcoder_list": [], "prompt_tokens": list(tokens),
            "prompt": graph.input_string, "node_threshold": node_threshold, "schema_version": 1}
    qparams = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""}
    return {"metadata": meta, "qParams": qparams, "nodes": used, "links": links}


# ---------------------------------------------------------------------------------------------- the schema
def graph_schema() -> dict:
    """Neuronpedia's attribution-graph JSON schema (draft-07), vendored in ``steerkit/data/neuronpedia/``.

    Examples:
        >>> from steerkit.probes.graph_json import graph_schema
        >>> graph_schema()["title"], graph_schema()["required"]
        ('Anthropic Attribution Graph', ['metadata', 'qParams', 'nodes', 'links'])
    """
    data = resources.files("steerkit.data.neuronpedia").joinpath("graph-schema.json").read_bytes()
    return parse_json(data, "Neuronpedia's graph schema")


_TYPES = {"object": dict, "array": list, "string": str, "number": (int, float), "integer": int, "boolean": bool,
          "null": type(None)}


def _type_ok(value: Any, kinds: str | list[str]) -> bool:
    for kind in [kinds] if isinstance(kinds, str) else kinds:
        if kind in ("number", "integer") and isinstance(value, bool):
            continue
        if isinstance(value, _TYPES[kind]):
            return True
    return False


def _check(value: Any, schema: dict, where: str, problems: list[str]) -> None:
    """The draft-07 keywords the schema uses (``type``, ``required``, ``properties``, ``items``)."""
    if "type" in schema and not _type_ok(value, schema["type"]):
        problems.append(f"{where}: expected {schema['type']}, found {type(value).__name__}")
        return
    if isinstance(value, dict):
        problems.extend(f"{where}: expected the field {key!r}, found none"
                        for key in schema.get("required", []) if key not in value)
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                _check(value[key], sub, f"{where}.{key}", problems)
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            _check(item, schema["items"], f"{where}[{i}]", problems)
            if len(problems) > 20:
                return


def validate_graph_json(doc: dict) -> None:
    """Check a frontend document against Neuronpedia's schema (:func:`graph_schema`); :class:`InputError` naming
    the first problems.

    Examples:
        >>> from steerkit.probes.graph_json import validate_graph_json
        >>> try:
        ...     validate_graph_json({"metadata": {"slug": "x"}, "qParams": {}, "nodes": [], "links": []})
        ... except ValueError as e:
        ...     print(str(e)[:75])
        expected a graph that Neuronpedia's schema accepts, found: graph.metadata: 
    """
    problems: list[str] = []
    _check(doc, graph_schema(), "graph", problems)
    if problems:
        raise InputError(f"expected a graph that Neuronpedia's schema accepts, found: {'; '.join(problems[:5])}")
