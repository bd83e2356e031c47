"""Execute the tutorial notebooks and write the executed copies that the documentation site renders.

The notebooks in ``docs/tutorials/`` are stored without outputs. This script runs each one top to bottom
(nbclient, a kernel of this interpreter, the Hugging Face hub offline, the working directory a temporary
folder) and writes the executed copy, outputs included, to ``docs/tutorials/executed/<name>.ipynb``. The
documentation build renders a copy only while its cell sources equal the notebook's
(``docs/hooks/notebooks.py``), and ``tests/integration/test_tutorials.py`` fails while a copy is stale.

Plotly figures are stored as HTML that draws the figure with a ``Plotly`` object the page provides: the site
loads one plotly.js for every figure (``docs/hooks/notebooks.py`` copies it from the installed ``plotly``
package), so no figure carries its own copy of plotly.js.

Usage:
    .venv/bin/python scripts/execute_tutorials.py                      # every notebook
    .venv/bin/python scripts/execute_tutorials.py 03_refusal_direction  # some of them (name or stem)
    .venv/bin/python scripts/execute_tutorials.py --check              # list stale or missing copies, run nothing

The vLLM tutorial needs the ``.venv-vllm`` environment (``scripts/setup.sh``); without it that notebook is
skipped and its committed copy is kept.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Sequence

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "docs" / "tutorials"
EXECUTED = TUTORIALS / "executed"
VLLM_PY = Path(os.environ.get("STEERKIT_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
NEEDS_VLLM = {"05_serving_vllm.ipynb"}
PLOTLY_MIME = "application/vnd.plotly.v1+json"
CHECK_TAG = "steerkit-check"
FIGURE_HEIGHT = "500px"  # a figure whose layout sets no height


def notebooks() -> list[Path]:
    """The tutorial notebooks, in file order."""
    return sorted(TUTORIALS.glob("*.ipynb"))


def sources(nb) -> list[tuple[str, str]]:
    """``(cell type, source)`` of every cell: what an executed copy must share with its notebook."""
    return [(c["cell_type"], "".join(c["source"]) if isinstance(c["source"], list) else c["source"])
            for c in nb["cells"]]


def stale(path: Path) -> str | None:
    """Why the executed copy of ``path`` cannot be shown (missing, unreadable, other cells), or None."""
    out = EXECUTED / path.name
    if not out.is_file():
        return f"no executed copy {out.relative_to(ROOT)}"
    try:
        mine = sources(json.loads(path.read_text(encoding="utf-8")))
        theirs = sources(json.loads(out.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable notebook or copy: {e}"
    if mine != theirs:
        changed = [i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b]
        extra = "" if len(mine) == len(theirs) else f"; {len(mine)} cells in the notebook, {len(theirs)} in the copy"
        return f"the copy's cells differ from the notebook's (cells {changed[:8]}{extra})"
    return None


def kernel_env(tmp: str | None = None) -> dict:
    """The kernel's environment: offline, plotly figures as JSON, torch on ``STEERKIT_TUTORIAL_THREADS`` threads
    (default 1: several times faster than 2 threads on a small machine that other processes share).

    ``tmp``: the kernel's ``TMPDIR``, so that what a notebook writes to a temporary folder of its own (a model
    folder, a GGUF file: hundreds of MB) goes where the run removes it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    if tmp is not None:
        env["TMPDIR"] = tmp
    threads = os.environ.get("STEERKIT_TUTORIAL_THREADS", "1")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PLOTLY_RENDERER="plotly_mimetype",  # the figure's JSON only; to_site() renders it
               OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    return env


def execute(path: Path, *, checks: Sequence[str] = (), timeout: float = 600, cwd: str | Path | None = None):
    """Run the notebook at ``path`` top to bottom and return ``(nb, seconds)``.

    ``checks``: code run in the same kernel after the last cell (each as a cell of its own, removed from the
    returned notebook); a failing check fails like a failing cell (``nbclient``'s ``CellExecutionError``).
    """
    import nbclient
    import nbformat
    from jupyter_client.manager import KernelManager

    nb = nbformat.read(str(path), as_version=4)
    n = len(nb.cells)
    for code in checks:
        nb.cells.append(nbformat.v4.new_code_cell(code, metadata={"tags": [CHECK_TAG]}))
    km = KernelManager(kernel_name="python3")
    km.kernel_spec.argv[0] = sys.executable  # this interpreter, whatever kernelspecs the machine has
    with tempfile.TemporaryDirectory(prefix="steerkit-tutorial-") as tmp:
        # cwd away from the repository root: its kernels/ folder must not shadow the `kernels` package
        where = str(cwd or tmp)
        client = nbclient.NotebookClient(nb, km=km, timeout=int(timeout), startup_timeout=120, allow_errors=False,
                                         resources={"metadata": {"path": where}})
        t0 = time.perf_counter()
        try:
            client.execute(cwd=where, env=kernel_env(tmp))
        finally:
            if km.has_kernel:  # the client leaves a kernel it was given running
                km.shutdown_kernel(now=True)
        elapsed = time.perf_counter() - t0
    nb.cells = nb.cells[:n]
    return nb, elapsed


