"""What lowering knows of a model without the model: :class:`ModelFacts`, and its one builder.

Every place that needs a model's facts builds them here: a loaded model (``SteerModel.facts``), a bare
Hugging Face model (``steerkit.vectors.facts_of``), the model a vLLM engine serves (its config) and a
plain dict (a server's facts handed over as JSON) all go through :meth:`ModelFacts.from_hf_config` or
:meth:`ModelFacts.from_dict`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from steerkit.loading.adapters import Adapter, adapter_for
from steerkit.errors import InputError, UnsupportedArchitectureError
from steerkit.hooks.names import EXPERT_OUT, HEAD_HOOKS, KV_HOOKS, MATRIX_HOOKS, MLP_HOOKS, ROUTER_LOGITS, ROUTING_HOOKS
from steerkit.hooks.names import record_only_error


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What lowering needs to know of a model, without the model: its name, depth, width, whether
    blocks have a ``hook_resid_mid`` (sequential blocks), its weight fingerprint, and the widths of the
    component hooks (heads, KV heads, head size, MLP width; routed experts per sparse block and experts
    per token on a mixture-of-experts model; ``None`` where unknown or absent).

    Examples:
        >>> f = tiny.facts
        >>> f.n_layers, f.d_model, f.n_heads, f.n_kv_heads, f.d_head, f.d_mlp
        (4, 64, 4, 2, 16, 128)
        >>> f.width("attn.hook_k", "blocks.0.attn.hook_k"), f.width("hook_resid_post", "blocks.0.hook_resid_post")
        (32, 64)
    """

    name: str
    n_layers: int
    d_model: int
    fingerprint: Optional[str] = None
    has_resid_mid: bool = True
    n_heads: Optional[int] = None
    n_kv_heads: Optional[int] = None
    d_head: Optional[int] = None
    d_mlp: Optional[int] = None
    n_experts: Optional[int] = None
    top_k: Optional[int] = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_hf_config(cls, config: Any, *, name: str, fingerprint: Optional[str] = None,
                       adapter: Optional[Adapter] = None, model: Any = None) -> "ModelFacts":
        """THE builder of a model's facts, from its Hugging Face ``config`` (its text config is read).

        ``adapter``: the family's :class:`~steerkit.loading.adapters.Adapter` (found from ``config.model_type``
        when not given); it reads the heads, KV heads, head size, experts and whether blocks are
        sequential by the family's own config names. ``model``: the loaded HF model, when there is one
        (then depth counts its blocks and ``d_mlp`` is its MLP weights' width; from a config alone,
        ``intermediate_size`` of a dense family). A family without an adapter gets depth and width only.

        Examples:
            >>> f = ModelFacts.from_hf_config(tiny.hf_model.config, name="tiny")
            >>> f == dataclasses.replace(tiny.facts, name="tiny", fingerprint=None)
            True
            >>> ModelFacts.from_hf_config(tiny.hf_model.config, name="tiny", model=tiny.hf_model).d_mlp
            128
        """
        return cls(name=str(name), fingerprint=fingerprint, **_config_facts(config, adapter, model))

    @classmethod
    def from_dict(cls, facts: Mapping) -> "ModelFacts":
        """Facts from a plain mapping (e.g. sent as JSON): ``name``, ``n_layers`` and ``d_model`` are
        required, every other field is taken when present (:meth:`as_dict` reads back).

        Examples:
            >>> ModelFacts.from_dict(tiny.facts.as_dict()) == tiny.facts
            True
            >>> ModelFacts.from_dict({"name": "m", "n_layers": 2, "d_model": 8}).n_heads is None
            True
            >>> ModelFacts.from_dict({"name": "m"})
            Traceback (most recent call last):
            ...
            steerkit.errors.InputError: expected the model's facts with name, n_layers and d_model, found no 'n_layers'
        """
        if not isinstance(facts, Mapping):
            raise InputError(f"expected the model's facts as a mapping, found {type(facts).__name__}")
        missing = [k for k in ("name", "n_layers", "d_model") if facts.get(k) is None]
        if missing:
            raise InputError(f"expected the model's facts with name, n_layers and d_model, found no {missing[0]!r}")
        ints = {f.name for f in dataclasses.fields(cls)} - {"name", "fingerprint", "has_resid_mid"}
        kw: dict = {k: (None if facts.get(k) is None else int(facts[k])) for k in ints if k in facts}
        fp = facts.get("fingerprint")
        return cls(name=str(facts["name"]), fingerprint=None if fp is None else str(fp),
                   has_resid_mid=bool(facts.get("has_resid_mid", True)), **kw)

    def _dim(self, name: str, site: str) -> int:
        v = getattr(self, name)
        if v is None:
            raise InputError(f"expected the model's {name} to lower an intervention at {site!r}, found none in its "
                             "facts; build them from the model (sm.facts)")
        return int(v)

    def heads_at(self, kind: str, site: str) -> int:
        """How many heads a head site of ``kind`` has (KV heads for hook_k / hook_v)."""
        return self._dim("n_kv_heads" if kind in KV_HOOKS else "n_heads", site)

    def width(self, kind: str, site: str) -> Optional[int]:
        """The feature width the kernel sees at a site of ``kind`` (``None``: it varies, as the key
        axis of an attention matrix does)."""
        if kind in MATRIX_HOOKS:
            return None
        if kind in HEAD_HOOKS:
            return self.heads_at(kind, site) * self._dim("d_head", site)
        if kind in MLP_HOOKS:
            return self._dim("d_mlp", site)
        if kind == ROUTER_LOGITS:
            return self._dim("n_experts", site)
        if kind == EXPERT_OUT:
            return self._dim("n_experts", site) * self.d_model
        if kind in ROUTING_HOOKS:
            raise record_only_error(site)
        return self.d_model

    def units_at(self, kind: str, site: str) -> tuple[int, int]:
        """``(count, width)`` of the units ``heads=`` selects at a site of ``kind``: attention heads of
        ``d_head`` features, or experts of ``d_model`` features at ``mlp.hook_expert_out``."""
        if kind == EXPERT_OUT:
            return self._dim("n_experts", site), self.d_model
        return self.heads_at(kind, site), self._dim("d_head", site)


