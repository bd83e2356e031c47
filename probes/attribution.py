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

The result is a :class:`~steerkit.probes.Graph` with circuit-tracer's fields and node order. The graph is computed
on the model's device (``device=`` another): the recorded activations, the frozen weights and the decoder rows of
the active features go there; the transcoders encode where they are kept (keep them on the GPU with ``.to("cuda")``
for the fastest encoding, or on the CPU, memory-mapped, to spare GPU memory). The rows of a graph limited by
``max_feature_nodes`` are kept on that device for the influence ranking (circuit-tracer copies them there for each
ranking); those of a graph of every feature (``[N, N]``, no ranking) are kept in CPU memory, as circuit-tracer
keeps them. The :class:`~steerkit.probes.Graph` returned holds CPU tensors (:meth:`~steerkit.probes.Graph.to` moves
them). No process-wide setting (thread counts, default device or dtype) is changed. The families whose
blocks are sequential and pre-norm (Llama, Mistral, Qwen 2 and 3, SmolLM 3, Gemma, OLMo, Phi-3; dense or
mixture-of-experts MLPs) are supported; the others raise :class:`~steerkit.UnsupportedArchitectureError`.
"""
from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from tqdm import tqdm

from steerkit.errors import InputError, UnsupportedArchitectureError
from steerkit.loading.adapters import get_module
from steerkit.model import SteerModel, Tokens
from steerkit.vectors import Transcoders
from steerkit.vectors.safety import release_pages

from .graph import Graph, LogitTarget
from .graph_rows import RowStore

log = logging.getLogger("steerkit.attribution")
#: the transcoder inputs the replacement model can be built around
ATTRIBUTION_INPUTS = ("mlp.hook_in", "ln2.hook_normalized", "hook_resid_mid")
#: positions whose features' decoder rows are padded together for one batched product (the padding is the busiest
#: position's count within a span, not the prompt's)
SPAN = 16


# ---------------------------------------------------------------------------------------------- tokens and targets
def prompt_ids(tokenizer: Any, prompt: str | Sequence[int] | Int[Tensor, "..."]) -> list[int]:
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
    """``(targets, probabilities, demeaned unembedding rows)`` on the logits' device: the salient logits
    (circuit-tracer's rule) or the tokens asked for (indices or single-token strings). ``unembed`` stays where the
    model keeps it: only the targets' rows and the mean row are read from it, in float32."""
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
        idx = torch.tensor(ids, dtype=torch.long, device=logits.device)
    if not len(idx) or bool((idx < 0).any() or (idx >= vocab).any()):
        raise InputError(f"expected target token indices in [0, {vocab}), found {idx.tolist()[:10]}")
    idx = idx.to(logits.device)
    mean = unembed.mean(dim=0, dtype=torch.float32).to(logits.device)
    vecs = unembed[idx.to(unembed.device)].to(logits.device, torch.float32) - mean
    targets = [LogitTarget(tokenizer.decode(i), i) for i in idx.tolist()]
    return targets, probs[idx], vecs


# ---------------------------------------------------------------------------------------------- the frozen model
def _linear(module: nn.Module, what: str, device: torch.device) -> Tensor:
    """The weight of a linear layer, in float32 on ``device``."""
    w = getattr(module, "weight", None)
    if not isinstance(module, nn.Linear) or not isinstance(w, Tensor):
        raise UnsupportedArchitectureError(f"expected the {what} as an nn.Linear, found {type(module).__name__}; "
                                           "attribution graphs need the family's projections as linear layers")
    return _on(w, device, what)


def _on(t: Tensor, device: torch.device, what: str) -> Tensor:
    """``t`` in float32 on ``device``; a weight offloaded to the meta device is refused."""
    if t.device.type == "meta":
        raise InputError(f"expected the model's {what} in memory, found it offloaded (on the meta device); load the "
                         "model without disk offloading to compute attribution graphs")
    return t.to(device=device, dtype=torch.float32)


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
    """The frozen replacement model of one prompt, transposed, on ``device``: :meth:`rows` are the direct effects of
    a batch of sources (injected gradients) on every feature, error and token node."""

    def __init__(self, sm: SteerModel, tc: Transcoders, ids: list[int], device: torch.device):
        _check_family(sm)
        a, m = sm.adapter, sm.hf_model
        self.device = device
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
        with sm.record(sorted(set(names)), positions="all", device=device) as cache:
            self.logits = _on(sm.forward(toks)[0], device, "logits")
        c = {k: _on(cache[k][0], device, k) for k in names}
        self.tokens = c["blocks.0.hook_resid_pre"]
        self.final = self._factor(c["ln_final.hook_scale"], a.final_norm_affine(m)[0])
        self.unembed = a.unembed_module(m).weight  # where the model keeps it: only the targets' rows are read
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
                                      _linear(a.o_proj_module(m, l), "attention output", device),
                                      self._v_weight(sm, l), torch.empty(0, device=device)))

    def _factor(self, scale: Tensor, w: Tensor | None) -> Tensor:
        inv = 1.0 / scale  # [P, 1]
        return inv if w is None else inv * _on(w, self.device, "norm weight")[None, :]

    def _v_weight(self, sm: SteerModel, l: int) -> Tensor:
        mods = sm.adapter.qkv_modules(sm.hf_model, l)
        if "v" in mods:
            return _linear(mods["v"], "value projection", self.device)
        w = _linear(mods["qkv"], "query/key/value projection", self.device)
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
        """Write the rows of a batch of sources into ``out`` ``[R, n_features + (L + 1) * P]`` (zeros, on the
        device): source ``r`` is injected at block ``layers[r]``'s transcoder input (``L``: the final norm's
        output), position ``positions[r]``, with gradient ``values[r]``. ``layers`` must be sorted, descending."""
        R, L, P, dev = len(layers), self.L, self.P, self.device
        Pm = int(positions.max()) + 1
        G = torch.zeros(Pm, R, self.d, device=dev)
        counts = torch.bincount(layers, minlength=L + 1).tolist()
        at = [sum(counts[i:]) for i in range(L + 1)]  # at[l + 1]: rows whose source is above block l
        n_top = counts[L]  # the logits' rows: at the final norm's output
        if n_top:
            r = torch.arange(n_top, device=dev)
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
            g_in = torch.zeros(Pm, b, self.d, device=dev)
            if a and feats.W_skip is not None:
                g_in[:, :a] = ga @ feats.W_skip[l]
            if b > a:
                r = torch.arange(a, b, device=dev)
                g_in[positions[a:b], r] = values[a:b]
            g_mid = G[:, :b] + self._ln2_T(l, g_in)
            G[:, :b] = g_mid + self._attn_T(l, g_mid)
        tok0 = err0 + L * P
        out[:, tok0: tok0 + Pm] = torch.einsum("prd,pd->rp", G, self.tokens[:Pm])


