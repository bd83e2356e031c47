"""The hook manager: scoped recording and editing of named activations.

Data flow: a caller asks :class:`HookManager` to ``record`` or ``edit`` some
hook names. The manager validates everything first (names, vectors,
positions), then registers one *hook function* per site with the backend
inside an :class:`contextlib.ExitStack`; if any registration fails, the stack
unwinds and nothing is left behind. Every registration returns a
:class:`HookHandle`; a handle removes exactly its own hooks (idempotently),
so nested scopes unwind in any order. ``reset()`` removes everything the
manager ever registered.

A hook function has the signature ``fn(x, call) -> Tensor | None`` where ``x``
is ``[batch, pos, features]`` and ``call`` is a :class:`SiteCall` telling which
chunk of positions this call covers; returning a tensor replaces the
activation. Backends (``steerkit.backends``) translate sites into PyTorch
hooks, TransformerLens hook points, or nnsight interventions, and hand each
site's activations over in its own shape; a :class:`SiteView` turns the
component hooks' shapes (``[batch, pos, heads, d_head]``, attention matrices
``[batch, heads, q, k]``) into rows of features for the hook functions and
back, so recording and every intervention see one layout.
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
from torch import Tensor

from steerkit.errors import HookNameError, InputError
from steerkit.hooks.names import EXPERT_OUT, HEAD_HOOKS, MATRIX_HOOKS, MLP_HOOKS, RECORD_ONLY, Site, parse, record_only_error
from steerkit.hooks.positions import PositionSpec, RunState, chunk_mask, selects_generated, validate_positions


@dataclass(slots=True)
class SiteCall:
    """One call of a hooked site: positions ``[start, start + T)`` of run ``run``.

    Examples:
        >>> call = SiteCall(start=0, T=3, B=1, run=RunState(torch.tensor([[0, 1, 1]])))
        >>> call.mask("last", "cpu").tolist(), call.mask("all", "cpu").tolist()
        ([[False, False, True]], [[False, True, True]])
    """

    start: int
    T: int
    B: int
    run: Optional[RunState]
    tail: tuple = ()  # the per-position shape of the site's own activations ((heads, d_head), ...)

    def mask(self, spec: PositionSpec, device) -> Optional[Tensor]:
        return chunk_mask(spec, self.run, self.start, self.T, self.B, device)


HookFn = Callable[[Tensor, SiteCall], Optional[Tensor]]


class SiteView:
    """How a site's own activations map to rows of features ``[batch, pos, features]``.

    ``"heads"``: ``[batch, pos, heads, d_head]`` <-> ``[batch, pos, heads * d_head]`` (also the per-expert
    outputs ``[batch, pos, n_experts, d_model]``);
    ``"matrix"``: ``[batch, heads, q, k]`` <-> ``[batch, q, heads * k]`` (positions are queries);
    ``None``: already ``[batch, pos, features]``.

    Examples:
        >>> view = SiteView.of(parse("blocks.0.attn.hook_z", n_layers=4))
        >>> x = torch.randn(2, 5, 4, 16)  # [batch, pos, heads, d_head]
        >>> view.kind, tuple(view.flat(x).shape), torch.equal(view.unflat(view.flat(x), x), x)
        ('heads', (2, 5, 64), True)
    """

    __slots__ = ("kind",)

    def __init__(self, kind: Optional[str]):
        self.kind = kind

    @staticmethod
    def of(site: Site) -> "SiteView":
        heads = site.kind in HEAD_HOOKS or site.kind == EXPERT_OUT
        return SiteView("heads" if heads else "matrix" if site.kind in MATRIX_HOOKS else None)

    def flat(self, x: Tensor) -> Tensor:
        if self.kind == "heads":
            return x.flatten(-2)
        if self.kind == "matrix":
            return x.transpose(1, 2).flatten(-2)
        return x

    def tail(self, x: Tensor) -> tuple:
        if self.kind == "heads":
            return tuple(x.shape[-2:])
        if self.kind == "matrix":
            return (int(x.shape[1]), int(x.shape[3]))
        return ()

    def unflat(self, y: Tensor, like: Tensor) -> Tensor:
        if self.kind == "heads":
            return y.unflatten(-1, tuple(like.shape[-2:]))
        if self.kind == "matrix":
            return y.unflatten(-1, (like.shape[1], like.shape[3])).transpose(1, 2)
        return y

    def wrap(self, fn: HookFn, tracker: "PositionTracker") -> tuple[HookFn, "PositionTracker"]:
        """``fn`` and ``tracker`` for a backend that hands over the site's own shape."""
        if self.kind is None:
            return fn, tracker
        view = self

        def on_view(x, call):
            y = fn(view.flat(x), call)
            return None if y is None else view.unflat(y, x)
        return on_view, _ViewedTracker(tracker, view)  # type: ignore[return-value]


