"""One engine step's steering as the host runs it: which rows of the flattened batch each request owns, and each
request's own compiled steering applied to them.

An inference server flattens a step's batch into rows ``[total_tokens, d_model]``: request ``i`` owns rows
``start_i:end_i`` (a prefill chunk or one decode token), each row with its absolute position in the sequence
(:class:`Block`, :func:`runner_requests`). Each request's steering is resolved and compiled once
(:func:`steerkit.serving.spec.resolve`, the compile the local backends use); an engine normally steers a step
through its steering slots (:class:`steerkit.serving.slots.StepSlots`: every request's tables in one table,
one kernel call per site). A step the slots cannot run (conditional steering, whose decisions are taken on the
host during the step; a torch operation such as an SAE latent clamp; more tables than the slots hold) is
steered by :class:`StepPlan` instead: at each site, each request's rows through that request's
:class:`~steerkit.interventions.SiteProgram`, with its positions evaluated by
:func:`steerkit.interventions.server_mask_of` (the position vocabulary of :mod:`steerkit.hooks.positions`
with the request's prompt length) and its CAST decisions held across steps by :class:`RequestConditions`.
A transcoder's clamp reads its block's MLP input (:meth:`StepPlan.read`, at the read-only site
``blocks.{l}.mlp.hook_in``) and edits the MLP's output later in the step; requests run in the same order at
every site, so each reads its own rows (:class:`steerkit.interventions.SiteReads` keeps them in order), also
when requests share one compiled steering.
Rows of unsteered requests are never touched.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.errors import InputError
from steerkit.interventions import KERNEL_OPS, CompiledSteering, Condition, Decisions, When, server_mask_of
from steerkit.kernels.slots import SlotShape


@dataclasses.dataclass
class Block:
    """The rows of one request in this step: ``[start, end)`` of the step's tokens, their absolute positions,
    the request's prompt length and its resolved steering.

    Examples:
        >>> b = Block(4, 6, np.array([7, 8]), n_prompt=8, resolved=None, req_id="r1")
        >>> b.end - b.start, int(b.positions[0]) >= b.n_prompt  # a prompt token, then a generated one
        (2, False)
    """

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
    """A step steered on the host (see the module docstring): at each site, each steered request's rows through
    its own compiled steering, in place. With ``conditions`` (the engine's :class:`RequestConditions`), the sites
    of CAST conditions take their requests' prompt rows into the decisions, and each rule (``when``) selects the
    rows of the requests it fired for.

    Examples:
        >>> from steerkit.serving.spec import parse_spec, resolve
        >>> r = resolve(parse_spec({"ops": [{"op": "add", "layers": [1], "vector": [1.0] * 64, "positions": "last"}]}),
        ...             store=store, facts=tiny.facts)
        >>> plan = StepPlan([Block(0, 3, np.arange(3), 3, r), Block(3, 4, np.array([7]), 7, None)])
        >>> h = torch.zeros(4, 64)
        >>> plan.apply("blocks.1.hook_resid_post", h)[:, 0].tolist()  # the first request's last prompt token
        [0.0, 0.0, 1.0, 0.0]
    """

    def __init__(self, blocks: Sequence[Block], conditions: Optional[RequestConditions] = None):
        self.blocks = [b for b in blocks if b.resolved is not None and b.resolved.compiled is not None
                       and b.end > b.start]
        self.conditions = conditions
        #: whether a request of this step has conditional steering (decided on the host)
        self.conditional = any(b.resolved.conditions for b in self.blocks)
        if self.conditional and conditions is None:
            raise InputError("expected the engine's RequestConditions for a step with conditional steering (CAST), "
                             "found none; pass conditions= to StepPlan")
        self.sites: dict[str, list[int]] = {}  # site -> indices of the blocks steered (or deciding) there
        for j, b in enumerate(self.blocks):
            for site in b.resolved.compiled.programs:
                self.sites.setdefault(site, []).append(j)
        self._masks: dict[int, Any] = {}  # block index -> its server_mask_of, built when first asked
        for b in self.blocks:  # two-site latent edits: nothing an interrupted step stored is read by this one
            if b.resolved.compiled.reads is not None:
                b.resolved.compiled.reads.clear()

    def __contains__(self, site: str) -> bool:
        return site in self.sites

    def __bool__(self) -> bool:
        return bool(self.blocks)

    def _mask_of(self, j: int, device):
        m = self._masks.get(j)
        if m is None:
            b = self.blocks[j]
            m = self._masks[j] = server_mask_of(torch.from_numpy(np.asarray(b.positions, dtype=np.int64)), b.n_prompt)

        def mask_of(spec):
            mask = m(spec)
            return None if mask is None else mask.to(device)
        return mask_of

    def _rule_of(self, b: Block, n: int, device):
        conditions = self.conditions

        def rule_of(when: When) -> Tensor:
            fired = None if conditions is None else conditions.fired(b.req_id, when)
            return torch.full((n,), bool(fired), dtype=torch.bool, device=device)
        return rule_of

    def steer_(self, site: str, x: Float[Tensor, "tokens d_model"],
               residual: Optional[Float[Tensor, "tokens d_model"]] = None) -> None:
        """Steer ``site``'s rows of this step in place: ``x``, or with ``residual`` the stream ``x + residual``
        (a decoder layer's output pair), written back as ``x = 0``, ``residual = steered`` on the rows that
        change."""
        for j in self.sites.get(site, ()):
            b = self.blocks[j]
            rows = slice(b.start, b.end)
            h = x[rows] if residual is None else x[rows] + residual[rows]
            new = self._run(j, site, h)
            if new is None:
                continue
            if residual is None:
                x[rows] = new.to(x.dtype)
            else:
                x[rows] = 0
                residual[rows] = new.to(residual.dtype)

    def _run(self, j: int, site: str, h: Tensor) -> Optional[Tensor]:
        """Block ``j``'s program at ``site`` on its rows ``h``: its conditions observe them, then it steers them (a
        new tensor, or ``None``). Blocks run in the same order at every site, so requests sharing one compiled
        steering each read their own rows from its :class:`~steerkit.interventions.SiteReads` (kept in order)."""
        b = self.blocks[j]
        program = b.resolved.compiled.programs[site]
        if self.conditions is not None:
            for c in program.conditions:  # the values as they arrive, before this site's own edits
                self.conditions.observe(b.req_id, c, h, b.positions, b.n_prompt)
        return program.apply(h, None, self._mask_of(j, h.device), rule_of=self._rule_of(b, b.end - b.start, h.device))

    def read(self, site: str, x: Float[Tensor, "tokens d_model"]) -> None:
        """Show ``site``'s rows of this step to the programs there without changing them: a read-only site (the
        input a transcoder's clamp encodes, ``blocks.{l}.mlp.hook_in``), whose programs store the rows for the
        edit at the transcoder's output site later in the step."""
        for j in self.sites.get(site, ()):
            b = self.blocks[j]
            new = self._run(j, site, x[b.start:b.end])
            if new is not None:
                raise InputError(f"expected no edit at the read-only site {site!r}, found one for request "
                                 f"{b.req_id!r}; a server edits only the sites of "
                                 "steerkit.serving.spec.SERVER_SITES")

    def apply(self, site: str, h: Float[Tensor, "tokens d_model"]) -> Float[Tensor, "tokens d_model"]:
        """``h`` (every row of the step) with ``site``'s rows steered, as a new tensor."""
        out = h.clone()
        self.steer_(site, out)
        return out


def single_request_plan(resolved: Any, n_tokens: int, n_prompt: int, start_pos: int = 0,
                        conditions: Optional[RequestConditions] = None) -> StepPlan:
    """The plan for one request's rows at positions ``[start_pos, start_pos + n_tokens)`` (for tests and
    notebooks).

    Examples:
        >>> from steerkit.serving.spec import parse_spec, resolve
        >>> r = resolve(parse_spec({"ops": [{"op": "add", "layers": [0], "vector": [1.0] * 64}]}), store=store,
        ...             facts=tiny.facts)
        >>> single_request_plan(r, 2, 2).apply("blocks.0.hook_resid_post", torch.zeros(2, 64))[:, 0].tolist()
        [1.0, 1.0]
    """
    return StepPlan([Block(0, n_tokens, np.arange(start_pos, start_pos + n_tokens), n_prompt, resolved)],
                    conditions)


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


def slot_refusal(steering: CompiledSteering, shape: SlotShape) -> Optional[str]:
    """Why a request's compiled ``steering`` cannot run through steering slots of this ``shape`` (``None``: it
    can): conditional steering (decided on the host), an operation other than the fused kernel's, or a site
    table larger than the slots.

    Examples:
        >>> add = steerkit.Intervention.add("blocks.1.hook_resid_post", torch.ones(64))
        >>> slot_refusal(tiny.compile([add]), SlotShape(64)) is None
        True
        >>> slot_refusal(tiny.compile([add]), SlotShape(32))
        "d_model 64 (the slots hold 32) at 'blocks.1.hook_resid_post'"
    """
    if steering.conditions:
        return "conditional steering (CAST conditions are decided on the host, during the step)"
    for site, program in steering.programs.items():
        if program.steps:
            ops = sorted({step.intervention.op for step in program.steps})
            return f"{ops} at {site!r} (the steering slots run {list(KERNEL_OPS)}, the fused kernel's operations)"
        if program.table is not None:
            why = shape.fits(program.table)
            if why is not None:
                return f"{why} at {site!r}"
    need = sum(p.table.n_configs for p in steering.programs.values() if p.table is not None)
    if need > shape.configs:
        return f"{need} configurations (the slots hold {shape.configs})"
    return None


__all__ = ["Block", "RequestConditions", "StepPlan", "SLOTS_ENV", "SLOT_DEFAULTS", "runner_requests",
           "single_request_plan", "slot_capacity", "slot_refusal"]
