"""The steerkit snippets of docs/migrating.md run: every fenced ```python block that follows an HTML comment
``<!-- run -->`` is executed, in page order, in one namespace, on the embedded default model (the page shows
real outputs), inside a temporary working folder (the export snippets write files). The other libraries'
snippets (TransformerLens, nnsight, steering-vectors, repeng) are shown, not run: an unmarked ```python block
must not use steerkit, so none of steerkit's is left out by mistake."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "migrating.md"
MARK = "<!-- run -->"
FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def python_blocks(text: str) -> list[tuple[bool, str]]:
    """``(marked, code)`` for each fenced python block: marked when the line before the fence is ``MARK``."""
    out = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        out.append((before == MARK, m.group(1)))
    return out


def test_blocks_are_marked():
    blocks = python_blocks(PAGE.read_text(encoding="utf-8"))
    marked = [code for run, code in blocks if run]
    assert len(marked) >= 8, f"expected the page's steerkit snippets marked with {MARK}, found {len(marked)}"
    for run, code in blocks:
        if not run:
            assert not re.search(r"\bsteerkit\b|\bsm\.", code), (
                f"a steerkit snippet without {MARK} before its fence (mark it so the test runs it):\n{code}")


@pytest.mark.slow
def test_steerkit_snippets_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("STEERKIT_STORE", raising=False)
    ns: dict = {"__name__": "docs_migrating"}
    out = io.StringIO()
    sm = None
    try:
        for i, code in enumerate(c for run, c in python_blocks(PAGE.read_text(encoding="utf-8")) if run):
            with contextlib.redirect_stdout(out):
                try:
                    exec(compile(code, f"docs/migrating.md run block {i}", "exec"), ns)
                except Exception as e:
                    raise AssertionError(f"run block {i} of docs/migrating.md failed: {e!r}\n{code}") from e
            sm = ns.get("sm", sm)
            assert sm is None or sm.hook_count() == 0, f"run block {i} left hooks on the model:\n{code}"
    finally:
        if sm is not None:
            sm.reset()
    printed = out.getvalue()
    # the snippets' claims about shapes and results
    assert "(1, 14, 576) (1, 9, 14, 14)" in printed, printed
    assert "(30, 4, 576)" in printed and "True" in printed, printed
    res = ns["res"]
    assert res.axes == ("layer", "pos") and tuple(res.values.shape) == (3, 2)
    assert (res.normalized().values > 0.5).tolist() == [[True, False], [True, False], [False, True]]
    assert ns["ref"] == "happy@1"
    assert (tmp_path / "happy.gguf").is_file() and (tmp_path / "happy-repeng.gguf").is_file()
    assert sorted(ns["control"].layers) == list(range(10, 20))
