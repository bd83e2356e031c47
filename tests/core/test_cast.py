"""Conditional activation steering (CAST, Lee et al. 2024) through the one intervention spine.

Mechanics on a tiny random-weight Llama (fast); the measured topic condition and its behaviour on the
default model (``default_model``, marked slow).
"""
from __future__ import annotations

import json
import warnings
from importlib.resources import files

import numpy as np
import pytest
import torch

import steerkit
import steerkit.probes
from steerkit import Condition, Intervention, When
from steerkit.errors import InputError
from steerkit.interventions import aggregate_rows, compile_steering, condition_similarity
from steerkit.vectors import (ArtifactFormatError, ConditionalRule, ConditionalSteering, ConditionVector,
                              ModelMismatchError, Provenance, SteeringVector, Store, VectorsError)
from steerkit.vectors.artifacts import artifact_to_payload, payload_to_artifact
from steerkit.vectors.exports import import_artifact, save_artifact

from tiny_models import no_leftover_hooks

COND_SITE = "blocks.1.hook_resid_pre"
LATE = "blocks.2.hook_resid_post"
EARLY = "blocks.0.hook_resid_post"
PROMPTS = ["hello there", "cook some pasta", "abc", "the weather is nice today", "x"]


TINY = {"num_hidden_layers": 4}


@pytest.fixture
def t(tiny):
    with no_leftover_hooks(tiny) as m:
        yield m


def _sims(sm, cond_like: Condition, prompts=PROMPTS) -> torch.Tensor:
    """The similarities the compiled evaluator computes for ``prompts`` (a condition-only steering)."""
    cs = compile_steering([], sm.facts, conditions=[cond_like])
    with sm.hooks.install(cs):
        sm.forward(prompts, chat=False)
    return cs.similarities[cond_like]


def _split(sm, u, site=COND_SITE, **kw) -> Condition:
    """A condition at ``site`` along ``u`` whose threshold splits PROMPTS (between the middle similarities)."""
    s = _sims(sm, Condition(site, u, 0.0, **kw)).sort().values
    k = len(s) // 2
    return Condition(site, u, float(s[k - 1] + s[k]) / 2, **kw)


def _changed(a: torch.Tensor, b: torch.Tensor) -> list[bool]:
    return [bool(x) for x in (a - b).abs().flatten(1).amax(1) > 0]


