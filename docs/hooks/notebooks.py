"""MkDocs hook: tutorial pages show the executed notebooks, and the site loads plotly.js once.

The notebooks in docs/tutorials/ are stored without outputs and rendered by mkdocs-jupyter, which does
not execute them. ``scripts/execute_tutorials.py`` executes each one and writes the executed copy to
``docs/tutorials/executed/<name>.ipynb`` (committed, excluded from the pages in mkdocs.yml). For each
tutorial notebook this hook points the page at that copy when the copy's cells hold the same sources as
the notebook (so a stale copy of an edited notebook is never shown; ``tests/integration/test_tutorials.py`` fails
while one is stale); otherwise the notebook is rendered as it is, without outputs, with a warning.

The executed copies store plotly figures as HTML that calls the page's ``Plotly`` (no plotly.js inside
them). The build copies ``plotly.min.js`` from the installed ``plotly`` package to
``assets/javascripts/plotly.min.js`` once, and every page that holds a figure loads it in its head.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXECUTED = ROOT / "docs" / "tutorials" / "executed"
PLOTLY_JS = "assets/javascripts/plotly.min.js"
FIGURE_MARK = 'class="plotly-graph-div"'

log = logging.getLogger("mkdocs.hooks.notebooks")


def _sources(path: Path) -> list[tuple[str, str]] | None:
    """``(cell type, source)`` of every cell, or None for an unreadable notebook."""
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
        return [(c["cell_type"], "".join(c["source"]) if isinstance(c["source"], list) else c["source"])
                for c in nb["cells"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def executed_copy(stored: Path) -> Path | None:
    """The current executed copy of ``stored``, or None when there is none (or it is stale)."""
    copy = EXECUTED / stored.name
    if not copy.is_file():
        return None
    mine = _sources(stored)
    return copy if mine is not None and _sources(copy) == mine else None


def plotly_js() -> Path | None:
    """The installed plotly package's ``plotly.min.js``, or None without plotly."""
    try:
        import plotly
    except ImportError:
        return None
    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    return path if path.is_file() else None


def on_files(files, config, **kwargs):
    for f in files:
        src = f.src_uri
        if not (src.startswith("tutorials/") and src.endswith(".ipynb")):
            continue
        copy = executed_copy(Path(f.abs_src_path))
        if copy is None:
            log.warning("%s: no current executed copy in %s, rendered without outputs; refresh it with "
                        "scripts/execute_tutorials.py", src, EXECUTED.relative_to(ROOT))
            continue
        # mkdocs-jupyter wraps the File: point both the wrapper and the file it wraps at the copy
        for target in {id(f): f, id(getattr(f, "file", f)): getattr(f, "file", f)}.values():
            target.abs_src_path = str(copy)
    return files


def with_plotly(html: str, page_url: str) -> str:
    """``html`` with a ``<script>`` that loads the site's plotly.js in its head when it holds a plotly figure."""
    if FIGURE_MARK not in html or "</head>" not in html:
        return html
    from mkdocs.utils import get_relative_url

    src = get_relative_url(PLOTLY_JS, page_url or ".")
    return html.replace("</head>", f'<script src="{src}" charset="utf-8"></script>\n</head>', 1)


def on_post_page(output, page, config, **kwargs):
    return with_plotly(output, page.url)


def on_post_build(config, **kwargs):
    js = plotly_js()
    if js is None:
        log.warning("plotly is not installed: the tutorial figures will not draw")
        return
    dest = Path(config["site_dir"]) / PLOTLY_JS
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(js, dest)
