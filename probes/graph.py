"""Attribution graphs as values: :class:`Graph`, its pruning (:func:`prune_graph`), its scores
(:func:`compute_graph_scores`) and the frontend file (:meth:`Graph.to_json`), with circuit-tracer's fields and
conventions.

How it works
------------
A graph's nodes are, in this order: the active transcoder features it kept (``selected_features``, indices into
``active_features``), one error node per block and position (what the transcoders miss: block-major), one token
node per position, and the logit targets. ``adjacency_matrix[t, s]`` is the direct effect of node ``s`` on node
``t`` (rows are targets, columns sources), a dense ``[N, N]`` tensor; :meth:`Graph.sparse_adjacency` gives the
sparse form.

Pruning and scores use circuit-tracer's definitions. The matrix is normalised row by row (``|A|`` over its row
sums), a node's *influence* is its weight in ``p (B + B^2 + ...)`` where ``p`` puts the logit probabilities on the
logit nodes; :func:`prune_graph` keeps the nodes whose influence makes up ``node_threshold`` of the total (every
token and logit node kept), then the edges whose influence (an edge's normalised weight times its target's
influence plus ``p``) makes up ``edge_threshold``, and drops, until nothing changes, feature and error nodes left
without an outgoing edge and features without an incoming one. :func:`compute_graph_scores` returns the
replacement score (the share of the tokens' and errors' influence that is the tokens') and the completeness score
(the influence-weighted share of each node's normalised input that comes from non-error nodes).

:meth:`Graph.to_json` writes what circuit-tracer's ``create_graph_files`` writes (its local graph server and
Neuronpedia open it): the pruned nodes with their influence (the cumulative influence score) and activation, the
kept edges between them, the metadata (``slug``, ``scan``, the prompt and its tokens) and Neuronpedia's query
parameters; the file is checked against Neuronpedia's attribution-graph JSON schema (:func:`validate_graph_json`,
the schema vendored in ``steerkit/data/neuronpedia/``), and the folder's ``graph-metadata.json`` lists it.
"""
from __future__ import annotations

import dataclasses
import json
import os
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

import torch
from jaxtyping import Float, Int
from torch import Tensor

from steerkit.errors import InputError
from steerkit.storage.documents import parse_json
from steerkit.storage.files import atomic_write_bytes


class LogitTarget(NamedTuple):
    """A logit node's token: its text and its vocabulary index (circuit-tracer's ``LogitTarget``).

    Examples:
        >>> from steerkit.probes import LogitTarget
        >>> token, index = LogitTarget(" Paris", 6342)
        >>> token, index
        (' Paris', 6342)
    """

    token_str: str
    vocab_idx: int


class PruneResult(NamedTuple):
    """What :func:`prune_graph` returns: the nodes kept, the edges kept (``[N, N]``, rows targets) and each node's
    cumulative influence score.

    Examples:
        >>> from steerkit.probes import PruneResult
        >>> PruneResult(torch.ones(2, dtype=torch.bool), torch.zeros(2, 2, dtype=torch.bool), torch.ones(2))._fields
        ('node_mask', 'edge_mask', 'cumulative_scores')
    """

    node_mask: Tensor
    edge_mask: Tensor
    cumulative_scores: Tensor


