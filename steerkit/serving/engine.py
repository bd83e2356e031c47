"""One object per engine: the steering of a served model, and the check of each request's steering in front of it.

* :class:`RequestSteerings`: each request's steering resolved and compiled once
  (:func:`steerkit.serving.spec.resolve`), by its spec text, bounded (least recently used out), safe to share
  between threads.
* :class:`FrontEnd`: what a server's front end runs on each request (vLLM's input processor, ``steerkit
  serve``'s middleware): the spec resolved and compiled against the served model once, and, for an engine that
  replays CUDA graphs, refused when it cannot run there (:func:`graph_refusal`, on that same compile).
* :class:`EngineSteering`: a worker's steering, made per model runner: the hooks on the sites
  :func:`steerkit.loading.adapters.vllm_sites` names, the steering operators they call (its own,
  :class:`~steerkit.serving.ops.ObjectOps`), the slots those read (:class:`~steerkit.serving.slots.StepSlots`),
  the requests' steerings, their CAST decisions, and the step being steered. Nothing of it lives anywhere else:
  two engines in one process steer independently.

A step (:meth:`EngineSteering.begin_step`, after vLLM has laid out its batch) writes each steered request's rows
into the slots; each hooked site then calls its operator once, which steers the site's rows in place through
:func:`steerkit.kernels.slots.steer_slots_` (the fused Triton kernel on CUDA, with a device flag for a site with
nothing to steer; the torch reference elsewhere). A step the slots cannot run (conditional steering, an SAE or
transcoder latent clamp, more tables than the slots hold) is steered by the same operators from the step's
:class:`~steerkit.serving.plan.StepPlan` on the host, which an engine that replays CUDA graphs never runs (its
front end refuses such requests). A read-only site (``blocks.{l}.mlp.hook_in``, the MLP's input, which a
transcoder's clamp encodes) has a forward pre-hook and a read operator of its own, which only the host plan uses
(:meth:`StepPlan.read <steerkit.serving.plan.StepPlan.read>`: the request's programs store the rows there, the
clamp at ``blocks.{l}.hook_mlp_out`` reads them later in the step); it never changes the input.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from steerkit.bounded import BoundedDict
from steerkit.interventions import CompiledSteering, ModelFacts
from steerkit.kernels.slots import SlotShape, steer_slots_
from steerkit.loading.adapters import vllm_sites
from steerkit.vectors import Store
from steerkit.vectors.provenance import folder_fingerprint

from steerkit.serving.ops import ObjectOps
from steerkit.serving.plan import (SLOTS_ENV, Block, RequestConditions, StepPlan, slot_capacity, slot_refusal)
from steerkit.serving.slots import StepSlots
from steerkit.serving.spec import Resolved, SpecError, parse_spec, resolve

log = logging.getLogger("steerkit.serving")


def store_from_env() -> Store:
    """The artifact store a server reads: ``STEERKIT_STORE``, or the default store.

    Examples:
        >>> import os
        >>> os.environ["STEERKIT_STORE"] = str(tmp_dir)
        >>> store_from_env().root == tmp_dir
        True
        >>> del os.environ["STEERKIT_STORE"]
    """
    return Store(os.environ.get("STEERKIT_STORE") or None)


def served_facts(model_config: Any) -> ModelFacts:
    """:class:`~steerkit.ModelFacts` of the model vLLM serves: its config read by the family's adapter
    (:meth:`~steerkit.ModelFacts.from_hf_config`: depth, width, heads, KV heads, head size, experts) and
    the fingerprint of its folder.

    Examples:
        >>> from types import SimpleNamespace
        >>> facts = served_facts(SimpleNamespace(hf_config=tiny.hf_model.config, model="tiny-llama"))
        >>> facts.name, facts.n_layers, facts.d_model, facts.fingerprint is None
        ('tiny-llama', 4, 64, True)
    """
    hf = model_config.hf_config
    path = model_config.model
    try:
        fp = folder_fingerprint(path) if os.path.isdir(path) else None
    except Exception as e:  # noqa: BLE001 - no safetensors, unreadable config: no fingerprint check
        log.warning("steerkit: no fingerprint for %s (%s); artifacts are checked by shape only", path, e)
        fp = None
    return ModelFacts.from_hf_config(hf, name=str(getattr(model_config, "served_model_name", None) or path),
                                     fingerprint=fp)


def graph_refusal(steering: CompiledSteering, shape: SlotShape) -> Optional[str]:
    """Why a compiled request steering cannot run in an engine that replays CUDA graphs (``None``: it can):
    conditional steering (decided on the host), an operation other than the fused kernel's, a region projection
    (its solve iterates on the host), or tables larger than the slots of ``shape``.

    Examples:
        >>> add = steerkit.Intervention.add("blocks.1.hook_resid_post", torch.ones(64))
        >>> graph_refusal(tiny.compile([add]), SlotShape(64)) is None
        True
        >>> ablate = steerkit.Intervention.ablate("blocks.1.hook_resid_post", torch.eye(64)[:2])
        >>> graph_refusal(tiny.compile([ablate]), SlotShape(64, basis=1))
        "a basis of 2 directions (the slots hold 1) at 'blocks.1.hook_resid_post'"
    """
    for site, program in steering.programs.items():
        if program.table is not None and program.table.has_region:
            return f"a region projection at {site!r} (its solve iterates on the host)"
    return slot_refusal(steering, shape)


def _key(raw: Any) -> str:
    return raw if isinstance(raw, str) else repr(sorted(raw.items())) if isinstance(raw, dict) else repr(raw)


class RequestSteerings:
    """Each request's steering resolved and compiled once, by its spec text (see the module docstring).

    ``check``: check artifacts against the model (a front end); a worker, behind a front end that has, does not.
    ``device`` / ``dtype``: where the steering is compiled. ``graphs``: also say why each steering cannot run in
    an engine that replays CUDA graphs (:meth:`refusal`), from the same compile.

    Examples:
        >>> steerings = RequestSteerings(tiny.facts, store=store)
        >>> raw = {"ops": [{"op": "add", "layers": [1], "vector": [0.5] * 64}]}
        >>> r = steerings.get(raw)
        >>> r.sites, steerings.get(raw) is r, len(r.compiled)
        (('blocks.1.hook_resid_post',), True, 1)
    """

    def __init__(self, facts: ModelFacts, *, store: Any = None, check: bool = True, device: Any = "cpu",
                 dtype: torch.dtype = torch.float32, graphs: Optional[SlotShape] = None, max_entries: int = 256):
        self.facts, self.check, self.device, self.dtype, self.graphs = facts, check, device, dtype, graphs
        self._store = store
        self._d: BoundedDict[str, tuple] = BoundedDict(max_entries)
        self._lock = threading.Lock()

    def _entry(self, raw: Any) -> tuple:
        key = _key(raw)
        with self._lock:
            hit = self._d.get(key)
        if hit is not None:
            return hit
        spec = parse_spec(raw)
        res: Optional[Resolved] = None
        why: Optional[str] = None
        if not spec.empty:
            res = resolve(spec, store=self._store if self._store is not None else store_from_env(), facts=self.facts,
                          check=self.check, device=self.device, dtype=self.dtype)
            if self.graphs is not None and res.compiled is not None:
                why = graph_refusal(res.compiled, self.graphs)
        entry = (res, why)
        with self._lock:
            self._d[key] = entry
        return entry

    def get(self, raw: Any) -> Optional[Resolved]:
        """The request's :class:`~steerkit.serving.spec.Resolved` (with its compiled steering), ``None`` for an
        empty spec; raises :class:`~steerkit.serving.spec.SpecError` for one that cannot be applied."""
        return self._entry(raw)[0]

    def refusal(self, raw: Any) -> Optional[str]:
        """Why the request's steering cannot run inside CUDA graphs (``None``: it can, or ``graphs`` is off)."""
        return self._entry(raw)[1]


