"""The figures of the reproduction pages (docs/reproductions/) and of the gallery (docs/gallery.md), drawn
from committed data by steerkit's own figure functions.

    .venv/bin/python scripts/reproduction_figures.py                # redraw every figure, write docs/gallery.md
    .venv/bin/python scripts/reproduction_figures.py --check        # exit 1 when a figure or the gallery differs
    .venv/bin/python scripts/reproduction_figures.py --collect norms /tmp/norms.json   # a run's JSON as a page's data
    .venv/bin/python scripts/reproduction_figures.py --gallery-data  # recompute patching.json, gallery.json

- Data: ``docs/reproductions/data/<name>.json``, the JSON a page's command writes (``--report``, ``--out``,
  ``ConditionVector.to_json``; ``refusal.json`` without its sample generations), floats kept to 6
  significant digits; ``patching.json`` holds the grids tests/probes/test_patching.py compares with TransformerLens
  and ``gallery.json`` the inputs of the gallery's other figures (both written by ``--gallery-data``). The
  refusal-on-quantised-loads figure reads ``benchmarks/results/refusal_paths.csv``.
- Figures: ``docs/reproductions/figures/<stem>.html``, one standalone page per figure (a fixed div id, so the
  same data gives the same file) that loads the site's one plotly.js, ``assets/javascripts/plotly.min.js``,
  which the documentation build copies from the installed plotly (docs/hooks/notebooks.py): they draw in the
  built site (``mkdocs serve`` / ``build``). The pages embed them with an ``<iframe>`` and link them.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "reproductions" / "data"
FIGURES = ROOT / "docs" / "reproductions" / "figures"
#: the site's one plotly.js (docs/hooks/notebooks.py copies it into the built site), from a figure's page
PLOTLY_JS = "../../assets/javascripts/plotly.min.js"
REFUSAL_PATHS = ROOT / "benchmarks" / "results" / "refusal_paths.csv"
DIGITS = 6


@dataclass(frozen=True)
class Figure:
    """One committed figure: ``stem``.html drawn by ``draw(data)`` from ``data``.json; ``code``: the
    function that draws it (``path/to/module.py:function``), for the gallery's links."""

    stem: str
    data: str
    draw: Callable
    code: str


def _load(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))


