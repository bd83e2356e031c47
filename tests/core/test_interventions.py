"""The one intervention type and its one compile step.

Every way of steering lowers to :class:`steerkit.Intervention` and passes through
:func:`steerkit.interventions.compile_steering`. These tests check the compiled programs against a plain
torch computation of what each intervention means, row by row and position by position, on a tiny
random Llama (mechanics only), and that artifacts, keyword edits and kernel specs lower to the same
thing.
"""
from __future__ import annotations

import ast
import gc
import weakref
from pathlib import Path

import pytest
import torch

import steerkit
from steerkit import Intervention
from steerkit.errors import InputError
from steerkit.interventions import Gate, compile_steering, server_mask_of
from steerkit.kernels import SteerConfig

from tiny_models import tiny_model

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["abc de", "hello there world", "x"]


def _resid(sm, layer, prompts, **steer):
    """``blocks.{layer}.hook_resid_post`` of every position under an optional steering (registered
    first, so the record hook at the same site sees the steered values)."""
    name = f"blocks.{layer}.hook_resid_post"
    h = sm.steer(**steer) if steer else None
    try:
        with sm.record(name, positions="all") as c:
            sm.forward(prompts, chat=False)
    finally:
        if h is not None:
            h.remove()
    return c[name], c.lengths(name)


def _unit(d, seed):
    v = torch.randn(d, generator=torch.Generator().manual_seed(seed))
    return v / v.norm()


def test_two_positions_at_one_site_equal_the_formulas(tiny):
    """add at every position + clamp at the last prompt token, one site: the clamp rows get both
    (the kernel's order: clamp, then add), every other row the add alone."""
    d, L = tiny.d_model, 1
    site = f"blocks.{L}.hook_resid_post"
    v, u = _unit(d, 0) * 3, _unit(d, 1)
    ivs = [Intervention.add(site, v, 2.0), Intervention.clamp(site, u, 5.0, positions="last")]
    base, n = _resid(tiny, L, PROMPTS)
    got, _ = _resid(tiny, L, PROMPTS, steering=ivs)
    for b in range(len(PROMPTS)):
        for t in range(int(n[b])):
            h = base[b, t]
            want = h + 2.0 * v
            if t == int(n[b]) - 1:  # the last prompt token: clamp first, then add
                want = h + (5.0 - h @ u) * u + 2.0 * v
            torch.testing.assert_close(got[b, t], want, atol=1e-5, rtol=1e-5)
    prog = tiny.compile(ivs).programs[site]
    assert prog.table.n_configs == 3  # {add}, {clamp}, {add, clamp}: one table, one call per step


def test_per_row_groups_with_torch_steps(tiny):
    """Per-row steering: row 0 unsteered, row 1 an ablation, row 2 a replacement at its prompt
    tokens; each row equals that row run alone with its own steering."""
    d, L = tiny.d_model, 1
    site = f"blocks.{L}.hook_resid_post"
    u, r = _unit(d, 2), _unit(d, 3)
    rows = [None, [Intervention.ablate(site, u)], [Intervention.replace(site, r, 0.5, positions="prompt")]]
    got, n = _resid(tiny, L, PROMPTS, rows=rows)
    for b, s in enumerate(rows):
        alone, m = _resid(tiny, L, [PROMPTS[b]], **({"steering": s} if s else {}))
        k = int(m[0])
        torch.testing.assert_close(got[b, :k], alone[0, :k], atol=1e-5, rtol=1e-5)
    assert torch.allclose(got[2, : int(n[2])], 0.5 * r.expand(int(n[2]), d))
    assert torch.allclose((got[1, : int(n[1])] @ u), torch.zeros(int(n[1])), atol=1e-5)


def test_keyword_edit_kernel_spec_and_intervention_are_the_same(tiny):
    d, site = tiny.d_model, "blocks.1.hook_attn_out"
    v = _unit(d, 4)
    a = _resid(tiny, 1, PROMPTS, steering=[Intervention.add(site, v, 3.0)])[0]
    with tiny.edit(site, add=v, scale=3.0):
        b = _resid(tiny, 1, PROMPTS)[0]
    with pytest.warns(DeprecationWarning, match="kernel's format"):  # the kernel's {hook: SteerConfig}, deprecated
        c = _resid(tiny, 1, PROMPTS, steering={site: SteerConfig.injection(v, 3.0)})[0]
    assert torch.equal(a, b) and torch.equal(a, c)


