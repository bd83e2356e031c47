"""Layout factories: one function per page, plus the shell (navigation, shared stores, downloads).

All pages live in the layout at once and the URL only toggles which one is visible, so every
component id always exists (no callback-on-missing-component errors) and the stores survive
navigation. Ids are plain strings, prefixed by page (``prof-``, ``probe-``, ``steer-``, ``patch-``,
``attn-``, ``tune-``, ``feat-``, ``store-``, ``diag-``); the browser tests rely on them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from dash import dash_table, dcc, html

from steerkit.vectors import FORMATS

from .data import (
    IOI_ANSWER, IOI_CLEAN, IOI_CORRUPTED, IOI_WRONG, MAX_ANSWER_CHARS, MAX_ATTN_TOKENS, MAX_BUILTIN_PAIRS,
    MAX_CIRCUIT_FEATURE_NODES, MAX_CIRCUIT_LOGITS, MAX_CIRCUIT_PINNED, MAX_CIRCUIT_PROMPT_CHARS, MAX_CIRCUIT_SCALE,
    MAX_CIRCUIT_TOKENS, MAX_DIAG_PROMPTS, MAX_FEATURE_CONTEXTS, MAX_FEATURE_DOC_CHARS, MAX_FEATURE_K, MAX_FEATURE_TEXT_CHARS,
    MAX_FEATURE_TEXTS, MAX_FIELD_CHARS, MAX_MODEL_PATH_CHARS, MAX_NEW_TOKENS, MAX_PATCH_PROMPT_CHARS,
    MAX_PATCH_TOKENS, MAX_STEER_PROMPT_CHARS, MAX_TUNE_CONCEPT_CHARS, MAX_TUNE_LAYERS, MAX_TUNE_NEW_TOKENS,
    MAX_SUPERNODE_NAME_CHARS, MAX_SUPERNODES, MAX_TUNE_PROMPT_CHARS, MAX_TUNE_PROMPTS, MAX_TUNE_SCALES,
    UPLOAD_MAX_BYTES,
)

if TYPE_CHECKING:
    from steerkit.model import SteerModel

PAGES = [("/profiles", "Profiles"), ("/probes", "Probes"), ("/steer", "Steer"), ("/patching", "Patching"),
         ("/attention", "Attention"), ("/tune", "Tune"), ("/features", "Features"), ("/circuits", "Circuits"),
         ("/store", "Store"),
         ("/diagnostics", "Diagnostics")]

#: graphs that get a "download HTML" button: graph id -> file stem
FIGURES = {"prof-graph": "divergence_profile", "prof-pairs": "per_pair", "prof-lens": "logit_lens",
           "probe-heatmap": "probe_auroc", "diag-norm": "residual_norm", "diag-sink": "sink_attention",
           "diag-mi": "mi_per_step", "patch-heatmap": "activation_patching", "patch-detail": "patching_detail",
           "attn-pattern": "attention_pattern", "tune-tradeoff": "tune_tradeoff", "tune-heatmap": "tune_heatmap",
           "feat-figure": "sae_feature", "circ-graph": "attribution_graph", "circ-effect": "supernode_effect"}

CARD = {"background": "#fff", "border": "1px solid #e3e3e3", "borderRadius": "6px", "padding": "12px 16px",
        "marginBottom": "14px"}
ROW = {"display": "flex", "gap": "14px", "alignItems": "flex-end", "flexWrap": "wrap"}
LABEL = {"fontSize": "12px", "color": "#555", "display": "block", "marginBottom": "3px"}
BTN = {"padding": "6px 14px", "borderRadius": "4px", "border": "1px solid #1f77b4", "background": "#1f77b4",
       "color": "#fff", "cursor": "pointer"}
BTN2 = {**BTN, "background": "#fff", "color": "#1f77b4"}
MSG = {"fontSize": "14px", "margin": "6px 0"}
PANE = {"flex": "1 1 0", "minWidth": "280px", "whiteSpace": "pre-wrap", "fontFamily": "ui-monospace, monospace",
        "fontSize": "13px", "background": "#fafafa", "border": "1px solid #eee", "padding": "10px",
        "minHeight": "120px", "borderRadius": "4px"}


def field(label, child, width=None):
    st = {"display": "flex", "flexDirection": "column"}
    if width:
        st["width"] = width
    return html.Div([html.Label(label, style=LABEL), child], style=st)


def dl_button(graph_id):
    return html.Button("Download HTML", id=f"dl-{graph_id}", n_clicks=0, style={**BTN2, "fontSize": "12px",
                                                                                 "padding": "3px 10px"})


def placeholder_figure(text: str) -> dict:
    """An empty figure that shows ``text`` (a plain dict: the layout needs no plotly)."""
    return {"data": [], "layout": {"template": "plotly_white", "xaxis": {"visible": False}, "yaxis": {"visible": False},
                                   "height": 300, "annotations": [{"text": text, "showarrow": False,
                                                                   "font": {"size": 14, "color": "#666"}}]}}


def graph(graph_id, height=None, placeholder=None):
    # the figure functions set their own heights; ``height`` is only the placeholder's
    st = {"minHeight": f"{height}px"} if height else {}
    extra = {"figure": placeholder_figure(placeholder)} if placeholder else {}
    return html.Div([dcc.Graph(id=graph_id, config={"displaylogo": False}, style=st, **extra),
                     html.Div(dl_button(graph_id), style={"textAlign": "right"})])


def progress_row(prefix, label="Compute"):
    return html.Div([
        html.Button(label, id=f"{prefix}-run", n_clicks=0, style=BTN),
        html.Button("Cancel", id=f"{prefix}-cancel", n_clicks=0, disabled=True, style=BTN2),
        html.Progress(id=f"{prefix}-progress", value="0", max="1", style={"width": "220px", "visibility": "hidden"}),
    ], style={**ROW, "alignItems": "center"})


def message(id_):
    return html.Div(id=id_, style=MSG, role="status")


DEFAULT_MODEL_VALUE = "__default__"

CONTRASTS = {"temporal": "Temporal reversal pairs", "harmful": "Harmful vs harmless",
             "steered": "Steered vs unsteered (Steer page settings)", "custom": "My own two prompt lists"}


def model_label(sm: "SteerModel") -> str:
    return f"model: {sm.name} · {sm.n_layers} layers · d_model {sm.d_model}"


def layer_marks(n_layers: Optional[int]) -> dict:
    """Slider marks for ``n_layers`` layers (none while no model is loaded: ``n_layers=None``)."""
    if not n_layers:
        return {}
    return {i: str(i) for i in range(0, n_layers, max(1, n_layers // 15))}


def model_options(models, current_value=None) -> list[dict]:
    """Dropdown options of the model picker (the embedded default as ``DEFAULT_MODEL_VALUE``)."""
    opts = [{"label": m["label"], "value": DEFAULT_MODEL_VALUE if m["value"] is None else m["value"]} for m in models]
    if current_value is not None and current_value not in [o["value"] for o in opts]:
        opts.append({"label": str(current_value), "value": current_value})
    return opts


def model_card(models, current_value):
    """The model picker: one model per app process; loading another replaces it for every page."""
    opts = model_options(models, current_value)
    return html.Div([
        html.Div([
            field("Model", dcc.Dropdown(id="model-pick", clearable=False, value=current_value, options=opts,
                                        style={"width": "420px"})),
            field("or a local folder, .gguf file or Hugging Face Hub id",
                  dcc.Input(id="model-path", type="text", value="", placeholder="/path/to/model or org/name",
                            debounce=False, maxLength=MAX_MODEL_PATH_CHARS, style={"width": "300px"})),
            html.Button("Load model", id="model-load", n_clicks=0, style=BTN2),
            html.Progress(id="model-progress", style={"width": "120px", "visibility": "hidden"}),
        ], style={**ROW, "alignItems": "center"}),
        message("model-status"),
    ], style=CARD)


def profiles_page(n_layers: Optional[int], models=(), current_model=DEFAULT_MODEL_VALUE):
    return html.Div([
        model_card(list(models), current_model),
        html.Div([
            html.Div([
                field("Contrast", dcc.Dropdown(id="prof-contrast", clearable=False, value="temporal", options=[
                    {"label": label, "value": value} for value, label in CONTRASTS.items()]), width="330px"),
                field("Pairs", dcc.Input(id="prof-n", type="number", min=1, max=MAX_BUILTIN_PAIRS, step=1, value=8,
                                         style={"width": "80px"})),
                field("Spread", dcc.RadioItems(id="prof-spread", value="std", inline=True, options=[
                    {"label": " ±1 sd ", "value": "std"}, {"label": " min–max ", "value": "range"},
                    {"label": " none", "value": "none"}])),
            ], style=ROW),
            html.Div(id="prof-custom", style={"display": "none"}, children=[
                html.P("One prompt per line (or a JSON list / JSON lines); line i of A pairs with line i of B. "
                       f"Uploads up to {UPLOAD_MAX_BYTES >> 10} KiB: .txt, .json, .jsonl.",
                       style={"fontSize": "12px", "color": "#666"}),
                html.Div([
                    html.Div([dcc.Textarea(id="prof-a", placeholder="prompts A", style={"width": "100%", "height": "110px"}),
                              dcc.Upload(id="prof-upload-a", children=html.A("upload A"), max_size=UPLOAD_MAX_BYTES,
                                         style={"fontSize": "12px"})], style={"flex": "1"}),
                    html.Div([dcc.Textarea(id="prof-b", placeholder="prompts B", style={"width": "100%", "height": "110px"}),
                              dcc.Upload(id="prof-upload-b", children=html.A("upload B"), max_size=UPLOAD_MAX_BYTES,
                                         style={"fontSize": "12px"})], style={"flex": "1"}),
                ], style={"display": "flex", "gap": "12px"}),
            ]),
            html.Div(progress_row("prof"), style={"marginTop": "10px"}),
            message("prof-status"),
        ], style=CARD),
        html.Div([graph("prof-graph", 440),
                  html.Div([html.Label("Layer (click the plot or slide)", style=LABEL),
                            dcc.Slider(id="prof-layer", min=0, max=max(0, (n_layers or 1) - 1), step=1, value=0,
                                       marks=layer_marks(n_layers),
                                       tooltip={"placement": "bottom"})], style={"padding": "0 30px"})], style=CARD),
        html.Div([
            html.Div([graph("prof-pairs")], style={"flex": "3 1 0", "minWidth": "380px"}),
            html.Div([graph("prof-lens")], style={"flex": "2 1 0", "minWidth": "300px"}),
        ], style={**CARD, "display": "flex", "gap": "12px", "flexWrap": "wrap"}),
        html.Div([
            html.Div([
                html.Button("Use this layer's mean difference on the Steer page", id="prof-use-dir", n_clicks=0,
                            style=BTN2),
                field("Store name", dcc.Input(id="prof-save-name", type="text", value="profile-direction",
                                              style={"width": "200px"})),
                html.Button("Save it to the store", id="prof-save", n_clicks=0, style=BTN2),
            ], style=ROW),
            message("prof-dir-status"),
        ], style=CARD),
    ], id="page-profiles")


def probes_page():
    return html.Div([
        html.Div([
            html.Div([
                field("Saved sweep", dcc.Dropdown(id="probe-file", clearable=False, style={"width": "420px"})),
                field("Method", dcc.Dropdown(id="probe-method", clearable=False, options=[], style={"width": "200px"})),
                html.Button("Rescan", id="probe-rescan", n_clicks=0, style=BTN2),
                dcc.Upload(id="probe-upload", children=html.A("or upload a sweep table (.json/.csv)"),
                           max_size=UPLOAD_MAX_BYTES, style={"fontSize": "13px"}),
            ], style=ROW),
            message("probe-status"),
        ], style=CARD),
        html.Div(graph("probe-heatmap", 520), style=CARD),
    ], id="page-probes")


def steer_page():
    return html.Div([
        html.Div([
            html.Div([
                field("Direction", dcc.Dropdown(id="steer-artifact", clearable=False, style={"width": "360px"})),
                field("Layers", dcc.Input(id="steer-layers", type="text", value="", placeholder="e.g. 12, 10-14 or all",
                                          debounce=True, style={"width": "120px"})),
                field("Operation", dcc.RadioItems(id="steer-op", value="add", inline=True, options=[
                    {"label": " add ", "value": "add"}, {"label": " ablate ", "value": "ablate"},
                    {"label": " clamp", "value": "clamp"}])),
                field("Max new tokens", dcc.Input(id="steer-max", type="number", min=1, max=MAX_NEW_TOKENS, step=1, value=24,
                                                  style={"width": "80px"})),
            ], style=ROW),
            html.Div([html.Label("Strength (add: multiple of the vector; clamp: projection value)", style=LABEL),
                      dcc.Slider(id="steer-strength", min=-16, max=16, step=0.5, value=4,
                                 marks={i: str(i) for i in range(-16, 17, 4)}, tooltip={"placement": "bottom"})],
                     style={"margin": "12px 0", "padding": "0 10px"}),
            field("Prompt", dcc.Textarea(id="steer-prompt", value="Tell me about your weekend.", maxLength=MAX_STEER_PROMPT_CHARS,
                                         style={"width": "100%", "height": "60px"})),
            html.Div([
                html.Button("Generate", id="steer-run", n_clicks=0, style=BTN),
                html.Button("Cancel", id="steer-cancel", n_clicks=0, disabled=True, style=BTN2),
                html.Progress(id="steer-progress", value="0", max="1", style={"width": "220px", "visibility": "hidden"}),
            ], style={**ROW, "alignItems": "center", "marginTop": "10px"}),
            message("steer-status"),
        ], style=CARD),
        html.Div([
            html.Div([html.H4("Baseline", style={"margin": "0 0 6px"}), html.Div(id="steer-base", style=PANE),
                      html.Div(id="steer-base-live", style={**PANE, "display": "none"})], style={"flex": "1"}),
            html.Div([html.H4("Steered", style={"margin": "0 0 6px"}), html.Div(id="steer-steered", style=PANE),
                      html.Div(id="steer-steered-live", style={**PANE, "display": "none"})], style={"flex": "1"}),
        ], style={**CARD, "display": "flex", "gap": "14px", "flexWrap": "wrap"}),
        html.Div("Token colour: projection of the residual that produced the token on the unit direction, at the "
                 "last steered layer (red positive, blue negative; hover for the value).",
                 style={"fontSize": "12px", "color": "#666"}),
    ], id="page-steer")


def export_formats() -> list[dict]:
    return [{"label": f, "value": f} for f in FORMATS]


def store_page():
    return html.Div([
        html.Div([
            html.Div([html.Button("Refresh", id="store-refresh", n_clicks=0, style=BTN2),
                      html.Span(id="store-path", style={"fontSize": "12px", "color": "#666"})],
                     style={**ROW, "alignItems": "center"}),
            message("store-status"),
            dash_table.DataTable(id="store-table", columns=[{"name": c, "id": c} for c in (
                "ref", "kind", "layers", "method", "model", "metrics", "tags", "created")], data=[],
                row_selectable="single", selected_rows=[], page_size=15,
                style_cell={"fontSize": "12px", "textAlign": "left", "maxWidth": "280px", "overflow": "hidden",
                            "textOverflow": "ellipsis"},
                style_header={"fontWeight": "bold"}),
        ], style=CARD),
        html.Div([
            html.Div([
                # options fixed at build time: a dropdown whose options arrive later can drop its value
                field("Export format", dcc.Dropdown(id="store-format", clearable=False, value="safetensors",
                                                    options=export_formats(), style={"width": "200px"})),
                html.Button("Download export", id="store-export", n_clicks=0, style=BTN),
            ], style=ROW),
            message("store-export-status"),
            html.Pre(id="store-detail", style={"fontSize": "12px", "maxHeight": "360px", "overflow": "auto",
                                               "background": "#fafafa", "padding": "8px"}),
        ], style=CARD),
    ], id="page-store")


def diagnostics_page():
    return html.Div([
        html.Div([
            field(f"Prompts (one per line, up to {MAX_DIAG_PROMPTS})", dcc.Textarea(
                id="diag-prompts", style={"width": "100%", "height": "80px"},
                value="The capital of France is Paris.\nWrite a short poem about the sea.\nHow do I bake bread?")),
            html.Div(progress_row("diag"), style={"marginTop": "10px"}),
            message("diag-status"),
        ], style=CARD),
        html.Div([html.Div(graph("diag-norm", 380), style={"flex": "1", "minWidth": "380px"}),
                  html.Div(graph("diag-sink", 380), style={"flex": "1", "minWidth": "380px"})],
                 style={**CARD, "display": "flex", "gap": "12px", "flexWrap": "wrap"}),
        html.Div([html.H4("Mutual information per generation step", style={"margin": "0 0 6px"}),
                  field("MI result", dcc.Dropdown(id="diag-mi-pick", clearable=False, options=[],
                                                  style={"width": "520px"})),
                  message("diag-mi-status"), graph("diag-mi", 360)], style=CARD),
    ], id="page-diagnostics")


#: the Patching page's hook grids: value -> label
PATCH_HOOK_LABELS = {"resid_pre": "resid_pre (layer x position)", "attn_out": "attn_out (layer x position)",
                     "mlp_out": "mlp_out (layer x position)", "z": "z: attention heads (layer x head)"}
PATCH_METHOD_LABELS = {"activation": " activation ", "attribution": " attribution ", "both": " both"}


def patching_page():
    """Clean vs corrupted prompt, two answer tokens, a hook grid: the patching heatmap and, for the
    clicked cell, its per-position detail."""
    prompt_style = {"width": "100%", "height": "44px"}
    return html.Div([
        html.Div([
            html.P("Activation patching: the clean run's activation at one site (a layer and a position, or a "
                   "head) replaces the corrupted run's; the metric is logit(answer) − logit(wrong answer) at the "
                   f"last position. Both prompts need the same number of tokens (at most {MAX_PATCH_TOKENS}).",
                   style={"fontSize": "12px", "color": "#666", "margin": "0 0 8px"}),
            html.Div([
                html.Div(field("Clean prompt", dcc.Textarea(id="patch-clean", value=IOI_CLEAN,
                                                            maxLength=MAX_PATCH_PROMPT_CHARS, style=prompt_style)),
                         style={"flex": "1"}),
                html.Div(field("Corrupted prompt", dcc.Textarea(id="patch-corrupted", value=IOI_CORRUPTED,
                                                                maxLength=MAX_PATCH_PROMPT_CHARS, style=prompt_style)),
                         style={"flex": "1"}),
            ], style={"display": "flex", "gap": "12px"}),
            html.Div([
                field("Answer token", dcc.Input(id="patch-answer", type="text", value=IOI_ANSWER,
                                                maxLength=MAX_ANSWER_CHARS, style={"width": "110px"})),
                field("Wrong answer token", dcc.Input(id="patch-wrong", type="text", value=IOI_WRONG,
                                                      maxLength=MAX_ANSWER_CHARS, style={"width": "110px"})),
                field("Hook grid", dcc.Dropdown(id="patch-hook", clearable=False, value="resid_pre", options=[
                    {"label": label, "value": value} for value, label in PATCH_HOOK_LABELS.items()]), width="290px"),
                field("Layers", dcc.Input(id="patch-layers", type="text", value="all", maxLength=MAX_FIELD_CHARS,
                                          placeholder="e.g. all, 10-14 or 3,5,9", style={"width": "120px"})),
                field("Method", dcc.RadioItems(id="patch-method", value="activation", inline=True, options=[
                    {"label": label, "value": value} for value, label in PATCH_METHOD_LABELS.items()])),
                field("Values", dcc.RadioItems(id="patch-scale", value="normalized", inline=True, options=[
                    {"label": " restored fraction ", "value": "normalized"},
                    {"label": " logit difference", "value": "raw"}])),
            ], style={**ROW, "marginTop": "8px"}),
            html.Div(progress_row("patch"), style={"marginTop": "10px"}),
            message("patch-status"),
        ], style=CARD),
        html.Div([graph("patch-heatmap", 460),
                  html.Div("Click a cell to see its per-position detail below.",
                           style={"fontSize": "12px", "color": "#666"})], style=CARD),
        html.Div([
            html.Div([html.Progress(id="patch-detail-progress", style={"width": "120px", "visibility": "hidden"})]),
            message("patch-detail-status"),
            graph("patch-detail", 360, placeholder="Click a cell of the heatmap to see its per-position detail."),
        ], style=CARD),
    ], id="page-patching")


def attention_page():
    """A prompt's attention pattern (``attn.hook_pattern``) at a layer: one head, or every head."""
    return html.Div([
        html.Div([
            field(f"Prompt (at most {MAX_ATTN_TOKENS} tokens)", dcc.Textarea(
                id="attn-prompt", value=IOI_CLEAN, maxLength=MAX_PATCH_PROMPT_CHARS,
                style={"width": "100%", "height": "44px"})),
            html.Div([
                field("Layer", dcc.Input(id="attn-layer", type="number", min=0, step=1, value=0, debounce=True,
                                         style={"width": "80px"})),
                field("Head", dcc.Input(id="attn-head", type="number", min=0, step=1, value=0, debounce=True,
                                        style={"width": "80px"})),
                field("Show", dcc.RadioItems(id="attn-view", value="one", inline=True, options=[
                    {"label": " this head ", "value": "one"}, {"label": " all heads of the layer", "value": "all"}])),
            ], style={**ROW, "marginTop": "8px"}),
            html.Div(progress_row("attn"), style={"marginTop": "10px"}),
            message("attn-status"),
        ], style=CARD),
        html.Div(graph("attn-pattern", 480), style=CARD),
    ], id="page-attention")


