"""nnsight 0.8 backend: hook functions run as interventions inside ``lm.trace(...)``.

``register(site, fn, tracker)`` only stores the function; nothing is attached to
the model. Every :meth:`NNsightBackend.forward` and :meth:`~NNsightBackend.step`
opens one ``with lm.trace(...)`` over steerkit's own token ids, attention mask and
position ids (no re-tokenization, no BOS), and inside it walks the registered
sites *in execution order* (nnsight requires a trace body to touch modules in the
order the forward pass runs them), reading each envoy's value, calling the hook
functions on it in registration order and writing the result back:

- ``hook_resid_pre``  -> ``layers[l].input`` (the block's first input);
- ``hook_attn_out`` / ``hook_mlp_out`` -> the output (first element when a
  tuple) of the module the adapter names as the sub-layer's contribution;
- ``hook_resid_post`` -> ``layers[l].output``;
- ``ln_final.hook_out`` -> the final norm's output; ``ln_final.hook_scale`` and
  ``ln_final.hook_normalized`` are computed from the final norm's input as the
  norm computes them (the adapter's :class:`~steerkit.loading.adapters.FinalNorm`), and an
  edit ``f`` of the normalised stream ``n`` makes the output
  ``y + (f(n) - n) * w_eff``; the final norm's hooks run in registration order;
- ``hook_resid_mid``: as in the HF backend, read as ``pre_attn_norm.input +
  attn_out`` and edited by adding ``f(mid) - mid`` to the attention output;
- component hooks: ``attn.hook_q`` / ``k`` / ``v`` / ``z`` and ``mlp.hook_in`` / ``hook_pre`` / ``post`` on the
  input or output of the module the adapter names (one read and write per fused projection),
  ``ln1`` / ``ln2`` as at the final norm, and ``attn.hook_attn_scores`` / ``hook_pattern`` through
  :mod:`steerkit.hooks.attention` (the hook runs inside the traced model's attention function);
- mixture-of-experts hooks (``mlp.hook_router_logits`` ... ``mlp.hook_expert_out``) through
  :mod:`steerkit.hooks.moe` on the wrapped copy's router and experts (they run inside the traced forward,
  as the attention matrices do).

Module paths come from the model's :class:`~steerkit.loading.adapters.Adapter`, so the
backend is not tied to Llama. nnsight patches the ``forward`` of every module of
the model it wraps, so the backend wraps its *own module tree* of the HF model (new module
objects over the same weight tensors: no weight is duplicated);
``sm.hf_model`` stays untouched.

Generation does not use nnsight's ``generate``: steerkit's loop calls
:meth:`step` once per token, and each step is one trace over the new token with
the HF ``DynamicCache`` passed through to the model, so the KV cache is real
(one token per step after the prompt) and every edit applies at every step.
"""
from __future__ import annotations

import inspect
import itertools
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from torch import Tensor

from steerkit.errors import InputError, SteerkitError
from steerkit.hooks import attention
from steerkit.hooks import moe
from steerkit.hooks.names import FINAL_HOOKS, FINAL_OUT, MATRIX_HOOKS, MLP_HOOKS, MOE_HOOKS, NORM_HOOKS, Site, record_only_error
from steerkit.backends._torch import Access, component_access, shell_copy, first as _first, normalized_edit, with_first as _with_first
from transformers import DynamicCache

if TYPE_CHECKING:
    from steerkit.model import SteerModel

if TYPE_CHECKING:
    from steerkit.hooks.manager import PositionTracker


def _envoy(root, path: str):
    env = root
    for part in path.split("."):
        env = env[int(part)] if part.isdigit() else getattr(env, part)
    return env


@dataclass
class _Entry:
    site: Site
    fn: Callable
    tracker: PositionTracker
    order: int
    access: Optional[Access] = None  # head / neuron sites: where the value lives (found at registration)


# Where in a block each kind of site is touched, in execution order (attention scores and pattern
# are not touched in the trace: steerkit.hooks.attention runs their hooks inside the attention function).
_STAGE = {"hook_resid_pre": 0, "ln1.hook_scale": 1, "ln1.hook_normalized": 1, "attn.hook_q": 2.0,
          "attn.hook_k": 2.1, "attn.hook_v": 2.2, "attn.hook_z": 3, "hook_attn_out": 4, "hook_resid_mid": 4,
          "ln2.hook_scale": 5, "ln2.hook_normalized": 5, "mlp.hook_in": 5.5, "mlp.hook_pre": 6, "mlp.hook_post": 7,
          "hook_mlp_out": 8, "hook_resid_post": 9}
