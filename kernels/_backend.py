"""Choice between the Triton kernels and the pure-torch references.

The choice is made from a device: ``impl="auto"`` picks Triton for CUDA
tensors when Triton imports, and the torch reference everywhere else.
:func:`~steerkit.kernels.fused_steer` makes it at every call (from its input's
device, :func:`resolve_impl`); :func:`~steerkit.kernels.bind_steer` makes it
once, when it binds (from the device it binds for, :func:`resolve_impl_for`),
and the bound call keeps it. ``impl="triton"`` forces the kernels; on CPU tensors that
only works under ``TRITON_INTERPRET=1`` (Triton's interpreter, used by CPU CI).
``impl="torch"`` forces the reference.

Tests and callers can override "auto" for a block of code with :func:`use_impl`
(a context manager, per thread); the override is read when the choice is made
(so a bound call keeps the one in force when it was bound). An explicit ``impl=``
argument other than "auto" always wins. There is no process-wide override: the
one function of the device, :func:`resolve_impl_for`, makes every choice.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator, Literal

import torch

from steerkit.errors import BackendUnavailableError, InputError

Impl = Literal["auto", "triton", "torch"]
_VALID = ("auto", "triton", "torch")

_state = threading.local()

try:  # Triton is optional (the `kernels` extra); the torch path never needs it.
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
    _TRITON_IMPORT_ERROR: Exception | None = None
except Exception as exc:  # pragma: no cover - depends on the environment
    HAS_TRITON = False
    _TRITON_IMPORT_ERROR = exc


def interpret_mode() -> bool:
    """True when Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``).

    Examples:
        >>> old = os.environ.get("TRITON_INTERPRET", "0")
        >>> os.environ["TRITON_INTERPRET"] = "1"; interpret_mode()
        True
        >>> os.environ["TRITON_INTERPRET"] = "0"; interpret_mode()
        False
        >>> os.environ["TRITON_INTERPRET"] = old
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def _check_name(impl: str) -> None:
    if impl not in _VALID:
        raise InputError(
            f"impl must be one of {_VALID}; found {impl!r}. "
            "Pass impl='auto' to let steerkit choose from the tensor's device."
        )


def get_impl() -> str:
    """The override in force for ``impl="auto"`` (innermost :func:`use_impl` first).

    Examples:
        >>> get_impl()
        'auto'
        >>> with use_impl("torch"):
        ...     print(get_impl())
        torch
    """
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else "auto"


@contextlib.contextmanager
def use_impl(impl: Impl) -> Iterator[None]:
    """Within the block, calls with ``impl="auto"`` behave as if given ``impl``.

    Examples:
        >>> with use_impl("torch"):
        ...     print(resolve_impl_for("auto", "cuda"))
        torch
        >>> with use_impl("fast"):  # doctest: +ELLIPSIS
        ...     pass
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: impl must be one of ('auto', 'triton', 'torch'); found 'fast'. ...
    """
    _check_name(impl)
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append(impl)
    try:
        yield
    finally:
        stack.pop()


def resolve_impl(impl: str, h: torch.Tensor) -> str:
    """Return "triton" or "torch" for a call on ``h``, or raise with what to do.

    Examples:
        >>> resolve_impl("auto", torch.zeros(2, 8)), resolve_impl("torch", torch.zeros(2, 8))
        ('torch', 'torch')
    """
    return resolve_impl_for(impl, h.device)


def resolve_impl_for(impl: str, device: torch.device | str) -> str:
    """Return "triton" or "torch" for tensors on ``device`` under the override in force now
    (:func:`get_impl`), or raise with what to do.

    Examples:
        >>> resolve_impl_for("auto", "cpu"), resolve_impl_for("auto", "cuda") == ("triton" if HAS_TRITON else "torch")
        ('torch', True)
    """
    _check_name(impl)
    if impl == "auto":
        impl = get_impl()
    is_cuda = (device if isinstance(device, torch.device) else torch.device(device)).type == "cuda"
    if impl == "auto":
        return "triton" if (HAS_TRITON and is_cuda) else "torch"
    if impl == "triton":
        if not HAS_TRITON:
            raise BackendUnavailableError(
                "impl='triton' was asked for but Triton does not import "
                f"({_TRITON_IMPORT_ERROR!r}). Install the 'kernels' extra "
                "(pip install 'steerkit[kernels]') or pass impl='torch'."
            )
        if not is_cuda and not interpret_mode():
            raise BackendUnavailableError(
                f"impl='triton' needs CUDA tensors; found tensors on {device}. "
                "Move the tensors to a GPU, set TRITON_INTERPRET=1 before importing "
                "triton to run the kernels on CPU (slow, for tests), or pass impl='torch'."
            )
    return impl
