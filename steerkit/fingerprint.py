"""Model fingerprints: a short hash that says "the same weights" across processes.

The hash covers the config (as sorted JSON, without paths and dtype) and a few
weight tensors (the embedding, the first and last block's first parameter),
each cast to float32 so that the same weights hash the same whatever dtype the
model was loaded in. It is cheap: no full pass over the weights.
"""
from __future__ import annotations

import hashlib
import json

import torch
from torch import nn


def model_fingerprint(model: nn.Module) -> str:
    cfg = model.config.to_dict() if hasattr(model, "config") else {}
    for k in ("_name_or_path", "torch_dtype", "dtype", "transformers_version", "_commit_hash",
              "architectures", "_attn_implementation_autoset", "_attn_implementation"):
        cfg.pop(k, None)
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode())
    params = list(model.named_parameters())
    picks = [params[0], params[len(params) // 2], params[-1]] if params else []
    for name, p in picks:
        t = p.detach().float().flatten()[:4096].cpu().contiguous()
        h.update(name.encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]
