"""The refusal method measures what it saves: the held-out evaluation steers with the very artifacts the
result stores (the ``DirectionSet`` that ablates at the embedding output and every attention and MLP output,
the ``SteeringVector`` added at the selected block's input), and the candidate search ablates at those same
sites."""
from __future__ import annotations

import pytest
import torch

from steerkit.model import wrap
from steerkit.probes.methods import refusal as R
from steerkit.vectors import DirectionSet, SteeringVector
from tiny_models import tiny_chat_llama


def _same(a, b):
    assert [(iv.site, iv.op, iv.scale, iv.positions) for iv in a] == [(iv.site, iv.op, iv.scale, iv.positions)
                                                                     for iv in b]
    assert all(torch.equal(x.tensor, y.tensor) for x, y in zip(a, b))


def test_the_evaluation_steers_with_the_saved_artifacts(monkeypatch):
    sm = wrap(*tiny_chat_llama(), name="tiny-chat-llama")
    evaluated = []
    real = sm.steer

    def spy(steering=None, *a, label=None, **k):
        if label is not None and label.startswith("refusal: the saved"):
            evaluated.append(steering)
        return real(steering, *a, label=label, **k)
    monkeypatch.setattr(sm, "steer", spy)
    cfg = R.RefusalConfig(n_train=4, n_val=2, n_test=2, max_new_tokens=2, min_keep=1, probe=False, n_positions=2)
    res = R.run(sm, cfg, progress=False)
    saved = res.artifacts(sm)
    ablated = [s for s in evaluated if isinstance(s, DirectionSet)]
    added = [s for s in evaluated if isinstance(s, SteeringVector)]
    assert len(ablated) == len(added) == 1 and len(evaluated) == 2  # harmful ablated, harmless added
    _same(ablated[0].to_interventions(sm.facts), saved["refusal-ablation"].to_interventions(sm.facts))
    _same(added[0].to_interventions(sm.facts), saved["refusal-direction"].to_interventions(sm.facts))
    ivs = saved["refusal-ablation"].to_interventions(sm.facts)
    assert len(ivs) == 2 * sm.n_layers + 1 and ivs[0].site == "blocks.0.hook_resid_pre"
    # the candidate search's ablation of the selected direction is the saved one too
    _same(R.ablation_interventions(sm, res.selection.direction), ivs)
    add = saved["refusal-direction"]
    assert add.hook_name(res.metrics["layer"]) == f"blocks.{res.metrics['layer']}.hook_resid_pre"
    _same(R.addition_interventions(res.selection.direction, res.metrics["layer"]), add.to_interventions(sm.facts))


def test_the_old_site_list_warns():
    with pytest.warns(DeprecationWarning, match="ablation_artifact"):
        assert R.ABLATION_SITES == ("hook_resid_pre", "hook_attn_out", "hook_mlp_out")