class _ConfigOnly:
    """A stand-in for a model of which only the config is known (what an adapter reads from a config)."""

    def __init__(self, config: Any):
        self.config = config


def _config_facts(config: Any, adapter: Optional[Adapter], model: Any) -> dict:
    """The widths a config (and, when given, the loaded model) says, by the adapter's names."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    # the adapter reads a model's config (model.config); a config alone stands in for a model there
    view: Any = model if model is not None else _ConfigOnly(config)
    if adapter is None:
        try:
            adapter = adapter_for(view)
        except UnsupportedArchitectureError:
            adapter = None
    if adapter is None:  # no family layout: depth and width by the common names only
        return dict(n_layers=int(text.num_hidden_layers), d_model=int(text.hidden_size))
    d_mlp: Optional[int]
    if model is not None:
        n_layers, d_mlp = adapter.n_layers(model), adapter.d_mlp(model)
    else:
        n_layers = int(next(getattr(text, a) for a in adapter.n_layers_attrs if getattr(text, a, None) is not None))
        width = getattr(text, "intermediate_size", None) if adapter.moe is None else None
        d_mlp = None if width is None else int(width)
    return dict(n_layers=n_layers, d_model=adapter.d_model(view), has_resid_mid=not adapter.is_parallel(view),
                n_heads=adapter.n_heads(view), n_kv_heads=adapter.n_kv_heads(view), d_head=adapter.d_head(view),
                d_mlp=d_mlp, n_experts=adapter.n_experts(view), top_k=adapter.top_k(view))
