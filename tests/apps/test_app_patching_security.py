"""The Patching and Attention pages trust no request: every value their callbacks receive is bounded.

Drives the Dash server through Flask's test client with a tiny random model (the fixtures and
helpers of tests/apps/test_app_security.py): oversize prompts and answers, prompts of too many tokens
or of unequal token length, hook grids, methods and views outside their lists, layer and head
indices out of range, huge layer ranges, oversize grids, clicks carrying junk, the time limit
(the grid computed so far, and a message saying so), and a hypothesis fuzz of the new callbacks.
"""
from __future__ import annotations

import time

import pytest

pytest.importorskip("dash", reason="the app extra (dash) is not installed")


from steerkit.apps import analysis  # noqa: E402
from steerkit.apps import data as limits  # noqa: E402
from steerkit.errors import InputError  # noqa: E402
from dash_requests import callback_key, fuzz_callbacks, post, run_page, text_of  # noqa: E402

# the fixtures of tests/apps/test_app_security.py: a tiny model, its folders, the app over them, a client

pytestmark = pytest.mark.timeout(600)

# the tiny model's tokenizer has one token per character: "abcd" is 4 tokens, "a" one token
GOOD = {"patch-run.n_clicks": 1, "patch-clean.value": "abcd", "patch-corrupted.value": "abce",
        "patch-answer.value": "a", "patch-wrong.value": "b", "patch-hook.value": "resid_pre",
        "patch-layers.value": "all", "patch-method.value": "activation"}


def run_patch(app, client, **changes):
    return run_page(app, client, "patch", GOOD, changes)


def patch_key(r):
    return r.get_json()["response"]["patch-key"]["data"]


@pytest.mark.parametrize("field, value, message", [
    ("clean", "x" * (limits.MAX_PATCH_PROMPT_CHARS + 1), f"at most {limits.MAX_PATCH_PROMPT_CHARS} characters"),
    ("corrupted", "x" * (limits.MAX_PATCH_PROMPT_CHARS + 1), f"at most {limits.MAX_PATCH_PROMPT_CHARS} characters"),
    ("answer", "x" * (limits.MAX_ANSWER_CHARS + 1), f"at most {limits.MAX_ANSWER_CHARS} characters"),
    ("wrong", ["a"], "the wrong answer as text"),
    ("hook", "blocks.0.hook_resid_pre", "expected a hook grid in"),
    ("hook", {"x": 1}, "expected a hook grid in"),
    ("method", "everything", "expected a method in"),
    ("layers", "0-1000000000", "range"),
    ("layers", "7", "expected layers below 2"),
    ("layers", "x" * (limits.MAX_FIELD_CHARS + 1), f"at most {limits.MAX_FIELD_CHARS} characters"),
    ("clean", "", "expected the clean prompt, found nothing"),
])
def test_patching_request_values_are_bounded(app, client, field, value, message):
    t = time.monotonic()
    r = run_patch(app, client, **{field: value})
    assert message in text_of(r), text_of(r)[:400]
    assert "Traceback" not in text_of(r)
    assert time.monotonic() - t < 30


def test_patching_token_counts_are_bounded_and_must_match(app, client):
    n = limits.MAX_PATCH_TOKENS + 1
    r = run_patch(app, client, clean="a" * n, corrupted="b" * n)
    assert f"at most {limits.MAX_PATCH_TOKENS} tokens, found {n}" in text_of(r)
    r = run_patch(app, client, clean="abcd", corrupted="abcde")
    assert "same number of tokens" in text_of(r) and "found 4 and 5" in text_of(r)
    r = run_patch(app, client, answer="ab")
    assert "to be one token, found 2" in text_of(r)


