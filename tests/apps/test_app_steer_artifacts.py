"""The Steer page steers every artifact kind it accepts exactly as ``sm.steer(artifact)`` does.

Each artifact is saved to a store and picked on the page as ``store:REF`` (the page's own resolution,
:func:`steerkit.apps.pages.steer.setting_for`); at strength 1 the page's steered row
(:func:`steerkit.apps.analysis.steer_compare`, one per-row steered batch) generates the same tokens as
``with sm.steer(artifact): sm.generate(...)`` and its steered row gets the same logits; every artifact here
changes the generation, so a page that applied it at another site (``hook_resid_post`` for a vector stored
at ``hook_resid_pre``, as the page once did), at other positions or with another operation fails.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("dash", reason="the app extra (dash) is not installed")

from steerkit.apps import analysis  # noqa: E402
from steerkit.apps.pages.common import Context  # noqa: E402
from steerkit.apps.pages.steer import default_layers, resolve_direction, setting_for  # noqa: E402
from steerkit.apps.runtime import ModelHost  # noqa: E402
from steerkit.errors import InputError  # noqa: E402
from steerkit.vectors import (  # noqa: E402
    ConditionalSteering, ConditionVector, DirectionSet, LayerSchedule, Provenance, Region, SteeringVector,
)

PROMPT = "hello there"
N_NEW = 8


def _vector(sm, seed: int, norm: float = 12.0) -> torch.Tensor:
    v = torch.randn(sm.d_model, generator=torch.Generator().manual_seed(seed))
    return v / v.norm() * norm


def artifact(kind: str, sm):
    """One artifact of each kind the Steer page accepts, on ``sm`` (every one changes the generation)."""
    prov = Provenance.from_model(sm)
    if kind == "vector@resid_pre":
        # (a norm at which the tiny model's tokens tell resid_pre from resid_post apart)
        return SteeringVector.from_direction(_vector(sm, 1, 4.0), 1, sm, hook_site="hook_resid_pre")
    if kind == "vector@resid_post":
        return SteeringVector.from_direction(_vector(sm, 2), 1, sm)
    if kind == "vector@resid_pre+positions":
        return SteeringVector.from_direction(_vector(sm, 3, 30.0), [0, 1], sm, hook_site="hook_resid_pre",
                                             positions=[0, 2])
    if kind == "vector@attn_out+positions":
        return SteeringVector.from_direction(_vector(sm, 4, 30.0), [0, 1], sm, hook_site="hook_attn_out",
                                             positions=[0, 2])
    if kind == "clamp vector":
        return SteeringVector.from_direction(_vector(sm, 5), [0, 1], sm, operation="clamp")
    if kind == "layer schedule":
        return SteeringVector({0: _vector(sm, 6), 1: _vector(sm, 7)}, scale=1.5,
                              schedule=LayerSchedule({0: 0.5, 1: 2.0}), provenance=prov)
    if kind == "direction set@layers":
        return DirectionSet.from_directions(torch.randn(16, sm.d_model, generator=torch.Generator().manual_seed(8)),
                                            sm, layers=[0, 1])
    if kind == "direction set everywhere":
        return DirectionSet.from_directions(torch.randn(16, sm.d_model, generator=torch.Generator().manual_seed(9)),
                                            sm, layers=None)
    if kind == "region":
        return Region(mean=torch.zeros(sm.d_model), projection=_vector(sm, 10, 1.0)[None],
                      normals=torch.tensor([[1.0]]), offsets=torch.tensor([-20.0]), layer=1, provenance=prov)
    if kind == "conditional steering":
        cond = ConditionVector(_vector(sm, 11, 1.0), layer=1, threshold=-1.0, provenance=prov)  # fires on every row
        return ConditionalSteering(condition=cond, behavior=SteeringVector.from_direction(_vector(sm, 12), 1, sm))
    raise AssertionError(kind)


KINDS = ["vector@resid_pre", "vector@resid_post", "vector@resid_pre+positions", "vector@attn_out+positions",
         "clamp vector", "layer schedule", "direction set@layers", "direction set everywhere", "region",
         "conditional steering"]


def generated(sm, steering=None) -> list[int]:
    """The token ids of ``PROMPT``'s greedy generation (chat template, as the page), under ``steering``."""
    ids: list[int] = []

    def run():
        sm.generate([PROMPT], max_new_tokens=N_NEW, chat=True, stream=lambda row, t, text: ids.append(int(t)))
    if steering is None:
        run()
    else:
        with sm.steer(steering):
            run()
    return ids


def page(sm, tmp_path) -> Context:
    """The pages' context over ``sm`` and a store in ``tmp_path``."""
    env = SimpleNamespace(host=ModelHost(sm), store_path=str(tmp_path), results_path=str(tmp_path), deadline=60.0)
    return Context.of(env)


