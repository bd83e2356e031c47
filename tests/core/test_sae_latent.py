"""Steering with sparse-autoencoder latents through the one intervention type.

``Intervention.sae_latent`` clamps latents with the SAE's error term kept (``h + (f_c - f) @ W_dec``)
as a torch step of the site's program, or adds decoder rows as a plain ``add`` in the fused kernel.
Checked on a tiny random Llama against a plain torch computation with the SAE's own encode, for every
architecture, per row, at some positions, and in KV-cached generation against the same edit written as
an ``apply`` callable.
"""
from __future__ import annotations

import pytest
import torch

import steerkit
from steerkit import Intervention
from steerkit.errors import InputError
from steerkit.sae import SAEWeights

from tiny_models import no_leftover_hooks

SITE = "blocks.1.hook_resid_post"
PROMPTS = ["abc de", "hello there world", "x"]


def make_sae(d: int, arch: str = "relu", d_sae: int = 128, seed: int = 0) -> SAEWeights:
    g = torch.Generator().manual_seed(seed)
    extra: dict = {}
    if arch == "jumprelu":
        extra["threshold"] = torch.rand(d_sae, generator=g) * 0.2
    if arch == "topk":
        extra["k"] = 8
    if arch == "gated":
        extra.update(b_mag=torch.randn(d_sae, generator=g) * 0.1, r_mag=torch.randn(d_sae, generator=g) * 0.1)
    return SAEWeights(torch.randn(d, d_sae, generator=g) / d ** 0.5, torch.randn(d_sae, generator=g) * 0.1,
                      torch.randn(d_sae, d, generator=g) / d ** 0.5, torch.randn(d, generator=g) * 0.1,
                      architecture=arch, **extra)


def real_tokens(sm, prompts=PROMPTS):
    """[batch, pos, 1]: the real (not padding) tokens of the right-padded batch."""
    n = [len(sm.tokenize(p, chat=False).input_ids[0]) for p in prompts]
    return (torch.arange(max(n))[None, :] < torch.tensor(n)[:, None])[..., None]


def site_values(sm, steering=None, prompts=PROMPTS):
    """The site's values after the steering (registered first, so the recording sees its result)."""
    if steering is None:
        with sm.record(SITE) as cache:
            sm.forward(prompts, chat=False)
        return cache[SITE]
    with sm.steer(steering), sm.record(SITE) as cache:
        sm.forward(prompts, chat=False)
    return cache[SITE]


@pytest.mark.parametrize("arch", ["relu", "jumprelu", "topk", "gated"])
def test_clamp_keeps_the_error_term(tiny, arch):
    sae = make_sae(tiny.d_model, arch)
    h = site_values(tiny)
    f = sae.encode(h)
    latents = [int(i) for i in f[0].abs().sum(0).topk(2).indices] + [5]  # two that fire, one that may not
    got = site_values(tiny, Intervention.sae_latent(SITE, sae, latents, value=[3.0, 0.0, 1.5]))
    real = real_tokens(tiny)  # padding is never steered
    want = h + real * ((torch.tensor([3.0, 0.0, 1.5]) - f[..., latents]) @ sae.W_dec[latents])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    # scale: each latent becomes a multiple of its own activation
    got = site_values(tiny, Intervention.sae_latent(SITE, sae, latents, scale=4.0))
    torch.testing.assert_close(got, h + real * ((3.0 * f[..., latents]) @ sae.W_dec[latents]), atol=2e-5,
                               rtol=1e-5)


def test_clamp_at_positions_and_per_row(tiny):
    sae = make_sae(tiny.d_model)
    h = site_values(tiny)
    clamp = Intervention.sae_latent(SITE, sae, [1, 2], value=5.0, positions="last")
    got = site_values(tiny, clamp)
    lengths = [len(tiny.tokenize(p, chat=False).input_ids[0]) for p in PROMPTS]
    want = h.clone()
    for r, n in enumerate(lengths):  # right-padded rows: the last real token of each
        want[r, n - 1] += (5.0 - sae.encode(h[r, n - 1])[[1, 2]]) @ sae.W_dec[[1, 2]]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    # one steering per row: the clamp on row 0 only, rows 1 and 2 as without steering
    with tiny.steer(rows=[[clamp], None, None]), tiny.record(SITE) as cache:
        tiny.forward(PROMPTS, chat=False)
    torch.testing.assert_close(cache[SITE][0], want[0], atol=2e-5, rtol=1e-5)
    assert torch.equal(cache[SITE][1:], h[1:])


def test_clamp_in_kv_cached_generation_equals_the_same_edit_as_a_callable(tiny):
    sae = make_sae(tiny.d_model, "topk")
    latents, value = [3, 40], torch.tensor([6.0, -2.0])

    def edit(x):  # the clamp written by hand, run at every position of every pass
        f = sae.encode(x)[..., latents]
        return x + (value - f) @ sae.W_dec[latents]
    clamp = Intervention.sae_latent(SITE, sae, latents, value=value)
    got = tiny.generate(PROMPTS, max_new_tokens=6, chat=False, steering=clamp, return_tokens=True)
    want = tiny.generate(PROMPTS, max_new_tokens=6, chat=False, steering=Intervention.apply(SITE, edit),
                         return_tokens=True)
    plain = tiny.generate(PROMPTS, max_new_tokens=6, chat=False, return_tokens=True)
    assert got == want and got != plain


