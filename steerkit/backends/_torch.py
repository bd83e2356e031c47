"""Pieces shared by the backends that run hook functions as PyTorch hooks.

Module outputs may be a tensor or a tuple/list whose first element is the
hidden state: :func:`first` reads it and :func:`with_first` rebuilds the output
around an edited one. :class:`TorchHooks` keeps the handles steerkit
registered, so a backend removes exactly its own hooks, and implements the two
registrations every torch-hook backend needs: an edit of a module's output,
and ``resid_mid`` as ``resid_in + attn_out`` edited through the attention
output (the residual between the two sub-layers is a local variable inside
the block, so it is read from the module that receives the block's residual
and the attention contribution, and an edit ``f`` adds ``f(mid) - mid`` to the
attention output), and the final norm's ``ln_final.hook_scale`` /
``hook_normalized`` from a forward hook that sees the norm's input and output:
the scale and the normalised stream are computed from the input as the norm
computes them (float32 statistics), and an edit ``f`` of the normalised stream
``n`` makes the output ``y + (f(n) - n) * w_eff`` (the bias unchanged), which is
exactly what the norm outputs from ``f(n)``.
"""
from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Callable, Literal, Optional

import torch
from torch import Tensor, nn

from steerkit.loading.adapters import Adapter
from steerkit.hooks.names import FINAL_SCALE, MLP_HOOKS, MLP_IN, Site, record_only_error


@dataclass(frozen=True)
class Access:
    """Where a head or neuron site lives in a block: the module (``path`` relative to the block) whose
    ``io`` ("input" / "output") holds it, ``get(t)`` the site's value in its own shape and
    ``put(t, y)`` the module's tensor with it replaced."""

    path: str
    io: Literal["input", "output"]
    get: Callable[[Tensor], Tensor]
    put: Callable[[Tensor, Tensor], Tensor]


def _same(t: Tensor) -> Tensor:
    return t


def _new(t: Tensor, y: Tensor) -> Tensor:
    return y


