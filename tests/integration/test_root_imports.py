"""Python started in the repository root: the root folders ``kernels/``, ``probes/``, ``vectors/`` and ``apps/``
never stand in for packages of those names (steerkit/_rootnames.py).

With Hugging Face's ``kernels`` installed (transformers 5.25 requires it and imports it from ``modeling_utils``),
``import transformers.modeling_utils, steerkit``, ``import sparsify`` and the README's quick start work from the
root with ``python -c``, a script on stdin, ``python -m``, a REPL, a Jupyter kernel and pytest, and a bare
``import kernels`` gives Hugging Face's package. Without it (an environment made here from this one's packages,
``kernels`` left out), transformers, steerkit and sparsify still import (transformers 5.25 then refuses to load
a model, which it does anywhere without ``kernels``), and a bare ``import kernels`` fails naming
``steerkit.kernels``. Each way runs tests/support/root_session.py's text in a fresh process at the root.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SESSION = ROOT / "tests" / "support" / "root_session.py"
TIMEOUT = 300
REPORT = re.compile(r'ROOT-SESSION (\{"path0".*\})')


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _repl_text(text: str) -> str:
    """``text`` as typed at the interactive prompt: a blank line after every indented block."""
    out: list[str] = []
    for line in text.splitlines():
        if out and out[-1].startswith((" ", "\t")) and line and not line.startswith((" ", "\t", ")", "]")):
            out.append("")
        out.append(line)
    return "\n".join(out) + "\n\n"


def run_at_root(python: str, way: str, **env: str) -> dict:
    """Run the session text at the root in one ``way``; returns its ROOT-SESSION report and its output."""
    text = SESSION.read_text(encoding="utf-8")
    cmd, stdin = {"-c": ([python, "-c", text], None),
                  "stdin": ([python, "-"], text),
                  "-m": ([python, "-m", "tests.support.root_session"], None),
                  "repl": ([python, "-i", "-q"], _repl_text(text))}[way]
    r = subprocess.run(cmd, input=stdin, capture_output=True, text=True, cwd=ROOT, env=_env(**env), timeout=TIMEOUT)
    assert r.returncode == 0, f"{way}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    found = REPORT.search(r.stdout)
    assert found is not None, f"{way}: no report\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    report = json.loads(found.group(1))
    report["output"] = r.stdout
    return report


def _is_hf_kernels(report: dict) -> bool:
    file = report["kernels"].get("file") or ""
    return "error" not in report["kernels"] and "site-packages" in file and not file.startswith(str(ROOT / "kernels"))


def _generated(report: dict) -> bool:
    """The quick start printed its steered generation (a list with one reply)."""
    after = report["output"][REPORT.search(report["output"]).end():]
    return "['" in after or '["' in after


@pytest.fixture(scope="module")
def hf_kernels_installed() -> None:
    try:
        import kernels  # noqa: F401  (Hugging Face's, wherever this suite runs: the root is on sys.path)
    except ImportError:
        pytest.fail("Hugging Face's `kernels` is not installed in this environment (locks/venv.txt has it)")
    assert "site-packages" in (kernels.__file__ or ""), kernels.__file__


@pytest.mark.parametrize("way", ["-c", "stdin", "-m", "repl"])
def test_root_sessions_with_hf_kernels(way, hf_kernels_installed):
    report = run_at_root(sys.executable, way)
    assert _is_hf_kernels(report), report["kernels"]
    assert Path(report["steerkit"]).resolve() == ROOT / "steerkit" / "__init__.py"
    assert _generated(report), report["output"][-1500:]


def test_jupyter_kernel_started_at_root(hf_kernels_installed):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(SESSION.read_text(encoding="utf-8"))])
    nbclient.NotebookClient(nb, timeout=TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    out = "".join(o.get("text", "") for o in nb.cells[0].outputs if o.get("output_type") == "stream")
    report = json.loads(REPORT.search(out).group(1))
    report["output"] = out
    assert _is_hf_kernels(report), report["kernels"]
    assert _generated(report), out[-1500:]


def test_this_pytest_process_at_root(hf_kernels_installed):
    """The suite itself: pytest's root conftest.py put the root on sys.path."""
    assert str(ROOT) in [str(Path(p).resolve()) for p in sys.path if p]
    import transformers.modeling_utils  # noqa: F401

    import kernels
    import steerkit.kernels
    assert "site-packages" in kernels.__file__ and kernels is not steerkit.kernels
    assert hasattr(kernels, "get_kernel") and hasattr(steerkit.kernels, "fused_steer")
    for name in ("probes", "vectors", "apps"):
        with pytest.raises(ModuleNotFoundError, match=rf"steerkit\.{name}"):
            __import__(name)


