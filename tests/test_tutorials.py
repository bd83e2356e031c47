"""The tutorials in docs/tutorials/ run top to bottom on the embedded default model.

Each notebook is executed with nbclient in a kernel of this interpreter (the .venv), with its cwd in
a temporary directory (the repository's top-level ``kernels/`` folder must not shadow the ``kernels``
package that transformers imports) and the Hugging Face hub offline. Any cell error fails the test;
the notebooks' own assertions are the checks. Stored notebooks carry no outputs and no execution
counts. Each notebook's run time is recorded as the ``run_time_s`` property (``--junitxml``) and printed.

A notebook that ran cleanly is written, outputs included, to ``build/tutorials-executed/`` (plotly figures
with the ``notebook_connected`` renderer, which loads plotly.js from its CDN instead of embedding it); the
documentation build renders that copy while its cells match the stored notebook's
(``docs/hooks/notebooks.py``). Every notebook is a page in the site's nav and in the tutorials index.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time
from datetime import datetime
from html import unescape as html_unescape
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "docs" / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("*.ipynb"))
EXECUTED = ROOT / "build" / "tutorials-executed"
VLLM_PY = Path(os.environ.get("STEERKIT_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
# per notebook: each is meant to run in under 5 minutes on 2 cores (a slower machine can raise it)
TIMEOUT_S = float(os.environ.get("STEERKIT_TUTORIAL_TIMEOUT", "600"))
NEEDS_VLLM = {"05_serving_vllm.ipynb"}


def test_there_are_tutorials():
    names = [p.name for p in NOTEBOOKS]
    for n in ("01_record_find_steer.ipynb", "02_probe_sweep.ipynb", "03_refusal_direction.ipynb",
              "04_patching.ipynb", "06_tuning.ipynb"):
        assert n in names, f"expected {n} in {TUTORIALS}, found {names}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(str(path), as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{path.name}: expected code cells, found none"
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, (f"{path.name}: expected notebooks stored with outputs stripped, found outputs or execution "
                       f"counts in cells {dirty}; clear them (nbstripout, or 'Clear All Outputs') before saving")
    assert any(c.cell_type == "markdown" for c in nb.cells), f"{path.name}: expected explanatory markdown cells"


def _slowest_cells(nb, n: int = 3) -> list[str]:
    """``"cell i: t s"`` for the ``n`` slowest code cells, from nbclient's execution timestamps."""
    times = []
    for i, c in enumerate(nb.cells):
        ex = c.get("metadata", {}).get("execution", {})
        a, b = ex.get("iopub.execute_input"), ex.get("shell.execute_reply")
        if a and b:
            dt = datetime.fromisoformat(b.replace("Z", "+00:00")) - datetime.fromisoformat(a.replace("Z", "+00:00"))
            times.append((dt.total_seconds(), i))
    return [f"cell {i}: {t:.0f} s" for t, i in sorted(times, reverse=True)[:n]]


@pytest.fixture(scope="module")
def kernel_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PLOTLY_RENDERER="notebook_connected")
    return env


@pytest.mark.slow
@pytest.mark.timeout(int(TIMEOUT_S) + 180)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path, kernel_env, record_property):
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    from jupyter_client.manager import KernelManager

    if path.name in NEEDS_VLLM:
        if not VLLM_PY.exists():
            pytest.skip(f"no vLLM environment at {VLLM_PY}: scripts/setup.sh creates it")
        pytest.importorskip("openai", reason="the serving tutorial queries vLLM with the openai client (test extra)")
    nb = nbformat.read(str(path), as_version=4)
    # the kernel is this interpreter (the .venv), whatever kernelspecs the machine has installed
    km = KernelManager(kernel_name="python3")
    km.kernel_spec.argv[0] = sys.executable
    client = nbclient.NotebookClient(nb, km=km, timeout=int(TIMEOUT_S), startup_timeout=120, allow_errors=False,
                                     resources={"metadata": {"path": str(tmp_path)}})
    t0 = time.perf_counter()
    try:
        client.execute(cwd=str(tmp_path), env=kernel_env)
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{path.name}: a cell failed:\n{e}", pytrace=False)
    finally:
        if km.has_kernel:  # the client leaves a kernel it was given running
            km.shutdown_kernel(now=True)
    elapsed = time.perf_counter() - t0
    record_property("run_time_s", round(elapsed, 1))
    print(f"\n{path.name}: {elapsed:.1f} s (slowest cells: {', '.join(_slowest_cells(nb))})")
    assert elapsed < TIMEOUT_S, f"{path.name}: expected a run under {TIMEOUT_S:.0f} s, took {elapsed:.0f} s"
    EXECUTED.mkdir(parents=True, exist_ok=True)
    tmp = EXECUTED / f".{path.name}.tmp-{os.getpid()}"
    nbformat.write(nb, str(tmp))
    os.replace(tmp, EXECUTED / path.name)  # the docs build renders it (docs/hooks/notebooks.py)


def _docs_hook():
    spec = importlib.util.spec_from_file_location("steerkit_docs_notebooks", ROOT / "docs" / "hooks" / "notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_notebook_is_a_docs_page():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    index = (TUTORIALS / "index.md").read_text(encoding="utf-8")
    assert "mkdocs-jupyter" in nav, "expected the mkdocs-jupyter plugin in mkdocs.yml"
    for p in NOTEBOOKS:
        assert f"tutorials/{p.name}" in nav, f"expected {p.name} in the nav of mkdocs.yml (the Tutorials section)"
        assert f"({p.name})" in index, f"expected a link to {p.name} in docs/tutorials/index.md"


def test_docs_use_an_executed_copy_only_while_it_is_current(tmp_path, monkeypatch):
    hook = _docs_hook()
    stored = NOTEBOOKS[0]
    monkeypatch.setattr(hook, "EXECUTED", tmp_path)
    assert hook.executed_copy(stored) is None  # no copy: the stored notebook, without outputs
    nb = nbformat.read(str(stored), as_version=4)
    code = next(c for c in nb.cells if c.cell_type == "code")
    code.outputs = [nbformat.v4.new_output("stream", name="stdout", text="ran\n")]
    code.execution_count = 1
    nbformat.write(nb, str(tmp_path / stored.name))
    assert hook.executed_copy(stored) == tmp_path / stored.name
    code.source += "\n# edited"  # the stored notebook changed since the copy ran: the copy is stale
    nbformat.write(nb, str(tmp_path / stored.name))
    assert hook.executed_copy(stored) is None


@pytest.mark.slow
def test_docs_render_the_executed_outputs():
    """Runs after the notebooks (file order): their executed copies render with their outputs."""
    convert = pytest.importorskip("mkdocs_jupyter.convert", reason="the docs extra (mkdocs-jupyter)")
    hook = _docs_hook()
    current = [p for p in NOTEBOOKS if hook.executed_copy(p) is not None]
    if not current:
        pytest.skip(f"no current executed notebook in {EXECUTED}: run test_notebook_runs first")
    path = hook.executed_copy(current[0])
    html = convert.nb2html(str(path))
    nb = nbformat.read(str(path), as_version=4)
    texts = [o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "stream"]
    line = next((t.strip().splitlines()[0] for t in texts if t.strip()), None)
    assert line is not None, f"{path.name}: expected printed output in the executed copy"
    assert html.count('class="jp-OutputArea') > 0, f"{path.name}: expected output areas in the rendered page"
    assert line in html_unescape(html), f"{path.name}: expected the printed line {line!r} on the rendered page"
