"""The Features page: a sparse autoencoder from the store (checked against the loaded model with
:meth:`steerkit.vectors.SAE.check`), the latents that fire most on a text
(:func:`steerkit.apps.analysis.find_latents`) and one latent's report over a set of texts
(:func:`steerkit.apps.analysis.feature_run`, :func:`steerkit.probes.feature_report` one batch per call):
its top contexts with every token shaded by its activation, and the figure of its histogram, logit effects
and nearest latents.

The contexts are Dash components (a ``html.Span`` per token, its text a plain string that the browser
escapes), never raw HTML.
"""
from __future__ import annotations

import warnings

from dash import Input, Output, State, html, no_update
from dash.exceptions import PreventUpdate

from steerkit.errors import InputError
from steerkit.probes import TopLatents

from .. import analysis, figures
from .. import data as inputs
from ..data import MAX_FEATURE_CONTEXTS, MAX_FEATURE_K, MAX_FIELD_CHARS, check_int, check_text
from ..runtime import cache_key, should_stop
from .common import Context, background, cached_reading, count, explain, key_of, note, ok, picker, ticker

#: characters of a store row's field (site, architecture) shown in the picker's labels
MAX_LABEL_CHARS = 120


def sae_options(c: Context) -> list[dict]:
    """The picker's options: the store's newest SAEs, each labelled with its site and width."""
    out = []
    for row in c.store.list(all_versions=False):
        if row.get("kind") != "sae":
            continue
        site, d_sae = str(row.get("site") or "?")[:MAX_LABEL_CHARS], row.get("d_sae")
        width = f", {d_sae} latents" if isinstance(d_sae, int) and not isinstance(d_sae, bool) else ""
        out.append({"label": f"{row['ref']} ({site}{width})", "value": row["ref"]})
    return out


def stored_sae(c: Context, ref):
    """The stored SAE ``ref`` checked against the loaded model (:meth:`steerkit.vectors.SAE.check`: its site
    exists there, its widths are the site's, the model is the one it was made for), and the check's notes."""
    ref = check_text(ref, "an SAE", MAX_FIELD_CHARS).strip()
    if not ref:
        raise InputError("expected an SAE from the store, found none; save one first (steerkit.load_sae(PATH), then "
                         "Store(FOLDER).save(NAME, sae), or steerkit vectors import PATH --name NAME)")
    art = c.store.load(ref)
    if art.kind != "sae":
        raise InputError(f"expected an SAE (sae), found a {art.kind} ({ref}); pick an SAE from the list")
    with warnings.catch_warnings():  # the notes are shown on the page
        warnings.simplefilter("ignore")
        notes = art.check(c.host.get())
    return art, notes


def table_rows(hits) -> list[dict]:
    """The rows of the table of latents (:class:`steerkit.probes.TopLatents`), tokens quoted."""
    return [{"latent": r["latent"], "max": round(r["max"], 4), "mean": round(r["mean"], 4), "count": r["count"],
             "token": repr(r["token"]), "position": r["position"]} for r in hits.rows]


def context_rows(run) -> list:
    """The report's contexts as components: per context its peak value, its text's number and its tokens,
    each a ``html.Span`` shaded by its activation (hover: the value), the firing token outlined."""
    rep = run.report
    peak = max((c["value"] for c in rep.contexts), default=0.0) or 1.0
    head = html.P(f"Latent {rep.latent} at {rep.site}: density {rep.density:.3g} ({rep.n_tokens} tokens of "
                  f"{count(run.texts, 'text')}); {count(rep.contexts, 'context')}, strongest first.",
                  style={"margin": "0 0 6px", "fontFamily": "system-ui, sans-serif"})
    rows = []
    for c in rep.contexts:
        spans = []
        for j, (token, act) in enumerate(zip(c["tokens"], c["acts"])):
            style = {"background": f"rgba(255,120,0,{max(0.0, min(1.0, act / peak)):.2f})"}
            if j == c["index"]:
                style["outline"] = "1px solid #c00"
            spans.append(html.Span(str(token), title=f"{act:.3f}", style=style))
        rows.append(html.Div([html.B(f"{c['value']:.2f}"), html.Span(f"  text {c['doc'] + 1}  ", style={"color": "#888"}),
                              *spans], className="feat-context", style={"marginBottom": "4px"}))
    if not rows:
        rows = [note("The latent fires on none of these texts.")]
    return [head, *rows]


def register(app, c: Context) -> None:
    """Wire the Features page."""
    register_sae(app, c)
    register_find(app, c)
    register_report(app, c)


