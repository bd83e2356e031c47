"""steerkit.probes.tune: the layer x scale grid, its scores, the Pareto front, the rule, JSON, figures, CLI."""
import json
import math

import pytest
import torch

import steerkit
from steerkit.errors import InputError
from steerkit.interventions import Intervention
from steerkit.probes.plots.tune import heatmap_figure, tradeoff_figure
from steerkit.probes.tune import (NEUTRAL_PROMPTS, Rule, TuneResult, bootstrap_mean_ci, pareto_front, recommend,
                                  repetition_share, tune)
from steerkit.vectors import DirectionSet, Probe, Provenance, SteeringVector, Store


PROMPTS = ["Hi", "Tell me a joke about cats", "What is two plus two?"]
NEUTRAL = ["Hello", "Good morning to you"]


@pytest.fixture(scope="module")
def tiny_dir(make_tiny_folder):
    return make_tiny_folder(seed=3, num_hidden_layers=3)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    sm = steerkit.load_model(tiny_dir)
    yield sm
    sm.reset()


def _direction(sm, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sm.d_model, generator=g) * 4


def _run(sm, v, **kw):
    args = dict(layers=[0, 1], scales=[0.0, 2.0, 8.0], concept=["the"], neutral=NEUTRAL, max_new_tokens=6,
                batch_size=5, n_boot=50, progress=False)
    args.update(kw)
    return tune(sm, v, PROMPTS, **args)


# ----------------------------------------------------------------------------- mechanics on a tiny model
def test_batched_grid_equals_cells_run_one_at_a_time(tiny):
    v = _direction(tiny)
    res = _run(tiny, v)
    assert tiny.hook_count() == 0
    # every cell against its own sm.generate call with the cell's steering on every prompt
    for c in res.cells:
        steering = None if c["scale"] == 0 else [Intervention.add(f"blocks.{c['layer']}.hook_resid_post", v, c["scale"])]
        assert c["generations"] == tiny.generate(PROMPTS, max_new_tokens=6, steering=steering), c
    assert res.baseline["generations"] == tiny.generate(PROMPTS, max_new_tokens=6)
    # ... and the whole grid run cell by cell (separate generate / forward calls): the same metrics
    ref = _run(tiny, v, batched=False)
    assert [c["generations"] for c in ref.cells] == [c["generations"] for c in res.cells]
    for a, b in zip(res.cells, ref.cells):
        assert a["concept"] == b["concept"] and a["repetition"] == b["repetition"] and a["pareto"] == b["pareto"]
        assert math.isclose(a["perplexity"], b["perplexity"], rel_tol=1e-4)
        assert math.isclose(a["kl"], b["kl"], rel_tol=1e-3, abs_tol=1e-6)
    assert res.recommended == ref.recommended
    assert res.settings["batched"] and not ref.settings["batched"]


def test_metrics_match_their_definitions(tiny):
    v = _direction(tiny)
    res = _run(tiny, v, layers=[1], scales=[0.0, 8.0])
    zero, steered = res.cell(1, 0.0), res.cell(1, 8.0)
    assert zero["kl"] == 0.0 and zero["ppl_ratio"] == 1.0 and zero["generations"] == res.baseline["generations"]
    assert steered["kl"] > 0
    # KL at the last position of each neutral prompt, unsteered || steered
    toks = tiny.tokenize(NEUTRAL)
    p = torch.log_softmax(tiny.forward(toks)[:, -1].float(), -1)
    with tiny.edit("blocks.1.hook_resid_post", add=v, scale=8.0):
        q = torch.log_softmax(tiny.forward(toks)[:, -1].float(), -1)
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    assert math.isclose(steered["kl"], kl, rel_tol=1e-4)
    # perplexity: the unsteered model on prompt + steered completion, completion tokens pooled
    ids = tiny.tokenize(PROMPTS)
    nll, n = 0.0, 0
    for b, text in enumerate(steered["generations"]):
        prompt = ids.input_ids[b][ids.attention_mask[b].bool()].tolist()
        gen = tiny.generate([PROMPTS[b]], max_new_tokens=6, return_tokens=True,
                            steering=[Intervention.add("blocks.1.hook_resid_post", v, 8.0)])[0]
        assert tiny.tokenizer.decode(gen, skip_special_tokens=True) == text
        if not gen:
            continue
        logits = tiny.forward(tiny.pad([prompt + gen]))[0].float()
        lp = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
        nll -= float(lp.gather(-1, torch.tensor(gen)[:, None]).sum())
        n += len(gen)
    assert math.isclose(steered["perplexity"], math.exp(nll / n), rel_tol=1e-4)
    # substring concept: 1 when a generation contains "the" (any case)
    assert steered["scores"] == [float("the" in g.lower()) for g in steered["generations"]]
    assert steered["concept"] == sum(steered["scores"]) / len(PROMPTS)
    lo, hi = steered["concept_ci"]
    assert lo <= steered["concept"] <= hi


