"""One error root: every exception class steerkit defines is a ``SteerkitError``, and the built-in
bases callers catch (``ValueError``, ``KeyError``...) stay where they are."""
from __future__ import annotations

import importlib
import pkgutil

import pytest

from steerkit.cli._common import error_line, run_verb
from steerkit.errors import (BackendUnavailableError, HookNameError, InputError, ModelNotFoundError, RowIndexError,
                             SteerkitError, UnsupportedArchitectureError)
from steerkit.kernels import SteerConfigError
from steerkit.kernels import _backend
from steerkit.serving.spec import SpecError
from steerkit.vectors.errors import (ArtifactFormatError, ExportError, ModelMismatchError, PathExistsError,
                                     StoreError, UnsafeNameError, VectorsError)

PACKAGES = ("steerkit", "steerkit.vectors", "steerkit.kernels", "steerkit.probes", "steerkit.serving",
            "steerkit.cli", "steerkit.apps", "steerkit.backends")
#: exception classes that are control-flow signals, not errors
SIGNALS = {"steerkit.apps.analysis.common.Cancelled"}


def _modules():
    """Every importable module of the installed package; a module whose optional dependency (vllm,
    dash...) is missing is skipped, any other import failure is an error."""
    names: set[str] = set()
    for pkg_name in PACKAGES:
        pkg = importlib.import_module(pkg_name)
        names.add(pkg_name)
        for info in pkgutil.walk_packages(pkg.__path__, pkg_name + ".", onerror=lambda name: None):
            names.add(info.name)
    mods, skipped = [], []
    for name in sorted(names):
        if name.rsplit(".", 1)[-1] == "__main__":  # running it is its import
            continue
        try:
            mods.append(importlib.import_module(name))
        except ImportError as e:
            if (e.name or "").split(".")[0] == "steerkit":
                raise
            skipped.append(name)
    return mods, skipped


def test_every_exception_class_is_a_steerkit_error():
    mods, _ = _modules()
    seen, bad = [], []
    for mod in mods:
        for obj in vars(mod).values():
            if not (isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == mod.__name__):
                continue
            qual = f"{obj.__module__}.{obj.__qualname__}"
            seen.append(qual)
            if qual not in SIGNALS and not issubclass(obj, SteerkitError):
                bad.append(qual)
    assert not bad, f"exception classes that do not subclass steerkit.errors.SteerkitError: {bad}"
    # the walk reached the sub-packages installed from the root folders
    for qual in ("steerkit.errors.InputError", "steerkit.vectors.errors.StoreError",
                 "steerkit.kernels.config.SteerConfigError", "steerkit.serving.spec.SpecError"):
        assert qual in seen


def test_builtin_bases_are_kept():
    for cls in (InputError, VectorsError, ArtifactFormatError, UnsafeNameError, ModelMismatchError, ExportError,
                StoreError, SteerConfigError, SpecError):
        assert issubclass(cls, SteerkitError) and issubclass(cls, ValueError), cls
    for cls in (ArtifactFormatError, UnsafeNameError, ModelMismatchError, ExportError, StoreError):
        assert issubclass(cls, VectorsError), cls
    assert issubclass(SteerConfigError, InputError) and issubclass(SpecError, InputError)
    assert issubclass(HookNameError, KeyError)
    assert issubclass(ModelNotFoundError, FileNotFoundError)
    assert issubclass(UnsupportedArchitectureError, NotImplementedError)
    assert issubclass(BackendUnavailableError, RuntimeError)
    assert issubclass(PathExistsError, FileExistsError) and issubclass(PathExistsError, SteerkitError)
    assert issubclass(RowIndexError, IndexError)
    assert str(HookNameError("blocks.9.hook_resid_post: no such layer")) == "blocks.9.hook_resid_post: no such layer"


def test_backend_raises_steerkit_errors():
    with pytest.raises(InputError, match="impl must be one of"):
        with _backend.use_impl("nope"):
            pass
    import torch
    if not _backend.HAS_TRITON or not _backend.interpret_mode():
        with pytest.raises(BackendUnavailableError, match="impl='torch'"):
            _backend.resolve_impl("triton", torch.zeros(2, 4))


def test_error_line_and_run_verb(capsys):
    assert error_line(InputError("expected a\nfile,\r\n  found\n\nnone")) == "steerkit: error: expected a file, found none"
    assert error_line(HookNameError("expected blocks.0.hook_resid_post")) == (
        "steerkit: error: expected blocks.0.hook_resid_post")

    def verb(args):
        raise StoreError("expected an artifact named 'x'\nfound none")

    assert run_verb(verb, None) == 2
    err = capsys.readouterr().err
    assert err == "steerkit: error: expected an artifact named 'x' found none\n"

    def disk_full(args):
        raise OSError(28, "No space left on device", "/tmp/x")

    assert run_verb(disk_full, None) == 1
    assert capsys.readouterr().err == "steerkit: error: No space left on device: /tmp/x\n"
    assert run_verb(lambda args: None, None) == 0
