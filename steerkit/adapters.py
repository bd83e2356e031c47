"""Architecture adapters: the only place that knows how a model family is laid out.

An :class:`Adapter` maps the canonical, TransformerLens-style hook names onto a
Hugging Face model:

- ``blocks.{l}.hook_resid_pre``  input of decoder block ``l``
- ``blocks.{l}.hook_attn_out``   what the attention sub-layer adds to the residual
- ``blocks.{l}.hook_resid_mid``  ``resid_pre + attn_out`` (sequential blocks only)
- ``blocks.{l}.hook_mlp_out``    what the MLP sub-layer adds to the residual
- ``blocks.{l}.hook_resid_post`` output of block ``l``
- ``ln_final.hook_normalized``   output of the final norm

Each adapter names modules by attribute path (``"model.layers"``...), so the
core never branches on architecture. "What is added to the residual" matters
for models with post-sub-layer norms (Gemma 2/3, OLMo 2): there the attention
contribution is the output of ``post_attention_layernorm``, not of
``self_attn``, and the adapter says so.

Adapters are registered per ``config.model_type`` with :func:`register_adapter`;
:func:`adapter_for` picks one for a loaded model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .errors import UnsupportedArchitectureError


def get_module(root: nn.Module, path: str) -> nn.Module:
    """Resolve a dotted attribute path (``"model.layers.3.mlp"``) below ``root``."""
    mod: nn.Module = root
    for part in path.split("."):
        mod = mod[int(part)] if part.isdigit() else getattr(mod, part)  # type: ignore[index]
    return mod


@dataclass(frozen=True)
class Adapter:
    """How one model family is laid out (attribute paths relative to the CausalLM).

    ``attn_out``/``mlp_out`` are paths relative to a block whose *output* is the
    sub-layer's contribution to the residual stream (first element when the
    module returns a tuple). ``parallel`` marks blocks where attention and MLP
    read the same input (GPT-NeoX, GPT-J): there is no ``hook_resid_mid``.
    """

    name: str
    model_types: tuple[str, ...]
    blocks: str
    embed: str
    final_norm: str
    unembed: str
    attn_out: str
    mlp_out: str
    attn: str = "self_attn"
    # The first module of the block that receives the residual stream unchanged as its
    # input (the pre-attention norm, or the attention itself when there is none, as in
    # OLMo 2): hook_resid_mid reads ``resid_pre`` there.
    pre_attn_norm: str = "input_layernorm"
    # Blocks where attention and MLP read the same input (GPT-NeoX with
    # use_parallel_residual, GPT-J): no resid_mid exists. A bool, or the name of
    # the config flag that says so.
    parallel: bool | str = False
    # Config attribute names differ between families; the first one present wins.
    n_layers_attrs: tuple[str, ...] = ("num_hidden_layers", "n_layer")
    d_model_attrs: tuple[str, ...] = ("hidden_size", "n_embd")
    ctx_attrs: tuple[str, ...] = ("max_position_embeddings", "n_positions")
    extra: dict = field(default_factory=dict)

    # --- facts read from a model -------------------------------------------------
    def _cfg(self, config, attrs):
        for a in attrs:
            v = getattr(config, a, None)
            if v is not None:
                return v
        raise UnsupportedArchitectureError(
            f"adapter {self.name!r}: expected one of the config attributes {attrs}, "
            f"found none on {type(config).__name__}; register an adapter with the right names"
        )

    def text_config(self, model: nn.Module) -> Any:
        # a transformers PretrainedConfig (nn.Module.__getattr__ types attributes as Tensor | Module)
        cfg: Any = model.config
        return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg

    def n_layers(self, model: nn.Module) -> int:
        return int(len(self.block_list(model)))

    def d_model(self, model: nn.Module) -> int:
        return int(self._cfg(self.text_config(model), self.d_model_attrs))

    def is_parallel(self, model: nn.Module) -> bool:
        if isinstance(self.parallel, str):
            return bool(getattr(self.text_config(model), self.parallel, False))
        return bool(self.parallel)

    def pre_attn_norm_module(self, model: nn.Module, layer: int) -> nn.Module:
        return get_module(self.block(model, layer), self.pre_attn_norm)

    def n_ctx(self, model: nn.Module) -> int | None:
        try:
            return int(self._cfg(self.text_config(model), self.ctx_attrs))
        except UnsupportedArchitectureError:
            return None

    # --- modules -----------------------------------------------------------------
    def block_list(self, model: nn.Module) -> nn.ModuleList:
        return get_module(model, self.blocks)  # type: ignore[return-value]

    def block(self, model: nn.Module, layer: int) -> nn.Module:
        return self.block_list(model)[layer]

    def attn_out_module(self, model: nn.Module, layer: int) -> nn.Module:
        return get_module(self.block(model, layer), self.attn_out)

    def mlp_out_module(self, model: nn.Module, layer: int) -> nn.Module:
        return get_module(self.block(model, layer), self.mlp_out)

    def final_norm_module(self, model: nn.Module) -> nn.Module:
        return get_module(model, self.final_norm)

    def embed_module(self, model: nn.Module) -> nn.Module:
        return get_module(model, self.embed)

    def unembed_module(self, model: nn.Module) -> nn.Module:
        return get_module(model, self.unembed)

    def residual_writer(self, model: nn.Module, layer: int, which: str) -> nn.Linear:
        """The ``nn.Linear`` whose output the attention (``which="attn"``) or MLP (``"mlp"``) sub-layer
        of block ``layer`` adds to the residual stream: what weight orthogonalisation rewrites.

        Raises :class:`UnsupportedArchitectureError` where the sub-layer's output passes through a
        norm before the residual (Gemma 2/3, OLMo 2): a projection does not commute with that norm."""
        if which not in ("attn", "mlp"):
            raise UnsupportedArchitectureError(f"expected which='attn' or 'mlp', found {which!r}")
        d_model = self.d_model(model)
        mod = self.attn_out_module(model, layer) if which == "attn" else self.mlp_out_module(model, layer)
        cls = type(mod).__name__.lower()
        if "norm" in cls:
            raise UnsupportedArchitectureError(
                f"adapter {self.name!r}: the {which} output passes through {type(mod).__name__} before the "
                "residual stream; a projection does not commute with that norm, so an ablation cannot be "
                "folded into the weights. Use run-time ablation instead")
        if isinstance(mod, nn.Dropout) or "dropout" in cls:  # Phi-3 / GPT-NeoX: the writer sits in attn / mlp
            mod = getattr(self.block(model, layer), self.attn if which == "attn" else "mlp")
        return _output_linear(mod, d_model)


_OUT_NAMES = ("o_proj", "down_proj", "out_proj", "dense", "c_proj", "fc2", "dense_4h_to_h")


def _output_linear(module: nn.Module, d_model: int) -> nn.Linear:
    if isinstance(module, nn.Linear) and module.out_features == d_model:
        return module
    for n in _OUT_NAMES:
        m = getattr(module, n, None)
        if isinstance(m, nn.Linear) and m.out_features == d_model:
            return m
    lin = [m for m in module.modules() if isinstance(m, nn.Linear) and m.out_features == d_model]
    if not lin:
        raise UnsupportedArchitectureError(f"expected a Linear layer writing d_model={d_model} features in "
                                           f"{type(module).__name__}, found none")
    return lin[-1]


# vLLM's text models keep their decoder blocks at ``model.layers`` (Llama, Mistral, Qwen2/3, Gemma,
# Phi-3, OLMo, Mixtral...), or one level down in multimodal wrappers; each block has ``self_attn`` and
# (dense or MoE) ``mlp``; blocks of other pipeline ranks are placeholders without them.
_VLLM_BLOCK_PATHS = ("model", "language_model.model", "model.language_model")


@dataclass(frozen=True)
class VLLMLayout:
    """The modules of a vLLM decoder model that steering hooks: blocks (absolute indices; ``None``
    for a block another pipeline rank holds), each block's attention and MLP, and the embedding."""

    blocks: tuple
    attn: tuple
    mlp: tuple
    embed: object