#: the Tune page's defaults: prompts, the words of the concept, the grid
TUNE_PROMPTS = "Tell me about your weekend.\nDescribe a good breakfast.\nWhat should I do this evening?"
TUNE_WORDS = "wedding, love, bride"
TUNE_SCALES = "0, 2, 4, 8"
#: what a scale means (``steerkit.probes.tune.tune``'s ``normalize``): value -> label
TUNE_NORMALIZE_LABELS = {"none": " a multiple of the vector ", "unit": " a length (unit vector) ",
                         "resid": " a fraction of the residual norm"}
#: the trade-off figure's damage axes and the heatmap's metrics: value -> label
TUNE_DAMAGE_LABELS = {"kl": " KL ", "perplexity": " perplexity ", "ppl_ratio": " perplexity ratio ",
                      "repetition": " repetition"}
TUNE_METRIC_LABELS = {"concept": "concept", "kl": "KL on neutral prompts", "perplexity": "perplexity",
                      "ppl_ratio": "perplexity ratio", "repetition": "repetition"}
TUNE_TABLE_COLUMNS = (("prompt", "prompt"), ("baseline", "baseline"), ("steered", "steered"))


def tune_page():
    """Tune a stored direction over a grid of layers x scales on the loaded model (or load a saved tune
    result): trade-off curves, a heatmap of one metric, and a clicked cell's generations next to the
    baseline's."""
    area = {"width": "100%", "height": "70px"}
    return html.Div([
        html.Div([
            html.P(f"A grid of at most {MAX_TUNE_LAYERS} layers x {MAX_TUNE_SCALES} scales, at most "
                   f"{MAX_TUNE_PROMPTS} prompts (each at most {MAX_TUNE_PROMPT_CHARS} characters) and "
                   f"{MAX_TUNE_NEW_TOKENS} new tokens per generation: every cell steers every prompt, scores "
                   "the concept in the generations and measures the damage (KL on neutral prompts, perplexity "
                   "under the unsteered model, repetition); the recommended cell has the most concept within "
                   "the damage bounds (steerkit.probes.tune).",
                   style={"fontSize": "12px", "color": "#666", "margin": "0 0 8px"}),
            html.Div([
                field("Direction (from the store)", dcc.Dropdown(id="tune-artifact", clearable=False,
                                                                 style={"width": "360px"})),
                field(f"Layers (at most {MAX_TUNE_LAYERS})", dcc.Input(
                    id="tune-layers", type="text", value="", placeholder="e.g. 10-14", maxLength=MAX_FIELD_CHARS,
                    style={"width": "120px"})),
                field(f"Scales (at most {MAX_TUNE_SCALES})", dcc.Input(
                    id="tune-scales", type="text", value=TUNE_SCALES, placeholder="e.g. 0, 2, 4, 8",
                    maxLength=MAX_FIELD_CHARS, style={"width": "140px"})),
                field(f"Max new tokens (1 to {MAX_TUNE_NEW_TOKENS})", dcc.Input(
                    id="tune-max", type="number", min=1, max=MAX_TUNE_NEW_TOKENS, step=1, value=16,
                    style={"width": "80px"})),
                field("A scale is", dcc.RadioItems(id="tune-normalize", value="none", inline=True, options=[
                    {"label": label, "value": value} for value, label in TUNE_NORMALIZE_LABELS.items()])),
            ], style=ROW),
            html.Div([
                html.Div(field(f"Prompts (one per line, at most {MAX_TUNE_PROMPTS})", dcc.Textarea(
                    id="tune-prompts", value=TUNE_PROMPTS, style=area)), style={"flex": "1"}),
                html.Div(field(f"Neutral prompts for the KL (one per line, at most {MAX_TUNE_PROMPTS}; "
                               "empty: the built-in ones)", dcc.Textarea(
                    id="tune-neutral", value="", style=area)), style={"flex": "1"}),
            ], style={"display": "flex", "gap": "12px", "marginTop": "8px"}),
            html.Div([
                field("Concept scored by", dcc.RadioItems(id="tune-concept-kind", value="words", inline=True, options=[
                    {"label": " words in the generation ", "value": "words"},
                    {"label": " a stored probe", "value": "probe"}])),
                field("Words that show the concept (comma separated)", dcc.Input(
                    id="tune-words", type="text", value=TUNE_WORDS, maxLength=MAX_TUNE_CONCEPT_CHARS,
                    style={"width": "260px"})),
                field("Words that must be absent (optional)", dcc.Input(
                    id="tune-absent", type="text", value="", maxLength=MAX_TUNE_CONCEPT_CHARS,
                    style={"width": "200px"})),
                field("Probe (from the store)", dcc.Dropdown(id="tune-probe", clearable=True,
                                                             style={"width": "260px"})),
            ], style={**ROW, "marginTop": "8px"}),
            html.Div(progress_row("tune"), style={"marginTop": "10px"}),
            message("tune-status"),
            html.Div([
                field("Save the result in the results folder as", dcc.Input(
                    id="tune-save-name", type="text", value="my", maxLength=MAX_FIELD_CHARS,
                    style={"width": "160px"})),
                html.Span("_tune.json", style={"fontSize": "13px", "color": "#666", "paddingBottom": "6px"}),
                html.Button("Save", id="tune-save", n_clicks=0, style=BTN2),
            ], style={**ROW, "marginTop": "6px"}),
            message("tune-save-status"),
        ], style=CARD),
        html.Div([
            html.Div([
                field("or a saved tune result (*tune*.json in the results folder)",
                      dcc.Dropdown(id="tune-file", clearable=True, options=[], style={"width": "420px"})),
                html.Button("Load", id="tune-load", n_clicks=0, style=BTN2),
                html.Button("Rescan", id="tune-rescan", n_clicks=0, style=BTN2),
            ], style=ROW),
            message("tune-file-status"),
        ], style=CARD),
        html.Div([
            html.Div([
                html.Div([field("Damage axis", dcc.RadioItems(id="tune-damage", value="kl", inline=True, options=[
                    {"label": label, "value": value} for value, label in TUNE_DAMAGE_LABELS.items()])),
                    graph("tune-tradeoff", 420, placeholder="Run a tune or load a saved result.")],
                    style={"flex": "1 1 0", "minWidth": "420px"}),
                html.Div([field("Heatmap metric", dcc.Dropdown(id="tune-metric", clearable=False, value="concept",
                                                               options=[{"label": label, "value": value} for value, label
                                                                        in TUNE_METRIC_LABELS.items()],
                                                               style={"width": "220px"})),
                          graph("tune-heatmap", 420, placeholder="Run a tune or load a saved result.")],
                         style={"flex": "1 1 0", "minWidth": "420px"}),
            ], style={"display": "flex", "gap": "12px", "flexWrap": "wrap"}),
            html.Div("Click a point of the curves or a cell of the heatmap to see its generations below; the star "
                     "is the recommended cell.", style={"fontSize": "12px", "color": "#666"}),
        ], style=CARD),
        html.Div([
            message("tune-cell-status"),
            dash_table.DataTable(id="tune-table", columns=[{"name": n, "id": i} for i, n in TUNE_TABLE_COLUMNS],
                                 data=[], page_size=32,
                                 style_cell={"fontSize": "12px", "textAlign": "left", "whiteSpace": "pre-wrap",
                                             "height": "auto", "verticalAlign": "top", "maxWidth": "420px",
                                             "fontFamily": "ui-monospace, monospace"},
                                 style_header={"fontWeight": "bold"}),
        ], style=CARD),
    ], id="page-tune")


