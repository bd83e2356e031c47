"""One engine step's steering plan: which token rows each hooked site edits, with which configuration.

An inference server flattens a step's batch into rows ``[total_tokens, d_model]``: request ``i``
owns rows ``start_i:end_i`` (a prefill chunk or one decode token), each row with its absolute
position in the sequence. :func:`plan_step` takes those blocks and each request's
:class:`~steerkit.serving.spec.Resolved` operations and returns, per site, a :class:`SitePlan`:
the rows to edit, one stacked ``SteerTable`` (cached across steps by the configurations in it),
and each row's index into it. A hook then makes ONE ``fused_steer`` call on those rows
(:meth:`SitePlan.apply`); rows of unsteered requests are never touched.

Position rules per operation: ``"all"``, ``"prompt"`` (position < prompt length), ``"generated"``
(position >= prompt length: the tokens the model produced, fed back), ``"last"`` (the last prompt
token) or a tuple of absolute positions. Rows where several operations of one site apply get their
combination (``Resolved.combined``), made once per (spec, site, subset) and cached.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, Optional, Sequence

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor


@dataclasses.dataclass
class Block:
    """The rows of one request in this step."""

    start: int
    end: int
    positions: np.ndarray  # [end - start] absolute positions
    n_prompt: int
    resolved: Any  # spec.Resolved


@dataclasses.dataclass
class SitePlan:
    rows: Tensor  # [n] int64 row indices into the flattened step
    table: Any  # SteerTable
    row_config: Tensor  # [n] int32

    def apply(self, h: Float[Tensor, "tokens d_model"]) -> Float[Tensor, "tokens d_model"]:
        """``h`` with this plan's rows steered (a new tensor; ``h`` is not modified)."""
        from steerkit.kernels import fused_steer
        out = h.clone()
        out[self.rows] = fused_steer(h[self.rows], self.table, row_config=self.row_config, validate=False)
        return out

    def steered(self, h: Float[Tensor, "n d_model"]) -> Float[Tensor, "n d_model"]:
        """The steered values of this plan's rows, given those rows of the hidden states."""
        from steerkit.kernels import fused_steer
        return fused_steer(h, self.table, row_config=self.row_config, validate=False)


def rule_mask(rule, pos: np.ndarray, n_prompt: int) -> np.ndarray:
    if rule == "all":
        return np.ones(pos.shape, dtype=bool)
    if rule == "prompt":
        return pos < n_prompt
    if rule == "generated":
        return pos >= n_prompt
    if rule == "last":
        return pos == n_prompt - 1
    return np.isin(pos, np.asarray(rule, dtype=np.int64))


class TableCache:
    """``SteerTable`` per tuple of configurations (by identity), least recently used dropped."""

    def __init__(self, d_model: int, device, max_entries: int = 512):
        self.d_model, self.device, self.max = d_model, device, max_entries
        self._d: "OrderedDict[tuple, tuple]" = OrderedDict()

    def get(self, configs: Sequence[Any]):
        from steerkit.kernels import SteerTable
        key = tuple(id(c) for c in configs)
        hit = self._d.get(key)
        if hit is not None:
            self._d.move_to_end(key)
            return hit[0]
        table = SteerTable.from_configs(list(configs), d_model=self.d_model, device=self.device)
        self._d[key] = (table, list(configs))  # keep the configs alive: their ids are the key
        while len(self._d) > self.max:
            self._d.popitem(last=False)
        return table


def plan_step(blocks: Sequence[Block], tables: TableCache, device=None) -> dict:
    """``{site: SitePlan}`` for this step (empty when no block is steered)."""
    per_site: dict = {}
    for b in blocks:
        if b.resolved is None or b.end <= b.start:
            continue
        pos = np.asarray(b.positions, dtype=np.int64)
        for site, ops in b.resolved.sites.items():
            bits = np.zeros(pos.shape, dtype=np.int64)
            for j, op in enumerate(ops):
                bits |= rule_mask(op.positions, pos, b.n_prompt).astype(np.int64) << j
            for v in np.unique(bits):
                if v == 0:
                    continue
                rows = np.nonzero(bits == v)[0] + b.start
                per_site.setdefault(site, []).append((rows, b.resolved.combined(site, int(v))))
    plans = {}
    for site, parts in per_site.items():
        configs, index, rows, rc = [], {}, [], []
        for r, cfg in parts:
            j = index.setdefault(id(cfg), len(configs))
            if j == len(configs):
                configs.append(cfg)
            rows.append(r)
            rc.append(np.full(len(r), j, dtype=np.int32))
        plans[site] = SitePlan(rows=torch.from_numpy(np.concatenate(rows)).to(device),
                               table=tables.get(configs),
                               row_config=torch.from_numpy(np.concatenate(rc)).to(device))
    return plans


def single_request_plan(resolved: Any, n_tokens: int, n_prompt: int, start_pos: int = 0,
                        tables: Optional[TableCache] = None, d_model: Optional[int] = None) -> dict:
    """The plan for one request's rows ``[start_pos, start_pos + n_tokens)`` (for tests and notebooks)."""
    tables = tables or TableCache(d_model, None)
    blk = Block(0, n_tokens, np.arange(start_pos, start_pos + n_tokens), n_prompt, resolved)
    return plan_step([blk], tables)
