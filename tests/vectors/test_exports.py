"""Export/import: layouts other engines read, exact round trips, refusals with a way out."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from steerkit.vectors import (
    DirectionSet, ExportError, LayerSchedule, Probe, Provenance, Region, SteeringVector, export, import_artifact,
    load_artifact,
)
from steerkit.vectors.exports import easysteer_request_path


def vec(layers=(3, 5), d=16, seed=0, n_layers=8, **kw):
    g = torch.Generator().manual_seed(seed)
    prov = Provenance(model_name="tiny", model_fingerprint="sk1:abc", model_arch="llama", d_model=d, n_layers=n_layers,
                      method="diff_in_means", method_params={"k": 2}, metrics={"acc": 0.75})
    return SteeringVector({l: torch.randn(d, generator=g) for l in layers}, provenance=prov, **kw)


SUFFIX = {"llama.cpp": ".gguf", "repeng": ".gguf", "easysteer": ".gguf", "tlens": ".json", "svec": ".svec", "safetensors": ".safetensors"}


@pytest.mark.parametrize("fmt", list(SUFFIX))
def test_round_trip_exact(tmp_path, fmt):
    v = vec()
    paths = export(v, fmt, tmp_path / f"v{SUFFIX[fmt]}")
    back = import_artifact(paths[-1])
    assert back == v
    assert load_artifact(paths[-1]) == v


@pytest.mark.parametrize("fmt", ["llama.cpp", "repeng"])
def test_gguf_round_trip_folds_scale_and_schedule(tmp_path, fmt):
    v = vec(scale=2.5, schedule=LayerSchedule({3: 0.5, 5: 1.0}))
    back = import_artifact(export(v, fmt, tmp_path / "v.gguf")[0])
    assert back == v.effective()
    assert torch.equal(back.directions[3], v.directions[3] * 1.25)


@pytest.mark.parametrize("fmt", ["easysteer", "tlens", "svec", "safetensors"])
def test_scale_survives_formats_that_carry_it(tmp_path, fmt):
    v = vec(scale=-3.0)
    back = import_artifact(export(v, fmt, tmp_path / f"v{SUFFIX[fmt]}")[-1])
    assert back == v and back.scale == -3.0


def test_llamacpp_layout_is_what_llamacpp_reads(tmp_path):
    v = vec(layers=(1, 7), n_layers=8).to(torch.bfloat16)
    p = export(v, "llama.cpp", tmp_path / "v.gguf")[0]
    r = gguf.GGUFReader(str(p))
    assert r.get_field("general.architecture").contents() == "controlvector"
    assert r.get_field("controlvector.model_hint").contents() == "llama"
    assert r.get_field("controlvector.layer_count").contents() == 2
    assert sorted(t.name for t in r.tensors) == ["direction.1", "direction.7"]  # nothing else: llama.cpp rejects other names
    for t in r.tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32 and list(t.shape) == [16]
        layer = int(t.name.split(".")[1])
        assert np.array_equal(t.data, v.directions[layer].float().numpy())
    prov = json.loads(r.get_field("steerkit.provenance").contents())
    assert prov["model_fingerprint"] == "sk1:abc" and "0-based" in r.get_field("steerkit.layer_base").contents()
    assert r.get_field("steerkit.operation").contents() == "add"
    assert r.get_field("steerkit.hook_site").contents() == "hook_resid_post"
    assert import_artifact(p) == v  # dtype restored from steerkit.dtype


def test_llamacpp_refusals_explain_alternatives(tmp_path):
    with pytest.raises(ExportError, match="block 0.*repeng"):
        export(vec(layers=(0, 3)), "llama.cpp", tmp_path / "a.gguf")
    too_deep = vec(layers=(3, 8), n_layers=None)
    too_deep.provenance = too_deep.provenance.replace(n_layers=8)  # e.g. a vector checked against another model
    with pytest.raises(ExportError, match="n_layers=8.*\\[8\\]"):
        export(too_deep, "llama.cpp", tmp_path / "a.gguf")
    with pytest.raises(ExportError, match="'clamp'.*tlens"):
        export(vec(operation="clamp"), "llama.cpp", tmp_path / "a.gguf")
    with pytest.raises(ExportError, match="positions.*easysteer"):
        export(vec(positions=[-1]), "llama.cpp", tmp_path / "a.gguf")
    with pytest.raises(ExportError, match="hook_attn_out; export it as 'tlens'"):
        export(vec(hook_site="hook_attn_out"), "llama.cpp", tmp_path / "a.gguf")
    with pytest.raises(ExportError, match="previous block's hook_resid_post"):
        export(vec(hook_site="hook_resid_pre"), "llama.cpp", tmp_path / "a.gguf")
    with pytest.raises(ExportError, match="per-token"):
        export(vec(schedule=LayerSchedule({3: 1.0}, position_weights=[1.0, 0.5])), "llama.cpp", tmp_path / "a.gguf")
    with pytest.raises(ExportError, match="write_orthogonalized_gguf"):
        export(DirectionSet.from_directions(torch.randn(1, 16)), "llama.cpp", tmp_path / "a.gguf")
    no_layers = SteeringVector({3: torch.randn(16)})
    with pytest.raises(ExportError, match="model="):
        export(no_layers, "llama.cpp", tmp_path / "a.gguf")
    with pytest.raises(ExportError, match="safetensors"):
        export(Probe(weight=torch.randn(1, 16), bias=torch.zeros(1), layer=1), "svec", tmp_path / "a.svec")
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_repeng_allows_layer_zero_and_reads_repeng_files(tmp_path):
    v = vec(layers=(0, 2))
    back = import_artifact(export(v, "repeng", tmp_path / "r.gguf")[0])
    assert back == v
    # a file written exactly the way repeng's ControlVector.export_gguf writes it
    dirs = {0: np.arange(16, dtype=np.float32), 4: -np.arange(16, dtype=np.float32)}
    w = gguf.GGUFWriter(str(tmp_path / "repeng.gguf"), "controlvector")
    w.add_string("controlvector.model_hint", "mistral")
    w.add_uint32("controlvector.layer_count", len(dirs))
    for layer, d in dirs.items():
        w.add_tensor(f"direction.{layer}", d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = import_artifact(tmp_path / "repeng.gguf")
    assert r.layers == [0, 4] and r.provenance.model_arch == "mistral" and r.provenance.method == "imported:controlvector"
    assert np.array_equal(r.directions[4].numpy(), dirs[4])


# EasySteer's current request, transcribed from ZJU-REAL/EasySteer-vllm-v1 at 6267ca0c
# (vllm/steer_vectors/request.py SteerVectorRequest, vllm/steer_vectors/api.py SelectSpec):
# the struct's fields with their types, the where-clause keys, and the rules its __post_init__ /
# SelectSpec validation applies to a single-vector "direct" request.
ES_REQUEST_FIELDS = {
    "steer_vector_name": str, "steer_vector_int_id": int, "steer_vector_local_path": str,
    "conflict_resolution": str, "scale": float, "target_layers": list, "apply_spec": dict, "algorithm": str,
    "normalize": bool, "inline_payload": dict, "payload_sha256": str, "vector_configs": list,
    "moe_expert_ids": list, "moe_mode": str, "moe_lambda": float, "moe_topk": int,
}
ES_APPLY_KEYS = ("prompt", "generation", "prompt_tokens", "prompt_positions", "prompt_window", "generation_tokens",
                 "generation_positions", "generation_window", "exclude_prompt_tokens", "exclude_prompt_positions",
                 "exclude_prompt_window", "exclude_generation_tokens", "exclude_generation_positions",
                 "exclude_generation_window")


def easysteer_request_errors(req: dict) -> list[str]:
    """What EasySteer's current SteerVectorRequest would reject in ``req`` (empty: accepted)."""
    errs = [f"unknown field {k}" for k in req if k not in ES_REQUEST_FIELDS]
    for k, t in ES_REQUEST_FIELDS.items():
        if k in req and not isinstance(req[k], t) and not (t is float and isinstance(req[k], int)):
            errs.append(f"{k} is {type(req[k]).__name__}, not {t.__name__}")
    if req.get("steer_vector_int_id", 0) < 1:
        errs.append("steer_vector_int_id must be > 0")
    if not req.get("steer_vector_local_path") and req.get("inline_payload") is None:
        errs.append("single-vector mode requires steer_vector_local_path")
    spec = req.get("apply_spec")
    if spec is None:
        return errs + ["no apply_spec: the request would steer no tokens"]
    errs += [f"unknown selection field {k}" for k in spec if k not in ES_APPLY_KEYS]
    covers = {ph: spec.get(ph) == "all" or any(spec.get(k) is not None for k in ES_APPLY_KEYS
                                                 if k.startswith(ph + "_"))
              for ph in ("prompt", "generation")}
    if not any(covers.values()):
        errs.append("the clause selects nothing")
    for ph in ("prompt", "generation"):
        if spec.get(ph) not in (None, "all"):
            errs.append(f"{ph} must be 'all' or None")
    for k in ("prompt_positions", "prompt_tokens", "generation_positions", "generation_tokens"):
        x = spec.get(k)
        if x is not None and (not isinstance(x, list) or not x or not all(isinstance(i, int) for i in x)):
            errs.append(f"{k} must be a non-empty list of ints")
    return errs


