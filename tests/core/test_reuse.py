"""Starting a pass at a block and a position of a cached run (:mod:`steerkit.reuse`), and the patching
grids built on it.

Mechanics on tiny random models of every adapter family (4 blocks; sliding-window families with a
window of 5 positions, shorter than the prompts, so the window is exercised; mixtures of experts
included), eager and SDPA attention:

- ``run_from`` (blocks ``l ..``, positions ``p ..``, per-row steerings at ``(l, p)``) equals the same
  positions of a full forward pass with the same steerings, within 1e-5 (measured: at most 3e-7);
- ``run_packed`` (several starts in one pass) equals one full forward pass per start;
- ``activation_patching`` with prefix reuse equals the full-pass grid for every hook kind;
- a failing hook inside ``run_from`` leaves the model's blocks in place and no hook behind;
- recordings inside ``run_from`` see the absolute positions ``p ..``;
- the errors say what was expected.
"""
from __future__ import annotations

import pytest
import torch

import steerkit
from steerkit import Intervention
from steerkit.errors import InputError
from steerkit.probes import activation_patching, logit_diff_metric
from steerkit.reuse import Pack, run_cached, run_from, run_packed, supports_run_from

from tiny_models import ARCHS, MOE_ARCHS, no_leftover_hooks, tiny_model

PROMPT = "When Mary and John went to the store, John gave"
SLIDING = ("mistral", "gemma2", "gemma3_text", "olmo3", "gemma3")
TOL = 1e-5


def _tiny(arch: str, impl: str = "eager"):
    kw: dict = dict(n_layer=4) if arch == "gpt2" else dict(num_hidden_layers=4)
    if arch in SLIDING:
        kw["sliding_window"] = 5
    if arch in ("gemma3_text", "olmo3", "gemma3"):
        kw["layer_types"] = ["sliding_attention", "full_attention"] * 2
    model, tok = tiny_model(arch, attn_implementation=impl, **kw)
    return steerkit.wrap(model, tok, name=f"tiny-{arch}")


FAMILIES = [(a, "eager") for a in ARCHS + MOE_ARCHS] + [(a, "sdpa") for a in ("llama", "mistral", "gpt2", "qwen2_moe")]


@pytest.mark.parametrize("arch,impl", FAMILIES, ids=[f"{a}-{i}" for a, i in FAMILIES])
def test_run_from_and_packed_equal_full_passes(arch, impl):
    sm = _tiny(arch, impl)
    with no_leftover_hooks(sm):
        toks = sm.tokenize([PROMPT])
        T = int(toks.input_ids.shape[1])
        assert T > 5  # longer than the sliding window
        rc = run_cached(sm, toks)
        assert float((rc.logits - sm.forward(toks)).abs().max()) <= TOL
        g = torch.Generator().manual_seed(0)
        worst = worst_packed = 0.0
        for layer in range(sm.n_layers):
            starts = [0, 3, T - 1, 7]
            vs = [torch.randn(sm.d_model, generator=g) for _ in starts]
            fulls = []
            for p, v in zip(starts, vs):
                with sm.steer(Intervention.add(f"blocks.{layer}.hook_resid_pre", v, positions=[p])):
                    fulls.append(sm.forward(toks)[0])
            # one start per pass, two rows steered their own way and one unsteered
            for p, v, full in zip(starts, vs, fulls):
                iv = Intervention.add(f"blocks.{layer}.hook_resid_pre", v, positions=[p])
                with sm.steer(rows=[[iv], None, [iv]]):
                    tail = run_from(sm, f"blocks.{layer}.hook_resid_pre", rc, start=p, rows=[0, 0, 0])
                worst = max(worst, float((tail[0] - full[p:]).abs().max()), float((tail[2] - full[p:]).abs().max()),
                            float((tail[1] - rc.logits[0, p:]).abs().max()))
            # every start in one packed pass
            pack = Pack.of(starts, T)
            src = torch.zeros(T + pack.length, sm.d_model)
            for i, (p, v) in enumerate(zip(starts, vs)):
                src[pack.index(i, p)] = v
            at = [pack.index(i, p) for i, p in enumerate(starts)]
            with sm.steer(Intervention.apply(f"blocks.{layer}.hook_resid_pre",
                                             lambda h, s=src, a=at: _add_at(h, s, a))):
                packed = run_packed(sm, layer, rc, pack)
            for i, full in enumerate(fulls):
                worst_packed = max(worst_packed, float((packed[i] - full).abs().max()))
        assert worst <= TOL, f"{arch}/{impl}: max |run_from - full| = {worst:.3g}"
        # the packed attention runs one whole sequence per segment, as a full pass does (hooks.segments): equal to
        # the last bit where no product changes shape (measured 0); mixture-of-experts blocks send another number
        # of tokens through each expert (measured at most 2.1e-7)
        assert worst_packed <= (TOL if arch in MOE_ARCHS else 1e-6), f"{arch}/{impl}: max |packed - full| = {worst_packed:.3g}"


