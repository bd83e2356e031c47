"""One chat-template default: every core API that takes a text prompt tokenizes it as raw text unless
given ``chat=True`` (then the chat template goes around it), so ``positions="last"`` / position -1 is the
same token in forward, record, generate, record_dataset, activation patching and the logit lens."""
import pytest
import torch

import steerkit
from steerkit.probes import activation_patching, logit_lens
from steerkit.recording import record_dataset
from tiny_models import tiny_model

PROMPT, OTHER = "hi there", "hi thera"  # equal length (one token per character)
HOOK = "blocks.1.hook_resid_post"
# a template with a system turn, as SmolLM2's has: the chat form is much longer than the raw text
TEMPLATE = ("{% for m in messages %}<bos>system\nYou are kind.\n<bos>{{ m['role'] }}\n{{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}<bos>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chat_sm():
    model, tok = tiny_model("llama")
    tok.chat_template = TEMPLATE
    return steerkit.wrap(model, tok, name="tiny-chat")


def _ids(sm, text, chat):
    tok = sm.tokenizer
    if chat:
        text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]
    return tok(text)["input_ids"]


def _last(sm, toks):
    with sm.record(HOOK, positions="last") as cache:
        logits = sm.forward(toks)
    return logits[0, -1], cache[HOOK][0]


@pytest.mark.parametrize("chat", [None, True])
def test_core_apis_tokenize_a_text_prompt_the_same_way(chat_sm, tmp_path, chat):
    sm = chat_sm
    kw = {} if chat is None else {"chat": chat}
    ids = _ids(sm, PROMPT, bool(chat))
    raw, templ = _ids(sm, PROMPT, False), _ids(sm, PROMPT, True)
    assert len(templ) > len(raw) + 5  # the two forms differ, so a wrong default cannot pass
    want_logits, want_act = _last(sm, sm.pad([ids]))

    assert sm.tokenize(PROMPT, **kw).input_ids[0].tolist() == ids
    assert sm.format(PROMPT, **kw) == (PROMPT if chat is None else sm.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False))
    # forward + record at "last"
    with sm.record(HOOK, positions="last") as cache:
        logits = sm.forward(PROMPT, **kw)
    assert logits.shape[1] == len(ids)
    torch.testing.assert_close(logits[0, -1], want_logits)
    torch.testing.assert_close(cache[HOOK][0], want_act)
    # generate (the method and the module function)
    want_gen = sm.generate(sm.pad([ids]), 4, return_tokens=True)
    assert sm.generate(PROMPT, 4, return_tokens=True, **kw) == want_gen
    assert steerkit.generation.generate(sm, [PROMPT], max_new_tokens=4, return_tokens=True, **kw) == want_gen
    # record_dataset at "last"
    ds = record_dataset(sm, [PROMPT], [HOOK], tmp_path / "ds", progress=False, **kw)
    torch.testing.assert_close(ds.load(HOOK)[0].float(), want_act.float())
    assert ds.meta["chat"] is bool(chat)
    # activation patching: the clean prompt's tokens and metric
    metric = lambda lg: lg[0, -1, 0]  # noqa: E731
    res = activation_patching(sm, PROMPT, OTHER, metric, layers=[0], progress=False, **kw)
    assert len(res.tokens) == len(ids)
    assert res.clean_metric == pytest.approx(float(want_logits[0]), abs=1e-5)
    # the logit lens at position -1
    lens = logit_lens(sm, PROMPT, layers=[sm.n_layers - 1], **kw)
    assert lens.positions == [len(ids) - 1] and len(lens.tokens) == len(ids)