class _ViewedTracker:
    """A :class:`PositionTracker` reading positions from a site's rows of features."""

    __slots__ = ("tracker", "view")

    def __init__(self, tracker: "PositionTracker", view: SiteView):
        self.tracker, self.view = tracker, view

    def call(self, x: Tensor) -> SiteCall:
        c = self.tracker.call(self.view.flat(x))
        c.tail = self.view.tail(x)
        return c


class PositionTracker:
    """Tracks, per site, where in the sequence each call starts (KV-cache steps).

    Examples:
        >>> holder = RunHolder()
        >>> tracker = PositionTracker(holder)
        >>> with holder.running(torch.ones(1, 4, dtype=torch.long)):
        ...     prompt = tracker.call(torch.zeros(1, 4, 8))  # the prompt pass
        ...     step = tracker.call(torch.zeros(1, 1, 8))  # one decoding step
        >>> (prompt.start, prompt.T), (step.start, step.T)
        ((0, 4), (4, 1))
    """

    def __init__(self, state: "RunHolder"):
        self.state = state
        self.run_id: object = None
        self.offset = 0

    def call(self, x: Tensor) -> SiteCall:
        run = self.state.run
        B, T = int(x.shape[0]), int(x.shape[1])
        if run is None:
            return SiteCall(0, T, B, None)
        if run.run_id != self.run_id:
            self.run_id, self.offset = run.run_id, 0
        if run.chunk_start is not None:  # the caller placed this chunk (a re-run step repeats positions)
            self.offset = run.chunk_start
        c = SiteCall(self.offset, T, B, run)
        self.offset += T
        return c


class RunHolder:
    """The current :class:`RunState`, shared by every hook of one model.

    Examples:
        >>> holder = RunHolder()
        >>> with holder.running(torch.ones(2, 3, dtype=torch.long)) as run:
        ...     print(holder.run is run, run.batch, run.prompt_len)
        True 2 3
        >>> holder.run is None
        True
    """

    _ids = itertools.count(1)

    def __init__(self):
        self.run: Optional[RunState] = None

    @contextlib.contextmanager
    def running(self, attention_mask: Tensor, input_ids: Optional[Tensor] = None):
        """A new run over a prompt batch; ``input_ids`` (``[batch, P]``) lets token-pattern specs see tokens."""
        prev = self.run
        self.run = RunState(attention_mask, next(self._ids), input_ids)
        try:
            yield self.run
        finally:
            self.run = prev


