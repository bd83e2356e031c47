"""Evaluating a sparse autoencoder on prompts: :func:`sae_eval`, sae-lens's ``run_evals`` metrics through
steerkit's own hooks.

How it works
------------
Each batch of prompts is tokenized as :meth:`SteerModel.forward <steerkit.SteerModel.forward>` does
(left-padded) and run three times:

1. clean, with the SAE attached (:meth:`SteerModel.attach_sae <steerkit.SteerModel.attach_sae>`, once for
   every batch) and its sub-sites ``hook_sae_input`` / ``hook_sae_acts_post`` / ``hook_sae_recons`` recorded at the counted
   positions: L0 and explained variance come from these rows, the clean loss from the logits;
2. spliced: the reconstruction in place of the activation at the counted positions
   (:func:`steerkit.saesites.splice_intervention`, what ``attach_sae(sae, splice=True, positions=...)``
   installs), the others keeping their own, as in sae-lens's ``get_recons_loss``;
3. zero-ablated: the activation replaced by zeros at every position (``sm.edit(site, replace=0)``).

The counted positions are the real tokens (padding never counts) less the tokenizer's structural special
tokens (BOS, EOS, PAD, SEP: sae-lens's ``get_special_token_ids``, which ``run_evals`` leaves out by
default; ``exclude_special_tokens=False`` counts them). The metrics are
:mod:`steerkit.probes.sae_metrics`'s, which are sae-lens's definitions
(``tests/integration/test_sae_eval_saelens.py`` runs sae-lens's own ``get_sparsity_and_variance_metrics`` and
``get_downstream_reconstruction_metrics`` on the same tensors): L0 the mean count of nonzero latents per counted token; explained variance
``1 - sum |x - x_hat|^2 / sum |x - mean(x)|^2`` over every counted token of every batch (sae-lens's
``ExplainedVarianceCalculator``); the losses the mean next-token cross-entropy over the predictions made
at counted positions; CE loss recovered ``(CE_zero_ablation - CE_spliced) / (CE_zero_ablation - CE_clean)``
(sae-lens's ``ce_loss_score``).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor
from tqdm.auto import tqdm

from steerkit.errors import InputError
from steerkit.saesites import sae_parts, splice_intervention
from steerkit.model import SteerModel

from .sae_metrics import ce_loss_recovered, explained_variance, l0, next_token_ce

__all__ = ["sae_eval", "special_token_ids"]

#: the tokenizer attributes whose ids sae-lens's evals leave out (``sae_lens.util.get_special_token_ids``)
SPECIAL_TOKEN_ATTRS = ("bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id")


def special_token_ids(tokenizer: Any) -> list[int]:
    """The ids of the tokenizer's structural special tokens (BOS, EOS, PAD, SEP, decoder start), sorted: what
    sae-lens's evals leave out by default (chat-template tokens are not among them).

    Examples:
        >>> special_token_ids(tiny.tokenizer)  # SmolLM2's <|im_start|> (BOS) and <|im_end|> (EOS, also its PAD)
        [1, 2]
    """
    ids = {getattr(tokenizer, a, None) for a in SPECIAL_TOKEN_ATTRS}
    return sorted(int(i) for i in ids if isinstance(i, int))


def _rows(cache, name: str) -> Tensor:
    """The recorded rows of ``name``, row after row (``[sum(lengths), width]``)."""
    v, n = cache[name], cache.lengths(name)
    return torch.cat([v[r, : int(n[r])] for r in range(v.shape[0])])


def sae_eval(sm: SteerModel, sae: Any, prompts: str | Sequence[str], *, site: str | None = None, batch_size: int = 8,
             chat: bool = False, exclude_special_tokens: bool = True, override: bool = False,
             progress: bool = True) -> dict:
    """sae-lens's evaluation of ``sae`` (``steerkit.load_sae(...)``, or a :class:`steerkit.sae.SAEWeights` with
    ``site=``) on ``prompts``: L0, explained variance and CE loss recovered, with the three losses behind it
    (see the module docstring). Three forward passes per batch of ``batch_size`` prompts (raw text; ``chat``:
    inside the chat template). A stored SAE is checked against the model first (``override``: a fingerprint
    or depth mismatch warns instead). Returns ``{"site", "l0", "explained_variance", "ce_loss_clean",
    "ce_loss_spliced", "ce_loss_zero_ablation", "ce_loss_recovered", "eval_tokens", "ce_tokens"}``
    (``eval_tokens``: the counted tokens; ``ce_tokens``: the predictions the losses average).

    Examples:
        >>> from steerkit.sae import SAEWeights
        >>> g = torch.Generator().manual_seed(0)
        >>> W = torch.randn(64, 256, generator=g) / 8
        >>> sae = SAEWeights(W, torch.zeros(256), W.T.clone(), torch.zeros(64), architecture="topk", k=8)
        >>> r = sae_eval(tiny, sae, ["The quick brown fox", "Once upon a time"], site="blocks.1.hook_resid_post",
        ...              progress=False)
        >>> r["l0"], r["eval_tokens"], r["ce_tokens"]  # 8 latents on each of 8 tokens, 6 predictions between them
        (8.0, 8, 6)
    """
    weights, site = sae_parts(sae, site)
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not prompts:
        raise InputError("expected at least one prompt to evaluate the SAE on, found an empty list")
    if batch_size < 1:
        raise InputError(f"expected batch_size >= 1, found {batch_size}")
    special = torch.tensor(special_token_ids(sm.tokenizer) if exclude_special_tokens else [], dtype=torch.long)
    xs, x_hats, ce = [], [], {"clean": [], "spliced": [], "zero": []}
    active, counted = 0.0, 0
    zero = torch.zeros(weights.d_in)
    with sm.attach_sae(sae, site, override=override) as h:  # the SAE's tensors on the model's device once
        for s in tqdm(range(0, len(prompts), batch_size), desc="sae eval", unit="batch", disable=not progress):
            toks = sm.tokenize(prompts[s:s + batch_size], chat=chat)
            keep = toks.attention_mask.bool() & ~torch.isin(toks.input_ids, special.to(toks.input_ids.device))
            if not bool(keep.any()):
                continue
            with sm.record(h.names[:3], positions=keep, device="cpu") as cache:
                logits = sm.forward(toks)
            ce["clean"].append(next_token_ce(logits, toks.input_ids, keep).cpu())
            del logits
            f = _rows(cache, h.names[1])
            active += l0(f) * f.shape[0]
            counted += f.shape[0]
            xs.append(_rows(cache, h.names[0]))
            x_hats.append(_rows(cache, h.names[2]))
            del cache, f
            with sm.steer(splice_intervention(h.weights, site, positions=keep)):
                ce["spliced"].append(next_token_ce(sm.forward(toks), toks.input_ids, keep).cpu())
            with sm.edit(site, replace=zero):
                ce["zero"].append(next_token_ce(sm.forward(toks), toks.input_ids, keep).cpu())
    if not counted:
        raise InputError(f"expected tokens to evaluate, found none: every one of the {len(prompts)} prompts is "
                         "special tokens only; pass longer prompts or exclude_special_tokens=False")
    loss = {k: torch.cat(v) for k, v in ce.items()}
    if loss["clean"].numel() == 0:
        raise InputError("expected at least one next-token prediction from a counted position, found none: the "
                         "prompts are one counted token each; pass longer prompts")
    mean = {k: float(v.double().mean()) for k, v in loss.items()}
    return {"site": site, "l0": active / counted, "explained_variance": explained_variance(torch.cat(xs), torch.cat(x_hats)),
            "ce_loss_clean": mean["clean"], "ce_loss_spliced": mean["spliced"], "ce_loss_zero_ablation": mean["zero"],
            "ce_loss_recovered": ce_loss_recovered(mean["clean"], mean["spliced"], mean["zero"]),
            "eval_tokens": counted, "ce_tokens": int(loss["clean"].numel())}