def compact(value, digits: int = DIGITS):
    """``value`` (JSON, or a figure's dict with numpy arrays) with every float rounded to ``digits`` significant
    digits (non-finite: None), arrays as lists: the same text from any numpy, BLAS or CPU."""
    if isinstance(value, np.ndarray):
        return compact(value.tolist(), digits)
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: compact(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [compact(v, digits) for v in value]
    return value


def _a(x) -> np.ndarray:
    return np.asarray(x, dtype=float)


# ------------------------------------------------------------------ the reproductions' figures
def norms_profile(d):
    from steerkit.probes.methods.norms import NormProfile
    n = d["norms"]
    return NormProfile(_a(n["mean"]), _a(n["std"]), _a(n["mean_no_first"]), _a(n["first"]), n["n_tokens"],
                       n["model"]).plot()


def norms_chain(d):
    from steerkit.probes.methods.norms import NormChain
    c = d["chain"]
    return NormChain(_a(c["norms"]), _a(c["first"]), c["n_layers"], c["passes"], c["model"]).plot()


def norms_drift(d):
    from steerkit.probes.methods.norms import AttentionDrift
    r = d["drift"]
    return AttentionDrift(sink=_a(r["sink"]), recent=_a(r["recent"]), prompt=_a(r["prompt"]),
                          generated=_a(r["generated"]), norm=_a(r["norm"]), window=r["window"],
                          n_prompts=r["n_prompts"], rows_per_step=np.asarray(r["rows_per_step"]),
                          model_name=r["model"]).plot()


def _induction(d):
    from steerkit.probes.methods.induction import InductionResult
    r = d["induction"]
    return InductionResult(scores=_a(r["scores"]), layers=r["layers"], loss=_a(r["loss"]), n_seqs=r["n_seqs"],
                           seq_len=r["seq_len"], seed=r["seed"], model_name=r["model"])


def induction_scores(d):
    from steerkit.probes.plots.induction import score_figure
    return score_figure(_induction(d))


def induction_loss(d):
    from steerkit.probes.plots.induction import loss_figure
    return loss_figure(_induction(d))


def mi_trajectory(d):
    from steerkit.probes.methods.mi import MIResult, MITrajectory
    trs = [MITrajectory(layer=t["layer"], mi=_a(t["mi"]), tokens=t["tokens"], peaks=t["peaks"], text=t["text"],
                        threshold_k=t["k"]) for t in d["mi"]]
    return MIResult(layer=trs[0].layer, trajectories=trs).plot()


def caa_multipliers(d):
    from steerkit.probes.plots.caa import caa_figure
    from steerkit.probes.methods.caa import AB_ITEMS  # the command's items: every vendored A/B item
    rows = d["caa"]["rows"]
    res = SimpleNamespace(rows=rows, layers=sorted({r["layer"] for r in rows}), n_items=len(AB_ITEMS))
    return caa_figure(res)


def temporal_profile(d):
    from steerkit.probes.plots.temporal import profile_figure
    p = d["profile"]
    prof = SimpleNamespace(rel=_a(p["rel"]), rel_std=_a(p["rel_std"]), cos=_a(p["cos"]), n_layers=len(p["rel"]),
                           peak_layer=p["peak_layer"], n_pairs=p["n_pairs"])
    return profile_figure(prof)


def region_result(d):
    from steerkit.probes.plots.region import result_figure
    r = d["region"]
    return result_figure(SimpleNamespace(layer=r["layer"], eval=r["eval"], train_summary=r["train"]))


def critique_f1(d):
    from steerkit.probes.plots.critique import f1_figure
    c = d["critique"]
    return f1_figure(SimpleNamespace(rows=c["rows"], layers=c["layers"], contrast=c["contrast"]))


def _patching(d: dict):
    from steerkit.probes.patching import PatchingResult
    return PatchingResult.from_json(json.dumps(d))


def ioi_both(d):
    from steerkit.probes.plots.ioi import ioi_figure
    r = d["ioi"]
    res = SimpleNamespace(resid_pre=[_patching(g) for g in r["resid_pre"]], z=_patching(r["z"]),
                          model_name=r["model"], pairs=r["pairs"], clean_logit_diff=r["clean_logit_diff"],
                          corrupted_logit_diff=r["corrupted_logit_diff"])
    return ioi_figure(res)


def patching_grid(key: str, title: str):
    def draw(d):
        return _patching(d[key]).plot(title=title)
    draw.__name__ = f"patching_{key}"
    return draw


def _refusal(d):
    c = d["candidates"]
    table = [SimpleNamespace(**x) for x in c]
    m = d["metrics"]
    best = next(x for x in table if x.pos == m["position"] and x.layer == m["layer"])
    sel = SimpleNamespace(table=table, best=best, baseline_harmful=m["baseline_harmful_val"])
    return SimpleNamespace(positions=d["positions"], position_tokens=d["position_tokens"], selection=sel)


def refusal_selection(d):
    from steerkit.probes.plots.refusal import selection_figure
    for x in d["candidates"]:
        x["bypass"] = float("nan") if x["bypass"] is None else x["bypass"]
    return selection_figure(_refusal(d))


def refusal_probe(d):
    from steerkit.probes.plots.refusal import probe_figure
    rows = d["probe"]["rows"]
    res = SimpleNamespace(rows=rows, table=lambda kind, pos: [r for r in rows
                                                              if r["labels"] == kind and r["position"] == pos])
    return probe_figure(res)


def cast_f1(d):
    from steerkit.vectors.plots import condition_f1
    rep = dict(d["report"], grid=_a(d["report"]["grid"]))
    cv = SimpleNamespace(report=rep, layer=d["layer"], threshold=d["threshold"], comparator=d["comparator"])
    return condition_f1(cv)


def bipo_loss(d):
    from steerkit.probes.plots.train import loss_figure
    b = d["bipo"]
    by: dict = {}
    for r in b["history"]:
        by.setdefault(r["epoch"], []).append(float(r["loss"]))
    res = SimpleNamespace(history=b["history"], losses=[float(r["loss"]) for r in b["history"]], method=b["method"],
                          layer=b["layer"], epoch_losses=lambda: [sum(v) / len(v) for _, v in sorted(by.items())])
    return loss_figure(res)


def refusal_paths(_d):
    """The quantised / offloaded refusal paths (benchmarks/results/refusal_paths.csv) as bars, drawn as the
    benchmark page draws its CSVs (benchmarks/render.py)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    with open(REFUSAL_PATHS, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    names = [r["path"] for r in rows]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("cosine with the float32 direction",
                                                        "refusal score of harmful val prompts"))
    fig.add_trace(go.Bar(x=names, y=[float(r["cosine_with_float32"]) for r in rows], name="cosine",
                         showlegend=False), row=1, col=1)
    for key, label in (("harmful_val_score", "unsteered"), ("bypass_score", "direction ablated")):
        fig.add_trace(go.Bar(x=names, y=[float(r[key]) for r in rows], name=label), row=1, col=2)
    fig.update_yaxes(range=[0, 1.05], row=1, col=1)
    fig.update_layout(title="The refusal direction on quantised and offloaded loads", barmode="group",
                      template="plotly_white", legend=dict(orientation="h", y=-0.2))
    return fig


def sae_steering(d):
    """The SAE-steering comparison (docs/reproductions/sae-steering.md): each method's effect (the joyful-minus-
    gloomy log-odds of the first answer token) against its cost (the answers' NLL under the plain model), one
    point a strength."""
    import plotly.graph_objects as go
    fig = go.Figure()
    conds = d["conditions"]
    for method, label in (("clamp", "latent clamp (x peak)"), ("add", "latent add (norm)"),
                          ("diffmean", "difference of means (norm)")):
        pts = [(k.split()[1], v) for k, v in conds.items() if k.split()[0] == method]
        fig.add_trace(go.Scatter(x=[v["nll"] for _, v in pts], y=[v["log_odds"] for _, v in pts],
                                 error_y=dict(type="data", array=[v["log_odds_se"] for _, v in pts]),
                                 text=[s for s, _ in pts], mode="lines+markers+text", textposition="top center",
                                 name=label))
    u = conds["unsteered"]
    fig.add_trace(go.Scatter(x=[u["nll"]], y=[u["log_odds"]], error_y=dict(type="data", array=[u["log_odds_se"]]),
                             mode="markers", marker=dict(symbol="x", size=11, color="black"), name="unsteered"))
    fig.update_layout(title=f"Steering with SAE latent {d['found']['latent']} vs the difference of means "
                            f"({d['site']}, {len(d['prompts'])} held-out prompts)",
                      xaxis_title="NLL of the answers under the plain model (lower: more fluent)",
                      yaxis_title="joyful - gloomy log-odds, first answer token", template="plotly_white",
                      legend=dict(orientation="h", y=-0.2))
    return fig


def attribution_graphs(d):
    """The attribution-graph finding (docs/reproductions/attribution-graphs.md): per prompt, the signed direct effect
    on the metric of the feature nodes (top) and of the error nodes (bottom), summed per block and position; the
    ablated supernodes marked, with the measured and the predicted change of the metric."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    names = [k for k in ("ioi", "capital") if k in d]
    metric = {k: (f"logit({d[k]['answer'].strip()}) - logit({d[k]['contrast'].strip()})" if d[k]["contrast"]
                  else f"logit({d[k]['answer'].strip()}) - mean logit") for k in names}
    titles = [f"{kind}: direct effect on {metric[k]}" for kind in ("feature nodes", "error nodes") for k in names]
    fig = make_subplots(rows=2, cols=len(names), subplot_titles=titles, horizontal_spacing=0.16,
                        vertical_spacing=0.14)
    for col, k in enumerate(names, 1):
        b = d[k]["direct_effect"]
        top = max(abs(v) for g in ("feature_grid", "error_grid") for row in b[g] for v in row) or 1.0
        labels = [f"{i} {t!r}" for i, t in enumerate(b["tokens"])]
        for row, grid in enumerate(("feature_grid", "error_grid"), 1):
            fig.add_trace(go.Heatmap(z=b[grid], x=labels, y=list(range(len(b[grid]))), zmid=0, zmin=-top, zmax=top,
                                     colorscale="RdBu", showscale=row == 1,
                                     colorbar=dict(title="direct effect", x=(col - (len(names) - col) * 0.16) / len(names) + 0.01,
                                                   len=0.9),
                                     hovertemplate="block %{y} at %{x}: %{z:.3f}<extra></extra>"), row=row, col=col)
        for where, sn in d[k]["supernodes"].items():
            if not sn.get("nodes"):
                continue
            fig.add_trace(go.Scatter(x=[labels[sn["position"]]] * len(sn["blocks"]), y=sn["blocks"], mode="markers",
                                     marker=dict(symbol="x-thin", size=10, line=dict(width=2, color="black")),
                                     showlegend=False, hovertext=f"{where} supernode ablated: metric "
                                     f"{sn['metric_change']:+.2f} (graph predicts {sn['predicted_direct_change']:+.2f}; "
                                     f"random features {sn['control']['metric_change']:+.2f})", hoverinfo="text"),
                          row=1, col=col)
        fig.update_yaxes(title_text="block", row=1, col=col)
        fig.update_yaxes(title_text="block", row=2, col=col)
    fig.update_layout(title="Where the answer comes from in the attribution graphs (x: the ablated supernodes)",
                      template="plotly_white", height=900)
    return fig


P = "probes/plots/"
REPRODUCTIONS = [
    Figure("norms_profile", "norms", norms_profile, P + "norms.py:profile_figure"),
    Figure("norms_chain", "norms", norms_chain, P + "norms.py:chain_figure"),
    Figure("norms_drift", "norms", norms_drift, P + "norms.py:drift_figure"),
    Figure("induction_scores", "induction", induction_scores, P + "induction.py:score_figure"),
    Figure("induction_loss", "induction", induction_loss, P + "induction.py:loss_figure"),
    Figure("mi_peaks", "mi-peaks", mi_trajectory, P + "mi.py:result_figure"),
    Figure("caa", "caa", caa_multipliers, P + "caa.py:caa_figure"),
    Figure("temporal_profile", "temporal", temporal_profile, P + "temporal.py:profile_figure"),
    Figure("region", "region", region_result, P + "region.py:result_figure"),
    Figure("critique_f1", "critique", critique_f1, P + "critique.py:f1_figure"),
    Figure("ioi", "ioi", ioi_both, P + "ioi.py:ioi_figure"),
    Figure("patching_resid_pre", "patching",
           patching_grid("activation_resid_pre", "activation patching, resid_pre (logit difference Mary - John)"),
           P + "patching.py:patching_figure"),
    Figure("attribution_resid_pre", "patching",
           patching_grid("attribution_resid_pre", "attribution patching, resid_pre (estimated change of the "
                                                  "logit difference)"), P + "patching.py:patching_figure"),
    Figure("patching_z", "patching",
           patching_grid("activation_z", "activation patching, z of each head at every position"),
           P + "patching.py:patching_figure"),
    Figure("attribution_z", "patching",
           patching_grid("attribution_z", "attribution patching, z of each head at every position"),
           P + "patching.py:patching_figure"),
    Figure("refusal_selection", "refusal", refusal_selection, P + "refusal.py:selection_figure"),
    Figure("refusal_probe", "refusal", refusal_probe, P + "refusal.py:probe_figure"),
    Figure("cast_f1", "cast", cast_f1, "vectors/plots.py:condition_f1"),
    Figure("bipo_loss", "bipo", bipo_loss, P + "train.py:loss_figure"),
    Figure("refusal_paths", "", refusal_paths, "scripts/reproduction_figures.py:refusal_paths"),
    Figure("sae_steering", "sae-steering", sae_steering, "scripts/reproduction_figures.py:sae_steering"),
    Figure("attribution_graphs", "attribution-graphs", attribution_graphs,
           "scripts/reproduction_figures.py:attribution_graphs"),
]


# ------------------------------------------------------------------ the gallery's own data (default model)
POSITIVE = ["I love this film, it is wonderful.", "What a beautiful, happy day.", "The food was delicious.",
            "She was thrilled with the gift.", "This is the best news all year.", "The team played brilliantly.",
            "Our trip was a delight.", "He smiled at the lovely garden."]
NEGATIVE = ["I hate this film, it is awful.", "What a miserable, gloomy day.", "The food was disgusting.",
            "She was upset with the gift.", "This is the worst news all year.", "The team played terribly.",
            "Our trip was a disaster.", "He frowned at the ruined garden."]
CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When John and Mary went to the store, Mary gave a drink to"


def gallery_data() -> dict:
    """Compute the inputs of the gallery's figures on the default model (SmolLM2-135M-Instruct; well under a
    minute on two CPU cores) and return them as JSON-ready values."""
    import steerkit
    from steerkit.apps import analysis
    from steerkit.probes import direct_logit_attribution, logit_lens, sweep
    from steerkit.probes.sweep import labels_for
    from steerkit.probes.tune import TuneResult

    sm = steerkit.load_model()
    prof = analysis.divergence_profile(sm, POSITIVE, NEGATIVE)
    layer = int(np.argmax(prof.rel.mean(0)))
    diag = analysis.layer_diagnostics(sm, POSITIVE[:4])
    att = analysis.attention_patterns(sm, CLEAN, 18)
    prompts, labels = labels_for(POSITIVE, NEGATIVE)
    sw = sweep(sm, prompts, labels, positions=[-2, "last", "mean"], method=["diffmean", "logistic"], n_boot=200)
    runs = _load("patching")
    zrun = _patching_run(runs, "z")
    detail = analysis.head_detail(sm, zrun, 17, 4)
    return {
        "model": sm.name,
        "profile": {"layers": list(prof.layers), "rel": prof.rel.tolist(), "cos": prof.cos.tolist(),
                    "prompts_a": POSITIVE, "prompts_b": NEGATIVE, "contrast": "sentiment",
                    "model_name": sm.name, "lens_layer": layer, "lens_top": prof.lens_top[layer],
                    "lens_bottom": prof.lens_bottom[layer]},
        "diagnostics": {"layers": list(diag.layers), "resid_norm": diag.resid_norm.tolist(),
                        "resid_norm_pos0": diag.resid_norm_pos0.tolist(), "sink": diag.sink.tolist(),
                        "sink_heads": diag.sink_heads.tolist(), "model_name": sm.name, "n_prompts": diag.n_prompts},
        "attention": {"prompt": att.prompt, "layer": att.layer, "tokens": att.tokens, "pattern": att.pattern.tolist(),
                      "model_name": sm.name},
        "sweep": json.loads(sw.to_json()),
        "lens": json.loads(logit_lens(sm, CLEAN, top_k=3).to_json()),
        "dla": json.loads(direct_logit_attribution(sm, CLEAN, " Mary", " John").to_json()),
        "head_detail": {"layer": detail.layer, "head": detail.head, "tokens": detail.tokens,
                        "results": {m: json.loads(r.to_json()) for m, r in detail.results.items()}},
        "tune": TuneResult.example().to_json(),
    }


def patching_data() -> dict:
    """The grids of the patching page (and of the gallery's patching figures): activation and attribution
    patching of ``resid_pre`` and ``z`` on the default model, the prompts and metric of tests/probes/test_patching.py."""
    import steerkit
    from steerkit.probes import activation_patching, attribution_patching

    sm = steerkit.load_model()
    ids = [sm.tokenizer.encode(t, add_special_tokens=False)[0] for t in (" Mary", " John")]

    def metric(logits):
        return logits[:, -1, ids[0]] - logits[:, -1, ids[1]]
    out = {}
    for hook in ("resid_pre", "z"):
        for name, fn in (("activation", activation_patching), ("attribution", attribution_patching)):
            out[f"{name}_{hook}"] = json.loads(fn(sm, CLEAN, CORRUPTED, metric, hook, progress=False).to_json())
    return out


def _patching_run(runs: dict, hook: str):
    from steerkit.apps.analysis import PatchingRun
    act, attr = _patching(runs[f"activation_{hook}"]), _patching(runs[f"attribution_{hook}"])
    return PatchingRun(clean=CLEAN, corrupted=CORRUPTED, answer=" Mary", wrong=" John", hook=hook,
                       tokens=list(act.tokens), corrupted_tokens=list(act.tokens), layers_requested=list(act.layers),
                       activation=act, attribution=attr, model_name=runs.get("model", ""))


def _profile(g):
    from steerkit.apps.analysis import DivergenceProfile
    p = g["profile"]
    return DivergenceProfile(layers=p["layers"], rel=p["rel"], cos=p["cos"], prompts_a=p["prompts_a"],
                             prompts_b=p["prompts_b"], contrast=p["contrast"], model_name=p["model_name"])


def _diagnostics(g):
    from steerkit.apps.analysis import LayerDiagnostics
    d = g["diagnostics"]
    return LayerDiagnostics(layers=d["layers"], resid_norm=_a(d["resid_norm"]),
                            resid_norm_pos0=_a(d["resid_norm_pos0"]),
                            sink=_a(d["sink"]), sink_heads=_a(d["sink_heads"]), model_name=d["model_name"],
                            n_prompts=d["n_prompts"])


def _attention(g):
    from steerkit.apps.analysis import AttentionPatterns
    a = g["attention"]
    return AttentionPatterns(prompt=a["prompt"], layer=a["layer"], tokens=a["tokens"], pattern=_a(a["pattern"]),
                             model_name=a["model_name"])


def app_profile(g):
    from steerkit.apps import figures
    return figures.profile_figure(_profile(g))


def app_pairs(g):
    from steerkit.apps import figures
    return figures.pairs_figure(_profile(g), g["profile"]["lens_layer"])


def app_lens(g):
    from steerkit.apps import figures
    p = g["profile"]
    return figures.vector_lens_figure([tuple(t) for t in p["lens_top"]], [tuple(t) for t in p["lens_bottom"]],
                                      layer=p["lens_layer"])


def app_norms(g):
    from steerkit.apps import figures
    return figures.norm_figure(_diagnostics(g))


def app_sink(g):
    from steerkit.apps import figures
    return figures.sink_figure(_diagnostics(g))


def app_attention_head(g):
    from steerkit.apps import figures
    return figures.attention_figure(_attention(g), head=6)


def app_attention_heads(g):
    from steerkit.apps import figures
    return figures.attention_figure(_attention(g))


def _sweep(g):
    from steerkit.probes.sweep import SweepResult
    return SweepResult.from_json(json.dumps(g["sweep"]))


def sweep_lines(g):
    return _sweep(g).plot()


def app_probe_heatmap(g):
    from steerkit.apps import figures
    from steerkit.apps.io import parse_sweep
    return figures.probe_heatmap(parse_sweep(json.dumps(g["sweep"]), name="sentiment", method="logistic"))


def lens_grid(g):
    from steerkit.probes.lens import LensResult
    return LensResult.from_json(json.dumps(g["lens"])).plot()


def dla_components(g):
    from steerkit.probes.lens import DLAResult
    return DLAResult.from_json(json.dumps(g["dla"])).plot()


def app_patching(_g):
    from steerkit.apps import figures
    return figures.patching_run_figure(_patching_run(_load("patching"), "resid_pre"))


def app_patching_detail(_g):
    from steerkit.apps import figures
    return figures.patching_detail_figure(_patching_run(_load("patching"), "resid_pre"), 21)


def app_head_detail(g):
    from steerkit.apps import figures
    from steerkit.apps.analysis import HeadDetail
    h = g["head_detail"]
    return figures.head_detail_figure(HeadDetail(layer=h["layer"], head=h["head"], tokens=h["tokens"],
                                                 results={m: _patching(r) for m, r in h["results"].items()}))


def app_mi(_g):
    from steerkit.apps import figures
    from steerkit.apps.io import parse_mi
    return figures.mi_figure(parse_mi(json.dumps(_load("mi-peaks")["mi"][0]), name="GSM8K question 0"))


def tune_tradeoff(g):
    from steerkit.probes.tune import tradeoff_figure
    return tradeoff_figure(g["tune"])


def tune_heatmap(g):
    from steerkit.probes.tune import heatmap_figure
    return heatmap_figure(g["tune"], "concept")


A = "apps/figures.py:"
GALLERY = [
    Figure("gallery_profile", "gallery", app_profile, A + "profile_figure"),
    Figure("gallery_pairs", "gallery", app_pairs, A + "pairs_figure"),
    Figure("gallery_lens_tokens", "gallery", app_lens, A + "vector_lens_figure"),
    Figure("gallery_sweep", "gallery", sweep_lines, P + "sweep.py:sweep_figure"),
    Figure("gallery_probe_heatmap", "gallery", app_probe_heatmap, A + "probe_heatmap"),
    Figure("gallery_logit_lens", "gallery", lens_grid, P + "lens.py:lens_figure"),
    Figure("gallery_dla", "gallery", dla_components, P + "lens.py:dla_figure"),
    Figure("gallery_patching", "gallery", app_patching, A + "patching_run_figure"),
    Figure("gallery_patching_detail", "gallery", app_patching_detail, A + "patching_detail_figure"),
    Figure("gallery_head_detail", "gallery", app_head_detail, A + "head_detail_figure"),
    Figure("gallery_attention_head", "gallery", app_attention_head, A + "attention_figure"),
    Figure("gallery_attention_heads", "gallery", app_attention_heads, A + "attention_figure"),
    Figure("gallery_norms", "gallery", app_norms, A + "norm_figure"),
    Figure("gallery_sink", "gallery", app_sink, A + "sink_figure"),
    Figure("gallery_mi", "gallery", app_mi, A + "mi_figure"),
    Figure("gallery_tune_tradeoff", "gallery", tune_tradeoff, P + "tune.py:tradeoff_figure"),
    Figure("gallery_tune_heatmap", "gallery", tune_heatmap, P + "tune.py:heatmap_figure"),
]
ALL = REPRODUCTIONS + GALLERY


# ------------------------------------------------------------------ the gallery page
M = "steerkit.probes.methods."
#: (section, its introduction, [(stem, caption, the API reference's object for it)])
SECTIONS = [
    ("Profiles", "A quantity per layer, one line per measure.", [
        ("gallery_profile", "Divergence profile of 8 sentiment pairs: relative divergence and cosine per layer, "
                            "the peak marked (the explorer's Profiles page).", "steerkit.apps.figures.profile_figure"),
        ("gallery_pairs", "Per-pair values: the same pairs at the peak layer, one bar per pair.",
         "steerkit.apps.figures.pairs_figure"),
        ("gallery_lens_tokens", "Logit lens of the pairs' mean difference at the peak layer: promoted and "
                                "suppressed tokens.", "steerkit.apps.figures.vector_lens_figure"),
        ("temporal_profile", "Temporal divergence profile ([Temporal](reproductions/temporal.md)).",
         M + "temporal.Profile.plot"),
        ("norms_profile", "Norm profile: the residual norm per layer, with and without the first token "
                          "([Norms](reproductions/norms.md)).", M + "norms.NormProfile.plot"),
        ("norms_chain", "Residual norm along re-applied blocks ([Norms](reproductions/norms.md)).",
         M + "norms.NormChain.plot"),
        ("gallery_norms", "Residual norm per layer and at the first token, log scale (the explorer's "
                          "Diagnostics page).",
         "steerkit.apps.figures.norm_figure"),
    ]),
    ("Probe sweeps and conditions", "A probe's or a condition's quality over layers, positions and thresholds.", [
        ("gallery_sweep", "Probe sweep: held-out AUROC per layer, one line per position and method, with its "
                          "bootstrap band (`plot(backend=\"matplotlib\")` draws it with matplotlib, "
                          "`probes/plots/sweep_matplotlib.py`).", "steerkit.probes.sweep.SweepResult.plot"),
        ("gallery_probe_heatmap", "Probe AUROC map: the same sweep over layers x positions (the explorer's "
                                  "Probes page).",
         "steerkit.apps.figures.probe_heatmap"),
        ("refusal_probe", "The refusal probe's cross-validated AUROC per layer and position "
                          "([Refusal](reproductions/refusal.md)).", M + "refusal.ProbeResult.plot"),
        ("cast_f1", "A CAST condition's F1 over layer x threshold, the chosen point marked "
                    "([CAST](reproductions/cast.md)).", "steerkit.vectors.ConditionVector.plot"),
    ]),
    ("Patching grids", "What patching one site of a clean run into a corrupted run restores.", [
        ("patching_resid_pre", "Activation patching of `resid_pre`, layers x positions "
                               "([Patching vs TransformerLens](reproductions/patching-vs-transformerlens.md)).",
         "steerkit.probes.patching.PatchingResult.plot"),
        ("gallery_patching", "Activation and attribution patching side by side (the explorer's Patching page).",
         "steerkit.apps.figures.patching_run_figure"),
        ("gallery_patching_detail", "One layer of the grid, position by position, both methods.",
         "steerkit.apps.figures.patching_detail_figure"),
        ("gallery_head_detail", "One head's `z` patched at each position separately.",
         "steerkit.apps.figures.head_detail_figure"),
        ("ioi", "IOI: `resid_pre` of one template and every head's `z` side by side "
                "([IOI](reproductions/ioi.md)).", M + "ioi.IOIResult.plot"),
    ]),
    ("Logit lens and direct logit attribution", "What each layer or component writes towards the answer.", [
        ("gallery_logit_lens", "Logit lens: each layer's residual stream unembedded, top tokens.",
         "steerkit.probes.lens.LensResult.plot"),
        ("gallery_dla", "Direct logit attribution of the logit difference to each component.",
         "steerkit.probes.lens.DLAResult.plot"),
    ]),
    ("Attention", "Attention patterns and where attention goes.", [
        ("gallery_attention_head", "One head's attention pattern, query tokens down, key tokens across.",
         "steerkit.apps.figures.attention_figure"),
        ("gallery_attention_heads", "All heads of a layer as small multiples on one colour scale.",
         "steerkit.apps.figures.attention_figure"),
        ("gallery_sink", "Attention on the first token per layer, with the spread over heads.",
         "steerkit.apps.figures.sink_figure"),
        ("induction_scores", "Induction score per head ([Induction heads](reproductions/induction.md)).",
         M + "induction.InductionResult.plot"),
        ("norms_drift", "Attention drift during generation ([Norms](reproductions/norms.md)).",
         M + "norms.AttentionDrift.plot"),
    ]),
    ("Along a generation or a sequence", "A quantity per generated token or position.", [
        ("gallery_mi", "MI per generation step, peaks marked with their tokens (the explorer's MI view).",
         "steerkit.apps.figures.mi_figure"),
        ("mi_peaks", "MI trajectories as the method draws them, one line per question "
                     "([MI peaks](reproductions/mi-peaks.md)).",
         M + "mi.MIResult.plot"),
        ("induction_loss", "Per-token loss of a repeated random sequence "
                           "([Induction heads](reproductions/induction.md)).",
         M + "induction.InductionResult.loss_plot"),
        ("bipo_loss", "Training loss of a BiPO vector, per step and per epoch ([BiPO](reproductions/bipo.md)).",
         "steerkit.probes.train.TrainResult.plot"),
    ]),
    ("Steering sweeps and tuning maps", "An effect over layers and strengths.", [
        ("gallery_tune_tradeoff", "Tuning trade-off: concept score against damage (KL), one line per layer, "
                                  "the Pareto front and the recommended cell marked ([Tuning](tuning.md)).",
         "steerkit.probes.plots.tune.tradeoff_figure"),
        ("gallery_tune_heatmap", "Tuning map: a metric over the layer x strength grid.",
         "steerkit.probes.plots.tune.heatmap_figure"),
        ("caa", "CAA: p(matching answer) against the multiplier, one line per layer ([CAA](reproductions/caa.md)).",
         M + "caa.CAAResult.plot"),
        ("critique_f1", "Error-detection F1 against alpha, one line per layer "
                        "([Critique vector](reproductions/critique.md)).", M + "critique.CritiqueResult.plot"),
        ("refusal_selection", "Refusal: bypass score of every candidate direction, the selected one marked "
                              "([Refusal](reproductions/refusal.md)).", M + "refusal.RefusalResult.plot"),
        ("region", "Concise region: generated tokens and accuracy, train and held-out ([Concise region]"
                   "(reproductions/region.md)).", M + "region.RegionResult.plot"),
    ]),
]
BY_STEM = {f.stem: f for f in ALL}


def embed(stem: str, page_dir: str = "reproductions") -> str:
    """The HTML that shows the figure ``stem`` on a page in ``page_dir`` (relative to docs/): an iframe whose
    ``src`` is relative to the page's built URL (``<page>/``), as tall as the figure."""
    return (f'<iframe class="steerkit-figure" src="{_iframe_src(stem, page_dir)}" title="{stem}" width="100%" '
            f'height="{height(draw(BY_STEM[stem])) + 20}" style="border:none"></iframe>')


def _iframe_src(stem: str, page_dir: str) -> str:
    depth = len(Path(page_dir).parts) if page_dir else 0
    return "../" * (depth + 1) + f"reproductions/figures/{stem}.html"


def gallery_page() -> str:
    """docs/gallery.md: every figure kind steerkit draws, one example each, with the code that draws it."""
    out = ["# Gallery", "",
           "The kinds of figure steerkit draws, one example each. Every figure is an interactive plotly figure "
           "(hover for values, drag to zoom, double-click to reset), drawn by the function named under it from "
           "committed data: the reproductions' runs on SmolLM2-135M-Instruct ([Results](RESULTS.md)) and, for "
           "the other figures, a short run of the same model on 8 sentiment pairs and the IOI prompts "
           "(`docs/reproductions/data/gallery.json`, written by "
           "`python scripts/reproduction_figures.py --gallery-data`); the tuning maps draw the "
           "example tune result (`TuneResult.example()`). `python scripts/reproduction_figures.py` draws them "
           "all again from the data. The figures of `steerkit.apps.figures` are the explorer's "
           "([The explorer app](app.md)); in a notebook, each result's `.plot()` returns its figure.", ""]
    have = {f.stem for f in available()}
    for title, intro, items in SECTIONS:
        out += [f"## {title}", "", intro, ""]
        for stem, caption, ref in items:
            if stem not in have:
                continue
            path, fn = BY_STEM[stem].code.split(":")
            obj = ref.split(".")
            name = ".".join(obj[-2:]) if obj[-1] in ("plot", "loss_plot") else obj[-1]
            drawn = f"[`{fn}`][{ref}] (`{path}`)" if name == fn else f"`{fn}` (`{path}`), called by [`{name}`][{ref}]"
            out += [f"### {title_of(stem, caption)}", "", embed(stem, ""), "",
                    f"{caption} Drawn by {drawn}; [the figure on its own](reproductions/figures/{stem}.html).", ""]
    return "\n".join(out)


def title_of(stem: str, caption: str) -> str:
    """A gallery heading: the caption up to its first colon, bracket or comma (the figure's stem when another
    heading has it)."""
    return caption.split(":")[0].split(" (")[0].split(", ")[0].rstrip(".")


def write_gallery(path: Path = ROOT / "docs" / "gallery.md") -> Path:
    path.write_text(gallery_page(), encoding="utf-8")
    return path


# ------------------------------------------------------------------ writing
def height(fig) -> int:
    """The height the figure is drawn at (its layout's, else plotly's default 450)."""
    return int(fig.layout.height or 450)


def page(fig, stem: str) -> str:
    """The figure as a standalone HTML page loading the shared plotly.js beside it; the same figure gives
    the same text (the div id is the stem), and so does a figure whose numbers differ past the digits it stores
    (:func:`compact`), as a redraw with another numpy, BLAS or CPU gives."""
    import plotly.io as pio
    return pio.to_html(compact(fig.to_plotly_json()), include_plotlyjs=PLOTLY_JS, full_html=True, div_id=stem,
                       default_width="100%", default_height=f"{height(fig)}px",
                       config={"responsive": True, "displaylogo": False})


def draw(f: Figure):
    data = _load(f.data) if f.data else {}
    return f.draw(data)


def available(figures=ALL) -> list[Figure]:
    """The figures whose data is committed."""
    return [f for f in figures if not f.data or (DATA / f"{f.data}.json").is_file()]


def redraw(figures=None, folder: Path = FIGURES, check: bool = False) -> list[str]:
    """Write (or with ``check`` compare) every figure whose data is committed; returns the stems that
    differ (``check``) or were written."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for f in available(figures or ALL):
        text = page(draw(f), f.stem)
        path = folder / f"{f.stem}.html"
        if check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                out.append(f.stem)
        else:
            path.write_text(text, encoding="utf-8")
            out.append(f.stem)
    return out


def collect(name: str, source: Path) -> Path:
    """Store a run's JSON (a command's ``--report``) as the data ``name``, floats to DIGITS digits."""
    doc = compact(json.loads(Path(source).read_text(encoding="utf-8")))
    DATA.mkdir(parents=True, exist_ok=True)
    path = DATA / f"{name}.json"
    path.write_text(json.dumps(doc, separators=(",", ":"), ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare the committed figures with a redraw")
    ap.add_argument("--collect", nargs=2, metavar=("NAME", "JSON"), help="store a run's JSON as the data NAME")
    ap.add_argument("--gallery-data", action="store_true",
                    help="recompute the patching grids and the gallery's data on the default model (minutes)")
    a = ap.parse_args(argv)
    if a.collect:
        print("wrote", collect(a.collect[0], Path(a.collect[1])))
        return 0
    if a.gallery_data:
        for name, make in (("patching", patching_data), ("gallery", gallery_data)):
            tmp = DATA / f"{name}.json.tmp"
            tmp.write_text(json.dumps(make()), encoding="utf-8")
            print("wrote", collect(name, tmp))
            tmp.unlink()
    if a.check:
        stale = redraw(check=True)
        gallery = ROOT / "docs" / "gallery.md"
        if not gallery.is_file() or gallery.read_text(encoding="utf-8") != gallery_page():
            stale.append("docs/gallery.md")
        if stale:
            print(f"figures that differ from a redraw of their data: {stale}; run "
                  "scripts/reproduction_figures.py", file=sys.stderr)
            return 1
        print(f"{len(available())} figures match their data")
        return 0
    written = redraw()
    print(f"wrote {len(written)} figures to {FIGURES.relative_to(ROOT)} and {write_gallery().relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
