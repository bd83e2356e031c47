"""Thin callbacks: read inputs, call :mod:`.data` (parsing, built-in contrasts), :mod:`.analysis`
(computations, through the model host's cache) and :mod:`.io` (saved results), hand results to
:mod:`.figures`. No user input is evaluated; every failure becomes a message in the page.

No request is trusted: every value a callback receives is checked where it is used (type, size,
count; the ``MAX_*`` limits of :mod:`.data`), picker values name only files of the results folder
(read through :class:`steerkit.files.Folder` by :mod:`.io`) or models the picker listed, and model
work stops at the per-request time limit.
"""
from __future__ import annotations

import base64
import io
import json
import re
import sys
import tempfile
import time
import traceback
import zipfile
from pathlib import Path

import numpy as np
from dash import Input, Output, State, ctx, dcc, html, no_update
from dash.exceptions import PreventUpdate

from steerkit.errors import InputError, SteerkitError
from steerkit.files import Folder
from steerkit.probes.tune import heatmap_figure, tradeoff_figure
from steerkit.vectors import FORMATS, DirectionSet, SteeringVector, Store, check_compatible, export

from . import analysis, figures
from . import data as inputs
from . import io as saved
from .analysis import Cancelled
from .data import (
    ATTN_VIEWS, MAX_ANSWER_CHARS, MAX_BUILTIN_PAIRS, MAX_FIELD_CHARS, MAX_MODEL_PATH_CHARS,
    MAX_NEW_TOKENS, MAX_PATCH_PROMPT_CHARS, MAX_PATCH_SITES, MAX_STEER_PROMPT_CHARS, MAX_STRENGTH, MAX_TUNE_LAYERS,
    MAX_TUNE_NEW_TOKENS, PATCH_HOOKS, PATCH_METHODS, UPLOAD_MAX_BYTES, check_choice, check_int, check_number,
    check_text,
)
from .layout import (
    CONTRASTS, DEFAULT_MODEL_VALUE, FIGURES, PAGES, PANE, TUNE_DAMAGE_LABELS, TUNE_METRIC_LABELS,
    TUNE_NORMALIZE_LABELS, layer_marks, model_label, model_options,
)
from .runtime import cache_key, should_stop

#: characters of an uploaded file's name kept for messages and labels
MAX_NAME_CHARS = 200
SPREADS = ("std", "range", "none")

HIDDEN = {"display": "none"}
SHOWN_PROGRESS = {"width": "220px", "visibility": "visible"}
HIDDEN_PROGRESS = {"width": "220px", "visibility": "hidden"}


def _warn(text):
    return html.Span(["⚠ ", text], style={"color": "#b00020"}, className="error-message")


def _ok(text):
    return html.Span(text, style={"color": "#1b5e20"}, className="ok-message")


def explain(e: BaseException):
    """A message for the page: what went wrong, never a traceback (that goes to the server log).

    Every :class:`steerkit.errors.SteerkitError` (input, model, vectors, kernels, serving errors
    alike) is shown as its message; anything else is logged with its traceback and named."""
    if isinstance(e, Cancelled):
        return html.Span("Cancelled.", style={"color": "#666"}, className="cancel-message")
    if isinstance(e, SteerkitError):
        return _warn(str(e))
    traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
    return _warn(f"Unexpected error ({type(e).__name__}): {str(e)[:300]}")


def _name(filename) -> str:
    return filename[:MAX_NAME_CHARS] if isinstance(filename, str) and filename else "upload"


def _too_big(n_bytes: int):
    return InputError(f"expected a file of at most {UPLOAD_MAX_BYTES >> 10} KiB, found {n_bytes >> 10} KiB")


