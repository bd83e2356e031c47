"""``steerkit.probes.sae_eval`` on the default model equals sae-lens's own evals
(``get_sparsity_and_variance_metrics``, ``get_downstream_reconstruction_metrics`` through its ``get_recons_loss``)
run in ``.venv-saelens`` on the same activations and logits (``tests/support/sae_lens_metrics_driver.py``), and the
spliced run's activation equals what sae-lens's replacement hook writes."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from steerkit.probes import sae_eval, special_token_ids
from steerkit.vectors import SAE, Provenance
from sae_weights import NO_SAELENS, SAELENS_PY, random_sae, rel

DRIVER = Path(__file__).resolve().parents[1] / "support" / "sae_lens_metrics_driver.py"
SITE = "blocks.3.hook_resid_post"
#: prompts of different lengths (padding), one holding the EOS token (a special token: not counted)
PROMPTS = ["The capital of France is Paris, and the capital of Spain is", "Hello<|im_end|> there",
           "One, two, three, four,", "Water boils at one hundred degrees", "A short one",
           "The quick brown fox jumps over the lazy dog while the cat sleeps"]


def _grid(cache, name: str, shape: tuple) -> torch.Tensor:
    """A recording at positions='all' back on the padded token grid ``[batch, pos, d]`` (zeros on padding)."""
    v, pos = cache[name], cache.positions(name)
    out = torch.zeros(*shape, v.shape[-1], dtype=v.dtype)
    for b in range(v.shape[0]):
        sel = pos[b] >= 0
        out[b, pos[b][sel]] = v[b][sel]
    return out


def batches_for_saelens(sm, sae: SAE, prompts: list[str], batch_size: int) -> tuple[dict, dict]:
    """What sae_eval runs, recorded as the driver reads it, and the spliced activations steerkit wrote."""
    special = torch.tensor(special_token_ids(sm.tokenizer))
    out, spliced_acts = {}, {}
    for i, s in enumerate(range(0, len(prompts), batch_size)):
        toks = sm.tokenize(prompts[s:s + batch_size])
        keep = toks.attention_mask.bool() & ~torch.isin(toks.input_ids, special)
        shape = tuple(toks.input_ids.shape)
        with sm.record(SITE) as cache:
            out[f"clean.{i}"] = sm.forward(toks)
        out[f"x.{i}"] = _grid(cache, SITE, shape)
        with sm.attach_sae(sae, splice=True, positions=keep), sm.record(SITE) as cache:  # the record sees the splice
            out[f"spliced.{i}"] = sm.forward(toks)
        spliced_acts[i] = (_grid(cache, SITE, shape), keep, toks.attention_mask.bool())
        with sm.edit(SITE, replace=torch.zeros(sm.d_model)):
            out[f"zero.{i}"] = sm.forward(toks)
        out[f"ids.{i}"] = toks.input_ids
        out[f"tokens.{i}"] = torch.where(keep, toks.input_ids, torch.full_like(toks.input_ids, -1))
    return {k: v.contiguous() for k, v in out.items()}, spliced_acts


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not SAELENS_PY.exists(), reason=NO_SAELENS)
@pytest.mark.parametrize("arch", ["topk", "jumprelu"])
def test_sae_eval_equals_saelens_evals_on_the_same_tensors(sm, tmp_path, arch):
    sae = SAE(random_sae(sm.d_model, arch), SITE, provenance=Provenance.from_model(sm))
    sae.save(tmp_path / "sae", "saelens")
    tensors, spliced = batches_for_saelens(sm, sae, PROMPTS, batch_size=4)
    padding = int((sm.tokenize(PROMPTS[:4]).attention_mask == 0).sum())
    assert int((tensors["tokens.0"] == -1).sum()) == padding + 1 and padding > 0, \
        "expected padding and a special token among the positions that do not count"
    save_file(tensors, tmp_path / "batches.safetensors")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    run = subprocess.run([str(SAELENS_PY), str(DRIVER), "metrics", str(tmp_path)], capture_output=True, text=True,
                         timeout=500, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    theirs = json.loads((tmp_path / "saelens_metrics.json").read_text())
    ours = sae_eval(sm, sae, PROMPTS, batch_size=4, progress=False)
    pairs = {"l0": "l0", "explained_variance": "explained_variance", "ce_loss_clean": "ce_loss_without_sae",
             "ce_loss_spliced": "ce_loss_with_sae", "ce_loss_zero_ablation": "ce_loss_with_ablation",
             "ce_loss_recovered": "ce_loss_score"}
    for key, their_key in pairs.items():
        assert ours[key] == pytest.approx(theirs[their_key], rel=1e-5, abs=1e-6), (key, ours[key], theirs[their_key])
    assert theirs["hook_name"] == SITE and ours["site"] == SITE
    # the spliced run: steerkit's activation is what sae-lens's replacement hook writes (the reconstruction at the
    # counted positions, the activation itself at the others)
    replaced = load_file(tmp_path / "saelens_replaced.safetensors")
    for i, (acts, keep, real) in spliced.items():
        want = replaced[f"replaced.{i}"]
        assert rel(acts[keep], want[keep]) < 1e-5, i
        assert torch.equal(acts[real & ~keep], tensors[f"x.{i}"][real & ~keep]), i
        assert rel(acts[keep], tensors[f"x.{i}"][keep]) > 0.1, "the splice changed nothing"
