"""Exceptions raised by steerkit.

Every error message follows one pattern: what was expected, what was found,
and what to do about it. The classes subclass the built-in exception a caller
would naturally catch (``ValueError``, ``KeyError``...) so existing ``except``
clauses keep working.
"""
from __future__ import annotations


class SteerkitError(Exception):
    """Base class for every error steerkit raises on purpose.

    Examples:
        >>> try:
        ...     steerkit.load_model(dtype="int8")
        ... except steerkit.SteerkitError as e:
        ...     print(type(e).__name__)
        InputError
    """


class ModelNotFoundError(SteerkitError, FileNotFoundError):
    """A model could not be found: no such file or folder, or a Hub id neither in the cache nor downloadable.

    Examples:
        >>> try:
        ...     steerkit.load_model("/no/such/folder/model.gguf")
        ... except FileNotFoundError as e:
        ...     print(type(e).__name__, str(e).startswith("expected a GGUF file"))
        ModelNotFoundError True
    """


class UnsupportedArchitectureError(SteerkitError, NotImplementedError):
    """No adapter knows this model's architecture.

    Examples:
        >>> try:
        ...     steerkit.adapter_for(torch.nn.Linear(4, 4))
        ... except NotImplementedError as e:
        ...     print(type(e).__name__)
        UnsupportedArchitectureError
    """


class HookNameError(SteerkitError, KeyError):
    """A hook name that does not exist on this model.

    Examples:
        >>> from steerkit.hooks.names import parse
        >>> try:
        ...     parse("blocks.40.hook_resid_post", n_layers=30)
        ... except KeyError as e:
        ...     print(type(e).__name__, "|", e)
        HookNameError | expected a layer in 0..29 for this model (30 blocks), found 40 in 'blocks.40.hook_resid_post'
    """

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class InputError(SteerkitError, ValueError):
    """Bad input: wrong shape, NaN, empty prompt list, prompt too long...

    Examples:
        >>> try:
        ...     steerkit.load_model(dtype="int8")
        ... except ValueError as e:
        ...     print(type(e).__name__, "|", e)
        InputError | expected a floating-point torch dtype ('auto', 'float32', 'bfloat16', 'float16'), found 'int8'
    """


class RowIndexError(SteerkitError, IndexError):
    """A row index outside the rows a recording holds (an ``IndexError``, so ``except IndexError`` catches it).

    Examples:
        >>> try:
        ...     raise steerkit.RowIndexError("expected a row index in [-2, 2), found 5; this recording has 2 rows")
        ... except IndexError as e:
        ...     print(e)
        expected a row index in [-2, 2), found 5; this recording has 2 rows
    """


class BackendUnavailableError(SteerkitError, RuntimeError):
    """A compute backend was asked for but cannot run here (Triton missing, tensors not on CUDA).

    Examples:
        >>> from steerkit.kernels import resolve_impl_for
        >>> try:  # the Triton kernels on CPU tensors, outside Triton's interpreter
        ...     resolve_impl_for("triton", "cpu")
        ... except RuntimeError as e:
        ...     print(type(e).__name__)
        BackendUnavailableError
    """


class PathExistsError(SteerkitError, FileExistsError):
    """A file or folder is already where something would be written.

    Examples:
        >>> from steerkit.storage.files import atomic_folder
        >>> (tmp_dir / "out").mkdir()
        >>> try:
        ...     with atomic_folder(tmp_dir / "out"):
        ...         pass
        ... except FileExistsError as e:
        ...     print(type(e).__name__)
        PathExistsError
    """