@dataclasses.dataclass(eq=False)
class Graph:
    """An attribution graph (see the module docstring), what :func:`steerkit.probes.attribution_graph` returns.

    ``input_tokens`` (the prompt's token ids, the special token in front included), ``active_features`` (int
    ``[n, 3]``: block, position, feature of every active feature, in that sorted order), ``activation_values``
    ``[n]``, ``selected_features`` (the indices of the nodes' features into ``active_features``),
    ``logit_targets`` (:class:`LogitTarget` values) and ``logit_probabilities``, ``adjacency_matrix`` ``[N, N]``;
    ``n_layers``, ``vocab_size``, ``scan`` (which transcoders: a Neuronpedia model id or a transcoder set's name),
    ``prompt_tokens`` (each token's text) and ``input_string`` (the prompt as the tokens decode).

    Examples:
        >>> from steerkit.probes import Graph, LogitTarget
        >>> adj = torch.zeros(6, 6)
        >>> adj[0, 3], adj[5, 0], adj[5, 4] = 1.0, 2.0, 0.5  # token 0 -> feature -> logit; token 1 -> logit
        >>> g = Graph(input_tokens=torch.tensor([2, 40]), active_features=torch.tensor([[0, 1, 7]]),
        ...           activation_values=torch.tensor([1.5]), selected_features=torch.tensor([0]),
        ...           logit_targets=[LogitTarget("!", 5)], logit_probabilities=torch.tensor([0.9]),
        ...           adjacency_matrix=adj, n_layers=1, vocab_size=100, prompt_tokens=["<s>", "a"])
        >>> g.n_pos, g.n_features, g.n_errors, g.node_kind(2), g.node_kind(5)
        (2, 1, 2, 'error', 'logit')
    """

    input_tokens: Int[Tensor, " n_pos"]
    active_features: Int[Tensor, "n_active 3"]
    activation_values: Float[Tensor, " n_active"]
    selected_features: Int[Tensor, " n_features"]
    logit_targets: list[LogitTarget]
    logit_probabilities: Float[Tensor, " n_logits"]
    adjacency_matrix: Float[Tensor, "n_nodes n_nodes"]
    n_layers: int
    vocab_size: int
    scan: str | None = None
    prompt_tokens: list[str] | None = None
    input_string: str = ""

    def __post_init__(self) -> None:
        n = self.n_features + self.n_errors + self.n_pos + self.n_logits
        if tuple(self.adjacency_matrix.shape) != (n, n):
            raise InputError(f"expected an adjacency matrix [{n}, {n}] ({self.n_features} features, {self.n_errors} "
                             f"errors, {self.n_pos} tokens, {self.n_logits} logits), found "
                             f"{tuple(self.adjacency_matrix.shape)}")
        if len(self.logit_probabilities) != self.n_logits:
            raise InputError(f"expected a probability for each of the {self.n_logits} logit targets, found "
                             f"{len(self.logit_probabilities)}")

    # ---- sizes and nodes
    @property
    def n_pos(self) -> int:
        """Positions of the prompt (tokens, the special token in front included)."""
        return int(self.input_tokens.shape[0])

    @property
    def n_features(self) -> int:
        """Feature nodes (``len(selected_features)``)."""
        return int(self.selected_features.shape[0])

    @property
    def n_errors(self) -> int:
        """Error nodes: one per block and position."""
        return self.n_layers * self.n_pos

    @property
    def n_logits(self) -> int:
        return len(self.logit_targets)

    @property
    def logit_token_ids(self) -> Tensor:
        """The logit targets' vocabulary indices (int64).

        Examples:
            >>> g = Graph(torch.tensor([2]), torch.zeros(0, 3, dtype=torch.long), torch.zeros(0),
            ...           torch.zeros(0, dtype=torch.long), [LogitTarget("a", 7), LogitTarget("b", 9)],
            ...           torch.tensor([0.6, 0.3]), torch.zeros(4, 4), n_layers=1, vocab_size=10)
            >>> g.logit_token_ids
            tensor([7, 9])
        """
        return torch.tensor([t.vocab_idx for t in self.logit_targets], dtype=torch.long)

    def node_kind(self, index: int) -> str:
        """``"feature"``, ``"error"``, ``"token"`` or ``"logit"``: what node ``index`` is (see the examples of
        :class:`Graph`)."""
        if not 0 <= index < self.adjacency_matrix.shape[0]:
            raise InputError(f"expected a node index in 0..{self.adjacency_matrix.shape[0] - 1}, found {index}")
        bounds = [(self.n_features, "feature"), (self.n_features + self.n_errors, "error"),
                  (self.n_features + self.n_errors + self.n_pos, "token")]
        return next((kind for end, kind in bounds if index < end), "logit")

    def sparse_adjacency(self) -> Tensor:
        """The adjacency matrix as a sparse COO tensor (rows targets, columns sources).

        Examples:
            >>> g = Graph(torch.tensor([2]), torch.zeros(0, 3, dtype=torch.long), torch.zeros(0),
            ...           torch.zeros(0, dtype=torch.long), [LogitTarget("a", 7)], torch.tensor([1.0]),
            ...           torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.5, 0.0]]), n_layers=1, vocab_size=10)
            >>> g.sparse_adjacency().indices().tolist(), g.sparse_adjacency().values().tolist()
            ([[2], [1]], [0.5])
        """
        return self.adjacency_matrix.to_sparse()

    # ---- files
    def to_json(self, path: str | os.PathLike, *, slug: str | None = None, scan: str | None = None,
                node_threshold: float = 0.8, edge_threshold: float = 0.98) -> Path:
        """Write the graph in circuit-tracer's frontend format (what its ``create_graph_files`` writes; its local
        graph server and Neuronpedia open it) at ``path``, pruned with :func:`prune_graph`, and list it in
        ``graph-metadata.json`` beside it. ``slug`` defaults to the file's stem (the local server opens
        ``{slug}.json`` of its folder), ``scan`` to the graph's. The file is checked against Neuronpedia's schema
        (:func:`validate_graph_json`) before it is written.

        Examples:
            >>> from steerkit.probes import Graph, LogitTarget
            >>> adj = torch.zeros(6, 6)
            >>> adj[0, 3], adj[5, 0], adj[5, 4] = 1.0, 2.0, 0.5
            >>> g = Graph(torch.tensor([2, 40]), torch.tensor([[0, 1, 7]]), torch.tensor([1.5]), torch.tensor([0]),
            ...           [LogitTarget("!", 5)], torch.tensor([0.9]), adj, n_layers=1, vocab_size=100,
            ...           scan="tiny", prompt_tokens=["<s>", "a"], input_string="<s>a")
            >>> doc = json.loads(g.to_json(tmp_dir / "tiny-graph.json").read_text())
            >>> [n["node_id"] for n in doc["nodes"]], doc["links"][0]
            (['0_7_1', 'E_2_0', 'E_40_1', '2_5_1'], {'source': 'E_2_0', 'target': '0_7_1', 'weight': 1.0})
        """
        p = Path(path)
        slug = slug or p.stem
        scan = scan or self.scan
        if not scan:
            raise InputError("expected scan= (which transcoders made the graph: a Neuronpedia model id or a transcoder "
                             "set's name), found none on the graph; pass scan=")
        doc = frontend_graph(self, slug=slug, scan=scan, node_threshold=node_threshold, edge_threshold=edge_threshold)
        validate_graph_json(doc)
        atomic_write_bytes(p, json.dumps(doc, indent=2, allow_nan=False).encode("utf-8"))
        _add_graph_metadata(p.parent / "graph-metadata.json", doc["metadata"])
        return p