def vllm_layout(model: nn.Module) -> VLLMLayout:
    """Where a vLLM model keeps what :class:`VLLMLayout` names (the plugin asks this, nothing else)."""
    for path in _VLLM_BLOCK_PATHS:
        m: object = model
        for part in path.split("."):
            m = getattr(m, part, None)
            if m is None:
                break
        if m is not None and hasattr(m, "layers"):
            blocks = tuple(b if hasattr(b, "self_attn") else None for b in m.layers)
            return VLLMLayout(blocks=blocks,
                              attn=tuple(None if b is None else b.self_attn for b in blocks),
                              mlp=tuple(None if b is None else getattr(b, "mlp", None) for b in blocks),
                              embed=getattr(m, "embed_tokens", None))
    raise UnsupportedArchitectureError(
        f"expected a vLLM decoder model with its blocks at one of {_VLLM_BLOCK_PATHS} (.layers), found "
        f"{type(model).__name__}; add its layout to steerkit.adapters.vllm_layout")


_REGISTRY: dict[str, Adapter] = {}


def register_adapter(adapter: Adapter) -> Adapter:
    """Register ``adapter`` for each of its ``model_types`` (later registrations win)."""
    for mt in adapter.model_types:
        _REGISTRY[mt] = adapter
    return adapter


