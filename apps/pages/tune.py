"""The Tune page: a stored direction over a grid of layers x scales on prompts
(:func:`steerkit.apps.analysis.tune_run`, :func:`steerkit.probes.tune.tune` one layer per call), or a
saved tune result of the results folder; trade-off curves, a metric heatmap, and a clicked cell's
generations next to the baseline's."""
from __future__ import annotations

import json
import re
import time

from dash import Input, Output, State, ctx, no_update
from dash.exceptions import PreventUpdate

from steerkit.errors import InputError
from steerkit.storage.files import Folder

from .. import analysis, figures
from .. import data as inputs
from .. import io as saved
from ..data import MAX_FIELD_CHARS, MAX_TUNE_LAYERS, MAX_TUNE_NEW_TOKENS, check_choice, check_int, check_text
from ..layout import TUNE_DAMAGE_LABELS, TUNE_METRIC_LABELS, TUNE_NORMALIZE_LABELS
from ..runtime import cache_key, should_stop
from .common import (
    DIRECTION_KINDS, Context, background, count, explain, key_of, layer_text, note, ok, ticker, warn,
)


def grid_layers(art, n_layers: int) -> str:
    """The grid's layers for a picked artifact: its own layers (at most ``MAX_TUNE_LAYERS``), or the
    five layers around its one layer (or around the middle)."""
    ls = list(getattr(art, "layers", None) or [])
    if len(ls) == 1:
        ls = list(range(max(0, ls[0] - 2), min(n_layers - 1, ls[0] + 2) + 1))
    elif not ls:
        ls = list(range(max(0, n_layers // 2 - 2), min(n_layers - 1, n_layers // 2 + 2) + 1))
    return layer_text(ls[:MAX_TUNE_LAYERS])


def tune_concept(c: Context, kind, words, absent, probe):
    """The concept of a tune (``steerkit.probes.tune.tune``'s ``concept``) and a label for it."""
    kind = check_choice(kind, "what scores the concept", ("words", "probe"))
    if kind == "probe":
        return c.stored(probe, ("probe",), "a probe"), f"probe {probe}"
    contains, missing = inputs.tune_words(words, "words"), inputs.tune_words(absent, "absent words")
    if not contains and not missing:
        raise InputError("expected words that show the concept (like 'wedding, love'), found none; type some or "
                         "pick a stored probe")
    return {"contains": contains, "absent": missing}, {"contains": contains, "absent": missing}


def cell_message(res: dict, cell: dict) -> str:
    """A cell's numbers next to the baseline's, and whether it is recommended or on the Pareto front."""
    rec = res.get("recommended") or {}
    tags = [t for t, on in (("recommended", rec.get("layer") == cell["layer"] and saved.tune_cell(
        res, rec.get("layer"), rec.get("scale")) is cell), ("on the Pareto front", cell.get("pareto"))) if on]

    def num(v, fmt=".3g"):
        return "—" if v is None else format(v, fmt)
    lo, hi = cell["concept_ci"]
    return (f"Layer {cell['layer']}, scale {cell['scale']:g}" + (f" ({', '.join(tags)})" if tags else "")
            + f": concept {num(cell['concept'])} [{num(lo)}, {num(hi)}] (baseline "
            f"{num(res['baseline'].get('concept'))}), KL {num(cell.get('kl'))}, perplexity "
            f"{num(cell.get('perplexity'))} (× {num(cell.get('ppl_ratio'))}), repetition "
            f"{num(cell.get('repetition'), '.2f')}; {count(res['prompts'], 'prompt')}.")


def register(app, c: Context) -> None:
    """Wire the Tune page."""
    register_grid(app, c)
    register_results(app, c)


def current_tune(c: Context, data):
    run = c.host.result(key_of(data))
    return run if isinstance(run, analysis.TuneRun) else None


def tune_selection(c: Context, cell, data):
    """``(layer, scale)`` of the ``tune-cell`` store when it names a cell of the current result."""
    if not (isinstance(cell, dict) and cell.get("key") == key_of(data)):
        return None
    run, layer, scale = current_tune(c, data), cell.get("layer"), cell.get("scale")
    if run is None or isinstance(layer, bool) or not isinstance(layer, int) \
            or saved.tune_cell(run.result, layer, scale) is None:
        return None
    return layer, float(scale)


def register_grid(app, c: Context) -> None:
    """The tune's inputs: the stored direction and probe pickers, the grid, the run."""
    host, env = c.host, c.env

    @app.callback(Output("tune-artifact", "options"), Output("tune-artifact", "value"),
                  Output("tune-probe", "options"), Output("tune-probe", "value"),
                  Input("url", "pathname"), Input("tune-rescan", "n_clicks"), Input("store-refresh", "n_clicks"),
                  Input("prof-dir-status", "children"), State("tune-artifact", "value"), State("tune-probe", "value"))
    def tune_artifacts(path, _, __, ___, current, probe):
        try:
            dirs, probes = c.store_options(DIRECTION_KINDS), c.store_options(("probe",))
        except Exception:  # noqa: BLE001 - an unreadable store lists nothing; the Store page says why
            dirs, probes = [], []
        dv, pv = [o["value"] for o in dirs], [o["value"] for o in probes]
        return (dirs, current if current in dv else (dv[0] if dv else None),
                probes, probe if probe in pv else (pv[0] if pv else None))

    @app.callback(Output("tune-layers", "value"), Input("tune-artifact", "value"), prevent_initial_call=True)
    def tune_default_layers(ref):
        try:
            art = c.stored(ref, DIRECTION_KINDS, "a direction")
        except Exception:  # noqa: BLE001
            raise PreventUpdate from None
        return grid_layers(art, host.get().n_layers)

    @app.callback(
        Output("tune-key", "data"), Output("tune-status", "children"),
        Input("tune-run", "n_clicks"),
        State("tune-artifact", "value"), State("tune-layers", "value"), State("tune-scales", "value"),
        State("tune-max", "value"), State("tune-normalize", "value"), State("tune-prompts", "value"),
        State("tune-neutral", "value"), State("tune-concept-kind", "value"), State("tune-words", "value"),
        State("tune-absent", "value"), State("tune-probe", "value"), **background("tune", interval=500))
    def run_tune(set_progress, _, ref, layers, scales, max_new, normalize, prompts, neutral, kind, words, absent,
                 probe):
        """Tune a stored direction over the grid on the loaded model (``analysis.tune_run``: one layer per
        call of ``steerkit.probes.tune.tune``, progress and cancel between layers)."""
        try:
            max_new = check_int(max_new, "a number of new tokens", 1, MAX_TUNE_NEW_TOKENS)
            normalize = check_choice(normalize, "what a scale is", tuple(TUNE_NORMALIZE_LABELS))
            prompts = inputs.tune_prompts(prompts, "prompts")
            neutral = inputs.tune_prompts(neutral, "neutral prompts", allow_empty=True) or None
            scales = inputs.parse_scales(check_text(scales, "the scales", MAX_FIELD_CHARS))
            sm = host.get()
            layers = inputs.tune_layers(check_text(layers, "a layer selection", MAX_FIELD_CHARS), sm.n_layers)
            art = c.stored(ref, DIRECTION_KINDS, "a direction")
            concept, concept_key = tune_concept(c, kind, words, absent, probe)
            key = cache_key("tune", sm.name, ref, layers, scales, max_new, normalize, prompts, neutral, concept_key)
            run, hit = host.cached(key, lambda: analysis.tune_run(
                sm, art, prompts, layers=layers, scales=scales, concept=concept, neutral=neutral,
                max_new_tokens=max_new, normalize=None if normalize == "none" else normalize,
                progress=ticker(set_progress), should_stop=should_stop, deadline=env.tune_deadline))
            cut = ""
            if run.stopped_at_deadline:  # a grid cut short is not what these settings give
                key = host.keep_partial(key, run)
                cut = (f" Stopped at the time limit of {env.tune_deadline:g} s after {len(run.result['layers'])} of "
                        f"{len(layers)} layers; this is what it had (choose fewer layers, scales, prompts or tokens).")
            rec = run.recommended
            msg = (f"{ref}: {count(run.result['layers'], 'layer')} × {count(run.result['scales'], 'scale')} on "
                   f"{count(prompts, 'prompt')}; "
                   + (f"recommended: layer {rec['layer']}, scale {rec['scale']:g}; " if rec else
                      "no cell is within the damage bounds (no recommendation); ")
                   + ("from the cache." if hit else f"computed in {run.seconds:.1f}s.") + cut)
            return {"key": key}, ok(msg)
        except Exception as e:  # noqa: BLE001
            return no_update, explain(e)


def register_results(app, c: Context) -> None:
    """A tune result on the page: loading and saving it, the selected cell, the figures and the table."""
    host, env = c.host, c.env

    @app.callback(Output("tune-file", "options"), Input("url", "pathname"), Input("tune-rescan", "n_clicks"),
                  Input("tune-save-status", "children"))
    def tune_files(*_):
        return [{"label": rel, "value": rel} for rel in saved.scan_tunes(env.results_path)]

    @app.callback(Output("tune-key", "data", allow_duplicate=True), Output("tune-file-status", "children"),
                  Input("tune-file", "value"), Input("tune-load", "n_clicks"), prevent_initial_call=True)
    def load_tune(rel, _):
        """A saved tune result of the results folder (read through ``steerkit.storage.files.Folder``)."""
        if not rel:
            if ctx.triggered_id == "tune-load":
                return no_update, warn("Pick a saved tune result from the list first.")
            raise PreventUpdate
        try:
            res = saved.read_tune(env.results_path, rel)
            key = host.put(cache_key("tune-file", rel, time.time()), analysis.TuneRun(res, source=rel))
            rec = res.get("recommended")
            return {"key": key}, ok(f"{rel}: {count(res['layers'], 'layer')} × {count(res['scales'], 'scale')} on "
                                    f"{count(res['prompts'], 'prompt')} ({res.get('concept_kind', '?')} concept); "
                                    + (f"recommended: layer {rec['layer']}, scale {rec['scale']:g}." if rec
                                       else "no recommended cell."))
        except Exception as e:  # noqa: BLE001
            return no_update, explain(e)

    @app.callback(Output("tune-save-status", "children"), Input("tune-save", "n_clicks"), State("tune-key", "data"),
                  State("tune-save-name", "value"), prevent_initial_call=True)
    def save_tune(_, data, name):
        """Write the shown result as ``NAME_tune.json`` into the results folder (``Folder.write_bytes``)."""
        run = current_tune(c, data)
        if run is None:
            return warn("Run a tune or load one first.")
        try:
            name = check_text(name, "a file name", MAX_FIELD_CHARS).strip()
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}", name):
                raise InputError(f"expected a file name of letters, digits, '_', '.' and '-' (at most 100, starting "
                                 f"with a letter or digit), found {name[:40]!r}")
            rel = f"{name}_tune.json"
            Folder(env.results_path).write_bytes(rel, json.dumps(run.result, allow_nan=False).encode("utf-8"))
            return ok(f"Saved {rel} in {env.results_path}.")
        except Exception as e:  # noqa: BLE001
            return explain(e)

    @app.callback(Output("tune-cell", "data"), Input("tune-key", "data"), Input("tune-tradeoff", "clickData"),
                  Input("tune-heatmap", "clickData"), State("tune-damage", "value"))
    def select_tune_cell(data, click_curves, click_heatmap, damage):
        """The cell shown below the figures: a clicked point or cell, else the recommended cell (or the
        first cell of the Pareto front, or the first cell)."""
        run = current_tune(c, data)
        if run is None:
            return None
        res = run.result
        if ctx.triggered_id in ("tune-tradeoff", "tune-heatmap"):
            click = click_curves if ctx.triggered_id == "tune-tradeoff" else click_heatmap
            try:
                point = click["points"][0]
            except (TypeError, KeyError, IndexError):
                raise PreventUpdate from None
            cell = figures.tune_point(res, point, damage if damage in TUNE_DAMAGE_LABELS else "kl")
            if cell is None:
                raise PreventUpdate
            return {"layer": cell[0], "scale": cell[1], "key": data["key"]}
        first = res.get("recommended") or next((c for c in res["cells"] if c.get("pareto")), res["cells"][0])
        return {"layer": first["layer"], "scale": float(first["scale"]), "key": data["key"]}

    @app.callback(Output("tune-tradeoff", "figure"), Output("tune-heatmap", "figure"), Input("tune-key", "data"),
                  Input("tune-cell", "data"), Input("tune-damage", "value"), Input("tune-metric", "value"))
    def draw_tune(data, cell, damage, metric):
        run = current_tune(c, data)
        if run is None:
            m = "Run a tune or load a saved result to see its trade-off curves and heatmap."
            return figures.empty_figure(m), figures.empty_figure(m)
        try:
            damage = check_choice(damage, "a damage axis", tuple(TUNE_DAMAGE_LABELS))
            metric = check_choice(metric, "a heatmap metric", tuple(TUNE_METRIC_LABELS))
        except InputError as e:
            return figures.empty_figure(str(e)), figures.empty_figure(str(e))
        return figures.tune_figures(run.result, damage, metric, selected=tune_selection(c, cell, data),
                                    stopped=run.stopped_at_deadline)

    @app.callback(Output("tune-table", "data"), Output("tune-cell-status", "children"), Input("tune-cell", "data"),
                  State("tune-key", "data"))
    def tune_table(cell, data):
        """The selected cell's generations next to the baseline's, one row per prompt."""
        run = current_tune(c, data)
        sel = tune_selection(c, cell, data) if run is not None else None
        found = saved.tune_cell(run.result, *sel) if sel is not None else None
        if found is None:
            return [], note("Click a point or a cell to see its generations next to the baseline's.")
        return figures.tune_rows(run.result, found["layer"], found["scale"]), ok(cell_message(run.result, found))
