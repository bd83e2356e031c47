"""Steering as an operator of the model's graph: fixed-capacity tables and the ``torch.library`` op.

An inference engine that compiles its model (``torch.compile``, CUDA graphs) runs Python hooks only
while tracing. To steer inside a compiled graph, each steered site calls one custom operator,
``torch.ops.steerkit.steer_slots_`` (or ``steer_resid_slots_`` for a decoder layer's
``(hidden, residual)`` pair), that reads **persistent buffers** instead of Python state:

* :class:`SteerSlots`: one :class:`~steerkit.kernels.SteerTable` of fixed capacity (``configs``
  rows, ``basis`` directions, ``region`` dimensions and ``halfspaces``) whose tensors are allocated
  once and refilled in place (:meth:`SteerSlots.load`) before a step; every site's configurations
  of the step sit in it, one contiguous span per site;
* per site a row of ``cfg`` (``[max_tokens]`` int64): each token's configuration index in the slots,
  ``-1`` for a token the site leaves untouched;
* per site a host row of ``info`` (CPU int64, :data:`INFO`): which stages the site's span uses and
  where that span is, and a device flag for norm preservation.

Shapes never change between steps, so a graph is compiled (or a CUDA graph captured) once, however
many requests, artifacts or steps go through it: the engine only writes new values into the
buffers, as vLLM's multi-LoRA does for its adapter weights and indices.

The operator mutates its inputs in place (its schema marks them ``Tensor(a!)``), so untouched rows cost nothing, and
registers a fake implementation (no computation, for tracing). Its arithmetic is
:func:`~steerkit.kernels.fused_steer_ref`, the same reference every other path of steerkit runs:

* **host path** (tensors off CUDA, where the compiled graph calls the operator's Python body at
  every step): only the rows with an index, only the site's span of the slots, only the stages it
  uses; the region projection's iterative solve runs here;
* **dense path** (CUDA tensors, where the operator may be captured into a CUDA graph and must not
  branch on the step's values on the host): every row, the whole slots table, ablation, gate and
  injection; a region projection is not supported there (its solve iterates on the host).

Examples:
    >>> from steerkit.kernels import SteerConfig, SteerTable
    >>> slots = SteerSlots(configs=4, d_model=8, basis=2)
    >>> slots.load(SteerTable.from_configs([SteerConfig.injection(torch.ones(8), 2.0)]), offset=1)
    (False, False, True, False)
    >>> cfg = torch.tensor([1, -1, 1])  # rows 0 and 2 use slot 1; row 1 is untouched
    >>> info = slot_info(stages=(False, False, True, False), offset=1, n=1)
    >>> x = torch.zeros(3, 8)
    >>> steer_slots_(x, cfg, info, torch.tensor(False), slots)
    >>> x[:, 0].tolist()
    [2.0, 0.0, 2.0]
"""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .config import SteerConfigError, SteerTable
from .reference import fused_steer_ref

#: the fields of a :class:`SteerTable`, in the order the operator takes them
FIELDS = ("basis", "strength", "target", "gate_dir", "gate_thr", "gate_sign", "add", "add_scale",
          "region_mean", "region_proj", "region_W", "region_c", "region_s", "region_step")