# ---------------------------------------------------------------------------------------------- the features
class _Features:
    """The active features of a prompt (circuit-tracer's order: block, position, feature), their encoder rows
    (injected) and their decoder rows times activations, grouped by position for the contraction; on the replacement
    model's device. The transcoders encode where they are kept; only the active features' rows are copied."""

    def __init__(self, tc: Transcoders, rep: _Replacement):
        self.tc, self.device = tc, rep.device
        L, P, dev, home = rep.L, rep.P, rep.device, tc.device
        idx, vals, recon = [], [], torch.zeros(L, P, rep.d, device=dev)
        self.blocks: list[list[tuple[int, int, Tensor, Tensor, list[int]]]] = [[] for _ in range(L)]
        self.W_skip = None if tc.W_skip is None else [w.to(dev, torch.float32) for w in tc.W_skip]
        self.offset = [0]
        for l in range(L):
            acts = tc.encode_layer(rep.x_in[l].to(home), l).to(dev, torch.float32)
            release_pages(tc.W_enc[l])  # a memory-mapped encoder read whole: its pages go back (rows read on use)
            acts[0] = 0  # the special token in front: no features there
            pos, feat = acts.nonzero(as_tuple=True)
            idx.append(torch.stack([torch.full_like(pos, l), pos, feat], dim=1))
            vals.append(acts[pos, feat])
            # the decoder rows of block l's active features, read once; the rest of a memory-mapped file's pages
            # are given back (the rows no prompt needs stay on disk, as circuit-tracer's lazy decoders do)
            rows = tc.W_dec[l][feat.to(home)].to(dev, torch.float32)
            release_pages(tc.W_dec[l])
            scaled = rows * vals[-1].reshape(-1, *[1] * (rows.ndim - 1))
            if tc.cross_layer:  # block l's features write every block from l on
                for k in range(L - l):
                    recon[l + k].index_add_(0, pos, scaled[:, k])
                    self._block(l + k, self.offset[l], pos, scaled[:, k], P)
            else:
                recon[l].index_add_(0, pos, scaled)
                self._block(l, self.offset[l], pos, scaled, P)
                if self.W_skip is not None:
                    recon[l] += rep.x_in[l] @ self.W_skip[l].T
            self.offset.append(self.offset[l] + len(pos))
        recon += torch.stack([b.to(dev, torch.float32) for b in tc.b_dec])[:, None, :]
        errors = rep.mlp_out - recon
        errors[:, 0] = 0
        for l in range(L):
            rep.layers[l].error = errors[l]
        self.active = torch.cat(idx)  # [n, 3]
        self.values = torch.cat(vals)
        self.n_active = len(self.active)

    def _block(self, target: int, lo: int, pos: Tensor, dec: Tensor, P: int) -> None:
        """Record a writer into block ``target``: its features (columns from ``lo``, at positions ``pos``, sorted) and
        their decoder rows times activations ``dec`` ``[n, d]``, padded per position within spans of ``SPAN``
        positions (a span's padding is its own busiest position's count): ``(first position, first column,
        decoders [span, d, kmax], flat index, start per position)`` per span that holds features."""
        if len(pos) == 0:
            return
        counts = torch.bincount(pos, minlength=P)
        ends = torch.cumsum(counts, 0).tolist()
        for p0 in range(0, P, SPAN):
            p1 = min(p0 + SPAN, P)
            a, b = (ends[p0 - 1] if p0 else 0), ends[p1 - 1]
            if a == b:
                continue
            c = counts[p0:p1]
            start = torch.cumsum(c, 0) - c
            kmax = int(c.max())
            sp = pos[a:b] - p0
            slot = torch.arange(b - a, device=self.device) - start[sp]
            D = torch.zeros(p1 - p0, kmax, dec.shape[-1], device=self.device)
            D[sp, slot] = dec[a:b]
            self.blocks[target].append((p0, lo + a, D.transpose(1, 2).contiguous(), sp * kmax + slot,
                                        start.tolist() + [b - a]))

    def contract(self, l: int, g: Tensor, out: Tensor) -> None:
        """``out[r, f] += g[pos_f, r] . decoder_f`` for the features writing block ``l`` (``g`` ``[Pm, a, d]``)."""
        Pm, a, _ = g.shape
        for p0, lo, D, flat, ends in self.blocks[l]:
            if p0 >= Pm:
                continue
            pm = min(Pm - p0, D.shape[0])
            n = ends[pm]  # the span's features at positions below Pm
            if n == 0:
                continue
            res = torch.bmm(g[p0: p0 + pm], D[:pm])  # [pm, a, kmax]
            out[:, lo: lo + n] += res.permute(1, 0, 2).reshape(a, -1)[:, flat[:n]]

    def encoders(self, index: Tensor) -> Tensor:
        """The encoder rows of active features ``index`` ``[n, d]``, on the device."""
        rows = self.active[index]
        out = torch.empty(len(index), self.tc.d_model, device=self.device)
        home = self.tc.device
        for l in rows[:, 0].unique().tolist():
            m = rows[:, 0] == l
            out[m] = self.tc.W_enc[l][rows[m, 2].to(home)].to(self.device, torch.float32)
            release_pages(self.tc.W_enc[l])
        return out


