"""Attribution graphs: :func:`attribution_graph` traces a prompt through a model's transcoders, as circuit-tracer does.

How it works
------------
The *replacement model* of a prompt is the model with every MLP replaced by its transcoder, the attention patterns
and the norms' scales frozen at their values on the prompt, and each MLP output's miss (the transcoder's *error*)
added back as a constant. Frozen so, everything between the transcoders' inputs and outputs is linear, so the
direct effect of a source node on a target node is a product of the target's gradient with the source's output:
a feature's decoder row times its activation, an error vector, a token's embedding. The graph's nodes are the
active features (every position but the first, which holds the special token in front), one error node per block
and position, one token node per position and the logit targets (the most probable next tokens up to
``desired_logit_prob`` of probability, at most ``max_n_logits``, each an unembedding row less the mean row).

steerkit computes the same numbers as circuit-tracer, differently:

1. **One recorded forward pass** (steerkit's hooks, batch 1): every block's ``ln1`` / ``ln2`` scale and attention
   pattern, the transcoders' input and output sites, the final norm's scale, the embedding as block 0 reads it.
2. **The transposed replacement model, written out.** Frozen, a block is a handful of linear maps: a norm is a
   per-position scaling (centred for LayerNorm), attention is ``W_V``, the pattern and ``W_O``. A batch of source
   nodes is pushed back through them as a ``[positions, rows, d_model]`` gradient, block by block, from the top:
   no batch-sized forward pass is recorded and replayed, so memory stays at one forward pass plus the graph.
   Rows are ordered so that only those already injected are carried (a feature of block ``l`` enters at its
   block's input), and a batch stops at its last source position (attention is causal). At each block the
   gradient is contracted with the decoder rows of the features writing there (one batched matrix product per
   block, features grouped by position) and with the error vectors; at the bottom with the token embeddings.
3. **Features visited in order of influence**, as circuit-tracer does: after the logits' rows, queues of
   ``update_interval * batch_size`` features, each queue the most influential ones not yet visited by the rows so
   far, until ``max_feature_nodes``; the influence is the same power iteration, run on the visited features'
   square block and applied to the rest once. Within a queue, batches are cut by position (that only changes which
   rows share a backward pass, not a row's values).

The result is a :class:`~steerkit.probes.Graph` with circuit-tracer's fields and node order. The model runs where it
is loaded; the graph is computed on the CPU (transcoders elsewhere are copied there). The families whose
blocks are sequential and pre-norm (Llama, Mistral, Qwen 2 and 3, SmolLM 3, Gemma, OLMo, Phi-3; dense or
mixture-of-experts MLPs) are supported; the others raise :class:`~steerkit.UnsupportedArchitectureError`.
"""
from __future__ import annotations

import logging
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from jaxtyping import Float
from torch import Tensor, nn

from steerkit.errors import InputError, UnsupportedArchitectureError
from steerkit.loading.adapters import get_module
from steerkit.model import SteerModel, Tokens
from steerkit.vectors import Transcoders
from steerkit.vectors.safety import release_pages

from .graph import Graph, LogitTarget

log = logging.getLogger("steerkit.attribution")
#: the transcoder inputs the replacement model can be built around
ATTRIBUTION_INPUTS = ("mlp.hook_in", "ln2.hook_normalized", "hook_resid_mid")


