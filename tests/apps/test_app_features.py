"""The Features page without a browser: its computations, figure, bounds and callbacks.

The computations run on a tiny random model (tests/support/tiny_models.py) with random-weight SAEs built here: the
chunked report against one call of ``steerkit.probes.feature_report``, the table against
``steerkit.probes.top_latents``. The callbacks run through Flask's test client on an app over the tiny
model and a temporary store holding an SAE of it, an SAE of another width and a steering vector (the
helpers of tests/apps/test_app_security.py).
"""
from __future__ import annotations

import time

import pytest

pytest.importorskip("plotly", reason="the app extra (plotly, dash) is not installed")
pytest.importorskip("dash", reason="the app extra (plotly, dash) is not installed")

import torch  # noqa: E402

from steerkit.apps import analysis, figures  # noqa: E402
from steerkit.apps import data as limits  # noqa: E402
from steerkit.apps.analysis import Cancelled  # noqa: E402
from steerkit.errors import InputError  # noqa: E402
from steerkit.probes import feature_report, top_latents  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from dash_requests import callback_key, callbacks_of, fuzz_callbacks, post, run_page, strings, text_of  # noqa: E402

pytestmark = pytest.mark.timeout(600)

SITE = "blocks.1.hook_resid_post"
TEXTS = ["the cat sat on the mat", "a dog ran far away", "hello there", "one two three four", "x y z",
         "a quick brown fox", "the end of the story"]


def random_sae(sm, d_in=None, n=96, seed=0, site=SITE):
    """A random-weight ReLU SAE of ``sm`` at ``site`` (its provenance names ``sm``)."""
    from steerkit.sae import SAEWeights
    from steerkit.vectors import SAE, Provenance
    d = d_in or sm.d_model
    g = torch.Generator().manual_seed(seed)
    W = torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=-1)
    w = SAEWeights(W.T.clone(), torch.randn(n, generator=g) * 0.05, W.clone(), torch.zeros(d))
    return SAE(w, site, provenance=Provenance.from_model(sm) if d_in is None else Provenance())


@pytest.fixture(scope="module")
def sae(tiny):
    return random_sae(tiny)


@pytest.fixture(scope="module")
def live(tiny, sae):
    """The SAE's latents that fire on at least 3 of ``TEXTS``, those firing on the most texts first."""
    texts_of: dict[int, int] = {}
    for t in TEXTS:
        for row in top_latents(tiny, sae, t, k=sae.d_sae).rows:
            texts_of[row["latent"]] = texts_of.get(row["latent"], 0) + 1
    out = sorted((l for l, n in texts_of.items() if n >= 3), key=lambda l: (-texts_of[l], l))
    assert len(out) >= 2
    return out


# ------------------------------------------------------------------ the computations
def test_the_table_is_top_latents(tiny, sae):
    got = analysis.find_latents(tiny, sae, "the cat sat on the mat", k=7)
    want = top_latents(tiny, sae, "the cat sat on the mat", k=7)
    assert got.rows == want.rows and got.tokens == want.tokens and len(got.rows) == 7


@pytest.mark.parametrize("text, k, message", [
    ("x" * (limits.MAX_FEATURE_TEXT_CHARS + 1), 5, f"the text of at most {limits.MAX_FEATURE_TEXT_CHARS} characters"),
    ("  ", 5, "expected a text to read the latents on, found nothing"),
    (["a"], 5, "the text as text, found list"),
    ("abc", limits.MAX_FEATURE_K + 1, f"a number of latents from 1 to {limits.MAX_FEATURE_K}"),
    ("abc", 0, "a number of latents from 1 to"),
    ("abc", 2.5, "a number of latents from 1 to"),
])
def test_find_bounds(tiny, sae, text, k, message):
    with pytest.raises(InputError, match=message):
        analysis.find_latents(tiny, sae, text, k)


def same_report(got, want):
    assert got.latent == want.latent and got.site == want.site and got.n_tokens == want.n_tokens
    assert got.contexts == want.contexts
    assert got.density == want.density
    torch.testing.assert_close(got.values, want.values)
    assert got.top_logits == want.top_logits and got.bottom_logits == want.bottom_logits
    assert got.neighbours == want.neighbours