class HookHandle:
    """Removes the hooks of one registration; usable as a context manager.

    Examples:
        >>> h = tiny.edit("blocks.0.hook_resid_post", add=torch.ones(64))
        >>> h.active, tiny.hook_count() > 0
        (True, True)
        >>> h.remove()
        >>> h.active, tiny.hook_count()
        (False, 0)
    """

    def __init__(self, removers: list[Callable[[], None]], manager: "HookManager", label: str = ""):
        self._removers = removers
        self._manager = manager
        self.label = label
        self.active = True
        #: the :class:`~steerkit.interventions.CompiledSteering` a steer handle installed (None for a record)
        self.compiled = None
        manager._handles.append(self)

    @property
    def decisions(self) -> dict:
        """``{condition: bool tensor [batch]}``: where each condition of the installed steering fired
        on the latest run (``{}`` without conditions), see
        :attr:`steerkit.interventions.CompiledSteering.decisions`."""
        return {} if self.compiled is None else self.compiled.decisions

    def remove(self) -> None:
        if not self.active:
            return
        self.active = False
        errors = []
        for r in reversed(self._removers):
            try:
                r()
            except Exception as e:  # keep removing the others
                errors.append(e)
        self._removers = []
        try:
            self._manager._handles.remove(self)
        except ValueError:
            pass
        if errors:
            raise errors[0]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
        return False

    def __repr__(self):
        return f"HookHandle({self.label!r}, active={self.active})"


class RecordHandle(HookHandle):
    """The handle of a record scope: ``with sm.record(...) as cache`` gives its :class:`ActivationCache`
    (also ``handle.cache``); the recorded values stay readable after the hooks are removed.

    Examples:
        >>> handle = tiny.record("blocks.1.hook_resid_post", positions="last")
        >>> _ = tiny.forward(["hello", "good morning"], chat=False)
        >>> handle.remove()
        >>> tuple(handle.cache["blocks.1.hook_resid_post"].shape)
        (2, 64)
    """

    cache: "ActivationCache"
    #: whether the recorded positions include generated tokens (generation then feeds the last one)
    records_generated: bool = False

    def __enter__(self) -> "ActivationCache":
        return self.cache


