"""Run a GGUF model in llama.cpp (via ``llama-cpp-python``) with a steerkit control vector.

How it works
------------
``llama-cpp-python`` exposes control vectors only through the low-level
``llama_set_adapter_cvec(ctx, data, len, n_embd, il_start, il_end)``.  Its buffer holds the
vector for layer ``N`` at offset ``n_embd * (N - 1)`` (layer 0 -- the output of block 0 -- has
no slot).  :meth:`LlamaCppRunner.set_vector` therefore always builds a buffer covering *every*
layer 1..n_layer-1 (zeros where the vector has none), because layers past the end of a shorter
buffer would keep the values of an earlier call.  Setting ``None`` clears the vector.

:meth:`LlamaCppRunner.next_token_logits` clears the KV cache (``llama_memory_clear``) and the
Python-side token history before every prompt, so a state cached under an old vector is never
reused, then evaluates the token ids and returns the last position's logits as float32.

:func:`cvec_buffer` reads a control-vector GGUF written by :func:`steerkit.vectors.export` the
way llama.cpp's ``common`` loader does (``direction.N`` -> slot ``N - 1``, scaled).
Flash attention is off (llama-cpp-python's default; ``llama-server`` turns it on) so the
comparison with PyTorch is like for like.  ``OMP_WAIT_POLICY`` defaults to ``PASSIVE`` (set
before ``llama_cpp`` is first imported) because spinning OpenMP threads are several times
slower on a shared machine.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .artifacts import SteeringVector
from .errors import ExportError, VectorsError
from .exports import import_artifact

# See _llama_cpp(): must be in the environment before llama_cpp (and its libgomp) is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _llama_cpp():
    # llama.cpp's CPU backend uses OpenMP; with the default (active, spinning) wait policy a
    # shared or busy machine makes every barrier wait for a descheduled thread (measured: 5x
    # slower on 2 busy cores).  Passive waiting costs nothing noticeable on an idle machine.
    # It only takes effect if set before libgomp is loaded, i.e. before the first import.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        import llama_cpp
    except ImportError as e:  # pragma: no cover - depends on the optional extra
        raise VectorsError("expected llama-cpp-python to be installed, found none; "
                           "pip install 'steerkit[llamacpp]' (it builds llama.cpp, ~7 minutes)") from e
    return llama_cpp


def cvec_buffer(vec: SteeringVector | None, n_layer: int, n_embd: int, scale: float = 1.0) -> np.ndarray:
    """The ``[(n_layer - 1) * n_embd]`` float32 buffer llama.cpp expects (slot ``N-1`` = layer ``N``).

    Examples:
        >>> from steerkit.vectors import SteeringVector
        >>> from steerkit.vectors.llamacpp import cvec_buffer
        >>> buf = cvec_buffer(SteeringVector({2: torch.ones(64)}, scale=3.0), n_layer=4, n_embd=64)
        >>> buf.shape, buf.reshape(3, 64)[:, 0].tolist()  # layer 2 sits in slot 1
        ((192,), [0.0, 3.0, 0.0])
    """
    buf = np.zeros(((n_layer - 1), n_embd), dtype=np.float32)
    if vec is None:
        return buf.reshape(-1)
    if vec.operation != "add" or vec.hook_site != "hook_resid_post" or vec.positions is not None:
        raise ExportError("llama.cpp applies additive vectors at block outputs on every token only; "
                          f"found operation={vec.operation}, hook_site={vec.hook_site}, positions={vec.positions}")
    eff = vec.effective()
    for l, d in eff.directions.items():
        if l == 0 or l >= n_layer:
            raise ExportError(f"expected layers 1..{n_layer - 1} for llama.cpp, found {l}")
        if d.shape[0] != n_embd:
            raise ExportError(f"expected vectors of n_embd={n_embd}, found {d.shape[0]}")
        buf[l - 1] = (d.detach().cpu().double() * scale).float().numpy()
    return buf.reshape(-1)


class LlamaCppRunner:
    """A llama.cpp context for next-token logits with an optional control vector.

    Needs ``llama-cpp-python`` (the ``llamacpp`` extra). The example runs the default model's shipped
    GGUF (``steerkit.loading.resolve.default_gguf_path()``) and steers it as ``--control-vector`` would:

    Examples:
        >>> from steerkit.loading.resolve import default_gguf_path
        >>> from steerkit.vectors import SteeringVector
        >>> from steerkit.vectors.llamacpp import LlamaCppRunner
        >>> with LlamaCppRunner(default_gguf_path(), n_ctx=64) as runner:
        ...     plain = runner.next_token_logits([1, 504, 3458])
        ...     runner.set_vector(SteeringVector({10: torch.full((576,), 4.0)}))
        ...     steered = runner.next_token_logits([1, 504, 3458])
        >>> runner.n_layer, runner.n_embd, plain.shape, bool(abs(plain - steered).max() > 0.1)
        (30, 576, (49152,), True)
    """

    def __init__(self, model_path: str | os.PathLike, *, n_ctx: int = 512, n_threads: int | None = None,
                 flash_attn: bool = False, seed: int = 0):
        llama_cpp = _llama_cpp()
        self._lc = llama_cpp
        self.path = Path(model_path)
        self.llm = llama_cpp.Llama(model_path=str(self.path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=n_threads or os.cpu_count(),
                                   logits_all=False, verbose=False, flash_attn=flash_attn, seed=seed, n_gpu_layers=0)
        self.n_embd = int(llama_cpp.llama_model_n_embd(self.llm.model))
        self.n_layer = int(llama_cpp.llama_model_n_layer(self.llm.model))
        self.n_vocab = int(self.llm.n_vocab())
        self._buf: Any = None  # keep the ctypes buffer alive while llama.cpp may read it

    def set_vector(self, vec: SteeringVector | None, scale: float = 1.0) -> None:
        """Install ``vec`` (or clear with ``None``) for every later evaluation."""
        lc = self._lc
        ctx = self.llm.ctx
        if vec is None:
            rc = lc.llama_set_adapter_cvec(ctx, None, 0, self.n_embd, -1, -1)
            self._buf = None
        else:
            flat = cvec_buffer(vec, self.n_layer, self.n_embd, scale)
            self._buf = (ctypes.c_float * flat.size).from_buffer_copy(flat.tobytes())
            rc = lc.llama_set_adapter_cvec(ctx, self._buf, flat.size, self.n_embd, 1, self.n_layer - 1)
        if rc != 0:
            raise VectorsError(f"expected llama_set_adapter_cvec to return 0, found {rc}; check n_embd/n_layer")
        self._clear()

    def set_vector_file(self, path: str | os.PathLike, scale: float = 1.0) -> SteeringVector:
        """Load a control-vector GGUF (as llama.cpp's loader would) and install it."""
        vec = import_artifact(path)
        self.set_vector(vec, scale)
        return vec

    def _clear(self) -> None:
        lc = self._lc
        mem = lc.llama_get_memory(self.llm.ctx)
        if mem is not None:
            lc.llama_memory_clear(mem, True)
        self.llm.reset()

    def next_token_logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits ``[n_vocab]`` after the last of ``token_ids``, from an empty KV cache."""
        if not token_ids:
            raise VectorsError("expected at least one token id, found none")
        self._clear()
        self.llm.eval(list(int(t) for t in token_ids))
        ptr = self._lc.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).astype(np.float32).copy()

    def close(self) -> None:
        try:
            self.llm.close()
        except Exception:
            pass

    def __enter__(self) -> "LlamaCppRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
