"""Where a model runs and in which floating-point type, when the caller says ``"auto"``.

``device="auto"``: the first CUDA device, else Apple's MPS, else the CPU. ``dtype="auto"``: bfloat16 on
a CUDA device that supports it (compute capability 8.0 and later: A100, H100, RTX 30xx on), float32
everywhere else (the CPU, MPS, older GPUs: float16 overflows in some families' activations, so it is
never chosen for the user). Both also take what torch takes: ``"cuda:1"``, ``torch.device("mps")``,
``"bfloat16"``, ``torch.float16``.
"""
from __future__ import annotations

import torch

from steerkit.errors import InputError

#: the dtype names the CLI offers (``--dtype``), besides ``auto``
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def pick_device(device: "str | torch.device" = "auto") -> torch.device:
    """The device ``device`` names, ``"auto"`` resolved (CUDA, then MPS, then CPU).

    Examples:
        >>> pick_device("cpu"), pick_device(torch.device("cpu"))
        (device(type='cpu'), device(type='cpu'))
        >>> pick_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")  # Linux: no MPS
        True
        >>> pick_device("gpu")
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected a torch device ('auto', 'cpu', 'cuda', 'cuda:1', 'mps'), found 'gpu'
    """
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InputError(f"expected a torch device ('auto', 'cpu', 'cuda', 'cuda:1', 'mps'), found {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"expected a CUDA device for device={device!r}, found none (torch {torch.__version__}, "
                         f"CUDA build: {torch.version.cuda or 'no'}); use device='cpu', or install a CUDA build of torch")
    return dev


def pick_dtype(dtype: "str | torch.dtype" = "auto", device: "str | torch.device" = "cpu") -> torch.dtype:
    """The floating-point dtype ``dtype`` names, ``"auto"`` resolved for ``device`` (bfloat16 on a CUDA
    device that supports it, else float32).

    Examples:
        >>> pick_dtype("auto", "cpu"), pick_dtype("bfloat16"), pick_dtype(torch.float16)
        (torch.float32, torch.bfloat16, torch.float16)
        >>> pick_dtype("int8")
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected a floating-point torch dtype ('auto', 'float32', 'bfloat16', 'float16'), found 'int8'
    """
    if dtype == "auto":
        dev = pick_device(device)
        if dev.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    dt = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise InputError(f"expected a floating-point torch dtype ('auto', {', '.join(map(repr, DTYPE_NAMES))}), "
                         f"found {dtype!r}")
    return dt
