"""Model fingerprints: a short, stable hash of a model's config and a few of its weight tensors.

Artifacts record the fingerprint of the model they were made on (their provenance), and steering
checks it against the model it is applied to. The tensors are cast to bfloat16 before hashing, so
float32 and bfloat16 loads of one model agree; only the first and last 8192 values of each hashed
tensor are read, so it is cheap enough to compute on every load. Which tensors is the adapters' word
(:func:`steerkit.loading.adapters.fingerprint_keys`, by parameter name, the same for every family).
:func:`folder_fingerprint` gives the same value for a model folder without loading the model (a server's front
end uses it).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from steerkit.errors import ModelNotFoundError
from steerkit.loading.adapters import fingerprint_keys
from transformers import AutoConfig

__all__ = ["model_fingerprint", "folder_fingerprint"]

# Config keys that do not change what the network computes.
_VOLATILE_CONFIG_KEYS = {
    "_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash",
    "_attn_implementation", "_attn_implementation_autoset", "attn_implementation",
    "use_cache", "output_attentions", "output_hidden_states", "return_dict",
    "_attn_implementation_internal", "architectures", "name_or_path",
}


def _unwrap(model: Any) -> Any:
    """Accept a SteerModel-like wrapper (with ``.model``) or a bare HF model."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "config") and not hasattr(model, "config"):
        return inner
    return model


def _config_dict(hf_model: Any) -> dict:
    cfg = getattr(hf_model, "config", None)
    if cfg is None:
        return {}
    d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))
    return {k: v for k, v in d.items() if k not in _VOLATILE_CONFIG_KEYS}


def _fingerprint_tensors(hf_model: Any) -> list[tuple[str, torch.Tensor]]:
    named = dict(hf_model.named_parameters())
    return [(k, _materialized(hf_model, k, named[k])) for k in fingerprint_keys(list(named))]


def _materialized(hf_model: Any, name: str, p: torch.Tensor) -> torch.Tensor:
    """``p``'s values: a weight that accelerate offloaded (a meta tensor) is read from the offload map
    of its module's hook."""
    if p.device.type != "meta":
        return p
    path, local = name.rsplit(".", 1) if "." in name else ("", name)
    hook = getattr(hf_model.get_submodule(path), "_hf_hook", None)
    weights = getattr(hook, "weights_map", None)
    if weights is None:
        raise ModelNotFoundError(f"expected the values of {name!r} to fingerprint the model, found a meta tensor "
                                 "without an offload map; load the model with its weights (or through "
                                 "steerkit.load_model(..., device_map=...))")
    return weights[local]


@torch.no_grad()
def model_fingerprint(model: Any) -> str:
    """A short, stable hash of a model's config and a few of its weight tensors.

    Accepts a Hugging Face ``PreTrainedModel`` or anything with ``.model`` being
    one (a ``SteerModel``).  Returns ``"sk1:<24 hex digits>"``.

    Examples:
        >>> fp = model_fingerprint(tiny)
        >>> fp.startswith("sk1:"), len(fp), fp == model_fingerprint(tiny.hf_model) == tiny.fingerprint()
        (True, 28, True)
        >>> fp == model_fingerprint(sm)
        False
    """
    hf = _unwrap(model)
    return _fingerprint_of(_config_dict(hf), _fingerprint_tensors(hf))


def folder_fingerprint(folder: Any) -> str:
    """:func:`model_fingerprint` of a Hugging Face model folder, without loading the model.

    A folder written by ``steerkit.loading.export_hf`` records the fingerprint of the model it was exported
    from (``steerkit_export.json``), which is what artifacts made on that model carry. Otherwise the
    config is read with ``transformers.AutoConfig`` and only the hashed tensors are read from the
    safetensors files, so this equals ``model_fingerprint(load_model(folder))``.

    Examples:
        >>> from steerkit.loading.export_hf import export_hf
        >>> folder = export_hf(tiny, tmp_dir / "tiny")
        >>> folder_fingerprint(folder) == model_fingerprint(tiny)  # recorded by the export
        True
        >>> (folder / "steerkit_export.json").unlink()
        >>> folder_fingerprint(folder) == model_fingerprint(tiny)  # computed from config and weights
        True
    """
    folder = Path(folder)
    meta = folder / "steerkit_export.json"
    if meta.is_file():
        fp = json.loads(meta.read_text(encoding="utf-8")).get("model_fingerprint")
        if fp:
            return str(fp)

    cfg = AutoConfig.from_pretrained(str(folder), local_files_only=True)

    class _Cfg:
        config = cfg

    where: dict[str, Any] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                where.setdefault(k, f)
    if not where:
        raise ModelNotFoundError(f"expected *.safetensors weights in {folder}, found none; point at the "
                                 "folder holding the model's safetensors files")
    tensors = []
    for k in fingerprint_keys(list(where)):
        with safe_open(str(where[k]), framework="pt") as fh:
            tensors.append((k, fh.get_tensor(k)))
    return _fingerprint_of(_config_dict(_Cfg), tensors)


def _fingerprint_of(config: dict, tensors: list) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, p in tensors:
        if type(p) not in (torch.Tensor, torch.nn.Parameter) and hasattr(p, "dequantize"):
            p = p.dequantize()  # a quantised weight (torchao): hash its values
        flat = p.detach().reshape(-1)
        sample = torch.cat([flat[:8192], flat[-8192:]]) if flat.numel() > 16384 else flat
        b = sample.to("cpu", torch.bfloat16).view(torch.int16).numpy().tobytes()
        h.update(name.encode())
        h.update(str(tuple(p.shape)).encode())
        h.update(b)
    return "sk1:" + h.hexdigest()[:24]
