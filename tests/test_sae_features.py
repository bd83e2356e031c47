"""Reading and attributing SAE latents: ``feature_report`` checked against an independent computation on a
tiny random Llama; ``latent_attribution`` checked against activation patching of the top 20 latents on the
real default model (IOI prompts, a random TopK SAE with unit decoder rows)."""
from __future__ import annotations

import pytest
import torch

import steerkit
from steerkit.errors import InputError
from steerkit.probes import feature_report, latent_attribution, logit_diff_metric
from steerkit.sae import SAEWeights

try:
    from tiny_models import tiny_model
except ImportError:  # pragma: no cover
    from tests.tiny_models import tiny_model

SITE = "blocks.1.hook_resid_post"
TEXTS = ["the cat sat on the mat", "a dog ran far away", "hello", "one two three four five six", "xyz"]


@pytest.fixture(scope="module")
def tiny():
    model, tok = tiny_model("llama")
    sm = steerkit.wrap(model, tok, name="tiny-llama")
    yield sm
    sm.reset()


def random_sae(d: int, n: int = 96, arch: str = "relu", seed: int = 0) -> SAEWeights:
    g = torch.Generator().manual_seed(seed)
    W = torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=-1)
    extra = {"k": 16} if arch == "topk" else {}
    return SAEWeights(W.T.clone(), torch.randn(n, generator=g) * 0.05, W.clone(), torch.zeros(d), architecture=arch,
                      **extra)


def test_feature_report_equals_an_independent_reading(tiny):
    sae = random_sae(tiny.d_model)
    latent = 7
    rep = feature_report(tiny, sae, latent, TEXTS, site=SITE, top=3, context=2, after=1, batch_size=2,
                         progress=False)
    acts, n_active, n_tokens = [], 0, 0  # each text alone: its activations at the site
    for t in TEXTS:
        with tiny.record(SITE) as cache:
            tiny.forward([t], chat=False)
        a = sae.encode(cache[SITE][0])[:, latent]
        acts.append(a)
        n_active, n_tokens = n_active + int((a > 0).sum()), n_tokens + a.numel()
    assert rep.n_tokens == n_tokens and rep.density == pytest.approx(n_active / n_tokens)
    peaks = sorted(((float(a.max()), i, int(a.argmax())) for i, a in enumerate(acts) if float(a.max()) > 0),
                   reverse=True)[:3]
    assert [(c["doc"], c["position"]) for c in rep.contexts] == [(i, p) for _, i, p in peaks]
    for c, (v, i, p) in zip(rep.contexts, peaks):
        assert c["value"] == pytest.approx(v, abs=1e-5)
        lo = max(0, p - 2)
        assert c["index"] == p - lo and len(c["tokens"]) == len(c["acts"]) == min(len(acts[i]), p + 2) - lo
        torch.testing.assert_close(torch.tensor(c["acts"]), acts[i][lo:p + 2], atol=1e-5, rtol=1e-5)
    eff = tiny.hf_model.lm_head.weight.float() @ sae.W_dec[latent]
    assert rep.top_logits[0] == (tiny.tokenizer.decode([int(eff.argmax())]), pytest.approx(float(eff.max()), abs=1e-4))
    assert rep.bottom_logits[0][1] == pytest.approx(float(eff.min()), abs=1e-4)
    cos = torch.nn.functional.normalize(sae.W_dec, dim=-1) @ torch.nn.functional.normalize(sae.W_dec[latent], dim=0)
    cos[latent] = -2
    assert rep.neighbours[0] == (int(cos.argmax()), pytest.approx(float(cos.max()), abs=1e-5))
    assert "<span" in rep.contexts_html() and type(rep.plot()).__name__ == "Figure"
    assert set(rep.to_dict()) >= {"latent", "contexts", "density", "top_logits"}


def test_feature_report_and_attribution_errors(tiny):
    sae = random_sae(tiny.d_model)
    with pytest.raises(InputError, match="SAE's site"):
        feature_report(tiny, sae, 1, TEXTS)
    with pytest.raises(InputError, match=r"latent indices in 0\.\.95"):
        feature_report(tiny, sae, 96, TEXTS, site=SITE)
    with pytest.raises(InputError, match="non-empty list of non-empty texts"):
        feature_report(tiny, sae, 1, [], site=SITE)
    with pytest.raises(InputError, match="same number of tokens"):
        latent_attribution(tiny, sae, "a b c", "a b", lambda logits: logits[0, -1, 0], site=SITE)


def test_latent_attribution_ranks_as_activation_patching_on_the_default_model(default_model):
    sm = default_model
    sae = random_sae(sm.d_model, 2048, "topk")
    clean = "When Mary and John went to the store, John gave a drink to"
    corrupted = "When Mary and John went to the store, Mary gave a drink to"
    res = latent_attribution(sm, sae, clean, corrupted, logit_diff_metric(sm, " Mary", " John"),
                             site="blocks.20.hook_resid_post", check=20)
    assert res.clean_metric > 2 and res.corrupted_metric < -2  # the task works, the comparison is not vacuous
    assert len(res.checked) == 20 and res.pearson_r is not None and res.pearson_r > 0.95
    # a random SAE's top latents have near-equal effects (0.39, 0.35, 0.34 ...), so the ranking is checked
    # loosely here: the top latent by attribution is among the top 5 by patching; top_in_top3 as it says
    by_patching = [res.checked[i] for i in torch.tensor(res.patching).abs().argsort(descending=True).tolist()]
    assert res.checked[0] in by_patching[:5] and res.top_in_top3 == (res.checked[0] in by_patching[:3])
    assert res.values.shape == (2048,) and res.per_position.sum(0).allclose(res.values)
    assert max(abs(p) for p in res.patching) > 0.1
