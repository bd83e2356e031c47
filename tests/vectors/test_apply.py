"""Applying artifacts: compatibility checks, steering through the one steering path (``sm.steer``:
artifact -> interventions -> compile), ablation == orthogonalised weights."""

from __future__ import annotations

import types

import pytest
import torch

from steerkit.vectors import (
    DirectionSet, ModelMismatchError, Provenance, SteeringVector, check_compatible, model_fingerprint,
)
import steerkit
from steerkit.model import Tokens
from steerkit.vectors.gguf_models import orthogonalize_tensors


def _ids(seed=0, B=3, T=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (B, T), generator=g)


def _logits(m, ids):
    with torch.no_grad():
        return m(input_ids=ids).logits


def _manual_add(m, layer, v, ids):
    def hook(_mod, _inp, out):
        if isinstance(out, tuple):
            return (out[0] + v, *out[1:])
        return out + v
    h = m.model.layers[layer].register_forward_hook(hook)
    try:
        return _logits(m, ids)
    finally:
        h.remove()


@pytest.fixture()
def tiny_sm(tiny_llama):
    tok = types.SimpleNamespace(pad_token_id=0, eos_token=None, pad_token=None, chat_template=None)
    return steerkit.wrap(tiny_llama, tok, name="tiny")


def test_steered_wrapped_model_matches_manual_hook(tiny_sm, tiny_llama):
    """Steering applies to the wrapped model's own forward too (hooks sit on its modules)."""
    v = torch.randn(64)
    sv = SteeringVector.from_direction(v, layer=2, model=tiny_llama, scale=3.0)
    ids = _ids()
    base = _logits(tiny_llama, ids)
    with tiny_sm.steer(sv):
        got = _logits(tiny_llama, ids)
    assert torch.allclose(got, _manual_add(tiny_llama, 2, 3.0 * v, ids), atol=1e-5)
    assert not torch.allclose(got, base, atol=1e-3)
    assert torch.equal(_logits(tiny_llama, ids), base)  # removed on exit
    h = tiny_sm.steer(sv)  # the handle, without a with block
    assert not torch.allclose(_logits(tiny_llama, ids), base, atol=1e-3)
    h.remove()
    assert torch.equal(_logits(tiny_llama, ids), base) and tiny_sm.hook_count() == 0


def test_steer_through_core_edits(tiny_sm, tiny_llama):
    ids = _ids(1)
    toks = Tokens(ids, torch.ones_like(ids))
    v = torch.randn(64)
    sv = SteeringVector.from_direction(v, layer=1, model=tiny_sm, scale=2.0)
    assert sv.provenance.model_name == "tiny" and sv.provenance.n_layers == 4
    with tiny_sm.steer(sv):
        got = tiny_sm.forward(toks)
    assert torch.allclose(got, _manual_add(tiny_llama, 1, 2.0 * v, ids), atol=1e-4)
    assert tiny_sm.hook_count() == 0


def test_clamp_operation_sets_the_component(tiny_sm):
    ids = _ids(2)
    toks = Tokens(ids, torch.ones_like(ids))
    v = torch.randn(64)
    sv = SteeringVector.from_direction(v, layer=1, model=tiny_sm, operation="clamp", scale=1.5)
    with tiny_sm.steer(sv), tiny_sm.record("blocks.1.hook_resid_post") as cache:
        tiny_sm.forward(toks)
    h = cache["blocks.1.hook_resid_post"]
    proj = h @ (v / v.norm())
    assert torch.allclose(proj, torch.full_like(proj, 1.5 * float(v.norm())), atol=1e-3)


def test_mismatch_names_both_sides_and_override(tiny_sm, tiny_llama):
    from _vectors_helpers import make_tiny_llama

    other = make_tiny_llama(seed=7)
    sv = SteeringVector.from_direction(torch.randn(64), layer=1, model=other)
    with pytest.raises(ModelMismatchError) as e:
        with tiny_sm.steer(sv):
            pass
    msg = str(e.value)
    assert model_fingerprint(other) in msg and model_fingerprint(tiny_llama) in msg and "override=True" in msg
    assert tiny_sm.hook_count() == 0
    with pytest.warns(UserWarning, match="override"):
        with tiny_sm.steer(sv, override=True):
            pass
    wide = SteeringVector.from_direction(torch.randn(32), layer=1)
    with pytest.raises(ModelMismatchError, match="d_model=64.*d_model=32.*not even with override"):
        check_compatible(wide, tiny_llama, override=True)
    deep = SteeringVector({9: torch.randn(64)})
    with pytest.raises(ModelMismatchError, match="below 4"):
        check_compatible(deep, tiny_llama, override=True)
    with pytest.warns(UserWarning, match="no model fingerprint"):
        check_compatible(SteeringVector({1: torch.randn(64)}), tiny_llama)