# ---------------------------------------------------------------------------------------------- influence
class _Influence:
    """circuit-tracer's partial influences of the rows written so far (``compute_partial_influences``), computed
    without copying the rows: the power iteration runs on the visited features' square block of the row-normalised
    ``|rows|`` (kept, and grown by the rows and columns each new batch brings), and its sum is applied to every
    column once. The rows are read from their store chunk by chunk; everything else is on the graph's device."""

    def __init__(self, store: RowStore, n_logits: int, n_max: int, logit_p: Tensor, logit_offset: int):
        dev = store.device
        self.store, self.n_logits, self.logit_p = store, n_logits, logit_p.to(dev)
        n_rows = n_logits + n_max
        self.row_nodes = torch.zeros(n_rows, dtype=torch.long, device=dev)
        self.row_nodes[:n_logits] = torch.arange(n_logits, device=dev) + logit_offset
        self.inv = torch.zeros(n_rows, device=dev)
        self.square = torch.zeros(n_rows, n_max, device=dev)  # [row, visited feature j]: |edge[row, its node]|
        self.n_rows = 0  # rows whose square part is filled
        self.add(0, n_logits, None)

    def add(self, start: int, stop: int, nodes: Tensor | None) -> None:
        """Rows ``start:stop`` were written (``nodes``: their features; ``None`` for the logits')."""
        if nodes is not None:
            self.row_nodes[start:stop] = nodes
        for i, W in self.store.chunks(start, stop):
            self.inv[i: i + len(W)] = 1.0 / W.abs().sum(1).clamp(min=1e-8)

    def _grow(self, st: int) -> None:
        """Fill the square block for the rows and feature columns written since the last call."""
        old, n = self.n_rows, self.n_logits
        if st == old:
            return
        cols = self.row_nodes[n:st]
        new_cols = self.row_nodes[old:st] if old > n else cols
        for i, W in self.store.chunks(0, st):
            inv = self.inv[i: i + len(W), None]
            if i + len(W) > old:  # new rows: every visited column
                k = max(old - i, 0)
                self.square[i + k: i + len(W), : st - n] = W[k:].index_select(1, cols).abs_().mul_(inv[k:])
            if i < old:  # old rows: the new columns
                m = min(len(W), old - i)
                c0 = old - n if old > n else 0
                self.square[i: i + m, c0: st - n] = W[:m].index_select(1, new_cols).abs_().mul_(inv[:m])
        self.n_rows = st

    def __call__(self, st: int, max_iter: int = 128) -> Tensor:
        """The influence of every column on the logits through the first ``st`` rows."""
        self._grow(st)
        n, dev = self.n_logits, self.store.device
        S = self.square[:st, : st - n]
        q = torch.zeros(st, device=dev)
        q[:n] = self.logit_p
        total = q.clone()
        for _ in range(max_iter):
            nxt = q @ S
            if not nxt.any():
                break
            q = torch.zeros(st, device=dev)
            q[n:] = nxt
            total += q
        else:
            raise InputError(f"expected the influence ranking to converge within {max_iter} steps (the replacement "
                             "model's graph has no cycles), found it did not: the activations are likely not finite; "
                             "check the model's logits on the prompt")
        weights = total * self.inv[:st]
        infl = torch.zeros(self.store.tensor.shape[1], device=dev)
        for i, W in self.store.chunks(0, st):
            w = weights[i: i + len(W)]
            for j in range(0, len(W), 1024):
                infl += w[j: j + 1024] @ W[j: j + 1024].abs()
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


