"""Architecture adapters: the only place that knows how a model family is laid out.

An :class:`Adapter` maps the canonical, TransformerLens-style hook names onto a
Hugging Face model:

- ``blocks.{l}.hook_resid_pre``  input of decoder block ``l``
- ``blocks.{l}.hook_attn_out``   what the attention sub-layer adds to the residual
- ``blocks.{l}.hook_resid_mid``  ``resid_pre + attn_out`` (sequential blocks only)
- ``blocks.{l}.hook_mlp_out``    what the MLP sub-layer adds to the residual
- ``blocks.{l}.hook_resid_post`` output of block ``l``
- ``ln_final.hook_scale``        the final norm's scale, ``[batch, pos, 1]``
- ``ln_final.hook_normalized``   the final norm's normalised input, before its weight and bias
- ``ln_final.hook_out``          output of the final norm
- ``blocks.{l}.attn.hook_q|k|v|z|attn_scores|pattern``, ``blocks.{l}.mlp.hook_in|pre|post`` and
  ``blocks.{l}.ln1|ln2.hook_scale|hook_normalized``: the component hooks, read from the modules an
  :class:`AttnLayout` / :class:`MLPLayout` names (the projections, or one fused projection and how
  its output is laid out; ``mlp.hook_in`` is the MLP module's input) and the block's two norms
- ``blocks.{l}.mlp.hook_router_logits|hook_expert_weights|hook_expert_indices|hook_expert_out``: the
  mixture-of-experts hooks of a sparse block, read from the router and the fused experts a
  :class:`MoELayout` names; the layout also holds the family's routing rule (:meth:`MoELayout.route`).
  A sparse block has no dense MLP neurons: ``mlp.hook_pre`` / ``hook_post`` are refused there (per
  layer, for families that mix dense and sparse blocks, as Qwen2-MoE's ``mlp_only_layers`` and
  ``decoder_sparse_step`` do)

Each adapter names modules by attribute path (``"model.layers"``...), so the
core never branches on architecture. "What is added to the residual" matters
for models with post-sub-layer norms (Gemma 2/3, OLMo 2): there the attention
contribution is the output of ``post_attention_layernorm``, not of
``self_attn``, and the adapter says so.

The final norm's hooks need what the norm computes, which the adapter's
:class:`FinalNorm` says: RMSNorm or LayerNorm, where its eps lives and its
effective weight (``weight``, ``1 + weight`` on Gemma, none on OLMo) and bias.

Adapters are registered per ``config.model_type`` with :func:`register_adapter`;
:func:`adapter_for` picks one for a loaded model.

The weights the model fingerprint hashes (:func:`fingerprint_keys`) and the module layout of a model vLLM
serves (:func:`vllm_layout`, :func:`vllm_sites`) are named here too.

Why one module: it is the one place that knows module paths (``tests/core/test_adapter_paths.py`` walks the
rest of the code for them), so every family's layout, a sparse block's fused experts, the fingerprinted weights
and vLLM's layout stay side by side, where a new family is added in one reading.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch
from jaxtyping import Float
from torch import Tensor, nn

from steerkit.errors import UnsupportedArchitectureError
from steerkit.hooks.names import ATTN_HOOKS, MLP_HOOKS, MLP_IN, MOE_HOOKS, NORM_HOOKS


def get_module(root: nn.Module, path: str) -> nn.Module:
    """Resolve a dotted attribute path (``"model.layers.3.mlp"``) below ``root``.

    Examples:
        >>> get_module(tiny.hf_model, "model.layers.2.mlp.down_proj")
        Linear(in_features=128, out_features=64, bias=False)
    """
    mod: nn.Module = root
    for part in path.split("."):
        mod = mod[int(part)] if part.isdigit() else getattr(mod, part)  # type: ignore[index]
    return mod


@dataclass(frozen=True)
class FinalNorm:
    """What a family's final norm computes, as its module computes it (statistics in float32).

    ``kind="rms"``: ``n = x * rsqrt(mean(x^2) + eps)``, scale ``sqrt(mean(x^2) + eps)``;
    ``kind="layer"``: ``n = (x - mean) / sqrt(var + eps)`` (biased variance), scale ``sqrt(var + eps)``.
    The output is ``n * w_eff + bias`` with ``w_eff = weight_offset + module.<weight>`` (no weight:
    ``w_eff = 1``) and the bias only where ``bias`` names one. ``eps_attr`` names the module
    attribute holding eps; ``None`` means the fixed ``eps``.

    Examples:
        >>> norm = tiny.adapter.norm
        >>> norm.kind, norm.eps_attr, norm.weight_offset
        ('rms', 'variance_epsilon', 0.0)
        >>> n, scale = norm.normalize(tiny.adapter.final_norm_module(tiny.hf_model), torch.full((2, 64), 3.0))
        >>> round(float(n[0, 0]), 3), round(float(scale[0, 0]), 3)
        (1.0, 3.0)
    """

    kind: Literal["rms", "layer"] = "rms"
    eps_attr: Optional[str] = "variance_epsilon"
    eps: float = 1e-5
    weight: Optional[str] = "weight"
    weight_offset: float = 0.0
    bias: Optional[str] = None

    def module_eps(self, module: nn.Module) -> float:
        if self.eps_attr is None:
            return self.eps
        eps = getattr(module, self.eps_attr, None)
        if eps is None:
            raise UnsupportedArchitectureError(
                f"expected the final norm {type(module).__name__} to have the eps attribute {self.eps_attr!r}, "
                "found none; register the adapter with the FinalNorm its module has")
        return float(eps)

    def normalize(self, module: nn.Module, x: Float[Tensor, "*rows d_model"]
                  ) -> tuple[Float[Tensor, "*rows d_model"], Float[Tensor, "*rows 1"]]:
        """``(normalized, scale)`` of the norm's input ``x``, both float32."""
        h = x.float()
        if self.kind == "layer":
            h = h - h.mean(-1, keepdim=True)
        var = h.pow(2).mean(-1, keepdim=True) + self.module_eps(module)
        return h * torch.rsqrt(var), var.sqrt()

    def effective_weight(self, module: nn.Module) -> Optional[Float[Tensor, " d_model"]]:
        """``w_eff`` in float32 (``None``: the norm has no weight, ``w_eff = 1``)."""
        if self.weight is None:
            return None
        w = getattr(module, self.weight).float()
        return w + self.weight_offset if self.weight_offset else w

    def bias_of(self, module: nn.Module) -> Optional[Float[Tensor, " d_model"]]:
        """The bias in float32 (``None``: none)."""
        b = None if self.bias is None else getattr(module, self.bias, None)
        return None if b is None else b.float()


