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
attention output).
"""
from __future__ import annotations

from typing import Callable

from torch import Tensor, nn


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

    def _edit_output(self, module: nn.Module, fn, tracker) -> Callable[[], None]:
        def post(mod, args, out):
            x = out if type(out) is Tensor else first(out)  # (a block that returns a tensor: no call)
            y = fn(x, tracker.call(x))
            return y if y is None or x is out else with_first(out, y)
        return self._track(module.register_forward_hook(post))

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
