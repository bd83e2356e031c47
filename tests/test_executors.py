"""Searches spread over an executor (``steerkit.executors``) give what they give in one process: the tuning
grid and the refusal candidate search, on a tiny model, through :class:`LocalExecutor` (the same split and
merge a Ray executor runs; ``tests/test_ray.py`` runs them on a cluster)."""
from __future__ import annotations

import pytest
import torch

import steerkit
from steerkit.executors import LocalExecutor, ModelSpec, RayExecutor
from steerkit.errors import InputError
from steerkit.probes import tune
from steerkit.probes.methods import refusal as R

try:
    from tiny_models import tiny_model
except ImportError:  # pragma: no cover
    from tests.tiny_models import tiny_model

PROMPTS = ["Tell me a joke", "Write about the sea", "Hi there", "Explain rain"]


@pytest.fixture(scope="module")
def tiny():
    return steerkit.wrap(*tiny_model("llama"))


def tune_args(sm):
    v = torch.randn(sm.d_model, generator=torch.Generator().manual_seed(3))
    return (v, PROMPTS), dict(layers=[0, 1], scales=[0.0, 2.0, 6.0], concept=["the", "a"], neutral=["Hello"],
                              max_new_tokens=5, n_boot=50, progress=False, chat=False)


def same_tune(a, b) -> None:
    assert a.layers == b.layers and a.scales == b.scales
    assert a.recommended == b.recommended
    assert [c["pareto"] for c in a.cells] == [c["pareto"] for c in b.cells]
    for x, y in zip(a.cells, b.cells):
        assert x["generations"] == y["generations"]
        for k in ("kl", "concept"):
            assert x[k] == pytest.approx(y[k], abs=1e-5), k


def test_tune_spread_over_layers_equals_one_call(tiny):
    args, kw = tune_args(tiny)
    same_tune(tune(tiny, *args, executor=LocalExecutor(tiny), **kw), tune(tiny, *args, **kw))


def refusal_args(sm):
    g = torch.Generator().manual_seed(4)
    cands = torch.randn(2, sm.n_layers, sm.d_model, generator=g)
    ids = R.refusal_token_ids(sm.tokenizer)
    return (sm, cands, [-2, -1], ["make a bomb", "steal a car"], ["bake bread", "write a poem"], ids)


def test_refusal_search_spread_selects_the_same(tiny):
    args = refusal_args(tiny)
    local = R.select_direction(*args, prune_frac=0.0)
    spread = R.select_direction(*args, prune_frac=0.0, executor=LocalExecutor(tiny))
    assert (spread.best.pos, spread.best.layer, spread.rule) == (local.best.pos, local.best.layer, local.rule)
    for a, b in zip(spread.table, local.table):  # every score the local (lazy) search computed, equal
        for k in ("bypass", "induce", "kl"):
            if getattr(b, k) == getattr(b, k):  # not NaN
                assert getattr(a, k) == pytest.approx(getattr(b, k), abs=1e-5), (a, b, k)


def test_executor_errors_are_clear():
    with pytest.raises(InputError, match="at least 1 Ray worker"):
        RayExecutor(ModelSpec(), workers=0)
    with pytest.raises(InputError, match="neither sm nor executor"):
        from steerkit.storage.dataset import record_dataset
        record_dataset(None, ["a"], ["blocks.0.hook_resid_post"], "/nonexistent-never-made")


def test_patching_grid_spread_over_layers_equals_one_call(tiny):
    from steerkit.probes import activation_patching, logit_diff_metric
    clean, corrupted = [5, 17, 23, 40, 41, 7], [5, 17, 29, 40, 41, 7]
    metric = logit_diff_metric(tiny, 12, 13)
    kw = dict(hook="resid_pre", positions=[1, 2, 5], progress=False)
    one = activation_patching(tiny, clean, corrupted, metric, **kw)
    spread = activation_patching(tiny, clean, corrupted, metric, executor=LocalExecutor(tiny), **kw)
    assert spread.layers == one.layers and spread.positions == one.positions
    assert torch.allclose(spread.values, one.values, atol=1e-5, rtol=0), (spread.values - one.values).abs().max()
    assert spread.clean_metric == pytest.approx(one.clean_metric)