# ------------------------------------------------------------------------------------ without HF's `kernels`

@pytest.fixture(scope="module")
def python_without_kernels(scratch) -> str:
    """A virtual environment holding this one's packages (links) except Hugging Face's ``kernels``."""
    env = scratch("no-kernels") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    here = Path(sysconfig.get_paths()["purelib"])
    (there,) = env.glob("lib/python*/site-packages")
    for entry in here.iterdir():
        if entry.name == "kernels" or (entry.name.startswith("kernels-") and entry.name.endswith(".dist-info")):
            continue
        (there / entry.name).symlink_to(entry)
    return str(env / "bin" / "python")


def test_without_hf_kernels_a_bare_import_names_steerkit_kernels(python_without_kernels):
    """transformers reads the folder as a stray one (no file, no version) and imports; the statement fails."""
    code = ("import transformers.modeling_utils, steerkit, sparsify\n"
            "from transformers.utils.import_utils import is_kernels_available\n"
            "assert not is_kernels_available()\n"
            "assert steerkit.kernels.fused_steer\n"
            "import kernels\n")
    r = subprocess.run([python_without_kernels, "-c", code], capture_output=True, text=True, cwd=ROOT, env=_env(),
                       timeout=TIMEOUT)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: No module named 'kernels'") and "steerkit.kernels" in last, last
    r = subprocess.run([python_without_kernels, "-c", "import kernels"], capture_output=True, text=True, cwd=ROOT,
                       env=_env(), timeout=TIMEOUT)
    assert r.returncode != 0 and "import steerkit.kernels" in r.stderr.strip().splitlines()[-1], r.stderr[-500:]


@pytest.mark.parametrize("way", ["stdin", "-m", "repl"])
def test_root_sessions_without_hf_kernels(way, python_without_kernels):
    """The imports (transformers 5.25 itself refuses to load a model without `kernels`: no quick start here)."""
    report = run_at_root(python_without_kernels, way, ROOT_SESSION_IMPORTS_ONLY="1")
    assert report["kernels"]["error"] == "ModuleNotFoundError", report["kernels"]
    assert "import steerkit.kernels" in report["kernels"]["message"]


def test_pytest_at_root_without_hf_kernels(python_without_kernels):
    node = "tests/integration/test_root_imports.py::test_bare_names_inside_pytest"
    r = subprocess.run([python_without_kernels, "-m", "pytest", "-q", "-p", "no:cacheprovider", node],
                       capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=TIMEOUT)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


def test_bare_names_inside_pytest():
    """Whichever environment runs it: steerkit works at the root and no folder passes for a bare package."""
    import transformers.modeling_utils  # noqa: F401

    import steerkit.kernels
    try:
        import kernels
    except ModuleNotFoundError as e:
        assert "steerkit.kernels" in str(e)
    else:
        assert kernels is not steerkit.kernels
        if getattr(kernels, "__file__", None) is None:  # the stray folder transformers checked
            with pytest.raises(ModuleNotFoundError, match=r"steerkit\.kernels"):
                kernels.get_kernel  # noqa: B018
        else:
            assert "site-packages" in kernels.__file__
    assert steerkit.kernels.fused_steer is not None
