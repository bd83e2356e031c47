"""Run only what a change touches: start a forward pass at a block and a position of a run already made.

An edit at block ``l`` (its input ``blocks.{l}.hook_resid_pre`` or anything inside it) changes nothing
that blocks ``0 .. l-1`` compute, and an edit at position ``p`` changes nothing at positions before
``p`` (attention is causal). A run that differs from an earlier one only there can start from that
run's residual stream at block ``l`` and reuse its keys and values for the positions before ``p``:

- :func:`run_cached` runs a batch once and keeps a :class:`RunCache`: the input of every block
  (the values of ``blocks.{l}.hook_resid_pre``), the keys and values of every attention layer (a
  transformers ``DynamicCache`` that keeps the whole history, sliding-window layers included) and
  the logits.
- :func:`run_from` runs blocks ``l ..`` over positions ``start ..`` only: blocks below ``l`` are
  passed through (they are not run), block ``l`` receives the cached residual, and attention reads
  the cached keys and values of positions ``0 .. start-1``. It returns the logits of positions
  ``start ..`` (and, on request, a complete KV cache to generate from).

Everything runs through the model's hook manager: recordings and edits at sites of blocks ``l ..``
fire as in a full pass, at their absolute positions ``start ..``; sites below block ``l`` do not fire
(those blocks are not run). The caller promises that every edit in force acts at block ``l`` or later
and at positions ``start`` or later; then the logits equal a full forward pass with the same edits
(float rounding aside: tests hold them within 1e-5 in float32). Activation patching, the tuning
grid and the refusal search's addition candidates build on it (:mod:`steerkit.probes.patching`,
:mod:`steerkit.probes.tune`, :mod:`steerkit.probes.methods.refusal`).

Only the ``hf`` backend runs a block range (:func:`supports_run_from`); TransformerLens and nnsight
models keep full forward passes. For the length of a call the blocks below the start are swapped for
pass-through modules in the model itself (restored afterwards, also after an exception): like hooks,
that is the model's state for every thread, so one model serves one pass at a time (the explorer app
runs its jobs under the model's lock).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.errors import InputError
from steerkit.hooks.implswitch import ImplementationSwitch
from steerkit.hooks.segments import Segments

if TYPE_CHECKING:
    from steerkit.model import SteerModel, Tokens


@dataclass(eq=False)
class RunCache:
    """One run of a batch, kept for :func:`run_from`: ``tokens`` ``[batch, pos]``, ``resid[l]`` the input
    of block ``l`` ``[batch, pos, d_model]`` (``blocks.{l}.hook_resid_pre``), ``kv`` the keys and values
    of every layer (a transformers cache with the whole history), ``logits`` ``[batch, pos, vocab]``.

    Examples:
        >>> from steerkit.reuse import run_cached
        >>> rc = run_cached(tiny, tiny.tokenize(["hello there"]))
        >>> len(rc.resid), tuple(rc.resid[1].shape), tuple(rc.logits.shape), rc.n_pos
        (4, (1, 2, 64), (1, 2, 49152), 2)
    """

    tokens: "Tokens"
    resid: list[Tensor]
    kv: Any
    logits: Tensor
    owner: int  # id() of the SteerModel that made it

    @property
    def n_pos(self) -> int:
        return int(self.tokens.input_ids.shape[1])

    @property
    def batch(self) -> int:
        return int(self.tokens.input_ids.shape[0])

    def check(self, sm: "SteerModel") -> None:
        """Refuse a cache that ``sm`` did not make (:func:`run_cached`).

        Examples:
            >>> rc = tiny.run_cached("hi")
            >>> rc.check(tiny)  # made by this model: nothing to say
        """
        if self.owner != id(sm):
            raise InputError("expected a RunCache made by this model, found one from another model; run "
                             "run_cached(sm, prompts) on this one")

    def select(self, rows: Optional[Sequence[int]] = None) -> tuple["Tokens", Tensor]:
        """The tokens of cache rows ``rows`` (repeats allowed; default all) and their index.

        Examples:
            >>> rc = tiny.run_cached(["hi", "hello there"])
            >>> toks, idx = rc.select([1, 1])
            >>> tuple(toks.input_ids.shape), idx.tolist()
            ((2, 2), [1, 1])
        """
        idx = _row_index(rows, self)
        dev = self.tokens.input_ids.device
        return type(self.tokens)(self.tokens.input_ids.index_select(0, idx.to(dev)),
                                 self.tokens.attention_mask.index_select(0, idx.to(dev))), idx


def supports_run_from(sm: "SteerModel") -> bool:
    """Whether ``sm``'s backend can run a range of blocks (the ``hf`` backend can; ``tlens`` / ``nnsight``
    cannot).

    Examples:
        >>> from steerkit.reuse import supports_run_from
        >>> supports_run_from(tiny)
        True
    """
    return hasattr(sm.backend, "run_blocks")


def _need_backend(sm: "SteerModel") -> None:
    if not supports_run_from(sm):
        raise InputError(f"expected a model on the 'hf' backend to run a range of blocks, found backend "
                         f"{sm.backend_name!r}; use sm.forward (a full pass), or load the model with backend='hf'")


def _need_cache(sm: "SteerModel", cache) -> None:
    if not isinstance(cache, RunCache):
        raise InputError(f"expected a RunCache from run_cached(sm, ...), found {type(cache).__name__}")
    cache.check(sm)


def _autograd(sm: "SteerModel"):
    """The grad mode of a pass, as ``sm.forward``'s: autograd inside ``sm.training()``, inference mode outside."""
    return torch.enable_grad() if sm.in_training else torch.inference_mode()


