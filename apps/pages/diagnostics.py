"""The Diagnostics page: residual norm and sink attention per layer
(:func:`steerkit.apps.analysis.layer_diagnostics`), and MI per step from ``steerkit mi-peaks --report``
results of the results folder."""
from __future__ import annotations

from dash import Input, Output, State, html, no_update

from steerkit.storage.naming import is_index

from .. import analysis, figures
from .. import data as inputs
from .. import io as saved
from ..data import MAX_FIELD_CHARS, check_text
from ..runtime import cache_key
from .common import Context, background, explain, key_of, note, ok, ticker, time_limit


def register(app, c: Context) -> None:
    """Wire the Diagnostics page."""
    host, env = c.host, c.env

    @app.callback(
        Output("diag-key", "data"), Output("diag-status", "children"),
        Input("diag-run", "n_clicks"), State("diag-prompts", "value"), **background("diag"))
    def run_diag(set_progress, _, text):
        try:
            prompts = inputs.parse_prompt_text(text or "", "prompts")
            sm = host.get()
            key = cache_key("diag", sm.name, prompts)
            # the time limit starts with the model work, not while this job waits for another's
            res, hit = host.cached(key, lambda: analysis.layer_diagnostics(
                sm, prompts, progress=ticker(set_progress),
                should_stop=time_limit(env.deadline, f"diagnostics of {len(prompts)} prompts")))
            extra = f" {res.note}" if res.note else ""
            return {"key": key}, ok(f"{res.n_prompts} prompts over {len(res.layers)} layers"
                                    + (" (from the cache)." if hit else ".") + extra)
        except Exception as e:  # noqa: BLE001
            return no_update, explain(e)

    @app.callback(Output("diag-norm", "figure"), Output("diag-sink", "figure"), Input("diag-key", "data"))
    def draw_diag(data):
        res = host.result(key_of(data))
        if not isinstance(res, analysis.LayerDiagnostics):
            m = "Press Compute to measure residual norms and sink attention."
            return figures.empty_figure(m), figures.empty_figure(m)
        return figures.norm_figure(res), figures.sink_figure(res)

    @app.callback(Output("diag-mi-pick", "options"), Output("diag-mi-pick", "value"), Input("url", "pathname"),
                  State("diag-mi-pick", "value"))
    def mi_options(path, current):
        opts = []
        for rel, n in saved.scan_mi(env.results_path):
            opts += [{"label": f"{rel}" + (f" · #{i}" if n > 1 else ""), "value": f"{i}:{rel}"} for i in range(n)]
        values = [o["value"] for o in opts]
        return opts, current if current in values else (values[0] if values else None)

    @app.callback(Output("diag-mi", "figure"), Output("diag-mi-status", "children"), Input("diag-mi-pick", "value"))
    def draw_mi(value):
        if not value:
            return (figures.empty_figure("No MI results yet"),
                    note(["No MI-per-step results yet — run ", html.Code(
                        f"steerkit mi-peaks --report {env.results_path}/mi_gsm8k.json"),
                        " (or save ", html.Code("MITrajectory.to_dict()"), " as ", html.Code("mi_*.json"), ") under ",
                        html.Code(env.results_path), "."]))
        try:
            i, _, f = check_text(value, "an MI result", MAX_FIELD_CHARS).partition(":")
            if not (is_index(i) and len(i) <= 6):  # str.isdigit() passes "²", which int() refuses
                raise saved.not_a_result("MI result")
            allmi = saved.read_mi_all(env.results_path, f)
            mi = allmi[min(int(i), len(allmi) - 1)]
            toks = [repr(mi.tokens[mi.steps.index(p)]) for p in mi.peaks if mi.tokens and p in mi.steps]
            return figures.mi_figure(mi), ok(f"{mi.name}: {len(mi.steps)} steps, peaks at {mi.peaks}"
                                             + (f" (tokens {', '.join(toks[:8])})." if toks else "."))
        except Exception as e:  # noqa: BLE001
            return figures.empty_figure("Could not read the MI result"), explain(e)
