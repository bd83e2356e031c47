"""An attached transcoder's latents as recordable sub-sites of its input site (``sm.attach_transcoders``,
``sm.attach_sae`` of a transcoder ``SAE``), sae-lens's names: ``{site}.hook_sae_acts_pre`` / ``hook_sae_acts_post``
equal ``Transcoders.encode_layer`` of the recorded input (without / with the activation), ``hook_sae_output`` its
prediction; the reconstruction and error of an autoencoder are refused for a transcoder; the handle removes every
block's hook; a splice and a cross-layer set are refused."""
from __future__ import annotations

import pytest
import torch

import steerkit
from steerkit.errors import HookNameError, InputError
from tiny_models import random_transcoders, tiny_circuit_llama

PROMPTS = ["abc de", "hello there world"]


@pytest.fixture(scope="module")
def sm():
    model, tok = tiny_circuit_llama(seed=2)
    return steerkit.wrap(model, tok, name="tiny-circuit-llama")


@pytest.mark.parametrize("options", [dict(activation="relu"), dict(activation="jumprelu", skip=True),
                                     dict(activation="topk", k=5)], ids=["relu", "jumprelu-skip", "topk"])
def test_recorded_latents_equal_encode_layer(sm, options):
    tc = random_transcoders(sm, d_sae=48, **options)
    layers = [0, 2]
    with sm.attach_transcoders(tc, layers=layers) as h:
        assert h.layers == layers and sm.hook_count() == 2
        subs = {l: h.names(l) for l in layers}
        assert subs[2] == [f"blocks.2.mlp.hook_in.{k}" for k in
                           ("hook_sae_input", "hook_sae_acts_post", "hook_sae_acts_pre", "hook_sae_output")]
        names = [f"blocks.{l}.mlp.hook_in" for l in layers] + [n for l in layers for n in subs[l]]
        with sm.record(names) as cache:
            sm.forward(PROMPTS, chat=False)
        with sm.record([subs[2][1]], positions="last") as last:
            sm.forward(PROMPTS, chat=False)
    assert not h.active and sm.hook_count() == 0
    n = [len(sm.tokenize(p, chat=False).input_ids[0]) for p in PROMPTS]
    real = torch.arange(max(n))[None, :] < torch.tensor(n)[:, None]  # the sub-sites are computed on real tokens only
    for l in layers:
        x = cache[f"blocks.{l}.mlp.hook_in"][real]
        inp, acts, pre, out = (cache[name][real] for name in subs[l])
        torch.testing.assert_close(inp, x)
        torch.testing.assert_close(acts, tc.encode_layer(x, l))
        torch.testing.assert_close(pre, tc.encode_layer(x, l, apply_activation_function=False))
        torch.testing.assert_close(out, tc.layer_weights(l).decode(acts, x))
        assert (acts != 0).any() and (acts == 0).any()
    x2 = cache["blocks.2.mlp.hook_in"]
    torch.testing.assert_close(last[subs[2][1]], tc.encode_layer(x2[torch.arange(2), torch.tensor(n) - 1], 2))
    with pytest.raises(HookNameError, match="expected an SAE attached at 'blocks.2.mlp.hook_in'"):
        sm.record(subs[2][1])


def test_a_transcoder_sae_attaches_at_its_input_site(sm):
    tc = random_transcoders(sm, d_sae=32, activation="relu")
    sae = tc.layer_sae(1)
    site = "blocks.1.mlp.hook_in"
    with sm.attach_sae(sae) as h, sm.record([site, h.names[1]]) as cache:
        sm.forward("hello", chat=False)
    torch.testing.assert_close(cache[h.names[1]], tc.encode_layer(cache[site], 1))
    with pytest.raises(InputError, match="found a transcoder, which predicts another site"):
        sm.attach_sae(sae, splice=True)
    assert sm.hook_count() == 0


def test_refusals_leave_no_hooks(sm):
    tc = random_transcoders(sm, d_sae=32, activation="relu")
    with sm.attach_transcoders(tc, layers="1") as h:
        for kind in ("hook_sae_recons", "hook_sae_error"):
            with pytest.raises(InputError, match=r"a transcoder predicts another site: record its prediction"):
                sm.record([f"blocks.1.mlp.hook_in.{kind}"])
        assert sm.hook_count() == 1  # the transcoder's own hook only
        with pytest.raises(InputError, match=r"expected one of the attached blocks \[1\]"):
            h.names(0)
    with pytest.raises(InputError, match="found a cross-layer transcoder"):
        sm.attach_transcoders(random_transcoders(sm, d_sae=16, cross_layer=True))
    with pytest.raises(InputError, match="expected a steerkit.vectors.Transcoders"):
        sm.attach_transcoders(tc.layer_sae(0))
    assert sm.hook_count() == 0 and sm.hooks.saes == {}


def test_an_autoencoder_has_the_two_new_sub_sites_too(sm):
    from steerkit.sae import SAEWeights
    g = torch.Generator().manual_seed(1)
    w = SAEWeights(torch.randn(64, 96, generator=g) / 8, torch.zeros(96), torch.randn(96, 64, generator=g) / 8,
                   torch.zeros(64))
    site = "blocks.0.hook_resid_post"
    names = [site, f"{site}.hook_sae_acts_pre", f"{site}.hook_sae_output", f"{site}.hook_sae_recons"]
    with sm.attach_sae(w, site) as h, sm.record(names) as cache:
        sm.forward("hello there", chat=False)
    assert len(h.names) == 4
    x = cache[site]
    torch.testing.assert_close(cache[names[1]], w.pre_acts(x))
    torch.testing.assert_close(cache[names[2]], w.reconstruct(x))
    assert torch.equal(cache[names[2]], cache[names[3]])
