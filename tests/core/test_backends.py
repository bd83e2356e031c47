"""The three backends (hf, tlens, nnsight) on the real default model, on the same token ids.

Tolerances, measured on SmolLM2-135M-Instruct in float32 on CPU:

- nnsight vs hf: **bit-exact** (measured max |diff| = 0.0). nnsight runs the very same HF
  modules with the same SDPA attention kernel; interventions only read and write
  tensors. The check allows 1e-5 absolute so that a change of BLAS thread count between
  calls cannot make it flaky.
- tlens vs hf: **float32 rounding**. The TransformerBridge forces eager attention while the
  HF backend uses SDPA; the two sum in a different order. Measured max |diff|: 8e-5 on
  logits (scale ~40), 8e-4 on ``blocks.29.hook_resid_post`` (scale ~4400: the massive
  activation dimension), i.e. <= 2e-6 of each tensor's max magnitude. Checked as
  ``|a - b| <= 1e-3 + 1e-4 |b|`` (assert_close rtol=1e-4, atol=1e-3): far tighter than
  any edit's effect (>= 30 on logits here) and loose enough for the kernel difference.

Forward checks run on two short raw prompts of different lengths (left padding). Greedy
generation is compared token for token on 3 chat prompts x 12 tokens, batched, so left
padding and the KV cache are exercised on every backend.

Runtime: the model is loaded once and wrapped by each backend once (module fixtures);
torch runs single-threaded here (``STEERKIT_TEST_THREADS``, default 1), which is several
times faster than 2 threads on a shared, contended machine.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformer_lens")
pytest.importorskip("nnsight")

import steerkit
from steerkit.errors import InputError

pytestmark = [pytest.mark.slow, pytest.mark.backends]

PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "Hi"]
N_GEN = 12
TOL = {"tlens": dict(rtol=1e-4, atol=1e-3), "nnsight": dict(rtol=0.0, atol=1e-5)}
EDIT_SITES = ["blocks.5.hook_resid_pre", "blocks.5.hook_resid_mid", "blocks.5.hook_resid_post",
              "blocks.5.hook_attn_out", "blocks.5.hook_mlp_out", "ln_final.hook_normalized", "ln_final.hook_out"]
FINAL = ["ln_final.hook_scale", "ln_final.hook_normalized", "ln_final.hook_out"]


@pytest.fixture(scope="module", autouse=True)
def _threads():
    prev = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("STEERKIT_TEST_THREADS", "1")))
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def hf(_threads, default_model):
    """The HF-backend reference: the session's default model (tests/conftest.py)."""
    return default_model


@pytest.fixture(scope="module")
def tlens(hf):
    return steerkit.wrap(hf.hf_model, hf.tokenizer, name=hf.name, backend="tlens")


@pytest.fixture(scope="module")
def nns(hf):
    return steerkit.wrap(hf.hf_model, hf.tokenizer, name=hf.name, backend="nnsight")


@pytest.fixture(scope="module")
def others(tlens, nns):
    return {"tlens": tlens, "nnsight": nns}


@pytest.fixture(scope="module")
def toks(hf):
    # Forward checks use the raw prompts (no chat template): short, still left-padded.
    return hf.tokenize(["The capital of France is", "Rain falls softly on the quiet town and"], chat=False)


@pytest.fixture(scope="module")
def ref_logits(hf, toks):
    return hf.forward(toks)


@pytest.fixture(scope="module")
def vec(hf):
    g = torch.Generator().manual_seed(0)
    return 4.0 * torch.randn(hf.d_model, generator=g)


def _close(name, a, b):
    torch.testing.assert_close(a, b, **TOL[name])


def _real(logits, toks):
    """Logits at real tokens only: a left-padding position attends to nothing, and what
    eager and SDPA attention return for an all-masked row differs (and means nothing)."""
    return logits[toks.attention_mask.bool()]


def test_backends_do_not_touch_the_original_model(hf, tlens, nns):
    assert tlens.hf_model is hf.hf_model and nns.hf_model is hf.hf_model
    assert all("forward" not in m.__dict__ for m in hf.hf_model.modules())  # nnsight patched its copy
    assert hf.hook_count() == 0
    assert tlens.backend.bridge.original_model is not hf.hf_model
    assert nns.backend.model is not hf.hf_model


def test_backends_share_the_weights(hf, tlens, nns):
    """tlens and nnsight run their own module trees over the HF model's own weight tensors: no
    parameter or buffer is duplicated (benchmarks/bench_backend_memory.py measures the memory)."""
    orig = {t.data_ptr() for t in (*hf.hf_model.parameters(), *hf.hf_model.buffers())}
    for name, mod in (("tlens", tlens.backend.bridge), ("nnsight", nns.backend.model)):
        params = list(mod.parameters())
        assert params and all(p.data_ptr() in orig for p in params), name
        assert sum(p.numel() for p in params) == sum(p.numel() for p in hf.hf_model.parameters()), name