def _add_at(h: torch.Tensor, src: torch.Tensor, at: list[int]) -> torch.Tensor:
    """``h`` (``[1, packed, d]``, the packed chunk after the cached positions) plus ``src`` at ``at``."""
    T = src.shape[0] - h.shape[1]
    out = h.clone()
    for k in at:
        out[0, k - T] += src[k].to(h)
    return out


HOOKS = ["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "z", "z_pos", "mlp_post"]
PATCH_FAMILIES = list(ARCHS + MOE_ARCHS)
#: families whose every hook kind is checked (one of each block layout: llama-like, sliding-window with layer
#: types, GPT-2, parallel GPT-NeoX, mixture of experts); the others check the kinds with distinct code paths
EVERY_HOOK = ("llama", "gemma2", "olmo3", "gpt2", "gpt_neox", "qwen2_moe")


@pytest.mark.parametrize("arch", PATCH_FAMILIES)
def test_patching_grids_equal_full_passes(arch):
    sm = _tiny(arch)
    clean, corrupted = "When Mary and John went to the store, John gave", "When Mary and John went to the store, Mary gave"
    metric = logit_diff_metric(sm, "a", "b")
    with no_leftover_hooks(sm):
        for hook in HOOKS if arch in EVERY_HOOK else ("resid_pre", "z", "z_pos"):
            if hook == "resid_mid" and not sm.hooks.has_resid_mid:
                continue
            if hook == "mlp_post" and sm.adapter.is_sparse(sm.hf_model, 0):
                continue
            kw: dict = {} if hook == "z" else dict(positions=[0, 5, 30, -1])
            if hook == "z_pos":
                kw["heads"] = [0, 3]
            a = activation_patching(sm, clean, corrupted, metric, hook, progress=False, batch_size=5, **kw)
            b = activation_patching(sm, clean, corrupted, metric, hook, progress=False, reuse=False, **kw)
            assert a.values.shape == b.values.shape
            err = float((a.values - b.values).abs().max())
            assert err <= TOL, f"{arch} {hook}: max |packed - full| = {err:.3g}"
            assert a.corrupted_metric == pytest.approx(b.corrupted_metric, abs=TOL)
        if arch in EVERY_HOOK and not sm.adapter.is_sparse(sm.hf_model, 0):
            a = activation_patching(sm, clean, corrupted, metric, "mlp_post", neurons=[1, 7], progress=False)
            b = activation_patching(sm, clean, corrupted, metric, "mlp_post", neurons=[1, 7], progress=False,
                                    reuse=False)
            assert float((a.values - b.values).abs().max()) <= TOL


def test_metric_without_positions_reads_every_position():
    """A metric that declares nothing gets every position's logits, the cached ones before each start."""
    sm = _tiny("llama")
    seen = []

    def metric(logits):
        seen.append(tuple(logits.shape))
        return logits[0, 2, 5] - logits[0, -1, 6]

    a = activation_patching(sm, "abcdefgh", "abcdxfgh", metric, "resid_pre", progress=False)
    b = activation_patching(sm, "abcdefgh", "abcdxfgh", metric, "resid_pre", progress=False, reuse=False)
    assert float((a.values - b.values).abs().max()) <= TOL
    assert set(seen) == {(1, 8, 256)}


@pytest.fixture(scope="module")
def tiny():
    sm = _tiny("llama")
    yield sm
    sm.reset()


def test_recordings_see_absolute_positions(tiny):
    toks = tiny.tokenize([PROMPT])
    rc = run_cached(tiny, toks)
    with tiny.record(["blocks.2.hook_resid_post", "blocks.0.hook_resid_post"], positions="all") as full:
        tiny.forward(toks)
    with tiny.record(["blocks.2.hook_resid_post", "blocks.0.hook_resid_post"], positions="all") as part:
        run_from(tiny, 1, rc, start=6)
    assert part["blocks.2.hook_resid_post"].shape[1] == toks.input_ids.shape[1] - 6
    assert torch.allclose(part["blocks.2.hook_resid_post"], full["blocks.2.hook_resid_post"][:, 6:], atol=TOL)
    with pytest.raises(InputError, match="nothing was recorded at 'blocks.0.hook_resid_post'"):
        part["blocks.0.hook_resid_post"]  # block 0 is not run
    with tiny.record("blocks.2.hook_resid_post", positions=[9]) as one:
        run_from(tiny, 1, rc, start=6)
    assert torch.allclose(one["blocks.2.hook_resid_post"][0, 0], full["blocks.2.hook_resid_post"][0, 9], atol=TOL)


def test_a_failing_hook_restores_the_blocks(tiny):
    blocks = list(tiny.adapter.block_list(tiny.hf_model))
    rc = run_cached(tiny, PROMPT)

    def boom(h):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        with tiny.steer(Intervention.apply("blocks.3.hook_resid_pre", boom)):
            run_from(tiny, 2, rc, start=3)
    assert list(tiny.adapter.block_list(tiny.hf_model)) == blocks
    assert tiny.hook_count() == 0
    assert torch.allclose(tiny.forward(PROMPT), rc.logits, atol=TOL)


def test_return_cache_continues_like_a_full_cache(tiny):
    toks = tiny.tokenize([PROMPT])
    rc = run_cached(tiny, toks)
    nxt = torch.tensor([[7]])
    v = torch.randn(tiny.d_model)
    with tiny.steer(Intervention.add("blocks.2.hook_resid_pre", v)):
        _, kv = run_from(tiny, 2, rc, keep=1, return_cache=True)
        full = tiny.forward(steerkit.model.Tokens(torch.cat([toks.input_ids, nxt], 1),
                                                  torch.ones(1, toks.input_ids.shape[1] + 1, dtype=torch.long)))
        T = toks.input_ids.shape[1]
        with tiny.hooks.runs.running(torch.ones(1, T, dtype=torch.long), toks.input_ids) as run:
            run.chunk_start = T
            step, _ = tiny.backend.step(nxt, torch.ones(1, T + 1, dtype=torch.long), torch.tensor([[T]]), kv)
    assert all(layer.get_seq_length() == T + 1 for layer in kv.layers)
    assert torch.allclose(step[0], full[0, -1], atol=TOL)


def test_errors_say_what_to_do(tiny):
    rc = run_cached(tiny, PROMPT)
    T = rc.n_pos
    with pytest.raises(InputError, match=r"expected start as a position in 0\.\.%d" % (T - 1)):
        run_from(tiny, 1, rc, start=T)
    with pytest.raises(InputError, match="expected a block index in 0..3"):
        run_from(tiny, 4, rc)
    with pytest.raises(InputError, match="after the last block"):
        run_from(tiny, "ln_final.hook_normalized", rc)
    with pytest.raises(InputError, match="expected rows as at least one index in 0..0"):
        run_from(tiny, 1, rc, rows=[1])
    with pytest.raises(InputError, match="expected resid of shape"):
        run_from(tiny, 1, rc, resid=torch.zeros(1, 2, 64))
    with pytest.raises(InputError, match="expected a RunCache from run_cached"):
        run_from(tiny, 1, rc.logits)
    other = _tiny("llama")
    with pytest.raises(InputError, match="made by this model"):
        run_from(other, 1, rc)
    with pytest.raises(InputError, match="expected at least one start position"):
        Pack.of([T], T)
    with pytest.raises(InputError, match="expected a Pack over the cache's"):
        run_packed(tiny, 1, rc, Pack.of([0], T + 1))
    padded = run_cached(tiny, ["a", "abc"])
    with pytest.raises(InputError, match="unpadded"):
        run_packed(tiny, 1, padded, Pack.of([0], padded.n_pos))
    assert tiny.hook_count() == 0


def test_a_packed_pass_refuses_pattern_hooks_and_restores_attention(tiny):
    """Attention patterns of a packed pass would be the per-segment batch's, not the run's: refused with
    what to use instead; the model's attention implementation is its own again afterwards."""
    rc = run_cached(tiny, PROMPT)
    base = tiny.hf_model.config._attn_implementation
    with pytest.raises(InputError, match="hook_pattern hook during a packed pass.*run_from"):
        with tiny.record(["blocks.2.attn.hook_pattern"]):
            run_packed(tiny, 1, rc, Pack.of([0, 3], rc.n_pos))
    assert tiny.hf_model.config._attn_implementation == base and tiny.hook_count() == 0
    with tiny.record(["blocks.2.attn.hook_pattern"]) as rec:  # run_from runs the run's own attention
        run_from(tiny, 1, rc, start=3)
    assert rec["blocks.2.attn.hook_pattern"].shape[-2:] == (rc.n_pos - 3, rc.n_pos)
    run_packed(tiny, 1, rc, Pack.of([0, 3], rc.n_pos))
    assert tiny.hf_model.config._attn_implementation == base


def test_backends_without_block_ranges_keep_full_passes(tiny):
    pytest.importorskip("nnsight")
    model, tok = tiny_model("llama", num_hidden_layers=4)
    tl = steerkit.wrap(model, tok, name="tiny-llama", backend="nnsight")
    assert supports_run_from(tiny) and not supports_run_from(tl)
    with pytest.raises(InputError, match="expected a model on the 'hf' backend"):
        run_cached(tl, PROMPT)
    metric = logit_diff_metric(tl, "a", "b")
    with pytest.raises(InputError, match="reuse=True only on the 'hf' backend"):
        activation_patching(tl, "abcd", "abce", metric, reuse=True, progress=False)
    grid = activation_patching(tl, "abcd", "abce", metric, layers=[1], progress=False)  # the full-pass path
    ref = activation_patching(tiny, "abcd", "abce", logit_diff_metric(tiny, "a", "b"), layers=[1], progress=False)
    assert grid.values.shape == ref.values.shape
    assert float((grid.values - ref.values).abs().max()) <= TOL  # the same random weights (seed 0)