#: Llama-style RMSNorm: ``weight * n``, eps in ``variance_epsilon``
RMS_NORM = FinalNorm()
#: Gemma / Gemma 2 / Gemma 3 RMSNorm: ``(1 + weight) * n``, eps in ``eps``
GEMMA_RMS_NORM = FinalNorm(eps_attr="eps", weight_offset=1.0)
#: ``nn.LayerNorm`` (GPT-2, GPT-NeoX): ``weight * n + bias``
LAYER_NORM = FinalNorm(kind="layer", eps_attr="eps", bias="bias")
#: OLMo's LayerNorm without weight or bias (``F.layer_norm(..., eps=1e-5)``)
OLMO_LAYER_NORM = FinalNorm(kind="layer", eps_attr=None, eps=1e-5, weight=None)


@dataclass(frozen=True)
class AttnLayout:
    """Where an attention module keeps its projections (paths relative to the attention module).

    ``q`` / ``k`` / ``v``: separate projections whose outputs are ``[.., heads * d_head]``; or ``qkv``:
    one fused projection laid out as ``"concat"`` (``[q | k | v]``, widths ``n_heads * d_head``,
    ``n_kv * d_head``, ``n_kv * d_head``: GPT-2, Phi-3) or ``"per_head"`` (``[heads, 3 * d_head]``
    with ``[q_h | k_h | v_h]`` per head: GPT-NeoX). ``o``: the output projection, whose input is
    ``hook_z``.

    Examples:
        >>> lay = tiny.adapter.attn_layout
        >>> lay.q, lay.k, lay.v, lay.o, lay.qkv
        ('q_proj', 'k_proj', 'v_proj', 'o_proj', None)
        >>> AttnLayout(q=None, k=None, v=None, qkv="qkv_proj").qkv_layout  # Phi-3's fused projection
        'concat'
    """

    q: Optional[str] = "q_proj"
    k: Optional[str] = "k_proj"
    v: Optional[str] = "v_proj"
    o: str = "o_proj"
    qkv: Optional[str] = None
    qkv_layout: Literal["concat", "per_head"] = "concat"


@dataclass(frozen=True)
class MLPLayout:
    """Where an MLP keeps its neurons (paths relative to the block): ``module`` the MLP, ``pre`` (relative
    to it) the projection whose output is the gate's pre-activation (``pre_half``: the first half of a
    fused ``[gate | up]`` output, Phi-3), ``post`` the down projection, whose input is ``hook_post``.

    Examples:
        >>> tiny.adapter.mlp_layout
        MLPLayout(module='mlp', pre='gate_proj', post='down_proj', pre_half=False)
    """

    module: str = "mlp"
    pre: str = "gate_proj"
    post: str = "down_proj"
    pre_half: bool = False


LLAMA_ATTN = AttnLayout()
LLAMA_MLP = MLPLayout()


