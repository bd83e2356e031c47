"""The Steer page: a direction (the Profiles page's mean difference, or a stored steering vector,
direction set, region or conditional steering), baseline and steered generations side by side,
streamed, tokens coloured by their projection.

Every steering goes through an artifact's own ``to_interventions(sm.facts, scale=strength)``
(:func:`steerkit.apps.analysis.steer_setting`): a stored artifact keeps its hook site, positions and
operation, the layer box selects among its layers; the profile's mean difference is built into a
:class:`~steerkit.vectors.SteeringVector` (or a direction set, to ablate) at the layers of the box first.
"""
from __future__ import annotations

from dash import Input, Output, State, ctx, html, no_update
from dash.exceptions import PreventUpdate

from steerkit.errors import InputError
from steerkit.storage.naming import is_index

from .. import analysis, figures
from ..data import MAX_FIELD_CHARS, MAX_NEW_TOKENS, MAX_STEER_PROMPT_CHARS, MAX_STRENGTH, check_int, check_number, check_text
from ..layout import PANE
from ..runtime import cache_key, should_stop
from .common import HIDDEN, Context, background, explain, layer_text, note, ok

#: the stored kinds the Steer page lists
STEER_KINDS = ("steering_vector", "direction_set", "region", "conditional_steering")


def resolve_direction(c: Context, value):
    """A Steer-page direction value as ``(direction, label)``: a stored artifact (checked against the
    loaded model), or the profile's mean difference at a layer as ``{layer: vector}``."""
    if not value:
        raise InputError("expected a direction: compute a profile and click \"Use this layer's mean "
                         "difference\", or pick an artifact from the store")
    kind, _, ref = check_text(value, "a direction", MAX_FIELD_CHARS).partition(":")
    sm = c.host.get()
    if kind == "profile":
        key, _, layer = ref.rpartition(":")
        prof = c.host.result(key)
        if not isinstance(prof, analysis.DivergenceProfile) or prof.mean_diff is None:
            raise InputError("expected the profile behind this direction in the cache, found it evicted; "
                             "compute the profile again")
        if prof.model_name and prof.model_name != sm.name:
            raise InputError(f"expected a direction of the current model {sm.name}, found one computed on "
                             f"{prof.model_name}; compute the profile again on this model")
        if not is_index(layer) or int(layer) not in prof.layers:  # str.isdigit() passes "²", which int() refuses
            raise InputError(f"expected a layer of the profile ({prof.layers[0]}..{prof.layers[-1]}), found "
                             f"{layer[:20]!r}")
        layer = int(layer)
        return {layer: prof.mean_diff[prof.layers.index(layer)]}, f"profile mean difference @ L{layer}"
    if kind == "store":
        art = c.stored(ref, STEER_KINDS, "a steering vector, direction set, region or conditional steering")
        label = f"{ref} (direction set, k={art.k})" if art.kind == "direction_set" else ref
        return art, label
    raise InputError(f"expected a direction from the profile or the store, found {value[:80]!r}")


def setting_for(c: Context, artifact, layers, op, strength):
    """The Steer page's settings as interventions (:func:`steerkit.apps.analysis.steer_setting`) and a
    label for the direction."""
    direction, label = resolve_direction(c, artifact)
    if strength is None:
        raise InputError("expected a strength, found none")
    strength = check_number(strength, "a strength", MAX_STRENGTH)
    layers = check_text(layers, "a layer selection", MAX_FIELD_CHARS)
    if not isinstance(op, str):
        raise InputError(f"expected an operation in {analysis.OPERATIONS}, found {type(op).__name__}")
    return analysis.steer_setting(c.host.get(), direction, layers or None, operation=op, strength=strength), label


def default_layers(direction) -> str:
    """The layer box for a picked direction: the layers it acts at (``all`` for a direction set that
    acts everywhere)."""
    if isinstance(direction, dict):
        return layer_text(sorted(direction))
    if getattr(direction, "kind", None) == "direction_set" and direction.layers is None:
        return "all"
    if getattr(direction, "kind", None) == "conditional_steering":
        return layer_text(sorted({l for r in direction.rules for l in default_layers_of(r.behavior)}))
    return layer_text(default_layers_of(direction))


def default_layers_of(art) -> list[int]:
    layer = getattr(art, "layer", None)
    return [layer] if layer is not None else list(getattr(art, "layers", None) or [])


