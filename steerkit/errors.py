"""Exceptions raised by steerkit.

Every error message follows one pattern: what was expected, what was found,
and what to do about it. The classes subclass the built-in exception a caller
would naturally catch (``ValueError``, ``KeyError``...) so existing ``except``
clauses keep working.
"""
from __future__ import annotations


class SteerkitError(Exception):
    """Base class for every error steerkit raises on purpose."""


class ModelNotFoundError(SteerkitError, FileNotFoundError):
    """A model could not be found locally (steerkit never downloads at run time)."""


class UnsupportedArchitectureError(SteerkitError, NotImplementedError):
    """No adapter knows this model's architecture."""


class HookNameError(SteerkitError, KeyError):
    """A hook name that does not exist on this model."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class InputError(SteerkitError, ValueError):
    """Bad input: wrong shape, NaN, empty prompt list, prompt too long..."""


class RowIndexError(SteerkitError, IndexError):
    """A row index outside the rows a recording holds."""


class BackendUnavailableError(SteerkitError, RuntimeError):
    """A compute backend was asked for but cannot run here (Triton missing, tensors not on CUDA)."""


class PathExistsError(SteerkitError, FileExistsError):
    """A file or folder is already where something would be written."""
