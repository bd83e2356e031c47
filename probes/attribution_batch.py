"""Attribution graphs over many prompts: :func:`attribution_graphs`, here or on Ray workers.

How it works
------------
Each prompt's graph is :func:`~steerkit.probes.attribution_graph` then :func:`~steerkit.probes.prune_graph`, run
where the executor runs it (here by default). What comes back per prompt is a :class:`PrunedGraph`: the nodes the
pruning keeps (their indices in the full graph, kinds and labels), the features among them (block, position,
feature, activation), the kept edges among them (a ``[k, k]`` matrix, rows targets, zeros where an edge was
pruned), each kept node's influence on the logits (``p (B + B^2 + ...)`` on the row-normalised ``|A|``, the
quantity the pruning ranks by) and the replacement and completeness scores; the full :class:`Graph` too with
``keep_graphs=True`` (a 512-token graph's dense adjacency is gigabytes, so it is left out by default).

Across prompts, :class:`AttributionGraphs` lists every transcoder feature (block, feature index) that a pruned
graph keeps at some position: in how many prompts, and its mean influence over those prompts (in each prompt, the
sum of its nodes' influences over positions). :meth:`AttributionGraphs.recurring` keeps those found in at least
``min_prompts`` prompts.

On Ray, each worker loads the model and the transcoders once, as a :class:`CircuitSpec` names them: the
transcoders travel as a reference (a folder or file every node can read, a Hub reference, or a store reference
with the store's folder), never as tensors; each prompt's :class:`PrunedGraph` comes back through Ray's object
store and the caller merges them in prompt order.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm import tqdm

from steerkit.errors import InputError
from steerkit.executors import ModelSpec
from steerkit.storage.files import atomic_write_bytes
from steerkit.vectors import Store, Transcoders, load_transcoders

from .attribution import attribution_graph
from .graph import Graph, LogitTarget, compute_graph_scores, compute_influence, normalize_matrix, prune_graph
from .plots.require import plotly_required

if TYPE_CHECKING:
    from steerkit.model import SteerModel

#: the most prompts one call takes
MAX_PROMPTS = 100_000


@dataclasses.dataclass(frozen=True)
class CircuitSpec:
    """What a Ray worker loads once for :func:`attribution_graphs`: the model (a :class:`~steerkit.executors.ModelSpec`)
    and the transcoders by reference (``transcoders``: a folder or file at the same path on every node, a Hub
    reference, or a store reference ``name@N`` with ``store`` the store's folder), read with
    :func:`steerkit.load_transcoders` and checked against the model.

    Examples:
        >>> from steerkit.executors import ModelSpec
        >>> from steerkit.probes import CircuitSpec
        >>> spec = CircuitSpec(ModelSpec(threads=1), "tc@1", store="/data/store")
        >>> spec.transcoders, spec.model.threads
        ('tc@1', 1)
    """

    model: ModelSpec = ModelSpec()
    transcoders: str = ""
    store: str | None = None

    def load(self) -> "CircuitWorker":
        """The model and the transcoders, loaded here (what each worker does once)."""
        sm = self.model.load()
        return CircuitWorker(sm, _load(self.transcoders, self.store, sm))

    def fingerprint(self, state: "CircuitWorker") -> str:
        """What must be equal on every worker: the model's fingerprint."""
        return state.sm.fingerprint()


@dataclasses.dataclass
class CircuitWorker:
    """A worker's state: its model and transcoders (what :meth:`CircuitSpec.load` returns; a
    :class:`~steerkit.executors.LocalExecutor` on one runs :func:`attribution_graphs` here as a worker would).

    Examples:
        >>> from steerkit.probes.attribution_batch import CircuitWorker
        >>> from steerkit.vectors import Transcoders
        >>> L, d = tiny.n_layers, tiny.d_model
        >>> tc = Transcoders([torch.randn(8, d)] * L, [torch.zeros(8)] * L, [torch.randn(8, d)] * L, [torch.zeros(d)] * L)
        >>> CircuitWorker(tiny, tc).transcoders.n_layers == tiny.n_layers
        True
    """

    sm: "SteerModel"
    transcoders: Transcoders

    def fingerprint(self) -> str:
        """The model's fingerprint (what a command line checks its workers by, as for a bare model)."""
        return self.sm.fingerprint()


def _load(source: str | os.PathLike, store: str | os.PathLike | None, sm: "SteerModel") -> Transcoders:
    if not str(source):
        raise InputError("expected transcoders as a folder, file, Hub reference or store reference (name@N), found "
                         "an empty name; pass the transcoders the graphs are traced through")
    return load_transcoders(source, model=sm, store=Store(store) if store is not None else None)


class RecurringFeature(NamedTuple):
    """A transcoder feature kept by the pruned graphs of several prompts: its block, its index, in how many prompts
    it is kept, and its mean influence on the logits over those prompts.

    Examples:
        >>> from steerkit.probes.attribution_batch import RecurringFeature
        >>> RecurringFeature(3, 17, n_prompts=2, mean_influence=0.25)
        RecurringFeature(layer=3, feature=17, n_prompts=2, mean_influence=0.25)
    """

    layer: int
    feature: int
    n_prompts: int
    mean_influence: float


@dataclasses.dataclass(eq=False)
class PrunedGraph:
    """One prompt's pruned attribution graph (see the module docstring): ``nodes`` (the kept nodes' indices in the
    full graph, in its order: features, errors, tokens, logits), ``kinds`` and ``labels`` (``"L3 F17 @5"``,
    ``"error L3 @5"``, ``"token @5 'cat'"``, ``"logit ' Paris'"``), ``features`` (int ``[f, 3]``: block, position,
    feature of the kept feature nodes, which come first) and their ``activations``, ``adjacency`` ``[k, k]`` (the
    kept edges, rows targets), ``influence`` ``[k]``, the prompt, its tokens, the logit targets and probabilities,
    and the replacement and completeness scores of the full graph; ``graph`` the full graph where kept.

    Examples:
        >>> from steerkit.probes import Graph, LogitTarget, PrunedGraph
        >>> adj = torch.zeros(6, 6)
        >>> adj[0, 3], adj[5, 0], adj[5, 4] = 1.0, 2.0, 0.5
        >>> g = Graph(torch.tensor([2, 40]), torch.tensor([[0, 1, 7]]), torch.tensor([1.5]), torch.tensor([0]),
        ...           [LogitTarget("!", 5)], torch.tensor([0.9]), adj, n_layers=1, vocab_size=100)
        >>> p = PrunedGraph.from_graph(g)
        >>> p.kinds, p.to_dict()["edges"]
        (['feature', 'token', 'token', 'logit'], [[0, 1, 1.0], [3, 0, 2.0], [3, 2, 0.5]])
    """

    prompt: str
    input_tokens: Int[Tensor, " n_pos"]
    prompt_tokens: list[str]
    nodes: Int[Tensor, " k"]
    kinds: list[str]
    labels: list[str]
    features: Int[Tensor, "f 3"]
    activations: Float[Tensor, " f"]
    adjacency: Float[Tensor, "k k"]
    influence: Float[Tensor, " k"]
    logit_targets: list[LogitTarget]
    logit_probabilities: Float[Tensor, " n_logits"]
    replacement_score: float
    completeness_score: float
    graph: Graph | None = None

    @classmethod
    def from_graph(cls, graph: Graph, node_threshold: float = 0.8, edge_threshold: float = 0.98,
                   keep_graph: bool = False) -> "PrunedGraph":
        """``graph`` pruned with :func:`~steerkit.probes.prune_graph`, its kept part (the full graph kept with
        ``keep_graph=True``).

        Examples:
            >>> from steerkit.probes import Graph, LogitTarget, PrunedGraph
            >>> adj = torch.zeros(6, 6)
            >>> adj[0, 3], adj[5, 0], adj[5, 4] = 1.0, 2.0, 0.5  # token 0 -> feature -> logit; token 1 -> logit
            >>> g = Graph(torch.tensor([2, 40]), torch.tensor([[0, 1, 7]]), torch.tensor([1.5]), torch.tensor([0]),
            ...           [LogitTarget("!", 5)], torch.tensor([0.9]), adj, n_layers=1, vocab_size=100,
            ...           prompt_tokens=["<s>", "a"])
            >>> p = PrunedGraph.from_graph(g)
            >>> p.nodes.tolist(), p.labels, p.features.tolist()
            ([0, 3, 4, 5], ['L0 F7 @1', "token @0 '<s>'", "token @1 'a'", "logit '!'"], [[0, 1, 7]])
            >>> p.adjacency.nonzero().tolist(), [round(x, 3) for x in p.influence.tolist()]
            ([[0, 1], [3, 0], [3, 2]], [0.72, 0.72, 0.18, 0.0])
        """
        pruned = prune_graph(graph, node_threshold, edge_threshold)
        weights = torch.zeros(graph.adjacency_matrix.shape[0], dtype=graph.adjacency_matrix.dtype)
        weights[-graph.n_logits:] = graph.logit_probabilities.to(weights)
        influence = compute_influence(normalize_matrix(graph.adjacency_matrix), weights)
        replacement, completeness = compute_graph_scores(graph)
        nodes = torch.where(pruned.node_mask)[0]
        adjacency = (graph.adjacency_matrix * pruned.edge_mask)[nodes][:, nodes]
        n_feat = int((nodes < graph.n_features).sum())
        features = graph.active_features[graph.selected_features[nodes[:n_feat]]]
        activations = graph.activation_values[graph.selected_features[nodes[:n_feat]]]
        kinds, labels = zip(*[_label(graph, int(i)) for i in nodes]) if len(nodes) else ((), ())
        return cls(prompt=graph.input_string, input_tokens=graph.input_tokens.cpu(),
                   prompt_tokens=list(graph.prompt_tokens or []), nodes=nodes.cpu(), kinds=list(kinds),
                   labels=list(labels), features=features.cpu(), activations=activations.cpu(),
                   adjacency=adjacency.cpu(), influence=influence[nodes].cpu(),
                   logit_targets=list(graph.logit_targets), logit_probabilities=graph.logit_probabilities.cpu(),
                   replacement_score=replacement, completeness_score=completeness,
                   graph=graph if keep_graph else None)

    def to_dict(self) -> dict[str, Any]:
        """The graph as plain JSON values: nodes (kind, label, influence, and block, position, feature and
        activation for a feature), edges ``[target, source, weight]`` (positions in ``nodes``), the scores."""
        nodes = []
        for i in range(len(self.nodes)):
            node: dict[str, Any] = {"index": int(self.nodes[i]), "kind": self.kinds[i], "label": self.labels[i],
                                    "influence": float(self.influence[i])}
            if i < len(self.features):
                layer, pos, feat = self.features[i].tolist()
                node.update(layer=layer, position=pos, feature=feat, activation=float(self.activations[i]))
            nodes.append(node)
        t, s = self.adjacency.nonzero(as_tuple=True)
        return {"prompt": self.prompt, "tokens": self.input_tokens.tolist(), "prompt_tokens": self.prompt_tokens,
                "logit_targets": [[t_.token_str, t_.vocab_idx] for t_ in self.logit_targets],
                "logit_probabilities": self.logit_probabilities.tolist(), "nodes": nodes,
                "edges": [[int(a), int(b), float(self.adjacency[a, b])] for a, b in zip(t.tolist(), s.tolist())],
                "replacement_score": self.replacement_score, "completeness_score": self.completeness_score}


def _label(graph: Graph, i: int) -> tuple[str, str]:
    kind = graph.node_kind(i)
    if kind == "feature":
        l, p, f = graph.active_features[graph.selected_features[i]].tolist()
        return kind, f"L{l} F{f} @{p}"
    tokens = graph.prompt_tokens or [str(t) for t in graph.input_tokens.tolist()]
    if kind == "error":
        l, p = divmod(i - graph.n_features, graph.n_pos)
        return kind, f"error L{l} @{p}"
    if kind == "token":
        p = i - graph.n_features - graph.n_errors
        return kind, f"token @{p} {tokens[p]!r}"
    return kind, f"logit {graph.logit_targets[i - graph.adjacency_matrix.shape[0] + graph.n_logits].token_str!r}"


def recurring_features(graphs: Sequence[PrunedGraph]) -> list[RecurringFeature]:
    """Every feature (block, index) kept by some pruned graph: in how many graphs, and the mean over those graphs of
    its influence (in each, summed over the positions it is kept at); most prompts first, then most influence.

    Examples:
        >>> from steerkit.probes.attribution_batch import recurring_features
        >>> a = PrunedGraph("a", torch.tensor([1]), [], torch.tensor([0, 1]), ["feature"] * 2, ["", ""],
        ...                 torch.tensor([[2, 1, 7], [2, 3, 7]]), torch.ones(2), torch.zeros(2, 2),
        ...                 torch.tensor([0.5, 0.25]), [], torch.zeros(0), 1.0, 1.0)
        >>> b = dataclasses.replace(a, nodes=torch.tensor([0]), features=torch.tensor([[2, 1, 7]]),
        ...                         influence=torch.tensor([0.25]))
        >>> recurring_features([a, b])
        [RecurringFeature(layer=2, feature=7, n_prompts=2, mean_influence=0.5)]
    """
    totals: dict[tuple[int, int], list[float]] = {}
    for g in graphs:
        here: dict[tuple[int, int], float] = {}
        for (layer, _, feat), infl in zip(g.features.tolist(), g.influence[: len(g.features)].tolist()):
            here[(layer, feat)] = here.get((layer, feat), 0.0) + infl
        for key, v in here.items():
            totals.setdefault(key, []).append(v)
    out = [RecurringFeature(l, f, len(v), sum(v) / len(v)) for (l, f), v in totals.items()]
    return sorted(out, key=lambda r: (-r.n_prompts, -r.mean_influence, r.layer, r.feature))


@dataclasses.dataclass(eq=False)
class AttributionGraphs:
    """What :func:`attribution_graphs` returns: ``graphs`` (a :class:`PrunedGraph` per prompt, in prompt order),
    ``features`` (:func:`recurring_features` over them), the thresholds and the graph options used.

    Examples:
        >>> from steerkit.probes import AttributionGraphs
        >>> from steerkit.probes.attribution_batch import RecurringFeature
        >>> res = AttributionGraphs([], [RecurringFeature(2, 7, 3, 0.5), RecurringFeature(1, 4, 1, 0.9)], 0.8, 0.98, {})
        >>> res.recurring(), res.to_json(tmp_dir / "graphs.json").name
        ([RecurringFeature(layer=2, feature=7, n_prompts=3, mean_influence=0.5)], 'graphs.json')
    """

    graphs: list[PrunedGraph]
    features: list[RecurringFeature]
    node_threshold: float
    edge_threshold: float
    options: dict[str, Any]

    def recurring(self, min_prompts: int = 2) -> list[RecurringFeature]:
        """The features kept in at least ``min_prompts`` prompts' graphs."""
        return [f for f in self.features if f.n_prompts >= min_prompts]

    def to_dict(self) -> dict[str, Any]:
        """Everything as plain JSON values (what :meth:`to_json` writes)."""
        return {"node_threshold": self.node_threshold, "edge_threshold": self.edge_threshold,
                "options": {k: v for k, v in self.options.items() if isinstance(v, (int, float, str, bool, type(None)))},
                "graphs": [g.to_dict() for g in self.graphs],
                "features": [f._asdict() for f in self.features]}

    def to_json(self, path: str | os.PathLike) -> Path:
        """Write :meth:`to_dict` as JSON at ``path`` (atomically) and return the path."""
        p = Path(path)
        atomic_write_bytes(p, json.dumps(self.to_dict(), indent=1).encode())
        return p

    def plot(self, *, top: int = 30, min_prompts: int = 1, title: str | None = None):
        """A plotly figure: the ``top`` features kept in the most prompts, bars of how many, coloured by their mean
        influence (:func:`steerkit.probes.plots.circuits.recurring_figure`)."""
        with plotly_required():
            from .plots import circuits as figures
        return figures.recurring_figure(self, top=top, min_prompts=min_prompts, title=title)


def _graph_task(state: Any, prompt: Any, *, transcoders: Transcoders | None, node_threshold: float,
                edge_threshold: float, keep_graphs: bool, options: dict[str, Any]) -> PrunedGraph:
    """One prompt's pruned graph, on a worker (``state``: a :class:`CircuitWorker`) or here (``state``: the model,
    ``transcoders`` the caller's)."""
    if isinstance(state, CircuitWorker):
        sm, tc = state.sm, state.transcoders
    elif transcoders is not None:
        sm, tc = state, transcoders
    else:
        raise InputError("expected the executor's workers to load the transcoders (RayExecutor(CircuitSpec(ModelSpec"
                         f"(...), 'transcoders folder or name@N'))), found a worker holding {type(state).__name__}; "
                         "make the executor with a steerkit.probes.CircuitSpec")
    graph = attribution_graph(sm, tc, prompt, progress=False, **options)
    return PrunedGraph.from_graph(graph, node_threshold, edge_threshold, keep_graphs)


def _prompts(prompts: Any) -> list[Any]:
    if isinstance(prompts, (str, Tensor)) or not isinstance(prompts, Sequence):
        raise InputError(f"expected prompts as a list of strings (or token id lists), found "
                         f"{type(prompts).__name__}; wrap a single prompt in a list or use attribution_graph")
    if not 0 < len(prompts) <= MAX_PROMPTS:
        raise InputError(f"expected between 1 and {MAX_PROMPTS} prompts, found {len(prompts)}")
    return list(prompts)


def attribution_graphs(sm: "SteerModel", transcoders: Transcoders | str | os.PathLike, prompts: Sequence[Any],
                       executor: Any = None, *, node_threshold: float = 0.8, edge_threshold: float = 0.98,
                       keep_graphs: bool = False, progress: bool = True, **graph_options: Any) -> AttributionGraphs:
    """The pruned attribution graph of every prompt and the features that recur across them (see the module
    docstring). ``transcoders``: a :class:`~steerkit.vectors.Transcoders` or what :func:`steerkit.load_transcoders`
    reads. ``executor``: ``None`` (here, on ``sm``), a :class:`~steerkit.executors.LocalExecutor`, or a
    :class:`~steerkit.executors.RayExecutor` whose workers load a :class:`CircuitSpec` (the same model as ``sm``:
    its fingerprint is checked; the graphs use the transcoders the spec names, and ``transcoders`` is not read). ``graph_options`` go to :func:`~steerkit.probes.attribution_graph`
    (``max_feature_nodes``, ``batch_size``, ``max_n_logits``, ``offload`` ...); the thresholds to
    :func:`~steerkit.probes.prune_graph`; ``keep_graphs=True`` keeps each full :class:`Graph` too. ``progress``: a
    bar over the prompts.

    Examples:
        >>> from steerkit.probes import attribution_graphs
        >>> from steerkit.vectors import Transcoders
        >>> g = torch.Generator().manual_seed(0)
        >>> L, d, n = tiny.n_layers, tiny.d_model, 64
        >>> tc = Transcoders([torch.randn(n, d, generator=g) for _ in range(L)], [torch.full((n,), -2.0)] * L,
        ...                  [torch.randn(n, d, generator=g) / 8 for _ in range(L)], [torch.zeros(d)] * L)
        >>> res = attribution_graphs(tiny, tc, ["The cat sat", "The dog ran"], max_feature_nodes=32, progress=False)
        >>> len(res.graphs), res.graphs[1].prompt.endswith("The dog ran"), res.graphs[0].kinds[-1]
        (2, True, 'logit')
    """
    items = _prompts(prompts)
    for name, v in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
            raise InputError(f"expected {name} between 0.0 and 1.0, found {v!r}")
    if "prompt" in graph_options or "progress" in graph_options:
        raise InputError("expected graph options for attribution_graph (max_feature_nodes=, batch_size= ...), found "
                         "prompt= or progress=; pass the prompts as the third argument")
    here = executor is None or bool(getattr(executor, "in_process", False))
    tc = None
    if here and not isinstance(getattr(executor, "sm", None), CircuitWorker):  # a worker state holds its own
        tc = transcoders if isinstance(transcoders, Transcoders) else _load(transcoders, None, sm)
    elif not here and not isinstance(getattr(executor, "spec", None), CircuitSpec):
        raise InputError(f"expected a Ray executor whose workers load the transcoders, RayExecutor(CircuitSpec("
                         f"ModelSpec(...), 'folder or name@N')), found one with {type(getattr(executor, 'spec', None)).__name__}; "
                         "make it with a steerkit.probes.CircuitSpec")
    task = functools.partial(_graph_task, transcoders=tc, node_threshold=node_threshold,
                             edge_threshold=edge_threshold, keep_graphs=keep_graphs, options=graph_options)
    results: dict[int, PrunedGraph] = {}
    with tqdm(total=len(items), desc="attribution graphs", unit="prompt", disable=not progress, leave=False) as bar:
        if executor is None:
            pairs: Any = ((i, task(sm, p)) for i, p in enumerate(items))
        else:
            pairs = executor.imap_unordered(task, items)
        for i, res in pairs:
            printed = getattr(executor, "fingerprint", None)  # a Ray executor's, known once its workers started
            if not results and isinstance(printed, str) and printed != sm.fingerprint():
                raise InputError(f"expected the workers to load the model loaded here (fingerprint "
                                 f"{sm.fingerprint()}), found {printed}; give the CircuitSpec the same model")
            results[i] = res
            bar.update(1)
    graphs = [results[i] for i in range(len(items))]
    return AttributionGraphs(graphs, recurring_features(graphs), float(node_threshold), float(edge_threshold),
                             dict(graph_options))