def test_repetition_and_bootstrap_definitions():
    assert repetition_share([1, 2]) == 0.0 and repetition_share([5, 5, 5, 5]) == 0.5
    assert repetition_share([1, 2, 1, 2], n=2) == pytest.approx(1 - 2 / 3)
    assert bootstrap_mean_ci([0.5]) == (0.5, 0.5)
    lo, hi = bootstrap_mean_ci([0, 1] * 20, n_boot=500, seed=1)
    assert lo < 0.5 < hi and bootstrap_mean_ci([0, 1] * 20, n_boot=500, seed=1) == (lo, hi)


def test_concept_from_probe_callable_and_rules(tiny):
    v = _direction(tiny)
    w = torch.randn(1, tiny.d_model)
    probe = Probe(w, torch.tensor([0.1]), layer=1, classes=["neg", "pos"],
                  provenance=Provenance.from_model(tiny, method_params={"position": "last"}))
    res = _run(tiny, v, layers=[0], scales=[0.0, 4.0], concept=probe)
    assert res.concept_kind == "probe"
    c = res.cell(0, 4.0)
    ids = tiny.tokenize(PROMPTS)
    for b, score in enumerate(c["scores"]):
        prompt = ids.input_ids[b][ids.attention_mask[b].bool()].tolist()
        gen = tiny.generate([PROMPTS[b]], max_new_tokens=6, return_tokens=True,
                            steering=[Intervention.add("blocks.0.hook_resid_post", v, 4.0)])[0]
        with tiny.record("blocks.1.hook_resid_post", positions="all") as cache:
            tiny.forward(tiny.pad([prompt + gen]))  # unsteered
        x = cache["blocks.1.hook_resid_post"][0, -1]
        assert math.isclose(score, float(torch.sigmoid(probe.decision_function(x)[0])), rel_tol=1e-4)
    seen = {}

    def fn(prompts, completions):
        seen["n"] = (len(prompts), len(completions))
        return [len(t) for t in completions]

    res = _run(tiny, v, layers=[0], scales=[0.0, 4.0], concept=fn)
    assert res.concept_kind == "callable" and seen["n"] == (2 * len(PROMPTS), 2 * len(PROMPTS))
    assert res.cell(0, 4.0)["scores"] == [float(len(g)) for g in res.cell(0, 4.0)["generations"]]
    res = _run(tiny, v, layers=[0], scales=[4.0], concept={"contains": ["a"], "absent": ["zzzz"]})
    assert res.cell(0, 4.0)["scores"] == [float("a" in g.lower()) for g in res.cell(0, 4.0)["generations"]]
    res = _run(tiny, v, layers=[0], scales=[4.0], concept={"absent": ["e"]})
    assert res.cell(0, 4.0)["scores"] == [float("e" not in g.lower()) for g in res.cell(0, 4.0)["generations"]]


