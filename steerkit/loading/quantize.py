"""Weight-only quantisation of a loaded model (torchao), for recording and steering quantised models.

``quantize(model, "int8")`` replaces the weight of every ``nn.Linear`` inside the decoder blocks with a
torchao quantised tensor: ``"int8"`` is torchao's ``Int8WeightOnlyConfig`` (one scale per output
channel), ``"int4"`` its ``IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))``
(one scale per 32 inputs). The embedding and the unembedding stay in the model's dtype. Activations stay
in the model's dtype too: every hook, recording and steering sees (and edits) the de-quantised
activations exactly as on the float model, with no change anywhere else in steerkit.

Why torchao: it is maintained by the PyTorch team, installs from PyPI as one wheel, and its
weight-only tensors run on the CPU build of torch (they de-quantise inside each matmul).
bitsandbytes' int8/nf4 layers target CUDA first; torchao's own int4 packing formats need a GPU or
the ``mslk`` kernels, so ``"int4"`` uses the unpacked int4 layout, which runs anywhere.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from steerkit.errors import InputError
from steerkit.imports import quiet_optional_imports

SCHEMES = ("int8", "int4")


def _config(scheme: str) -> Any:
    try:
        with quiet_optional_imports():
            from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig
            from torchao.quantization.granularity import PerGroup
    except ImportError as e:
        raise InputError(f"expected torchao to quantise weights ({scheme}), found it is not installed: "
                         "pip install 'steerkit[quant]'") from e
    if scheme == "int8":
        return Int8WeightOnlyConfig()
    return IntxWeightOnlyConfig(weight_dtype=getattr(torch, "int4"), granularity=PerGroup(32))  # noqa: B009


def block_linears(blocks: nn.Module) -> Callable[[nn.Module, str], bool]:
    """The filter torchao's ``quantize_`` takes: the ``nn.Linear`` modules inside ``blocks``.

    Examples:
        >>> keep = block_linears(tiny.hf_model.model.layers)
        >>> keep(tiny.hf_model.model.layers[0].self_attn.q_proj, "q_proj"), keep(tiny.hf_model.lm_head, "lm_head")
        (True, False)
    """
    inside = {id(m) for m in blocks.modules()}

    def keep(module: nn.Module, fqn: str) -> bool:
        return isinstance(module, nn.Linear) and id(module) in inside
    return keep


def quantize(model: nn.Module, scheme: str, blocks: nn.Module) -> nn.Module:
    """Quantise the weights of the ``nn.Linear`` layers inside ``blocks`` (a module of ``model``), in
    place; returns ``model``.

    Examples:
        >>> import copy
        >>> model = copy.deepcopy(tiny.hf_model)
        >>> _ = quantize(model, "int8", model.model.layers)
        >>> scheme_of(model), type(model.model.layers[0].mlp.down_proj.weight).__name__
        ('int8', 'Int8Tensor')
        >>> q = steerkit.wrap(model, tiny.tokenizer)  # records and steers like the float model
        >>> q.quantization, tuple(q.forward("hi", chat=False).shape[-1:])
        ('int8', (49152,))

        ``steerkit.load_model(quantize="int4")`` loads and quantises in one call.
    """
    if scheme not in SCHEMES:
        raise InputError(f"expected a quantisation scheme in {SCHEMES}, found {scheme!r}")
    cfg = _config(scheme)
    from torchao.quantization import quantize_
    quantize_(model, cfg, filter_fn=block_linears(blocks))
    return model


def scheme_of(model: nn.Module) -> str | None:
    """The weight-only scheme of a model :func:`quantize` quantised (``None``: not quantised), read from
    its weights.

    Examples:
        >>> import copy
        >>> model = copy.deepcopy(tiny.hf_model)
        >>> _ = quantize(model, "int4", model.model.layers)
        >>> scheme_of(tiny.hf_model), scheme_of(model)
        (None, 'int4')
    """
    for m in model.modules():
        if isinstance(m, nn.Linear):
            name = type(m.weight).__name__
            if name == "Int8Tensor":
                return "int8"
            if name.startswith("IntxUnpacked"):
                return "int4"
    return None
