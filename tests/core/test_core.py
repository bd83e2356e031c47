"""Core hook manager on the real default model: records, edits, scopes, positions, bad input."""
import gc
import weakref

import pytest
import torch

import steerkit
from steerkit.errors import HookNameError, InputError

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a haiku about autumn leaves falling gently down"]
L = 15
H = f"blocks.{L}.hook_resid_post"


def hidden_states(sm, toks):
    with torch.inference_mode():
        o = sm.model(input_ids=toks.input_ids, attention_mask=toks.attention_mask,
                     position_ids=toks.position_ids, output_hidden_states=True)
    return o.hidden_states


def test_resid_post_is_block_output_and_last_is_last_real_token(sm):
    toks = sm.tokenize(PROMPTS)
    assert (toks.attention_mask[:, -1] == 1).all() and (toks.attention_mask[0, 0] == 0)  # left padded
    with sm.record(steerkit.resid_post(range(sm.n_layers)), positions="last") as cache:
        sm.forward(PROMPTS)
    hs = hidden_states(sm, toks)
    for l in (0, L, sm.n_layers - 2):  # hidden_states[-1] has the final norm applied
        assert cache[f"blocks.{l}.hook_resid_post"].shape == (2, sm.d_model)
        torch.testing.assert_close(cache[f"blocks.{l}.hook_resid_post"], hs[l + 1][:, -1], rtol=0, atol=0)
    assert cache.stack().shape == (sm.n_layers, 2, sm.d_model)


def test_positions_all_prompt_indices_and_padding(sm):
    toks = sm.tokenize(PROMPTS)
    n_real = toks.attention_mask.sum(1)
    hs = hidden_states(sm, toks)[L + 1]
    with sm.record([H], positions="all") as c_all, sm.record([H], positions=[0, -1]) as c_idx:
        sm.forward(PROMPTS)
    assert c_all.lengths(H).tolist() == n_real.tolist()
    for b in range(2):
        real = hs[b][toks.attention_mask[b].bool()]
        torch.testing.assert_close(c_all[H][b, : n_real[b]], real, rtol=0, atol=0)
        torch.testing.assert_close(c_idx[H][b], real[[0, -1]], rtol=0, atol=0)
    # a padded row computes what it computes alone
    with sm.record([H], positions="all") as alone:
        sm.forward(PROMPTS[0])
    torch.testing.assert_close(alone[H][0, : n_real[0]], c_all[H][0, : n_real[0]], atol=2e-4, rtol=1e-4)


def test_record_during_generate_one_row_per_generated_token(sm):
    n = 6
    with sm.record([H], positions="generated") as cache:
        toks_out = sm.generate(PROMPTS, max_new_tokens=n, return_tokens=True, chat=True)
    got = cache[H]
    assert got.shape[0] == 2
    for b in range(2):
        assert int(cache.lengths(H)[b]) == len(toks_out[b])
    # the same rows from one forward pass over prompt + generated tokens (no KV cache)
    toks = sm.tokenize(PROMPTS[:1], chat=True)
    full = torch.cat([toks.input_ids, torch.tensor([toks_out[0]])], 1)
    t2 = steerkit.Tokens(full, torch.ones_like(full))
    ref = hidden_states(sm, t2)[L + 1][0, toks.input_ids.shape[1]:]
    k = len(toks_out[0])
    torch.testing.assert_close(got[0, :k], ref[:k], atol=2e-4, rtol=1e-4)


def test_zero_vector_is_bit_identical(sm):
    base = sm.forward(PROMPTS)
    with sm.edit(H, add=torch.zeros(sm.d_model)):
        z = sm.forward(PROMPTS)
    assert torch.equal(base, z)


def test_nested_add_and_subtract_returns_to_baseline(sm):
    g = torch.Generator().manual_seed(0)
    v = torch.randn(sm.d_model, generator=g) * 5
    base = sm.forward(PROMPTS)
    with sm.edit(H, add=v) as outer:
        moved = sm.forward(PROMPTS)
        with sm.edit(H, add=-v):
            back = sm.forward(PROMPTS)
        assert outer.active
        again = sm.forward(PROMPTS)   # the inner scope removed only its own hook
    assert (moved - base).abs().max() > 1.0
    # (x + v) - v differs from x by float32 rounding of |x|+|v| ~ 1e2 -> ~1e-5 per element,
    # amplified through 14 more blocks: 1e-3 on logits is a tight bound
    torch.testing.assert_close(back, base, atol=1e-3, rtol=0)
    torch.testing.assert_close(again, moved, atol=0, rtol=0)