def test_artifact_kinds_and_normalisation(tiny):
    v = _direction(tiny)
    # a steering vector with one direction is used at every grid layer: equal to the raw tensor
    one = SteeringVector.from_direction(v, 1, tiny)
    a, b = _run(tiny, one), _run(tiny, v)
    assert [c["generations"] for c in a.cells] == [c["generations"] for c in b.cells]
    # a vector with several layers: each grid layer uses its own; layers default to the vector's
    multi = SteeringVector({0: v, 1: -v}, provenance=Provenance.from_model(tiny))
    res = _run(tiny, multi, layers=None, scales=[3.0])
    assert res.layers == (0, 1)
    assert res.cell(1, 3.0)["generations"] == tiny.generate(
        PROMPTS, max_new_tokens=6, steering=[Intervention.add("blocks.1.hook_resid_post", -v, 3.0)])
    # unit: the direction divided by its norm
    unit = _run(tiny, v, normalize="unit", scales=[0.0, 5.0])
    ref = _run(tiny, v / v.norm(), scales=[0.0, 5.0])
    assert [c["generations"] for c in unit.cells] == [c["generations"] for c in ref.cells]
    # resid: times the layer's mean residual norm over the prompts' tokens (first token left out)
    res = _run(tiny, v, normalize="resid", layers=[1], scales=[0.5])
    norm = res.settings["resid_norms"]["1"]
    ids = tiny.tokenize(PROMPTS)
    with tiny.record("blocks.1.hook_resid_post", positions="all") as cache:
        tiny.forward(ids)
    x, lens = cache["blocks.1.hook_resid_post"], cache.lengths("blocks.1.hook_resid_post")
    want = torch.cat([x[b, 1:lens[b]].norm(dim=-1) for b in range(len(PROMPTS))]).mean()
    assert math.isclose(norm, float(want), rel_tol=1e-4)
    assert res.cell(1, 0.5)["generations"] == tiny.generate(
        PROMPTS, max_new_tokens=6, steering=[Intervention.add("blocks.1.hook_resid_post", v / v.norm(), 0.5 * norm)])
    # a direction set: ablation of strength = scale
    ds = DirectionSet.from_directions(torch.stack([v, torch.randn(tiny.d_model)]), tiny)
    res = _run(tiny, ds, layers=[1], scales=[0.0, 1.0])
    assert res.settings["operation"] == "ablate" and res.cell(1, 0.0)["kl"] == 0.0
    assert res.cell(1, 1.0)["generations"] == tiny.generate(
        PROMPTS, max_new_tokens=6, steering=[Intervention.ablate("blocks.1.hook_resid_post", ds.basis, 1.0)])


def test_a_cell_is_the_artifact_at_its_layer_steered_by_its_own_interventions(tiny):
    """Site and positions come from the artifact (here resid_pre, the first and last tokens); the grid's
    scale replaces the vector's own scale."""
    v = _direction(tiny)
    prov = Provenance.from_model(tiny)
    vec = SteeringVector({0: v, 1: -v}, scale=5.0, hook_site="hook_resid_pre", positions=[0, -1], provenance=prov)
    res = _run(tiny, vec, layers=None, scales=[2.0])
    assert res.settings["site"] == "hook_resid_pre" and res.layers == (0, 1)
    for layer, d in ((0, v), (1, -v)):
        alone = SteeringVector({layer: d}, hook_site="hook_resid_pre", positions=[0, -1], provenance=prov)
        assert res.cell(layer, 2.0)["generations"] == tiny.generate(PROMPTS, max_new_tokens=6,
                                                                    steering=alone.to_interventions(tiny.facts, scale=2.0))
        with tiny.steer(alone, 2.0):
            assert res.cell(layer, 2.0)["generations"] == tiny.generate(PROMPTS, max_new_tokens=6)


def test_errors(tiny):
    v = _direction(tiny)
    bad = [dict(layers=[3]), dict(layers=[0, 0]), dict(layers=[]), dict(scales=[]), dict(scales=[1.0, 1.0]),
           dict(scales=[float("nan")]), dict(concept=3), dict(concept={"contain": ["a"]}), dict(concept={}),
           dict(concept=[""]), dict(max_new_tokens=0), dict(batch_size=0), dict(n_boot=0), dict(normalize="l2"),
           dict(rule={"max_kll": 1}), dict(rule={"max_kl": -1}), dict(rule={"objective": "best"}), dict(alpha=1.5),
           dict(neutral=[]), dict(concept=lambda p, c: [1.0])]
    for kw in bad:
        with pytest.raises(InputError):
            _run(tiny, v, **kw)
    with pytest.raises(InputError, match="d_model"):
        _run(tiny, torch.ones(7))
    with pytest.raises(InputError, match="layers="):
        _run(tiny, v, layers=None)
    with pytest.raises(InputError, match="none at layer 1"):
        _run(tiny, SteeringVector({0: v, 2: v}, provenance=Provenance.from_model(tiny)), layers=[0, 1])
    with pytest.raises(InputError, match="operation 'add'"):
        _run(tiny, SteeringVector({1: v}, operation="clamp", provenance=Provenance.from_model(tiny)))
    with pytest.raises(InputError, match="normalize=None"):
        _run(tiny, DirectionSet.from_directions(v[None], tiny), normalize="unit")
    with pytest.raises(InputError, match="d_model|model"):
        _run(tiny, SteeringVector.from_direction(torch.ones(32), 1))
    with pytest.raises(InputError):
        tune(tiny, v, [], concept=["a"], layers=[0])
    with pytest.raises(TypeError):
        tune(tiny, v, PROMPTS, layers=[0])  # concept is required
    assert tiny.hook_count() == 0


