"""steerkit inside stock vLLM: a general plugin that steers each request with its own artifacts.

Enable it with ``VLLM_PLUGINS=steerkit`` (entry point group ``vllm.general_plugins``) and point it at
a store with ``STEERKIT_STORE``; run the model with ``enforce_eager=True`` (``--enforce-eager``).
vLLM calls :func:`register` in every process it starts; it patches, idempotently:

* **front end** (``LLM`` / API-server process): ``InputProcessor._validate_params`` parses each
  request's ``extra_args["steerkit"]`` spec, loads its artifacts from the store and checks them
  against the served model (d_model, depth, fingerprint). A bad spec, an unknown artifact or an
  artifact of another model raises ``VLLMValidationError``: ``LLM.generate`` raises it, the OpenAI
  server answers 400, and the engine keeps serving everyone else.
* **engine core**: ``Request.from_engine_core_request`` salts a steered request's prefix-cache
  hash with its spec (:func:`steerkit.serving.spec.salt`), so KV computed under one steering is
  never reused by a request with another (or none); identical steering still shares its cache.
* **worker**: after ``load_model`` (GPU and CPU model runners), forward hooks on the decoder
  layers (their output ``(hidden, residual)`` sums to the residual stream after the block), the
  attention and MLP modules and the embedding; after ``_prepare_inputs`` (the step's batch
  layout is final) the step's :func:`~steerkit.serving.plan.plan_step` from each request's rows
  (``query_start_loc``), positions and spec; after ``execute_model`` the plan is cleared, so
  dummy / profiling runs are never steered. Each hooked site then makes one ``fused_steer``
  call over the steered rows of the step; unsteered rows are not touched.

Only eager mode is supported: under CUDA graphs or ``torch.compile`` the hooks run once while
tracing and never again, so steered requests are refused (400) when the engine is not eager.
A failure inside the worker is logged and that step runs unsteered (an exception there would
kill the engine for every user); the front-end check makes it rare.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from typing import Any, Optional

from .spec import KEY, SpecError, parse_spec, resolve, salt

log = logging.getLogger("steerkit.serving")

_STATE: dict[str, Any] = {"plan": None, "runner": None}
_LOCK = threading.Lock()
_PATCHED: set = set()


def enabled() -> bool:
    """The plugin acts only when asked: ``steerkit`` in ``VLLM_PLUGINS`` or ``STEERKIT_VLLM=1``
    (vLLM loads every installed plugin when ``VLLM_PLUGINS`` is unset)."""
    names = [n.strip() for n in os.environ.get("VLLM_PLUGINS", "").split(",")]
    return "steerkit" in names or os.environ.get("STEERKIT_VLLM") == "1"


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group (runs in every vLLM process)."""
    if not enabled():
        return
    # steerkit hooks the V1 model runner; the V2 runner would silently bypass them
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    with _LOCK:
        for name, fn in (("front", _patch_front_end), ("salt", _patch_engine_core), ("worker", _patch_worker)):
            if name in _PATCHED:
                continue
            try:
                fn()
                _PATCHED.add(name)
            except ImportError as e:  # another vLLM layout: say so once, leave vLLM as it is
                log.warning("steerkit: cannot patch the vLLM %s (%s); per-request steering is off", name, e)


# ------------------------------------------------------------------------------ shared
def store():
    from steerkit.vectors import Store
    return Store(os.environ.get("STEERKIT_STORE") or None)


def served_facts(model_config) -> dict:
    """``{"name", "d_model", "n_layers", "fingerprint"}`` of the model vLLM serves."""
    from steerkit.vectors.provenance import folder_fingerprint
    hf = model_config.hf_config
    text = getattr(hf, "text_config", None) or hf
    path = model_config.model
    try:
        fp = folder_fingerprint(path) if os.path.isdir(path) else None
    except Exception as e:  # noqa: BLE001 - no safetensors, unreadable config: no fingerprint check
        log.warning("steerkit: no fingerprint for %s (%s); artifacts are checked by shape only", path, e)
        fp = None
    return {"name": str(getattr(model_config, "served_model_name", None) or path), "d_model": int(text.hidden_size),
            "n_layers": int(text.num_hidden_layers), "fingerprint": fp}


