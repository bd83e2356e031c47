"""Attention scores and probabilities where the model runs SDPA or flash attention.

``attn.hook_attn_scores`` and ``attn.hook_pattern`` are intermediate values of the attention
*function*, which fused kernels (SDPA, flash attention) never materialise. transformers 5 calls the
function by name through its ``AttentionInterface`` (``config._attn_implementation``), with the
queries and keys after rotary embeddings and the keys of the whole KV cache. While a scores or
pattern hook is registered on a model, :func:`hooked` switches its implementation to
``"steerkit:<base>"``: a function that, for the attention modules that carry such a hook, computes
attention the eager way (``softmax(q k^T * scaling + mask) v``, with a logit soft-cap where the family
has one, statistics in float32) and runs the hooks on the scores (the dtype's lowest value where a
query does not attend, as eager attention and TransformerLens 4 store them) and on the probabilities; every other module runs the base
implementation unchanged. The mask function registered for the new name is the base's, so masks
(padding, sliding windows) are built as before. When the last such hook goes, the model's own
implementation is restored.

Hooked modules therefore compute attention as eager attention does: their output equals the fused
kernel's to float rounding (about 1e-6 relative in float32), not bit for bit.
"""
from __future__ import annotations

import contextlib
import math
import sys
import weakref
from contextvars import ContextVar
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor, nn

from steerkit.errors import InputError, UnsupportedArchitectureError
from steerkit.hooks import segments
from steerkit.hooks.implswitch import PREFIX, ImplementationSwitch
from steerkit.imports import quiet_optional_imports

with quiet_optional_imports():  # transformers.modeling_utils imports torchao when it is installed
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

# attention module -> {"attn.hook_attn_scores": [(fn, tracker), ...], "attn.hook_pattern": [...]}
_HOOKS: "weakref.WeakKeyDictionary[nn.Module, dict[str, list]]" = weakref.WeakKeyDictionary()


def _register_name(base: str) -> str:
    attn, masks = ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS
    name = PREFIX + base
    if name not in attn._global_mapping:
        mask_fn = masks._global_mapping.get(base)
        if mask_fn is None:
            raise UnsupportedArchitectureError(
                f"expected a model whose attention implementation builds masks transformers knows (sdpa, eager, "
                f"flash_attention_*, flex_attention), found {base!r}; load it with attn_implementation='sdpa'")
        attn.register(name, _attention)  # type: ignore[arg-type]
        masks.register(name, mask_fn)  # type: ignore[arg-type]
    return name


_SWITCH = ImplementationSwitch("_attn_implementation", _register_name)


def hooked(model: nn.Module, attn_module: nn.Module, kind: str, fn, tracker) -> Callable[[], None]:
    """Run ``fn(x, tracker.call(x))`` on ``attn_module``'s scores or probabilities (``kind``:
    ``attn.hook_attn_scores`` / ``attn.hook_pattern``); returns the function that removes it.

    Examples:
        >>> from steerkit.hooks.manager import PositionTracker, RunHolder
        >>> seen = []
        >>> attn = tiny.hf_model.model.layers[0].self_attn
        >>> remove = hooked(tiny.hf_model, attn, "attn.hook_pattern", lambda x, call: seen.append(x.sum(-1)),
        ...                 PositionTracker(RunHolder()))
        >>> tiny.hf_model.config._attn_implementation
        'steerkit:sdpa'
        >>> _ = tiny.forward("hello world", chat=False)
        >>> remove()
        >>> tiny.hf_model.config._attn_implementation, tuple(seen[0].shape), bool(torch.allclose(seen[0], torch.tensor(1.0)))
        ('sdpa', (1, 4, 2), True)
    """
    release = _SWITCH.acquire(model)
    entry = (fn, tracker)
    _HOOKS.setdefault(attn_module, {}).setdefault(kind, []).append(entry)

    def remove():
        hooks = _HOOKS.get(attn_module, {}).get(kind, [])
        if entry in hooks:
            hooks.remove(entry)
            release()
    return remove


_SEGMENTS: "ContextVar[Optional[segments.Segments]]" = ContextVar("steerkit_packed_segments", default=None)


@contextlib.contextmanager
def packed(model: nn.Module, layout: segments.Segments) -> Iterator[None]:
    """Within, ``model``'s attention takes its single row as the packed segments ``layout`` and computes
    them as a batch of whole sequences (:mod:`steerkit.hooks.segments`); restored afterwards.

    Examples:
        >>> from steerkit.hooks.segments import Segments
        >>> with packed(tiny.hf_model, Segments.of([0], n_pos=3)):
        ...     inside = tiny.hf_model.config._attn_implementation
        >>> inside, tiny.hf_model.config._attn_implementation
        ('steerkit:sdpa', 'sdpa')
    """
    release = _SWITCH.acquire(model)
    token = _SEGMENTS.set(layout)
    try:
        yield
    finally:
        _SEGMENTS.reset(token)
        release()