@pytest.mark.parametrize("which", [0, 1])
def test_batch_by_batch_equals_one_call_of_feature_report(tiny, sae, live, which):
    latent = live[which]
    want = feature_report(tiny, sae, latent, TEXTS, top=3, batch_size=2, progress=False)
    assert len(want.contexts) == 3 and want.n_tokens > 0  # the latent fires: the comparison means something
    ticks = []
    run = analysis.feature_run(tiny, sae, latent, TEXTS, top=3, batch_size=2,
                               progress=lambda d, t: ticks.append((d, t)), ref="tiny-sae@1")
    assert ticks == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)]
    same_report(run.report, want)
    assert run.texts == TEXTS and run.n_texts == 7 and not run.stopped_at_deadline and run.sae == "tiny-sae@1"
    # and the page's own batch size: one call
    same_report(analysis.feature_run(tiny, sae, latent, TEXTS, top=3).report,
                feature_report(tiny, sae, latent, TEXTS, top=3, progress=False))


def test_merging_keeps_the_strongest_context_of_each_text_across_batches(tiny, sae, live):
    texts = TEXTS + TEXTS[::-1]  # texts read twice: equal values, the one call keeps the first reader
    want = feature_report(tiny, sae, live[0], texts, top=5, batch_size=3, progress=False)
    assert len(want.contexts) == 5
    same_report(analysis.feature_run(tiny, sae, live[0], texts, top=5, batch_size=3).report, want)


def test_the_reading_cancels_and_stops_at_the_deadline(tiny, sae, live):
    calls = []
    with pytest.raises(Cancelled):
        analysis.feature_run(tiny, sae, live[0], TEXTS, batch_size=2,
                             should_stop=lambda: calls.append(1) or len(calls) > 1)
    assert len(calls) == 2
    run = analysis.feature_run(tiny, sae, live[0], TEXTS, top=3, batch_size=2, deadline=0.0)
    assert run.stopped_at_deadline and run.texts == TEXTS[:2] and run.n_texts == 7
    same_report(run.report, feature_report(tiny, sae, live[0], TEXTS[:2], top=3, batch_size=2, progress=False))


@pytest.mark.parametrize("latent, texts, top, message", [
    (96, TEXTS, 3, "a latent from 0 to 95, found '96'"),
    (-1, TEXTS, 3, "a latent from 0 to 95"),
    (True, TEXTS, 3, "a latent from 0 to 95"),
    ("3", TEXTS, 3, "a latent from 0 to 95"),
    (3, TEXTS, limits.MAX_FEATURE_CONTEXTS + 1, f"a number of contexts from 1 to {limits.MAX_FEATURE_CONTEXTS}"),
    (3, ["t"] * (limits.MAX_FEATURE_TEXTS + 1), 3, f"at most {limits.MAX_FEATURE_TEXTS} prompts"),
    (3, ["x" * (limits.MAX_FEATURE_DOC_CHARS + 1)], 3, f"at most {limits.MAX_FEATURE_DOC_CHARS} characters"),
    (3, [], 3, "at least one text"),
    (3, "one text", 3, "a list of texts"),
    (3, ["a", 7], 3, "a list of texts"),
])
def test_report_bounds(tiny, sae, latent, texts, top, message):
    with pytest.raises(InputError, match=message):
        analysis.feature_run(tiny, sae, latent, texts, top=top)


def test_the_text_sets_are_bounded():
    assert limits.feature_texts("custom", "a\n\nb") == ["a", "b"]
    assert len(limits.feature_texts("instructions")) == limits.MAX_FEATURE_TEXTS
    assert len(set(limits.feature_texts("temporal"))) > 1
    for kind, text, message in [("custom", "\n".join("t" * limits.MAX_FEATURE_TEXTS + "t"), "at most 256 prompts"),
                                ("custom", "x" * (limits.MAX_FEATURE_DOC_CHARS + 1), "at most 2000 characters"),
                                ("custom", "A" * (limits.MAX_PROMPT_LIST_CHARS + 1), f"the texts of at most {limits.MAX_PROMPT_LIST_CHARS} characters"),
                                ("custom", " ", "at least one text"), ("custom", ["a"], "the texts as text"),
                                ("everything", "", "expected a text set in")]:
        with pytest.raises(InputError, match=message):
            limits.feature_texts(kind, text)


