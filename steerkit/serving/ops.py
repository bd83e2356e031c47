"""Operators of the model's graph that belong to one object (an engine's steering, its recorder).

A compiled engine (``torch.compile``, CUDA graphs) runs a forward hook's Python only while tracing; what it
keeps is the operators the hook called. :class:`ObjectOps` defines such operators for one object:
``torch.ops.steerkit.<name>_e<k>``, whose body is a method of that object, with a fake implementation that
computes nothing for tracing. Each object gets its own names, the lowest ``k`` not registered in the process
when it defines the operator, so two engines in one process never share one and nothing outside the object
holds its state, while one engine per process always gets the same names (``_e0``): a graph an engine compiled
and cached under those names is found again by the next start. The operators go when the object closes.

Defined with the dispatcher directly (``torch.library.Library``): a ``torch.library.custom_op`` wrapper adds
about 25 us to every call, which a compiled engine pays at every site of every step.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


class ObjectOps:
    """``torch.library`` operators whose bodies belong to one object (see the module docstring).

    Examples:
        >>> seen = []
        >>> ops = ObjectOps()
        >>> touch = ops.define("touch_(Tensor(a!) x, int k) -> ()", lambda x, k: seen.append(k))
        >>> touch(torch.zeros(1), 3)
        >>> seen, ops.names
        ([3], ['touch_e0'])
        >>> ops.close()
    """

    def __init__(self) -> None:
        self._lib: Any = torch.library.Library("steerkit", "FRAGMENT")
        self.names: list[str] = []

    def define(self, schema: str, body: Callable[..., None]) -> Callable[..., None]:
        """Register ``schema`` (``"name(Tensor(a!) x, ...) -> ()"``) as ``torch.ops.steerkit.<name>_e<k>`` (the
        lowest free ``k``) with ``body`` as its kernel on every device, and return the operator."""
        base, rest = schema.split("(", 1)
        stem = base.strip() if base.strip().endswith("_") else base.strip() + "_"
        k = 0
        while hasattr(torch.ops.steerkit, f"{stem}e{k}"):
            k += 1
        name = f"{stem}e{k}"
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
