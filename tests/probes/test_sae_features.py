"""Reading and attributing SAE latents: ``feature_report`` checked against an independent computation on a
tiny random Llama, as is ``top_latents`` (the first token left out); ``feature_contexts`` (many latents at several
sites in one pass per batch) against ``feature_report`` of each latent; ``latent_attribution`` checked against
activation patching of the top 20 latents on the real default model (IOI prompts, a random TopK SAE with unit decoder
rows)."""
from __future__ import annotations

import pytest
import torch

from steerkit.errors import InputError
from steerkit.probes import feature_contexts, feature_report, latent_attribution, logit_diff_metric, top_latents
from steerkit.sae import SAEWeights


SITE = "blocks.1.hook_resid_post"
TEXTS = ["the cat sat on the mat", "a dog ran far away", "hello", "one two three four five six", "xyz"]


def random_sae(d: int, n: int = 96, arch: str = "relu", seed: int = 0, k: int = 16) -> SAEWeights:
    g = torch.Generator().manual_seed(seed)
    W = torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=-1)
    extra = {"k": k} if arch == "topk" else {}
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
        counted = a[1:] if a.numel() > 1 else a  # the first token is not counted (the attention sink)
        n_active, n_tokens = n_active + int((counted > 0).sum()), n_tokens + counted.numel()
    assert rep.n_tokens == n_tokens and rep.density == pytest.approx(n_active / n_tokens)
    first = [1 if a.numel() > 1 else 0 for a in acts]
    peaks = sorted(((float(a[s:].max()), i, s + int(a[s:].argmax())) for i, (a, s) in enumerate(zip(acts, first))
                    if float(a[s:].max()) > 0), reverse=True)[:3]
    assert [(c["doc"], c["position"]) for c in rep.contexts] == [(i, p) for _, i, p in peaks]
    for c, (v, i, p) in zip(rep.contexts, peaks):
        assert c["value"] == pytest.approx(v, abs=1e-5)
        lo = max(0, p - 2)
        assert c["index"] == p - lo and len(c["tokens"]) == len(c["acts"]) == min(len(acts[i]), p + 2) - lo
        torch.testing.assert_close(torch.tensor(c["acts"]), acts[i][lo:p + 2], atol=1e-5, rtol=1e-5)
        ids = tiny.tokenize([TEXTS[i]], chat=False).input_ids[0].tolist()  # the text alone: no padding
        assert c["tokens"] == [tiny.tokenizer.decode([t]) for t in ids[lo:p + 2]], (i, c["tokens"])
    eff = tiny.hf_model.lm_head.weight.float() @ sae.W_dec[latent]
    assert rep.top_logits[0] == (tiny.tokenizer.decode([int(eff.argmax())]), pytest.approx(float(eff.max()), abs=1e-4))
    assert rep.bottom_logits[0][1] == pytest.approx(float(eff.min()), abs=1e-4)
    cos = torch.nn.functional.normalize(sae.W_dec, dim=-1) @ torch.nn.functional.normalize(sae.W_dec[latent], dim=0)
    cos[latent] = -2
    assert rep.neighbours[0] == (int(cos.argmax()), pytest.approx(float(cos.max()), abs=1e-5))
    assert "<span" in rep.contexts_html() and type(rep.plot()).__name__ == "Figure"
    assert set(rep.to_dict()) >= {"latent", "contexts", "density", "top_logits"}


@pytest.mark.parametrize("arch", ["relu", "topk"])
def test_top_latents_equals_an_independent_reading(tiny, arch):
    sae = random_sae(tiny.d_model, arch=arch, seed=2)
    text = TEXTS[3]
    hits = top_latents(tiny, sae, text, k=12, site=SITE)
    with tiny.record(SITE) as cache:  # the site recorded, every latent encoded, the peak over tokens
        tiny.forward([text], chat=False)
    f = sae.encode(cache[SITE][0])  # [T, d_sae]
    ids = tiny.tokenize([text], chat=False).input_ids[0].tolist()
    assert hits.tokens == [tiny.tokenizer.decode([t]) for t in ids] and len(ids) == f.shape[0]
    counted = f[1:]  # the first token (the attention sink) is not counted
    peaks = sorted(((float(counted[:, i].max()), i) for i in range(sae.d_sae) if float(counted[:, i].max()) > 0),
                   reverse=True)
    assert len(peaks) > 12  # the cut at k matters
    assert [r["latent"] for r in hits.rows] == [i for _, i in peaks[:12]]
    for r in hits.rows:
        a = counted[:, r["latent"]]
        assert r["max"] == pytest.approx(float(a.max()), abs=1e-6) and r["position"] == int(a.argmax()) + 1
        assert r["mean"] == pytest.approx(float(a.mean()), abs=1e-6) and r["count"] == int((a > 0).sum())
        assert r["token"] == hits.tokens[r["position"]]
    assert hits.to_dict()["rows"] == hits.rows and hits.site == SITE and hits.text == text
    few = top_latents(tiny, sae, "xyz", k=500, site=SITE)
    assert 0 < len(few.rows) < sae.d_sae and all(r["max"] > 0 for r in few.rows)  # never one that fires nowhere
    one = top_latents(tiny, sae, "x", k=3, site=SITE)  # a one-token text: that token counts
    assert len(one.tokens) == 1 and [r["position"] for r in one.rows] == [0, 0, 0]
    with pytest.raises(InputError, match="non-empty text"):
        top_latents(tiny, sae, "", site=SITE)
    with pytest.raises(InputError, match="k as an int >= 1"):
        top_latents(tiny, sae, text, k=0, site=SITE)