def _run(hooks: list, x: Tensor) -> Tensor:
    for fn, tracker in hooks:
        y = fn(x, tracker.call(x))
        if y is not None:
            x = y
    return x


def _attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
               scaling: Optional[float] = None, dropout: float = 0.0, softcap: Optional[float] = None, **kwargs):
    hooks = _HOOKS.get(module)
    layout = _SEGMENTS.get()
    if layout is not None:
        if hooks and any(hooks.values()):
            raise InputError("expected no attn.hook_attn_scores / attn.hook_pattern hook during a packed pass, found "
                             f"{sorted(k for k, v in hooks.items() if v)}; run the continuations with run_from")
        return _segmented(module, layout, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                          softcap=softcap, **kwargs)
    if not hooks or not any(hooks.values()):
        cfg: Any = module.config
        fused: Any = ALL_ATTENTION_FUNCTIONS._global_mapping.get(ImplementationSwitch.base_of(cfg._attn_implementation))
        if fused is not None:
            return fused(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, softcap=softcap,
                         **kwargs)
    return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, softcap=softcap,
                 sliding_window=kwargs.get("sliding_window"), hooks=hooks or {})


def _segmented(module: nn.Module, layout: segments.Segments, query: Tensor, key: Tensor, value: Tensor,
               attention_mask: Optional[Tensor], *, softcap: Optional[float] = None, **kwargs):
    """A packed pass's attention through the model's own function (the fused one, or its modeling file's
    eager attention), one whole sequence per segment."""
    cfg: Any = module.config
    base = ImplementationSwitch.base_of(cfg._attn_implementation)
    fn: Any = ALL_ATTENTION_FUNCTIONS._global_mapping.get(base)
    if fn is None:
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        def fn(m, q, k, v, mask, **kw):
            return eager(m, q, k, v, mask, scaling=kw.get("scaling"), dropout=kw.get("dropout", 0.0),
                         softcap=kw.get("softcap"), sliding_window=kw.get("sliding_window"))
    extra = {} if softcap is None else {"softcap": softcap}
    return segments.attend(fn, module, layout, query, key, value, attention_mask, base == "sdpa", **extra, **kwargs)


def eager(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor], *,
          scaling: Optional[float] = None, dropout: float = 0.0, softcap: Optional[float] = None,
          sliding_window: Optional[int] = None, hooks: Optional[dict] = None) -> tuple[Tensor, Tensor]:
    """Eager attention over ``query [b, heads, q, d]`` and ``key`` / ``value [b, kv_heads, k, d]`` (the
    whole cache), with ``attention_mask`` as transformers builds it: ``[b, 1, q, k]`` bool (True where a
    query attends) or float (added to the scores), complete (causal, padding, sliding window); ``None``
    (causal) or ``[b, k]`` (flash attention's padding mask: causal, and ``sliding_window`` applied here).
    Returns ``(output [b, q, heads, d], probabilities)``.

    Examples:
        >>> q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
        >>> out, probs = eager(tiny.hf_model.model.layers[0].self_attn, q, k, v, None)  # causal
        >>> tuple(out.shape), tuple(probs.shape), probs[0, 0, 0].tolist()
        ((1, 3, 4, 16), (1, 4, 3, 3), [1.0, 0.0, 0.0])
        >>> sdpa = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1),
        ...                                                         v.repeat_interleave(2, 1), is_causal=True)
        >>> torch.allclose(out, sdpa.transpose(1, 2), atol=1e-5)
        True
    """
    hooks = hooks or {}
    n_rep = query.shape[1] // key.shape[1]
    if n_rep > 1:
        key = key.repeat_interleave(n_rep, dim=1)
        value = value.repeat_interleave(n_rep, dim=1)
    if scaling is None:
        scaling = 1.0 / math.sqrt(query.shape[-1])
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    Q, K = scores.shape[-2], scores.shape[-1]
    if attention_mask is None or attention_mask.dim() == 2:
        q_pos = torch.arange(K - Q, K, device=scores.device)[:, None]
        k_pos = torch.arange(K, device=scores.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window:
            allowed = allowed & (q_pos - k_pos < sliding_window)
        if attention_mask is not None:
            allowed = allowed & attention_mask[:, None, None, -K:].bool()
    elif attention_mask.dtype == torch.bool:
        allowed = attention_mask[..., :K]
    else:
        allowed = attention_mask[..., :K] > torch.finfo(attention_mask.dtype).min / 2
    # the dtype's lowest value where a query does not attend, as eager attention's additive mask leaves it
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    scores = _run(hooks.get("attn.hook_attn_scores", []), scores)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = _run(hooks.get("attn.hook_pattern", []), probs)
    if dropout and module.training:
        probs = nn.functional.dropout(probs, p=dropout, training=True)
    out = torch.matmul(probs, value).transpose(1, 2).contiguous()
    return out, probs