#: the Features page's text sets: value -> label (``steerkit.apps.data.FEATURE_DATASETS``)
FEATURE_DATASET_LABELS = {"custom": "My own texts (below)", "instructions": "Built-in: harmful and harmless instructions",
                          "temporal": "Built-in: temporal reversal stories"}
FEATURE_TEXT = "The cat sat on the mat because it was tired after the long walk."
FEATURE_TEXTS = ("The cat sat on the mat.\nA dog chased the ball across the park.\nShe poured a cup of coffee and "
                 "read the news.\nThe stock market fell sharply on Monday.\nPlease translate this sentence into "
                 "French.\nThe recipe needs two eggs and a cup of flour.")
#: the columns of the Features page's table of latents: id -> header
FEATURE_COLUMNS = {"latent": "latent", "max": "peak", "mean": "mean", "count": "active tokens", "token": "peak token",
                   "position": "position"}


def features_page():
    """A stored SAE's latents on the loaded model: the latents that fire most on a text, and one latent's
    report over a set of texts (top contexts, density, histogram, logit effects, nearest latents)."""
    small = {"fontSize": "12px", "color": "#666", "margin": "0 0 8px"}
    return html.Div([
        html.Div([
            html.P("A sparse autoencoder from the store, read at its own site on the loaded model "
                   "(steerkit.probes.top_latents and feature_report). Save one with steerkit.load_sae(...) and "
                   "Store.save, or steerkit vectors import.", style=small),
            html.Div([
                field("SAE (from the store)", dcc.Dropdown(id="feat-sae", clearable=False, style={"width": "560px"})),
                html.Button("Rescan", id="feat-rescan", n_clicks=0, style=BTN2),
            ], style=ROW),
            message("feat-sae-status"),
        ], style=CARD),
        html.Div([
            html.H4("Find the latents that fire on a text", style={"margin": "0 0 6px"}),
            field(f"Text (at most {MAX_FEATURE_TEXT_CHARS} characters)", dcc.Textarea(
                id="feat-text", value=FEATURE_TEXT, maxLength=MAX_FEATURE_TEXT_CHARS,
                style={"width": "100%", "height": "50px"})),
            html.Div([
                field(f"Latents (1 to {MAX_FEATURE_K})", dcc.Input(id="feat-k", type="number", min=1, max=MAX_FEATURE_K,
                                                                   step=1, value=10, style={"width": "80px"})),
                html.Button("Find", id="feat-find", n_clicks=0, style=BTN),
                html.Progress(id="feat-find-progress", style={"width": "120px", "visibility": "hidden"}),
            ], style={**ROW, "alignItems": "center", "marginTop": "8px"}),
            message("feat-find-status"),
            dash_table.DataTable(id="feat-table", columns=[{"name": n, "id": i} for i, n in FEATURE_COLUMNS.items()],
                                 data=[], page_size=MAX_FEATURE_K,
                                 style_cell={"fontSize": "12px", "textAlign": "left", "cursor": "pointer",
                                             "fontFamily": "ui-monospace, monospace", "whiteSpace": "pre"},
                                 style_header={"fontWeight": "bold"}),
            html.Div("Click a row to read its latent below.", style={"fontSize": "12px", "color": "#666"}),
        ], style=CARD),
        html.Div([
            html.H4("Report of one latent", style={"margin": "0 0 6px"}),
            html.Div([
                field("Latent", dcc.Input(id="feat-latent", type="number", min=0, step=1, value=None,
                                          placeholder="index", style={"width": "100px"})),
                field("Texts", dcc.Dropdown(id="feat-dataset", clearable=False, value="custom", options=[
                    {"label": label, "value": value} for value, label in FEATURE_DATASET_LABELS.items()]),
                      width="360px"),
                field(f"Contexts (1 to {MAX_FEATURE_CONTEXTS})", dcc.Input(
                    id="feat-top", type="number", min=1, max=MAX_FEATURE_CONTEXTS, step=1, value=20,
                    style={"width": "80px"})),
            ], style=ROW),
            field(f"My own texts (one per line, at most {MAX_FEATURE_TEXTS} texts of {MAX_FEATURE_DOC_CHARS} "
                  "characters)", dcc.Textarea(id="feat-texts", value=FEATURE_TEXTS,
                                              style={"width": "100%", "height": "90px"})),
            html.Div(progress_row("feat"), style={"marginTop": "10px"}),
            message("feat-status"),
        ], style=CARD),
        html.Div([
            html.Div(id="feat-contexts", style={**PANE, "whiteSpace": "pre-wrap", "minHeight": "60px"}),
            graph("feat-figure", 420, placeholder="Pick a latent and press Compute to read it over the texts."),
        ], style=CARD),
    ], id="page-features")


