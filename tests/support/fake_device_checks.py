"""No library call moves the model or a tensor to the CPU behind the caller's back.

A tiny Llama runs on a fake accelerator (``tests/support/fake_device.py``: PyTorch's PrivateUse1 backend set up for
Python, computing on the CPU and logging every value that comes back to the host). The same weights on the
CPU give the reference, so every result is also compared exactly. What may come back, and why:

* the model fingerprint's few sampled weights (at most 16,384 values a tensor, once per model: hashing);
* position bookkeeping (integer indices of recorded rows and positions) and one boolean per site and
  step that says whether a steering applies at all (it skips the kernel when nothing does);
* one copy of the sampled tokens per decoding step (to decode them): never one read per row;
* recorded activations where the caller asked for them on the CPU (``device="cpu"``, a dataset on disk):
  one copy per site per forward pass, however many rows the batch has.

Nothing else: no floating-point activation, logit or weight, and the weights stay on the device.

These checks run in a process of their own (``tests/core/test_fake_device.py`` starts it): registering the fake
device makes ``torch.accelerator`` report it, which the rest of the suite must not see.
"""
from __future__ import annotations

import pytest
import torch

import steerkit
from steerkit.interventions import Intervention

import fake_device as F
from tiny_models import tiny_model

SITES = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_pre"]
PROMPTS = ["hello world", "a b c d", "the cat sat on", "x y", "one two three four five", "z"]
FINGERPRINT_SAMPLE = 16384


@pytest.fixture(scope="module")
def models():
    """``(sm on the fake device, the same weights on the CPU)``."""
    F.setup()
    m, tok = tiny_model("llama")
    ref, _ = tiny_model("llama")  # the same seed: the same weights
    sm = steerkit.wrap(F.to_fake(m), tok)
    return sm, steerkit.wrap(ref, tok)


def floats(log, but=()) -> list:
    """The floating-point values that came back to the host, less those from files named in ``but``."""
    return [t for t in log if t.dtype.is_floating_point and not any(t.called_from(b) for b in but)]


def weights_on_device(sm) -> bool:
    return all(isinstance(p, F.FakeGpuTensor) for p in sm.hf_model.parameters())


def test_fake_device_is_a_device(models):
    sm, _ = models
    assert sm.device.type == F.NAME and str(sm.hf_model.device).startswith(F.NAME)
    with F.Transfers() as log:
        fp = sm.fingerprint()
    assert fp == models[1].fingerprint()
    # hashing samples a few weights: small copies, nothing else
    assert log and all(t.called_from("fingerprint.py") and t.numel <= FINGERPRINT_SAMPLE for t in log)
    _ = sm.facts  # computed once per model (the fingerprint above, cached)


def test_record_stays_on_the_device(models):
    sm, ref = models
    with F.Transfers() as log:
        with sm.record(SITES) as rec:
            logits = sm.forward(PROMPTS)
    with ref.record(SITES) as want:
        ref_logits = ref.forward(PROMPTS)
    assert not floats(log), [t.where() for t in floats(log)]
    assert all(t.dtype in (torch.bool, torch.int64) for t in log)
    assert logits.device.type == F.NAME and torch.equal(F.host(logits), ref_logits)
    for s in SITES:
        got = rec[s]
        assert got.device.type == F.NAME, s
        assert torch.equal(F.host(got), want[s])
    assert weights_on_device(sm)


def _cpu_copies(sm, prompts) -> list:
    with F.Transfers() as log:
        with sm.record(SITES, device="cpu") as rec:
            sm.forward(prompts)
    assert all(rec[s].device.type == "cpu" for s in SITES)
    return floats(log)


def test_record_to_cpu_copies_once_per_site_not_per_row(models):
    sm, ref = models
    few, many = _cpu_copies(sm, PROMPTS[:2]), _cpu_copies(sm, PROMPTS)
    assert len(few) == len(many) == len(SITES), [t.where() for t in many]
    assert sum(t.numel for t in many) > sum(t.numel for t in few)  # the whole batch in each copy


def test_steering_moves_nothing_back(models):
    sm, ref = models
    _ = sm.facts
    v = torch.randn(sm.d_model, generator=torch.Generator().manual_seed(1))  # the caller's CPU vector
    with F.Transfers() as log:
        with sm.edit(SITES[0], add=v, scale=2.0):
            logits = sm.forward(PROMPTS)
    with ref.edit(SITES[0], add=v, scale=2.0):
        want = ref.forward(PROMPTS)
    assert not floats(log), [t.where() for t in floats(log)]
    assert torch.equal(F.host(logits), want)
    assert weights_on_device(sm)


