"""Steering vectors trained by gradient (steerkit.probes.train) and the grad path under them.

Mechanics on a tiny random Llama: the gradient of a loss with respect to an ``Intervention.add``
vector through ``sm.forward`` (compile -> kernel table -> fused kernel backward) equals autograd's
through a plain forward hook, for the torch reference and the Triton kernel under its CPU
interpreter; the BiPO loss equals a hand computation; training lowers the loss and moves margins;
results round-trip through the store; inference mode stays the default. One small check on the
default model: a few BiPO steps raise the training margin.
"""
from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is compiled (as tests/kernels)

import pytest  # noqa: E402
import torch  # noqa: E402

from steerkit import Intervention  # noqa: E402
from steerkit.errors import InputError  # noqa: E402
from steerkit.kernels import HAS_TRITON, interpret_mode, use_impl  # noqa: E402
from steerkit.probes import (TrainResult, bipo_loss, completion_logprobs, myopic_items,  # noqa: E402
                             preference_margins, preference_pairs, train_bipo, train_promptless)
from steerkit.probes.methods.caa import AB_ITEMS  # noqa: E402
from steerkit.vectors import Store  # noqa: E402


LAYER = 1
SITE = f"blocks.{LAYER}.hook_resid_post"


TINY = {"num_hidden_layers": 3}


def _ids(sm, text: str) -> list[int]:
    return sm.tokenizer(text, add_special_tokens=False)["input_ids"]


def _hooked_logits(sm, ids: list[list[int]], v, scale: float = 1.0, layer: int = LAYER):
    """Logits with ``scale * v`` added to block ``layer``'s output by a plain forward hook."""
    toks = sm.pad(ids)
    blk = sm.adapter.block(sm.hf_model, layer)

    def hook(mod, inp, out):
        if isinstance(out, tuple):
            return (out[0] + scale * v,) + tuple(out[1:])
        return out + scale * v
    h = blk.register_forward_hook(hook)
    try:
        return sm.hf_model(input_ids=toks.input_ids, attention_mask=toks.attention_mask,
                           position_ids=toks.position_ids).logits, toks
    finally:
        h.remove()


# ------------------------------------------------------------------------------- grad path
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_grad_through_steer_equals_forward_hook(tiny, impl):
    if impl == "triton" and not (HAS_TRITON and interpret_mode()):
        pytest.skip("Triton (with TRITON_INTERPRET=1 on CPU) is not available")
    prompts = ["abc de", "hello there world"]
    torch.manual_seed(0)
    v = torch.nn.Parameter(torch.randn(tiny.d_model) * 0.3)
    with use_impl(impl), tiny.training():
        with tiny.steer(Intervention.add(SITE, v, 0.7)) as handle:
            prog = handle.compiled.programs[SITE] if hasattr(handle, "compiled") else None
            logits = tiny.forward(prompts, chat=False)
        if prog is not None:
            assert prog.kernel.impl == impl
        toks = tiny.tokenize(prompts, chat=False)
        m = toks.attention_mask.bool()
        loss = (logits.log_softmax(-1)[..., 7] * m).sum() + (logits[:, -1] ** 2).mean()
        loss.backward()
    g_steer = v.grad.clone()
    assert g_steer.abs().sum() > 0
    v.grad = None
    with torch.enable_grad():
        for p in tiny.hf_model.parameters():
            p.requires_grad_(False)
        try:
            ref, _ = _hooked_logits(tiny, [_ids(tiny, p) for p in prompts], v, 0.7)
        finally:
            for p in tiny.hf_model.parameters():
                p.requires_grad_(True)
        loss_ref = (ref.log_softmax(-1)[..., 7] * m).sum() + (ref[:, -1] ** 2).mean()
        loss_ref.backward()
    assert torch.allclose(loss.detach(), loss_ref.detach(), atol=1e-4)
    torch.testing.assert_close(g_steer, v.grad, atol=1e-4, rtol=1e-4)