#: a site's host row: stages used (ablate, gate, add, region), norm preservation, span offset, span size
INFO = ("ablate", "gate", "add", "region", "preserve_norm", "offset", "n")
_STAGES = {"ablate": ("basis", "strength", "target"), "gate": ("gate_dir", "gate_thr", "gate_sign"),
           "add": ("add", "add_scale"),
           "region": ("region_mean", "region_proj", "region_W", "region_c", "region_s", "region_step")}


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
        """Why ``table`` does not fit one span of slots of this shape (``None`` when it fits)."""
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
    """A :class:`SteerTable` of fixed capacity, allocated once and refilled in place.

    ``configs`` rows; ablation / clamp bases of up to ``basis`` directions; regions of up to
    ``region`` dimensions and ``halfspaces`` half-spaces. An empty row is the identity: zero basis
    and strength, no gate (sign 0), zero injection, region strength 0.

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
        self.tensors: list[Tensor] = [getattr(self.table, f) for f in FIELDS]

    def nbytes(self) -> int:
        """Bytes held by the slots' tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def fits(self, table: SteerTable) -> Optional[str]:
        """Why ``table`` does not fit one span of these slots (``None`` when it fits)."""
        return self.shape.fits(table)

    def load(self, table: SteerTable, offset: int) -> tuple[bool, bool, bool, bool]:
        """Write ``table``'s configurations into rows ``offset ..`` (padding each to the capacities)
        and return the stages they use: ``(ablate, gate, add, region)``."""
        why = self.fits(table)
        if why is not None:
            raise SteerConfigError(f"expected a table that fits the steering slots, found {why}; raise the "
                                   "capacity (steerkit.serving: STEERKIT_VLLM_SLOTS)")
        n, t = table.n_configs, self.table
        if offset < 0 or offset + n > self.configs:
            raise SteerConfigError(f"expected rows {offset}..{offset + n - 1} inside the {self.configs} slots, "
                                   "found them outside; raise the capacity (steerkit.serving: STEERKIT_VLLM_SLOTS)")
        rows = slice(offset, offset + n)
        for name in FIELDS:  # empty rows first: the identity
            dst = getattr(t, name)[rows]
            dst.fill_(1.0 if name == "region_step" else 0.0)
        stages = []
        for names in _STAGES.values():
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
        return tuple(stages)  # type: ignore[return-value]

    def __repr__(self) -> str:
        return (f"SteerSlots(configs={self.configs}, d_model={self.d_model}, basis={self.basis}, "
                f"region={self.region}, halfspaces={self.halfspaces})")


def slot_info(stages: Sequence[bool] = (False, False, False, False), preserve_norm: bool = False, offset: int = 0,
              n: int = 0) -> Int[Tensor, " 7"]:
    """A site's host row (:data:`INFO`), on the CPU.

    Examples:
        >>> slot_info((True, False, True, False), offset=3, n=2).tolist()
        [1, 0, 1, 0, 0, 3, 2]
    """
    return torch.tensor([*map(int, stages), int(preserve_norm), int(offset), int(n)], dtype=torch.long)


#: host path only: ``fn(site_index, x, residual_or_None)`` called for a site whose ``info`` row says
#: ``n = -1`` (the step did not fit the slots; the engine steers it from its own plan, in place).
#: Held in one place per process: a test runner may import this file twice (``kernels.slots`` and
#: ``steerkit.kernels.slots``), and the operator runs the copy that registered it.
_STATE_KEY = "steerkit.kernels._slots_state"
_STATE = sys.modules.setdefault(_STATE_KEY, types.ModuleType(_STATE_KEY))
_HOST_FALLBACK: list = _STATE.__dict__.setdefault("fallback", [None])
_SPANS: dict = {}  # (slots storage, info row) -> the span's SteerTable (see _span_table)
_STAGE_FIELDS = tuple(tuple((name, FIELDS.index(name)) for name in names) for names in _STAGES.values())


def set_host_fallback(fn: Optional[Callable[[int, Tensor, Optional[Tensor]], None]]) -> None:
    """Set the host path's fallback: for a site whose ``info`` row has ``n = -1`` (and ``offset`` =
    the site's index), the operator calls ``fn(site_index, x, residual)`` (``residual`` is ``None``
    for :func:`steer_slots_`), which steers ``x`` in place. An engine uses it for a step whose
    steering does not fit its slots; the dense (CUDA) path has none.

    Examples:
        >>> seen = []
        >>> set_host_fallback(lambda i, x, r: seen.append(i))
        >>> steer_slots_(torch.zeros(2, 4), torch.tensor([-1, -1]), slot_info(offset=5, n=-1), torch.tensor(False),
        ...              SteerSlots(configs=1, d_model=4))
        >>> set_host_fallback(None)
        >>> seen
        [5]
    """
    _HOST_FALLBACK[0] = fn


