"""The Tune page without a browser: its figures, readers, bounds and callbacks.

Figures and readers are checked on a tune result written by hand (``RESULT``, the schema of
``steerkit.probes.tune.TuneResult.to_json``); the computation on a tiny random model (against one
call of ``steerkit.probes.tune.tune``); the callbacks through Flask's test client on an app over the
tiny model, a store holding a vector of it and a results folder with a saved tune, a symbolic link,
a FIFO and a file outside (the helpers of tests/apps/test_app_security.py).
"""
from __future__ import annotations

import copy
import json
import os
import time

import pytest

pytest.importorskip("plotly", reason="the app extra (plotly, dash) is not installed")
pytest.importorskip("dash", reason="the app extra (plotly, dash) is not installed")

import torch  # noqa: E402

from steerkit.apps import analysis, figures  # noqa: E402
from steerkit.apps import data as limits  # noqa: E402
from steerkit.apps import io as saved  # noqa: E402
from steerkit.apps.analysis import Cancelled  # noqa: E402
from steerkit.errors import InputError  # noqa: E402
from steerkit.probes.tune import TuneResult, heatmap_figure, tradeoff_figure, tune  # noqa: E402
from dash_requests import callback_key, callbacks_of, fuzz_callbacks, post, run_page, text_of  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def _cell(layer, scale, concept, kl, ppl, rep, pareto, gens):
    return {"layer": layer, "scale": scale, "concept": concept, "concept_ci": [concept - 0.1, concept + 0.1],
            "scores": [concept, concept], "perplexity": ppl, "ppl_ratio": ppl / 5.0, "kl": kl, "repetition": rep,
            "pareto": pareto, "generations": gens}


#: a tune result written by hand: 2 layers x 3 scales on 2 prompts; layer 2 at scale 2 is recommended
RESULT = {
    "format": "steerkit.tune/1", "layers": [1, 2], "scales": [0.0, 2.0, 4.0],
    "prompts": ["Tell me about your weekend.", "Describe a good breakfast."], "neutral": ["What is 2+2?"],
    "baseline": {"generations": ["I went hiking.", "Eggs and toast."], "concept": 0.0, "concept_ci": [0.0, 0.0],
                 "scores": [0.0, 0.0], "perplexity": 5.0, "repetition": 0.0},
    "cells": [
        _cell(1, 0.0, 0.0, 0.0, 5.0, 0.0, True, ["I went hiking.", "Eggs and toast."]),
        _cell(1, 2.0, 0.5, 0.3, 6.0, 0.0, False, ["A wedding in the hills.", "Toast at the wedding."]),
        _cell(1, 4.0, 0.5, 2.5, 9.0, 0.5, False, ["wedding wedding wedding", "love love love"]),
        _cell(2, 0.0, 0.0, 0.0, 5.0, 0.0, True, ["I went hiking.", "Eggs and toast."]),
        _cell(2, 2.0, 1.0, 0.2, 5.5, 0.0, True, ["We danced at a wedding.", "Breakfast for the bride."]),
        _cell(2, 4.0, 1.0, 1.8, 8.0, 0.5, False, ["bride bride bride", "wedding wedding"]),
    ],
    "recommended": {"layer": 2, "scale": 2.0},
    "rule": {"objective": "concept", "max_kl": 1.0, "max_ppl_ratio": 1.5, "max_repetition": 0.25},
    "concept_kind": "substring",
    "settings": {"artifact": "hand-made", "model": "none", "max_new_tokens": 8},
}


def result():
    return copy.deepcopy(RESULT)


# ------------------------------------------------------------------ figures (the probes package's) and app helpers
def test_the_hand_made_result_is_a_tune_document():
    res = TuneResult.from_json(result())
    assert res.recommended == {"layer": 2, "scale": 2.0} and len(res.front) == 3
    assert saved.check_tune(result()) == RESULT


