"""TransformerLens 4 backend: hook functions run on a ``TransformerBridge``'s hook points.

The bridge (``TransformerBridge.boot_transformers(name, hf_model=..., tokenizer=...)``)
rewires the model it wraps (it swaps sub-modules for bridge components and forces
eager attention), so this backend boots it on its *own module tree* of the HF model
(:func:`~steerkit.backends._torch.shell_copy`: new module objects over the same weight tensors,
so no weight is duplicated);
``sm.hf_model`` stays the untouched original that facts (config, fingerprint,
generation config) are read from.

Sites map onto the bridge's :class:`~transformer_lens.hook_points.HookPoint` modules;
steerkit registers plain PyTorch forward hooks on them (a ``HookPoint`` is an
identity module, so a forward hook that returns a tensor replaces the activation
for everything downstream):

- ``hook_resid_pre``  -> ``blocks.{l}.hook_in`` (the block input, before the
  pre-attention norm *and* the residual branch read it);
- ``hook_resid_post`` -> ``blocks.{l}.hook_out``;
- ``hook_attn_out`` / ``hook_mlp_out`` -> the bridge's own ``blocks.{l}.hook_attn_out`` /
  ``hook_mlp_out`` aliases (``attn.hook_out`` / ``mlp.hook_out`` on Llama; the
  post-sub-layer norms on Gemma 2-style blocks): what each sub-layer adds to the residual;
- the component hooks (``attn.hook_q`` ... ``ln2.hook_normalized``) -> the bridge's own hook
  points of those names (it computes attention eagerly, so scores and pattern are its own);
- ``ln_final.hook_scale`` / ``hook_normalized`` / ``hook_out`` -> the bridge's own
  hook points of those names (the norm's scale, the normalised stream before the
  weight, the output). An edit of the bridge's ``hook_normalized`` reaches the
  output: the bridge then builds it as ``normalized * w_eff + bias``;
  ``hook_scale`` is recorded only (an edit raises :class:`~steerkit.errors.InputError`);
- ``hook_resid_mid``: the bridge aliases it to ``ln2.hook_in``, but replacing that
  only changes the MLP's *input*: the HF block adds the MLP output to its own local
  copy of the residual, so the edit would not reach ``resid_post``. As in the HF
  backend, ``mid`` is read as ``ln1.hook_in + hook_attn_out`` (``ln1.hook_in``: the
  block input after any ``hook_resid_pre`` edit) and an edit ``f`` adds
  ``f(mid) - mid`` to the attention output, which changes everything downstream
  exactly as editing ``mid`` would.

Inputs are token ids passed straight to the bridge (no BOS is prepended, no
re-tokenization), with steerkit's attention mask and position ids, so every
backend sees identical inputs.

KV cache: the bridge's attention re-implementation looks for the cache under the
``past_key_values`` keyword, while transformers 5.x passes it to the attention
module as ``cache=`` (which is why the bridge's own cached ``generate`` produces
garbage there: every decode step attends to itself only). This backend installs
one forward pre-hook per attention bridge that hands the ``cache`` keyword on as
``past_key_values``; with it, :meth:`step` is a real KV-cached step (one new token
per call), and greedy tokens match the HF backend. Those pre-hooks are part of the
backend's baseline :meth:`hook_count`; :meth:`reset` leaves them in place.

Mixture-of-experts hooks (``mlp.hook_router_logits`` ... ``mlp.hook_expert_out``) are refused with
:class:`~steerkit.errors.UnsupportedArchitectureError`: the bridge has no hook points for a sparse block's
router or experts (use ``backend="hf"`` or ``"nnsight"``), and ``mlp.hook_pre`` / ``hook_post`` are
refused at a sparse block, which has no dense MLP neurons.

Numerics: the bridge runs eager attention while the HF backend runs SDPA, so
activations agree with the HF backend to float32 rounding (about 1e-5 relative),
not bit for bit.
"""
from __future__ import annotations

import inspect
import logging
import warnings
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor, nn

from steerkit.errors import InputError, UnsupportedArchitectureError
from steerkit.hooks.names import COMPONENT_HOOKS, FINAL_HOOKS, HEAD_HOOKS, KV_HOOKS, MLP_HOOKS, MOE_HOOKS, Site, record_only_error
from steerkit.backends._torch import TorchHooks, shell_copy
from transformers import DynamicCache

if TYPE_CHECKING:
    from steerkit.model import SteerModel


def _cache_alias_pre_hook(mod, args, kwargs):
    """transformers 5.x names the KV cache ``cache``; the bridge's attention reads ``past_key_values``."""
    if kwargs.get("past_key_values") is None and kwargs.get("cache") is not None:
        kwargs = dict(kwargs)
        kwargs["past_key_values"] = kwargs["cache"]
        return args, kwargs
    return None