#: the stages of head and neuron sites (q / k / v, z, the MLP's input, pre-activation and neurons)
_COMPONENT_STAGES = (2.0, 2.1, 2.2, 3, 5.5, 6, 7)


class NNsightBackend:
    name = "nnsight"

    def __init__(self, sm: "SteerModel"):
        try:
            from nnsight import LanguageModel
        except ImportError as e:  # pragma: no cover - depends on the install
            raise InputError("the 'nnsight' backend needs nnsight 0.8: pip install 'steerkit[backends]'") from e
        self.sm = sm
        self.adapter = sm.adapter
        self.model = shell_copy(sm.hf_model)  # nnsight patches every module's forward: its own modules, shared weights
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # LanguageModel is a deprecated alias in 0.8
            self.lm = LanguageModel(self.model, tokenizer=sm.tokenizer)
        params = inspect.signature(type(self.model).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._entries: list[_Entry] = []
        self._order = itertools.count()
        self._stash = None  # the residual entering attention of the block being traced (for resid_mid)

    # --- hooks -------------------------------------------------------------------
    def register(self, site: Site, fn, tracker) -> Callable[[], None]:
        if site.kind in MATRIX_HOOKS:
            return attention.hooked(self.model, self.adapter.attn_module(self.model, site.block_index), site.kind,
                                    fn, tracker)
        if site.kind in MOE_HOOKS:
            return moe.hooked(self.model, self.adapter, site.block_index, site.kind, fn, tracker).remove
        if site.kind in NORM_HOOKS:
            self.adapter.block_norm_module(self.model, site.block_index, site.kind[:3])  # the family has it
        if site.kind in MLP_HOOKS:
            self.adapter.check_dense_mlp(self.model, site.block_index)  # a sparse block has no neurons
        access = component_access(self.adapter, self.model, site) if _STAGE.get(site.kind) in _COMPONENT_STAGES \
            else None
        e = _Entry(site, fn, tracker, next(self._order), access)
        self._entries.append(e)

        def remove():
            try:
                self._entries.remove(e)
            except ValueError:
                pass
        return remove

    def hook_count(self) -> int:
        """Registered hook functions, plus any torch hooks on the wrapped copy's modules."""
        n = len(self._entries)
        for m in self.model.modules():
            n += len(m._forward_hooks) + len(m._forward_pre_hooks)
        return n

    def reset(self) -> None:
        self._entries.clear()

    # --- the intervention --------------------------------------------------------
    def _plan(self):
        """Registered entries grouped by (layer, stage), in execution order."""
        by_layer: dict[int, dict[int, list[_Entry]]] = {}
        final: list[_Entry] = []
        for e in sorted(self._entries, key=lambda e: e.order):
            if e.site.kind in FINAL_HOOKS:
                final.append(e)
            else:
                by_layer.setdefault(e.site.layer, {}).setdefault(_STAGE[e.site.kind], []).append(e)
        return [(l, by_layer[l]) for l in sorted(by_layer)], final

    @staticmethod
    def _apply(entries: list[_Entry], x: Tensor, stash: Optional[Tensor]) -> Tensor:
        """Run hook functions on one activation; resid_mid entries see ``stash + x``."""
        for e in entries:
            if e.site.kind == "hook_resid_mid":
                if stash is None:
                    raise SteerkitError(f"expected the input of the pre-attention norm for {e.site.name}, found "
                                        "none; hook_resid_mid reads it there, so this is a steerkit bug to report")
                mid = stash + x
                y = e.fn(mid, e.tracker.call(mid))
                if y is not None:
                    x = x + (y - mid)
            else:
                y = e.fn(x, e.tracker.call(x))
                if y is not None:
                    x = y
        return x

    def _components(self, blk, entries: list[_Entry]) -> None:
        """Head / neuron sites of one stage, grouped by the module that holds them (a fused projection
        holds q, k and v: it is read and written once)."""
        groups: dict[tuple, list] = {}
        for e in entries:
            acc = e.access
            assert acc is not None, e.site
            groups.setdefault((acc.path, acc.io), []).append((e, acc))
        for (path, io), items in groups.items():
            env = _envoy(blk, path)
            t0 = env.input if io == "input" else env.output
            t = _first(t0)
            new = t
            for e, acc in items:
                x = acc.get(new)
                y = e.fn(x, e.tracker.call(x))
                if y is not None:
                    new = acc.put(new, y)
            if new is not t:
                if io == "input":
                    env.input = new
                else:
                    env.output = _with_first(t0, new)

    def _intervene(self, plan) -> None:
        """The body of a trace: touch every hooked site, in the order the model runs them."""
        layers, final = plan
        a = self.adapter
        blocks = _envoy(self.lm, a.blocks)
        for l, stages in layers:
            blk = blocks[l]
            self._stash = None
            for st in sorted(stages):
                if st > 0 and self._stash is None and any(e.site.kind == "hook_resid_mid" for e in stages.get(4, [])):
                    # resid_mid reads the residual entering attention: before anything inside the block runs
                    self._stash = _envoy(blk, a.pre_attn_norm).input
                self._stage(blk, l, st, stages[st])
        if final:
            self._norm(final, _envoy(self.lm, a.final_norm), a.final_norm_module(self.model))

    def _stage(self, blk, l: int, st, entries: list[_Entry]) -> None:
        """One stage of block ``l`` (see ``_STAGE``): read the site's value, run its hook functions,
        write the result back."""
        a = self.adapter
        if st in (1, 5):
            which = "ln1" if st == 1 else "ln2"
            path = a.ln1 if which == "ln1" else a.ln2
            assert path is not None
            same = which == "ln1" and path == a.pre_attn_norm and self._stash is not None
            self._norm(entries, _envoy(blk, path), a.block_norm_module(self.model, l, which),
                       x_in=self._stash if same else None)
        elif st == 0:
            x = blk.input
            y = self._apply(entries, x, None)
            if y is not x:
                blk.input = y
        elif st in (4, 8, 9):
            stash = self._stash if any(e.site.kind == "hook_resid_mid" for e in entries) else None
            env = blk if st == 9 else _envoy(blk, a.attn_out if st == 4 else a.mlp_out)
            out = env.output
            x = _first(out)
            y = self._apply(entries, x, stash)
            if y is not x:
                env.output = _with_first(out, y)
        else:
            self._components(blk, entries)

    def _norm(self, entries: list[_Entry], norm, module, x_in=None) -> None:
        """A norm's hooks (the final norm's, or a block's ln1 / ln2), in registration order: hook_out
        edits its output; hook_scale and hook_normalized are computed from its input, and a
        hook_normalized edit adds ``(f(n) - n) * w_eff`` to the output."""
        a = self.adapter
        if x_in is None and any(e.site.kind != FINAL_OUT for e in entries):
            x_in = norm.input
        out = norm.output
        y0 = y = _first(out)
        n = None
        for e in entries:
            if e.site.kind == FINAL_OUT:
                r = e.fn(y, e.tracker.call(y))
                if r is not None:
                    y = r
                continue
            assert x_in is not None
            if e.site.kind.endswith("hook_scale"):
                s = a.norm_parts(module, x_in)[1].to(x_in.dtype)
                if e.fn(s, e.tracker.call(s)) is not None:
                    raise record_only_error(e.site.name)
                continue
            if n is None:
                n = a.norm_parts(module, x_in)[0].to(x_in.dtype)
            r = e.fn(n, e.tracker.call(n))
            if r is not None:
                y = normalized_edit(y, n, r, a.norm_affine(module)[0])
                n = r
        if y is not y0:
            norm.output = _with_first(out, y)

    def _run(self, **inputs) -> Tensor:
        plan = self._plan()
        with self.lm.trace(**inputs):
            self._intervene(plan)
            logits = self.lm.output.logits.save()
        return logits

    # --- running -----------------------------------------------------------------
    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, keep: int = 0) -> Tensor:
        """Logits of the last ``keep`` positions (0: all)."""
        return self._run(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False, logits_to_keep=keep)

    def new_cache(self):
        return DynamicCache(config=self.model.config)

    def step(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, cache, keep: int = 1):
        """One KV-cached step (one trace): logits of the last position (``keep=0``: ``[batch, T, vocab]``
        of every fed position), and the cache."""
        logits = self._run(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           use_cache=True, logits_to_keep=keep, **{self._cache_kw: cache})
        return (logits[:, -1] if keep == 1 else logits), cache