def test_plain_logits_agree(others, toks, ref_logits):
    for name, sm in others.items():
        _close(name, _real(sm.forward(toks), toks), _real(ref_logits, toks))


def test_recorded_activations_agree(hf, others, toks):
    names = [f"blocks.{l}.hook_resid_post" for l in (0, 10, hf.n_layers - 1)] + [
        "blocks.7.hook_resid_pre", "blocks.7.hook_resid_mid", "blocks.7.hook_attn_out",
        "blocks.7.hook_mlp_out", *FINAL]
    with hf.record(names) as ref:
        hf.forward(toks)
    for name, sm in others.items():
        with sm.record(names) as got:
            sm.forward(toks)
        for n in names:
            assert got[n].shape == ref[n].shape
            _close(name, got[n], ref[n])
            assert torch.equal(got.positions(n), ref.positions(n))


def test_resid_mid_is_resid_pre_plus_attn_out(others, toks):
    for name, sm in others.items():
        with sm.record(["blocks.4.hook_resid_pre", "blocks.4.hook_attn_out", "blocks.4.hook_resid_mid"]) as c:
            sm.forward(toks)
        torch.testing.assert_close(c["blocks.4.hook_resid_mid"],
                                   c["blocks.4.hook_resid_pre"] + c["blocks.4.hook_attn_out"], msg=name)


@pytest.mark.parametrize("site", EDIT_SITES)
def test_add_edit_gives_same_logits(hf, others, toks, ref_logits, vec, site):
    with hf.edit(site, add=vec):
        want = hf.forward(toks)
    # the edit really changes what comes downstream
    assert float((_real(want, toks) - _real(ref_logits, toks)).abs().max()) > 1.0
    for name, sm in others.items():
        with sm.edit(site, add=vec):
            got = sm.forward(toks)
        _close(name, _real(got, toks), _real(want, toks))
        _close(name, _real(sm.forward(toks), toks), _real(ref_logits, toks))  # gone after its scope


def test_final_norm_edits_agree(hf, others, toks, vec):
    """Edits at hook_normalized and hook_out, and what all three final-norm hooks record under them,
    agree across backends; hook_scale is record only on every backend."""
    d = vec / vec.norm()

    def run(sm):
        with sm.edit("ln_final.hook_normalized", add=0.1 * vec), sm.edit("ln_final.hook_normalized", ablate=d), \
                sm.edit("ln_final.hook_out", fn=lambda x: 0.9 * x), sm.record(FINAL) as c:
            logits = sm.forward(toks)
        return logits, c

    want, cw = run(hf)
    assert float((cw["ln_final.hook_normalized"] @ d).abs().max()) < 1e-4
    for name, sm in {"hf": hf, **others}.items():
        base = sm.hook_count()
        with pytest.raises(InputError, match="hook_scale"):
            sm.edit("ln_final.hook_scale", add=vec)
        assert sm.hook_count() == base, name
        if name == "hf":
            continue
        got, cg = run(sm)
        _close(name, _real(got, toks), _real(want, toks))
        for n in FINAL:
            assert cg[n].shape == cw[n].shape
            _close(name, cg[n], cw[n])


def test_ablation_and_resid_mid_edits_agree(hf, others, toks, vec):
    d = vec / vec.norm()
    def edits(sm):
        return [sm.edit("blocks.10.hook_resid_post", ablate=d),
                sm.edit("blocks.3.hook_resid_mid", fn=lambda x: 0.5 * x),
                sm.edit("blocks.3.hook_resid_mid", add=vec, positions="last"),
                sm.edit("blocks.12.hook_resid_mid", ablate=d)]
    probe = ["blocks.10.hook_resid_post", "blocks.12.hook_resid_mid", "blocks.3.hook_resid_mid"]

    def run(sm):
        hs = edits(sm)
        try:
            with sm.record(probe) as c:
                logits = sm.forward(toks)
        finally:
            for h in hs:
                h.remove()
        return logits, c

    want, cw = run(hf)
    # the ablated direction is gone where it was ablated (recorded after the edit)
    assert float((cw["blocks.10.hook_resid_post"] @ d).abs().max()) < 1e-3
    assert float((cw["blocks.12.hook_resid_mid"] @ d).abs().max()) < 1e-3
    for name, sm in others.items():
        got, cg = run(sm)
        _close(name, _real(got, toks), _real(want, toks))
        for n in probe:
            _close(name, cg[n], cw[n])


