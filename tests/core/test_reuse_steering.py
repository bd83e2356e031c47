"""Steering added at one layer starts from the unsteered run there (:mod:`steerkit.reuse`): generation from a
cached prompt pass (:func:`steerkit.generation.generate_from`), the tuning grid (:func:`steerkit.probes.tune`)
and the refusal search's induce scores (:func:`~steerkit.probes.methods.refusal.select_direction`) give what
full passes give, and backends that cannot run a range of blocks keep full passes.
"""
from __future__ import annotations

import importlib
import math

import pytest
import torch

import steerkit
from steerkit.errors import InputError
from steerkit.generation import generate_from
from steerkit.probes.methods import refusal as R
from steerkit.probes.methods.refusal import select as select_mod
from steerkit.reuse import run_cached, supports_run_from
from steerkit.vectors import DirectionSet, SteeringVector

from refusal_checks import same_tables, steer_rows_spy
from tiny_models import tiny_model

tune_mod = importlib.import_module("steerkit.probes.tune")  # the module (steerkit.probes.tune is also the function)

PROMPTS = ["hello there", "how do I bake bread?", "x", "tell me a story about a cat"]


def _tiny(arch="llama", layers=4, seed=0):
    kw = dict(n_layer=layers) if arch == "gpt2" else dict(num_hidden_layers=layers)
    if arch == "gemma3_text":
        kw["layer_types"] = ["sliding_attention", "full_attention"] * (layers // 2)
    model, tok = tiny_model(arch, seed=seed, **kw)
    return steerkit.wrap(model, tok, name=f"tiny-{arch}")


def _block_starts(monkeypatch, sm) -> list[int]:
    """The first block of every pass that runs a range of blocks on ``sm``."""
    starts: list[int] = []
    real = sm.backend.run_blocks

    def spy(input_ids, attention_mask, position_ids, cache, first, resid, keep=0):
        starts.append(int(first))
        return real(input_ids, attention_mask, position_ids, cache, first, resid, keep=keep)
    monkeypatch.setattr(sm.backend, "run_blocks", spy)
    return starts


class _NoBlockRange:
    """A backend that runs only full passes (as TransformerLens and nnsight do): everything but run_blocks."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        if name == "run_blocks":
            raise AttributeError(name)
        return getattr(self._inner, name)


# --------------------------------------------------------------------------- generation from a cached prompt pass
@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt2"])
def test_generate_from_equals_generate_with_the_same_steering(arch):
    """A steering at the start block: the tokens, and the recordings at that block and later, equal plain
    ``sm.generate``; sites below the start block record the generated positions only."""
    sm = _tiny(arch)
    toks = sm.tokenize(["Hi", "Tell me a joke please", "abc"])
    rc = run_cached(sm, toks)
    rows = [0, 1, 2, 1]
    ids = [toks.input_ids[i][toks.attention_mask[i].bool()].tolist() for i in rows]
    torch.manual_seed(0)
    add = steerkit.Intervention.add("blocks.2.hook_resid_pre", torch.randn(64), 4.0)
    later = ["blocks.2.hook_resid_post", "blocks.3.attn.hook_z", "blocks.3.hook_mlp_out"]
    below = "blocks.1.hook_resid_post"
    with sm.steer(add), sm.record(later + [below]) as got:
        fast = generate_from(sm, "blocks.2.hook_resid_pre", rc, rows, max_new_tokens=6, return_tokens=True)
    with sm.record(later + [below]) as want:
        full = sm.generate(sm.pad(ids), max_new_tokens=6, steering=add, return_tokens=True)
    assert fast == full
    for name in later:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5)
        assert torch.equal(got.positions(name), want.positions(name))
    P = toks.input_ids.shape[1]
    assert got.positions(below).min() >= P  # (the prompt never ran below block 2)
    assert sm.hook_count() == 0


def test_generate_from_per_row_steering_text_and_sampling():
    """Per-row steerings, text output with a stop string and seeded sampling equal ``sm.generate``'s."""
    sm = _tiny("llama")
    toks = sm.tokenize(PROMPTS)
    rc = run_cached(sm, toks)
    torch.manual_seed(1)
    adds = [[steerkit.Intervention.add(f"blocks.{l}.hook_resid_post", torch.randn(64), 6.0)] for l in (1, 3)]
    steer = [adds[0], None, adds[1], adds[0]]
    kw = dict(max_new_tokens=5, do_sample=True, temperature=0.8, top_k=20, seed=3, stop=["e"])
    with sm.steer(rows=steer):
        fast = generate_from(sm, 1, rc, **kw)
    assert fast == sm.generate(toks, steer_rows=steer, **kw)


def test_generate_from_refuses_what_it_cannot_run():
    sm, other = _tiny("llama"), _tiny("llama", seed=1)
    rc = run_cached(sm, ["hi"])
    with pytest.raises(InputError, match="RunCache made by this model"):
        generate_from(other, 1, rc)
    with pytest.raises(InputError, match="RunCache"):
        generate_from(sm, 1, "hi")
    with pytest.raises(InputError, match="block index"):
        generate_from(sm, 7, rc)
    with pytest.raises(InputError, match="rows"):
        generate_from(sm, 1, rc, [3])
    sm.backend = _NoBlockRange(sm.backend)
    with pytest.raises(InputError, match="'hf' backend"):
        generate_from(sm, 1, rc)


# --------------------------------------------------------------------------- the tuning grid
def _same_tune(a, b, tol=1e-5):
    assert [(c["layer"], c["scale"]) for c in a.cells] == [(c["layer"], c["scale"]) for c in b.cells]
    assert a.baseline["generations"] == b.baseline["generations"]
    for x, y in zip(a.cells, b.cells):
        assert x["generations"] == y["generations"], (x["layer"], x["scale"])
        assert x["scores"] == y["scores"] and x["pareto"] == y["pareto"]
        for k in ("kl", "perplexity", "ppl_ratio", "concept", "repetition"):
            u, v = x[k], y[k]
            assert (u is None) == (v is None), k
            if u is not None:
                assert abs(u - v) <= tol * max(1.0, abs(v)), (k, u, v)
    assert a.recommended == b.recommended


ARTIFACTS = {
    "tensor": lambda sm: torch.randn(sm.d_model),  # added at hook_resid_post
    "vector": lambda sm: SteeringVector.from_direction(torch.randn(sm.d_model), 0, sm, hook_site="hook_resid_pre"),
}


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("batch_size", [64, 3])  # 3: several prompt groups, calls that mix layers
@pytest.mark.parametrize("kind", ["tensor", "vector"])
def test_tune_with_reuse_equals_full_passes(monkeypatch, batched, batch_size, kind):
    sm = _tiny("llama")
    torch.manual_seed(0)
    art = ARTIFACTS[kind](sm)
    kw = dict(layers=[3, 1, 2], scales=[0, 4, 16], concept=["e"], neutral=["Hello", "What is up", "x"],
              max_new_tokens=5, n_boot=20, progress=False, batched=batched, batch_size=batch_size)
    starts = _block_starts(monkeypatch, sm)
    fast = tune_mod.tune(sm, art, PROMPTS, reuse=True, **kw)
    if batched and batch_size == 64:  # one generate call and one KL pass, from the lowest grid layer
        assert starts == [1, 1]
    else:  # calls of one cell (or of a few, layer by layer): from the cells' layers
        assert set(starts) == {1, 2, 3}
    starts.clear()
    full = tune_mod.tune(sm, art, PROMPTS, reuse=False, **kw)
    assert starts == []
    _same_tune(fast, full)
    assert fast.settings == full.settings
    assert sm.hook_count() == 0


def test_tune_ablation_grid_with_reuse_equals_full_passes(monkeypatch):
    """A direction set ablated at one layer per cell also starts there."""
    sm = _tiny("llama")
    torch.manual_seed(2)
    ds = DirectionSet.from_directions(torch.randn(2, sm.d_model), sm)
    kw = dict(layers=[1, 2], scales=[0.0, 1.0], concept=["e"], neutral=["Hello", "x"], max_new_tokens=4,
              n_boot=20, progress=False, batched=False)
    starts = _block_starts(monkeypatch, sm)
    fast = tune_mod.tune(sm, ds, PROMPTS[:2], reuse=True, **kw)
    assert set(starts) == {1, 2, 3}  # the cells' layers; the baseline's prompt pass runs the last block only
    _same_tune(fast, tune_mod.tune(sm, ds, PROMPTS[:2], reuse=False, **kw))


def test_tune_keeps_full_passes_without_a_block_range_or_with_other_hooks(monkeypatch):
    """A backend without run_blocks (TransformerLens / nnsight) and a model with other hooks on it run full
    passes, with the same result."""
    sm = _tiny("llama")
    torch.manual_seed(0)
    v = torch.randn(sm.d_model)
    kw = dict(layers=[1, 2], scales=[0, 8], concept=["e"], neutral=["Hello"], max_new_tokens=3, n_boot=20,
              progress=False)
    ref = tune_mod.tune(sm, v, PROMPTS[:2], reuse=False, **kw)

    def no_cache(*a, **k):
        raise AssertionError("expected full passes, found run_cached called")
    monkeypatch.setattr(tune_mod, "run_cached", no_cache)
    with sm.record("blocks.0.hook_resid_post"):  # another hook: full passes
        _same_tune(tune_mod.tune(sm, v, PROMPTS[:2], **kw), ref)
    inner = sm.backend
    monkeypatch.setattr(sm, "backend", _NoBlockRange(inner))
    assert not supports_run_from(sm)
    _same_tune(tune_mod.tune(sm, v, PROMPTS[:2], **kw), ref)


def test_tune_on_nnsight_keeps_full_passes(monkeypatch):
    pytest.importorskip("nnsight")
    model, tok = tiny_model("llama", num_hidden_layers=3)
    hf = steerkit.wrap(model, tok, name="tiny-llama")
    nns = steerkit.wrap(model, tok, name="tiny-llama", backend="nnsight")
    assert supports_run_from(hf) and not supports_run_from(nns)
    torch.manual_seed(0)
    v = torch.randn(hf.d_model)
    kw = dict(layers=[1, 2], scales=[0, 8], concept=["e"], neutral=["Hello"], max_new_tokens=3, n_boot=20,
              progress=False)
    calls = []
    real = tune_mod.run_cached
    monkeypatch.setattr(tune_mod, "run_cached", lambda sm, *a, **k: calls.append(sm) or real(sm, *a, **k))
    a, b = tune_mod.tune(hf, v, PROMPTS[:2], **kw), tune_mod.tune(nns, v, PROMPTS[:2], **kw)
    assert calls and all(c is hf for c in calls)
    _same_tune(a, b)


# --------------------------------------------------------------------------- the refusal search
@pytest.mark.parametrize("lazy", [True, False])
@pytest.mark.parametrize("batched,batch_size", [(True, 4), (True, 16), (False, 3)])
@pytest.mark.parametrize("rule", ["paper", "relative"])
def test_refusal_selection_with_reuse_equals_full_passes(monkeypatch, lazy, batched, batch_size, rule):
    """The induce passes start at their candidates' layers; the table, statuses and selection equal full
    passes'."""
    sm = _tiny("llama", layers=5)
    torch.manual_seed(0 if rule == "paper" else 1)
    cands = torch.randn(2, sm.n_layers, sm.d_model) * (0.5 if rule == "paper" else 2.0)
    cands[0, 1] = 0.0
    ids = R.refusal_token_ids(sm.tokenizer, ["I", "A"])
    kw = dict(kl_max=1e9, induce_min=-1e9 if rule == "paper" else 1e9, lazy=lazy, batch_size=batch_size,
              batched=batched)
    starts = _block_starts(monkeypatch, sm)
    fast = R.select_direction(sm, cands, [-2, -1], PROMPTS[:3], PROMPTS[1:], ids, reuse=True, **kw)
    n_induce = sum(not math.isnan(c.induce) for c in fast.table)
    assert n_induce and starts and set(starts) <= {c.layer for c in fast.table if not math.isnan(c.induce)}
    starts.clear()
    full = R.select_direction(sm, cands, [-2, -1], PROMPTS[:3], PROMPTS[1:], ids, reuse=False, **kw)
    assert starts == []
    assert fast.rule == rule
    same_tables(fast, full)
    assert sm.hook_count() == 0


def test_refusal_induce_passes_only_start_late_and_keep_their_count(monkeypatch):
    """Bypass and KL (an ablation at every layer) run the whole model; the induce rows go after them, layer
    by layer, in as many passes of as many rows as before."""
    sm = _tiny("llama", layers=5)
    torch.manual_seed(0)
    cands = torch.randn(2, sm.n_layers, sm.d_model)
    ids = R.refusal_token_ids(sm.tokenizer, ["I", "A"])
    calls = steer_rows_spy(monkeypatch, sm)
    starts = _block_starts(monkeypatch, sm)
    n_rows = 2 * 4 * 2 * 3  # 2 positions x 4 unpruned layers x 2 prompts x (bypass, KL, induce)
    for per_pass in (8, 24):
        calls.clear()
        starts.clear()
        R.select_direction(sm, cands, [-2, -1], PROMPTS[:2], PROMPTS[2:], ids, kl_max=1e9, induce_min=-1e9,
                           lazy=False, batch_size=8, batched=True, rows=per_pass)
        assert sum(calls) == n_rows and len(calls) == -(-n_rows // per_pass)
        n_from = n_rows // 3 // per_pass  # the induce-only passes (the last mixed one runs the whole model)
        assert len(starts) == n_from
    assert starts == []  # 24 rows a pass: the 16 induce rows share a pass with 8 KL rows


def test_refusal_selection_keeps_full_passes_without_a_block_range(monkeypatch):
    sm = _tiny("llama", layers=5)
    torch.manual_seed(0)
    cands = torch.randn(2, sm.n_layers, sm.d_model) * 0.5
    ids = R.refusal_token_ids(sm.tokenizer, ["I", "A"])
    kw = dict(kl_max=1e9, induce_min=-1e9, lazy=False)
    ref = R.select_direction(sm, cands, [-2, -1], PROMPTS[:2], PROMPTS[2:], ids, reuse=False, **kw)
    monkeypatch.setattr(select_mod, "run_cached", lambda *a, **k: pytest.fail("expected full passes"))
    monkeypatch.setattr(sm, "backend", _NoBlockRange(sm.backend))
    same_tables(R.select_direction(sm, cands, [-2, -1], PROMPTS[:2], PROMPTS[2:], ids, **kw), ref)
    with pytest.raises(InputError, match="reuse"):
        R.select_direction(sm, cands, [-2, -1], PROMPTS[:2], PROMPTS[2:], ids, reuse="yes", **kw)


# --------------------------------------------------------------------------- the default model
@pytest.mark.slow
def test_generate_from_and_tune_on_default_model(sm, monkeypatch):
    """The default model in float32 (30 blocks): chat prompts generated from a cached prompt pass equal
    ``sm.generate``, and a small tune grid with reuse equals full passes."""
    prompts = ["What is the capital of France?", "Name a color."]
    toks = sm.tokenize(prompts, chat=True)
    rc = run_cached(sm, toks)
    torch.manual_seed(0)
    add = steerkit.Intervention.add("blocks.12.hook_resid_post", torch.randn(sm.d_model), 6.0)
    with sm.steer(add):
        fast = generate_from(sm, 12, rc, max_new_tokens=8, return_tokens=True)
    assert fast == sm.generate(toks, max_new_tokens=8, steering=add, return_tokens=True)
    v = torch.randn(sm.d_model)
    kw = dict(layers=[10, 20], scales=[0, 4], concept=["Paris"], neutral=["Hello"], max_new_tokens=4,
              n_boot=20, progress=False, normalize="unit", batch_size=4)
    starts = _block_starts(monkeypatch, sm)
    a = tune_mod.tune(sm, v, prompts, **kw)
    assert set(starts) == {10, 20}
    _same_tune(a, tune_mod.tune(sm, v, prompts, reuse=False, **kw), tol=1e-4)


@pytest.mark.slow
def test_refusal_selection_with_reuse_on_default_model(sm, monkeypatch):
    """The default model, chat-template prompts of several lengths (padding), 2 positions x 2 layers: the
    induce passes start at the candidates' layers and the table equals full passes'."""
    data = R.sample_splits(4, 3, 1, seed=0)
    ids = R.refusal_token_ids(sm.tokenizer)
    positions = R.post_instruction_positions(sm)[0][-2:]
    acts = {k: R.record_resid_pre(sm, data["train"][k], positions, None)[0] for k in ("harmful", "harmless")}
    cands = R.mean_diff(acts["harmful"], acts["harmless"])
    args = (sm, cands, positions, data["val"]["harmful"], data["val"]["harmless"], ids)
    kw = dict(layers=[6, 14], batch_size=4, kl_max=1e9, induce_min=-1e9, lazy=False, rows=6)
    starts = _block_starts(monkeypatch, sm)
    fast = R.select_direction(*args, **kw)
    assert set(starts) == {6, 14}
    same_tables(fast, R.select_direction(*args, reuse=False, **kw), tol=1e-4)
