"""Training a set of transcoders through sparsify (``steerkit.probes.train_transcoders``): every block in one pass,
checkpoints that survive an interruption, resuming to the uninterrupted run's weights, and the metrics.

A tiny random 3-layer Llama (a character tokenizer) trains 2x-wide TopK transcoders on a slice of the vendored
corpus. An interruption is a ``KeyboardInterrupt`` raised from the progress bar after a step, as Ctrl-C would
arrive; the run then resumes from its checkpoint. The replacement model's loss is checked against raw torch hooks
on the Hugging Face modules, outside steerkit's hook manager.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import steerkit
from steerkit.errors import InputError
from steerkit.probes import explained_variance, next_token_ce, train_transcoders, transcoder_metrics
from steerkit.probes import transcoder_train as tt
from steerkit.vectors import Transcoders

from cli_runs import assert_one_error_line, run_main  # noqa: E402

pytest.importorskip("sparsify")

CTX, TOKENS = 64, 1200
# sparsify's default learning rate is for a real model's scale; the tiny model's MLP outputs are far smaller
ARGS = dict(tokens=TOKENS, k=4, expansion=2, ctx_len=CTX, batch_size=4, eval_tokens=2 * CTX - 2, lr=1e-4,
            progress=False, precision="float32")


@pytest.fixture(scope="module")
def corpus(corpus_slice) -> Path:
    return corpus_slice


TINY3 = dict(num_hidden_layers=3, name="tiny-3")  # make_tiny("llama", **TINY3): a fresh one for each caller


@pytest.fixture(scope="module")
def trained(make_tiny, corpus, tmp_path_factory):
    sm = make_tiny("llama", **TINY3)
    out = tmp_path_factory.mktemp("tc") / "run"
    return sm, train_transcoders(sm, "all", corpus=corpus, out=out, checkpoint_seconds=1e9, **ARGS)


def test_every_block_trains_in_one_run_and_reads_back(trained):
    sm, r = trained
    assert r.layers == [0, 1, 2] and r.resumed_tokens == 0 and r.tokens >= TOKENS
    tc = r.transcoders(sm)
    assert isinstance(tc, Transcoders) and tc.n_layers == 3 and tc.d_sae == 2 * sm.d_model
    assert tc.activation == "topk" and tc.k == 4 and tc.sites(1) == ("blocks.1.mlp.hook_in", "blocks.1.hook_mlp_out")
    assert tc.check(sm) == []
    assert not (r.folder / tt.CHECKPOINT).exists()  # removed once the run is done
    on_disk = json.loads((r.folder / "metrics.json").read_text())
    assert [row["layer"] for row in on_disk["per_layer"]] == [0, 1, 2]
    for sae, l in zip(r.saes(), range(3)):  # the set and the per-block folders are the same weights
        assert sae.site == f"blocks.{l}.mlp.hook_in" and sae.output_site == f"blocks.{l}.hook_mlp_out"
        assert torch.equal(sae.weights.W_enc.T.contiguous(), tc.W_enc[l].contiguous())


def test_training_lowers_the_fvu_below_the_mean_predictor(trained):
    _, r = trained
    rows = r.metrics["per_layer"]
    assert all(0 < row["fvu"] < 1 for row in rows), rows  # better than predicting the mean, not perfect
    assert all(row["l0"] == 4.0 for row in rows)
    assert all(0 <= row["dead_latents"] <= 128 for row in rows)
    m = r.metrics
    assert m["ce_loss_clean"] < m["ce_loss_zero_ablation"]


def test_metrics_equal_raw_hooks_on_the_modules(trained, corpus):
    """FVU from recorded activations by hand; the replacement model's loss with forward hooks on the MLP modules
    that return each transcoder's prediction of its own input."""
    sm, r = trained
    saes = r.saes()
    ids = torch.randint(3, 60, (2, 32), generator=torch.Generator().manual_seed(1))
    m = transcoder_metrics(sm, saes, ids, progress=False)
    with sm.record([s for sae in saes for s in (sae.site, sae.output_site)]) as cache:
        sm.forward(steerkit.model.Tokens(ids, torch.ones_like(ids)))
    for row, sae in zip(m["per_layer"], saes):
        x, y = cache[sae.site].flatten(0, 1), cache[sae.output_site].flatten(0, 1)
        w = sae.weights
        assert row["fvu"] == pytest.approx(1 - explained_variance(y, w.decode(w.encode(x), x)), abs=1e-6)

    def predict(w):
        return lambda module, args, out: w.decode(w.encode(args[0]), args[0]).to(out.dtype)
    handles = [sm.adapter.mlp_module(sm.hf_model, l).register_forward_hook(predict(sae.weights))
               for l, sae in enumerate(saes)]
    try:
        with torch.no_grad():
            logits = sm.hf_model(ids).logits
    finally:
        for h in handles:
            h.remove()
    assert m["ce_loss_replaced"] == pytest.approx(float(next_token_ce(logits, ids).double().mean()), rel=1e-5)


class _Interrupt:
    """Raise KeyboardInterrupt from the token bar after ``after`` steps (Ctrl-C between two steps)."""

    def __init__(self, monkeypatch, after: int):
        self.calls = 0
        real = tt._TokenBar.update

        def update(bar, n=1):
            self.calls += 1
            real(bar, n)
            if self.calls == after:
                raise KeyboardInterrupt
        monkeypatch.setattr(tt._TokenBar, "update", update)


