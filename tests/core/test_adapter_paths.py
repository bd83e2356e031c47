"""The adapters are the only place that knows a model's module paths: the fingerprint asks
``loading.adapters.fingerprint_keys`` which weights to hash, the MoE hooks ask the block's ``MoELayout`` for the
fused experts' weights, and no other module of the core, the probes or the app names a module of a model."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from steerkit.hooks.moe import expert_outputs
from steerkit.loading.adapters import adapter_for, fingerprint_keys
from steerkit.loading.fingerprint import folder_fingerprint, model_fingerprint
from tiny_models import ARCHS, MOE_ARCHS, tiny_model

ROOT = Path(__file__).resolve().parents[2]

_LLAMA = ["model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight",
          "model.layers.1.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight"]
_MOE = ["model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.weight",
        "model.layers.1.self_attn.o_proj.weight", "model.norm.weight"]
#: the weights each family's fingerprint hashes, as before the rule moved into the adapters (artifacts carry
#: fingerprints computed from these: the choice must not change)
KEYS = {**{a: _LLAMA for a in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3",
                               "olmo2", "olmo3", "smollm3")},
        "olmo": _LLAMA[:-1],  # OLMo's final LayerNorm has no weight
        "gpt2": ["transformer.wte.weight", "transformer.ln_f.bias"],  # no rule matches: first and last
        "gpt_neox": ["gpt_neox.embed_in.weight", "lm_head.weight"],
        "gpt_neox_seq": ["gpt_neox.embed_in.weight", "lm_head.weight"],
        "gemma3": [k.replace("model.", "model.language_model.", 1) for k in _LLAMA],
        **{a: _MOE for a in MOE_ARCHS}}


@pytest.mark.parametrize("arch", ARCHS + MOE_ARCHS)
def test_the_fingerprint_hashes_the_same_weights_per_family(arch):
    model, _ = tiny_model(arch)
    assert fingerprint_keys([n for n, _ in model.named_parameters()]) == KEYS[arch]


def test_a_folder_and_its_loaded_model_agree(tmp_path):
    model, _ = tiny_model("llama")
    model.config.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    assert folder_fingerprint(tmp_path) == model_fingerprint(model)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_expert_outputs_add_up_to_the_eager_experts(arch):
    model, _ = tiny_model(arch)
    adapter = adapter_for(model)
    experts, layout = adapter.experts_module(model, 0), adapter.moe_layout(model, 0)
    g = torch.Generator().manual_seed(0)
    k, n = adapter.top_k(model), adapter.n_experts(model)
    x = torch.randn(6, model.config.hidden_size, generator=g)
    idx = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(6)])
    w = torch.rand(6, k, generator=g)
    per, hit = expert_outputs(experts, x, idx, w, layout)
    assert per.shape == (6, n, x.shape[1]) and hit == sorted(set(idx.flatten().tolist()))
    torch.testing.assert_close(per.sum(1), experts(x, idx, w), atol=1e-5, rtol=1e-5)
    unused = [e for e in range(n) if e not in hit]
    assert all(float(per[:, e].abs().max()) == 0.0 for e in unused)


# ------------------------------------------------------------------ no module paths outside the adapters
#: names of a Hugging Face model's modules (and of the fused experts' weights) that only adapters.py may write
MODULE_NAMES = {"self_attn", "q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj",
                "gate_up_proj", "embed_tokens", "embed_in", "lm_head", "c_attn", "c_proj", "c_fc", "wte", "ln_f",
                "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm", "shared_expert", "shared_expert_gate", "block_sparse_moe", "_apply_gate",
                "num_experts", "num_local_experts"}
PATHS = re.compile(r"\bmodel\.(layers|norm|embed_tokens|language_model)\b|\.experts\b|\bmlp\.gate\b")
#: a file's own format that spells module paths without touching a model: sparsify names an SAE's folder after
#: the module it hooks (``layers.12.self_attn``), which steerkit.sae.formats translates into a steerkit site
ALLOWED = {("steerkit/sae/formats.py", "_SPARSIFY_RE")}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _assigned_to(tree: ast.AST) -> dict[int, str]:
    """id of each string constant -> the module-level name it is assigned to (if any)."""
    out = {}
    for node in tree.body:  # type: ignore[attr-defined]
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            for sub in ast.walk(node.value):
                out[id(sub)] = node.targets[0].id
    return out


def test_only_the_adapters_name_module_paths():
    found = []
    for folder in ("steerkit", "probes", "apps"):
        for f in sorted((ROOT / folder).rglob("*.py")):
            rel = str(f.relative_to(ROOT))
            if rel == "steerkit/loading/adapters.py":
                continue
            tree = ast.parse(f.read_text(encoding="utf-8"))
            docs, owner = _docstrings(tree), _assigned_to(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr in MODULE_NAMES:
                    found.append(f"{rel}:{node.lineno} .{node.attr}")
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs \
                        and not re.search(r"\s", node.value):  # a path has no spaces; messages may name modules
                    words = set(re.findall(r"\w+", node.value))
                    if (words & MODULE_NAMES or PATHS.search(node.value)) and (rel, owner.get(id(node))) not in ALLOWED:
                        found.append(f"{rel}:{node.lineno} {node.value[:60]!r}")
    assert found == [], "module paths outside steerkit/loading/adapters.py (ask the adapter):\n" + "\n".join(found)