# ---------------------------------------------------------------------------------------------- tokens and targets
def prompt_ids(tokenizer: Any, prompt: str | Sequence[int] | Tensor) -> list[int]:
    """The prompt's token ids as circuit-tracer reads them: raw text without special tokens, then a special token in
    front unless the first already is one (the tokenizer's BOS, else its pad, EOS or first special token).

    Examples:
        >>> from steerkit.probes.attribution import prompt_ids
        >>> ids = prompt_ids(tiny.tokenizer, "The cat")
        >>> ids[0] == tiny.tokenizer.bos_token_id, ids[1:] == tiny.tokenizer("The cat", add_special_tokens=False)["input_ids"]
        (True, True)
    """
    if isinstance(prompt, str):
        if not prompt:
            raise InputError("expected a prompt with at least one character, found an empty string")
        ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    else:
        ids = [int(t) for t in (prompt.reshape(-1).tolist() if isinstance(prompt, Tensor) else prompt)]
    if not ids:
        raise InputError("expected a prompt of at least one token, found none")
    special = list(getattr(tokenizer, "all_special_ids", []) or [])
    if ids[0] in special:
        return ids
    candidates = [tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id] + special
    first = next(filter(None, candidates), None)  # circuit-tracer's choice: the first that is not None nor 0
    if first is None:
        warnings.warn("no special token found to put in front of the prompt; the first token's features are left out",
                      stacklevel=3)
        return ids
    return [int(first)] + ids


def _targets(logits: Tensor, unembed: Tensor, tokenizer: Any, attribution_targets: Any, max_n_logits: int,
             desired_logit_prob: float) -> tuple[list[LogitTarget], Tensor, Tensor]:
    """``(targets, probabilities, demeaned unembedding rows)``: the salient logits (circuit-tracer's rule) or the
    tokens asked for (indices or single-token strings)."""
    probs = torch.softmax(logits, dim=-1)
    vocab = logits.shape[0]
    if attribution_targets is None:
        top_p, top_idx = torch.topk(probs, max_n_logits)
        cutoff = int(torch.searchsorted(torch.cumsum(top_p, 0), desired_logit_prob)) + 1
        idx = top_idx[:cutoff]
    elif isinstance(attribution_targets, Tensor):
        idx = attribution_targets.reshape(-1).long()
    else:
        ids = []
        for t in attribution_targets:
            if isinstance(t, str):
                enc = tokenizer.encode(t, add_special_tokens=False)
                if len(enc) != 1:
                    raise InputError(f"expected each target string to be one token, found {t!r} as {len(enc)} tokens")
                ids.append(enc[0])
            else:
                ids.append(int(t))
        idx = torch.tensor(ids, dtype=torch.long)
    if not len(idx) or bool((idx < 0).any() or (idx >= vocab).any()):
        raise InputError(f"expected target token indices in [0, {vocab}), found {idx.tolist()[:10]}")
    idx = idx.to(logits.device)
    vecs = unembed[idx] - unembed.mean(dim=0, keepdim=True)
    targets = [LogitTarget(tokenizer.decode(i), i) for i in idx.tolist()]
    return targets, probs[idx], vecs


# ---------------------------------------------------------------------------------------------- the frozen model
def _linear(module: nn.Module, what: str) -> Tensor:
    w = getattr(module, "weight", None)
    if not isinstance(module, nn.Linear) or not isinstance(w, Tensor):
        raise UnsupportedArchitectureError(f"expected the {what} as an nn.Linear, found {type(module).__name__}; "
                                           "attribution graphs need the family's projections as linear layers")
    return w


def _check_family(sm: SteerModel) -> None:
    a, m = sm.adapter, sm.hf_model
    problems = []
    if a.is_parallel(m):
        problems.append("its blocks run attention and the MLP in parallel")
    if a.ln1 is None or a.ln2 is None or a.pre_attn_norm != a.ln1:
        problems.append("it has no pre-attention and pre-MLP norms (it normalises after each sub-layer)")
    for what, path, own in (("attention", a.attn_out, a.attn), ("MLP", a.mlp_out, a.mlp_layout.module)):
        mod = get_module(a.block(m, 0), path)
        if path != own and not isinstance(mod, nn.Dropout):
            problems.append(f"what its {what} adds to the residual passes through {type(mod).__name__}")
    if a.attn_layout.qkv is not None and a.attn_layout.qkv_layout != "concat":
        problems.append("its fused query/key/value projection is laid out per head")
    if problems:
        raise UnsupportedArchitectureError(
            f"expected a family with sequential pre-norm blocks for attribution graphs (Llama, Mistral, Qwen, Gemma, "
            f"OLMo, Phi-3), found {a.name!r}: {'; '.join(problems)}")


