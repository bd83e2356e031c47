"""Component hooks (attention heads, attention matrices, MLP neurons, block norms) on tiny random-weight
models of every supported family, checked against the transformers modeling code: the eager attention
probabilities (``output_attentions``), the modules' own inputs and outputs captured with plain torch
hooks, and the algebra that ties them together (``pattern @ v == z``, ``softmax(scores) == pattern``,
``act(pre) * up == post``). The models run SDPA (Gemma 2, which transformers runs eagerly only, eager),
so ``attn.hook_pattern`` goes through steerkit's attention function; edits per head and per neuron are checked against the same edit written by hand."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import steerkit
from steerkit import Intervention
from steerkit.loading.adapters import get_module
from steerkit.errors import InputError, UnsupportedArchitectureError
from steerkit.hooks.names import COMPONENT_HOOKS, NORM_HOOKS
from steerkit.model import Tokens

from tiny_models import ARCHS, tiny_model

ATOL = 1e-5
LAYER = 1
_CACHE: dict = {}
NO_BLOCK_NORMS = ("olmo2", "olmo3")  # OLMo 2 normalises after each sub-layer only: no ln1 / ln2


def steer(arch: str) -> steerkit.SteerModel:
    if arch not in _CACHE:
        try:
            model, tok = tiny_model(arch, attn_implementation="sdpa")
        except ValueError:  # Gemma 2 has no SDPA path in transformers: eager, as it ships
            model, tok = tiny_model(arch, attn_implementation="eager")
        _CACHE[arch] = steerkit.wrap(model, tok, name=f"tiny-{arch}")
    return _CACHE[arch]


def batch(seed=0, B=2, T=7, pad_first=0) -> Tokens:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 100, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    if pad_first:
        ids[0, :pad_first] = 0
        mask[0, :pad_first] = 0
    return Tokens(ids, mask)


def names(sm, layer=LAYER):
    return [n for n in sm.hook_names(components=True) if n.startswith(f"blocks.{layer}.")
            and n.split(".", 2)[-1] in COMPONENT_HOOKS]


@contextlib.contextmanager
def captured(module, io="output"):
    """A module's first input or output, with a plain torch hook (not steerkit's)."""
    box: dict = {}
    if io == "output":
        h = module.register_forward_hook(lambda m, a, o: box.__setitem__("v", (o[0] if isinstance(o, tuple) else o).detach()))
    else:
        h = module.register_forward_pre_hook(lambda m, a, kw: box.__setitem__("v", (a[0] if a else kw["hidden_states"]).detach()),
                                             with_kwargs=True)
    try:
        yield box
    finally:
        h.remove()


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param


def test_component_names_per_family(arch):
    sm = steer(arch)
    got = {n.split(".", 2)[-1] for n in names(sm)}
    expected = set(COMPONENT_HOOKS) - (set(NORM_HOOKS) if arch in NO_BLOCK_NORMS else set())
    assert got == expected
    if arch in NO_BLOCK_NORMS:
        with pytest.raises(UnsupportedArchitectureError, match="ln1"):
            sm.record("blocks.0.ln1.hook_normalized")


def test_recorded_components_match_the_modeling_code(arch):
    sm = steer(arch)
    a, m = sm.adapter, sm.hf_model
    toks = batch(pad_first=2)
    mlp = a.mlp_module(m, LAYER)
    with contextlib.ExitStack() as st:
        o_out = st.enter_context(captured(a.o_proj_module(m, LAYER)))
        down_out = st.enter_context(captured(a.mlp_post_module(m, LAYER)))
        norms = {w: st.enter_context(captured(a.block_norm_module(m, LAYER, w)))
                 for w in ("ln1", "ln2") if arch not in NO_BLOCK_NORMS}
        c = st.enter_context(sm.record(names(sm), positions="all"))
        sm.forward(toks)
    H, KV, dh = sm.n_heads, sm.n_kv_heads, sm.d_head
    z, v = c[f"blocks.{LAYER}.attn.hook_z"], c[f"blocks.{LAYER}.attn.hook_v"]
    pattern, scores = c[f"blocks.{LAYER}.attn.hook_pattern"], c[f"blocks.{LAYER}.attn.hook_attn_scores"]
    B, T = toks.input_ids.shape
    assert z.shape == (B, T, H, dh) and v.shape == (B, T, KV, dh)
    assert c[f"blocks.{LAYER}.attn.hook_q"].shape == (B, T, H, dh)
    assert c[f"blocks.{LAYER}.attn.hook_k"].shape == (B, T, KV, dh)
    assert pattern.shape == scores.shape == (B, H, T, T)
    # the eager implementation's own attention probabilities (same weights, output_attentions)
    eager, _ = tiny_model(arch, attn_implementation="eager")
    with torch.inference_mode():
        kw = dict(input_ids=toks.input_ids, attention_mask=toks.attention_mask, position_ids=toks.position_ids,
                  output_attentions=True)
        att = eager(**kw).attentions[LAYER]
    # recorded queries are each row's real positions, left-aligned (row 0 is left-padded); keys keep
    # their absolute positions
    pos = c.positions(f"blocks.{LAYER}.attn.hook_pattern")
    lens = c.lengths(f"blocks.{LAYER}.attn.hook_pattern")
    assert lens.tolist() == [T - 2, T]
    for b in range(B):
        n, p = int(lens[b]), pos[b, : int(lens[b])]
        assert torch.allclose(pattern[b, :, :n], att[b][:, p], atol=ATOL)
        assert torch.allclose(torch.softmax(scores[b, :, :n], -1), pattern[b, :, :n], atol=1e-6)
        # pattern @ v == z (query heads share KV heads in groups; v's rows are the real keys)
        vv = v[b, :n].repeat_interleave(H // KV, dim=1)
        assert torch.allclose(torch.einsum("hqk,khd->qhd", pattern[b, :, :n][..., p], vv), z[b, :n], atol=ATOL)
        assert float(pattern[b, :, :n][..., ~toks.attention_mask[b].bool()].abs().sum()) == 0  # no padding key
    # z is the output projection's input; hook_post the down projection's
    o = a.o_proj_module(m, LAYER)
    down = a.mlp_post_module(m, LAYER)

    def lin(mod, x):
        if isinstance(mod, torch.nn.Linear):
            return F.linear(x, mod.weight, mod.bias)
        return x @ mod.weight + mod.bias  # GPT-2's Conv1D keeps [in, out]
    real = toks.attention_mask.bool()
    aligned = torch.arange(T)[None] < lens[:, None]  # where the recorded (left-aligned) rows are
    assert torch.allclose(lin(o, z.flatten(-2))[aligned], o_out["v"][real], atol=ATOL)
    post, pre = c[f"blocks.{LAYER}.mlp.hook_post"], c[f"blocks.{LAYER}.mlp.hook_pre"]
    assert post.shape == pre.shape == (B, T, sm.d_mlp)
    assert torch.allclose(lin(down, post)[aligned], down_out["v"][real], atol=ATOL)
    act = getattr(mlp, "act_fn", None) or getattr(mlp, "act", None) or getattr(mlp, "activation_fn", None)
    if arch in ("gpt2", "gpt_neox", "gpt_neox_seq"):
        assert torch.allclose(act(pre), post, atol=ATOL)
    else:  # gated: post = act(gate) * up, so post / act(pre) is the up projection, the same for every neuron
        g = act(pre)
        ok = g.abs() > 1e-3
        up = post[ok] / g[ok]
        assert torch.isfinite(up).all() and up.abs().max() > 0
    for w, box in norms.items():
        n = c[f"blocks.{LAYER}.{w}.hook_normalized"]
        mod = a.block_norm_module(m, LAYER, w)
        weight, bias = a.norm_affine(mod)
        y = n * (1 if weight is None else weight) + (0 if bias is None else bias)
        assert torch.allclose(y[aligned], box["v"][real], atol=ATOL), w
        assert c[f"blocks.{LAYER}.{w}.hook_scale"].shape == (B, T, 1)


def test_gated_up_projection(arch):
    """post / act(pre) is the up projection's output, read from the module itself."""
    if arch in ("gpt2", "gpt_neox", "gpt_neox_seq"):
        pytest.skip("not a gated MLP")
    sm = steer(arch)
    mlp = sm.adapter.mlp_module(sm.hf_model, LAYER)
    up_mod = getattr(mlp, "up_proj", None) or mlp.gate_up_proj
    with captured(up_mod) as box, sm.record([f"blocks.{LAYER}.mlp.hook_pre", f"blocks.{LAYER}.mlp.hook_post"]) as c:
        sm.forward(batch())
    up = box["v"] if hasattr(mlp, "up_proj") else box["v"][..., sm.d_mlp:]
    act = getattr(mlp, "act_fn", None) or mlp.activation_fn
    assert torch.allclose(act(c[f"blocks.{LAYER}.mlp.hook_pre"]) * up, c[f"blocks.{LAYER}.mlp.hook_post"], atol=ATOL)


