"""A request's record spec: what it asks the vLLM plugin to record, validated in the client and the
front end (the worker reads it in :mod:`steerkit.serving.record_worker`; the offline API that sends it
and reads the rows back is :mod:`steerkit.serving.capture`).

A request asks for its activations with one entry in ``SamplingParams.extra_args`` (a JSON string
or a dict, like the steering spec of :mod:`steerkit.serving.spec`)::

    extra_args = {"steerkit_record": '{"hooks": ["blocks.12.hook_resid_post"], "positions": "prompt",
                                       "run": "a1b2c3", "request": "0"}'}

* ``hooks``: TransformerLens names the plugin reaches: ``blocks.{l}.hook_resid_post`` (the decoder
  layer's output, hidden + residual), ``blocks.{l}.hook_attn_out``, ``blocks.{l}.hook_mlp_out``,
  ``blocks.0.hook_resid_pre`` (the embedding) and ``blocks.{l}.hook_resid_pre`` for ``l > 0``
  (recorded at ``blocks.{l-1}.hook_resid_post``, the same tensor); at most :data:`MAX_HOOKS`.
* ``positions``: the vocabulary of :mod:`steerkit.hooks.positions` a server can evaluate: ``"all"``,
  ``"prompt"``, ``"generated"``, ``"last"`` (the last prompt token) or a list of at most
  :data:`MAX_INDICES` prompt token indices (negative ones count from the end of the prompt), through
  :func:`steerkit.interventions.server_mask_of`, the masks steering uses.
* ``run`` / ``request``: where the rows go inside the engine's record folder, ``$STEERKIT_RECORD_DIR``
  (:data:`ENV`, set by whoever starts the engine: :func:`~steerkit.serving.capture.record_generate`,
  :func:`~steerkit.serving.capture.start_llm`, ``steerkit record --engine vllm``; never by a request,
  which names only a run id).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Optional, Sequence, Union

from steerkit.errors import HookNameError
from steerkit.hooks.names import parse as parse_hook
from steerkit.hooks.positions import plain_positions

from steerkit.serving.spec import SpecError
from steerkit.storage import jsontext

__all__ = ["KEY", "ENV", "RECORD_ENV", "RecordSpec", "parse_record", "record_args", "check_request", "can_record"]

#: the ``extra_args`` key of a request's record spec
KEY = "steerkit_record"
#: the engine's record folder (set by the process that starts the engine, never by a request)
ENV = "STEERKIT_RECORD_DIR"
MAX_HOOKS = 256
MAX_INDICES = 4096
MAX_SPEC_CHARS = 1 << 16
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SITE_KINDS = ("hook_resid_post", "hook_attn_out", "hook_mlp_out", "hook_resid_pre")
#: ``STEERKIT_VLLM_RECORD=1``: a compiled engine installs the record hooks when it loads (they must be
#: in the graph it traces), so it can record; an eager engine installs them at its first recording step
RECORD_ENV = "STEERKIT_VLLM_RECORD"


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
        """The positions as :mod:`steerkit.hooks.positions` reads them."""
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
            value = jsontext.loads(value)
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
    pos = plain_positions(value.get("positions", "all"), "'positions'", error=SpecError, max_indices=MAX_INDICES)
    positions: Union[str, tuple[int, ...]] = pos if isinstance(pos, str) else tuple(pos)
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


def can_record(model_config: Any) -> bool:
    """Whether an engine records: eager, or compiled with ``STEERKIT_VLLM_RECORD=1`` (its record
    hooks are then installed when it loads, inside the graph it traces).

    Examples:
        >>> from types import SimpleNamespace
        >>> can_record(SimpleNamespace(enforce_eager=True))
        True
    """
    return bool(getattr(model_config, "enforce_eager", False)) or os.environ.get(RECORD_ENV) == "1"

