"""Attribution graphs as values: :class:`Graph`, its pruning (:func:`prune_graph`) and its scores
(:func:`compute_graph_scores`), with circuit-tracer's fields and conventions.

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

:meth:`Graph.to_json` writes circuit-tracer's frontend file (:mod:`steerkit.probes.graph_json`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import NamedTuple

import torch
from jaxtyping import Bool, Float, Int
from safetensors.torch import save_file
from torch import Tensor

from steerkit.errors import InputError
from steerkit.storage.files import atomic_path
from steerkit.vectors.safety import map_safetensors, read_json_bytes

from .graph_json import write_graph_json

#: the largest graph file :meth:`Graph.load` reads by default (a 512-token graph of 8192 features is about 2.2 GiB)
MAX_GRAPH_BYTES = 32 << 30
_TENSORS = ("input_tokens", "active_features", "activation_values", "selected_features", "logit_probabilities",
            "adjacency_matrix")
_GRAPH_FORMAT = "steerkit.graph/1"


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

    node_mask: Bool[Tensor, " n_nodes"]
    edge_mask: Bool[Tensor, "n_nodes n_nodes"]
    cumulative_scores: Float[Tensor, " n_nodes"]


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
    def logit_token_ids(self) -> Int[Tensor, " n_logits"]:
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

    def feature_node(self, index: int) -> tuple[int, int, int]:
        """``(block, position, feature)`` of feature node ``index``; any other node is refused, naming its kind.

        Examples:
            >>> g = Graph(torch.tensor([2, 40]), torch.tensor([[0, 1, 7]]), torch.tensor([1.5]), torch.tensor([0]),
            ...           [LogitTarget("!", 5)], torch.tensor([0.9]), torch.zeros(6, 6), n_layers=1, vocab_size=100)
            >>> g.feature_node(0)
            (0, 1, 7)
        """
        kind = self.node_kind(index)
        if kind != "feature":
            raise InputError(f"expected a feature node (0..{self.n_features - 1}), found node {index}, a {kind} node")
        layer, pos, feature = self.active_features[int(self.selected_features[index])].tolist()
        return int(layer), int(pos), int(feature)

    def fingerprint(self) -> str:
        """A hash of the graph's node set (16 hex digits): its prompt's tokens, the selected features (block, position,
        feature) and the logit targets; what an artifact made from the graph records.

        Examples:
            >>> g = Graph(torch.tensor([2, 40]), torch.tensor([[0, 1, 7]]), torch.tensor([1.5]), torch.tensor([0]),
            ...           [LogitTarget("!", 5)], torch.tensor([0.9]), torch.zeros(6, 6), n_layers=1, vocab_size=100)
            >>> len(g.fingerprint()), g.fingerprint() == dataclasses.replace(g, activation_values=torch.ones(1)).fingerprint()
            (16, True)
        """
        nodes = {"tokens": self.input_tokens.tolist(), "n_layers": self.n_layers,
                 "features": self.active_features[self.selected_features.long()].tolist(),
                 "logits": [t.vocab_idx for t in self.logit_targets]}
        return hashlib.sha256(json.dumps(nodes, sort_keys=True).encode()).hexdigest()[:16]

    def sparse_adjacency(self) -> Float[Tensor, "n_nodes n_nodes"]:
        """The adjacency matrix as a sparse COO tensor (rows targets, columns sources).

        Examples:
            >>> g = Graph(torch.tensor([2]), torch.zeros(0, 3, dtype=torch.long), torch.zeros(0),
            ...           torch.zeros(0, dtype=torch.long), [LogitTarget("a", 7)], torch.tensor([1.0]),
            ...           torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.5, 0.0]]), n_layers=1, vocab_size=10)
            >>> g.sparse_adjacency().indices().tolist(), g.sparse_adjacency().values().tolist()
            ([[2], [1]], [0.5])
        """
        return self.adjacency_matrix.to_sparse()

    def to(self, device: str | torch.device) -> "Graph":
        """Move the graph's tensors to ``device`` (in place, as circuit-tracer's ``Graph.to`` does) and return it:
        :func:`prune_graph` and :func:`compute_graph_scores` then run there.

        Examples:
            >>> g = Graph(torch.tensor([2]), torch.zeros(0, 3, dtype=torch.long), torch.zeros(0),
            ...           torch.zeros(0, dtype=torch.long), [LogitTarget("a", 7)], torch.tensor([1.0]),
            ...           torch.zeros(3, 3), n_layers=1, vocab_size=10)
            >>> g.to("cpu") is g, g.to("meta").adjacency_matrix.device  # meta: shapes without data
            (True, device(type='meta'))
        """
        for name in ("input_tokens", "active_features", "activation_values", "selected_features",
                     "logit_probabilities", "adjacency_matrix"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    # ---- files
    def save(self, path: str | os.PathLike) -> Path:
        """Write the graph as one safetensors file (its tensors, and its other fields as a JSON document in a byte
        tensor; no pickle), atomically; :meth:`load` reads it back.

        Examples:
            >>> from steerkit.probes import Graph, LogitTarget
            >>> g = Graph(torch.tensor([2, 40]), torch.tensor([[0, 1, 7]]), torch.tensor([1.5]), torch.tensor([0]),
            ...           [LogitTarget("!", 5)], torch.tensor([0.9]), torch.eye(6), n_layers=1, vocab_size=100,
            ...           scan="tiny", prompt_tokens=["<s>", "a"], input_string="<s>a")
            >>> back = Graph.load(g.save(tmp_dir / "g.safetensors"))
            >>> back.logit_targets, back.prompt_tokens, torch.equal(back.adjacency_matrix, g.adjacency_matrix)
            ([LogitTarget(token_str='!', vocab_idx=5)], ['<s>', 'a'], True)
        """
        meta = {"format": _GRAPH_FORMAT, "logit_targets": [[t.token_str, int(t.vocab_idx)] for t in self.logit_targets],
                "n_layers": int(self.n_layers), "vocab_size": int(self.vocab_size), "scan": self.scan,
                "prompt_tokens": self.prompt_tokens, "input_string": self.input_string}
        data = json.dumps(meta, allow_nan=False).encode("utf-8")
        tensors = {k: getattr(self, k).detach().cpu().contiguous() for k in _TENSORS}
        tensors["meta_json"] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        p = Path(path)
        with atomic_path(p) as tmp:
            save_file(tensors, tmp)
        return p

    @classmethod
    def load(cls, path: str | os.PathLike, *, max_bytes: int = MAX_GRAPH_BYTES) -> "Graph":
        """A graph :meth:`save` wrote (see its example): the file validated as safetensors (bounded, memory-mapped:
        the adjacency is read as it is used), the JSON document bounded in size and depth, every field checked."""
        tensors = map_safetensors(path, "graph file", max_bytes=max_bytes)
        missing = [k for k in (*_TENSORS, "meta_json") if k not in tensors]
        if missing:
            raise InputError(f"expected a graph file written by Graph.save with tensors {list(_TENSORS)}, found "
                             f"{path} without {missing}; check the path")
        meta = read_json_bytes(bytes(tensors["meta_json"].numpy().tobytes()), f"graph file {path}")
        if not isinstance(meta, dict) or meta.get("format") != _GRAPH_FORMAT:
            raise InputError(f"expected a graph file of format {_GRAPH_FORMAT!r}, found "
                             f"{meta.get('format') if isinstance(meta, dict) else type(meta).__name__!r} in {path}")
        targets = meta.get("logit_targets")
        ok = (isinstance(targets, list) and all(isinstance(t, list) and len(t) == 2 and isinstance(t[0], str)
                                                and isinstance(t[1], int) for t in targets)
              and all(isinstance(meta.get(k), int) for k in ("n_layers", "vocab_size"))
              and isinstance(meta.get("scan"), (str, type(None))) and isinstance(meta.get("input_string"), str)
              and (meta.get("prompt_tokens") is None or (isinstance(meta["prompt_tokens"], list)
                                                         and all(isinstance(t, str) for t in meta["prompt_tokens"]))))
        if not ok:
            raise InputError(f"expected a graph file's fields (logit_targets, n_layers, vocab_size, scan, "
                             f"prompt_tokens, input_string) with their types, found {path} otherwise; write it again "
                             "with Graph.save")
        ints, floats = ("input_tokens", "active_features", "selected_features"), ("activation_values",
                                                                                  "logit_probabilities", "adjacency_matrix")
        if any(tensors[k].is_floating_point() for k in ints) or any(not tensors[k].is_floating_point() for k in floats):
            raise InputError(f"expected integer token and feature indices and float values in the graph file {path}, "
                             "found other dtypes; write it again with Graph.save")
        return cls(**{k: tensors[k] for k in _TENSORS}, logit_targets=[LogitTarget(s, i) for s, i in targets],
                   n_layers=meta["n_layers"], vocab_size=meta["vocab_size"], scan=meta["scan"],
                   prompt_tokens=meta["prompt_tokens"], input_string=meta["input_string"])

    def to_json(self, path: str | os.PathLike, *, slug: str | None = None, scan: str | None = None,
                node_threshold: float = 0.8, edge_threshold: float = 0.98) -> Path:
        """Write the graph in circuit-tracer's frontend format (what its ``create_graph_files`` writes; its local
        graph server and Neuronpedia open it) at ``path``, pruned with :func:`prune_graph`, and list it in
        ``graph-metadata.json`` beside it. ``slug`` defaults to the file's stem (the local server opens
        ``{slug}.json`` of its folder), ``scan`` to the graph's. The file is checked against Neuronpedia's schema
        (:func:`steerkit.probes.graph_json.validate_graph_json`) before it is written.

        Examples:
            >>> from steerkit.probes import Graph, LogitTarget
            >>> adj = torch.zeros(6, 6)
            >>> adj[0, 3], adj[5, 0], adj[5, 4] = 1.0, 2.0, 0.5
            >>> g = Graph(torch.tensor([2, 40]), torch.tensor([[0, 1, 7]]), torch.tensor([1.5]), torch.tensor([0]),
            ...           [LogitTarget("!", 5)], torch.tensor([0.9]), adj, n_layers=1, vocab_size=100,
            ...           scan="tiny", prompt_tokens=["<s>", "a"], input_string="<s>a")
            >>> import json
            >>> doc = json.loads(g.to_json(tmp_dir / "tiny-graph.json").read_text())
            >>> [n["node_id"] for n in doc["nodes"]], doc["links"][0]
            (['0_7_1', 'E_2_0', 'E_40_1', '2_5_1'], {'source': 'E_2_0', 'target': '0_7_1', 'weight': 1.0})
        """
        pruned = prune_graph(self, node_threshold, edge_threshold)
        return write_graph_json(self, pruned, path, slug=slug, scan=scan, node_threshold=node_threshold)


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
            raise InputError(f"expected an acyclic graph, whose influence converges within {max_iter} steps, found "
                             "it still changing: the adjacency matrix has a cycle or values that are not finite; "
                             "check the matrix (edges run from earlier nodes to later ones)")
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