class _Resolver:
    """Parsed and resolved specs by their text, bounded (LRU)."""

    def __init__(self, max_entries: int = 256):
        self._d: "OrderedDict[str, Any]" = OrderedDict()
        self.max = max_entries
        self.facts: Optional[dict] = None

    def get(self, raw: Any, facts: dict, check: bool = True):
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
def _patch_front_end() -> None:
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    orig = InputProcessor._validate_params
    resolver = _Resolver()
    facts_cache: dict = {}

    def _validate_params(self, params, supported_tasks):
        out = orig(self, params, supported_tasks)
        if not isinstance(params, SamplingParams) or not params.extra_args or KEY not in params.extra_args:
            return out
        mc = self.vllm_config.model_config
        if not mc.enforce_eager:
            raise VLLMValidationError(
                "expected a vLLM engine in eager mode for steerkit steering, found one with CUDA graphs / "
                "torch.compile (the steering hooks would run once while tracing and then never): start it with "
                "enforce_eager=True / --enforce-eager", parameter=f"vllm_xargs.{KEY}")
        try:
            if "facts" not in facts_cache:
                facts_cache["facts"] = served_facts(mc)
            resolver.get(params.extra_args[KEY], facts_cache["facts"])
        except SpecError as e:
            raise VLLMValidationError(f"steerkit: {e}", parameter=f"vllm_xargs.{KEY}") from None
        except Exception as e:  # noqa: BLE001 - anything else is still this request's problem
            raise VLLMValidationError(f"steerkit: could not apply the steering spec ({type(e).__name__}: {e})",
                                      parameter=f"vllm_xargs.{KEY}") from None
        return out

    InputProcessor._validate_params = _validate_params


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
def decoder_modules(model) -> dict:
    """``{"layers": [...], "embed": module}`` of a vLLM text model (architecture details live here).

    vLLM's decoder models keep their blocks at ``model.layers`` (Llama, Mistral, Qwen2/3, Gemma,
    Phi-3, OLMo...), or one level down for multimodal wrappers (``language_model``)."""
    for path in ("model", "language_model.model", "model.language_model"):
        m = model
        for part in path.split("."):
            m = getattr(m, part, None)
            if m is None:
                break
        if m is not None and hasattr(m, "layers"):
            return {"layers": list(m.layers), "embed": getattr(m, "embed_tokens", None)}
    raise RuntimeError(f"steerkit: expected a vLLM decoder model with .model.layers, found {type(model).__name__}")


def _install_hooks(model) -> list:
    mods = decoder_modules(model)
    handles = []

    def resid_hook(layer):
        def hook(_mod, _args, output):
            plan = _STATE["plan"]
            sp = plan.get(("resid_post", layer)) if plan else None
            if sp is None:
                return None
            try:
                hidden, residual = output
                rows = sp.rows
                new = sp.steered(hidden[rows] + residual[rows])
                hidden, residual = hidden.clone(), residual.clone()
                # the next layer (and the final norm) sums the two: 0 + new is exactly new
                hidden[rows] = 0
                residual[rows] = new.to(residual.dtype)
                return hidden, residual
            except Exception:  # noqa: BLE001 - never take the engine down
                log.exception("steerkit: steering failed at resid_post %d; this step runs unsteered", layer)
                return None
        return hook

    def out_hook(kind, layer):
        def hook(_mod, _args, output):
            plan = _STATE["plan"]
            sp = plan.get((kind, layer)) if plan else None
            if sp is None:
                return None
            try:
                t = output[0] if isinstance(output, tuple) else output
                new = sp.apply(t)
                return (new, *output[1:]) if isinstance(output, tuple) else new
            except Exception:  # noqa: BLE001
                log.exception("steerkit: steering failed at %s %d; this step runs unsteered", kind, layer)
                return None
        return hook

    for layer, blk in enumerate(mods["layers"]):  # absolute indices: vLLM keeps placeholders for
        if not hasattr(blk, "self_attn"):          # the blocks of other pipeline ranks
            continue  # PPMissingLayer: this rank does not hold the block
        handles.append(blk.register_forward_hook(resid_hook(layer)))
        handles.append(blk.self_attn.register_forward_hook(out_hook("attn_out", layer)))
        if hasattr(blk, "mlp"):
            handles.append(blk.mlp.register_forward_hook(out_hook("mlp_out", layer)))
    if mods["embed"] is not None:
        handles.append(mods["embed"].register_forward_hook(out_hook("embed", 0)))
    return handles


def _step_blocks(runner, resolver, facts) -> list:
    from .plan import Block
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

    from .plan import TableCache, plan_step

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
            self._steerkit_tables = TableCache(self._steerkit_facts["d_model"], self.device)
            log.info("steerkit: %d steering hooks installed in pid %d", len(self._steerkit_hooks), os.getpid())

        cls.load_model = load_model

    GMR = gpu_model_runner.GPUModelRunner
    orig_prepare = GMR._prepare_inputs

    def _prepare_inputs(self, *a, **k):
        out = orig_prepare(self, *a, **k)
        if getattr(self, "_steerkit_hooks", None):
            try:
                blocks = _step_blocks(self, self._steerkit_resolver, self._steerkit_facts)
                _STATE["plan"] = plan_step(blocks, self._steerkit_tables, self.device) if blocks else None
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
