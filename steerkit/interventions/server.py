"""Position masks for a server's rows: one request's contiguous rows, in the position vocabulary of
:mod:`steerkit.hooks.positions`."""
from __future__ import annotations

import torch
from torch import Tensor

from steerkit.hooks.positions import RunState, chunk_mask

from steerkit.interventions.program import MaskOf


def server_mask_of(positions: Tensor, n_prompt: int) -> MaskOf:
    """``mask_of`` for rows of ONE request with absolute ``positions`` (contiguous, as a server feeds
    them) and a prompt of ``n_prompt`` tokens, in the position vocabulary of :mod:`steerkit.hooks.positions`.

    Examples:
        >>> mask_of = server_mask_of(torch.arange(0, 5), n_prompt=3)  # a prefill chunk of 5 tokens
        >>> mask_of("last").tolist(), mask_of("generated").tolist()
        ([False, False, True, False, False], [False, False, False, True, True])
        >>> mask_of("prompt").tolist()
        [True, True, True, False, False]
    """
    start, T = int(positions[0]), int(positions.shape[0])
    run = RunState(torch.ones(1, n_prompt, dtype=torch.long, device=positions.device))

    def mask_of(spec):
        m = chunk_mask(spec, run, start, T, 1, positions.device)
        return None if m is None else m[0]
    return mask_of
