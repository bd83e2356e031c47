"""MkDocs hook: tutorial pages show executed outputs where a current executed copy exists.

The notebooks in docs/tutorials/ are stored without outputs and rendered by mkdocs-jupyter, which
does not execute them. ``tests/test_tutorials.py`` executes each one and writes the executed copy to
``build/tutorials-executed/<name>.ipynb``. For each tutorial notebook this hook points the page at
that copy when the copy's cells hold the same sources as the stored notebook (so a stale copy of an
edited notebook is never shown); otherwise the stored notebook is rendered as it is, without outputs.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXECUTED = ROOT / "build" / "tutorials-executed"

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


def on_files(files, config, **kwargs):
    for f in files:
        src = f.src_uri
        if not (src.startswith("tutorials/") and src.endswith(".ipynb")):
            continue
        copy = executed_copy(Path(f.abs_src_path))
        if copy is None:
            log.info("%s: no current executed copy in %s, rendered without outputs", src, EXECUTED)
            continue
        # mkdocs-jupyter wraps the File: point both the wrapper and the file it wraps at the copy
        for target in {id(f): f, id(getattr(f, "file", f)): getattr(f, "file", f)}.values():
            target.abs_src_path = str(copy)
    return files
