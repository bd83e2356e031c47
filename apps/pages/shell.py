"""What every page shares on screen: the navigation (the URL shows one page), the model picker (load a
listed model or a typed path; every page then uses it) and the figures' HTML downloads."""
from __future__ import annotations

from dash import Input, Output, State, ctx, dcc, html, no_update
from dash.exceptions import PreventUpdate

from steerkit.errors import InputError

from .. import figures
from ..data import MAX_MODEL_PATH_CHARS, check_text
from ..layout import DEFAULT_MODEL_VALUE, FIGURES, PAGES, layer_marks, model_label, model_options
from .common import HIDDEN, Context, explain, ok


def model_spec(c: Context, picked, path):
    """What to load: the path typed into the box, else a model the picker listed (``None``: the
    default); ``(spec, typed)``. A picker value naming anything else is refused."""
    typed = check_text(path, "a model folder, .gguf file or hub id", MAX_MODEL_PATH_CHARS).strip()
    if typed:
        if any(ch in typed for ch in "\n\r\x00"):
            raise InputError("expected a model folder, .gguf file or hub id on one line, found a line break "
                             "or a NUL character")
        return typed, True
    values = [o["value"] for o in model_options(c.env.listed_models())]
    if not isinstance(picked, str) or picked not in values:
        raise InputError("expected one of the models listed in the picker (or a folder, .gguf file or "
                         "hub id typed into the box next to it), found another value; pick one from "
                         "the list")
    return (None if picked == DEFAULT_MODEL_VALUE else picked), False


def register(app, c: Context) -> None:
    """Wire the navigation, the model picker and the figure downloads."""
    host, env = c.host, c.env

    @app.callback([Output(f"page-{p.strip('/')}", "style") for p, _ in PAGES]
                  + [Output(f"nav-{p.strip('/')}", "style") for p, _ in PAGES],
                  Input("url", "pathname"))
    def route(path):
        path = path if isinstance(path, str) and path in dict(PAGES) else "/profiles"
        styles = [None if p == path else HIDDEN for p, _ in PAGES]
        nav = [{"marginRight": "18px", "textDecoration": "none", "fontWeight": "bold" if p == path else "normal",
                "borderBottom": "2px solid #1f77b4" if p == path else "none"} for p, _ in PAGES]
        return styles + nav

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
        ``$STEERKIT_MODELS``, the start-up model, paths typed before) or the path typed in the box."""
        try:
            spec, typed = model_spec(c, picked, path)
            sm = host.switch(spec)
            value = DEFAULT_MODEL_VALUE if spec is None else spec
            if typed:  # a typed path: list it, so the picker shows it and can pick it again
                env.allow_model(value, f"{sm.name} ({spec})")
            options = model_options(env.listed_models(), value)
            return (model_label(sm), ok(f"Loaded {sm.name} in {host.load_seconds:.1f}s: {sm.n_layers} layers, "
                                        f"d_model {sm.d_model}. Every page now uses it."),
                    max(0, sm.n_layers - 1), layer_marks(sm.n_layers), None, "", options, value)
        except Exception as e:  # noqa: BLE001 - a model that does not load keeps the current one
            return no_update, [explain(e), html.Span(f" The current model ({host.get().name}) stays loaded.")], \
                no_update, no_update, no_update, no_update, no_update, no_update

    @app.callback(Output("download-fig", "data"), [Input(f"dl-{g}", "n_clicks") for g in FIGURES],
                  [State(g, "figure") for g in FIGURES], prevent_initial_call=True)
    def download_figure(*args):
        n = len(FIGURES)
        clicks, figs = args[:n], args[n:]
        gid = str(ctx.triggered_id or "")[3:]
        if gid not in FIGURES or not any(clicks):
            raise PreventUpdate
        fig = figs[list(FIGURES).index(gid)]
        page = figures.figure_page(fig) if fig and isinstance(fig, dict) else None
        if page is None:  # nothing drawn, or not a figure this app drew
            raise PreventUpdate
        return dcc.send_string(page, f"{FIGURES[gid]}.html")