def _check_options(batch_size: Any, update_interval: Any, max_feature_nodes: Any, max_n_logits: Any,
                   desired_logit_prob: Any) -> None:
    for name, v, least in (("batch_size", batch_size, 1), ("update_interval", update_interval, 1),
                           ("max_n_logits", max_n_logits, 1), ("max_feature_nodes", max_feature_nodes, 1)):
        if name == "max_feature_nodes" and v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise InputError(f"expected {name} as a positive integer, found {v!r}")
    if not isinstance(desired_logit_prob, (int, float)) or not 0.0 < desired_logit_prob <= 1.0:
        raise InputError(f"expected desired_logit_prob in (0, 1], found {desired_logit_prob!r}")


def _device(sm: SteerModel, device: str | torch.device | None) -> torch.device:
    """The device the graph is computed on: ``device``, else the model's (where its inputs go)."""
    if device is None:
        return sm.device
    try:
        dev = torch.device(device)
        torch.empty(0, device=dev)
    except (RuntimeError, TypeError, ValueError, AssertionError) as e:  # a misspelt name, no such device here (torch
        # without CUDA asserts)
        raise InputError(f"expected device= as a device this machine has ('cpu', 'cuda', 'cuda:1'...), found "
                         f"{device!r} ({str(e).splitlines()[0][:120]}); leave it out to use the model's") from None
    return dev


