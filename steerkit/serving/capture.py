"""Activation capture through vLLM: a request's record spec, the worker's per-step collection, and
the offline API that returns the recorded rows with the outputs.

A request asks for its activations with one entry in ``SamplingParams.extra_args`` (a JSON string
or a dict, like the steering spec of :mod:`steerkit.serving.spec`)::

    extra_args = {"steerkit_record": '{"hooks": ["blocks.12.hook_resid_post"], "positions": "prompt",
                                       "run": "a1b2c3", "request": "0"}'}

* ``hooks``: TransformerLens names the plugin reaches: ``blocks.{l}.hook_resid_post`` (the decoder
  layer's output, hidden + residual), ``blocks.{l}.hook_attn_out``, ``blocks.{l}.hook_mlp_out``,
  ``blocks.0.hook_resid_pre`` (the embedding) and ``blocks.{l}.hook_resid_pre`` for ``l > 0``
  (recorded at ``blocks.{l-1}.hook_resid_post``, the same tensor); at most :data:`MAX_HOOKS`.
* ``positions``: the vocabulary of :mod:`steerkit.positions` a server can evaluate: ``"all"``,
  ``"prompt"``, ``"generated"``, ``"last"`` (the last prompt token) or a list of at most
  :data:`MAX_INDICES` prompt token indices (negative ones count from the end of the prompt), through
  :func:`steerkit.interventions.server_mask_of`, the masks steering uses.
* ``run`` / ``request``: where the rows go inside the engine's record folder, ``$STEERKIT_RECORD_DIR``
  (:data:`ENV`, set by whoever starts the engine: :func:`record_generate`, :func:`start_llm`,
  ``steerkit record --engine vllm``; never by a request, which names only a run id).

Recording happens after steering at the same site, so a steered request records what a steered
``sm.record`` records. "generated" rows are those of the generated tokens the model ran on: a
request with ``max_tokens=N`` runs on ``N - 1`` of its generated tokens (the last one is sampled,
never fed back).

The worker (the plugin calls :func:`on_load`, :func:`on_prepare`, :func:`on_step_end`): forward hooks
on the sites :func:`steerkit.adapters.vllm_layout` names, after the steering hooks (so they see
steered values), each calling the record operator ``torch.ops.steerkit.record_site_`` (so a graph
traced by ``torch.compile`` keeps it and runs it at every step, on the host); an eager engine installs
them at its first recording step, a compiled one started with ``STEERKIT_VLLM_RECORD=1`` when it
loads (:func:`can_record`); per step :func:`on_prepare` plans the rows of
each recorded request (``query_start_loc``, positions, prompt length), the hooks copy those rows
to the CPU, and :func:`on_step_end` writes them as one safetensors file per run and step through
:class:`steerkit.files.Folder` (confined to the record folder, written atomically) and forgets them:
nothing accumulates in the worker across steps. The plugin gives every recorded request its own
prefix-cache salt, so all of its prompt tokens are computed (and recorded), never read from cache.

:func:`record_generate` runs ``LLM.generate`` with record specs and returns, per request, its rows
``{hook: [n_positions, d_model]}`` (float32); :func:`record_dataset_vllm` writes the sharded,
resumable data set of :func:`steerkit.dataset.record_dataset` through vLLM (``steerkit record
--engine vllm``, which runs :func:`main` in vLLM's Python).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
import tempfile
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.adapters import vllm_sites
from steerkit.dataset import FORMAT, MANIFEST, ActivationDataset, _prompts_hash, resume_state
from steerkit.errors import BackendUnavailableError, HookNameError, InputError, SteerkitError
from steerkit.files import Folder, atomic_write_bytes
from steerkit.fingerprint import folder_fingerprint
from steerkit.hooknames import parse as parse_hook
from steerkit.interventions import server_mask_of
from steerkit.kernels.slots import define_op

from .plan import runner_requests
from .spec import NAMED_POSITIONS, SpecError

log = logging.getLogger("steerkit.serving")

__all__ = ["KEY", "ENV", "RECORD_ENV", "RecordSpec", "parse_record", "record_args", "check_request", "can_record",
           "StepRecorder",
           "RowBlock", "start_llm", "record_generate", "record_dataset_vllm", "dataset_plan", "main"]

#: the ``extra_args`` key of a request's record spec
KEY = "steerkit_record"
#: the engine's record folder (set by the process that starts the engine, never by a request)
ENV = "STEERKIT_RECORD_DIR"
MAX_HOOKS = 256
MAX_INDICES = 4096
MAX_SPEC_CHARS = 1 << 16
MAX_FILE_BYTES = 1 << 34
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SITE_KINDS = ("hook_resid_post", "hook_attn_out", "hook_mlp_out", "hook_resid_pre")


# ------------------------------------------------------------------------------ the record spec
@dataclasses.dataclass(frozen=True)
class RecordSpec:
    """A request's parsed record spec (see the module docstring).

    Examples:
        >>> spec = parse_record({"hooks": ["blocks.2.hook_resid_pre", "blocks.0.hook_resid_pre"], "run": "r1"},
        ...                     n_layers=4)
        >>> spec.positions, spec.request, spec.sites()
        ('all', '0', {'blocks.1.hook_resid_post': ('blocks.2.hook_resid_pre',), 'blocks.0.hook_resid_pre': ('blocks.0.hook_resid_pre',)})
    """

    hooks: tuple[str, ...]
    positions: Union[str, tuple[int, ...]] = "all"
    run: str = ""
    request: str = "0"

    def sites(self) -> dict[str, tuple[str, ...]]:
        """``{site the worker hooks: the requested hook names recorded there}``."""
        out: dict[str, list[str]] = {}
        for h in self.hooks:
            out.setdefault(record_site(h), []).append(h)
        return {k: tuple(v) for k, v in out.items()}

    def mask_spec(self) -> Union[str, list[int]]:
        """The positions as :mod:`steerkit.positions` reads them."""
        return self.positions if isinstance(self.positions, str) else list(self.positions)


def record_site(hook: str, n_layers: int = 1 << 30) -> str:
    """The site the worker hooks for ``hook`` (``blocks.{l}.hook_resid_pre`` with ``l > 0`` is
    ``blocks.{l-1}.hook_resid_post``); a hook the plugin cannot reach raises :class:`SpecError`.

    Examples:
        >>> record_site("blocks.3.hook_resid_pre"), record_site("blocks.3.hook_mlp_out")
        ('blocks.2.hook_resid_post', 'blocks.3.hook_mlp_out')
    """
    try:
        s = parse_hook(hook, n_layers)
    except HookNameError as e:
        raise SpecError(f"steerkit_record: {e}") from None
    if s.kind not in _SITE_KINDS or s.layer is None:
        raise SpecError(f"expected hooks the vLLM plugin can record (blocks.{{l}}.hook_resid_post, hook_attn_out, "
                        f"hook_mlp_out, hook_resid_pre), found {hook!r}; record it with steerkit itself (sm.record)")
    if s.kind == "hook_resid_pre" and s.layer > 0:
        return f"blocks.{s.layer - 1}.hook_resid_post"
    return hook


def _ident(x: Any, what: str) -> str:
    if isinstance(x, int) and not isinstance(x, bool) and x >= 0:
        x = str(x)
    if not isinstance(x, str) or not _ID.fullmatch(x):
        raise SpecError(f"expected {what} as 1-64 letters, digits, '-' or '_', found {str(x)[:80]!r}; it names a "
                        "folder inside the engine's record folder, nothing else")
    return x


def parse_record(value: Any, n_layers: Optional[int] = None) -> RecordSpec:
    """Validate a request's ``extra_args["steerkit_record"]`` (a JSON string or a dict) into a
    :class:`RecordSpec`; with ``n_layers`` the hook layers are checked against the model.

    Examples:
        >>> parse_record('{"hooks": ["blocks.1.hook_attn_out"], "positions": [0, -1], "run": "r1"}')
        RecordSpec(hooks=('blocks.1.hook_attn_out',), positions=(0, -1), run='r1', request='0')
        >>> parse_record({"hooks": ["blocks.9.hook_resid_post"], "run": "r1"}, n_layers=4)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        steerkit.serving.spec.SpecError: steerkit_record: expected a layer in 0..3 for this model (4 blocks), found 9 ...
    """
    if isinstance(value, RecordSpec):
        value = dataclasses.asdict(value)
    if isinstance(value, (str, bytes)):
        if len(value) > MAX_SPEC_CHARS:
            raise SpecError(f"expected a record spec under {MAX_SPEC_CHARS} characters, found {len(value)}; "
                            "record fewer hooks or indices per request")
        try:
            value = json.loads(value)
        except ValueError as e:
            raise SpecError(f"expected the record spec ({KEY}) as a JSON object with 'hooks', 'positions' and "
                            f"'run', could not parse it ({e})") from None
    if not isinstance(value, dict):
        raise SpecError(f"expected the record spec ({KEY}) as a JSON object with 'hooks', 'positions' and 'run', "
                        f"found {type(value).__name__}")
    unknown = set(value) - {"hooks", "positions", "run", "request"}
    if unknown:
        raise SpecError(f"expected only the keys hooks, positions, run, request in the record spec, found "
                        f"{sorted(unknown)}; remove them")
    hooks = value.get("hooks")
    if isinstance(hooks, str):
        hooks = [hooks]
    if not isinstance(hooks, list) or not hooks or len(hooks) > MAX_HOOKS \
            or not all(isinstance(h, str) for h in hooks):
        found = f"a list of {len(hooks)}" if isinstance(hooks, list) else type(hooks).__name__
        raise SpecError(f"expected 'hooks' as a list of 1 to {MAX_HOOKS} hook names such as "
                        f"'blocks.12.hook_resid_post', found {found}")
    hooks = list(dict.fromkeys(hooks))
    for h in hooks:
        record_site(h, n_layers if n_layers is not None else 1 << 30)
    pos = value.get("positions", "all")
    positions: Union[str, tuple[int, ...]]
    if isinstance(pos, str):
        if pos not in NAMED_POSITIONS:
            raise SpecError(f"expected 'positions' in {NAMED_POSITIONS} or a list of prompt token indices, found "
                            f"{pos[:40]!r}")
        positions = pos
    elif isinstance(pos, list):
        if not pos or len(pos) > MAX_INDICES:
            raise SpecError(f"expected 'positions' as a list of 1 to {MAX_INDICES} prompt token indices, found "
                            f"{len(pos)}; record 'prompt' for every prompt token")
        if not all(isinstance(p, int) and not isinstance(p, bool) for p in pos):
            bad = next(p for p in pos if not isinstance(p, int) or isinstance(p, bool))
            raise SpecError(f"expected prompt token indices as integers in 'positions', found {str(bad)[:40]!r}")
        positions = tuple(pos)
    else:
        raise SpecError(f"expected 'positions' as one of {NAMED_POSITIONS} or a list of prompt token indices, "
                        f"found {type(pos).__name__}")
    if "run" not in value:
        raise SpecError("expected 'run' in the record spec (the run id its rows are filed under), found none; "
                        "build requests with steerkit.serving.capture.record_generate or record_args")
    return RecordSpec(tuple(hooks), positions, _ident(value["run"], "'run'"),
                      _ident(value.get("request", "0"), "'request'"))


def record_args(hooks: Union[str, Sequence[str]], positions: Union[str, Sequence[int]] = "all", *, run: str,
                request: Union[str, int] = 0) -> dict:
    """``SamplingParams.extra_args`` that record ``hooks`` at ``positions`` under ``run``/``request``
    (validated here, so a typo fails in the client). Merge it with steering:
    ``{**request_args("happy@1"), **record_args(...)}``.

    Examples:
        >>> record_args("blocks.3.hook_resid_post", "last", run="r1", request=2)
        {'steerkit_record': '{"hooks":["blocks.3.hook_resid_post"],"positions":"last","run":"r1","request":"2"}'}
    """
    spec = {"hooks": [hooks] if isinstance(hooks, str) else list(hooks),
            "positions": positions if isinstance(positions, str) else [int(p) for p in positions],
            "run": run, "request": str(request)}
    parse_record(spec)
    return {KEY: json.dumps(spec, separators=(",", ":"))}


def _n_layers(model_config: Any) -> int:
    hf = model_config.hf_config
    text = getattr(hf, "text_config", None) or hf
    return int(text.num_hidden_layers)


def check_request(extra_args: dict, model_config: Any, graphs: bool = False) -> None:
    """Front end: refuse a bad record spec with :class:`~steerkit.serving.spec.SpecError` (the plugin
    turns it into ``VLLMValidationError``: ``LLM.generate`` raises, the OpenAI server answers 400).

    Examples:
        >>> from types import SimpleNamespace
        >>> cfg = SimpleNamespace(enforce_eager=False, hf_config=SimpleNamespace(num_hidden_layers=4))
        >>> check_request({"steerkit": "{}"}, cfg)  # no record spec: nothing to check
        >>> check_request(record_args("blocks.1.hook_mlp_out", run="r1"), cfg)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        steerkit.serving.spec.SpecError: expected a vLLM engine that can record activations, found a compiled one started without STEERKIT_VLLM_RECORD=1 ... to record (enforce_eager=True in LLM(...))
    """
    if not extra_args or KEY not in extra_args:
        return
    if graphs and not getattr(model_config, "enforce_eager", False):
        raise SpecError("expected a vLLM engine that can record activations, found one that replays CUDA graphs "
                        "(the record operator copies rows out on the host): start with --enforce-eager to record "
                        "(enforce_eager=True in LLM(...))")
    if not can_record(model_config):
        raise SpecError(f"expected a vLLM engine that can record activations, found a compiled one started without "
                        f"{RECORD_ENV}=1 (its graph has no record hooks): start it with {RECORD_ENV}=1, or with "
                        "--enforce-eager to record (enforce_eager=True in LLM(...))")
    if not os.environ.get(ENV):
        raise SpecError(f"expected the engine's record folder in ${ENV}, found it unset; record through "
                        "steerkit.serving.capture.record_generate or start_llm (or steerkit record --engine vllm), "
                        f"or set {ENV} before starting vLLM")
    parse_record(extra_args[KEY], _n_layers(model_config))


# ------------------------------------------------------------------------------ worker
#: ``STEERKIT_VLLM_RECORD=1``: a compiled engine installs the record hooks when it loads (they must be
#: in the graph it traces), so it can record; an eager engine installs them at its first recording step
RECORD_ENV = "STEERKIT_VLLM_RECORD"
#: recorders by id, read by the record operator's body
_RECORDERS: dict[int, "StepRecorder"] = {}


def _record_site(x: Tensor, residual: Optional[Tensor], token: Tensor, recorder: int, site: int) -> None:
    """The record hook's body as an operator of the graph: a compiled graph keeps it (it "mutates" the
    recorder's token) and runs it at every step, on the host; it copies the planned rows out."""
    rec = _RECORDERS.get(recorder)
    if rec is not None:
        rec._record(rec._names[site], x, residual)


