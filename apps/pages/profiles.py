"""The Profiles page: a contrast (built-in pairs, pasted or uploaded lists, or the Steer page's steering
against none) -> the divergence profile (:func:`steerkit.apps.analysis.divergence_profile`), its
per-pair values and logit-lens tokens at a layer; keep that layer's mean difference for the Steer page
or save it to the store."""
from __future__ import annotations

from dash import Input, Output, State, ctx, no_update
from dash.exceptions import PreventUpdate

from steerkit.errors import InputError
from steerkit.vectors import SteeringVector

from .. import analysis, figures
from .. import data as inputs
from .. import io as saved
from ..data import MAX_BUILTIN_PAIRS, check_int, check_text
from ..layout import CONTRASTS, layer_marks, model_label
from ..runtime import cache_key
from .common import (
    HIDDEN, MAX_NAME_CHARS, Context, background, decode_upload, explain, key_of, layer_value, ok, ticker, time_limit,
    warn,
)
from .steer import setting_for

SPREADS = ("std", "range", "none")


def contrast_prompts(c: Context, contrast, n, text_a, text_b, steering):
    """The A and B prompts of a contrast, the steering of the A side (``None``, or a context-manager
    factory for the steered contrast) and what the cache key needs to know of it."""
    if not isinstance(contrast, str) or contrast not in CONTRASTS:
        raise InputError(f"expected a contrast in {list(CONTRASTS)}, found {str(contrast)[:40]!r}")
    if contrast == "temporal":
        a, b = inputs.temporal_pairs(n)
    elif contrast == "harmful":
        a, b = inputs.refusal_pairs(n)
    elif contrast == "steered":
        a = b = inputs.refusal_pairs(n)[1]  # the same harmless prompts, A steered
        sm = c.host.get()
        setting, _ = setting_for(c, *steering)
        return a, b, (lambda: sm.steer(setting.interventions, label="steered contrast (A side)")), list(steering)
    else:
        a = inputs.parse_prompt_text(text_a or "", "list A")
        b = inputs.parse_prompt_text(text_b or "", "list B")
    return a, b, None, None


def register(app, c: Context) -> None:
    """Wire the Profiles page."""
    host, env = c.host, c.env

    @app.callback(Output("prof-custom", "style"), Input("prof-contrast", "value"))
    def show_custom(contrast):
        return {"display": "block", "marginTop": "10px"} if contrast == "custom" else HIDDEN

    for side in ("a", "b"):
        @app.callback(Output(f"prof-{side}", "value"), Output("prof-status", "children", allow_duplicate=True),
                      Input(f"prof-upload-{side}", "contents"), State(f"prof-upload-{side}", "filename"),
                      prevent_initial_call=True)
        def upload(contents, filename, side=side):
            try:
                text = decode_upload(contents, filename)
                prompts = inputs.parse_prompt_text(text, f"upload {side.upper()}")
                return "\n".join(prompts), ok(f"Read {len(prompts)} prompts from {filename} into list {side.upper()}.")
            except PreventUpdate:
                raise
            except Exception as e:  # noqa: BLE001
                return no_update, explain(e)

    @app.callback(
        Output("prof-key", "data"), Output("prof-status", "children"),
        Input("prof-run", "n_clicks"),
        State("prof-contrast", "value"), State("prof-n", "value"), State("prof-a", "value"), State("prof-b", "value"),
        State("steer-artifact", "value"), State("steer-layers", "value"), State("steer-op", "value"),
        State("steer-strength", "value"), **background("prof"))
    def run_profile(set_progress, n_clicks, contrast, n, text_a, text_b, artifact, layers, op, strength):
        try:
            n = check_int(n, "a number of pairs", 1, MAX_BUILTIN_PAIRS)
            a, b, edit_a, steering = contrast_prompts(c, contrast, n, text_a, text_b, (artifact, layers, op, strength))
            a, b = inputs.check_pairs(a, b)
            sm = host.get()
            key = cache_key("profile", sm.name, contrast, a, b, steering)
            # the time limit starts with the model work, not while this job waits for another's
            prof, hit = host.cached(key, lambda: analysis.divergence_profile(
                sm, a, b, contrast=contrast, edit_a=edit_a, progress=ticker(set_progress),
                should_stop=time_limit(env.deadline, f"a divergence profile of {len(a)} pairs")))
            msg = (f"{CONTRASTS[contrast]}: {prof.n_pairs} pairs × {len(prof.layers)} layers; peak relative divergence at layer "
                   f"{prof.peak_layer} ({prof.rel_mean[prof.peak_index]:.3f}); "
                   + ("from the cache." if hit else f"computed in {prof.seconds:.1f}s."))
            return {"key": key}, ok(msg)
        except Exception as e:  # noqa: BLE001
            return no_update, explain(e)

    def current_profile(data):
        return profile_of(c, data)

    @app.callback(Output("prof-layer", "max", allow_duplicate=True), Output("prof-layer", "marks", allow_duplicate=True),
                  Output("model-label", "children", allow_duplicate=True), Input("prof-key", "data"),
                  prevent_initial_call=True)
    def follow_model(data):
        """The layer slider and the model label follow the model a profile ran on (a model that
        loaded on first use included)."""
        if not host.loaded or current_profile(data) is None:
            raise PreventUpdate
        n = host.get().facts.n_layers
        return max(0, n - 1), layer_marks(n), model_label(host.get())

    def sweep_overlay(prof):
        try:
            for p in saved.scan_sweeps(env.results_path):
                sw = saved.read_sweep(env.results_path, p)
                if sw.model_name and prof.model_name and sw.model_name not in prof.model_name \
                        and prof.model_name not in sw.model_name:
                    continue
                if not set(sw.layers) <= set(prof.layers):  # layers this model does not have: another model's
                    continue
                return sw.best_per_layer(), sw.layers
        except Exception:  # noqa: BLE001 - an unreadable sweep must not break the profile
            pass
        return None, None

    @app.callback(Output("prof-graph", "figure"), Input("prof-key", "data"), Input("prof-spread", "value"),
                  Input("prof-layer", "value"))
    def draw_profile(data, spread, layer):
        prof = current_profile(data)
        if prof is None:
            return figures.empty_figure("Choose a contrast and press Compute to build a divergence profile.")
        au, al = sweep_overlay(prof)
        spread = spread if isinstance(spread, str) and spread in SPREADS else "std"
        return figures.profile_figure(prof, spread=spread, auroc=au, auroc_layers=al, selected_layer=layer_value(layer))

    @app.callback(Output("prof-pairs", "figure"), Output("prof-lens", "figure"), Input("prof-key", "data"),
                  Input("prof-layer", "value"))
    def draw_layer(data, layer):
        prof = current_profile(data)
        if prof is None:
            m = figures.empty_figure("Click a layer in the profile to see its per-pair values.")
            return m, figures.empty_figure("Logit-lens tokens of the mean difference appear here.")
        layer = prof.peak_layer if layer_value(layer) not in prof.layers else layer
        j = prof.layers.index(layer)
        lens = (figures.vector_lens_figure(prof.lens_top[j], prof.lens_bottom[j], layer=layer) if prof.lens_top
                else figures.empty_figure("no logit lens"))
        return figures.pairs_figure(prof, layer), lens

    @app.callback(Output("prof-layer", "value"), Input("prof-graph", "clickData"), Input("prof-key", "data"),
                  prevent_initial_call=True)
    def pick_layer(click, data):
        if ctx.triggered_id == "prof-key":
            prof = current_profile(data)
            if prof is None:
                raise PreventUpdate
            return prof.peak_layer
        try:
            return int(round(float(click["points"][0]["x"])))
        except (TypeError, KeyError, IndexError, ValueError, OverflowError):
            raise PreventUpdate from None

    register_keep(app, c)


