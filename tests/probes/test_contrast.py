"""Contrast pairs from personas and templates (steerkit.probes.contrast).

The default model's tokenizer (SmolLM2's chat template) renders every pair exactly as
``apply_chat_template`` does; truncation gives one pair per token (or word) of each suffix; multi-turn
templates keep their turns; bad inputs are InputErrors. On a tiny model the recorded activations are
the last-token activations of the rendered texts tokenized once. On the default model a happy/sad
persona direction found from a few pairs separates held-out personas on held-out suffixes.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from steerkit.errors import InputError
from steerkit.probes import (SENTENCE_STARTERS, ContrastPair, auroc, contrast_activations, contrast_direction,
                             contrast_pairs, find_direction, persona_pairs, render, render_messages,
                             truncated_suffixes)
from steerkit.probes.contrast import PERSONA_TEMPLATE

from tiny_models import BOS, tiny_model

DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="module")
def tok():
    """The default model's tokenizer alone (no weights)."""
    from transformers import AutoTokenizer

    from steerkit.loading import resolve as loading

    _, folder, _ = loading.resolve(None)
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


# --- rendering --------------------------------------------------------------------------------------
def test_render_is_the_models_chat_template(tok):
    pairs = contrast_pairs(PERSONA_TEMPLATE, ["happy"], ["sad"], ["I feel", ""], truncate=None)
    pos, neg = render(pairs, tok)
    # a partial reply: continue_final_message, the text ends with the reply (no <|im_end|>)
    assert pos[0] == (DEFAULT_SYSTEM + "<|im_start|>user\nAct as if you're extremely happy.<|im_end|>\n"
                      "<|im_start|>assistant\nI feel")
    assert pos[0] == tok.apply_chat_template(pairs[0].positive, continue_final_message=True, tokenize=False)
    # no reply yet: the generation prompt, the text ends where the reply starts
    assert pairs[1].positive == [{"role": "user", "content": "Act as if you're extremely happy."}]
    assert pos[1] == tok.apply_chat_template(pairs[1].positive, add_generation_prompt=True, tokenize=False)
    assert pos[1].endswith("<|im_start|>assistant\n")
    assert neg == [p.replace("happy", "sad") for p in pos]  # the pair differs only in the persona


def test_render_with_system_prompt_and_trailing_space(tok):
    pairs = persona_pairs(["calm"], ["angry"], ["Well, "], truncate=None, persona_in="system")
    pos, neg = render(pairs, tok)
    assert pos[0] == ("<|im_start|>system\nAct as if you're extremely calm.<|im_end|>\n"
                      "<|im_start|>user\nTell me about your day.<|im_end|>\n<|im_start|>assistant\nWell, ")
    assert neg[0] == tok.apply_chat_template(pairs[0].negative, continue_final_message=True, tokenize=False)
    assert render_messages(pairs[0].positive, tok) == pos[0]


def test_multi_turn_template(tok):
    dialogue = [{"role": "system", "content": "You are {persona}."},
                {"role": "user", "content": "Hi, how was the trip?"},
                {"role": "assistant", "content": "It was long."},
                {"role": "user", "content": "And the hotel?"},
                {"role": "assistant", "content": "Honestly,"}]
    pairs = contrast_pairs(dialogue, ["cheerful"], ["grumpy"], [" the room was small"], tokenizer=tok,
                           max_suffix_len=2)
    assert [p.suffix for p in pairs] == [" the", " the room"]
    p = pairs[1]
    assert [m["role"] for m in p.positive] == ["system", "user", "assistant", "user", "assistant"]
    assert p.positive[0]["content"] == "You are cheerful." and p.negative[0]["content"] == "You are grumpy."
    assert p.positive[-1]["content"] == "Honestly, the room"  # the template's opener, continued by the suffix
    assert p.positive[1:4] == dialogue[1:4]
    pos, _ = render(pairs, tok)
    assert pos[1] == tok.apply_chat_template(p.positive, continue_final_message=True, tokenize=False)
    assert pos[1].endswith("<|im_end|>\n<|im_start|>assistant\nHonestly, the room")
    assert pos[1].count("<|im_start|>assistant") == 2 and DEFAULT_SYSTEM not in pos[1]
    # the template's own turns are left as they are
    assert dialogue[-1]["content"] == "Honestly,"


def test_braces_other_than_the_slot_stay(tok):
    pairs = contrast_pairs('Reply as {persona} JSON: {"mood": ...}', ["happy"], ["sad"], truncate=None)
    assert pairs[0].positive[0]["content"] == 'Reply as happy JSON: {"mood": ...}'


