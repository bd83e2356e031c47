"""The Attention page's computation: :func:`attention_patterns` -> :class:`AttentionPatterns`, every
head's ``attn.hook_pattern`` at a layer for one prompt."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from steerkit.errors import InputError
from steerkit.hooks.names import layer_names

from ..data import MAX_ATTN_CELLS, MAX_ATTN_TOKENS, check_int
from .common import one_prompt

if TYPE_CHECKING:
    from steerkit.model import SteerModel


@dataclass
class AttentionPatterns:
    """``blocks.{layer}.attn.hook_pattern`` of one prompt: ``pattern[h, q, k]`` is how much query
    position ``q`` of head ``h`` attends to key position ``k`` (rows sum to 1; zero above the diagonal)."""

    prompt: str
    layer: int
    tokens: list[str]
    pattern: np.ndarray
    model_name: str = ""

    @property
    def n_heads(self) -> int:
        return int(self.pattern.shape[0])


def attention_patterns(sm: SteerModel, prompt: str, layer: int) -> AttentionPatterns:
    """Every head's attention pattern at ``layer`` for ``prompt`` (recorded at ``attn.hook_pattern``)."""
    layer = check_int(layer, "a layer", 0, sm.n_layers - 1)
    toks, tokens = one_prompt(sm, prompt, "the prompt", MAX_ATTN_TOKENS)
    n_heads = int(sm.facts.n_heads)
    if n_heads * len(tokens) ** 2 > MAX_ATTN_CELLS:
        raise InputError(f"expected at most {MAX_ATTN_CELLS} attention weights ({n_heads} heads x query x key), "
                         f"found {n_heads * len(tokens) ** 2}; shorten the prompt")
    site = layer_names(layer, "attn.hook_pattern")[0]
    with sm.record([site], positions="all") as cache:
        sm.forward(toks)
    pattern = cache[site][0].float().cpu().numpy()  # [heads, q, k]
    return AttentionPatterns(prompt=prompt, layer=layer, tokens=tokens, pattern=pattern, model_name=sm.name)


