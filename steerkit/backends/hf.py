"""The default backend: plain PyTorch forward hooks on a Hugging Face model.

Sites map onto modules through the model's :class:`~steerkit.loading.adapters.Adapter`:

- ``hook_resid_pre``: forward pre-hook on the block (edits replace its input);
- ``hook_resid_post``: forward hook on the block (edits replace its output);
- ``hook_attn_out`` / ``hook_mlp_out``: forward hook on the module whose output
  the block adds to the residual;
- ``hook_resid_mid``: the residual between the two sub-layers exists only as a
  local variable inside the block. It is read as ``resid_pre + attn_out``
  (``resid_pre`` taken at the input of the pre-attention norm, so it sees any
  edit made at ``hook_resid_pre``), and an edit ``f`` is applied by adding
  ``f(mid) - mid`` to the attention output, which changes everything the block
  computes afterwards exactly as editing ``mid`` would;
- ``ln_final.hook_out``: forward hook on the final norm (edits replace its output);
- ``ln_final.hook_scale`` / ``ln_final.hook_normalized``: a forward hook on the
  final norm that computes them from its input as the norm does (the adapter's
  :class:`~steerkit.loading.adapters.FinalNorm`); an edit ``f`` of the normalised stream
  ``n`` makes the output ``y + (f(n) - n) * w_eff``. Hooks at the final norm run
  in registration order.

- component hooks (``attn.hook_q`` ... ``ln2.hook_normalized``) on the modules the adapter's
  :class:`~steerkit.loading.adapters.AttnLayout` / :class:`~steerkit.loading.adapters.MLPLayout` name: ``mlp.hook_in``
  reads (and an edit replaces) the MLP module's input; ``hook_q`` /
  ``hook_k`` / ``hook_v`` read (and edits replace) the projection's output, or its slice of a fused
  projection; ``hook_z`` and ``mlp.hook_post`` the input of the output / down projection;
  ``mlp.hook_pre`` the gate projection's output (its first half when fused with the up projection);
  ``ln1`` / ``ln2`` as at the final norm; ``hook_attn_scores`` / ``hook_pattern`` through
  :mod:`steerkit.hooks.attention` (eager attention for the hooked modules only);
- mixture-of-experts hooks (``mlp.hook_router_logits`` ... ``mlp.hook_expert_out``) through
  :mod:`steerkit.hooks.moe`: a forward hook on the router (edited logits re-route the block) and, for the
  per-expert outputs, the experts implementation switched for the hooked experts modules only.

Tuple outputs are handled by editing their first element.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Optional

from torch import Tensor, nn

from steerkit.hooks import attention
from steerkit.hooks import moe
from steerkit.hooks.segments import Segments
from steerkit.loading.adapters import Adapter, get_module
from steerkit.hooks.names import (COMPONENT_HOOKS, FINAL_NORMALIZED, FINAL_OUT, FINAL_SCALE, MATRIX_HOOKS, MOE_HOOKS, NORM_HOOKS,
                         Site)
from steerkit.backends._torch import TorchHooks, component_access
from transformers import DynamicCache


class _PassThrough(nn.Module):
    """A block that is not run: it returns the hidden state it is given."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class HFBackend(TorchHooks):
    name = "hf"

    def __init__(self, model: nn.Module, adapter: Adapter):
        self.model = model
        self.adapter = adapter
        super().__init__()
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    # --- hooks -------------------------------------------------------------------
    def _module_for(self, site: Site) -> nn.Module:
        a, m = self.adapter, self.model
        if site.kind == FINAL_OUT:
            return a.final_norm_module(m)
        if site.kind in ("hook_resid_pre", "hook_resid_post"):
            return a.block(m, site.block_index)
        if site.kind == "hook_attn_out":
            return a.attn_out_module(m, site.block_index)
        if site.kind == "hook_mlp_out":
            return a.mlp_out_module(m, site.block_index)
        raise AssertionError(site)

    def register(self, site: Site, fn, tracker) -> Callable[[], None]:
        if site.kind == "hook_resid_pre":
            def pre(mod, args, kwargs):
                if args:
                    x = args[0]
                    y = fn(x, tracker.call(x))
                    return None if y is None else ((y,) + tuple(args[1:]), kwargs)
                x = kwargs["hidden_states"]
                y = fn(x, tracker.call(x))
                if y is None:
                    return None
                kwargs = dict(kwargs, hidden_states=y)
                return args, kwargs
            return self._track(self._module_for(site).register_forward_pre_hook(pre, with_kwargs=True))
        if site.kind in (FINAL_SCALE, FINAL_NORMALIZED):
            a, m = self.adapter, self.model
            return self._final_norm(a.final_norm_module(m), site.kind, lambda x: a.final_norm_parts(m, x),
                                    lambda: a.final_norm_affine(m), fn, tracker)
        if site.kind == "hook_resid_mid":
            return self._edit_mid(self.adapter.pre_attn_norm_module(self.model, site.block_index), True,
                                  self.adapter.attn_out_module(self.model, site.block_index), fn, tracker)
        if site.kind in COMPONENT_HOOKS:
            return self._component(site, fn, tracker)
        if site.kind in MOE_HOOKS:
            return self._track(moe.hooked(self.model, self.adapter, site.block_index, site.kind, fn, tracker))
        return self._edit_output(self._module_for(site), fn, tracker)

    def _component(self, site: Site, fn, tracker) -> Callable[[], None]:
        a, m, kind = self.adapter, self.model, site.kind
        if kind in NORM_HOOKS:
            mod = a.block_norm_module(m, site.block_index, kind[:3])
            return self._final_norm(mod, kind, lambda x: a.norm_parts(mod, x), lambda: a.norm_affine(mod), fn,
                                    tracker)
        if kind in MATRIX_HOOKS:
            return attention.hooked(m, a.attn_module(m, site.block_index), kind, fn, tracker)
        acc = component_access(a, m, site)
        mod = get_module(a.block(m, site.block_index), acc.path)
        if acc.io == "input":
            return self._edit_input(mod, acc.get, acc.put, fn, tracker)
        return self._edit_part(mod, acc.get, acc.put, fn, tracker)

    def hook_count(self) -> int:
        """Torch hooks steerkit registered and has not removed (not transformers' own: the
        output-capturing hooks it installs, once, at the first ``output_hidden_states=True`` call)."""
        return len(self._torch_handles)

    # --- running -----------------------------------------------------------------
    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, keep: int = 0) -> Tensor:
        """Logits of the last ``keep`` positions (0: all; the others skip the unembedding)."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False, logits_to_keep=keep)
        return out.logits

    def new_cache(self, full: bool = False):
        """An empty KV cache; ``full``: one that keeps every position at every layer (sliding-window layers
        included), so it can be cut at any position later (:mod:`steerkit.reuse`)."""
        return DynamicCache() if full else DynamicCache(config=self.model.config)  # type: ignore[arg-type]

    def run_blocks(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, cache, first: int,
                   resid: Tensor, keep: int = 0, segments: Optional[Segments] = None):
        """A forward pass of ``input_ids`` (the positions after the cache's) in which block ``first``
        receives ``resid`` and the blocks below it are passed through, not run (:func:`steerkit.reuse.run_from`).
        ``segments``: the row is a packed pass laid out so (:func:`steerkit.reuse.run_packed`), its
        attention computed one whole sequence per segment. Returns the logits and the cache."""
        blocks = self.adapter.block_list(self.model)
        below = [blocks[i] for i in range(first)]

        def inject(mod, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            y = resid.to(device=x.device, dtype=x.dtype)
            if args:
                return (y,) + tuple(args[1:]), kwargs
            return args, dict(kwargs, hidden_states=y)

        handle = blocks[first].register_forward_pre_hook(inject, with_kwargs=True, prepend=True)
        scope = contextlib.nullcontext() if segments is None else attention.packed(self.model, segments)
        try:
            for i in range(first):
                blocks[i] = _PassThrough()
            with scope:
                out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 use_cache=True, logits_to_keep=keep, **{self._cache_kw: cache})
        finally:
            for i, b in enumerate(below):
                blocks[i] = b
            handle.remove()
        return out.logits, getattr(out, "cache", None) or getattr(out, "past_key_values", None) or cache

    def step(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, cache, keep: int = 1):
        """One step with a KV cache: logits of the last position (``keep=0``: ``[batch, T, vocab]`` of
        every fed position), and the cache."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, logits_to_keep=keep, **{self._cache_kw: cache})
        new_cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None) or cache
        return (out.logits[:, -1] if keep == 1 else out.logits), new_cache
