"""The Circuits page's computations over stored transcoders: :func:`circuit_run` -> :class:`CircuitRun`, the
attribution graph of one prompt (:func:`steerkit.probes.attribution_graph`, with progress and cancel between its
batches of rows) pruned by :func:`steerkit.probes.prune_graph`, and the nodes and edges a figure draws
(:class:`CircuitNode`: the most influential kept nodes and the strongest kept edges, within the page's bounds);
:func:`node_report`, a feature node's report as the Features page reads a latent (:func:`feature_run`, through
:func:`steerkit.probes.feature_report`) of its block's transcoder seen as an SAE
(:meth:`steerkit.vectors.Transcoders.layer_sae`: its encoder at the site it reads); :func:`graph_contexts` ->
:class:`GraphContexts`, every drawn feature node read that way at once (:func:`steerkit.probes.feature_contexts`:
one model pass per batch of texts for every block), what the figure's hover shows; :func:`pinned_nodes`, the checks
of a list of pinned nodes; :func:`supernode_effect` (a supernode clamped on the graph's own prompt:
:func:`steerkit.probes.intervene_graph`, the top next tokens before and after and each logit target's change) and
:func:`supernode_artifact` (the supernode as the stored :class:`steerkit.vectors.LatentClamp` of
:func:`steerkit.probes.supernode_clamp`, which the Save button keeps). Both clamp through the artifact's own
``to_interventions`` (``sm.steer(clamp)``), as every stored artifact steers.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from steerkit.errors import InputError
from steerkit.probes import (
    Graph, GraphIntervention, PruneResult, attribution_graph, feature_contexts, intervene_graph, prune_graph,
    supernode_clamp,
)
from steerkit.probes.attribution import prompt_ids
from steerkit.probes.sae_features import LatentContexts
from steerkit.vectors import LatentClamp, Transcoders

from ..data import (
    MAX_CIRCUIT_DRAWN_NODES, MAX_CIRCUIT_EDGES, MAX_CIRCUIT_FEATURE_NODES, MAX_CIRCUIT_LOGITS, MAX_CIRCUIT_PINNED,
    MAX_CIRCUIT_PROMPT_CHARS, MAX_CIRCUIT_SCALE, MAX_CIRCUIT_TOKENS, MAX_CIRCUIT_VALUE, MAX_FEATURE_CONTEXTS,
    check_choice, check_int, check_number, check_text,
)
from .common import read_chunks, tick
from .features import FeatureRun, feature_run, merge_contexts, report_texts, text_chunks

if TYPE_CHECKING:
    from steerkit.model import SteerModel

#: the node kinds of a graph, in its node order
NODE_KINDS = ("feature", "error", "token", "logit")
#: how a supernode's features are clamped: to ``scale`` times their activation, or to a value
CLAMP_MODES = ("scale", "value")
#: where a saved supernode clamp acts: wherever its features fire (any prompt), or at its nodes' own positions
CLAMP_POSITIONS = ("all", "graph")
#: next tokens listed before and after an intervention
TOP_NEXT_TOKENS = 10


@dataclass(frozen=True)
class CircuitNode:
    """One node of a graph as the page draws it: ``node`` (its index in the graph's node order), ``kind``
    (``NODE_KINDS``), ``layer`` (a feature's or an error's block; -1 for a token, ``n_layers`` for a logit),
    ``position``, ``feature`` (a feature's index in its block, else ``None``), ``activation`` (a feature's),
    ``influence`` (its cumulative influence score: the smaller, the more influential), ``label``; a logit's
    ``probability``.

    Examples:
        >>> from steerkit.apps.analysis import CircuitNode
        >>> CircuitNode(0, "feature", 2, 1, 7, 1.5, 0.1, "L2 #7").kind
        'feature'
    """

    node: int
    kind: str
    layer: int
    position: int
    feature: Optional[int]
    activation: float
    influence: float
    label: str
    probability: Optional[float] = None


@dataclass
class CircuitRun:
    """The Circuits page's result: ``graph`` (:class:`steerkit.probes.Graph` of ``prompt`` through the transcoders
    ``transcoders``, a store reference), ``pruned`` (:func:`steerkit.probes.prune_graph` at ``node_threshold``,
    ``edge_threshold``), the nodes and edges to draw (``nodes``: the kept tokens and logits and the most
    influential kept features and errors, at most ``MAX_CIRCUIT_DRAWN_NODES``; ``edges``: ``(source, target,
    weight)`` by node index, the strongest kept edges among them, at most ``MAX_CIRCUIT_EDGES``) and how many
    nodes and edges were kept in all (``n_kept``, ``n_kept_edges``).

    Examples:
        >>> from steerkit.vectors import LatentClamp, Transcoders
        >>> from steerkit.apps.analysis import circuit_run
        >>> g = torch.Generator().manual_seed(0)
        >>> L, d, n = tiny.n_layers, tiny.d_model, 32
        >>> tc = Transcoders([torch.randn(n, d, generator=g) for _ in range(L)], [torch.full((n,), -2.0)] * L,
        ...                  [torch.randn(n, d, generator=g) / 8 for _ in range(L)], [torch.zeros(d)] * L)
        >>> run = circuit_run(tiny, tc, "The cat sat", max_feature_nodes=16)
        >>> run.graph.n_features <= 16, {n.kind for n in run.nodes} >= {"token", "logit"}
        (True, True)
    """

    graph: Graph
    pruned: PruneResult
    prompt: str
    nodes: list[CircuitNode]
    edges: list[tuple[int, int, float]]
    n_kept: int
    n_kept_edges: int
    transcoders: str = ""
    model_name: str = ""
    node_threshold: float = 0.8
    edge_threshold: float = 0.98
    seconds: float = 0.0
    by_node: dict[int, CircuitNode] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.by_node = {n.node: n for n in self.nodes}

    @property
    def tokens(self) -> list[str]:
        """The prompt's tokens as the graph's positions read them (the special token in front included)."""
        return list(self.graph.prompt_tokens or [str(int(t)) for t in self.graph.input_tokens])

    def node(self, index: Any) -> CircuitNode:
        """The drawn node ``index`` (a node index of the graph), checked."""
        if isinstance(index, bool) or not isinstance(index, int) or index not in self.by_node:
            raise InputError(f"expected a node of the graph drawn (an index from 0 to "
                             f"{self.graph.adjacency_matrix.shape[0] - 1} that the figure shows), found "
                             f"{str(index)[:40]!r}; click a node of the figure")
        return self.by_node[index]


def _threshold(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise InputError(f"expected {what} from 0 to 1, found {str(value)[:40]!r}")
    return float(value)


def describe_node(graph: Graph, index: int, influence: float) -> CircuitNode:
    """What node ``index`` of ``graph`` is (:class:`CircuitNode`), with its ``influence`` score.

    Examples:
        >>> from steerkit.probes import Graph, LogitTarget
        >>> from steerkit.apps.analysis import describe_node
        >>> g = Graph(torch.tensor([2, 40]), torch.tensor([[0, 1, 7]]), torch.tensor([1.5]), torch.tensor([0]),
        ...           [LogitTarget("!", 5)], torch.tensor([0.9]), torch.zeros(6, 6), n_layers=1, vocab_size=100,
        ...           prompt_tokens=["<s>", "a"])
        >>> [describe_node(g, i, 0.0).label for i in range(6)]
        ["L0 #7 'a'", "error L0 '<s>'", "error L0 'a'", "'<s>'", "'a'", "'!' 90.0%"]
    """
    nf, ne, P = graph.n_features, graph.n_errors, graph.n_pos
    toks = graph.prompt_tokens or [str(int(t)) for t in graph.input_tokens]
    if index < nf:
        a = int(graph.selected_features[index])
        layer, pos, feat = (int(v) for v in graph.active_features[a].tolist())
        return CircuitNode(index, "feature", layer, pos, feat, float(graph.activation_values[a]), influence,
                           f"L{layer} #{feat} {toks[pos]!r}")
    if index < nf + ne:
        layer, pos = divmod(index - nf, P)
        return CircuitNode(index, "error", layer, pos, None, 0.0, influence, f"error L{layer} {toks[pos]!r}")
    if index < nf + ne + P:
        pos = index - nf - ne
        return CircuitNode(index, "token", -1, pos, None, 0.0, influence, repr(toks[pos]))
    k = index - nf - ne - P
    p = float(graph.logit_probabilities[k])
    return CircuitNode(index, "logit", graph.n_layers, P - 1, None, 0.0, influence,
                       f"{graph.logit_targets[k].token_str!r} {p:.1%}", probability=p)


def drawn(graph: Graph, pruned: PruneResult, max_nodes: int = MAX_CIRCUIT_DRAWN_NODES,
          max_edges: int = MAX_CIRCUIT_EDGES) -> tuple[list[CircuitNode], list[tuple[int, int, float]], int, int]:
    """The nodes and edges of a pruned graph that a figure draws: every kept token and logit node, then the kept
    features and errors by influence up to ``max_nodes`` in all; the kept edges among them, strongest (by
    ``|weight|``) first, at most ``max_edges``. Returns ``(nodes, edges, nodes kept, edges kept)``.

    Examples:
        >>> from steerkit.probes import Graph, LogitTarget, prune_graph
        >>> from steerkit.apps.analysis import drawn
        >>> adj = torch.zeros(6, 6)
        >>> adj[0, 3], adj[5, 0], adj[5, 4] = 1.0, 2.0, 0.5
        >>> g = Graph(torch.tensor([2, 40]), torch.tensor([[0, 1, 7]]), torch.tensor([1.5]), torch.tensor([0]),
        ...           [LogitTarget("!", 5)], torch.tensor([0.9]), adj, n_layers=1, vocab_size=100)
        >>> nodes, edges, n_kept, n_edges = drawn(g, prune_graph(g))
        >>> [n.node for n in nodes], edges, n_kept, n_edges
        ([0, 3, 4, 5], [(0, 5, 2.0), (3, 0, 1.0), (4, 5, 0.5)], 4, 3)
    """
    kept = torch.where(pruned.node_mask)[0]
    scores = pruned.cumulative_scores
    fixed_from = graph.n_features + graph.n_errors
    fixed, inner = kept[kept >= fixed_from], kept[kept < fixed_from]
    inner = inner[torch.argsort(scores[inner], stable=True)][: max(0, max_nodes - len(fixed))]
    chosen = torch.sort(torch.cat([inner, fixed])).values
    nodes = [describe_node(graph, int(i), float(scores[i])) for i in chosen.tolist()]
    sub = pruned.edge_mask[chosen][:, chosen]
    t, s = torch.where(sub)
    w = graph.adjacency_matrix[chosen][:, chosen][t, s]
    order = torch.argsort(w.abs(), descending=True, stable=True)[:max_edges]
    edges = [(int(chosen[s[i]]), int(chosen[t[i]]), float(w[i])) for i in order.tolist()]
    return nodes, edges, len(kept), int(pruned.edge_mask.sum())


def circuit_run(sm: SteerModel, transcoders: Transcoders, prompt, *, max_feature_nodes=256, max_n_logits=5,
                node_threshold=0.8, edge_threshold=0.98, batch_size: int = 64, progress=None, should_stop=None,
                ref: str = "") -> CircuitRun:
    """The attribution graph of ``prompt`` through ``transcoders`` on ``sm``, pruned, as the page draws it: the
    page's bounds first (a prompt of at most ``MAX_CIRCUIT_PROMPT_CHARS`` characters and ``MAX_CIRCUIT_TOKENS``
    tokens with the special token in front, 1 to ``MAX_CIRCUIT_FEATURE_NODES`` feature nodes, 1 to
    ``MAX_CIRCUIT_LOGITS`` logit targets, thresholds from 0 to 1), then :func:`steerkit.probes.attribution_graph`
    (``progress(done, total)`` after each batch of ``batch_size`` rows, ``should_stop()`` cancels there) and
    :func:`steerkit.probes.prune_graph`. ``ref``: the transcoders' store reference, kept with the result.

    Examples:
        >>> from steerkit.vectors import LatentClamp, Transcoders
        >>> from steerkit.apps.analysis import circuit_run
        >>> g = torch.Generator().manual_seed(0)
        >>> L, d, n = tiny.n_layers, tiny.d_model, 32
        >>> tc = Transcoders([torch.randn(n, d, generator=g) for _ in range(L)], [torch.full((n,), -2.0)] * L,
        ...                  [torch.randn(n, d, generator=g) / 8 for _ in range(L)], [torch.zeros(d)] * L)
        >>> circuit_run(tiny, tc, "The cat sat", max_feature_nodes=4096)
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected a number of feature nodes from 1 to 2048, found '4096'
    """
    t0 = time.perf_counter()
    prompt = check_text(prompt, "the prompt", MAX_CIRCUIT_PROMPT_CHARS)
    if not prompt.strip():
        raise InputError("expected a prompt to trace, found nothing; type one")
    max_feature_nodes = check_int(max_feature_nodes, "a number of feature nodes", 1, MAX_CIRCUIT_FEATURE_NODES)
    max_n_logits = check_int(max_n_logits, "a number of logit targets", 1, MAX_CIRCUIT_LOGITS)
    node_threshold = _threshold(node_threshold, "a node threshold")
    edge_threshold = _threshold(edge_threshold, "an edge threshold")
    ids = prompt_ids(sm.tokenizer, prompt)
    if len(ids) > MAX_CIRCUIT_TOKENS:
        raise InputError(f"expected a prompt of at most {MAX_CIRCUIT_TOKENS} tokens (the special token in front "
                         f"included), found {len(ids)}; shorten it")
    tick(progress, should_stop, 0, max_feature_nodes)
    graph = attribution_graph(sm, transcoders, ids, max_feature_nodes=max_feature_nodes, max_n_logits=max_n_logits,
                              batch_size=batch_size, progress=lambda done, total: tick(progress, should_stop, done,
                                                                                       total))
    pruned = prune_graph(graph, node_threshold, edge_threshold)
    nodes, edges, n_kept, n_edges = drawn(graph, pruned)
    return CircuitRun(graph, pruned, prompt=prompt, nodes=nodes, edges=edges, n_kept=n_kept, n_kept_edges=n_edges,
                      transcoders=ref, model_name=sm.name, node_threshold=node_threshold,
                      edge_threshold=edge_threshold, seconds=time.perf_counter() - t0)


def pinned_nodes(run: CircuitRun, nodes: Any) -> list[int]:
    """``nodes`` (what a page's state holds) checked against ``run``: a list of at most ``MAX_CIRCUIT_PINNED``
    distinct feature nodes the figure draws (only features can be grouped and clamped), in the order given.

    Examples:
        >>> from steerkit.vectors import LatentClamp, Transcoders
        >>> from steerkit.apps.analysis import circuit_run, pinned_nodes
        >>> g = torch.Generator().manual_seed(0)
        >>> L, d, n = tiny.n_layers, tiny.d_model, 32
        >>> tc = Transcoders([torch.randn(n, d, generator=g) for _ in range(L)], [torch.full((n,), -2.0)] * L,
        ...                  [torch.randn(n, d, generator=g) / 8 for _ in range(L)], [torch.zeros(d)] * L)
        >>> run = circuit_run(tiny, tc, "The cat sat", max_feature_nodes=16)
        >>> feature = next(n for n in run.nodes if n.kind == "feature")
        >>> pinned_nodes(run, [feature.node, feature.node]) == [feature.node]
        True
        >>> pinned_nodes(run, [run.nodes[-1].node])
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected feature nodes (what a supernode clamps), found logit node ...
    """
    if not isinstance(nodes, (list, tuple)):
        raise InputError(f"expected the pinned nodes as a list, found {type(nodes).__name__}")
    if len(nodes) > MAX_CIRCUIT_PINNED:
        raise InputError(f"expected at most {MAX_CIRCUIT_PINNED} pinned nodes, found {len(nodes)}; unpin some")
    out: list[int] = []
    for v in nodes:
        node = run.node(v)
        if node.kind != "feature":
            raise InputError(f"expected feature nodes (what a supernode clamps), found {node.kind} node {node.label}")
        if node.node not in out:
            out.append(node.node)
    return out


def node_report(sm: SteerModel, transcoders: Transcoders, run: CircuitRun, node, texts: Sequence[str], *, top=10,
                progress=None, should_stop=None, deadline: Optional[float] = None) -> FeatureRun:
    """The report of feature node ``node`` of ``run`` over ``texts``: :func:`feature_run` (the Features page's
    report, :func:`steerkit.probes.feature_report` one batch of texts per call) of its feature through its block's
    transcoder as an SAE (:meth:`steerkit.vectors.Transcoders.layer_sae`), at the site the block reads (a
    cross-layer transcoder is refused there).

    Examples:
        >>> from steerkit.vectors import LatentClamp, Transcoders
        >>> from steerkit.apps.analysis import circuit_run, node_report
        >>> g = torch.Generator().manual_seed(0)
        >>> L, d, n = tiny.n_layers, tiny.d_model, 32
        >>> tc = Transcoders([torch.randn(n, d, generator=g) for _ in range(L)], [torch.full((n,), -2.0)] * L,
        ...                  [torch.randn(n, d, generator=g) / 8 for _ in range(L)], [torch.zeros(d)] * L)
        >>> run = circuit_run(tiny, tc, "The cat sat", max_feature_nodes=16)
        >>> feature = next(n for n in run.nodes if n.kind == "feature")
        >>> rep = node_report(tiny, tc, run, feature.node, ["the cat sat", "a dog ran"], top=2).report
        >>> rep.latent == feature.feature, rep.site == f"blocks.{feature.layer}.mlp.hook_in"
        (True, True)
    """
    n = run.node(node)
    if n.kind != "feature":
        raise InputError(f"expected a feature node to read over the texts, found {n.kind} node {n.label}; click a "
                         "feature (a circle)")
    assert n.feature is not None
    return feature_run(sm, transcoders.layer_sae(n.layer), n.feature, texts, top=top, progress=progress,
                       should_stop=should_stop, deadline=deadline, ref=f"{run.transcoders} block {n.layer}")


@dataclass
class GraphContexts:
    """Every drawn feature node of a graph read over a set of texts (:func:`graph_contexts`): ``nodes`` maps each
    drawn feature node (its index) to its feature's reading, a :class:`steerkit.probes.sae_features.LatentContexts`
    (its ``top`` strongest contexts, best first, and its density; the nodes of one feature share one reading);
    ``texts`` the texts read, of ``n_texts`` asked for (fewer when the time limit stopped it:
    ``stopped_at_deadline``); ``transcoders`` the graph's store reference.

    Examples:
        >>> from steerkit.vectors import Transcoders
        >>> from steerkit.apps.analysis import circuit_run, graph_contexts
        >>> g = torch.Generator().manual_seed(0)
        >>> L, d, n = tiny.n_layers, tiny.d_model, 32
        >>> tc = Transcoders([torch.randn(n, d, generator=g) for _ in range(L)], [torch.full((n,), -2.0)] * L,
        ...                  [torch.randn(n, d, generator=g) / 8 for _ in range(L)], [torch.zeros(d)] * L)
        >>> run = circuit_run(tiny, tc, "The cat sat", max_feature_nodes=16)
        >>> read = graph_contexts(tiny, tc, run, ["the cat sat", "a dog ran"])
        >>> sorted(read.nodes) == [n.node for n in run.nodes if n.kind == "feature"], read.n_read, read.fits(run)
        (True, 2, True)
    """

    nodes: dict[int, LatentContexts]
    texts: list[str]
    n_texts: int
    top: int = 3
    transcoders: str = ""
    model_name: str = ""
    seconds: float = 0.0
    stopped_at_deadline: bool = False

    @property
    def n_read(self) -> int:
        """How many texts were read."""
        return len(self.texts)

    @property
    def n_features(self) -> int:
        """How many distinct features were read (the nodes of one feature at several positions share one)."""
        return len({(r.site, r.latent) for r in self.nodes.values()})

    def fits(self, run: CircuitRun) -> bool:
        """Whether this reading is of ``run``'s drawn feature nodes (each a feature node of ``run`` read as its feature
        at its block), as a page checks a result key it is sent."""
        for i, r in self.nodes.items():
            n = run.by_node.get(i)
            if n is None or n.kind != "feature" or r.latent != n.feature \
                    or not r.site.startswith(f"blocks.{n.layer}."):
                return False
        return True


def graph_contexts(sm: SteerModel, transcoders: Transcoders, run: CircuitRun, texts: Sequence[str], *, top=3,
                   batch_size: int = 16, progress=None, should_stop=None,
                   deadline: Optional[float] = None) -> GraphContexts:
    """Every drawn feature node of ``run`` read over ``texts`` at once, each as :func:`node_report` reads one: its
    block's transcoder as an SAE (:meth:`steerkit.vectors.Transcoders.layer_sae`, at the site the block reads; a
    cross-layer transcoder is refused there), its ``top`` strongest contexts (1 to ``MAX_FEATURE_CONTEXTS``) and its
    density, through :func:`steerkit.probes.feature_contexts` (one model pass per batch records every block's site
    and encodes only the drawn features) on ``batch_size`` texts per call, so that ``progress(done, total)``
    advances and ``should_stop()`` cancels between calls, merged by :func:`merge_contexts`; past ``deadline``
    seconds it stops with the texts it has read (``stopped_at_deadline``). The texts are bounded as the Features
    page's (:func:`report_texts`).

    Examples:
        >>> from steerkit.vectors import Transcoders
        >>> from steerkit.apps.analysis import circuit_run, graph_contexts, node_report
        >>> g = torch.Generator().manual_seed(0)
        >>> L, d, n = tiny.n_layers, tiny.d_model, 32
        >>> tc = Transcoders([torch.randn(n, d, generator=g) for _ in range(L)], [torch.full((n,), -2.0)] * L,
        ...                  [torch.randn(n, d, generator=g) / 8 for _ in range(L)], [torch.zeros(d)] * L)
        >>> run = circuit_run(tiny, tc, "The cat sat", max_feature_nodes=16)
        >>> texts = ["the cat sat", "a dog ran", "hello"]
        >>> ticks = []
        >>> read = graph_contexts(tiny, tc, run, texts, progress=lambda done, total: ticks.append(done))
        >>> node = next(n for n in run.nodes if n.kind == "feature")
        >>> read.nodes[node.node].contexts == node_report(tiny, tc, run, node.node, texts, top=3).report.contexts, ticks
        (True, [0, 1])
        >>> graph_contexts(tiny, tc, run, texts, top=0)
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected a number of contexts from 1 to 50, found '0'
    """
    t0 = time.perf_counter()
    top = check_int(top, "a number of contexts", 1, MAX_FEATURE_CONTEXTS)
    texts = report_texts(texts)
    chunks = text_chunks(texts, batch_size)
    features = [n for n in run.nodes if n.kind == "feature"]
    if not features:
        raise InputError("expected feature nodes in the graph drawn to read over the texts, found none; compute a "
                         "graph with more feature nodes or lower thresholds")
    by_layer: dict[int, list[int]] = {}
    for n in features:
        assert n.feature is not None
        by_layer.setdefault(n.layer, []).append(n.feature)
    reads: dict[str, tuple[Any, list[int]]] = {}
    site_of: dict[int, str] = {}
    for layer, feats in sorted(by_layer.items()):
        sae = transcoders.layer_sae(layer)  # a cross-layer transcoder is refused here, as node_report refuses it
        reads[sae.site], site_of[layer] = (sae, sorted(set(feats))), sae.site
    parts, stopped = read_chunks(chunks, lambda chunk: feature_contexts(sm, reads, chunk, top=top,
                                                                        batch_size=len(chunk), progress=False),
                                 progress=progress, should_stop=should_stop, deadline=deadline)
    sizes = [len(c) for c in chunks[:len(parts)]]
    merged = {key: LatentContexts(key[0], key[1], merge_contexts([p[key].contexts for p in parts], sizes, top),
                                  sum(p[key].n_active for p in parts), sum(p[key].n_tokens for p in parts))
              for key in parts[0]}
    nodes = {n.node: merged[(site_of[n.layer], n.feature)] for n in features if n.feature is not None}
    return GraphContexts(nodes, texts=texts[:sum(sizes)], n_texts=len(texts), top=top, transcoders=run.transcoders,
                         model_name=sm.name, seconds=time.perf_counter() - t0, stopped_at_deadline=stopped)


def _clamp_args(run: CircuitRun, nodes: Any, mode: Any, amount: Any) -> tuple[list[int], dict]:
    """The supernode's nodes (:func:`pinned_nodes`, at least one) and the clamp's ``scale=`` / ``value=`` keyword."""
    nodes = pinned_nodes(run, nodes)
    if not nodes:
        raise InputError("expected a supernode of at least one feature node, found none; pin features and group them")
    mode = check_choice(mode, "a clamp", CLAMP_MODES)
    bound = MAX_CIRCUIT_SCALE if mode == "scale" else MAX_CIRCUIT_VALUE
    return nodes, {mode: check_number(amount, f"a {mode}", bound)}


def supernode_effect(sm: SteerModel, transcoders: Transcoders, run: CircuitRun, nodes: Any, *, mode: Any = "scale",
                     amount: Any = 0.0) -> GraphIntervention:
    """The graph's own prompt run with the features of ``nodes`` (feature nodes of ``run``, :func:`pinned_nodes`)
    clamped at their nodes' positions: :func:`steerkit.probes.intervene_graph`, ``mode`` ``"scale"`` (``amount`` times
    their activation, at most ``MAX_CIRCUIT_SCALE`` in size; 0 turns them off) or ``"value"`` (at most
    ``MAX_CIRCUIT_VALUE``): the top ``TOP_NEXT_TOKENS`` next tokens before and after and each logit target's change.

    Examples:
        >>> from steerkit.vectors import Provenance, Transcoders
        >>> from steerkit.apps.analysis import circuit_run, supernode_effect
        >>> g = torch.Generator().manual_seed(0)
        >>> L, d, n = tiny.n_layers, tiny.d_model, 32
        >>> tc = Transcoders([torch.randn(n, d, generator=g) for _ in range(L)], [torch.full((n,), -2.0)] * L,
        ...                  [torch.randn(n, d, generator=g) / 8 for _ in range(L)], [torch.zeros(d)] * L,
        ...                  provenance=Provenance.from_model(tiny))
        >>> run = circuit_run(tiny, tc, "The cat sat", max_feature_nodes=16)
        >>> features = [n.node for n in run.nodes if n.kind == "feature"][:2]
        >>> effect = supernode_effect(tiny, tc, run, features, mode="scale", amount=0.0)
        >>> len(effect.target_changes()) == run.graph.n_logits, effect.how, effect.amount
        (True, 'scale', 0.0)
        >>> supernode_effect(tiny, tc, run, features, mode="scale", amount=1000)
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected a scale as a finite number from -100 to 100, found '1000'
    """
    nodes, how = _clamp_args(run, nodes, mode, amount)
    return intervene_graph(sm, run.graph, transcoders, nodes, top_k=TOP_NEXT_TOKENS, **how)


def supernode_artifact(transcoders: Transcoders, run: CircuitRun, nodes: Any, *, mode: Any = "scale",
                       amount: Any = 0.0, positions: Any = "all") -> LatentClamp:
    """The features of ``nodes`` (feature nodes of ``run``) clamped as :func:`supernode_effect` clamps them, as the
    stored artifact :func:`steerkit.probes.supernode_clamp` makes (its provenance: the prompt, the graph's and the
    transcoders' fingerprints, the nodes), acting at ``positions``: ``"all"`` (wherever the features fire, on any
    prompt) or ``"graph"`` (each feature at its nodes' positions, prompt-token indices).

    Examples:
        >>> from steerkit.vectors import Provenance, Transcoders
        >>> from steerkit.apps.analysis import circuit_run, supernode_artifact
        >>> g = torch.Generator().manual_seed(0)
        >>> L, d, n = tiny.n_layers, tiny.d_model, 32
        >>> tc = Transcoders([torch.randn(n, d, generator=g) for _ in range(L)], [torch.full((n,), -2.0)] * L,
        ...                  [torch.randn(n, d, generator=g) / 8 for _ in range(L)], [torch.zeros(d)] * L,
        ...                  provenance=Provenance.from_model(tiny))
        >>> run = circuit_run(tiny, tc, "The cat sat", max_feature_nodes=16)
        >>> features = [n.node for n in run.nodes if n.kind == "feature"][:2]
        >>> clamp = supernode_artifact(tc, run, features, positions="all")
        >>> clamp.kind, clamp.provenance.method_params["nodes"] == features
        ('latent_clamp', True)
    """
    nodes, how = _clamp_args(run, nodes, mode, amount)
    positions = check_choice(positions, "where the clamp acts", CLAMP_POSITIONS)
    return supernode_clamp(run.graph, transcoders, nodes, positions=positions, **how)