class FrontEnd:
    """A server front end's check of each request's steering against the served model (``model_config``: vLLM's),
    once per spec (:class:`RequestSteerings`); ``graphs``: the engine may replay CUDA graphs, where the steering
    must fit the slots and run the fused kernel's operations only.

    Examples:
        >>> from types import SimpleNamespace
        >>> front = FrontEnd(SimpleNamespace(hf_config=tiny.hf_model.config, model="tiny"), store=store)
        >>> front.check({"ops": [{"op": "add", "layers": [1], "vector": [0.5] * 64}]}).sites
        ('blocks.1.hook_resid_post',)
        >>> front.check({"ops": [{"op": "add", "layers": [9], "vector": [0.5] * 64}]})
        Traceback (most recent call last):
        ...
        steerkit.serving.spec.SpecError: steerkit: ...
    """

    def __init__(self, model_config: Any, *, graphs: bool = False, store: Any = None):
        self.model_config, self.graphs, self._store = model_config, graphs, store
        self._steerings: Optional[RequestSteerings] = None
        self._lock = threading.Lock()

    @property
    def steerings(self) -> RequestSteerings:
        with self._lock:
            if self._steerings is None:
                facts = served_facts(self.model_config)
                shape = SlotShape(facts.d_model, **slot_capacity(os.environ.get(SLOTS_ENV))) if self.graphs else None
                self._steerings = RequestSteerings(facts, store=self._store, graphs=shape)
            return self._steerings

    def check(self, raw: Any) -> Optional[Resolved]:
        """The request's steering, resolved and checked (``None`` for an empty spec); raises
        :class:`~steerkit.serving.spec.SpecError` with the reason a client reads."""
        try:
            res = self.steerings.get(raw)
            why = self.steerings.refusal(raw)
        except SpecError as e:
            raise SpecError(f"steerkit: {e}") from None
        except Exception as e:  # noqa: BLE001 - anything else is still this request's problem
            raise SpecError(f"steerkit: could not apply the steering spec ({type(e).__name__}: {e})") from None
        if why is not None:
            raise SpecError(f"steerkit: expected steering that runs inside CUDA graphs, found {why}; start the engine "
                            "with --enforce-eager for this steering, or raise STEERKIT_VLLM_SLOTS")
        return res