CIRCUIT_PROMPT = "The capital of France is"


def circuits_page():
    """Stored transcoders on the loaded model: the attribution graph of a prompt, drawn; a feature node's contexts;
    pinned nodes grouped into supernodes, clamped, and saved."""
    small = {"fontSize": "12px", "color": "#666", "margin": "0 0 8px"}
    number = {"type": "number", "style": {"width": "90px"}}
    return html.Div([
        html.Div([
            html.P("Transcoders from the store, checked against the loaded model; the attribution graph of a prompt "
                   "through them (steerkit.probes.attribution_graph, pruned by prune_graph). Save transcoders with "
                   "steerkit.load_transcoders(...) and Store.save.", style=small),
            html.Div([
                field("Transcoders (from the store)", dcc.Dropdown(id="circ-tc", clearable=False,
                                                                   style={"width": "560px"})),
                html.Button("Rescan", id="circ-rescan", n_clicks=0, style=BTN2),
            ], style=ROW),
            message("circ-tc-status"),
            field(f"Prompt (at most {MAX_CIRCUIT_TOKENS} tokens, {MAX_CIRCUIT_PROMPT_CHARS} characters)", dcc.Textarea(
                id="circ-prompt", value=CIRCUIT_PROMPT, maxLength=MAX_CIRCUIT_PROMPT_CHARS,
                style={"width": "100%", "height": "40px"})),
            html.Div([
                field(f"Feature nodes (1 to {MAX_CIRCUIT_FEATURE_NODES})", dcc.Input(
                    id="circ-features", min=1, max=MAX_CIRCUIT_FEATURE_NODES, step=1, value=256, **number)),
                field(f"Logit targets (1 to {MAX_CIRCUIT_LOGITS})", dcc.Input(
                    id="circ-logits", min=1, max=MAX_CIRCUIT_LOGITS, step=1, value=5, **number)),
                field("Node threshold (0 to 1)", dcc.Input(id="circ-node-threshold", min=0, max=1, step=0.01,
                                                           value=0.8, **number)),
                field("Edge threshold (0 to 1)", dcc.Input(id="circ-edge-threshold", min=0, max=1, step=0.01,
                                                           value=0.98, **number)),
            ], style={**ROW, "marginTop": "8px"}),
            html.Div(progress_row("circ"), style={"marginTop": "10px"}),
            message("circ-status"),
        ], style=CARD),
        html.Div([
            graph("circ-graph", 420, placeholder="Pick transcoders, type a prompt and press Compute."),
            html.Div("Click a node to select it: a feature's contexts are read below; pin features to group them. "
                     "Read the drawn features (below) to see each feature's top contexts when you hover it.",
                     style=small),
        ], style=CARD),
        html.Div([
            html.Div(id="circ-node-info", style={**MSG, "fontFamily": "ui-monospace, monospace"}),
            html.Div([
                html.Button("Pin", id="circ-pin", n_clicks=0, style=BTN2),
                html.Button("Unpin", id="circ-unpin", n_clicks=0, style=BTN2),
                html.Button("Clear pins", id="circ-clear", n_clicks=0, style=BTN2),
            ], style={**ROW, "alignItems": "center"}),
            message("circ-pin-status"),
            html.Div(id="circ-pinned-list", style={"fontSize": "13px", "fontFamily": "ui-monospace, monospace"}),
            html.Div([
                field(f"Supernode name (at most {MAX_SUPERNODE_NAME_CHARS} characters)", dcc.Input(
                    id="circ-supernode-name", type="text", value="", maxLength=MAX_SUPERNODE_NAME_CHARS,
                    placeholder="e.g. capital", style={"width": "200px"})),
                html.Button("Group pinned into a supernode", id="circ-group", n_clicks=0, style=BTN2),
            ], style={**ROW, "marginTop": "8px"}),
            message("circ-group-status"),
            html.Div(f"At most {MAX_CIRCUIT_PINNED} pinned features and {MAX_SUPERNODES} supernodes.", style=small),
        ], style=CARD),
        html.Div([
            html.H4("Intervene on a supernode", style={"margin": "0 0 6px"}),
            html.Div([
                field("Supernode", dcc.Dropdown(id="circ-supernode", clearable=False, style={"width": "300px"})),
                field("Clamp", dcc.RadioItems(id="circ-mode", value="scale", inline=True, options=[
                    {"label": " scale its activations ", "value": "scale"},
                    {"label": " set them to a value", "value": "value"}])),
                field(f"Scale or value (at most {MAX_CIRCUIT_SCALE:g} in size for a scale)", dcc.Input(
                    id="circ-scale", value=0, step=0.1, **number)),
            ], style=ROW),
            html.Div(progress_row("circ-int"), style={"marginTop": "10px"}),
            message("circ-int-status"),
            graph("circ-effect", 320, placeholder="Group pinned features into a supernode and press Compute."),
            html.Div("Compute clamps the supernode's features at their nodes' positions on the graph's prompt.",
                     style=small),
            html.Div([
                field("The saved clamp acts", dcc.RadioItems(id="circ-positions", value="all", inline=True, options=[
                    {"label": " wherever its features fire (any prompt) ", "value": "all"},
                    {"label": " at its nodes' positions", "value": "graph"}])),
                field("Store name", dcc.Input(id="circ-save-name", type="text", value="", placeholder="supernode",
                                              style={"width": "200px"})),
                html.Button("Save to the store", id="circ-save", n_clicks=0, style=BTN2),
            ], style=ROW),
            message("circ-save-status"),
        ], style=CARD),
        html.Div([
            html.H4("Contexts of the selected feature, and of every drawn feature on hover",
                    style={"margin": "0 0 6px"}),
            html.Div([
                field("Texts", dcc.Dropdown(id="circ-dataset", clearable=False, value="custom", options=[
                    {"label": label, "value": value} for value, label in FEATURE_DATASET_LABELS.items()]),
                      width="360px"),
                field(f"Contexts (1 to {MAX_FEATURE_CONTEXTS})", dcc.Input(
                    id="circ-top", min=1, max=MAX_FEATURE_CONTEXTS, step=1, value=10, **number)),
            ], style=ROW),
            field(f"My own texts (one per line, at most {MAX_FEATURE_TEXTS} texts of {MAX_FEATURE_DOC_CHARS} "
                  "characters)", dcc.Textarea(id="circ-texts", value=FEATURE_TEXTS,
                                              style={"width": "100%", "height": "70px"})),
            html.Div(progress_row("circ-report"), style={"marginTop": "10px"}),
            message("circ-report-status"),
            html.Div(id="circ-contexts", style={**PANE, "whiteSpace": "pre-wrap", "minHeight": "60px"}),
            html.Div(progress_row("circ-hover", "Read the drawn features"), style={"marginTop": "10px"}),
            message("circ-hover-status"),
            html.Div("Reads every feature the graph draws over these texts at once: hover a feature node for its "
                     "density and its top contexts, the firing token marked «so».", style=small),
        ], style=CARD),
    ], id="page-circuits")