def test_artifacts_lower_to_interventions_with_a_check(tiny):
    from steerkit.vectors import DirectionSet, ModelMismatchError, SteeringVector
    d = tiny.d_model
    v = _unit(d, 5)
    sv = SteeringVector.from_direction(v, [0, 1], tiny, scale=2.0)
    ivs = sv.to_interventions(tiny.facts, scale=1.5)
    assert [(i.site, i.op, i.scale) for i in ivs] == [("blocks.0.hook_resid_post", "add", 1.5),
                                                     ("blocks.1.hook_resid_post", "add", 1.5)]
    assert torch.equal(ivs[0].tensor, v * 2.0)
    ds = DirectionSet.from_directions(torch.stack([_unit(d, 6), _unit(d, 7)]), tiny)
    every = ds.to_interventions(tiny.facts)
    assert [i.site for i in every] == ["blocks.0.hook_resid_pre"] + [
        f"blocks.{l}.{h}" for l in range(tiny.n_layers) for h in ("hook_attn_out", "hook_mlp_out")]
    other = SteeringVector.from_direction(torch.ones(d + 1), 1)
    with pytest.raises(ModelMismatchError, match="d_model"):
        other.to_interventions(tiny.facts)
    # sm.steer(artifact) is the same as sm.steer(its interventions); the handle removes itself
    before = tiny.hook_count()
    h = tiny.steer(sv, 1.5)
    assert tiny.hook_count() == before + 2
    a = _resid(tiny, 1, PROMPTS)[0]
    h.remove()
    assert tiny.hook_count() == before
    b = _resid(tiny, 1, PROMPTS, steering=ivs)[0]
    assert torch.equal(a, b)


def test_region_projection_strength_lives_in_the_config(tiny):
    """A stored region is the kernel's region: it is projected into as it is, and the strength of
    the projection is the configuration's ``region_strength`` (the table's ``region_s``)."""
    from steerkit.interventions import from_config
    from steerkit.kernels import Polyhedron as KernelRegion
    from steerkit.vectors import Region
    d, L = tiny.d_model, 1
    site = f"blocks.{L}.hook_resid_post"
    P = steerkit.orthonormalize(torch.randn(3, d, generator=torch.Generator().manual_seed(8)))
    reg = Region(mean=torch.zeros(d), projection=P, normals=torch.eye(3), offsets=torch.full((3,), -0.5), layer=L)
    assert isinstance(reg, KernelRegion)
    iv = Intervention.project(site, reg, 0.5)
    cfg = iv.config()
    assert cfg.region is reg and cfg.region_strength == 0.5
    back = from_config(site, cfg)
    assert [(i.op, i.scale) for i in back] == [("project", 0.5)] and back[0].region is reg
    both = [iv, Intervention.add(site, _unit(d, 9), 1.0)]
    assert tiny.compile(both).programs[site].table.region_s.tolist() == [0.5]
    base, n = _resid(tiny, L, PROMPTS)
    got, _ = _resid(tiny, L, PROMPTS, steering=[iv])
    for b in range(len(PROMPTS)):
        h = base[b, : int(n[b])].double()
        z = reg.coordinates(h)
        want = h + 0.5 * (reg.project(z) - z) @ P.double()
        torch.testing.assert_close(got[b, : int(n[b])].double(), want, atol=1e-3, rtol=1e-4)