class TLensBackend(TorchHooks):
    name = "tlens"

    def __init__(self, sm: "SteerModel"):
        try:
            from transformer_lens.model_bridge import TransformerBridge
        except ImportError as e:  # pragma: no cover - depends on the install
            raise InputError("the 'tlens' backend needs transformer-lens 4: "
                             "pip install 'steerkit[backends]'") from e
        self.sm = sm
        src = sm.hf_model
        # The bridge swaps sub-modules and re-configures attention in what it wraps: give it its own
        # module tree over the same weights.
        model_copy = shell_copy(src)
        tl_logger = logging.getLogger("transformer_lens")
        level = tl_logger.level
        tl_logger.setLevel(logging.ERROR)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.bridge = TransformerBridge.boot_transformers(
                    sm.name, hf_model=model_copy, tokenizer=sm.tokenizer,
                    device=str(next(src.parameters()).device), dtype=next(src.parameters()).dtype)
        finally:
            tl_logger.setLevel(level)
        self.bridge.eval()
        self.hf = self.bridge.original_model
        params = inspect.signature(self.hf.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._hooks = self.bridge.hook_dict
        TorchHooks.__init__(self)
        self._infra_handles: list = []
        if self._cache_kw == "cache":
            for blk in self.bridge.blocks:
                attn = getattr(blk, "attn", None)
                if attn is not None:
                    self._infra_handles.append(
                        attn.register_forward_pre_hook(_cache_alias_pre_hook, with_kwargs=True))
        # The bridge wires some capture hooks lazily on its first forward; run one tiny
        # forward now so hook_count() has a stable baseline.
        with torch.inference_mode():
            ids = torch.zeros(1, 1, dtype=torch.long, device=self.sm.device)
            self.forward(ids, torch.ones_like(ids), torch.zeros_like(ids))

    # --- hooks -------------------------------------------------------------------
    def _hp(self, *names: str) -> nn.Module:
        """The first of ``names`` the bridge has (aliases such as ``blocks.0.hook_attn_out``
        resolve to the architecture's own hook point, e.g. the post-attention norm on Gemma 2)."""
        for name in names:
            hp = self._hooks.get(name)
            if hp is not None:
                return hp
        raise UnsupportedArchitectureError(
            f"expected the TransformerBridge to have one of the hook points {names}, found none; use "
            "backend='hf' for this model or a hook this architecture exposes")

    def _point_for(self, site: Site) -> nn.Module:
        l = site.layer
        if site.kind in FINAL_HOOKS or site.kind in COMPONENT_HOOKS:  # the bridge's own hook point of that name
            return self._hp(site.name)
        return self._hp(*{
            "hook_resid_pre": (f"blocks.{l}.hook_in", f"blocks.{l}.hook_resid_pre"),
            "hook_resid_post": (f"blocks.{l}.hook_out", f"blocks.{l}.hook_resid_post"),
            "hook_attn_out": (f"blocks.{l}.hook_attn_out", f"blocks.{l}.attn.hook_out"),
            "hook_mlp_out": (f"blocks.{l}.hook_mlp_out", f"blocks.{l}.mlp.hook_out"),
        }[site.kind])

    def register(self, site: Site, fn, tracker) -> Callable[[], None]:
        if site.kind in MOE_HOOKS:
            raise UnsupportedArchitectureError(
                f"expected a hook the TransformerBridge exposes, found {site.name!r}: the bridge has no hook points "
                "for a mixture-of-experts block's router or experts; use backend='hf' or backend='nnsight' for it")
        if site.kind in MLP_HOOKS:
            self.sm.adapter.check_dense_mlp(self.sm.hf_model, site.block_index)
        if site.kind == "hook_resid_mid":
            return self._register_mid(site, fn, tracker)
        if site.kind.endswith(("hook_scale", "hook_normalized")):
            dtype, name = self.sm.dtype, site.name

            def at_model_dtype(x, call):  # the bridge computes these two in float32
                r = fn(x.to(dtype), call)
                if r is None:
                    return None
                if name.endswith("hook_scale"):
                    raise record_only_error(name)
                return r.to(x.dtype)
            return self._edit_output(self._point_for(site), at_model_dtype, tracker)
        if site.kind in HEAD_HOOKS:
            # the bridge's hook points carry [batch, pos, heads * d_head] (it reshapes only for its own hooks)
            heads = self.sm.n_kv_heads if site.kind in KV_HOOKS else self.sm.n_heads
            dh = self.sm.d_head
            flat_fn, flat_tracker = fn, tracker

            def on_heads(x, call):
                y = flat_fn(x.unflatten(-1, (heads, dh)), call)
                return None if y is None else y.flatten(-2)

            class _HeadTracker:
                def call(self, x):
                    return flat_tracker.call(x.unflatten(-1, (heads, dh)))
            return self._edit_output(self._point_for(site), on_heads, _HeadTracker())
        return self._edit_output(self._point_for(site), fn, tracker)

    def _register_mid(self, site: Site, fn, tracker) -> Callable[[], None]:
        # ln1.hook_in outputs the residual entering the attention sub-layer
        l = site.layer
        return self._edit_mid(self._hp(f"blocks.{l}.ln1.hook_in", f"blocks.{l}.attn.hook_in"), False,
                              self._point_for(Site(site.name, "hook_attn_out", l)), fn, tracker)

    def hook_count(self) -> int:
        """Every torch hook on the bridge's modules: steerkit's, plus the bridge's own capture
        hooks and the cache-alias pre-hooks (a constant baseline, 90 on a 30-layer Llama)."""
        n = 0
        for m in self.bridge.modules():
            n += len(m._forward_hooks) + len(m._forward_pre_hooks)
        return n

    # --- running -----------------------------------------------------------------
    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, keep: int = 0) -> Tensor:
        """Logits of the last ``keep`` positions (0: all)."""
        return self.bridge(input_ids, return_type="logits", attention_mask=attention_mask,
                           position_ids=position_ids, use_cache=False, logits_to_keep=keep)

    def new_cache(self):
        return DynamicCache(config=self.hf.config)

    def step(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, cache, keep: int = 1):
        """One KV-cached step: logits of the last position (``keep=0``: ``[batch, T, vocab]`` of every fed
        position), and the cache.

        The cache object is passed to the HF model under its own keyword (``cache=`` on
        transformers 5.x) and updated in place by the bridge's attention (see the module
        docstring for the keyword alias that makes that work).
        """
        logits = self.bridge(input_ids, return_type="logits", attention_mask=attention_mask,
                             position_ids=position_ids, use_cache=True, logits_to_keep=keep,
                             **{self._cache_kw: cache})
        return (logits[:, -1] if keep == 1 else logits), cache