@pytest.mark.parametrize("arch", ["relu", "topk"])
def test_feature_contexts_reads_latents_at_two_sites_as_feature_report(tiny, arch, monkeypatch):
    """Several latents at two sites, one forward pass per batch for both: each latent's contexts and density are
    those feature_report gives it alone (the same windows, the same first tokens left out, the same heap)."""
    other = "blocks.0.hook_mlp_out"
    saes = {other: random_sae(tiny.d_model, arch=arch, seed=3, k=48), SITE: random_sae(tiny.d_model, arch=arch, seed=4,
                                                                                     k=48)}
    latents = {other: [40, 2, 7], SITE: [7, 11, 95, 0]}
    passes = []
    forward = tiny.forward
    with monkeypatch.context() as m:
        m.setattr(tiny, "forward", lambda *a, **k: passes.append(1) or forward(*a, **k))
        got = feature_contexts(tiny, {s: (saes[s], latents[s]) for s in saes}, TEXTS, top=3, context=2, after=1,
                               batch_size=2, progress=False)
    assert len(passes) == 3  # 5 texts in batches of 2, both sites recorded in each pass
    assert list(got) == [(s, i) for s in saes for i in latents[s]]
    full = 0
    for (site, i), r in got.items():
        want = feature_report(tiny, saes[site], i, TEXTS, site=site, top=3, context=2, after=1, batch_size=2,
                              progress=False)
        assert (r.site, r.latent) == (site, i)
        assert r.contexts == want.contexts, (site, i)
        assert r.density == want.density and r.n_tokens == want.n_tokens and r.n_active == want.values.numel()
        full += len(r.contexts) == 3 and r.n_active > 3
    assert full >= 3, "latents that fill their 3 contexts from the 5 texts: the heap's choice is compared"
    # one latent alone, the one-site call and the defaults: the same reading
    alone = feature_contexts(tiny, {SITE: (saes[SITE], 11)}, TEXTS, progress=False)[(SITE, 11)]
    want = feature_report(tiny, saes[SITE], 11, TEXTS, site=SITE, top=3, progress=False)
    assert alone.contexts == want.contexts and alone.density == want.density
    assert "LatentContexts(site='blocks.1.hook_resid_post', latent=11" in repr(alone)


def test_feature_contexts_bounds(tiny):
    from steerkit.vectors import SAE
    sae = random_sae(tiny.d_model)
    good = {SITE: (sae, [1, 2])}
    for kwargs, message in [({"top": 0}, "expected top, batch_size >= 1 and context, after >= 0"),
                            ({"batch_size": 0}, "top, batch_size >= 1"), ({"context": -1}, "context, after >= 0"),
                            ({"after": -2}, "context, after >= 0"), ({"top": 1.5}, "whole numbers"),
                            ({"top": True}, "whole numbers"), ({"batch_size": "4"}, "whole numbers")]:
        with pytest.raises(InputError, match=message):
            feature_contexts(tiny, good, TEXTS, progress=False, **kwargs)
    for reads, dataset, message in [
            ({}, TEXTS, "expected reads as a non-empty dict"), ([(SITE, sae)], TEXTS, "non-empty dict .* found list"),
            ({SITE: sae}, TEXTS, "as a pair \\(sae, latents\\)"), ({SITE: (sae, [96])}, TEXTS, r"latent indices in 0\.\.95"),
            ({SITE: (sae, [1, 1])}, TEXTS, "distinct latent indices"), ({SITE: (sae, [])}, TEXTS, "at least one latent"),
            ({SITE: (sae, "x")}, TEXTS, "latent indices"),
            ({"blocks.0.hook_resid_post": (SAE(sae, SITE), [1])}, TEXTS, "the SAE's own site"),
            ({0: (sae, [1])}, TEXTS, "the SAE's site"),
            (good, [], "non-empty list of non-empty texts"), (good, "one text", "non-empty list of non-empty texts"),
            (good, ["a", ""], "non-empty list of non-empty texts"), (good, ["a", 3], "non-empty list")]:
        with pytest.raises(InputError, match=message):
            feature_contexts(tiny, reads, dataset, progress=False)


def test_feature_report_and_attribution_errors(tiny):
    sae = random_sae(tiny.d_model)
    with pytest.raises(InputError, match="SAE's site"):
        feature_report(tiny, sae, 1, TEXTS)
    with pytest.raises(InputError, match=r"latent indices in 0\.\.95"):
        feature_report(tiny, sae, 96, TEXTS, site=SITE)
    with pytest.raises(InputError, match="non-empty list of non-empty texts"):
        feature_report(tiny, sae, 1, [], site=SITE)
    with pytest.raises(InputError, match="k_neighbours >= 1"):
        feature_report(tiny, sae, 1, TEXTS, site=SITE, k_neighbours=0)
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