# ------------------------------------------------------------------ the figure and the layout
def test_the_figure_is_the_reports_own_and_bins_many_values(tiny, sae, live, tmp_path):
    rep = feature_report(tiny, sae, live[0], TEXTS, top=3, progress=False)
    assert rep.values.numel() > 2
    fig, own = figures.feature_figure(rep), rep.plot()
    assert fig.to_dict() == own.to_dict()
    binned = figures.feature_figure(rep, max_values=rep.values.numel() - 1, stopped=True)
    assert binned.data[0].type == "bar" and sum(binned.data[0].y) == rep.values.numel()
    assert [t.to_plotly_json() for t in binned.data[1:]] == [t.to_plotly_json() for t in own.data[1:]]
    assert binned.layout.title.text.endswith("(stopped at the time limit)")
    page = figures.to_html(fig, tmp_path / "f.html")
    assert "<html" in page and "logit effect" in page


def test_the_page_has_its_inputs_figure_and_download():
    from steerkit.apps import layout

    def walk(c):
        yield c
        kids = getattr(c, "children", None)
        for k in kids if isinstance(kids, list) else [kids] if kids is not None and not isinstance(kids, str) else []:
            yield from walk(k)
    assert ("/features", "Features") in layout.PAGES and layout.FIGURES["feat-figure"] == "sae_feature"
    comps = list(walk(layout.features_page()))
    ids = {getattr(c, "id", None) for c in comps}
    assert {"feat-sae", "feat-rescan", "feat-text", "feat-k", "feat-find", "feat-table", "feat-latent", "feat-dataset",
            "feat-texts", "feat-top", "feat-run", "feat-cancel", "feat-progress", "feat-contexts", "feat-figure",
            "dl-feat-figure"} <= ids
    text = " ".join(str(getattr(c, "children", "")) for c in comps)
    assert f"at most {limits.MAX_FEATURE_TEXT_CHARS} characters" in text and f"1 to {limits.MAX_FEATURE_K}" in text
    assert f"at most {limits.MAX_FEATURE_TEXTS} texts" in text


# ------------------------------------------------------------------ the callbacks (Flask test client)
@pytest.fixture(scope="module")
def app(tiny, sae, tmp_path_factory):
    from steerkit.apps.app import create_app
    from steerkit.vectors import SteeringVector, Store
    root = tmp_path_factory.mktemp("features")
    store = Store(root / "store")
    store.save("tiny-sae", sae)
    store.save("narrow-sae", random_sae(tiny, d_in=32, n=16))
    store.save("tiny-dir", SteeringVector.from_direction(torch.ones(tiny.d_model), 1, tiny, method="test"))
    (root / "results").mkdir()
    return create_app(tiny, store=str(root / "store"), results=str(root / "results"), cache_dir=str(root / "cache"),
                      port=8050, deadline=30.0)



FIND = {"feat-find.n_clicks": 1, "feat-sae.value": "tiny-sae@1", "feat-text.value": "the cat sat on the mat",
        "feat-k.value": 5}
GOOD = {"feat-run.n_clicks": 1, "feat-sae.value": "tiny-sae@1", "feat-latent.value": None,
        "feat-dataset.value": "custom", "feat-texts.value": "\n".join(TEXTS), "feat-top.value": 3}


@pytest.fixture(scope="module")
def good(live):
    """The report's inputs, reading a latent that fires on these texts."""
    return dict(GOOD, **{"feat-latent.value": live[0]})


def find(app, client, **changes):
    vals = dict(FIND, **{f"feat-{k}.value": v for k, v in changes.items()})
    r = post(client, app, callback_key(app, "feat-find-key.data"), vals)
    assert r.status_code == 200
    return r


def run_report(app, client, good, **changes):
    return run_page(app, client, "feat", good, changes)