@pytest.mark.parametrize("arch_", ["llama", "mistral", "qwen2", "gemma", "phi3", "gpt2"])
def test_scores_from_q_and_k(arch_):
    """scores = rot(q) . rot(k) * scaling (+ mask): q and k are the projections' outputs before rotary."""
    sm = steer(arch_)
    toks = batch()
    site = f"blocks.{LAYER}.attn."
    with sm.record([site + "hook_q", site + "hook_k", site + "hook_attn_scores"]) as c:
        sm.forward(toks)
    q, k = c[site + "hook_q"].transpose(1, 2), c[site + "hook_k"].transpose(1, 2)
    attn = sm.adapter.attn_module(sm.hf_model, LAYER)
    if arch_ != "gpt2":
        mod = __import__(type(attn).__module__, fromlist=["apply_rotary_pos_emb"])
        inner = sm.hf_model.model
        cos, sin = inner.rotary_emb(q, toks.position_ids)
        q, k = mod.apply_rotary_pos_emb(q, k, cos, sin)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q @ k.transpose(2, 3) * attn.scaling
    causal = torch.ones(toks.input_ids.shape[1], toks.input_ids.shape[1], dtype=torch.bool).tril()
    got = c[site + "hook_attn_scores"]
    assert torch.allclose(got[..., causal], s[..., causal], atol=1e-4)
    assert bool((got[..., ~causal] == torch.finfo(got.dtype).min).all())