def _span_table(tensors: Sequence[Tensor], row: Sequence[int], d: int) -> SteerTable:
    """The slots' span ``row`` names (views of the persistent tensors), built once per span: the
    views stay valid when the slots are refilled in place, and they keep the storage they view alive,
    so its address (the key) cannot be reused by other slots meanwhile."""
    ab, ga, ad, rg, _, off, n = row
    key = (tensors[0].data_ptr(), tuple(tensors[0].shape), ab, ga, ad, rg, off, n)
    hit = _SPANS.get(key)
    if hit is None:
        if len(_SPANS) >= 4096:
            _SPANS.clear()
        span = slice(off, off + n)
        kw: dict[str, Any] = {name: (tensors[i][span] if used else None)
                                for fields, used in zip(_STAGE_FIELDS, (ab, ga, ad, rg)) for name, i in fields}
        hit = _SPANS[key] = SteerTable(n_configs=n, d_model=d, **kw)
    return hit


def _host_rows(cfg: Tensor, row: Sequence[int], tensors: Sequence[Tensor], T: int, d: int):
    """Host path: ``(rows, their slot indices within the span, the span's table)``, or ``None``
    when the site steers no row of this step (``row``: the site's info row, as ints)."""
    n = row[6]
    if n <= 0:
        return None
    c = cfg[:T]
    rows = torch.nonzero(c >= 0).squeeze(1)
    if rows.numel() == 0:
        return None
    return rows, c.index_select(0, rows) - row[5], _span_table(tensors, row, d), bool(row[4])