def test_easysteer_schema_check_rejects_what_easysteer_rejects():
    ok = {"steer_vector_name": "a", "steer_vector_int_id": 1, "steer_vector_local_path": "/x.gguf",
          "apply_spec": {"prompt": "all", "generation": "all"}}
    assert easysteer_request_errors(ok) == []
    assert easysteer_request_errors({**ok, "prefill_trigger_tokens": [-1]})  # the first release's field
    assert easysteer_request_errors({k: v for k, v in ok.items() if k != "apply_spec"})
    assert easysteer_request_errors({**ok, "apply_spec": {"phases": ["prompt"]}})
    assert easysteer_request_errors({**ok, "apply_spec": {"prompt_positions": []}})


def test_easysteer_request_fields(tmp_path):
    v = vec(scale=1.5)
    gp, rp = export(v, "easysteer", tmp_path / "happy.gguf")
    assert rp == easysteer_request_path(gp) == tmp_path / "happy.request.json"
    req = json.loads(rp.read_text())
    assert easysteer_request_errors(req) == []
    assert req["steer_vector_local_path"] == str(gp.resolve())
    assert req["target_layers"] == [3, 5] and req["scale"] == 1.5 and req["algorithm"] == "direct"
    assert req["apply_spec"] == {"prompt": "all", "generation": "all"}
    assert gguf.GGUFReader(str(gp)).get_field("general.architecture").contents() == "steervector"
    assert import_artifact(rp) == v
    pv = vec(positions=[0, -1])
    _, rp2 = export(pv, "easysteer", tmp_path / "pos.gguf")
    req2 = json.loads(rp2.read_text())
    assert easysteer_request_errors(req2) == [] and req2["apply_spec"] == {"prompt_positions": [0, -1]}
    assert import_artifact(rp2) == pv
    # a where-clause steerkit cannot express is refused on import, not approximated
    req2["apply_spec"] = {"generation_window": [0, 4]}
    rp2.write_text(json.dumps(req2))
    from steerkit.vectors import ArtifactFormatError

    with pytest.raises(ArtifactFormatError, match="generation_window"):
        import_artifact(rp2)