def shell(model_label: str, n_layers: Optional[int], store_path: str, results_path: str, models=(),
          current_model=DEFAULT_MODEL_VALUE):
    nav = html.Div([html.Span("steerkit explorer", style={"fontWeight": "bold", "marginRight": "24px"})]
                   + [dcc.Link(label, href=path, id=f"nav-{path.strip('/')}",
                               style={"marginRight": "18px", "textDecoration": "none"}) for path, label in PAGES]
                   + [html.Span(model_label, id="model-label",
                                style={"marginLeft": "auto", "fontSize": "12px", "color": "#666"})],
                   style={"display": "flex", "alignItems": "center", "padding": "10px 18px",
                          "borderBottom": "1px solid #ddd", "background": "#fff"})
    return html.Div([
        dcc.Location(id="url"),
        dcc.Store(id="prof-key"), dcc.Store(id="direction"), dcc.Store(id="diag-key"), dcc.Store(id="probe-upload-data"),
        dcc.Store(id="patch-key"), dcc.Store(id="attn-key"), dcc.Store(id="tune-key"), dcc.Store(id="tune-cell"),
        dcc.Store(id="feat-find-key"), dcc.Store(id="feat-key"), dcc.Store(id="circ-key"), dcc.Store(id="circ-selected"),
        dcc.Store(id="circ-pinned"), dcc.Store(id="circ-supernodes"), dcc.Store(id="circ-report-key"),
        dcc.Store(id="circ-effect-key"), dcc.Store(id="circ-hover-key"),
        dcc.Download(id="download-fig"), dcc.Download(id="download-export"),
        nav,
        html.Div([profiles_page(n_layers, models, current_model), probes_page(), steer_page(), patching_page(),
                  attention_page(), tune_page(), features_page(), circuits_page(), store_page(),
                  diagnostics_page()],
                 style={"padding": "14px 18px", "maxWidth": "1280px", "margin": "0 auto"}),
        html.Div(f"store: {store_path} · results: {results_path}",
                 style={"fontSize": "11px", "color": "#999", "padding": "6px 18px"}),
    ], style={"fontFamily": "system-ui, -apple-system, Segoe UI, sans-serif", "background": "#f5f6f8",
              "minHeight": "100vh"})