def test_server_entry_equals_local_call(tiny):
    """``SiteProgram.apply`` on flattened rows (as a server calls it) == the local hook's result."""
    d, site = tiny.d_model, "blocks.1.hook_resid_post"
    v, u = _unit(d, 8), _unit(d, 9)
    rows = [[Intervention.add(site, v, 1.0, positions="generated"), Intervention.ablate(site, u, positions=[0, -1])],
            None, [Intervention.clamp(site, u, -2.0, positions="prompt")]]
    prog = compile_steering(rows, tiny.facts, per_row=True).programs[site]
    n_prompt, start, T = [5, 3, 4], [3, 0, 4], [4, 3, 1]  # prefill chunk, whole prompt, a decode token
    hs = [torch.randn(t, d, generator=torch.Generator().manual_seed(10 + i)) for i, t in enumerate(T)]
    h = torch.cat(hs)
    groups = torch.cat([torch.full((t,), g if rows[g] is not None else -1) for g, t in enumerate(T)])
    masks = [server_mask_of(torch.arange(s, s + t), p) for s, t, p in zip(start, T, n_prompt)]

    def mask_of(spec):
        parts = [m(spec) for m in masks]
        return torch.cat([torch.ones(t, dtype=torch.bool) if p is None else p for p, t in zip(parts, T)])
    out = prog.apply(h, groups, mask_of)
    off = 0
    for g, (t, s, p) in enumerate(zip(T, start, n_prompt)):
        x = hs[g]
        want = x.clone()
        for j in range(t):
            pos = s + j
            y = x[j].clone()
            if g == 0:
                if pos in (0, p - 1):
                    y = y - (y @ u) * u
                if pos >= p:
                    y = y + v
            if g == 2 and pos < p:
                y = y + (-2.0 - y @ u) * u
            want[j] = y
        torch.testing.assert_close(out[off:off + t], want, atol=1e-5, rtol=1e-5)
        off += t


def test_clear_errors_and_no_hooks_left(tiny):
    d, site = tiny.d_model, "blocks.1.hook_resid_post"
    before = tiny.hook_count()
    g1, g2 = Gate(_unit(d, 1), 0.1), Gate(_unit(d, 2), 0.1)
    cases = [
        ([Intervention.add(site, _unit(d, 0), gate=g1), Intervention.add(site, _unit(d, 3), gate=g2)], "one gate"),
        ([Intervention.add(site, _unit(d, 0), preserve_norm=True), Intervention.ablate(site, _unit(d, 1))],
         "preserve_norm"),
        ([Intervention.ablate(site, _unit(d, 0)), Intervention.ablate(site, _unit(d, 0))], "orthonormal"),
        ([Intervention.add(site, torch.ones(d + 2))], f"shape \\[{d}\\]"),
        ([Intervention.add(site, _unit(d, 0), positions=p) for p in ([0], [1], [2], [3], [4])], "position specs"),
        ([Intervention.add("blocks.9.hook_resid_post", _unit(d, 0))], "layer"),
    ]
    for steering, match in cases:
        with pytest.raises((InputError, steerkit.HookNameError), match=match):
            tiny.steer(steering)
        assert tiny.hook_count() == before
    with pytest.raises(InputError, match="finite"):
        Intervention.add(site, torch.full((d,), float("nan")))
    with pytest.raises(InputError, match="gate only"):
        Intervention(site, "ablate", _unit(d, 0)[None], gate=g1)


def test_record_handle_is_a_scope(tiny):
    h = tiny.record("blocks.1.hook_resid_post", positions="last")
    tiny.forward(PROMPTS, chat=False)
    h.remove()
    assert h.cache["blocks.1.hook_resid_post"].shape == (3, tiny.d_model)
    assert tiny.hook_count() == 0 or not h.active


def test_fingerprint_cache_holds_models_weakly():
    from steerkit.vectors.apply import _FP_CACHE, fingerprint_of
    model, _ = tiny_model("llama", seed=3)
    fingerprint_of(model)
    ref = weakref.ref(model)
    assert ref() in _FP_CACHE
    del model
    gc.collect()
    assert ref() is None


