"""Router and per-expert hooks of sparse mixture-of-experts blocks.

A sparse block (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) flattens its input to ``[tokens, d_model]``,
asks its router for ``(router_logits, top-k weights, top-k indices)`` and hands the indices and weights
to its fused experts, which add up each chosen expert's weighted output (Qwen2-MoE adds a gated shared
expert on top). The modules it uses, the fused experts' weights and how one expert computes come from the
model's :class:`~steerkit.loading.adapters.Adapter` (:class:`~steerkit.loading.adapters.MoELayout`): this module
names no module path. :func:`hooked` runs hook functions there:

- ``mlp.hook_router_logits`` ``[batch, pos, n_experts]``, ``mlp.hook_expert_weights`` /
  ``hook_expert_indices`` ``[batch, pos, top_k]``: one forward hook on the router runs the logits'
  hooks first; when one of them returns an edit, the top-k choice and its weights are recomputed from
  the edited logits by the family's rule (:meth:`~steerkit.loading.adapters.Adapter.route`: softmax in float32,
  top-k, renormalised where the family does), and the block routes by them; then the weights' and
  indices' hooks see the routing the block uses (record only: an edit raises
  :class:`~steerkit.errors.InputError`).
- ``mlp.hook_expert_out`` ``[batch, pos, n_experts, d_model]``: each expert's weighted contribution
  exists only inside the experts' forward, which transformers 5 dispatches by name through
  ``ALL_EXPERTS_FUNCTIONS`` (``config._experts_implementation``: eager, ``grouped_mm``,
  ``batched_mm``...). While such a hook is registered on a model its implementation is
  ``"steerkit:<base>"``: experts modules that carry the hook compute every chosen expert the eager way
  (``down(act(gate) * up) * weight``, zero for experts a token does not use), run the hooks on those
  outputs and return their sum over experts, added in expert order as eager does (so an unedited
  recording returns what eager experts return, bit for bit); every other experts module runs the base
  implementation. When the last such hook goes, the model's own implementation is restored.

The block's ``[batch, pos]`` shape is read by a forward pre-hook on the MoE block while any of these
hooks is registered there; :class:`MoEHandle` removes the hook function and, with the last one of a
block, those torch hooks too.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import Tensor, nn

from steerkit.errors import SteerkitError, UnsupportedArchitectureError
from steerkit.hooks.names import EXPERT_INDICES, EXPERT_OUT, EXPERT_WEIGHTS, MOE_HOOKS, ROUTER_LOGITS, record_only_error
from steerkit.hooks.implswitch import PREFIX, ImplementationSwitch
from steerkit.imports import quiet_optional_imports

with quiet_optional_imports():  # transformers' integrations import torchao when it is installed
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

if TYPE_CHECKING:
    from steerkit.loading.adapters import Adapter, MoELayout



class _Block:
    """What is hooked on one sparse block: hook functions per kind, its torch hooks, the current call's
    ``(batch, pos)``."""

    def __init__(self, model: nn.Module, adapter: "Adapter", layer: int):
        self.model, self.adapter, self.layer = model, adapter, layer
        self.layout: "MoELayout" = adapter.moe_layout(model, layer)
        self.hooks: dict[str, list] = {k: [] for k in MOE_HOOKS}
        self.handles: list = []
        self.shape: Optional[tuple[int, int]] = None

    def any(self) -> bool:
        return any(self.hooks.values())

    def site(self, kind: str) -> str:
        return f"blocks.{self.layer}.{kind}"

    def rows(self, x: Tensor) -> Tensor:
        """``x`` (``[tokens, ..]``) as ``[batch, pos, ..]``."""
        if self.shape is None:
            raise SteerkitError(f"expected the input shape of the MoE block at block {self.layer} before its router "
                                "ran, found none; this is a steerkit bug to report")
        return x.reshape(*self.shape, *x.shape[1:])


# MoE block -> its _Block; experts module -> the _Block of its MoE block
_BLOCKS: "weakref.WeakKeyDictionary[nn.Module, _Block]" = weakref.WeakKeyDictionary()
_EXPERTS: "weakref.WeakKeyDictionary[nn.Module, _Block]" = weakref.WeakKeyDictionary()


class MoEHandle:
    """Removes one hook function registered by :func:`hooked` (idempotently): a backend keeps it with its
    torch handles (``remove()``).

    Examples:
        >>> from steerkit.hooks.moe import MoEHandle
        >>> h = MoEHandle(lambda: print("removed"))
        >>> h.remove()
        removed
        >>> h.remove()  # a second call does nothing
    """

    def __init__(self, remove: Callable[[], None]):
        self._remove: Optional[Callable[[], None]] = remove

    def remove(self) -> None:
        r, self._remove = self._remove, None
        if r is not None:
            r()


def _register_name(base: str) -> str:
    name = PREFIX + base
    if name not in ALL_EXPERTS_FUNCTIONS._global_mapping:
        ALL_EXPERTS_FUNCTIONS.register(name, _experts)
    return name


_SWITCH = ImplementationSwitch("_experts_implementation", _register_name)


def _block_state(model: nn.Module, adapter: "Adapter", layer: int) -> _Block:
    blk = adapter.moe_block(model, layer)  # refused where the block is dense
    state = _BLOCKS.get(blk)
    if state is not None:
        return state
    router = adapter.router_module(model, layer)
    state = _Block(model, adapter, layer)

    def shape(mod, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        state.shape = (int(x.shape[0]), int(x.shape[1])) if x.dim() == 3 else (1, int(x.shape[0]))

    def route(mod, args, out):
        return _routed(state, out)

    state.handles.append(blk.register_forward_pre_hook(shape, with_kwargs=True))
    try:
        state.handles.append(router.register_forward_hook(route))
    except BaseException:
        state.handles.pop().remove()
        raise
    _BLOCKS[blk] = state
    return state


def hooked(model: nn.Module, adapter: "Adapter", layer: int, kind: str, fn, tracker) -> MoEHandle:
    """Run ``fn(x, tracker.call(x))`` at the mixture-of-experts hook ``kind`` (one of
    :data:`~steerkit.hooks.names.MOE_HOOKS`) of block ``layer``; returns the handle that removes it.
    :class:`~steerkit.errors.UnsupportedArchitectureError` where the block is dense.

    Examples:
        >>> from types import SimpleNamespace
        >>> from steerkit.hooks.moe import hooked
        >>> from steerkit.loading.adapters import adapter_for
        >>> from transformers import MixtralConfig, MixtralForCausalLM
        >>> cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        ...                     num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
        ...                     num_experts_per_tok=2)
        >>> model = MixtralForCausalLM(cfg).eval()
        >>> seen = []
        >>> h = hooked(model, adapter_for(model), 0, "mlp.hook_router_logits",
        ...            lambda x, call: seen.append(tuple(x.shape)), SimpleNamespace(call=lambda x: None))
        >>> _ = model(torch.tensor([[1, 2, 3]]))  # router logits [batch, pos, n_experts]
        >>> h.remove()
        >>> _ = model(torch.tensor([[1, 2, 3]]))  # removed: not called again
        >>> seen
        [(1, 3, 4)]
    """
    if kind not in MOE_HOOKS:  # pragma: no cover - the backends dispatch MOE_HOOKS only
        raise UnsupportedArchitectureError(f"expected one of {MOE_HOOKS}, found {kind!r}")
    blk = adapter.moe_block(model, layer)
    experts = adapter.experts_module(model, layer) if kind == EXPERT_OUT else None
    if experts is not None and not hasattr(type(experts).forward, "__wrapped__"):
        raise UnsupportedArchitectureError(
            f"expected the experts of block {layer} ({type(experts).__name__}) to dispatch through transformers' "
            "experts interface (@use_experts_implementation), found a plain forward; mlp.hook_expert_out needs it")
    state = _block_state(model, adapter, layer)
    release = None
    if experts is not None:
        release = _SWITCH.acquire(model)
        _EXPERTS[experts] = state
    entry = (fn, tracker)
    state.hooks[kind].append(entry)

    def remove():
        hooks = state.hooks[kind]
        if entry not in hooks:
            return
        hooks.remove(entry)
        if experts is not None and release is not None:
            release()
            if not hooks:
                _EXPERTS.pop(experts, None)
        if not state.any():
            for h in state.handles:
                h.remove()
            state.handles.clear()
            if _BLOCKS.get(blk) is state:
                del _BLOCKS[blk]
    return MoEHandle(remove)


def _routed(state: _Block, out):
    """The router's output after the hooks of ``state`` (``None``: unchanged)."""
    logits, weights, indices = out
    hooks = state.hooks
    edited = False
    if hooks[ROUTER_LOGITS]:
        x = state.rows(logits)
        for fn, tracker in hooks[ROUTER_LOGITS]:
            y = fn(x, tracker.call(x))
            if y is not None:
                x, edited = y, True
        if edited:
            logits = x.reshape(logits.shape).to(logits.dtype)
            weights, indices = state.adapter.route(state.model, logits)
    for kind, value in ((EXPERT_WEIGHTS, weights), (EXPERT_INDICES, indices)):
        if hooks[kind]:
            x = state.rows(value)
            for fn, tracker in hooks[kind]:
                if fn(x, tracker.call(x)) is not None:
                    raise record_only_error(state.site(kind))
    return (logits, weights, indices) if edited else None