def response(r, component, prop):
    return r.get_json()["response"][component][prop]


def test_the_picker_lists_the_stores_saes_with_their_site(app, client):
    r = post(client, app, callback_key(app, "feat-sae.options"), {"url.pathname": "/features"})
    opts = response(r, "feat-sae", "options")
    assert [o["value"] for o in opts] == ["narrow-sae@1", "tiny-sae@1"]  # no steering vector
    assert opts[1]["label"] == f"tiny-sae@1 ({SITE}, 96 latents)"
    assert response(r, "feat-sae", "value") == "narrow-sae@1"
    r = post(client, app, callback_key(app, "feat-sae.options"), {"url.pathname": "/features", "feat-sae.value": "tiny-sae@1"})
    assert "value" not in r.get_json()["response"]["feat-sae"]  # the picked SAE stays
    r = post(client, app, callback_key(app, "feat-sae.options"), {"url.pathname": "/features", "feat-sae.value": "tiny-dir@1"})
    assert response(r, "feat-sae", "value") == "narrow-sae@1"  # not an SAE: the first SAE instead


def test_the_sae_is_checked_against_the_loaded_model(app, client):
    key = callback_key(app, "feat-sae-status.children")
    r = post(client, app, key, {"feat-sae.value": "tiny-sae@1"})
    assert f"relu SAE at {SITE} with 96 latents (d_in 64); it fits tiny-llama" in text_of(r)
    assert response(r, "feat-latent", "max") == 95
    r = post(client, app, key, {"feat-sae.value": "narrow-sae@1"})
    msg = text_of(r)
    assert f"expected an SAE at {SITE} to read 64 features on 'tiny-llama', found 32" in msg and "⚠" in msg
    assert "Traceback" not in msg and response(r, "feat-latent", "max") is None
    assert "expected an SAE (sae), found a steering_vector (tiny-dir@1)" in text_of(post(client, app, key, {
        "feat-sae.value": "tiny-dir@1"}))
    assert "No SAE in the store yet" in text_of(post(client, app, key, {"feat-sae.value": None}))


def test_find_shows_top_latents_and_a_click_selects_one(app, client, tiny, sae):
    r = find(app, client)
    rows = response(r, "feat-table", "data")
    hits = top_latents(tiny, sae, "the cat sat on the mat", k=5)
    want = hits.rows
    assert [row["latent"] for row in rows] == [w["latent"] for w in want]
    assert [row["max"] for row in rows] == [round(w["max"], 4) for w in want]
    assert [row["token"] for row in rows] == [repr(w["token"]) for w in want]
    assert f"the 5 latents that fire most on these {len(hits.tokens)} tokens" in text_of(r)
    key = response(r, "feat-find-key", "data")
    select = callback_key(app, "feat-latent.value")
    r = post(client, app, select, {"feat-table.active_cell": {"row": 2, "column": 0}, "feat-find-key.data": key})
    assert response(r, "feat-latent", "value") == want[2]["latent"]
    for junk in ({"row": 5}, {"row": -1}, {"row": True}, {"row": "2"}, None, "x", [1]):
        r = post(client, app, select, {"feat-table.active_cell": junk, "feat-find-key.data": key})
        assert r.status_code == 204, junk
    r = post(client, app, select, {"feat-table.active_cell": {"row": 0}, "feat-find-key.data": {"key": "0" * 24}})
    assert r.status_code == 204
    assert "from the cache" in text_of(find(app, client))


@pytest.mark.parametrize("field, value, message", [
    ("text", "x" * (limits.MAX_FEATURE_TEXT_CHARS + 1), f"at most {limits.MAX_FEATURE_TEXT_CHARS} characters"),
    ("text", "", "expected a text to read the latents on, found nothing"),
    ("k", limits.MAX_FEATURE_K + 1, f"a number of latents from 1 to {limits.MAX_FEATURE_K}"),
    ("k", 10 ** 12, "a number of latents from 1 to"),
    ("k", "5", "a number of latents from 1 to"),
    ("sae", "narrow-sae@1", "to read 64 features on 'tiny-llama', found 32"),
    ("sae", "tiny-dir@1", "expected an SAE (sae), found a steering_vector"),
    ("sae", "../../etc/passwd", "expected"),
    ("sae", None, "expected an SAE from the store, found none"),
    ("sae", {"ref": 1}, "expected an SAE as text"),
])
def test_find_request_values_are_bounded(app, client, field, value, message):
    t = time.monotonic()
    r = find(app, client, **{field: value})
    msg = text_of(r)
    assert message in msg, msg[:400]
    assert "feat-find-key" not in r.get_json().get("response", {}) and "Traceback" not in msg
    assert time.monotonic() - t < 30