def _dense(h: Tensor, cfg: Tensor, preserve: Tensor, tensors: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Dense path (CUDA): ``(active rows, values for every row)`` with no host branch on the step's
    values, so the operator can be captured in a CUDA graph; the region stage is not run."""
    kw: dict[str, Any] = dict(zip(FIELDS, tensors))
    for name in _STAGES["region"]:
        kw[name] = None
    tab = SteerTable(n_configs=tensors[0].shape[0], d_model=h.shape[-1], **kw)
    c = cfg[: h.shape[0]]
    active, g = c >= 0, c.clamp_min(0)
    plain = fused_steer_ref(h, tab, g, active)
    kept = fused_steer_ref(h, tab, g, active, preserve_norm=True)
    return active, torch.where(preserve, kept, plain)


def _steer_in_place(x: Tensor, residual: Optional[Tensor], cfg: Tensor, info: Tensor, preserve: Tensor,
                    tensors: Sequence[Tensor]) -> None:
    """Both operators' body: steer ``x`` (or the stream ``x + residual``, written back as ``x = 0``,
    ``residual = steered``: the next layer, and the final norm, sums the two, and 0 + new is exactly
    new) on the rows ``cfg`` indexes; other rows keep their values."""
    # the host row decides the fallback on every device: an eager CUDA engine uses it; under CUDA graphs
    # this runs at capture only, when no step is planned (graph engines refuse what would need it)
    row = info.tolist()
    if row[6] == -1:  # the step's steering is not in the slots: the engine's fallback steers this site
        fn = _HOST_FALLBACK[0]
        if fn is not None:
            fn(row[5], x, residual)
        return
    if x.is_cuda:
        active, new = _dense(x if residual is None else x + residual, cfg, preserve, tensors)
        a = active[:, None]
        if residual is None:
            x.copy_(torch.where(a, new.to(x.dtype), x))
        else:
            residual.copy_(torch.where(a, new.to(residual.dtype), residual))
            x.masked_fill_(a, 0)
        return
    host = _host_rows(cfg, row, tensors, x.shape[0], x.shape[-1])
    if host is None:
        return
    rows, g, tab, pn = host
    if residual is None:
        x.index_copy_(0, rows, fused_steer_ref(x.index_select(0, rows), tab, g, None, preserve_norm=pn).to(x.dtype))
    else:
        new = fused_steer_ref(x.index_select(0, rows) + residual.index_select(0, rows), tab, g, None, preserve_norm=pn)
        x.index_fill_(0, rows, 0)
        residual.index_copy_(0, rows, new.to(residual.dtype))


def define_op(schema: str, body: Callable[..., None]) -> None:
    """Register ``torch.ops.steerkit.<name>`` from its ``schema`` (``"name(Tensor(a!) x, ...) -> ()"``):
    ``body`` is the kernel for every device, and a fake that computes nothing stands in while tracing.
    Defined with the dispatcher directly (``torch.library.Library``): a ``torch.library.custom_op``
    wrapper adds about 25 us to every call, which a compiled engine pays at every site of every step.
    Once per process: a second call with the same name keeps the first registration.

    Examples:
        >>> seen = []
        >>> define_op("doc_touch_(Tensor(a!) x, int k) -> ()", lambda x, k: seen.append(k))
        >>> torch.ops.steerkit.doc_touch_(torch.zeros(1), 3)
        >>> seen
        [3]
    """
    name = schema.split("(", 1)[0].strip()
    libs = _STATE.__dict__.setdefault("libraries", {})
    if name in libs:
        return
    lib = torch.library.Library("steerkit", "FRAGMENT")
    lib.define(schema)
    lib.impl(name, body, "CompositeExplicitAutograd")
    torch.library.register_fake(f"steerkit::{name}", lambda *args: None, lib=lib)
    libs[name] = lib


define_op("steer_slots_(Tensor(a!) x, Tensor cfg, Tensor info, Tensor preserve, Tensor[] tensors) -> ()",
          lambda x, cfg, info, preserve, tensors: _steer_in_place(x, None, cfg, info, preserve, tensors))
define_op("steer_resid_slots_(Tensor(a!) hidden, Tensor(b!) residual, Tensor cfg, Tensor info, Tensor preserve, "
          "Tensor[] tensors) -> ()", _steer_in_place)


def steer_slots_(x: Float[Tensor, "tokens d_model"], cfg: Int[Tensor, " max_tokens"], info: Int[Tensor, " 7"],
                 preserve: Tensor, slots: SteerSlots) -> None:
    """Steer the rows of ``x`` in place: row ``i`` by slot ``cfg[i]`` (``-1``: untouched); ``info``
    is the site's host row (:func:`slot_info`), ``preserve`` its device norm flag (0-d bool).
    Calls ``torch.ops.steerkit.steer_slots_`` (what a compiled graph records).

    Examples:
        >>> from steerkit.kernels import SteerConfig, SteerTable
        >>> slots = SteerSlots(configs=2, d_model=4, basis=1)
        >>> stages = slots.load(SteerTable.from_configs([SteerConfig.ablation(torch.eye(4)[:1])]), offset=0)
        >>> x = torch.ones(2, 4)
        >>> steer_slots_(x, torch.tensor([0, -1]), slot_info(stages, n=1), torch.tensor(False), slots)
        >>> x.tolist()
        [[0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
    """
    torch.ops.steerkit.steer_slots_(x, cfg, info, preserve, slots.tensors)


def steer_resid_slots_(hidden: Float[Tensor, "tokens d_model"], residual: Float[Tensor, "tokens d_model"],
                       cfg: Int[Tensor, " max_tokens"], info: Int[Tensor, " 7"], preserve: Tensor,
                       slots: SteerSlots) -> None:
    """:func:`steer_slots_` for a decoder layer's output pair, whose sum is the residual stream: a
    steered row becomes ``hidden = 0``, ``residual = steered(hidden + residual)``; other rows are
    untouched. Calls ``torch.ops.steerkit.steer_resid_slots_``.

    Examples:
        >>> from steerkit.kernels import SteerConfig, SteerTable
        >>> slots = SteerSlots(configs=1, d_model=4)
        >>> stages = slots.load(SteerTable.from_configs([SteerConfig.injection(torch.ones(4))]), offset=0)
        >>> h, r = torch.ones(2, 4), torch.ones(2, 4)
        >>> steer_resid_slots_(h, r, torch.tensor([0, -1]), slot_info(stages, n=1), torch.tensor(False), slots)
        >>> (h + r)[:, 0].tolist(), h[0, 0].item()
        ([3.0, 2.0], 0.0)
    """
    torch.ops.steerkit.steer_resid_slots_(hidden, residual, cfg, info, preserve, slots.tensors)
