"""Candidate refusal directions: the residual stream at every block input and post-instruction position, the
filtering of prompts by the model's own refusal score, and the difference of means."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.errors import InputError

from .data import batches
from .score import last_logits, refusal_score_from_logits

if TYPE_CHECKING:
    from steerkit.model import SteerModel

@torch.inference_mode()
def record_resid_pre(sm: "SteerModel", prompts: Sequence[str], positions: list[int], refusal_ids: Sequence[int] | None = None,
                     *, batch_size: int = 16, progress: Optional[Callable[[int], object]] = None
                     ) -> tuple[Float[Tensor, "n n_pos n_layers d_model"], Optional[Float[Tensor, " n"]]]:
    """Residual stream at every block input and ``positions``: ``[n, n_pos, n_layers, d_model]``,
    and the refusal scores of the same forward passes (``None`` without ``refusal_ids``).

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> ids = R.refusal_token_ids(tiny.tokenizer)
        >>> acts, scores = R.record_resid_pre(tiny, ["hi", "bake bread", "sing"], [-2, -1], ids, batch_size=2)
        >>> tuple(acts.shape), tuple(scores.shape)
        ((3, 2, 4, 64), (3,))
    """
    names = [f"blocks.{l}.hook_resid_pre" for l in range(sm.n_layers)]
    acts, scores = [], []
    for chunk in batches(list(prompts), batch_size):
        with sm.record(names, positions=list(positions)) as cache:
            lg = last_logits(sm, chunk, batch_size=len(chunk))
        a = torch.stack([cache[n] for n in names], dim=2).float().cpu()  # [b, n_pos, L, d]
        if a.shape[1] != len(positions):
            raise InputError(f"expected {len(positions)} recorded positions per prompt, found {a.shape[1]}; "
                             "is a prompt shorter than the chat template suffix?")
        acts.append(a)
        if refusal_ids is not None:
            scores.append(refusal_score_from_logits(lg, refusal_ids))
        if progress is not None:
            progress(len(chunk))
    return torch.cat(acts), (torch.cat(scores) if scores else None)


def mean_diff(harmful_acts: Float[Tensor, "n_harmful ..."], harmless_acts: Float[Tensor, "n_harmless ..."]
              ) -> Float[Tensor, "..."]:
    """Difference of means over the first axis (prompts): ``mean(harmful) - mean(harmless)``.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> R.mean_diff(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.zeros(1, 2))
        tensor([2., 3.])
    """
    if harmful_acts.shape[1:] != harmless_acts.shape[1:]:
        raise InputError(f"expected activations of equal shapes after the prompt axis, found "
                         f"{tuple(harmful_acts.shape)} and {tuple(harmless_acts.shape)}")
    if harmful_acts.shape[0] == 0 or harmless_acts.shape[0] == 0:
        raise InputError("expected at least one prompt on each side, found an empty set")
    for name, a in (("harmful", harmful_acts), ("harmless", harmless_acts)):
        if not bool(torch.isfinite(a).all()):
            raise InputError(f"expected finite {name} activations, found NaN/inf")
    return harmful_acts.double().mean(0).float() - harmless_acts.double().mean(0).float()


def filter_by_score(prompts: Sequence[str], scores: Float[Tensor, " n"], *, refuses: bool, min_keep: int
                    ) -> tuple[list[str], str]:
    """Keep the prompts the model refuses (``refuses``: score > 0) or does not (score < 0).

    Returns ``(kept, note)``; when fewer than ``min_keep`` would remain, everything is kept and the
    note says so.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> prompts, scores = ["a", "b", "c"], torch.tensor([1.5, -0.2, 0.3])
        >>> R.filter_by_score(prompts, scores, refuses=True, min_keep=2)
        (['a', 'c'], 'kept 2/3 refused (score > 0)')
        >>> R.filter_by_score(prompts, scores, refuses=False, min_keep=2)
        (['a', 'b', 'c'], 'only 1/3 not refused (score < 0) (< min_keep=2); kept all, unfiltered')
    """
    keep = (scores > 0) if refuses else (scores < 0)
    kept = [p for p, k in zip(prompts, keep.tolist()) if k]
    what = "refused (score > 0)" if refuses else "not refused (score < 0)"
    if len(kept) >= min_keep:
        return kept, f"kept {len(kept)}/{len(prompts)} {what}"
    return list(prompts), (f"only {len(kept)}/{len(prompts)} {what} (< min_keep={min_keep}); "
                           "kept all, unfiltered")
