"""The Patching page: a clean and a corrupted prompt, two answer tokens and a hook grid ->
activation and / or attribution patching (:func:`steerkit.apps.analysis.patching_run`) as a heatmap;
a clicked cell's detail (a layer over positions, or one head patched at each position)."""
from __future__ import annotations


from dash import Input, Output, State, ctx, no_update

from steerkit.errors import InputError

from .. import analysis, figures
from ..data import (
    MAX_ANSWER_CHARS, MAX_FIELD_CHARS, MAX_PATCH_PROMPT_CHARS, MAX_PATCH_SITES, PATCH_HOOKS, PATCH_METHODS,
    check_choice, check_int, check_text,
)
from ..runtime import cache_key, should_stop
from .common import Context, background, explain, key_of, ok, ticker


def clicked_cell(click):
    """``(layer, column)`` of a heatmap click (whole numbers in range), or ``None``."""
    try:
        pt = click["points"][0]
        layer, col = pt["y"], pt["x"]
        return (check_int(layer, "a layer", 0, MAX_PATCH_SITES), check_int(col, "a column", 0, MAX_PATCH_SITES))
    except (TypeError, KeyError, IndexError, InputError):
        return None


def run_message(run, hit: bool, note: str) -> str:
    n_l, n_c = len(run.layers_requested), len(run.columns())
    cols = ("head" if run.by_head else "position") + ("s" if n_c != 1 else "")
    return (f"{run.hook}: {n_l} layer{'s' if n_l != 1 else ''} × {n_c} {cols}; logit({run.answer!r}) "
            f"− logit({run.wrong!r}) is {run.clean_metric:.3f} clean, {run.corrupted_metric:.3f} corrupted; "
            + ("from the cache." if hit else f"computed in {run.seconds:.1f}s.") + note
            + ("" if run.can_normalize else " The clean and corrupted metrics are equal, so the values are "
               "shown as logit differences, not as a restored fraction."))


def register(app, c: Context) -> None:
    """Wire the Patching page."""
    host, env = c.host, c.env

    @app.callback(
        Output("patch-key", "data"), Output("patch-status", "children"), Output("patch-heatmap", "clickData"),
        Input("patch-run", "n_clicks"),
        State("patch-clean", "value"), State("patch-corrupted", "value"), State("patch-answer", "value"),
        State("patch-wrong", "value"), State("patch-hook", "value"), State("patch-layers", "value"),
        State("patch-method", "value"), **background("patch"))
    def run_patching(set_progress, _, clean, corrupted, answer, wrong, hook, layers, method):
        try:
            clean = check_text(clean, "the clean prompt", MAX_PATCH_PROMPT_CHARS)
            corrupted = check_text(corrupted, "the corrupted prompt", MAX_PATCH_PROMPT_CHARS)
            answer = check_text(answer, "the answer", MAX_ANSWER_CHARS)
            wrong = check_text(wrong, "the wrong answer", MAX_ANSWER_CHARS)
            hook = check_choice(hook, "a hook grid", PATCH_HOOKS)
            method = check_choice(method, "a method", PATCH_METHODS)
            layers = check_text(layers, "a layer selection", MAX_FIELD_CHARS).strip() or "all"
            sm = host.get()
            key = cache_key("patching", sm.name, clean, corrupted, answer, wrong, hook, layers, method)
            run, hit = host.cached(key, lambda: analysis.patching_run(
                sm, clean, corrupted, answer, wrong, hook, layers=layers, method=method,
                progress=ticker(set_progress), should_stop=should_stop, deadline=env.deadline))
            note = ""
            if run.stopped_at_deadline:  # a grid cut short is not what these settings give
                key = host.keep_partial(key, run)
                n_done = len(run.activation.layers) if run.activation is not None else 0
                note = (f" Stopped at the time limit of {env.deadline:g} s per request after {n_done} of "
                        f"{len(run.layers_requested)} layers; this is what it had (choose fewer layers).")
            return {"key": key}, ok(run_message(run, hit, note)), None
        except Exception as e:  # noqa: BLE001
            return no_update, explain(e), no_update

    def current_run(data):
        run = host.result(key_of(data))
        return run if isinstance(run, analysis.PatchingRun) else None

    def normalized_for(run, scale):
        return scale == "normalized" and run.can_normalize

    @app.callback(Output("patch-heatmap", "figure"), Input("patch-key", "data"), Input("patch-scale", "value"),
                  Input("patch-heatmap", "clickData"))
    def draw_patching(data, scale, click):
        run = current_run(data)
        if run is None:
            return figures.empty_figure("Enter a clean and a corrupted prompt and press Compute to patch.")
        cell = clicked_cell(click) if ctx.triggered_id != "patch-key" else None
        return figures.patching_run_figure(run, normalized=normalized_for(run, scale), selected=cell)

    @app.callback(
        Output("patch-detail", "figure"), Output("patch-detail-status", "children"),
        Input("patch-heatmap", "clickData"), Input("patch-scale", "value"), Input("patch-key", "data"),
        background=True, prevent_initial_call=True, interval=400,
        running=[(Output("patch-detail-progress", "style"), {"width": "120px", "visibility": "visible"},
                  {"width": "120px", "visibility": "hidden"})],
    )
    def patch_detail(click, scale, data):
        """The clicked cell's detail: a position grid's layer over positions, or a head patched at each
        position separately (computed on click)."""
        try:
            run = current_run(data)
            cell = clicked_cell(click)
            if run is None or cell is None or ctx.triggered_id == "patch-key":
                return figures.empty_figure("Click a cell of the heatmap to see its per-position detail."), ""
            layer, col = cell
            norm = normalized_for(run, scale)
            if layer not in run.layers_requested:
                raise InputError(f"expected a layer of the grid ({run.layers_requested[0]}.."
                                 f"{run.layers_requested[-1]}), found {layer}")
            if not run.by_head:
                fig = figures.patching_detail_figure(run, layer, normalized=norm)
                return fig, ok(f"Layer {layer}: {run.hook} patched at each of {len(run.tokens)} positions.")
            sm = host.get()
            if run.model_name != sm.name:
                raise InputError(f"expected the model the grid was computed on ({run.model_name}), found {sm.name} "
                                 "loaded; press Compute again")
            key = cache_key("patch-head", key_of(data), layer, col)
            det, hit = host.cached(key, lambda: analysis.head_detail(sm, run, layer, col))
            return figures.head_detail_figure(det, normalized=norm), ok(
                f"Head L{layer}H{col} patched at each of {len(det.tokens)} positions separately"
                + (" (from the cache)." if hit else "."))
        except Exception as e:  # noqa: BLE001
            return figures.empty_figure("No detail for this cell"), explain(e)
