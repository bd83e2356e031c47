"""Temporal Activation Injection as interventions (probes/methods/temporal.py): what injection_spec returns,
where and when it edits (the last prompt token of the scheduled layers, prefill only), and per-row taus.
The profile and the rest of the method are tested in tests/probes/test_methods.py."""
from __future__ import annotations

import torch

from steerkit.interventions import Intervention
from steerkit.model import wrap
from steerkit.probes.methods import temporal as T
from tiny_models import tiny_model

torch.set_num_threads(1)


def _sm(**kw):
    model, tok = tiny_model("llama", **kw)
    return wrap(model, tok, name="tiny-llama")


def test_injection_spec_is_one_add_per_scheduled_layer_at_the_last_token():
    tau = torch.arange(8, dtype=torch.float64)
    spec = T.injection_spec(tau, T.linear_decay(0, 4), beta=2.0)
    assert all(isinstance(iv, Intervention) for iv in spec)
    assert [(iv.site, iv.op, iv.scale, iv.positions) for iv in spec] == [
        ("blocks.1.hook_resid_post", "add", 2.0, "last"), ("blocks.2.hook_resid_post", "add", 2.0 * 2 / 3, "last"),
        ("blocks.3.hook_resid_post", "add", 2.0 / 3, "last")]
    assert all(iv.tensor.dtype == torch.float32 and torch.equal(iv.tensor, tau.float()) for iv in spec)
    assert [iv.site for iv in T.injection_spec(tau, {1: 0.0, 2: 0.5}, beta=1.0)] == ["blocks.2.hook_resid_post"]


def test_injection_applied_only_at_last_prompt_token_and_scheduled_layers():
    sm = _sm(num_hidden_layers=3)
    g = torch.Generator().manual_seed(3)
    tau = torch.randn(sm.d_model, generator=g)
    prompts = ["the cat sat", "a much longer prompt here"]
    names = ["blocks.2.hook_resid_pre", "blocks.1.hook_resid_pre"]
    with sm.record(names) as base:
        sm.forward(prompts, chat=False)
    # only layer 1 in the schedule: block 2's input differs by beta * w_1 * tau exactly at the last token
    one = T.injection_spec(tau, {1: 0.75}, beta=2.0)
    assert [iv.site for iv in one] == ["blocks.1.hook_resid_post"]
    with sm.steer(one), sm.record(names) as st:
        sm.forward(prompts, chat=False)
    diff = st["blocks.2.hook_resid_pre"] - base["blocks.2.hook_resid_pre"]
    lens = base.lengths("blocks.2.hook_resid_pre")
    for r in range(2):
        k = int(lens[r])
        assert torch.allclose(diff[r, k - 1], 1.5 * tau, atol=1e-4)
        assert float(diff[r, : k - 1].abs().max()) == 0.0
    assert torch.equal(st["blocks.1.hook_resid_pre"], base["blocks.1.hook_resid_pre"])
    # prefill only: generated positions are never edited (tokens kept equal by a tiny tau)
    small = T.injection_spec(tau * 1e-4, {0: 1.0}, beta=1.0)
    with sm.record("blocks.1.hook_resid_pre", positions="generated") as b2:
        t0 = sm.generate(prompts, max_new_tokens=3, chat=False, return_tokens=True)
    with sm.steer(small), sm.record("blocks.1.hook_resid_pre", positions="generated") as s2:
        t1 = sm.generate(prompts, max_new_tokens=3, chat=False, return_tokens=True)
    assert t0 == t1
    assert torch.equal(b2["blocks.1.hook_resid_pre"], s2["blocks.1.hook_resid_pre"])
    # per-input taus: a different vector per row
    with T.steer_injection(sm, torch.stack([tau, -tau]), {1: 1.0}, beta=1.0), sm.record(names) as pr:
        sm.forward(prompts, chat=False)
    d2 = pr["blocks.2.hook_resid_pre"] - base["blocks.2.hook_resid_pre"]
    assert torch.allclose(d2[0, int(lens[0]) - 1], tau, atol=1e-4)
    assert torch.allclose(d2[1, int(lens[1]) - 1], -tau, atol=1e-4)
    assert sm.hook_count() == 0


def test_choice_accuracy_with_a_per_row_steering_equals_each_row_alone():
    sm = _sm(num_hidden_layers=3)
    items = [T.OrderItem(f"{a}? Yes or No", ["Y", "N"], i % 2, "yesno", f"{b}?")
             for i, (a, b) in enumerate([("x then y", "y then x"), ("a; b; c", "c; b; a")])]
    g = torch.Generator().manual_seed(5)
    taus = torch.randn(2, sm.d_model, generator=g) * 50
    per_row = T.choice_accuracy(sm, items, chat=False,
                                steer_rows=lambda batch: [T.injection_spec(t, {1: 1.0}, 1.0) for t in taus])
    alone = [T.choice_accuracy(sm, [it], chat=False, steering=T.injection_spec(t, {1: 1.0}, 1.0))["accuracy"]
             for it, t in zip(items, taus)]
    assert per_row["accuracy"] == sum(alone) / 2 and sm.hook_count() == 0


def test_stored_tau_steers_as_the_methods_fixed_injection():
    """``sm.steer(artifacts["temporal-tau"])`` is the method's own injection: the schedule's layers, the
    evaluation's beta, the last prompt token only."""
    sm = _sm(num_hidden_layers=4)
    res = T.run(sm, T.TemporalConfig(n_pairs=4, source=1), progress=False)
    assert res.artifacts(sm)["temporal-tau"].scale == 1.0  # no evaluation: beta 1
    res.eval = {"beta": 3.0}  # what an evaluation chose
    art = res.artifacts(sm)["temporal-tau"]
    beta = 3.0
    assert art.positions == [-1] and art.scale == beta
    prompts = ["the cat sat; then it ran", "first a, then b"]
    with sm.steer(T.injection_spec(res.profile.tau[res.source], res.schedule, beta)):
        want = sm.forward(prompts, chat=False)
    with sm.steer(art):
        got = sm.forward(prompts, chat=False)
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, sm.forward(prompts, chat=False), atol=1e-3)
