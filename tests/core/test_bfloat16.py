"""The model-level equalities in bfloat16, on the real default model (``load_model(dtype="bfloat16")``, this CPU).

What each comparison may differ by, and why. bfloat16 keeps 8 significant bits: between 16 and 32 its spacing
is 0.125, between 32 and 64 it is 0.25, and this model's logits reach about 40. Float32 runs of the same
comparisons are in test_core.py, test_steering.py, test_adapters.py and test_patching.py.

- A recording is the value the block returned, and per-row steering of a batch equals each row steered
  alone: the same operations on the same values, so equal to the last bit (measured 0).
- A steering equals an independent forward hook that adds the same vector in float32 and rounds the
  sum to bfloat16 once, which is what steerkit's kernel does: equal to the last bit (measured 0). A hook
  that adds in bfloat16 rounds twice (the scaled vector, then the sum) and differs by up to 0.56 in the
  logits: not the reference.
- KV-cached generation vs one full forward pass over prompt + generated tokens (teacher forcing): the
  decoding steps multiply one row at a time and the prompt runs left-padded beside a longer one, so every
  layer rounds otherwise; the differences add up through 30 layers. Logits (the final norm's output
  through the unembedding in float32) agree within 2.5% of the largest logit (measured 0.79 of 39.7,
  2.0%; float32: 1e-5), and the greedy token agrees wherever the top two logits are further apart than
  that. Tokens are not compared where they are closer: a tie can flip.
- Activation patching (the packed prefix-reuse grid) equals its own full passes to the last bit
  (measured 0) and TransformerLens 4's ``get_act_patch_resid_pre`` on the bridge of the same bfloat16
  model within 0.25 logit units: the metric is the difference of two logits between 16 and 32 (spacing
  0.125) and TransformerLens runs eager attention, steerkit SDPA, so each may round a couple of spacings
  apart (measured 0.156; the float32 grids differ from the bfloat16 ones by 0.150).

Marked ``device``: ``STEERKIT_TEST_DEVICE=cuda`` runs them on a GPU (``scripts/gpu_check.sh``), on random
weights in the default model's configuration where the default model is not installed (the IOI figures are
then not asserted). The last-bit equalities were measured on this CPU; elsewhere the per-row and packed
comparisons allow what the KV comparison allows, since a GPU's matrix kernels may depend on the batch's shape.
"""
from __future__ import annotations

import pytest
import torch

import steerkit
from steerkit import Intervention
from steerkit.probes import activation_patching, logit_diff_metric

from tiny_models import TEST_DEVICE, default_or_random

pytestmark = [pytest.mark.slow, pytest.mark.device]
ON_CPU = torch.device(TEST_DEVICE).type == "cpu"

P = ["The capital of France is", "Write a haiku about autumn", "Name three colours.", "Hi"]
CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When John and Mary went to the store, Mary gave a drink to"


@pytest.fixture(scope="module")
def loaded():
    sm, real = default_or_random(TEST_DEVICE, torch.bfloat16)
    assert sm.dtype == torch.bfloat16 and sm.device.type == torch.device(TEST_DEVICE).type
    yield sm, real
    sm.reset()


@pytest.fixture(scope="module")
def bf(loaded):
    return loaded[0]


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Equal to the last bit on the CPU; elsewhere within the KV comparison's 2.5% of the largest value."""
    if ON_CPU:
        assert torch.equal(a, b), what
    else:
        tol = 0.025 * float(b.float().abs().max())
        assert float((a.float() - b.float()).abs().max()) <= tol, what


def _vec(sm, seed: int = 0) -> torch.Tensor:
    return torch.randn(sm.d_model, generator=torch.Generator().manual_seed(seed))


def test_record_is_the_blocks_output(bf):
    blocks = bf.adapter.block_list(bf.hf_model)
    got: dict = {}
    handles = [blocks[l].register_forward_hook(lambda m, i, o, l=l: got.__setitem__(l, o[0] if isinstance(o, tuple)
                                                                                    else o)) for l in (0, 15, 29)]
    try:
        with bf.record([f"blocks.{l}.hook_resid_post" for l in (0, 15, 29)], positions="all") as rec:
            bf.forward([P[0]])
    finally:
        for h in handles:
            h.remove()
    for l in (0, 15, 29):
        r = rec[f"blocks.{l}.hook_resid_post"]
        assert r.dtype == torch.bfloat16 and torch.equal(r, got[l].detach()), l