define_op("record_site_(Tensor x, Tensor? residual, Tensor(a!) token, int recorder, int site) -> ()", _record_site)


def record_sites(model: Any) -> dict:
    """``{site: (module, kind)}`` the worker can record on this rank (module paths from
    :func:`steerkit.adapters.vllm_layout`): "resid" for a decoder layer, "out" for a module whose
    output is the site.

    Examples:
        >>> sites = record_sites(tiny.hf_model)
        >>> len(sites), sites["blocks.2.hook_resid_post"][1], sites["blocks.0.hook_resid_pre"][1]
        (13, 'resid', 'out')
    """
    return vllm_sites(model)


@dataclasses.dataclass
class RowBlock:
    """One recorded request's rows in a step: rows ``start:end`` of the flattened batch at absolute
    ``positions``, its prompt length and its :class:`RecordSpec`.

    Examples:
        >>> RowBlock(0, 3, np.arange(3), 3, parse_record({"hooks": ["blocks.0.hook_mlp_out"], "run": "r"})).end
        3
    """

    start: int
    end: int
    positions: np.ndarray
    n_prompt: int
    spec: RecordSpec


def _flat(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


class StepRecorder:
    """The worker's recorder for one model: forward hooks on its sites (:func:`record_sites`) that copy
    the rows :meth:`plan` chose for this step to the CPU, and :meth:`collect`, which hands them out
    per run and forgets them.

    Examples:
        >>> rec = StepRecorder(tiny.hf_model)
        >>> spec = parse_record({"hooks": ["blocks.1.hook_mlp_out", "blocks.0.hook_resid_pre"],
        ...                      "positions": "last", "run": "r1", "request": "7"})
        >>> rec.plan([RowBlock(0, 5, np.arange(5), 5, spec)])
        >>> with rec:
        ...     _ = tiny.hf_model(torch.tensor([[1, 2, 3, 4, 5]]))
        >>> {k: tuple(v.shape) for k, v in rec.collect()["r1"].items()}
        {'7/positions': (1,), '7/blocks.1.hook_mlp_out': (1, 64), '7/blocks.0.hook_resid_pre': (1, 64)}
    """

    def __init__(self, model: Any):
        self.sites = record_sites(model)
        self._names = list(self.sites)
        self._token = torch.zeros(1)
        _RECORDERS[id(self)] = self
        self.handles: list = []
        self._entries: list = []  # (spec, positions np) per recorded block with rows
        self._site_rows: dict = {}  # site -> (rows tensor, [(entry index, offset, n)])
        self._got: dict[str, Tensor] = {}
        self._device_rows: dict = {}

    # --- hooks --------------------------------------------------------------------------
    def install(self) -> "StepRecorder":
        """Register the forward hooks (after any hook already on the modules: recording sees their edits)."""
        if not self.handles:
            self.handles = [module.register_forward_hook(self._hook(site, kind))
                            for site, (module, kind) in self.sites.items()]
        return self

    def remove(self) -> None:
        """Remove the hooks (what they recorded stays until :meth:`collect` or :meth:`clear`)."""
        for h in self.handles:
            h.remove()
        self.handles = []

    def __enter__(self) -> "StepRecorder":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.remove()

    def _hook(self, site: str, kind: str):
        """The forward hook: the record operator on the module's output (``hidden, residual`` of a
        decoder layer), which runs :meth:`_record` at every step, traced or not."""
        i, me, token = self._names.index(site), id(self), self._token

        def hook(_mod, _args, output):
            if kind == "resid" and isinstance(output, tuple) and len(output) >= 2 and output[1] is not None \
                    and output[0].shape == output[1].shape:
                torch.ops.steerkit.record_site_(output[0], output[1], token, me, i)
            else:
                torch.ops.steerkit.record_site_(output[0] if isinstance(output, tuple) else output, None, token,
                                                me, i)
        return hook

    def _record(self, site: str, x: Tensor, residual: Optional[Tensor]) -> None:
        """Copy this step's planned rows of ``site`` (``x`` or ``x + residual``) to the CPU."""
        plan = self._site_rows.get(site)
        if plan is None:
            return
        try:
            rows = self._device_rows.get((site, x.device))
            if rows is None:
                rows = self._device_rows[(site, x.device)] = plan[0].to(x.device)
            v = _flat(x)[rows] if residual is None else _flat(x)[rows] + _flat(residual)[rows]
            self._got[site] = v.detach().to("cpu", torch.float32)
        except Exception:  # noqa: BLE001 - never take the engine down
            log.exception("steerkit: recording failed at %s; this step's rows there are skipped", site)

    # --- one step -----------------------------------------------------------------------
    def plan(self, blocks: Sequence[RowBlock]) -> None:
        """Choose this step's rows: each block's rows its positions select, for each site its hooks need."""
        self.clear()
        per_site: dict[str, list] = {}
        for b in blocks:
            if b.end <= b.start:
                continue
            pos = np.asarray(b.positions, dtype=np.int64)
            mask = server_mask_of(torch.from_numpy(pos), b.n_prompt)(b.spec.mask_spec())
            sel = np.arange(b.end - b.start) if mask is None else np.flatnonzero(mask.cpu().numpy())
            if sel.size == 0:
                continue
            e = len(self._entries)
            self._entries.append((b.spec, pos[sel]))
            for site in b.spec.sites():
                if site in self.sites:
                    per_site.setdefault(site, []).append((e, b.start + sel))
        for site, parts in per_site.items():
            rows = np.concatenate([r for _, r in parts])
            segs, off = [], 0
            for e, r in parts:
                segs.append((e, off, len(r)))
                off += len(r)
            self._site_rows[site] = (torch.from_numpy(rows), segs)

    def collect(self) -> dict[str, dict[str, Tensor]]:
        """This step's rows per run: ``{run: {"{request}/positions": [n], "{request}/{hook}": [n, d]}}``
        (float32, on the CPU); the plan and the rows are forgotten."""
        out: dict[str, dict[str, Tensor]] = {}
        for site, (_, segs) in self._site_rows.items():
            got = self._got.get(site)
            if got is None:
                continue
            for e, off, n in segs:
                spec, pos = self._entries[e]
                d = out.setdefault(spec.run, {})
                d.setdefault(f"{spec.request}/positions", torch.from_numpy(pos.copy()))
                for name in spec.sites()[site]:
                    d[f"{spec.request}/{name}"] = got[off:off + n].clone()  # one tensor per name: safetensors shares none
        self.clear()
        return out

    def clear(self) -> None:
        """Forget this step's plan and rows."""
        self._entries, self._site_rows, self._got, self._device_rows = [], {}, {}, {}


_W: dict[str, Any] = {"seq": 0, "specs": OrderedDict()}


def _parsed(raw: Any) -> Optional[RecordSpec]:
    key = raw if isinstance(raw, str) else json.dumps(raw, sort_keys=True, default=str)
    cache: OrderedDict = _W["specs"]
    hit = cache.get(key)
    if hit is None:
        try:
            hit = parse_record(raw)
        except SpecError as e:  # checked in the front end; never fail a step for it
            log.error("steerkit: a request's record spec is not valid, it records nothing: %s", e)
            hit = False
        cache[key] = hit
        while len(cache) > 256:
            cache.popitem(last=False)
    return hit if isinstance(hit, RecordSpec) else None


def can_record(model_config: Any) -> bool:
    """Whether an engine records: eager, or compiled with ``STEERKIT_VLLM_RECORD=1`` (its record
    hooks are then installed when it loads, inside the graph it traces).

    Examples:
        >>> from types import SimpleNamespace
        >>> can_record(SimpleNamespace(enforce_eager=True))
        True
    """
    return bool(getattr(model_config, "enforce_eager", False)) or os.environ.get(RECORD_ENV) == "1"


def on_load(runner: Any) -> None:
    """Worker, after ``load_model`` and after the steering hooks (so recording sees steered values):
    in an eager engine the record hooks are installed at the first step that records; a compiled one
    with ``STEERKIT_VLLM_RECORD=1`` installs them now, before vLLM traces the model."""
    runner._steerkit_recorder = None
    runner._steerkit_record_eager = can_record(runner.model_config)
    if not runner._steerkit_record_eager:
        log.info("steerkit: compiled engine without %s=1; record requests will be refused", RECORD_ENV)
    elif not getattr(runner.model_config, "enforce_eager", False):
        runner._steerkit_recorder = StepRecorder(runner.model).install()
        log.info("steerkit: %d record hooks installed in pid %d (compiled)", len(runner._steerkit_recorder.handles),
                 os.getpid())


def _row_blocks(runner: Any) -> list[RowBlock]:
    blocks = []
    for _, a, b, positions, n_prompt, raw in runner_requests(runner, KEY):
        spec = _parsed(raw)
        if spec is not None:
            blocks.append(RowBlock(a, b, positions, n_prompt, spec))
    return blocks


def on_prepare(runner: Any) -> None:
    """Worker, after ``_prepare_inputs`` (the step's batch layout is final): plan the rows to record."""
    if not getattr(runner, "_steerkit_record_eager", False):
        return
    try:
        blocks = _row_blocks(runner)
        rec = runner._steerkit_recorder
        if rec is None:
            if not blocks:
                return
            rec = runner._steerkit_recorder = StepRecorder(runner.model).install()
            log.info("steerkit: %d record hooks installed in pid %d", len(rec.handles), os.getpid())
        rec.plan(blocks)
    except Exception:  # noqa: BLE001 - never take the engine down
        log.exception("steerkit: could not plan this step's recording; it records nothing")
        rec = getattr(runner, "_steerkit_recorder", None)
        if rec is not None:
            rec.clear()


def on_step_end(runner: Any) -> None:
    """Worker, after ``execute_model``: write this step's rows to the record folder, one safetensors
    file per run, and forget them."""
    rec = getattr(runner, "_steerkit_recorder", None)
    if rec is None:
        return
    try:
        payloads = rec.collect()
        if not payloads:
            return
        root = os.environ.get(ENV)
        if not root:
            log.error("steerkit: $%s is not set in the engine's process; this step's recorded rows are dropped", ENV)
            return
        from safetensors.torch import save
        folder = Folder(root)
        _W["seq"] += 1
        for run, tensors in payloads.items():
            folder.write_bytes(f"{run}/{_W['seq']:012d}-{os.getpid()}.safetensors", save(tensors))
    except Exception:  # noqa: BLE001
        log.exception("steerkit: could not write this step's recorded rows")
        rec.clear()


# ------------------------------------------------------------------------------ offline API
def _plugin_on() -> bool:
    names = [n.strip() for n in os.environ.get("VLLM_PLUGINS", "").split(",")]
    return "steerkit" in names or os.environ.get("STEERKIT_VLLM") == "1"


def start_llm(model: str, *, record_dir: Optional[str] = None, **kwargs: Any) -> Any:
    """A ``vllm.LLM`` that can record (eager, the steerkit plugin on, ``$STEERKIT_RECORD_DIR`` set
    before the engine starts, which a multiprocess engine needs); ``kwargs`` go to ``LLM``.

    Examples:
        >>> llm = start_llm("path/to/exported-model", dtype="float32")  # doctest: +SKIP
        >>> outputs, rows = record_generate(llm, ["Hi"], hooks=["blocks.3.hook_resid_post"])  # doctest: +SKIP

    (skipped: it needs vLLM, which lives in its own environment.)
    """
    if not _plugin_on():
        os.environ["VLLM_PLUGINS"] = ",".join([p for p in os.environ.get("VLLM_PLUGINS", "").split(",") if p]
                                              + ["steerkit"])
    if record_dir is not None:
        os.environ[ENV] = str(Path(record_dir).resolve())
    elif not os.environ.get(ENV):
        os.environ[ENV] = tempfile.mkdtemp(prefix="steerkit-record-")
    from vllm import LLM
    kwargs.setdefault("enforce_eager", True)
    return LLM(model=model, **kwargs)


def _model_config(llm: Any) -> Any:
    cfg = getattr(getattr(llm, "llm_engine", None), "model_config", None)
    if cfg is None:
        cfg = llm.llm_engine.vllm_config.model_config
    return cfg


def _read_run(folder: Folder, run: str) -> dict[str, dict[str, dict[int, Tensor]]]:
    """``{request: {hook: {position: row}}}`` from a run's files (a later file wins: a recomputed
    token after a preemption writes the same row again)."""
    from safetensors.torch import load
    out: dict[str, dict[str, dict[int, Tensor]]] = {}
    for name in folder.listdir(run):
        if not name.endswith(".safetensors") or name.startswith("."):
            continue
        tensors = load(folder.read_bytes(f"{run}/{name}", MAX_FILE_BYTES))
        for key, t in tensors.items():
            req, _, hook = key.partition("/")
            if hook == "positions":
                continue
            pos = tensors[f"{req}/positions"].tolist()
            d = out.setdefault(req, {}).setdefault(hook, {})
            for p, row in zip(pos, t):
                d[int(p)] = row
    return out


def _as_params(sampling_params: Any, n: int) -> list:
    from vllm import SamplingParams
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    sps = list(sampling_params)
    if len(sps) != n:
        raise InputError(f"expected one SamplingParams per prompt ({n}), found {len(sps)}; pass one for all or "
                         "a list as long as the prompts")
    return sps


def record_generate(llm: Any, prompts: Sequence[Any], sampling_params: Any = None, *,
                    hooks: Union[str, Sequence[str]], positions: Union[str, Sequence[int]] = "all",
                    record: Optional[Sequence[Any]] = None, use_tqdm: bool = True
                    ) -> tuple[list, list[Optional[dict[str, Float[Tensor, "n_positions d_model"]]]]]:
    """``llm.generate(prompts, sampling_params)`` recording ``hooks`` at ``positions`` through vLLM's
    continuous batching; returns ``(outputs, rows)`` where ``rows[i]`` is ``{hook: [n_positions,
    d_model]}`` (float32, positions in order) for each recorded request and ``None`` for the others.

    ``record``: which requests record (default: all): per prompt ``True`` (``hooks`` at
    ``positions``), a ``{"hooks": ..., "positions": ...}`` dict of its own, or ``False`` / ``None``.
    Requests may also steer (``extra_args`` from :func:`steerkit.serving.request_args`): they record
    the steered values. Prompts and sampling parameters are those of ``LLM.generate``; a recorded
    request needs ``n=1``. The engine must run the steerkit plugin in eager mode with
    ``$STEERKIT_RECORD_DIR`` set before it started when it is multiprocess (:func:`start_llm`); the
    rows are read back from that folder and removed.

    Examples:
        >>> outputs, rows = record_generate(llm, ["Hello"], hooks=["blocks.3.hook_resid_post"],
        ...                                 positions="last")  # doctest: +SKIP
        >>> rows[0]["blocks.3.hook_resid_post"].shape  # doctest: +SKIP
        torch.Size([1, 576])

    (skipped: it needs vLLM, which lives in its own environment.)
    """
    prompts = list(prompts)
    if not prompts:
        raise InputError("expected at least one prompt to generate from, found an empty list")
    if not _plugin_on():
        raise BackendUnavailableError("expected the steerkit vLLM plugin enabled (VLLM_PLUGINS=steerkit, set before "
                                      "vLLM starts), found it off; start the engine with "
                                      "steerkit.serving.capture.start_llm(...) or set VLLM_PLUGINS=steerkit")
    cfg = _model_config(llm)
    n_layers, d_model = _n_layers(cfg), int(cfg.get_hidden_size())
    flags = [True] * len(prompts) if record is None else list(record)
    if len(flags) != len(prompts):
        raise InputError(f"expected record= with one entry per prompt ({len(prompts)}), found {len(flags)}")
    params = _as_params(sampling_params, len(prompts))
    root = os.environ.get(ENV)
    if not root:
        root = os.environ[ENV] = tempfile.mkdtemp(prefix="steerkit-record-")
    folder = Folder(root)
    run = uuid.uuid4().hex[:16]
    wanted: dict[int, RecordSpec] = {}
    sent = []
    for i, (flag, sp) in enumerate(zip(flags, params)):
        if not flag:
            sent.append(sp)
            continue
        h, p = (flag.get("hooks", hooks), flag.get("positions", positions)) if isinstance(flag, dict) else \
            (hooks, positions)
        if getattr(sp, "n", 1) != 1:
            raise InputError(f"expected n=1 for a recorded request, found n={sp.n} for prompt {i}; send each "
                             "sample as its own request")
        xa = record_args(h, p, run=run, request=i)
        wanted[i] = parse_record(xa[KEY], n_layers)
        sp = sp.clone()
        sp.extra_args = {**(sp.extra_args or {}), **xa}
        sent.append(sp)
    try:
        outputs = llm.generate(prompts, sent, use_tqdm=use_tqdm)
        got = _read_run(folder, run) if wanted else {}
    finally:
        if wanted:
            folder.remove(run)
    rows: list[Optional[dict[str, Tensor]]] = [None] * len(prompts)
    for i, spec in wanted.items():
        o = outputs[i]
        n_prompt = len(o.prompt_token_ids or [])
        n_fed = n_prompt + max(len(o.outputs[0].token_ids) - 1, 0) if o.outputs else n_prompt
        per = got.get(str(i), {})
        mine: dict[str, Tensor] = {}
        for h in spec.hooks:
            d = {p: r for p, r in per.get(h, {}).items() if p < n_fed}
            mine[h] = torch.stack([d[p] for p in sorted(d)]) if d else torch.zeros(0, d_model)
        rows[i] = mine
        expect = server_mask_of(torch.arange(n_fed), n_prompt)(spec.mask_spec()) if n_fed else None
        n_expect = n_fed if expect is None else int(expect.sum())
        if n_expect and not got:
            raise SteerkitError(f"expected the recorded rows of run {run} in {root}, found none: a multiprocess "
                                f"engine reads ${ENV} when it starts (start it with "
                                "steerkit.serving.capture.start_llm(...) or set the variable before LLM(...)), and "
                                "the engine's log says why when it could not write them")
    return outputs, rows


# ------------------------------------------------------------------------------ data set
def _format_prompt(tok: Any, prompt: str, chat: bool) -> list[int]:
    """Token ids of ``prompt`` as :meth:`steerkit.SteerModel.tokenize` makes them."""
    templ = chat and getattr(tok, "chat_template", None)
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                   tokenize=False) if templ else prompt
    return list(tok(text, add_special_tokens=not templ)["input_ids"])


