"""``steerkit.probes.sae_eval`` and ``steerkit sae eval``: an exact autoencoder loses nothing, and the command
prints what the function returns (tests/integration/test_sae_eval_saelens.py shows the metrics equal sae-lens's own
evals)."""
from __future__ import annotations

import json

import pytest
import torch

import steerkit
from steerkit.cli import main
from steerkit.probes import sae_eval, special_token_ids
from steerkit.sae import SAEWeights
from steerkit.vectors import SAE, Provenance
from sae_weights import random_sae
from tiny_models import tiny_model

SITE = "blocks.3.hook_resid_post"
PROMPTS = ["The capital of France is Paris, and the capital of Spain is", "Hello<|im_end|> there",
           "One, two, three, four,"]


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