# --- truncation -------------------------------------------------------------------------------------
def test_token_truncation_gives_one_suffix_per_token(tok):
    s = "The weather today is lovely, and I"
    ids = tok(s, add_special_tokens=False)["input_ids"]
    cuts = truncated_suffixes([s], tokenizer=tok)
    assert len(cuts) == len(ids) == 8
    assert cuts[0] == "The" and cuts[-1] == s
    for i, c in enumerate(cuts, 1):
        assert s.startswith(c)
        assert tok(c, add_special_tokens=False)["input_ids"] == ids[:i]
    assert truncated_suffixes([s], tokenizer=tok, max_suffix_len=3) == cuts[:3]
    assert truncated_suffixes([s], tokenizer=tok, min_suffix_len=7) == cuts[6:]
    # a SteerModel-like object holding the tokenizer works as tokenizer=
    holder = type("Holder", (), {"tokenizer": tok})()
    assert truncated_suffixes([s], tokenizer=holder) == cuts


def test_pair_counts_and_order(tok):
    sfx = ["I think so", "I feel fine"]  # share the one-token prefix "I": kept once
    pairs = contrast_pairs("Be {persona}.", ["happy", "joyful", "glad"], ["sad", "miserable", "down"], sfx,
                           tokenizer=tok)
    n_cuts = len(truncated_suffixes(sfx, tokenizer=tok))
    assert n_cuts == 3 + 3 - 1
    assert len(pairs) == n_cuts * 3
    assert [p.suffix for p in pairs[:4]] == ["I", "I", "I", "I think"]  # suffix by suffix, every persona pair
    assert [(p.positive_persona, p.negative_persona) for p in pairs[:3]] == [("happy", "sad"), ("joyful", "miserable"),
                                                                              ("glad", "down")]
    default = persona_pairs(["happy"], ["sad"], tokenizer=tok)
    assert len(default) == len(truncated_suffixes(SENTENCE_STARTERS, tokenizer=tok)) > len(SENTENCE_STARTERS)
    assert all(ContrastPair.from_dict(p.to_dict()) == p for p in default[:5])


def test_word_truncation():
    cuts = truncated_suffixes(["I  feel great,  really", "Yes"], truncate="words")
    assert cuts == ["I", "I  feel", "I  feel great,", "I  feel great,  really", "Yes"]
    assert truncated_suffixes(["a b c"], truncate=None) == ["a b c"]
    assert truncated_suffixes([""], truncate="tokens") == [""]  # nothing to cut: no tokenizer needed


# --- errors -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("call, match", [
    (lambda: contrast_pairs("Be {persona}.", [], ["sad"], truncate=None), "at least one entry in positive"),
    (lambda: contrast_pairs("Be {persona}.", ["happy"], [], truncate=None), "at least one entry in negative"),
    (lambda: contrast_pairs("Be {persona}.", ["a", "b"], ["c"], truncate=None), "as many positive as negative"),
    (lambda: contrast_pairs("Be {persona}.", ["  "], ["sad"], truncate=None), "non-empty personas"),
    (lambda: contrast_pairs("Be {persona}.", "happy", ["sad"], truncate=None), "one string"),
    (lambda: contrast_pairs("Be happy.", ["happy"], ["sad"], truncate=None), r"slot \{persona\}"),
    (lambda: contrast_pairs("Be {mood}.", ["happy"], ["sad"], system="Hi", truncate=None), r"slot \{persona\}"),
    (lambda: contrast_pairs("Be {persona}.", ["happy"], ["sad"], ["I am"]), "expected tokenizer="),
    (lambda: contrast_pairs("Be {persona}.", ["happy"], ["sad"], [], truncate=None), "at least one entry in suffixes"),
    (lambda: contrast_pairs("Be {persona}.", ["happy"], ["sad"], ["x"], truncate="chars"), "truncate= one of"),
    (lambda: contrast_pairs([], ["happy"], ["sad"], truncate=None), "at least one message"),
    (lambda: contrast_pairs([{"role": "bot", "content": "{persona}"}], ["a"], ["b"], truncate=None), "roles"),
    (lambda: contrast_pairs([{"role": "user"}], ["a"], ["b"], truncate=None), "'role': str, 'content': str"),
    (lambda: contrast_pairs([{"role": "system", "content": "{persona}"}], ["a"], ["b"], truncate=None),
     "end with a user or an assistant"),
    (lambda: contrast_pairs([{"role": "system", "content": "x"}, {"role": "user", "content": "{persona}"}], ["a"],
                            ["b"], system="y", truncate=None), "system prompt once"),
    (lambda: truncated_suffixes(["a b"], truncate="words", min_suffix_len=2, max_suffix_len=1), "min_suffix_len"),
    (lambda: persona_pairs(["a"], ["b"], ["x"], truncate=None, persona_in="assistant"), "persona_in"),
    (lambda: render([], None), "at least one contrast pair"),
    (lambda: render_messages([{"role": "user", "content": "x"}], object()), "tokenizer or a SteerModel"),
    (lambda: ContrastPair.from_dict({"positive": []}), "without"),
])
def test_errors(call, match):
    with pytest.raises(InputError, match=match):
        call()


