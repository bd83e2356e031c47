"""Artifacts: construction checks, arithmetic, .to(), provenance, payload round trips."""

from __future__ import annotations


import pytest
import torch

from steerkit.interventions import ModelFacts
from steerkit.vectors import (
    ARTIFACT_KINDS, ArtifactFormatError, DirectionSet, LayerSchedule, ModelMismatchError, Probe, Provenance,
    Region, SteeringVector, VectorsError, model_fingerprint, prompts_hash,
)
from steerkit.vectors.artifacts import payload_to_artifact
from steerkit.vectors.safety import parse_safetensors, tensors_to_safetensors


def vec(seed=0, layers=(3, 5), d=16, **kw):
    g = torch.Generator().manual_seed(seed)
    return SteeringVector({l: torch.randn(d, generator=g) for l in layers}, provenance=Provenance(d_model=d, n_layers=8), **kw)


def test_from_direction_fills_provenance_from_model(tiny_llama):
    v = torch.randn(64)
    sv = SteeringVector.from_direction(v, layer=2, model=tiny_llama, method="diff_in_means",
                                       method_params={"n": 4}, prompts=["a", "b"], metrics={"acc": 0.9})
    p = sv.provenance
    assert sv.layers == [2] and torch.equal(sv.directions[2], v)
    assert sv.hook_name(2) == "blocks.2.hook_resid_post"
    assert (p.d_model, p.n_layers, p.model_arch) == (64, 4, "llama")
    assert p.model_fingerprint == model_fingerprint(tiny_llama)
    assert p.prompts_hash == prompts_hash(["a", "b"]) != prompts_hash(["ab"])
    assert p.method == "diff_in_means" and p.method_params == {"n": 4} and p.metrics == {"acc": 0.9}
    assert "0-based" in p.layer_base and p.schema_version == 1 and p.created_at
    with pytest.raises(ModelMismatchError, match="n_layers=4"):
        SteeringVector.from_direction(v, layer=4, model=tiny_llama)
    with pytest.raises(ModelMismatchError, match="d_model=64"):
        SteeringVector.from_direction(torch.randn(63), layer=1, model=tiny_llama)


def test_fingerprint_changes_with_weights_not_dtype(tiny_llama):
    from _vectors_helpers import make_tiny_llama

    a = model_fingerprint(tiny_llama)
    assert a == model_fingerprint(make_tiny_llama(seed=0))
    assert a != model_fingerprint(make_tiny_llama(seed=1))
    assert a == model_fingerprint(make_tiny_llama(seed=0).to(torch.bfloat16))
    m = make_tiny_llama(seed=0)
    with torch.no_grad():
        m.model.layers[-1].mlp.down_proj.weight[0, 0] += 1.0
    assert model_fingerprint(m) != a


def test_arithmetic_matches_tensor_arithmetic():
    a, b = vec(0), vec(1, layers=(5, 6))
    s = a + b
    assert s.layers == [3, 5, 6]
    assert torch.equal(s.directions[5], a.directions[5] + b.directions[5])
    assert torch.equal(s.directions[6], b.directions[6])
    d = a - b
    assert torch.equal(d.directions[6], -b.directions[6])
    assert torch.equal((a * 2.5).directions[3], a.directions[3] * 2.5)
    assert torch.equal((2.5 * a).directions[3], a.directions[3] * 2.5)
    assert torch.equal((a / 4).directions[3], a.directions[3] / 4)
    assert torch.equal((-a).directions[5], -a.directions[5])
    assert sum([a, b]) == a + b
    assert s.provenance.method == "combination"
    with pytest.raises(VectorsError, match="nonzero divisor"):
        a / 0


def test_arithmetic_refuses_mismatches():
    a = vec(0)
    with pytest.raises(ModelMismatchError, match="d_model"):
        a + vec(1, d=8)
    other = vec(1)
    other.provenance = other.provenance.replace(model_fingerprint="sk1:other")
    a.provenance = a.provenance.replace(model_fingerprint="sk1:mine")
    with pytest.raises(ModelMismatchError, match="sk1:mine.*sk1:other"):
        a + other
    with pytest.raises(VectorsError, match="clamp"):
        vec(0) + vec(1, operation="clamp")


def test_scale_and_schedule_fold_into_effective():
    sched = LayerSchedule({3: 0.5, 5: 2.0})
    v = vec(0, scale=3.0, schedule=sched)
    e = v.effective()
    assert e.scale == 1.0 and e.schedule is None
    assert torch.allclose(e.directions[3], v.directions[3] * 1.5)
    assert torch.allclose(e.directions[5], v.directions[5] * 6.0)
    plain = vec(0)
    assert plain.effective() == plain


def test_to_returns_new_object():
    v = vec(0)
    w = v.to(torch.float16)
    assert w is not v and w.directions[3].dtype == torch.float16 and v.directions[3].dtype == torch.float32
    ds = DirectionSet.from_directions(torch.randn(2, 16))
    assert ds.to(torch.float64).basis.dtype == torch.float64 and ds.basis.dtype == torch.float32


def test_validation_errors_say_what_was_found():
    with pytest.raises(ArtifactFormatError, match="1-D direction"):
        SteeringVector({1: torch.randn(2, 3)})
    with pytest.raises(ArtifactFormatError, match="d_model=4.*found 5"):
        SteeringVector({1: torch.randn(4), 2: torch.randn(5)})
    with pytest.raises(ArtifactFormatError, match="finite"):
        SteeringVector({1: torch.tensor([1.0, float("nan")])})
    with pytest.raises(ArtifactFormatError, match="layer index"):
        SteeringVector({-1: torch.randn(4)})
    with pytest.raises(ArtifactFormatError, match="orthonormal"):
        DirectionSet(torch.ones(2, 8))
    with pytest.raises(VectorsError, match="operation"):
        vec(0, operation="multiply")


