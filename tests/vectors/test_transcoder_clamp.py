"""A transcoder's latents clamped through the one compile step (``Transcoders.clamp``): a two-site edit that encodes at
``blocks.{l}.mlp.hook_in`` and adds ``(f' - f) @ W_dec`` at ``blocks.{l}.hook_mlp_out``, the MLP's real output kept.
Checked on a tiny random Llama against the formula computed by hand from recorded ``mlp.hook_in`` / ``hook_mlp_out``
for ReLU, JumpReLU (with a skip connection) and TopK sets, with value and scale, at positions and per row; a clamp to
the latents' own values changes nothing; the source's activation never outlives its pass; the refusals."""
from __future__ import annotations

import pytest
import torch

import steerkit
from steerkit import Intervention
from steerkit.errors import InputError
from steerkit.interventions import LatentEdit, SiteReads, compile_steering
from steerkit.vectors import VectorsError
from tiny_models import random_transcoders, tiny_circuit_llama

PROMPTS = ["abc de", "hello there world", "x"]
LAYER = 1
IN, OUT = f"blocks.{LAYER}.mlp.hook_in", f"blocks.{LAYER}.hook_mlp_out"


@pytest.fixture(scope="module")
def sm():
    model, tok = tiny_circuit_llama(seed=5)
    return steerkit.wrap(model, tok, name="tiny-circuit-llama")


def real_tokens(sm, prompts=PROMPTS):
    """[batch, pos, 1]: the real (not padding) tokens of the right-padded batch."""
    n = [len(sm.tokenize(p, chat=False).input_ids[0]) for p in prompts]
    return (torch.arange(max(n))[None, :] < torch.tensor(n)[:, None])[..., None]


def recorded(sm, steering=None, rows=None, prompts=PROMPTS):
    """``(mlp.hook_in, hook_mlp_out)`` of the layer, after the steering (registered first)."""
    if steering is None and rows is None:
        with sm.record([IN, OUT]) as cache:
            sm.forward(prompts, chat=False)
    else:
        with sm.steer(steering, rows=rows), sm.record([IN, OUT]) as cache:
            sm.forward(prompts, chat=False)
    return cache[IN], cache[OUT]


def by_hand(tc, x, y, latents, value=None, scale=None):
    """The two-site formula: ``y + (f' - f) @ W_dec[l][latents]`` with ``f`` the transcoder's latents of ``x``."""
    f = tc.encode_layer(x, LAYER)[..., latents]
    new = torch.as_tensor(value, dtype=f.dtype).expand_as(f) if value is not None else f * scale
    return y + (new - f) @ tc.W_dec[LAYER][latents]


@pytest.mark.parametrize("options", [dict(activation="relu"), dict(activation="jumprelu", skip=True),
                                     dict(activation="topk", k=6)], ids=["relu", "jumprelu-skip", "topk"])
def test_clamp_equals_the_two_site_formula(sm, options):
    tc = random_transcoders(sm, d_sae=64, bias=0.0, **options)
    x, y = recorded(sm)
    f = tc.encode_layer(x, LAYER)
    latents = [int(i) for i in (f[0] != 0).sum(0).topk(2).indices] + [7]  # two that fire, one that may not
    real = real_tokens(sm)
    got_x, got_y = recorded(sm, tc.clamp(LAYER, latents, value=[3.0, 0.0, 1.5]))
    assert torch.equal(got_x, x)  # the input site is read, not edited
    want = y + real * (by_hand(tc, x, y, latents, value=torch.tensor([3.0, 0.0, 1.5])) - y)
    torch.testing.assert_close(got_y, want, atol=2e-5, rtol=1e-5)
    assert not torch.allclose(got_y, y, atol=1e-3)
    _, got_y = recorded(sm, tc.clamp(LAYER, latents, scale=0.0))  # ablation: the features' part removed
    torch.testing.assert_close(got_y, y + real * (by_hand(tc, x, y, latents, scale=0.0) - y), atol=2e-5, rtol=1e-5)
    _, same = recorded(sm, tc.clamp(LAYER, latents, scale=1.0))  # clamped to their own values: nothing changes
    torch.testing.assert_close(same, y, atol=1e-6, rtol=0)


def test_clamp_at_positions_and_per_row(sm):
    tc = random_transcoders(sm, d_sae=64, activation="topk", k=6)
    x, y = recorded(sm)
    latents = [int(i) for i in (tc.encode_layer(x, LAYER)[1] != 0).sum(0).topk(2).indices]
    clamp = tc.clamp(LAYER, latents, value=4.0, positions="last")
    _, got = recorded(sm, clamp)
    lengths = [len(sm.tokenize(p, chat=False).input_ids[0]) for p in PROMPTS]
    want = y.clone()
    for r, n in enumerate(lengths):  # right-padded rows: the last real token of each
        want[r, n - 1] = by_hand(tc, x[r, n - 1], y[r, n - 1], latents, value=4.0)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    # prompt-token indices, and one steering per row: row 1 clamped at positions 1 and 2, row 2 ablated everywhere
    at = tc.clamp(LAYER, latents, value=4.0, positions=[1, 2])
    off = tc.clamp(LAYER, latents, scale=0.0)
    _, got = recorded(sm, rows=[None, [at], [off]])
    assert torch.equal(got[0], y[0])
    want1 = y[1].clone()
    want1[1:3] = by_hand(tc, x[1, 1:3], y[1, 1:3], latents, value=4.0)
    torch.testing.assert_close(got[1], want1, atol=2e-5, rtol=1e-5)
    n2 = lengths[2]
    torch.testing.assert_close(got[2, :n2], by_hand(tc, x[2, :n2], y[2, :n2], latents, scale=0.0), atol=2e-5, rtol=1e-5)


