"""The serving package without vLLM: specs, salts, request helpers, per-step plans, the HF export,
folder fingerprints and the CLI wiring (the real vLLM runs in tests/integration/test_vllm.py)."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from steerkit.serving import SpecError, parse_spec, request_args, request_body, salt
from steerkit.serving.plan import Block, StepPlan
from steerkit.serving.spec import KEY, resolve


def test_parse_spec_accepts_json_and_dicts_and_says_what_is_wrong():
    s = parse_spec('{"artifacts": [{"ref": "happy@1", "scale": 2}], "ops": [{"op": "add", "layer": 3, '
                   '"vector": [1, 0], "positions": "generated"}]}')
    assert s.artifacts[0].ref == "happy@1" and s.artifacts[0].scale == 2.0
    assert s.ops[0].layers == (3,) and s.ops[0].positions == "generated"
    assert parse_spec({"artifacts": ["a@1"]}).artifacts[0].scale == 1.0
    bad = [("{x", "JSON object"), ("[1]", "JSON object with 'artifacts'"), ({"artifact": []}, "only the keys"),
           ({"artifacts": [{"ref": 3}]}, "artifacts[0]"), ({"artifacts": [{"ref": "a", "scale": "x"}]}, "number"),
           ({"artifacts": [{"ref": "a", "scale": float("nan")}]}, "finite"),
           ({"ops": [{"op": "region", "layers": [1], "vector": [1.0]}]}, "ops[0].op"),
           ({"ops": [{"op": "add", "layers": [], "vector": [1.0]}]}, "non-empty list"),
           ({"ops": [{"op": "add", "layers": [1], "vector": [1.0], "positions": "middle"}]}, "positions"),
           ({"ops": [{"op": "add", "layers": [1], "vector": [1.0], "positions": [0.5]}]}, "ops[0] positions"),
           ({"ops": [{"op": "ablate", "layers": [1], "vectors": [[1.0], [1.0, 2.0]]}]}, "one length"),
           ({"ops": [{"op": "add", "layers": [1], "vectors": [[1.0], [2.0]]}]}, "one vector")]
    for spec, msg in bad:
        with pytest.raises(SpecError, match=re.escape(msg)):
            parse_spec(spec)  # noqa: PT012
    # ints are indices among the prompt tokens; negative ones count from the end of the prompt
    s = parse_spec({"ops": [{"op": "add", "layers": [1], "vector": [1.0], "positions": [-1, 0, -3]}]})
    assert s.ops[0].positions == (-1, 0, -3)


def test_salt_and_request_helpers():
    a, b = request_args("happy@1", scale=1.0), request_args("happy@1", scale=0.5)
    assert json.loads(a[KEY]) == {"artifacts": [{"ref": "happy@1", "scale": 1.0}]}
    assert salt(a[KEY]) == salt(json.loads(a[KEY])) != salt(b[KEY])  # equal specs share, others never
    assert salt(a[KEY], "user") == "user-" + salt(a[KEY])
    two = json.loads(request_args("a@1", "b@2", scale=[1.0, 0.5])[KEY])
    assert [x["scale"] for x in two["artifacts"]] == [1.0, 0.5]
    assert json.loads(request_args({"a@1": 2.0})[KEY])["artifacts"] == [{"ref": "a@1", "scale": 2.0}]
    with pytest.raises(SpecError, match="one scale per artifact"):
        request_args("a@1", "b@2", scale=[1.0])
    body = request_body("m", "happy@1", prompt="hi", max_tokens=5)
    assert body["vllm_xargs"] == a and body["cache_salt"] == salt(a[KEY]) and body["max_tokens"] == 5
    assert "vllm_xargs" not in request_body("m", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(SpecError, match="exactly one of prompt"):
        request_body("m", "happy@1")


class _Store:
    def __init__(self, arts):
        self.arts, self.root = arts, "memory"

    def load(self, ref):
        if ref not in self.arts:
            raise KeyError(f"no {ref}")
        return self.arts[ref]


class _Lowered:
    """An artifact-like object that lowers to one add at ``site`` (with ``positions``)."""

    def __init__(self, site, v, positions="all"):
        self.site, self.v, self.positions = site, v, positions

    def to_interventions(self, facts, *, scale=1.0, override=False):
        from steerkit import Intervention
        return [Intervention.add(self.site, self.v, scale, positions=self.positions)]


def _facts(sm):
    from steerkit.vectors.apply import fingerprint_of
    return {"name": sm.name, "d_model": sm.d_model, "n_layers": sm.n_layers, "fingerprint": fingerprint_of(sm)}


def test_resolve_checks_artifacts_and_maps_sites(tiny):
    from steerkit import Intervention
    from steerkit.vectors import DirectionSet, SteeringVector
    d = tiny.d_model
    v = torch.randn(d)
    basis = torch.randn(1, d)
    store = _Store({"add@1": SteeringVector.from_direction(v, 1, tiny),
                    "abl@1": DirectionSet.from_directions(basis, tiny, layers=None),
                    "pre@1": SteeringVector.from_direction(v, 1, tiny, hook_site="hook_resid_pre"),
                    "pre0@1": SteeringVector.from_direction(v, 0, tiny, hook_site="hook_resid_pre"),
                    "mid@1": _Lowered("blocks.1.hook_resid_mid", v)})
    facts = _facts(tiny)
    r = resolve(parse_spec({"artifacts": [{"ref": "add@1", "scale": 2.0}]}), store=store, facts=facts)
    (iv,) = r.interventions
    assert isinstance(iv, Intervention) and (iv.site, iv.op, iv.scale, iv.positions) == \
        ("blocks.1.hook_resid_post", "add", 2.0, "all")
    assert torch.equal(iv.tensor, v) and r.sites == ("blocks.1.hook_resid_post",)
    assert r.key == parse_spec({"artifacts": [{"ref": "add@1", "scale": 2.0}]}).canonical()
    r = resolve(parse_spec({"artifacts": ["abl@1"]}), store=store, facts=facts)
    assert set(r.sites) == {"blocks.0.hook_resid_pre"} | {f"blocks.{l}.{k}" for l in range(tiny.n_layers)
                                                          for k in ("hook_attn_out", "hook_mlp_out")}
    assert all(iv.op == "ablate" and iv.scale == 1.0 for iv in r.interventions)
    assert torch.allclose(r.interventions[0].tensor, basis / basis.norm())
    r = resolve(parse_spec({"artifacts": ["pre@1"]}), store=store, facts=facts)
    assert r.sites == ("blocks.0.hook_resid_post",)  # resid_pre of block 1 is resid_post of block 0
    r = resolve(parse_spec({"artifacts": ["pre0@1"]}), store=store, facts=facts)
    assert r.sites == ("blocks.0.hook_resid_pre",)  # the embedding output
    with pytest.raises(SpecError, match=re.escape("expected a site the vLLM plugin can edit")):
        resolve(parse_spec({"artifacts": ["mid@1"]}), store=store, facts=facts)
    with pytest.raises(SpecError, match="expected an artifact 'nope@1'"):
        resolve(parse_spec({"artifacts": ["nope@1"]}), store=store, facts=facts)
    with pytest.raises(SpecError, match="fingerprint differs"):
        resolve(parse_spec({"artifacts": ["add@1"]}), store=store, facts={**facts, "fingerprint": "sk1:x"})
    r = resolve(parse_spec({"artifacts": ["add@1"], "override": True}), store=store, facts={**facts, "fingerprint": "sk1:x"})
    assert any("override" in n for n in r.notes)
    # the worker (check=False) applies what the front end checked, without notes
    r = resolve(parse_spec({"artifacts": ["add@1"]}), store=store, facts={**facts, "fingerprint": "sk1:x"}, check=False)
    assert r.sites == ("blocks.1.hook_resid_post",) and r.notes == ()
    with pytest.raises(SpecError, match="d_model"):
        resolve(parse_spec({"artifacts": ["add@1"]}), store=store, facts={**facts, "d_model": d + 1})
    with pytest.raises(SpecError, match="orthonormal") as e:  # two overlapping ablations at one site
        u = [1.0] + [0.0] * (d - 1)
        w = [0.6, 0.8] + [0.0] * (d - 2)
        resolve(parse_spec({"ops": [{"op": "ablate", "layers": [0], "vector": u},
                                    {"op": "ablate", "layers": [0], "vector": w}]}), store=store, facts=facts)
    assert "blocks.0.hook_resid_post" in str(e.value)  # where it is
    n = tiny.n_layers
    with pytest.raises(SpecError, match=re.escape(f"expected layers in 0..{n - 1}, found [{n + 3}]")):
        resolve(parse_spec({"ops": [{"op": "add", "layers": [n + 3], "vector": u}]}), store=store, facts=facts)
    with pytest.raises(SpecError, match=re.escape(f"expected inline vectors of d_model={d}, found length 3")):
        resolve(parse_spec({"ops": [{"op": "add", "layers": [0], "vector": [1.0, 2.0, 3.0]}]}), store=store,
                facts=facts)


def test_resolve_inline_ops_and_server_positions(tiny):
    from steerkit.hooks.positions import AnyOf, TokenMatch
    from steerkit.kernels import orthonormalize
    d = tiny.d_model
    g = torch.Generator().manual_seed(1)
    V = torch.randn(2, d, generator=g)
    q = orthonormalize(torch.cat([V, torch.randn(1, d, generator=g)]))[2]  # orthogonal to the ablated span
    facts = _facts(tiny)
    r = resolve(parse_spec({"ops": [{"op": "ablate", "layers": [0, 1], "vectors": V.tolist(), "positions": [-1, 0]},
                                    {"op": "clamp", "layers": [1], "vector": (3 * q).tolist(), "value": 2.0,
                                     "positions": "last"}]}), store=_Store({}), facts=facts)
    a0, a1, c = r.interventions
    assert (a0.site, a1.site, c.site) == ("blocks.0.hook_resid_post", "blocks.1.hook_resid_post",
                                          "blocks.1.hook_resid_post")
    assert a0.op == "ablate" and a0.positions == [-1, 0] and torch.allclose(a0.tensor, orthonormalize(V), atol=1e-6)
    assert c.op == "clamp" and c.positions == "last" and float(c.value[0]) == 2.0
    assert torch.allclose(c.tensor[0], q, atol=1e-6)
    site, ones = "blocks.1.hook_resid_post", torch.ones(d)  # artifacts whose positions need token ids or a batch
    store = _Store({"tok@1": _Lowered(site, ones, TokenMatch([3])), "any@1": _Lowered(site, ones, AnyOf("last", TokenMatch([3]))),
                    "mask@1": _Lowered(site, ones, torch.ones(1, 4, dtype=torch.bool)),
                    "rng@1": _Lowered(site, ones, AnyOf("generated", range(-2, 0)))})
    for ref, what in (("tok@1", "token pattern"), ("any@1", "token pattern"), ("mask@1", "bool mask")):
        with pytest.raises(SpecError, match=f"expected positions a server can evaluate at 'blocks.1.hook_resid_post'.*{what}"):
            resolve(parse_spec({"artifacts": [ref]}), store=store, facts=facts)
    assert resolve(parse_spec({"artifacts": ["rng@1"]}), store=store, facts=facts).sites == ("blocks.1.hook_resid_post",)


def test_plan_steers_exactly_the_rows_asked_for(tiny):
    """Three requests flattened as a server does: A (add everywhere, clamp on its last prompt token)
    prefilling 4 rows, an unsteered one, and B (add on generated tokens only, plus a clamp on prompt
    tokens -2 and 5) with rows at positions 4, 5 (prompt) and 6 (generated); each steered row
    equals fused_steer with its own configuration, the rest is unchanged."""
    from steerkit.kernels import fused_steer
    d = tiny.d_model
    g = torch.Generator().manual_seed(0)
    va, vb, u = torch.randn(d, generator=g), torch.randn(d, generator=g), torch.randn(d, generator=g)
    u = u / u.norm()
    facts = _facts(tiny)
    ra = resolve(parse_spec({"ops": [{"op": "add", "layers": [1], "vector": va.tolist(), "scale": 3.0},
                                     {"op": "clamp", "layers": [1], "vector": u.tolist(), "value": 2.0,
                                      "positions": "last"}]}), store=_Store({}), facts=facts)
    rb = resolve(parse_spec({"ops": [{"op": "add", "layers": [1], "vector": vb.tolist(), "positions": "generated"},
                                     {"op": "clamp", "layers": [1], "vector": u.tolist(), "value": -1.0,
                                      "positions": [-2, 5]}]}), store=_Store({}), facts=facts)
    blocks = [Block(0, 4, np.arange(4), 4, ra), Block(4, 6, np.arange(2), 2, None),
              Block(6, 9, np.array([4, 5, 6]), 6, rb)]  # B: prompt of 6; rows at positions 4, 5 (prompt), 6
    plan = StepPlan(blocks)
    site = "blocks.1.hook_resid_post"
    assert set(plan.sites) == {site} and [b.resolved for b in plan.blocks] == [ra, rb]
    h = torch.randn(9, d, generator=g)
    out = plan.apply(site, h)
    assert torch.equal(out[4:6], h[4:6])  # the unsteered request
    assert torch.allclose(out[:3], h[:3] + 3.0 * va, atol=1e-5)
    want3 = fused_steer(h[3:4], basis=u[None], target=torch.tensor([2.0]), add=3.0 * va[None]).squeeze(0)
    assert torch.allclose(out[3], want3, atol=1e-4)  # A's last prompt token: clamp, then add
    for r in (6, 7):  # B's prompt tokens 4 (index -2 of 6) and 5: clamp only
        assert torch.allclose(out[r], h[r] + (-1.0 - h[r] @ u) * u, atol=1e-4)
    assert torch.allclose(out[8], h[8] + vb, atol=1e-5)  # generated: add only (5 is a prompt index)
    assert not StepPlan([Block(0, 3, np.arange(3), 3, None)])
    # each request's own compiled steering: the order the server lists its requests in does not matter
    order = [6, 7, 8, 4, 5, 0, 1, 2, 3]
    again = StepPlan([Block(0, 3, np.array([4, 5, 6]), 6, rb), Block(3, 5, np.arange(2), 2, None),
                      Block(5, 9, np.arange(4), 4, ra)])
    assert torch.equal(again.apply(site, h[order]), out[order])


def test_plan_steers_resid_pre_and_resid_post_at_one_site(tiny):
    """blocks.1.hook_resid_pre is blocks.0.hook_resid_post: two requests steering through either
    name act at one site, each row steered by its own request; decode rows by position."""
    from steerkit.vectors import SteeringVector
    d = tiny.d_model
    g = torch.Generator().manual_seed(2)
    v, w = torch.randn(d, generator=g), torch.randn(d, generator=g)
    store = _Store({"pre@1": SteeringVector.from_direction(v, 1, tiny, hook_site="hook_resid_pre")})
    facts = _facts(tiny)
    ra = resolve(parse_spec({"artifacts": [{"ref": "pre@1", "scale": 0.5}]}), store=store, facts=facts)
    rb = resolve(parse_spec({"ops": [{"op": "add", "layers": [0], "vector": w.tolist(), "positions": "prompt"}]}),
                 store=store, facts=facts)
    site = "blocks.0.hook_resid_post"
    plan = StepPlan([Block(0, 1, np.array([7]), 5, ra), Block(1, 2, np.array([5]), 5, rb),
                     Block(2, 4, np.array([3, 4]), 5, rb)])
    assert set(plan.sites) == {site} and ra.sites == rb.sites == (site,)
    h = torch.randn(4, d, generator=g)
    out = plan.apply(site, h)
    assert torch.allclose(out[0], h[0] + 0.5 * v, atol=1e-5)
    assert torch.equal(out[1], h[1])  # a decode token: not a prompt token
    assert torch.allclose(out[2:], h[2:] + w, atol=1e-5)


def test_plan_matches_steerkit_generation_on_a_model(tiny):
    """The plan's edit at resid_post, applied through a hook on the HF blocks, gives the same
    logits as steerkit's own add edit at that site."""
    from steerkit.serving.plan import single_request_plan
    from steerkit.vectors import SteeringVector
    d = tiny.d_model
    v = torch.randn(d)
    store = _Store({"a@1": SteeringVector.from_direction(v, 1, tiny)})
    res = resolve(parse_spec({"artifacts": [{"ref": "a@1", "scale": 2.0}]}), store=store, facts=_facts(tiny))
    toks = tiny.tokenize(["hello there"], chat=False)
    T = toks.input_ids.shape[1]
    plan = single_request_plan(res, T, T)
    site = "blocks.1.hook_resid_post"
    block = tiny.adapter.block(tiny.model, 1)

    def hook(_m, _a, out):
        h = out[0] if isinstance(out, tuple) else out
        new = plan.apply(site, h[0])[None]
        return (new, *out[1:]) if isinstance(out, tuple) else new

    hd = block.register_forward_hook(hook)
    try:
        got = tiny.model(input_ids=toks.input_ids, attention_mask=toks.attention_mask).logits
    finally:
        hd.remove()
    with tiny.steer(store.load("a@1"), scale=2.0):
        want = tiny.forward(toks)
    want = want.logits if hasattr(want, "logits") else want
    assert torch.allclose(got, want, atol=1e-5)