def _generate(sm, prompts, v, n=4):
    rows = [Intervention.add(SITES[0], v, 3.0) if i % 2 == 0 else None for i in range(len(prompts))]
    with F.Transfers() as log:
        out = sm.generate(prompts, n, steer_rows=rows, return_tokens=True)
    assert all(len(o) == n for o in out), "a row ended early: pick prompts that run the whole length"
    return out, log


def test_generation_reads_the_tokens_once_per_step(models):
    """The sampled tokens of a step come back in one copy, whatever the batch size; per-row reads would make
    the six-row run read three times as often as the two-row one."""
    sm, ref = models
    _ = sm.facts
    v = torch.randn(sm.d_model, generator=torch.Generator().manual_seed(2))
    few, log_few = _generate(sm, PROMPTS[:2], v)
    many, log_many = _generate(sm, PROMPTS, v)
    assert not floats(log_many), [t.where() for t in floats(log_many)]
    assert len(log_many) == len(log_few), ([t.where() for t in log_many], [t.where() for t in log_few])
    token_reads = [t for t in log_many if t.called_from("generation.py") and t.op == "tolist"]
    assert len(token_reads) == 4 and all(t.numel == len(PROMPTS) for t in token_reads)
    rows = [Intervention.add(SITES[0], v, 3.0) if i % 2 == 0 else None for i in range(len(PROMPTS))]
    assert many == ref.generate(PROMPTS, 4, steer_rows=rows, return_tokens=True)
    assert weights_on_device(sm)


def test_dataset_copies_per_batch_not_per_row(models, tmp_path):
    sm, ref = models
    from steerkit.recording import record_dataset

    def copies(batch_size, out):
        with F.Transfers() as log:
            ds = record_dataset(sm, PROMPTS, SITES, out, batch_size=batch_size, progress=False)
        return floats(log, but=("fingerprint.py",)), ds

    per_batch, ds = copies(3, tmp_path / "a")
    want = record_dataset(ref, PROMPTS, SITES, tmp_path / "b", batch_size=3, progress=False)
    assert len(per_batch) == len(SITES) * 2, [t.where() for t in per_batch]  # 6 prompts in batches of 3
    for s in SITES:
        assert torch.equal(ds.load(s), want.load(s))
    assert weights_on_device(sm)


def test_the_steering_operator_reads_nothing_back(models):
    """What a CUDA engine's steering operator runs (every row, the flag and the indices read on the device), on an
    accelerator: after the step's indices are written, the operator at a steered site, at a site with nothing to
    steer and on a decoder layer's (hidden, residual) pair reads no value back; the results equal the CPU's."""
    import numpy as np

    from steerkit.kernels.slots import steer_slots_
    from steerkit.serving.plan import Block
    from steerkit.serving.slots import StepSlots
    from steerkit.serving.spec import parse_spec, resolve

    sm, ref = models
    d, fake = sm.d_model, torch.device(F.NAME, 0)
    g = torch.Generator().manual_seed(3)
    u = torch.randn(d, generator=g)
    spec = parse_spec({"ops": [{"op": "add", "layers": [0], "vector": torch.randn(d, generator=g).tolist(), "scale": 2.0},
                               {"op": "clamp", "layers": [0], "vector": (u / u.norm()).tolist(), "value": 1.0,
                                "positions": "last"}]})
    sites = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
    steps = [[Block(0, 4, np.arange(4), 4, None)], [Block(0, 1, np.array([6]), 4, None)]]  # a prefill, a decode
    x, r = torch.randn(5, d, generator=g), torch.randn(5, d, generator=g)
    for device in (fake, torch.device("cpu")):
        res = resolve(spec, store=None, facts=ref.facts, device=device)
        slots = StepSlots(sites, d_model=d, max_tokens=8, configs=8, device=device)
        outs = []
        for k, step in enumerate(steps):
            blocks = [Block(b.start, b.end, b.positions, b.n_prompt, res) for b in step]
            with F.Transfers() as fill_log:
                assert slots.fill(blocks, total=5)
            assert k == 0 or not fill_log, [t.where() for t in fill_log]  # indices planned on the host, once
            assert not floats(fill_log)
            xs, hs, rs = (t.clone().to(device) for t in (x, x, r))
            with F.Transfers() as log:
                for i in range(len(sites)):
                    steer_slots_(xs, None, slots.cfg[i], slots.flag[i], slots.slots)
                steer_slots_(hs, rs, slots.cfg[0], slots.flag[0], slots.slots)
            if device == fake:
                assert not log, [t.where() for t in log]
            outs.append([F.host(t) if device == fake else t for t in (xs, hs, rs)])
        if device == fake:
            on_fake = outs
    for got, want in zip(on_fake, outs):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