def test_zero_edits_at_every_component_are_exact(arch):
    sm = steer(arch)
    toks = batch()
    base = sm.forward(toks)
    for n in names(sm):
        kind = n.split(".", 2)[-1]
        if kind.endswith("hook_scale"):
            continue
        if kind in ("attn.hook_pattern", "attn.hook_attn_scores"):
            edit = sm.edit(n, fn=lambda x: x)
        else:
            width = sm.facts.width(kind, n)
            edit = sm.edit(n, add=torch.zeros(width))
        with edit:
            out = sm.forward(toks)
        if kind in ("attn.hook_pattern", "attn.hook_attn_scores"):  # eager attention at that module: float rounding
            assert torch.allclose(out, base, atol=1e-5), n
        else:
            assert torch.equal(out, base), n
    assert sm.hf_model.config._attn_implementation in ("sdpa", "eager")


def test_head_and_neuron_edits_equal_the_edit_by_hand(arch):
    sm = steer(arch)
    toks = batch()
    base = sm.forward(toks)
    z = f"blocks.{LAYER}.attn.hook_z"

    def zero_head(x):
        x = x.clone()
        x[:, :, 1] = 0
        return x
    with sm.edit(z, replace=torch.zeros(sm.d_head), heads=[1]):
        a = sm.forward(toks)
    with sm.edit(z, fn=zero_head):
        b = sm.forward(toks)
    assert torch.equal(a, b) and not torch.allclose(a, base)
    v = torch.randn(sm.d_head, generator=torch.Generator().manual_seed(3))
    with sm.edit(f"blocks.{LAYER}.attn.hook_v", add=v, heads=[0]):
        a = sm.forward(toks)

    def add_v(x):
        x = x.clone()
        x[:, :, 0] += v
        return x
    with sm.edit(f"blocks.{LAYER}.attn.hook_v", fn=add_v):
        b = sm.forward(toks)
    assert torch.allclose(a, b, atol=1e-6) and not torch.allclose(a, base)
    post = f"blocks.{LAYER}.mlp.hook_post"
    with sm.edit(post, replace=torch.tensor([0.0, 0.0]), neurons=[3, 7]):
        a = sm.forward(toks)

    def zero_neurons(x):
        x = x.clone()
        x[..., [3, 7]] = 0
        return x
    with sm.edit(post, fn=zero_neurons):
        b = sm.forward(toks)
    assert torch.equal(a, b) and not torch.allclose(a, base)
    # a head's direction ablated: its projection on u is 0 afterwards, other heads untouched
    u = torch.randn(sm.d_head, generator=torch.Generator().manual_seed(4))
    u = u / u.norm()
    q = f"blocks.{LAYER}.attn.hook_q"
    with sm.edit(q, ablate=u, heads=[2]), sm.record(q) as c:
        sm.forward(toks)
    with sm.record(q) as c0:
        sm.forward(toks)
    assert float((c[q][:, :, 2] @ u).abs().max()) < 1e-5
    assert torch.equal(c[q][:, :, [0, 1, 3]], c0[q][:, :, [0, 1, 3]])