def component_access(adapter: Adapter, model: nn.Module, site: Site) -> Access:
    """The :class:`Access` of ``attn.hook_q`` / ``k`` / ``v`` / ``z``, ``mlp.hook_in`` and ``mlp.hook_pre`` / ``post``
    in the adapter's layout (separate or fused projections)."""
    a, kind = adapter, site.kind
    att, mlp = a.attn_layout, a.mlp_layout
    if kind == MLP_IN:  # the MLP module's input (dense or a sparse block's)
        return Access(mlp.module, "input", _same, _new)
    H, KV, dh = a.n_heads(model), a.n_kv_heads(model), a.d_head(model)
    if kind in MLP_HOOKS:
        a.check_dense_mlp(model, site.block_index)  # a sparse mixture-of-experts block has no neurons
    if kind == "attn.hook_z":
        return Access(f"{a.attn}.{att.o}", "input", lambda x: x.unflatten(-1, (H, dh)), lambda x, y: y.flatten(-2))
    if kind == "mlp.hook_post":
        return Access(f"{mlp.module}.{mlp.post}", "input", _same, _new)
    if kind == "mlp.hook_pre":
        path = f"{mlp.module}.{mlp.pre}"
        if not mlp.pre_half:
            return Access(path, "output", _same, _new)

        def put_half(y: Tensor, new: Tensor) -> Tensor:  # [gate | up]: the gate half
            return torch.cat([new, y[..., y.shape[-1] // 2:]], dim=-1)
        return Access(path, "output", lambda y: y[..., : y.shape[-1] // 2], put_half)
    which = kind.rsplit("_", 1)[-1]  # q / k / v
    heads = H if which == "q" else KV
    if att.qkv is None:
        return Access(f"{a.attn}.{getattr(att, which)}", "output", lambda y: y.unflatten(-1, (heads, dh)),
                      lambda y, new: new.flatten(-2))
    i = "qkv".index(which)
    if att.qkv_layout == "per_head":  # [.., heads, 3 * d_head]: [q_h | k_h | v_h] per head
        def get(y: Tensor) -> Tensor:
            return y.unflatten(-1, (H, 3 * dh))[..., i * dh:(i + 1) * dh]

        def put(y: Tensor, new: Tensor) -> Tensor:
            z = y.unflatten(-1, (H, 3 * dh)).clone()
            z[..., i * dh:(i + 1) * dh] = new
            return z.flatten(-2)
    else:  # [q | k | v]
        lo = [0, H * dh, (H + KV) * dh][i]
        hi = lo + heads * dh

        def get(y: Tensor) -> Tensor:
            return y[..., lo:hi].unflatten(-1, (heads, dh))

        def put(y: Tensor, new: Tensor) -> Tensor:
            z = y.clone()
            z[..., lo:hi] = new.flatten(-2)
            return z
    return Access(f"{a.attn}.{att.qkv}", "output", get, put)


def shell_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s module tree (new module objects and config, so a wrapper may patch,
    swap or re-configure them) that shares every parameter and buffer with ``model``: no weight is
    copied, and a change to the weights is seen by both."""
    memo: dict = {id(t): t for t in model.parameters()}
    memo.update({id(t): t for t in model.buffers()})
    return copy.deepcopy(model, memo)


def normalized_edit(y: Tensor, n: Tensor, new: Tensor, w_eff: Optional[Tensor]) -> Tensor:
    """The final norm's output ``y`` once its normalised stream ``n`` is edited to ``new``:
    ``y + (new - n) * w_eff`` (``w_eff=None``: a norm without weight), in ``y``'s dtype."""
    d = new.float() - n.float()
    if w_eff is not None:
        d = d * w_eff.to(d.device)
    return y + d.to(y.dtype)


def first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def with_first(out, new):
    if isinstance(out, tuple):
        return (new,) + tuple(out[1:])
    if isinstance(out, list):
        return [new] + list(out[1:])
    return new


class TorchHooks:
    """Handle bookkeeping and the common registrations for torch-hook backends."""

    def __init__(self):
        self._torch_handles: list = []
        # per final-norm module: (a weak reference to the input of its current call, the normalised
        # stream after the edits so far); the entry goes when that input does
        self._norm_state: dict[int, tuple[weakref.ref, Tensor]] = {}

    def _track(self, h) -> Callable[[], None]:
        self._torch_handles.append(h)

        def remove():
            h.remove()
            try:
                self._torch_handles.remove(h)
            except ValueError:
                pass
        return remove

    def reset(self) -> None:
        for h in list(self._torch_handles):
            h.remove()
        self._torch_handles.clear()
        self._norm_state.clear()

    def _edit_output(self, module: nn.Module, fn, tracker) -> Callable[[], None]:
        def post(mod, args, out):
            x = out if type(out) is Tensor else first(out)  # (a block that returns a tensor: no call)
            y = fn(x, tracker.call(x))
            return y if y is None or x is out else with_first(out, y)
        return self._track(module.register_forward_hook(post))

    def _edit_part(self, module: nn.Module, get: Callable, put: Callable, fn, tracker) -> Callable[[], None]:
        """An edit of part of ``module``'s output: ``get(out)`` is the site's value, ``put(out, y)`` the
        output with it replaced (a fused projection's query slice, a head-shaped view ...)."""
        def post(mod, args, out):
            y0 = first(out)
            x = get(y0)
            y = fn(x, tracker.call(x))
            return None if y is None else with_first(out, put(y0, y))
        return self._track(module.register_forward_hook(post))

    def _edit_input(self, module: nn.Module, get: Callable, put: Callable, fn, tracker) -> Callable[[], None]:
        """An edit of ``module``'s first input seen as ``get(x)`` (``put(x, y)`` rebuilds it)."""
        def pre(mod, args, kwargs):
            x0 = args[0] if args else kwargs["hidden_states"]
            x = get(x0)
            y = fn(x, tracker.call(x))
            if y is None:
                return None
            new = put(x0, y)
            if args:
                return (new,) + tuple(args[1:]), kwargs
            return args, dict(kwargs, hidden_states=new)
        return self._track(module.register_forward_pre_hook(pre, with_kwargs=True))

    def _final_norm(self, module: nn.Module, kind: str, parts, affine, fn, tracker) -> Callable[[], None]:
        """A norm's ``hook_scale`` / ``hook_normalized`` (``kind`` ends in one of them; the final norm's
        or a block's ln1 / ln2) on the norm ``module``: ``parts(x)`` is ``(normalized, scale)`` of its
        input (float32), ``affine()`` its ``(w_eff, bias)``."""
        state = self._norm_state
        key = id(module)
        scale_only = kind.endswith("hook_scale")
        assert scale_only or kind.endswith("hook_normalized"), kind

        def post(mod, args, kwargs, out):
            x = args[0] if args else kwargs["hidden_states"]
            if scale_only:
                s = parts(x)[1].to(x.dtype)
                if fn(s, tracker.call(s)) is not None:
                    raise record_only_error(kind if kind != FINAL_SCALE else FINAL_SCALE)
                return None
            seen = state.get(key)
            # an earlier hook_normalized edit of this call already edited the stream: start from it
            n = seen[1] if seen is not None and seen[0]() is x else parts(x)[0].to(x.dtype)
            new = fn(n, tracker.call(n))
            if new is None:
                return None

            def drop(ref):
                if state.get(key, (None,))[0] is ref:
                    del state[key]
            state[key] = (weakref.ref(x, drop), new)
            y = out if type(out) is Tensor else first(out)
            return with_first(out, normalized_edit(y, n, new, affine()[0]))
        return self._track(module.register_forward_hook(post, with_kwargs=True))

    def _edit_mid(self, resid_in: nn.Module, resid_in_is_input: bool, attn_out: nn.Module, fn,
                  tracker) -> Callable[[], None]:
        """``resid_mid`` edits: ``resid_in`` sees the residual entering attention (as its input
        when ``resid_in_is_input``, else as its output), ``attn_out`` outputs what attention adds."""
        stash: dict = {}
        if resid_in_is_input:
            def grab(mod, args, kwargs):
                stash["x"] = args[0] if args else kwargs["hidden_states"]
            h1 = resid_in.register_forward_pre_hook(grab, with_kwargs=True)
        else:
            def grab(mod, args, out):
                stash["x"] = first(out)
            h1 = resid_in.register_forward_hook(grab)
        r1 = self._track(h1)

        def post(mod, args, out):
            a = first(out)
            mid = stash.pop("x") + a
            y = fn(mid, tracker.call(mid))
            return None if y is None else with_first(out, a + (y - mid))
        try:
            r2 = self._track(attn_out.register_forward_hook(post))
        except BaseException:
            r1()
            raise

        def remove():
            r2()
            r1()
        return remove
