"""Backends: where hook functions actually run.

- ``hf``: plain PyTorch hooks on a Hugging Face model (default, fastest).
- ``tlens``: TransformerLens 4's ``TransformerBridge`` hook points.
- ``nnsight``: interventions inside nnsight traces.

Each backend implements ``register(site, fn, tracker) -> remover``,
``forward(input_ids, attention_mask, position_ids)`` and ``step(...)`` for
generation with a KV cache, plus ``hook_count()`` and ``reset()``.
"""
from __future__ import annotations

BACKENDS = ("hf", "tlens", "nnsight")