def attribution_graph(sm: SteerModel, transcoders: Transcoders, prompt: str | Sequence[int] | Int[Tensor, "..."], *,
                      max_n_logits: int = 10, desired_logit_prob: float = 0.95, max_feature_nodes: int | None = None,
                      batch_size: int = 512, update_interval: int = 4,
                      attribution_targets: Sequence[str | int] | Int[Tensor, " n"] | None = None,
                      device: str | torch.device | None = None, override: bool = False,
                      progress: bool | Callable[[int, int], Any] = True, verbose: bool = False,
                      offload: bool | str | os.PathLike = False) -> Graph:
    """The attribution graph of ``prompt`` (raw text, or token ids) through ``transcoders`` (see the module
    docstring), with circuit-tracer's defaults: the salient logits (at most ``max_n_logits``, up to
    ``desired_logit_prob``; ``attribution_targets``: tokens or single-token strings instead), every active feature
    or the ``max_feature_nodes`` most influential, ``batch_size`` sources per backward pass and the influence
    re-ranked every ``update_interval`` batches (both change which features a limited graph keeps, as in
    circuit-tracer). Computed on the model's device, or ``device``; the graph returned holds CPU tensors.
    ``override=True``: transcoders made for another fingerprint are used anyway (warned). ``progress`` shows a
    tqdm bar over the features' rows (after two seconds), or, a callable, is called as ``progress(done, total)``
    after each batch of rows instead (an exception it raises stops the graph there: an app's cancel or time
    limit); ``verbose`` also writes each phase's time, as circuit-tracer's ``verbose`` does. ``offload=True`` (or a
    folder) keeps the rows of a graph limited by ``max_feature_nodes`` in a temporary file rather than in memory
    (:mod:`steerkit.probes.graph_rows`: for long prompts, the same values within a memory bound; the file takes
    ``(max_feature_nodes + logits) x (active features + (n_layers + 1) x positions) x 4`` bytes of disk while the
    graph is computed).

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
        >>> ticks = []
        >>> _ = attribution_graph(tiny, tc, "The cat sat", max_feature_nodes=8, batch_size=4,
        ...                       progress=lambda done, total: ticks.append((done, total)))
        >>> ticks
        [(4, 8), (8, 8)]
    """
    t0 = time.perf_counter()
    _check_transcoders(sm, transcoders, override)
    _check_options(batch_size, update_interval, max_feature_nodes, max_n_logits, desired_logit_prob)
    dev = _device(sm, device)
    ids = prompt_ids(sm.tokenizer, prompt)

    def phase(what: str) -> None:
        log.info("%s after %.2fs", what, time.perf_counter() - t0)
        if verbose:
            tqdm.write(f"attribution graph: {what} after {time.perf_counter() - t0:.2f}s", file=sys.stderr)
    with torch.inference_mode():
        rep = _Replacement(sm, transcoders, ids, dev)
        feats = _Features(transcoders, rep)
        targets, probs, vecs = _targets(rep.logits[-1], rep.unembed, sm.tokenizer, attribution_targets, max_n_logits,
                                        desired_logit_prob)
        phase(f"forward pass, {feats.n_active} active features and {len(targets)} logit targets")
        n_max = min(max_feature_nodes or feats.n_active, feats.n_active)
        with tqdm(total=n_max, desc="attribution graph", unit="feature", disable=progress is not True, leave=False,
                  delay=2) as bar:
            ticks = _Ticks(progress, n_max) if callable(progress) else bar
            adjacency, selected = _visit(rep, feats, vecs, probs, n_max, batch_size, update_interval, ticks, offload)
    phase(f"{len(selected)} features' rows")
    tok = sm.tokenizer
    return Graph(input_tokens=torch.tensor(ids, dtype=torch.long, device="cpu"), active_features=feats.active.cpu(),
                 activation_values=feats.values.cpu(), selected_features=selected.cpu(), logit_targets=targets,
                 logit_probabilities=probs.cpu(), adjacency_matrix=adjacency, n_layers=rep.L,
                 vocab_size=int(tok.vocab_size), scan=transcoders.scan, prompt_tokens=[tok.decode([t]) for t in ids],
                 input_string=tok.decode(ids))


class _Ticks:
    """A progress bar's ``update(n)`` that calls ``fn(done, total)``."""

    def __init__(self, fn: Callable[[int, int], Any], total: int):
        self.fn, self.total, self.done = fn, total, 0

    def update(self, n: int) -> None:
        self.done += int(n)
        self.fn(self.done, self.total)