def test_pattern_edit_changes_the_output_as_eager_attention_would(arch):
    """Halving head 0's probabilities halves its z (z = pattern @ v)."""
    sm = steer(arch)
    toks = batch()
    site = f"blocks.{LAYER}.attn."

    def halve(p):
        p = p.clone()
        p[:, 0] *= 0.5
        return p
    with sm.record(site + "hook_z") as c0:
        sm.forward(toks)
    with sm.edit(site + "hook_pattern", fn=halve), sm.record(site + "hook_z") as c:
        sm.forward(toks)
    assert torch.allclose(c[site + "hook_z"][:, :, 0], 0.5 * c0[site + "hook_z"][:, :, 0], atol=ATOL)
    assert torch.allclose(c[site + "hook_z"][:, :, 1:], c0[site + "hook_z"][:, :, 1:], atol=ATOL)


def test_patch_moves_a_source_run_into_a_destination_run(arch):
    sm = steer(arch)
    src, dst = batch(seed=1, B=1), batch(seed=2, B=1)
    z = f"blocks.{LAYER}.attn.hook_z"
    pat = f"blocks.{LAYER}.attn.hook_pattern"
    with sm.record([z, pat, f"blocks.{LAYER}.hook_resid_pre"]) as c_src:
        sm.forward(src)
    # patch head 2 at position 4 only
    with sm.steer(Intervention.patch(z, c_src[z][0], positions=[4], heads=[2])), sm.record(z) as c:
        sm.forward(dst)
    with sm.record(z) as c_dst:
        sm.forward(dst)
    got, want = c[z][0], c_dst[z][0].clone()
    want[4, 2] = c_src[z][0, 4, 2]
    assert torch.equal(got, want)
    # the whole residual at every position: the destination run becomes the source run downstream
    resid = f"blocks.{LAYER}.hook_resid_pre"
    with sm.steer(Intervention.patch(resid, c_src[resid][0])):
        out = sm.forward(dst)
    assert torch.allclose(out, sm.forward(src), atol=1e-5)
    # an attention pattern, per head
    with sm.steer(Intervention.patch(pat, c_src[pat][0], heads=[0])), sm.record(pat) as c:
        sm.forward(dst)
    assert torch.equal(c[pat][0, 0], c_src[pat][0, 0])
    assert torch.allclose(c[pat][0, 1:], c_dst_pattern(sm, dst, pat)[0, 1:], atol=1e-6)


def c_dst_pattern(sm, toks, pat):
    with sm.record(pat) as c:
        sm.forward(toks)
    return c[pat]


def test_per_row_patches_in_one_pass_equal_one_pass_each():
    sm = steer("llama")
    src, dst = batch(seed=1, B=1), batch(seed=2, B=1)
    z = f"blocks.{LAYER}.attn.hook_z"
    with sm.record(z) as c:
        sm.forward(src)
    rows = [[Intervention.patch(z, c[z][0], heads=[h])] for h in range(sm.n_heads)]
    many = Tokens(dst.input_ids.repeat(len(rows), 1), dst.attention_mask.repeat(len(rows), 1))
    with sm.steer(rows=rows):
        together = sm.forward(many)
    for h, row in enumerate(rows):
        with sm.steer(row):
            alone = sm.forward(dst)
        assert torch.allclose(together[h], alone[0], atol=1e-5), h