def test_easysteer_v1_request_fields(tmp_path):
    v = vec(scale=1.5)
    gp, rp = export(v, "easysteer-v1", tmp_path / "old.gguf")
    req = json.loads(rp.read_text())
    assert "apply_spec" not in req and easysteer_request_errors(req)  # the current EasySteer refuses it
    assert req["prefill_trigger_tokens"] == [-1] and req["generate_trigger_tokens"] == [-1]
    assert import_artifact(rp) == v
    pv = vec(positions=[0, -1])
    _, rp2 = export(pv, "easysteer-v1", tmp_path / "oldpos.gguf")
    assert json.loads(rp2.read_text())["prefill_trigger_positions"] == [0, -1]
    assert import_artifact(rp2) == pv


def test_easysteer_request_cannot_point_outside_its_folder(tmp_path):
    (tmp_path / "a").mkdir()
    _, rp = export(vec(), "easysteer", tmp_path / "a" / "v.gguf")
    req = json.loads(rp.read_text())
    req["steer_vector_local_path"] = "/etc/passwd"
    rp.write_text(json.dumps(req))
    from steerkit.vectors import ArtifactFormatError

    with pytest.raises(ArtifactFormatError, match="next to"):
        import_artifact(rp)


def test_tlens_spec_shape_and_ablation(tmp_path):
    v = vec(scale=2.0)
    spec = json.loads(export(v, "tlens", tmp_path / "v.json")[0].read_text())
    assert spec["blocks.3.hook_resid_post"]["op"] == "add" and spec["blocks.3.hook_resid_post"]["scale"] == 2.0
    assert spec["blocks.3.hook_resid_post"]["pos"] is None and len(spec["blocks.5.hook_resid_post"]["value"]) == 16
    ds = DirectionSet.from_directions(torch.randn(2, 16), layers=None)
    ds.provenance = ds.provenance.replace(n_layers=3)
    p = export(ds, "tlens", tmp_path / "d.json")[0]
    spec = json.loads(p.read_text())
    assert set(spec) - {"__steerkit__"} == {"hook_embed", *(f"blocks.{l}.{h}" for l in range(3) for h in ("hook_attn_out", "hook_mlp_out"))}
    assert import_artifact(p) == ds
    ds2 = DirectionSet.from_directions(torch.randn(1, 16), layers=[2, 4])
    assert import_artifact(export(ds2, "tlens", tmp_path / "d2.json")[0]) == ds2
    pv = vec(operation="clamp", positions=[-1])
    p = export(pv, "tlens", tmp_path / "p.json")[0]
    assert json.loads(p.read_text())["blocks.3.hook_resid_post"]["op"] == "clamp"
    assert import_artifact(p) == pv
    # a spec written by an earlier version names the clamp "project": it imports as the clamp
    old = json.loads(p.read_text())
    for k in ("blocks.3.hook_resid_post", "blocks.5.hook_resid_post"):
        old[k]["op"] = "project"
    old["__steerkit__"]["provenance"]["operation"] = "project"
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert import_artifact(tmp_path / "old.json") == pv