@dataclass(frozen=True)
class MoELayout:
    """A sparse mixture-of-experts block (paths relative to the MoE block, which sits at
    ``MLPLayout.module``) and the family's routing rule.

    ``router``: the module returning ``(router_logits [tokens, n_experts], top-k weights, top-k
    indices)``; ``experts``: the fused experts (3-D ``gate_up_proj`` / ``down_proj``), called with the
    block's flattened input, the indices and the weights; ``shared`` / ``shared_gate``: a shared expert
    every token uses and the linear gate whose sigmoid scales it (Qwen2-MoE), ``None`` where there is
    none. ``renormalize``: whether the top-k probabilities are divided by their sum (a bool, or the
    config flag that says so, ``norm_topk_prob``); ``weights_in_logits_dtype``: whether the weights are
    cast back to the logits' dtype (Qwen-MoE, OLMoE) or stay float32 (Mixtral).

    Examples:
        >>> moe = MoELayout(renormalize=True)
        >>> weights, idx = moe.route(torch.tensor([[2.0, 0.0, 1.0, -1.0]]), top_k=2, renormalize=True)
        >>> idx.tolist(), round(float(weights.sum()), 3)
        ([[0, 2]], 1.0)
    """

    router: str = "gate"
    experts: str = "experts"
    shared: Optional[str] = None
    shared_gate: Optional[str] = None
    n_experts_attrs: tuple[str, ...] = ("num_experts",)
    top_k_attrs: tuple[str, ...] = ("num_experts_per_tok",)
    renormalize: bool | str = "norm_topk_prob"
    weights_in_logits_dtype: bool = True
    #: the fused experts' 3-D weights (``[n_experts, 2 * d_expert, d_model]``, ``[n_experts, d_model, d_expert]``)
    #: and their count, as transformers' experts modules name them
    gate_up: str = "gate_up_proj"
    down: str = "down_proj"
    experts_count: str = "num_experts"

    def check_experts(self, experts: nn.Module) -> None:
        """:class:`UnsupportedArchitectureError` unless ``experts`` holds fused ``[gate | up]`` weights without
        bias, which :meth:`expert_output` computes one expert at a time."""
        if getattr(experts, "has_bias", False) or getattr(experts, "is_transposed", False) or \
                not getattr(experts, "has_gate", True):
            raise UnsupportedArchitectureError(
                f"expected fused experts with [gate | up] weights without bias ({type(experts).__name__}), found "
                "another layout; mlp.hook_expert_out supports Mixtral / Qwen-MoE / OLMoE experts")

    def n_routed(self, experts: nn.Module) -> int:
        """How many experts the fused ``experts`` module holds."""
        return int(getattr(experts, self.experts_count))

    def expert_output(self, experts: nn.Module, e: int, x: Float[Tensor, "rows d_model"]
                      ) -> Float[Tensor, "rows d_model"]:
        """Expert ``e``'s output for the rows ``x``, before its routing weight, as eager fused experts compute
        it: ``down(act(gate) * up)``.

        Examples:
            >>> from transformers import MixtralConfig, MixtralForCausalLM
            >>> cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
            ...                     num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
            ...                     num_experts_per_tok=2)
            >>> model = MixtralForCausalLM(cfg).eval()
            >>> a = adapter_for(model)
            >>> lay, experts = a.moe_layout(model, 0), a.experts_module(model, 0)
            >>> x = torch.randn(3, 32)
            >>> eager = experts(x, torch.tensor([[1, 0]] * 3), torch.tensor([[1.0, 0.0]] * 3))  # expert 1 alone
            >>> lay.n_routed(experts), bool(torch.allclose(lay.expert_output(experts, 1, x), eager, atol=1e-6))
            (4, True)
        """
        h = nn.functional.linear(x, getattr(experts, self.gate_up)[e])
        h = experts._apply_gate(h)  # type: ignore[operator]
        return nn.functional.linear(h, getattr(experts, self.down)[e])

    def route(self, logits: Float[Tensor, "*rows n_experts"], top_k: int, renormalize: bool
              ) -> tuple[Float[Tensor, "*rows top_k"], Tensor]:
        """``(weights, indices)`` the router computes from ``logits``: softmax in float32, top-k, the
        top-k probabilities renormalised where the family does; indices int64."""
        probs = torch.softmax(logits.float(), dim=-1)
        top, idx = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            top = top / top.sum(dim=-1, keepdim=True)
        if self.weights_in_logits_dtype:
            top = top.to(logits.dtype)
        return top, idx


