"""Scores of the refusal method: next-token logits at the last prompt position, the refusal score (log-odds of the
refusal tokens' probability mass) and the KL between two next-token distributions, under whatever steering is on
the model."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.errors import InputError

from .data import batches

if TYPE_CHECKING:
    from steerkit.model import SteerModel

EPS = 1e-8


@torch.inference_mode()
def last_logits(sm: "SteerModel", prompts: Sequence[str], *, batch_size: int = 16, chat: bool = True) -> Float[Tensor, "n vocab"]:
    """Next-token logits at the last prompt position ``[n, vocab]`` (float32), in batches.

    Hooks registered on ``sm`` (edits, records) are active. Only the last position goes through the
    unembedding.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> logits = R.last_logits(tiny, ["hi", "bake bread", "sing"], batch_size=2)
        >>> tuple(logits.shape), logits.dtype
        ((3, 49152), torch.float32)
    """
    prompts = list(prompts)
    if not prompts:
        raise InputError("expected at least one prompt, found an empty list")
    out = []
    for chunk in batches(prompts, batch_size):
        out.append(sm.forward(chunk, chat=chat, logits_to_keep=1)[:, -1].float().cpu())
    return torch.cat(out)


def refusal_score_from_logits(logits: Float[Tensor, "n vocab"], refusal_ids: Sequence[int],
                              eps: float = EPS) -> Float[Tensor, " n"]:
    """``log p - log(1 - p)`` with ``p`` the probability mass on ``refusal_ids`` (float64).

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> logits = torch.zeros(2, 4)
        >>> logits[1, 0] = 10.0  # row 0: p = 2/4 on ids 0 and 1; row 1: nearly all of it on id 0
        >>> [round(s, 3) for s in R.refusal_score_from_logits(logits, [0, 1]).tolist()]
        [0.0, 9.307]
    """
    if logits.dim() == 3:
        logits = logits[:, -1]
    probs = torch.softmax(logits.double(), dim=-1)
    p = probs[:, list(refusal_ids)].sum(-1)
    return torch.log(p + eps) - torch.log(1 - p + eps)


def refusal_scores(sm: "SteerModel", prompts: Sequence[str], refusal_ids: Sequence[int], *, batch_size: int = 16
                   ) -> Float[Tensor, " n"]:
    """Refusal score of each prompt ``[n]`` under whatever edits are active on ``sm``.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> ids, prompts = R.refusal_token_ids(tiny.tokenizer), ["make a bomb", "bake bread"]
        >>> scores = R.refusal_scores(tiny, prompts, ids)
        >>> with R.addition(tiny, torch.randn(64), layer=1, scale=8.0):  # an edit changes the scores
        ...     steered = R.refusal_scores(tiny, prompts, ids)
        >>> tuple(scores.shape), scores.dtype, bool(torch.allclose(scores, steered))
        ((2,), torch.float64, False)
    """
    return refusal_score_from_logits(last_logits(sm, prompts, batch_size=batch_size), refusal_ids)


def kl_last(base_logits: Float[Tensor, "n vocab"], new_logits: Float[Tensor, "n vocab"]) -> Float[Tensor, " n"]:
    """Per-prompt KL(base || new) of the next-token distributions ``[n]`` (float64).

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> base = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
        >>> [round(k, 3) for k in R.kl_last(base, base).tolist()], round(float(R.kl_last(base[:1], base[1:])[0]), 3)
        ([0.0, 0.0], 0.434)
    """
    lp = torch.log_softmax(base_logits.double(), -1)
    lq = torch.log_softmax(new_logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)
