"""Adapters on tiny random-weight models of every supported family.

For each architecture the hooks are checked against the transformers modeling
code itself: ``output_hidden_states``, the module inputs that *are* the
residual stream between the sub-layers, and the edits' downstream effects.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import steerkit
from steerkit.loading.adapters import adapter_for, get_module
from steerkit.errors import HookNameError, InputError, UnsupportedArchitectureError
from steerkit.model import Tokens

from tiny_models import _LLAMA_LIKE, ARCHS, greedy_by_forward, tiny_model

ATOL = 1e-5

# arch -> adapter it must resolve to
ADAPTER = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama", "gemma": "llama",
           "olmo": "llama", "smollm3": "llama", "phi3": "phi3", "gemma2": "gemma2", "gemma3_text": "gemma2",
           "gemma3": "gemma3", "olmo2": "olmo2", "olmo3": "olmo2", "gpt2": "gpt2", "gpt_neox": "gpt_neox",
           "gpt_neox_seq": "gpt_neox"}
# arch -> module of a block whose input is the true residual between attention and MLP (read
# from each family's DecoderLayer.forward); None for parallel blocks. Independent of the adapter.
MID_CONSUMER = {a: "post_attention_layernorm" for a in ADAPTER}
MID_CONSUMER.update({"gemma2": "pre_feedforward_layernorm", "gemma3_text": "pre_feedforward_layernorm",
                     "gemma3": "pre_feedforward_layernorm", "olmo2": "mlp", "olmo3": "mlp", "gpt2": "ln_2",
                     "gpt_neox": None})
assert set(ADAPTER) == set(ARCHS)

_CACHE: dict = {}


def steer(arch: str, backend: str = "hf", **overrides) -> steerkit.SteerModel:
    """The tiny model of family ``arch`` on ``backend`` (``tiny_models.tiny_model``), built once per arguments."""
    key = (arch, backend, repr(sorted(overrides.items())))
    if key not in _CACHE:
        model, tok = tiny_model(arch, **overrides)
        _CACHE[key] = steerkit.wrap(model, tok, name=f"tiny-{arch}", backend=backend)
    return _CACHE[key]


def batch(seed=0, B=2, T=6) -> Tokens:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 100, (B, T), generator=g)
    ids[:, 0] = 2
    return Tokens(ids, torch.ones(B, T, dtype=torch.long))


def vec(seed=1, d=64) -> torch.Tensor:
    return torch.randn(d, generator=torch.Generator().manual_seed(seed))


def kinds(sm, layer):
    ks = ["hook_resid_pre", "hook_attn_out", "hook_mlp_out", "hook_resid_post"]
    if sm.hooks.has_resid_mid:
        ks.insert(2, "hook_resid_mid")
    return [f"blocks.{layer}.{k}" for k in ks]


class ModuleInput:
    """Records the first input of a module with a plain torch pre-hook (not steerkit's)."""

    def __init__(self, module):
        self.module, self.x = module, None

    def __enter__(self):
        def pre(mod, args, kwargs):
            self.x = (args[0] if args else kwargs["hidden_states"]).detach().clone()
        self.h = self.module.register_forward_pre_hook(pre, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self.h.remove()


def mid_consumer(sm, arch, layer):
    return get_module(sm.adapter.block(sm.hf_model, layer), MID_CONSUMER[arch])


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param


def test_layout(arch):
    sm = steer(arch)
    assert sm.adapter.name == ADAPTER[arch]
    assert (sm.n_layers, sm.d_model) == (2, 64)
    names = sm.hook_names()
    assert ("blocks.0.hook_resid_mid" in names) == (MID_CONSUMER[arch] is not None)
    assert names[-3:] == ["ln_final.hook_scale", "ln_final.hook_normalized", "ln_final.hook_out"]


def test_hooks_match_hidden_states(arch):
    """resid_pre/resid_post are the decoder-layer inputs/outputs HF reports; ln_final.hook_out its last
    state."""
    sm = steer(arch)
    toks = batch()
    names = [n for l in range(sm.n_layers) for n in kinds(sm, l)] + ["ln_final.hook_out"]
    with sm.record(names) as cache:
        logits = sm.forward(toks)
    assert sm.hook_count() == 0
    with torch.no_grad():
        out = sm.hf_model(input_ids=toks.input_ids, attention_mask=toks.attention_mask, output_hidden_states=True,
                          use_cache=False)
    hs = out.hidden_states
    L = sm.n_layers
    assert len(hs) == L + 1
    torch.testing.assert_close(logits, out.logits, atol=0, rtol=0)
    # embeddings as block 0 sees them (Gemma's sqrt(d) scaling, GPT-2's position embeddings included)
    torch.testing.assert_close(cache["blocks.0.hook_resid_pre"], hs[0], atol=0, rtol=0)
    for l in range(L - 1):  # hs[L] has the final norm applied
        torch.testing.assert_close(cache[f"blocks.{l}.hook_resid_post"], hs[l + 1], atol=0, rtol=0)
        torch.testing.assert_close(cache[f"blocks.{l + 1}.hook_resid_pre"], hs[l + 1], atol=0, rtol=0)
    torch.testing.assert_close(cache["ln_final.hook_out"], hs[L], atol=0, rtol=0)
    fn = sm.adapter.final_norm_module(sm.hf_model)
    torch.testing.assert_close(fn(cache[f"blocks.{L - 1}.hook_resid_post"]), hs[L], atol=ATOL, rtol=0)


def test_residual_decomposition(arch):
    """resid_pre + attn_out + mlp_out == resid_post; resid_mid is the residual the MLP side reads."""
    sm = steer(arch)
    toks = batch()
    L = sm.n_layers
    names = [n for l in range(L) for n in kinds(sm, l)]
    with contextlib.ExitStack() as stack:
        c = stack.enter_context(sm.record(names))
        mids = [stack.enter_context(ModuleInput(mid_consumer(sm, arch, l)))
                for l in range(L) if MID_CONSUMER[arch] is not None]
        sm.forward(toks)
    for l in range(L):
        pre, a, m, post = (c[f"blocks.{l}.{k}"] for k in ("hook_resid_pre", "hook_attn_out", "hook_mlp_out",
                                                           "hook_resid_post"))
        torch.testing.assert_close(pre + a + m, post, atol=ATOL, rtol=0)
        # the sub-layer outputs are not trivially zero or the residual itself
        assert a.abs().max() > 1e-3 and m.abs().max() > 1e-3
        assert not torch.allclose(a, post, atol=1e-3)
        if mids:
            mid = c[f"blocks.{l}.hook_resid_mid"]
            torch.testing.assert_close(mid, pre + a, atol=ATOL, rtol=0)
            torch.testing.assert_close(mid, mids[l].x, atol=ATOL, rtol=0)
            torch.testing.assert_close(post, mid + m, atol=ATOL, rtol=0)


def test_zero_add_is_bit_identical(arch):
    sm = steer(arch)
    toks = batch()
    base = sm.forward(toks)
    zero = torch.zeros(sm.d_model)
    with sm.edit({name: zero for name in sm.hook_names() if name != "ln_final.hook_scale"}):
        assert torch.equal(sm.forward(toks), base)
    assert sm.hook_count() == 0


def test_edits_propagate(arch):
    sm = steer(arch)
    toks = batch()
    v = vec()
    L = sm.n_layers
    has_mid = MID_CONSUMER[arch] is not None
    last = f"blocks.{L - 1}.hook_resid_post"
    with sm.record([last] + ([f"blocks.{l}.hook_resid_mid" for l in range(L)] if has_mid else [])) as c0:
        base = sm.forward(toks)
    for l in range(L):
        with sm.edit(f"blocks.{l}.hook_attn_out", add=v):
            via_attn = sm.forward(toks)
        assert (via_attn - base).abs().max() > 1e-3
        if has_mid:
            # adding v to resid_mid is adding v to what attention adds to the residual,
            # and the MLP side reads the edited residual
            with sm.edit(f"blocks.{l}.hook_resid_mid", add=v), \
                    ModuleInput(mid_consumer(sm, arch, l)) as mid_in:
                via_mid = sm.forward(toks)
            torch.testing.assert_close(via_mid, via_attn, atol=ATOL, rtol=0)
            torch.testing.assert_close(mid_in.x, c0[f"blocks.{l}.hook_resid_mid"] + v, atol=ATOL, rtol=0)
    if has_mid:
        # an edit at resid_pre is seen by resid_mid (read at the pre-attention norm's input)
        l = L - 1
        with sm.edit(f"blocks.{l}.hook_resid_pre", add=v), \
                sm.record([f"blocks.{l}.hook_resid_pre", f"blocks.{l}.hook_attn_out",
                           f"blocks.{l}.hook_resid_mid"]) as c, \
                ModuleInput(mid_consumer(sm, arch, l)) as mid_in:
            sm.forward(toks)
        torch.testing.assert_close(c[f"blocks.{l}.hook_resid_mid"], mid_in.x, atol=ATOL, rtol=0)
        torch.testing.assert_close(c[f"blocks.{l}.hook_resid_mid"],
                                   c[f"blocks.{l}.hook_resid_pre"] + c[f"blocks.{l}.hook_attn_out"],
                                   atol=ATOL, rtol=0)
    # resid_post of block l is resid_pre of block l + 1
    with sm.edit("blocks.0.hook_resid_post", add=v):
        a = sm.forward(toks)
    with sm.edit("blocks.1.hook_resid_pre", add=v):
        b = sm.forward(toks)
    assert torch.equal(a, b)
    assert (a - base).abs().max() > 1e-3
    # adding at the last resid_post feeds the final norm
    with sm.edit(last, add=v), sm.record("ln_final.hook_out") as c1:
        sm.forward(toks)
    fn = sm.adapter.final_norm_module(sm.hf_model)
    torch.testing.assert_close(c1["ln_final.hook_out"], fn(c0[last] + v), atol=ATOL, rtol=0)
    assert sm.hook_count() == 0


# arch -> (RMSNorm?, effective weight of the final norm module, its bias), read from each family's norm class
def _norm_facts(arch, mod):
    if arch in ("gemma", "gemma2", "gemma3_text", "gemma3"):
        return True, 1 + mod.weight.float(), None
    if arch == "olmo":
        return False, None, None
    if arch in ("gpt2", "gpt_neox", "gpt_neox_seq"):
        return False, mod.weight.float(), mod.bias.float()
    return True, mod.weight.float(), None


def test_final_norm_hooks(arch):
    """hook_normalized * w_eff (+ bias) == hook_out; hook_scale is TransformerLens's scale; an add
    edit of v at hook_normalized changes hook_out by v * w_eff; hook_scale cannot be edited."""
    sm = steer(arch)
    toks = batch()
    L = sm.n_layers
    mod = sm.adapter.final_norm_module(sm.hf_model)
    with torch.no_grad():  # make weight and bias non-trivial, so w_eff and the bias matter
        for name in ("weight", "bias"):
            p = getattr(mod, name, None)
            if isinstance(p, torch.nn.Parameter):
                p.add_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(11)))
    rms, w, b = _norm_facts(arch, mod)
    names = [f"blocks.{L - 1}.hook_resid_post", "ln_final.hook_scale", "ln_final.hook_normalized",
             "ln_final.hook_out"]
    try:
        with sm.record(names) as c:
            base = sm.forward(toks)
        x, s, n, y = (c[k] for k in names)
        assert s.shape == (*x.shape[:-1], 1) and n.shape == y.shape == x.shape
        h = x if rms else x - x.mean(-1, keepdim=True)
        eps = sm.adapter.norm.module_eps(mod)
        cfg = sm.adapter.text_config(sm.hf_model)
        want_eps = 1e-5 if arch == "olmo" else next(getattr(cfg, a) for a in (
            "rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps") if getattr(cfg, a, None) is not None)
        assert eps == want_eps
        torch.testing.assert_close(s, (h.pow(2).mean(-1, keepdim=True) + eps).sqrt(), atol=ATOL, rtol=1e-5)
        torch.testing.assert_close(n, h / s, atol=ATOL, rtol=0)
        # the weight (or bias) is not the identity; OLMo's norm has neither
        assert torch.allclose(n, y, atol=1e-2) == (w is None and b is None)
        want = n * (1 if w is None else w) + (0 if b is None else b)
        torch.testing.assert_close(want, y, atol=ATOL, rtol=0)
        assert w is None or not torch.allclose(w, torch.ones_like(w))
        v = vec(5)
        with sm.edit("ln_final.hook_normalized", add=v), sm.record(["ln_final.hook_normalized",
                                                                    "ln_final.hook_out"]) as ce:
            steered = sm.forward(toks)
        torch.testing.assert_close(ce["ln_final.hook_normalized"], n + v, atol=ATOL, rtol=0)
        torch.testing.assert_close(ce["ln_final.hook_out"], y + v * (1 if w is None else w), atol=ATOL, rtol=0)
        assert (steered - base).abs().max() > 1e-3
        # two edits compose: the second sees the first one's result
        with sm.edit("ln_final.hook_normalized", add=v), sm.edit("ln_final.hook_normalized", fn=lambda t: 2 * t), \
                sm.record("ln_final.hook_out") as c2:
            sm.forward(toks)
        torch.testing.assert_close(c2["ln_final.hook_out"], 2 * (n + v) * (1 if w is None else w)
                                   + (0 if b is None else b), atol=1e-4, rtol=0)
        with pytest.raises(InputError, match="hook_scale"):
            sm.edit("ln_final.hook_scale", add=torch.zeros(sm.d_model))
        assert sm.hook_count() == 0
    finally:
        for key in [k for k in _CACHE if k[0] == arch]:  # the norm's parameters were changed
            del _CACHE[key]