def test_a_report_runs_equals_feature_report_and_draws(app, client, tiny, sae, good, live):
    r = run_report(app, client, good)
    msg = text_of(r)
    assert f"Latent {live[0]} of tiny-sae@1 at {SITE}: density" in msg and "computed in" in msg, msg[:400]
    assert "7 texts, 3 contexts" in msg
    key = response(r, "feat-key", "data")
    run = app.steerkit_env.host.result(key["key"])
    same_report(run.report, feature_report(tiny, sae, live[0], TEXTS, top=3, progress=False))
    r = post(client, app, callback_key(app, "feat-contexts.children"), {"feat-key.data": key})
    out = r.get_json()["response"]
    kids = out["feat-contexts"]["children"]
    assert "density" in strings(kids[0]) and len(kids) == 1 + len(run.report.contexts)
    for shown, c in zip(kids[1:], run.report.contexts):
        spans = [k for k in shown["props"]["children"] if k["type"] == "Span"][1:]
        assert [s["props"]["children"] for s in spans] == c["tokens"]
        assert [s["props"]["title"] for s in spans] == [f"{a:.3f}" for a in c["acts"]]
        assert "outline" in spans[c["index"]]["props"]["style"]
    fig = out["feat-figure"]["figure"]
    assert [t["type"] for t in fig["data"]] == ["histogram", "bar", "bar"]
    assert fig["layout"]["title"]["text"] == f"latent {live[0]} at {SITE}"
    # the figure downloads as standalone HTML through the app's download callback
    r = post(client, app, callback_key(app, "download-fig.data"), {"dl-feat-figure.n_clicks": 1, "feat-figure.figure": fig},
             changed="dl-feat-figure.n_clicks")
    dl = response(r, "download-fig", "data")
    assert dl["filename"] == "sae_feature.html" and "logit effect" in dl["content"]
    assert "from the cache" in text_of(run_report(app, client, good))


def test_markup_in_a_text_stays_text(app, client, good, tiny, sae):
    """The contexts are components whose children are strings: markup in a text is shown, never run."""
    evil = "<img src=x onerror=alert(1)><script>alert(2)</script>"
    latent = top_latents(tiny, sae, evil, k=1).rows[0]["latent"]  # one that fires on it
    r = run_report(app, client, good, texts=evil, latent=latent, top=1)
    key = response(r, "feat-key", "data")
    r = post(client, app, callback_key(app, "feat-contexts.children"), {"feat-key.data": key})
    assert "dangerously" not in r.get_data(as_text=True).lower()
    (context,) = app.steerkit_env.host.result(key["key"]).report.contexts
    spans = r.get_json()["response"]["feat-contexts"]["children"][1]["props"]["children"][2:]
    assert [s["type"] for s in spans] == ["Span"] * len(context["tokens"])
    assert [s["props"]["children"] for s in spans] == context["tokens"]  # plain strings, escaped by the browser
    assert any("<" in t for t in context["tokens"])