@pytest.mark.parametrize("kind", KINDS)
def test_the_steer_page_steers_a_stored_artifact_as_sm_steer_does(kind, tiny, tmp_path):
    art = artifact(kind, tiny)
    c = page(tiny, tmp_path)
    ref = c.store.save("art", art)
    setting, _ = setting_for(c, f"store:{ref}", "", "add", 1.0)
    # picking the artifact fills the layer box with its layers: the same steering
    filled, _ = setting_for(c, f"store:{ref}", default_layers(resolve_direction(c, f"store:{ref}")[0]), "add", 1.0)
    assert [(iv.site, iv.op) for iv in filled.interventions] == [(iv.site, iv.op) for iv in setting.interventions]
    res = analysis.steer_compare(tiny, PROMPT, setting, max_new_tokens=N_NEW)
    want, base = generated(tiny, art), generated(tiny)
    assert want != base, f"the {kind} does not change the generation: the comparison could not fail"
    assert res.steered_ids == want
    assert res.baseline_ids == base
    # the page's steered row gets the artifact's logits (the same per-row steering as the generation)
    with tiny.steer(rows=[None, setting.interventions]):
        page_logits = tiny.forward([PROMPT, PROMPT], chat=True)[1]
    with tiny.steer(art):
        want_logits = tiny.forward([PROMPT], chat=True)[0]
    torch.testing.assert_close(page_logits, want_logits)
    # the interventions are the artifact's own, site for site
    assert [(iv.site, iv.op) for iv in setting.interventions] == [
        (iv.site, iv.op) for iv in art.to_interventions(tiny.facts)]
    assert not tiny.hooks.handles


def test_the_strength_scales_the_artifact_and_the_layer_box_selects_among_its_layers(tiny, tmp_path):
    art = SteeringVector.from_direction(_vector(tiny, 20, 6.0), [0, 1], tiny, hook_site="hook_resid_pre",
                                        positions=[1])
    c = page(tiny, tmp_path)
    ref = c.store.save("two-layers", art)
    setting, _ = setting_for(c, f"store:{ref}", "", "clamp", 2.5)  # the operation box does not apply
    res = analysis.steer_compare(tiny, PROMPT, setting, max_new_tokens=N_NEW)
    assert res.steered_ids == generated(tiny, art * 2.5)
    assert [(iv.site, iv.op) for iv in setting.interventions] == [
        ("blocks.0.hook_resid_pre", "add"), ("blocks.1.hook_resid_pre", "add")]
    assert [iv.positions for iv in setting.interventions] == [iv.positions for iv in art.to_interventions(tiny.facts)]
    one, _ = setting_for(c, f"store:{ref}", "1", "add", 1.0)
    assert [iv.site for iv in one.interventions] == ["blocks.1.hook_resid_pre"] and one.layers == [1]
    only = SteeringVector({1: art.directions[1]}, hook_site="hook_resid_pre", positions=[1], provenance=art.provenance)
    res1 = analysis.steer_compare(tiny, PROMPT, one, max_new_tokens=N_NEW)
    assert res1.steered_ids == generated(tiny, only)
    single = c.store.save("one-layer", SteeringVector.from_direction(_vector(tiny, 21), 1, tiny))
    with pytest.raises(InputError, match=r"acts at layers \[1\].*found \[0\]"):
        setting_for(c, f"store:{single}", "0-1", "add", 1.0)


def test_a_profile_direction_is_built_into_an_artifact_at_the_chosen_layers(tiny, tmp_path):
    """The Profiles page's mean difference goes the same path: a SteeringVector of this model at the
    layer box's layers (a direction set to ablate, a clamp vector of the unit direction to clamp)."""
    v = _vector(tiny, 30)
    add = analysis.steer_setting(tiny, {1: v.numpy()}, None, operation="add", strength=3.0)
    res = analysis.steer_compare(tiny, PROMPT, add, max_new_tokens=N_NEW)
    assert res.steered_ids == generated(tiny, SteeringVector.from_direction(v, 1, tiny) * 3.0)
    abl = analysis.steer_setting(tiny, v.numpy(), "0-1", operation="ablate")
    res = analysis.steer_compare(tiny, PROMPT, abl, max_new_tokens=N_NEW)
    assert res.steered_ids == generated(tiny, DirectionSet.from_directions(v, tiny, layers=[0, 1]))


@pytest.mark.slow
def test_the_refusal_site_on_the_default_model(sm, tmp_path):
    """On the real default model: a vector stored at ``hook_resid_pre`` (where the refusal direction is
    saved) steers at that site on the page, token for token as ``sm.steer``."""
    v = torch.randn(sm.d_model, generator=torch.Generator().manual_seed(0))
    art = SteeringVector.from_direction(v / v.norm() * 60.0, 10, sm, hook_site="hook_resid_pre")
    c = page(sm, tmp_path)
    ref = c.store.save("resid-pre", art)
    setting, _ = setting_for(c, f"store:{ref}", "", "add", 1.0)
    assert [iv.site for iv in setting.interventions] == ["blocks.10.hook_resid_pre"]
    res = analysis.steer_compare(sm, PROMPT, setting, max_new_tokens=N_NEW)
    want = generated(sm, art)
    assert want != generated(sm) and res.steered_ids == want