def _norm_T(g: Tensor, scale: Tensor, kind: str) -> Tensor:
    """The transpose of a frozen norm (``scale``: ``w_eff / s`` per position ``[P, 1 or d]``)."""
    y = g * scale
    return y - y.mean(-1, keepdim=True) if kind == "layer" else y


@dataclass
class _Layer:
    """What block ``l`` of the frozen replacement model needs: the transposed norms' factors ``[P, d]``, the
    attention pattern ``[H, P, P]``, ``W_O`` ``[d, H * d_head]`` and ``W_V`` ``[KV * d_head, d]``."""

    ln1: Tensor
    ln2: Tensor
    pattern: Tensor
    W_O: Tensor
    W_V: Tensor
    error: Tensor


class _Replacement:
    """The frozen replacement model of one prompt, transposed: :meth:`rows` are the direct effects of a batch of
    sources (injected gradients) on every feature, error and token node."""

    def __init__(self, sm: SteerModel, tc: Transcoders, ids: list[int]):
        _check_family(sm)
        a, m = sm.adapter, sm.hf_model
        self.L, self.P, self.d = sm.n_layers, len(ids), sm.d_model
        self.H, self.KV, self.dh = sm.n_heads, sm.n_kv_heads, sm.d_head
        self.kind = a.norm.kind
        self.input_hook = tc.input_hook
        L = self.L
        names = ["blocks.0.hook_resid_pre", "ln_final.hook_scale"]
        for l in range(L):
            names += [f"blocks.{l}.ln1.hook_scale", f"blocks.{l}.ln2.hook_scale", f"blocks.{l}.attn.hook_pattern",
                      *tc.sites(l)]
        toks = Tokens(torch.tensor([ids], device=sm.device), torch.ones(1, len(ids), dtype=torch.long, device=sm.device))
        with sm.record(sorted(set(names)), positions="all") as cache:
            self.logits = sm.forward(toks)[0].float().cpu()
        c = {k: cache[k][0].float().cpu() for k in names}  # the graph is computed on the CPU
        self.tokens = c["blocks.0.hook_resid_pre"]
        final = a.final_norm_affine(m)[0]
        self.final = self._factor(c["ln_final.hook_scale"], final)
        self.unembed = a.unembed_module(m).weight.float().cpu()
        self.x_in = torch.stack([c[tc.sites(l)[0]] for l in range(L)])
        self.mlp_out = torch.stack([c[tc.sites(l)[1]] for l in range(L)])
        self.layers = []
        for l in range(L):
            w1 = a.norm_affine(a.block_norm_module(m, l, "ln1"))[0]
            w2 = a.norm_affine(a.block_norm_module(m, l, "ln2"))[0]
            ln2 = {"mlp.hook_in": self._factor(c[f"blocks.{l}.ln2.hook_scale"], w2),
                   "ln2.hook_normalized": self._factor(c[f"blocks.{l}.ln2.hook_scale"], None),
                   "hook_resid_mid": None}[self.input_hook]
            self.layers.append(_Layer(self._factor(c[f"blocks.{l}.ln1.hook_scale"], w1), ln2,  # type: ignore[arg-type]
                                      c[f"blocks.{l}.attn.hook_pattern"].transpose(1, 2).contiguous(),
                                      _linear(a.o_proj_module(m, l), "attention output").float().cpu(),
                                      self._v_weight(sm, l), torch.empty(0)))

    def _factor(self, scale: Tensor, w: Tensor | None) -> Tensor:
        inv = 1.0 / scale.float()  # [P, 1]
        return inv if w is None else inv * w.float().cpu()[None, :]

    def _v_weight(self, sm: SteerModel, l: int) -> Tensor:
        mods = sm.adapter.qkv_modules(sm.hf_model, l)
        if "v" in mods:
            return _linear(mods["v"], "value projection").float().cpu()
        w = _linear(mods["qkv"], "query/key/value projection").float().cpu()
        lo = (self.H + self.KV) * self.dh
        return w[lo: lo + self.KV * self.dh]

    # ---- the backward map
    def _ln2_T(self, l: int, g: Tensor) -> Tensor:
        f = self.layers[l].ln2
        if self.input_hook == "hook_resid_mid":
            return g
        return _norm_T(g, f[: g.shape[0], None, :], self.kind)

    def _attn_T(self, l: int, g: Tensor) -> Tensor:
        """The transposed attention of block ``l`` (pattern frozen) on ``g`` ``[Pm, b, d]``."""
        lay, (Pm, b, _) = self.layers[l], g.shape
        H, KV, dh = self.H, self.KV, self.dh
        gz = (g @ lay.W_O).view(Pm, b, H, dh).permute(2, 0, 1, 3).reshape(H, Pm, b * dh)
        gv = torch.bmm(lay.pattern[:, :Pm, :Pm], gz)  # [H, k, b * dh]: pattern is stored transposed
        if KV != H:
            gv = gv.view(KV, H // KV, Pm, b * dh).sum(1)
        gv = gv.view(KV, Pm, b, dh).permute(1, 2, 0, 3).reshape(Pm, b, KV * dh)
        return _norm_T(gv @ lay.W_V, lay.ln1[:Pm, None, :], self.kind)

    def rows(self, out: Tensor, layers: Tensor, positions: Tensor, values: Tensor, feats: "_Features") -> None:
        """Write the rows of a batch of sources into ``out`` ``[R, n_features + (L + 1) * P]``: source ``r`` is
        injected at block ``layers[r]``'s transcoder input (``L``: the final norm's output), position
        ``positions[r]``, with gradient ``values[r]``. ``layers`` must be sorted, descending."""
        R, L, P = len(layers), self.L, self.P
        Pm = int(positions.max()) + 1
        G = torch.zeros(Pm, R, self.d)
        at = [int((layers > l).sum()) for l in range(-1, L)]  # at[l + 1]: rows whose source is above block l
        n_top = int((layers == L).sum())  # the logits' rows: at the final norm's output
        if n_top:
            r = torch.arange(n_top)
            G[positions[:n_top], r] = _norm_T(values[:n_top], self.final[positions[:n_top]], self.kind)
        err0 = feats.n_active
        for l in range(L - 1, -1, -1):
            a, b = at[l + 1], at[l]  # rows above block l carry G; rows [a, b) start at its input
            if a:
                ga = G[:, :a]
                feats.contract(l, ga, out[:a])
                out[:a, err0 + l * P: err0 + l * P + Pm] = torch.einsum("prd,pd->rp", ga, self.layers[l].error[:Pm])
            if b == 0:
                continue
            g_in = torch.zeros(Pm, b, self.d)
            if a and feats.tc.W_skip is not None:
                g_in[:, :a] = ga @ feats.tc.W_skip[l].float()
            if b > a:
                r = torch.arange(a, b)
                g_in[positions[a:b], r] = values[a:b]
            g_mid = G[:, :b] + self._ln2_T(l, g_in)
            G[:, :b] = g_mid + self._attn_T(l, g_mid)
        tok0 = err0 + L * P
        out[:, tok0: tok0 + Pm] = torch.einsum("prd,pd->rp", G, self.tokens[:Pm])


# ---------------------------------------------------------------------------------------------- the features
class _Features:
    """The active features of a prompt (circuit-tracer's order: block, position, feature), their encoder rows
    (injected) and their decoder rows times activations, grouped by position for the contraction."""

    def __init__(self, tc: Transcoders, rep: _Replacement):
        self.tc = tc
        L, P = rep.L, rep.P
        idx, vals, recon = [], [], torch.zeros(L, P, rep.d)
        self.blocks: list[list[tuple[int, Tensor, Tensor, Tensor]]] = [[] for _ in range(L)]
        self.offset = [0]
        for l in range(L):
            acts = tc.encode_layer(rep.x_in[l], l).float()
            acts[0] = 0  # the special token in front: no features there
            pos, feat = acts.nonzero(as_tuple=True)
            idx.append(torch.stack([torch.full_like(pos, l), pos, feat], dim=1))
            vals.append(acts[pos, feat])
            # the decoder rows of block l's active features, read once; the rest of a memory-mapped file's pages
            # are given back (the rows no prompt needs stay on disk, as circuit-tracer's lazy decoders do)
            scaled = tc.W_dec[l][feat].float() * vals[-1].reshape(-1, *[1] * (tc.W_dec[l].ndim - 1))
            release_pages(tc.W_dec[l])
            if tc.cross_layer:  # block l's features write every block from l on
                for k in range(L - l):
                    recon[l + k].index_add_(0, pos, scaled[:, k])
                    self._block(l + k, self.offset[l], pos, scaled[:, k], P)
            else:
                recon[l].index_add_(0, pos, scaled)
                self._block(l, self.offset[l], pos, scaled, P)
                if tc.W_skip is not None:
                    recon[l] += tc.skip(rep.x_in[l], l).float()
            self.offset.append(self.offset[l] + len(pos))
        recon += torch.stack([b.float() for b in tc.b_dec])[:, None, :]
        errors = rep.mlp_out - recon
        errors[:, 0] = 0
        for l in range(L):
            rep.layers[l].error = errors[l]
        self.active = torch.cat(idx)  # [n, 3]
        self.values = torch.cat(vals)
        self.n_active = len(self.active)

    def _block(self, target: int, lo: int, pos: Tensor, dec: Tensor, P: int) -> None:
        """Record a writer into block ``target``: its features (columns from ``lo``, at positions ``pos``, sorted) and
        their decoder rows times activations ``dec`` ``[n, d]``, padded per position: ``(column offset, decoders
        [P, d, kmax], flat index, start per position)``."""
        n = len(pos)
        if n == 0:
            return
        counts = torch.bincount(pos, minlength=P)
        start = torch.cumsum(counts, 0) - counts
        kmax = int(counts.max())
        slot = torch.arange(n) - start[pos]
        D = torch.zeros(P, kmax, dec.shape[-1])
        D[pos, slot] = dec
        ends = torch.cat([start, torch.tensor([n])])
        self.blocks[target].append((lo, D.transpose(1, 2).contiguous(), pos * kmax + slot, ends))

    def contract(self, l: int, g: Tensor, out: Tensor) -> None:
        """``out[r, f] += g[pos_f, r] . decoder_f`` for the features writing block ``l`` (``g`` ``[Pm, a, d]``)."""
        Pm, a, _ = g.shape
        for lo, D, flat, ends in self.blocks[l]:
            n = int(ends[Pm])  # the features at positions below Pm
            if n == 0:
                continue
            res = torch.bmm(g, D[:Pm])  # [Pm, a, kmax]
            out[:, lo: lo + n] += res.permute(1, 0, 2).reshape(a, -1)[:, flat[:n]]

    def encoders(self, index: Tensor) -> Tensor:
        """The encoder rows of active features ``index`` ``[n, d]``."""
        rows = self.active[index]
        out = torch.empty(len(index), self.tc.d_model)
        for l in rows[:, 0].unique().tolist():
            m = rows[:, 0] == l
            out[m] = self.tc.W_enc[l][rows[m, 2]].float()
        return out


# ---------------------------------------------------------------------------------------------- influence
class _Influence:
    """circuit-tracer's partial influences of the rows written so far (``compute_partial_influences``), computed
    without copying the rows: the power iteration runs on the visited features' square block of the row-normalised
    ``|rows|`` (kept, and grown by the rows and columns each new batch brings), and its sum is applied to every
    column once."""

    def __init__(self, edge: Tensor, n_logits: int, n_max: int, logit_p: Tensor, logit_offset: int):
        self.edge, self.n_logits, self.logit_p = edge, n_logits, logit_p
        n_rows = n_logits + n_max
        self.row_nodes = torch.zeros(n_rows, dtype=torch.long)
        self.row_nodes[:n_logits] = torch.arange(n_logits) + logit_offset
        self.inv = torch.zeros(n_rows)
        self.square = torch.zeros(n_rows, n_max)  # [row, visited feature j]: |edge[row, node of row n_logits + j]|
        self.n_rows = 0  # rows whose square part is filled
        self.add(0, n_logits, None)

    def add(self, start: int, stop: int, nodes: Tensor | None) -> None:
        """Rows ``start:stop`` were written (``nodes``: their features; ``None`` for the logits')."""
        if nodes is not None:
            self.row_nodes[start:stop] = nodes
        self.inv[start:stop] = 1.0 / self.edge[start:stop].abs().sum(1).clamp(min=1e-8)

    def _grow(self, st: int) -> None:
        """Fill the square block for the rows and feature columns written since the last call."""
        old, n = self.n_rows, self.n_logits
        if st == old:
            return
        cols = self.row_nodes[n:st]
        self.square[old:st, : st - n] = self.edge[old:st].index_select(1, cols).abs_().mul_(self.inv[old:st, None])
        if old > 0 and old > n:
            new_cols = self.row_nodes[old:st]
            self.square[:old, old - n: st - n] = self.edge[:old].index_select(1, new_cols).abs_().mul_(
                self.inv[:old, None])
        elif old > 0:
            self.square[:old, : st - n] = self.edge[:old].index_select(1, cols).abs_().mul_(self.inv[:old, None])
        self.n_rows = st

    def __call__(self, st: int, max_iter: int = 128) -> Tensor:
        """The influence of every column on the logits through the first ``st`` rows."""
        self._grow(st)
        n = self.n_logits
        S = self.square[:st, : st - n]
        q = torch.zeros(st)
        q[:n] = self.logit_p
        total = q.clone()
        for _ in range(max_iter):
            nxt = q @ S
            if not nxt.any():
                break
            q = torch.zeros(st)
            q[n:] = nxt
            total += q
        else:
            raise RuntimeError(f"expected the influence to converge within {max_iter} steps, found it did not")
        weights = total * self.inv[:st]
        W = self.edge[:st]
        infl = torch.zeros(W.shape[1])
        for i in range(0, st, 1024):
            infl += weights[i:i + 1024] @ W[i:i + 1024].abs()
        return infl


# ---------------------------------------------------------------------------------------------- the entry point
def _batches(index: Tensor, positions: Tensor, layers: Tensor, batch_size: int) -> list[Tensor]:
    """``index`` cut into batches by position (sources sharing a backward pass stop early together), each sorted by
    block, descending."""
    order = index[torch.argsort(positions[index], stable=True)]
    out = []
    for i in range(0, len(order), batch_size):
        b = order[i:i + batch_size]
        out.append(b[torch.argsort(layers[b], descending=True, stable=True)])
    return out


def _check_transcoders(sm: SteerModel, tc: Transcoders, override: bool) -> None:
    if not isinstance(tc, Transcoders):
        raise InputError(f"expected transcoders as steerkit.vectors.Transcoders (steerkit.load_transcoders), found "
                         f"{type(tc).__name__}")
    if tc.input_hook not in ATTRIBUTION_INPUTS or tc.output_hook != "hook_mlp_out":
        raise InputError(f"expected transcoders reading one of {ATTRIBUTION_INPUTS} and writing hook_mlp_out (they "
                         f"replace the MLPs), found {tc.input_hook} -> {tc.output_hook}")
    with warnings.catch_warnings():  # transcoders from circuit-tracer's files name no model: nothing to warn about
        warnings.filterwarnings("ignore", message=".*records no model fingerprint.*")
        tc.check(sm, override=override)


def attribution_graph(sm: SteerModel, transcoders: Transcoders, prompt: str | Sequence[int] | Tensor, *,
                      max_n_logits: int = 10, desired_logit_prob: float = 0.95, max_feature_nodes: int | None = None,
                      batch_size: int = 512, update_interval: int = 4,
                      attribution_targets: Sequence[str | int] | Tensor | None = None, override: bool = False,
                      verbose: bool = False) -> Graph:
    """The attribution graph of ``prompt`` (raw text, or token ids) through ``transcoders`` (see the module
    docstring), with circuit-tracer's defaults: the salient logits (at most ``max_n_logits``, up to
    ``desired_logit_prob``; ``attribution_targets``: tokens or single-token strings instead), every active feature
    or the ``max_feature_nodes`` most influential, ``batch_size`` sources per backward pass and the influence
    re-ranked every ``update_interval`` batches (both change which features a limited graph keeps, as in
    circuit-tracer). ``override=True``: transcoders made for another fingerprint are used anyway (warned).

    Examples:
        >>> from steerkit.probes import attribution_graph, prune_graph
        >>> from steerkit.vectors import Transcoders
        >>> g = torch.Generator().manual_seed(0)
        >>> L, d, n = tiny.n_layers, tiny.d_model, 64
        >>> tc = Transcoders([torch.randn(n, d, generator=g) for _ in range(L)], [torch.full((n,), -2.0)] * L,
        ...                  [torch.randn(n, d, generator=g) / 8 for _ in range(L)], [torch.zeros(d)] * L)
        >>> graph = attribution_graph(tiny, tc, "The cat sat")
        >>> graph.input_tokens.tolist() == [tiny.tokenizer.bos_token_id] + tiny.tokenizer("The cat sat")["input_ids"]
        True
        >>> n = graph.n_features + graph.n_errors + graph.n_pos + graph.n_logits
        >>> tuple(graph.adjacency_matrix.shape) == (n, n), graph.active_features.shape[1]
        (True, 3)
        >>> nodes, edges, _ = prune_graph(graph)
        >>> bool(nodes[-graph.n_logits:].all())
        True
    """
    t0 = time.perf_counter()
    _check_transcoders(sm, transcoders, override)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"expected batch_size as a positive integer, found {batch_size!r}")
    ids = prompt_ids(sm.tokenizer, prompt)
    if transcoders.device.type != "cpu":  # the graph is computed on the CPU, as its rows are kept
        transcoders = transcoders.to("cpu")
    with torch.inference_mode():
        rep = _Replacement(sm, transcoders, ids)
        feats = _Features(transcoders, rep)
        targets, probs, vecs = _targets(rep.logits[-1], rep.unembed, sm.tokenizer, attribution_targets, max_n_logits,
                                        desired_logit_prob)
        log.info("forward pass and %d active features in %.2fs", feats.n_active, time.perf_counter() - t0)
        adjacency, selected = _visit(rep, feats, vecs.float(), probs.float(), max_feature_nodes, batch_size,
                                     update_interval)
    log.info("attribution done in %.2fs", time.perf_counter() - t0)
    tok = sm.tokenizer
    input_tokens = torch.tensor(ids, dtype=torch.long)
    return Graph(input_tokens=input_tokens, active_features=feats.active, activation_values=feats.values,
                 selected_features=selected, logit_targets=targets, logit_probabilities=probs.float().cpu(),
                 adjacency_matrix=adjacency, n_layers=rep.L, vocab_size=int(tok.vocab_size), scan=transcoders.scan,
                 prompt_tokens=[tok.decode([t]) for t in ids], input_string=tok.decode(ids))


