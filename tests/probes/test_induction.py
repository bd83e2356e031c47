"""Induction heads on repeated random tokens (probes/methods/induction.py).

Mechanics on a tiny random Llama (inputs, the score as the pattern's diagonal, the loss, the
result's JSON and figures); the finding itself on the default model (SmolLM2-135M-Instruct): the
loss on the repeated half is far below the first half's, some heads score high, and every score
equals the diagonal of a pattern recorded directly.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from steerkit.errors import InputError
from steerkit.model import wrap
from steerkit.probes.methods import REGISTRY
from steerkit.probes.methods import induction as I
from tiny_models import tiny_model


def _pattern(sm, ids: torch.Tensor, layer: int) -> torch.Tensor:
    name = f"blocks.{layer}.attn.hook_pattern"
    with sm.record([name], positions="all") as cache:
        sm.forward(sm.pad(ids.tolist()))
    return cache[name]


def test_repeated_tokens_are_bos_then_a_sequence_twice():
    ids = I.repeated_tokens(5, 7, bos=2, low=10, high=20, seed=3)
    assert ids.shape == (5, 15) and bool((ids[:, 0] == 2).all())
    assert torch.equal(ids[:, 1:8], ids[:, 8:])
    assert int(ids[:, 1:].min()) >= 10 and int(ids[:, 1:].max()) < 20
    assert torch.equal(ids, I.repeated_tokens(5, 7, bos=2, low=10, high=20, seed=3))
    assert not torch.equal(ids, I.repeated_tokens(5, 7, bos=2, low=10, high=20, seed=4))
    with pytest.raises(InputError, match="sequence length"):
        I.repeated_tokens(2, 1, bos=0, low=0, high=5)


def test_induction_score_is_the_mean_of_the_offset_diagonal():
    n = 4
    T = 2 * n + 1
    p = torch.zeros(1, 2, T, T)
    for q in range(n - 1, T):  # head 0 attends exactly along the stripe, head 1 to the first token
        p[0, 0, q, q - n + 1] = 1.0
    p[0, 1, :, 0] = 1.0
    s = I.induction_scores(p, n)
    assert s.shape == (1, 2)
    assert float(s[0, 0]) == pytest.approx(1.0)
    assert float(s[0, 1]) == pytest.approx(1 / (n + 2))  # only the stripe's first entry is key 0
    with pytest.raises(InputError, match="pattern"):
        I.induction_scores(torch.zeros(2, 3, 4), 2)


def test_run_on_a_tiny_model_matches_direct_computation():
    model, tok = tiny_model("llama", num_hidden_layers=3, attn_implementation="sdpa")
    sm = wrap(model, tok, name="tiny-llama")
    cfg = I.InductionConfig(n_seqs=5, seq_len=6, seed=1, batch_size=2, layers=(0, 2), top_k=3)
    res = I.run(sm, cfg, progress=False)
    assert sm.hook_count() == 0 and model.config._attn_implementation == "sdpa"
    assert res.scores.shape == (2, 4) and res.layers == [0, 2] and res.loss.shape == (12,)
    # the same inputs, recorded and scored directly in one batch
    ids = I.repeated_tokens(5, 6, bos=tok.bos_token_id, low=100, high=256, seed=1)
    for li, l in enumerate((0, 2)):
        want = I.induction_scores(_pattern(sm, ids, l), 6).mean(0)
        np.testing.assert_allclose(res.scores[li], want.numpy(), atol=1e-6)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits.float()
    loss = -torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0].mean(0)
    np.testing.assert_allclose(res.loss, loss.numpy(), rtol=1e-5, atol=1e-5)
    assert res.loss_first == pytest.approx(float(loss[:6].mean()), rel=1e-5)
    assert res.loss_repeated == pytest.approx(float(loss[6:].mean()), rel=1e-5)
    top = res.top_heads()
    assert len(top) == 3 and top[0][2] == pytest.approx(float(res.scores.max()))
    assert [s for _, _, s in top] == sorted((s for _, _, s in top), reverse=True)
    d = json.loads(json.dumps(res.to_json(), allow_nan=False))
    assert d["layers"] == [0, 2] and len(d["top_heads"]) == 3 and d["loss_drop"] == pytest.approx(res.loss_drop)
    assert [len(f.data) for f in res.figures()] == [1, 1]
    assert REGISTRY["induction"].run is I.run and REGISTRY["induction"].config is I.InductionConfig


def test_config_errors_say_what_to_fix():
    model, tok = tiny_model("llama")
    sm = wrap(model, tok, name="tiny-llama")
    with pytest.raises(InputError, match="layers"):
        I.run(sm, I.InductionConfig(n_seqs=1, seq_len=3, layers=(5,)), progress=False)
    with pytest.raises(InputError, match="vocab_low"):
        I.run(sm, I.InductionConfig(n_seqs=1, seq_len=3, vocab_low=300), progress=False)
    with pytest.raises(InputError, match="batch_size"):
        I.run(sm, I.InductionConfig(n_seqs=1, seq_len=3, batch_size=0), progress=False)


# --------------------------------------------------------------------------- the default model
# Measured on SmolLM2-135M-Instruct (float32, 8 and 32 sequences of 50 tokens, seed 0): first half 13.4
# nats, repeated half 2.6 nats; best head L18H6 with a score of ~0.89, four heads above 0.6.
@pytest.mark.slow
def test_default_model_has_induction_heads(default_model):
    sm = default_model
    res = I.run(sm, I.InductionConfig(n_seqs=8, seq_len=50, seed=0, batch_size=8), progress=False)
    assert res.scores.shape == (sm.n_layers, sm.n_heads)
    assert res.loss_first > 10.0  # random tokens: nothing to predict
    assert res.loss_repeated < 4.0 and res.loss_drop > 8.0
    (l0, h0, best), = res.top_heads(1)
    assert best > 0.7
    assert int((res.scores > 0.5).sum()) >= 3
    # the top head's layer against its pattern recorded directly for the same 8 sequences
    ids = I.repeated_tokens(8, 50, bos=sm.tokenizer.bos_token_id, low=100, high=20000, seed=0)
    p = _pattern(sm, ids, l0)
    assert p.shape == (8, sm.n_heads, 101, 101)
    np.testing.assert_allclose(p.sum(-1).numpy(), 1.0, atol=1e-4)
    np.testing.assert_allclose(res.scores[l0], I.induction_scores(p, 50).mean(0).numpy(), atol=1e-5)
    by_hand = [float(np.mean([float(p[0, h, q, q - 49]) for q in range(49, 101)])) for h in range(sm.n_heads)]
    np.testing.assert_allclose(I.induction_scores(p[:1], 50)[0].numpy(), by_hand, atol=1e-6)
    alone = I.induction_scores(_pattern(sm, ids[:1], l0), 50)[0]  # sequence 0 alone: as in the batch
    np.testing.assert_allclose(alone.numpy(), by_hand, atol=1e-5)
    assert sm.hook_count() == 0