def test_export_hf_and_folder_fingerprint(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    import steerkit
    from steerkit.errors import InputError
    from steerkit.loading.export_hf import export_hf
    from steerkit.vectors.provenance import folder_fingerprint, model_fingerprint
    out = export_hf(tiny, tmp_path / "m")
    meta = json.loads((out / "steerkit_export.json").read_text())
    assert meta["model_fingerprint"] == model_fingerprint(tiny) == folder_fingerprint(out)
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["architectures"] == [type(tiny.model).__name__]
    back = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.allclose(back(ids).logits, tiny.model(ids).logits, atol=1e-5)  # eager vs sdpa attention
    with pytest.raises(InputError, match="overwrite=True"):
        export_hf(tiny, out)
    export_hf(tiny, out, overwrite=True)
    # a plain HF folder (no steerkit_export.json): the fingerprint read from its files equals the
    # fingerprint of the model load_model makes from it
    (out / "steerkit_export.json").unlink()
    assert folder_fingerprint(out) == model_fingerprint(steerkit.load_model(str(out)))


def test_cli_model_export_and_serve_dry_run(tiny, tmp_path, capsys):
    from steerkit.cli import main
    src = tmp_path / "src"
    tiny.model.save_pretrained(src)
    tiny.tokenizer.save_pretrained(src)
    assert main(["model", "export", "--format", "hf", str(tmp_path / "exp"), "--model", str(src)]) == 0
    assert (tmp_path / "exp" / "model.safetensors").is_file()
    assert main(["serve", str(tmp_path / "exp"), "--store", str(tmp_path / "st"), "--port", "8123", "--dry-run",
                 "--", "--max-model-len", "512"]) == 0
    err = capsys.readouterr().err
    assert "VLLM_PLUGINS=steerkit" in err and f"STEERKIT_STORE={tmp_path / 'st'}" in err
    assert "--enforce-eager" not in err and err.rstrip().endswith("--max-model-len 512")  # compiled by default
    assert main(["serve", str(tmp_path / "exp"), "--eager", "--dry-run"]) == 0
    assert "--enforce-eager" in capsys.readouterr().err
    assert main(["serve", str(tmp_path / "nothing"), "--dry-run"]) == 2  # no model folder: a clear error
    assert "steerkit model export" in capsys.readouterr().err
    assert main(["serve", str(tmp_path / "exp"), "--host", "0.0.0.0", "--dry-run"]) == 2


def _asgi(app, body: bytes, path="/v1/completions"):
    """Run one POST through an ASGI app; returns (status, body bytes, what the inner app received)."""
    import asyncio
    sent, msgs = [], [{"type": "http.request", "body": body[:7], "more_body": True},
                      {"type": "http.request", "body": body[7:], "more_body": False}]

    async def receive():
        return msgs.pop(0) if msgs else {"type": "http.disconnect"}

    async def send(m):
        sent.append(m)
    scope = {"type": "http", "method": "POST", "path": path, "app": app.fastapi}
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_request_check_refuses_bad_specs_before_the_route_and_replays_good_bodies(tiny, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from steerkit.loading.export_hf import export_hf
    from steerkit.serving import vllm_plugin
    from steerkit.vectors import Store, SteeringVector
    model_dir = export_hf(tiny, tmp_path / "m")
    store = Store(tmp_path / "store")
    store.save("v", SteeringVector.from_direction(torch.ones(tiny.d_model), 1, tiny, method="test"))
    monkeypatch.setenv("STEERKIT_STORE", str(tmp_path / "store"))
    cfg = tiny.model.config
    mc = SimpleNamespace(enforce_eager=True, hf_config=cfg, model=str(model_dir), served_model_name="tiny")
    received = []

    async def inner(scope, receive, send):
        chunks = []
        while True:
            m = await receive()
            chunks.append(m.get("body", b""))
            if not m.get("more_body"):
                break
        received.append(b"".join(chunks))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
    app = vllm_plugin.RequestCheck(inner)
    app.fastapi = SimpleNamespace(state=SimpleNamespace(vllm_config=SimpleNamespace(model_config=mc),
                                                        engine_client=SimpleNamespace(input_processor=SimpleNamespace())))
    bad = json.dumps({"prompt": "hi", "stream": True, "vllm_xargs": {"steerkit": json.dumps(
        {"artifacts": [{"ref": "nope@1"}]})}}).encode()
    status, out = _asgi(app, bad)
    err = json.loads(out)["error"]
    assert status == 400 and "expected an artifact 'nope@1'" in err["message"] and err["param"] == "vllm_xargs.steerkit"
    assert received == []  # the route never ran
    bad_record = json.dumps({"prompt": "hi", "stream": True, "vllm_xargs": {"steerkit_record": json.dumps(
        {"hooks": ["blocks.1.hook_resid_post"], "run": "r1"})}}).encode()
    monkeypatch.delenv("STEERKIT_RECORD_DIR", raising=False)
    status, out = _asgi(app, bad_record)
    assert status == 400 and "record folder" in json.loads(out)["error"]["message"] and received == []
    for good in (json.dumps({"prompt": "hi", "vllm_xargs": {"steerkit": json.dumps({"artifacts": [{"ref": "v@1"}]})}}),
                 json.dumps({"prompt": "hi"}), "not json"):
        status, out = _asgi(app, good.encode(), path="/v1/chat/completions")
        assert (status, out) == (200, b"ok") and received[-1] == good.encode()  # replayed byte for byte
    # vLLM's input processor (found through app.state.engine_client) holds the front end the middleware used
    front = app.fastapi.state.engine_client.input_processor._steerkit_front
    assert front.check(json.dumps({"artifacts": [{"ref": "v@1"}]})) is not None
    # compiled on the CPU: the steering runs on the host where the slots cannot hold it
    mc.enforce_eager = False
    ablate3 = json.dumps({"prompt": "x", "vllm_xargs": {"steerkit": json.dumps({"ops": [
        {"op": "ablate", "layers": [1], "vectors": torch.eye(tiny.d_model)[:3].tolist()}]})}}).encode()
    monkeypatch.setenv("STEERKIT_VLLM_SLOTS", "basis=2")

    def server(**config):  # a new server, with a new front end
        app.fastapi.state = SimpleNamespace(vllm_config=SimpleNamespace(model_config=mc, **config))
    server()
    assert _asgi(app, ablate3) == (200, b"ok")
    # compiled on CUDA (graphs): a table larger than the slots is refused, with what to do
    server(device_config=SimpleNamespace(device_type="cuda"))
    status, out = _asgi(app, ablate3)
    msg = json.loads(out)["error"]["message"]
    assert status == 400 and "a basis of 3 directions (the slots hold 2)" in msg and "--enforce-eager" in msg
    monkeypatch.setenv("STEERKIT_VLLM_SLOTS", "basis=4")
    server(device_config=SimpleNamespace(device_type="cuda"))
    assert _asgi(app, ablate3) == (200, b"ok")


def test_plugin_refuses_untested_vllm_versions(monkeypatch):
    from steerkit.errors import BackendUnavailableError
    from steerkit.serving.vllm_plugin import TESTED_VLLM, check_vllm_version
    check_vllm_version(TESTED_VLLM[0])
    for v in ("0.31.9", "0.33.0", "1.0.0"):
        with pytest.raises(BackendUnavailableError, match=f"found {v}; install a tested vLLM"):
            check_vllm_version(v)
    monkeypatch.setenv("STEERKIT_VLLM_UNTESTED", "1")
    check_vllm_version("0.33.0")  # allowed, with a warning in the log


def test_parse_spec_bounds_layers_positions_and_nesting():
    """Found by benchmarks/soak_serve.py: a 3 MB spec listing one layer 1.5 million times took two minutes of
    the server's CPU to refuse, and 10 ops x 30 layers x 65,536 prompt positions 16 s to accept; a spec
    nested too deeply raised RecursionError. Each is now a SpecError from the parse, before any work."""
    from steerkit.serving.spec import MAX_LAYERS, MAX_POSITIONS
    add = {"op": "add", "vector": [1.0, 0.0]}
    bad = [({"ops": [{**add, "layers": [0] * 1_500_000}]}, f"at most {MAX_LAYERS} distinct block indices, found 1500000"),
           ({"ops": [{**add, "layers": [1, 2, 1]}]}, "ops[0].layers without repeats, found 1 repeated"),
           ({"ops": [{**add, "layers": list(range(30)), "positions": [5] * 65536}] * 10},
            f"at most {MAX_POSITIONS} prompt-token indices per request"),
           ({"ops": [{**add, "layers": [0, 1], "positions": list(range(MAX_POSITIONS // 4))}] * 2
             + [{**add, "layers": [2], "positions": [0]}]}, "found more by ops[2]"),
           ('{"ops": ' + "[" * 100_000 + "]" * 100_000 + "}", "could not parse it")]
    for spec, msg in bad:
        with pytest.raises(SpecError, match=re.escape(msg)):
            parse_spec(spec)
    ok = parse_spec({"ops": [{**add, "layers": [0, 1], "positions": list(range(MAX_POSITIONS // 4))}] * 2})
    assert len(ok.ops) == 2 and ok.ops[1].positions[-1] == MAX_POSITIONS // 4 - 1  # exactly at the bound
    assert parse_spec({"ops": [{**add, "layers": list(range(MAX_LAYERS))}]}).ops[0].layers[-1] == MAX_LAYERS - 1


def _checked_app(tiny, tmp_path, monkeypatch):
    """A RequestCheck around an inner app that records the bodies it gets (the tiny model's config)."""
    from types import SimpleNamespace

    from steerkit.loading.export_hf import export_hf
    from steerkit.serving import vllm_plugin
    monkeypatch.setenv("STEERKIT_STORE", str(tmp_path / "store"))
    mc = SimpleNamespace(enforce_eager=True, hf_config=tiny.model.config, model=str(export_hf(tiny, tmp_path / "m")),
                         served_model_name="tiny")
    received = []

    async def inner(scope, receive, send):
        received.append(await receive())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
    app = vllm_plugin.RequestCheck(inner)
    app.fastapi = SimpleNamespace(state=SimpleNamespace(vllm_config=SimpleNamespace(model_config=mc)))
    return app, received


def _post_chunks(app, chunks, before=None):
    """POST ``chunks`` (one ASGI message each) through ``app``; ``before``: a coroutine function run as a task
    beside it. Returns (status, error object, how many messages the app read)."""
    import asyncio
    msgs = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent, n = [], [0]

    async def receive():
        n[0] += 1
        return msgs.pop(0) if msgs else {"type": "http.disconnect"}

    async def send(m):
        sent.append(m)

    async def main():
        task = asyncio.create_task(before()) if before else None
        await app({"type": "http", "method": "POST", "path": "/v1/completions", "app": app.fastapi}, receive, send)
        if task:
            await task
    asyncio.run(main())
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, (json.loads(body)["error"] if status != 200 else body), n[0]


def test_request_check_refuses_oversized_and_too_deep_bodies_with_4xx(tiny, tmp_path, monkeypatch):
    """Found by benchmarks/soak_serve.py: a body over MAX_BODY went on unchecked, so a streamed one with a bad
    spec got a 200 stream carrying the error; a body nested too deeply made the check raise (HTTP 500).
    Now: 413 after the whole body is read (so the client is not still writing), and 400."""
    from steerkit.serving import vllm_plugin
    app, received = _checked_app(tiny, tmp_path, monkeypatch)
    monkeypatch.setattr(vllm_plugin.RequestCheck, "MAX_BODY", 100)
    spec = json.dumps({"artifacts": [{"ref": "nope@1"}], "pad": "x" * 200})
    body = json.dumps({"prompt": "hi", "stream": True, "vllm_xargs": {"steerkit": spec}}).encode()
    chunks = [body[i:i + 10] for i in range(0, len(body), 10)]
    status, err, n_read = _post_chunks(app, chunks)
    assert status == 413 and "at most 100 bytes" in err["message"] and err["code"] == 413
    assert n_read == len(chunks) and received == []  # read to the end; the route never ran
    monkeypatch.setattr(vllm_plugin.RequestCheck, "MAX_BODY", 64 << 20)
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b', "vllm_xargs": {"steerkit": "{}"}}'
    status, err, _ = _post_chunks(app, [deep])
    assert (status, err["param"]) == (400, None) and "nested too deeply" in err["message"] and received == []
    deep_spec = json.dumps({"prompt": "hi", "vllm_xargs": {"steerkit": '{"ops": ' + "[" * 100_000 + "]" * 100_000 + "}"}})
    status, err, _ = _post_chunks(app, [deep_spec.encode()])
    assert status == 400 and "could not parse it" in err["message"] and received == []
    assert _post_chunks(app, [b'{"prompt": "hi"}'])[:2] == (200, b"ok") and len(received) == 1


def test_request_check_checks_specs_off_the_event_loop(tiny, tmp_path, monkeypatch):
    """Found by benchmarks/soak_serve.py: the check ran in the server's event loop, so one request whose spec
    took 11 s to refuse stopped every other stream for 11 s. The check now runs in a worker thread: here it
    waits for the event loop to run another task, which it could not do in the loop's own thread."""
    import threading

    from steerkit.serving import vllm_plugin
    app, received = _checked_app(tiny, tmp_path, monkeypatch)
    ticked, threads = threading.Event(), []

    def slow_refusal(scope, body):
        threads.append(threading.get_ident())
        assert ticked.wait(10), "the event loop did not run while the spec was checked"
        return None

    async def ticker():
        threads.append(threading.get_ident())
        ticked.set()
    monkeypatch.setattr(vllm_plugin.RequestCheck, "refusal", staticmethod(slow_refusal))
    assert _post_chunks(app, [b'{"prompt": "hi"}'], before=ticker)[:2] == (200, b"ok")
    assert len(set(threads)) == 2 and len(received) == 1


def test_an_unknown_artifact_answer_does_not_name_the_servers_store_path(tiny, tmp_path):
    """The 400 a client gets for an unknown artifact says which names the store holds, not where it lives."""
    from steerkit.vectors import Store, SteeringVector
    store = Store(tmp_path / "private-store-path")
    store.save("happy", SteeringVector.from_direction(torch.randn(tiny.d_model), 1, tiny))
    with pytest.raises(SpecError) as e:
        resolve(parse_spec({"artifacts": ["nope@1"]}), store=store, facts=_facts(tiny))
    msg = str(e.value)
    assert "expected an artifact 'nope@1' in the server's store" in msg and "happy" in msg
    assert "private-store-path" not in msg and str(tmp_path) not in msg