@dataclass(frozen=True)
class Adapter:
    """How one model family is laid out (attribute paths relative to the CausalLM).

    ``attn_out``/``mlp_out`` are paths relative to a block whose *output* is the
    sub-layer's contribution to the residual stream (first element when the
    module returns a tuple). ``parallel`` marks blocks where attention and MLP
    read the same input (GPT-NeoX, GPT-J): there is no ``hook_resid_mid``.

    Examples:
        >>> a = adapter_for(tiny.hf_model)
        >>> a.name, a.blocks, a.n_layers(tiny.hf_model), a.d_model(tiny.hf_model), a.is_parallel(tiny.hf_model)
        ('llama', 'model.layers', 4, 64, False)
        >>> a.block(tiny.hf_model, 0) is tiny.hf_model.model.layers[0]
        True
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
    # What the final norm computes (ln_final.hook_scale / hook_normalized); the block norms (ln1, ln2)
    # compute the same.
    norm: FinalNorm = RMS_NORM
    # Component hooks: the attention projections, the MLP's neurons, and the norms TransformerLens calls
    # ln1 (before attention) and ln2 (before the MLP), paths relative to the block; None: the family
    # has no such norm (OLMo 2 normalises after each sub-layer only).
    attn_layout: AttnLayout = LLAMA_ATTN
    mlp_layout: MLPLayout = LLAMA_MLP
    ln1: Optional[str] = "input_layernorm"
    ln2: Optional[str] = "post_attention_layernorm"
    n_heads_attrs: tuple[str, ...] = ("num_attention_heads", "n_head")
    n_kv_attrs: tuple[str, ...] = ("num_key_value_heads",)
    # Mixture-of-experts blocks (at mlp_layout.module): None for a dense family.
    moe: Optional[MoELayout] = None

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

    def n_heads(self, model: nn.Module) -> int:
        return int(self._cfg(self.text_config(model), self.n_heads_attrs))

    def n_kv_heads(self, model: nn.Module) -> int:
        cfg = self.text_config(model)
        for a in self.n_kv_attrs:
            v = getattr(cfg, a, None)
            if v is not None:
                return int(v)
        return self.n_heads(model)

    def d_head(self, model: nn.Module) -> int:
        hd = getattr(self.text_config(model), "head_dim", None)
        return int(hd) if hd else self.d_model(model) // self.n_heads(model)

    def d_mlp(self, model: nn.Module) -> int:
        """The MLP's width (the down projection's input features) of the first dense block; a family
        whose blocks are all sparse: one expert's width."""
        dense = [l for l in range(self.n_layers(model)) if not self.is_sparse(model, l)]
        if not dense:
            experts: Any = self.experts_module(model, 0)
            return int(experts.down_proj.shape[-1])
        lin = self.mlp_post_module(model, dense[0])
        w: Tensor = lin.weight  # type: ignore[assignment]
        # nn.Linear keeps [out, in]; GPT-2's Conv1D keeps [in, out]
        return int(w.shape[1] if isinstance(lin, nn.Linear) else w.shape[0])

    def attn_module(self, model: nn.Module, layer: int) -> nn.Module:
        return get_module(self.block(model, layer), self.attn)

    def _component(self, root: nn.Module, path: Optional[str], what: str) -> nn.Module:
        if path is None:
            raise UnsupportedArchitectureError(
                f"adapter {self.name!r}: this family has no {what}, so its hooks do not exist here; use the "
                "residual hooks (hook_resid_pre / hook_attn_out ...) instead")
        return get_module(root, path)

    def qkv_modules(self, model: nn.Module, layer: int) -> dict:
        """``{"q": module, "k": ..., "v": ...}`` (separate projections) or ``{"qkv": module}`` (fused)."""
        attn, lay = self.attn_module(model, layer), self.attn_layout
        if lay.qkv is not None:
            return {"qkv": get_module(attn, lay.qkv)}
        return {n: get_module(attn, getattr(lay, n)) for n in ("q", "k", "v")}

    def o_proj_module(self, model: nn.Module, layer: int) -> nn.Module:
        """The attention's output projection: its input is ``hook_z``."""
        return get_module(self.attn_module(model, layer), self.attn_layout.o)

    def mlp_module(self, model: nn.Module, layer: int) -> nn.Module:
        return get_module(self.block(model, layer), self.mlp_layout.module)

    def mlp_pre_module(self, model: nn.Module, layer: int) -> nn.Module:
        self.check_dense_mlp(model, layer)
        return get_module(self.mlp_module(model, layer), self.mlp_layout.pre)

    def mlp_post_module(self, model: nn.Module, layer: int) -> nn.Module:
        self.check_dense_mlp(model, layer)
        return get_module(self.mlp_module(model, layer), self.mlp_layout.post)

    # --- mixture of experts --------------------------------------------------------
    def is_sparse(self, model: nn.Module, layer: int) -> bool:
        """Whether block ``layer``'s MLP is a sparse mixture-of-experts block."""
        return self.moe is not None and hasattr(self.mlp_module(model, layer), self.moe.experts)

    def check_dense_mlp(self, model: nn.Module, layer: int) -> None:
        """:class:`UnsupportedArchitectureError` where block ``layer`` has no dense MLP neurons."""
        if self.is_sparse(model, layer):
            raise UnsupportedArchitectureError(
                f"adapter {self.name!r}: expected a dense MLP at block {layer} for mlp.hook_pre / mlp.hook_post, "
                "found a sparse mixture-of-experts block, which has no dense MLP neurons; use "
                "mlp.hook_router_logits / hook_expert_out (or hook_mlp_out) there")

    def moe_layout(self, model: nn.Module, layer: int) -> MoELayout:
        """The :class:`MoELayout` of block ``layer``; :class:`UnsupportedArchitectureError` where the
        block is dense."""
        if self.moe is None:
            raise UnsupportedArchitectureError(
                f"adapter {self.name!r}: expected a mixture-of-experts family for the mlp.hook_router_logits / "
                "hook_expert_* hooks, found a dense one; use mlp.hook_pre / hook_post or hook_mlp_out")
        if not self.is_sparse(model, layer):
            raise UnsupportedArchitectureError(
                f"adapter {self.name!r}: expected a sparse mixture-of-experts block at block {layer} for the "
                "router and expert hooks, found a dense MLP (this model mixes dense and sparse blocks: "
                "mlp_only_layers / decoder_sparse_step); use mlp.hook_pre / hook_post there, or a sparse block")
        return self.moe

    def moe_block(self, model: nn.Module, layer: int) -> nn.Module:
        """Block ``layer``'s sparse MoE block (refused where it is dense)."""
        self.moe_layout(model, layer)
        return self.mlp_module(model, layer)

    def router_module(self, model: nn.Module, layer: int) -> nn.Module:
        return get_module(self.moe_block(model, layer), self.moe_layout(model, layer).router)

    def experts_module(self, model: nn.Module, layer: int) -> nn.Module:
        return get_module(self.moe_block(model, layer), self.moe_layout(model, layer).experts)

    def shared_expert(self, model: nn.Module, layer: int) -> Optional[tuple[nn.Module, nn.Module]]:
        """``(shared expert, its gate)`` of block ``layer``, ``None`` where the family has none: the block
        adds ``sigmoid(gate(x)) * shared(x)`` to the routed experts' sum."""
        lay, blk = self.moe_layout(model, layer), self.moe_block(model, layer)
        if lay.shared is None or lay.shared_gate is None:
            return None
        return get_module(blk, lay.shared), get_module(blk, lay.shared_gate)

    def n_experts(self, model: nn.Module) -> Optional[int]:
        """Routed experts per sparse block (``None``: a dense family)."""
        if self.moe is None:
            return None
        return int(self._cfg(self.text_config(model), self.moe.n_experts_attrs))

    def top_k(self, model: nn.Module) -> Optional[int]:
        """Experts each token is routed to (``None``: a dense family)."""
        if self.moe is None:
            return None
        return int(self._cfg(self.text_config(model), self.moe.top_k_attrs))

    def route(self, model: nn.Module, logits: Float[Tensor, "*rows n_experts"]
              ) -> tuple[Float[Tensor, "*rows top_k"], Tensor]:
        """``(top-k weights, top-k indices)`` from router logits by this family's rule."""
        lay = self.moe
        if lay is None:
            raise UnsupportedArchitectureError(f"adapter {self.name!r}: expected a mixture-of-experts family to "
                                               "route router logits, found a dense one")
        renorm = lay.renormalize
        if isinstance(renorm, str):
            renorm = bool(getattr(self.text_config(model), renorm, False))
        k = self.top_k(model)
        assert k is not None
        return lay.route(logits, k, bool(renorm))

    def component_hooks(self, model: nn.Module, layer: int) -> tuple[str, ...]:
        """The component hook kinds block ``layer`` has: attention, the dense MLP's neurons or the
        mixture-of-experts hooks, and the block norms the family has."""
        mlp = MOE_HOOKS if self.is_sparse(model, layer) else MLP_HOOKS
        norms = tuple(k for k in NORM_HOOKS if getattr(self, k[:3]) is not None)
        return ATTN_HOOKS + (MLP_IN,) + mlp + norms

    def block_norm_module(self, model: nn.Module, layer: int, which: str) -> nn.Module:
        """``which="ln1"`` (before attention) or ``"ln2"`` (before the MLP)."""
        return self._component(self.block(model, layer), self.ln1 if which == "ln1" else self.ln2,
                               f"{'pre-attention' if which == 'ln1' else 'pre-MLP'} norm ({which})")

    def norm_parts(self, module: nn.Module, x: Float[Tensor, "*rows d_model"]
                   ) -> tuple[Float[Tensor, "*rows d_model"], Float[Tensor, "*rows 1"]]:
        """``(normalized, scale)`` a norm of this family (``module``) computes from ``x`` (float32)."""
        return self.norm.normalize(module, x)

    def norm_affine(self, module: nn.Module
                    ) -> tuple[Optional[Float[Tensor, " d_model"]], Optional[Float[Tensor, " d_model"]]]:
        """``(w_eff, bias)`` of a norm of this family in float32."""
        return self.norm.effective_weight(module), self.norm.bias_of(module)

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

    def final_norm_parts(self, model: nn.Module, x: Float[Tensor, "*rows d_model"]
                         ) -> tuple[Float[Tensor, "*rows d_model"], Float[Tensor, "*rows 1"]]:
        """``(normalized, scale)`` the final norm computes from its input ``x`` (float32):
        TransformerLens's ``ln_final.hook_normalized`` and ``ln_final.hook_scale``."""
        return self.norm.normalize(self.final_norm_module(model), x)

    def final_norm_affine(self, model: nn.Module
                          ) -> tuple[Optional[Float[Tensor, " d_model"]], Optional[Float[Tensor, " d_model"]]]:
        """``(w_eff, bias)`` of the final norm in float32 (``None`` for one it lacks): its output is
        ``normalized * w_eff + bias``."""
        mod = self.final_norm_module(model)
        return self.norm.effective_weight(mod), self.norm.bias_of(mod)

    def embed_module(self, model: nn.Module) -> nn.Module:
        return get_module(model, self.embed)

    def unembed_module(self, model: nn.Module) -> nn.Module:
        return get_module(model, self.unembed)

    def residual_writer(self, model: nn.Module, layer: int, which: str) -> nn.Linear:
        """The ``nn.Linear`` whose output the attention (``which="attn"``) or MLP (``"mlp"``) sub-layer
        of block ``layer`` adds to the residual stream: what weight orthogonalisation rewrites.

        Raises :class:`UnsupportedArchitectureError` where the sub-layer's output passes through a
        norm before the residual (Gemma 2/3, OLMo 2): a projection does not commute with that norm; and
        for the MLP of a sparse mixture-of-experts block, which has no single output projection."""
        if which not in ("attn", "mlp"):
            raise UnsupportedArchitectureError(f"expected which='attn' or 'mlp', found {which!r}")
        d_model = self.d_model(model)
        if which == "mlp" and self.is_sparse(model, layer):
            raise UnsupportedArchitectureError(
                f"adapter {self.name!r}: expected a dense MLP at block {layer} to fold an ablation into its output "
                "projection, found a sparse mixture-of-experts block, whose experts write the residual through "
                "fused 3-D weights (and a shared expert where the family has one); use run-time ablation instead")
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


