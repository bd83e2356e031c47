"""Temporal profile + injection, norm growth, HSIC MI peaks and CAA (probes/methods/temporal, norms, mi, caa),
and the registry of every method (steerkit.probes.methods.REGISTRY).

Mechanics on tiny random models with planted structure; one short end-to-end check on the default
model (SmolLM2-135M-Instruct).
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import sys

import numpy as np
import pytest
import torch

from steerkit.errors import InputError
from steerkit.model import wrap
from steerkit.probes.methods import REGISTRY, Method
from steerkit.probes.methods import caa as C
from steerkit.probes.methods import critique as K
from steerkit.probes.methods import induction as IND
from steerkit.probes.methods import ioi as IOI
from steerkit.probes.methods import mi as M
from steerkit.probes.methods import norms as N
from steerkit.probes.methods import refusal as R
from steerkit.probes.methods import region as RG
from steerkit.probes.methods import temporal as T
from steerkit.probes.train import ABItem
from tiny_models import tiny_model

torch.set_num_threads(1)


SHORT = [("x then y", "y then x"), ("a; b; c", "c; b; a"), ("up, down", "down, up"), ("1 2 3", "3 2 1"),
         ("go then stop", "stop then go"), ("eat, sleep", "sleep, eat")]
SHORT_AB = [ABItem("Pick?", "now", "later", "A"), ABItem("Take?", "more later", "less now", "B"),
            ABItem("Get?", "1 now", "5 soon", "A"), ABItem("Want?", "big later", "small now", "B"),
            ABItem("Eat?", "a bit now", "a lot later", "A"), ABItem("Go?", "far later", "near now", "B")]


def _sm(arch="llama", **kw):
    model, tok = tiny_model(arch, **kw)
    return wrap(model, tok, name=f"tiny-{arch}")


# --------------------------------------------------------------------------- temporal
def test_pairs_and_questions_generator():
    pairs = T.temporal_pairs(60, seed=0)
    assert len(pairs) == 60 and len({p.text for p in pairs}) >= 50
    for p in pairs[:10]:
        assert p.text != p.text_rev and len(p.events) >= 2
        assert p.events[0] in p.text and p.events[-1] in p.text_rev
    qs = T.order_questions(200, seed=1)
    assert len(qs) == 200
    assert {q.kind for q in qs} == {"yesno", "choice"}
    assert 60 < sum(q.answer == 0 for q in qs) < 140
    assert all(q.prompt_rev and q.prompt_rev != q.prompt for q in qs)


def test_profile_from_planted_states_finds_the_peak():
    g = torch.Generator().manual_seed(0)
    n, L, d = 40, 6, 32
    h = torch.randn(n, L, d, generator=g) * 10
    scales = torch.tensor([0.1, 0.3, 0.5, 2.0, 0.7, 0.4])
    u = torch.randn(d, generator=g)
    u = u / u.norm()
    hr = h - (scales[None, :, None] * 10) * u
    prof = T.profile_from_states(h, hr)
    assert prof.peak_layer == 3
    ref = ((h - hr).norm(dim=-1) / h.norm(dim=-1)).mean(0)
    assert np.allclose(prof.rel, ref.numpy(), atol=1e-6)
    assert torch.allclose(prof.tau[3], 20 * u, atol=1e-4)
    w = prof.weights()
    assert w.max() == pytest.approx(1.0)
    sched = prof.schedule()
    assert sorted(sched.weights) == [4, 5] and sched.weights[4] == pytest.approx(w[4])


def test_temporal_profile_on_tiny_model_with_planted_direction():
    sm = _sm(num_hidden_layers=3)
    pairs = SHORT
    same = T.temporal_profile(sm, [(p[0], p[0]) for p in pairs])
    assert same.rel.shape == (3,) and np.allclose(same.rel, 0, atol=1e-6) and np.allclose(same.cos, 1, atol=1e-5)
    u = torch.randn(sm.d_model)
    u = 5 * u / u.norm()
    calls = {"n": 0}

    def plant(sign):  # the ordered prompts only (temporal_profile runs them first, in one batch)
        def fn(x):
            if calls["n"] == 0:
                return x + sign * u
            return x
        return fn

    def count(x):
        calls["n"] += 1
        return x
    with sm.edit({"blocks.1.hook_resid_post": plant(1), "blocks.2.hook_resid_pre": plant(-1)}, op="fn"), \
            sm.edit({"blocks.2.hook_resid_post": count}, op="fn"):
        prof = T.temporal_profile(sm, [(p[0], p[0]) for p in pairs], batch_size=16)
    # identical texts: the only ordered-vs-reversed difference is the planted one, at block 1's output
    assert prof.peak_layer == 1
    assert prof.rel[1] > 0.1 and max(prof.rel[0], prof.rel[2]) < 1e-4
    assert torch.allclose(prof.tau[1], u, atol=1e-4)
    assert prof.taus.shape == (6, 3, sm.d_model)
    assert sm.hook_count() == 0


def test_choice_accuracy_and_beta_on_dev():
    sm = _sm()
    items = [T.OrderItem(f"{a}? Yes or No", ["Y", "N"], i % 2, "yesno", f"{b}?") for i, (a, b) in enumerate(SHORT)]
    base = T.choice_accuracy(sm, items, chat=False)
    assert base["n"] == 6 and 0 <= base["accuracy"] <= 1 and base["ci95"][0] <= base["accuracy"] <= base["ci95"][1]
    beta, rows = T.choose_beta(sm, items[:4], torch.zeros(sm.d_model), {1: 1.0}, [0.0, 1.0], chat=False)
    assert beta == 0.0 and len(rows) == 2


# --------------------------------------------------------------------------- norms
def test_norm_profile_mechanics():
    sm = _sm(num_hidden_layers=3)
    prompts = ["hello there", "abc", "a longer prompt with more tokens"]
    prof = N.norm_profile(sm, prompts, chat=False)
    assert prof.mean.shape == (3,) and prof.growth.shape == (2,)
    assert prof.n_tokens == sum(len(p) for p in prompts)
    with sm.record("blocks.2.hook_resid_post", positions="prompt") as c:
        sm.forward(prompts, chat=False)
    x, lens = c["blocks.2.hook_resid_post"], c.lengths("blocks.2.hook_resid_post")
    allv = torch.cat([x[r, : int(lens[r])].norm(dim=-1) for r in range(3)])
    assert prof.mean[2] == pytest.approx(float(allv.mean()), rel=1e-5)
    assert prof.first[2] == pytest.approx(float(torch.stack([x[r, 0].norm() for r in range(3)]).mean()), rel=1e-5)


def _eager_attention(model, ids):
    """Per layer ``[T, T]`` attention weights (mean over heads) of one unpadded row, from transformers'
    eager attention with ``output_attentions`` (the independent reference)."""
    prev = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            att = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    finally:
        model.set_attn_implementation(prev)
    return [a[0].mean(0) for a in att]


def test_attention_drift_masses_sum_to_one_and_match_the_attention_weights():
    model, tok = tiny_model("llama", num_hidden_layers=3, attn_implementation="sdpa")
    sm = wrap(model, tok, name="tiny-llama")
    prompts = ["hello there", "abc"]
    d = N.attention_drift(sm, prompts, max_new_tokens=5, window=2, chat=False)
    assert model.config._attn_implementation == "sdpa"  # the pattern hooks are gone, the model's own attention back
    assert sm.hook_count() == 0
    assert d.sink.shape == (3, d.n_steps) and 1 <= d.n_steps <= 5 and d.rows_per_step[0] == 2
    total = d.sink + d.recent + d.prompt + d.generated
    np.testing.assert_allclose(total, 1.0, atol=1e-5)
    assert (d.norm > 0).all()
    # window 1: "recent" is the mass a query puts on itself; check one row against the weights
    one = N.attention_drift(sm, prompts[:1], max_new_tokens=4, window=1, chat=False)
    gen = sm.generate(prompts[:1], max_new_tokens=4, chat=False, return_tokens=True)[0]
    ids = tok.encode(prompts[0], add_special_tokens=False) + gen
    att = _eager_attention(model, ids)
    P = len(ids) - len(gen)
    for l in range(3):
        a = att[l]  # [T, T]
        for s in range(one.n_steps):
            q = P - 1 + s
            assert one.recent[l, s] == pytest.approx(float(a[q, q]), abs=1e-5)
            assert one.sink[l, s] == pytest.approx(float(a[q, 0]), abs=1e-5)
            assert one.prompt[l, s] == pytest.approx(float(a[q, 1:min(P, q)].sum()), abs=1e-5)
    # the padded batch (the shorter prompt left-padded): its sink mass is the mean of each row's own
    gens = sm.generate(prompts, max_new_tokens=5, chat=False, return_tokens=True)
    assert len({len(g) for g in gens}) == 1 and len(gens[0]) == d.n_steps
    rows = [tok.encode(p, add_special_tokens=False) for p in prompts]
    atts = [_eager_attention(model, r + g) for r, g in zip(rows, gens)]
    for l in range(3):
        for s in range(d.n_steps):
            want = np.mean([float(a[l][len(r) - 1 + s, 0]) for r, a in zip(rows, atts)])
            assert d.sink[l, s] == pytest.approx(want, abs=1e-5)
    fig = d.plot()
    assert len(fig.data) > 4
    with pytest.raises(InputError, match="window"):
        N.attention_drift(sm, prompts, window=0)


def test_norm_chain_first_pass_is_the_model_and_later_passes_reapply_the_blocks():
    sm = _sm(num_hidden_layers=3)
    prompts = ["hello there", "abc", "a longer prompt"]
    one = N.norm_chain(sm, prompts, passes=1, chat=False)
    prof = N.norm_profile(sm, prompts, chat=False)
    np.testing.assert_allclose(one.norms, prof.mean_no_first, rtol=1e-5)
    np.testing.assert_allclose(one.first, prof.first, rtol=1e-5)
    two = N.norm_chain(sm, prompts, passes=2, chat=False)
    assert two.norms.shape == two.first.shape == (6,) and two.growth_per_pass.shape == (1,)
    np.testing.assert_allclose(two.norms[:3], one.norms, rtol=1e-6)
    # independent: feed the last block's output back as input embeddings (Llama: blocks 0..L-1 again)
    toks = sm.tokenize(prompts, chat=False)
    outs = []
    blocks = sm.hf_model.model.layers
    hs = [b.register_forward_hook(lambda m, i, o: outs.append(o[0] if isinstance(o, tuple) else o)) for b in blocks]
    try:
        with torch.inference_mode():
            kw = dict(attention_mask=toks.attention_mask, position_ids=toks.position_ids, use_cache=False)
            sm.hf_model(input_ids=toks.input_ids, **kw)
            sm.hf_model(inputs_embeds=outs[2].clone(), **kw)
    finally:
        for h in hs:
            h.remove()
    real = toks.attention_mask.bool().clone()
    real[torch.arange(3), real.float().argmax(1)] = False
    ref = [float(o.norm(dim=-1)[real].mean()) for o in outs[3:]]
    np.testing.assert_allclose(two.norms[3:], ref, rtol=1e-5)
    assert len(two.plot().data) == 2
    with pytest.raises(InputError, match="passes"):
        N.norm_chain(sm, prompts, passes=0)


# --------------------------------------------------------------------------- MI
def _hsic_direct(x, y, sigma=50.0, eps=1e-5):
    """Direct small-matrix computation, element by element, in float64."""
    x = np.asarray(x, float).reshape(-1, 1)
    y = np.asarray(y, float).reshape(-1, 1)
    m = len(x)
    H = np.eye(m) - np.ones((m, m)) / m

    def K(z):
        D = np.array([[float(((z[i] - z[j]) ** 2).sum()) for j in range(m)] for i in range(m)])
        return np.exp(-D / (2 * sigma ** 2 * z.shape[1])) @ H
    Kx, Ky = K(x), K(y)
    Rx = Kx @ np.linalg.inv(Kx + eps * m * np.eye(m))
    Ry = Ky @ np.linalg.inv(Ky + eps * m * np.eye(m))
    return float((Rx * Ry.T).sum())


def test_hsic_matches_direct_computation():
    g = np.random.default_rng(0)
    x = g.normal(size=24) * 30
    y = x * 0.5 + g.normal(size=24) * 5
    z = g.normal(size=24) * 30
    for a, b in [(x, y), (x, z)]:
        assert M.hsic_mi(a, b, dtype=torch.float64) == pytest.approx(_hsic_direct(a, b), rel=1e-8)
        assert M.hsic_mi(a, b) == pytest.approx(_hsic_direct(a, b), rel=3e-2)  # float32 as the reference: ill-conditioned inverse
    assert M.hsic_mi(x, y) > M.hsic_mi(x, z)
    assert M.hsic_mi(x, x) >= M.hsic_mi(x, y)


def test_find_peaks_and_trajectory():
    v = [1.0] * 20 + [10.0] + [1.0] * 5
    assert M.find_peaks(v) == [20]
    sm = _sm()
    tr = M.mi_trajectory(sm, "hello", "the answer is 4", layer=1, max_new_tokens=6, chat=False)
    assert len(tr.mi) == len(tr.tokens) >= 1 and np.isfinite(tr.mi).all()


# --------------------------------------------------------------------------- CAA
def test_caa_vector_is_mean_difference_at_answer_letter():
    sm = _sm()
    items = SHORT_AB[:4]
    v = C.caa_vector(sm, items, chat=False)
    assert v.shape == (sm.n_layers, sm.d_model)
    with sm.record("blocks.1.hook_resid_post", positions="last") as c:
        sm.forward([it.text + "(" + it.matching for it in items], chat=False)
        sm.forward([it.text + "(" + it.not_matching for it in items], chat=False)
    a = c["blocks.1.hook_resid_post"]
    assert torch.allclose(v[1], a[:4].mean(0) - a[4:].mean(0), atol=1e-5)
    rows = C.caa_eval(sm, v, items, layers=[1], multipliers=[-1.0, 0.0, 1.0], chat=False)
    assert len(rows) == 3 and all(0 <= r["p_matching"] <= 1 for r in rows)
    assert sm.hook_count() == 0


def test_caa_planted_direction_moves_the_letter():
    sm = _sm()
    items = SHORT_AB
    ids = {l: sm.tokenizer(l, add_special_tokens=False)["input_ids"][0] for l in "AB"}
    W = sm.hf_model.lm_head.weight.detach()
    v = W[ids["A"]] - W[ids["B"]]  # at the last block's output this favours "A"
    items_a = [it for it in items if it.matching == "A"]
    p0 = C.matching_prob(sm, items_a, chat=False)
    p1 = C.matching_prob(sm, items_a, vector=v, layer=sm.n_layers - 1, multiplier=3.0, chat=False)
    assert p1 > p0


def test_caa_adds_after_the_instruction_and_at_generated_tokens_only():
    sm = _sm()
    sm.tokenizer.chat_template = ("{% for m in messages %}<u>{{ m['content'] }}</u>{% endfor %}"
                                  "{% if add_generation_prompt %}<a>{% endif %}")
    spec = C.after_instruction(sm)  # "</u><a>" (7 characters) and "(" -> the last 8 prompt tokens
    prompts = [sm.format(q, True) + "(" for q in ("Pick one?", "Which?")]
    v = torch.randn(sm.d_model)
    name = "blocks.1.hook_resid_post"
    with sm.record(name, positions="all") as base:
        sm.generate(prompts, max_new_tokens=3, chat=False)
    with sm.edit(name, add=v, scale=2.0, positions=spec), sm.record(name, positions="all") as new:
        sm.generate(prompts, max_new_tokens=3, chat=False)
    for r, p in enumerate(prompts):
        n_prompt = len(p)  # one token per character
        n = int(base.lengths(name)[r])
        d = new[name][r, :n] - base[name][r, :n]
        assert float(d[: n_prompt - 8].abs().max()) == 0.0  # the instruction itself: untouched
        # after the instruction the edit is there (the first edited position exactly 2v; later ones
        # also carry the changed attention, so only "changed" is asserted)
        torch.testing.assert_close(d[n_prompt - 8], 2.0 * v, atol=1e-5, rtol=1e-5)
        assert bool((d[n_prompt - 8:].abs().amax(-1) > 1e-3).all())
    assert C.after_instruction(sm, chat=False).__class__.__name__ == "AnyOf"
    assert sm.hook_count() == 0


# --------------------------------------------------------------------------- default model (short)
def test_default_model_end_to_end(sm):
    pairs = T.temporal_pairs(8, seed=0)
    prof = T.temporal_profile(sm, pairs)
    assert prof.rel.shape == (sm.n_layers,) and 0 <= prof.peak_layer < sm.n_layers
    assert (prof.rel > 0).all() and (prof.cos < 1).all()
    items = T.order_questions(4, seed=5)
    acc = T.choice_accuracy(sm, items, steering=T.injection_spec(prof.tau[prof.peak_layer], prof.schedule(), 1.0))
    assert acc["n"] == 4
    norms = N.norm_profile(sm, ["What is 2+2?", "Name a color."])
    assert norms.mean.shape == (sm.n_layers,)
    v = C.caa_vector(sm, C.AB_ITEMS[:4])
    assert v.shape == (sm.n_layers, sm.d_model) and float(v.norm()) > 0


def test_cli_registers_the_method_commands():
    from steerkit.cli import build_parser
    p = build_parser()
    for argv in (["temporal", "--n-pairs", "8"], ["norms"], ["mi-peaks", "--n", "1"], ["caa", "--layers", "3"]):
        a = p.parse_args(argv)
        assert a.func is not None and a.method == argv[0]


def test_cli_norms_on_default_model(sm, tmp_path, capsys):
    from steerkit.cli import main
    f = tmp_path / "p.txt"
    f.write_text("Hello\nWhat is 2+2?\n")
    rep = tmp_path / "r.json"
    assert main(["norms", str(f), "--quiet", "--report", str(rep)]) == 0
    import json
    r = json.loads(rep.read_text())
    assert len(r["norms"]["mean"]) == sm.n_layers


def test_result_objects_plot():
    pytest.importorskip("plotly")
    p = T.profile_from_states(torch.randn(4, 5, 8), torch.randn(4, 5, 8))
    assert len(p.plot().data) == 3
    n = N.NormProfile(np.ones(3), np.zeros(3), np.ones(3), np.ones(3), 5)
    assert len(n.plot().data) == 3
    tr = M.MITrajectory(1, np.array([1.0, 3.0, 1.0]), ["a", "b", "c"], [1])
    assert len(tr.plot().data) == 2
    for r in (p, n, tr):  # JSON round trip of the to_json form
        assert json.loads(json.dumps(r.to_json())) == r.to_dict()
    assert json.loads(json.dumps(tr.to_json()))["peak_tokens"] == ["b"]


# --------------------------------------------------------------------------- the registry
def _tiny_configs():
    return {
        "refusal": R.RefusalConfig(n_train=6, n_val=4, n_test=4, max_new_tokens=3, min_keep=100),
        "temporal": T.TemporalConfig(n_pairs=4, eval=4, n_dev=4, betas=(0.0, 1.0)),
        "norms": N.NormsConfig(prompts=("hi", "what is 2+2?"), drift_tokens=3, passes=2),
        "mi-peaks": M.MIConfig(n=1, max_new_tokens=4, eval="arith", n_eval=2, eval_tokens=4, thinking_words=("a", "e")),
        "caa": C.CAAConfig(layers=(0, 1), multipliers=(-1.0, 0.0, 1.0)),
        "region": RG.RegionConfig(n_train=4, n_test=2, max_new_tokens=8, train_max_new_tokens=8, keep="all",
                                  n_components=2, n_clusters=2),
        "critique": K.CritiqueConfig(n=2, n_eval=2, layers=(0, 1), alphas=(-1.0, 0.0, 1.0)),
        "induction": IND.InductionConfig(n_seqs=3, seq_len=5, batch_size=2),
        "ioi": IOI.IOIConfig(templates=("When{IO} and{S} met,{S2} gave it to",), names=(("a", "b"), ("c", "d"))),
    }


KEYS = {"refusal": {"metrics", "candidates", "probe", "samples"}, "temporal": {"profile", "source_layer", "eval"},
        "norms": {"norms", "chain", "drift"}, "mi-peaks": {"mi", "peak_tokens", "thinking_eval"}, "caa": {"caa"},
        "region": {"layer", "fit", "train", "eval"}, "critique": {"rows", "norms", "best", "saved_layer"},
        "induction": {"scores", "loss", "loss_first", "loss_repeated", "top_heads"},
        "ioi": {"pairs", "resid_pre", "z", "s2_curve", "end_curve", "top_heads"}}


def _result_type(m):
    ann = inspect.signature(m.run).return_annotation
    return getattr(sys.modules[m.run.__module__], ann) if isinstance(ann, str) else ann


def test_every_registry_entry_has_a_cli_verb_a_config_and_a_result_with_to_json_and_plot():
    from steerkit.cli import build_parser
    from steerkit.cli import refusal as cli_refusal
    assert set(REGISTRY) == set(_tiny_configs()) == {"refusal", "temporal", "norms", "mi-peaks", "caa", "region",
                                                     "critique", "induction", "ioi"}
    p = build_parser()
    for name, m in REGISTRY.items():
        assert isinstance(m, Method) and m.name == name and m.summary and callable(m.run)
        assert dataclasses.is_dataclass(m.config) and isinstance(m.config(), m.config)  # defaults build
        assert list(inspect.signature(m.run).parameters)[:2] == ["sm", "config"]
        a = p.parse_args([name])  # the CLI verb of the same name
        assert a.func is (cli_refusal.run if name == "refusal" else a.func) and callable(a.func)
        if name != "refusal":
            assert a.method == name
        res_t = _result_type(m)
        assert callable(getattr(res_t, "to_json", None)) and callable(getattr(res_t, "plot", None)), name
    with pytest.raises(dataclasses.FrozenInstanceError):
        REGISTRY["caa"].name = "other"


def test_every_registry_method_runs_on_a_tiny_model_and_its_result_serialises_and_plots():
    pytest.importorskip("plotly")
    sm = _sm(max_position_embeddings=2048)
    for name, cfg in _tiny_configs().items():
        m = REGISTRY[name]
        assert isinstance(cfg, m.config)
        res = m.run(sm, cfg, progress=False)
        assert isinstance(res, _result_type(m)), name
        d = res.to_json()
        back = json.loads(json.dumps(d, allow_nan=False))  # plain JSON: no NaN, no tensors
        assert isinstance(d, dict) and set(back) == set(d) and KEYS[name] <= set(back), (name, sorted(back))
        fig = res.plot()
        assert type(fig).__name__ == "Figure" and len(fig.data) >= 1, name
        if hasattr(res, "artifacts"):
            assert all(isinstance(k, str) for k in res.artifacts(sm)), name
        assert sm.hook_count() == 0, name