def run_cached(sm: "SteerModel", prompts, *, chat: bool = False, keep: int = 0) -> RunCache:
    """Run ``prompts`` (text, tokenized as :meth:`~steerkit.SteerModel.tokenize` does, or ``Tokens``) once,
    with whatever hooks are in force, and keep what :func:`run_from` needs (:class:`RunCache`). ``keep``:
    keep the logits of the last ``keep`` positions only (0: every position), as ``sm.forward``'s
    ``logits_to_keep``.

    Examples:
        >>> from steerkit.reuse import run_cached
        >>> rc = run_cached(tiny, "hello there")
        >>> torch.allclose(rc.logits, tiny.forward("hello there"), atol=1e-5)
        True
    """
    _need_backend(sm)
    toks = sm.tokenize(prompts, chat=chat)
    resid: list[Optional[Tensor]] = [None] * sm.n_layers

    def store(layer: int):
        def fn(x: Tensor, call) -> None:
            resid[layer] = x.detach()
        return fn

    sites = [(sm.hooks.parse(f"blocks.{l}.hook_resid_pre"), store(l)) for l in range(sm.n_layers)]
    with torch.inference_mode(), sm.hooks.register(sites, label="run_cached"):
        with sm.hooks.runs.running(toks.attention_mask, toks.input_ids):
            logits, kv = sm.backend.step(toks.input_ids, toks.attention_mask, toks.position_ids,
                                         sm.backend.new_cache(full=True), keep=keep)
    if keep == 1:  # the backend's one-position form is [batch, vocab]
        logits = logits[:, None]
    return RunCache(toks, [r for r in resid if r is not None], kv, logits, id(sm))


def start_block(sm: "SteerModel", site: Union[int, str]) -> int:
    """The block a pass from ``site`` starts at: an index, or any hook name inside the block.

    Examples:
        >>> from steerkit.reuse import start_block
        >>> start_block(tiny, "blocks.2.attn.hook_z"), start_block(tiny, 3)
        (2, 3)
    """
    if isinstance(site, bool):
        raise InputError(f"expected a block index or a hook name to start from, found {site!r}")
    if isinstance(site, int):
        if not 0 <= site < sm.n_layers:
            raise InputError(f"expected a block index in 0..{sm.n_layers - 1}, found {site}")
        return site
    if not isinstance(site, str):
        raise InputError(f"expected a block index or a hook name to start from (e.g. 'blocks.12.hook_resid_pre'), "
                         f"found {type(site).__name__} {site!r:.80}")
    layer = sm.hooks.parse(site).layer
    if layer is None:
        raise InputError(f"expected a hook name inside a block to start from (e.g. 'blocks.12.hook_resid_pre'), "
                         f"found {site!r}, which is after the last block; use sm.forward")
    return int(layer)


def _row_index(rows, cache: RunCache) -> Tensor:
    if rows is None:
        return torch.arange(cache.batch)
    if isinstance(rows, int) and not isinstance(rows, bool):
        rows = [rows]
    try:
        idx = torch.as_tensor(list(rows), dtype=torch.long)
    except (TypeError, ValueError):
        raise InputError(f"expected rows as cache row indices (ints, repeats allowed), found {rows!r:.80}") from None
    if idx.numel() == 0 or idx.dim() != 1 or int(idx.min()) < 0 or int(idx.max()) >= cache.batch:
        raise InputError(f"expected rows as at least one index in 0..{cache.batch - 1} (the cache's rows), found "
                         f"{rows!r:.80}")
    return idx