def _decode_upload(contents, filename):
    """The text of an upload component's ``contents`` (a ``data:...;base64,`` URL), at most
    ``UPLOAD_MAX_BYTES`` decoded: checked here, where the value is read, whoever sent it."""
    if not contents:
        raise PreventUpdate
    filename = _name(filename)
    if not isinstance(contents, str):
        raise InputError(f"expected an uploaded file as a data URL, found {type(contents).__name__}")
    # base64 is 4 characters per 3 bytes: refuse an oversize value before decoding it
    if len(contents) > 4 * (UPLOAD_MAX_BYTES // 3 + 1) + 1024:
        raise _too_big(len(contents) * 3 // 4)
    try:
        _, b64 = contents.split(",", 1)
        data = base64.b64decode(b64, validate=False)
    except Exception:
        raise InputError(f"expected an uploaded file, could not decode {filename!r}") from None
    if len(data) > UPLOAD_MAX_BYTES:
        raise _too_big(len(data))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"expected a UTF-8 text file (.txt, .json, .jsonl, .csv), found binary data in "
                         f"{filename!r}") from None


def _key_of(data):
    """The result key a ``dcc.Store`` holds (``{"key": ...}``), or ``None`` for anything else."""
    if isinstance(data, dict) and isinstance(data.get("key"), str) and len(data["key"]) <= 64:
        return data["key"]
    return None


def _selected_row(sel, rows):
    """The selected row of the store table (a dict with a text ``ref``), or ``None``."""
    if not isinstance(sel, list) or not sel or not isinstance(rows, list):
        return None
    i = sel[0]
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(rows):
        return None
    r = rows[i]
    return r if isinstance(r, dict) and isinstance(r.get("ref"), str) and len(r["ref"]) <= MAX_FIELD_CHARS else None


def _uploaded(data):
    """``(name, text)`` of the sweep upload store, each bounded, or ``None``."""
    if not isinstance(data, dict) or not isinstance(data.get("text"), str):
        return None
    text = data["text"]
    if len(text) > UPLOAD_MAX_BYTES or len(text.encode("utf-8", "replace")) > UPLOAD_MAX_BYTES:
        raise _too_big(len(text.encode("utf-8", "replace")) if len(text) <= 4 * UPLOAD_MAX_BYTES else len(text))
    return _name(data.get("name")), text


def _count(items, noun: str) -> str:
    """``"3 layers"``, ``"1 layer"``: how many ``items``, with the noun."""
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"


def _layer(value):
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def time_limit(seconds: float, what: str):
    """A ``should_stop`` for one request: true when the job was cancelled; past ``seconds`` it
    raises an :class:`InputError` naming the limit (the computation stops between batches)."""
    end = time.monotonic() + seconds

    def stop():
        if should_stop():
            return True
        if time.monotonic() > end:
            raise InputError(f"expected {what} to finish within the time limit of {seconds:g} s per request, found "
                             "it still running; ask for fewer pairs or prompts")
        return False
    return stop


def register(app, env):
    """Wire every callback of the app. ``env``: the :class:`~steerkit.apps.app.AppEnv`."""
    host = env.host

    # ------------------------------------------------------------------ navigation
    @app.callback([Output(f"page-{p.strip('/')}", "style") for p, _ in PAGES]
                  + [Output(f"nav-{p.strip('/')}", "style") for p, _ in PAGES],
                  Input("url", "pathname"))
    def route(path):
        path = path if isinstance(path, str) and path in dict(PAGES) else "/profiles"
        styles = [None if p == path else HIDDEN for p, _ in PAGES]
        nav = [{"marginRight": "18px", "textDecoration": "none", "fontWeight": "bold" if p == path else "normal",
                "borderBottom": "2px solid #1f77b4" if p == path else "none"} for p, _ in PAGES]
        return styles + nav

    # ------------------------------------------------------------------ model
    @app.callback(
        Output("model-label", "children"), Output("model-status", "children"), Output("prof-layer", "max"),
        Output("prof-layer", "marks"), Output("prof-key", "data", allow_duplicate=True),
        Output("model-path", "value"), Output("model-pick", "options"), Output("model-pick", "value"),
        Input("model-load", "n_clicks"), State("model-pick", "value"), State("model-path", "value"),
        background=True, prevent_initial_call=True,
        running=[(Output("model-load", "disabled"), True, False),
                 (Output("model-progress", "style"), {"width": "120px", "visibility": "visible"},
                  {"width": "120px", "visibility": "hidden"})],
    )
    def load_model(_, picked, path):
        """Load a model the picker listed (the embedded default, the Hugging Face cache,
        ``$STEERKIT_MODELS``, the start-up model, paths typed before) or the path typed in the box;
        a picker value naming anything else is refused."""
        try:
            typed = check_text(path, "a model folder, .gguf file or hub id", MAX_MODEL_PATH_CHARS).strip()
            if typed:
                if any(c in typed for c in "\n\r\x00"):
                    raise InputError("expected a model folder, .gguf file or hub id on one line, found a line break "
                                     "or a NUL character")
                spec = typed
            else:
                values = [o["value"] for o in model_options(env.listed_models())]
                if not isinstance(picked, str) or picked not in values:
                    raise InputError("expected one of the models listed in the picker (or a folder, .gguf file or "
                                     "hub id typed into the box next to it), found another value; pick one from "
                                     "the list")
                spec = None if picked == DEFAULT_MODEL_VALUE else picked
            sm = host.switch(spec)
            value = DEFAULT_MODEL_VALUE if spec is None else spec
            if typed:  # a typed path: list it, so the picker shows it and can pick it again
                env.allow_model(value, f"{sm.name} ({spec})")
            options = model_options(env.listed_models(), value)
            return (model_label(sm), _ok(f"Loaded {sm.name} in {host.load_seconds:.1f}s: {sm.n_layers} layers, "
                                         f"d_model {sm.d_model}. Every page now uses it."),
                    max(0, sm.n_layers - 1), layer_marks(sm.n_layers), None, "", options, value)
        except Exception as e:  # noqa: BLE001 - a model that does not load keeps the current one
            return no_update, [explain(e), html.Span(f" The current model ({host.get().name}) stays loaded.")], \
                no_update, no_update, no_update, no_update, no_update, no_update

    # ------------------------------------------------------------------ profiles
    @app.callback(Output("prof-custom", "style"), Input("prof-contrast", "value"))
    def show_custom(contrast):
        return {"display": "block", "marginTop": "10px"} if contrast == "custom" else HIDDEN

    for side in ("a", "b"):
        @app.callback(Output(f"prof-{side}", "value"), Output("prof-status", "children", allow_duplicate=True),
                      Input(f"prof-upload-{side}", "contents"), State(f"prof-upload-{side}", "filename"),
                      prevent_initial_call=True)
        def upload(contents, filename, side=side):
            try:
                text = _decode_upload(contents, filename)
                prompts = inputs.parse_prompt_text(text, f"upload {side.upper()}")
                return "\n".join(prompts), _ok(f"Read {len(prompts)} prompts from {filename} into list {side.upper()}.")
            except PreventUpdate:
                raise
            except Exception as e:  # noqa: BLE001
                return no_update, explain(e)

    def steer_spec(artifact, layers, op, strength):
        return {"artifact": artifact, "layers": layers, "op": op, "strength": strength}

    def resolve_direction(artifact_value):
        """A Steer-page direction value as ``({layer: vector}, label)`` or ``(DirectionSet, label)``."""
        if not artifact_value:
            raise InputError("expected a direction: compute a profile and click \"Use this layer's mean "
                             "difference\", or pick an artifact from the store")
        kind, _, ref = check_text(artifact_value, "a direction", MAX_FIELD_CHARS).partition(":")
        sm = host.get()
        if kind == "profile":
            key, _, layer = ref.rpartition(":")
            prof = host.result(key)
            if prof is None or prof.mean_diff is None:
                raise InputError("expected the profile behind this direction in the cache, found it evicted; "
                                 "compute the profile again")
            if prof.model_name and prof.model_name != sm.name:
                raise InputError(f"expected a direction of the current model {sm.name}, found one computed on "
                                 f"{prof.model_name}; compute the profile again on this model")
            if not layer.isdigit() or int(layer) not in prof.layers:
                raise InputError(f"expected a layer of the profile ({prof.layers[0]}..{prof.layers[-1]}), found "
                                 f"{layer[:20]!r}")
            layer = int(layer)
            return {layer: prof.mean_diff[prof.layers.index(layer)]}, f"profile mean difference @ L{layer}"
        if kind == "store":
            art = Store(env.store_path).load(ref)
            check_compatible(art, sm)
            if isinstance(art, SteeringVector):
                eff = art.effective()
                return {l: d.float().numpy() for l, d in eff.directions.items()}, ref
            if isinstance(art, DirectionSet):
                return art, f"{ref} (direction set, k={art.k})"
            raise InputError(f"expected a steering vector or direction set, found a {art.kind} ({ref})")
        raise InputError(f"expected a direction from the profile or the store, found {artifact_value[:80]!r}")

    def setting_for(artifact, layers, op, strength):
        """The Steer page's settings as interventions (:func:`analysis.steer_setting`)."""
        direction, label = resolve_direction(artifact)
        if strength is None:
            raise InputError("expected a strength, found none")
        strength = check_number(strength, "a strength", MAX_STRENGTH)
        layers = check_text(layers, "a layer selection", MAX_FIELD_CHARS)
        if not isinstance(op, str):
            raise InputError(f"expected an operation in {analysis.OPERATIONS}, found {type(op).__name__}")
        return analysis.steer_setting(host.get(), direction, layers or None, operation=op, strength=strength), label

    def edit_for(artifact, layers, op, strength):
        """A context-manager factory applying the Steer page settings to every row (steered contrast)."""
        sm = host.get()
        setting, _ = setting_for(artifact, layers, op, strength)
        return lambda: sm.steer(setting.interventions, label="steered contrast (A side)")

    @app.callback(
        Output("prof-key", "data"), Output("prof-status", "children"),
        Input("prof-run", "n_clicks"),
        State("prof-contrast", "value"), State("prof-n", "value"), State("prof-a", "value"), State("prof-b", "value"),
        State("steer-artifact", "value"), State("steer-layers", "value"), State("steer-op", "value"),
        State("steer-strength", "value"),
        background=True, prevent_initial_call=True, interval=400,
        progress=[Output("prof-progress", "value"), Output("prof-progress", "max")],
        running=[(Output("prof-run", "disabled"), True, False), (Output("prof-cancel", "disabled"), False, True),
                 (Output("prof-progress", "style"), SHOWN_PROGRESS, HIDDEN_PROGRESS)],
        cancel=[Input("prof-cancel", "n_clicks")],
    )
    def run_profile(set_progress, n_clicks, contrast, n, text_a, text_b, artifact, layers, op, strength):
        try:
            n = check_int(n, "a number of pairs", 1, MAX_BUILTIN_PAIRS)
            if not isinstance(contrast, str) or contrast not in CONTRASTS:
                raise InputError(f"expected a contrast in {list(CONTRASTS)}, found {str(contrast)[:40]!r}")
            sm = host.get()
            edit_a = None
            extra = None
            if contrast == "temporal":
                a, b = inputs.temporal_pairs(n)
            elif contrast == "harmful":
                a, b = inputs.refusal_pairs(n)
            elif contrast == "steered":
                a = b = inputs.refusal_pairs(n)[1]  # the same harmless prompts, A steered
                edit_a = edit_for(artifact, layers, op, strength)
                extra = steer_spec(artifact, layers, op, strength)
            elif contrast == "custom":
                a = inputs.parse_prompt_text(text_a or "", "list A")
                b = inputs.parse_prompt_text(text_b or "", "list B")
            else:
                raise InputError(f"expected a contrast, found {contrast!r}")
            a, b = inputs.check_pairs(a, b)
            key = cache_key("profile", sm.name, contrast, a, b, extra)

            def prog(done, total):
                set_progress((str(done), str(total)))

            stop = time_limit(env.deadline, f"a divergence profile of {len(a)} pairs")
            prof, hit = host.cached(key, lambda: analysis.divergence_profile(
                sm, a, b, contrast=contrast, edit_a=edit_a, progress=prog, should_stop=stop))
            msg = (f"{CONTRASTS[contrast]}: {prof.n_pairs} pairs × {len(prof.layers)} layers; peak relative divergence at layer "
                   f"{prof.peak_layer} ({prof.rel_mean[prof.peak_index]:.3f}); "
                   + ("from the cache." if hit else f"computed in {prof.seconds:.1f}s."))
            return {"key": key}, _ok(msg)
        except Exception as e:  # noqa: BLE001
            return no_update, explain(e)

    def current_profile(data):
        return host.result(_key_of(data))

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
        return figures.profile_figure(prof, spread=spread, auroc=au, auroc_layers=al, selected_layer=_layer(layer))

    @app.callback(Output("prof-pairs", "figure"), Output("prof-lens", "figure"), Input("prof-key", "data"),
                  Input("prof-layer", "value"))
    def draw_layer(data, layer):
        prof = current_profile(data)
        if prof is None:
            m = figures.empty_figure("Click a layer in the profile to see its per-pair values.")
            return m, figures.empty_figure("Logit-lens tokens of the mean difference appear here.")
        layer = prof.peak_layer if _layer(layer) not in prof.layers else layer
        j = prof.layers.index(layer)
        lens = (figures.lens_figure(prof.lens_top[j], prof.lens_bottom[j], layer=layer) if prof.lens_top
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

    @app.callback(Output("direction", "data"), Output("prof-dir-status", "children"),
                  Input("prof-use-dir", "n_clicks"), State("prof-key", "data"), State("prof-layer", "value"),
                  prevent_initial_call=True)
    def use_direction(_, data, layer):
        prof = current_profile(data)
        if prof is None:
            return no_update, _warn("Compute a profile first.")
        if _layer(layer) not in prof.layers:
            return no_update, _warn(f"Pick a layer of the profile ({prof.layers[0]}..{prof.layers[-1]}) first.")
        return ({"value": f"profile:{data['key']}:{layer}", "label": f"profile ({prof.contrast}) mean difference @ L{layer}",
                 "layer": layer},
                _ok(f"The mean difference at layer {layer} is now available on the Steer page."))

    @app.callback(Output("prof-dir-status", "children", allow_duplicate=True), Input("prof-save", "n_clicks"),
                  State("prof-key", "data"), State("prof-layer", "value"), State("prof-save-name", "value"),
                  prevent_initial_call=True)
    def save_direction(_, data, layer, name):
        prof = current_profile(data)
        if prof is None:
            return _warn("Compute a profile first.")
        try:
            if _layer(layer) not in prof.layers:
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
            ref = Store(env.store_path).save((name or "").strip(), sv)
            return _ok(f"Saved {ref} to {env.store_path}.")
        except Exception as e:  # noqa: BLE001
            return explain(e)

    # ------------------------------------------------------------------ steer
    @app.callback(Output("steer-artifact", "options"), Output("steer-artifact", "value"),
                  Output("steer-status", "children", allow_duplicate=True),
                  Input("url", "pathname"), Input("direction", "data"), Input("store-refresh", "n_clicks"),
                  State("steer-artifact", "value"), prevent_initial_call="initial_duplicate")
    def steer_options(path, direction, _, current):
        opts, note = [], None
        if not (isinstance(direction, dict) and isinstance(direction.get("label"), str)
                and isinstance(direction.get("value"), str) and len(direction["label"]) <= MAX_FIELD_CHARS
                and len(direction["value"]) <= MAX_FIELD_CHARS):
            direction = None
        if direction:
            opts.append({"label": direction["label"], "value": direction["value"]})
        try:
            for row in Store(env.store_path).list(all_versions=False):
                if row.get("kind") in ("steering_vector", "direction_set"):
                    opts.append({"label": f"{row['ref']} ({row.get('kind')}, {row.get('method') or '?'})",
                                 "value": f"store:{row['ref']}"})
        except Exception as e:  # noqa: BLE001
            note = explain(e)
        values = [o["value"] for o in opts]
        if ctx.triggered_id == "direction" and direction:
            value = direction["value"]
        else:
            value = current if current in values else (values[0] if values else None)
        if not opts and note is None:
            note = html.Span(["No direction yet — compute a profile and click “Use this layer's mean difference”, "
                              "or save one to the store (", html.Code("steerkit vectors import FILE --name NAME"),
                              ")."], style={"color": "#666"})
        return opts, value, note if note is not None else no_update

    @app.callback(Output("steer-layers", "value"), Input("steer-artifact", "value"), prevent_initial_call=True)
    def steer_default_layers(value):
        if not value:
            raise PreventUpdate
        try:
            direction, _ = resolve_direction(value)
        except Exception:  # noqa: BLE001
            raise PreventUpdate from None
        if isinstance(direction, DirectionSet):  # its own layers, or everywhere
            ls = direction.layers
            if ls is None:
                return "all"
        else:
            ls = sorted(direction)
        if len(ls) > 1 and ls == list(range(ls[0], ls[-1] + 1)):
            return f"{ls[0]}-{ls[-1]}"
        return ",".join(map(str, ls))

    def render_tokens(tokens, values, scale):
        cols = figures.token_colors(values, scale)
        return [html.Span(t, title=f"{v:+.3f}", style={"background": c}) for t, v, c in zip(tokens, values, cols)]

    @app.callback(
        Output("steer-base", "children"), Output("steer-steered", "children"), Output("steer-status", "children"),
        Input("steer-run", "n_clicks"), Input("steer-strength", "value"),
        State("steer-artifact", "value"), State("steer-layers", "value"), State("steer-op", "value"),
        State("steer-prompt", "value"), State("steer-max", "value"),
        background=True, prevent_initial_call=True, interval=300,
        progress=[Output("steer-base-live", "children"), Output("steer-steered-live", "children"),
                  Output("steer-progress", "value"), Output("steer-progress", "max")],
        running=[(Output("steer-run", "disabled"), True, False), (Output("steer-cancel", "disabled"), False, True),
                 (Output("steer-progress", "style"), SHOWN_PROGRESS, HIDDEN_PROGRESS),
                 (Output("steer-base", "style"), HIDDEN, PANE), (Output("steer-steered", "style"), HIDDEN, PANE),
                 (Output("steer-base-live", "style"), PANE, HIDDEN),
                 (Output("steer-steered-live", "style"), PANE, HIDDEN)],
        cancel=[Input("steer-cancel", "n_clicks")],
    )
    def run_steer(set_progress, n_clicks, strength, artifact, layers, op, prompt, max_new):
        try:
            max_new = check_int(max_new, "a number of new tokens", 1, MAX_NEW_TOKENS)
            prompt = check_text(prompt, "a prompt", MAX_STEER_PROMPT_CHARS)
            sm = host.get()
            setting, label = setting_for(artifact, layers, op, strength)
            key = cache_key("steer", sm.name, artifact, setting.layers, setting.everywhere, setting.operation,
                            setting.strength, prompt, max_new)
            texts = ["", ""]
            state = {"n": 0}

            def stream(row, text):
                texts[row] = text
                state["n"] += 1
                if state["n"] % 3 == 0:
                    set_progress((texts[0], texts[1], str(state["n"]), str(2 * max_new)))

            res, hit = host.cached(key, lambda: analysis.steer_compare(
                sm, prompt, setting, max_new_tokens=max_new, stream=stream, should_stop=should_stop,
                label=label, deadline=env.deadline))
            if res.stopped_at_deadline:
                host.forget(key)  # a cut generation is not what these settings give
            scale = max([abs(x) for x in res.baseline_proj + res.steered_proj] or [1.0]) or 1.0
            desc = {"add": f"+ {res.strength:g} × v", "ablate": "v ablated",
                    "clamp": f"projection clamped to {res.strength:g}"}[res.operation]
            where = ("every write into the residual stream (all layers)" if res.everywhere
                     else f"layers {', '.join(map(str, res.layers))}")
            msg = _ok(f"{label} at {where}: {desc}" + (" (from the cache)." if hit else ".")
                      + (f" Stopped at the time limit of {env.deadline:g} s per request after "
                         f"{max(len(res.baseline_tokens), len(res.steered_tokens))} tokens; this is what it had."
                         if res.stopped_at_deadline else ""))
            return (render_tokens(res.baseline_tokens, res.baseline_proj, scale),
                    render_tokens(res.steered_tokens, res.steered_proj, scale), msg)
        except Exception as e:  # noqa: BLE001
            return no_update, no_update, explain(e)

    # ------------------------------------------------------------------ patching
    @app.callback(
        Output("patch-key", "data"), Output("patch-status", "children"), Output("patch-heatmap", "clickData"),
        Input("patch-run", "n_clicks"),
        State("patch-clean", "value"), State("patch-corrupted", "value"), State("patch-answer", "value"),
        State("patch-wrong", "value"), State("patch-hook", "value"), State("patch-layers", "value"),
        State("patch-method", "value"),
        background=True, prevent_initial_call=True, interval=400,
        progress=[Output("patch-progress", "value"), Output("patch-progress", "max")],
        running=[(Output("patch-run", "disabled"), True, False), (Output("patch-cancel", "disabled"), False, True),
                 (Output("patch-progress", "style"), SHOWN_PROGRESS, HIDDEN_PROGRESS)],
        cancel=[Input("patch-cancel", "n_clicks")],
    )
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
                progress=lambda d, t: set_progress((str(d), str(t))), should_stop=should_stop,
                deadline=env.deadline))
            note = ""
            if run.stopped_at_deadline:  # a grid cut short is not what these settings give
                host.forget(key)
                key = host.put(cache_key("patching-partial", key, time.time()), run)
                n_done = len(run.activation.layers) if run.activation is not None else 0
                note = (f" Stopped at the time limit of {env.deadline:g} s per request after {n_done} of "
                        f"{len(run.layers_requested)} layers; this is what it had (choose fewer layers).")
            n_l, n_c = len(run.layers_requested), len(run.columns())
            cols = ("head" if run.by_head else "position") + ("s" if n_c != 1 else "")
            msg = (f"{run.hook}: {n_l} layer{'s' if n_l != 1 else ''} × {n_c} {cols}; logit({run.answer!r}) "
                   f"− logit({run.wrong!r}) is {run.clean_metric:.3f} clean, {run.corrupted_metric:.3f} corrupted; "
                   + ("from the cache." if hit else f"computed in {run.seconds:.1f}s.") + note
                   + ("" if run.can_normalize else " The clean and corrupted metrics are equal, so the values are "
                      "shown as logit differences, not as a restored fraction."))
            return {"key": key}, _ok(msg), None
        except Exception as e:  # noqa: BLE001
            return no_update, explain(e), no_update

    def current_run(data):
        run = host.result(_key_of(data))
        return run if isinstance(run, analysis.PatchingRun) else None

    def normalized_for(run, scale):
        return scale == "normalized" and run.can_normalize

    def clicked_cell(click):
        """``(layer, column)`` of a heatmap click (whole numbers in range), or ``None``."""
        try:
            pt = click["points"][0]
            layer, col = pt["y"], pt["x"]
            return (check_int(layer, "a layer", 0, MAX_PATCH_SITES), check_int(col, "a column", 0, MAX_PATCH_SITES))
        except (TypeError, KeyError, IndexError, InputError):
            return None

    @app.callback(Output("patch-heatmap", "figure"), Input("patch-key", "data"), Input("patch-scale", "value"),
                  Input("patch-heatmap", "clickData"))
    def draw_patching(data, scale, click):
        run = current_run(data)
        if run is None:
            return figures.empty_figure("Enter a clean and a corrupted prompt and press Compute to patch.")
        cell = clicked_cell(click) if ctx.triggered_id != "patch-key" else None
        return figures.patching_figure(run, normalized=normalized_for(run, scale), selected=cell)

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
                return fig, _ok(f"Layer {layer}: {run.hook} patched at each of {len(run.tokens)} positions.")
            sm = host.get()
            if run.model_name != sm.name:
                raise InputError(f"expected the model the grid was computed on ({run.model_name}), found {sm.name} "
                                 "loaded; press Compute again")
            key = cache_key("patch-head", _key_of(data), layer, col)
            det, hit = host.cached(key, lambda: analysis.head_detail(sm, run, layer, col))
            return figures.head_detail_figure(det, normalized=norm), _ok(
                f"Head L{layer}H{col} patched at each of {len(det.tokens)} positions separately"
                + (" (from the cache)." if hit else "."))
        except Exception as e:  # noqa: BLE001
            return figures.empty_figure("No detail for this cell"), explain(e)

    # ------------------------------------------------------------------ attention
    @app.callback(
        Output("attn-key", "data"), Output("attn-status", "children"),
        Input("attn-run", "n_clicks"), Input("attn-layer", "value"), State("attn-prompt", "value"),
        background=True, prevent_initial_call=True, interval=400,
        progress=[Output("attn-progress", "value"), Output("attn-progress", "max")],
        running=[(Output("attn-run", "disabled"), True, False), (Output("attn-cancel", "disabled"), False, True),
                 (Output("attn-progress", "style"), SHOWN_PROGRESS, HIDDEN_PROGRESS)],
        cancel=[Input("attn-cancel", "n_clicks")],
    )
    def run_attention(set_progress, _, layer, prompt):
        try:
            prompt = check_text(prompt, "the prompt", MAX_PATCH_PROMPT_CHARS)
            sm = host.get()
            layer = check_int(layer, "a layer", 0, sm.n_layers - 1)
            key = cache_key("attention", sm.name, prompt, layer)
            att, hit = host.cached(key, lambda: analysis.attention_patterns(sm, prompt, layer))
            return {"key": key}, _ok(f"Layer {att.layer}: {att.n_heads} heads × {len(att.tokens)} tokens"
                                     + (" (from the cache)." if hit else "."))
        except Exception as e:  # noqa: BLE001
            return no_update, explain(e)

    @app.callback(Output("attn-pattern", "figure"), Input("attn-key", "data"), Input("attn-head", "value"),
                  Input("attn-view", "value"))
    def draw_attention(data, head, view):
        att = host.result(_key_of(data))
        if not isinstance(att, analysis.AttentionPatterns):
            return figures.empty_figure("Pick a layer and press Compute to see the attention pattern.")
        try:
            view = check_choice(view, "a view", ATTN_VIEWS)
            if view == "all":
                return figures.attention_figure(att)
            return figures.attention_figure(att, check_int(head, "a head", 0, att.n_heads - 1))
        except InputError as e:
            return figures.empty_figure(str(e))

    # ------------------------------------------------------------------ tune
    def store_refs(kinds) -> list[dict]:
        """Dropdown options of the store's newest artifacts of ``kinds`` (value: the ref)."""
        return [{"label": f"{row['ref']} ({row.get('kind')}, {row.get('method') or '?'})", "value": row["ref"]}
                for row in Store(env.store_path).list(all_versions=False) if row.get("kind") in kinds]

    def stored(ref, kinds, what: str):
        """The stored artifact ``ref`` (one of ``kinds``), checked against the loaded model."""
        ref = check_text(ref, what, MAX_FIELD_CHARS).strip()
        if not ref:
            raise InputError(f"expected {what} from the store, found none; save one to the store first "
                             "(the Profiles page, or steerkit vectors import FILE --name NAME)")
        art = Store(env.store_path).load(ref)
        if art.kind not in kinds:
            raise InputError(f"expected {what} ({' or '.join(kinds)}), found a {art.kind} ({ref})")
        check_compatible(art, host.get())
        return art

    def current_tune(data):
        run = host.result(_key_of(data))
        return run if isinstance(run, analysis.TuneRun) else None

    def tune_selection(cell, data):
        """``(layer, scale)`` of the ``tune-cell`` store when it names a cell of the current result."""
        if not (isinstance(cell, dict) and cell.get("key") == _key_of(data)):
            return None
        run, layer, scale = current_tune(data), cell.get("layer"), cell.get("scale")
        if run is None or isinstance(layer, bool) or not isinstance(layer, int) \
                or saved.tune_cell(run.result, layer, scale) is None:
            return None
        return layer, float(scale)

    @app.callback(Output("tune-artifact", "options"), Output("tune-artifact", "value"),
                  Output("tune-probe", "options"), Output("tune-probe", "value"),
                  Input("url", "pathname"), Input("tune-rescan", "n_clicks"), Input("store-refresh", "n_clicks"),
                  Input("prof-dir-status", "children"), State("tune-artifact", "value"), State("tune-probe", "value"))
    def tune_artifacts(path, _, __, ___, current, probe):
        try:
            dirs, probes = store_refs(("steering_vector", "direction_set")), store_refs(("probe",))
        except Exception:  # noqa: BLE001 - an unreadable store lists nothing; the Store page says why
            dirs, probes = [], []
        dv, pv = [o["value"] for o in dirs], [o["value"] for o in probes]
        return (dirs, current if current in dv else (dv[0] if dv else None),
                probes, probe if probe in pv else (pv[0] if pv else None))

    @app.callback(Output("tune-layers", "value"), Input("tune-artifact", "value"), prevent_initial_call=True)
    def tune_default_layers(ref):
        """The grid's layers for a picked artifact: its own layers (at most ``MAX_TUNE_LAYERS``), or
        the five layers around its one layer."""
        try:
            art = stored(ref, ("steering_vector", "direction_set"), "a direction")
        except Exception:  # noqa: BLE001
            raise PreventUpdate from None
        n = host.get().n_layers
        ls = list(getattr(art, "layers", None) or [])
        if len(ls) == 1:
            ls = list(range(max(0, ls[0] - 2), min(n - 1, ls[0] + 2) + 1))
        elif not ls:
            ls = list(range(max(0, n // 2 - 2), min(n - 1, n // 2 + 2) + 1))
        ls = ls[:MAX_TUNE_LAYERS]
        if len(ls) > 1 and ls == list(range(ls[0], ls[-1] + 1)):
            return f"{ls[0]}-{ls[-1]}"
        return ",".join(map(str, ls))

    def tune_concept(kind, words, absent, probe):
        """The concept of a tune (``steerkit.probes.tune.tune``'s ``concept``) and a label for it."""
        kind = check_choice(kind, "what scores the concept", ("words", "probe"))
        if kind == "probe":
            return stored(probe, ("probe",), "a probe"), f"probe {probe}"
        contains, missing = inputs.tune_words(words, "words"), inputs.tune_words(absent, "absent words")
        if not contains and not missing:
            raise InputError("expected words that show the concept (like 'wedding, love'), found none; type some or "
                             "pick a stored probe")
        return {"contains": contains, "absent": missing}, {"contains": contains, "absent": missing}

    @app.callback(
        Output("tune-key", "data"), Output("tune-status", "children"),
        Input("tune-run", "n_clicks"),
        State("tune-artifact", "value"), State("tune-layers", "value"), State("tune-scales", "value"),
        State("tune-max", "value"), State("tune-normalize", "value"), State("tune-prompts", "value"),
        State("tune-neutral", "value"), State("tune-concept-kind", "value"), State("tune-words", "value"),
        State("tune-absent", "value"), State("tune-probe", "value"),
        background=True, prevent_initial_call=True, interval=500,
        progress=[Output("tune-progress", "value"), Output("tune-progress", "max")],
        running=[(Output("tune-run", "disabled"), True, False), (Output("tune-cancel", "disabled"), False, True),
                 (Output("tune-progress", "style"), SHOWN_PROGRESS, HIDDEN_PROGRESS)],
        cancel=[Input("tune-cancel", "n_clicks")],
    )
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
            art = stored(ref, ("steering_vector", "direction_set"), "a direction")
            concept, concept_key = tune_concept(kind, words, absent, probe)
            key = cache_key("tune", sm.name, ref, layers, scales, max_new, normalize, prompts, neutral, concept_key)
            run, hit = host.cached(key, lambda: analysis.tune_run(
                sm, art, prompts, layers=layers, scales=scales, concept=concept, neutral=neutral,
                max_new_tokens=max_new, normalize=None if normalize == "none" else normalize,
                progress=lambda d, t: set_progress((str(d), str(t))), should_stop=should_stop,
                deadline=env.tune_deadline))
            note = ""
            if run.stopped_at_deadline:  # a grid cut short is not what these settings give
                host.forget(key)
                key = host.put(cache_key("tune-partial", key, time.time()), run)
                note = (f" Stopped at the time limit of {env.tune_deadline:g} s after {len(run.result['layers'])} of "
                        f"{len(layers)} layers; this is what it had (choose fewer layers, scales, prompts or tokens).")
            rec = run.recommended
            msg = (f"{ref}: {_count(run.result['layers'], 'layer')} × {_count(run.result['scales'], 'scale')} on "
                   f"{_count(prompts, 'prompt')}; "
                   + (f"recommended: layer {rec['layer']}, scale {rec['scale']:g}; " if rec else
                      "no cell is within the damage bounds (no recommendation); ")
                   + ("from the cache." if hit else f"computed in {run.seconds:.1f}s.") + note)
            return {"key": key}, _ok(msg)
        except Exception as e:  # noqa: BLE001
            return no_update, explain(e)

    @app.callback(Output("tune-file", "options"), Input("url", "pathname"), Input("tune-rescan", "n_clicks"),
                  Input("tune-save-status", "children"))
    def tune_files(*_):
        return [{"label": rel, "value": rel} for rel in saved.scan_tunes(env.results_path)]

    @app.callback(Output("tune-key", "data", allow_duplicate=True), Output("tune-file-status", "children"),
                  Input("tune-file", "value"), Input("tune-load", "n_clicks"), prevent_initial_call=True)
    def load_tune(rel, _):
        """A saved tune result of the results folder (read through ``steerkit.files.Folder``)."""
        if not rel:
            if ctx.triggered_id == "tune-load":
                return no_update, _warn("Pick a saved tune result from the list first.")
            raise PreventUpdate
        try:
            res = saved.read_tune(env.results_path, rel)
            key = host.put(cache_key("tune-file", rel, time.time()), analysis.TuneRun(res, source=rel))
            rec = res.get("recommended")
            return {"key": key}, _ok(f"{rel}: {_count(res['layers'], 'layer')} × {_count(res['scales'], 'scale')} on "
                                     f"{_count(res['prompts'], 'prompt')} ({res.get('concept_kind', '?')} concept); "
                                     + (f"recommended: layer {rec['layer']}, scale {rec['scale']:g}." if rec
                                        else "no recommended cell."))
        except Exception as e:  # noqa: BLE001
            return no_update, explain(e)

    @app.callback(Output("tune-save-status", "children"), Input("tune-save", "n_clicks"), State("tune-key", "data"),
                  State("tune-save-name", "value"), prevent_initial_call=True)
    def save_tune(_, data, name):
        """Write the shown result as ``NAME_tune.json`` into the results folder (``Folder.write_bytes``)."""
        run = current_tune(data)
        if run is None:
            return _warn("Run a tune or load one first.")
        try:
            name = check_text(name, "a file name", MAX_FIELD_CHARS).strip()
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}", name):
                raise InputError(f"expected a file name of letters, digits, '_', '.' and '-' (at most 100, starting "
                                 f"with a letter or digit), found {name[:40]!r}")
            rel = f"{name}_tune.json"
            Folder(env.results_path).write_bytes(rel, json.dumps(run.result, allow_nan=False).encode("utf-8"))
            return _ok(f"Saved {rel} in {env.results_path}.")
        except Exception as e:  # noqa: BLE001
            return explain(e)

    @app.callback(Output("tune-cell", "data"), Input("tune-key", "data"), Input("tune-tradeoff", "clickData"),
                  Input("tune-heatmap", "clickData"), State("tune-damage", "value"))
    def select_tune_cell(data, click_curves, click_heatmap, damage):
        """The cell shown below the figures: a clicked point or cell, else the recommended cell (or the
        first cell of the Pareto front, or the first cell)."""
        run = current_tune(data)
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
        run = current_tune(data)
        if run is None:
            m = "Run a tune or load a saved result to see its trade-off curves and heatmap."
            return figures.empty_figure(m), figures.empty_figure(m)
        try:
            damage = check_choice(damage, "a damage axis", tuple(TUNE_DAMAGE_LABELS))
            metric = check_choice(metric, "a heatmap metric", tuple(TUNE_METRIC_LABELS))
        except InputError as e:
            return figures.empty_figure(str(e)), figures.empty_figure(str(e))
        try:
            curves, heat = tradeoff_figure(run.result, damage=damage), heatmap_figure(run.result, metric)
        except (InputError, ValueError, TypeError, KeyError) as e:  # a result these figures cannot draw
            m = f"Could not draw this tune result ({type(e).__name__}: {str(e)[:200]})"
            return figures.empty_figure(m), figures.empty_figure(m)
        sel = tune_selection(cell, data)
        if sel is not None:
            figures.mark_tune_tradeoff(curves, run.result, *sel, damage=damage)
            figures.mark_tune_heatmap(heat, run.result, *sel)
        if run.stopped_at_deadline:
            for f in (curves, heat):
                f.update_layout(title=f"{f.layout.title.text} (stopped at the time limit)")
        for f in (curves, heat):
            f.update_layout(clickmode="event", height=420)
        return curves, heat

    @app.callback(Output("tune-table", "data"), Output("tune-cell-status", "children"), Input("tune-cell", "data"),
                  State("tune-key", "data"))
    def tune_table(cell, data):
        """The selected cell's generations next to the baseline's, one row per prompt."""
        run = current_tune(data)
        sel = tune_selection(cell, data) if run is not None else None
        c = saved.tune_cell(run.result, *sel) if sel is not None else None
        if c is None:
            return [], html.Span("Click a point or a cell to see its generations next to the baseline's.",
                                 style={"color": "#666"})
        res = run.result
        rec = res.get("recommended") or {}
        tags = [t for t, on in (("recommended", rec.get("layer") == c["layer"] and saved.tune_cell(
            res, rec.get("layer"), rec.get("scale")) is c), ("on the Pareto front", c.get("pareto"))) if on]

        def num(v, fmt=".3g"):
            return "—" if v is None else format(v, fmt)
        lo, hi = c["concept_ci"]
        msg = (f"Layer {c['layer']}, scale {c['scale']:g}" + (f" ({', '.join(tags)})" if tags else "")
               + f": concept {num(c['concept'])} [{num(lo)}, {num(hi)}] (baseline "
               f"{num(res['baseline'].get('concept'))}), KL {num(c.get('kl'))}, perplexity {num(c.get('perplexity'))}"
               f" (× {num(c.get('ppl_ratio'))}), repetition {num(c.get('repetition'), '.2f')}; "
               f"{_count(res['prompts'], 'prompt')}.")
        return figures.tune_rows(res, c["layer"], c["scale"]), _ok(msg)

    # ------------------------------------------------------------------ store
    @app.callback(Output("store-table", "data"), Output("store-path", "children"), Output("store-status", "children"),
                  Output("store-table", "selected_rows"),
                  Input("store-refresh", "n_clicks"), Input("url", "pathname"), Input("prof-dir-status", "children"),
                  State("store-table", "selected_rows"), State("store-table", "data"))
    def store_rows(_, path, __, selected, old_rows):
        label = f"store: {env.store_path}"
        # a refresh keeps the selected artifact selected (a reset selection made a later export fail)
        row = _selected_row(selected, old_rows)
        sel_ref = row["ref"] if row else None
        try:
            st = Store(env.store_path)
            rows = st.list() if Path(env.store_path).exists() else []
            out = []
            for r in rows[:300]:
                layers, metrics = "", ""
                try:
                    meta = st.show(r["ref"]).get("meta", {})
                    m = (meta.get("provenance") or {}).get("metrics") or {}
                    metrics = ", ".join(f"{k}={v:.3g}" if isinstance(v, (int, float)) else f"{k}={v}"
                                        for k, v in list(m.items())[:4])
                    if len(rows) <= 60:
                        art = st.load(r["ref"])
                        ls = getattr(art, "layers", None)
                        ls = ls if ls is not None else ([art.layer] if getattr(art, "layer", None) is not None else [])
                        layers = ",".join(map(str, ls))
                except Exception:  # noqa: BLE001
                    pass
                out.append({"ref": r["ref"], "kind": r.get("kind"), "layers": layers, "method": r.get("method"),
                            "model": r.get("model_name"), "metrics": metrics, "tags": ",".join(r.get("tags", [])),
                            "created": (r.get("created_at") or r.get("saved_at") or "")[:19]})
            if not out:
                msg = html.Span(["No artifacts in this store yet — save one from the Profiles page, or ",
                                 html.Code("steerkit vectors import FILE --name NAME"), "."], style={"color": "#666"})
            else:
                msg = f"{len(out)} artifact versions."
            if out == (old_rows if isinstance(old_rows, list) else []):
                # unchanged: leave the table (and a selection made since this request left) alone
                return no_update, label, msg, no_update
            refs = [r["ref"] for r in out]
            return out, label, msg, ([refs.index(sel_ref)] if sel_ref in refs else [])
        except Exception as e:  # noqa: BLE001
            return [], label, explain(e), []

    @app.callback(Output("store-detail", "children"), Input("store-table", "selected_rows"), State("store-table", "data"))
    def store_detail(sel, data):
        row = _selected_row(sel, data)
        if row is None:
            return "Select an artifact to see its provenance."
        try:
            info = Store(env.store_path).show(row["ref"])
            return json.dumps(info, indent=1, default=str)[:20000]
        except Exception as e:  # noqa: BLE001
            return f"could not read it: {e}"

    @app.callback(Output("download-export", "data"), Output("store-export-status", "children"),
                  Input("store-export", "n_clicks"), State("store-table", "selected_rows"), State("store-table", "data"),
                  State("store-format", "value"), prevent_initial_call=True)
    def store_export(_, sel, data, fmt):
        row = _selected_row(sel, data)
        if row is None:
            return no_update, _warn("Select an artifact in the table first.")
        if not fmt or not isinstance(fmt, str) or fmt not in FORMATS:
            return no_update, _warn("Choose an export format from the list first.")
        try:
            ref = row["ref"]
            art = Store(env.store_path).load(ref)
            ext = {"llama.cpp": ".gguf", "repeng": ".gguf", "easysteer": ".gguf", "easysteer-v1": ".gguf", "tlens": ".json", "svec": ".svec",
                   "safetensors": ".safetensors"}.get(fmt, ".bin")
            stem = ref.replace("@", "_v")
            with tempfile.TemporaryDirectory() as d:
                paths = export(art, fmt, Path(d) / f"{stem}{ext}", model=host.get())
                if len(paths) == 1:
                    blob, fname = Path(paths[0]).read_bytes(), Path(paths[0]).name
                else:
                    buf = io.BytesIO()
                    with zipfile.ZipFile(buf, "w") as z:
                        for p in paths:
                            z.write(p, Path(p).name)
                    blob, fname = buf.getvalue(), f"{stem}_{fmt}.zip"
            return dcc.send_bytes(blob, fname), _ok(f"Exported {ref} as {fmt} ({fname}, {len(blob)} bytes).")
        except Exception as e:  # noqa: BLE001
            return no_update, explain(e)

    # ------------------------------------------------------------------ downloads
    @app.callback(Output("download-fig", "data"), [Input(f"dl-{g}", "n_clicks") for g in FIGURES],
                  [State(g, "figure") for g in FIGURES], prevent_initial_call=True)
    def download_figure(*args):
        n = len(FIGURES)
        clicks, figs = args[:n], args[n:]
        gid = str(ctx.triggered_id or "")[3:]
        if gid not in FIGURES or not any(clicks):
            raise PreventUpdate
        fig = figs[list(FIGURES).index(gid)]
        if not fig or not isinstance(fig, dict):
            raise PreventUpdate
        import plotly.graph_objects as go
        try:
            page = figures.to_html(go.Figure(fig))
        except (ValueError, TypeError, KeyError):  # not a figure this app drew
            raise PreventUpdate from None
        return dcc.send_string(page, f"{FIGURES[gid]}.html")

    # ------------------------------------------------------------------ probes
    @app.callback(Output("probe-file", "options"), Output("probe-file", "value"),
                  Input("url", "pathname"), Input("probe-rescan", "n_clicks"), Input("probe-upload-data", "data"),
                  State("probe-file", "value"))
    def probe_files(path, _, uploaded, current):
        opts = [{"label": rel, "value": rel} for rel in saved.scan_sweeps(env.results_path)]
        try:
            uploaded = _uploaded(uploaded)
        except InputError:
            uploaded = None
        if uploaded:
            opts.insert(0, {"label": f"uploaded: {uploaded[0]}", "value": "upload"})
        values = [o["value"] for o in opts]
        if ctx.triggered_id == "probe-upload-data" and uploaded:
            return opts, "upload"
        return opts, current if current in values else (values[0] if values else None)

    @app.callback(Output("probe-upload-data", "data"), Output("probe-status", "children", allow_duplicate=True),
                  Input("probe-upload", "contents"), State("probe-upload", "filename"), prevent_initial_call=True)
    def probe_upload(contents, filename):
        try:
            text = _decode_upload(contents, filename)
            saved.parse_sweep(text, _name(filename))
            return {"name": _name(filename), "text": text}, no_update
        except PreventUpdate:
            raise
        except Exception as e:  # noqa: BLE001
            return no_update, explain(e)

    @app.callback(Output("probe-heatmap", "figure"), Output("probe-status", "children"),
                  Output("probe-method", "options"), Output("probe-method", "value"),
                  Input("probe-file", "value"), Input("probe-method", "value"), State("probe-upload-data", "data"))
    def probe_heatmap(value, method, uploaded):
        if not value:
            msg = html.Span(["No probe sweep results yet — run ", html.Code("steerkit probe sweep --pos P --neg N "
                             f"--out {env.results_path}/NAME_sweep.json"), " (or save a ", html.Code("steerkit.probes"),
                             " sweep with ", html.Code(".save('..._sweep.json')"), ") under ", html.Code(env.results_path),
                             ", or upload a sweep table here."], style={"color": "#666"})
            return figures.empty_figure("No probe sweep yet"), msg, [], None
        try:
            method = method if ctx.triggered_id == "probe-method" else None
            if method is not None and not isinstance(method, str):
                raise InputError(f"expected a method name, found {type(method).__name__}")
            up = _uploaded(uploaded) if value == "upload" else None
            if up is not None:
                sw = saved.parse_sweep(up[1], up[0], method=method)
            else:
                sw = saved.read_sweep(env.results_path, value, method=method)
            best = sw.best_per_layer()
            i = int(np.nanargmax(best))
            opts = [{"label": m, "value": m} for m in sw.methods]
            what = f" ({sw.method})" if sw.method else ""
            return (figures.probe_heatmap(sw), _ok(f"{sw.name}{what}: {len(sw.layers)} layers × {len(sw.positions)} "
                                                   f"positions; best AUROC {best[i]:.3f} at layer {sw.layers[i]}."),
                    opts, sw.method or None)
        except Exception as e:  # noqa: BLE001
            return figures.empty_figure("Could not read this sweep"), explain(e), [], None

    # ------------------------------------------------------------------ diagnostics
    @app.callback(
        Output("diag-key", "data"), Output("diag-status", "children"),
        Input("diag-run", "n_clicks"), State("diag-prompts", "value"),
        background=True, prevent_initial_call=True, interval=400,
        progress=[Output("diag-progress", "value"), Output("diag-progress", "max")],
        running=[(Output("diag-run", "disabled"), True, False), (Output("diag-cancel", "disabled"), False, True),
                 (Output("diag-progress", "style"), SHOWN_PROGRESS, HIDDEN_PROGRESS)],
        cancel=[Input("diag-cancel", "n_clicks")],
    )
    def run_diag(set_progress, _, text):
        try:
            prompts = inputs.parse_prompt_text(text or "", "prompts")
            sm = host.get()
            key = cache_key("diag", sm.name, prompts)
            stop = time_limit(env.deadline, f"diagnostics of {len(prompts)} prompts")
            res, hit = host.cached(key, lambda: analysis.layer_diagnostics(
                sm, prompts, progress=lambda d, t: set_progress((str(d), str(t))), should_stop=stop))
            note = f" {res.note}" if res.note else ""
            return {"key": key}, _ok(f"{res.n_prompts} prompts over {len(res.layers)} layers"
                                     + (" (from the cache)." if hit else ".") + note)
        except Exception as e:  # noqa: BLE001
            return no_update, explain(e)

    @app.callback(Output("diag-norm", "figure"), Output("diag-sink", "figure"), Input("diag-key", "data"))
    def draw_diag(data):
        res = host.result(_key_of(data))
        if res is None:
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
                    html.Span(["No MI-per-step results yet — run ", html.Code(
                        f"steerkit mi-peaks --report {env.results_path}/mi_gsm8k.json"),
                        " (or save ", html.Code("MITrajectory.to_dict()"), " as ", html.Code("mi_*.json"), ") under ",
                        html.Code(env.results_path), "."], style={"color": "#666"}))
        try:
            i, _, f = check_text(value, "an MI result", MAX_FIELD_CHARS).partition(":")
            if not (i.isdigit() and len(i) <= 6):
                raise saved.not_a_result("MI result")
            allmi = saved.read_mi_all(env.results_path, f)
            mi = allmi[min(int(i), len(allmi) - 1)]
            toks = [repr(mi.tokens[mi.steps.index(p)]) for p in mi.peaks if mi.tokens and p in mi.steps]
            return figures.mi_figure(mi), _ok(f"{mi.name}: {len(mi.steps)} steps, peaks at {mi.peaks}"
                                              + (f" (tokens {', '.join(toks[:8])})." if toks else "."))
        except Exception as e:  # noqa: BLE001
            return figures.empty_figure("Could not read the MI result"), explain(e)
