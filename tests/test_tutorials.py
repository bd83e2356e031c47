"""The tutorials in docs/tutorials/ run top to bottom on the embedded default model.

Each notebook is executed with nbclient in a kernel of this interpreter (the .venv), with its cwd in
a temporary directory (the repository's top-level ``kernels/`` folder must not shadow the ``kernels``
package that transformers imports) and the Hugging Face hub offline. Any cell error fails the test;
the notebooks' own assertions are the checks. Stored notebooks carry no outputs and no execution
counts. Each notebook's run time is recorded as the ``run_time_s`` property (``--junitxml``) and printed.
"""
from __future__ import annotations

import os
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "docs" / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("*.ipynb"))
VLLM_PY = Path(os.environ.get("STEERKIT_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
# per notebook: each is meant to run in under 5 minutes on 2 cores (a slower machine can raise it)
TIMEOUT_S = float(os.environ.get("STEERKIT_TUTORIAL_TIMEOUT", "600"))
NEEDS_VLLM = {"05_serving_vllm.ipynb"}


def test_there_are_tutorials():
    names = [p.name for p in NOTEBOOKS]
    for n in ("01_record_find_steer.ipynb", "02_probe_sweep.ipynb", "03_refusal_direction.ipynb",
              "04_patching.ipynb"):
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
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
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