def run_from(sm: "SteerModel", site: Union[int, str], cache: RunCache, *, start: int = 0,
             rows: Optional[Sequence[int]] = None, resid: Optional[Tensor] = None, keep: int = 0,
             return_cache: bool = False, within_run: bool = False
             ) -> Union[Float[Tensor, "rows new_pos vocab"], tuple]:
    """The logits of positions ``start ..`` of a run that begins at block ``site`` (an index, or any hook
    name inside the block: ``"blocks.12.hook_resid_pre"``, ``"blocks.12.attn.hook_z"``) from ``cache``:
    the block's input is the cached residual (``resid`` ``[rows, pos - start, d_model]`` replaces it),
    blocks below it are not run, and attention reads the cached keys and values of positions before
    ``start``. ``rows``: which cache rows to run (repeats allowed, e.g. ``[0] * 8``: eight copies of row 0
    for eight per-row steerings; default all). ``keep``: as in ``sm.forward(logits_to_keep=...)``.
    ``return_cache``: also return a KV cache of every layer (the cached rows' below the block) to
    generate from (:func:`steerkit.generation.generate_from`). ``within_run``: run inside the run
    already in force (a generation loop's, whose prompt is the selected rows: its recordings and
    conditions then continue into the decoding steps) instead of a run of its own.

    Edits in force must act at block ``site`` or later and at positions ``start`` or later (see the
    module docstring); their positions are absolute, as in a full pass.

    Examples:
        >>> from steerkit.reuse import run_cached, run_from
        >>> toks = tiny.tokenize(["When Mary and John went"])
        >>> rc = run_cached(tiny, toks)
        >>> v = torch.randn(64)
        >>> edit = steerkit.Intervention.add("blocks.1.hook_resid_pre", v, positions=[3])
        >>> with tiny.steer(edit):
        ...     full = tiny.forward(toks)
        ...     tail = run_from(tiny, "blocks.1.hook_resid_pre", rc, start=3)
        >>> tuple(tail.shape), torch.allclose(tail, full[:, 3:], atol=1e-5)
        ((1, 2, 49152), True)
    """
    _need_backend(sm)
    _need_cache(sm, cache)
    layer = start_block(sm, site)
    T = cache.n_pos
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < T:
        raise InputError(f"expected start as a position in 0..{T - 1} (the cached run has {T}), found {start!r}")
    toks, idx = cache.select(rows)
    ids, mask = toks.input_ids, toks.attention_mask
    if resid is None:
        resid = cache.resid[layer][:, start:].index_select(0, idx.to(cache.resid[layer].device))
    elif tuple(resid.shape) != (len(idx), T - start, sm.d_model):
        raise InputError(f"expected resid of shape {(len(idx), T - start, sm.d_model)} ([rows, pos - start, "
                         f"d_model]), found {tuple(resid.shape)}")
    kv = _prefix_kv(sm, cache, idx, start)
    pos = (mask.long().cumsum(-1) - 1).clamp_min(0)[:, start:]
    if within_run and sm.hooks.runs.run is None:
        raise InputError("expected a run in force for within_run=True (a generation loop's), found none; "
                         "call run_from without within_run")
    with _autograd(sm), contextlib.nullcontext(sm.hooks.runs.run) if within_run else sm.hooks.runs.running(mask, ids) as run:
        assert run is not None
        run.chunk_start = start
        logits, kv = sm.backend.run_blocks(ids[:, start:], mask, pos, kv, layer, resid, keep=keep)
    if not return_cache:
        return logits
    _fill_below(sm, kv, cache, idx, layer, T)
    return logits, kv