def test_intervention_keeps_grad_only_when_asked(tiny):
    v = torch.nn.Parameter(torch.ones(tiny.d_model))
    with torch.enable_grad():
        assert Intervention.add(SITE, v).tensor.requires_grad
    with torch.no_grad():
        assert not Intervention.add(SITE, v).tensor.requires_grad
    assert not Intervention.add(SITE, torch.ones(tiny.d_model)).tensor.requires_grad
    bad = torch.ones(tiny.d_model, requires_grad=True) * float("nan")
    with torch.enable_grad(), pytest.raises(InputError, match="finite"):
        Intervention.add(SITE, bad)


# ------------------------------------------------------------------------------- BiPO loss by hand
def test_bipo_loss_equals_hand_computation(tiny):
    prompt, chosen, rejected = "q: pick", " yes", " no!"
    torch.manual_seed(1)
    v = torch.randn(tiny.d_model) * 0.5
    beta, d = 0.5, -1

    def logp(text, scale):
        ids = [_ids(tiny, prompt) + _ids(tiny, text)]
        n = len(_ids(tiny, text))
        with torch.no_grad():
            logits, toks = _hooked_logits(tiny, ids, v, scale)
        lp = logits[0].log_softmax(-1)
        seq = toks.input_ids[0]
        P = seq.shape[0]
        return sum(float(lp[t - 1, seq[t]]) for t in range(P - n, P))

    inner = (logp(chosen, d) - logp(chosen, 0.0)) - (logp(rejected, d) - logp(rejected, 0.0))
    hand = -math.log(1 / (1 + math.exp(-d * beta * inner)))
    with tiny.training():
        got = bipo_loss(tiny, v.clone().requires_grad_(True), [(prompt, chosen, rejected)], LAYER, direction=d,
                        beta=beta, chat=False)
    assert abs(float(got.detach()) - hand) < 1e-4


def _signal_pairs(n: int = 8):
    """Pairs whose chosen completion is always "x" and rejected "y": a single vector can learn it."""
    words = ["abc", "hello", "tree", "blue sky", "run fast", "cold", "a b c", "zeta"]
    return [(f"{words[i % len(words)]} {i}:", "x", "y") for i in range(n)]


def test_bipo_lowers_loss_and_steers_both_ways(tiny):
    pairs = _signal_pairs()
    r = train_bipo(tiny, pairs, LAYER, epochs=10, lr=0.1, beta=1.0, batch_size=4, chat=False, progress=False)
    assert isinstance(r, TrainResult)
    el = r.epoch_losses()
    assert len(r.history) == 20 and len(el) == 10
    assert el[-1] < el[0] - 0.1
    base = preference_margins(tiny, pairs, chat=False)
    up = preference_margins(tiny, pairs, chat=False, steering=r.vector)
    down = preference_margins(tiny, pairs, chat=False, steering=Intervention.add(SITE, -r.tensor))
    assert bool((up > base).all()) and bool((down < base).all())
    js = r.to_json()
    assert js["method"] == "bipo" and js["params"]["beta"] == 1.0 and len(js["history"]) == 20
    fig = r.plot()
    assert len(fig.data) == 2 and len(fig.data[0].y) == 20


def test_train_bipo_is_reproducible_with_seed(tiny):
    pairs = _signal_pairs(4)
    a = train_bipo(tiny, pairs, LAYER, epochs=2, lr=0.05, batch_size=2, seed=3, chat=False, progress=False)
    b = train_bipo(tiny, pairs, LAYER, epochs=2, lr=0.05, batch_size=2, seed=3, chat=False, progress=False)
    assert [r["direction"] for r in a.history] == [r["direction"] for r in b.history]
    torch.testing.assert_close(a.tensor, b.tensor)


def test_promptless_raises_target_logprob(tiny):
    target = "hello world"
    before = completion_logprobs(tiny, [""], [target], chat=False)
    r = train_promptless(tiny, [target], LAYER, epochs=15, lr=0.2, chat=False, progress=False, max_norm=8.0)
    after = completion_logprobs(tiny, [""], [target], chat=False, steering=r.vector)
    assert float(after[0]) > float(before[0]) + 1.0
    assert float(r.tensor.norm()) <= 8.0 + 1e-4
    assert r.losses[-1] < r.losses[0]
    assert r.vector.provenance.method == "promptless"


