"""From an attribution graph to a steering: :func:`supernode_clamp` and :func:`intervene_graph`.

How it works
------------
A graph's feature nodes (:class:`~steerkit.probes.Graph`, circuit-tracer's node order: selected features, error
nodes, token nodes, logit nodes) are transcoder features at a block and a position of the graph's prompt. A
*supernode* is a set of them. :func:`supernode_clamp` turns one into a stored :class:`steerkit.vectors.LatentClamp`
over the blocks its features live in: per block the transcoder restricted to those features (a TopK set: the
block's whole transcoder), clamped to ``value`` or to ``scale`` times their own activation (default ``scale=0``, an
ablation), with the error term kept: each part is a two-site edit that encodes at ``blocks.{l}.mlp.hook_in`` and
adds ``(f' - f) @ W_dec`` at ``blocks.{l}.hook_mlp_out`` (:meth:`steerkit.vectors.Transcoders.clamp`), so the MLP's
real output stays and nothing is frozen. At ``positions="all"`` (the default) the features are clamped wherever
they fire on any prompt; ``positions="graph"`` clamps each feature only at the positions of its nodes (token
indices of the graph's prompt, the special token in front counted). The clamp's provenance records the graph's
prompt (text and token ids), the graph's fingerprint (:meth:`~steerkit.probes.Graph.fingerprint`), the nodes and
their features, and the transcoders' fingerprint (:meth:`steerkit.vectors.Transcoders.fingerprint`); ``sm.steer``
applies it, the store keeps it and a server request names it like any artifact.

:func:`intervene_graph` runs the graph's own prompt with such a clamp at the nodes' own positions and reports the
next-token distribution before and after (the top ``top_k``) and each logit target's change
(:class:`GraphIntervention`, with ``to_dict()``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence, Union

import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.errors import InputError
from steerkit.model import SteerModel, Tokens
from steerkit.vectors import LatentClamp, Provenance, Transcoders, prompts_hash

from .graph import Graph, LogitTarget

#: the most nodes one supernode may hold
MAX_SUPERNODE = 4096


def _feature_nodes(graph: Graph, nodes: Any) -> list[tuple[int, int, int, int]]:
    """``[(node, block, position, feature)]`` of ``nodes`` (distinct, in order), every bad index named in one error."""
    if isinstance(nodes, (int, Tensor)) and not isinstance(nodes, bool) and torch.as_tensor(nodes).dim() == 0:
        nodes = [int(nodes)]
    try:
        idx = [int(i) for i in nodes] if not isinstance(nodes, (str, bytes)) else None
    except (TypeError, ValueError):
        idx = None
    if idx is None or any(isinstance(i, bool) for i in nodes):
        raise InputError(f"expected node indices (ints in the graph's node order), found {nodes!r:.80}")
    if not idx or len(idx) > MAX_SUPERNODE:
        raise InputError(f"expected 1..{MAX_SUPERNODE} node indices, found {len(idx)}")
    n = int(graph.adjacency_matrix.shape[0])
    bad = []
    for i in dict.fromkeys(idx):
        if not 0 <= i < n:
            bad.append(f"{i} (out of range: the graph has {n} nodes)")
        elif (kind := graph.node_kind(i)) != "feature":
            bad.append(f"{i} ({'an' if kind[0] in 'aeiou' else 'a'} {kind} node)")
    if bad:
        raise InputError(f"expected feature nodes (indices 0..{graph.n_features - 1} of {n} nodes: features, then "
                         f"errors, tokens and logits), found {', '.join(bad[:10])}{' ...' if len(bad) > 10 else ''}")
    return [(i, *graph.feature_node(i)) for i in dict.fromkeys(idx)]


def supernode_clamp(graph: Graph, transcoders: Transcoders, nodes: Union[int, Sequence[int], Tensor], *,
                    scale: Optional[float] = None, value: Any = None,
                    positions: Union[str, Sequence[int]] = "all") -> LatentClamp:
    """The features of ``nodes`` (indices in ``graph``'s node order; feature nodes only) as one stored
    :class:`steerkit.vectors.LatentClamp` over their blocks (see the module docstring): each clamped to ``value`` (a
    number, or one per node) or ``scale`` times its own activation (exactly one; neither: ``scale=0``, ablated).
    ``positions``: ``"all"`` (wherever the features fire, on any prompt), ``"graph"`` (each feature only at its
    nodes' positions on the graph's prompt), or any plain position spec (``"last"``, token indices) for every part.
    ``transcoders``: the set the graph was computed with (checked by its shape; its fingerprint is recorded).

    Examples:
        >>> from steerkit.probes import attribution_graph, supernode_clamp
        >>> from steerkit.vectors import Provenance, Transcoders
        >>> g = torch.Generator().manual_seed(0)
        >>> L, d, n = tiny.n_layers, tiny.d_model, 64
        >>> tc = Transcoders([torch.randn(n, d, generator=g) for _ in range(L)], [torch.full((n,), -2.0)] * L,
        ...                  [torch.randn(n, d, generator=g) / 8 for _ in range(L)], [torch.zeros(d)] * L,
        ...                  provenance=Provenance.from_model(tiny))
        >>> graph = attribution_graph(tiny, tc, "The cat sat", progress=False)
        >>> graph.feature_node(0)  # block, position, feature of node 0
        (0, 1, 1)
        >>> clamp = supernode_clamp(graph, tc, [0], positions="graph")  # ablate it where it is
        >>> [(p.sae.output_site, p.latents, p.positions) for p in clamp.parts]
        [('blocks.0.hook_mlp_out', (1,), [1])]
        >>> clamp.scale, clamp.provenance.method_params["graph"] == graph.fingerprint()
        (0.0, True)
        >>> with tiny.steer(clamp):
        ...     _ = tiny.forward("The cat sat", chat=False)
    """
    if not isinstance(graph, Graph):
        raise InputError(f"expected a steerkit.probes.Graph (attribution_graph(...)), found {type(graph).__name__}")
    if not isinstance(transcoders, Transcoders):
        raise InputError(f"expected the graph's steerkit.vectors.Transcoders, found {type(transcoders).__name__}")
    if transcoders.n_layers != graph.n_layers:
        raise InputError(f"expected the transcoders the graph was computed with ({graph.n_layers} blocks), found a set "
                         f"of {transcoders.n_layers}")
    found = _feature_nodes(graph, nodes)
    if scale is None and value is None:
        scale = 0.0
    per_node = _per_node_values(value, len(found))
    by_graph = isinstance(positions, str) and positions == "graph"
    groups: dict = {}  # (block, positions key) -> {feature: value}
    for j, (_, layer, pos, feature) in enumerate(found):
        key = (layer, pos) if by_graph else (layer, None)
        feats = groups.setdefault(key, {})
        v = None if per_node is None else per_node[j]
        if feature in feats and feats[feature] != v:
            raise InputError(f"expected one value per feature of block {layer}, found feature {feature} with "
                             f"{feats[feature]} and {v}; give positions='graph' or one value for both")
        feats[feature] = v
    items = _parts(groups, by_graph, positions)
    values = None if per_node is None else [v for _, feats, _ in items for v in feats.values()]
    params = {"prompt": graph.input_string, "prompt_tokens": graph.input_tokens.tolist(), "graph": graph.fingerprint(),
              "nodes": [i for i, *_ in found], "features": [[l, p, f] for _, l, p, f in found],
              "transcoders": transcoders.fingerprint(), "scan": graph.scan or transcoders.scan,
              "positions": positions if isinstance(positions, str) else list(positions)}
    prov = Provenance(method="supernode_clamp", method_params=params, prompts_hash=prompts_hash([graph.input_string]))
    return LatentClamp.of_transcoders(transcoders, [(layer, list(feats), pos) for layer, feats, pos in items],
                                      value=values, scale=None if values is not None else scale,
                                      provenance=prov)


def _per_node_values(value: Any, n: int) -> Optional[list[float]]:
    if value is None:
        return None
    t = torch.as_tensor(value, dtype=torch.float32).reshape(-1)
    if t.numel() == 1:
        t = t.expand(n)
    if t.numel() != n or not bool(torch.isfinite(t).all()):
        raise InputError(f"expected value= as one finite number, or one per node ({n}), found {value!r:.80}")
    return [float(v) for v in t]


def _parts(groups: dict, by_graph: bool, positions: Any) -> list[tuple[int, dict, Any]]:
    """``[(block, {feature: value}, positions)]``: per block (``"graph"``: the positions of a block whose features
    are the same merged into one part)."""
    if not by_graph:
        return [(layer, feats, positions if isinstance(positions, str) else list(positions))
                for (layer, _), feats in sorted(groups.items())]
    merged: dict = {}  # (block, features and values) -> positions
    for (layer, pos), feats in sorted(groups.items()):
        merged.setdefault((layer, tuple(feats.items())), []).append(pos)
    return [(layer, dict(feats), sorted(pos)) for (layer, feats), pos in merged.items()]


@dataclasses.dataclass
class GraphIntervention:
    """What :func:`intervene_graph` returns: the graph prompt's next-token logits before and after a clamp of some
    nodes' features (``how``: ``"scale"`` or ``"value"``, by ``amount``), the graph's logit ``targets``, the nodes'
    positions, the tokens' ``texts`` (by id) and the :class:`~steerkit.vectors.LatentClamp` applied (``clamp``).
    :meth:`top` gives the top ``top_k`` next tokens, :meth:`target_changes` each target's change.

    Examples:
        >>> from steerkit.probes import LogitTarget
        >>> r = GraphIntervention([0], "scale", 0.0, torch.tensor([2.0, 1.0]), torch.tensor([1.0, 2.0]),
        ...                       [LogitTarget("a", 0)], {0: "a", 1: "b"}, top_k=1, positions=[3])
        >>> r.top(), r.top(after=True)[0]["token"]
        ([{'token_id': 0, 'token': 'a', 'logit': 2.0, 'prob': 0.7310585975646973}], 'b')
        >>> r.target_changes()[0]["logit_change"]
        -1.0
    """

    nodes: list[int]
    how: str
    amount: Union[float, list[float]]
    logits_before: Float[Tensor, " vocab"]
    logits_after: Float[Tensor, " vocab"]
    targets: list[LogitTarget]
    texts: dict = dataclasses.field(default_factory=dict)
    top_k: int = 10
    positions: list[int] = dataclasses.field(default_factory=list)
    clamp: Optional[LatentClamp] = None

    @property
    def probs_before(self) -> Float[Tensor, " vocab"]:
        return torch.softmax(self.logits_before.float(), -1)

    @property
    def probs_after(self) -> Float[Tensor, " vocab"]:
        return torch.softmax(self.logits_after.float(), -1)

    def top(self, after: bool = False) -> list[dict]:
        """The top ``top_k`` next tokens before (or ``after``) the clamp: token id, text, logit, probability."""
        logits, probs = (self.logits_after, self.probs_after) if after else (self.logits_before, self.probs_before)
        vals, idx = probs.topk(min(self.top_k, probs.numel()))
        return [{"token_id": int(i), "token": self.texts.get(int(i), str(int(i))), "logit": float(logits[i]),
                 "prob": float(v)} for v, i in zip(vals, idx)]

    def target_changes(self) -> list[dict]:
        """Each logit target's logit and probability before and after, and the logit's change."""
        pb, pa = self.probs_before, self.probs_after
        return [{"token": t.token_str, "token_id": t.vocab_idx, "logit_before": float(self.logits_before[t.vocab_idx]),
                 "logit_after": float(self.logits_after[t.vocab_idx]),
                 "logit_change": float(self.logits_after[t.vocab_idx] - self.logits_before[t.vocab_idx]),
                 "prob_before": float(pb[t.vocab_idx]), "prob_after": float(pa[t.vocab_idx])} for t in self.targets]

    def to_dict(self) -> dict:
        """Everything as JSON-able values (the clamp left out: keep it with ``store.save``)."""
        return {"nodes": self.nodes, "positions": self.positions, "how": self.how, "amount": self.amount,
                "top_before": self.top(), "top_after": self.top(after=True), "targets": self.target_changes()}


def intervene_graph(sm: SteerModel, graph: Graph, transcoders: Transcoders, nodes: Union[int, Sequence[int], Tensor],
                    *, scale: Optional[float] = None, value: Any = None, top_k: int = 10,
                    positions: Union[str, Sequence[int]] = "graph") -> GraphIntervention:
    """Run ``graph``'s own prompt (its token ids) with the features of ``nodes`` clamped at their nodes' positions
    (:func:`supernode_clamp` with ``positions="graph"``, applied through ``sm.steer``; ``positions``: any other
    choice :func:`supernode_clamp` takes, e.g. ``"all"``, as the clamp will act when stored): ``value`` (a number,
    or one per node) or ``scale`` times their activation (default ``scale=0``, ablated). Returns the top ``top_k`` next
    tokens before and after and each logit target's change (:class:`GraphIntervention`).

    Examples:
        >>> from steerkit.probes import attribution_graph, intervene_graph
        >>> from steerkit.vectors import Provenance, Transcoders
        >>> g = torch.Generator().manual_seed(0)
        >>> L, d, n = tiny.n_layers, tiny.d_model, 64
        >>> tc = Transcoders([torch.randn(n, d, generator=g) for _ in range(L)], [torch.full((n,), -2.0)] * L,
        ...                  [torch.randn(n, d, generator=g) / 8 for _ in range(L)], [torch.zeros(d)] * L,
        ...                  provenance=Provenance.from_model(tiny))
        >>> graph = attribution_graph(tiny, tc, "The cat sat", progress=False)
        >>> r = intervene_graph(tiny, graph, tc, [0], scale=10.0, top_k=3)
        >>> len(r.top()), len(r.top(after=True)), len(r.target_changes()) == graph.n_logits
        (3, 3, True)
        >>> sorted(r.to_dict())
        ['amount', 'how', 'nodes', 'positions', 'targets', 'top_after', 'top_before']
    """
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= 1000:
        raise InputError(f"expected top_k as an integer in 1..1000, found {top_k!r:.40}")
    clamp = supernode_clamp(graph, transcoders, nodes, scale=scale, value=value, positions=positions)
    found = _feature_nodes(graph, nodes)
    ids = graph.input_tokens.reshape(1, -1).long().to(sm.device)
    tokens = Tokens(ids, torch.ones_like(ids))
    with torch.no_grad():
        before = sm.forward(tokens)[0, -1].float().cpu()
        with sm.steer(clamp):
            after = sm.forward(tokens)[0, -1].float().cpu()
    how = "value" if value is not None else "scale"
    amount: Union[float, list[float]] = (0.0 if scale is None else float(scale)) if value is None else \
        [float(v) for v in torch.as_tensor(value, dtype=torch.float32).reshape(-1)]
    if isinstance(amount, list) and len(amount) == 1:
        amount = amount[0]
    shown = set(before.topk(min(top_k, before.numel())).indices.tolist()) | \
        set(after.topk(min(top_k, after.numel())).indices.tolist())
    texts = {i: sm.tokenizer.decode([i]) for i in sorted(shown)}
    texts.update({t.vocab_idx: t.token_str for t in graph.logit_targets})
    return GraphIntervention([i for i, *_ in found], how, amount, before, after, list(graph.logit_targets), texts,
                             top_k=top_k, positions=[p for _, _, p, _ in found], clamp=clamp)
