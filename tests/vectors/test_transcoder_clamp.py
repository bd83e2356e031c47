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
        assert len(reads) == 0
        sm.generate(PROMPTS, max_new_tokens=4, chat=False)  # KV-cached steps
        assert len(reads) == 0
    # a pass interrupted between the two sites leaves an activation; the next pass does not read it
    calls = []

    def fail_once(h):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("interrupted")
        return h
    x, y = recorded(sm)
    with sm.hooks.install(compiled), sm.steer(Intervention.apply(f"blocks.{LAYER}.mlp.hook_post", fail_once)):
        with pytest.raises(RuntimeError, match="interrupted"):
            sm.forward(PROMPTS, chat=False)
        assert len(reads) == 1
        with sm.record([OUT]) as cache:
            sm.forward(PROMPTS, chat=False)
        assert len(reads) == 0
    want = y + real_tokens(sm) * (by_hand(tc, x, y, [1, 2], value=2.0) - y)
    torch.testing.assert_close(cache[OUT], want, atol=2e-5, rtol=1e-5)


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


def test_a_cross_layer_clamp_writes_every_later_block(sm, tmp_path):
    """A cross-layer transcoder's features of block s write every block l >= s: ``clamp_layers`` gives one two-site
    intervention per block, each equal to ``(f' - f) @ W_dec[s][:, l - s]`` with ``f`` read at block s's input."""
    from steerkit.vectors import LatentClamp, Store
    clt = random_transcoders(sm, d_sae=32, activation="jumprelu", cross_layer=True, bias=0.0)
    s, latents = 0, [3, 8]
    ivs = clt.clamp_layers(s, latents, value=[2.0, 1.0])
    assert [(iv.site, iv.latent.source) for iv in ivs] == [
        (f"blocks.{l}.hook_mlp_out", "blocks.0.mlp.hook_in") for l in range(sm.n_layers)]
    src = "blocks.0.mlp.hook_in"
    outs = [f"blocks.{l}.hook_mlp_out" for l in range(sm.n_layers)]
    with sm.record([src] + outs) as plain:
        sm.forward(PROMPTS, chat=False)
    f = clt.encode_layer(plain[src], s)[..., latents]
    real = real_tokens(sm)
    for l, iv in enumerate(ivs):  # each block's part alone: nothing upstream of block l changes
        with sm.steer(iv), sm.record(outs[l]) as cache:
            sm.forward(PROMPTS, chat=False)
        want = plain[outs[l]] + real * ((torch.tensor([2.0, 1.0]) - f) @ clt.W_dec[s][latents, l - s])
        torch.testing.assert_close(cache[outs[l]], want, atol=2e-5, rtol=1e-5)
    clamp = LatentClamp.of_transcoders(clt, {s: latents}, value=[2.0, 1.0])
    assert len(clamp.parts) == sm.n_layers and clamp.value.tolist() == [2.0, 1.0] * sm.n_layers
    store = Store(tmp_path / "store")
    back = store.load(store.save("clt", clamp))
    assert back == clamp
    torch.testing.assert_close(logits_under(sm, back), logits_under(sm, ivs), atol=1e-6, rtol=0)
    with pytest.raises(VectorsError, match="expected written="):
        clt.layer_weights(1)
    with pytest.raises(VectorsError, match=r"expected written= one of the blocks \[1, 2\]"):
        clt.layer_weights(1, written=0)


def test_refusals(sm):
    cross = random_transcoders(sm, d_sae=16, cross_layer=True)
    with pytest.raises(VectorsError, match="found a cross-layer transcoder .* use Transcoders.clamp_layers"):
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


# ---- a stored clamp over several blocks (LatentClamp of transcoders)
def logits_under(sm, steering, prompts=PROMPTS, scale=1.0):
    with sm.steer(steering, scale):
        return sm.forward(prompts, chat=False)