def test_tradeoff_and_heatmap_figures_of_the_result():
    fig = tradeoff_figure(result(), damage="kl")
    names = [t.name for t in fig.data]
    assert names == ["layer 1", "layer 2", "Pareto front", "recommended"]
    line = fig.data[1]
    assert list(line.x) == [0.0, 0.2, 1.8] and list(line.y) == [0.0, 1.0, 1.0]
    assert [c[0] for c in line.customdata] == [0.0, 2.0, 4.0]  # the scale of each point
    rec = fig.data[3]
    assert list(rec.x) == [0.2] and list(rec.y) == [1.0]
    heat = heatmap_figure(result(), "concept")
    assert [list(r) for r in heat.data[0].z] == [[0.0, 0.5, 0.5], [0.0, 1.0, 1.0]]
    assert list(heat.data[0].x) == ["0", "2", "4"] and list(heat.data[0].y) == ["L1", "L2"]
    assert heat.data[1].name == "recommended" and list(heat.data[1].x) == ["2"] and list(heat.data[1].y) == ["L2"]


def test_the_selection_is_outlined_on_both_figures():
    res = result()
    heat = figures.mark_tune_heatmap(heatmap_figure(res, "kl"), res, 1, 4.0)
    assert [(s.x0, s.x1, s.y0, s.y1) for s in heat.layout.shapes] == [(1.5, 2.5, -0.5, 0.5)]
    assert not figures.mark_tune_heatmap(heatmap_figure(res, "kl"), res, 7, 4.0).layout.shapes
    curves = figures.mark_tune_tradeoff(tradeoff_figure(res, damage="perplexity"), res, 1, 2.0, "perplexity")
    sel = curves.data[-1]
    assert sel.name == "selected" and list(sel.x) == [6.0] and list(sel.y) == [0.5]


def test_clicked_points_name_their_cell():
    res = result()
    assert figures.tune_point(res, {"x": "4", "y": "L1", "z": 2.5}) == (1, 4.0)  # a heatmap cell
    # a point of the layer 1 line (its scale in customdata), and the same cell's Pareto / star markers by value
    assert figures.tune_point(res, {"x": 0.3, "y": 0.5, "customdata": [2.0, 0.3, 6.0, 0.0]}) == (1, 2.0)
    assert figures.tune_point(res, {"x": 0.2, "y": 1.0}) == (2, 2.0)
    assert figures.tune_point(res, {"x": 5.5, "y": 1.0}, "perplexity") == (2, 2.0)
    for junk in (None, "x", {}, {"x": "9", "y": "L1"}, {"x": "2", "y": "L9"}, {"x": "2", "y": "Lx"},
                 {"x": 0.25, "y": 1.0}, {"x": True, "y": False}, {"x": [1], "y": {"a": 1}},
                 {"x": "2", "y": "L" + "9" * 5000}, {"x": float("nan"), "y": 1.0, "customdata": [float("inf")]}):
        assert figures.tune_point(res, junk) is None, junk


def test_rows_put_each_prompt_next_to_the_baseline():
    rows = figures.tune_rows(result(), 2, 2.0)
    assert rows == [{"prompt": "Tell me about your weekend.", "baseline": "I went hiking.",
                     "steered": "We danced at a wedding."},
                    {"prompt": "Describe a good breakfast.", "baseline": "Eggs and toast.",
                     "steered": "Breakfast for the bride."}]
    assert figures.tune_rows(result(), 3, 2.0) == []
    assert saved.tune_cell(result(), 2, 2)["kl"] == 0.2 and saved.tune_cell(result(), 2, True) is None


def test_tune_figures_download_as_standalone_html(tmp_path):
    for fig in (tradeoff_figure(result()), heatmap_figure(result(), "repetition")):
        page = figures.to_html(fig, tmp_path / "f.html")
        assert "<html" in page and "plotly" in page.lower()


def test_the_page_has_its_graphs_downloads_and_bounds_in_view():
    from steerkit.apps import layout
    assert ("/tune", "Tune") in layout.PAGES
    assert layout.FIGURES["tune-tradeoff"] == "tune_tradeoff" and layout.FIGURES["tune-heatmap"] == "tune_heatmap"

    def walk(c):
        yield c
        kids = getattr(c, "children", None)
        for k in kids if isinstance(kids, list) else [kids] if kids is not None and not isinstance(kids, str) else []:
            yield from walk(k)
    comps = list(walk(layout.tune_page()))
    ids = {getattr(c, "id", None) for c in comps}
    assert {"tune-artifact", "tune-layers", "tune-scales", "tune-max", "tune-prompts", "tune-neutral", "tune-run",
            "tune-cancel", "tune-progress", "tune-file", "tune-load", "tune-tradeoff", "tune-heatmap",
            "dl-tune-tradeoff", "dl-tune-heatmap", "tune-damage", "tune-metric", "tune-table", "tune-save"} <= ids
    text = " ".join(c for c in comps if isinstance(c, str)) + " ".join(
        getattr(c, "children", "") for c in comps if isinstance(getattr(c, "children", None), str))
    assert f"at most {limits.MAX_TUNE_LAYERS} layers x {limits.MAX_TUNE_SCALES} scales" in text
    assert f"{limits.MAX_TUNE_PROMPTS} prompts" in text and f"{limits.MAX_TUNE_NEW_TOKENS} new tokens" in text


