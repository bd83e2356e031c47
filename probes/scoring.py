"""Scoring new prompts with a stored probe.

How it works
------------
A :class:`~steerkit.vectors.Probe` knows its layer and hook site; the position it was fitted
at and whether the chat template was used are in ``provenance.method_params`` (``position``,
``chat``; defaults ``"last"`` and ``True``). :func:`score_prompts` checks the probe against the
model (width, layer count, fingerprint: :func:`steerkit.vectors.check_compatible`), records
that one hook at that position exactly as the sweep did (:func:`record_activations`), and
evaluates the stored arrays (:func:`~steerkit.probes.linear.probe_scores`). Scores are
logits: higher means the probe's positive class (``probe.classes[-1]``); the probability is
``sigmoid(score)`` for a logistic probe.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
from jaxtyping import Float

from steerkit.errors import InputError
from steerkit.vectors import ModelMismatchError, check_compatible

from .linear import probe_scores
from .sweep import record_activations

if TYPE_CHECKING:
    from steerkit.model import SteerModel

__all__ = ["score_prompts", "probe_position"]


def probe_position(probe) -> int | str:
    """The token position a probe reads (``method_params["position"]`` of its provenance; ``"last"`` if unset).

    Examples:
        >>> from steerkit.probes import fit_probe
        >>> from steerkit.probes.scoring import probe_position
        >>> pos, neg = torch.randn(10, 64) + 1, torch.randn(10, 64)
        >>> probe_position(fit_probe(pos, neg, layer=2)), probe_position(fit_probe(pos, neg, layer=2, position="mean"))
        ('last', 'mean')
    """
    p = (probe.provenance.method_params or {}).get("position")
    return "last" if p is None else p


def score_prompts(sm: "SteerModel", probe, prompts: Sequence[str], *, chat: bool | None = None, batch_size: int = 16,
                  override: bool = False) -> Float[np.ndarray, " n"]:
    """Per-prompt probe scores (logits, float64) at the probe's layer, hook and position.

    A probe fitted on recorded activations scores new prompts.

    Examples:
        >>> from steerkit.probes import fit_probe, record_activations, score_prompts
        >>> questions, statements = ["Where is it?", "Who are you?", "Why not?"], ["It is here.", "I am Bob.", "Fine."]
        >>> acts = record_activations(tiny, questions + statements, hooks=["blocks.2.hook_resid_post"])["last"][0]
        >>> probe = fit_probe(acts[:3], acts[3:], layer=2, model=tiny, method="diffmean")
        >>> score_prompts(tiny, probe, ["What is that?", "That is a cat."]).shape
        (2,)
    """
    try:
        check_compatible(probe, sm, override=override)
    except ModelMismatchError as e:
        raise InputError(f"{e}") from None
    hook = f"blocks.{probe.layer}.{probe.hook_site}"
    if chat is None:
        chat = bool((probe.provenance.method_params or {}).get("chat", True))
    pos = probe_position(probe)
    acts = record_activations(sm, prompts, hooks=[hook], positions=[pos], chat=chat, batch_size=batch_size)
    return probe_scores(probe, next(iter(acts.values()))[0])