def _add_graph_metadata(path: Path, meta: dict) -> None:
    """circuit-tracer's ``graph-metadata.json``: ``{"graphs": [metadata, ...]}``, one entry per slug."""
    graphs: list = []
    if path.exists():
        old = parse_json(path.read_bytes(), str(path))
        graphs = old.get("graphs", []) if isinstance(old, dict) else []
        graphs = [g for g in graphs if isinstance(g, dict) and g.get("slug") != meta["slug"]]
    atomic_write_bytes(path, json.dumps({"graphs": graphs + [meta]}, indent=2).encode("utf-8"))


# ---------------------------------------------------------------------------------------------- influence
def normalize_matrix(matrix: Float[Tensor, "n n"]) -> Float[Tensor, "n n"]:
    """``|A|`` divided by its row sums (a row of zeros stays zeros).

    Examples:
        >>> from steerkit.probes.graph import normalize_matrix
        >>> normalize_matrix(torch.tensor([[1.0, -3.0], [0.0, 0.0]]))
        tensor([[0.2500, 0.7500],
                [0.0000, 0.0000]])
    """
    a = matrix.abs()
    return a / a.sum(dim=1, keepdim=True).clamp(min=1e-10)


def compute_influence(A: Float[Tensor, "n n"], logit_weights: Float[Tensor, " n"], max_iter: int = 1000
                      ) -> Float[Tensor, " n"]:
    """``p A + p A^2 + ...`` (``p``: ``logit_weights``), summed until a term is all zeros (an attribution graph's
    edges run forward, so one is); ``RuntimeError`` after ``max_iter`` terms.

    Examples:
        >>> from steerkit.probes.graph import compute_influence
        >>> A = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.5, 0.5, 0.0]])  # 0 -> 1 -> 2, 0 -> 2
        >>> compute_influence(A, torch.tensor([0.0, 0.0, 1.0]))
        tensor([1.0000, 0.5000, 0.0000])
    """
    current = logit_weights @ A
    influence = current
    n = 0
    while current.any():
        if n >= max_iter:
            raise RuntimeError(f"expected the influence to converge within {max_iter} steps, found it did not: the "
                               "graph has a cycle")
        current = current @ A
        influence = influence + current
        n += 1
    return influence


