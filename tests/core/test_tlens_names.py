"""steerkit's hook names carry TransformerLens's values: every name recorded by the HF backend equals
the value TransformerLens 4's ``TransformerBridge.run_with_cache`` stores under that name, on the real
default model and the same token ids.

Names and their TransformerLens keys (the bridge keeps aliases; the first it has is used):
``blocks.{l}.hook_resid_pre`` / ``hook_resid_mid`` / ``hook_resid_post`` / ``hook_attn_out`` /
``hook_mlp_out`` under the same names (``hook_in`` / ``ln2.hook_in`` / ``hook_out`` /
``attn.hook_out`` / ``mlp.hook_out``), and the final norm's ``ln_final.hook_scale`` (its scale,
``[batch, pos, 1]``), ``ln_final.hook_normalized`` (the normalised stream before its weight) and
``ln_final.hook_out`` (its output) under the same three names.

Tolerance: the bridge runs eager attention and the HF backend SDPA (another summation order):
|a - b| <= 1e-4 * max|b| per tensor, with max|b| up to ~4400 on this model's massive-activation
dimension (measured: 2.3e-6 relative at worst).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformer_lens")

import steerkit  # noqa: E402
from steerkit.hooks.names import FINAL_HOOKS  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.backends]

TL_KEYS = {
    "hook_resid_pre": ("blocks.{l}.hook_resid_pre", "blocks.{l}.hook_in"),
    "hook_resid_mid": ("blocks.{l}.hook_resid_mid", "blocks.{l}.ln2.hook_in"),
    "hook_resid_post": ("blocks.{l}.hook_resid_post", "blocks.{l}.hook_out"),
    "hook_attn_out": ("blocks.{l}.hook_attn_out", "blocks.{l}.attn.hook_out"),
    "hook_mlp_out": ("blocks.{l}.hook_mlp_out", "blocks.{l}.mlp.hook_out"),
}


@pytest.fixture(scope="module")
def bridge(default_model):
    tl = steerkit.wrap(default_model.hf_model, default_model.tokenizer, name=default_model.name, backend="tlens")
    return tl.backend.bridge


def _tl_value(cache, kind: str, layer: int):
    for key in TL_KEYS[kind]:
        k = key.format(l=layer)
        if k in cache:
            return cache[k]
    raise KeyError(f"none of {TL_KEYS[kind]} in TransformerLens's cache for layer {layer}")


def test_every_hook_name_equals_run_with_cache(default_model, bridge):
    sm = default_model
    toks = sm.tokenize(["When Mary and John went to the store, John gave a drink to"], chat=False)
    names = sm.hook_names()
    assert len(names) == 5 * sm.n_layers + 3
    assert names[-3:] == list(FINAL_HOOKS)
    with sm.record(names, positions="all") as ours:
        sm.forward(toks)
    with torch.inference_mode():
        _, cache = bridge.run_with_cache(toks.input_ids)
    checked = 0
    for name in names:
        site = sm.hooks.parse(name)
        theirs = cache[name] if name in FINAL_HOOKS else _tl_value(cache, site.kind, site.layer)
        mine = ours[name]
        assert mine.shape == theirs.shape, (name, tuple(mine.shape), tuple(theirs.shape))
        scale = float(theirs.abs().max())
        err = float((mine - theirs.to(mine.dtype)).abs().max())
        assert err <= 1e-4 * scale, f"{name}: max |steerkit - TransformerLens| = {err:.3g} (scale {scale:.3g})"
        checked += 1
    assert checked == len(names)


def test_every_component_hook_equals_run_with_cache(default_model, bridge):
    """Each block's attention, MLP and norm hooks (TransformerLens's names, shapes and values):
    ``attn.hook_q`` / ``hook_k`` / ``hook_v`` / ``hook_z`` per head, ``hook_attn_scores`` (the dtype's
    lowest value where a query does not attend, as the bridge stores it) and ``hook_pattern``,
    ``mlp.hook_in`` / ``hook_pre`` / ``hook_post``, ``ln1`` / ``ln2`` ``.hook_scale`` / ``.hook_normalized``.
    While pattern hooks are registered the HF model computes attention eagerly, as the bridge
    does, so the values agree to float32 rounding."""
    sm = default_model
    toks = sm.tokenize(["When Mary and John went to the store, John gave a drink to"], chat=False)
    names = [n for n in sm.hook_names(components=True) if n not in sm.hook_names()]
    assert len(names) == 13 * sm.n_layers  # mlp.hook_in included
    with sm.record(names, positions="all") as ours:
        sm.forward(toks)
    with torch.inference_mode():
        _, cache = bridge.run_with_cache(toks.input_ids)
    for name in names:
        mine, theirs = ours[name], cache[name].to(torch.float32)
        assert mine.shape == theirs.shape, (name, tuple(mine.shape), tuple(theirs.shape))
        fin = theirs > torch.finfo(theirs.dtype).min / 2
        assert torch.equal(fin, mine > torch.finfo(mine.dtype).min / 2), name
        scale = float(theirs[fin].abs().max())
        err = float((mine[fin] - theirs[fin]).abs().max())
        assert err <= 1e-4 * scale, f"{name}: max |steerkit - TransformerLens| = {err:.3g} (scale {scale:.3g})"
