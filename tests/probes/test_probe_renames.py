"""One meaning per public name in the probes: the temporal method's handle is ``steer_injection``
(``steerkit.kernels.inject`` is the kernel's injection), its old name warns; the critique method's lens of a
vector is the probes' lens (soft-capped where the model caps its logits)."""
from __future__ import annotations

import pytest
import torch

import steerkit
from steerkit.probes.lens import vector_lens
from tiny_models import tiny_softcapped


def test_the_temporal_handle_is_steer_injection_and_its_old_name_warns():
    import steerkit.probes as probes
    from steerkit.kernels import inject as kernel_inject
    from steerkit.probes.methods import temporal

    with pytest.warns(DeprecationWarning, match="steerkit.probes.methods.temporal.steer_injection"):
        assert probes.steer_injection is temporal.steer_injection  # a method's name: it lives with the method
    for module in (temporal, probes):
        with pytest.warns(DeprecationWarning, match="steer_injection"):
            assert module.inject is temporal.steer_injection
    assert kernel_inject is not temporal.steer_injection and kernel_inject.__module__ == "steerkit.kernels.fused"


def test_the_critique_lens_is_the_probes_lens():
    from steerkit.probes.methods.critique import logit_lens_tokens

    sm = steerkit.wrap(*tiny_softcapped(0.1), name="tiny soft-capped gemma2")
    v = torch.randn(sm.d_model, generator=torch.Generator().manual_seed(0))
    top, bottom = vector_lens(sm, v, k=3)
    assert logit_lens_tokens(sm, v, k=3) == {"top": top, "bottom": bottom}
    assert max(abs(x) for _, x in top + bottom) <= 0.1