@pytest.mark.parametrize("activation", ["relu", "jumprelu", "topk"])
def test_latent_clamp_of_transcoders_steers_as_the_clamps_and_round_trips(sm, activation, tmp_path):
    from steerkit.vectors import LatentClamp, Provenance, Store
    tc = random_transcoders(sm, d_sae=64, activation=activation, k=6, bias=0.0)
    chosen = [(0, [4, 9], "all"), (2, [1], [1, 2]), (2, [30, 5], "last")]
    prov = Provenance(method="test", method_params={"why": "round trip"})
    clamp = LatentClamp.of_transcoders(tc, chosen, value=[2.0, 0.5, 3.0, 0.0, 1.0], provenance=prov)
    assert clamp.layers == [0, 2] and len(clamp.parts) == 3
    whole = activation == "topk"
    assert clamp.restricted is not whole
    assert [p.sae.d_sae for p in clamp.parts] == ([64, 64, 64] if whole else [2, 1, 2])
    assert clamp.provenance.method_params == {"why": "round trip"}
    assert clamp.provenance.model_fingerprint == tc.provenance.model_fingerprint
    by_hand = [tc.clamp(0, [4, 9], value=[2.0, 0.5]), tc.clamp(2, [1], value=3.0, positions=[1, 2]),
               tc.clamp(2, [30, 5], value=[0.0, 1.0], positions="last")]
    want = logits_under(sm, by_hand)
    torch.testing.assert_close(logits_under(sm, clamp), want, atol=1e-6, rtol=0)
    assert not torch.allclose(want, sm.forward(PROMPTS, chat=False), atol=1e-4)
    store = Store(tmp_path / "store")
    back = store.load(store.save("supernode", clamp))
    assert back == clamp and back.provenance.method_params == {"why": "round trip"}
    assert [(p.sae.site, p.sae.output_site, p.latents, p.positions) for p in back.parts] == \
        [(p.sae.site, p.sae.output_site, p.latents, p.positions) for p in clamp.parts]
    assert torch.equal(logits_under(sm, back), logits_under(sm, clamp))
    # a request scale multiplies the values
    half = [tc.clamp(0, [4, 9], value=[1.0, 0.25]), tc.clamp(2, [1], value=1.5, positions=[1, 2]),
            tc.clamp(2, [30, 5], value=[0.0, 0.5], positions="last")]
    torch.testing.assert_close(logits_under(sm, back, scale=0.5), logits_under(sm, half), atol=1e-6, rtol=0)


def test_latent_clamp_of_transcoders_ablates_per_row_and_refuses_bad_input(sm, tmp_path):
    from steerkit.vectors import ArtifactFormatError, LatentClamp, Store
    tc = random_transcoders(sm, d_sae=32, activation="relu", bias=0.0)
    clamp = LatentClamp.of_transcoders(tc, {1: [2, 3], 2: [5]}, scale=0.0)
    plain = sm.forward(PROMPTS, chat=False)
    with sm.steer(rows=[clamp, None, None]):
        per_row = sm.forward(PROMPTS, chat=False)
    torch.testing.assert_close(per_row[0], logits_under(sm, clamp)[0], atol=1e-6, rtol=0)
    assert torch.equal(per_row[1:], plain[1:])
    with pytest.raises(VectorsError, match="exactly one of value="):
        LatentClamp.of_transcoders(tc, {1: [2]})
    with pytest.raises(VectorsError, match=r"block 1: expected latent indices in 0\.\.31"):
        LatentClamp.of_transcoders(tc, {1: [32]}, scale=0.0)
    with pytest.raises(VectorsError, match=r"one clamp value per feature \(3\), found 2"):
        LatentClamp.of_transcoders(tc, {1: [2, 3], 2: [5]}, value=[1.0, 2.0])
    tensors, meta = clamp.to_payload()
    meta["fields"]["more"][0]["latents"] = ["x"]
    with pytest.raises(ArtifactFormatError, match="latents as a list of ints"):
        LatentClamp.from_payload(tensors, meta)
    tensors, meta = clamp.to_payload()
    tensors["more.7.W_enc"] = tensors["more.0.W_enc"]
    with pytest.raises(ArtifactFormatError, match="'more.<i>.\\*'"):
        LatentClamp.from_payload(tensors, meta)
    store = Store(tmp_path / "s")
    assert store.load(store.save("off", clamp)) == clamp


def test_a_latent_clamp_of_one_transcoder_sae_is_its_two_site_clamp(sm):
    from steerkit.vectors import LatentClamp
    tc = random_transcoders(sm, d_sae=32, activation="jumprelu", bias=0.0)
    clamp = LatentClamp.of(tc.layer_sae(1), [2, 6], value=[2.0, -1.0], positions="last")
    (iv,) = clamp.to_interventions(sm.facts)
    assert (iv.site, iv.latent.source, iv.positions) == (OUT, IN, "last")
    torch.testing.assert_close(logits_under(sm, clamp), logits_under(sm, tc.clamp(1, [2, 6], value=[2.0, -1.0],
                                                                                   positions="last")), atol=1e-6, rtol=0)