# ------------------------------------------------------------------ bounds of the grid and of a saved result
def test_grid_inputs_are_bounded_with_clear_messages():
    assert limits.parse_scales("8, 0, 2") == [0.0, 2.0, 8.0]
    with pytest.raises(InputError, match="at most 8 scales, found 9"):
        limits.parse_scales(",".join(map(str, range(9))))
    with pytest.raises(InputError, match="found 'inf'"):
        limits.parse_scales("1, inf")
    with pytest.raises(InputError, match="found '1e9'"):
        limits.parse_scales("1e9")
    with pytest.raises(InputError, match="found nothing"):
        limits.parse_scales(" ")
    with pytest.raises(InputError, match="at most 8 layers for a tune, found 9"):
        limits.tune_layers("0-8", 30)
    with pytest.raises(InputError, match="expected layers below 30"):
        limits.tune_layers("30", 30)
    assert limits.tune_prompts("a\nb") == ["a", "b"]
    with pytest.raises(InputError, match="at most 32 prompts in the prompts of a tune, found 33"):
        limits.tune_prompts("\n".join(f"p{i}" for i in range(33)))
    with pytest.raises(InputError, match="prompts of at most 1000 characters in the prompts of a tune, found 1001 in prompt 2"):
        limits.tune_prompts("ok\n" + "x" * 1001)
    with pytest.raises(InputError, match="at least one of the prompts"):
        limits.tune_prompts("")
    with pytest.raises(InputError, match="as text, found list"):
        limits.tune_prompts(["a"])
    with pytest.raises(InputError, match="at most 4000 characters"):
        limits.tune_words("w," * 2001)


@pytest.mark.parametrize("change, message", [
    (lambda r: r.pop("format"), "format 'steerkit.tune/1'"),
    (lambda r: r.pop("cells"), "found no cells"),
    (lambda r: r.update(layers=list(range(limits.MAX_TUNE_RESULT_LAYERS + 1))), "'layers' as 1 to 128 layer numbers"),
    (lambda r: r.update(scales=[1.0, float("nan")]), "finite scales"),
    (lambda r: r.update(scales=["1"]), "expected a scale as a number"),
    (lambda r: r["baseline"].update(generations=["one"]), "the baseline's generations as a list of 2 texts"),
    (lambda r: r["cells"][0].update(generations=["x" * (limits.MAX_TUNE_GENERATION_CHARS + 1), "y"]),
     "at most 20000 characters"),
    (lambda r: r["cells"][1].update(layer=5), "found a cell at layer 5, scale 2.0"),
    (lambda r: r["cells"][1].update(scale=0.0), "found layer 1, scale 0.0 twice"),
    (lambda r: r["cells"][1].update(kl="big"), "the cell's kl as a number"),
    (lambda r: r["cells"][1].update(concept_ci=[0.1]), "concept_ci as [low, high]"),
    (lambda r: r["cells"][1].update(concept=None), "concept as a finite number"),
    (lambda r: r["cells"][1].update(pareto="yes"), "'pareto' as true or false"),
    (lambda r: r.update(cells=r["cells"] * 2), "'cells' as 1 to 6 objects"),
    (lambda r: r.update(recommended={"layer": 9, "scale": 2.0}), "'recommended' as the layer and scale"),
])
def test_a_saved_result_is_checked_before_anything_is_drawn(change, message):
    bad = result()
    change(bad)
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("(", r"\(")):
        saved.check_tune(bad)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tune")
    results, store, cache, outside = root / "results", root / "store", root / "cache", root / "outside"
    for d in (results, outside, results / "sub"):
        d.mkdir()
    (results / "sub" / "hand_tune.json").write_text(json.dumps(RESULT))
    (results / "broken_tune.json").write_text("{not json")
    (outside / "secret_tune.json").write_text(json.dumps(RESULT))
    os.symlink(outside / "secret_tune.json", results / "link_tune.json")
    os.symlink(outside, results / "linkdir")
    os.mkfifo(results / "fifo_tune.json")
    os.symlink("/dev/zero", results / "zero_tune.json")
    return {"root": root, "results": results, "store": store, "cache": cache, "outside": outside}