def test_greedy_generation_agrees(hf, others):
    want = hf.generate(PROMPTS, N_GEN, return_tokens=True, chat=True)  # replies: no row ends at once
    assert all(len(w) > 0 for w in want)
    for name, sm in others.items():
        assert sm.generate(PROMPTS, N_GEN, return_tokens=True, chat=True) == want, name


def test_steered_generation_and_generated_rows_agree(hf, others, vec):
    site = "blocks.8.hook_resid_post"
    with hf.edit(site, add=2 * vec), hf.record(site, positions="generated") as cw:
        want = hf.generate(PROMPTS[:2], 6, return_tokens=True)
    plain = hf.generate(PROMPTS[:2], 6, return_tokens=True)
    assert want != plain  # the edit applies during generation
    for name, sm in others.items():
        with sm.edit(site, add=2 * vec), sm.record(site, positions="generated") as cg:
            got = sm.generate(PROMPTS[:2], 6, return_tokens=True)
        assert got == want, name
        # one recorded row per generated token
        assert cg.lengths(site).tolist() == [len(t) for t in got]
        _close(name, cg[site], cw[site])


def test_hook_count_back_to_baseline_after_exception(hf, others, toks, ref_logits, vec):
    for name, sm in {"hf": hf, **others}.items():
        base = sm.hook_count()
        with pytest.raises(RuntimeError, match="boom"):
            with sm.edit("blocks.2.hook_resid_mid", add=vec), sm.record(["blocks.6.hook_resid_post",
                                                                          "ln_final.hook_normalized"]):
                assert sm.hook_count() > base, name
                sm.forward(toks)
                raise RuntimeError("boom")
        assert sm.hook_count() == base, name

        # an exception raised *inside* a hook function propagates and leaves nothing behind
        def bad(x):
            raise RuntimeError("boom in hook")
        with pytest.raises(Exception, match="boom in hook"):
            with sm.edit("blocks.3.hook_resid_post", fn=bad):
                sm.forward(toks)
        assert sm.hook_count() == base, name

        # handles removed out of order, then reset()
        h1 = sm.edit("blocks.1.hook_resid_post", add=vec)
        h2 = sm.edit("blocks.1.hook_resid_mid", add=vec)
        h1.remove()
        assert sm.hook_count() > base
        sm.reset()
        assert sm.hook_count() == base and not h2.active, name
        tol = TOL.get(name, dict(rtol=0.0, atol=0.0))
        torch.testing.assert_close(_real(sm.forward(toks), toks), _real(ref_logits, toks), **tol)


def test_recycling_agrees_across_backends(hf, others):
    """Representation recycling re-runs steps (cache cropped, positions repeated) on every backend."""
    from steerkit.generation import Recycle
    plain = hf.generate(PROMPTS[:2], 8, return_tokens=True)
    thinking = sorted({t for row in plain for t in row[2:5]})  # steps 2-4 of each row re-run
    rec = Recycle(layer=10, tokens=thinking)
    want = hf.generate(PROMPTS[:2], 8, return_tokens=True, recycle=rec)
    assert rec.events, "some step should have been recycled"
    for name, sm in others.items():
        r = Recycle(layer=10, tokens=thinking)
        assert sm.generate(PROMPTS[:2], 8, return_tokens=True, recycle=r) == want, name
        assert r.events == rec.events, name
    assert hf.hook_count() == 0


def _component_edits(sm):
    """Per-head, per-neuron, pattern and norm edits at once (handles, removed by the caller)."""
    return [sm.edit("blocks.4.attn.hook_z", replace=torch.zeros(sm.d_head), heads=[2]),
            sm.edit("blocks.6.mlp.hook_post", replace=torch.zeros(3), neurons=[1, 5, 7]),
            sm.edit("blocks.7.attn.hook_pattern", fn=lambda p: p * 0.5),
            sm.edit("blocks.8.ln2.hook_normalized", fn=lambda x: x * 1.1),
            sm.edit("blocks.9.attn.hook_q", add=torch.ones(sm.d_head), heads=[0, 4])]


def test_component_hooks_and_edits_agree(hf, others, toks, ref_logits):
    """The component hooks record the same values on the three backends (tlens: the bridge's own
    hook points; nnsight: envoys of the traced model) and the same edits give the same logits."""
    names = [n for n in hf.hook_names(components=True) if n.startswith("blocks.4.") and "." in n.split(".", 2)[-1]]
    real = toks.attention_mask.bool()

    def run(sm):
        with sm.record(names, positions="all") as c:
            sm.forward(toks)
        edits = _component_edits(sm)
        try:
            return c, sm.forward(toks)
        finally:
            for e in edits:
                e.remove()
    c0, l0 = run(hf)
    assert float((_real(l0, toks) - _real(ref_logits, toks)).abs().max()) > 1.0  # the edits do something
    for name, sm in others.items():
        c1, l1 = run(sm)
        for n in names:
            scale = float(c0[n].abs().max())
            assert float((c1[n] - c0[n]).abs().max()) <= 1e-4 * scale, (name, n)
        torch.testing.assert_close(l1[real], l0[real], **TOL[name])