# The fingerprint hashes a few weights chosen by parameter name alone (so that a folder is fingerprinted without
# loading it): the same rule for every family, which must not change, since artifacts carry the values it gave.
_FP_EMBED, _FP_BLOCK_OUTS, _FP_FINAL_NORM = "embed_tokens.weight", ("self_attn.o_proj.weight", "mlp.down_proj.weight"), \
    "model.norm.weight"


def fingerprint_keys(names: list[str]) -> list[str]:
    """Which parameters :func:`steerkit.loading.fingerprint.model_fingerprint` hashes, in order, chosen from the
    parameter (or safetensors) names only: the token embedding, the attention and MLP output projections of the
    first and last block, the final norm; the first and last parameter where none of those is found.

    Examples:
        >>> fingerprint_keys([n for n, _ in tiny.hf_model.named_parameters()])  # doctest: +NORMALIZE_WHITESPACE
        ['model.embed_tokens.weight', 'model.layers.0.self_attn.o_proj.weight', 'model.layers.0.mlp.down_proj.weight',
         'model.layers.3.self_attn.o_proj.weight', 'model.layers.3.mlp.down_proj.weight', 'model.norm.weight']
        >>> fingerprint_keys(["transformer.wte.weight", "transformer.h.0.attn.c_attn.weight", "lm_head.weight"])
        ['transformer.wte.weight', 'lm_head.weight']
    """
    keys = [k for k in names if k.endswith(_FP_EMBED)]
    layer_keys = sorted({k for k in names if ".layers." in k})
    if layer_keys:
        idx = sorted({int(k.split(".layers.")[1].split(".")[0]) for k in layer_keys})
        for li in (idx[0], idx[-1]):
            for suffix in _FP_BLOCK_OUTS:
                keys += [k for k in names if k.endswith(f".layers.{li}.{suffix}")]
    keys += [k for k in names if k.endswith(_FP_FINAL_NORM)]
    if not keys:  # unknown architecture: first and last parameter
        keys = names[:1] + names[-1:]
    return list(dict.fromkeys(keys))