NOT_A_RESULT = str(saved.not_a_result("tune result"))


def test_saved_results_are_read_only_through_the_folder(folders):
    res = folders["results"]
    assert saved.scan_tunes(res) == ["broken_tune.json", "sub/hand_tune.json"]  # regular files only
    assert saved.read_tune(res, "sub/hand_tune.json") == RESULT
    for name in ("link_tune.json", "linkdir/secret_tune.json", "fifo_tune.json", "zero_tune.json",
                 "../outside/secret_tune.json", str(folders["outside"] / "secret_tune.json"), "sub/../../outside/x_tune.json",
                 "missing_tune.json", "/dev/zero", "sub/hand.json", 7, None, "x" * 2000):
        t = time.monotonic()
        with pytest.raises(saved.NotAResult) as e:
            saved.read_tune(res, name)
        assert str(e.value) == NOT_A_RESULT and time.monotonic() - t < 2.0, name
    with pytest.raises(InputError, match="as JSON in broken_tune.json"):
        saved.read_tune(res, "broken_tune.json")
    with pytest.raises(OSError):  # the path reader confines the read to the file's folder: no link
        saved.load_tune(res / "link_tune.json")
    assert saved.load_tune(res / "sub" / "hand_tune.json")["recommended"] == {"layer": 2, "scale": 2.0}


# ------------------------------------------------------------------ the computation (tiny model)
TINY = {"num_hidden_layers": 3}


PROMPTS = ["Hi", "Tell me a joke"]
KW = dict(scales=[0.0, 4.0], concept=["the"], neutral=["Hello"], max_new_tokens=4, n_boot=50)


def test_layer_by_layer_equals_one_call_of_the_probes_function(tiny):
    v = torch.randn(tiny.d_model, generator=torch.Generator().manual_seed(0))
    want = tune(tiny, v, PROMPTS, layers=[0, 1, 2], progress=False, **KW).to_json()
    ticks = []
    run = analysis.tune_run(tiny, v, PROMPTS, layers=[0, 1, 2], progress=lambda d, t: ticks.append((d, t)), **KW)
    assert ticks == [(0, 3), (1, 3), (2, 3), (3, 3)] and not run.stopped_at_deadline
    got = run.result
    assert got["layers"] == want["layers"] == [0, 1, 2] and got["scales"] == want["scales"]
    assert got["baseline"]["generations"] == want["baseline"]["generations"]
    assert [(c["layer"], c["scale"]) for c in got["cells"]] == [(c["layer"], c["scale"]) for c in want["cells"]]
    for a, b in zip(got["cells"], want["cells"]):
        assert a["generations"] == b["generations"] and a["concept"] == b["concept"] and a["pareto"] == b["pareto"]
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-4, abs=1e-6)
    assert got["recommended"] == want["recommended"]
    assert saved.check_tune(json.loads(json.dumps(got))) is not None  # what the app saves, it can read


def test_the_computation_cancels_and_stops_at_the_deadline(tiny):
    v = torch.ones(tiny.d_model)
    calls = []
    with pytest.raises(Cancelled):
        analysis.tune_run(tiny, v, PROMPTS, layers=[0, 1, 2], should_stop=lambda: calls.append(1) or len(calls) > 1,
                          **KW)
    run = analysis.tune_run(tiny, v, PROMPTS, layers=[0, 1, 2], deadline=0.0, **KW)
    assert run.stopped_at_deadline and run.result["layers"] == [0] and run.layers_requested == [0, 1, 2]
    assert len(run.result["cells"]) == 2


# ------------------------------------------------------------------ the callbacks (Flask test client)
@pytest.fixture(scope="module")
def app(tiny, folders):
    from steerkit.apps.app import create_app
    from steerkit.vectors import SteeringVector, Store
    v = torch.randn(tiny.d_model, generator=torch.Generator().manual_seed(1))
    Store(folders["store"]).save("tiny-dir", SteeringVector.from_direction(v, 1, tiny, method="test"))
    return create_app(tiny, store=str(folders["store"]), results=str(folders["results"]),
                      cache_dir=str(folders["cache"]), port=8050, deadline=30.0)