def _hf_to_gguf_names(sd):
    m = {"model.embed_tokens.weight": "token_embd.weight"}
    out = {}
    for k, v in sd.items():
        if k in m:
            out[m[k]] = v.numpy()
        elif k.endswith("self_attn.o_proj.weight"):
            out[f"blk.{k.split('.')[2]}.attn_output.weight"] = v.numpy()
        elif k.endswith("mlp.down_proj.weight"):
            out[f"blk.{k.split('.')[2]}.ffn_down.weight"] = v.numpy()
    return out


def test_runtime_ablation_equals_orthogonalised_weights(tiny_sm, tiny_llama):
    """The maths the GGUF writer bakes in gives what run-time ablation gives (tiny model, exact-ish)."""
    from transformers import LlamaForCausalLM

    ds = DirectionSet.from_directions(torch.randn(2, 64), model=tiny_llama)
    ids = _ids(3)
    with tiny_sm.steer(ds):
        runtime = _logits(tiny_llama, ids)
    base = _logits(tiny_llama, ids)
    assert (runtime - base).abs().max() > 1e-3  # the ablation does something
    sd = {k: v.detach().clone() for k, v in tiny_llama.state_dict().items()}
    new = orthogonalize_tensors(_hf_to_gguf_names(sd), ds.basis.double().numpy())
    cfg = tiny_llama.config.__class__(**{**tiny_llama.config.to_dict(), "tie_word_embeddings": False})
    baked = LlamaForCausalLM(cfg).eval()
    sd2 = dict(sd)
    sd2["model.embed_tokens.weight"] = torch.from_numpy(new["token_embd.weight"])
    sd2["lm_head.weight"] = torch.from_numpy(new["output.weight"])
    for k in list(sd2):
        if k.endswith("self_attn.o_proj.weight"):
            sd2[k] = torch.from_numpy(new[f"blk.{k.split('.')[2]}.attn_output.weight"])
        if k.endswith("mlp.down_proj.weight"):
            sd2[k] = torch.from_numpy(new[f"blk.{k.split('.')[2]}.ffn_down.weight"])
    baked.load_state_dict(sd2)
    assert torch.allclose(_logits(baked, ids), runtime, atol=1e-4)


def test_ablation_at_layers_through_core(tiny_sm):
    ds = DirectionSet.from_directions(torch.randn(1, 64), model=tiny_sm, layers=[2])
    ids = _ids(4)
    with tiny_sm.steer(ds), tiny_sm.record("blocks.2.hook_resid_post") as cache:
        tiny_sm.forward(Tokens(ids, torch.ones_like(ids)))
    assert (cache["blocks.2.hook_resid_post"] @ ds.basis.T).abs().max() < 1e-4


def test_sm_steer_scale_multiplies_the_artifact(tiny_sm):
    """``with sm.steer(artifact, scale=...)`` == the same vector with its scale multiplied; checks the model."""
    v = torch.randn(64)
    sv = SteeringVector.from_direction(v, layer=1, model=tiny_sm)
    ids = _ids(3)
    base = tiny_sm.model(input_ids=ids).logits.detach()
    with tiny_sm.steer(sv * 2.0):
        want = tiny_sm.model(input_ids=ids).logits.detach()
    with tiny_sm.steer(sv, scale=2.0):
        got = tiny_sm.model(input_ids=ids).logits.detach()
    assert torch.equal(got, want) and not torch.allclose(got, base, atol=1e-3)
    other = SteeringVector(directions={1: v}, provenance=Provenance(model_name="x", model_fingerprint="sk1:other",
                                                                       d_model=64, n_layers=sv.provenance.n_layers))
    with pytest.raises(ModelMismatchError):
        with tiny_sm.steer(other):
            pass
