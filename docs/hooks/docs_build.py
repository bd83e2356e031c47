"""MkDocs hooks for the documentation build.

- The API reference reads the sources statically (griffe). ``steerkit.probes``, ``.vectors``, ``.kernels``
  and ``.apps`` install from root folders (``package-dir`` in pyproject.toml), a layout griffe does not
  follow, so ``build/docs-src/steerkit`` is laid out as installed (``scripts/lint_imports.py``'s
  ``assemble``: a copy of ``steerkit/`` with those folders inside). ``mkdocs.yml`` points mkdocstrings
  there (``paths``).
- The build fails while docs/cli.md differs from ``steerkit.cli.build_parser()``: the page is written by
  ``scripts/cli_reference.py``, rendered again here and compared.
"""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"steerkit_docs_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cli_reference = _script("cli_reference")
lint_imports = _script("lint_imports")  # its ``assemble`` lays the package out as installed

SOURCES = ROOT / "build" / "docs-src"
shutil.rmtree(SOURCES, ignore_errors=True)
lint_imports.assemble(SOURCES)


def on_pre_build(config, **kwargs) -> None:
    page = Path(config["docs_dir"]) / "cli.md"
    current = page.read_text(encoding="utf-8") if page.exists() else ""
    if current != cli_reference.render():
        raise PluginError("docs/cli.md differs from steerkit.cli.build_parser(); "
                          "run: .venv/bin/python scripts/cli_reference.py")
