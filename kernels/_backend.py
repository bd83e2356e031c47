"""Choice between the Triton kernels and the pure-torch references.

The choice is made once per call from the tensors' device: ``impl="auto"``
picks Triton for CUDA tensors when Triton imports, and the torch reference
everywhere else. ``impl="triton"`` forces the kernels; on CPU tensors that
only works under ``TRITON_INTERPRET=1`` (Triton's interpreter, used by CPU CI).
``impl="torch"`` forces the reference.

Tests and callers can override "auto" for a whole block of code with
:func:`use_impl` (a context manager) or for the process with :func:`set_impl`;
an explicit ``impl=`` argument other than "auto" always wins.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator, Literal

import torch

Impl = Literal["auto", "triton", "torch"]
_VALID = ("auto", "triton", "torch")

_state = threading.local()
_global_override: str = "auto"
# Bumped whenever an override changes (set_impl, use_impl enter/exit): a caller that cached a
# choice (``fused.bind_steer``) re-decides when the epoch it cached under is no longer current.
EPOCH = [0]

try:  # Triton is optional (the `kernels` extra); the torch path never needs it.
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
    _TRITON_IMPORT_ERROR: Exception | None = None
except Exception as exc:  # pragma: no cover - depends on the environment
    HAS_TRITON = False
    _TRITON_IMPORT_ERROR = exc


def interpret_mode() -> bool:
    """True when Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def _check_name(impl: str) -> None:
    if impl not in _VALID:
        raise ValueError(
            f"impl must be one of {_VALID}; found {impl!r}. "
            "Pass impl='auto' to let steerkit choose from the tensor's device."
        )


def set_impl(impl: Impl) -> None:
    """Set the process-wide choice used when a call says ``impl="auto"``."""
    global _global_override
    _check_name(impl)
    _global_override = impl
    EPOCH[0] += 1


def get_impl() -> str:
    """The override in force for ``impl="auto"`` (innermost :func:`use_impl` first)."""
    stack = getattr(_state, "stack", None)
    if stack:
        return stack[-1]
    return _global_override


@contextlib.contextmanager
def use_impl(impl: Impl) -> Iterator[None]:
    """Within the block, calls with ``impl="auto"`` behave as if given ``impl``."""
    _check_name(impl)
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append(impl)
    EPOCH[0] += 1
    try:
        yield
    finally:
        stack.pop()
        EPOCH[0] += 1


def resolve_impl(impl: str, h: torch.Tensor) -> str:
    """Return "triton" or "torch" for this call, or raise with what to do."""
    _check_name(impl)
    if impl == "auto":
        impl = get_impl()
    if impl == "auto":
        return "triton" if (HAS_TRITON and h.is_cuda) else "torch"
    if impl == "triton":
        if not HAS_TRITON:
            raise RuntimeError(
                "impl='triton' was asked for but Triton does not import "
                f"({_TRITON_IMPORT_ERROR!r}). Install the 'kernels' extra "
                "(pip install 'steerkit[kernels]') or pass impl='torch'."
            )
        if not h.is_cuda and not interpret_mode():
            raise RuntimeError(
                f"impl='triton' needs CUDA tensors; found a tensor on {h.device}. "
                "Move the tensors to a GPU, set TRITON_INTERPRET=1 before importing "
                "triton to run the kernels on CPU (slow, for tests), or pass impl='torch'."
            )
    return impl