GOOD = {"tune-run.n_clicks": 1, "tune-artifact.value": "tiny-dir@1", "tune-layers.value": "1-2",
        "tune-scales.value": "0, 4", "tune-max.value": 3, "tune-normalize.value": "none",
        "tune-prompts.value": "Hi\nTell me a joke", "tune-neutral.value": "Hello", "tune-concept-kind.value": "words",
        "tune-words.value": "the, a", "tune-absent.value": "", "tune-probe.value": None}


def run_tune(app, client, **changes):
    return run_page(app, client, "tune", GOOD, changes)


def key_of(r):
    return r.get_json()["response"]["tune-key"]["data"]


def select(app, client, key, changed="tune-key.data", **clicks):
    vals = {"tune-key.data": key, "tune-damage.value": "kl", "tune-tradeoff.clickData": clicks.get("curves"),
            "tune-heatmap.clickData": clicks.get("heatmap")}
    return post(client, app, callback_key(app, "tune-cell.data"), vals, changed=changed)


def table(app, client, key, cell):
    r = post(client, app, callback_key(app, "tune-table.data"), {"tune-cell.data": cell, "tune-key.data": key})
    assert r.status_code == 200
    return r.get_json()["response"]["tune-table"]["data"], text_of(r)


def test_a_tune_runs_draws_and_shows_a_cells_generations(app, client):
    r = run_tune(app, client)
    msg = text_of(r)
    assert "tiny-dir@1: 2 layers × 2 scales on 2 prompts" in msg and "computed in" in msg, msg[:400]
    key = key_of(r)
    run = app.steerkit_env.host.result(key["key"])
    assert run.result["layers"] == [1, 2] and len(run.result["cells"]) == 4
    # the first selection is the recommended cell (or the first of the front)
    cell = select(app, client, key).get_json()["response"]["tune-cell"]["data"]
    first = run.result["recommended"] or next(c for c in run.result["cells"] if c["pareto"])
    assert (cell["layer"], cell["scale"]) == (first["layer"], first["scale"])
    # both figures are the probes package's, with the selection outlined
    r = post(client, app, callback_key(app, "tune-tradeoff.figure"), {"tune-key.data": key, "tune-cell.data": cell,
                                                                "tune-damage.value": "kl", "tune-metric.value": "kl"})
    figs = r.get_json()["response"]
    names = [t.get("name") for t in figs["tune-tradeoff"]["figure"]["data"]]
    assert names[:2] == ["layer 1", "layer 2"] and "selected" in names
    assert figs["tune-heatmap"]["figure"]["data"][0]["type"] == "heatmap"
    assert len(figs["tune-heatmap"]["figure"]["layout"]["shapes"]) == 1
    # a click on the heatmap cell (layer 2, scale 4) selects it; its table is prompt | baseline | steered
    r = select(app, client, key, changed="tune-heatmap.clickData", heatmap={"points": [{"x": "4", "y": "L2"}]})
    cell = r.get_json()["response"]["tune-cell"]["data"]
    assert (cell["layer"], cell["scale"]) == (2, 4.0)
    rows, msg = table(app, client, key, cell)
    want = next(c for c in run.result["cells"] if (c["layer"], c["scale"]) == (2, 4.0))
    assert [r["prompt"] for r in rows] == ["Hi", "Tell me a joke"]
    assert [r["baseline"] for r in rows] == run.result["baseline"]["generations"]
    assert [r["steered"] for r in rows] == want["generations"]
    assert "Layer 2, scale 4" in msg and f"KL {want['kl']:.3g}" in msg
    # the same settings again come from the cache
    assert "from the cache" in text_of(run_tune(app, client))