# vLLM's text models keep their decoder blocks at ``model.layers`` (Llama, Mistral, Qwen2/3, Gemma,
# Phi-3, OLMo, Mixtral...), or one level down in multimodal wrappers; each block has ``self_attn`` and
# (dense or MoE) ``mlp``; blocks of other pipeline ranks are placeholders without them.
_VLLM_BLOCK_PATHS = ("model", "language_model.model", "model.language_model")


@dataclass(frozen=True)
class VLLMLayout:
    """The modules of a vLLM decoder model that steering hooks: blocks (absolute indices; ``None``
    for a block another pipeline rank holds), each block's attention and MLP, and the embedding.

    Examples:
        >>> lay = vllm_layout(tiny.hf_model)  # a Hugging Face Llama keeps its modules where vLLM's does
        >>> type(lay).__name__, len(lay.blocks), len(lay.attn), len(lay.mlp)
        ('VLLMLayout', 4, 4, 4)
    """

    blocks: tuple
    attn: tuple
    mlp: tuple
    embed: object


def _vllm_mlp(block: nn.Module) -> Optional[nn.Module]:
    """A vLLM block's MLP: ``mlp`` (dense or MoE), or ``block_sparse_moe`` (vLLM's Mixtral)."""
    for name in ("mlp", "block_sparse_moe"):
        m = getattr(block, name, None)
        if m is not None:
            return m
    return None


def vllm_layout(model: nn.Module) -> VLLMLayout:
    """Where a vLLM model keeps what :class:`VLLMLayout` names (the plugin asks this, nothing else).

    Examples:
        >>> lay = vllm_layout(tiny.hf_model)  # a Hugging Face Llama keeps its modules where vLLM's does
        >>> lay.attn[0] is tiny.hf_model.model.layers[0].self_attn, lay.embed is tiny.hf_model.model.embed_tokens
        (True, True)
    """
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
                              mlp=tuple(None if b is None else _vllm_mlp(b) for b in blocks),
                              embed=getattr(m, "embed_tokens", None))
    raise UnsupportedArchitectureError(
        f"expected a vLLM decoder model with its blocks at one of {_VLLM_BLOCK_PATHS} (.layers), found "
        f"{type(model).__name__}; add its layout to steerkit.loading.adapters.vllm_layout")


