"""The app's logit lens is the probes' (``steerkit.probes.lens``): on a family that soft-caps its final logits
(Gemma 2) the Profiles page's lens tokens carry the capped logits the model itself computes, not
``unembed(norm(x))``; the app's old names of the lens and of its figures still work and warn."""
from __future__ import annotations

import pytest
import torch

import steerkit
from steerkit.probes.lens import unembed, vector_lens
from tiny_models import tiny_softcapped

CAP = 0.1  # the tiny model's raw logits reach about 0.5


@pytest.fixture(scope="module")
def capped():
    model, tok = tiny_softcapped(CAP)
    return steerkit.wrap(model, tok, name="tiny soft-capped gemma2")


def test_the_lens_of_a_vector_is_soft_capped_as_the_models_logits(capped):
    sm = capped
    with sm.record(f"blocks.{sm.n_layers - 1}.hook_resid_post") as cache:
        logits = sm.forward("Hello there", chat=False)
    last = cache[f"blocks.{sm.n_layers - 1}.hook_resid_post"][0, -1]
    assert float(logits.abs().max()) <= CAP  # the model caps its logits ...
    assert torch.allclose(unembed(sm, last), logits[0, -1].float(), atol=1e-5)  # ... and so does the lens
    top, bottom = vector_lens(sm, last, k=5)
    want = logits[0, -1].float().topk(5)
    assert [t for t, _ in top] == [sm.tokenizer.decode([int(i)]) for i in want.indices]
    assert torch.allclose(torch.tensor([v for _, v in top]), want.values, atol=1e-5)
    # what the app computed before: unembed(norm(x)) without the capping, past the cap here
    norm, head = sm.adapter.final_norm_module(sm.hf_model), sm.adapter.unembed_module(sm.hf_model)
    with torch.inference_mode():
        raw = head(norm(last.reshape(1, 1, -1))).reshape(-1)
    assert float(raw.abs().max()) > 2 * CAP and max(abs(v) for _, v in top + bottom) <= CAP
    capped_raw = CAP * torch.tanh(raw.float() / CAP)
    assert torch.allclose(torch.tensor([v for _, v in top]), capped_raw.topk(5).values, atol=1e-5)


def test_the_profiles_page_lens_uses_the_probes_lens(capped):
    from steerkit.apps.analysis import divergence_profile

    a, b = ["I love this.", "What a great day."], ["I hate this.", "What an awful day."]
    prof = divergence_profile(capped, a, b, lens_k=4)
    for j in range(len(prof.layers)):
        top, bottom = vector_lens(capped, torch.as_tensor(prof.mean_diff[j]), k=4)
        for got, want in ((prof.lens_top[j], top), (prof.lens_bottom[j], bottom)):
            assert [t for t, _ in got] == [t for t, _ in want]
            assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=1e-6)
        assert max(abs(v) for _, v in prof.lens_top[j] + prof.lens_bottom[j]) <= CAP


def test_the_apps_old_names_warn_and_name_the_new_ones(capped):
    import steerkit.apps.analysis as analysis
    from steerkit.apps import figures
    from steerkit.apps.analysis import common

    for module in (analysis, common):
        with pytest.warns(DeprecationWarning, match="steerkit.probes.lens.vector_lens"):
            assert module.logit_lens is vector_lens
    with pytest.warns(DeprecationWarning, match="steerkit.apps.figures.vector_lens_figure"):
        assert figures.lens_figure is figures.vector_lens_figure
    with pytest.warns(DeprecationWarning, match="steerkit.apps.figures.patching_run_figure"):
        assert figures.patching_figure is figures.patching_run_figure
    with pytest.warns(DeprecationWarning):
        from steerkit.apps.figures import lens_figure  # noqa: F401  (a from-import warns too)
