"""The docstring examples of the public modules: every public function and class has one, and they all run.

The modules are listed once, in scripts/doctest_modules.txt; scripts/doctests.sh runs their doctests
(``pytest --doctest-modules``, in a separate process, so this suite never collects them itself).
"""
from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIST = ROOT / "scripts" / "doctest_modules.txt"


def doctest_modules() -> list[str]:
    lines = (ln.strip() for ln in LIST.read_text(encoding="utf-8").splitlines())
    return [ln for ln in lines if ln and not ln.startswith("#")]


def public_objects(name: str) -> dict[str, object]:
    """The public functions and classes of a module: its ``__all__``, else those it defines without a leading
    underscore (methods are not counted)."""
    module = importlib.import_module(name)
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, o in vars(module).items()
                 if not n.startswith("_") and getattr(o, "__module__", None) == name]
    objs = {n: getattr(module, n) for n in names}
    return {n: o for n, o in objs.items() if inspect.isfunction(o) or inspect.isclass(o)}


def test_every_documented_module_is_listed():
    """Each module of the API reference (docs/api/*.md) and each module defining one of their public names
    has its doctests run."""
    listed = set(doctest_modules())
    documented = set()
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        documented |= set(re.findall(r"^::: ([\w.]+)", page.read_text(encoding="utf-8"), flags=re.M))
    assert documented - listed == set(), f"add to {LIST.name}: {sorted(documented - listed)}"
    outside = sorted({f"{o.__module__} (defines {m}.{n})" for m in listed for n, o in public_objects(m).items()
                      if o.__module__ not in listed})
    assert outside == [], f"public names defined in modules missing from {LIST.name}: {outside}"


def test_every_public_name_has_an_example():
    # a class's own docstring (``__doc__`` is not inherited), each object once, under the module defining it
    missing = sorted({f"{o.__module__}.{o.__qualname__}" for m in doctest_modules()
                      for o in public_objects(m).values() if ">>>" not in (o.__doc__ or "")})
    assert missing == [], f"{len(missing)} public names without a `>>>` example in their docstring: {missing}"


def test_examples_are_in_examples_sections():
    """The API reference (mkdocstrings, Google style) renders an ``Examples:`` section as code; an ``Example:``
    section becomes an admonition whose ``>>>`` lines read as Markdown (quotes, and links that fail the strict
    build), so every example sits under ``Examples:``."""
    singular = []
    for name in doctest_modules():
        path = Path(importlib.import_module(name).__file__)
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.fullmatch(r"\s+Example:\s*", line):
                singular.append(f"{path.relative_to(ROOT)}:{i}")
    assert singular == [], f"write these sections as `Examples:` (plural): {singular}"


@pytest.mark.slow
def test_doctests_run():
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "doctests.sh")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"scripts/doctests.sh failed (exit {proc.returncode}):\n{out[-12000:]}"
    assert " passed" in out, out[-4000:]