def _position_spec(positions: Any) -> Any:
    return positions if isinstance(positions, (str, int)) else list(positions)


def _model_meta(model_dir: str) -> tuple[str, Optional[str], int, int]:
    """(name, fingerprint, n_layers, d_model) of a Hugging Face model folder."""
    p = Path(model_dir)
    try:
        cfg = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"expected a Hugging Face model folder with config.json at {model_dir}, could not read it "
                         f"({e}); write one with: steerkit model export --format hf DIR") from None
    text = cfg.get("text_config") or cfg
    try:
        fp: Optional[str] = folder_fingerprint(p)
    except Exception as e:  # noqa: BLE001 - no safetensors, unreadable config: recorded without one
        log.warning("steerkit: no fingerprint for %s (%s)", model_dir, e)
        fp = None
    name = str(p)
    try:  # a steerkit export names the model it was written from
        name = str(json.loads((p / "steerkit_export.json").read_text()).get("name") or name)
    except (OSError, ValueError, AttributeError):
        pass
    try:
        return name, fp, int(text["num_hidden_layers"]), int(text["hidden_size"])
    except (KeyError, TypeError, ValueError):
        raise InputError(f"expected num_hidden_layers and hidden_size in {p / 'config.json'}, found neither; "
                         "is it a decoder language model?") from None