def test_add_mode_is_a_kernel_add_of_the_decoder_rows(tiny):
    sae = make_sae(tiny.d_model)
    iv = Intervention.sae_latent(SITE, sae, [4, 9], scale=2.5, mode="add", positions="last")
    assert iv.op == "add" and iv.scale == 2.5
    torch.testing.assert_close(iv.tensor, sae.W_dec[4] + sae.W_dec[9])
    program = steerkit.interventions.compile_steering([iv], tiny.facts).programs[SITE]
    assert program.table is not None and not program.steps  # the fused kernel, no torch step


def test_clamp_runs_as_a_torch_step_and_composes_with_kernel_ops(tiny):
    sae = make_sae(tiny.d_model)
    v = torch.randn(tiny.d_model)
    both = [Intervention.add(SITE, v, 2.0), Intervention.sae_latent(SITE, sae, [0], value=1.0)]
    program = steerkit.interventions.compile_steering(both, tiny.facts).programs[SITE]
    assert program.table is not None and [step.intervention.op for step in program.steps] == ["latent"]
    h = site_values(tiny)
    got = site_values(tiny, both)
    real = real_tokens(tiny)
    added = h + real * 2.0 * v  # the kernel's add first, then the clamp reads the added stream
    want = added + real * ((1.0 - sae.encode(added)[..., [0]]) @ sae.W_dec[[0]])
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-5)


