"""The code's shape, checked on the source: units a reader can hold, figures apart from compute, and
lazy imports only where an optional extra needs them."""
from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("steerkit", "kernels", "vectors", "probes", "apps")
MAX_FUNCTION_LINES = 150
MAX_MODULE_LINES = 800
# a module longer than MAX_MODULE_LINES says why in its docstring, in a sentence that starts so
SIZE_REASON = "Why one module:"

# Third-party packages that steerkit's required dependencies do not bring: the extras of pyproject.toml
# (backends, probes, kernels, quant, app, llamacpp, ray, sae) and the serving engine. Only these may be imported
# inside a function, so that everything else works without them. Every other import sits at a module's top.
OPTIONAL = {
    "plotly", "dash", "flask", "diskcache", "multiprocess", "psutil", "waitress",   # app
    "sklearn", "threadpoolctl", "scipy",                                 # probes (scikit-learn and its deps)
    "transformer_lens", "nnsight",                                       # backends
    "triton",                                                            # kernels
    "torchao",                                                           # quant
    "llama_cpp",                                                         # llamacpp
    "vllm",                                                              # serving (its own environment)
    "accelerate",                                                        # big-model loading (device_map)
    "matplotlib",                                                        # a fallback plotter where plotly is absent
    "ray",                                                               # ray (steerkit.executors)
    "sparsify",                                                          # sae (eai-sparsify: SAE training)
}
# the figure modules: the only places that import plotly
PLOTTING = ("probes/plots/", "vectors/plots.py", "apps/figures")


def _library_files():
    for folder in FOLDERS:
        for f in sorted((ROOT / folder).rglob("*.py")):
            yield f, str(f.relative_to(ROOT)), ast.parse(f.read_text(encoding="utf-8"))


def _functions(tree):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _imported(node) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module]
    return []


def test_functions_a_reader_can_hold():
    long = [f"{rel}:{fn.lineno} {fn.name} ({fn.end_lineno - fn.lineno + 1} lines)"
            for _, rel, tree in _library_files() for fn in _functions(tree)
            if fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(long)


def test_modules_of_one_concern():
    big = []
    for f, rel, tree in _library_files():
        n = len(f.read_text(encoding="utf-8").splitlines())
        if n > MAX_MODULE_LINES and SIZE_REASON not in (ast.get_docstring(tree) or ""):
            big.append(f"{rel} ({n} lines)")
    assert not big, (f"modules over {MAX_MODULE_LINES} lines whose docstring gives no reason "
                     f"('{SIZE_REASON} ...'); split them by concern:\n" + "\n".join(big))


def test_plotly_only_in_figure_modules():
    found = [f"{rel}:{n.lineno}" for _, rel, tree in _library_files() if not rel.startswith(PLOTTING)
             for n in ast.walk(tree) for name in _imported(n) if name.split(".")[0] == "plotly"]
    assert not found, "plotly imported by a compute module (move the figure to a plotting module):\n" + "\n".join(found)


def test_lazy_imports_only_for_optional_extras():
    stdlib = set(sys.stdlib_module_names)
    found = []
    for _, rel, tree in _library_files():
        for fn in _functions(tree):
            for n in ast.walk(fn):
                for name in _imported(n):
                    top = name.split(".")[0]
                    if top != "steerkit" and top not in OPTIONAL:
                        kind = "standard library" if top in stdlib else "required dependency"
                        found.append(f"{rel}:{n.lineno} {name} ({kind})")
    assert not found, "imports inside functions of modules every install has (move them to the top):\n" + "\n".join(found)



def test_every_package_is_in_the_wheel():
    """pyproject's ``packages`` names every folder with an ``__init__.py`` (a missing one would be left out
    of a built wheel while the editable install still finds it)."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    folders = {v: k for k, v in cfg["package-dir"].items()}
    found = set()
    for folder, package in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *rel.parts]))
    assert found <= set(cfg["packages"]), sorted(found - set(cfg["packages"]))
