"""Doctest support for the public modules (``bash scripts/doctests.sh``).

- Collection: the package installs from several root folders (``package-dir`` in pyproject.toml: ``probes/``
  is ``steerkit.probes`` and so on). ``pytest --doctest-modules`` would import ``probes/sweep.py`` as the
  top-level module ``probes.sweep``, a second copy of the code; here every doctest module under one of those
  folders is imported by its installed name (``steerkit.probes.sweep``) instead.
- ``doctest_namespace``: the names every doctest may use without importing: ``steerkit``, ``torch``, ``np``,
  ``sm`` (the embedded default model, loaded once per run, only when a doctest uses it), ``tiny`` (a tiny
  random-weight Llama with the default tokenizer's vocabulary, built once, offline), and for each doctest a
  fresh ``tmp_dir`` (a ``pathlib.Path``) and ``store`` (a ``steerkit.vectors.Store`` in its own folder).
  torch's seed is 0 at the start of every doctest; a doctest that leaves hooks on ``sm`` or ``tiny`` fails.
"""
from __future__ import annotations

import importlib
import os
import re
from pathlib import Path

import pytest
from _pytest.doctest import DoctestModule

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent


def _package_dirs() -> dict[Path, str]:
    """``{folder: installed package name}`` read from pyproject.toml's ``package-dir``, deepest folder first."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    if tomllib is not None:
        mapping = tomllib.loads(text)["tool"]["setuptools"]["package-dir"]
    else:  # the one-line inline table of [tool.setuptools]
        line = re.search(r"^package-dir\s*=\s*\{(.*)\}\s*$", text, flags=re.M)
        mapping = dict(re.findall(r'"([\w.]+)"\s*=\s*"([^"]+)"', line.group(1) if line else ""))
    dirs = {(ROOT / folder).resolve(): name for name, folder in mapping.items()}
    return dict(sorted(dirs.items(), key=lambda kv: -len(kv[0].parts)))


PACKAGE_DIRS = _package_dirs()


def module_name(path: Path) -> str | None:
    """The installed dotted name of a source file of the package (``probes/sweep.py`` ->
    ``steerkit.probes.sweep``), or None for a file outside its folders."""
    path = path.resolve()
    for folder, name in PACKAGE_DIRS.items():
        if path.is_relative_to(folder):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts and parts[-1] == "__init__":
                parts.pop()
            return ".".join([name, *parts])
    return None


class InstalledDoctestModule(DoctestModule):
    """A doctest module imported by its installed name, so the doctests run against the one copy of the code."""

    def _getobj(self):
        name = module_name(self.path)
        module = importlib.import_module(name)
        found = Path(module.__file__).resolve()
        if found != self.path.resolve():
            raise pytest.UsageError(f"expected {name} to be imported from {self.path}, found {found}; install "
                                    "the package editable (pip install -e .) to run the doctests of this tree")
        return module


def pytest_collect_directory(path, parent):
    """A folder of the package is a plain directory to pytest, not a package it imports by path (``probes/``
    as ``probes``: steerkit/_rootnames.py hands that name over to whatever package is installed under it)."""
    if module_name(path / "__init__.py") is not None:
        return pytest.Dir.from_parent(parent, path=path)
    return None


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path, parent):
    """A source file of the package yields its doctests, imported by the installed name; a file passed on the
    command line would also be collected as a test module, imported by its path (``kernels/launch.py`` as
    ``kernels.launch``, which is not steerkit's: steerkit/_rootnames.py): it holds no tests, so it is left out."""
    collected = yield
    if module_name(file_path) is None:
        return collected
    return [InstalledDoctestModule.from_parent(parent, path=file_path) if type(c) is DoctestModule else c
            for c in collected if type(c) is DoctestModule or not isinstance(c, pytest.Module)]


# ---------------------------------------------------------------------------------------------- doctest names

@pytest.fixture(scope="session")
def doctest_default_model():
    """The embedded default model (SmolLM2-135M-Instruct, float32), loaded once."""
    import steerkit

    sm = steerkit.load_model()
    yield sm
    sm.reset()


@pytest.fixture(scope="session")
def doctest_tiny_model():
    """A tiny random-weight Llama SteerModel: 4 layers, d_model 64, 4 heads, 2 KV heads, the default
    tokenizer (its vocabulary), built offline with fixed weights."""
    import steerkit
    from tiny_models import tiny_chat_llama  # tests/support, on pytest's pythonpath

    model, tok = tiny_chat_llama()
    tiny = steerkit.wrap(model, tok, name="tiny-llama")
    yield tiny
    tiny.reset()


def _uses(dtest, name: str) -> bool:
    pattern = re.compile(rf"\b{name}\b")
    return any(pattern.search(ex.source) for ex in dtest.examples)


@pytest.fixture
def doctest_namespace(request, tmp_path):
    """The names of every doctest (see the module docstring); the models load only for doctests that use them."""
    import numpy as np
    import torch

    import steerkit
    from steerkit.vectors import Store

    ns = {"steerkit": steerkit, "torch": torch, "np": np, "tmp_dir": tmp_path / "tmp",
          "store": Store(tmp_path / "store")}
    ns["tmp_dir"].mkdir()
    dtest = getattr(request.node, "dtest", None)
    models = {}
    for name, fixture in (("sm", "doctest_default_model"), ("tiny", "doctest_tiny_model")):
        if dtest is None or _uses(dtest, name):
            models[name] = ns[name] = request.getfixturevalue(fixture)
    before = {name: m.hook_count() for name, m in models.items()}
    torch.manual_seed(0)
    yield ns
    leftover = {name: m.hook_count() - before[name] for name, m in models.items()}
    for m in models.values():
        m.reset()
    bad = {name: n for name, n in leftover.items() if n}
    assert not bad, f"the doctest left hooks on {bad}; use `with ...:` or call `.remove()`"
