"""Indirect-object identification by activation patching (probes/methods/ioi.py).

Mechanics on a tiny random Llama with a character tokenizer (pairs, aggregation against
activation_patching run by hand, JSON, figures); the finding on the default model
(SmolLM2-135M-Instruct) for one prompt pair.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from steerkit.errors import InputError
from steerkit.probes import activation_patching, logit_diff_metric
from steerkit.probes.methods import REGISTRY
from steerkit.probes.methods import ioi as IOI

TINY_TEMPLATES = ("When{IO} and{S} met,{S2} gave it to", "{S} saw{IO};{S2} ran to")
TINY_NAMES = (("a", "b"), ("x", "q"))


def test_pairs_differ_in_the_second_subject_only(tiny):
    pairs = IOI.ioi_pairs(tiny, TINY_TEMPLATES, TINY_NAMES)
    assert len(pairs) == 4 and [p.template for p in pairs] == [0, 0, 1, 1]
    p = pairs[0]
    assert p.clean == "Whena andb met,b gave it to" and p.corrupted == "Whena andb met,a gave it to"
    assert p.s2_pos == p.clean.index(",b") + 1  # one character, one token
    with pytest.raises(InputError, match="one token"):
        IOI.ioi_pairs(tiny, TINY_TEMPLATES[:1], (("ab", "c"),))
    with pytest.raises(InputError, match="S2"):
        IOI.ioi_pairs(tiny, ("{IO} and {S}",), TINY_NAMES)
    with pytest.raises(InputError, match="two different"):
        IOI.ioi_pairs(tiny, TINY_TEMPLATES, (("a", "a"),))
    with pytest.raises(InputError, match="hooks"):
        IOI.run(tiny, IOI.IOIConfig(templates=TINY_TEMPLATES, names=TINY_NAMES, hooks=("mlp_out",)), progress=False)


def test_run_aggregates_activation_patching_over_the_pairs(tiny):
    cfg = IOI.IOIConfig(templates=TINY_TEMPLATES, names=TINY_NAMES, batch_size=7)
    res = IOI.run(tiny, cfg, progress=False)
    assert tiny.hook_count() == 0
    pairs = IOI.ioi_pairs(tiny, TINY_TEMPLATES, TINY_NAMES)
    by_hand = []
    for p in pairs:
        m = logit_diff_metric(tiny, p.io, p.s)
        # the run's batch size: the same cells share a pass, so the values round the same way
        by_hand.append((p, (activation_patching(tiny, p.clean, p.corrupted, m, "resid_pre", progress=False,
                                                batch_size=cfg.batch_size),
                            activation_patching(tiny, p.clean, p.corrupted, m, "z", progress=False,
                                                batch_size=cfg.batch_size))))
    rs = [x for _, x in by_hand]
    # z: mean raw values normalised by the mean clean / corrupted metrics
    clean = np.mean([r.clean_metric for r, _ in rs])
    corr = np.mean([r.corrupted_metric for r, _ in rs])
    want_z = (torch.stack([z.values for _, z in rs]).double().mean(0) - corr) / (clean - corr)
    assert res.z is not None and res.z.is_normalized and res.z.values.shape == (2, tiny.n_heads)
    np.testing.assert_allclose(res.z.values.numpy(), want_z.numpy(), rtol=1e-4, atol=1e-5)
    # resid_pre: per template
    assert len(res.resid_pre) == 2
    for t in (0, 1):
        mine = [r for p, (r, _) in by_hand if p.template == t]
        c, k = np.mean([r.clean_metric for r in mine]), np.mean([r.corrupted_metric for r in mine])
        want = (torch.stack([r.values for r in mine]).double().mean(0) - k) / (c - k)
        np.testing.assert_allclose(res.resid_pre[t].values.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)
        assert res.resid_pre[t].tokens == mine[0].tokens
    # the S2 / last-token curves over every pair; at layer 0 S2 patching restores the clean run exactly
    s2 = (torch.stack([r.values[:, p.s2_pos] for p, (r, _) in by_hand]).double().mean(0) - corr) / (clean - corr)
    np.testing.assert_allclose(res.s2_curve, s2.numpy(), rtol=1e-4, atol=1e-5)
    assert res.s2_curve[0] == pytest.approx(1.0, abs=1e-4)
    assert [p.clean_metric for p in res.pairs] == pytest.approx([r.clean_metric for r, _ in rs], abs=1e-5)
    d = json.loads(json.dumps(res.to_json(), allow_nan=False))
    assert len(d["pairs"]) == 4 and len(d["resid_pre"]) == 2 and d["z"]["shape"] == [2, tiny.n_heads]
    assert len(res.plot().data) == 2 and len(res.figures()) == 3
    assert len(res.top_heads(3)) == 3
    assert REGISTRY["ioi"].run is IOI.run


def test_only_the_chosen_hooks_run(tiny):
    res = IOI.run(tiny, IOI.IOIConfig(templates=TINY_TEMPLATES[:1], names=TINY_NAMES[:1], hooks=("z",)),
                  progress=False)
    assert res.resid_pre == [] and res.s2_curve is None and res.z is not None
    assert len(res.plot().data) == 1 and res.pairs[0].clean_metric == pytest.approx(res.z.clean_metric)


# --------------------------------------------------------------------------- the default model
# Measured on SmolLM2-135M-Instruct (float32), template 0 with Mary / John: clean logit diff 6.12,
# corrupted -5.49; patching resid_pre moves the answer from the S2 token to the last token between
# layers 20 and 24; head L23H3's z alone restores most of the gap over four such pairs (+0.65).
@pytest.mark.slow
def test_default_model_moves_the_name_from_s2_to_the_end(default_model):
    sm = default_model
    cfg = IOI.IOIConfig(templates=IOI.TEMPLATES[:1], names=IOI.NAMES[:1])
    res = IOI.run(sm, cfg, progress=False)
    assert res.clean_logit_diff > 3.0 and res.corrupted_logit_diff < -3.0
    s2, end = res.s2_curve, res.end_curve
    assert (s2[:16] > 0.9).all() and (np.abs(end[:16]) < 0.1).all()  # early: only the S2 token matters
    assert (np.abs(s2[26:]) < 0.1).all() and (end[26:] > 0.8).all()  # late: only the last token
    (l, h, v), = res.top_heads(1)
    assert (l, h) == (23, 3) and v > 0.3
    assert sm.hook_count() == 0