def _original_forward(module: nn.Module) -> Callable:
    return type(module).forward.__wrapped__  # type: ignore[attr-defined]


def _experts(module: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, *args,
             **kwargs) -> Tensor:
    state = _EXPERTS.get(module)
    if state is None or not state.hooks[EXPERT_OUT]:
        cfg: Any = module.config
        base = ImplementationSwitch.base_of(cfg._experts_implementation)
        fwd = _original_forward(module) if base == "eager" else ALL_EXPERTS_FUNCTIONS.get_interface(
            base, _original_forward(module))
        return fwd(module, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
    return per_expert(module, hidden_states, top_k_index, top_k_weights, state)


def expert_outputs(module: Any, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                   layout: "MoELayout") -> tuple[Tensor, list[int]]:
    """``([tokens, n_experts, d_model], experts used)``: each expert's weighted output for every token as
    eager experts compute it (zero where the token does not use the expert). ``layout``: the block's
    :class:`~steerkit.loading.adapters.MoELayout` (``adapter.moe_layout(model, layer)``), which knows the fused
    experts' weights and computes one expert (:meth:`~steerkit.loading.adapters.MoELayout.expert_output`).

    Examples:
        >>> from steerkit.hooks.moe import expert_outputs
        >>> from steerkit.loading.adapters import adapter_for
        >>> from transformers import MixtralConfig, MixtralForCausalLM
        >>> cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        ...                     num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
        ...                     num_experts_per_tok=2)
        >>> model = MixtralForCausalLM(cfg).eval()
        >>> adapter = adapter_for(model)
        >>> experts, layout = adapter.experts_module(model, 0), adapter.moe_layout(model, 0)
        >>> x, idx = torch.randn(3, 32), torch.tensor([[0, 1], [1, 2], [3, 0]])  # 3 tokens, 2 experts each
        >>> w = torch.full((3, 2), 0.5)
        >>> per, hit = expert_outputs(experts, x, idx, w, layout)
        >>> tuple(per.shape), hit, bool(torch.allclose(per.sum(1), experts(x, idx, w), atol=1e-6))
        ((3, 4, 32), [0, 1, 2, 3], True)
    """
    layout.check_experts(module)
    N, d = hidden_states.shape
    E = layout.n_routed(module)
    per = hidden_states.new_zeros(N, E, d)
    with torch.no_grad():
        mask = torch.nn.functional.one_hot(top_k_index, num_classes=E + 1).permute(2, 1, 0)
        hit = [int(e) for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist() if e < E]
    for e in hit:
        top_k_pos, token_idx = torch.where(mask[e])
        h = layout.expert_output(module, e, hidden_states[token_idx])
        h = h * top_k_weights[token_idx, top_k_pos, None]
        per[token_idx, e] = h.to(per.dtype)
    return per, hit


def per_expert(module: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
               state: _Block) -> Tensor:
    """The experts' output with ``mlp.hook_expert_out``'s hooks run on each expert's contribution.

    Examples:
        >>> from types import SimpleNamespace
        >>> from steerkit.hooks.moe import per_expert
        >>> from steerkit.loading.adapters import adapter_for
        >>> from transformers import MixtralConfig, MixtralForCausalLM
        >>> cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        ...                     num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
        ...                     num_experts_per_tok=2)
        >>> model = MixtralForCausalLM(cfg).eval()
        >>> adapter = adapter_for(model)
        >>> experts = adapter.experts_module(model, 0)
        >>> x, idx, w = torch.randn(3, 32), torch.tensor([[0, 1], [1, 2], [3, 0]]), torch.full((3, 2), 0.5)
        >>> zero_expert_1 = lambda h, call: h * torch.tensor([1.0, 0.0, 1.0, 1.0])[:, None]  # [.., n_experts, d]
        >>> tracker = SimpleNamespace(call=lambda h: None)
        >>> block = SimpleNamespace(hooks={"mlp.hook_expert_out": [(zero_expert_1, tracker)]}, rows=lambda h: h,
        ...                         layout=adapter.moe_layout(model, 0))  # what hooked() keeps for a block
        >>> out, eager = per_expert(experts, x, idx, w, block), experts(x, idx, w)
        >>> bool(torch.allclose(out[2], eager[2], atol=1e-6)), bool(torch.allclose(out[1], eager[1]))
        (True, False)
    """
    per, hit = expert_outputs(module, hidden_states, top_k_index, top_k_weights, state.layout)
    x = state.rows(per)
    edited = False
    for fn, tracker in state.hooks[EXPERT_OUT]:
        y = fn(x, tracker.call(x))
        if y is not None:
            x, edited = y, True
    per = x.reshape(per.shape).to(per.dtype)
    out = torch.zeros_like(hidden_states)
    for e in (range(per.shape[1]) if edited else hit):  # in expert order, as eager experts add them up
        out = out + per[:, e]
    return out
