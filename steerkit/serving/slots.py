"""An engine's steering slots: the persistent buffers its steering operators read, and where each request's
tables sit in them.

:class:`StepSlots` holds one :class:`~steerkit.kernels.slots.SteerSlots` for the whole engine, per hooked site
a row of ``cfg`` (each token's row of the slots, ``-1`` untouched) and a device flag, and the stages each site
uses in the current step. A request's steering is compiled once (:class:`~steerkit.serving.spec.Resolved`:
one program per site); the first step that needs it places each of its site tables into free rows of the slots
(:meth:`StepSlots.place`), where they stay while the engine keeps them (least recently used first out, never one
of the current step's). A step then only writes indices: per request and site, its rows' configurations
(:meth:`~steerkit.interventions.SiteProgram.kernel_rows` on the request's positions, offset by where its table
sits), all sites' indices for the step in one host buffer copied to the device at once; a decoding token's
indices depend only on the request's steering, so they are computed once per steering. Steering several
requests costs no compile and no table copy per combination of requests: each steering is compiled and loaded
once. Shapes never change, so a compiled or captured graph follows whatever is written.

Examples:
    >>> from steerkit.serving.plan import Block
    >>> from steerkit.serving.spec import parse_spec, resolve
    >>> r = resolve(parse_spec({"ops": [{"op": "add", "layers": [1], "vector": [1.0] * 64, "positions": "last"}]}),
    ...             store=store, facts=tiny.facts)
    >>> slots = StepSlots(["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"], d_model=64, max_tokens=8, configs=4)
    >>> slots.fill([Block(0, 3, np.arange(3), 3, r)], total=4)
    True
    >>> slots.cfg[1, :4].tolist(), slots.flag.tolist()  # the last prompt token; nothing at block 0
    ([-1, -1, 0, -1], [0, 1])
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Optional, Sequence

import numpy as np
import torch

from steerkit.interventions import CompiledSteering, server_mask_of
from steerkit.kernels.config import SteerConfigError
from steerkit.kernels.slots import STAGE_FIELDS, SteerSlots

from steerkit.serving.plan import Block, slot_refusal

_N_STAGES = len(STAGE_FIELDS)


@dataclasses.dataclass
class Placed:
    """Where one request steering's site tables sit in the slots: per site index ``(offset, n, stages)``, and
    what a decoding token's row gets at each site (``decode[i]``: its slot index, ``-1``: untouched).

    Examples:
        >>> placed = Placed(spans={1: (0, 1, np.array([False, False, True, False]))}, decode=np.array([-1, 0]),
        ...                 stages=np.array([[False] * 4, [False, False, True, False]]))
        >>> [i for i, row in enumerate(placed.decode) if row >= 0]  # the sites a generated token is steered at
        [1]
    """

    spans: dict  # site index -> (offset, n configurations, stages (ablate, gate, add, region))
    decode: np.ndarray  # [sites] int64
    stages: np.ndarray  # [sites, 4] bool: the stages each site's table uses


class StepSlots:
    """The persistent buffers of an engine's steering operators (see the module docstring).

    ``sites``: the hooked sites, in the order their ``cfg`` rows and flags are kept; ``max_tokens``: the most
    tokens one step holds; ``configs`` / ``basis`` / ``region`` / ``halfspaces``: the slots' capacities.

    Examples:
        >>> from steerkit.serving.engine import RequestSteerings
        >>> res = RequestSteerings(tiny.facts, store=store).get(
        ...     {"ops": [{"op": "add", "layers": [1], "vector": [0.5] * 64}]})
        >>> slots = StepSlots(["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"], d_model=64, max_tokens=8,
        ...                   configs=4, basis=2, region=2, halfspaces=2)
        >>> slots.fill([Block(0, 3, np.arange(3), 3, res)], total=3)
        True
        >>> slots.flag.tolist(), slots.cfg[:, :3].tolist()
        ([0, 1], [[-1, -1, -1], [0, 0, 0]])
        >>> slots.place(res.key, res.compiled).decode.tolist()  # placed by the fill: a generated token's rows
        [-1, 0]
    """

    def __init__(self, sites: Sequence[str], *, d_model: int, max_tokens: int, configs: int = 512, basis: int = 8,
                 region: int = 8, halfspaces: int = 16, device=None, dtype: torch.dtype = torch.float32):
        self.sites = list(sites)
        self.index = {s: i for i, s in enumerate(self.sites)}
        self.max_tokens = int(max_tokens)
        self.slots = SteerSlots(configs, d_model, basis=basis, region=region, halfspaces=halfspaces, device=device,
                                dtype=dtype)
        S = len(self.sites)
        self.device = device
        self.cfg = torch.full((S, self.max_tokens), -1, dtype=torch.long, device=device)
        self.flag = torch.zeros(S, dtype=torch.int32, device=device)
        #: per site, the stages (ablate, gate, add, region) the current step's rows use there (host, [sites, 4])
        self.stages = np.zeros((S, _N_STAGES), dtype=bool)
        pin = torch.device(device).type == "cuda" if device is not None else False
        self._host = torch.full((S, self.max_tokens), -1, dtype=torch.long, pin_memory=pin)
        self._host_flag = torch.zeros(S, dtype=torch.int32, pin_memory=pin)
        self._placed: collections.OrderedDict[str, Placed] = collections.OrderedDict()  # key -> Placed (LRU)
        self._free: list[tuple[int, int]] = [(0, self.slots.configs)]  # free row ranges (offset, n), sorted
        self._refusals: dict[str, Optional[str]] = {}
        self._written = 0  # the tokens the last fill wrote

    def nbytes(self) -> int:
        """Bytes of device memory the buffers hold."""
        return self.slots.nbytes() + self.cfg.numel() * 8 + self.flag.numel() * 4

    def refusal(self, steering: CompiledSteering) -> Optional[str]:
        """Why ``steering`` cannot run through these slots (:func:`~steerkit.serving.plan.slot_refusal`)."""
        return slot_refusal(steering, self.slots.shape)

    # --- where each steering's tables sit -------------------------------------------------------
    def _alloc(self, n: int) -> Optional[int]:
        for j, (off, size) in enumerate(self._free):
            if size >= n:
                self._free[j] = (off + n, size - n)
                if size == n:
                    del self._free[j]
                return off
        return None

    def _release(self, placed: Placed) -> None:
        for off, n, _ in placed.spans.values():
            self.slots.clear(off, n)
            self._free.append((off, n))
        merged: list[tuple[int, int]] = []
        for off, n in sorted(self._free):
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((off, n))
        self._free = merged

    def place(self, key: str, steering: CompiledSteering, keep: frozenset = frozenset()) -> Optional[Placed]:
        """The rows of ``steering``'s site tables (loaded the first time it is asked for), evicting steerings
        not in ``keep`` (least recently used first) to make room; ``None`` when it does not fit."""
        hit = self._placed.get(key)
        if hit is not None:
            self._placed.move_to_end(key)
            return hit
        tables = [(self.index[s], p.table, p.preserve_norm) for s, p in steering.programs.items()
                  if p.table is not None and s in self.index]
        need = sum(t.n_configs for _, t, _ in tables)
        while sum(n for _, n in self._free) < need or self._fragmented(tables):
            victim = next((k for k in self._placed if k not in keep), None)
            if victim is None:
                return None
            self._release(self._placed.pop(victim))
        spans: dict = {}
        stages = np.zeros((len(self.sites), _N_STAGES), dtype=bool)
        for i, table, preserve in tables:
            off = self._alloc(table.n_configs)
            assert off is not None  # _fragmented said every table finds a range
            st = self.slots.load(table, off, preserve)
            spans[i] = (off, table.n_configs, st)
            stages[i] = st
        placed = Placed(spans, self._decode_rows(steering, spans), stages)
        self._placed[key] = placed
        return placed

    def _fragmented(self, tables: list) -> bool:
        """Whether the free ranges cannot take every table (first fit, largest first), though rows are free."""
        free = sorted(n for _, n in self._free)
        for need in sorted((t.n_configs for _, t, _ in tables), reverse=True):
            j = next((k for k, n in enumerate(free) if n >= need), None)
            if j is None:
                return True
            free[j] -= need
        return False

    def _decode_rows(self, steering: CompiledSteering, spans: dict) -> np.ndarray:
        """Each site's slot index for one generated token (any position after the prompt: what the
        position vocabulary selects there does not depend on which)."""
        out = np.full(len(self.sites), -1, dtype=np.int64)
        mask_of = server_mask_of(torch.tensor([1]), 1)
        for i, (off, _, _) in spans.items():
            sel = steering.programs[self.sites[i]].kernel_rows((1,), "cpu", None, mask_of)
            out[i] = _indices(sel, off, 1)[0]
        return out

    # --- one step -------------------------------------------------------------------------------
    def clear(self) -> None:
        """No site steers any token (dummy and profiling runs, unsteered steps, a step the host steers)."""
        self.flag.zero_()
        if self._written:
            self.cfg[:, :self._written].fill_(-1)
            self._written = 0
        self.stages = np.zeros((len(self.sites), _N_STAGES), dtype=bool)

    def fill(self, blocks: Sequence[Block], total: int) -> bool:
        """Write this step's indices: each steered block's rows (of ``total`` tokens in the step) at each site
        its steering acts at. ``False`` when the step cannot run through the slots (conditional steering, an
        operation the kernel does not run, more tables than the slots hold, more tokens than ``max_tokens``):
        the buffers then steer nothing and the caller steers the step another way."""
        self.clear()
        steered = [b for b in blocks if b.resolved is not None and b.resolved.compiled is not None and b.end > b.start]
        if not steered:
            return True
        if total > self.max_tokens:
            return False
        steerings = {b.resolved.key: b.resolved.compiled for b in steered}
        keep = frozenset(steerings)
        at: dict[str, Placed] = {}
        for key, compiled in steerings.items():
            if key not in self._refusals:
                self._refusals[key] = self.refusal(compiled)
            try:
                p = None if self._refusals[key] is not None else self.place(key, compiled, keep)
            except SteerConfigError:
                p = None
            if p is None:
                return False
            at[key] = p
        placed = [at[b.resolved.key] for b in steered]
        host, flag = self._host[:, :total], self._host_flag
        host.fill_(-1)
        flag.zero_()
        hv, fv = host.numpy(), flag.numpy()
        stages = np.zeros((len(self.sites), _N_STAGES), dtype=bool)
        decoding: dict[int, tuple[Placed, list]] = {}  # id(placed) -> its generated tokens' rows
        for b, p in zip(steered, placed):
            if b.end - b.start == 1 and int(b.positions[0]) >= b.n_prompt:  # a generated token
                decoding.setdefault(id(p), (p, []))[1].append(b.start)
                continue
            touched = self._prefill_rows(hv, b, p)
            fv[touched] = 1
            stages[touched] |= p.stages[touched]
        for p, cols in decoding.values():  # each steering's decode indices, for all its tokens at once
            hv[:, cols] = p.decode[:, None]
            touched = p.decode >= 0
            fv[touched] = 1
            stages[touched] |= p.stages[touched]
        self.cfg[:, :total].copy_(host, non_blocking=True)
        self.flag.copy_(flag, non_blocking=True)
        self.stages = stages
        self._written = total
        return True

    def _prefill_rows(self, hv: np.ndarray, b: Block, p: Placed) -> np.ndarray:
        """Write the indices of a prompt chunk (or any block but one generated token); returns the sites it
        touches."""
        touched = np.zeros(len(self.sites), dtype=bool)
        n = b.end - b.start
        mask_of = server_mask_of(torch.from_numpy(np.asarray(b.positions, dtype=np.int64)), b.n_prompt)
        compiled = b.resolved.compiled
        for i, (off, _, _) in p.spans.items():
            sel = compiled.programs[self.sites[i]].kernel_rows((n,), "cpu", None, mask_of)
            if sel is None:
                continue
            hv[i, b.start:b.end] = _indices(sel, off, n)
            touched[i] = True
        return touched


def _indices(sel, off: int, n: int) -> np.ndarray:
    """Slot indices of ``n`` rows from :meth:`~steerkit.interventions.SiteProgram.kernel_rows`'s answer (``None``:
    no row)."""
    if sel is None:
        return np.full(n, -1, dtype=np.int64)
    active, rc = sel
    idx = np.full(n, off, dtype=np.int64) if rc is None else off + rc.cpu().numpy().astype(np.int64)
    if active is not None:
        idx = np.where(active.cpu().numpy(), idx, -1)
    return idx


__all__ = ["Placed", "StepSlots"]