def test_steer_equals_an_independent_hook_that_rounds_once(bf):
    blocks, v, toks = bf.adapter.block_list(bf.hf_model), _vec(bf), bf.tokenize([P[0]])

    def add(m, i, o):
        x = o[0] if isinstance(o, tuple) else o
        y = (x.float() + 4.0 * v.to(x.device)).to(x.dtype)
        return (y,) + tuple(o[1:]) if isinstance(o, tuple) else y
    h = blocks[12].register_forward_hook(add)
    try:
        with torch.no_grad():
            want = bf.hf_model(input_ids=toks.input_ids.to(bf.device)).logits
    finally:
        h.remove()
    with bf.steer(Intervention.add("blocks.12.hook_resid_post", v, 4.0)):
        got = bf.forward(toks)
    _same(got, want, "steer vs an independent hook")
    assert not torch.equal(got, bf.forward(toks))  # the steering acts


def test_per_row_steering_equals_each_row_alone(bf):
    v = _vec(bf)
    specs = [[Intervention.add("blocks.12.hook_resid_post", v, 4.0)], None,
             [Intervention.add("blocks.5.hook_resid_pre", v, 2.0)], None]
    with bf.steer(rows=specs):
        batch = bf.forward(P)
    for i, (p, s) in enumerate(zip(P, specs)):
        if s is None:
            alone = bf.forward([p])
        else:
            with bf.steer(s):
                alone = bf.forward([p])
        _same(batch[i, -alone.shape[1]:], alone[0], f"row {i}")


def test_kv_cached_logits_equal_full_forward_logits(loaded):
    bf, real = loaded
    W = bf.hf_model.lm_head.weight.float().cpu()
    with bf.record(["ln_final.hook_out"], positions="all") as rec:
        out = bf.generate(P[:2], max_new_tokens=12, return_tokens=True, chat=True)
    toks = bf.tokenize(P[:2], chat=True)
    for b in range(2):
        prompt = toks.input_ids[b][toks.attention_mask[b].bool()].tolist()
        n = int(rec.lengths("ln_final.hook_out")[b])
        assert n == len(prompt) + len(out[b])  # the prompt, then each generated token (a recording feeds the last too)
        cached = rec["ln_final.hook_out"][b, :n].float().cpu() @ W.T
        with bf.record(["ln_final.hook_out"], positions="all") as full_rec:
            bf.forward(bf.pad([prompt + list(out[b])]))
        full = full_rec["ln_final.hook_out"][0, :n].float().cpu() @ W.T
        tol = 0.025 * float(full.abs().max())
        err = float((cached - full).abs().max())
        assert err <= tol, f"row {b}: max |cached - full| = {err:.3g} > {tol:.3g}"
        top2 = full.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > tol
        assert bool(clear.any()) or not real  # random weights may leave no clear winner
        assert torch.equal(cached.argmax(-1)[clear], full.argmax(-1)[clear]), b


def test_patching_packed_equals_full_passes_and_transformer_lens(loaded):
    bf, real = loaded
    metric = logit_diff_metric(bf, " Mary", " John")
    layers = [0, 9, 18, 29]
    grid = activation_patching(bf, CLEAN, CORRUPTED, metric, "resid_pre", layers=layers, progress=False)
    full = activation_patching(bf, CLEAN, CORRUPTED, metric, "resid_pre", layers=layers, progress=False, reuse=False)
    if ON_CPU:
        assert torch.equal(grid.values, full.values)
    else:  # the grid is a logit difference: the KV comparison's bound on two logits of up to about 40
        assert float((grid.values - full.values).abs().max()) <= 2.0
    if not real:
        return  # random weights: no IOI, and no TransformerLens on the GPU check's machine
    assert grid.clean_metric > 3 and grid.corrupted_metric < -3  # the model still does IOI in bfloat16
    pd = pytest.importorskip("pandas")
    pytest.importorskip("transformer_lens")
    from transformer_lens import patching

    other = steerkit.load_model(dtype="bfloat16", device=TEST_DEVICE)  # the bridge changes the model it wraps
    bridge = steerkit.wrap(other.hf_model, other.tokenizer, name=other.name, backend="tlens").backend.bridge
    clean, corrupted = other.tokenize([CLEAN]).input_ids, other.tokenize([CORRUPTED]).input_ids
    cells = [(0, p) for p in range(clean.shape[1])] + [(l, p) for l in layers[1:] for p in (1, 3, 9, 13)]
    with torch.inference_mode():
        _, cache = bridge.run_with_cache(clean)
        theirs = patching.get_act_patch_resid_pre(bridge, corrupted, cache, metric, index_axis_names=None,
                                                  index_df=pd.DataFrame(cells, columns=["layer", "pos"]))
    ours = torch.stack([grid.values[layers.index(l), p] for l, p in cells])
    err = float((ours - theirs.cpu().float()).abs().max())
    assert err <= 0.25, f"max |steerkit - TransformerLens| in bfloat16 = {err:.3g}"
