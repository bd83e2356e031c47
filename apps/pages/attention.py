"""The Attention page: a prompt's ``attn.hook_pattern`` at a layer
(:func:`steerkit.apps.analysis.attention_patterns`), one head or every head of the layer."""
from __future__ import annotations

from dash import Input, Output, State, no_update

from steerkit.errors import InputError

from .. import analysis, figures
from ..data import ATTN_VIEWS, MAX_PATCH_PROMPT_CHARS, check_choice, check_int, check_text
from ..runtime import cache_key
from .common import Context, background, explain, key_of, ok


def register(app, c: Context) -> None:
    """Wire the Attention page."""
    host = c.host

    @app.callback(
        Output("attn-key", "data"), Output("attn-status", "children"),
        Input("attn-run", "n_clicks"), Input("attn-layer", "value"), State("attn-prompt", "value"),
        **background("attn"))
    def run_attention(set_progress, _, layer, prompt):
        try:
            prompt = check_text(prompt, "the prompt", MAX_PATCH_PROMPT_CHARS)
            sm = host.get()
            layer = check_int(layer, "a layer", 0, sm.n_layers - 1)
            key = cache_key("attention", sm.name, prompt, layer)
            att, hit = host.cached(key, lambda: analysis.attention_patterns(sm, prompt, layer))
            return {"key": key}, ok(f"Layer {att.layer}: {att.n_heads} heads × {len(att.tokens)} tokens"
                                    + (" (from the cache)." if hit else "."))
        except Exception as e:  # noqa: BLE001
            return no_update, explain(e)

    @app.callback(Output("attn-pattern", "figure"), Input("attn-key", "data"), Input("attn-head", "value"),
                  Input("attn-view", "value"))
    def draw_attention(data, head, view):
        att = host.result(key_of(data))
        if not isinstance(att, analysis.AttentionPatterns):
            return figures.empty_figure("Pick a layer and press Compute to see the attention pattern.")
        try:
            view = check_choice(view, "a view", ATTN_VIEWS)
            if view == "all":
                return figures.attention_figure(att)
            return figures.attention_figure(att, check_int(head, "a head", 0, att.n_heads - 1))
        except InputError as e:
            return figures.empty_figure(str(e))