# ----------------------------------------------------------------------------- front and rule, constructed
def _cell(layer, scale, concept, kl, ppl_ratio=1.0, rep=0.0, lo=None):
    return {"layer": layer, "scale": scale, "concept": concept, "concept_ci": [concept if lo is None else lo, concept],
            "kl": kl, "perplexity": None if ppl_ratio is None else 10.0 * ppl_ratio, "ppl_ratio": ppl_ratio,
            "repetition": rep}


def test_pareto_front_constructed():
    cells = [_cell(1, 0.0, 0.1, 0.0), _cell(1, 1.0, 0.5, 0.2), _cell(1, 2.0, 0.4, 0.3),  # 2 dominated by 1
             _cell(2, 1.0, 0.5, 0.2, ppl_ratio=1.2),  # dominated by cell 1 (same concept and kl, higher ppl)
             _cell(2, 2.0, 0.9, 2.0), _cell(2, 4.0, 0.9, 2.0, rep=0.5),  # 5 dominated by 4 (repetition)
             _cell(3, 1.0, 0.95, 0.1, ppl_ratio=None)]  # None perplexity: infinitely bad, still best concept
    assert pareto_front(cells) == [True, True, False, False, True, False, True]
    assert pareto_front(cells, damages=("kl",)) == [True, False, False, False, False, False, True]
    twins = [_cell(1, 1.0, 0.5, 0.2), _cell(2, 1.0, 0.5, 0.2)]
    assert pareto_front(twins) == [True, True]  # equal points do not dominate each other


def test_rule_constructed():
    cells = [_cell(1, 0.0, 0.1, 0.0), _cell(1, 2.0, 0.6, 0.4), _cell(1, 4.0, 0.8, 1.5),
             _cell(2, 1.0, 0.6, 0.3), _cell(2, 3.0, 0.6, 0.1, ppl_ratio=1.2, lo=0.5),
             _cell(2, 6.0, 0.9, 0.2, ppl_ratio=3.0)]
    for c, p in zip(cells, pareto_front(cells)):
        c["pareto"] = p
    # highest concept with kl <= 1 and ppl ratio <= 1.5: two front cells at 0.6, tie -> the smaller scale
    assert recommend(cells, {"max_kl": 1.0}) == {"layer": 2, "scale": 1.0}
    # ... and a cell dominated at equal concept (layer 1, scale 2: kl 0.4 > 0.3) is never picked
    assert [c["pareto"] for c in cells] == [True, False, True, True, True, True]
    assert recommend(cells, Rule(max_kl=1.0, max_ppl_ratio=None)) == {"layer": 2, "scale": 6.0}
    assert recommend(cells, {"max_kl": 2.0, "max_ppl_ratio": 1.5}) == {"layer": 1, "scale": 4.0}
    assert recommend(cells, {"max_kl": 0.05}) == {"layer": 1, "scale": 0.0}
    assert recommend(cells, {"max_kl": 1.0, "objective": "concept_lo"}) == {"layer": 2, "scale": 1.0}
    cells[3]["concept_ci"][0] = 0.2
    assert recommend(cells, {"max_kl": 1.0, "objective": "concept_lo"}) == {"layer": 2, "scale": 3.0}
    assert recommend([c for c in cells if c["scale"] > 0], {"max_kl": 0.05}) is None
    rep = [_cell(1, 1.0, 0.5, 0.1, rep=0.5), _cell(1, 2.0, 0.2, 0.1)]
    for c, p in zip(rep, pareto_front(rep)):
        c["pareto"] = p
    assert recommend(rep, {"max_repetition": 0.25}) == {"layer": 1, "scale": 2.0}
    assert recommend(rep, {"max_repetition": None}) == {"layer": 1, "scale": 1.0}
    # whatever the bounds, the pick is a front cell
    for kl in (0.05, 0.2, 0.35, 1.0, 5.0):
        r = recommend(cells, {"max_kl": kl, "max_ppl_ratio": None})
        assert r is None or next(c for c in cells if (c["layer"], c["scale"]) == (r["layer"], r["scale"]))["pareto"]
    assert Rule.of(None) == Rule() and Rule.of({"max_kl": None}).max_kl is None