def test_ablation_projection_below_1e5_relative(sm):
    g = torch.Generator().manual_seed(1)
    B = steerkit.orthonormalize(torch.randn(3, sm.d_model, generator=g))
    names = [f"blocks.{l}.hook_resid_pre" for l in range(sm.n_layers)]
    with sm.edit(names, ablate=B), sm.record(names + [H], positions="all") as cache:
        sm.forward(PROMPTS)
    for n in (names[0], names[L], names[-1]):
        x = cache[n][cache.positions(n) >= 0]
        rel = ((x @ B.T).abs() / x.norm(dim=-1, keepdim=True)).max()
        assert rel < 1e-5, (n, float(rel))
    # the block output is not ablated: it writes the directions back
    x = cache[H][cache.positions(H) >= 0]
    assert ((x @ B.T).abs() / x.norm(dim=-1, keepdim=True)).max() > 1e-3


def test_clamp_replace_fn_and_positions(sm):
    u = torch.randn(sm.d_model)
    u = u / u.norm()
    with sm.edit(H, clamp=u, value=3.0), sm.record([H], positions="all") as c:
        sm.forward(PROMPTS)
    x = c[H][c.positions(H) >= 0]
    # float32: the projection carries rounding of order eps * |x| (|x| reaches ~1e3 on this model)
    err = (x @ u - 3.0).abs()
    assert (err <= 1e-6 * x.norm(dim=-1) + 1e-5).all(), float(err.max())
    # edits limited to generated tokens leave the prompt's logits untouched
    base = sm.forward(PROMPTS)
    with sm.edit(H, add=u * 50, positions="generated"):
        same = sm.forward(PROMPTS)
        steered = sm.generate(PROMPTS, max_new_tokens=4, return_tokens=True)
    assert torch.equal(base, same)
    assert steered != sm.generate(PROMPTS, max_new_tokens=4, return_tokens=True)  # ... and steer what follows
    # fn edit sees [batch, pos, d_model]
    seen = []
    with sm.edit(H, fn=lambda x: (seen.append(x.shape), x)[1]):
        sm.forward(PROMPTS)
    assert seen and seen[0][0] == 2 and seen[0][2] == sm.d_model
    # edit only the last prompt token: earlier positions unchanged, last one changed
    with sm.edit(H, add=u * 50, positions="last"):
        last = sm.forward(PROMPTS)
    assert torch.equal(last[:, :-1], base[:, :-1]) and not torch.allclose(last[:, -1], base[:, -1])


def module_hooks(model):
    return {name: (len(m._forward_hooks), len(m._forward_pre_hooks)) for name, m in model.named_modules()}


def test_exception_inside_scope_restores_hook_count(sm):
    hidden_states(sm, sm.tokenize(PROMPTS[:1]))  # transformers installs its own capture hooks once
    per_module = module_hooks(sm.model)
    before = sm.hook_count()
    with pytest.raises(RuntimeError, match="boom"):
        with sm.edit([H, "blocks.3.hook_resid_mid"], add=torch.ones(sm.d_model)):
            with sm.record(steerkit.resid_post(range(sm.n_layers))):
                assert sm.hook_count() > before
                raise RuntimeError("boom")
    assert sm.hook_count() == before
    assert module_hooks(sm.model) == per_module
    # a failure half-way through registration leaves nothing behind
    with pytest.raises(InputError):
        sm.edit({H: torch.ones(sm.d_model), "blocks.2.hook_resid_pre": torch.ones(7)}, op="add")
    assert sm.hook_count() == before
    h = sm.edit(H, add=torch.ones(sm.d_model))
    h2 = sm.edit(H, add=torch.ones(sm.d_model))
    h.remove()
    h.remove()  # idempotent
    assert sm.hook_count() == before + 1
    sm.reset()
    assert sm.hook_count() == before and not h2.active
    assert module_hooks(sm.model) == per_module


@pytest.mark.parametrize("kwargs,match", [
    (dict(hooks="blocks.15.hook_resid_side", add=torch.zeros(576)), "expected a hook name"),
    (dict(hooks="blocks.30.hook_resid_post", add=torch.zeros(576)), "expected a layer in 0..29"),
    (dict(hooks=H, add=torch.zeros(512)), r"expected the add vector of shape \[576\]"),
    (dict(hooks=H, add=torch.tensor([float("nan")] * 576)), "NaN/inf"),
    (dict(hooks=H, add=torch.tensor([float("inf")] + [0.0] * 575)), "NaN/inf"),
    (dict(hooks=H, ablate=torch.randn(2, 576)), "orthonormal"),
    (dict(hooks=H), "exactly one of"),
])
def test_bad_edits_raise_and_leave_nothing(sm, kwargs, match):
    before = sm.hook_count()
    with pytest.raises((InputError, HookNameError), match=match):
        sm.edit(**kwargs)
    assert sm.hook_count() == before and not sm.hooks.handles