def test_ablate_attn_out(arch):
    """Ablating a direction at attn_out removes it from what the block adds to the residual."""
    sm = steer(arch)
    toks = batch()
    u = vec(3)
    names = ["blocks.0.hook_resid_pre", "blocks.0.hook_attn_out", "blocks.0.hook_mlp_out",
             "blocks.0.hook_resid_post"]
    with sm.record("blocks.0.hook_attn_out") as c0:
        base = sm.forward(toks)
    assert (c0["blocks.0.hook_attn_out"] @ (u / u.norm())).abs().max() > 1e-3
    with sm.edit("blocks.0.hook_attn_out", ablate=u), sm.record(names) as c:
        logits = sm.forward(toks)
    a = c["blocks.0.hook_attn_out"]
    torch.testing.assert_close(a @ (u / u.norm()), torch.zeros(a.shape[:-1]), atol=ATOL, rtol=0)
    # the block really used the ablated output
    torch.testing.assert_close(c["blocks.0.hook_resid_pre"] + a + c["blocks.0.hook_mlp_out"],
                               c["blocks.0.hook_resid_post"], atol=ATOL, rtol=0)
    assert (logits - base).abs().max() > 1e-3


def test_left_padding_invariance(arch):
    """A left-padded row computes what it computes alone (the long row exceeds sliding windows)."""
    sm = steer(arch)
    g = torch.Generator().manual_seed(5)
    short = [2] + torch.randint(4, 100, (6,), generator=g).tolist()
    long = [2] + torch.randint(4, 100, (19,), generator=g).tolist()
    names = steerkit.resid_post(range(sm.n_layers))
    with sm.record(names) as cp:
        lp = sm.forward(sm.pad([short, long]))
    n = len(short)
    with sm.record(names) as ca:
        la = sm.forward(sm.pad([short]))
    torch.testing.assert_close(lp[0, -n:], la[0], atol=ATOL, rtol=0)
    for name in names:
        assert cp.lengths(name).tolist() == [n, len(long)]
        torch.testing.assert_close(cp[name][0, :n], ca[name][0], atol=ATOL, rtol=0)