def test_component_edits_and_records_in_generation_agree(hf, others):
    site = "blocks.5.attn.hook_pattern"

    def run(sm):
        edits = _component_edits(sm)
        try:
            with sm.record([site, "blocks.5.attn.hook_z"], positions="generated") as c:
                return sm.generate(PROMPTS[:2], 6, return_tokens=True, chat=True), c
        finally:
            for e in edits:
                e.remove()
    want, cw = run(hf)
    with hf.record("blocks.5.attn.hook_z", positions="generated") as plain:
        hf.generate(PROMPTS[:2], 6, chat=True)
    assert float((plain["blocks.5.attn.hook_z"] - cw["blocks.5.attn.hook_z"]).abs().max()) > 0.1  # the edits act
    for name, sm in others.items():
        got, cg = run(sm)
        assert got == want, name
        assert cg[site].shape == cw[site].shape, name
        assert float((cg[site] - cw[site]).abs().max()) < 1e-4, name
        assert float((cg["blocks.5.attn.hook_z"] - cw["blocks.5.attn.hook_z"]).abs().max()) < 1e-3, name


def test_logits_to_keep_and_continuation_logprobs_agree(hf, others, toks, ref_logits, vec):
    """``logits_to_keep=k`` returns the last ``k`` positions of the full logits on every backend.
    ``continuation_logprobs`` (each prompt's KV cache shared by its rows) equals the log-softmax of a full
    forward of prompt + continuation, with no edit and with an edit at every position; under an edit of
    the generated positions only it equals the distribution the generation itself sampled from."""
    from steerkit.generation import continuation_logprobs
    prompts = [hf.tokenizer(p)["input_ids"] for p in ("The capital of France is", "Rain falls on")]
    rows = [(0, [12366, 30, 378, 314]), (1, [260]), (0, [12366]), (1, [288, 3273, 284, 5248, 28, 339]), (0, [])]

    def full_forward(sm):
        out = []
        for p, t in rows:
            full = sm.forward(sm.pad([prompts[p] + t]))[0].float()
            lp = torch.log_softmax(full[len(prompts[p]) - 1:-1], -1)
            out.append(lp.gather(-1, torch.tensor(t, dtype=torch.long)[:, None])[:, 0] if t else torch.zeros(0))
        return out

    unembed = hf.adapter.unembed_module(hf.hf_model)
    for name, sm in {"hf": hf, **others}.items():
        last = sm.forward(toks, logits_to_keep=1)
        assert last.shape == (ref_logits.shape[0], 1, ref_logits.shape[-1]), name
        torch.testing.assert_close(last[:, 0], ref_logits[:, -1], rtol=1e-4, atol=1e-3)
        plain = continuation_logprobs(sm, prompts, rows, batch_size=2)
        for got, want in zip(plain, full_forward(sm)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        with sm.edit("blocks.3.hook_resid_post", add=vec):
            for got, want in zip(continuation_logprobs(sm, prompts, rows, batch_size=2), full_forward(sm)):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # generated positions only: the generation's own next-token distributions (ln_final output, unembedded)
        n = len(prompts[0])
        with sm.edit("blocks.3.hook_resid_post", add=vec, positions="generated"):
            with sm.record("ln_final.hook_out", positions="all") as rec:
                gen = sm.generate(sm.pad(prompts[:1]), max_new_tokens=5, return_tokens=True)[0]
            got = continuation_logprobs(sm, prompts, [(0, gen)])[0]
        with torch.inference_mode():
            lp = torch.log_softmax(unembed(rec["ln_final.hook_out"][0, n - 1:n - 1 + len(gen)]).float(), -1)
        torch.testing.assert_close(got, lp.gather(-1, torch.tensor(gen)[:, None])[:, 0], rtol=1e-4, atol=1e-4)
        assert not torch.allclose(got, continuation_logprobs(sm, prompts, [(0, gen)])[0]), name
    with pytest.raises(InputError, match="logits_to_keep"):
        hf.forward(toks, logits_to_keep=-1)
    with pytest.raises(InputError, match="prompt index"):
        continuation_logprobs(hf, prompts, [(2, [5])])