class RowArena:
    """Bump allocator that keeps recorded rows on the CPU in a few large blocks.

    Why: a record scope keeps many small tensors alive (a ``[batch, d_model]`` row set per hook per
    forward pass) while each forward allocates and frees large transient activations. With glibc,
    the small long-lived blocks land between the transients on the heap (after the first large
    free glibc raises its mmap threshold), the freed space can no longer be returned or reused
    whole, and the process's resident memory grew by about 1.4 GiB over 256 recorded prompts while
    the recorded data was 17 MiB (``benchmarks/bench_record.py``). Copying the rows into blocks of
    ``block_bytes`` (above glibc's largest mmap threshold, so always their own mapping, touched
    only as they fill) keeps them off the heap: the growth is then the recorded data itself.
    Only CPU rows go through the arena; rows on an accelerator stay with its caching allocator.

    Examples:
        >>> arena = RowArena()
        >>> rows = [arena.keep(torch.full((2, 4), float(i))) for i in range(3)]
        >>> [r[0, 0].item() for r in rows]
        [0.0, 1.0, 2.0]
        >>> rows[0].untyped_storage().data_ptr() == rows[2].untyped_storage().data_ptr()  # one block
        True
    """

    block_bytes = 64 << 20

    def __init__(self):
        self._blocks: dict[torch.dtype, tuple[Tensor, int]] = {}

    def keep(self, v: Tensor) -> Tensor:
        """A copy of ``v`` inside the arena (``v`` itself when it is not on the CPU or is large)."""
        if v.device.type != "cpu":
            return v
        n, size = v.numel(), v.element_size()
        if n * size * 4 > self.block_bytes or n == 0:
            return v.clone() if v._base is not None else v  # big enough to be its own mapping
        buf, used = self._blocks.get(v.dtype, (None, 0))
        if buf is None or used + n > buf.numel():
            buf, used = torch.empty(self.block_bytes // size, dtype=v.dtype), 0
        out = buf[used:used + n].view(v.shape)
        out.copy_(v)
        self._blocks[v.dtype] = (buf, used + n)
        return out


class ActivationCache:
    """Recorded activations keyed by hook name.

    Shapes: with ``positions="last"``, ``cache[name]`` is ``[batch, d_model]``.
    Otherwise it is ``[batch, n, d_model]``: the selected positions of each row
    in sequence order, left-aligned and zero-padded to the longest row;
    ``cache.lengths(name)`` ``[batch]`` gives each row's count and
    ``cache.positions(name)`` ``[batch, n]`` the absolute position of each
    entry (``-1`` on padding; generated tokens have positions >= the padded
    prompt length). Several forward calls inside one scope append along the
    batch axis. A position recorded twice in one run (a generation step that was
    re-run, as representation recycling does) keeps its last recording.
    Component hooks keep their own shape: ``[batch, n, heads, d_head]`` for ``attn.hook_q`` / ``k`` /
    ``v`` / ``z``, ``[batch, n, n_experts, d_model]`` for ``mlp.hook_expert_out``,
    ``[batch, heads, n, k_pos]`` for ``attn.hook_pattern`` / ``hook_attn_scores`` (the
    recorded positions are queries; over a generation each step's keys are padded to the longest with
    what the causal mask gives there: probability 0, the lowest score), with ``"last"`` the ``n`` axis
    dropped.

    Examples:
        >>> names = ["blocks.0.hook_resid_post", "blocks.3.hook_resid_post"]
        >>> with tiny.record(names) as cache:
        ...     _ = tiny.forward(["hi", "hello there friend"], chat=False)
        >>> cache.lengths(names[1]).tolist(), cache.positions(names[1]).tolist()
        ([1, 3], [[2, -1, -1], [0, 1, 2]])
        >>> tuple(cache[names[1]].shape), tuple(cache.stack().shape)
        ((2, 3, 64), (2, 2, 3, 64))
    """

    def __init__(self, names: list[str], positions: PositionSpec, device=None):
        self.names = list(names)
        self.spec = positions
        self.device = device
        self._runs: dict[str, list[dict]] = {n: [] for n in names}
        self._final: dict[str, tuple[Tensor, Tensor, Tensor]] = {}
        self._tails: dict[str, tuple] = {}
        self._arena = RowArena()

    # --- filled by hooks ---------------------------------------------------------
    def _segment(self, name: str, call: SiteCall) -> dict:
        segs = self._runs[name]
        rid = call.run.run_id if call.run is not None else None
        if not segs or segs[-1]["rid"] != rid or rid is None and call.start == 0 and segs[-1]["closed"]:
            run = call.run
            segs.append({"rid": rid, "B": call.B, "b": [], "p": [], "v": [], "t": [], "closed": False,
                         "n": None if run is None else run.n_real(), "gen": run is not None and run.generating})
        return segs[-1]

    def _add(self, name: str, x: Tensor, call: SiteCall) -> None:
        b, t = self._selected(call, x.device)
        self._keep(name, b, t, x.reshape(-1, x.shape[-1]) if b is None else x[b, t], call)

    def _selected(self, call: SiteCall, device) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """The (row, position-in-chunk) pairs this cache's positions select in ``call``; ``(None, None)``:
        every one of the chunk's ``B * T`` positions, in row-major order."""
        mask = call.mask(self.spec, device)
        if mask is None:
            return None, None
        b, t = mask.nonzero(as_tuple=True)
        return b, t

    def _keep(self, name: str, b: Optional[Tensor], t: Optional[Tensor], v: Tensor, call: SiteCall) -> None:
        """Keep the rows ``v`` ``[n, features]`` of the positions ``(b, t)`` (:meth:`_selected`) of ``call``."""
        self._final.pop(name, None)
        seg = self._segment(name, call)
        if b is None or t is None:
            b, t = torch.meshgrid(torch.arange(call.B), torch.arange(call.T), indexing="ij")
            b, t = b.reshape(-1), t.reshape(-1)
        v = v.detach()
        if self.device is not None:
            v = v.to(self.device)
        keep = self._arena.keep
        seg["b"].append(keep(b.cpu()))
        seg["p"].append(keep((t + call.start).cpu()))
        seg["v"].append(keep(v))
        seg["t"].append(call.tail)
        self._tails[name] = call.tail
        if call.run is None:
            seg["closed"] = True

    # --- read --------------------------------------------------------------------
    def _build(self, name: str, keep: bool = True):
        """``(values, positions, lengths)`` of ``name``, built once and kept (``keep=False``: built
        and not kept, for a caller that copies it anyway, like :meth:`stack`)."""
        if name in self._final:
            return self._final[name]
        if name not in self._runs:
            raise HookNameError(f"expected one of the recorded hooks {self.names}, found {name!r}; record it first")
        segs = self._runs[name]
        if not segs:
            raise InputError(f"nothing was recorded at {name!r}: run sm.forward(...) or sm.generate(...) "
                             "inside the record scope")
        # attention matrices: each generation step has more keys; pad every chunk to the most
        keys = max((t[1] for seg in segs for t in seg["t"] if len(t) == 2 and self._is_matrix(name)), default=None)
        vals, rows, poss, n_rows = [], [], [], 0
        for seg in segs:
            vs = seg["v"]
            if keys is not None:
                scores = name.endswith("hook_attn_scores")
                vs = [_pad_keys(v, t, keys, scores) for v, t in zip(vs, seg["t"])]
            vals += vs
            rows += [b + n_rows for b in seg["b"]]  # the rows of every segment, one after another
            poss += seg["p"]
            n_rows += seg["B"]
        v, b, p = torch.cat(vals), torch.cat(rows), torch.cat(poss)
        # each row's entries in position order (stable); a position recorded twice in one run (a
        # re-run step, as representation recycling does) keeps its last recording
        key = b * (int(p.max()) + 2 if p.numel() else 1) + p
        order = torch.argsort(key, stable=True)
        ks = key[order]
        last = torch.ones_like(ks, dtype=torch.bool)
        last[:-1] = ks[1:] != ks[:-1]
        order = order[last]
        bs, ps = b[order], p[order]
        lengths = torch.bincount(bs, minlength=n_rows)
        n = int(lengths.max()) if n_rows else 0
        if n == 0 and isinstance(self.spec, str) and self.spec == "generated" and not any(seg["gen"] for seg in segs):
            lens = [int(x) for seg in segs if seg["n"] is not None for x in seg["n"].tolist()]
            raise InputError(f"expected positions='generated' to select generated tokens at {name!r}, found none: "
                             f"only forward passes ran in this record scope (prompt lengths in tokens: {lens}), "
                             "and they generate nothing; record inside sm.generate(...), or use positions='all', "
                             "'prompt', 'last' or token indices")
        col = torch.arange(bs.numel()) - (torch.cumsum(lengths, 0) - lengths)[bs]
        out = torch.zeros(n_rows, n, v.shape[-1], dtype=v.dtype, device=v.device)
        out[bs.to(v.device), col.to(v.device)] = v[order.to(v.device)]
        pos = torch.full((n_rows, n), -1, dtype=torch.long)
        pos[bs, col] = ps
        tail = self._tails.get(name, ())
        if tail:
            out = out.unflatten(-1, (tail[0], -1))  # [batch, n, heads, d_head | k_pos]
            if self._is_matrix(name):
                out = out.transpose(1, 2)  # [batch, heads, n, k_pos]
        if keep:
            self._final[name] = (out, pos, lengths)
        return out, pos, lengths

    def _is_matrix(self, name: str) -> bool:
        return name.rsplit(".", 2)[-2:] in (["attn", "hook_pattern"], ["attn", "hook_attn_scores"])

    def __getitem__(self, name: str) -> Tensor:
        return self._value(name)

    def _value(self, name: str, keep: bool = True) -> Tensor:
        out, _, lengths = self._build(name, keep)
        if self.spec == "last":
            if bool((lengths != 1).any()):
                raise InputError(f"expected one last-prompt-token activation per row at {name!r}, "
                                 f"found counts {lengths.tolist()}")
            return out[:, :, 0] if self._is_matrix(name) else out[:, 0]
        return out

    def positions(self, name: str) -> Tensor:
        return self._build(name)[1]

    def lengths(self, name: str) -> Tensor:
        return self._build(name)[2]

    def keys(self):
        return list(self.names)

    def items(self):
        return [(n, self[n]) for n in self.names]

    def __contains__(self, name) -> bool:
        return name in self._runs

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)

    def stack(self, names: Optional[Iterable[str]] = None) -> Tensor:
        """``[n_hooks, batch, ...]``: the named (default: all) hooks stacked, e.g. every layer."""
        # each hook built, copied into the stack and dropped: the peak is the recorded rows, the
        # stacked result and one hook's values, not a kept copy of every hook besides
        names = list(names or self.names)
        first = self._value(names[0], keep=False)
        out = first.new_empty((len(names), *first.shape))
        out[0] = first
        del first
        for i, n in enumerate(names[1:], 1):
            v = self._value(n, keep=False)
            if v.shape != out.shape[1:]:
                raise InputError(f"expected every stacked hook to have the shape of {names[0]!r} "
                                 f"{tuple(out.shape[1:])}, found {tuple(v.shape)} at {n!r}; stack hooks of one kind")
            out[i] = v
        return out

    def clear(self) -> None:
        self._runs = {n: [] for n in self.names}
        self._final = {}
        self._tails = {}
        self._arena = RowArena()


