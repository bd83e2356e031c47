"""The figures of the reproduction pages and the gallery (scripts/reproduction_figures.py): every reproduction page
shows its figures (or says its result is a table), every embedded figure and linked file exists, every figure
loads the site's one plotly.js, the gallery names code that exists, and the committed figures are what the script
draws from the committed data."""
from __future__ import annotations

import importlib
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted((DOCS / "reproductions").glob("*.md"))
FIGURES = DOCS / "reproductions" / "figures"
GALLERY = DOCS / "gallery.md"
#: pages whose result is a table: their command draws no figure
TABLE_ONLY = {"kernels", "llamacpp-exports"}
IFRAME = re.compile(r'<iframe\b[^>]*\bsrc="([^"]+)"')
LINK = re.compile(r"\]\(((?:figures|data|reproductions/figures|reproductions/data)/[^)\s]+)\)")


def _script():
    spec = importlib.util.spec_from_file_location("reproduction_figures", ROOT / "scripts" / "reproduction_figures.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _results(page: Path) -> str:
    text = page.read_text(encoding="utf-8")
    m = re.search(r"^## Results\n(.*?)(?=^## )", text, flags=re.S | re.M)
    assert m, f"expected a Results section in {page.name}"
    return m.group(1)


def _built_target(page: Path, src: str) -> Path:
    """The file an iframe's ``src`` names: relative to the page's built URL, ``<page without .md>/``."""
    url_dir = page.relative_to(DOCS).with_suffix("")
    if url_dir.name == "index":
        url_dir = url_dir.parent
    return (DOCS / url_dir / src).resolve()


def test_the_pages_are_all_checked():
    assert len(PAGES) >= 15
    assert TABLE_ONLY <= {p.stem for p in PAGES}


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_each_reproduction_page_shows_its_figures_or_a_table(page):
    results = _results(page)
    srcs = IFRAME.findall(results)
    if page.stem in TABLE_ONLY:
        assert re.search(r"^\|[- |:]+\|$", results, flags=re.M), f"expected a table in {page.name}'s Results"
        assert "no figure" in results, f"expected {page.name} to say that its result is a table"
        return
    assert srcs, f"expected at least one figure (an <iframe>) in {page.name}'s Results"
    for src in srcs:
        target = _built_target(page, src)
        assert target.is_file(), f"{page.name} embeds {src}, which is not a file ({target})"
        assert target.parent == FIGURES.resolve()
        assert f"(figures/{target.name})" in results, f"expected {page.name} to link {target.name} as well"
    assert re.search(r"[Ff]igures? from\s+(`|the Python)", results), \
        f"expected {page.name} to say what made its figures"
    for rel in LINK.findall(results):
        assert (page.parent / rel).is_file(), f"{page.name} links {rel}, which does not exist"


def test_figures_load_the_sites_one_plotly_js():
    """Each figure loads the plotly.js the build copies into the site (docs/hooks/notebooks.py), none its own."""
    spec = importlib.util.spec_from_file_location("steerkit_docs_notebooks", DOCS / "hooks" / "notebooks.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    site_js = (Path("/site/reproductions/figures") / "../../" / hook.PLOTLY_JS).resolve()
    pages = sorted(FIGURES.glob("*.html"))
    assert pages
    for p in pages:
        text = p.read_text(encoding="utf-8")
        src = re.findall(r'<script charset="utf-8" src="([^"]+)"></script>', text)
        assert len(src) == 1, p.name
        assert (Path("/site/reproductions/figures") / src[0]).resolve() == site_js, (p.name, src)
        assert p.stat().st_size < 200_000, f"{p.name} is {p.stat().st_size} bytes: plotly.js embedded?"
    assert list(FIGURES.glob("*.js")) == []


def test_every_committed_figure_is_drawn_by_the_script():
    R = _script()
    stems = {f.stem for f in R.ALL}
    assert len(stems) == len(R.ALL), "two figures share a stem"
    committed = {p.stem for p in FIGURES.glob("*.html")}
    assert committed == {f.stem for f in R.available()}, "committed figures differ from the script's list"
    assert {f.stem for f in R.available()} == stems, "some figures' data is not committed"


def test_gallery_names_code_that_exists():
    R = _script()
    text = GALLERY.read_text(encoding="utf-8")
    srcs = IFRAME.findall(text)
    assert len(srcs) >= 25
    for src in srcs:
        assert _built_target(GALLERY, src).is_file(), src
    for rel in LINK.findall(text):
        assert (DOCS / rel).is_file(), rel
    refs = re.findall(r"\]\[(steerkit\.[\w.]+)\]", text)
    assert len(refs) == len(srcs), "expected one link to the API reference per figure"
    for ref in refs:  # each reference names an object that exists
        module, _, attr = ref.rpartition(".")
        obj = None
        while module:
            try:
                obj = importlib.import_module(module)
                break
            except ImportError:
                module, _, more = module.rpartition(".")
                attr = f"{more}.{attr}"
        assert obj is not None, ref
        for part in attr.split("."):
            obj = getattr(obj, part)
        assert callable(obj), ref
    for stem in (src.rsplit("/", 1)[1].removesuffix(".html") for src in srcs):
        path, fn = R.BY_STEM[stem].code.split(":")
        assert re.search(rf"^\s*def {fn}\(", (ROOT / path).read_text(encoding="utf-8"), flags=re.M), \
            f"expected {path} to define {fn} (the gallery's {stem})"
        assert f"`{path}`" in text


def test_data_is_compact_json():
    R = _script()
    assert R.compact({"a": [1.23456789, float("nan")], "b": "x", "c": 3}) == {"a": [1.23457, None], "b": "x", "c": 3}
    for p in (DOCS / "reproductions" / "data").glob("*.json"):
        json.loads(p.read_text(encoding="utf-8"))
        assert p.stat().st_size < 200_000, f"{p.name}: {p.stat().st_size} bytes"


def test_the_figures_and_the_gallery_are_current():
    """A redraw from the committed data gives the committed figures and gallery page, byte for byte."""
    pytest.importorskip("plotly")
    R = _script()
    stale = R.redraw(check=True)
    assert stale == [], f"run: .venv/bin/python scripts/reproduction_figures.py (figures differ: {stale})"
    assert GALLERY.read_text(encoding="utf-8") == R.gallery_page(), \
        "run: .venv/bin/python scripts/reproduction_figures.py"


def test_a_figure_redraws_from_its_data(tmp_path):
    pytest.importorskip("plotly")
    R = _script()
    f = R.BY_STEM["induction_scores"]
    written = R.redraw([f], folder=tmp_path)
    assert written == ["induction_scores"]
    assert (tmp_path / "induction_scores.html").read_text(encoding="utf-8") == \
        (FIGURES / "induction_scores.html").read_text(encoding="utf-8")
