"""Models larger than memory: accelerate's big-model loading with disk offload (``load_model(...,
device_map=, max_memory=, offload_folder=)``). A tiny model saved to a folder is loaded with a
``max_memory`` smaller than its weights, so most blocks stay on disk (meta tensors in the model, read
for each forward pass); every hook, recording and steering must give what the in-memory model gives,
bit for bit (the same computation on the same CPU)."""
from __future__ import annotations

import pytest
import torch

import steerkit
from steerkit import Intervention
from steerkit.errors import InputError
from steerkit.model import Tokens

from tiny_models import tiny_model


@pytest.fixture(scope="module")
def pair(scratch):
    folder = scratch("tiny-llama")
    model, tok = tiny_model("llama", num_hidden_layers=4, attn_implementation="sdpa")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    mem = steerkit.load_model(folder)
    off = steerkit.load_model(folder, device_map="auto", max_memory={"cpu": weights // 3},
                              offload_folder=scratch("offload"))
    return mem, off


def test_most_weights_stay_on_disk(pair):
    mem, off = pair
    placed = set(off.hf_model.hf_device_map.values())
    assert "disk" in placed
    n_meta = sum(p.numel() for p in off.hf_model.parameters() if p.device.type == "meta")
    assert n_meta > 0.5 * sum(p.numel() for p in off.hf_model.parameters())
    assert off.device == torch.device("cpu")
    assert off.fingerprint() == mem.fingerprint()


def test_offloaded_model_records_and_steers_as_in_memory(pair):
    mem, off = pair
    toks = Tokens(torch.randint(4, 100, (2, 8), generator=torch.Generator().manual_seed(0)), torch.ones(2, 8).long())
    v = torch.randn(64, generator=torch.Generator().manual_seed(1))
    sites = ["blocks.2.hook_resid_post", "blocks.3.attn.hook_z", "blocks.3.attn.hook_pattern"]

    def run(sm):
        with sm.edit("blocks.1.hook_resid_post", add=v, scale=2.0), \
                sm.steer(Intervention.replace("blocks.2.attn.hook_z", torch.zeros(16), heads=[1])), \
                sm.record(sites) as c:
            logits = sm.forward(toks)
        return logits, c, sm.generate(toks, max_new_tokens=4, return_tokens=True, steering=Intervention.add(
            "blocks.1.hook_resid_post", v, 2.0))
    a, ca, ga = run(mem)
    b, cb, gb = run(off)
    assert torch.equal(a, b)
    for s in sites:
        assert torch.equal(ca[s], cb[s]), s
    assert ga == gb
    assert not torch.equal(a, mem.forward(toks))  # the steering acts
    assert off.hook_count() == 0


def test_big_model_options_need_a_device_map(tmp_path):
    with pytest.raises(InputError, match="device_map"):
        steerkit.load_model(None, max_memory={"cpu": "1GiB"})
