"""Every ``steerkit.*`` dotted name that a documentation page (docs/**/*.md, README.md) writes in inline code or
in a fenced code block exists, and the API reference renders it.

What the reference renders is computed from the ``::: module`` directives of docs/api/*.md and their options,
as mkdocstrings does: the module; unless ``members: false``, its public names (its ``__all__``, else the
functions, classes and variables it defines without a leading underscore) and the public attributes of those
classes; with ``show_submodules: true``, the same for every submodule. A package counts as rendered when some of
its modules are. A name re-exported elsewhere counts as
rendered where its object is (``steerkit.probes.activation_patching`` is documented under
``steerkit.probes.patching``). Names with a private component (``steerkit.backends._torch``) and the modules in
:data:`INTERNALS` are not API: the pages that explain how steerkit works inside name them."""
from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
#: modules of steerkit's implementation, named where the architecture, security and serving pages explain it
INTERNALS = (
    "steerkit.storage",            # the crash-safe folders and names behind the store and the datasets
    "steerkit.bounded",            # bounded containers behind the app and the server
    "steerkit.backends",           # the three backends behind SteerModel
    "steerkit.cli",                # the command line: its reference is docs/cli.md
    "steerkit.serving.plan",       # the vLLM plugin's per-step planning
    "steerkit.serving.salt",       # its prefix-cache salt
    "steerkit.serving.vllm_plugin",  # the plugin itself (imports vLLM)
    "steerkit.hooks.manager.RowArena",  # the allocator behind a recording
    "steerkit.hooks.segments",     # the packed-pass attention layout
    "steerkit.loading.fingerprint",  # the model fingerprint behind provenance
    "steerkit.loading.adapters.vllm_layout",  # an adapter's vLLM module layout
    "steerkit.apps",               # the explorer, described on docs/app.md (its figures: docs/api/figures.md)
)
NAME = re.compile(r"(?<![\w./])steerkit(?:\.[A-Za-z_]\w*)+")
CODE = re.compile(r"^(`{3,})[^\n]*\n.*?^\1\s*$|`[^`\n]+`", re.S | re.M)


def _directives() -> list[tuple[str, dict]]:
    out = []
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        lines = page.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            m = re.match(r"^::: ([\w.]+)\s*$", line)
            if not m:
                continue
            opts = {}
            for follow in lines[i + 1:]:
                if not follow.startswith("    "):
                    break
                kv = re.match(r"\s+(\w+):\s*(\S+)\s*$", follow)
                if kv:
                    opts[kv.group(1)] = kv.group(2)
            out.append((m.group(1), opts))
    return out


def _public_names(module) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    defined = set()
    try:
        tree = ast.parse(Path(inspect.getsourcefile(module)).read_text(encoding="utf-8"))
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AnnAssign) else []
            defined |= {t.id for t in targets if isinstance(t, ast.Name)}
    except (OSError, TypeError):
        pass
    out = []
    for n, o in vars(module).items():
        if n.startswith("_") or inspect.ismodule(o):
            continue
        if inspect.isfunction(o) or inspect.isclass(o):
            if getattr(o, "__module__", None) == module.__name__:
                out.append(n)
        elif n in defined:
            out.append(n)
    return out


def rendered() -> tuple[set[str], set[str]]:
    """(dotted paths the reference renders, canonical ``module.qualname`` of its functions and classes)."""
    paths: set[str] = set()
    canon: set[str] = set()

    def add_module(name: str, members: bool, submodules: bool):
        module = importlib.import_module(name)
        paths.add(name)
        if members:
            for n in _public_names(module):
                obj = getattr(module, n)
                paths.add(f"{name}.{n}")
                if inspect.isclass(obj) or inspect.isfunction(obj):
                    canon.add(f"{obj.__module__}.{obj.__qualname__}")
                if inspect.isclass(obj):
                    paths.update(f"{name}.{n}.{a}" for a in dir(obj) if not a.startswith("_"))
                    canon.update(f"{obj.__module__}.{obj.__qualname__}.{a}" for a in dir(obj) if not a.startswith("_"))
        if submodules and hasattr(module, "__path__"):
            for info in pkgutil.iter_modules(module.__path__):
                if not info.name.startswith("_"):
                    add_module(f"{name}.{info.name}", members, submodules)

    for name, opts in _directives():
        add_module(name, opts.get("members", "true") != "false", opts.get("show_submodules", "false") == "true")
    return paths, canon


def _resolve(name: str):
    """The object a dotted name names (a module, or an attribute path below one); AttributeError if none."""
    parts = name.split(".")
    obj, i = None, len(parts)
    while i > 0:
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            i -= 1
    if obj is None:
        raise AttributeError(name)
    for p in parts[i:]:
        obj = getattr(obj, p)
    return obj


def named_in_code(text: str) -> set[str]:
    return {n for block in CODE.finditer(text) for n in NAME.findall(block.group(0))}


def test_the_name_pattern():
    text = "`steerkit.probes.tune` and torch.ops.steerkit.steer_ in `torch.ops.steerkit.steer_`, " \
           "a link (api/steerkit.md), prose steerkit.vectors.Store\n```python\nsteerkit.load_model()\n```\n"
    assert named_in_code(text) == {"steerkit.probes.tune", "steerkit.load_model"}


def test_pages_name_only_rendered_symbols():
    paths, canon = rendered()
    missing, unknown = [], []
    for page in PAGES:
        rel = page.relative_to(ROOT).as_posix()
        for name in sorted(named_in_code(page.read_text(encoding="utf-8"))):
            if any(p.startswith("_") for p in name.split(".")) or \
                    any(name == i or name.startswith(i + ".") for i in INTERNALS):
                continue
            try:
                obj = _resolve(name)
            except AttributeError:
                unknown.append(f"{rel}: {name}")
                continue
            if name in paths:
                continue
            key = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
            if (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismethod(obj)) and key in canon:
                continue
            if inspect.ismodule(obj) and (obj.__name__ in paths or any(p.startswith(obj.__name__ + ".") for p in paths)):
                continue  # a module, or a package some of whose modules the reference renders
            missing.append(f"{rel}: {name}")
    assert unknown == [], f"pages name steerkit symbols that do not exist: {unknown}"
    assert missing == [], f"pages name steerkit symbols the API reference does not render (add a page under " \
                          f"docs/api/ or export them): {missing}"


def test_internals_are_still_named():
    """Each entry of INTERNALS is named by some page (the list does not outlive what it excuses)."""
    named = set().union(*(named_in_code(p.read_text(encoding="utf-8")) for p in PAGES))
    stale = [i for i in INTERNALS if not any(n == i or n.startswith(i + ".") for n in named)]
    assert stale == [], f"remove from INTERNALS (no page names them): {stale}"
