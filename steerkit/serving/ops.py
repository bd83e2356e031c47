"""Operators of the model's graph that belong to one object (an engine's steering, its recorder).

A compiled engine (``torch.compile``, CUDA graphs) runs a forward hook's Python only while tracing; what it
keeps is the operators the hook called. :class:`ObjectOps` defines such operators for one object:
``torch.ops.steerkit.<name>_<tag>``, whose body is a method of that object, with a fake implementation that
computes nothing for tracing. Each object gets its own names (its ``tag``), so two engines in one process
never share one, and nothing outside the object holds its state; the operators go when the object closes.

Defined with the dispatcher directly (``torch.library.Library``): a ``torch.library.custom_op`` wrapper adds
about 25 us to every call, which a compiled engine pays at every site of every step.

Examples:
    >>> seen = []
    >>> ops = ObjectOps()
    >>> touch = ops.define("touch_(Tensor(a!) x, int k) -> ()", lambda x, k: seen.append(k))
    >>> touch(torch.zeros(1), 3)
    >>> seen, touch.__name__.startswith("touch_")
    ([3], True)
    >>> ops.close()
"""
from __future__ import annotations

import uuid
from typing import Any, Callable

import torch


class ObjectOps:
    """``torch.library`` operators whose bodies belong to one object (see the module docstring)."""

    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex[:12]
        self._lib: Any = torch.library.Library("steerkit", "FRAGMENT")
        self.names: list[str] = []

    def define(self, schema: str, body: Callable[..., None]) -> Callable[..., None]:
        """Register ``schema`` (``"name(Tensor(a!) x, ...) -> ()"``) as ``torch.ops.steerkit.<name>_<tag>`` with
        ``body`` as its kernel on every device, and return the operator."""
        base, rest = schema.split("(", 1)
        name = f"{base.strip()}_{self.tag}"
        self._lib.define(f"{name}({rest}")
        self._lib.impl(name, body, "CompositeExplicitAutograd")
        torch.library.register_fake(f"steerkit::{name}", lambda *args: None, lib=self._lib)
        self.names.append(name)
        op = getattr(torch.ops.steerkit, name)
        op._steerkit_owner = self  # the operator keeps its library (its registration) alive
        return op

    def close(self) -> None:
        """Remove the operators (a graph traced with them must not run afterwards)."""
        if self._lib is not None:
            self._lib._destroy()
            self._lib = None