def _visit(rep: _Replacement, feats: _Features, vecs: Tensor, probs: Tensor, max_feature_nodes: int | None,
           batch_size: int, update_interval: int) -> tuple[Tensor, Tensor]:
    """The logits' rows, then the features' in order of influence; ``(adjacency [N, N], selected features)``."""
    L, P, n_active, n_logits = rep.L, rep.P, feats.n_active, len(probs)
    logit_offset = n_active + (L + 1) * P
    n_max = min(max_feature_nodes or n_active, n_active)
    layers, positions = feats.active[:, 0], feats.active[:, 1]
    every = n_max == n_active
    n_rows = n_max + n_logits
    if every:  # rows go straight to their place in the adjacency matrix
        N = logit_offset + n_logits
        edge = torch.zeros(N, N)
        logit_rows = edge[N - n_logits:, :logit_offset]
    else:
        edge = torch.zeros(n_rows, logit_offset)
        logit_rows = edge[:n_logits]
    rep.rows(logit_rows, torch.full((n_logits,), L), torch.full((n_logits,), P - 1), vecs, feats)
    workers = _Workers(torch.get_num_threads())
    if every:
        def fill(b: Tensor) -> None:
            buf = torch.zeros(len(b), logit_offset)
            rep.rows(buf, layers[b], positions[b], feats.encoders(b), feats)
            edge[b, :logit_offset] = buf
        workers.run(fill, _batches(torch.arange(n_active), positions, layers, batch_size))
        return edge, torch.arange(n_active)
    influence = _Influence(edge, n_logits, n_max, probs, logit_offset)
    visited = torch.zeros(n_active, dtype=torch.bool)
    st = n_logits

    def write(job: tuple[int, Tensor]) -> None:
        at, b = job
        rep.rows(edge[at: at + len(b)], layers[b], positions[b], feats.encoders(b), feats)
    while st - n_logits < n_max:
        infl = influence(st)
        rank = torch.argsort(infl[:n_active], descending=True)
        pending = rank[~visited[rank]][: min(update_interval * batch_size, n_max - (st - n_logits))]
        jobs = []
        for b in _batches(pending, positions, layers, batch_size):
            jobs.append((st, b))
            st += len(b)
        workers.run(write, jobs)
        for at, b in jobs:
            influence.add(at, at + len(b), b)
            visited[b] = True
    row_nodes = influence.row_nodes
    del influence
    return _package(edge, row_nodes, visited, n_active, logit_offset, n_logits), torch.where(visited)[0]


