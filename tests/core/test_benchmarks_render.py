"""benchmarks/render.py on hand-made CSVs (tables, run facts stated once, targets with pass / fail,
figures), and every benchmark script's command line (a CSV path through --out, a --quick mode)."""
from __future__ import annotations

import ast
import csv
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if p.name not in ("_common.py", "render.py"))
FACTS = {"machine": "x86_64", "cpus": "2", "python": "3.11.7", "torch": "2.13.0+cpu", "transformers": "5.24.0",
         "commit": "abc1234"}


def _render_module():
    spec = importlib.util.spec_from_file_location("bench_render", BENCH / "render.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # the module's dataclass looks itself up there
    spec.loader.exec_module(mod)
    return mod


def _write(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


@pytest.fixture
def results(tmp_path):
    d = tmp_path / "results"
    d.mkdir()
    step = [("add", "0.41"), ("ablate", "3.4"), ("torch-ablate", "9.9"), ("base-2", "-0.2")]
    _write(d / "step_overhead.csv", [{"mode": "full", "batch": "1", "condition": c, "base_ms": "126.0",
                                      "overhead_pct": o, **FACTS} for c, o in step])
    _write(d / "record.csv", [{"mode": "quick", "prompts": "32", "batch": "16", "throughput_ratio": "0.95",
                                **FACTS, "record_s": "5.312999991234"}])
    # two commits: the commit column stays in the table, the other facts are stated once
    _write(d / "generation.csv", [
        {"library": "steerkit", "edit": "add", "batch": "1", "paired_overhead_pct": "1.5", **FACTS},
        {"library": "steerkit", "edit": "ablate", "batch": "8", "paired_overhead_pct": "2.9",
         **{**FACTS, "commit": "def5678"}},
        {"library": "nnsight", "edit": "ablate", "batch": "8", "paired_overhead_pct": "11.5", **FACTS}])
    _write(d / "refusal_paths.csv", [{"path": "float32", "cosine_with_float32": "1.0"},
                                     {"path": "int4", "cosine_with_float32": "0.78"}])
    return d


def _run(results: Path, out: Path, *extra: str) -> str:
    r = subprocess.run([sys.executable, str(BENCH / "render.py"), "--results", str(results), "--out", str(out),
                        *extra], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return out.read_text()


def _section(page: str, stem: str) -> str:
    m = re.search(rf"^## `{re.escape(stem)}\.csv`\n(.*?)(?=^## |\Z)", page, re.S | re.M)
    assert m, f"no section for {stem}.csv"
    return m.group(1)


def _table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in text.splitlines()
            if line.startswith("| ")]


def test_tables_and_facts(results, tmp_path):
    page = _run(results, tmp_path / "docs" / "benchmarks_data.md", "--no-figures")
    for stem in ("step_overhead", "record", "generation", "refusal_paths"):
        _section(page, stem)
    step = _section(page, "step_overhead")
    rows = _table_rows(step)
    assert rows[0] == ["mode", "batch", "condition", "base_ms", "overhead_pct"]  # facts are not columns
    assert [r[2] for r in rows[1:]] == ["add", "ablate", "torch-ablate", "base-2"]
    assert rows[2][4] == "3.4"
    assert step.count("torch 2.13.0+cpu") == 1 and step.count("`abc1234`") == 1
    assert "machine x86_64" in step and "CPUs 2" in step and "transformers 5.24.0" in step
    rec = _table_rows(_section(page, "record"))
    assert rec[0][-1] == "record_s" and rec[1][-1] == "5.313"  # long floats cut to 4 significant digits
    gen = _section(page, "generation")
    grows = _table_rows(gen)
    assert grows[0][-1] == "commit" and "torch" not in grows[0]
    assert [r[-1] for r in grows[1:]] == ["abc1234", "def5678", "abc1234"]
    assert gen.count("torch 2.13.0+cpu") == 1
    assert "Not recorded: machine, CPUs, Python, torch, transformers, commit." in _section(page, "refusal_paths")
    # only relative links
    links = re.findall(r"\]\(([^)]*)\)", page)
    assert links and all(not re.match(r"[a-z]+:|/", link) for link in links), links


def test_target_comparison(results, tmp_path):
    page = _run(results, tmp_path / "out.md", "--no-figures")
    bounds = page.split("## Stated bounds", 1)[1].split("\n## ", 1)[0]
    rows = _table_rows(bounds)
    assert rows[0] == ["metric", "bound", "measured", "worst row", "measured by", "stated in"]
    by_metric = {r[0]: r for r in rows[1:]}
    R = _render_module()
    assert set(by_metric) == set(R.TARGETS)
    step = by_metric[next(m for m, t in R.TARGETS.items() if t.csv == "step_overhead")]
    # torch-ablate (9.9) is not a steerkit condition: the worst of add / ablate is ablate at +3.40%
    assert step[1:4] == ["<= 3%", "+3.40%", "batch 1, condition ablate"]
    assert step[4] == "`step_overhead.csv` `overhead_pct`"
    rec = by_metric[next(m for m, t in R.TARGETS.items() if t.csv == "record")]
    assert rec[1:4] == [">= 0.9", "0.95", "prompts 32, batch 16 (quick run)"]
    gen = by_metric[next(m for m, t in R.TARGETS.items() if t.csv == "generation")]
    assert gen[2:4] == ["+2.90%", "edit ablate, batch 8"]  # nnsight's 11.5% is not steerkit's
    vllm = by_metric[next(m for m, t in R.TARGETS.items() if t.csv == "vllm")]
    assert vllm[2:4] == ["no data", "-"]
    assert "`overhead_pct` <= 3%; measured +3.40% (batch 1, condition ablate)" in _section(page, "step_overhead")
    assert not re.search(r"today|\*\*pass\*\*|\*\*FAIL\*\*|## Targets", page)  # a figure beside its bound, no verdict


def test_evaluate_direct():
    R = _render_module()
    t = R.Target("x", "ratio", ">=", 0.9, "x", "here", label=("b",))
    rows = [{"b": "1", "ratio": "0.95"}, {"b": "8", "ratio": "0.89"}, {"b": "16", "ratio": ""}]
    assert R.evaluate(t, rows) == {"status": "fail", "value": 0.89, "row": "b 8", "mode": ""}
    assert R.evaluate(t, rows[:1])["status"] == "pass"
    assert R.evaluate(t, rows[2:])["status"] == "no data"


def test_figures(results, tmp_path):
    pytest.importorskip("plotly")
    out = tmp_path / "docs" / "benchmarks_data.md"
    page = _run(results, out, "--figures", str(tmp_path / "docs" / "figs"))
    ext = "png" if importlib.util.find_spec("kaleido") else "html"
    for stem in ("step_overhead", "record", "generation", "refusal_paths"):
        f = tmp_path / "docs" / "figs" / f"{stem}.{ext}"
        assert f.is_file() and f.stat().st_size > 1000, f
        assert f"(figs/{stem}.{ext})" in _section(page, stem)
    if ext == "html":
        html = (tmp_path / "docs" / "figs" / "step_overhead.html").read_text()
        assert "step_overhead: overhead_pct" in html and "target " in html  # the title and the target line


def _options(path: Path) -> dict[str, ast.Call]:
    found = {}
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "add_argument":
            for a in n.args:
                if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("--"):
                    found[a.value] = n
    return found


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_has_out_and_quick(script):
    opts = _options(script)
    assert "--quick" in opts, f"{script.name} has no --quick option"
    assert "--out" in opts, f"{script.name} has no --out option for its CSV"
    src = script.read_text()
    assert "csv_rows" in src, f"{script.name} does not write its rows through _common.csv_rows"
    assert re.search(r'"results"', src) and ".csv" in src, f"{script.name} has no default CSV under results/"


def test_every_target_column_is_written_by_its_script():
    R = _render_module()
    for metric, t in R.TARGETS.items():
        script = ROOT / R.SOURCES[t.csv][0]
        src = script.read_text()
        assert f'"{t.column}"' in src, f"{metric}: {script.name} writes no column {t.column!r}"
