"""The Patching and Attention pages' figures and computations, without a browser.

Figures are checked on hand-made results (``steerkit.probes.PatchingResult`` filled by hand);
the computations on a tiny random model (against ``steerkit.probes.activation_patching`` called
directly) and, for the IOI default, on the embedded default model.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("plotly", reason="the app extra (plotly, dash) is not installed")
pytest.importorskip("dash", reason="the app extra (plotly, dash) is not installed")

import torch  # noqa: E402

from steerkit.apps import analysis, data, figures  # noqa: E402
from steerkit.apps.analysis import Cancelled  # noqa: E402
from steerkit.errors import InputError  # noqa: E402
from steerkit.probes import PatchingResult, activation_patching, attribution_patching, logit_diff_metric  # noqa: E402

TOKENS = ["When", " Mary", " and", " John", " to"]


def result(values, hook="resid_pre", method="activation", layers=None, heads=None, clean=4.0, corrupted=-2.0):
    v = torch.as_tensor(np.asarray(values, dtype=np.float32))
    return PatchingResult(values=v, hook=hook, method=method, layers=list(layers or range(v.shape[0])),
                          positions=list(range(len(TOKENS))), heads=heads, tokens=list(TOKENS), clean_metric=clean,
                          corrupted_metric=corrupted)


def hand_run(hook="resid_pre", attribution=True, n_layers=3):
    n_cols = 4 if hook == "z" else len(TOKENS)
    act = np.arange(n_layers * n_cols, dtype=float).reshape(n_layers, n_cols) - 2.0
    heads = list(range(4)) if hook == "z" else None
    run = analysis.PatchingRun(
        clean="clean", corrupted="corrupted", answer=" Mary", wrong=" John", hook=hook, tokens=list(TOKENS),
        corrupted_tokens=list(TOKENS), layers_requested=list(range(n_layers)),
        activation=result(act, hook, heads=heads),
        attribution=result(act / 2, hook, "attribution", heads=heads) if attribution else None)
    return run, act


# ------------------------------------------------------------------ figures (hand-made results)
def test_patching_run_figure_heatmaps_token_labels_and_one_colour_axis():
    run, act = hand_run()
    fig = figures.patching_run_figure(run, normalized=True)
    assert [t.type for t in fig.data] == ["heatmap", "heatmap"]
    a, b = fig.data
    np.testing.assert_allclose(np.array(a.z), (act - (-2.0)) / 6.0)  # (v - corrupted) / (clean - corrupted)
    np.testing.assert_allclose(np.array(b.z), (act / 2) / 6.0)  # attribution: a change, divided by the gap
    assert list(a.x) == list(range(5)) and list(a.y) == [0, 1, 2]
    assert a.coloraxis == b.coloraxis == "coloraxis" and fig.layout.coloraxis.cmid == 0
    assert fig.layout.coloraxis.cmax == -fig.layout.coloraxis.cmin >= 1.0
    assert list(fig.layout.xaxis.ticktext) == ["0 'When'", "1 ' Mary'", "2 ' and'", "3 ' John'", "4 ' to'"]
    assert fig.layout.yaxis.autorange == "reversed" and fig.layout.yaxis.title.text == "layer"
    assert list(fig.layout.yaxis.tickvals) == [0, 1, 2]  # whole layers only
    assert [x.text for x in fig.layout.annotations][:2] == ["activation patching", "attribution patching"]
    assert "logit(' Mary') − logit(' John')" in fig.layout.title.text
    assert a.customdata[1][3] == "3 ' John'"  # hover names the token
    assert not fig.layout.shapes
    fig = figures.patching_run_figure(run, selected=(2, 3))
    assert [(s.xref, s.x0, s.x1, s.y0, s.y1) for s in fig.layout.shapes] == [("x", 2.5, 3.5, 1.5, 2.5),
                                                                            ("x2", 2.5, 3.5, 1.5, 2.5)]


def test_raw_values_share_the_metric_units():
    run, act = hand_run()
    fig = figures.patching_run_figure(run, normalized=False)
    np.testing.assert_allclose(np.array(fig.data[0].z), act)
    np.testing.assert_allclose(np.array(fig.data[1].z), act / 2 - 2.0)  # corrupted metric + predicted change
    assert fig.layout.coloraxis.colorbar.title.text == "logit difference"


def test_head_grid_figure_and_activation_only():
    run, act = hand_run("z", attribution=False)
    fig = figures.patching_run_figure(run)
    assert len(fig.data) == 1 and list(fig.layout.xaxis.ticktext) == ["H0", "H1", "H2", "H3"]
    assert fig.layout.xaxis.title.text == "head" and "attention heads" in fig.layout.title.text
    assert run.columns() == [0, 1, 2, 3] and run.by_head


def test_detail_figures_are_bars_over_positions_with_tokens():
    run, act = hand_run()
    fig = figures.patching_detail_figure(run, 1, normalized=False)
    assert [t.name for t in fig.data] == ["activation", "attribution"]
    np.testing.assert_allclose(fig.data[0].y, act[1])
    np.testing.assert_allclose(fig.data[1].y, act[1] / 2 - 2.0)
    assert list(fig.layout.xaxis.ticktext)[1] == "1 ' Mary'" and "Layer 1" in fig.layout.title.text
    with pytest.raises(InputError, match="expected a layer of the grid"):
        figures.patching_detail_figure(run, 7)
    det = analysis.HeadDetail(layer=2, head=1, tokens=list(TOKENS), results={
        "activation": result(np.arange(5.0).reshape(1, 5, 1), "z_pos", heads=[1])})
    fig = figures.head_detail_figure(det, normalized=True)
    np.testing.assert_allclose(fig.data[0].y, (np.arange(5.0) + 2.0) / 6.0)
    assert "L2H1" in fig.layout.title.text and list(fig.layout.xaxis.ticktext)[4] == "4 ' to'"


def test_a_grid_cut_at_the_time_limit_says_so():
    run, act = hand_run(attribution=False)
    run.stopped_at_deadline = True
    assert "stopped at the time limit" in figures.patching_run_figure(run).layout.title.text


def planted_attention(n_heads=4, n=5, seed=0):
    rng = np.random.default_rng(seed)
    p = np.tril(rng.random((n_heads, n, n)) + 0.01)
    p /= p.sum(-1, keepdims=True)
    return analysis.AttentionPatterns(prompt="p", layer=3, tokens=list(TOKENS[:n]), pattern=p.astype(np.float32))


def test_attention_figure_one_head_and_small_multiples():
    att = planted_attention()
    fig = figures.attention_figure(att, 2)
    assert len(fig.data) == 1 and fig.data[0].type == "heatmap"
    np.testing.assert_allclose(np.array(fig.data[0].z), att.pattern[2], rtol=1e-6)
    assert list(fig.layout.xaxis.ticktext) == list(fig.layout.yaxis.ticktext) == [
        "0 'When'", "1 ' Mary'", "2 ' and'", "3 ' John'", "4 ' to'"]
    assert fig.layout.yaxis.autorange == "reversed" and "layer 3 head 2" in fig.layout.title.text
    assert fig.data[0].customdata[3][1] == ["3 ' John'", "1 ' Mary'"]  # hover: query, key
    with pytest.raises(ValueError):
        figures.attention_figure(att, 4)
    fig = figures.attention_figure(planted_attention(n_heads=9))
    assert len(fig.data) == 9 and {t.coloraxis for t in fig.data} == {"coloraxis"}
    assert [a.text for a in fig.layout.annotations] == [f"H{h}" for h in range(9)]
    assert fig.layout.coloraxis.cmin == 0
    assert "all 9 heads" in fig.layout.title.text


def test_new_figures_download_as_standalone_html(tmp_path):
    run, _ = hand_run()
    for fig in (figures.patching_run_figure(run), figures.patching_detail_figure(run, 0),
                figures.attention_figure(planted_attention(), 0)):
        page = figures.to_html(fig, tmp_path / "f.html")
        assert "<html" in page and "plotly" in page.lower() and (tmp_path / "f.html").exists()


def test_new_graphs_have_download_buttons_and_pages():
    from steerkit.apps import layout
    assert {"patch-heatmap", "patch-detail", "attn-pattern"} <= set(layout.FIGURES)
    assert ("/patching", "Patching") in layout.PAGES and ("/attention", "Attention") in layout.PAGES
    page = layout.patching_page()

    def ids(c):
        out = {getattr(c, "id", None)}
        kids = getattr(c, "children", None)
        for k in kids if isinstance(kids, list) else [kids] if kids is not None and not isinstance(kids, str) else []:
            out |= ids(k)
        return out
    got = ids(page) | ids(layout.attention_page())
    assert {"dl-patch-heatmap", "dl-patch-detail", "dl-attn-pattern", "patch-clean", "patch-corrupted", "patch-answer",
            "patch-wrong", "patch-hook", "patch-run", "attn-layer", "attn-head", "attn-view", "attn-run"} <= got


# ------------------------------------------------------------------ computations (tiny model)
TINY = {"num_hidden_layers": 3}


@pytest.mark.parametrize("hook", ["resid_pre", "attn_out", "mlp_out", "z"])
def test_chunked_patching_equals_one_call_of_the_probes_function(tiny, hook):
    metric = logit_diff_metric(tiny, "a", "b")
    want = activation_patching(tiny, "abcd", "abce", metric, hook, progress=False)
    ticks = []
    # 4 patched rows per forward pass: one layer per call of activation_patching
    run = analysis.patching_run(tiny, "abcd", "abce", "a", "b", hook, batch_size=4,
                                progress=lambda d, t: ticks.append((d, t)))
    assert ticks == [(0, 3), (1, 3), (2, 3), (3, 3)]
    assert run.activation.layers == [0, 1, 2] and run.attribution is None
    torch.testing.assert_close(run.activation.values, want.values)
    assert run.clean_metric == pytest.approx(want.clean_metric)
    assert run.tokens == ["a", "b", "c", "d"] and run.hook == hook and not run.stopped_at_deadline


def test_both_methods_and_a_layer_selection(tiny):
    metric = logit_diff_metric(tiny, "a", "b")
    run = analysis.patching_run(tiny, "abcd", "abce", "a", "b", "resid_pre", layers="1-2", method="both")
    want = attribution_patching(tiny, "abcd", "abce", metric, "resid_pre", layers=[1, 2], progress=False)
    torch.testing.assert_close(run.attribution.values, want.values)
    assert run.activation.layers == run.attribution.layers == [1, 2]
    assert set(run.layer_values(2)) == {"activation", "attribution"}
    run = analysis.patching_run(tiny, "abcd", "abce", "a", "b", method="attribution")
    assert run.activation is None and list(run.results) == ["attribution"]


def test_patching_refuses_unequal_prompts_and_answers_of_several_tokens(tiny):
    with pytest.raises(InputError, match=r"same number of tokens.*found 4 and 3"):
        analysis.patching_run(tiny, "abcd", "abc", "a", "b")
    with pytest.raises(InputError, match="one token"):
        analysis.patching_run(tiny, "abcd", "abce", "ab", "b")
    with pytest.raises(InputError, match="expected the answer as one token"):
        analysis.patching_run(tiny, "abcd", "abce", "", "b")
    with pytest.raises(InputError, match="expected a hook grid in"):
        analysis.patching_run(tiny, "abcd", "abce", "a", "b", "resid_post")


def test_patching_cancels_between_calls_and_stops_at_the_deadline(tiny):
    calls = []

    def stop():
        calls.append(1)
        return len(calls) > 2
    with pytest.raises(Cancelled):
        analysis.patching_run(tiny, "abcd", "abce", "a", "b", batch_size=4, should_stop=stop)
    run = analysis.patching_run(tiny, "abcd", "abce", "a", "b", batch_size=4, deadline=0.0)
    assert run.stopped_at_deadline and run.activation.layers == [0] and run.activation.values.shape == (1, 4)
    assert run.layers_requested == [0, 1, 2]


def test_head_detail_patches_one_head_at_each_position(tiny):
    metric = logit_diff_metric(tiny, "a", "b")
    run = analysis.patching_run(tiny, "abcd", "abce", "a", "b", "z", method="both")
    det = analysis.head_detail(tiny, run, 2, 1)
    want = activation_patching(tiny, "abcd", "abce", metric, "z_pos", layers=[2], heads=[1], progress=False)
    np.testing.assert_allclose(det.values()["activation"], want.values.reshape(-1).double().numpy())
    assert set(det.values()) == {"activation", "attribution"} and det.tokens == run.tokens
    # the first three positions are the same token in both prompts: patching them changes nothing
    np.testing.assert_allclose(det.values()["activation"][:3], run.corrupted_metric, atol=1e-5)
    with pytest.raises(InputError, match="from 0 to 3"):
        analysis.head_detail(tiny, run, 2, 4)
    resid = analysis.patching_run(tiny, "abcd", "abce", "a", "b", "resid_pre", layers="0")
    with pytest.raises(InputError, match="z \\(heads\\) grid"):
        analysis.head_detail(tiny, resid, 0, 0)


def test_attention_patterns_are_the_recorded_hook_pattern(tiny):
    att = analysis.attention_patterns(tiny, "hello", 1)
    assert att.pattern.shape == (4, 5, 5) and att.n_heads == 4 and att.tokens == list("hello")
    np.testing.assert_allclose(att.pattern.sum(-1), 1.0, atol=1e-5)
    assert np.all(np.triu(att.pattern, 1) == 0)  # causal: nothing above the diagonal
    with tiny.record(["blocks.1.attn.hook_pattern"], positions="all") as cache:
        tiny.forward(tiny.tokenize(["hello"], chat=False))
    np.testing.assert_allclose(att.pattern, cache["blocks.1.attn.hook_pattern"][0].float().numpy())
    with pytest.raises(InputError, match="from 0 to 2"):
        analysis.attention_patterns(tiny, "hello", 3)
    with pytest.raises(InputError, match="expected the prompt, found nothing"):
        analysis.attention_patterns(tiny, "  ", 0)


# ------------------------------------------------------------------ the IOI default on the default model
@pytest.mark.slow
def test_ioi_default_on_the_default_model(sm):
    run = analysis.patching_run(sm, data.IOI_CLEAN, data.IOI_CORRUPTED, data.IOI_ANSWER, data.IOI_WRONG, "resid_pre",
                                layers=f"0,{sm.n_layers - 1}")
    assert run.clean_metric > 1.0 and run.corrupted_metric < -1.0  # the model prefers the indirect object
    assert run.tokens[1] == " Mary" and run.corrupted_tokens[1] == " John" and len(run.tokens) == 14
    g = run.grid("activation", normalized=True)
    same = [p for p, (a, b) in enumerate(zip(run.tokens, run.corrupted_tokens)) if a == b]
    # layer 0's resid_pre is the embedding: where the two prompts have the same token, patching does nothing
    np.testing.assert_allclose(g[0, same], 0.0, atol=1e-4)
    # the last layer's residual at the last position carries (nearly) the whole answer
    assert g[1, -1] > 0.8
    fig = figures.patching_run_figure(run)
    assert list(fig.data[0].y) == [0, sm.n_layers - 1] and len(fig.layout.xaxis.ticktext) == 14
    att = analysis.attention_patterns(sm, data.IOI_CLEAN, 5)
    assert att.pattern.shape == (sm.facts.n_heads, 14, 14)
    np.testing.assert_allclose(att.pattern.sum(-1), 1.0, atol=1e-4)
