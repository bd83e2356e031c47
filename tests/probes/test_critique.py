"""The hidden critique vector (Phan et al. 2026; probes/methods/critique.py).

Generator properties, the vector and the steering on a tiny random model (checked against independent
computations), the F1 arithmetic, input errors, and one tiny end-to-end run on the default model.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from steerkit.probes.methods import critique as K
from tiny_models import tiny_model

from steerkit.errors import InputError
from steerkit.model import wrap

torch.set_num_threads(1)


def _sm():
    model, tok = tiny_model("llama", max_position_embeddings=1024)
    return wrap(model, tok, name="tiny-llama")


@pytest.fixture(scope="module")
def tiny():
    return _sm()


# --------------------------------------------------------------------------- data
def test_corrupted_step_is_wrong_and_the_others_right():
    for clean, bad in K.trace_pairs(60, seed=3):
        assert clean.question == bad.question and clean.corrupted == -1 and 0 <= bad.corrupted < len(bad.steps)
        assert all(K.check_step(s) for s in clean.steps)
        assert clean.answer == clean.true_answer == clean.values[-1]
        for i, s in enumerate(bad.steps):
            assert K.check_step(s) == (i != bad.corrupted), (i, s)
        # steps before the error are the clean ones; later steps start from the written wrong value
        assert bad.steps[:bad.corrupted] == clean.steps[:bad.corrupted]
        for i in range(1, len(bad.steps)):
            assert bad.steps[i].split(": ")[1].startswith(str(bad.values[i - 1]) + " ")
        assert bad.answer == bad.values[-1] != bad.true_answer == clean.true_answer
        rec = bad.recovered()
        assert rec.is_recovery and rec.answer == clean.answer and rec.steps == bad.steps
        assert rec.text.endswith(f"The answer is {clean.answer}.") and not bad.is_recovery


def test_generator_is_deterministic_and_seeded():
    a, b = K.arithmetic_traces(30, seed=1), K.arithmetic_traces(30, seed=1)
    assert [t.text for t in a] == [t.text for t in b] and [t.corrupted for t in a] == [t.corrupted for t in b]
    assert [t.text for t in K.arithmetic_traces(30, seed=2)] != [t.text for t in a]
    assert 0 < sum(t.corrupted >= 0 for t in a) < 30
    assert len({t.question for t in a}) == 30
    assert all(t.corrupted == -1 for t in K.arithmetic_traces(5, error_rate=0.0))
    assert all(t.corrupted >= 0 for t in K.arithmetic_traces(5, error_rate=1.0))
    assert [t.text for t, _ in K.trace_pairs(5)] == [t.text for t, _ in K.trace_pairs(5)]


def test_vendored_gsm8k_error_prefixes():
    rows = K.gsm8k_error_traces(5)
    assert len(rows) == 5 and all(r["question"] and r["search"] for r in rows)
    assert len(K.gsm8k_error_traces()) == 300
    with pytest.raises(InputError, match="nothing there"):
        K.gsm8k_error_traces(path="/nonexistent.jsonl")


# --------------------------------------------------------------------------- vector
def test_vector_is_the_difference_of_span_means(tiny):
    sm = tiny
    pairs = K.trace_pairs(3, seed=0, n_steps=2)
    clean, bad = [c for c, _ in pairs], [e for _, e in pairs]

    def span_mean(t, layer):  # one trace alone, every position recorded, span cut out by hand
        prefix = K.SOLVE_PROMPT.format(question=t.question) + t.reasoning + "\n"
        ids_p = sm.tokenizer(prefix)["input_ids"]
        ids_s = sm.tokenizer(t.answer_sentence, add_special_tokens=False)["input_ids"]
        name = f"blocks.{layer}.hook_resid_post"
        with sm.record(name) as cache:
            sm.forward(sm.pad([ids_p + ids_s]), chat=False)
        h = cache[name][0]
        assert h.shape[0] == len(ids_p) + len(ids_s)
        return h[len(ids_p):].float().mean(0)

    cv = K.critique_vector(sm, clean, bad, contrast="error", batch_size=2)
    assert cv.contrast == "error" and cv.n_pos == cv.n_neg == 3 and cv.vectors.shape == (sm.n_layers, sm.d_model)
    for l in range(sm.n_layers):
        exp = torch.stack([span_mean(t, l) for t in bad]).mean(0) - torch.stack([span_mean(t, l) for t in clean]).mean(0)
        torch.testing.assert_close(cv.vectors[l], exp, atol=1e-5, rtol=1e-4)
    # recovery contrast: recovered items only, written with the right answer, against their clean traces
    rec = K.critique_vector(sm, clean, bad, contrast="recovery", recovered=[True, False, True])
    exp = (K.critique_activations(sm, [bad[0].recovered(), bad[2].recovered()]).mean(0)
           - K.critique_activations(sm, [clean[0], clean[2]]).mean(0))
    assert rec.contrast == "recovery" and rec.n_pos == 2 and rec.n_recovered == 2
    torch.testing.assert_close(rec.vectors, exp, atol=1e-5, rtol=1e-4)
    # auto falls back to the error contrast when recoveries are too rare
    auto = K.critique_vector(sm, clean, bad, recovered=[True, False, False], min_recoveries=2)
    assert auto.contrast == "error" and auto.n_recovered == 1
    torch.testing.assert_close(auto.vectors, cv.vectors)
    assert K.critique_vector(sm, clean, bad, recovered=[True, True, False], min_recoveries=2).contrast == "recovery"


def test_steering_adds_alpha_v_at_every_position(tiny):
    sm = tiny
    v = torch.randn(sm.d_model, generator=torch.Generator().manual_seed(0))
    prompts = ["Step 1: 2 + 3 = 5.", "Is there a wrong step?"]
    name = "blocks.0.hook_resid_post"
    nxt = "blocks.1.hook_resid_pre"
    with sm.record([name, nxt]) as base:
        sm.forward(prompts, chat=False)
    with K.steer_critique(sm, v, 0, 0.6), sm.record([nxt]) as steered:
        sm.forward(prompts, chat=False)
    assert sm.hook_count() == 0
    lens = base.lengths(nxt)
    for r in range(2):
        d = steered[nxt][r, :lens[r]] - base[nxt][r, :lens[r]]
        torch.testing.assert_close(d, (0.6 * v).expand_as(d), atol=1e-5, rtol=1e-5)
    with pytest.raises(InputError, match="layer"):
        K.steer_critique(sm, v, sm.n_layers, 1.0)


# --------------------------------------------------------------------------- evaluation
def test_f1_arithmetic_on_a_planted_case():
    assert K.f1_score(1.0, 0.0) == 0.0 and K.f1_score(0.0, 0.0) == 0.0
    assert K.f1_score(0.5, 1.0) == pytest.approx(2 / 3)
    # 4 erroneous (3 flagged), 6 correct (4 passed): accuracies 0.75 and 2/3
    pred = [True, True, True, False, False, False, False, False, True, True]
    y = [True] * 4 + [False] * 6
    d = K.detection_scores(pred, y)
    assert d["acc_error"] == 0.75 and d["acc_correct"] == pytest.approx(4 / 6)
    assert d["f1"] == pytest.approx(2 * 0.75 * (4 / 6) / (0.75 + 4 / 6)) and (d["n_error"], d["n_correct"]) == (4, 6)


def test_detection_reads_yes_minus_no_logits(tiny):
    sm = tiny
    yes, no = K.yes_no_ids(sm.tokenizer)
    traces = [t for pair in K.trace_pairs(2, n_steps=2) for t in pair]  # clean, bad, clean, bad
    m = K.yes_no_margins(sm, traces, chat=False)
    logits = sm.forward([K.detection_prompt(t) for t in traces], chat=False)[:, -1]
    np.testing.assert_allclose(m, (logits[:, yes] - logits[:, no]).numpy(), atol=1e-5)
    d = K.detection_eval(sm, traces, chat=False)
    assert d == {**K.detection_scores(m > 0, [t.corrupted >= 0 for t in traces]), "mean_margin": pytest.approx(m.mean()),
                 "auroc": d["auroc"]}


def test_sweep_rows_and_result(tiny):
    sm = tiny
    res = K.run_critique(sm, 2, n_eval=2, layers=[0, 1], alphas=[-1.0, 0.0, 1.0], lens_k=3, chat=False)
    assert res.contrast == "error" and len(res.rows) == 6
    assert [(r["layer"], r["alpha"]) for r in res.rows] == [(l, a) for l in (0, 1) for a in (-1.0, 0.0, 1.0)]
    base = [r for r in res.rows if r["alpha"] == 0.0]
    assert base[0]["f1"] == base[1]["f1"] and base[0]["mean_margin"] == base[1]["mean_margin"]
    d = res.to_dict()
    assert d["contrast"] == "error" and len(d["norms"]) == sm.n_layers and set(d["lens"]) == {"0", "1"}
    assert len(d["lens"]["0"]["top"]) == 3
    fig = res.plot()
    assert len(fig.data) == 2 and list(fig.data[0].x) == [-1.0, 0.0, 1.0]
    j = json.loads(json.dumps(res.to_json()))
    assert j["rows"] == json.loads(json.dumps(d["rows"])) and j["saved_layer"] == res.best()["layer"]
    sv = K.to_artifact(sm, res, 1)
    assert sv.layers == [1] and sv.provenance.method == K.METHOD
    assert sv.provenance.method_params["contrast"] == "error"
    torch.testing.assert_close(sv.directions[1], res.vectors[1])


def test_bad_inputs_have_clear_messages(tiny):
    sm = tiny
    pairs = K.trace_pairs(3, n_steps=2)
    clean, bad = [c for c, _ in pairs], [e for _, e in pairs]
    with pytest.raises(InputError, match="at least one clean"):
        K.critique_vector(sm, [], bad)
    with pytest.raises(InputError, match="one clean trace per corrupted trace"):
        K.critique_vector(sm, clean, bad[:2])
    with pytest.raises(InputError, match="same question"):
        K.critique_vector(sm, bad, clean)
    with pytest.raises(InputError, match="contrast in"):
        K.critique_vector(sm, clean, bad, contrast="nope")
    with pytest.raises(InputError, match="one recovered flag per item"):
        K.critique_vector(sm, clean, bad, recovered=[True])
    with pytest.raises(InputError, match="at least one recovery"):
        K.critique_vector(sm, clean, bad, contrast="recovery", recovered=[False] * 3)
    with pytest.raises(InputError, match="both activation sets non-empty"):
        K.vector_from_activations(torch.zeros(0, 4), torch.zeros(2, 4))
    with pytest.raises(InputError, match="one prediction per sequence"):
        K.detection_scores([True, False], [True, False, True])
    with pytest.raises(InputError, match="both erroneous and correct"):
        K.detection_scores([True, False], [True, True])
    with pytest.raises(InputError, match="at least one evaluation"):
        K.detection_eval(sm, [])
    with pytest.raises(InputError, match="vectors"):
        K.critique_sweep(sm, torch.zeros(5, sm.d_model), clean + bad, [0], [1.0])
    with pytest.raises(InputError, match="layers in"):
        K.critique_activations(sm, clean, layers=[7])
    with pytest.raises(InputError, match="step like"):
        K.check_step("three plus four")


# --------------------------------------------------------------------------- default model
def test_end_to_end_on_the_default_model(sm):
    res = K.run_critique(sm, 4, n_eval=4, layers=[10, 20], alphas=[-1.0, 0.0, 1.0], lens_k=5)
    assert res.contrast in ("recovery", "error") and res.n_train == 4
    assert res.vectors.shape == (sm.n_layers, sm.d_model) and all(np.isfinite(res.norms))
    assert len(res.rows) == 6 and all(0.0 <= r["f1"] <= 1.0 for r in res.rows)
    assert all(r["n_error"] == 2 and r["n_correct"] == 2 for r in res.rows)
    # steering moves the Yes-No margin (the vector is not zero and alpha is applied)
    margins = {(r["layer"], r["alpha"]): r["mean_margin"] for r in res.rows}
    assert margins[(20, 1.0)] != margins[(20, 0.0)]
    assert len(res.lens[20]["top"]) == 5
    sv = K.to_artifact(sm, res, 20)
    assert sv.provenance.method_params["contrast"] == res.contrast and sv.layers == [20]


def test_cli_registers_critique_and_saves_the_vector(tiny, tmp_path, capsys):
    from steerkit.vectors import Store

    from steerkit.cli import build_parser
    from steerkit.cli.methods import _critique
    a = build_parser().parse_args(["critique", "--n", "2", "--n-eval", "2", "--layers", "0,1", "--alphas=-1,0,1",
                                   "--out", str(tmp_path), "--quiet"])
    assert a.func is not None and a.method == "critique" and a.contrast == "auto"
    assert build_parser().parse_args(["critique"]).alphas.split(",") == [f"{x:g}" for x in K.DEFAULT_ALPHAS]
    report = {}
    _critique(tiny, a, report)
    r = report["critique"]
    assert r["contrast"] == "error" and len(r["rows"]) == 6 and r["saved_layer"] in (0, 1)
    sv = Store(tmp_path).load("critique-vector")
    assert sv.layers == [r["saved_layer"]] and sv.provenance.method_params["contrast"] == "error"
    assert "rows" in sv.provenance.metrics
    assert "critique-vector" in capsys.readouterr().out
    a.layer = 5
    with pytest.raises(InputError, match="--layer among the swept layers"):
        _critique(tiny, a, {})