def test_generate_with_cache_matches_forward(arch):
    """Greedy generation with the KV cache and a steering edit == argmax of full forwards."""
    sm = steer(arch)
    v = vec(7) * 2
    prompts = ["hello there", "hi"]
    N = 3
    with sm.edit("blocks.0.hook_resid_post", add=v):
        got = sm.generate(prompts, max_new_tokens=N, chat=False, return_tokens=True)
        want = greedy_by_forward(sm, prompts, N)
    assert got == want
    assert sm.hook_count() == 0


def test_continuation_logprobs_match_forward(arch):
    """Scoring continuations with each prompt's KV cache shared == the log-softmax of full forwards, under
    an edit at every position (every family's cache layout)."""
    sm = steer(arch)
    prompts = [sm.tokenizer(p)["input_ids"] for p in ("hello there", "hi")]
    rows = [(0, [30, 31, 32]), (1, [33]), (1, [34, 35, 36, 37, 38]), (0, [])]
    with sm.edit("blocks.0.hook_resid_post", add=vec(7)):
        got = steerkit.continuation_logprobs(sm, prompts, rows, batch_size=2)
        for (p, t), g in zip(rows, got):
            assert g.shape == (len(t),)
            if t:
                full = sm.forward(sm.pad([prompts[p] + t]))[0].float()
                want = torch.log_softmax(full[len(prompts[p]) - 1:-1], -1).gather(-1, torch.tensor(t)[:, None])[:, 0]
                torch.testing.assert_close(g, want, atol=ATOL, rtol=1e-4)
    assert sm.hook_count() == 0


