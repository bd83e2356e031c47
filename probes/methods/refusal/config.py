"""The settings of the refusal method (:class:`RefusalConfig`) and their check."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from steerkit.errors import InputError

from .data import DEFAULT_REFUSAL_WORDS


@dataclass
class RefusalConfig:
    """The settings of :func:`run` / :func:`run_refusal` (prompt counts per side, selection thresholds, what
    to evaluate); check them with :func:`check_config`.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> cfg = R.RefusalConfig(n_train=8, probe=False)
        >>> cfg.n_train, cfg.n_val, cfg.refusal_words, cfg.fallback
        (8, 16, ('I', 'As'), 'relative')
    """
    n_train: int = 32
    n_val: int = 16
    n_test: int = 16
    seed: int = 0
    batch_size: int = 16
    max_new_tokens: int = 24
    refusal_words: tuple = DEFAULT_REFUSAL_WORDS
    min_keep: int = 8
    prune_frac: float = 0.2
    kl_max: float = 0.1
    induce_min: float = 0.0
    fallback: Optional[str] = "relative"  # see select_direction; None: raise when nothing passes the paper's rule
    lazy: bool = True
    probe: bool = True
    probe_n_train: Optional[int] = None  # refusal probe train prompts per side (default: every vendored train prompt)
    probe_n_test: Optional[int] = None  # refusal probe held-out prompts per side (default: every vendored val prompt)
    batched: bool = True  # score many candidates per forward pass (per-row steering); False: one candidate at a time
    score_rows: Optional[int] = None  # rows per pass of the batched search (default: batch_size on a CPU, 256 elsewhere)
    n_positions: Optional[int] = None  # use only the last k post-instruction positions (default: all)
    layer_step: int = 1  # evaluate candidates at every layer_step-th layer (default: every layer)
    n_samples: int = 3


def check_config(config: RefusalConfig) -> RefusalConfig:
    """``config`` when its counts are valid; :class:`InputError` naming the field otherwise.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> R.check_config(R.RefusalConfig(n_train=4)).n_train
        4
        >>> R.check_config(R.RefusalConfig(layer_step=0))
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected layer_step >= 1, found 0
    """
    for k in ("n_train", "n_val", "n_test", "batch_size", "layer_step"):
        if getattr(config, k) < 1:
            raise InputError(f"expected {k} >= 1, found {getattr(config, k)}")
    if config.score_rows is not None and config.score_rows < 1:
        raise InputError(f"expected score_rows >= 1 (or None for the device's default), found {config.score_rows}")
    if not config.refusal_words:
        raise InputError("expected at least one refusal word, found none")
    return config
