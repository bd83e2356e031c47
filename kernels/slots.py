"""Steering slots: a table of fixed capacity an engine refills in place, and the steering of a step's rows by it.

An inference engine that compiles its model (``torch.compile``, CUDA graphs) runs Python hooks only while
tracing. To steer inside a compiled graph, each steered site calls one operator that reads **persistent
buffers** instead of Python state:

* :class:`SteerSlots`: one :class:`~steerkit.kernels.SteerTable` of fixed capacity (``configs`` rows, ``basis``
  directions, ``region`` dimensions and ``halfspaces``) plus each row's norm-preservation flag, allocated once;
  an engine writes a steering's tables into rows of it (:meth:`SteerSlots.load`) and leaves them there for as
  long as it needs them;
* per site, ``cfg`` (``[max_tokens]`` int64): each token's row of the slots, ``-1`` for a token the site leaves
  untouched, and a device ``flag`` (int32 scalar): whether any token of the step is steered there.

Shapes never change between steps, so a graph is compiled (or a CUDA graph captured) once, however many
requests, artifacts or steps go through it: the engine only writes new values into the buffers, as vLLM's
multi-LoRA does for its adapter weights and indices.

:func:`steer_slots_` steers one site's rows in place, by the implementation chosen from the device
(:func:`~steerkit.kernels.resolve_impl_for`):

* ``"triton"`` (CUDA): one launch of the fused kernel over the whole slots table, in place: a row with ``-1``
  is neither read twice nor written, a tile of such rows reads nothing more, and with the flag at 0 every
  program returns after one read; no host synchronisation, so it can be captured in a CUDA graph. It runs
  ablation / clamp, gate, injection and per-row norm preservation; a region projection only when the caller
  says the step has one (``stages``), which an engine replaying CUDA graphs never does (its solve iterates);
* ``"torch"`` on the CPU: the rows with a configuration, through :func:`~steerkit.kernels.fused_steer_ref`,
  with only the stages the step uses; on another accelerator (no Triton there): the same reference over every
  row, the untouched ones selected back, without reading a value on the host.

Both are the arithmetic every other path of steerkit runs: the Triton kernel and its torch reference.

Examples:
    >>> from steerkit.kernels import SteerConfig, SteerTable
    >>> slots = SteerSlots(configs=4, d_model=8, basis=2)
    >>> slots.load(SteerTable.from_configs([SteerConfig.injection(torch.ones(8), 2.0)]), offset=1)
    (False, False, True, False)
    >>> cfg = torch.tensor([1, -1, 1])  # rows 0 and 2 use slot 1; row 1 is untouched
    >>> x = torch.zeros(3, 8)
    >>> steer_slots_(x, None, cfg, torch.tensor(1, dtype=torch.int32), slots)
    >>> x[:, 0].tolist()
    [2.0, 0.0, 2.0]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor

from . import _backend
from .config import SteerConfigError, SteerTable
from .fused import _launch_fused  # the launcher imports Triton on first launch
from .reference import DEFAULT_REGION_MAX_ITER, DEFAULT_REGION_TOL, fused_steer_ref

#: the fields of a :class:`SteerTable`, in the order they are stored
FIELDS = ("basis", "strength", "target", "gate_dir", "gate_thr", "gate_sign", "add", "add_scale",
          "region_mean", "region_proj", "region_W", "region_c", "region_s", "region_step")
#: the kernel's stages, in order, and the table fields each reads
STAGE_FIELDS = {"ablate": ("basis", "strength", "target"), "gate": ("gate_dir", "gate_thr", "gate_sign"),
                "add": ("add", "add_scale"),
                "region": ("region_mean", "region_proj", "region_W", "region_c", "region_s", "region_step")}
#: what a CUDA-graph engine's operator runs at every step: every stage but the region projection
GRAPH_STAGES = (True, True, True, False)


@dataclass(frozen=True)
class SlotShape:
    """The capacities of :class:`SteerSlots`, without their tensors (what a front end checks a
    request against).

    Examples:
        >>> from steerkit.kernels import SteerConfig, SteerTable
        >>> SlotShape(8, basis=1).fits(SteerTable.from_configs([SteerConfig.ablation(torch.eye(8)[:2])]))
        'a basis of 2 directions (the slots hold 1)'
    """

    d_model: int
    configs: int = 512
    basis: int = 8
    region: int = 8
    halfspaces: int = 16

    def fits(self, table: SteerTable) -> Optional[str]:
        """Why ``table`` does not fit rows of slots of this shape (``None`` when it fits)."""
        if table.d_model != self.d_model:
            return f"d_model {table.d_model} (the slots hold {self.d_model})"
        if table.n_configs > self.configs:
            return f"{table.n_configs} configurations (the slots hold {self.configs})"
        if table.basis is not None and table.basis.shape[1] > self.basis:
            return f"a basis of {table.basis.shape[1]} directions (the slots hold {self.basis})"
        if table.region_proj is not None and table.region_proj.shape[1] > self.region:
            return f"a region of {table.region_proj.shape[1]} dimensions (the slots hold {self.region})"
        if table.region_W is not None and table.region_W.shape[1] > self.halfspaces:
            return f"a region of {table.region_W.shape[1]} half-spaces (the slots hold {self.halfspaces})"
        if table.schedule is not None:
            return "a per-layer schedule in the table (fold it into the configurations)"
        return None


class SteerSlots:
    """A :class:`SteerTable` of fixed capacity, allocated once and refilled in place, with each row's
    norm-preservation flag (``norm``, nonzero: the row keeps the norm of what it steers).

    ``configs`` rows; ablation / clamp bases of up to ``basis`` directions; regions of up to
    ``region`` dimensions and ``halfspaces`` half-spaces. An empty row is the identity: zero basis
    and strength, no gate (sign 0), zero injection, region strength 0, no norm preservation.

    Examples:
        >>> slots = SteerSlots(configs=16, d_model=576, basis=4)
        >>> slots.table.basis.shape, slots.table.add.shape, slots.nbytes() // 1024
        (torch.Size([16, 4, 576]), torch.Size([16, 576]), 549)
    """

    def __init__(self, configs: int, d_model: int, *, basis: int = 8, region: int = 8, halfspaces: int = 16,
                 device=None, dtype: torch.dtype = torch.float32):
        if min(configs, d_model, basis, region, halfspaces) < 1:
            raise SteerConfigError(f"expected positive slot capacities, found configs={configs}, d_model={d_model}, "
                                   f"basis={basis}, region={region}, halfspaces={halfspaces}")
        C, d = int(configs), int(d_model)
        self.configs, self.d_model, self.basis, self.region, self.halfspaces = C, d, basis, region, halfspaces
        self.shape = SlotShape(d, configs=C, basis=basis, region=region, halfspaces=halfspaces)

        def z(*shape):
            return torch.zeros(*shape, device=device, dtype=dtype)
        self.table = SteerTable(
            n_configs=C, d_model=d, basis=z(C, basis, d), strength=z(C, basis), target=z(C, basis),
            gate_dir=z(C, d), gate_thr=z(C), gate_sign=z(C), add=z(C, d), add_scale=z(C),
            region_mean=z(C, d), region_proj=z(C, region, d), region_W=z(C, halfspaces, region),
            region_c=z(C, halfspaces), region_s=z(C), region_step=torch.ones(C, device=device, dtype=dtype))
        self.norm = z(C)
        self._views: dict[tuple, SteerTable] = {}

    @property
    def tensors(self) -> list[Tensor]:
        """The table's tensors (:data:`FIELDS` order) and the norm flags."""
        return [getattr(self.table, f) for f in FIELDS] + [self.norm]

    def nbytes(self) -> int:
        """Bytes held by the slots' tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def fits(self, table: SteerTable) -> Optional[str]:
        """Why ``table`` does not fit rows of these slots (``None`` when it fits)."""
        return self.shape.fits(table)

    def clear(self, offset: int, n: int) -> None:
        """Make rows ``offset .. offset + n - 1`` the identity."""
        rows = slice(offset, offset + n)
        for name in FIELDS:
            getattr(self.table, name)[rows].fill_(1.0 if name == "region_step" else 0.0)
        self.norm[rows].fill_(0.0)

    def load(self, table: SteerTable, offset: int, preserve_norm: bool = False) -> tuple[bool, bool, bool, bool]:
        """Write ``table``'s configurations into rows ``offset ..`` (padding each to the capacities), each
        keeping norms when ``preserve_norm``, and return the stages they use: ``(ablate, gate, add, region)``."""
        why = self.fits(table)
        if why is not None:
            raise SteerConfigError(f"expected a table that fits the steering slots, found {why}; raise the "
                                   "capacity (SteerSlots(configs=, basis=, region=, halfspaces=))")
        n, t = table.n_configs, self.table
        if offset < 0 or offset + n > self.configs:
            raise SteerConfigError(f"expected rows {offset}..{offset + n - 1} inside the {self.configs} slots, "
                                   "found them outside; raise the capacity (SteerSlots(configs=))")
        self.clear(offset, n)
        rows = slice(offset, offset + n)
        stages = []
        for names in STAGE_FIELDS.values():
            used = getattr(table, names[0]) is not None
            stages.append(used)
            if not used:
                continue
            for name in names:
                src = getattr(table, name)
                if src is None:
                    continue
                dst = getattr(t, name)[rows]
                if name == "basis" and src.shape[0] == 1 and n > 1:  # one basis shared by every config
                    src = src.expand(n, *src.shape[1:])
                dst[tuple(slice(0, s) for s in src.shape)].copy_(src)
        self.norm[rows].fill_(1.0 if preserve_norm else 0.0)
        return tuple(stages)  # type: ignore[return-value]

    def view(self, stages: Sequence[bool]) -> SteerTable:
        """The whole table with only the fields of ``stages`` (``(ablate, gate, add, region)``): views of the
        persistent tensors, so it stays valid when rows are refilled."""
        key = tuple(bool(s) for s in stages)
        hit = self._views.get(key)
        if hit is None:
            kw: dict[str, Any] = {name: getattr(self.table, name) if used else None
                                  for used, names in zip(key, STAGE_FIELDS.values()) for name in names}
            hit = self._views[key] = SteerTable(n_configs=self.configs, d_model=self.d_model, **kw)
        return hit

    def rows(self, stages: Sequence[bool], which: Tensor) -> SteerTable:
        """The configurations ``which`` (row indices) of the table, with only the fields of ``stages``: a small
        table of copies, for the host path (its reference is linear in the table's size)."""
        kw: dict[str, Any] = {name: getattr(self.table, name).index_select(0, which) if used else None
                              for used, names in zip(stages, STAGE_FIELDS.values()) for name in names}
        return SteerTable(n_configs=int(which.numel()), d_model=self.d_model, **kw)

    def __repr__(self) -> str:
        return (f"SteerSlots(configs={self.configs}, d_model={self.d_model}, basis={self.basis}, "
                f"region={self.region}, halfspaces={self.halfspaces})")


def steer_slots_(x: Float[Tensor, "tokens d_model"], residual: Optional[Float[Tensor, "tokens d_model"]],
                 cfg: Int[Tensor, " max_tokens"], flag: Int[Tensor, ""], slots: SteerSlots, *,
                 stages: Optional[Sequence[bool]] = None, impl: str = "auto") -> None:
    """Steer the rows of ``x`` in place: row ``i`` by row ``cfg[i]`` of the slots (``-1``: untouched); with
    ``residual`` (a decoder layer's output pair, whose sum is the residual stream) a steered row becomes
    ``x = 0``, ``residual = steered(x + residual)`` and other rows are untouched. ``flag``: the site's device
    flag (0: no row is steered). ``stages``: the stages the step's rows use (``(ablate, gate, add,
    region)``); ``None`` for every stage but the region (:data:`GRAPH_STAGES`, what a captured graph runs).

    Examples:
        >>> from steerkit.kernels import SteerConfig, SteerTable
        >>> slots = SteerSlots(configs=2, d_model=4, basis=1)
        >>> stages = slots.load(SteerTable.from_configs([SteerConfig.ablation(torch.eye(4)[:1])]), offset=0)
        >>> x, on = torch.ones(2, 4), torch.tensor(1, dtype=torch.int32)
        >>> steer_slots_(x, None, torch.tensor([0, -1]), on, slots, stages=stages)
        >>> x.tolist()
        [[0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
        >>> h, r = torch.ones(2, 4), torch.ones(2, 4)
        >>> steer_slots_(h, r, torch.tensor([0, -1]), on, slots)
        >>> (h + r).tolist(), h[0].tolist()
        ([[0.0, 2.0, 2.0, 2.0], [2.0, 2.0, 2.0, 2.0]], [0.0, 0.0, 0.0, 0.0])
    """
    T = x.shape[0]
    c = cfg[:T]
    use = GRAPH_STAGES if stages is None else tuple(bool(s) for s in stages)
    if not any(use):
        return
    if _backend.resolve_impl_for(impl, x.device) == "triton":
        _launch_fused(x, slots.view(use), c, None, 1.0, False, DEFAULT_REGION_TOL, DEFAULT_REGION_MAX_ITER,
                      out=x, residual=residual, flag=flag, row_norm=slots.norm)
        return
    if x.device.type != "cpu":  # an accelerator without Triton: every row, no host synchronisation
        _steer_dense_(x, residual, c, flag, slots, use)
        return
    if not bool(flag):  # on the host the flag costs nothing to read
        return
    rows = torch.nonzero(c >= 0).squeeze(1)
    if rows.numel() == 0:
        return
    used, g = torch.unique(c.index_select(0, rows), return_inverse=True)  # the configurations these rows use
    h = x.index_select(0, rows)
    if residual is not None:
        h = h + residual.index_select(0, rows)
    keep = slots.norm.index_select(0, used).index_select(0, g) != 0
    new = fused_steer_ref(h, slots.rows(use, used), g, None, preserve_norm=keep if bool(keep.any()) else False)
    if residual is None:
        x.index_copy_(0, rows, new.to(x.dtype))
    else:
        x.index_fill_(0, rows, 0)
        residual.index_copy_(0, rows, new.to(residual.dtype))


def _steer_dense_(x: Tensor, residual: Optional[Tensor], c: Tensor, flag: Tensor, slots: SteerSlots,
                  stages: tuple) -> None:
    """:func:`steer_slots_` on an accelerator without the Triton kernel: the reference over every row, the
    inactive ones selected back, with no value read on the host (so it can be captured in a graph)."""
    active = (c >= 0) & (flag != 0)
    g = c.clamp_min(0)
    h = x if residual is None else x + residual
    keep = slots.norm.index_select(0, g) != 0
    new = fused_steer_ref(h, slots.view(stages), g, active, preserve_norm=keep).to(x.dtype)
    a = active[:, None]
    if residual is None:
        x.copy_(torch.where(a, new, x))
    else:
        residual.copy_(torch.where(a, new.to(residual.dtype), residual))
        x.masked_fill_(a, 0)