@pytest.mark.parametrize("field, value, message", [
    ("layers", "0-2,1", None),  # fine: 3 layers
    ("layers", "0,1,2,3", "expected layers below 3"),
    ("layers", "x" * (limits.MAX_FIELD_CHARS + 1), f"at most {limits.MAX_FIELD_CHARS} characters"),
    ("scales", ",".join(map(str, range(9))), "at most 8 scales, found 9"),
    ("scales", "1, nan", "finite numbers"),
    ("scales", ["1"], "the scales as text"),
    ("max", limits.MAX_TUNE_NEW_TOKENS + 1, "a number of new tokens from 1 to 64"),
    ("max", "8", "a number of new tokens from 1 to 64"),
    ("prompts", "\n".join(f"p{i}" for i in range(33)), "at most 32 prompts in the prompts of a tune, found 33"),
    ("prompts", "x" * 1001, "prompts of at most 1000 characters in the prompts of a tune, found 1001"),
    ("prompts", "", "expected at least one of the prompts"),
    ("prompts", "A" * 300_000, "characters in the prompts, found 300000"),
    ("neutral", "\n".join(f"n{i}" for i in range(33)), "at most 32 prompts in the neutral prompts of a tune"),
    ("normalize", "loud", "expected what a scale is in"),
    ("concept_kind", "vibes", "expected what scores the concept in"),
    ("words", "", "expected words that show the concept"),
    ("words", "w," * 3000, "at most 4000 characters"),
    ("concept_kind", "probe", "expected a probe from the store, found none"),
    ("artifact", "../../etc/passwd", "expected"),
    ("artifact", None, "expected a direction from the store, found none"),
    ("artifact", {"ref": 1}, "expected a direction as text"),
])
def test_tune_request_values_are_bounded(app, client, field, value, message):
    t = time.monotonic()
    r = run_tune(app, client, **{field: value})
    msg = text_of(r)
    if message is None:
        assert "3 layers × 2 scales" in msg, msg[:400]
    else:
        assert message in msg, msg[:400]
        assert "tune-key" not in r.get_json().get("response", {}) and "Traceback" not in msg
    assert time.monotonic() - t < 60


def test_a_probe_slot_naming_a_vector_is_refused(app, client):
    msg = text_of(run_tune(app, client, concept_kind="probe", probe="tiny-dir@1"))
    assert "expected a probe (probe), found a steering_vector (tiny-dir@1)" in msg


def test_the_tune_time_limit_keeps_the_layers_it_has(app, client, monkeypatch):
    env = app.steerkit_env
    monkeypatch.setattr(env, "tune_deadline", 0.0)
    r = run_tune(app, client, layers="0-2", scales="0, 2")
    msg = text_of(r)
    assert "Stopped at the time limit of 0 s after 1 of 3 layers" in msg, msg[:400]
    run = env.host.result(key_of(r)["key"])
    assert run.stopped_at_deadline and run.result["layers"] == [0]
    r = post(client, app, callback_key(app, "tune-tradeoff.figure"), {"tune-key.data": key_of(r), "tune-damage.value": "kl",
                                                                "tune-metric.value": "concept"})
    assert "stopped at the time limit" in text_of(r)
    monkeypatch.setattr(env, "tune_deadline", 600.0)  # the same settings again are computed again
    assert "computed in" in text_of(run_tune(app, client, layers="0-2", scales="0, 2"))


def load(app, client, value, changed="tune-file.value"):
    key = next(k for k, v in app.callback_map.items() if "tune-file-status.children" in k)
    return post(client, app, key, {"tune-file.value": value, "tune-load.n_clicks": 1}, changed=changed)


def test_a_saved_result_loads_and_outside_names_get_one_message(app, client, folders):
    r = post(client, app, callback_key(app, "tune-file.options"), {"url.pathname": "/tune"})
    assert [o["value"] for o in r.get_json()["response"]["tune-file"]["options"]] == ["broken_tune.json",
                                                                                      "sub/hand_tune.json"]
    r = load(app, client, "sub/hand_tune.json")
    assert "sub/hand_tune.json: 2 layers × 3 scales on 2 prompts (substring concept); recommended: layer 2, scale 2." \
        in text_of(r), text_of(r)[:400]
    key = r.get_json()["response"]["tune-key"]["data"]
    cell = select(app, client, key).get_json()["response"]["tune-cell"]["data"]
    assert (cell["layer"], cell["scale"]) == (2, 2.0)
    rows, msg = table(app, client, key, cell)
    assert rows[0] == {"prompt": "Tell me about your weekend.", "baseline": "I went hiking.",
                       "steered": "We danced at a wedding."}
    assert "recommended, on the Pareto front" in msg
    # a click on the trade-off curve of layer 1 at scale 4
    r = select(app, client, key, changed="tune-tradeoff.clickData",
               curves={"points": [{"x": 2.5, "y": 0.5, "customdata": [4.0, 2.5, 9.0, 0.5], "curveNumber": 0}]})
    assert r.get_json()["response"]["tune-cell"]["data"]["layer"] == 1
    for name in ("link_tune.json", "linkdir/secret_tune.json", "fifo_tune.json", "zero_tune.json",
                 "../outside/secret_tune.json", str(folders["outside"] / "secret_tune.json"), "/etc/passwd",
                 "missing_tune.json", ["sub/hand_tune.json"]):
        t = time.monotonic()
        r = load(app, client, name)
        assert r.status_code == 200 and NOT_A_RESULT in text_of(r), (name, text_of(r)[:300])
        assert time.monotonic() - t < 5
    assert "Pick a saved tune result" in text_of(load(app, client, None, changed="tune-load.n_clicks"))