# ----------------------------------------------------------------------------- JSON and figures
def test_json_round_trip_and_figures(tiny, tmp_path):
    res = _run(tiny, _direction(tiny))
    doc = res.to_json()
    for key in ("layers", "scales", "prompts", "baseline", "cells", "recommended", "rule", "concept_kind", "settings"):
        assert key in doc
    for key in ("generations", "concept", "concept_ci", "perplexity", "repetition"):
        assert key in doc["baseline"]
    for key in ("layer", "scale", "concept", "concept_ci", "perplexity", "kl", "repetition", "pareto", "generations"):
        assert all(key in c for c in doc["cells"])
    text = json.dumps(doc, allow_nan=False)
    back = TuneResult.from_json(text)
    assert back.to_json() == json.loads(text)
    assert TuneResult.from_json(json.loads(text)).to_json() == back.to_json()
    path = res.save(tmp_path / "tune.json")
    assert TuneResult.from_json(path).to_json() == back.to_json() == TuneResult.from_json(str(path)).to_json()
    assert len(doc["cells"]) == 6 and [c["layer"] for c in doc["cells"]] == [0, 0, 0, 1, 1, 1]
    fig = res.plot()
    names = [t.name for t in fig.data]
    assert names[:2] == ["layer 0", "layer 1"] and "Pareto front" in names
    assert ("recommended" in names) == (res.recommended is not None)
    for damage in ("kl", "perplexity", "ppl_ratio", "repetition"):
        tradeoff_figure(doc, damage=damage)
    for metric in ("concept", "perplexity", "ppl_ratio", "kl", "repetition"):
        hm = heatmap_figure(doc, metric)
        z = hm.data[0].z
        assert len(z) == 2 and len(z[0]) == 3
    assert list(heatmap_figure(text, "kl").data[0].z[1]) == [c["kl"] for c in doc["cells"][3:]]
    for bad in (dict(doc, format="nope"), {"format": "steerkit.tune/1"}, "not json {", str(tmp_path / "missing.json")):
        with pytest.raises(InputError):
            tradeoff_figure(bad)
    with pytest.raises(InputError):
        heatmap_figure(doc, "loss")
    with pytest.raises(InputError):
        tradeoff_figure(doc, damage="concept")


def test_progress_bar_and_exports(tiny, capsys):
    import sys

    import steerkit.probes as probes
    from steerkit.probes import tune_result
    assert probes.tune is tune and probes.TuneResult is TuneResult is tune_result.TuneResult
    # the figures live in steerkit.probes.plots.tune; their old names resolve there (plotly imported on use)
    module = sys.modules["steerkit.probes.tune"]
    assert module.tradeoff_figure is tradeoff_figure and module.heatmap_figure is heatmap_figure
    assert not hasattr(module, "no_such_name")
    _run(tiny, _direction(tiny), layers=[0], scales=[1.0], progress=True)
    assert "tune" in capsys.readouterr().err
    assert len(NEUTRAL_PROMPTS) >= 4


