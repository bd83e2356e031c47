"""What the explorer's computations share: the cancel signal, progress ticks, one-prompt tokenising and
the logit lens of a residual-space vector."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.errors import InputError
from steerkit.model import Tokens

from ..data import MAX_ANSWER_CHARS, MAX_PATCH_PROMPT_CHARS, check_text

if TYPE_CHECKING:
    from steerkit.model import SteerModel


class Cancelled(Exception):
    """Raised inside a computation when its caller asked it to stop (a signal, not an error)."""


def tick(progress, should_stop, done, total):
    if should_stop is not None and should_stop():
        raise Cancelled("cancelled")
    if progress is not None:
        progress(done, total)



def unembed_fn(sm: SteerModel):
    norm = sm.adapter.final_norm_module(sm.hf_model)
    unembed = sm.adapter.unembed_module(sm.hf_model)

    @torch.inference_mode()
    def f(v):
        x = torch.as_tensor(v, dtype=sm.dtype, device=sm.device).reshape(1, 1, -1)
        return unembed(norm(x)).reshape(-1).float().cpu()
    return f


def logit_lens(sm: SteerModel, v: Float[Tensor, " d_model"] | np.ndarray,
               k: int = 10) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """Top and bottom ``k`` tokens of ``unembed(final_norm(v))`` for a residual-space vector ``v``."""
    logits = unembed_fn(sm)(v)
    return top_bottom(sm, logits, k)


def top_bottom(sm: SteerModel, logits, k):
    k = min(k, logits.shape[0])
    top = torch.topk(logits, k)
    bot = torch.topk(-logits, k)

    def dec(i):
        return sm.tokenizer.decode([int(i)])
    return ([(dec(i), float(s)) for s, i in zip(top.values, top.indices)],
            [(dec(i), float(-s)) for s, i in zip(bot.values, bot.indices)])



def one_prompt(sm: SteerModel, text, what: str, max_tokens: int) -> tuple[Tokens, list[str]]:
    """One prompt (bounded text, bounded tokens) as one-row ``Tokens`` and its token labels."""
    text = check_text(text, what, MAX_PATCH_PROMPT_CHARS)
    if not text.strip():
        raise InputError(f"expected {what}, found nothing; type a prompt")
    toks = sm.tokenize([text], chat=False)
    n = int(toks.input_ids.shape[1])
    if n > max_tokens:
        raise InputError(f"expected {what} of at most {max_tokens} tokens, found {n}; shorten it")
    return toks, [sm.tokenizer.decode([int(i)]) for i in toks.input_ids[0].tolist()]


def answer_token(value, what: str) -> str:
    value = check_text(value, what, MAX_ANSWER_CHARS)
    if not value:
        raise InputError(f"expected {what} as one token (like ' Mary', with its leading space), found nothing")
    return value