def test_kv_cached_generation_records_and_edits_components():
    sm = steer("llama")
    toks = batch(B=1, T=5)
    ns = [f"blocks.{LAYER}.attn.hook_pattern", f"blocks.{LAYER}.attn.hook_attn_scores", f"blocks.{LAYER}.attn.hook_z",
          f"blocks.{LAYER}.mlp.hook_post"]
    abl = dict(replace=torch.zeros(sm.d_head), heads=[1])
    with sm.edit("blocks.0.attn.hook_z", **abl), sm.record(ns) as c:
        new = sm.generate(toks, max_new_tokens=5, return_tokens=True)[0]
    full = Tokens(torch.cat([toks.input_ids[0], torch.tensor(new)])[None], torch.ones(1, 10, dtype=torch.long))
    with sm.edit("blocks.0.attn.hook_z", **abl), sm.record(ns) as f:
        logits = sm.forward(full)
    assert logits[0, 4:-1].argmax(-1).tolist() == new
    n = c[ns[0]].shape[2]
    assert n == 10 and c[ns[0]].shape == (1, sm.n_heads, 10, 10)
    for name in ns:
        assert torch.allclose(c[name], f[name], atol=1e-5), name


def test_errors_and_cleanup():
    sm = steer("llama")
    before = sm.hook_count()
    with pytest.raises(InputError, match="heads= at an attention component"):
        sm.edit("blocks.0.hook_resid_post", add=torch.zeros(4), heads=[0])
    with pytest.raises(InputError, match="heads in 0..3"):
        sm.edit("blocks.0.attn.hook_z", add=torch.zeros(sm.d_head), heads=[4])
    with pytest.raises(InputError, match="neurons= at an MLP hook"):
        sm.edit("blocks.0.attn.hook_z", add=torch.zeros(2), neurons=[0, 1])
    with pytest.raises(InputError, match="patch or apply at"):
        sm.edit("blocks.0.attn.hook_pattern", add=torch.zeros(4))
    with pytest.raises(InputError, match=r"shape \[16\]"):
        sm.edit("blocks.0.attn.hook_z", add=torch.zeros(8), heads=[0])
    with pytest.raises(InputError, match="can only be recorded"):
        sm.edit("blocks.0.ln1.hook_scale", add=torch.zeros(sm.d_model))
    with pytest.raises(InputError, match="features per position"):
        sm.steer(Intervention.patch("blocks.0.attn.hook_z", torch.zeros(5, 3, 16)))
    with sm.steer(Intervention.patch("blocks.0.hook_resid_pre", torch.zeros(3, sm.d_model))):
        with pytest.raises(InputError, match="positions its source has"):
            sm.forward(batch(T=5))
    # a failing hook at a pattern site leaves nothing behind, and the model's attention as it was

    def boom(p):
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        with sm.edit("blocks.1.attn.hook_pattern", fn=boom):
            sm.forward(batch())
    assert sm.hook_count() == before
    assert sm.hf_model.config._attn_implementation == "sdpa"
    base = sm.forward(batch())
    with sm.record("blocks.1.attn.hook_pattern"):
        with sm.record("blocks.0.attn.hook_pattern"):
            assert sm.hf_model.config._attn_implementation.startswith("steerkit:")
        assert sm.hf_model.config._attn_implementation.startswith("steerkit:")
    assert sm.hf_model.config._attn_implementation == "sdpa"
    assert torch.equal(sm.forward(batch()), base)


def test_modules_named_by_the_adapter_exist(arch):
    sm = steer(arch)
    a, m = sm.adapter, sm.hf_model
    for l in range(sm.n_layers):
        mods = a.qkv_modules(m, l)
        assert set(mods) in ({"q", "k", "v"}, {"qkv"})
        a.o_proj_module(m, l), a.mlp_pre_module(m, l), a.mlp_post_module(m, l)
        if arch not in NO_BLOCK_NORMS:
            get_module(a.block(m, l), a.ln1), get_module(a.block(m, l), a.ln2)


def test_record_some_heads_and_neurons():
    sm = steer("llama")
    toks = batch()
    z, pat, post = (f"blocks.{LAYER}.attn.hook_z", f"blocks.{LAYER}.attn.hook_pattern",
                    f"blocks.{LAYER}.mlp.hook_post")
    with sm.record([z, pat, post]) as full:
        sm.forward(toks)
    with sm.record([z, pat], heads=[3, 1]) as some, sm.record(post, neurons=[5, 0, 9]) as few:
        sm.forward(toks)
    assert torch.equal(some[z], full[z][:, :, [3, 1]])
    assert torch.equal(some[pat], full[pat][:, [3, 1]])
    assert torch.equal(few[post], full[post][..., [5, 0, 9]])
    with pytest.raises(InputError, match="attention component"):
        sm.record([z, post], heads=[0])
    with pytest.raises(InputError, match="heads in 0..3"):
        with sm.record(z, heads=[7]):
            sm.forward(toks)