# ----------------------------------------------------------------------------- the command line
def test_cli_tune_json_on_a_tiny_store_model(tiny, tiny_dir, tmp_path, capsys):
    from steerkit.cli import main
    store = str(tmp_path / "store")
    Store(store).save("vec", SteeringVector.from_direction(_direction(tiny), 1, tiny))
    (tmp_path / "p.txt").write_text("\n".join(PROMPTS))
    (tmp_path / "n.json").write_text(json.dumps(NEUTRAL))
    argv = ["vectors", "--store", store, "tune", "vec", "--prompts", str(tmp_path / "p.txt"), "--layers", "0-1",
            "--scales", "0,2,8", "--neutral", str(tmp_path / "n.json"), "--contains", "the", "--tokens", "6",
            "--n-boot", "50", "--batch-size", "5", "--model", str(tiny_dir)]
    assert main([*argv, "--json", "--out", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.html")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "recommended" in doc and doc["layers"] == [0, 1] and doc["scales"] == [0.0, 2.0, 8.0]
    assert doc["settings"]["artifact"].startswith("vec")
    api = _run(tiny, _direction(tiny))
    assert [c["generations"] for c in doc["cells"]] == [c["generations"] for c in api.cells]
    assert json.loads((tmp_path / "r.json").read_text()) == doc
    assert "plotly" in (tmp_path / "r.html").read_text()
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "recommended:" in out and "baseline:" in out
    errors = [["--layers", "x"], ["--scales", "a,b"], ["--tokens", "0"], ["--concept-probe", "vec"],
              ["--layers", "9"], ["--contains", "a", "--concept-probe", "vec"]]
    for extra in errors:
        base = [a for a in argv if a not in ("--contains", "the")] if "--concept-probe" in extra else argv
        capsys.readouterr()
        assert main([*base, *extra]) == 2, extra
        err = [l for l in capsys.readouterr().err.strip().splitlines() if "Loading weights" not in l]
        assert len(err) == 1 and err[0].startswith("steerkit: error: "), (extra, err)
    no_concept = [a for a in argv if a not in ("--contains", "the")]
    assert main(no_concept) == 2 and "--concept-probe" in capsys.readouterr().err
    missing = [a if a != "vec" else "nosuch" for a in argv]
    assert main(missing) == 2


# ----------------------------------------------------------------------------- the default model
TOPICS = ["the weather today", "my new job", "a walk in the park", "the weekend", "my neighbour", "dinner tonight",
          "the train ride", "a letter from home"]
HAPPY = [f"Write one sentence about {t} in a joyful, happy, delighted tone." for t in TOPICS]
SAD = [f"Write one sentence about {t} in a sad, gloomy, miserable tone." for t in TOPICS]
HAPPY_WORDS = ("happy", "joy", "wonderful", "delight", "love", "excit", "amazing", "great", "!", "beautiful",
               "cheer", "smile", "glad", "fun", "bright")


def happy_words(prompts, completions):
    """How many happy words a completion has."""
    return [sum(t.lower().count(w) for w in HAPPY_WORDS) for t in completions]


def test_tune_a_happy_direction_on_the_default_model(sm):
    from steerkit.probes import record_activations
    acts = record_activations(sm, HAPPY + SAD, positions=["last"])["last"]  # [layer, n, d]
    n = len(HAPPY)
    vec = SteeringVector({l: acts[l, :n].mean(0) - acts[l, n:].mean(0) for l in range(sm.n_layers)},
                         provenance=Provenance.from_model(sm, method="diffmean"))
    prompts = ["Describe your morning.", "Tell me about your city.", "What did you do yesterday?"]
    res = tune(sm, vec, prompts, layers=[6, 12, 18], scales=[0.0, 0.25, 0.5], concept=happy_words,
               neutral=list(NEUTRAL_PROMPTS[:4]), normalize="resid", max_new_tokens=16, n_boot=200, progress=False)
    assert sm.hook_count() == 0
    by = {(c["layer"], c["scale"]): c for c in res.cells}
    # the concept rises with the scale at a middle layer, and so does the damage
    mid = [by[(12, s)] for s in (0.0, 0.25, 0.5)]
    assert mid[0]["concept"] < mid[2]["concept"], [c["concept"] for c in mid]
    assert mid[0]["kl"] == 0.0 < mid[1]["kl"] < mid[2]["kl"]
    assert mid[2]["perplexity"] > mid[0]["perplexity"]
    for layer in (6, 12, 18):
        assert by[(layer, 0.5)]["kl"] > by[(layer, 0.25)]["kl"] > 0
    rec = res.recommended
    assert rec is not None and by[(rec["layer"], rec["scale"])]["pareto"]
    assert Rule().admits(by[(rec["layer"], rec["scale"])])