def _picker(names: list[str], sites: list[Site], heads, neurons):
    """``(x, call) -> (x, call)`` keeping only some heads / neurons of every recorded site (``None``:
    keep everything)."""
    if heads is None and neurons is None:
        return None
    if heads is not None and neurons is not None:
        raise InputError("expected heads= (attention component hooks) or neurons= (MLP hooks), found both")
    chosen = [heads] if isinstance(heads, int) else heads if heads is not None else \
        [neurons] if isinstance(neurons, int) else neurons
    try:
        idx = [int(i) for i in chosen]
    except (TypeError, ValueError):
        raise InputError(f"expected {'heads' if heads is not None else 'neurons'} as a list of indices, found "
                         f"{chosen!r:.60}") from None
    if not idx or min(idx) < 0 or len(set(idx)) != len(idx):
        raise InputError(f"expected distinct non-negative indices, found {idx}")
    for site in sites:
        ok = site.kind in (HEAD_HOOKS + MATRIX_HOOKS + (EXPERT_OUT,)) if heads is not None else site.kind in MLP_HOOKS
        if not ok:
            raise InputError(f"expected only {'attention component (or expert output)' if heads is not None else 'MLP'} "
                             "hooks when "
                             f"recording with {'heads' if heads is not None else 'neurons'}=, found {site.name!r}; "
                             "record it in another scope")
    sel = torch.tensor(idx, dtype=torch.long)
    units = "experts" if all(site.kind == EXPERT_OUT for site in sites) else "heads"

    def pick(x: Tensor, call: SiteCall):
        width = x.shape[-1]
        if heads is None:
            if max(idx) >= width:
                raise InputError(f"expected neurons below {width} (d_mlp), found {max(idx)}")
            return x[..., sel.to(x.device)], call
        H, m = call.tail
        if max(idx) >= H:
            raise InputError(f"expected {units} in 0..{H - 1}, found {max(idx)}")
        cols = (sel[:, None] * m + torch.arange(m)[None]).reshape(-1).to(x.device)
        return x[..., cols], SiteCall(call.start, call.T, call.B, call.run, (len(idx), m))
    return pick