def test_bad_prompts(sm):
    before = sm.hook_count()
    with sm.record([H]):
        with pytest.raises(InputError, match="at least one prompt"):
            sm.forward([])
        with pytest.raises(InputError, match="at most 8192 tokens"):
            sm.forward(["hello " * 9000])
        for bad in (None, 3, b"hi"):
            with pytest.raises(InputError, match="expected a prompt string"):
                sm.forward(bad)
            with pytest.raises(InputError, match="expected a prompt string"):
                sm.tokenize(bad)
    assert sm.hook_count() == before
    with pytest.raises(HookNameError, match="expected a layer in 0..29 .* found -1"):
        with sm.record(["blocks.-1.hook_resid_post"]):
            pass
    with pytest.raises(InputError, match="positions"):
        with sm.record([H], positions="middle"):
            pass
    assert sm.hook_count() == before


def test_model_is_freed_after_delete():
    sm2 = steerkit.load_model()
    ref = weakref.ref(sm2.model)
    with sm2.edit(H, add=torch.ones(sm2.d_model)), sm2.record([H]):
        sm2.forward(PROMPTS[:1])
    h = sm2.edit(H, add=torch.ones(sm2.d_model))  # even with a live hook
    del sm2, h
    gc.collect()
    assert ref() is None


def test_right_padding_positions_mean_real_tokens(sm):
    left = sm.tokenize(PROMPTS)
    ids, mask = left.input_ids, left.attention_mask
    # the same batch right-padded by hand
    r_ids, r_mask = torch.full_like(ids, sm.tokenizer.pad_token_id), torch.zeros_like(mask)
    for b in range(ids.shape[0]):
        real = ids[b][mask[b].bool()]
        r_ids[b, : len(real)] = real
        r_mask[b, : len(real)] = 1
    with sm.record([H], positions="last") as c_left, sm.record([H], positions=[0, 2, -1]) as i_left:
        sm.forward(left)
    with sm.record([H], positions="last") as c_right, sm.record([H], positions=[0, 2, -1]) as i_right:
        sm.forward(steerkit.Tokens(r_ids, r_mask))
    torch.testing.assert_close(c_left[H], c_right[H], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(i_left[H], i_right[H], atol=2e-4, rtol=1e-4)


def test_row_arena_keeps_copies_in_shared_blocks():
    """Recorded rows are copied into a few large blocks (see RowArena): values, not views of the
    activation; a new block starts when one is full; dtypes never share a block."""
    from steerkit.hooks.manager import RowArena

    arena = RowArena()
    arena.block_bytes = 4 * 1024  # 1024 float32 per block: forces block changes
    src = torch.arange(200, dtype=torch.float32).reshape(2, 100)
    rows = [arena.keep(src[:, :50] * k) for k in range(12)]  # 100 floats each: 10 per block
    src.zero_()
    for k, r in enumerate(rows):
        assert r.shape == (2, 50)
        torch.testing.assert_close(r, torch.arange(200, dtype=torch.float32).reshape(2, 100)[:, :50] * k)
    storages = {r.untyped_storage().data_ptr() for r in rows}
    assert len(storages) == 2  # 10 rows in the first block, 2 in the second
    idx = arena.keep(torch.tensor([3, 1, 2]))
    assert idx.dtype == torch.long and idx.tolist() == [3, 1, 2]
    assert idx.untyped_storage().data_ptr() not in storages
    big = torch.ones(4096)  # a quarter block or more: kept as its own tensor
    assert arena.keep(big) is big


def test_range_positions_are_their_indices_and_slices_are_slices():
    """range(-2, 0) means the last two real prompt tokens (as [-2, -1]), not the empty slice(-2, 0)."""
    from steerkit.hooks.positions import RunState, chunk_mask

    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])  # row 0 left-padded
    run = RunState(mask)

    def sel(spec):
        return chunk_mask(spec, run, 0, 5, 2, "cpu").nonzero().tolist()
    last2 = [[0, 3], [0, 4], [1, 3], [1, 4]]
    assert sel(range(-2, 0)) == sel([-2, -1]) == sel(slice(-2, None)) == last2
    assert sel(range(0, 2)) == sel([0, 1]) == sel(slice(0, 2)) == [[0, 1], [0, 2], [1, 0], [1, 1]]
    assert sel(slice(-1, 0)) == []  # a slice keeps Python's meaning