def dataset_plan(model_dir: str, prompts: Sequence[str], hooks: Sequence[str], out_dir: Any, *,
                 positions: Any = "last", shard_size: int = 256, chat: bool = True) -> tuple[dict, list[int]]:
    """The manifest fields of a recording of ``prompts`` into ``out_dir`` (the format of
    :func:`steerkit.dataset.record_dataset`) and the shards still to record (resuming a folder of
    the same run; another run there is an error). Needs no vLLM.

    Examples:
        >>> from steerkit.export_hf import export_hf
        >>> folder = export_hf(tiny, tmp_dir / "tiny")
        >>> meta, todo = dataset_plan(str(folder), ["a", "b", "c"], ["blocks.1.hook_resid_post"], tmp_dir / "ds",
        ...                           shard_size=2)
        >>> meta["format"], meta["n_prompts"], todo
        ('steerkit.activations/1', 3, [0, 1])
    """
    prompts = list(prompts)
    if not prompts:
        raise InputError("expected at least one prompt to record, found an empty list")
    if shard_size < 1:
        raise InputError(f"expected shard_size >= 1, found {shard_size}")
    name, fp, n_layers, d_model = _model_meta(model_dir)
    for h in hooks:
        record_site(h, n_layers)
    parse_record({"hooks": list(hooks), "positions": _position_spec(positions), "run": "check"})
    meta = {"format": FORMAT, "hooks": list(hooks), "positions": _position_spec(positions), "model": name,
            "fingerprint": fp, "n_prompts": len(prompts), "prompts_sha256": _prompts_hash(prompts),
            "shard_size": shard_size, "chat": chat, "d_model": d_model}
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"expected the output folder {out} to be a folder or not exist yet, found a file; "
                         "choose another path or remove the file")
    done, todo = resume_state(out, meta, len(prompts), shard_size)
    meta["shards"] = done
    return meta, todo