def slowest_cells(nb, n: int = 3) -> list[str]:
    """``"cell i: t s"`` for the ``n`` slowest code cells, from nbclient's execution timestamps."""
    from datetime import datetime

    times = []
    for i, c in enumerate(nb.cells):
        ex = c.get("metadata", {}).get("execution", {})
        a, b = ex.get("iopub.execute_input"), ex.get("shell.execute_reply")
        if a and b:
            dt = datetime.fromisoformat(b.replace("Z", "+00:00")) - datetime.fromisoformat(a.replace("Z", "+00:00"))
            times.append((dt.total_seconds(), i))
    return [f"cell {i}: {t:.0f} s" for t, i in sorted(times, reverse=True)[:n]]


def figure_html(figure: dict, div_id: str) -> str:
    """A plotly figure as an HTML fragment that draws it with the page's ``Plotly`` (no plotly.js inside)."""
    import plotly.io as pio

    return pio.to_html(figure, include_plotlyjs=False, full_html=False, div_id=div_id, validate=False,
                       default_width="100%", default_height=FIGURE_HEIGHT)


def _noise(out) -> bool:
    """A progress bar, tqdm's notebook warning or a blank line on stderr."""
    if out.get("output_type") != "stream" or out.get("name") != "stderr":
        return False
    text = "".join(out.get("text", ""))
    return "\r" in text or "TqdmWarning" in text or "from .autonotebook import" in text or not text.strip()


def to_site(nb, stem: str):
    """The executed notebook as the site stores it: each plotly figure as HTML (``figure_html``) in place of its
    JSON, without progress bars on stderr, execution timestamps or kernel-specific metadata."""
    nb = copy.deepcopy(nb)
    k = 0
    for cell in nb.cells:
        cell.get("metadata", {}).pop("execution", None)
        if cell.cell_type != "code":
            continue
        cell.outputs = [out for out in cell.outputs if not _noise(out)]
        for out in cell.outputs:
            data = out.get("data", {})
            if PLOTLY_MIME in data:
                k += 1
                data["text/html"] = figure_html(data.pop(PLOTLY_MIME), f"{stem}-figure-{k}")
                data.pop("text/plain", None)
    nb.metadata = {key: nb.metadata[key] for key in ("kernelspec", "language_info") if key in nb.metadata}
    nb.metadata.setdefault("language_info", {})["name"] = "python"
    for key in list(nb.metadata["language_info"]):
        if key != "name":
            del nb.metadata["language_info"][key]
    return nb


def write(nb, path: Path) -> Path:
    """Write ``nb`` (executed) as the site's copy of the tutorial at ``path``; returns the copy's path."""
    import nbformat

    EXECUTED.mkdir(parents=True, exist_ok=True)
    out = EXECUTED / path.name
    tmp = EXECUTED / f".{path.name}.tmp-{os.getpid()}"
    nbformat.write(to_site(nb, path.stem), str(tmp))
    os.replace(tmp, out)
    return out


def _select(names: Iterable[str]) -> list[Path]:
    every = notebooks()
    if not names:
        return every
    chosen = []
    for name in names:
        hits = [p for p in every if name in (p.name, p.stem) or p.name.startswith(name)]
        if len(hits) != 1:
            raise SystemExit(f"expected one tutorial named {name!r}, found {[p.name for p in hits] or 'none'} "
                             f"among {[p.name for p in every]}")
        chosen.append(hits[0])
    return chosen


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", help="notebooks to run (file name, stem or its number prefix); default all")
    ap.add_argument("--check", action="store_true", help="list stale or missing executed copies; run nothing")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per cell (default 900)")
    a = ap.parse_args(argv)
    paths = _select(a.names)
    if a.check:
        bad = {p.name: why for p in paths if (why := stale(p))}
        for name, why in bad.items():
            print(f"{name}: {why}")
        print("every executed copy is current" if not bad else
              f"refresh: {Path(sys.executable).name} scripts/execute_tutorials.py {' '.join(bad)}")
        return 1 if bad else 0
    failed = []
    for p in paths:
        if p.name in NEEDS_VLLM and not VLLM_PY.exists():
            print(f"{p.name}: skipped, no vLLM environment at {VLLM_PY} (its committed copy is kept)", flush=True)
            continue
        print(f"{p.name}: running ...", flush=True)
        try:
            nb, elapsed = execute(p, timeout=a.timeout)
        except Exception as e:  # a failing cell: report it, keep the old copy, go on with the others
            print(f"{p.name}: FAILED, copy not written\n{e}", flush=True)
            failed.append(p.name)
            continue
        out = write(nb, p)
        print(f"{p.name}: {elapsed:.0f} s (slowest {', '.join(slowest_cells(nb))}); wrote "
              f"{out.relative_to(ROOT)} ({out.stat().st_size / 1024:.0f} KiB)", flush=True)
    if failed:
        print(f"failed: {' '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