def test_an_interrupted_run_resumes_to_the_uninterrupted_weights(make_tiny, trained, corpus, tmp_path, monkeypatch):
    _, whole = trained
    sm = make_tiny("llama", **TINY3)
    out = tmp_path / "run"
    with monkeypatch.context() as mp:
        _Interrupt(mp, after=3)
        with pytest.raises(KeyboardInterrupt):
            train_transcoders(sm, "all", corpus=corpus, out=out, checkpoint_seconds=0, **ARGS)
    assert (out / tt.CHECKPOINT / "state.pt").is_file() and not (out / "metrics.json").exists()
    assert torch.load(out / tt.CHECKPOINT / "state.pt")["global_step"] == 3  # the next step to take
    assert sm.hook_count() == 0 and len(sm.adapter.block_list(sm.hf_model)) == 3  # the model is whole again
    r = train_transcoders(sm, "all", corpus=corpus, out=out, checkpoint_seconds=0, **ARGS)
    assert r.resumed_tokens > 0 and r.resumed_tokens < r.tokens
    a, b = whole.transcoders(), r.transcoders()
    for l in range(3):
        for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
            assert torch.allclose(getattr(a, name)[l], getattr(b, name)[l], atol=1e-6), (name, l)
    for got, want in zip(r.metrics["per_layer"], whole.metrics["per_layer"]):
        assert got == pytest.approx(want)


def test_resuming_with_other_settings_is_refused(make_tiny, corpus, tmp_path, monkeypatch):
    sm = make_tiny("llama", **TINY3)
    out = tmp_path / "run"
    with monkeypatch.context() as mp:
        _Interrupt(mp, after=1)
        with pytest.raises(KeyboardInterrupt):
            train_transcoders(sm, "all", corpus=corpus, out=out, checkpoint_seconds=0, **ARGS)
    with pytest.raises(InputError, match=r"settings of the interrupted run.*k: 4 then, 8 now"):
        train_transcoders(sm, "all", corpus=corpus, out=out, **{**ARGS, "k": 8})
    (out / ".checkpoint.tmp-x").mkdir()  # a swap cut off by a hard kill is cleared on the next start
    with pytest.raises(InputError, match="expected at least one layer|layers"):
        train_transcoders(sm, [], corpus=corpus, out=out, **ARGS)
    train_transcoders(sm, "all", corpus=corpus, out=out, **ARGS)
    assert not list(out.glob(".checkpoint.*"))
    with pytest.raises(InputError, match="no finished transcoders"):
        train_transcoders(sm, "all", corpus=corpus, out=out, **ARGS)


def test_a_family_with_a_norm_after_the_mlp_is_refused(make_tiny, tmp_path):
    sm = make_tiny("gemma2")
    with pytest.raises(InputError, match="MLP module's own output"):
        train_transcoders(sm, "all", out=tmp_path / "x", **ARGS)


def test_bfloat16_autocast_keeps_every_weight_float32(make_tiny, corpus, tmp_path):
    """Under autocast the model's pass and the encoders' products run in bfloat16; the transcoders' parameters
    (the encoder bias initialised from the first batch included) stay float32 and load as one set."""
    sm = make_tiny("llama", **TINY3)
    r = train_transcoders(sm, [0, 1, 2], corpus=corpus, out=tmp_path / "bf16", **{**ARGS, "precision": "bfloat16"})
    assert r.metrics["bfloat16_autocast"] is True
    tc = r.transcoders(sm)
    assert {t.dtype for name in ("W_enc", "b_enc", "W_dec", "b_dec") for t in getattr(tc, name)} == {torch.float32}
    assert all(0 < row["fvu"] < 1 for row in r.metrics["per_layer"]), r.metrics["per_layer"]


def test_precision_choice():
    assert tt.autocast_bf16(torch.device("cpu"), "float32") is False
    assert tt.autocast_bf16(torch.device("cpu"), "bfloat16") is True
    with pytest.raises(InputError, match="precision"):
        tt.autocast_bf16(torch.device("cpu"), "fp8")


def test_cli_trains_transcoders(make_tiny_folder, corpus, tmp_path, capsys):
    folder = make_tiny_folder("llama", num_hidden_layers=3)
    out = tmp_path / "cli"
    code, stdout, _ = run_main(capsys, "sae", "train", "--model", folder, "--transcoder", "--layers", "0,2", "--tokens",
                               TOKENS, "--k", 4, "--expansion", 2, "--lr", 1e-4, "--ctx-len", CTX, "--corpus", corpus,
                               "--eval-tokens", 2 * CTX - 2, "--out", out, "--precision", "float32", "--quiet", "--json")
    assert code == 0
    got = json.loads(stdout)
    assert got["layers"] == [0, 2] and [r["layer"] for r in got["metrics"]["per_layer"]] == [0, 2]
    assert sorted(p.name for p in out.glob("layers.*")) == ["layers.0.mlp", "layers.2.mlp"]


@pytest.mark.parametrize("argv, match", [
    (["--transcoder", "--hook", "blocks.1.hook_resid_post"], "--layers"),
    (["--transcoder"], "--layers"),
    (["--hook", "blocks.1.hook_resid_post", "--layers", "all"], "only with --transcoder"),
    (["--transcoder", "--layers", "x-3"], "layer"),
    (["--transcoder", "--layers", "all", "--checkpoint-seconds", "-1"], "--checkpoint-seconds"),
])
def test_cli_refusals(argv, match, capsys, tmp_path):
    code, out, err = run_main(capsys, "sae", "train", "--tokens", 100, "--out", tmp_path / "o", *argv)
    assert_one_error_line(code, err, match)