@pytest.fixture(scope="module")
def u(tiny):
    return torch.randn(tiny.d_model, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def v(tiny):
    return 8.0 * torch.randn(tiny.d_model, generator=torch.Generator().manual_seed(2))


# ----------------------------------------------------------------------------- the formula
def test_similarity_formula_is_cast():
    h = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    u = torch.randn(16, generator=torch.Generator().manual_seed(1))
    un = u / u.norm()
    P = torch.outer(un, un)
    proj = torch.tanh(h @ P.T)  # IBM: tanh(P h)
    want = (h * proj).sum(-1) / (h.norm(dim=-1) * proj.norm(dim=-1))
    torch.testing.assert_close(condition_similarity(h, u, "cast"), want)
    torch.testing.assert_close(condition_similarity(h, u, "cosine"), torch.nn.functional.cosine_similarity(h, un[None]))


def test_aggregate_excludes_padding():
    x = torch.tensor([[[9.0], [1.0], [3.0]], [[5.0], [7.0], [9.0]]])
    m = torch.tensor([[False, True, True], [True, True, False]])
    assert aggregate_rows(x, m, "mean").flatten().tolist() == [2.0, 6.0]
    assert aggregate_rows(x, m, "last").flatten().tolist() == [3.0, 7.0]


def test_evaluator_matches_recorded_formula(t, u):
    c = Condition(COND_SITE, u, 0.0)
    toks = t.tokenize(PROMPTS, chat=False)
    with t.record(COND_SITE, positions="prompt") as cache:
        t.forward(toks)
    x, n = cache[COND_SITE], cache.lengths(COND_SITE)
    want = c.scores(x, torch.arange(x.shape[1])[None] < n[:, None])
    torch.testing.assert_close(_sims(t, c), want, rtol=1e-5, atol=1e-6)
    last = Condition(COND_SITE, u, 0.0, aggregate="last", measure="cosine")
    want = condition_similarity(x[torch.arange(len(PROMPTS)), n - 1], u, "cosine")
    torch.testing.assert_close(_sims(t, last), want, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("kw, match", [
    (dict(comparator="larger"), "comparator"), (dict(aggregate="max"), "aggregate"), (dict(measure="dot"), "measure"),
    (dict(threshold=float("nan")), "finite"), (dict(direction=torch.zeros(64)), "nonzero"),
    (dict(direction=torch.ones(2, 64)), r"\[d_model\]"), (dict(site=""), "hook name"),
])
def test_condition_validation(kw, match):
    args = {**dict(site=COND_SITE, direction=torch.ones(64), threshold=0.1), **kw}
    with pytest.raises(InputError, match=match):
        Condition(**args)


def test_when_validation_and_equality(u):
    c = Condition(COND_SITE, u, 0.1)
    assert c == Condition(COND_SITE, u.clone(), 0.1) and hash(c) == hash(Condition(COND_SITE, u.clone(), 0.1))
    assert c != Condition(COND_SITE, u, 0.2)
    for bad in [(), ("c",), [c, "c"]]:
        with pytest.raises(InputError, match="one or more"):
            When(bad)
    with pytest.raises(InputError, match="mode"):
        When((c,), mode="xor")
    with pytest.raises(InputError, match="negate"):
        When((c,), negate=1)
    with pytest.raises(InputError, match="when="):
        Intervention.add(LATE, u, when="yes")
    iv = Intervention.add(LATE, u, when=c)  # one Condition is a rule of its own
    assert iv.when == When((c,)) and iv.at("prompt").when == iv.when
    assert When((c, c)).conditions == (c,)


def test_compile_checks_conditions(t, u):
    with pytest.raises(InputError, match=r"shape \[64\]"):
        compile_steering([Intervention.add(LATE, u, when=Condition(COND_SITE, torch.ones(32), 0.0))], t.facts)
    with pytest.raises(InputError, match="attention matrix"):
        compile_steering([], t.facts, conditions=[Condition("blocks.1.attn.hook_pattern", torch.ones(64), 0.0)])
    with pytest.raises(steerkit.errors.HookNameError):
        compile_steering([], t.facts, conditions=[Condition("blocks.9.hook_resid_pre", torch.ones(64), 0.0)])
    with pytest.raises(InputError, match="Condition"):
        compile_steering([], t.facts, conditions=["c"])
    with pytest.raises(InputError, match="at least one"):
        compile_steering([], t.facts)


# ----------------------------------------------------------------------------- mechanics
def test_behaviour_only_on_fired_rows_forward(t, u, v):
    c = _split(t, u)
    base = t.forward(PROMPTS, chat=False)
    with t.steer([Intervention.add(LATE, v, when=When((c,)))]) as h:
        out = t.forward(PROMPTS, chat=False)
        fired = h.decisions[c].tolist()
    assert 0 < sum(fired) < len(PROMPTS)
    assert _changed(out, base) == fired
    for b, f in enumerate(fired):
        if not f:
            assert torch.equal(out[b], base[b])
    assert h.compiled.decisions[c].tolist() == fired and set(h.compiled.similarities) == {c}
    assert t.hook_count() == 0


def test_decision_held_across_decoding_steps(t, u, v):
    c = _split(t, u)
    kw = dict(max_new_tokens=8, chat=False, return_tokens=True)
    plain = t.generate(PROMPTS, **kw)
    always = t.generate(PROMPTS, steering=[Intervention.add(LATE, v)], **kw)
    cond = t.generate(PROMPTS, steering=[Intervention.add(LATE, v, when=When((c,)))], **kw)
    fired = (_sims(t, c) > c.threshold).tolist()
    assert 0 < sum(fired) < len(PROMPTS)
    for b, f in enumerate(fired):
        assert cond[b] == (always[b] if f else plain[b]), b  # steered at every decoding step of fired rows
    assert any(always[b] != plain[b] for b, f in enumerate(fired) if f)


def test_behaviour_before_condition_site_waits_for_the_decision(t, u, v):
    """On the prompt pass a behaviour at a site before its condition's has no decision yet: nothing
    there; decoding steps hold the decision, so an always-firing condition is positions='generated'."""
    c = Condition("blocks.2.hook_resid_pre", u, -1.0)  # cos > -1: fires on every row
    base = t.forward(PROMPTS, chat=False)
    with t.steer([Intervention.add(EARLY, v, when=c)]) as h:
        out = t.forward(PROMPTS, chat=False)
        assert all(h.decisions[c].tolist())
    assert torch.equal(out, base)
    kw = dict(max_new_tokens=6, chat=False, return_tokens=True)
    cond = t.generate(PROMPTS, steering=[Intervention.add(EARLY, v, when=c)], **kw)
    gen_only = t.generate(PROMPTS, steering=[Intervention.add(EARLY, v, positions="generated")], **kw)
    assert cond == gen_only
    # at the condition's own site the decision comes first: the prompt pass is steered
    with t.steer([Intervention.add("blocks.2.hook_resid_pre", v, when=c)]):
        assert all(_changed(t.forward(PROMPTS, chat=False), base))


def test_any_all_negate(t, u, v):
    c1 = _split(t, u)
    c2 = _split(t, -u.roll(7), site="blocks.2.hook_resid_pre")
    f1 = (_sims(t, c1) > c1.threshold)
    f2 = (_sims(t, c2) > c2.threshold)
    base = t.forward(PROMPTS, chat=False)
    cases = {When((c1, c2), "any"): f1 | f2, When((c1, c2), "all"): f1 & f2,
             When((c1, c2), "any", negate=True): ~(f1 | f2), When((c1,), negate=True): ~f1}
    for w, want in cases.items():
        with t.steer([Intervention.add("blocks.3.hook_resid_post", v, when=w)]):
            got = _changed(t.forward(PROMPTS, chat=False), base)
        assert got == want.tolist(), (w, got, want)
    assert (f1 != f2).any()


def test_two_rules_and_unconditional_at_one_site(t, u, v):
    """"if C1 then B1, if C2 then B2" plus an unconditional edit: one kernel table with (positions,
    when) specs; each row gets the sum of what applies to it."""
    c1, c2 = _split(t, u), Condition(COND_SITE, u, -1.0, comparator="below")  # c2 never fires
    f1 = (_sims(t, c1) > c1.threshold)
    w = 0.5 * v.roll(3)
    with t.steer([Intervention.add(LATE, v, when=c1), Intervention.add(LATE, 5 * v, when=c2),
                  Intervention.add(LATE, w)]):
        got = t.forward(PROMPTS, chat=False)
    toks = t.tokenize(PROMPTS, chat=False)
    for b, f in enumerate(f1.tolist()):
        want_v = w + (v if f else 0)
        with t.steer([Intervention.add(LATE, want_v)]):
            ref = t.forward(toks)
        torch.testing.assert_close(got[b], ref[b], rtol=1e-5, atol=1e-5)


def test_torch_steps_with_when(t, u, v):
    c = _split(t, u)
    fired = (_sims(t, c) > c.threshold).tolist()
    base = t.forward(PROMPTS, chat=False)
    with t.steer([Intervention.apply(LATE, lambda h: h * 2.0, when=c)]):
        out = t.forward(PROMPTS, chat=False)
    assert _changed(out, base) == fired
    with t.steer([Intervention.replace(LATE, v, when=When((c,), negate=True))]):
        out = t.forward(PROMPTS, chat=False)
    assert _changed(out, base) == [not f for f in fired]


def test_per_row_steering_with_conditions(t, u, v):
    c = _split(t, u)
    fired = (_sims(t, c) > c.threshold).tolist()
    rows = [[Intervention.add(LATE, v, when=c)], None, [Intervention.add(LATE, v, when=c)],
            [Intervention.add(LATE, v)], [Intervention.add(LATE, v, when=When((c,), negate=True))]]
    base = t.forward(PROMPTS, chat=False)
    with t.steer(rows=rows) as h:
        out = t.forward(PROMPTS, chat=False)
        assert h.compiled.n_groups == len(PROMPTS)
    want = [fired[0], False, fired[2], True, not fired[4]]
    assert _changed(out, base) == want
    kw = dict(max_new_tokens=5, chat=False, return_tokens=True)
    plain = t.generate(PROMPTS, **kw)
    gen = t.generate(PROMPTS, steer_rows=rows, **kw)
    assert gen[1] == plain[1] and all(gen[b] == plain[b] for b in range(5) if not want[b])


def test_decisions_reset_every_run(t, u, v):
    c = _split(t, u)
    cs = t.compile([Intervention.add(LATE, v, when=c)])
    with t.hooks.install(cs):
        t.forward(PROMPTS, chat=False)
        first = cs.decisions[c].clone()
        t.forward(PROMPTS[:2], chat=False)
        assert cs.decisions[c].shape == (2,) and torch.equal(cs.decisions[c], first[:2])
    assert cs.conditions == (c,)


def test_hooks_removed_after_an_exception(t, u):
    c = Condition(COND_SITE, u, -1.0)

    def boom(h):
        raise RuntimeError("boom")
    before = t.hook_count()
    with pytest.raises(RuntimeError, match="boom"):
        with t.steer([Intervention.apply(LATE, boom, when=c)]):
            t.forward(PROMPTS, chat=False)
    assert t.hook_count() == before
    with pytest.raises(InputError):
        t.steer([Intervention.add(LATE, torch.ones(64), when=Condition(COND_SITE, torch.ones(8), 0.0))])
    assert t.hook_count() == before


def test_direct_call_and_server_path_refuse_conditions(t, u, v):
    c = Condition(COND_SITE, u, 0.0)
    cs = t.compile([Intervention.add(LATE, v, when=c)])
    prog = cs.programs[LATE]
    with pytest.raises(InputError, match="server"):
        prog.apply(torch.zeros(3, 64), None, lambda spec: None)
    with t.hooks.install(cs):
        toks = t.tokenize(["hi"], chat=False)
        with pytest.raises(InputError, match="SteerModel"):
            t.hf_model(input_ids=toks.input_ids)


# ----------------------------------------------------------------------------- artifacts
def _cv(sm, layer=1, threshold=0.1, seed=3, **kw) -> ConditionVector:
    d = torch.randn(sm.d_model, generator=torch.Generator().manual_seed(seed))
    return ConditionVector(d, layer=layer, threshold=threshold, provenance=Provenance.from_model(sm), **kw)


def _sv(sm, layer=2, seed=4, scale=8.0) -> SteeringVector:
    d = torch.randn(sm.d_model, generator=torch.Generator().manual_seed(seed))
    return SteeringVector.from_direction(d, layer, sm, scale=scale)


def _rules(sm) -> ConditionalSteering:
    grid = torch.rand(2, 2, 5, dtype=torch.float64)
    c1 = _cv(sm, report={"f1": 0.9, "layers": [1, 2], "thresholds": [0.0, 0.1, 0.2, 0.3, 0.4],
                         "comparators": ["above", "below"], "grid": grid, "confusion": {"tp": 3, "fp": 1, "fn": 0,
                                                                                        "tn": 4}})
    c2 = _cv(sm, layer=2, threshold=-0.2, seed=5, comparator="below", aggregate="last", measure="cosine")
    c3 = _cv(sm, layer=3, threshold=0.3, seed=6, hook_site="hook_resid_post", chat=False)
    return ConditionalSteering(rules=[ConditionalRule([c1, c2], _sv(sm), mode="all"),
                                      ConditionalRule([c3], _sv(sm, layer=1, seed=7), negate=True)])


def test_condition_vector_fires_through_the_compiled_evaluator(t):
    cv = _cv(t, threshold=0.0)
    cond = cv.to_condition()
    assert cond.site == "blocks.1.hook_resid_pre" and cond.threshold == 0.0
    sims = _sims(t, cond, PROMPTS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the provenance matches: no warning
        assert cv.fires(t, PROMPTS, batch_size=2) == (sims > 0).tolist()
    torch.testing.assert_close(torch.tensor(cv.similarities(t, PROMPTS)), sims, rtol=1e-5, atol=1e-6)
    assert t.hook_count() == 0


def test_conditional_steering_lowers_with_when(t):
    cs = _rules(t)
    ivs = cs.to_interventions(t.facts)
    assert [iv.site for iv in ivs] == ["blocks.2.hook_resid_post", "blocks.1.hook_resid_post"]
    w0, w1 = ivs[0].when, ivs[1].when
    assert w0.mode == "all" and not w0.negate and len(w0.conditions) == 2 and w1.negate
    assert w0.conditions[1].comparator == "below" and w0.conditions[1].measure == "cosine"
    assert w1.conditions[0].site == "blocks.3.hook_resid_post"
    torch.testing.assert_close(ivs[0].tensor, 8.0 * cs.rules[0].behavior.directions[2])
    assert ivs[0].scale == 1.0 and cs.to_interventions(t.facts, scale=0.5)[0].scale == 0.5
    one = ConditionalSteering(condition=cs.rules[0].conditions[0], behavior=cs.rules[0].behavior)
    assert one.rules[0].mode == "any" and len(one.conditions) == 1


def test_conditional_steering_applies_via_steer_and_generate(t):
    s = torch.tensor(_cv(t).similarities(t, PROMPTS)).sort().values
    cv = _cv(t, threshold=float(s[1] + s[2]) / 2)
    fired = cv.fires(t, PROMPTS)
    assert 0 < sum(fired) < len(PROMPTS)
    cs = ConditionalSteering(condition=cv, behavior=_sv(t))
    base = t.forward(PROMPTS, chat=False)
    with t.steer(cs) as h:
        out = t.forward(PROMPTS, chat=False)
    assert _changed(out, base) == fired == list(h.decisions.values())[0].tolist()
    kw = dict(max_new_tokens=5, chat=False, return_tokens=True)
    plain, steered = t.generate(PROMPTS, **kw), t.generate(PROMPTS, steering=cs, **kw)
    assert all(steered[b] == plain[b] for b, f in enumerate(fired) if not f)
    assert any(steered[b] != plain[b] for b, f in enumerate(fired) if f)


def test_round_trip_store_and_safetensors(t, tmp_path):
    cs = _rules(t)
    store = Store(tmp_path / "store")
    ref = store.save("cast", cs)
    back = store.load(ref)
    assert back == cs and isinstance(back, ConditionalSteering)
    assert back.rules[0].conditions[0].report["grid"].dtype == torch.float64
    assert store.load(store.save("cond", cs.rules[0].conditions[0])) == cs.rules[0].conditions[0]
    p = save_artifact(cs, tmp_path / "cs.safetensors")
    assert import_artifact(p) == cs
    tensors, meta = artifact_to_payload(cs)
    assert {"rule.0.condition.0.direction", "rule.0.condition.0.report.grid", "rule.0.condition.1.direction",
            "rule.1.condition.0.direction"} <= set(tensors)
    assert all(k.startswith(("rule.0.behavior.", "rule.1.behavior.", "rule.0.condition.", "rule.1.condition."))
               for k in tensors)
    json.dumps(meta)  # the metadata is JSON
    assert payload_to_artifact(tensors, meta) == cs
    assert [r.behavior.kind for r in back.rules] == ["steering_vector", "steering_vector"]


def test_payload_validation(t):
    cs = _rules(t)
    tensors, meta = artifact_to_payload(cs)

    def bad(tens, m, match):
        with pytest.raises(ArtifactFormatError, match=match):
            payload_to_artifact(tens, m)
    bad({**tensors, "rule.0.extra": torch.ones(1)}, meta, "only rule")
    m = json.loads(json.dumps(meta))
    m["fields"]["rules"][0]["behavior"]["kind"] = "probe"
    bad(tensors, m, "nested artifact")
    m = json.loads(json.dumps(meta))
    m["fields"]["rules"][0]["conditions"][0]["fields"]["comparator"] = "larger"
    bad(tensors, m, "comparator")
    m = json.loads(json.dumps(meta))
    m["fields"]["rules"][0]["conditions"][0]["fields"]["threshold"] = "0.1"
    bad(tensors, m, "threshold")
    m = json.loads(json.dumps(meta))
    m["fields"]["rules"][1]["mode"] = "xor"
    bad(tensors, m, "rule 1")
    m = json.loads(json.dumps(meta))
    m["fields"]["rules"] = []
    bad(tensors, m, "non-empty")
    t2 = dict(tensors)
    t2["rule.0.condition.0.report.grid"] = torch.rand(2, 2, 4, dtype=torch.float64)
    bad(t2, meta, "grid")
    t2 = dict(tensors)
    t2["rule.0.condition.0.direction"] = torch.full((t.d_model,), float("nan"))
    bad(t2, meta, "finite")
    t2 = dict(tensors)
    del t2["rule.1.behavior.direction.1"]
    bad(t2, meta, "direction")


def test_equality_arithmetic_and_errors(t):
    cs = _rules(t)
    assert cs == _rules(t).__class__(rules=cs.rules, provenance=cs.provenance)
    doubled = cs * 2
    assert doubled != cs
    torch.testing.assert_close(doubled.rules[0].behavior.effective().directions[2],
                               2 * cs.rules[0].behavior.effective().directions[2])
    assert (2 * cs) == doubled and (doubled / 2) == cs and (-cs).rules[0].conditions == cs.rules[0].conditions
    assert cs.to(torch.float64).rules[0].conditions[0].direction.dtype == torch.float64
    with pytest.raises(VectorsError, match="either"):
        ConditionalSteering(condition=cs.rules[0].conditions[0], behavior=_sv(t), rules=cs.rules)
    with pytest.raises(VectorsError, match="condition="):
        ConditionalSteering(condition=cs.rules[0].conditions[0])
    with pytest.raises(VectorsError, match="behavior"):
        ConditionalRule([cs.rules[0].conditions[0]], "vector")
    with pytest.raises(ModelMismatchError, match="d_model"):
        ConditionalRule([cs.rules[0].conditions[0]], SteeringVector({1: torch.ones(8)}))
    with pytest.raises(ArtifactFormatError, match="comparator"):
        ConditionVector(torch.ones(64), layer=1, threshold=0.0, comparator="larger")


def test_provenance_checked_on_every_nested_artifact(t):
    cs = _rules(t)
    other = Provenance.from_model(t).replace(model_fingerprint="sha256:other")
    c_bad = ConditionVector(torch.ones(64), layer=1, threshold=0.0, provenance=other)
    bad = ConditionalSteering(rules=[ConditionalRule([c_bad], cs.rules[0].behavior)], provenance=cs.provenance)
    with pytest.raises(ModelMismatchError, match="fingerprint"):
        bad.to_interventions(t.facts)
    with pytest.raises(ModelMismatchError, match="fingerprint"):
        c_bad.fires(t, ["hi"])
    with pytest.warns(UserWarning, match="override"):
        assert len(bad.to_interventions(t.facts, override=True)) == 1
    deep = ConditionVector(torch.ones(64), layer=9, threshold=0.0, provenance=Provenance.from_model(t))
    with pytest.raises(ModelMismatchError, match="layers below"):
        ConditionalSteering(condition=deep, behavior=cs.rules[0].behavior).to_interventions(t.facts)


def test_fit_condition_mechanics_and_report(t):
    food = ["how do I bake bread", "best pasta sauce", "roast potatoes", "a soup recipe", "grill fish", "make tea"]
    other = ["fix a bike", "what is gravity", "who wrote hamlet", "how tides work", "learn chess", "paint walls"]
    cv = steerkit.probes.fit_condition(t, food, other, layers=[1, 2, 3], thresholds=[x / 20 for x in range(-20, 21)],
                                       chat=False, progress=False, batch_size=4)
    rep = cv.report
    assert tuple(rep["grid"].shape) == (2, 3, 41) and rep["layers"] == [1, 2, 3]
    assert cv.layer in (1, 2, 3) and cv.comparator in ("above", "below") and not cv.chat
    assert rep["f1"] == pytest.approx(float(rep["grid"].max()))
    conf = rep["confusion"]
    assert sum(conf.values()) == 12
    # the compiled evaluator decides exactly as the fit's grid search did
    again = steerkit.probes.condition_confusion(cv, t, food, other, batch_size=5)
    assert {k: again[k] for k in conf} == conf
    fig = cv.plot()
    assert len(fig.data) >= 2 and fig.data[0].type == "heatmap"
    doc = json.loads(cv.to_json())
    assert doc["layer"] == cv.layer and len(doc["report"]["grid"]) == 2
    with pytest.raises(InputError, match="site"):
        steerkit.probes.fit_condition(t, food, other, site="mlp_out", progress=False)
    with pytest.raises(InputError, match="layers"):
        steerkit.probes.fit_condition(t, food, other, layers=[7], progress=False)
    with pytest.raises(InputError, match="paired|as many"):
        steerkit.probes.fit_condition(t, food, other[:3], layers=[1], progress=False)
    with pytest.raises(InputError, match="list of prompts"):
        steerkit.probes.fit_condition(t, "food", other, progress=False)


def test_serving_resolves_conditional_steering_at_server_sites(t, tmp_path):
    """A stored ConditionalSteering resolves for the vLLM plugin: its behaviour and its condition
    (``blocks.1.hook_resid_pre``) at the sites the server hooks (``blocks.0.hook_resid_post``)."""
    from steerkit.serving.spec import parse_spec, resolve
    store = Store(tmp_path / "s")
    store.save("cast", ConditionalSteering(condition=_cv(t), behavior=_sv(t)))
    res = resolve(parse_spec({"artifacts": [{"ref": "cast@1"}]}), store=store, facts=t.facts)
    assert res.sites == ("blocks.2.hook_resid_post",)
    assert res.condition_sites == ("blocks.0.hook_resid_post",)
    (c,) = res.conditions
    assert c.key[1:] == _cv(t).to_condition().key[1:]  # the same condition, read at the canonical site
    assert res.interventions[0].when.conditions == (c,)
    from steerkit.kernels.slots import SlotShape
    from steerkit.serving.engine import graph_refusal  # CUDA graphs cannot decide on the host
    assert "conditional steering" in graph_refusal(res.compiled, SlotShape(t.d_model))


def _server_run(sm, res, ids, chunks, conditions, req_id="r"):
    """``ids`` through the HF model as a server runs them: prefill chunks of ``chunks`` tokens, each a
    step's ``StepPlan`` (one request) applied by hooks on every block's output, with
    the KV cache carried between steps. Returns the logits of every position."""
    from steerkit.serving.plan import Block, StepPlan
    state = {}

    def hook_of(site):
        def hook(_m, _a, out):
            plan = state.get("plan")
            if plan is None or site not in plan:
                return None
            h = out[0] if isinstance(out, tuple) else out
            new = plan.apply(site, h[0])[None]
            return (new, *out[1:]) if isinstance(out, tuple) else new
        return hook

    handles = [sm.adapter.block(sm.model, layer).register_forward_hook(hook_of(f"blocks.{layer}.hook_resid_post"))
               for layer in range(sm.n_layers)]
    past, logits, start = None, [], 0
    try:
        with torch.inference_mode():
            for n in chunks:
                block = Block(0, n, np.arange(start, start + n), len(ids), res, req_id)
                state["plan"] = StepPlan([block], conditions)
                out = sm.model(input_ids=torch.tensor([ids[start:start + n]]), cache=past, use_cache=True)
                past, start = out.cache, start + n
                logits.append(out.logits[0])
    finally:
        for h in handles:
            h.remove()
    return torch.cat(logits)


def test_server_plan_decides_on_the_prompt_as_sm_steer_does(t, tmp_path):
    """The server's plan for a ConditionalSteering: a prompt in one prefill chunk gives exactly the
    logits of ``sm.steer(cs)`` (fired prompts steered, the others untouched); split over chunks, the
    decision and its similarity are the same, taken when the last prompt token passes the site, and
    the chunk after it is steered."""
    from steerkit.serving.plan import RequestConditions
    from steerkit.serving.spec import parse_spec, resolve
    sims = torch.tensor(_cv(t).similarities(t, PROMPTS)).sort().values
    cv = _cv(t, threshold=float(sims[1] + sims[2]) / 2)
    fired = cv.fires(t, PROMPTS)
    assert 0 < sum(fired) < len(PROMPTS)
    cs = ConditionalSteering(condition=cv, behavior=_sv(t))
    store = Store(tmp_path / "s")
    store.save("cast", cs)
    res = resolve(parse_spec({"artifacts": [{"ref": "cast@1"}]}), store=store, facts=t.facts)
    (cond,) = res.conditions
    for prompt, f, sim in zip(PROMPTS, fired, cv.similarities(t, PROMPTS)):
        ids = t.tokenize(prompt, chat=cv.chat).input_ids[0].tolist()
        with t.steer(cs):
            want = t.forward(prompt, chat=cv.chat)[0]
        plain = t.forward(prompt, chat=cv.chat)[0]
        rc = RequestConditions()
        got = _server_run(t, res, ids, [len(ids)], rc)
        assert torch.allclose(got, want, atol=1e-5), prompt
        assert rc.fired("r", res.interventions[0].when) is f
        assert rc.similarity("r", cond) == pytest.approx(sim, abs=1e-5)
        assert bool((got - plain).abs().max() > 1e-3) is f  # the behaviour acts only where it fired
        if len(ids) < 3:
            continue
        rc2 = RequestConditions()
        k = len(ids) // 2
        chunked = _server_run(t, res, ids, [k, len(ids) - k], rc2)
        assert rc2.similarity("r", cond) == pytest.approx(sim, abs=1e-5)
        assert rc2.fired("r", res.interventions[0].when) is f
        assert torch.allclose(chunked[:k], plain[:k], atol=1e-5)  # undecided on the first chunk
        assert bool((chunked[k:] - plain[k:]).abs().max() > 1e-3) is f  # decided: the rest is steered
    rc.keep([])
    assert len(rc) == 0


# ----------------------------------------------------------------------------- backends
@pytest.mark.parametrize("backend", ["tlens", "nnsight"])
def test_backends_agree(tiny, backend, u, v):
    pytest.importorskip({"tlens": "transformer_lens", "nnsight": "nnsight"}[backend])
    c = _split(tiny, u)
    steering = [Intervention.add(LATE, v, when=c), Intervention.add(EARLY, 0.5 * v, when=When((c,), negate=True))]
    kw = dict(max_new_tokens=5, chat=False, return_tokens=True)
    with tiny.steer(steering) as h:
        ref_logits = tiny.forward(PROMPTS, chat=False)
        ref_fired = h.decisions[c].tolist()
    ref_gen = tiny.generate(PROMPTS, steering=steering, **kw)
    try:
        other = steerkit.wrap(tiny.hf_model, tiny.tokenizer, name=tiny.name, backend=backend)
    except Exception as e:  # noqa: BLE001 - a backend that cannot wrap this tiny model
        pytest.skip(f"{backend} cannot wrap the tiny Llama: {e}")
    _same_on(other, tiny, steering, c, PROMPTS, ref_logits, ref_fired, ref_gen, atol=1e-4, **kw)


def _same_on(other, ref_model, steering, c, prompts, ref_logits, ref_fired, ref_gen, atol, **kw):
    """``other`` (another backend's wrap) steered by ``steering`` fires the condition ``c`` where the reference did,
    gives its logits (within ``atol``) and generates its tokens; ``other``'s hooks are removed afterwards."""
    try:
        with other.steer(steering) as h:
            logits = other.forward(prompts, chat=False)
            assert h.decisions[c].tolist() == ref_fired
        mask = ref_model.tokenize(prompts, chat=False).attention_mask.bool()
        torch.testing.assert_close(logits[mask], ref_logits[mask], rtol=1e-4, atol=atol)
        assert other.generate(prompts, steering=steering, **kw) == ref_gen
    finally:
        other.reset()


@pytest.mark.slow
@pytest.mark.backends
def test_tlens_agrees_on_the_default_model(default_model):
    """TransformerLens's bridge needs a real checkpoint: the default model, forward and generation."""
    pytest.importorskip("transformer_lens")
    hf = default_model
    g = torch.Generator().manual_seed(0)
    u, v = torch.randn(hf.d_model, generator=g), 6.0 * torch.randn(hf.d_model, generator=g)
    prompts = ["The capital of France is", "Rain falls softly on the quiet town and", "Hi"]
    s = _sims(hf, Condition("blocks.6.hook_resid_pre", u, 0.0), prompts).sort().values
    c = Condition("blocks.6.hook_resid_pre", u, float(s[0] + s[1]) / 2)
    steering = [Intervention.add("blocks.10.hook_resid_post", v, when=c)]
    kw = dict(max_new_tokens=6, chat=False, return_tokens=True)
    with hf.steer(steering) as h:
        ref = hf.forward(prompts, chat=False)
        fired = h.decisions[c].tolist()
    assert fired == [x > c.threshold for x in _sims(hf, c, prompts).tolist()] and 0 < sum(fired) < 3
    ref_gen = hf.generate(prompts, steering=steering, **kw)
    tl = steerkit.wrap(hf.hf_model, hf.tokenizer, name=hf.name, backend="tlens")
    _same_on(tl, hf, steering, c, prompts, ref, fired, ref_gen, atol=1e-3, **kw)


# ----------------------------------------------------------------------------- the default model
FOOD = json.loads(files("steerkit").joinpath("data/conditions/food_topic.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def food_condition(default_model):
    return steerkit.probes.fit_condition(default_model, FOOD["matching_train"], FOOD["other_train"], progress=False)


@pytest.mark.slow
def test_topic_condition_held_out(default_model, food_condition):
    cv = food_condition
    assert cv.report["f1"] >= 0.95 and cv.site == f"blocks.{cv.layer}.hook_resid_pre"
    r = steerkit.probes.condition_confusion(cv, default_model, FOOD["matching_test"], FOOD["other_test"])
    print("held-out confusion", r, "layer", cv.layer, "threshold", cv.threshold, cv.comparator)
    assert r["f1"] >= HELD_OUT_F1 and r["accuracy"] >= HELD_OUT_ACCURACY


@pytest.mark.slow
def test_topic_condition_gates_a_refusal_behaviour(default_model, food_condition):
    sm = default_model
    harm = json.loads(files("steerkit").joinpath("data/refusal/harmful_train.json").read_text(encoding="utf-8"))
    safe = json.loads(files("steerkit").joinpath("data/refusal/harmless_train.json").read_text(encoding="utf-8"))
    layer = BEHAVIOUR_LAYER
    hook = f"blocks.{layer}.hook_resid_post"
    with sm.record(hook, positions="last") as cache:
        sm.forward([r["instruction"] for r in harm[:16]], chat=True)
        sm.forward([r["instruction"] for r in safe[:16]], chat=True)
    acts = cache[hook]
    d = steerkit.probes.find_direction(acts[:16], acts[16:], method="diffmean")
    behaviour = d.to_steering_vector(layer, sm, scale=BEHAVIOUR_SCALE)
    cs = ConditionalSteering(condition=food_condition, behavior=behaviour)
    prompts = FOOD["matching_test"][:3] + FOOD["other_test"][:3]
    fired = food_condition.fires(sm, prompts)
    assert sum(fired[:3]) >= 2 and not any(fired[3:])
    plain = sm.generate(prompts, max_new_tokens=16, return_tokens=True, chat=True)
    steered = sm.generate(prompts, max_new_tokens=16, return_tokens=True, steering=cs, chat=True)
    for b, f in enumerate(fired):
        if f:
            assert steered[b] != plain[b], prompts[b]  # fired: the behaviour changes the greedy generation
        else:
            assert steered[b] == plain[b], prompts[b]  # not fired: exactly the unsteered tokens
    print("steered:", sm.tokenizer.batch_decode(steered))
    assert sm.hook_count() == 0


HELD_OUT_F1 = 0.9
HELD_OUT_ACCURACY = 0.9
BEHAVIOUR_LAYER = 12
BEHAVIOUR_SCALE = 4.0


@pytest.mark.parametrize("aggregate", ["mean", "last"])
def test_one_accumulator_chunk_by_chunk_equals_one_pass(aggregate):
    """interventions.Decisions is THE decision accumulator: a prompt fed in chunks (the server's
    prefill) decides as the whole prompt in one pass (sm.generate), and RequestConditions is it."""
    from steerkit.interventions import Decisions
    from steerkit.serving.plan import RequestConditions
    g = torch.Generator().manual_seed(0)
    c = Condition(COND_SITE, torch.randn(64, generator=g), 0.0, aggregate=aggregate)
    x = torch.randn(1, 7, 64, generator=g)
    whole = Decisions([c])
    whole.evaluate(c, x, None, run_id=1)
    chunked, rc = Decisions([c]), RequestConditions()
    for a, b in ((0, 3), (3, 5), (5, 7)):
        chunked.observe("r", c, x[:, a:b], None, first=a == 0, last=b == 7)
        rc.observe("r", c, x[0, a:b], np.arange(a, b), n_prompt=7)
    assert chunked.selected("r", When(c)).tolist() == whole.fired()[c].tolist() == [rc.fired("r", When(c))]
    assert torch.allclose(chunked.similarity("r", c), whole.similarities()[c], atol=1e-6)
    assert abs(rc.similarity("r", c) - float(whole.similarities()[c][0])) < 1e-6
    rc.keep([])
    assert len(rc) == 0 and rc.fired("r", When(c)) is None
