"""Representation recycling and thinking-token continuation (Qian et al. 2025) as generation options.

Checked on a tiny random Llama against an independent computation with plain PyTorch hooks on
the Hugging Face model (no KV cache): the recycled step runs block ``l`` twice at the newest
position, the steps after it see the recycled keys and values, other rows are untouched.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from steerkit.errors import InputError
from steerkit.generation import Recycle, continue_thinking

torch.set_num_threads(1)
PROMPTS = ["ab c", "hello there"]


TINY = {"seed": 1}


def _ids(tiny, prompt):
    return tiny.tokenizer.encode(prompt, add_special_tokens=False)


@torch.inference_mode()
def _doubled_argmax(tiny, ids, layer, at):
    """Greedy next token of ``ids`` when block ``layer`` runs twice at position ``at`` (no cache)."""
    blocks = tiny.model.model.layers
    x = torch.tensor([ids])
    grabbed = {}

    def grab(m, i, o):
        grabbed["h"] = (o[0] if isinstance(o, tuple) else o)[:, at].clone()  # returns None: output unchanged

    h = blocks[layer].register_forward_hook(grab)
    try:
        tiny.model(input_ids=x)
    finally:
        h.remove()

    def pre(m, args, kwargs):
        hs = args[0] if args else kwargs["hidden_states"]
        hs = hs.clone()
        hs[:, at] = grabbed["h"]
        if args:
            return (hs,) + tuple(args[1:]), kwargs
        kwargs["hidden_states"] = hs
        return args, kwargs

    h = blocks[layer].register_forward_pre_hook(pre, with_kwargs=True)
    try:
        return int(tiny.model(input_ids=x).logits[0, -1].argmax())
    finally:
        h.remove()


def test_recycling_reruns_exactly_the_thinking_step(tiny):
    base = tiny.generate(PROMPTS, max_new_tokens=10, chat=False, return_tokens=True)
    p0 = _ids(tiny, PROMPTS[0])
    chosen = None
    for layer in range(tiny.n_layers):
        for k in range(1, 8):
            tok = base[0][k]
            if tok in base[0][:k] or tok in base[1]:
                continue
            if _doubled_argmax(tiny, p0 + base[0][:k], layer, -1) != tok:  # recycling changes this token
                chosen = (layer, k, tok)
                break
        if chosen:
            break
    assert chosen, "no step of the tiny model where recycling changes the token; pick another seed"
    layer, k, tok = chosen
    n_hooks = tiny.hook_count()
    rec = Recycle(layer=layer, tokens=[tok])
    out = tiny.generate(PROMPTS, max_new_tokens=10, chat=False, return_tokens=True, recycle=rec)
    assert tiny.hook_count() == n_hooks
    assert out[0][:k] == base[0][:k]
    assert rec.events[0] == (0, k)
    new = _doubled_argmax(tiny, p0 + base[0][:k], layer, -1)
    assert out[0][k] == new != tok
    assert out[1] == base[1]  # the other row is untouched
    assert out[0][k + 1] != tok and len(rec.events) == 1  # so the next step is a plain one ...
    ref = _doubled_argmax(tiny, p0 + out[0][:k + 1], layer, len(p0) + k - 1)
    assert out[0][k + 1] == ref  # ... that reads the recycled keys and values of step k


def test_recycling_at_prefill_and_record_keeps_the_rerun_rows(tiny):
    base = tiny.generate(PROMPTS[:1], max_new_tokens=6, chat=False, return_tokens=True)
    name = "blocks.1.hook_resid_post"
    with tiny.record(name, positions="all") as plain:
        tiny.generate(PROMPTS[:1], max_new_tokens=6, chat=False)
    rec = Recycle(layer=1, tokens=[base[0][0]])  # the first generated token: the prefill step re-runs
    with tiny.record(name, positions="all") as cache:
        out = tiny.generate(PROMPTS[:1], max_new_tokens=6, chat=False, return_tokens=True, recycle=rec)
    assert rec.events[0] == (0, 0)
    p0 = _ids(tiny, PROMPTS[0])
    assert out[0][0] == _doubled_argmax(tiny, p0, 1, -1)
    pos = cache.positions(name)[0]
    n = int(cache.lengths(name)[0])
    assert n == int(plain.lengths(name)[0]) or n == len(p0) + len(out[0])
    assert bool((pos[1:n] > pos[:n - 1]).all()), "each position once"
    # prompt rows before the last are not recycled: identical to the plain run
    torch.testing.assert_close(cache[name][0, :len(p0) - 1], plain[name][0, :len(p0) - 1])
    # the last prompt row is the re-run's: block 1 applied twice there
    assert not torch.allclose(cache[name][0, len(p0) - 1], plain[name][0, len(p0) - 1])


def test_recycle_bad_input_leaves_nothing_behind(tiny):
    n = tiny.hook_count()
    with pytest.raises(InputError, match="recycle layer"):
        tiny.generate(PROMPTS, max_new_tokens=2, chat=False, recycle=Recycle(layer=99, tokens=[5]))
    with pytest.raises(InputError, match="probability"):
        tiny.generate(PROMPTS, max_new_tokens=2, chat=False, recycle=Recycle(layer=0, tokens=[5], prob=1.5))
    with pytest.raises(InputError, match="single token"):
        tiny.generate(PROMPTS, max_new_tokens=2, chat=False, recycle=Recycle(layer=0, tokens=["Wait"]))
    assert tiny.hook_count() == n
    rec = Recycle(layer=0, tokens=["a", "b", 7])  # single characters are single tokens here
    assert rec.token_ids(tiny.tokenizer) == {tiny.tokenizer.convert_tokens_to_ids("a"),
                                           tiny.tokenizer.convert_tokens_to_ids("b"), 7}
    with pytest.raises(InputError, match="non-empty"):
        Recycle(layer=0, tokens=[" "]).token_ids(tiny.tokenizer)


def test_recycle_probability_zero_is_plain_generation(tiny):
    base = tiny.generate(PROMPTS, max_new_tokens=8, chat=False, return_tokens=True)
    rec = Recycle(layer=1, tokens=list(range(100)), prob=0.0)
    assert tiny.generate(PROMPTS, max_new_tokens=8, chat=False, return_tokens=True, recycle=rec) == base
    assert rec.events == []


def test_continue_thinking_matches_plain_hf_greedy(tiny):
    res = continue_thinking(tiny, PROMPTS, word="w", chat=False, max_new_tokens=5, continue_tokens=4,
                            final_prompt=" =", final_tokens=3)
    eos = tiny.tokenizer.eos_token_id
    for i, p in enumerate(PROMPTS):
        ids = _ids(tiny, p)
        with torch.inference_mode():
            g = tiny.model.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False, eos_token_id=eos,
                                  pad_token_id=tiny.tokenizer.pad_token_id)[0, len(ids):].tolist()
        g = [t for t in g if t != eos]
        assert res.answer[i] == tiny.tokenizer.decode(g)
        ids2 = ids + g + _ids(tiny, " w")
        with torch.inference_mode():
            c = tiny.model.generate(torch.tensor([ids2]), max_new_tokens=4, do_sample=False, eos_token_id=eos,
                                  pad_token_id=tiny.tokenizer.pad_token_id)[0, len(ids2):].tolist()
        c = [t for t in c if t != eos]
        assert res.continued[i] == tiny.tokenizer.decode(c)
        assert res.texts[i].startswith(res.answer[i] + " w" + res.continued[i] + " =")
    with pytest.raises(InputError, match="thinking word"):
        continue_thinking(tiny, PROMPTS, word=" ", chat=False)


def test_thinking_eval_and_peak_tokens_on_a_tiny_model(tiny):
    from steerkit.probes.methods.mi import MITrajectory, peak_token_counts, thinking_eval, thinking_token_ids
    from steerkit.probes.methods.region import Problem

    ids, dropped = thinking_token_ids(tiny.tokenizer, ["a", "Wait", "b"])
    assert dropped == ["Wait"] and len(ids) == 2
    probs = [Problem("1+1?", 2.0), Problem("2+3?", 5.0), Problem("4+4?", 8.0)]
    ev = thinking_eval(tiny, probs, layer=1, words=["e", "a", "t"], continue_with="o", max_new_tokens=6,
                       continue_tokens=3, batch_size=2)
    assert ev["n"] == 3 and ev["layer"] == 1
    for cond in ("greedy", "recycling", "continuation"):
        r = ev[cond]
        assert 0.0 <= r["accuracy"] <= 1.0 and r["ci95"][0] <= r["accuracy"] <= r["ci95"][1]
        assert r["correct"] == round(r["accuracy"] * 3)
    assert len(ev["examples"]) == 3 and all("recycling" in e for e in ev["examples"])
    with pytest.raises(InputError, match="single-token"):
        thinking_eval(tiny, probs, words=["Wait"])
    def tr(toks, peaks):
        return MITrajectory(0, np.zeros(len(toks)), toks, peaks)
    assert peak_token_counts([tr([" So", "x", " Wait"], [0, 2]), tr([" So"], [0])]) == {"So": 2, "Wait": 1}