def test_a_tokenizer_without_chat_template_is_an_error():
    _, plain = tiny_model("llama")
    pairs = contrast_pairs("Be {persona}.", ["happy"], ["sad"], truncate=None)
    with pytest.raises(InputError, match="chat template"):
        render(pairs, plain)


# --- recording on a tiny model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_chat():
    """A tiny random Llama whose chat template starts with the BOS token, as Llama 3's does."""
    import steerkit

    model, tk = tiny_model("llama")
    tk.chat_template = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</>{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}")
    return steerkit.wrap(model, tk, name="tiny-chat")


def test_activations_are_the_rendered_texts_last_token(tiny_chat):
    sm = tiny_chat
    pairs = contrast_pairs("Be {persona}!", ["glad", "happy"], ["sad", "down"], ["I am ok", ""], truncate="words")
    hook = "blocks.1.hook_resid_post"
    pos, neg = contrast_activations(sm, pairs, hook, batch_size=3, progress=False)
    assert pos.shape == neg.shape == (len(pairs), 64) and pos.dtype == torch.float32
    pos_texts, neg_texts = render(pairs, sm)
    assert pos_texts[0] == "<bos><user>Be glad!</><assistant>I"
    assert pos_texts[-1] == "<bos><user>Be happy!</><assistant>"
    for texts, got in ((pos_texts, pos), (neg_texts, neg)):
        for i, t in enumerate(texts):
            ids = sm.tokenizer(t, add_special_tokens=False)["input_ids"]
            assert ids.count(BOS) == 1 and ids[0] == BOS  # the template's BOS, not one more
            with sm.record(hook, positions="last") as cache:
                sm.forward(sm.pad([ids]))
            torch.testing.assert_close(got[i], cache[hook][0].float(), atol=1e-5, rtol=1e-5)
    both = contrast_activations(sm, pairs, [hook, "blocks.0.hook_resid_post"], batch_size=16, progress=False)
    assert set(both) == {hook, "blocks.0.hook_resid_post"}
    torch.testing.assert_close(both[hook][0], pos, atol=1e-5, rtol=1e-5)  # batching does not change the rows
    d = contrast_direction(sm, pairs, hook, method="pca_diff", progress=False)
    assert d.method == "pca_diff" and d.separation > 0
    assert sm.hook_count() == 0
    with pytest.raises(InputError, match="one hook name"):
        contrast_direction(sm, pairs, [hook])
    with pytest.raises(InputError, match="batch_size"):
        contrast_activations(sm, pairs, hook, batch_size=0)


# --- end to end on the default model -------------------------------------------------------------------
# Measured on the default model (float32, CPU) with these sets (22 training pairs, 20 held-out pairs),
# held-out AUROC of the diffmean direction by block: 4: 0.50, 8: 0.50, 12: 0.56, 16: 0.80, 20: 0.95,
# 24: 1.00 (pca_diff at 24: 0.995); pair by pair the positive side scores higher in 100% of the held-out
# pairs from block 16 on. The bound leaves room for numerical differences between machines.
E2E_LAYER = 24
E2E_MIN_AUROC = 0.95


@pytest.mark.slow
def test_persona_direction_separates_held_out_personas(sm):
    train = persona_pairs(["happy"], ["sad"], SENTENCE_STARTERS[:8], tokenizer=sm, max_suffix_len=3)
    test = persona_pairs(["cheerful", "joyful"], ["gloomy", "miserable"], SENTENCE_STARTERS[20:30], tokenizer=sm,
                         truncate=None)
    hook = f"blocks.{E2E_LAYER}.hook_resid_post"
    direction = contrast_direction(sm, train, hook, progress=False)
    p, n = contrast_activations(sm, test, hook, progress=False)
    scores = torch.cat([direction.score(p), direction.score(n)]).numpy()
    y = np.r_[np.ones(len(p)), np.zeros(len(n))]
    a = auroc(y, scores)
    print(f"\nheld-out persona AUROC at {hook}: {a:.3f} ({len(train)} training pairs, {len(test)} held-out pairs)")
    assert a >= E2E_MIN_AUROC, f"expected held-out AUROC >= {E2E_MIN_AUROC}, found {a:.3f}"
    assert float((direction.score(p) > direction.score(n)).float().mean()) >= 0.9  # pair by pair
    assert find_direction(p, n).vector @ direction.vector > 0  # the held-out pairs point the same way