def test_result_round_trips_through_store(tiny, tmp_path):
    pairs = _signal_pairs(4)
    r = train_bipo(tiny, pairs, LAYER, epochs=1, lr=0.05, batch_size=4, chat=False, progress=False)
    store = Store(tmp_path / "store")
    ref = store.save("bipo-x", r.vector)
    back = store.load(ref)
    assert back == r.vector
    p = back.provenance
    assert p.method == "bipo" and p.method_params["lr"] == 0.05 and p.method_params["n_pairs"] == 4
    assert p.prompts_hash == r.vector.provenance.prompts_hash and p.prompts_hash.startswith("sha256:")
    torch.testing.assert_close(preference_margins(tiny, pairs, chat=False, steering=back),
                               preference_margins(tiny, pairs, chat=False, steering=r.vector))


# ------------------------------------------------------------------------------- inference stays the default
def test_inference_mode_is_the_default_and_training_scope_cleans_up(tiny, monkeypatch):
    assert not tiny.forward("abc", chat=False).requires_grad
    weights = [p for p in tiny.hf_model.parameters()]
    assert all(p.requires_grad for p in weights)
    with tiny.training():
        assert not any(p.requires_grad for p in weights)
        v = torch.nn.Parameter(torch.zeros(tiny.d_model))
        with tiny.steer(Intervention.add(SITE, v)):
            assert tiny.forward("abc", chat=False).requires_grad
        assert not tiny.forward("abc", chat=False, grad=False).requires_grad
    assert all(p.requires_grad for p in weights)
    assert not tiny.forward("abc", chat=False).requires_grad

    before = tiny.hook_count()
    real = tiny.backend.forward
    calls = {"n": 0}

    def failing(*a, **k):
        calls["n"] += 1
        if calls["n"] >= 2:
            raise RuntimeError("boom in the middle of training")
        return real(*a, **k)
    monkeypatch.setattr(tiny.backend, "forward", failing)
    with pytest.raises(RuntimeError, match="boom"):
        train_bipo(tiny, _signal_pairs(4), LAYER, epochs=1, batch_size=2, chat=False, progress=False)
    monkeypatch.setattr(tiny.backend, "forward", real)
    assert calls["n"] >= 2
    assert tiny.hook_count() == before
    assert all(p.requires_grad for p in weights)
    out = tiny.forward("abc", chat=False)
    assert not out.requires_grad and torch.is_inference(out)


def test_bad_arguments_are_input_errors(tiny):
    with pytest.raises(InputError, match="layer"):
        train_bipo(tiny, _signal_pairs(2), 99, progress=False)
    with pytest.raises(InputError, match="site"):
        train_bipo(tiny, _signal_pairs(2), 0, site="mlp_out", progress=False)
    with pytest.raises(InputError, match="pair 0"):
        train_bipo(tiny, [("only two", "x")], 0, progress=False)
    with pytest.raises(InputError, match="epochs"):
        train_bipo(tiny, _signal_pairs(2), 0, epochs=0, progress=False)
    with pytest.raises(InputError, match="target"):
        train_promptless(tiny, [""], 0, progress=False)


def test_preference_data():
    train = myopic_items(40, seed=0)
    held = myopic_items(20, seed=1, exclude=train)
    assert len({it.question for it in train} | {it.question for it in held}) == 60
    assert [it.matching for it in train[:4]] == ["A", "B", "A", "B"]
    p = preference_pairs(AB_ITEMS[:2])
    assert p[1].chosen.startswith("(B) ") and p[1].rejected.startswith("(A) ")


# ------------------------------------------------------------------------------- the default model
def test_bipo_steps_raise_training_margin_on_default_model(sm):
    # one step from v = 0 moves v along the same first-order direction whichever sign it draws
    pairs = preference_pairs(myopic_items(2, seed=0))
    base = preference_margins(sm, pairs)
    r = train_bipo(sm, pairs, 15, epochs=1, lr=0.05, batch_size=2, progress=False)
    after = preference_margins(sm, pairs, steering=r.vector)
    assert len(r.history) == 1 and r.tensor.norm() > 0
    assert float(after.mean()) > float(base.mean())
    assert sm.hook_count() == 0
