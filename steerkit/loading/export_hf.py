"""Export a loaded model as a plain Hugging Face folder that other runtimes (vLLM...) can load.

``load_model()`` de-quantizes the embedded GGUF with transformers' GGUF loader. The
float folder steerkit caches for itself is *not* loadable elsewhere as is: its
``config.json`` still carries the GGUF ``quantization_config`` (vLLM then looks
for a GGUF file), it has no ``architectures`` entry (vLLM picks the model class
from it), and the tied embedding is stored under ``lm_head.weight`` only, which
loaders that skip ``lm_head`` for tied models never see.

:func:`export_hf` writes, from the model currently in memory:

- ``model.safetensors`` written with ``safetensors.torch.save_file``; every tensor
  is contiguous and owns its memory. When the output embedding is tied to the
  input embedding, the tensor is stored once, as the *input* embedding
  (``model.embed_tokens.weight`` for Llama), and ``lm_head.weight`` is left out:
  both HF (``tie_word_embeddings``) and vLLM re-tie it at load time;
- ``config.json`` without ``quantization_config``, with ``architectures`` and the
  saved ``dtype``; ``generation_config.json`` when the model has one;
- the tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, chat template);
- ``steerkit_export.json``: where the model came from, its shape and its model fingerprint
  (so a server can check artifacts against the folder without the source model).

The folder is written to a temporary sibling of ``out_dir`` and renamed into
place, so an interrupted export never leaves a half folder behind. Weights are
exported as they are in memory: hook-based edits (``sm.edit``) are not part of
the weights and are not exported.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import json
import os
from pathlib import Path

import torch

from steerkit.errors import InputError
from steerkit.storage.files import atomic_folder
from steerkit.loading.fingerprint import model_fingerprint
from steerkit.version import __version__
from safetensors.torch import save_file

if TYPE_CHECKING:
    from steerkit.model import SteerModel

__all__ = ["export_hf"]


def _named_weight(model, module) -> str | None:
    """The state-dict key of ``module.weight`` inside ``model``, or ``None``."""
    if module is None or getattr(module, "weight", None) is None:
        return None
    for name, mod in model.named_modules():
        if mod is module:
            return f"{name}.weight" if name else "weight"
    return None


def _tensors_to_save(model, dtype: torch.dtype | None) -> tuple[dict[str, torch.Tensor], bool]:
    """``(tensors, tied)``: the state dict as independent contiguous CPU tensors, tied output dropped."""
    state = model.state_dict()
    in_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    in_key, out_key = _named_weight(model, in_emb), _named_weight(model, out_emb)
    tied = False
    if in_key and out_key and in_key != out_key and in_emb is not None and out_emb is not None:
        tied = bool(in_emb.weight is out_emb.weight or (in_emb.weight.data_ptr() == out_emb.weight.data_ptr()
                                                        and in_emb.weight.shape == out_emb.weight.shape))
    if tied and not bool(getattr(model.config, "tie_word_embeddings", True)):
        raise InputError(
            "expected the config's tie_word_embeddings to be true for a model whose output embedding is its "
            "input embedding, found false; loaders would look for a separate lm_head.weight that is not saved. "
            "Set model.config.tie_word_embeddings = True or untie the weights before exporting")
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        if tied and key == out_key:
            continue
        if t.device.type == "meta":
            raise InputError(f"expected every weight in memory, found {key!r} on the meta device "
                             "(an offloaded or lazily loaded model); load it fully before exporting")
        t = t.detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[key] = t.contiguous().clone()  # owns its memory: save_file refuses shared storage
    if tied and in_key not in out:
        raise InputError(f"expected the input embedding {in_key!r} in the state dict, found it missing")
    return out, tied


def export_hf(sm: "SteerModel", out_dir: str | os.PathLike, *, dtype: torch.dtype | str | None = None,
              overwrite: bool = False, extra_files: dict[str, str] | None = None) -> Path:
    """Write ``sm``'s model and tokenizer as a plain HF folder at ``out_dir``; return its path.

    ``sm``: a :class:`~steerkit.SteerModel` (its ``hf_model`` is exported).
    ``dtype``: cast floating weights (``"bfloat16"``, ``torch.float16``...); ``None`` keeps
    the model's dtype. ``overwrite``: replace an existing ``out_dir``; without it an
    existing folder is an error. ``extra_files``: ``{file name: text}`` written into the folder
    with the rest (e.g. how the weights were edited).

    The result loads with ``AutoModelForCausalLM.from_pretrained(out_dir)`` and with
    ``vllm.LLM(model=out_dir)``.

    Examples:
        >>> folder = export_hf(tiny, tmp_dir / "tiny", extra_files={"EDITS.md": "no edits"})
        >>> (folder / "config.json").is_file(), (folder / "EDITS.md").read_text()
        (True, 'no edits')
        >>> steerkit.load_model(folder).fingerprint() == tiny.fingerprint()
        True
    """
    model = getattr(sm, "hf_model", None)
    tokenizer = getattr(sm, "tokenizer", None)
    if model is None or tokenizer is None or not hasattr(model, "state_dict") or not hasattr(model, "config"):
        raise InputError(f"expected a SteerModel (from steerkit.load_model), found {type(sm).__name__}; "
                         "wrap a transformers model and tokenizer with steerkit.wrap(model, tokenizer) first")
    cast: torch.dtype | None
    if isinstance(dtype, str):
        named = getattr(torch, dtype, None)
        if not isinstance(named, torch.dtype):
            raise InputError(f"expected dtype to name a torch dtype such as 'float32' or 'bfloat16', "
                             f"found {dtype!r}")
        cast = named
    else:
        cast = dtype
    if cast is not None and not cast.is_floating_point:
        raise InputError(f"expected a floating dtype, found {cast}")
    out_dir = Path(out_dir).expanduser().resolve()
    if out_dir.exists():
        if not out_dir.is_dir():
            raise InputError(f"expected out_dir to be a folder path, found a file at {out_dir}; "
                             "choose another path")
        if not overwrite:
            raise InputError(f"expected out_dir not to exist, found {out_dir}; "
                             "pass overwrite=True to replace it or choose another path")


    tensors, tied = _tensors_to_save(model, cast)
    saved_dtype = cast or next(iter(t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)

    config = json.loads(model.config.to_json_string(use_diff=True))  # what save_pretrained writes
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = str(saved_dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    if tied:
        config["tie_word_embeddings"] = True

    with atomic_folder(out_dir, if_exists="replace") as tmp:  # the old export stays if this one fails
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            gen.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "steerkit_export.json").write_text(json.dumps({
            "steerkit_version": __version__,
            "name": getattr(sm, "name", None),
            "source_gguf": str(sm.source_gguf) if getattr(sm, "source_gguf", None) else None,
            "architecture": type(model).__name__,
            "n_layers": getattr(sm, "n_layers", None),
            "d_model": getattr(sm, "d_model", None),
            "dtype": config["dtype"],
            "tied_embeddings": tied,
            # what artifacts made on ``sm`` carry: lets a server check them against this folder
            "model_fingerprint": model_fingerprint(model),
        }, indent=1) + "\n")
        for fname, text in (extra_files or {}).items():
            (tmp / fname).write_text(text)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)  # safetensors writes 0600 files
    return out_dir