def registered_model_types() -> list[str]:
    return sorted(_REGISTRY)


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter for a Hugging Face causal LM, chosen by ``config.model_type``."""
    cfg = getattr(model, "config", None)
    mt = getattr(cfg, "model_type", None)
    if mt in _REGISTRY:
        return _REGISTRY[mt]
    text = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else None
    if text is not None and getattr(text, "model_type", None) in _REGISTRY:
        return _REGISTRY[text.model_type]
    raise UnsupportedArchitectureError(
        f"expected a model whose config.model_type is one of {registered_model_types()}, "
        f"found {mt!r} ({type(model).__name__}); register an Adapter for it with "
        "steerkit.adapters.register_adapter(Adapter(...))"
    )


# Every layout below was checked against the transformers 5.x modeling code of its family
# (``*DecoderLayer.forward``) and is tested on a tiny random-weight model in
# tests/test_adapters.py.

# Llama-like decoders: model.layers[i].{input_layernorm, self_attn, post_attention_layernorm, mlp},
# model.norm, lm_head; the block computes h += self_attn(norm(h)); h += mlp(norm(h)).
# Gemma scales the embeddings inside GemmaModel.forward, before block 0: hook_resid_pre of
# block 0 sees the scaled embeddings. Qwen3's q/k norms and SmolLM3's NoPE layers live inside
# self_attn and change nothing here.
def _llama_like(name: str, model_types: tuple[str, ...], *, attn_out: str = "self_attn", mlp_out: str = "mlp",
                blocks: str = "model.layers", embed: str = "model.embed_tokens", final_norm: str = "model.norm",
                pre_attn_norm: str = "input_layernorm") -> Adapter:
    """An adapter with the Llama layout, some of its module paths replaced."""
    return Adapter(name=name, model_types=model_types, blocks=blocks, embed=embed, final_norm=final_norm,
                   unembed="lm_head", attn_out=attn_out, mlp_out=mlp_out, pre_attn_norm=pre_attn_norm)


register_adapter(_llama_like("llama", ("llama", "mistral", "qwen2", "qwen3", "gemma", "olmo", "smollm3")))
# Not Granite: its block adds ``residual_multiplier * self_attn(...)``, a product no module
# outputs, so hook_attn_out/hook_mlp_out (and resid_mid edits) would be off by that factor.

# Phi-3: Llama layout, but the residual receives resid_attn_dropout(self_attn(...)) and
# resid_mlp_dropout(mlp(...)); hooking the dropouts keeps resid_pre + attn_out + mlp_out ==
# resid_post exact in train mode too (in eval they are the identity).
register_adapter(_llama_like("phi3", ("phi3",), attn_out="resid_attn_dropout", mlp_out="resid_mlp_dropout"))

# Post-sub-layer norms: the residual receives the *normed* sub-layer output.
# Gemma 2 / Gemma 3 text: h += post_attention_layernorm(self_attn(input_layernorm(h)));
# h += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))). Gemma 3 scales the
# embeddings inside its embedding module (Gemma3TextScaledWordEmbedding).
_POST_ATTN, _POST_MLP = "post_attention_layernorm", "post_feedforward_layernorm"
register_adapter(_llama_like("gemma2", ("gemma2", "gemma3_text"), attn_out=_POST_ATTN, mlp_out=_POST_MLP))
# Gemma 3 multimodal (Gemma3ForConditionalGeneration, config.model_type "gemma3"): the same
# decoder, one level down at model.language_model; lm_head stays at the top.
register_adapter(_llama_like("gemma3", ("gemma3",), attn_out=_POST_ATTN, mlp_out=_POST_MLP,
                             blocks="model.language_model.layers", embed="model.language_model.embed_tokens",
                             final_norm="model.language_model.norm"))
# OLMo 2 / OLMo 3: h += post_attention_layernorm(self_attn(h)); h += post_feedforward_layernorm(mlp(h)).
# There is no pre-attention norm: self_attn itself receives the residual.
register_adapter(_llama_like("olmo2", ("olmo2", "olmo3"), attn_out=_POST_ATTN, mlp_out=_POST_MLP,
                             pre_attn_norm="self_attn"))

# GPT-2: transformer.h[i] computes h += attn(ln_1(h))[0]; h += mlp(ln_2(h)) (the attention
# returns (output, weights) and applies resid_dropout itself; the MLP applies its dropout).
register_adapter(Adapter(name="gpt2", model_types=("gpt2",), blocks="transformer.h", embed="transformer.wte",
                         final_norm="transformer.ln_f", unembed="lm_head", attn_out="attn", mlp_out="mlp",
                         attn="attn", pre_attn_norm="ln_1"))
# GPT-NeoX (Pythia): a = post_attention_dropout(attention(input_layernorm(h))[0]);
# m = post_mlp_dropout(mlp(post_attention_layernorm(.))); with use_parallel_residual (the
# default) h + a + m, both sub-layers reading h, so there is no resid_mid; otherwise sequential.
register_adapter(Adapter(name="gpt_neox", model_types=("gpt_neox",), blocks="gpt_neox.layers",
                         embed="gpt_neox.embed_in", final_norm="gpt_neox.final_layer_norm",
                         unembed="embed_out", attn_out="post_attention_dropout", mlp_out="post_mlp_dropout",
                         attn="attention", parallel="use_parallel_residual"))