@pytest.mark.parametrize("arch_", ["phi3", "gpt_neox", "gpt_neox_seq", "gpt2"])
def test_decomposition_holds_with_dropout(arch_):
    """attn_out/mlp_out are what is added to the residual even when dropout is active."""
    drop = {"phi3": dict(resid_pdrop=0.5), "gpt2": dict(resid_pdrop=0.5),
            "gpt_neox": dict(hidden_dropout=0.5), "gpt_neox_seq": dict(hidden_dropout=0.5)}[arch_]
    model, tok = tiny_model(arch_, **drop)
    sm = steerkit.wrap(model.train(), tok)
    toks = batch()
    with sm.record(kinds(sm, 0)) as c:
        sm.forward(toks)
    pre, a, m, post = (c[f"blocks.0.{k}"] for k in ("hook_resid_pre", "hook_attn_out", "hook_mlp_out",
                                                   "hook_resid_post"))
    assert (a == 0).float().mean() > 0.2  # dropout was on, and seen by the hook
    torch.testing.assert_close(pre + a + m, post, atol=ATOL, rtol=0)
    if sm.hooks.has_resid_mid:
        torch.testing.assert_close(c["blocks.0.hook_resid_mid"], pre + a, atol=ATOL, rtol=0)


def test_parallel_blocks_refuse_resid_mid():
    sm = steer("gpt_neox")
    assert sm.adapter.is_parallel(sm.hf_model)
    for call in (lambda: sm.record("blocks.0.hook_resid_mid").__enter__(),
                 lambda: sm.edit("blocks.1.hook_resid_mid", add=torch.zeros(64))):
        with pytest.raises(HookNameError, match="parallel"):
            call()
    assert sm.hook_count() == 0
    assert not steer("gpt_neox_seq").adapter.is_parallel(steer("gpt_neox_seq").hf_model)


def test_unsupported_architecture_is_refused():
    from transformers import AutoConfig, AutoModelForCausalLM

    # Granite scales each sub-layer's output by residual_multiplier before adding it: no module
    # outputs the contribution, so it has no adapter rather than a wrong one.
    cfg = AutoConfig.for_model("granite", **{**_LLAMA_LIKE, "num_hidden_layers": 1})
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(UnsupportedArchitectureError, match="register"):
        adapter_for(model)