class EngineSteering:
    """One engine's steering (see the module docstring): made per model runner, after its model loads.

    ``model``: the served model (its sites from :func:`~steerkit.loading.adapters.vllm_sites`); ``facts``: its
    :class:`~steerkit.ModelFacts`; ``max_tokens``: the most tokens one step holds; ``capacity``: the slots'
    capacities (:func:`~steerkit.serving.plan.slot_capacity`); ``graphs``: the engine may replay CUDA graphs.

    Examples:
        >>> engine = EngineSteering(tiny.hf_model, tiny.facts, max_tokens=8,
        ...                         capacity={"configs": 4, "basis": 2, "region": 2, "halfspaces": 2})
        >>> raw = {"ops": [{"op": "add", "layers": [1], "vector": [0.5] * 64}]}
        >>> engine.steerings = RequestSteerings(tiny.facts, store=store)
        >>> engine.begin_step([("r0", 0, 3, range(3), 3, raw)], total=3)
        >>> i = engine.slots.index["blocks.1.hook_resid_post"]
        >>> engine.plan is None, engine.slots.flag[i].item(), engine.slots.cfg[i, :3].tolist()
        (True, 1, [0, 0, 0])
        >>> engine.end_step(); engine.close()
    """

    def __init__(self, model: Any, facts: ModelFacts, *, max_tokens: int, device: Any = None,
                 dtype: torch.dtype = torch.float32, capacity: Optional[dict] = None, store: Any = None,
                 graphs: bool = False):
        self.facts, self.graphs = facts, graphs
        self.sites = vllm_sites(model)
        #: the read-only sites (a module's input: ``mlp.hook_in``), which only the host path reads
        self.read_sites = [s for s, (_, kind) in self.sites.items() if kind == "in"]
        cap = capacity or slot_capacity(os.environ.get(SLOTS_ENV))
        self.steerings = RequestSteerings(facts, store=store, check=False, device=device or "cpu", dtype=dtype)
        self.conditions = RequestConditions()
        self.slots = StepSlots([s for s, (_, kind) in self.sites.items() if kind != "in"], d_model=facts.d_model,
                               max_tokens=max_tokens, device=device, dtype=dtype, **cap)
        #: the step being steered on the host (a step the slots cannot run), or None
        self.plan: Optional[StepPlan] = None
        self._ops = ObjectOps()
        self._op = self._ops.define("steer_(Tensor(a!) x, Tensor cfg, Tensor flag, int site) -> ()",
                                    lambda x, cfg, flag, site: self._steer(x, None, cfg, flag, site))
        self._op_resid = self._ops.define(
            "steer_resid_(Tensor(a!) hidden, Tensor(b!) residual, Tensor cfg, Tensor flag, int site) -> ()",
            lambda x, residual, cfg, flag, site: self._steer(x, residual, cfg, flag, site))
        # declared as writing x so that a compiled graph keeps the call; it never changes x
        self._op_read = self._ops.define("read_(Tensor(a!) x, int site) -> ()", self._read)
        self.handles = [module.register_forward_pre_hook(self._read_hook(site)) if kind == "in"
                        else module.register_forward_hook(self._hook(site, kind))
                        for site, (module, kind) in self.sites.items()]

    def nbytes(self) -> int:
        """Bytes of device memory the steering buffers hold."""
        return self.slots.nbytes()

    def _hook(self, site: str, kind: str) -> Callable:
        """The forward hook of one site: its steering operator on the module's output, in place. It reads only
        the slots' persistent buffers, so a compiled graph that traced it once steers every later step."""
        i = self.slots.index[site]
        cfg, flag = self.slots.cfg[i], self.slots.flag[i]
        op, op_resid = self._op, self._op_resid
        if kind == "resid":
            def resid_hook(_mod, _args, output):
                hidden, residual = output[0], output[1]
                op_resid(hidden, residual, cfg, flag, i)
            return resid_hook

        def out_hook(_mod, _args, output):
            op(output[0] if isinstance(output, tuple) else output, cfg, flag, i)
        return out_hook

    def _read_hook(self, site: str) -> Callable:
        """The forward pre-hook of a read-only site (a module's input): the read operator on that input, which
        the step's host plan shows to its programs (a transcoder's clamp stores it for the module's output)."""
        j, op = self.read_sites.index(site), self._op_read

        def in_hook(_mod, args):
            if args and isinstance(args[0], torch.Tensor):
                op(args[0], j)
        return in_hook

    def _read(self, x: torch.Tensor, j: int) -> None:
        """The read operator's body: the step's plan reads ``x`` at read site ``j``; the slots never read there."""
        plan = self.plan
        if plan is not None:
            plan.read(self.read_sites[j], x)

    def _steer(self, x: torch.Tensor, residual: Optional[torch.Tensor], cfg: torch.Tensor, flag: torch.Tensor,
               i: int) -> None:
        """The operators' body: the step's plan on the host, else the slots."""
        plan = self.plan
        if plan is not None:
            plan.steer_(self.slots.sites[i], x, residual)
            return
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        steer_slots_(x, residual, cfg, flag, self.slots.slots, stages=None if capturing else self.slots.stages[i])

    def begin_step(self, requests: Sequence[tuple], total: int, live: Optional[Sequence[str]] = None) -> None:
        """Prepare this step: ``requests`` as :func:`~steerkit.serving.plan.runner_requests` yields them (the
        steered requests' rows), ``total`` tokens in the step, ``live``: every request the engine holds (finished
        requests' CAST decisions go)."""
        self.plan = None
        blocks = []
        for req_id, a, b, positions, n_prompt, raw in requests:
            try:
                res = self.steerings.get(raw)
            except Exception as e:  # noqa: BLE001 - the store changed since the front end checked
                log.error("steerkit: request %s runs unsteered: %s", req_id, e)
                continue
            if res is not None:
                blocks.append(Block(a, b, np.asarray(positions), n_prompt, res, req_id))
        if live is not None and len(self.conditions):
            self.conditions.keep(live)
        if self.slots.fill(blocks, total):
            return
        plan = StepPlan(blocks, self.conditions)
        if self.graphs:
            log.error("steerkit: this step's steering does not fit the steering slots and the engine replays CUDA "
                      "graphs; the step runs unsteered (raise %s)", SLOTS_ENV)
            return
        self.plan = plan  # steered from the plan, in place, by the same operators

    def end_step(self) -> None:
        """After the step: nothing is steered until the next :meth:`begin_step` (dummy and profiling runs)."""
        self.plan = None
        self.slots.clear()

    def close(self) -> None:
        """Remove the hooks and the operators."""
        for h in self.handles:
            h.remove()
        self.handles = []
        self._ops.close()


__all__ = ["EngineSteering", "FrontEnd", "RequestSteerings", "graph_refusal", "served_facts", "store_from_env"]