def _pad_keys(v: Tensor, tail: tuple, keys: int, scores: bool) -> Tensor:
    """Rows ``[n, heads * k]`` of an attention matrix padded to ``keys`` keys per head with what a query
    that does not attend there has: probability 0, or the dtype's lowest score."""
    h, k = tail
    if k == keys:
        return v
    fill = torch.finfo(v.dtype).min if scores else 0.0
    return torch.nn.functional.pad(v.unflatten(-1, (h, k)), (0, keys - k), value=fill).flatten(-2)


class HookManager:
    """Registers record and edit hooks on a backend, each behind a handle.

    Examples:
        >>> mgr = tiny.hooks
        >>> mgr.parse("blocks.2.mlp.hook_post").layer, len(mgr.handles)
        (2, 0)
        >>> with mgr.record("blocks.2.mlp.hook_post", positions="last") as cache:
        ...     _ = tiny.forward("hi", chat=False)
        >>> tuple(cache["blocks.2.mlp.hook_post"].shape), len(mgr.handles)
        ((1, 128), 0)
    """

    def __init__(self, backend, n_layers: int, d_model: int, has_resid_mid: bool = True):
        self.backend = backend
        self.n_layers = n_layers
        self.d_model = d_model
        self.has_resid_mid = has_resid_mid
        self.runs = RunHolder()
        self._handles: list[HookHandle] = []
        #: the sparse autoencoders attached to this model, by site (:class:`steerkit.saesites.SAEHandle`)
        self.saes: dict[str, Any] = {}

    def parse(self, name: str) -> Site:
        return parse(name, self.n_layers, has_resid_mid=self.has_resid_mid, sae_sites=self.saes)

    def _names(self, hooks) -> list[str]:
        if isinstance(hooks, str):
            hooks = [hooks]
        hooks = list(hooks)
        if not hooks:
            raise InputError("expected at least one hook name, found an empty list")
        for h in hooks:
            self.parse(h)
        return hooks

    def register(self, sites: list[tuple[Site, HookFn]], label: str = "", cls: type | None = None) -> "HookHandle":
        """Register ``fn`` at each site; all or nothing."""
        removers: list[Callable[[], None]] = []
        with contextlib.ExitStack() as stack:
            for site, fn in sites:
                fn, tracker = SiteView.of(site).wrap(fn, PositionTracker(self.runs))
                r = self.backend.register(site, fn, tracker)
                removers.append(r)
                stack.callback(r)
            stack.pop_all()  # success: keep them
        return (cls or HookHandle)(removers, self, label)

    # --- public ------------------------------------------------------------------
    def record(self, hooks, positions: PositionSpec = "all", *, device=None, heads=None,
               neurons=None) -> "RecordHandle":
        """Record ``hooks`` at ``positions``; the handle's ``cache`` fills during every forward pass.
        ``heads`` / ``neurons`` keep only those heads (attention component hooks) or neurons (MLP hooks).
        An attached SAE's sub-sites (``{site}.hook_sae_acts_post`` ...) are computed by the SAE's own hook
        for this cache (:mod:`steerkit.saesites`)."""
        names = self._names(hooks)
        positions = validate_positions(positions)
        cache = ActivationCache(names, positions, device=device)
        pick = _picker(names, [self.parse(n) for n in names], heads, neurons)

        def make(name):
            def fn(x, call):
                if pick is not None:
                    x, call = pick(x, call)
                cache._add(name, x, call)
                return None
            return fn

        sites = [self.parse(n) for n in names]
        h = self.register([(s, make(s.name)) for s in sites if s.parent is None], label=f"record {names}",
                          cls=RecordHandle)
        assert isinstance(h, RecordHandle)
        # an attached SAE's sub-sites: its hook at the site computes them for this cache
        try:
            for host in dict.fromkeys(s.parent for s in sites if s.parent is not None):
                h._removers.append(self.saes[host].subscribe(cache, [s.name for s in sites if s.parent == host]))
        except BaseException:
            h.remove()
            raise
        h.cache = cache
        h.records_generated = selects_generated(positions)
        return h

    def install(self, compiled, label: str = "steer") -> HookHandle:
        """Register a :class:`~steerkit.interventions.CompiledSteering`: each site's program is its
        hook function (all sites or none); a record-only site (``ln_final.hook_scale``) raises
        :class:`InputError`."""
        sites = [(self.parse(site), program) for site, program in compiled]
        for site, _ in sites:
            if site.kind in RECORD_ONLY:
                raise record_only_error(site.name)
        h = self.register(sites, label=label)
        h.compiled = compiled
        return h

    def reset(self) -> None:
        """Remove every hook this manager registered (the escape hatch)."""
        for h in list(self._handles):
            h.remove()
        self.backend.reset()

    @property
    def handles(self) -> list[HookHandle]:
        return list(self._handles)