def register_sae(app, c: Context) -> None:
    """The SAE picker and its check against the loaded model."""

    @app.callback(Output("feat-sae", "options"), Output("feat-sae", "value"),
                  Input("url", "pathname"), Input("feat-rescan", "n_clicks"), Input("store-refresh", "n_clicks"),
                  State("feat-sae", "value"))
    def feature_saes(path, _, __, current):
        return picker(lambda: sae_options(c), current)

    @app.callback(Output("feat-sae-status", "children"), Output("feat-latent", "max"), Input("feat-sae", "value"),
                  Input("model-label", "children"))
    def feature_sae_status(ref, _):
        """The picked SAE, checked against the loaded model (again when another model is loaded)."""
        if not ref:
            return note("No SAE in the store yet: save one (steerkit.load_sae(PATH), then Store(FOLDER).save(NAME, "
                        "sae)) and press Rescan."), None
        try:
            sae, notes = stored_sae(c, ref)
            sm = c.host.get()
            k = f", k={sae.weights.k}" if getattr(sae.weights, "k", None) else ""
            msg = ok(f"{ref}: {sae.architecture}{k} SAE at {sae.site} with {sae.d_sae} latents (d_in {sae.d_in}); "
                     f"it fits {sm.name}." + "".join(f" Note: {n}" for n in notes))
            return msg, sae.d_sae - 1
        except Exception as e:  # noqa: BLE001
            return explain(e), None


def register_find(app, c: Context) -> None:
    """The latents that fire most on a text, and the latent a click on the table selects."""
    host = c.host

    @app.callback(
        Output("feat-find-key", "data"), Output("feat-find-status", "children"), Output("feat-table", "data"),
        Output("feat-table", "active_cell"),
        Input("feat-find", "n_clicks"), State("feat-sae", "value"), State("feat-text", "value"), State("feat-k", "value"),
        background=True, prevent_initial_call=True, interval=400,
        running=[(Output("feat-find", "disabled"), True, False),
                 (Output("feat-find-progress", "style"), {"width": "120px", "visibility": "visible"},
                  {"width": "120px", "visibility": "hidden"})])
    def find_features(_, ref, text, k):
        """``analysis.find_latents``: the latents of the picked SAE that fire most on the text."""
        try:
            text = check_text(text, "the text", inputs.MAX_FEATURE_TEXT_CHARS)
            k = check_int(k, "a number of latents", 1, MAX_FEATURE_K)
            sae, _ = stored_sae(c, ref)
            sm = host.get()
            key = cache_key("feat-find", sm.name, ref, text, k)
            hits, hit = host.cached(key, lambda: analysis.find_latents(sm, sae, text, k))
            msg = (f"{ref} at {hits.site}: " + (f"the {count(hits.rows, 'latent')} that fire most on "
                   if hits.rows else "no latent fires on ") + f"these {count(hits.tokens, 'token')}"
                   + (" (from the cache)." if hit else "."))
            return {"key": key}, ok(msg), table_rows(hits), None
        except Exception as e:  # noqa: BLE001
            return no_update, explain(e), no_update, no_update

    @app.callback(Output("feat-latent", "value"), Input("feat-table", "active_cell"), State("feat-find-key", "data"),
                  prevent_initial_call=True)
    def select_latent(cell, data):
        """The latent of the clicked row, read from the result on the server (not from the table's data)."""
        hits = host.result(key_of(data))
        if not isinstance(hits, TopLatents) or not isinstance(cell, dict):
            raise PreventUpdate
        row = cell.get("row")
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < len(hits.rows):
            raise PreventUpdate
        return hits.rows[row]["latent"]


def register_report(app, c: Context) -> None:
    """One latent read over a set of texts (a background job), its contexts and its figure."""
    host, env = c.host, c.env

    @app.callback(
        Output("feat-key", "data"), Output("feat-status", "children"),
        Input("feat-run", "n_clicks"), State("feat-sae", "value"), State("feat-latent", "value"),
        State("feat-dataset", "value"), State("feat-texts", "value"), State("feat-top", "value"),
        **background("feat", interval=500))
    def run_features(set_progress, _, ref, latent, dataset, texts, top):
        """``analysis.feature_run`` of the latent over the texts on the loaded model: progress, cancel and
        the time limit between batches of texts."""
        try:
            top = check_int(top, "a number of contexts", 1, MAX_FEATURE_CONTEXTS)
            if latent is None:
                raise InputError("expected a latent: click a row of the table of latents or type its index")
            texts = inputs.feature_texts(dataset, texts)
            sae, _ = stored_sae(c, ref)
            latent = check_int(latent, "a latent", 0, sae.d_sae - 1)
            sm = host.get()
            key = cache_key("features", sm.name, ref, latent, texts, top)
            run, hit, key, cut = cached_reading(host, key, lambda: analysis.feature_run(
                sm, sae, latent, texts, top=top, ref=ref, progress=ticker(set_progress), should_stop=should_stop,
                deadline=env.deadline), env.deadline, "; this is what it had (choose fewer texts)")
            rep = run.report
            return {"key": key}, ok(
                f"Latent {rep.latent} of {ref} at {rep.site}: density {rep.density:.3g} over {rep.n_tokens} tokens of "
                f"{count(run.texts, 'text')}, {count(rep.contexts, 'context')}; "
                + ("from the cache." if hit else f"computed in {run.seconds:.1f}s.") + cut)
        except Exception as e:  # noqa: BLE001
            return no_update, explain(e)

    @app.callback(Output("feat-contexts", "children"), Output("feat-figure", "figure"), Input("feat-key", "data"))
    def draw_features(data):
        run = host.result(key_of(data))
        if not isinstance(run, analysis.FeatureRun):
            m = "Pick a latent and press Compute to read it over the texts."
            return note(m), figures.empty_figure(m)
        return context_rows(run), figures.feature_figure(run.report, stopped=run.stopped_at_deadline)