def test_one_lowering_function():
    """Kernel tables are built in one place of the package: the compile step (and the kernels)."""
    builders = []
    for pkg in ("steerkit", "vectors", "probes", "apps"):
        for f in (ROOT / pkg).rglob("*.py"):
            tree = ast.parse(f.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr == "from_configs":
                    builders.append(str(f.relative_to(ROOT)))
    assert builders == ["steerkit/interventions/program.py"], builders


def test_apply_fn_of_the_wrong_shape_is_refused(tiny):
    site = "blocks.1.hook_resid_post"
    with tiny.steer([Intervention.apply(site, lambda x: x[..., :3])]):
        with pytest.raises(InputError, match="to return a tensor of shape"):
            tiny.forward(PROMPTS, chat=False)
    assert tiny.hook_count() == 0


def test_per_row_steering_is_said_with_rows(tiny):
    """sm.steer(rows=[...]) / generate(steer_rows=[...]) steer each row its own way; a list of
    Interventions is one steering (composed); the old per-row list warns and still works."""
    t = tiny
    add = steerkit.Intervention.add("blocks.1.hook_resid_post", torch.ones(64), 3.0)
    prompts = ["hi there", "bye"]
    base = t.forward(prompts, chat=False)
    with t.steer(rows=[[add], None]):
        per_row = t.forward(prompts, chat=False)
    assert torch.allclose(per_row[1], base[1]) and not torch.allclose(per_row[0], base[0])
    with pytest.warns(DeprecationWarning, match="rows="):
        with t.steer([[add], None]):
            old = t.forward(prompts, chat=False)
    assert torch.equal(old, per_row)
    with t.steer([add, add]):  # one steering: both adds apply to every row
        both = t.forward(prompts, chat=False)
    with t.steer(steerkit.Intervention.add("blocks.1.hook_resid_post", torch.ones(64), 6.0)):
        once = t.forward(prompts, chat=False)
    assert torch.allclose(both, once, atol=1e-4)
    got = t.generate(prompts, 3, chat=False, steer_rows=[[add], None])
    with pytest.warns(DeprecationWarning, match="steer_rows="):
        assert t.generate(prompts, 3, chat=False, steering=[[add], None]) == got
    with pytest.raises(InputError, match="both"):
        t.steer([add], rows=[[add], None])
    with pytest.raises(InputError, match="one steering spec per prompt"):
        t.generate(prompts, 3, chat=False, steer_rows=[[add]])


def test_model_facts_have_one_builder(tiny):
    """SteerModel.facts, vectors.facts_of, the served model's facts (its config) and a dict all build
    through ModelFacts.from_hf_config / from_dict, as complete as the information allows."""
    import dataclasses
    from types import SimpleNamespace

    from steerkit.interventions import ModelFacts
    from steerkit.serving.spec import _facts
    from steerkit.serving.vllm_plugin import served_facts
    from steerkit.vectors import facts_of
    t = tiny
    f = t.facts
    assert facts_of(t.hf_model) == dataclasses.replace(f, name="LlamaForCausalLM") and facts_of(t) is f
    served = served_facts(SimpleNamespace(hf_config=t.hf_model.config, model="/nonexistent", served_model_name=t.name))
    want = {k: v for k, v in f.as_dict().items() if k not in ("fingerprint", "d_mlp")}
    assert {k: v for k, v in served.as_dict().items() if k in want} == want
    assert served.n_heads == t.n_heads and served.n_kv_heads == t.n_kv_heads and served.d_head == t.d_head
    assert _facts(f.as_dict()) == f == ModelFacts.from_dict(f.as_dict())
    assert t.__dict__["facts"] is f  # functools.cached_property


def test_one_validation_per_steering(tiny, monkeypatch):
    """Artifact -> interventions -> site programs -> bound kernel: an artifact is checked against the model once,
    each intervention's values once (where it is made), and the kernel's table is stacked without checking them
    again; the compile checks each intervention against the model once."""
    from steerkit.kernels import config as K
    from steerkit.vectors import DirectionSet, SteeringVector
    from steerkit.vectors import apply as A

    counts = {"artifact": 0, "values": 0, "table": 0}

    def counted(key, fn):
        def wrapper(*a, **k):
            counts[key] += 1
            return fn(*a, **k)
        return wrapper
    import steerkit.vectors.artifacts.directions as D
    import steerkit.vectors.artifacts.vector as V
    for mod in (V, D):
        monkeypatch.setattr(mod, "check_against", counted("artifact", A.check_against))
    import steerkit.interventions.values as Vals  # the constructors' checks of the values
    monkeypatch.setattr(Vals, "_vector", counted("values", Vals._vector))
    monkeypatch.setattr(Vals, "_basis", counted("values", Vals._basis))
    monkeypatch.setattr(K, "_finite", counted("table", K._finite))
    monkeypatch.setattr(K, "_check_orthonormal", counted("table", K._check_orthonormal))
    d = tiny.d_model
    vec = SteeringVector.from_direction(_unit(d, 9), layer=1, model=tiny, scale=2.0)
    dirs = DirectionSet.from_directions(torch.eye(d)[:2], tiny, layers=[0, 1])
    counts.update(artifact=0, values=0, table=0)
    for art, n_ivs in ((vec, 1), (dirs, 2)):
        before = dict(counts)
        with tiny.steer(art):
            tiny.forward("hello world", chat=False)
        assert counts["artifact"] - before["artifact"] == 1, counts
        assert counts["values"] - before["values"] == n_ivs, counts
        assert counts["table"] == 0, counts