@dataclass(frozen=True)
class Pack:
    """Continuations of one cached row, each from its own first position, laid end to end in one
    sequence (:func:`run_packed`): segment ``i`` holds positions ``starts[i] .. n_pos - 1``. Hooks see
    the packed run as one row whose positions ``n_pos ..`` are the segments; :meth:`index` is where
    position ``p`` of segment ``i`` sits there (place a segment's edit at it).

    Examples:
        >>> from steerkit.reuse import Pack
        >>> pack = Pack.of([3, 0, 4], n_pos=5)
        >>> pack.length, pack.index(0, 3), pack.index(1, 0), pack.index(2, 4)
        (8, 5, 7, 12)
    """

    starts: tuple[int, ...]
    offsets: tuple[int, ...]
    n_pos: int

    @classmethod
    def of(cls, starts: Sequence[int], n_pos: int) -> "Pack":
        if not starts or any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < n_pos for s in starts):
            raise InputError(f"expected at least one start position in 0..{n_pos - 1}, found {list(starts)!r:.80}")
        offsets, o = [], 0
        for s in starts:
            offsets.append(o)
            o += n_pos - s
        return cls(tuple(starts), tuple(offsets), n_pos)

    @property
    def length(self) -> int:
        """Positions in the packed sequence."""
        return self.offsets[-1] + self.n_pos - self.starts[-1]

    def index(self, segment: int, position: int) -> int:
        """The packed run's position (as hooks see it) of ``position`` in ``segment``."""
        if not self.starts[segment] <= position < self.n_pos:
            raise InputError(f"expected a position in {self.starts[segment]}..{self.n_pos - 1} for segment "
                             f"{segment}, found {position}")
        return self.n_pos + self.offsets[segment] + position - self.starts[segment]

    def positions(self) -> Tensor:
        """``[length]`` each packed token's position in its own sequence."""
        return torch.cat([torch.arange(s, self.n_pos) for s in self.starts])

    def segment_ids(self) -> Tensor:
        """``[length]`` each packed token's segment."""
        return torch.cat([torch.full((self.n_pos - s,), i) for i, s in enumerate(self.starts)])


def _packed_allowed(pack: Pack, window: Optional[int]) -> Tensor:
    """``[length, n_pos + length]`` bool: which keys each packed query attends to: the cached row's
    positions before its segment's start, and its own segment's positions up to itself (within
    ``window`` positions when the layer slides)."""
    T, N = pack.n_pos, pack.length
    qpos, seg = pack.positions(), pack.segment_ids()
    start = torch.tensor(pack.starts)[seg]
    kpos = torch.cat([torch.arange(T), qpos])
    prefix = torch.arange(T)[None, :] < start[:, None]
    own = (seg[:, None] == seg[None, :]) & (torch.arange(N)[None, :] <= torch.arange(N)[:, None])
    allowed = torch.cat([prefix, own], 1)
    if window:
        allowed &= (qpos[:, None] - kpos[None, :]) < int(window)
    return allowed


def _packed_mask(sm: "SteerModel", pack: Pack, dtype: torch.dtype, device):
    """The packed run's attention mask in the form the model takes: ``[1, 1, q, k]`` (bool for sdpa,
    additive for eager attention), or one per layer type for models with sliding-window layers."""
    cfg = sm.adapter.text_config(sm.hf_model)
    impl = ImplementationSwitch.base_of(getattr(sm.hf_model.config, "_attn_implementation", None))
    if impl not in ("eager", "sdpa"):
        raise InputError(f"expected eager or sdpa attention to run packed sequences, found {impl!r}; use "
                         "run_from (one start per pass)")
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)

    def form(allowed: Tensor) -> Tensor:
        allowed = allowed.to(device)[None, None]
        if impl == "sdpa":
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)

    if types and set(types) <= {"full_attention", "sliding_attention"}:
        return {t: form(_packed_allowed(pack, window if t == "sliding_attention" else None)) for t in set(types)}
    return form(_packed_allowed(pack, window))


