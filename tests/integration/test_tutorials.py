"""The tutorials in docs/tutorials/: stored without outputs, committed executed, rendered with outputs, and run
top to bottom on the embedded default model.

- Each notebook is stored without outputs; its executed copy, outputs and figures included, is committed in
  ``docs/tutorials/executed/`` and must be current: its cells' sources equal the notebook's (otherwise the
  site would show the notebook without outputs). ``scripts/execute_tutorials.py NAME`` refreshes a copy.
- The copies are small (well under 1 MB each) and their plotly figures carry no plotly.js: the site loads one
  plotly.js for every figure (``docs/hooks/notebooks.py``), which the rendered pages and the hook are checked
  for here.
- ``test_notebook_runs`` (slow) executes every notebook with nbclient in a kernel of this interpreter (the
  .venv), in a temporary directory (the repository's top-level ``kernels/`` folder must not shadow the
  ``kernels`` package that transformers imports), the Hugging Face hub offline. The notebooks read as
  narratives, with few asserts; the checks of what each one shows are in ``CHECKS`` below, run in the same
  kernel after the notebook's last cell (on the notebook's own variables). Any cell or check error fails the
  test. Each notebook's run time is recorded as the ``run_time_s`` property (``--junitxml``) and printed.
  With ``STEERKIT_WRITE_TUTORIALS=1`` a notebook that ran cleanly is also written as its executed copy.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
from html import unescape as html_unescape
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = ROOT / "docs" / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("*.ipynb"))
EXECUTED = TUTORIALS / "executed"
# per notebook: each is meant to run in a few minutes on 2 cores (a slower machine can raise it)
TIMEOUT_S = float(os.environ.get("STEERKIT_TUTORIAL_TIMEOUT", "600"))
MAX_COPY_BYTES = 1_000_000
REFRESH = ".venv/bin/python scripts/execute_tutorials.py"


def _module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


runner = _module("steerkit_execute_tutorials", ROOT / "scripts" / "execute_tutorials.py")


def _docs_hook():
    return _module("steerkit_docs_notebooks", ROOT / "docs" / "hooks" / "notebooks.py")


# ----------------------------------------------------------------------------- checks, per notebook
# Code run in the notebook's kernel after its last cell; each string is one check (a failing one names itself).
CHECKS: dict[str, list[str]] = {
    "01_record_find_steer": [
        "assert acts.shape == (sm.n_layers, len(happy) + len(sad), sm.d_model), acts.shape",
        "assert auroc(labels, proj.numpy()) >= 0.8, 'the direction separates the prompts it came from'",
        "assert all(b != s for b, s in zip(baseline, steered)), 'steering changes every greedy continuation'\n"
        "assert all(b != a for b, a in zip(baseline, anti))",
        "assert p_sad < p_happy, (p_sad, p_happy)",
        "assert diff_store < 1e-3, 'the stored artifact steers exactly like the edit it came from'",
        "assert roundtrip < 1e-5, 'the llama.cpp export reads back as written'",
        "if 'lc_steered' in globals():  # llama-cpp-python installed\n"
        "    assert lc_base != lc_steered, 'the control vector changes llama.cpp\\'s continuation'\n"
        "    assert agree >= 8, f'llama.cpp and steerkit agree on only {agree} steered tokens'",
        "assert sm.hook_count() == 0",
    ],
    "02_probe_sweep": [
        "assert best['auroc'] >= 0.95, best",
        "assert np.nanmax(grid[len(layers) // 2:]) >= 0.95, 'readable in the second half of the network'",
        "assert last[0] < 0.7, 'block 0 at the template token carries almost nothing'",
        "assert scores[0] > scores[1], 'the stored probe scores the positive review higher'",
    ],
    "03_refusal_direction": [
        "assert float(base['harmful'].mean()) > float(base['harmless'].mean())",
        "assert candidates.shape == (sm.n_layers, len(positions), sm.d_model)",
        "assert float((cache['blocks.20.hook_resid_post'].reshape(4, -1) @ u).abs().max()) < 1e-3, "
        "'nothing left along r after the ablation'",
        "assert best.status == 'selected' and best.bypass < base_val_h and best.induce > base_val_s, best",
        "assert float(scores['harmful, ablated'].mean()) < float(scores['harmful, baseline'].mean())\n"
        "assert float(scores['harmless, added'].mean()) > float(scores['harmless, baseline'].mean())",
        "assert result.selection.best.layer == best.layer and cos > 0.999, (result.selection.best, best, cos)",
        "m = result.metrics\n"
        "assert m['bypass'] < m['baseline_harmful_val'] and m['induce'] > m['baseline_harmless_val'], m\n"
        "rs = m['refusal_score']\n"
        "assert rs['harmful_test_ablated'] < rs['harmful_test_baseline'], rs\n"
        "assert rs['harmless_test_added'] > rs['harmless_test_baseline'], rs",
        "top = float(ablated[real].abs().max())\n"
        "assert err < 1e-4 * top, 'orthogonalised weights equal run-time ablation'\n"
        "assert effect > 1e-2 * top, 'and differ from the original model'",
    ],
    "04_patching": [
        "assert resid.clean_metric > 0 > resid.corrupted_metric, 'the model prefers the right name in both'",
        "assert int(v[0].argmax()) == s2 and float(v[0, s2]) > 0.5, 'S2 restores the most at block 0'\n"
        "assert float(v[0, [p for p in range(len(tokens)) if p not in differ]].abs().max()) < 1e-4",
        "assert float(v[-1, -1]) > 0.8 and float(v[-1, s2]) < 0.2, 'the information moved to the last position'",
        "assert top_value > 0.2, top_value",
        "assert r_z > 0.8, f'attribution patching agrees with activation patching on heads: r = {r_z}'",
        "assert lens.top_ids[-1, -1, 0] == int(logits.argmax()) == sm.tokenizer(' Mary')['input_ids'][0]\n"
        "assert float(p_mary[-1]) > float(p_mary[: sm.n_layers // 2].max())",
        "import torch\n"
        "assert torch.allclose(pattern.sum(-1), torch.ones(len(tokens)), atol=1e-4)\n"
        "assert order[0] in differ, 'the top head reads a name from the last position'",
    ],
    "05_serving_vllm": [
        "assert steered != plain, 'the steered request differs from the unsteered one'",
        "assert steered.strip() == reference.strip(), 'vLLM and steerkit give the same steered text'",
        "assert refused == 400 and again == plain, 'an unknown artifact is refused and the engine keeps serving'",
    ],
    "06_tuning": [
        "assert len(result.cells) == len(LAYERS) * 3",
        "assert all(result.cell(l, 0.0)['kl'] == 0.0 for l in LAYERS), 'scale 0 is the unsteered model'",
        "rec = result.recommended\n"
        "assert rec is None or (result.cell(rec['layer'], rec['scale'])['pareto'] "
        "and result.rule.admits(result.cell(rec['layer'], rec['scale'])))",
        "import json\nassert again.to_json() == json.loads(json.dumps(result.to_json()))",
    ],
    "07_conditional_steering": [
        "assert cv.report['f1'] >= 0.95 and cv.site == f'blocks.{cv.layer}.hook_resid_pre', cv.report['f1']",
        "assert confusion['f1'] >= 0.9 and confusion['accuracy'] >= 0.9, confusion",
        "assert sum(fired[:3]) >= 2 and not any(fired[3:]), fired",
        "for f, a, b in zip(fired, plain, steered):\n"
        "    assert (a != b) if f else (a == b), 'fired rows change, the others are exactly unsteered'",
        "assert decided == fired, (decided, fired)",
        "import torch\n"
        "changed = ((logits - sm.forward(prompts, chat=True)).flatten(1).abs().amax(1) > 0).tolist()\n"
        "assert changed == [not f for f in fired], (changed, fired)",
        "assert sm.hook_count() == 0",
    ],
    "08_bipo_vs_diffmean": [
        "assert len(r.history) == 4 and r.vector.provenance.method == 'bipo'",
        "assert float(v_bipo.norm()) > 0 and abs(float(v_dm.norm()) - float(v_bipo.norm())) < 1e-3",
        "assert all(m.shape == (len(held),) and bool(torch.isfinite(m).all()) for m in margins.values())",
        "assert float((margins['BiPO +v'] - margins['BiPO -v']).mean()) > 0, "
        "'+v favours the chosen completions more than -v'",
        "assert len(set(out)) > 1, 'the trained vector changes the generation'",
        "assert sm.hook_count() == 0",
    ],
    "09_backends": [
        "for n in names:\n"
        "    ref = records['hf'][n]\n"
        "    assert (records['nnsight'][n] - ref).abs().max() <= 1e-5, n\n"
        "    assert (records['tlens'][n] - ref).abs().max() <= 1e-4 * ref.abs().max(), n",
        "assert float((ours - theirs.to(ours.dtype)).abs().max()) <= 1e-4 * float(theirs.abs().max())",
        "assert float((edited['hf'] - plain)[real].abs().max()) > 1.0\n"
        "assert float((edited['nnsight'] - edited['hf'])[real].abs().max()) <= 1e-5\n"
        "assert float((edited['tlens'] - edited['hf'])[real].abs().max()) <= 1e-3 + 1e-4 * float(edited['hf'][real].abs().max())",
        "assert gens['tlens'] == gens['hf'] == gens['nnsight'], gens",
        "assert {n: sm.hook_count() for n, sm in models.items()} == hooks_at_rest",
        "weights = {t.data_ptr() for t in hf.hf_model.parameters()}\n"
        "for module in (tl.backend.bridge, nn.backend.model):\n"
        "    assert all(p.data_ptr() in weights for p in module.parameters())",
    ],
}


# ----------------------------------------------------------------------------- the stored notebooks
def test_there_are_tutorials():
    names = [p.stem for p in NOTEBOOKS]
    for n in ("01_record_find_steer", "02_probe_sweep", "03_refusal_direction", "04_patching", "06_tuning",
              "07_conditional_steering", "08_bipo_vs_diffmean", "09_backends"):
        assert n in names, f"expected {n}.ipynb in {TUTORIALS}, found {names}"
    assert set(CHECKS) >= set(names), f"expected checks for every notebook, found none for {set(names) - set(CHECKS)}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(str(path), as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{path.name}: expected code cells, found none"
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, (f"{path.name}: expected notebooks stored with outputs stripped, found outputs or execution "
                       f"counts in cells {dirty}; clear them (nbstripout, or 'Clear All Outputs') before saving, "
                       f"and refresh the executed copy with {REFRESH} {path.stem}")
    prose = [c for c in nb.cells if c.cell_type == "markdown"]
    assert len(prose) >= len(code) // 2, f"{path.name}: expected prose between the code cells, found {len(prose)}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_reads_as_a_narrative(path):
    """Checks belong in CHECKS, not in the tutorial: a few asserts at most."""
    nb = nbformat.read(str(path), as_version=4)
    asserts = sum(len(re.findall(r"^\s*assert\b", c.source, re.M)) for c in nb.cells if c.cell_type == "code")
    assert asserts <= 2, f"{path.name}: expected at most 2 asserts in the tutorial, found {asserts}; move them to CHECKS"


# ----------------------------------------------------------------------------- the committed executed copies
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_executed_copy_is_current(path):
    why = runner.stale(path)
    assert why is None, (f"{path.name}: the executed copy the site renders is stale ({why}); the site would show the "
                         f"notebook without outputs. Refresh it: {REFRESH} {path.stem}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_executed_copy_is_complete_and_small(path):
    copy = EXECUTED / path.name
    if not copy.is_file():
        pytest.fail(f"{path.name}: no executed copy {copy.relative_to(ROOT)}; write it with {REFRESH} {path.stem}")
    size = copy.stat().st_size
    assert size < MAX_COPY_BYTES, f"{copy.name}: expected an executed copy under {MAX_COPY_BYTES} bytes, found {size}"
    nb = nbformat.read(str(copy), as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    unrun = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.execution_count is None]
    assert not unrun, f"{copy.name}: expected every code cell executed, found cells {unrun} without a run"
    outputs = [o for c in code for o in c.outputs]
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, f"{copy.name}: expected no errors, found {[o.get('ename') for o in errors]}"
    assert any(o.output_type == "stream" and o.name == "stdout" for o in outputs), f"{copy.name}: no printed output"
    for o in outputs:
        data = o.get("data", {})
        assert runner.PLOTLY_MIME not in data, f"{copy.name}: expected figures as HTML, found plotly JSON"
        html = "".join(data.get("text/html", ""))
        if "plotly-graph-div" in html:
            assert "Plotly.newPlot" in html and "<script src" not in html and "plotly.js v" not in html and \
                len(html) < 300_000, f"{copy.name}: expected a figure without its own plotly.js"


def test_every_notebook_is_a_docs_page():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    index = (TUTORIALS / "index.md").read_text(encoding="utf-8")
    assert "mkdocs-jupyter" in nav, "expected the mkdocs-jupyter plugin in mkdocs.yml"
    assert "tutorials/executed/" in nav, "expected the executed copies excluded from the pages (exclude_docs)"
    for p in NOTEBOOKS:
        assert f"tutorials/{p.name}" in nav, f"expected {p.name} in the nav of mkdocs.yml (the Tutorials section)"
        assert f"({p.name})" in index, f"expected a link to {p.name} in docs/tutorials/index.md"


def test_docs_use_an_executed_copy_only_while_it_is_current(tmp_path, monkeypatch):
    hook = _docs_hook()
    assert hook.EXECUTED == EXECUTED == runner.EXECUTED
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


def test_stale_copy_is_reported_with_the_refresh_command(tmp_path, monkeypatch):
    stored = NOTEBOOKS[0]
    monkeypatch.setattr(runner, "EXECUTED", tmp_path)
    monkeypatch.setattr(runner, "ROOT", tmp_path.parent)
    assert "no executed copy" in runner.stale(stored)
    nb = json.loads(stored.read_text(encoding="utf-8"))
    (tmp_path / stored.name).write_text(json.dumps(nb), encoding="utf-8")
    assert runner.stale(stored) is None
    nb["cells"][-1]["source"] = "print('edited')"
    (tmp_path / stored.name).write_text(json.dumps(nb), encoding="utf-8")
    assert "differ" in runner.stale(stored)
    assert runner.main(["--check", stored.stem]) == 1


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_docs_render_the_executed_outputs(path):
    convert = pytest.importorskip("mkdocs_jupyter.convert", reason="the docs extra (mkdocs-jupyter)")
    copy = _docs_hook().executed_copy(path)
    assert copy is not None, f"{path.name}: no current executed copy; refresh it with {REFRESH} {path.stem}"
    html = html_unescape(convert.nb2html(str(copy)))
    nb = nbformat.read(str(copy), as_version=4)
    texts = [o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "stream"]
    line = next(t.strip().splitlines()[0] for t in texts if t.strip())
    assert 'class="jp-OutputArea' in html, f"{path.name}: expected output areas on the rendered page"
    assert line in html, f"{path.name}: expected the printed line {line!r} on the rendered page"
    figures = sum("plotly-graph-div" in "".join(o.get("data", {}).get("text/html", ""))
                  for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert html.count('class="plotly-graph-div"') == figures, f"{path.name}: expected every figure on the page"


def test_site_loads_one_plotly_js(tmp_path):
    hook = _docs_hook()
    js = hook.plotly_js()
    assert js is not None and js.stat().st_size > 1_000_000, "expected plotly.min.js in the installed plotly"
    page = '<html><head><title>t</title></head><body><div class="plotly-graph-div"></div></body></html>'
    out = hook.with_plotly(page, "tutorials/02_probe_sweep/")
    assert out.count("<script") == 1 and '<script src="../../assets/javascripts/plotly.min.js"' in out
    plain = "<html><head></head><body><p>no figure</p></body></html>"
    assert hook.with_plotly(plain, "concepts/") == plain, "pages without figures load no plotly.js"
    hook.on_post_build({"site_dir": str(tmp_path)})
    assert (tmp_path / hook.PLOTLY_JS).read_bytes() == js.read_bytes()


# ----------------------------------------------------------------------------- running them
@pytest.mark.slow
@pytest.mark.timeout(int(TIMEOUT_S) + 180)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, record_property):
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    if path.name in runner.NEEDS_VLLM:
        if not runner.VLLM_PY.exists():
            pytest.skip(f"no vLLM environment at {runner.VLLM_PY}: scripts/setup.sh creates it")
        pytest.importorskip("openai", reason="the serving tutorial queries vLLM with the openai client (test extra)")
    try:
        nb, elapsed = runner.execute(path, checks=CHECKS.get(path.stem, ()), timeout=TIMEOUT_S)
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{path.name}: a cell or a check failed:\n{e}", pytrace=False)
    record_property("run_time_s", round(elapsed, 1))
    print(f"\n{path.name}: {elapsed:.1f} s (slowest cells: {', '.join(runner.slowest_cells(nb))})")
    assert elapsed < TIMEOUT_S, f"{path.name}: expected a run under {TIMEOUT_S:.0f} s, took {elapsed:.0f} s"
    if os.environ.get("STEERKIT_WRITE_TUTORIALS") == "1":
        runner.write(nb, path)
