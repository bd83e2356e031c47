"""What the root folders ``kernels/``, ``probes/``, ``vectors/`` and ``apps/`` do when imported by their bare names.

steerkit installs those folders as ``steerkit.kernels``, ``steerkit.probes``, ``steerkit.vectors`` and
``steerkit.apps``. Python started in a checkout's root (``python -c``, ``python -m``, a script on stdin, a
REPL, a notebook, pytest's root ``conftest.py``) puts the root on ``sys.path``, where ``import kernels`` would
find the folder before Hugging Face's ``kernels`` package, which transformers imports. Each folder's
``__init__.py`` calls :func:`hand_over` when its module name is the bare one:

- an installed package of that name (found on ``sys.path`` without the checkout's root) is loaded in the
  folder's place, so ``import kernels`` gives Hugging Face's package, as outside the checkout;
- with none installed, an ``import`` statement fails as it would outside the checkout, with a message
  naming ``steerkit.<name>``; a programmatic availability check (``importlib.import_module``, as
  transformers' ``_is_package_available`` uses when a name has no distribution metadata) gets a module with
  no ``__file__`` and no ``__version__``, which such checks read as a stray folder; any other attribute of it
  raises that same error, and once its ``__file__`` has been asked for it leaves ``sys.modules``.

The folders' ``__init__.py`` files run this file with :func:`runpy.run_path`, by path: importing
``steerkit`` from there would import transformers, which may be what is importing the folder.
This file imports nothing of steerkit's and is never used by the installed package.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Optional


def _not_installed(name: str, folder: str) -> ModuleNotFoundError:
    return ModuleNotFoundError(
        f"No module named {name!r}: the folder {folder} of this steerkit checkout is steerkit.{name} (import "
        f"steerkit.{name}), and no package named {name!r} is installed outside it", name=name)


def _installed_spec(name: str, root: str) -> importlib.machinery.ModuleSpec | None:
    """The spec of a real module ``name`` on ``sys.path`` without the checkout's root, or None.

    A namespace portion (a folder without ``__init__.py``, such as ``tests/kernels``) is not a package."""
    path = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.origin is None or not spec.has_location:
        return None
    return spec


def _from_import_module() -> bool:
    """Whether the import in progress was asked for by ``importlib.import_module`` rather than a statement.

    Called from :func:`hand_over`: two frames up is the folder's ``__init__`` body, and above it the import
    system's own frames, then whoever asked for the import."""
    frame: Optional[types.FrameType] = sys._getframe(3)
    while frame is not None and frame.f_code.co_filename.startswith("<frozen importlib"):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_name == "import_module" \
        and frame.f_code.co_filename == importlib.__file__


def _placeholder(module: types.ModuleType, name: str, error: ModuleNotFoundError) -> None:
    """Empty ``module`` into what availability checks read as a stray folder: no file, no version, no members.

    Such a check reads ``__file__`` last; then the module leaves ``sys.modules``, so that a later ``import``
    statement fails as it would outside the checkout."""
    for key in [k for k in vars(module) if k not in ("__name__", "__doc__", "__package__", "__spec__", "__loader__")]:
        del vars(module)[key]
    module.__path__ = []

    def __getattr__(attr: str):
        if attr == "__file__" and sys.modules.get(name) is module:
            del sys.modules[name]
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        raise error

    module.__getattr__ = __getattr__  # type: ignore[method-assign]


def hand_over(name: str) -> None:
    """Put the installed package ``name`` in the place of the checkout's folder of that name (see the module).

    Called from the folder's ``__init__.py`` while it is being imported as ``name``."""
    stray = sys.modules[name]
    folder = os.path.dirname(os.path.realpath(stray.__file__ or ""))
    spec = _installed_spec(name, os.path.dirname(folder))
    if spec is None:
        error = _not_installed(name, folder)
        if not _from_import_module():
            raise error
        _placeholder(stray, name, error)
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the import system returns what sys.modules holds once this body ends
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except BaseException:
        sys.modules[name] = stray
        raise
