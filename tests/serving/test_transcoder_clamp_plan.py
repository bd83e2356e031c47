"""A stored transcoder clamp named by a server request: the spec resolves it to one two-site ``latent`` step per
block, the steering slots refuse it (the host path runs it), and the host plan -- called at the input site, then at
the output site, as an engine's hooks call it -- steers only that request's rows, exactly by the two-site formula."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import steerkit
from steerkit.serving import parse_spec, resolve
from steerkit.serving.plan import Block, StepPlan
from steerkit.vectors import LatentClamp, Store
from tiny_models import random_transcoders, tiny_circuit_llama


@pytest.fixture(scope="module")
def sm():
    model, tok = tiny_circuit_llama(seed=1)
    return steerkit.wrap(model, tok, name="tiny-circuit-llama")


def test_a_request_steers_its_rows_through_both_sites(sm, tmp_path):
    tc = random_transcoders(sm, d_sae=32, activation="topk", k=5)
    store = Store(tmp_path / "store")
    ref = store.save("supernode", LatentClamp.of_transcoders(tc, {1: [2, 7]}, value=3.0))
    res = resolve(parse_spec({"artifacts": [{"ref": ref, "scale": 2.0}]}), store=store, facts=sm.facts)
    site_in, site_out = tc.sites(1)
    assert [iv.op for iv in res.interventions] == ["latent"]
    assert set(res.compiled.programs) == {site_in, site_out}
    blocks = [Block(0, 3, np.arange(3), 3, res), Block(3, 5, np.arange(2), 2, None)]
    plan = StepPlan(blocks)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(5, sm.d_model, generator=g), torch.randn(5, sm.d_model, generator=g)
    assert torch.equal(plan.apply(site_in, x), x)  # read, not edited
    out = plan.apply(site_out, y)
    assert torch.equal(out[3:], y[3:])
    f = tc.encode_layer(x[:3], 1)[:, [2, 7]]
    torch.testing.assert_close(out[:3], y[:3] + (6.0 - f) @ tc.W_dec[1][[2, 7]], atol=1e-5, rtol=0)
    assert len(res.compiled.reads) == 0


def test_two_requests_of_one_spec_read_their_own_rows(sm, tmp_path):
    """Requests with the same spec share one compiled steering (the engine compiles a spec once): in one step each
    request's output rows read its own input rows."""
    tc = random_transcoders(sm, d_sae=32, activation="relu")
    store = Store(tmp_path / "store")
    ref = store.save("supernode", LatentClamp.of_transcoders(tc, {2: [1, 4, 9]}, scale=0.0))
    res = resolve(parse_spec({"artifacts": [{"ref": ref}]}), store=store, facts=sm.facts)
    site_in, site_out = tc.sites(2)
    blocks = [Block(0, 3, np.arange(3), 3, res, "a"), Block(3, 4, np.arange(1), 1, None, "b"),
              Block(4, 7, np.arange(3), 3, res, "c")]
    plan = StepPlan(blocks)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(7, sm.d_model, generator=g), torch.randn(7, sm.d_model, generator=g)
    plan.apply(site_in, x)
    out = plan.apply(site_out, y)
    for rows in (slice(0, 3), slice(4, 7)):
        f = tc.encode_layer(x[rows], 2)[:, [1, 4, 9]]
        torch.testing.assert_close(out[rows], y[rows] - f @ tc.W_dec[2][[1, 4, 9]], atol=1e-5, rtol=0)
    assert torch.equal(out[3], y[3]) and len(res.compiled.reads) == 0