@pytest.mark.parametrize("field, value, message", [
    ("latent", 96, "a latent from 0 to 95, found '96'"),
    ("latent", -1, "a latent from 0 to 95"),
    ("latent", 10 ** 30, "a latent from 0 to 95"),
    ("latent", None, "expected a latent: click a row of the table"),
    ("latent", "3", "a latent from 0 to 95"),
    ("top", limits.MAX_FEATURE_CONTEXTS + 1, f"a number of contexts from 1 to {limits.MAX_FEATURE_CONTEXTS}"),
    ("top", 0, "a number of contexts from 1 to"),
    ("texts", "\n".join(f"t{i}" for i in range(limits.MAX_FEATURE_TEXTS + 1)),
     f"at most {limits.MAX_FEATURE_TEXTS} prompts in the texts of a report, found {limits.MAX_FEATURE_TEXTS + 1}"),
    ("texts", "ok\n" + "x" * (limits.MAX_FEATURE_DOC_CHARS + 1), f"at most {limits.MAX_FEATURE_DOC_CHARS} characters"),
    ("texts", "A" * 1_100_000, f"at most {limits.MAX_PROMPT_LIST_CHARS} characters"),
    ("texts", "", "expected at least one text"),
    ("texts", ["a"], "the texts as text"),
    ("dataset", "everything", "expected a text set in"),
    ("sae", "narrow-sae@1", "to read 64 features on 'tiny-llama', found 32"),
    ("sae", "tiny-dir@1", "expected an SAE (sae), found a steering_vector"),
    ("sae", "/etc/passwd", "expected"),
])
def test_report_request_values_are_bounded(app, client, good, field, value, message):
    t = time.monotonic()
    r = run_report(app, client, good, **{field: value})
    msg = text_of(r)
    assert message in msg, msg[:400]
    assert "feat-key" not in r.get_json().get("response", {}) and "Traceback" not in msg
    assert time.monotonic() - t < 30


def test_a_built_in_text_set_reads_without_pasting(app, client, good):
    r = run_report(app, client, good, dataset="temporal", texts=None)
    assert f"{limits.MAX_FEATURE_TEXTS} texts" in text_of(r), text_of(r)[:400]


def test_the_time_limit_keeps_the_texts_it_has(app, client, good, monkeypatch):
    env = app.steerkit_env
    monkeypatch.setattr(env, "deadline", 0.0)
    texts = "\n".join(f"text number {i}" for i in range(40))
    r = run_report(app, client, good, texts=texts)
    msg = text_of(r)
    assert "Stopped at the time limit of 0 s per request after 16 of 40 texts" in msg, msg[:400]
    run = env.host.result(response(r, "feat-key", "data")["key"])
    assert run.stopped_at_deadline and run.n_read == 16
    r = post(client, app, callback_key(app, "feat-contexts.children"), {"feat-key.data": response(r, "feat-key", "data")})
    assert "(stopped at the time limit)" in text_of(r)
    monkeypatch.setattr(env, "deadline", 60.0)  # the same settings again are computed again, in full
    msg = text_of(run_report(app, client, good, texts=texts))
    assert "40 texts" in msg and "computed in" in msg and "Stopped" not in msg


@pytest.mark.parametrize("headers", [{"Host": "evil.example:8050"},
                                     {"Host": "127.0.0.1:8050", "Origin": "http://evil.example"}])
def test_the_host_check_covers_the_feature_callbacks(app, client, good, headers, monkeypatch):
    called = []
    monkeypatch.setattr(analysis, "feature_run", lambda *a, **k: called.append(1))
    monkeypatch.setattr(analysis, "find_latents", lambda *a, **k: called.append(1))
    for key, vals in ((callback_key(app, "feat-key.data"), good), (callback_key(app, "feat-find-key.data"), FIND),
                      (callback_key(app, "feat-sae-status.children"), {"feat-sae.value": "tiny-sae@1"})):
        assert post(client, app, key, vals, headers=headers).status_code == 403
    assert not called


def test_fuzz_the_feature_callbacks(app, client):
    """Random values for every input of the Features page's callbacks (those the app-wide fuzz of
    tests/apps/test_app_security.py also reaches, here over a store that holds an SAE): never a server error,
    never a traceback."""
    keys = callbacks_of(app, "feat-")
    assert len(keys) >= 6

    def stored_sae(values, data):
        if "feat-sae.value" in values and data.draw(st.booleans(), label="a stored SAE"):
            values["feat-sae.value"] = "tiny-sae@1"  # past the picker's check, into the bounds of the rest
    fuzz_callbacks(app, client, keys, seconds=40, examples=150, tweak=stored_sae)
