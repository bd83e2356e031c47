"""Generation with the KV cache, under steerkit's hooks.

The loop is steerkit's own (not ``model.generate``), so that every step runs
through the backend under one :class:`~steerkit.positions.RunState`: hooks
know which positions are prompt and which are generated, edits apply to
generated tokens as well, and tokens can be streamed. Prompts are
left-padded; position ids come from the attention mask. When a record scope
asks for generated positions, one extra step feeds the last sampled token, so
the cache holds one row per generated token.

Greedy decoding gives the same tokens as ``transformers``' ``generate``.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from .errors import InputError


def _sample(logits: Tensor, do_sample: bool, temperature: float, top_p: float, top_k: int,
            gen: torch.Generator | None) -> Tensor:
    if not do_sample:
        return logits.argmax(-1)
    if temperature <= 0:
        raise InputError(f"expected temperature > 0 when sampling, found {temperature}")
    logits = logits.float() / temperature
    if top_k and top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sl, si = logits.sort(-1, descending=True)
        cp = sl.softmax(-1).cumsum(-1)
        drop = cp - sl.softmax(-1) > top_p
        sl = sl.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, si, sl)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def _wants_generated_rows(sm) -> bool:
    return any(getattr(h, "_records_generated", False) for h in sm.hooks.handles)


@torch.inference_mode()
def generate(sm, prompts, *, max_new_tokens: int = 32, chat: bool = True, do_sample: bool = False,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, stop: Sequence[str] = (),
             seed: int | None = None, stream: Callable | None = None, return_tokens: bool = False):
    """Generate up to ``max_new_tokens`` per prompt; returns a list of strings (or token lists).

    ``stream(row, token_id, text_so_far)`` is called for every new token. A row stops at
    its EOS token or when its text contains one of ``stop`` (the stop string is cut off).
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"expected max_new_tokens >= 1, found {max_new_tokens!r}")
    toks = sm.tokenize(prompts, chat=chat)
    B, P = toks.input_ids.shape
    if sm.n_ctx is not None and P + max_new_tokens > sm.n_ctx:
        raise InputError(f"expected prompt + max_new_tokens <= {sm.n_ctx} (the model's context), found "
                         f"{P} + {max_new_tokens}; lower max_new_tokens or shorten the prompts")
    dev = toks.input_ids.device
    gen = None
    if seed is not None:
        gen = torch.Generator(device=dev).manual_seed(seed)
    eos = sm.tokenizer.eos_token_id
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) if eos is not None else set()
    gcfg = getattr(sm.hf_model, "generation_config", None)
    if gcfg is not None and gcfg.eos_token_id is not None:
        e = gcfg.eos_token_id
        eos_ids |= set(e if isinstance(e, (list, tuple)) else [e])
    pad = sm.tokenizer.pad_token_id
    out: list[list[int]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    texts = [""] * B
    mask = toks.attention_mask
    backend = sm.backend
    with sm.hooks.runs.running(toks.attention_mask, toks.input_ids) as run:
        cache = backend.new_cache()
        pos = toks.position_ids
        logits, cache = backend.step(toks.input_ids, mask, pos, cache)
        next_pos = pos[:, -1:] + 1
        for step in range(max_new_tokens):
            nxt = _sample(logits, do_sample, temperature, top_p, top_k, gen)
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            for b in range(B):
                if done[b]:
                    continue
                t = int(nxt[b])
                if t in eos_ids:
                    done[b] = True
                    continue
                out[b].append(t)
                if stream is not None or stop:
                    texts[b] = sm.tokenizer.decode(out[b], skip_special_tokens=True)
                if stream is not None:
                    stream(b, t, texts[b])
                if stop and any(s in texts[b] for s in stop):
                    done[b] = True
            last = step == max_new_tokens - 1
            if bool(done.all()) or (last and not _wants_generated_rows(sm)):
                break
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=dev)], 1)
            run.append_tokens(nxt.unsqueeze(1))  # token-pattern position specs read the fed ids
            logits, cache = backend.step(nxt.unsqueeze(1), mask, next_pos, cache)
            next_pos = next_pos + 1
    if return_tokens:
        return out
    res = []
    for b in range(B):
        txt = sm.tokenizer.decode(out[b], skip_special_tokens=True)
        for s in stop:
            i = txt.find(s)
            if i >= 0:
                txt = txt[:i]
        res.append(txt)
    return res