def test_svec_matches_ibm_loader(tmp_path):
    v = vec()
    v.provenance.metrics["explained_variance"] = {"3": 0.4, "5": 0.6}
    p = export(v, "svec", tmp_path / "v.svec")[0]
    data = json.loads(p.read_text())
    # what activation_steering.SteeringVector.load does
    directions = {int(k): np.array(val) for k, val in data["directions"].items()}
    variances = {int(k): val for k, val in data["explained_variances"].items()}
    assert data["model_type"] == "llama" and variances == {3: 0.4, 5: 0.6}
    assert np.array_equal(directions[5].astype(np.float32), v.directions[5].numpy())
    assert import_artifact(p) == v


@pytest.mark.parametrize("art", [
    DirectionSet.from_directions(torch.randn(2, 16)),
    Probe(weight=torch.randn(2, 16), bias=torch.zeros(2), layer=3, classes=["a", "b"]),
    Region(mean=torch.zeros(4), projection=torch.eye(4)[:2], normals=torch.eye(2), offsets=torch.ones(2), layer=1),
    LayerSchedule({1: 0.5}),
], ids=lambda a: a.kind)
def test_safetensors_carries_every_kind(tmp_path, art):
    assert import_artifact(export(art, "safetensors", tmp_path / "a.safetensors")[0]) == art


@settings(max_examples=40, deadline=3000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layers=st.sets(st.integers(1, 7), min_size=1, max_size=4),
       values=st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=6, max_size=6),
       fmt=st.sampled_from(list(SUFFIX)), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_round_trip_exact_property(tmp_path_factory, layers, values, fmt, dtype):
    base = torch.tensor(values, dtype=torch.float32)
    dirs = {l: (base * (i + 1) if i < 2 else base).to(dtype) for i, l in enumerate(sorted(layers))}
    if not all(torch.isfinite(d).all() for d in dirs.values()):
        return  # overflowed while building the example; not a vector
    v = SteeringVector(dirs, provenance=Provenance(d_model=6, n_layers=8, model_arch="llama"))
    d = tmp_path_factory.mktemp("rt")
    back = import_artifact(export(v, fmt, d / f"v{SUFFIX[fmt]}")[-1])
    assert back == v


def test_same_tensor_at_two_layers_round_trips(tmp_path):
    """Found by hypothesis: one tensor object reused for two layers shares memory; safetensors refused it."""
    import torch
    from steerkit.vectors import SteeringVector, export, import_artifact
    v = torch.randn(16)
    sv = SteeringVector(directions={3: v, 4: v})
    p = export(sv, "safetensors", tmp_path / "shared.safetensors")
    back = import_artifact(p[0] if isinstance(p, (list, tuple)) else p)
    assert set(back.directions) == {3, 4}
    assert all(torch.equal(back.directions[l], v) for l in (3, 4))


@pytest.mark.parametrize("site", ["hook_attn_out", "hook_mlp_out", "hook_resid_mid"])
def test_sub_layer_sites_round_trip_and_steer_there(tmp_path, site):
    """A vector at what attention / the MLP add (or at resid_mid) keeps its site through the exports that carry
    one, and lowers to interventions at that site."""
    v = vec(hook_site=site, positions=[-1])
    for fmt in ("tlens", "safetensors"):
        out = export(v, fmt, tmp_path / f"v{SUFFIX[fmt]}")
        back = import_artifact(out[0]) if fmt == "tlens" else load_artifact(out[0])
        assert back.hook_site == site and back.positions == [-1]
    assert {iv.site for iv in v.to_interventions({"name": "tiny", "n_layers": 8, "d_model": 16}, override=True)} == {
        f"blocks.3.{site}", f"blocks.5.{site}"}

