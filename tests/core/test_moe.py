"""Mixture-of-experts blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) on tiny random-weight models.

The residual and attention batteries of tests/core/test_adapters.py run on every MoE family here; the MoE
hooks are checked against the modeling code: the router's own output captured with a plain torch hook,
the block's output rebuilt by hand from its experts' weights, and the routing rule re-applied to edited
logits."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import steerkit
from steerkit import Intervention
from steerkit.hooks import names as hooknames
from steerkit.errors import InputError, UnsupportedArchitectureError
from steerkit.hooks.names import ATTN_HOOKS, MLP_HOOKS, MLP_IN, MOE_HOOKS, NORM_HOOKS, Site
from steerkit.model import Tokens

from tests.core import test_adapters as battery
from tiny_models import MOE_ARCHS, greedy_by_forward, tiny_model

ATOL = 1e-5
LAYER = 1
N_EXPERTS, TOP_K = 4, 2
ADAPTER = {"mixtral": "mixtral", "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe", "olmoe": "olmoe"}
SHARED = ("qwen2_moe",)


@pytest.fixture(params=MOE_ARCHS)
def arch(request, monkeypatch):
    # the battery's tables of what each family is, for the MoE families (Llama layout)
    monkeypatch.setitem(battery.ADAPTER, request.param, ADAPTER[request.param])
    monkeypatch.setitem(battery.MID_CONSUMER, request.param, "post_attention_layernorm")
    return request.param


# the residual battery of every family: hooks == hidden states, decomposition, zero edits bit-identical,
# edits propagate, final-norm hooks, ablation, left padding, KV-cached generation == forward
from_battery = [battery.test_layout, battery.test_hooks_match_hidden_states, battery.test_residual_decomposition,
                battery.test_zero_add_is_bit_identical, battery.test_edits_propagate, battery.test_final_norm_hooks,
                battery.test_ablate_attn_out, battery.test_left_padding_invariance,
                battery.test_generate_with_cache_matches_forward]
for _t in from_battery:
    globals()[_t.__name__] = _t


steer = battery.steer


def batch(seed=0, B=2, T=7) -> Tokens:
    return battery.batch(seed, B, T)


def site(kind, layer=LAYER):
    return f"blocks.{layer}.{kind}"


@contextlib.contextmanager
def captured(module, io="output"):
    """A module's first input or its whole output, with a plain torch hook (not steerkit's)."""
    box: dict = {}
    if io == "output":
        h = module.register_forward_hook(lambda m, a, o: box.__setitem__("v", o))
    else:
        h = module.register_forward_pre_hook(
            lambda m, a, kw: box.__setitem__("v", (a[0] if a else kw["hidden_states"]).detach()), with_kwargs=True)
    try:
        yield box
    finally:
        h.remove()


@torch.no_grad()
def by_hand(sm: steerkit.SteerModel, layer, x, weights, indices, drop=()):
    """What the sparse block of ``layer`` outputs for its input ``x`` ([b, pos, d]) with this routing,
    computed from the experts' weights (experts in ``drop`` left out), and the shared expert's part."""
    a, m = sm.adapter, sm.hf_model
    ex = a.experts_module(m, layer)
    act = ex.act_fn
    h = x.reshape(-1, x.shape[-1])
    w, idx = weights.reshape(h.shape[0], -1), indices.reshape(h.shape[0], -1)
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if e in drop:
                continue
            gate, up = (ex.gate_up_proj[e] @ h[t]).chunk(2)
            out[t] += (ex.down_proj[e] @ (act(gate) * up)) * w[t, j]
    shared = torch.zeros_like(h)
    sh = a.shared_expert(m, layer)
    if sh is not None:
        shared = torch.sigmoid(sh[1](h)) * sh[0](h)
    return out.reshape(x.shape), shared.reshape(x.shape)


# --- layout ---------------------------------------------------------------------------------------

def test_moe_layout(arch):
    sm = steer(arch)
    a, m = sm.adapter, sm.hf_model
    assert a.name == ADAPTER[arch]
    assert (a.n_experts(m), a.top_k(m)) == (N_EXPERTS, TOP_K)
    assert all(a.is_sparse(m, l) for l in range(sm.n_layers))
    assert a.component_hooks(m, 0) == ATTN_HOOKS + (MLP_IN,) + MOE_HOOKS + NORM_HOOKS
    assert (a.shared_expert(m, 0) is not None) == (arch in SHARED)
    assert sm.d_mlp == 32  # one expert's width: the blocks have no dense MLP


def test_dense_neurons_are_refused(arch):
    sm = steer(arch)
    with pytest.raises(UnsupportedArchitectureError, match="sparse mixture-of-experts"):
        sm.adapter.residual_writer(sm.hf_model, LAYER, "mlp")
    assert sm.adapter.residual_writer(sm.hf_model, LAYER, "attn") is sm.adapter.o_proj_module(sm.hf_model, LAYER)
    for kind in MLP_HOOKS:
        with pytest.raises(UnsupportedArchitectureError, match="sparse mixture-of-experts"):
            sm.record(site(kind))
        with pytest.raises(UnsupportedArchitectureError, match="sparse mixture-of-experts"):
            sm.edit(site(kind), fn=lambda t: t)
    assert sm.hook_count() == 0


def test_mixed_dense_and_sparse_blocks():
    """Qwen2-MoE with mlp_only_layers=[0]: block 0 is a dense MLP with neurons, block 1 sparse."""
    sm = steer("qwen2_moe", mlp_only_layers=[0])
    a, m = sm.adapter, sm.hf_model
    assert not a.is_sparse(m, 0) and a.is_sparse(m, 1)
    assert a.component_hooks(m, 0) == ATTN_HOOKS + (MLP_IN,) + MLP_HOOKS + NORM_HOOKS
    assert a.component_hooks(m, 1) == ATTN_HOOKS + (MLP_IN,) + MOE_HOOKS + NORM_HOOKS
    assert sm.d_mlp == 128  # the dense block's width
    names = hooknames.all_names(sm.n_layers, components=lambda l: a.component_hooks(m, l))
    assert "blocks.0.mlp.hook_post" in names and "blocks.0.mlp.hook_router_logits" not in names
    assert "blocks.1.mlp.hook_expert_out" in names and "blocks.1.mlp.hook_pre" not in names
    toks = batch()
    with captured(a.mlp_post_module(m, 0), "input") as down_in, \
            sm.record([site("mlp.hook_post", 0), site("mlp.hook_router_logits", 1)]) as c:
        sm.forward(toks)
    torch.testing.assert_close(c[site("mlp.hook_post", 0)], down_in["v"], atol=0, rtol=0)
    assert c[site("mlp.hook_router_logits", 1)].shape == (2, 7, N_EXPERTS)
    for kind in MOE_HOOKS:
        with pytest.raises(UnsupportedArchitectureError, match="dense MLP"):
            sm.record(site(kind, 0))
    with pytest.raises(UnsupportedArchitectureError, match="sparse mixture-of-experts"):
        sm.record(site("mlp.hook_pre", 1))
    assert sm.hook_count() == 0


def test_dense_families_refuse_moe_hooks():
    model, tok = tiny_model("llama")
    sm = steerkit.wrap(model, tok)
    with pytest.raises(UnsupportedArchitectureError, match="mixture-of-experts"):
        sm.record(site("mlp.hook_router_logits"))
    assert sm.hook_count() == 0


# --- recording ------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["hf", "nnsight"])
def test_router_hooks_are_the_routers_output(arch, backend):
    if backend == "nnsight":
        pytest.importorskip("nnsight")
    sm = steer(arch, backend)
    hf = sm.hf_model if backend == "hf" else sm.backend.model
    toks = batch()
    names = [site(k) for k in MOE_HOOKS] + [site("hook_mlp_out")]
    with captured(sm.adapter.router_module(hf, LAYER)) as router, sm.record(names) as c:
        logits = sm.forward(toks)
    B, T = toks.input_ids.shape
    lg, w, idx = router["v"]
    torch.testing.assert_close(c[site("mlp.hook_router_logits")], lg.reshape(B, T, N_EXPERTS), atol=0, rtol=0)
    torch.testing.assert_close(c[site("mlp.hook_expert_weights")], w.reshape(B, T, TOP_K), atol=0, rtol=0)
    got_idx = c[site("mlp.hook_expert_indices")]
    assert got_idx.dtype == torch.int64 and torch.equal(got_idx, idx.reshape(B, T, TOP_K))
    # the routing rule of the family, applied to the logits, is what the router computed
    rw, ri = sm.adapter.route(hf, lg)
    assert torch.equal(ri, idx) and torch.equal(rw, w)
    # each expert's weighted output: zero for experts a token does not use; their sum (plus the shared
    # expert's) is what the block adds
    out = c[site("mlp.hook_expert_out")]
    assert out.shape == (B, T, N_EXPERTS, sm.d_model)
    used = torch.zeros(B, T, N_EXPERTS, dtype=torch.bool).scatter_(-1, got_idx, True)
    assert bool((out[~used] == 0).all()) and bool((out[used].abs().amax(-1) > 0).all())
    with captured(sm.adapter.mlp_module(hf, LAYER), "input") as x_in:
        sm.forward(toks)
    routed, shared = by_hand(sm, LAYER, x_in["v"], w, idx)
    torch.testing.assert_close(out.sum(2), routed, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.sum(2) + shared, c[site("hook_mlp_out")], atol=ATOL, rtol=0)
    assert (shared.abs().max() > 1e-4) == (arch in SHARED)
    # recording does not change the output
    torch.testing.assert_close(logits, sm.forward(toks), atol=ATOL, rtol=0)
    assert sm.hook_count() == 0


def test_record_some_experts(arch):
    sm = steer(arch)
    toks = batch()
    with sm.record(site("mlp.hook_expert_out")) as full:
        sm.forward(toks)
    with sm.record(site("mlp.hook_expert_out"), heads=[3, 1]) as some:
        sm.forward(toks)
    torch.testing.assert_close(some[site("mlp.hook_expert_out")], full[site("mlp.hook_expert_out")][:, :, [3, 1]],
                               atol=0, rtol=0)
    with pytest.raises(InputError, match="experts"):
        with sm.record(site("mlp.hook_expert_out"), heads=[N_EXPERTS]):
            sm.forward(toks)
    assert sm.hook_count() == 0


# --- editing --------------------------------------------------------------------------------------

def unedited(arch: str, backend: str):
    """``(model, its HF module tree, a batch, the batch's logits, the experts each token is routed to)`` before any
    edit, on ``backend`` (nnsight skipped where it is not installed)."""
    if backend == "nnsight":
        pytest.importorskip("nnsight")
    sm = steer(arch, backend)
    hf = sm.hf_model if backend == "hf" else sm.backend.model
    toks = batch()
    with sm.record(site("mlp.hook_expert_indices")) as c0:
        base = sm.forward(toks)
    return sm, hf, toks, base, c0[site("mlp.hook_expert_indices")]


@pytest.mark.parametrize("backend", ["hf", "nnsight"])
def test_router_edit_reroutes(arch, backend):
    """Raising expert e's logit makes every token use e; the weights follow the family's rule."""
    sm, hf, toks, base, routed_to = unedited(arch, backend)
    e = next(i for i in range(N_EXPERTS) if not bool((routed_to == i).any(-1).all()))
    boost = torch.zeros(N_EXPERTS)
    boost[e] = 50.0
    names = [site(k) for k in MOE_HOOKS] + [site("hook_mlp_out")]
    with sm.edit(site("mlp.hook_router_logits"), add=boost), sm.record(names) as c, \
            captured(sm.adapter.mlp_module(hf, LAYER), "input") as x_in:
        steered = sm.forward(toks)
    idx, w = c[site("mlp.hook_expert_indices")], c[site("mlp.hook_expert_weights")]
    assert bool((idx == e).any(-1).all())
    lg = c[site("mlp.hook_router_logits")]
    rw, ri = sm.adapter.route(hf, lg)
    assert torch.equal(ri, idx) and torch.equal(rw, w)
    routed, shared = by_hand(sm, LAYER, x_in["v"], w, idx)
    torch.testing.assert_close(c[site("hook_mlp_out")], routed + shared, atol=ATOL, rtol=0)
    assert (steered - base).abs().max() > 1e-4
    # a zero edit of the logits re-routes to the same experts with the same weights
    with sm.edit(site("mlp.hook_router_logits"), add=torch.zeros(N_EXPERTS)):
        assert torch.equal(sm.forward(toks), base)
    assert sm.hook_count() == 0


@pytest.mark.parametrize("backend", ["hf", "nnsight"])
def test_zeroing_an_expert_equals_the_block_without_it(arch, backend):
    sm, hf, toks, base, routed_to = unedited(arch, backend)
    e = int(routed_to[0, 0, 0])  # an expert the first token uses
    names = [site("mlp.hook_expert_weights"), site("mlp.hook_expert_indices"), site("hook_mlp_out")]
    zero = Intervention.replace(site("mlp.hook_expert_out"), torch.zeros(sm.d_model), heads=[e])
    with sm.steer([zero]), sm.record(names) as c, captured(sm.adapter.mlp_module(hf, LAYER), "input") as x_in:
        steered = sm.forward(toks)
    routed, shared = by_hand(sm, LAYER, x_in["v"], c[names[0]], c[names[1]], drop=(e,))
    torch.testing.assert_close(c[site("hook_mlp_out")], routed + shared, atol=ATOL, rtol=0)
    assert (steered - base).abs().max() > 1e-5
    # the same with an apply on the natural shape [batch, pos, n_experts, d_model]
    def drop(t):
        t = t.clone()
        t[:, :, e] = 0
        return t
    with sm.steer([Intervention.apply(site("mlp.hook_expert_out"), drop)]):
        torch.testing.assert_close(sm.forward(toks), steered, atol=ATOL, rtol=0)
    # an add on one expert's output adds to what the block adds
    v = torch.randn(sm.d_model, generator=torch.Generator().manual_seed(3))
    with sm.steer([Intervention.add(site("mlp.hook_expert_out"), v, heads=[e])]), \
            sm.record(site("hook_mlp_out")) as ca:
        sm.forward(toks)
    with sm.record(site("hook_mlp_out")) as cb:
        sm.forward(toks)
    torch.testing.assert_close(ca[site("hook_mlp_out")], cb[site("hook_mlp_out")] + v, atol=ATOL, rtol=0)
    assert sm.hook_count() == 0


def test_expert_hooks_on_eager_experts_are_bit_exact(arch):
    """With eager experts, recording or zero-editing every MoE hook leaves the logits bit-identical."""
    sm = steer(arch, experts_implementation="eager")
    assert sm.hf_model.config._experts_implementation == "eager"
    toks = batch()
    base = sm.forward(toks)
    with sm.record([site(k, l) for l in range(sm.n_layers) for k in MOE_HOOKS]):
        assert torch.equal(sm.forward(toks), base)
    zero = [Intervention.add(site("mlp.hook_router_logits", l), torch.zeros(N_EXPERTS)) for l in range(sm.n_layers)]
    zero += [Intervention.add(site("mlp.hook_expert_out", l), torch.zeros(sm.d_model * N_EXPERTS))
             for l in range(sm.n_layers)]
    with sm.steer(zero):
        assert sm.hf_model.config._experts_implementation == "steerkit:eager"
        assert torch.equal(sm.forward(toks), base)
    assert sm.hf_model.config._experts_implementation == "eager" and sm.hook_count() == 0


def test_patch_expert_outputs_between_runs(arch):
    sm = steer(arch)
    src, dst = batch(0), batch(1)
    with sm.record([site("mlp.hook_expert_out"), site("hook_mlp_out")]) as cs:
        sm.forward(src)
    patch = Intervention.patch(site("mlp.hook_expert_out"), cs[site("mlp.hook_expert_out")][0], heads=[0, 1, 2, 3])
    one = Tokens(dst.input_ids[:1], dst.attention_mask[:1])
    with sm.steer([patch]), sm.record(site("hook_mlp_out")) as cd, \
            captured(sm.adapter.mlp_module(sm.hf_model, LAYER), "input") as x_in:
        sm.forward(one)
    # the shared expert still reads the destination's input
    _, shared = by_hand(sm, LAYER, x_in["v"], torch.zeros(1, 7, TOP_K), torch.zeros(1, 7, TOP_K, dtype=torch.long),
                        drop=range(N_EXPERTS))
    want = cs[site("mlp.hook_expert_out")][0].sum(1) + shared[0]
    torch.testing.assert_close(cd[site("hook_mlp_out")][0], want, atol=ATOL, rtol=0)
    assert sm.hook_count() == 0


def test_generation_with_router_edit_matches_forward(arch):
    """KV-cached greedy generation with a re-routing edit == argmax of full forwards with it."""
    sm = steer(arch)
    boost = torch.zeros(N_EXPERTS)
    boost[0] = 50.0
    prompts = ["hello there", "hi"]
    N = 3
    with sm.edit(site("mlp.hook_router_logits", 0), add=boost), \
            sm.steer([Intervention.add(site("mlp.hook_expert_out"), torch.ones(sm.d_model), heads=[2])]):
        got = sm.generate(prompts, max_new_tokens=N, chat=False, return_tokens=True)
        want = greedy_by_forward(sm, prompts, N)
    assert got == want
    assert sm.hook_count() == 0


# --- errors and cleanup ---------------------------------------------------------------------------

def test_routing_hooks_are_record_only(arch):
    sm = steer(arch)
    for kind in ("mlp.hook_expert_weights", "mlp.hook_expert_indices"):
        with pytest.raises(InputError, match="hook_router_logits"):
            sm.edit(site(kind), add=torch.zeros(TOP_K))
        with pytest.raises(InputError, match="hook_router_logits"):
            with sm.steer([Intervention.apply(site(kind), lambda t: t)]):
                sm.forward(batch())
    with pytest.raises(InputError, match="n_experts|shape"):
        sm.edit(site("mlp.hook_router_logits"), add=torch.zeros(sm.d_model))
    assert sm.hook_count() == 0
    assert sm.hf_model.config._experts_implementation == "grouped_mm"


def test_hooks_return_to_baseline_after_an_exception(arch):
    sm = steer(arch)
    model = sm.hf_model
    impl = model.config._experts_implementation
    base = sm.hook_count()
    toks = batch()
    want = sm.forward(toks)

    def boom(t):
        raise RuntimeError("boom")
    for kind in ("mlp.hook_router_logits", "mlp.hook_expert_out"):
        with pytest.raises(RuntimeError, match="boom"):
            with sm.record([site(k) for k in MOE_HOOKS]), sm.steer([Intervention.apply(site(kind), boom)]):
                assert model.config._experts_implementation == "steerkit:" + impl
                sm.forward(toks)
        assert sm.hook_count() == base
        assert model.config._experts_implementation == impl
    # a registration that fails half-way leaves nothing behind
    with pytest.raises(UnsupportedArchitectureError):
        sm.record([site("mlp.hook_expert_out"), site("mlp.hook_router_logits", 0), site("mlp.hook_pre")])
    assert sm.hook_count() == base and model.config._experts_implementation == impl
    assert torch.equal(sm.forward(toks), want)


def test_tlens_refuses_moe_hooks():
    from steerkit.backends.tlens import TLensBackend

    backend = TLensBackend.__new__(TLensBackend)  # the refusal comes before the bridge is touched
    for kind in MOE_HOOKS:
        with pytest.raises(UnsupportedArchitectureError, match="backend='hf'"):
            backend.register(Site(site(kind), kind, LAYER), lambda x, c: None, None)


def test_router_hooks_keep_the_experts_implementation():
    """Only mlp.hook_expert_out switches the experts implementation; the router hooks do not."""
    sm = steer("olmoe")
    with sm.record(site("mlp.hook_router_logits")) as c:
        sm.forward(batch())
    assert sm.hf_model.config._experts_implementation == "grouped_mm"
    assert F.softmax(c[site("mlp.hook_router_logits")], -1).sum(-1).allclose(torch.ones(2, 7))


def test_facts_and_hook_names_know_the_experts():
    sm = steer("mixtral")
    f = sm.facts
    assert f.n_experts == sm.adapter.n_experts(sm.hf_model) and f.top_k == sm.adapter.top_k(sm.hf_model)
    names = sm.hook_names(components=True)
    assert "blocks.0.mlp.hook_router_logits" in names and "blocks.0.mlp.hook_expert_out" in names
    assert "blocks.0.mlp.hook_post" not in names  # a sparse block has no dense neurons