def test_patching_grid_size_is_bounded(tiny, monkeypatch):
    monkeypatch.setattr(analysis.patching, "MAX_PATCH_SITES", 7)
    with pytest.raises(InputError, match="at most 7 cells, found 2 layers x 4 positions = 8"):
        analysis.patching_run(tiny, "abcd", "abce", "a", "b")
    with pytest.raises(InputError, match="at most 7 cells, found 2 layers x 4 heads = 8"):
        analysis.patching_run(tiny, "abcd", "abce", "a", "b", "z")
    analysis.patching_run(tiny, "abcd", "abce", "a", "b", layers="1")  # 4 cells: fine


def test_a_good_request_draws_and_junk_clicks_get_a_message(app, client):
    r = run_patch(app, client)
    assert "resid_pre: 2 layers × 4 positions" in text_of(r), text_of(r)[:400]
    key = patch_key(r)
    draw = callback_key(app, "patch-heatmap.figure")
    r = post(client, app, draw, {"patch-key.data": key, "patch-scale.value": "normalized",
                                 "patch-heatmap.clickData": {"points": [{"x": 10 ** 12, "y": "L1"}]}})
    assert r.status_code == 200 and "heatmap" in r.get_data(as_text=True)
    detail = callback_key(app, "patch-detail.figure")
    for click in (None, "x", {"points": []}, {"points": [{"x": -1, "y": 0}]}, {"points": [{"x": 1.5, "y": 0}]},
                  {"points": [{"x": 0, "y": 10 ** 15}]}, {"points": [{"x": True, "y": 0}]},
                  {"points": [[1, 2]]}, {"points": [{"x": 1, "y": [0]}]}):
        r = post(client, app, detail, {"patch-heatmap.clickData": click, "patch-scale.value": "raw",
                                       "patch-key.data": key}, changed="patch-heatmap.clickData")
        assert r.status_code == 200, (click, r.data[:300])
        assert "Traceback" not in text_of(r)
    # a layer the grid does not hold: a message
    r = post(client, app, detail, {"patch-heatmap.clickData": {"points": [{"x": 1, "y": 5}]},
                                   "patch-scale.value": "raw", "patch-key.data": key}, changed="patch-heatmap.clickData")
    assert "expected a layer of the grid (0..1), found 5" in text_of(r)
    # a good click: the layer's values over positions
    r = post(client, app, detail, {"patch-heatmap.clickData": {"points": [{"x": 1, "y": 1}]},
                                   "patch-scale.value": "raw", "patch-key.data": key}, changed="patch-heatmap.clickData")
    assert "Layer 1: resid_pre patched at each of 4 positions" in text_of(r)
    # a key the app never gave out: the empty figure
    r = post(client, app, detail, {"patch-heatmap.clickData": {"points": [{"x": 1, "y": 1}]},
                                   "patch-key.data": {"key": "0" * 24}}, changed="patch-heatmap.clickData")
    assert r.status_code == 200 and "Click a cell" in text_of(r)


def test_head_clicks_are_bounded_by_the_model(app, client):
    r = run_patch(app, client, hook="z")
    assert "z: 2 layers × 4 heads" in text_of(r), text_of(r)[:400]
    key = patch_key(r)
    detail = callback_key(app, "patch-detail.figure")
    r = post(client, app, detail, {"patch-heatmap.clickData": {"points": [{"x": 99, "y": 1}]},
                                   "patch-key.data": key}, changed="patch-heatmap.clickData")
    assert "expected a head from 0 to 3, found '99'" in text_of(r)
    r = post(client, app, detail, {"patch-heatmap.clickData": {"points": [{"x": 3, "y": 1}]},
                                   "patch-key.data": key}, changed="patch-heatmap.clickData")
    assert "Head L1H3 patched at each of 4 positions separately" in text_of(r)


