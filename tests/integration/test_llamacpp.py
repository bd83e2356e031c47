"""Numerical proof that exported artifacts do in llama.cpp what steerkit does in PyTorch.

Needs ``llama-cpp-python`` (the ``llamacpp`` extra) and the embedded SmolLM2-135M GGUF.
The float32 GGUF is a de-quantised copy of the shipped Q4_1 file, i.e. the very weights
``steerkit.load_model()`` runs in PyTorch, so the two engines compute the same function.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from steerkit.vectors import DirectionSet, SteeringVector, export, import_artifact
from steerkit.vectors.gguf_models import write_dequantized_gguf, write_orthogonalized_gguf

from steerkit.vectors.llamacpp import LlamaCppRunner, cvec_buffer  # noqa: E402

llama_cpp = pytest.importorskip("llama_cpp")  # after steerkit.vectors.llamacpp set OMP_WAIT_POLICY


pytestmark = pytest.mark.slow

LAYER = 15
PROMPTS = [
    "What is the capital of France?", "Write a haiku about autumn.", "How do I boil an egg?",
    "Tell me a joke about cats.", "Explain photosynthesis in one sentence.", "What is 12 times 7?",
    "Describe the colour blue to someone who cannot see.", "Give me three tips for sleeping better.",
    "Who wrote Romeo and Juliet?", "Translate 'good morning' into Spanish.", "What is a black hole?",
    "Suggest a name for a pet turtle.", "Why is the sky blue?", "How many legs does a spider have?",
    "What should I cook for dinner tonight?", "Summarise the plot of Cinderella.", "Is it going to rain tomorrow?",
    "What is your favourite book?", "How do airplanes stay in the air?", "Write one sentence about the sea.",
    "What is the boiling point of water?", "Recommend a board game for four people.",
]


@pytest.fixture(scope="module")
def lm(default_model):
    if default_model.source_gguf is None:
        pytest.skip("the default model did not come from a GGUF file")
    return default_model


@pytest.fixture(scope="module")
def token_ids(lm):
    return [lm.tokenize([p], chat=True).input_ids[0].tolist() for p in PROMPTS]


@pytest.fixture(scope="module")
def f32_gguf(lm, scratch):
    return write_dequantized_gguf(lm.source_gguf, scratch("gguf") / "smollm2-f32.gguf")


@pytest.fixture(scope="module")
def happy_vector(lm):
    """A real steering vector: mean difference of block-15 outputs, happy minus sad prompts."""
    pos = ["I am so happy today!", "What a wonderful, joyful day.", "I love everything about this."]
    neg = ["I am so sad today.", "What a terrible, miserable day.", "I hate everything about this."]
    hook = f"blocks.{LAYER}.hook_resid_post"
    with lm.record(hook, positions="last") as cache:
        lm.forward(pos + neg)
    acts = cache[hook].reshape(len(pos) + len(neg), -1)
    v = acts[: len(pos)].mean(0) - acts[len(pos):].mean(0)
    return SteeringVector.from_direction(v, layer=LAYER, model=lm, scale=4.0, method="mean_difference",
                                         prompts=pos + neg)


def torch_last_logits(lm, token_ids):
    toks = lm.pad(token_ids)
    return lm.forward(toks)[:, -1, :].float().numpy()


def llama_last_logits(runner, token_ids):
    return np.stack([runner.next_token_logits(ids) for ids in token_ids])


def test_cvec_buffer_layout():
    v = SteeringVector({1: torch.ones(4), 3: torch.full((4,), 3.0)})
    buf = cvec_buffer(v, n_layer=5, n_embd=4).reshape(4, 4)
    assert buf[0].tolist() == [1.0] * 4 and buf[2].tolist() == [3.0] * 4  # layer N at slot N-1
    assert not buf[1].any() and not buf[3].any()  # every other layer explicitly zero


def test_f32_gguf_steering_matches_pytorch(lm, token_ids, f32_gguf, happy_vector, tmp_path, record_property):
    path = export(happy_vector, "llama.cpp", tmp_path / "happy.gguf", model=lm)[0]
    with LlamaCppRunner(f32_gguf) as runner:
        assert (runner.n_layer, runner.n_embd) == (lm.n_layers, lm.d_model)
        base_lc = llama_last_logits(runner, token_ids)
        loaded = runner.set_vector_file(path)  # what llama.cpp's loader reads: direction.15 = 4 * v
        steered_lc = llama_last_logits(runner, token_ids)
        few = token_ids[:6]  # (llama.cpp is slow on 2 shared cores; these checks are exact, 6 prompts suffice)
        runner.set_vector(loaded * 0.0)  # a zero vector changes nothing
        zero_lc = llama_last_logits(runner, few)
        runner.set_vector(None)
        again_lc = llama_last_logits(runner, few)  # cleared, with a fresh KV cache each prompt
    base_pt = torch_last_logits(lm, token_ids)
    with lm.edit(happy_vector.hook_name(LAYER), add=happy_vector.directions[LAYER], scale=happy_vector.scale):
        steered_pt = torch_last_logits(lm, token_ids)
    with lm.steer(import_artifact(path)):  # the imported file through the one steering path
        steered_pt2 = torch_last_logits(lm, token_ids)

    effect = np.abs(steered_pt - base_pt).max()
    assert effect > 1.0, f"the vector barely changes the logits ({effect:.3f}); the comparison would be vacuous"
    diff = np.abs(steered_lc - steered_pt).max()
    base_diff = np.abs(base_lc - base_pt).max()
    record_property("llamacpp_f32_steered_max_abs_diff", float(diff))
    record_property("llamacpp_f32_unsteered_max_abs_diff", float(base_diff))
    record_property("steering_effect_max_abs", float(effect))
    print(f"\n[f32] steered max|llama.cpp - torch| = {diff:.4f}; unsteered {base_diff:.4f}; "
          f"steering effect {effect:.2f}; prompts {len(token_ids)}")
    assert len(token_ids) >= 20
    assert diff <= 0.1 and base_diff <= 0.1
    assert np.array_equal(steered_lc.argmax(-1), steered_pt.argmax(-1))
    assert np.abs(steered_pt2 - steered_pt).max() <= 1e-3
    assert np.array_equal(zero_lc, base_lc[:6]) and np.array_equal(again_lc, base_lc[:6])


def test_q4_1_steering_effect_correlates(lm, token_ids, happy_vector, tmp_path, record_property):
    token_ids = token_ids[:12]  # 12 prompts x 49152 logits each: plenty for a correlation
    with LlamaCppRunner(lm.source_gguf) as runner:
        base_lc = llama_last_logits(runner, token_ids)
        runner.set_vector_file(export(happy_vector, "llama.cpp", tmp_path / "happy.gguf", model=lm)[0])
        steered_lc = llama_last_logits(runner, token_ids)
    base_pt = torch_last_logits(lm, token_ids)
    with lm.steer(happy_vector):
        steered_pt = torch_last_logits(lm, token_ids)
    d_lc, d_pt = (steered_lc - base_lc).reshape(-1), (steered_pt - base_pt).reshape(-1)
    r = float(np.corrcoef(d_lc, d_pt)[0, 1])
    record_property("q4_1_delta_correlation", r)
    print(f"\n[Q4_1] corr(steered-unsteered logit change, llama.cpp vs torch) = {r:.4f}")
    assert r >= 0.95


def test_orthogonalized_gguf_matches_runtime_ablation(lm, token_ids, happy_vector, tmp_path, record_property):
    ds = DirectionSet.from_directions(happy_vector.directions[LAYER][None, :], model=lm, method="mean_difference")
    out = write_orthogonalized_gguf(lm.source_gguf, ds, tmp_path / "ablated-f32.gguf", model=lm)
    with LlamaCppRunner(out) as runner:
        ablated_lc = llama_last_logits(runner, token_ids)
    base_pt = torch_last_logits(lm, token_ids)
    with lm.steer(ds):
        ablated_pt = torch_last_logits(lm, token_ids)
    effect = np.abs(ablated_pt - base_pt).max()
    diff = np.abs(ablated_lc - ablated_pt).max()
    record_property("orthogonalized_max_abs_diff", float(diff))
    print(f"\n[ablation] max|llama.cpp(orthogonalised weights) - torch(run-time ablation)| = {diff:.4f}; effect {effect:.2f}")
    assert effect > 0.1, "ablating the direction changes nothing; the comparison would be vacuous"
    assert diff <= 0.1
    assert np.array_equal(ablated_lc.argmax(-1), ablated_pt.argmax(-1))


def test_sae_latent_vector_steers_llamacpp_as_the_latent_addition(lm, token_ids, f32_gguf, tmp_path):
    """``SteeringVector.from_sae_latent`` (a latent's decoder row) exported to llama.cpp steers as
    ``Intervention.sae_latent(..., mode="add")`` does in PyTorch."""
    from steerkit import Intervention
    from steerkit.sae import SAEWeights
    from steerkit.vectors import SAE, Provenance
    g = torch.Generator().manual_seed(0)
    W_dec = torch.nn.functional.normalize(torch.randn(256, lm.d_model, generator=g), dim=-1)  # unit rows
    sae = SAE(SAEWeights(W_dec.T.clone(), torch.zeros(256), W_dec, torch.zeros(lm.d_model)),
              site=f"blocks.{LAYER}.hook_resid_post", provenance=Provenance.from_model(lm))
    vec = SteeringVector.from_sae_latent(sae, 42, strength=12.0)
    path = export(vec, "llama.cpp", tmp_path / "latent.gguf", model=lm)[0]
    few = token_ids[:6]
    with LlamaCppRunner(f32_gguf) as runner:
        runner.set_vector_file(path)
        steered_lc = llama_last_logits(runner, few)
    base_pt = torch_last_logits(lm, few)
    with lm.steer(Intervention.sae_latent(sae.site, sae, 42, scale=12.0, mode="add")):
        steered_pt = torch_last_logits(lm, few)
    effect = np.abs(steered_pt - base_pt).max()
    assert effect > 1.0, f"the latent barely changes the logits ({effect:.3f}); the comparison would be vacuous"
    assert np.abs(steered_lc - steered_pt).max() <= 0.1
    assert np.array_equal(steered_lc.argmax(-1), steered_pt.argmax(-1))