def record_dataset_vllm(llm: Any, model_dir: str, prompts: Sequence[str], hooks: Sequence[str], out_dir: Any, *,
                        positions: Any = "last", batch_size: int = 64, shard_size: int = 256, chat: bool = True,
                        progress: bool = True) -> ActivationDataset:
    """Record ``hooks`` at ``positions`` for every prompt through vLLM (``llm`` serves ``model_dir``)
    into the sharded, resumable folder :func:`steerkit.dataset.record_dataset` writes (the same
    manifest, shards and ``::lengths``, float32): each prompt runs its prompt tokens once
    (``max_tokens=1``), ``batch_size`` requests per ``generate`` call.

    Examples:
        >>> ds = record_dataset_vllm(llm, "model-dir", ["Hi", "Bye"], ["blocks.3.hook_resid_post"],
        ...                          "acts")  # doctest: +SKIP
        >>> ds.load("blocks.3.hook_resid_post").shape  # doctest: +SKIP
        torch.Size([2, 576])

    (skipped: it needs vLLM, which lives in its own environment.)
    """
    from safetensors.torch import save
    from vllm import SamplingParams
    if batch_size < 1:
        raise InputError(f"expected batch_size >= 1, found {batch_size}")
    prompts = list(prompts)
    hooks = list(hooks)
    meta, todo = dataset_plan(model_dir, prompts, hooks, out_dir, positions=positions, shard_size=shard_size,
                              chat=chat)
    done = meta.pop("shards")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = llm.get_tokenizer()
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(prompts), desc="recording (vLLM)", unit="prompt",
                   initial=len(prompts) - sum(min(shard_size, len(prompts) - i * shard_size) for i in todo))
    last = positions == "last"
    for i in todo:
        chunk = prompts[i * shard_size:(i + 1) * shard_size]
        tensors: dict[str, list[Tensor]] = {h: [] for h in hooks}
        lengths: dict[str, list[int]] = {h: [] for h in hooks}
        for j in range(0, len(chunk), batch_size):
            part = chunk[j:j + batch_size]
            ids = [{"prompt_token_ids": _format_prompt(tok, p, chat)} for p in part]
            _, rows = record_generate(llm, ids, sp, hooks=hooks, positions=_position_spec(positions), use_tqdm=False)
            for r in rows:
                assert r is not None
                for h in hooks:
                    tensors[h].append(r[h])
                    lengths[h].append(int(r[h].shape[0]))
            if bar is not None:
                bar.update(len(part))
        if last:
            bad = sorted({n for h in hooks for n in lengths[h] if n != 1})
            if bad:
                raise InputError(f"expected one last-prompt-token row per prompt, found counts {bad}")
        payload = {h: torch.cat(tensors[h]).contiguous() for h in hooks}
        if not last:
            payload.update({f"{h}::lengths": torch.tensor(lengths[h], dtype=torch.long) for h in hooks})
        fname = f"shard-{i:05d}.safetensors"
        atomic_write_bytes(out / fname, save(payload, metadata={"format": FORMAT, "shard": str(i)}))
        done[fname] = len(chunk)
        atomic_write_bytes(out / MANIFEST, json.dumps({**meta, "shards": done}, indent=1).encode())
    if bar is not None:
        bar.close()
    if not (out / MANIFEST).exists():
        atomic_write_bytes(out / MANIFEST, json.dumps({**meta, "shards": done}, indent=1).encode())
    return ActivationDataset(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``steerkit record --engine vllm`` inside vLLM's Python: ``main([JOB.json])`` reads the job the
    CLI wrote (model, prompts, hooks, positions, out, shard_size, batch_size, chat, engine, progress),
    starts the engine (:func:`start_llm`) and runs :func:`record_dataset_vllm`.

    Examples:
        >>> main([str(tmp_dir / "missing.json")])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected the record job file ... could not read it ...
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        raise InputError(f"expected one argument, the record job file, found {len(args)}")
    try:
        job = json.loads(Path(args[0]).read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"expected the record job file {args[0]} as JSON, could not read it ({e})") from None
    engine = {"dtype": "float32", "seed": 0, **(job.get("engine") or {})}
    llm = start_llm(job["model"], **engine)
    record_dataset_vllm(llm, job["model"], job["prompts"], job["hooks"], job["out"],
                        positions=job.get("positions", "last"), batch_size=int(job.get("batch_size", 64)),
                        shard_size=int(job.get("shard_size", 256)), chat=bool(job.get("chat", True)),
                        progress=bool(job.get("progress", True)))
    return 0