def test_direction_set_is_orthonormal_and_projects_out():
    raw = torch.randn(3, 32)
    ds = DirectionSet.from_directions(raw)
    assert torch.allclose(ds.basis @ ds.basis.T, torch.eye(3), atol=1e-5)
    x = torch.randn(10, 32)
    y = ds.project_out(x)
    assert (y @ raw.T).abs().max() < 1e-4
    # span preserved: the raw directions are in the span of the basis
    assert torch.allclose(raw @ ds.basis.T @ ds.basis, raw, atol=1e-4)


def test_probe_and_region_compute():
    d, k = 12, 3
    proj = DirectionSet.from_directions(torch.randn(k, d)).basis
    probe = Probe(weight=torch.randn(1, k), bias=torch.randn(1), layer=4, classes=["no", "yes"],
                  mean=torch.randn(d), scale=torch.rand(d) + 0.5, projection=proj)
    x = torch.randn(5, d)
    z = ((x - probe.mean) / probe.scale) @ proj.T
    expected = torch.sigmoid(z @ probe.weight.T + probe.bias)
    assert torch.allclose(probe.predict_proba(x)[:, 1:], expected)
    region = Region(mean=torch.zeros(d), projection=proj, normals=torch.cat([torch.eye(k), -torch.eye(k)]),
                    offsets=torch.ones(2 * k), layer=4)
    inside = proj.T @ torch.tensor([0.5, -0.5, 0.1])
    outside = proj.T @ torch.tensor([2.0, 0.0, 0.0])
    assert region.contains(torch.stack([inside, outside])).tolist() == [True, False]


def _all_artifacts():
    d = 16
    g = torch.Generator().manual_seed(3)
    proj = DirectionSet.from_directions(torch.randn(2, d, generator=g)).basis
    return [
        vec(0, scale=1.5, positions=[0, -1], schedule=LayerSchedule({3: 0.25, 5: 1.0}, position_weights=[1.0, 0.5])),
        vec(1, operation="clamp").to(torch.bfloat16),
        DirectionSet.from_directions(torch.randn(2, d, generator=g), layers=[1, 2]),
        DirectionSet.from_directions(torch.randn(1, d, generator=g)),
        Probe(weight=torch.randn(3, 2, generator=g), bias=torch.randn(3, generator=g), layer=7, classes=["a", "b", "c"],
              projection=proj, mean=torch.randn(d, generator=g), probe_kind="softmax"),
        Probe(weight=torch.randn(1, d, generator=g), bias=torch.randn(1, generator=g), layer=0),
        Region(mean=torch.randn(d, generator=g), projection=proj, normals=torch.randn(4, 2, generator=g),
               offsets=torch.randn(4, generator=g), layer=2),
        LayerSchedule({1: 0.1, 2: 0.7, 9: 1.0}, position_weights=[1.0, 0.9, 0.81]),
    ]


@pytest.mark.parametrize("art", _all_artifacts(), ids=lambda a: a.kind)
def test_payload_round_trip_is_exact(art):
    tensors, meta = art.to_payload()
    data = tensors_to_safetensors(tensors)
    t2, _ = parse_safetensors(data)
    import json

    back = payload_to_artifact(t2, json.loads(json.dumps(meta)))
    assert back == art
    assert type(back) is type(art)
    assert set(ARTIFACT_KINDS) >= {art.kind}


def test_payload_with_wrong_kind_or_shapes_is_refused():
    t, m = vec(0).to_payload()
    with pytest.raises(ArtifactFormatError, match="kind"):
        payload_to_artifact(t, {**m, "kind": "pickle"})
    with pytest.raises(ArtifactFormatError, match="direction.N"):
        payload_to_artifact({**t, "evil": torch.zeros(1)}, m)
    with pytest.raises(ArtifactFormatError, match="provenance"):
        payload_to_artifact(t, {**m, "provenance": {"d_model": "sixteen"}})
    with pytest.raises(ArtifactFormatError, match="newer"):
        payload_to_artifact(t, {**m, "provenance": {**m["provenance"], "schema_version": 99}})


def test_old_project_operation_loads_as_clamp():
    """Earlier versions called the clamp "project": their payloads (a literal of that format), their
    store index rows and a vector built with the old name all mean the clamp."""
    import warnings

    t = {"direction.3": torch.tensor([3.0, 4.0])}
    meta = {"kind": "steering_vector",
            "fields": {"scale": 2.0, "operation": "project", "hook_site": "hook_resid_post", "positions": None},
            "provenance": {"schema_version": 1, "d_model": 2, "operation": "project", "hook_site": "hook_resid_post"}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a stored file is read without a warning
        old = payload_to_artifact(t, meta)
    assert old.operation == "clamp" and old.provenance.operation == "clamp"
    assert old.to_payload()[1]["fields"]["operation"] == "clamp"
    (iv,) = old.to_interventions(ModelFacts(name="m", n_layers=8, d_model=2), override=True)
    assert iv.op == "clamp" and iv.site == "blocks.3.hook_resid_post"
    with pytest.warns(DeprecationWarning, match="'clamp'"):
        built = SteeringVector({3: torch.tensor([3.0, 4.0])}, scale=2.0, operation="project")
    assert built.operation == "clamp" and built.to_interventions(ModelFacts(name="m", n_layers=8, d_model=2),
                                                                 override=True)[0].op == "clamp"