def test_junk_selections_and_keys_change_nothing(app, client):
    key = load(app, client, "sub/hand_tune.json").get_json()["response"]["tune-key"]["data"]
    for click in (None, "x", {"points": []}, {"points": [{"x": "9", "y": "L1"}]}, {"points": [[1]]},
                  {"points": [{"x": {"a": 1}, "y": "L2"}]}):
        r = select(app, client, key, changed="tune-heatmap.clickData", heatmap=click)
        assert r.status_code == 204, (click, r.data[:200])  # PreventUpdate: the selection stays
    for cell in (None, {"layer": 2, "scale": 2.0, "key": "0" * 24}, {"layer": True, "scale": 2.0, "key": key["key"]},
                 {"layer": 2, "scale": "2", "key": key["key"]}, {"layer": 9, "scale": 2.0, "key": key["key"]}):
        rows, msg = table(app, client, key, cell)
        assert rows == [] and "Click a point or a cell" in msg
    r = post(client, app, callback_key(app, "tune-tradeoff.figure"), {"tune-key.data": {"key": "0" * 24}})
    assert "Run a tune or load a saved result" in text_of(r)
    r = post(client, app, callback_key(app, "tune-tradeoff.figure"), {"tune-key.data": key, "tune-damage.value": "loss",
                                                                "tune-metric.value": "kl"})
    assert "expected a damage axis in" in text_of(r)


def test_a_result_saves_into_the_results_folder_only(app, client, folders):
    key = load(app, client, "sub/hand_tune.json").get_json()["response"]["tune-key"]["data"]
    save = callback_key(app, "tune-save-status.children")
    for name in ("../outside/x", "/tmp/x", "a/b", "", ".hidden", "x" * 101, ["a"]):
        r = post(client, app, save, {"tune-save.n_clicks": 1, "tune-key.data": key, "tune-save-name.value": name})
        assert "expected a file name" in text_of(r) or "as text" in text_of(r), (name, text_of(r)[:200])
    assert sorted(p.name for p in folders["outside"].iterdir()) == ["secret_tune.json"]
    r = post(client, app, save, {"tune-save.n_clicks": 1, "tune-key.data": key, "tune-save-name.value": "copy"})
    assert "Saved copy_tune.json" in text_of(r)
    assert saved.read_tune(folders["results"], "copy_tune.json") == RESULT
    r = post(client, app, save, {"tune-save.n_clicks": 1, "tune-key.data": None, "tune-save-name.value": "copy"})
    assert "Run a tune or load one first" in text_of(r)


@pytest.mark.parametrize("headers", [{"Host": "evil.example:8050"},
                                     {"Host": "127.0.0.1:8050", "Origin": "http://evil.example"}])
def test_the_host_check_covers_the_tune_callbacks(app, client, headers, monkeypatch):
    called = []
    monkeypatch.setattr(analysis, "tune_run", lambda *a, **k: called.append(1))
    monkeypatch.setattr(saved, "read_tune", lambda *a, **k: called.append(1))
    for key, vals in ((callback_key(app, "tune-key.data"), GOOD),
                      (next(k for k in app.callback_map if "tune-file-status.children" in k),
                       {"tune-file.value": "sub/hand_tune.json"})):
        r = post(client, app, key, vals, headers=headers)
        assert r.status_code == 403
    assert not called


def test_fuzz_the_tune_callbacks(app, client, folders):
    """Random values for every input of the Tune page's callbacks: never a server error, never a
    traceback, nothing written outside the results folder."""
    keys = callbacks_of(app, "tune-")
    assert len(keys) >= 8
    before = sorted(p.name for p in folders["outside"].iterdir())
    fuzz_callbacks(app, client, keys, seconds=40, examples=150)
    assert sorted(p.name for p in folders["outside"].iterdir()) == before