def profile_of(c: Context, data):
    """The profile a ``prof-key`` store names, or ``None``."""
    prof = c.host.result(key_of(data))
    return prof if isinstance(prof, analysis.DivergenceProfile) else None


def register_keep(app, c: Context) -> None:
    """Keeping a layer's mean difference: for the Steer page, or in the store."""
    host, env = c.host, c.env

    def current_profile(data):
        return profile_of(c, data)

    @app.callback(Output("direction", "data"), Output("prof-dir-status", "children"),
                  Input("prof-use-dir", "n_clicks"), State("prof-key", "data"), State("prof-layer", "value"),
                  prevent_initial_call=True)
    def use_direction(_, data, layer):
        prof = current_profile(data)
        if prof is None:
            return no_update, warn("Compute a profile first.")
        if layer_value(layer) not in prof.layers:
            return no_update, warn(f"Pick a layer of the profile ({prof.layers[0]}..{prof.layers[-1]}) first.")
        return ({"value": f"profile:{data['key']}:{layer}", "label": f"profile ({prof.contrast}) mean difference @ L{layer}",
                 "layer": layer},
                ok(f"The mean difference at layer {layer} is now available on the Steer page."))

    @app.callback(Output("prof-dir-status", "children", allow_duplicate=True), Input("prof-save", "n_clicks"),
                  State("prof-key", "data"), State("prof-layer", "value"), State("prof-save-name", "value"),
                  prevent_initial_call=True)
    def save_direction(_, data, layer, name):
        prof = current_profile(data)
        if prof is None:
            return warn("Compute a profile first.")
        try:
            if layer_value(layer) not in prof.layers:
                raise InputError(f"expected a layer of the profile ({prof.layers[0]}..{prof.layers[-1]}), found "
                                 f"{str(layer)[:20]!r}")
            name = check_text(name, "a store name", MAX_NAME_CHARS)
            j = prof.layers.index(layer)
            sv = SteeringVector.from_direction(
                prof.mean_diff[j], int(layer), host.get(), method="mean_difference",
                method_params={"contrast": prof.contrast, "n_pairs": prof.n_pairs, "position": "last"},
                prompts=list(prof.prompts_a) + list(prof.prompts_b),
                metrics={"relative_divergence": float(prof.rel_mean[j]), "cosine": float(prof.cos_mean[j]),
                         "peak_layer": prof.peak_layer})
            ref = c.store.save((name or "").strip(), sv)
            return ok(f"Saved {ref} to {env.store_path}.")
        except Exception as e:  # noqa: BLE001
            return explain(e)