def run_packed(sm: "SteerModel", site: Union[int, str], cache: RunCache, pack: Pack, *, row: int = 0,
               positions: Optional[Sequence[int]] = None) -> Float[Tensor, "segments kept vocab"]:
    """Run several continuations of ``cache``'s row ``row`` in ONE pass, each from its own first position
    (the segments of ``pack``), all starting at block ``site`` as :func:`run_from` does: each segment
    attends to the cached keys and values before its start and to itself. Returns each segment's logits
    at ``positions`` (absolute; default every position), ``[segments, len(positions), vocab]``, positions
    before a segment's start taken from the cache. Only those positions are unembedded.

    Hooks see one row whose positions ``n_pos ..`` are the segments: an edit of segment ``i`` at position
    ``p`` goes at ``pack.index(i, p)`` (:class:`Pack`). Needs eager or sdpa attention, and refuses
    attention pattern hooks: attention runs one whole sequence per segment, with the keys and the mask a
    full pass has (:mod:`steerkit.hooks.segments`), so the values round as a full pass's do.

    Examples:
        >>> from steerkit.reuse import Pack, run_cached, run_packed
        >>> toks = tiny.tokenize(["When Mary and John went"])
        >>> rc = run_cached(tiny, toks)
        >>> v = torch.randn(64)
        >>> edits = {1: steerkit.Intervention.add("blocks.1.hook_resid_pre", v, positions=[1]),
        ...          3: steerkit.Intervention.add("blocks.1.hook_resid_pre", v, positions=[3])}
        >>> pack = Pack.of([1, 3], rc.n_pos)  # positions 1..4, then 3..4
        >>> with tiny.steer(edits[1].at([pack.index(0, 1), pack.index(1, 3)])):  # both edits, one spec
        ...     both = run_packed(tiny, 1, rc, pack, positions=[-1])
        >>> with tiny.steer(edits[3]):
        ...     alone = tiny.forward(toks)[:, -1]
        >>> tuple(both.shape), torch.allclose(both[1], alone, atol=1e-5)
        ((2, 1, 49152), True)
    """
    _need_backend(sm)
    _need_cache(sm, cache)
    if not isinstance(pack, Pack) or pack.n_pos != cache.n_pos:
        raise InputError(f"expected a Pack over the cache's {cache.n_pos} positions (Pack.of(starts, "
                         f"{cache.n_pos})), found {pack!r:.80}")
    if not 0 <= row < cache.batch:
        raise InputError(f"expected row in 0..{cache.batch - 1}, found {row!r}")
    if not bool(cache.tokens.attention_mask[row].bool().all()):
        raise InputError("expected an unpadded cached row to run packed segments from, found padding; cache "
                         "the prompt alone")
    layer, T = start_block(sm, site), cache.n_pos
    want = list(range(T)) if positions is None else [int(p) % T for p in positions]
    if positions is not None and any(not -T <= int(p) < T for p in positions):
        raise InputError(f"expected positions in {-T}..{T - 1}, found {list(positions)!r:.80}")
    dev = cache.tokens.input_ids.device
    qpos = pack.positions()
    ids_row = cache.tokens.input_ids[row]
    ids = ids_row[qpos.to(dev)][None]
    resid = cache.resid[layer][row][qpos.to(cache.resid[layer].device)][None]
    keep_idx = sorted({pack.index(i, p) - T for i, s in enumerate(pack.starts) for p in want if p >= s})
    kv = _prefix_kv(sm, cache, torch.tensor([row]), T)  # the whole row: every segment reads its own prefix
    mask = _packed_mask(sm, pack, resid.dtype, dev)
    full_ids = torch.cat([ids_row[None], ids], 1)
    with _autograd(sm), sm.hooks.runs.running(torch.ones_like(full_ids), full_ids) as run:
        run.chunk_start = T
        logits, _ = sm.backend.run_blocks(ids, mask, qpos.to(dev)[None], kv, layer, resid,
                                          keep=torch.tensor(keep_idx, device=dev),
                                          segments=Segments.of(list(pack.starts), T).to(dev))
    at = {k: j for j, k in enumerate(keep_idx)}
    base = T - int(cache.logits.shape[1])  # run_cached(keep=k) kept the last k positions only
    if any(p < min(base, s) for s in pack.starts for p in want):
        raise InputError(f"expected the cached logits of positions {min(want)}.. (before a segment's start), found "
                         f"the last {T - base} only; run_cached(..., keep=0) or ask for later positions")
    out = cache.logits[row, [max(p - base, 0) for p in want]].unsqueeze(0).repeat(len(pack.starts), 1, 1)
    for i, s in enumerate(pack.starts):
        for j, p in enumerate(want):
            if p >= s:
                out[i, j] = logits[0, at[pack.index(i, p) - T]]
    return out


def _prefix_kv(sm: "SteerModel", cache: RunCache, idx: Tensor, start: int):
    """A cache holding the cached rows' keys and values of positions ``0 .. start-1`` at every layer."""
    kv = sm.backend.new_cache(full=True)
    if start == 0:
        return kv
    for i, lay in enumerate(cache.kv.layers):
        k, v = lay.keys, lay.values
        kv.update(k[:, :, :start].index_select(0, idx.to(k.device)), v[:, :, :start].index_select(0, idx.to(v.device)),
                  i)
    return kv


def _fill_below(sm: "SteerModel", kv, cache: RunCache, idx: Tensor, layer: int, T: int) -> None:
    """Put the cached rows' keys and values of the blocks that were not run into ``kv``, so it holds all
    ``T`` positions at every layer."""
    for i in range(layer):
        src = cache.kv.layers[i]
        k, v = src.keys.index_select(0, idx.to(src.keys.device)), src.values.index_select(0, idx.to(src.keys.device))
        lay = kv.layers[i]
        have = lay.get_seq_length()
        if have:  # positions before start are there already
            k, v = k[:, :, have:], v[:, :, have:]
        lay.update(k, v)