def vllm_sites(model: nn.Module) -> dict[str, tuple[Any, str]]:
    """``{site: (module, kind)}`` for every site a vLLM model exposes on this rank: ``kind`` "resid"
    for a decoder layer (``blocks.{l}.hook_resid_post``: its output ``(hidden, residual)`` sums to the
    residual stream after the block), "out" for a module whose output is the site (the embedding for
    ``blocks.0.hook_resid_pre``, attention and MLP for ``hook_attn_out`` / ``hook_mlp_out``), "in" for a
    module whose input is the site, read and never written (the MLP for ``blocks.{l}.mlp.hook_in``, the
    normalised stream a transcoder reads). Blocks of other pipeline ranks are absent; indices stay absolute.

    Examples:
        >>> sites = vllm_sites(tiny.hf_model)
        >>> len(sites), sites["blocks.2.hook_resid_post"][1], sites["blocks.0.hook_resid_pre"][1]
        (17, 'resid', 'out')
        >>> module, kind = sites["blocks.2.mlp.hook_in"]
        >>> module is sites["blocks.2.hook_mlp_out"][0], kind
        (True, 'in')
    """
    lay = vllm_layout(model)
    sites: dict[str, tuple[Any, str]] = {}
    if lay.embed is not None:
        sites["blocks.0.hook_resid_pre"] = (lay.embed, "out")
    for l, blk in enumerate(lay.blocks):  # absolute indices: None for the blocks of other pipeline ranks
        if blk is None:
            continue
        sites[f"blocks.{l}.hook_resid_post"] = (blk, "resid")
        attn, mlp = lay.attn[l], lay.mlp[l]
        if attn is not None:
            sites[f"blocks.{l}.hook_attn_out"] = (attn, "out")
        if mlp is not None:
            sites[f"blocks.{l}.mlp.hook_in"] = (mlp, "in")
            sites[f"blocks.{l}.hook_mlp_out"] = (mlp, "out")
    return sites


_REGISTRY: dict[str, Adapter] = {}


def register_adapter(adapter: Adapter) -> Adapter:
    """Register ``adapter`` for each of its ``model_types`` (later registrations win).

    Examples:
        >>> import dataclasses
        >>> mine = dataclasses.replace(adapter_for(tiny.hf_model), name="my-llama", model_types=("my_llama",))
        >>> register_adapter(mine).name, "my_llama" in registered_model_types()
        ('my-llama', True)
    """
    for mt in adapter.model_types:
        _REGISTRY[mt] = adapter
    return adapter