def _rows_into(dst: Tensor, rep: _Replacement, feats: _Features, layers: Tensor, positions: Tensor, values: Tensor
               ) -> None:
    """The rows of a batch of sources written into ``dst`` (zeros): in place where it is on the device, else through
    a buffer there."""
    if dst.device == rep.device:
        rep.rows(dst, layers, positions, values, feats)
        return
    buf = torch.zeros(dst.shape, device=rep.device)
    rep.rows(buf, layers, positions, values, feats)
    dst.copy_(buf)


def _visit(rep: _Replacement, feats: _Features, vecs: Tensor, probs: Tensor, n_max: int, batch_size: int,
           update_interval: int, bar: tqdm | _Ticks, offload: bool | str | os.PathLike = False
           ) -> tuple[Float[Tensor, "n n"], Tensor]:
    """The logits' rows, then the features' in order of influence; ``(adjacency [N, N] on the CPU, selected
    features)``. A graph of every feature is written straight into its CPU matrix; a limited one's rows are kept on
    the device for the ranking, then packaged."""
    L, P, n_active, n_logits, dev = rep.L, rep.P, feats.n_active, len(probs), rep.device
    logit_offset = n_active + (L + 1) * P
    layers, positions = feats.active[:, 0], feats.active[:, 1]
    logit_layers = torch.full((n_logits,), L, device=dev)
    logit_positions = torch.full((n_logits,), P - 1, device=dev)
    if n_max == n_active:  # every feature: no ranking, rows go straight to their place in the CPU matrix
        N = logit_offset + n_logits
        edge = torch.zeros(N, N, device="cpu")
        _rows_into(edge[N - n_logits:, :logit_offset], rep, feats, logit_layers, logit_positions, vecs)
        for b in _batches(torch.arange(n_active, device=dev), positions, layers, batch_size):
            buf = torch.zeros(len(b), logit_offset, device=dev)
            rep.rows(buf, layers[b], positions[b], feats.encoders(b), feats)
            edge[b.cpu(), :logit_offset] = buf.cpu()
            bar.update(len(b))
        return edge, torch.arange(n_active, device="cpu")
    store = RowStore(n_max + n_logits, logit_offset, dev, offload)
    edge = store.tensor
    _rows_into(edge[:n_logits], rep, feats, logit_layers, logit_positions, vecs)
    influence = _Influence(store, n_logits, n_max, probs, logit_offset)
    visited = torch.zeros(n_active, dtype=torch.bool, device=dev)
    st = n_logits
    while st - n_logits < n_max:
        infl = influence(st)
        rank = torch.argsort(infl[:n_active], descending=True)
        pending = rank[~visited[rank]][: min(update_interval * batch_size, n_max - (st - n_logits))]
        for b in _batches(pending, positions, layers, batch_size):
            _rows_into(edge[st: st + len(b)], rep, feats, layers[b], positions[b], feats.encoders(b))
            influence.add(st, st + len(b), b)
            visited[b] = True
            st += len(b)
            bar.update(len(b))
    row_nodes = influence.row_nodes
    del influence, edge
    try:
        return _package(store, row_nodes, visited, n_active, logit_offset, n_logits), torch.where(visited)[0]
    finally:
        store.close()


def _package(store: RowStore, row_nodes: Tensor, visited: Tensor, n_active: int, logit_offset: int, n_logits: int
             ) -> Float[Tensor, "n n"]:
    """The adjacency matrix of the selected features, on the CPU: their rows in feature order, the columns of the
    features not selected left out."""
    dev = store.device
    selected = torch.where(visited)[0]
    cols = torch.cat([selected, torch.arange(n_active, logit_offset, device=dev)])
    n_sel = len(selected)
    N = len(cols) + n_logits
    out = torch.zeros(N, N, device="cpu")
    order = torch.argsort(row_nodes)  # the selected features by index, then the logits
    dest = torch.cat([torch.arange(n_sel, device="cpu"), torch.arange(N - n_logits, N, device="cpu")])
    if not store.offloaded:
        edge = store.tensor
        for i in range(0, len(order), 1024):
            src = order[i:i + 1024]
            out[dest[i:i + 1024], : len(cols)] = edge[src].index_select(1, cols).cpu()
        return out
    where = torch.empty_like(order)
    where[order] = torch.arange(len(order), device=order.device)  # each stored row's place in the output
    for i, W in store.chunks(0, len(order)):  # the file read once, in order
        out[dest[where[i: i + len(W)]].cpu(), : len(cols)] = W.index_select(1, cols.to(W.device)).cpu()
    return out
