"""A fake accelerator for tests: a model whose weights live on device ``fakegpu`` computes on the CPU, but
every value that comes back to the host (a copy to the CPU, ``.item()``, ``bool()``, ``.tolist()``,
``.numpy()``) is logged with the calling frames, its dtype and its size.

It is PyTorch's PrivateUse1 backend, set up for a Python backend
(``torch.utils.backend_registration._setup_privateuseone_for_python_backend``), so C++ code that asks the
device for a guard (indexing, ``torch.tensor(..., device=)``) works as on a real one. Tensors on it are a
wrapper subclass holding a CPU tensor; a :class:`Transfers` mode (a dispatch mode plus a function mode) runs
every operation on the CPU tensors behind them, wraps the results back onto the fake device, and logs each
result that lands on the host. The values are the CPU's, so results can be compared with the same model on
the CPU exactly.

The backend can be set up once per process (``torch.utils.rename_privateuse1_backend``); nothing else in the
suite uses PrivateUse1.
"""
from __future__ import annotations

import dataclasses
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

NAME = "fakegpu"
_library: torch.library.Library | None = None


@dataclasses.dataclass
class Transfer:
    """One value that came back to the host: the op, the source tensor's dtype and size, where it was called."""
    op: str
    dtype: torch.dtype
    numel: int
    stack: list

    def called_from(self, fragment: str) -> bool:
        """Is a frame of the call in a file whose path contains ``fragment``?"""
        return any(fragment in f.filename for f in self.stack)

    def where(self) -> str:
        frames = [f for f in self.stack if "/steerkit/" in f.filename or "/transformers/" in f.filename]
        return " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in frames[-3:][::-1])


class FakeGpuTensor(torch.Tensor):
    """A tensor on the fake device: shape, dtype and device of its own, its values in ``elem`` (on the CPU)."""
    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(),
                                                   storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                   device=torch.device(NAME, 0), requires_grad=elem.requires_grad)

    def __init__(self, elem: torch.Tensor):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {}, None)


def setup() -> None:
    """Register the fake device (once per process): the Python backend, and the factory and copy kernels
    that ``torch.tensor(..., device=)`` reaches below the dispatch modes."""
    global _library
    if _library is not None:
        return
    torch.utils.backend_registration._setup_privateuseone_for_python_backend(NAME)
    lib = torch.library.Library("aten", "IMPL")

    def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
        return FakeGpuTensor(torch.empty_strided(size, stride, dtype=dtype, layout=layout, device="cpu"))

    def empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
        return FakeGpuTensor(torch.empty(size, dtype=dtype, layout=layout, device="cpu", memory_format=memory_format))

    def copy_from(src, dst, non_blocking=False):
        (dst.elem if isinstance(dst, FakeGpuTensor) else dst).copy_(src.elem if isinstance(src, FakeGpuTensor) else src)
        return dst

    lib.impl("empty_strided", empty_strided, "PrivateUse1")
    lib.impl("empty.memory_format", empty, "PrivateUse1")
    lib.impl("_copy_from", copy_from, "PrivateUse1")
    _library = lib


_SCALAR_OPS = ("aten._local_scalar_dense", "aten.item", "aten.is_nonzero")


def _device_arg(func, args, kwargs):
    if "device" in kwargs:
        return kwargs["device"]
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "device" and i < len(args):
            return args[i]
    return None


def _lands_on_host(func, args, kwargs) -> bool:
    if any(str(func).startswith(op + ".") for op in _SCALAR_OPS):
        return True
    d = _device_arg(func, args, kwargs)
    return d is not None and torch.device(d).type == "cpu"


def _run(func, args, kwargs, log: list | None):
    touched = False

    def unwrap(x):
        nonlocal touched
        if isinstance(x, FakeGpuTensor):
            touched = True
            return x.elem
        if isinstance(x, torch.device) and x.type == NAME:
            touched = True
            return torch.device("cpu")
        return x

    a, kw = tree_map(unwrap, args), tree_map(unwrap, kwargs)
    if isinstance(kwargs.get("device"), str) and torch.device(kwargs["device"]).type == NAME:
        kw["device"], touched = torch.device("cpu"), True
    a = [torch.device("cpu") if isinstance(x, str) and x.startswith(NAME) else x for x in a]
    out = func(*a, **kw)
    if not touched:
        return out
    if _lands_on_host(func, args, kwargs):
        src = next((t for t in tree_leaves(args) if isinstance(t, FakeGpuTensor)), None)
        if log is not None and src is not None:
            log.append(Transfer(str(func), src.dtype, src.numel(), traceback.extract_stack()[:-3]))
        return out
    with torch.inference_mode(False):  # (a wrapper made inside inference mode cannot take part in views)
        return tree_map(lambda t: FakeGpuTensor(t) if type(t) is torch.Tensor else t, out)


_READS = {torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy"}


class _Dispatch(TorchDispatchMode):
    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {}, self.log)


class _Reads(TorchFunctionMode):
    """``tolist`` / ``numpy`` read a tensor's memory without an aten op: logged here, served from the CPU tensor."""
    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _READS and args and isinstance(args[0], FakeGpuTensor):
            self.log.append(Transfer(_READS[func], args[0].dtype, args[0].numel(), traceback.extract_stack()[:-1]))
            return func(args[0].elem, *args[1:], **(kwargs or {}))
        return func(*args, **(kwargs or {}))


class Transfers:
    """``with Transfers() as log:`` runs the block with the fake device active; ``log`` lists every value
    that came back to the host (:class:`Transfer`)."""

    def __init__(self):
        self.log: list[Transfer] = []
        self._modes = (_Dispatch(self.log), _Reads(self.log))

    def __enter__(self) -> list[Transfer]:
        for m in self._modes:
            m.__enter__()
        return self.log

    def __exit__(self, *exc):
        for m in reversed(self._modes):
            m.__exit__(*exc)


def to_fake(model: torch.nn.Module) -> torch.nn.Module:
    """Move ``model``'s parameters and buffers onto the fake device in place (tied weights stay tied)."""
    memo: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for n, p in list(mod._parameters.items()):
            if p is not None:
                if id(p) not in memo:
                    memo[id(p)] = torch.nn.Parameter(FakeGpuTensor(p.data), requires_grad=p.requires_grad)
                mod._parameters[n] = memo[id(p)]
        for n, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[n] = FakeGpuTensor(b)
    return model


def host(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor behind a fake-device tensor (no transfer logged: for the test's own checks)."""
    return t.elem if isinstance(t, FakeGpuTensor) else t