def test_the_source_activation_does_not_outlive_its_pass(sm):
    tc = random_transcoders(sm, d_sae=64, activation="relu")
    compiled = sm.compile(tc.clamp(LAYER, [1, 2], value=2.0))
    assert set(compiled.programs) == {IN, OUT}
    reads = compiled.reads
    assert isinstance(reads, SiteReads) and reads.readers == {IN: (OUT,)}
    assert compiled.programs[IN].reads is reads and compiled.programs[OUT].reads is reads
    assert compiled.programs[IN].stores and not compiled.programs[OUT].stores
    with sm.hooks.install(compiled):
        sm.forward(PROMPTS, chat=False)
        assert reads._held == {}
        sm.generate(PROMPTS, max_new_tokens=4, chat=False)  # KV-cached steps
        assert reads._held == {}


def test_clamp_in_kv_cached_generation_equals_a_full_forward(sm):
    """Greedy generation under the clamp, step by step with the KV cache, equals the argmax of a full steered forward
    pass over the tokens so far (the clamp at every position)."""
    tc = random_transcoders(sm, d_sae=64, activation="jumprelu", bias=0.0)
    clamp = tc.clamp(LAYER, [0, 3, 9], value=8.0)
    got = sm.generate("hello there", max_new_tokens=4, chat=False, steering=clamp, return_tokens=True)[0]
    ids = sm.tokenize("hello there", chat=False).input_ids[0].tolist()
    with sm.steer(clamp):
        for _ in range(4):
            logits = sm.forward(steerkit.Tokens(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)))
            ids.append(int(logits[0, -1].argmax()))
    assert list(got)[-4:] == ids[-4:]


def test_layer_weights_are_the_layers_transcoder(sm):
    for options in (dict(activation="relu", skip=True), dict(activation="jumprelu"), dict(activation="topk", k=5)):
        tc = random_transcoders(sm, d_sae=48, **options)
        x = torch.randn(5, sm.d_model)
        w = tc.layer_weights(2)
        assert w.transcoder and not w.apply_b_dec_to_input
        torch.testing.assert_close(w.encode(x), tc.encode_layer(x, 2))
        f = tc.encode_layer(x, 2)
        torch.testing.assert_close(w.decode(f, x), tc.decode(torch.stack([f] * tc.n_layers),
                                                             torch.stack([x] * tc.n_layers))[2])
        sae = tc.layer_sae(2)
        assert (sae.site, sae.output_site) == tc.sites(2) and sae.check(sm) == []


def test_refusals(sm):
    cross = random_transcoders(sm, d_sae=16, cross_layer=True)
    with pytest.raises(VectorsError, match="cross-layer transcoder"):
        cross.clamp(0, [1], scale=0.0)
    tc = random_transcoders(sm, d_sae=16, activation="relu")
    with pytest.raises(InputError, match="exactly one of value="):
        tc.clamp(0, [1], value=1.0, scale=2.0)
    with pytest.raises(InputError, match=r"latent indices in 0\.\.15"):
        tc.clamp(0, [16], value=1.0)
    w = tc.layer_weights(0)
    with pytest.raises(InputError, match="expected source="):
        Intervention.sae_latent("blocks.0.hook_mlp_out", w, [1], value=1.0)
    with pytest.raises(InputError, match="expected a transcoder for an edit that reads another site"):
        LatentEdit.of(steerkit.sae.SAEWeights(torch.eye(4), torch.zeros(4), torch.eye(4), torch.zeros(4)), [1],
                      value=1.0, source="blocks.0.mlp.hook_in")
    # the source checked against the model: a site it has, as wide as the encoder reads
    bad_site = Intervention.sae_latent("blocks.0.hook_mlp_out", w, [1], value=1.0, source="blocks.9.mlp.hook_in")
    with pytest.raises(InputError, match="source of the latent edit at 'blocks.0.hook_mlp_out' to be a site"):
        compile_steering([bad_site], sm.facts)
    narrow = Intervention.sae_latent("blocks.0.hook_mlp_out", w, [1], value=1.0, source="blocks.0.mlp.hook_post")
    with pytest.raises(InputError, match=r"read \d+ features at 'blocks.0.mlp.hook_post', found d_in=64"):
        compile_steering([narrow], sm.facts)
    # a source that runs after the edit in the pass: one clear error when it runs
    late = Intervention.sae_latent("blocks.0.hook_mlp_out", w, [1], value=1.0, source="blocks.2.mlp.hook_in")
    with sm.steer(late), pytest.raises(InputError, match="from the same forward pass"):
        sm.forward("hello", chat=False)
    assert sm.hook_count() == 0
