"""The data sets vendored under ``steerkit/data/`` (see its README for sources and licences)."""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Optional

from steerkit.errors import InputError


def read_jsonl(vendored: str, *, path=None, n: Optional[int] = None, offset: int = 0,
               what: str = "rows") -> list[dict]:
    """Rows ``offset .. offset + n`` of a vendored jsonl (``vendored``: a path under ``steerkit/data``,
    e.g. ``"reasoning/gsm8k_test_first300.jsonl"``), or of the file at ``path`` instead."""
    if path is None:
        text = (resources.files("steerkit") / "data" / vendored).read_text(encoding="utf-8")
    else:
        p = Path(path)
        if not p.is_file():
            raise InputError(f"expected a jsonl of {what} at {p}, found nothing there")
        text = p.read_text(encoding="utf-8")
    rows = []
    for i, line in enumerate(text.splitlines()):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise InputError(f"expected one JSON object per line in {path or vendored}, line {i + 1}: {e}") from None
    return rows[offset:] if n is None else rows[offset:offset + n]