def _logit_weights(graph: Graph) -> Tensor:
    w = torch.zeros(graph.adjacency_matrix.shape[0], device=graph.adjacency_matrix.device,
                    dtype=graph.adjacency_matrix.dtype)
    w[-graph.n_logits:] = graph.logit_probabilities.to(w)
    return w


def _find_threshold(scores: Tensor, threshold: float) -> Tensor:
    ordered = torch.sort(scores, descending=True).values
    cumulative = torch.cumsum(ordered, dim=0) / torch.sum(ordered)
    i = min(int(torch.searchsorted(cumulative, threshold).item()), len(cumulative) - 1)
    return ordered[i]


def prune_graph(graph: Graph, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> PruneResult:
    """``(node_mask, edge_mask, cumulative_scores)``: the nodes and edges kept by circuit-tracer's pruning (see the
    module docstring) and each node's cumulative influence score (the share of the total influence of the nodes
    at least as influential as it).

    Examples:
        >>> from steerkit.probes import Graph, LogitTarget, prune_graph
        >>> adj = torch.zeros(6, 6)
        >>> adj[0, 3], adj[5, 0], adj[5, 4] = 1.0, 2.0, 0.5
        >>> g = Graph(torch.tensor([2, 40]), torch.tensor([[0, 1, 7]]), torch.tensor([1.5]), torch.tensor([0]),
        ...           [LogitTarget("!", 5)], torch.tensor([0.9]), adj, n_layers=1, vocab_size=100)
        >>> nodes, edges, scores = prune_graph(g)
        >>> nodes.tolist(), edges.nonzero().tolist()
        ([True, False, False, True, True, True], [[0, 3], [5, 0], [5, 4]])
    """
    for name, v in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if not 0.0 <= v <= 1.0:
            raise InputError(f"expected {name} between 0.0 and 1.0, found {v}")
    n_tokens, n_logits, n_features = graph.n_pos, graph.n_logits, graph.n_features
    weights = _logit_weights(graph)
    node_influence = compute_influence(normalize_matrix(graph.adjacency_matrix), weights)
    node_mask = node_influence >= _find_threshold(node_influence, node_threshold)
    node_mask[-n_logits - n_tokens:] = True
    pruned = graph.adjacency_matrix.clone()
    pruned[~node_mask] = 0
    pruned[:, ~node_mask] = 0
    normalized = normalize_matrix(pruned)
    edge_scores = normalized * (compute_influence(normalized, weights) + weights)[:, None]
    del normalized, pruned
    edge_mask = edge_scores >= _find_threshold(edge_scores.flatten(), edge_threshold)
    del edge_scores
    old = node_mask.clone()
    node_mask[: -n_logits - n_tokens] &= edge_mask[:, : -n_logits - n_tokens].any(0)
    node_mask[:n_features] &= edge_mask[:n_features].any(1)
    while not torch.equal(node_mask, old):
        old[:] = node_mask
        edge_mask[~node_mask] = False
        edge_mask[:, ~node_mask] = False
        node_mask[: -n_logits - n_tokens] &= edge_mask[:, : -n_logits - n_tokens].any(0)
        node_mask[:n_features] &= edge_mask[:n_features].any(1)
    ordered, order = torch.sort(node_influence, descending=True)
    scores = torch.zeros_like(node_influence)
    scores[order] = torch.cumsum(ordered, dim=0) / torch.sum(ordered)
    return PruneResult(node_mask, edge_mask, scores)


def compute_graph_scores(graph: Graph) -> tuple[float, float]:
    """``(replacement score, completeness score)`` of circuit-tracer (see the module docstring): how much of the
    model's computation, from the tokens to the logits, runs through features rather than error nodes.

    Examples:
        >>> from steerkit.probes import Graph, LogitTarget, compute_graph_scores
        >>> adj = torch.zeros(6, 6)
        >>> adj[0, 3], adj[5, 0], adj[5, 1] = 1.0, 3.0, 1.0  # the logit: 3 from the feature, 1 from an error
        >>> g = Graph(torch.tensor([2, 40]), torch.tensor([[0, 1, 7]]), torch.tensor([1.5]), torch.tensor([0]),
        ...           [LogitTarget("!", 5)], torch.tensor([1.0]), adj, n_layers=1, vocab_size=100)
        >>> [round(s, 3) for s in compute_graph_scores(g)]
        [0.75, 0.909]
    """
    n_features, n_tokens = graph.n_features, graph.n_pos
    error_end = n_features + n_tokens * graph.n_layers
    token_end = error_end + n_tokens
    weights = _logit_weights(graph)
    normalized = normalize_matrix(graph.adjacency_matrix)
    influence = compute_influence(normalized, weights)
    token_influence = influence[error_end:token_end].sum()
    error_influence = influence[n_features:error_end].sum()
    replacement = token_influence / (token_influence + error_influence)
    non_error = 1 - normalized[:, n_features:error_end].sum(dim=-1)
    output_influence = influence + weights
    completeness = (non_error * output_influence).sum() / output_influence.sum()
    return float(replacement.item()), float(completeness.item())


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


def frontend_graph(graph: Graph, *, slug: str, scan: str, node_threshold: float = 0.8,
                   edge_threshold: float = 0.98) -> dict:
    """The frontend document :meth:`Graph.to_json` writes, as a dict (circuit-tracer's ``create_graph_files``):
    ``metadata``, ``qParams``, the pruned ``nodes`` that have an edge (every token and logit node too) and the
    kept ``links`` between them, in circuit-tracer's order (by target, then source).

    Examples:
        >>> from steerkit.probes import Graph, LogitTarget
        >>> from steerkit.probes.graph import frontend_graph
        >>> adj = torch.zeros(6, 6)
        >>> adj[0, 3], adj[5, 0] = 1.0, 2.0
        >>> g = Graph(torch.tensor([2, 40]), torch.tensor([[0, 1, 7]]), torch.tensor([1.5]), torch.tensor([0]),
        ...           [LogitTarget("!", 5)], torch.tensor([0.9]), adj, n_layers=1, vocab_size=100,
        ...           prompt_tokens=["<s>", "a"], input_string="<s>a")
        >>> doc = frontend_graph(g, slug="demo", scan="tiny")
        >>> doc["metadata"]["prompt_tokens"], len(doc["links"]), doc["nodes"][-1]["clerp"]
        (['<s>', 'a'], 2, 'Output "!" (p=0.900)')
    """
    node_mask, edge_mask, scores = (t.cpu() for t in prune_graph(graph, node_threshold, edge_threshold))
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
        >>> from steerkit.probes.graph import graph_schema
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
        >>> from steerkit.probes.graph import validate_graph_json
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
