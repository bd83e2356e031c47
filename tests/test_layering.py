"""The package's shape, checked: layering (import-linter), no function-local imports of steerkit
modules, ruff, and the type checker."""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("steerkit", "kernels", "vectors", "probes", "apps")
# steerkit modules that need an optional dependency at import time (Triton for the kernels, Dash for the
# app's callbacks, layout and runtime): the function that needs them imports them, so that everything
# else works without the extra. (file, module as written)
LAZY_OK = {("kernels/fused.py", "._triton"), ("apps/app.py", "."), ("apps/app.py", ".runtime")}


def _lazy_ok(rel: str, mod: str) -> bool:
    """Plotting modules (``steerkit.probes.plots.*``, ``steerkit.vectors.plots``) need plotly (the ``app``
    extra) at import: a result's ``plot()`` imports its figure module when called."""
    return (rel, mod) in LAZY_OK or mod.split(".")[-1] == "plots" or ".plots." in mod or mod.startswith(".plots")


def _bin(name: str) -> str:
    exe = Path(sys.executable).with_name(name)
    if not exe.exists():
        pytest.fail(f"{name} is not installed in this environment; run scripts/setup.sh")
    return str(exe)


def test_layers_contract():
    """core (kernels below it) <- vectors <- probes <- apps / serving / cli: pyproject's contract."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "lint_imports.py")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout
    # only the interventions (the one lowering step) and the serving operator import the kernels
    assert "the kernels: imported only by steerkit.interventions and steerkit.serving KEPT" in r.stdout
    # the inside of the core, ordered: every module has its place, none imports one above it
    assert "the core in layers, bottom to top KEPT" in r.stdout


def test_the_core_contract_orders_every_core_module():
    """The core's contract names each of its modules once, bottom to top as docs/ARCHITECTURE.md lists them, and
    ignores no import."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    core = next(c for c in config["contracts"] if c["name"] == "the core in layers, bottom to top")
    layers = [sorted(m.strip() for m in layer.split(":")) for layer in reversed(core["layers"])]
    assert layers == [["errors", "version"], ["bounded", "deprecation", "imports"], ["kernels"], ["storage"],
                      ["hooks"], ["loading", "sae"], ["interventions"], ["backends", "reuse", "saesites"],
                      ["generation"], ["model"], ["executors"], ["recording"], ["demo"]]
    assert core["exhaustive"] is True and not core.get("ignore_imports")
    named = {m for layer in layers for m in layer} | set(core["exhaustive_ignores"])
    on_disk = {p.stem for p in (ROOT / "steerkit").glob("*.py") if p.stem != "__init__"}
    on_disk |= {p.parent.name for p in (ROOT / "steerkit").glob("*/__init__.py")}
    on_disk |= {"kernels", "vectors", "probes", "apps"}
    assert on_disk - named == set()


def test_no_function_local_imports_of_steerkit_modules():
    found = []
    for folder in FOLDERS:
        for f in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(f.read_text(encoding="utf-8"))
            for fn in ast.walk(tree):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for n in ast.walk(fn):
                    rel = str(f.relative_to(ROOT))
                    if isinstance(n, ast.ImportFrom):
                        mod = "." * n.level + (n.module or "")
                        if (n.level or mod.startswith("steerkit")) and not _lazy_ok(rel, mod):
                            found.append(f"{rel}:{n.lineno} from {mod}")
                    elif isinstance(n, ast.Import):
                        found += [f"{rel}:{n.lineno} import {a.name}" for a in n.names
                                  if a.name.startswith("steerkit") and not _lazy_ok(rel, a.name)]
    assert not found, "imports inside functions (move them to the module top):\n" + "\n".join(found)


def test_ruff():
    r = subprocess.run([_bin("ruff"), "check", *FOLDERS, "benchmarks", "scripts"], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


def test_type_checker():
    """mypy over the core, the kernels and the vectors (configuration in pyproject.toml)."""
    if shutil.which("mypy", path=str(Path(sys.executable).parent)) is None:
        pytest.fail("mypy is not installed in this environment; run scripts/setup.sh")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "typecheck.py")], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


def test_functions_that_take_a_model_say_so():
    """Every parameter named ``sm`` carries its type (``SteerModel``), so readers and the type checker know."""
    bare = []
    for folder in FOLDERS:
        for f in (ROOT / folder).rglob("*.py"):
            for fn in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    bare += [f"{f.relative_to(ROOT)}:{fn.lineno} {fn.name}" for a in fn.args.args + fn.args.kwonlyargs
                             if a.arg == "sm" and a.annotation is None]
    assert not bare, "\n".join(bare)


def test_subpackages_are_attributes_loaded_on_first_use():
    """``import steerkit`` loads the core only; ``steerkit.probes`` (and every other subpackage) works without a
    separate import and loads then."""
    code = ("import sys, steerkit\n"
            "before = sorted(m for m in ('steerkit.probes', 'steerkit.apps', 'steerkit.vectors') if m in sys.modules)\n"
            "names = [steerkit.probes.sweep.__name__, steerkit.vectors.Store.__name__, steerkit.kernels.__name__]\n"
            "print(before, names, 'steerkit.apps' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[] ['sweep', 'Store', 'steerkit.kernels'] False", r.stdout