def test_index_positions_no_row_has_are_an_error_and_short_rows_warn():
    """An index no prompt of the batch has is an error naming the valid range and the prompt lengths;
    one that only the longer prompts have selects nothing in the shorter rows, with a warning."""
    from steerkit.hooks.positions import PositionRangeWarning, RunState, chunk_mask

    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])  # 4 and 5 real tokens
    for spec in ([99999], [5], [-6], range(100, 200), [0, 7]):
        with pytest.raises(InputError, match=r"expected token positions in \[-5, 4\].*prompt lengths in tokens: "
                                             r"\[4, 5\]"):
            chunk_mask(spec, RunState(mask, check_positions=True), 0, 5, 2, "cpu")
    run = RunState(mask, check_positions=True)
    with pytest.warns(PositionRangeWarning, match=r"\[4\] lie beyond the shorter prompts"):
        got = chunk_mask([4], run, 0, 5, 2, "cpu")
    assert got.nonzero().tolist() == [[1, 4]]  # the 4-token row has no index 4
    with pytest.warns(PositionRangeWarning, match=r"\[-5\] lie beyond"):
        got = chunk_mask([-5, 0], RunState(mask, check_positions=True), 0, 5, 2, "cpu")
    assert got.nonzero().tolist() == [[0, 1], [1, 0]]
    # without the check (a server's per-request masks): an index no row has selects nothing
    assert not chunk_mask([99999], RunState(mask), 0, 5, 2, "cpu").any()
    # decoding steps never check again (and select nothing: indices are prompt tokens)
    assert not chunk_mask([99999], run, 5, 1, 2, "cpu").any()


def test_out_of_range_positions_fail_the_forward_for_records_and_edits(sm):
    before = sm.hook_count()
    n = int(sm.tokenize(PROMPTS[0]).attention_mask.sum())
    for spec in ([99999], range(100, 200)):
        with sm.record([H], positions=spec):
            with pytest.raises(InputError, match=rf"\[-{n}, {n - 1}\].*prompt lengths in tokens: \[{n}\]"):
                sm.forward(PROMPTS[0])
        with sm.edit(H, add=torch.ones(sm.d_model), positions=spec):
            with pytest.raises(InputError, match="no prompt of this batch has"):
                sm.forward(PROMPTS[0])
    with pytest.raises(InputError, match="no prompt of this batch has"):
        sm.generate(PROMPTS[0], 2, steering=steerkit.Intervention.add(H, torch.ones(sm.d_model), positions=[999]))
    assert sm.hook_count() == before


def test_generated_positions_recorded_by_forward_passes_only_is_an_error(sm):
    with sm.record([H], positions="generated") as cache:
        sm.forward(PROMPTS)
    with pytest.raises(InputError, match="positions='generated'.*only forward passes ran"):
        cache[H]


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=float("nan")), "temperature as a finite number"),
    (dict(do_sample=True, temperature=0.0), r"temperature > 0 when sampling"),
    (dict(do_sample=True, temperature=-1.0), r"temperature > 0 when sampling"),
    (dict(top_p=0.0), r"top_p in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p in \(0, 1\]"),
    (dict(top_p=float("nan")), r"top_p in \(0, 1\]"),
    (dict(top_k=-1), "top_k as an integer >= 0"),
    (dict(top_k=2.5), "top_k as an integer >= 0"),
    (dict(max_new_tokens=True), "max_new_tokens as an integer >= 1, found bool"),
    (dict(max_new_tokens=-3), "max_new_tokens >= 1, found -3"),
    (dict(max_new_tokens=10 ** 9), r"max_new_tokens <= 8192 \(the model's context\)"),
    (dict(seed="7"), "seed as an integer or None, found str"),
    (dict(seed=1.5), "seed as an integer or None, found float"),
    (dict(do_sample="yes"), "do_sample as True or False"),
    (dict(stop=[""]), "non-empty strings"),
    (dict(stream=5), "stream as a callable"),
])
def test_bad_generate_arguments(sm, kwargs, match):
    with pytest.raises(InputError, match=match):
        sm.generate(PROMPTS[0], **{"max_new_tokens": 2, **kwargs})
    with pytest.raises(InputError, match=match):  # checked before any steering is compiled
        sm.generate(PROMPTS[0], **{"max_new_tokens": 2, **kwargs}, steering=steerkit.Intervention.add(
            H, torch.ones(sm.d_model)))


def test_generate_without_prompts(sm):
    for bad in (None, 3, b"bytes"):
        with pytest.raises(InputError, match="expected a prompt string or a list of prompt strings"):
            sm.generate(bad, 2)
    with pytest.raises(InputError, match="found None"):
        steerkit.continue_thinking(sm, None)
    assert sm.generate(PROMPTS[0], 3, stop="\n") == sm.generate(PROMPTS[0], 3, stop=["\n"])  # one stop string