def registered_model_types() -> list[str]:
    """The ``config.model_type`` values an adapter is registered for, sorted.

    Examples:
        >>> {"llama", "mistral", "qwen2", "gpt2", "gemma3_text"} <= set(registered_model_types())
        True
    """
    return sorted(_REGISTRY)


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter for a Hugging Face causal LM, chosen by ``config.model_type``.

    Examples:
        >>> adapter_for(tiny.hf_model).name, adapter_for(sm.hf_model).name
        ('llama', 'llama')
    """
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
        "steerkit.loading.adapters.register_adapter(Adapter(...))"
    )


# Every layout below was checked against the transformers 5.x modeling code of its family
# (``*DecoderLayer.forward``) and is tested on a tiny random-weight model in
# tests/core/test_adapters.py.

# Llama-like decoders: model.layers[i].{input_layernorm, self_attn, post_attention_layernorm, mlp},
# model.norm, lm_head; the block computes h += self_attn(norm(h)); h += mlp(norm(h)).
# Gemma scales the embeddings inside GemmaModel.forward, before block 0: hook_resid_pre of
# block 0 sees the scaled embeddings. Qwen3's q/k norms and SmolLM3's NoPE layers live inside
# self_attn and change nothing here.
def _llama_like(name: str, model_types: tuple[str, ...], *, attn_out: str = "self_attn", mlp_out: str = "mlp",
                blocks: str = "model.layers", embed: str = "model.embed_tokens", final_norm: str = "model.norm",
                pre_attn_norm: str = "input_layernorm", norm: FinalNorm = RMS_NORM,
                attn_layout: AttnLayout = LLAMA_ATTN, mlp_layout: MLPLayout = LLAMA_MLP,
                ln1: Optional[str] = "input_layernorm", ln2: Optional[str] = "post_attention_layernorm",
                moe: Optional[MoELayout] = None) -> Adapter:
    """An adapter with the Llama layout, some of its module paths replaced."""
    return Adapter(name=name, model_types=model_types, blocks=blocks, embed=embed, final_norm=final_norm,
                   unembed="lm_head", attn_out=attn_out, mlp_out=mlp_out, pre_attn_norm=pre_attn_norm, norm=norm,
                   attn_layout=attn_layout, mlp_layout=mlp_layout, ln1=ln1, ln2=ln2, moe=moe)


# The final norm: LlamaRMSNorm-style (weight * n, variance_epsilon) on Llama, Mistral, Qwen2/3 and
# SmolLM3; GemmaRMSNorm is (1 + weight) * n with eps; OlmoLayerNorm has neither weight nor bias.
register_adapter(_llama_like("llama", ("llama", "mistral", "qwen2", "qwen3", "smollm3")))
register_adapter(_llama_like("llama", ("gemma",), norm=GEMMA_RMS_NORM))
register_adapter(_llama_like("llama", ("olmo",), norm=OLMO_LAYER_NORM))
# Not Granite: its block adds ``residual_multiplier * self_attn(...)``, a product no module
# outputs, so hook_attn_out/hook_mlp_out (and resid_mid edits) would be off by that factor.

# Mixture of experts, Llama layout with ``mlp`` a sparse block: ``mlp.gate`` (a TopKRouter returning
# (router_logits, top-k weights, top-k indices)) and ``mlp.experts`` (fused 3-D expert weights); the
# block returns experts(x, indices, weights), plus sigmoid(shared_expert_gate(x)) * shared_expert(x) on
# Qwen2-MoE. Routing: softmax in float32, top-k; Mixtral always renormalises and keeps the weights in
# float32, Qwen2/3-MoE and OLMoE renormalise where norm_topk_prob says and cast them to the logits'
# dtype. Qwen2/3-MoE blocks listed in mlp_only_layers, or off the decoder_sparse_step, are dense
# (Qwen2MoeMLP / Qwen3MoeMLP with gate_proj / up_proj / down_proj). OLMoE's q/k norms live inside
# self_attn.
register_adapter(_llama_like("mixtral", ("mixtral",),
                             moe=MoELayout(n_experts_attrs=("num_local_experts",), renormalize=True,
                                           weights_in_logits_dtype=False)))
register_adapter(_llama_like("qwen2_moe", ("qwen2_moe",),
                             moe=MoELayout(shared="shared_expert", shared_gate="shared_expert_gate")))
register_adapter(_llama_like("qwen3_moe", ("qwen3_moe",), moe=MoELayout()))
register_adapter(_llama_like("olmoe", ("olmoe",), moe=MoELayout()))

# Phi-3: Llama layout, but the residual receives resid_attn_dropout(self_attn(...)) and
# resid_mlp_dropout(mlp(...)); hooking the dropouts keeps resid_pre + attn_out + mlp_out ==
# resid_post exact in train mode too (in eval they are the identity).
# Its projections are fused: qkv_proj ([q | k | v]) and gate_up_proj ([gate | up]).
register_adapter(_llama_like("phi3", ("phi3",), attn_out="resid_attn_dropout", mlp_out="resid_mlp_dropout",
                             attn_layout=AttnLayout(q=None, k=None, v=None, qkv="qkv_proj"),
                             mlp_layout=MLPLayout(pre="gate_up_proj", pre_half=True)))

# Post-sub-layer norms: the residual receives the *normed* sub-layer output.
# Gemma 2 / Gemma 3 text: h += post_attention_layernorm(self_attn(input_layernorm(h)));
# h += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))). Gemma 3 scales the
# embeddings inside its embedding module (Gemma3TextScaledWordEmbedding).
_POST_ATTN, _POST_MLP = "post_attention_layernorm", "post_feedforward_layernorm"
# TransformerLens's ln2 is the norm before the MLP: pre_feedforward_layernorm.
_PRE_MLP = "pre_feedforward_layernorm"
register_adapter(_llama_like("gemma2", ("gemma2", "gemma3_text"), attn_out=_POST_ATTN, mlp_out=_POST_MLP,
                             norm=GEMMA_RMS_NORM, ln2=_PRE_MLP))
# Gemma 3 multimodal (Gemma3ForConditionalGeneration, config.model_type "gemma3"): the same
# decoder, one level down at model.language_model; lm_head stays at the top.
register_adapter(_llama_like("gemma3", ("gemma3",), attn_out=_POST_ATTN, mlp_out=_POST_MLP,
                             blocks="model.language_model.layers", embed="model.language_model.embed_tokens",
                             final_norm="model.language_model.norm", norm=GEMMA_RMS_NORM, ln2=_PRE_MLP))
# OLMo 2 / OLMo 3: h += post_attention_layernorm(self_attn(h)); h += post_feedforward_layernorm(mlp(h)).
# There is no pre-attention norm: self_attn itself receives the residual. Olmo2RMSNorm is
# (weight * n).to(dtype), the same values as Llama's in float32.
register_adapter(_llama_like("olmo2", ("olmo2", "olmo3"), attn_out=_POST_ATTN, mlp_out=_POST_MLP,
                             pre_attn_norm="self_attn", ln1=None, ln2=None))

# GPT-2: transformer.h[i] computes h += attn(ln_1(h))[0]; h += mlp(ln_2(h)) (the attention
# returns (output, weights) and applies resid_dropout itself; the MLP applies its dropout).
# GPT-2 and GPT-NeoX end in an nn.LayerNorm with weight and bias.
register_adapter(Adapter(name="gpt2", model_types=("gpt2",), blocks="transformer.h", embed="transformer.wte",
                         final_norm="transformer.ln_f", unembed="lm_head", attn_out="attn", mlp_out="mlp",
                         attn="attn", pre_attn_norm="ln_1", norm=LAYER_NORM, ln1="ln_1", ln2="ln_2",
                         attn_layout=AttnLayout(q=None, k=None, v=None, qkv="c_attn", o="c_proj"),
                         mlp_layout=MLPLayout(pre="c_fc", post="c_proj")))
# GPT-NeoX (Pythia): a = post_attention_dropout(attention(input_layernorm(h))[0]);
# m = post_mlp_dropout(mlp(post_attention_layernorm(.))); with use_parallel_residual (the
# default) h + a + m, both sub-layers reading h, so there is no resid_mid; otherwise sequential.
register_adapter(Adapter(name="gpt_neox", model_types=("gpt_neox",), blocks="gpt_neox.layers",
                         embed="gpt_neox.embed_in", final_norm="gpt_neox.final_layer_norm",
                         unembed="lm_head", attn_out="post_attention_dropout", mlp_out="post_mlp_dropout",
                         attn="attention", parallel="use_parallel_residual", norm=LAYER_NORM,
                         attn_layout=AttnLayout(q=None, k=None, v=None, qkv="query_key_value", o="dense",
                                                qkv_layout="per_head"),
                         mlp_layout=MLPLayout(pre="dense_h_to_4h", post="dense_4h_to_h")))