def test_eager_attention_reads_every_mask_transformers_builds():
    """steerkit.hooks.attention.eager gives the same probabilities from a 4-D bool mask (SDPA), a 4-D additive
    mask (eager), no mask (causal) and a 2-D padding mask with a sliding window (flash attention)."""
    from steerkit.hooks.attention import eager

    g = torch.Generator().manual_seed(0)
    B, H, KV, T, d, W = 2, 4, 2, 6, 8, 3
    q, k, v = (torch.randn(B, n, T, d, generator=g) for n in (H, KV, KV))
    pad = torch.ones(B, T, dtype=torch.bool)
    pad[0, :2] = False
    i = torch.arange(T)
    causal = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < W)
    full = causal[None, None] & pad[:, None, None, :]
    additive = torch.zeros(B, 1, T, T).masked_fill(~full, torch.finfo(torch.float32).min)
    mod = torch.nn.Module()
    outs = [eager(mod, q, k, v, full)[1], eager(mod, q, k, v, additive)[1],
            eager(mod, q, k, v, pad.long(), sliding_window=W)[1]]
    for o in outs[1:]:
        assert torch.allclose(o[1], outs[0][1], atol=1e-6)  # the unpadded row
        assert torch.allclose(o[0, :, 2:], outs[0][0, :, 2:], atol=1e-6)
    no_mask = eager(mod, q, k, v, None)[1]
    assert torch.allclose(no_mask.tril(), no_mask) and torch.allclose(no_mask.sum(-1), torch.ones(B, H, T))


@pytest.mark.parametrize("arch_", ["llama", "gemma2", "gpt2", "olmo2", "qwen2_moe"])
def test_mlp_hook_in_is_the_mlp_input_after_the_norm_weight(arch_):
    """``mlp.hook_in`` reads (and an edit replaces) what the MLP module receives: the pre-MLP norm's output after its
    weight, which is not 1 here (OLMo 2 has no pre-MLP norm: the residual itself), on a sparse block too; the nnsight
    backend records and edits the same."""
    model, tok = tiny_model(arch_, attn_implementation="eager")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    sm = steerkit.wrap(model, tok, name=f"tiny-{arch_}")
    a, m = sm.adapter, sm.hf_model
    toks = batch()
    site = f"blocks.{LAYER}.mlp.hook_in"
    with captured(a.mlp_module(m, LAYER), io="input") as box, sm.record(site, positions="all") as c:
        base = sm.forward(toks)
    assert torch.allclose(c[site], box["v"], atol=ATOL)
    if a.ln2 is not None:  # after the norm's weight: ln2.hook_normalized times the weight
        with sm.record(f"blocks.{LAYER}.ln2.hook_normalized", positions="all") as n:
            sm.forward(toks)
        normalized = n[f"blocks.{LAYER}.ln2.hook_normalized"]
        w, b = a.norm_affine(a.block_norm_module(m, LAYER, "ln2"))
        assert torch.allclose(c[site], normalized * w + (0 if b is None else b), atol=ATOL)
        assert not torch.allclose(c[site], normalized, atol=1e-2)
    v = torch.randn(sm.d_model, generator=g)
    with sm.edit(site, add=v):
        edited = sm.forward(toks)
    h = a.mlp_module(m, LAYER).register_forward_pre_hook(lambda mod, args: (args[0] + v,) + tuple(args[1:]))
    try:
        ref = sm.forward(toks)
    finally:
        h.remove()
    assert not torch.allclose(edited, base, atol=1e-3) and torch.allclose(edited, ref, atol=1e-4)
    nn_sm = steerkit.wrap(model, tok, name=f"tiny-{arch_}", backend="nnsight")
    with nn_sm.record(site, positions="all") as c2:
        nn_sm.forward(toks)
    with nn_sm.edit(site, add=v):
        assert torch.allclose(nn_sm.forward(toks), ref, atol=1e-4)
    assert torch.allclose(c2[site], c[site], atol=ATOL)
    assert sm.hook_count() == 0 and nn_sm.hook_count() == 0
