"""``steerkit.probes.sae_eval`` and ``steerkit sae eval``: an exact autoencoder loses nothing, and on the default
model the metrics equal sae-lens's own evals (``get_sparsity_and_variance_metrics``,
``get_downstream_reconstruction_metrics`` through its ``get_recons_loss``) run in ``.venv-saelens`` on the same
activations and logits (``tests/support/sae_lens_metrics_driver.py``), and the spliced run's activation equals what
sae-lens's replacement hook writes."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import steerkit
from steerkit.cli import main
from steerkit.probes import sae_eval, special_token_ids
from steerkit.sae import SAEWeights
from steerkit.vectors import SAE, Provenance
from tiny_models import tiny_model

ROOT = Path(__file__).resolve().parents[2]
SAELENS_PY = Path(os.environ.get("STEERKIT_SAELENS_PYTHON") or ROOT / ".venv-saelens" / "bin" / "python")
DRIVER = ROOT / "tests" / "support" / "sae_lens_metrics_driver.py"
SITE = "blocks.3.hook_resid_post"
#: prompts of different lengths (padding), one holding the EOS token (a special token: not counted)
PROMPTS = ["The capital of France is Paris, and the capital of Spain is", "Hello<|im_end|> there",
           "One, two, three, four,", "Water boils at one hundred degrees", "A short one",
           "The quick brown fox jumps over the lazy dog while the cat sleeps"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def random_sae(d: int, arch: str, seed: int = 0, d_sae: int = 1024) -> SAEWeights:
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(d, d_sae, generator=g) / d ** 0.5
    extra: dict = {"topk": {"k": 24}, "jumprelu": {"threshold": torch.rand(d_sae, generator=g) * 0.5},
                   "relu": {}}[arch]
    return SAEWeights(W, torch.randn(d_sae, generator=g) * 0.1, W.T.clone() / 2, torch.randn(d, generator=g) * 0.1,
                      architecture=arch, **extra)


def exact_sae(d: int) -> SAEWeights:
    """``relu(x) - relu(-x) == x``: an autoencoder that reconstructs every activation exactly."""
    eye = torch.eye(d)
    return SAEWeights(torch.cat([eye, -eye], 1), torch.zeros(2 * d), torch.cat([eye, -eye], 0), torch.zeros(d),
                      apply_b_dec_to_input=False)


def test_an_exact_autoencoder_recovers_everything():
    model, tok = tiny_model("llama")
    tiny = steerkit.wrap(model, tok, name="tiny")
    site = "blocks.1.hook_resid_post"
    r = sae_eval(tiny, exact_sae(tiny.d_model), ["hello world", "good morning to you", "x"], site=site,
                 batch_size=2, progress=False)
    with tiny.record(site) as cache:
        tiny.forward(["hello world", "good morning to you", "x"])
    n = cache.lengths(site)
    nonzero = sum(int((cache[site][b, : int(n[b])] != 0).sum()) for b in range(3))
    assert r["eval_tokens"] == int(n.sum()) == 11 + 19 + 1 and r["ce_tokens"] == 10 + 18
    assert r["l0"] == pytest.approx(nonzero / r["eval_tokens"], rel=1e-12)  # every nonzero feature is a latent
    assert r["explained_variance"] == pytest.approx(1.0, abs=1e-6)
    assert r["ce_loss_spliced"] == pytest.approx(r["ce_loss_clean"], abs=1e-5)
    assert r["ce_loss_recovered"] == pytest.approx(1.0, abs=1e-4)
    assert r["ce_loss_zero_ablation"] > r["ce_loss_clean"] + 0.01  # zeroing the residual costs something
    assert tiny.hook_count() == 0 and not tiny.hooks.handles and not tiny.hooks.saes
    assert special_token_ids(tok) == [0, 1, 2]
    with pytest.raises(steerkit.InputError, match="special tokens only"):
        sae_eval(tiny, exact_sae(tiny.d_model), ["<eos>"], site=site, progress=False)
    assert tiny.hook_count() == 0 and not tiny.hooks.saes


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
@pytest.mark.skipif(not SAELENS_PY.exists(), reason=f"no sae-lens environment at {SAELENS_PY}: scripts/setup.sh "
                    "creates it (sae-lens==6.54.*)")
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


@pytest.mark.slow
def test_cli_sae_eval_prints_the_metrics(sm, tmp_path, capsys):
    sae = SAE(random_sae(sm.d_model, "topk", seed=3), SITE, provenance=Provenance.from_model(sm))
    folder = sae.save(tmp_path / "sae", "saelens")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:3]) + "\n")
    assert main(["sae", "eval", str(folder), "--prompts", str(prompts), "--json", "--quiet", "--device", "cpu",
                 "--dtype", "float32"]) == 0
    printed = json.loads(capsys.readouterr().out)
    want = sae_eval(sm, steerkit.load_sae(folder), PROMPTS[:3], progress=False)
    assert printed.keys() == want.keys()
    for key, v in want.items():
        assert printed[key] == (pytest.approx(v, rel=1e-6) if isinstance(v, float) else v), key
    assert main(["sae", "eval", str(tmp_path / "missing"), "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("steerkit: error: expected an SAE folder"), err