def test_bad_latent_interventions_get_clear_errors(tiny):
    sae = make_sae(tiny.d_model)
    with pytest.raises(InputError, match="exactly one of value= .* found both"):
        Intervention.sae_latent(SITE, sae, 1, value=1.0, scale=2.0)
    with pytest.raises(InputError, match="exactly one of value= .* found neither"):
        Intervention.sae_latent(SITE, sae, 1)
    with pytest.raises(InputError, match=r"latent indices in 0\.\.127 .* found \[128\]"):
        Intervention.sae_latent(SITE, sae, [128], value=1.0)
    with pytest.raises(InputError, match="distinct latent indices"):
        Intervention.sae_latent(SITE, sae, [2, 2], value=1.0)
    with pytest.raises(InputError, match="one finite clamp value per latent"):
        Intervention.sae_latent(SITE, sae, [1, 2], value=[1.0, 2.0, 3.0])
    with pytest.raises(InputError, match="mode 'clamp' or 'add'"):
        Intervention.sae_latent(SITE, sae, 1, value=1.0, mode="set")
    with pytest.raises(InputError, match="with mode='add', found value="):
        Intervention.sae_latent(SITE, sae, 1, value=1.0, mode="add")
    with pytest.raises(InputError, match="expected a sparse autoencoder"):
        Intervention.sae_latent(SITE, torch.zeros(3), 1, value=1.0)
    transcoder = SAEWeights(sae.W_enc, sae.b_enc, sae.W_dec, sae.b_dec, transcoder=True,
                            apply_b_dec_to_input=False)
    with pytest.raises(InputError, match="found a transcoder"):
        Intervention.sae_latent(SITE, transcoder, 1, value=1.0)
    narrow = make_sae(tiny.d_model // 2)
    with pytest.raises(InputError, match=rf"shape \[{tiny.d_model}\]"), no_leftover_hooks(tiny):
        with tiny.steer(Intervention.sae_latent(SITE, narrow, 1, value=1.0)):
            pass

    class AtSite:  # a stored SAE carries its site
        site, weights = "blocks.0.hook_resid_post", sae
    with pytest.raises(InputError, match="SAE's own site .* found the SAE at 'blocks.0.hook_resid_post'"):
        Intervention.sae_latent(SITE, AtSite(), 1, value=1.0)


def test_from_sae_latent_is_the_latent_addition_as_a_vector(tiny):
    from steerkit.vectors import SAE, Provenance, SteeringVector
    from steerkit.vectors.errors import VectorsError
    sae = SAE(make_sae(tiny.d_model), site=SITE, provenance=Provenance.from_model(tiny))
    vec = SteeringVector.from_sae_latent(sae, 11, strength=3.0)
    assert vec.provenance.method == "sae_latent" and vec.provenance.model_name == tiny.name
    assert site_values(tiny, vec).equal(site_values(tiny, Intervention.sae_latent(SITE, sae, 11, scale=3.0,
                                                                                  mode="add")))
    with pytest.raises(VectorsError, match="expected a stored SAE"):
        SteeringVector.from_sae_latent(sae.weights, 11)


# ----------------------------------------------------------------------------- the stored clamp
def stored(sm, arch: str):
    from steerkit.vectors import SAE, Provenance
    return SAE(make_sae(sm.d_model, arch), SITE, provenance=Provenance.from_model(sm))


@pytest.mark.parametrize("arch", ["relu", "jumprelu", "topk", "gated"])
def test_latent_clamp_artifact_steers_as_the_intervention_and_round_trips(tiny, arch, tmp_path):
    """A stored LatentClamp keeps only the clamped latents (TopK: the whole SAE), survives the store bit for
    bit, and steers exactly as ``Intervention.sae_latent`` on the full SAE; a request scale multiplies the
    value."""
    from steerkit.vectors import LatentClamp, Store
    sae = stored(tiny, arch)
    clamp = LatentClamp.of(sae, [9, 2], value=[4.0, -1.5], positions="last")
    assert clamp.restricted is (arch != "topk") and clamp.sae.d_sae == (128 if arch == "topk" else 2)
    store = Store(tmp_path / "store")
    back = store.load(store.save("c", clamp))
    assert back == clamp and back.latents == (9, 2) and back.positions == "last"
    for scale in (1.0, 0.5):
        want = site_values(tiny, Intervention.sae_latent(SITE, sae, [9, 2], value=[4.0 * scale, -1.5 * scale],
                                                          positions="last"))
        with tiny.steer(back, scale=scale), tiny.record(SITE) as cache:
            tiny.forward(PROMPTS, chat=False)
        torch.testing.assert_close(cache[SITE], want, atol=1e-6, rtol=0)
    assert not torch.equal(want, site_values(tiny))
    by_scale = LatentClamp.of(sae, 9, scale=0.0)  # turn the latent off where it fires
    with tiny.steer(by_scale), tiny.record(SITE) as cache:
        tiny.forward(PROMPTS, chat=False)
    torch.testing.assert_close(cache[SITE], site_values(tiny, Intervention.sae_latent(SITE, sae, 9, scale=0.0)),
                               atol=1e-6, rtol=0)


def test_latent_clamp_refuses_bad_input_and_other_models(tiny):
    from steerkit.vectors import SAE, LatentClamp, ModelMismatchError, Provenance, VectorsError
    sae = stored(tiny, "relu")
    for kwargs, match in (({"latents": 128, "value": 1.0}, "0..127"), ({"latents": [1, 1], "value": 1.0}, "distinct"),
                          ({"latents": 1}, "exactly one of value"), ({"latents": 1, "value": float("nan")}, "finite"),
                          ({"latents": 1, "value": 1.0, "positions": "middle"}, "positions")):
        with pytest.raises(VectorsError, match=match):
            LatentClamp.of(sae, kwargs.pop("latents"), **kwargs)
    wide = SAE(make_sae(32, "relu"), SITE, provenance=Provenance(d_model=32))
    with pytest.raises(ModelMismatchError, match="expected an SAE at blocks.1.hook_resid_post to read 64"):
        LatentClamp.of(wide, 1, value=1.0).to_interventions(tiny)


def test_a_server_request_resolves_a_latent_clamp_and_steers_its_rows_on_the_host_path(tiny, tmp_path):
    """The serving spec names a stored clamp like any artifact: it resolves to the ``latent`` op, the plan
    steers only that request's rows (exactly as ``sm.steer`` would the same activations), the steering slots
    refuse it (a torch step: the host path runs it) and a CUDA-graph engine refuses the request."""
    import numpy as np

    from steerkit.serving import parse_spec, resolve
    from steerkit.kernels.slots import SlotShape
    from steerkit.serving.engine import graph_refusal
    from steerkit.serving.plan import Block, StepPlan
    from steerkit.serving.slots import StepSlots
    from steerkit.vectors import LatentClamp, Store
    sae = stored(tiny, "topk")
    store = Store(tmp_path / "store")
    ref = store.save("c", LatentClamp.of(sae, 5, value=3.0))
    res = resolve(parse_spec({"artifacts": [{"ref": ref, "scale": 2.0}]}), store=store, facts=tiny.facts)
    assert [iv.op for iv in res.interventions] == ["latent"] and res.sites == (SITE,)
    blocks = [Block(0, 3, np.arange(3), 3, res), Block(3, 5, np.arange(2), 2, None)]
    plan = StepPlan(blocks)
    h = torch.randn(5, tiny.d_model, generator=torch.Generator().manual_seed(4))
    out = plan.apply(SITE, h)
    assert torch.equal(out[3:], h[3:])
    want = Intervention.sae_latent(SITE, sae, 5, value=6.0).latent(h[:3])  # the clamp's own edit, request scale 2
    torch.testing.assert_close(out[:3], want, atol=1e-6, rtol=0)
    assert not torch.equal(out[:3], h[:3])
    slots = StepSlots([SITE], d_model=tiny.d_model, max_tokens=8, configs=4)
    assert slots.fill(blocks, total=5) is False  # not a fused-kernel operation: the host plan steers this step
    assert "latent" in graph_refusal(res.compiled, SlotShape(tiny.d_model))
