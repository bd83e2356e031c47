"""One engine step's steering plan: which rows of the flattened batch each hooked site steers, and
the compiled program (:class:`steerkit.interventions.SiteProgram`) that steers them.

An inference server flattens a step's batch into rows ``[total_tokens, d_model]``: request ``i``
owns rows ``start_i:end_i`` (a prefill chunk or one decode token), each row with its absolute
position in the sequence. :func:`plan_step` takes those blocks with each request's
:class:`~steerkit.serving.spec.Resolved` interventions and returns a :class:`StepPlan`. The
steered requests of a step are compiled together by :func:`steerkit.interventions.compile`
(``per_row=True``: one row group per distinct steering), the same compile the local backends use;
the compiled steering is cached by the step's steering keys (:class:`SteeringCache`), so a steady
decode batch compiles once. Per site the plan holds the rows of the requests steered there, their
groups, and ``mask_of``: each request's rows evaluated by
:func:`steerkit.interventions.server_mask_of` (the position vocabulary of :mod:`steerkit.hooks.positions`
with the request's prompt length), concatenated. A hook then calls
``program.apply(h[rows], groups, mask_of)`` (:meth:`StepPlan.steered`); rows of unsteered
requests are never touched.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.bounded import BoundedDict
from steerkit.errors import InputError
from steerkit.interventions import (KERNEL_OPS, CompiledSteering, Condition, Decisions, ModelFacts, SiteProgram, When,
                                   compile, server_mask_of)
from steerkit.kernels.config import SteerConfigError
from steerkit.kernels.slots import SlotShape, SteerSlots, slot_info


@dataclasses.dataclass
class Block:
    """The rows of one request in this step."""

    start: int
    end: int
    positions: np.ndarray  # [end - start] absolute positions (contiguous)
    n_prompt: int
    resolved: Any  # spec.Resolved or None (unsteered)
    req_id: str = ""  # the engine's request id (CAST decisions are held per request)


def runner_requests(runner: Any, key: str):
    """The requests of a vLLM V1 model runner's step that carry ``extra_args[key]``: ``(request id,
    start, end, positions [end - start], prompt length, extra_args[key])``, rows ``start:end`` of the
    flattened batch (``runner.input_batch``, ``query_start_loc``, ``positions``, ``requests``: the
    runner fields listed in :data:`steerkit.serving.vllm_plugin.VLLM_INTERNALS`).

    Examples:
        >>> from types import SimpleNamespace as NS
        >>> req = lambda extra: NS(sampling_params=NS(extra_args=extra), num_prompt_tokens=3)
        >>> runner = NS(input_batch=NS(num_reqs=2, req_ids=["a", "b"]), query_start_loc=NS(np=np.array([0, 3, 4])),
        ...             positions=NS(np=np.array([0, 1, 2, 7])), requests={"a": req({"k": 1}), "b": req(None)})
        >>> [(r, a, b, p.tolist(), n, v) for r, a, b, p, n, v in runner_requests(runner, "k")]
        [('a', 0, 3, [0, 1, 2], 3, 1)]
    """
    num_reqs = runner.input_batch.num_reqs
    qsl = runner.query_start_loc.np[: num_reqs + 1]
    total = int(qsl[num_reqs]) if num_reqs else 0
    positions = runner.positions.np[:total] if hasattr(runner.positions, "np") else \
        runner.positions.cpu().numpy()[:total]
    for i, req_id in enumerate(runner.input_batch.req_ids[:num_reqs]):
        st = runner.requests.get(req_id)
        sp = getattr(st, "sampling_params", None)
        extra = (sp.extra_args or {}) if sp is not None else {}
        if key in extra:
            a, b = int(qsl[i]), int(qsl[i + 1])
            yield req_id, a, b, np.asarray(positions[a:b], dtype=np.int64), int(st.num_prompt_tokens), extra[key]


class SteeringCache:
    """:class:`~steerkit.interventions.CompiledSteering` per tuple of steering keys (one row group per
    key, in that order), least recently used dropped."""

    def __init__(self, facts: ModelFacts, device=None, dtype: torch.dtype = torch.float32, max_entries: int = 128):
        self.facts, self.device, self.dtype = facts, device, dtype
        self._d: BoundedDict[tuple, CompiledSteering] = BoundedDict(max_entries)

    def __len__(self) -> int:
        return len(self._d)

    def get(self, resolved: Sequence[Any]) -> CompiledSteering:
        """The compiled steering of ``resolved`` (distinct keys), row group ``i`` for ``resolved[i]``."""
        key = tuple(r.key for r in resolved)
        hit = self._d.get(key)
        if hit is None:
            hit = self._d[key] = compile([list(r.interventions) for r in resolved], self.facts, per_row=True,
                                         device=self.device, dtype=self.dtype)
        return hit


@dataclasses.dataclass
class SiteRows:
    """The rows of the step one site steers: ``rows`` into the flattened step, each row's ``groups``
    (its request's row group) and the blocks they come from (for ``mask_of``)."""

    program: SiteProgram
    rows: Tensor  # [n] int64
    groups: Tensor  # [n] int64
    blocks: tuple  # indices into StepPlan.blocks


class RequestConditions:
    """The CAST decisions of a server's requests (:class:`steerkit.Condition`), held across steps.

    ``sm.generate`` decides a row's conditions on the forward pass that holds its prompt and holds the
    decision for every later step. A server sees a prompt in one or several prefill chunks; both feed
    the one accumulator, :class:`steerkit.interventions.Decisions` (here one owner per request, one
    row each): at the condition's site it gathers the aggregate of the prompt rows seen (the running
    sum and count for ``"mean"``, the row for ``"last"``) and decides when the prompt's last token
    passes the site. Sites that run after it in that step already see the decision;
    before it (earlier sites, earlier chunks) the request is undecided and its rules select nothing, as
    in ``sm.generate`` for sites before the condition's. Entries of finished requests are dropped by
    :meth:`keep`.

    Examples:
        >>> c = steerkit.Condition("blocks.1.hook_resid_post", torch.ones(64), 0.5, measure="cosine")
        >>> rc = RequestConditions()
        >>> rc.observe("r1", c, torch.ones(2, 64), np.array([0, 1]), n_prompt=4)  # the first chunk
        >>> rc.fired("r1", steerkit.When(c)) is None  # undecided
        True
        >>> rc.observe("r1", c, torch.ones(2, 64), np.array([2, 3]), n_prompt=4)  # the prompt's end
        >>> rc.fired("r1", steerkit.When(c)), round(rc.similarity("r1", c), 3)
        (True, 1.0)
    """

    def __init__(self) -> None:
        self._decisions = Decisions()  # the one accumulator sm.generate uses too; owners: request ids

    def __len__(self) -> int:
        return len(self._decisions.owners())

    def observe(self, req_id: str, c: Condition, x: Float[Tensor, "n width"], positions: np.ndarray,
                n_prompt: int) -> None:
        """Take the rows ``x`` of ``req_id`` at ``c``'s site (their absolute ``positions``) into its
        decision; decide when they hold the prompt's last token. Decided requests are skipped; a chunk
        from the prompt's start (again, after a preemption) starts a fresh aggregate."""
        pos = np.asarray(positions)
        sel = np.flatnonzero(pos < n_prompt)
        if sel.size == 0:
            return
        rows = x[torch.from_numpy(sel).to(x.device)]
        self._decisions.observe(req_id, c, rows[None], None, first=int(pos[sel[0]]) == 0,
                                last=int(pos[sel[-1]]) == n_prompt - 1)

    def fired(self, req_id: str, when: When) -> Optional[bool]:
        """Whether ``when`` selects ``req_id`` (``None`` while one of its conditions is undecided)."""
        sel = self._decisions.selected(req_id, when)
        return None if sel is None else bool(sel[0])

    def similarity(self, req_id: str, c: Condition) -> Optional[float]:
        """``req_id``'s similarity for ``c`` (``None`` while undecided)."""
        sim = self._decisions.similarity(req_id, c)
        return None if sim is None else float(sim[0])

    def keep(self, live) -> None:
        """Drop the entries of requests not in ``live``."""
        self._decisions.keep(live)


class StepPlan:
    """What every hooked site does in one step (see the module docstring). With ``conditions`` (the
    engine's :class:`RequestConditions`), the sites of CAST conditions take their requests' prompt
    rows into the decisions, and each rule (``when``) selects the rows of the requests it fired for."""

    def __init__(self, blocks: Sequence[Block], steering: CompiledSteering, sites: dict, device,
                 conditions: Optional[RequestConditions] = None):
        self.blocks = list(blocks)
        self.steering = steering
        self.sites: dict[str, SiteRows] = sites
        self.device = device
        self.conditions = conditions
        #: whether a request of this step has conditional steering (decided on the host)
        self.conditional = any(b.resolved is not None and b.resolved.conditions for b in self.blocks)
        if self.conditional and conditions is None:
            raise InputError("expected the engine's RequestConditions for a step with conditional steering (CAST), "
                             "found none; pass conditions= to plan_step")
        self._block_masks: dict[int, Any] = {}  # block index -> its server_mask_of, built when first asked
        self._masks: dict = {}  # (block indices, spec id) -> (spec, mask on device | None)

    def __contains__(self, site: str) -> bool:
        return site in self.sites

    def rows(self, site: str) -> Tensor:
        return self.sites[site].rows

    def mask_of(self, site: str):
        """``mask_of(spec)`` over the rows of ``site``: each block's rows through ``server_mask_of``."""
        sr = self.sites[site]

        def mask_of(spec):
            key = (sr.blocks, id(spec))
            hit = self._masks.get(key)
            if hit is not None:
                return hit[1]
            parts = [self._block_mask(i)(spec) for i in sr.blocks]
            if all(m is None for m in parts):
                out = None
            else:
                out = torch.cat([torch.ones(self.blocks[i].end - self.blocks[i].start, dtype=torch.bool)
                                 if m is None else m for i, m in zip(sr.blocks, parts)]).to(self.device)
            self._masks[key] = (spec, out)  # the spec is held: its id cannot be reused meanwhile
            return out
        return mask_of

    def _block_mask(self, i: int):
        m = self._block_masks.get(i)
        if m is None:
            b = self.blocks[i]
            m = self._block_masks[i] = server_mask_of(torch.from_numpy(np.asarray(b.positions, dtype=np.int64)),
                                                      b.n_prompt)
        return m

    def steered(self, site: str, h_rows: Float[Tensor, "n d_model"]) -> Optional[Float[Tensor, "n d_model"]]:
        """The steered values of ``site``'s rows given those rows of the hidden states (``h[rows]``),
        or ``None`` where nothing applies to them in this step."""
        sr = self.sites[site]
        rule_of = None
        if self.conditional:
            self._observe(sr, h_rows)
            rule_of = self._rule_of(sr)
        return sr.program.apply(h_rows, sr.groups, self.mask_of(site), rule_of=rule_of)

    def _observe(self, sr: SiteRows, h_rows: Tensor) -> None:
        """Each request's rows into the decisions of its conditions evaluated at this site (on the
        site's values before its own edits, as ``sm.generate`` evaluates them)."""
        if not sr.program.conditions or self.conditions is None:
            return
        off = 0
        for j in sr.blocks:
            b = self.blocks[j]
            n = b.end - b.start
            mine = b.resolved.conditions
            for c in sr.program.conditions:
                if c in mine:
                    self.conditions.observe(b.req_id, c, h_rows[off:off + n], b.positions, b.n_prompt)
            off += n

    def _rule_of(self, sr: SiteRows):
        """``rule_of(when)``: ``[n]`` bool over the site's rows, true on the rows of requests ``when``
        selects (false while undecided)."""
        assert self.conditions is not None
        conditions, blocks = self.conditions, [self.blocks[j] for j in sr.blocks]

        def rule_of(when):
            parts = [torch.full((b.end - b.start,), bool(conditions.fired(b.req_id, when)), dtype=torch.bool)
                     for b in blocks]
            return torch.cat(parts).to(self.device)
        return rule_of

    def apply(self, site: str, h: Float[Tensor, "tokens d_model"]) -> Float[Tensor, "tokens d_model"]:
        """``h`` (every row of the step) with ``site``'s rows steered: a new tensor, or ``h`` itself
        where nothing applies."""
        rows = self.sites[site].rows
        new = self.steered(site, h[rows])
        if new is None:
            return h
        out = h.clone()
        out[rows] = new.to(h.dtype)
        return out


def plan_step(blocks: Sequence[Block], compiler: SteeringCache,
              conditions: Optional[RequestConditions] = None) -> Optional[StepPlan]:
    """The :class:`StepPlan` of this step, or ``None`` when no block is steered; ``conditions``: the
    engine's :class:`RequestConditions` (needed when a request has conditional steering)."""
    steered = [(i, b) for i, b in enumerate(blocks) if b.resolved is not None and b.end > b.start
               and b.resolved.interventions]
    if not steered:
        return None
    keys: dict[str, int] = {}
    resolved: list = []
    for _, b in sorted(steered, key=lambda t: t[1].resolved.key):  # order-free: reordered batches hit
        if b.resolved.key not in keys:
            keys[b.resolved.key] = len(resolved)
            resolved.append(b.resolved)
    cs = compiler.get(resolved)
    device = compiler.device
    per_site: dict[str, list[int]] = {}
    for j, (_, b) in enumerate(steered):
        for site in dict.fromkeys(b.resolved.sites + b.resolved.condition_sites):
            per_site.setdefault(site, []).append(j)
    plan_blocks = [b for _, b in steered]
    shared: dict = {}  # block subsets shared by several sites share their index tensors
    sites: dict[str, SiteRows] = {}
    for site, js in per_site.items():
        sub = tuple(js)
        if sub not in shared:
            rows = np.concatenate([np.arange(plan_blocks[j].start, plan_blocks[j].end) for j in sub])
            groups = np.concatenate([np.full(plan_blocks[j].end - plan_blocks[j].start, keys[plan_blocks[j].resolved.key])
                                     for j in sub])
            shared[sub] = (torch.from_numpy(rows.astype(np.int64)).to(device),
                           torch.from_numpy(groups.astype(np.int64)).to(device))
        rows_t, groups_t = shared[sub]
        sites[site] = SiteRows(cs.programs[site], rows_t, groups_t, sub)
    return StepPlan(plan_blocks, cs, sites, device, conditions)


def single_request_plan(resolved: Any, n_tokens: int, n_prompt: int, start_pos: int = 0, *,
                        compiler: Optional[SteeringCache] = None, facts: Optional[ModelFacts] = None,
                        device=None, dtype: torch.dtype = torch.float32) -> Optional[StepPlan]:
    """The plan for one request's rows at positions ``[start_pos, start_pos + n_tokens)`` (for tests
    and notebooks); ``compiler`` or the served model's ``facts``."""
    if compiler is None:
        if facts is None:
            raise InputError("expected compiler= or the served model's facts=, found neither")
        compiler = SteeringCache(facts, device, dtype)
    blk = Block(0, n_tokens, np.arange(start_pos, start_pos + n_tokens), n_prompt, resolved)
    return plan_step([blk], compiler)


#: the steering slots' capacities: ``STEERKIT_VLLM_SLOTS="configs=512,basis=8,region=8,halfspaces=16"``
SLOTS_ENV = "STEERKIT_VLLM_SLOTS"
SLOT_DEFAULTS = {"configs": 512, "basis": 8, "region": 8, "halfspaces": 16}


def slot_capacity(value: Optional[str] = None) -> dict:
    """The steering slots' capacities from ``value`` (the text of :data:`SLOTS_ENV`), defaults for
    the rest.

    Examples:
        >>> slot_capacity("configs=64, basis=4")
        {'configs': 64, 'basis': 4, 'region': 8, 'halfspaces': 16}
        >>> slot_capacity("rows=3")
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected STEERKIT_VLLM_SLOTS as name=count pairs with names in ['configs', 'basis', 'region', 'halfspaces'] and positive counts, found 'rows=3'; e.g. STEERKIT_VLLM_SLOTS="configs=512,basis=8"
    """
    out = dict(SLOT_DEFAULTS)
    for part in (value or "").split(","):
        if not part.strip():
            continue
        name, _, count = part.partition("=")
        name = name.strip()
        if name not in out or not count.strip().isdigit() or int(count) < 1:
            raise InputError(f"expected {SLOTS_ENV} as name=count pairs with names in {list(SLOT_DEFAULTS)} and positive "
                             f"counts, found {value!r}; e.g. {SLOTS_ENV}=\"configs=512,basis=8\"")
        out[name] = int(count)
    return out


def slot_refusal(steering: CompiledSteering, slots: Union[SteerSlots, SlotShape]) -> Optional[str]:
    """Why ``steering`` cannot run through steering slots of this capacity (``None``: it can): an
    operation other than the fused kernel's, a site table larger than the slots, or a gate that
    several position specs share."""
    for site, program in steering.programs.items():
        if program.steps:
            ops = sorted({p.op for p, _ in program.steps})
            return (f"{ops} at {site!r} (the steering slots run {list(KERNEL_OPS)}, the fused kernel's operations)")
        if program.table is not None:
            why = slots.fits(program.table)
            if why is not None:
                return f"{why} at {site!r}"
    return None


class StepSlots:
    """The persistent per-step buffers an engine's steering operators read (see
    :mod:`steerkit.kernels.slots`): one :class:`~steerkit.kernels.slots.SteerSlots` for the whole
    step, per site a row of ``cfg`` (each token's slot, ``-1`` untouched), a host ``info`` row and a
    device norm flag. :meth:`fill` writes a :class:`StepPlan` into them before the step (the tables
    only when the step's compiled steering changed); shapes never change.

    Examples:
        >>> add = steerkit.Intervention.add("blocks.1.hook_resid_post", torch.ones(64), 2.0, positions="last")
        >>> steering = compile([[add]], tiny.facts, per_row=True)
        >>> slots = StepSlots(["blocks.1.hook_resid_post"], d_model=64, max_tokens=8, configs=4)
        >>> plan = StepPlan([Block(0, 3, np.arange(3), 3, None)], steering,
        ...                 {"blocks.1.hook_resid_post": SiteRows(steering.programs["blocks.1.hook_resid_post"],
        ...                  torch.arange(3), torch.zeros(3, dtype=torch.long), (0,))}, "cpu")
        >>> slots.fill(plan)
        True
        >>> slots.cfg[0, :4].tolist()  # the last prompt token only
        [-1, -1, 0, -1]
    """

    def __init__(self, sites: Sequence[str], *, d_model: int, max_tokens: int, configs: int = 512, basis: int = 8,
                 region: int = 8, halfspaces: int = 16, device=None, dtype: torch.dtype = torch.float32):
        self.sites = list(sites)
        self.index = {s: i for i, s in enumerate(self.sites)}
        self.max_tokens = int(max_tokens)
        self.slots = SteerSlots(configs, d_model, basis=basis, region=region, halfspaces=halfspaces, device=device,
                                dtype=dtype)
        S = len(self.sites)
        self.cfg = torch.full((S, self.max_tokens), -1, dtype=torch.long, device=device)
        self.info = torch.zeros(S, 7, dtype=torch.long)  # host rows (kernels.slots.INFO)
        self.preserve = torch.zeros(S, dtype=torch.bool, device=device)
        self.device = device
        self._loaded: Optional[CompiledSteering] = None
        self._spans: dict[str, tuple] = {}  # site -> (info row, offset, all positions?) of the loaded steering
        self._idx: dict[str, tuple] = {}  # site -> (its requests' rows, slot index per row): the last step's
        self._dirty: list[int] = []  # sites whose cfg rows the previous step set

    def refusal(self, steering: CompiledSteering) -> Optional[str]:
        """:func:`slot_refusal` for these slots."""
        return slot_refusal(steering, self.slots)

    def clear(self) -> None:
        """No site steers any token (dummy and profiling runs, unsteered steps)."""
        for i in self._dirty:
            self.cfg[i].fill_(-1)
            self.info[i, 6] = 0
        self._dirty = []

    def _load(self, steering: CompiledSteering) -> bool:
        if steering is self._loaded:
            return True
        need = sum(p.table.n_configs for p in steering.programs.values() if p.table is not None)
        if need > self.slots.configs or self.refusal(steering) is not None:
            return False
        spans, off = {}, 0
        for site, program in steering.programs.items():
            if program.table is None or site not in self.index:
                continue
            stages = self.slots.load(program.table, off)
            static = all(spec == "all" for spec in program.specs) and all(w is None for w in program.whens)
            spans[site] = (slot_info(stages, program.preserve_norm, off, program.table.n_configs), off, static)
            self.preserve[self.index[site]] = program.preserve_norm
            off += program.table.n_configs
        self._loaded, self._spans, self._idx = steering, spans, {}
        return True

    def fallback(self, plan: StepPlan) -> None:
        """Mark every site of ``plan`` for the host fallback (:func:`steerkit.kernels.slots.set_host_fallback`):
        the operator hands those sites to the engine, which steers them from ``plan``."""
        self.clear()
        for site in plan.sites:
            i = self.index.get(site)
            if i is not None:
                self.info[i] = slot_info(offset=i, n=-1)
                self._dirty.append(i)

    def nbytes(self) -> int:
        """Bytes of device memory the buffers hold."""
        return self.slots.nbytes() + self.cfg.numel() * 8 + self.preserve.numel()

    def fill(self, plan: Optional[StepPlan]) -> bool:
        """Write ``plan`` into the buffers; ``False`` when it does not fit them (more configurations
        than the slots hold, or an operation they do not run): the buffers then steer nothing and
        the caller steers this step another way."""
        self.clear()
        if plan is None:
            return True
        if plan.conditional:  # CAST decisions are taken on the host, during the step: the plan steers it
            return False
        if any(site not in self.index for site in plan.sites):
            return False
        try:
            if not self._load(plan.steering):
                return False
        except SteerConfigError:
            return False
        if any(len(sr.rows) and int(sr.rows.max()) >= self.max_tokens for sr in plan.sites.values()):
            return False
        for site, sr in plan.sites.items():
            span = self._spans.get(site)
            if span is None:
                continue
            info, off, static = span
            # a site whose every spec selects all positions steers the same slots for the same rows:
            # a steady decode batch reuses the previous step's indices (keyed by its requests' rows)
            sig = tuple((plan.blocks[j].start, plan.blocks[j].end, plan.blocks[j].resolved.key) for j in sr.blocks) \
                if static else None
            hit = self._idx.get(site) if sig is not None else None
            if hit is not None and hit[0] == sig:
                idx = hit[1]
            else:
                sel = sr.program.kernel_rows((len(sr.rows),), sr.rows.device, sr.groups, plan.mask_of(site))
                if sel is None:
                    continue
                active, rc = sel
                idx = torch.full((len(sr.rows),), off, dtype=torch.long, device=sr.rows.device)
                if rc is not None:
                    idx = idx + rc
                if active is not None:
                    idx = torch.where(active, idx, torch.full_like(idx, -1))
                idx = idx.to(self.cfg.device)
                if sig is not None:
                    self._idx[site] = (sig, idx)
            i = self.index[site]
            self.cfg[i, sr.rows] = idx
            self.info[i] = info
            self._dirty.append(i)
        return True


__all__ = ["Block", "RequestConditions", "SiteRows", "SlotShape", "SteeringCache", "StepPlan", "StepSlots", "SLOTS_ENV", "SLOT_DEFAULTS",
           "plan_step", "runner_requests", "single_request_plan", "slot_capacity", "slot_refusal"]
