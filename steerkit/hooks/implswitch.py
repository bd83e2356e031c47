"""Switching a transformers model to a steerkit implementation of one of its interfaces while hooks need it.

transformers 5 dispatches attention (``config._attn_implementation``) and fused experts
(``config._experts_implementation``) by name through registries. :class:`ImplementationSwitch` sets the
model's name to ``"steerkit:<base>"`` when the first hook that needs steerkit's implementation is
registered on a model, counts the hooks, and restores the model's own name when the last goes.
:mod:`steerkit.hooks.attention` and :mod:`steerkit.hooks.moe` each keep one.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

from torch import nn

PREFIX = "steerkit:"


class ImplementationSwitch:
    """``attr``: the config attribute naming the implementation; ``register(base)`` registers
    ``"steerkit:<base>"`` for a base implementation and returns that name."""

    def __init__(self, attr: str, register: Callable[[str], str]):
        self.attr = attr
        self.register = register
        self._users: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()

    @staticmethod
    def base_of(name: str | None) -> str:
        """The base implementation a (possibly switched) name stands for."""
        name = name or "eager"
        return name[len(PREFIX):] if name.startswith(PREFIX) else name

    def acquire(self, model: nn.Module) -> Callable[[], None]:
        """Switch ``model`` (if it is not yet) and count one user; returns the release (idempotent)."""
        cfg: Any = model.config
        users = self._users.get(model)
        if users is None:
            base = self.base_of(getattr(cfg, self.attr))
            name = self.register(base)
            users = self._users[model] = [base, 0]
            setattr(cfg, self.attr, name)
        users[1] += 1
        done = [False]

        def release() -> None:
            if done[0]:
                return
            done[0] = True
            u = self._users.get(model)
            if u is not None:
                u[1] -= 1
                if u[1] <= 0:
                    setattr(cfg, self.attr, u[0])
                    del self._users[model]
        return release