def test_the_patching_time_limit_keeps_the_layers_it_has(app, client, monkeypatch):
    env = app.steerkit_env
    monkeypatch.setattr(env, "deadline", 0.0)
    # two layers, 4 positions; one row per forward pass would make two calls: force one layer per call
    real = analysis.patching_run
    monkeypatch.setattr(analysis, "patching_run", lambda *a, **kw: real(*a, **dict(kw, batch_size=4)))
    r = run_patch(app, client, clean="dcba", corrupted="dcbe")
    assert "Stopped at the time limit of 0 s per request after 1 of 2 layers" in text_of(r), text_of(r)[:400]
    key = patch_key(r)
    run = env.host.result(key["key"])
    assert run.stopped_at_deadline and run.activation.layers == [0]
    r = post(client, app, callback_key(app, "patch-heatmap.figure"), {"patch-key.data": key, "patch-scale.value": "raw"})
    assert r.status_code == 200 and "time limit" in text_of(r)
    # the same settings again are computed again (a cut grid is not cached under them)
    monkeypatch.setattr(env, "deadline", 60.0)
    r = run_patch(app, client, clean="dcba", corrupted="dcbe")
    assert "Stopped" not in text_of(r) and "computed in" in text_of(r)


@pytest.mark.parametrize("layer", [10 ** 9, "1", -1, 0.5, True, None, [0]])
def test_attention_layers_are_bounded(app, client, layer):
    message = "expected a layer from 0 to 1"
    r = post(client, app, callback_key(app, "attn-key.data"), {"attn-run.n_clicks": 1, "attn-layer.value": layer,
                                                        "attn-prompt.value": "hello"})
    assert r.status_code == 200 and message in text_of(r), text_of(r)[:300]


def test_attention_prompt_heads_and_views_are_bounded(app, client, tiny, monkeypatch):
    run = callback_key(app, "attn-key.data")
    # (the tiny model's context, 128 tokens, is the limit's value: a smaller limit shows the check)
    monkeypatch.setattr(analysis.attention, "MAX_ATTN_TOKENS", 8)
    r = post(client, app, run, {"attn-run.n_clicks": 1, "attn-layer.value": 0, "attn-prompt.value": "a" * 9})
    assert "at most 8 tokens, found 9" in text_of(r)
    monkeypatch.undo()
    r = post(client, app, run, {"attn-run.n_clicks": 1, "attn-layer.value": 0,
                                "attn-prompt.value": "a" * (limits.MAX_PATCH_PROMPT_CHARS + 1)})
    assert f"at most {limits.MAX_PATCH_PROMPT_CHARS} characters" in text_of(r)
    r = post(client, app, run, {"attn-run.n_clicks": 1, "attn-layer.value": 1, "attn-prompt.value": "hello"})
    assert "Layer 1: 4 heads × 5 tokens" in text_of(r), text_of(r)[:300]
    key = r.get_json()["response"]["attn-key"]["data"]
    draw = callback_key(app, "attn-pattern.figure")
    for head, view, message in ((9, "one", "expected a head from 0 to 3, found '9'"), (None, "one", "expected a head"),
                                ("2", "one", "expected a head"), (0, "grid", "expected a view in")):
        r = post(client, app, draw, {"attn-key.data": key, "attn-head.value": head, "attn-view.value": view})
        assert r.status_code == 200 and message in text_of(r), (head, view, text_of(r)[:300])
    r = post(client, app, draw, {"attn-key.data": key, "attn-head.value": 3, "attn-view.value": "one"})
    assert "Attention pattern, layer 1 head 3" in text_of(r)
    r = post(client, app, draw, {"attn-key.data": key, "attn-head.value": 77, "attn-view.value": "all"})
    assert "all 4 heads" in text_of(r)  # the head is not used for the grid of every head
    monkeypatch.setattr(analysis.attention, "MAX_ATTN_CELLS", 50)
    with pytest.raises(InputError, match="at most 50 attention weights"):
        analysis.attention_patterns(tiny, "hello", 0)  # 4 heads x 5 x 5 = 100


def test_fuzz_the_patching_and_attention_callbacks(app, client):
    """Random values for every input of the new callbacks: never a server error, never a traceback."""
    keys = [callback_key(app, k) for k in ("patch-key.data", "patch-heatmap.figure", "patch-detail.figure", "attn-key.data",
                                   "attn-pattern.figure")]
    fuzz_callbacks(app, client, keys, seconds=45, examples=120)