def render_tokens(tokens, values, scale):
    cols = figures.token_colors(values, scale)
    return [html.Span(t, title=f"{v:+.3f}", style={"background": c}) for t, v, c in zip(tokens, values, cols)]


def register(app, c: Context) -> None:
    """Wire the Steer page."""
    host, env = c.host, c.env

    @app.callback(Output("steer-artifact", "options"), Output("steer-artifact", "value"),
                  Output("steer-status", "children", allow_duplicate=True),
                  Input("url", "pathname"), Input("direction", "data"), Input("store-refresh", "n_clicks"),
                  State("steer-artifact", "value"), prevent_initial_call="initial_duplicate")
    def steer_options(path, direction, _, current):
        opts, msg = [], None
        if not (isinstance(direction, dict) and isinstance(direction.get("label"), str)
                and isinstance(direction.get("value"), str) and len(direction["label"]) <= MAX_FIELD_CHARS
                and len(direction["value"]) <= MAX_FIELD_CHARS):
            direction = None
        if direction:
            opts.append({"label": direction["label"], "value": direction["value"]})
        try:
            opts += c.store_options(STEER_KINDS, lambda ref: f"store:{ref}")
        except Exception as e:  # noqa: BLE001
            msg = explain(e)
        values = [o["value"] for o in opts]
        if ctx.triggered_id == "direction" and direction:
            value = direction["value"]
        else:
            value = current if current in values else (values[0] if values else None)
        if not opts and msg is None:
            msg = note(["No direction yet — compute a profile and click “Use this layer's mean difference”, "
                        "or save one to the store (", html.Code("steerkit vectors import FILE --name NAME"), ")."])
        return opts, value, msg if msg is not None else no_update

    @app.callback(Output("steer-layers", "value"), Input("steer-artifact", "value"), prevent_initial_call=True)
    def steer_default_layers(value):
        if not value:
            raise PreventUpdate
        try:
            direction, _ = resolve_direction(c, value)
        except Exception:  # noqa: BLE001
            raise PreventUpdate from None
        return default_layers(direction)

    @app.callback(Output("steer-op", "options"), Input("steer-artifact", "value"))
    def steer_operations(value):
        """The operation box builds a profile direction; a stored artifact brings its own operation."""
        own = isinstance(value, str) and value.startswith("store:")
        return [{"label": f" {op} ", "value": op, "disabled": own} for op in analysis.OPERATIONS]

    @app.callback(
        Output("steer-base", "children"), Output("steer-steered", "children"), Output("steer-status", "children"),
        Input("steer-run", "n_clicks"), Input("steer-strength", "value"),
        State("steer-artifact", "value"), State("steer-layers", "value"), State("steer-op", "value"),
        State("steer-prompt", "value"), State("steer-max", "value"),
        **background("steer", interval=300, progress=[
            Output("steer-base-live", "children"), Output("steer-steered-live", "children"),
            Output("steer-progress", "value"), Output("steer-progress", "max")], running=[
            (Output("steer-base", "style"), HIDDEN, PANE), (Output("steer-steered", "style"), HIDDEN, PANE),
            (Output("steer-base-live", "style"), PANE, HIDDEN), (Output("steer-steered-live", "style"), PANE, HIDDEN)]),
    )
    def run_steer(set_progress, n_clicks, strength, artifact, layers, op, prompt, max_new):
        try:
            max_new = check_int(max_new, "a number of new tokens", 1, MAX_NEW_TOKENS)
            prompt = check_text(prompt, "a prompt", MAX_STEER_PROMPT_CHARS)
            sm = host.get()
            setting, label = setting_for(c, artifact, layers, op, strength)
            key = cache_key("steer", sm.name, artifact, setting.layers, setting.everywhere, setting.operation, setting.strength,
                            prompt, max_new)
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
            where = ("every write into the residual stream (all layers)" if res.everywhere
                     else f"layers {', '.join(map(str, res.layers))}")
            msg = ok(f"{label} at {where}: {res.description}" + (" (from the cache)." if hit else ".")
                     + (f" Stopped at the time limit of {env.deadline:g} s per request after "
                        f"{max(len(res.baseline_tokens), len(res.steered_tokens))} tokens; this is what it had."
                        if res.stopped_at_deadline else ""))
            return (render_tokens(res.baseline_tokens, res.baseline_proj, scale),
                    render_tokens(res.steered_tokens, res.steered_proj, scale), msg)
        except Exception as e:  # noqa: BLE001
            return no_update, no_update, explain(e)