class _Workers:
    """Batches of sources run side by side on ``n`` threads, each op on one thread: coarse parallel work that a
    busy machine cannot stall the way it stalls many small multi-threaded ops (each waits for every thread)."""

    def __init__(self, n: int):
        self.n = max(1, int(n))

    def run(self, fn, jobs: list) -> None:
        if self.n == 1 or len(jobs) < 2:
            for job in jobs:
                fn(job)
            return
        outer = torch.get_num_threads()

        def one(job):
            torch.set_num_threads(1)
            with torch.inference_mode():
                fn(job)
        try:
            with ThreadPoolExecutor(self.n) as pool:
                for f in [pool.submit(one, job) for job in jobs]:
                    f.result()
        finally:
            torch.set_num_threads(outer)


def _package(edge: Tensor, row_nodes: Tensor, visited: Tensor, n_active: int, logit_offset: int, n_logits: int
             ) -> Float[Tensor, "n n"]:
    """The adjacency matrix of the selected features: their rows in feature order, the columns of the features
    not selected left out."""
    selected = torch.where(visited)[0]
    cols = torch.cat([selected, torch.arange(n_active, logit_offset)])
    n_sel = len(selected)
    N = len(cols) + n_logits
    out = torch.zeros(N, N)
    order = torch.argsort(row_nodes)  # the selected features by index, then the logits
    dest = torch.cat([torch.arange(n_sel), torch.arange(N - n_logits, N)])
    for i in range(0, len(order), 1024):
        src = order[i:i + 1024]
        out[dest[i:i + 1024], : len(cols)] = edge[src].index_select(1, cols)
    return out
