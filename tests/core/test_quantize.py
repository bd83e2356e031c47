"""Weight-only quantisation (torchao) and steering on the quantised model.

Tolerances: quantisation changes the model, so steering cannot give the float model's logits; what
must hold is that steering acts on the de-quantised activations as on the float model. The logit
change a steering causes (steered minus unsteered) is compared with the float model's change:
relative error (Frobenius norm of the difference over that of the float change) measured 0.0054 (int8)
and 0.080 (int4) on the tiny Llama, 0.10 (int8) on the default model (int4 there: 0.93, one scale per
32 weights is too coarse for a 135M model); bounds 0.03 / 0.2 / 0.2.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao")

import steerkit  # noqa: E402
from steerkit.errors import InputError  # noqa: E402
from steerkit.loading.fingerprint import model_fingerprint  # noqa: E402
from steerkit.model import Tokens  # noqa: E402
from steerkit.loading.quantize import quantize, scheme_of  # noqa: E402

from tiny_models import tiny_model


def _tiny(scheme=None):
    model, tok = tiny_model("llama", intermediate_size=128)
    fp = model_fingerprint(model)
    if scheme:
        quantize(model, scheme, model.model.layers)
    return steerkit.wrap(model, tok, name="tiny-llama", fingerprint=fp if scheme else None)


def _rel_change_error(sf, base, sq, lq):
    d_f, d_q = sf - base, sq - lq
    return float((d_q - d_f).norm() / d_f.norm())


@pytest.mark.parametrize("scheme,bound", [("int8", 0.03), ("int4", 0.2)])
def test_steering_a_quantised_model_changes_logits_as_on_the_float_model(scheme, bound):
    f, q = _tiny(), _tiny(scheme)
    assert q.quantization == scheme and f.quantization is None and scheme_of(q.hf_model) == scheme
    lin = q.hf_model.model.layers[0].self_attn.q_proj
    assert type(lin.weight).__name__ != "Parameter"  # really quantised
    assert type(q.hf_model.lm_head.weight).__name__ == "Parameter"  # the unembedding is not
    toks = Tokens(torch.randint(4, 100, (2, 9), generator=torch.Generator().manual_seed(0)), torch.ones(2, 9).long())
    v = torch.randn(64, generator=torch.Generator().manual_seed(1))
    site = "blocks.0.hook_resid_post"
    base, lq = f.forward(toks), q.forward(toks)
    assert not torch.equal(base, lq)
    with f.edit(site, add=v, scale=3.0):
        sf = f.forward(toks)
    with q.edit(site, add=v, scale=3.0):
        sq = q.forward(toks)
    err = _rel_change_error(sf, base, sq, lq)
    assert err < bound, err
    # the steering itself is the same operation: the recorded edited activation is h + 3 v on both
    with q.record(site) as c0:
        q.forward(toks)
    with q.edit(site, add=v, scale=3.0), q.record(site) as c1:
        q.forward(toks)
    assert torch.allclose(c1[site] - c0[site], (3.0 * v).expand_as(c0[site]), atol=1e-5)
    # provenance: the quantised model keeps its float fingerprint, so float artifacts apply to it
    assert q.fingerprint() == f.fingerprint() != model_fingerprint(q.hf_model)


def test_quantize_refuses_unknown_schemes():
    with pytest.raises(InputError, match="quantisation scheme"):
        quantize(tiny_model("llama")[0], "int3", torch.nn.Module())
    with pytest.raises(InputError, match="quantize= one of"):
        steerkit.load_model(quantize="fp4")


@pytest.mark.slow
def test_default_model_int8(default_model):
    sm = default_model
    q = steerkit.load_model(quantize="int8")
    assert q.quantization == "int8" and q.fingerprint() == sm.fingerprint()
    toks = sm.tokenize(["The capital of France is", "Tell me a story about a dragon"], chat=False)
    real = toks.attention_mask.bool()
    v = torch.randn(sm.d_model, generator=torch.Generator().manual_seed(0))
    v = 8 * v / v.norm()
    site = "blocks.10.hook_resid_post"
    base, lq = sm.forward(toks), q.forward(toks)
    with sm.edit(site, add=v):
        sf = sm.forward(toks)
    with q.edit(site, add=v):
        sq = q.forward(toks)
    assert _rel_change_error(sf[real], base[real], sq[real], lq[real]) < 0.2
    assert q.generate(["The capital of France is"], 3, chat=False)[0].strip().startswith("Paris")
