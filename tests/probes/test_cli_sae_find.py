"""``steerkit sae find`` and ``steerkit sae report`` through the in-process CLI on a tiny random Llama saved as a
folder and a random SAE saved as a sae-lens folder: the printed JSON equals the library's
``top_latents`` / ``feature_report`` on the same model and SAE, the table and the HTML file show the contexts,
and bad input exits 2 with one ``steerkit: error:`` line."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

import steerkit
from steerkit.cli import main
from steerkit.probes import feature_report, top_latents
from steerkit.sae import SAEWeights
from steerkit.vectors import SAE

from tiny_models import tiny_model

SITE = "blocks.1.hook_resid_post"
TEXT = "the cat sat on the mat\nand the dog ran"
TEXTS = ["the cat sat on the mat", "a dog ran far away", "hello", "one two three four five six", "xyz", "a b"]
CPU = ["--device", "cpu", "--dtype", "float32"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The saved model folder, the SAE folder, a dataset file, and the model and SAE as the library loads them."""
    root = tmp_path_factory.mktemp("sae_cli")
    model, tok = tiny_model("llama")
    model.save_pretrained(root / "tiny")
    tok.save_pretrained(root / "tiny")
    g = torch.Generator().manual_seed(4)
    W = torch.nn.functional.normalize(torch.randn(96, model.config.hidden_size, generator=g), dim=-1)
    sae = SAE(SAEWeights(W.T.clone(), torch.randn(96, generator=g) * 0.05, W.clone(), torch.zeros(W.shape[1])), SITE)
    folder = sae.save(root / "sae", "saelens")
    (root / "texts.txt").write_text("\n".join(TEXTS) + "\n")
    sm = steerkit.load_model(str(root / "tiny"), device="cpu", dtype="float32")
    return root, folder, sm, steerkit.load_sae(folder)


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _roundtrip(d: dict) -> dict:
    return json.loads(json.dumps(d))


def test_find_prints_what_top_latents_returns(setup, capsys):
    root, folder, sm, sae = setup
    code, out, err = _cli(capsys, "sae", "find", TEXT, "--sae", folder, "--k", 7, "--json", "--model", root / "tiny",
                          *CPU)
    assert code == 0, err
    want = top_latents(sm, sae, TEXT, k=7)
    assert len(want.rows) == 7 and json.loads(out) == _roundtrip(want.to_dict())
    (root / "text.txt").write_text(TEXT + "\n")  # the file's final newline is not part of the text
    code, out, err = _cli(capsys, "sae", "find", "--text-file", root / "text.txt", "--sae", folder, "--k", 7,
                          "--model", root / "tiny", *CPU)
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith(f"SAE {folder} at {SITE} (96 latents): the top 7 on "
                                             f"{len(want.tokens)} tokens (the first, the attention sink, not counted)"), out
    rows = lines[2:]
    assert len(rows) == 7
    for line, row in zip(rows, want.rows):
        assert line.split()[0] == str(row["latent"]) and line.endswith(f"{row['token']!r} ({row['position']})")


def test_report_prints_what_feature_report_returns_and_writes_the_html(setup, capsys):
    root, folder, sm, sae = setup
    with sm.record(SITE) as cache:  # a latent that fires on some tokens, not on all
        sm.forward(TEXTS, chat=False)
    on = (sae.encode(cache[SITE]) > 0).flatten(0, 1)[cache.positions(SITE).flatten() >= 0].float().mean(0)
    latent = int(((on - 0.5).abs() + (on == 0) * 9).argmin())
    assert 0.2 < float(on[latent]) < 0.8
    want = feature_report(sm, sae, latent, TEXTS, top=4, context=3, batch_size=4, progress=False)
    base = ("sae", "report", "--sae", folder, "--latent", latent, "--dataset", root / "texts.txt", "--top", 4, "--context",
            3, "--batch-size", 4, "--quiet", "--model", root / "tiny", *CPU)
    code, out, err = _cli(capsys, *base, "--json")
    assert code == 0, err
    assert len(want.contexts) >= 2 and json.loads(out) == _roundtrip(want.to_dict())
    page = root / "out" / "latent.html"
    code, out, err = _cli(capsys, *base, "--html", page)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == (f"latent {latent} of SAE {folder} at {SITE}: density {want.density:.4g} ({want.values.numel()} of "
                        f"{want.n_tokens} tokens in {len(TEXTS)} texts)")
    for c in want.contexts:  # each context on its line, the firing token marked
        marked = "".join(f"[[{t}]]" if j == c["index"] else t for j, t in enumerate(c["tokens"]))
        assert any(line.endswith(f"text {c['doc']} token {c['position']}: {marked}") for line in lines), (marked, out)
    assert any(line.startswith("top logit effects:") and repr(want.top_logits[0][0]) in line for line in lines)
    assert any(line.startswith("nearest decoder neighbours") and str(want.neighbours[0][0]) in line for line in lines)
    doc = page.read_text(encoding="utf-8")
    assert doc.startswith("<!DOCTYPE html>") and doc.count("outline:1px solid #c00") == len(want.contexts)
    assert want.contexts_html() in doc and "Plotly.newPlot" in doc


def _one_error(capsys, *argv) -> str:
    code, out, err = _cli(capsys, *argv)
    lines = [line for line in err.strip().splitlines() if "Loading weights" not in line]  # transformers' bar
    assert code == 2 and len(lines) == 1 and lines[0].startswith("steerkit: error: "), (code, err)
    assert "Traceback" not in err
    return lines[0]


def test_bad_input_exits_2_with_one_line(setup, capsys, monkeypatch):
    root, folder, sm, sae = setup
    model = ("--model", root / "tiny", *CPU)
    early = ("--model", root / "no-model")  # these fail before any model loads: this one would fail otherwise
    assert "expected an SAE folder" in _one_error(capsys, "sae", "find", "hello", "--sae", root / "missing", *early)
    assert "expected an SAE folder" in _one_error(capsys, "sae", "report", "--sae", root / "missing", "--latent", 1,
                                                  "--dataset", root / "texts.txt", *early)
    assert "non-empty text" in _one_error(capsys, "sae", "find", "", "--sae", folder, *early)
    (root / "empty.txt").write_text("\n")
    assert "non-empty text" in _one_error(capsys, "sae", "find", "--text-file", root / "empty.txt", "--sae", folder,
                                          *early)
    assert "found both" in _one_error(capsys, "sae", "find", "hi", "--text-file", root / "empty.txt", "--sae", folder)
    assert "found neither" in _one_error(capsys, "sae", "find", "--sae", folder)
    assert "--k >= 1" in _one_error(capsys, "sae", "find", "hi", "--sae", folder, "--k", 0)
    for latent in (96, -1):
        line = _one_error(capsys, "sae", "report", "--sae", folder, "--latent", latent, "--dataset",
                          root / "texts.txt", *early)
        assert f"expected --latent in 0..95 (the SAE has 96 latents), found {latent}" in line
    (root / "afile").write_text("x")
    assert "in its way" in _one_error(capsys, "sae", "report", "--sae", folder, "--latent", 1, "--dataset",
                                      root / "texts.txt", "--html", root / "afile" / "r.html", *early)
    assert "prompts file" in _one_error(capsys, "sae", "report", "--sae", folder, "--latent", 1, "--dataset",
                                        root / "nothing.txt", *early)
    assert "no-model" in _one_error(capsys, "sae", "find", "hi", "--sae", folder, *early)  # the model is the error
    assert "to read 128 features" in _one_error(capsys, "sae", "find", "hi", "--sae", folder, "--site",
                                               "blocks.1.mlp.hook_post", *model)
    find_spec = importlib.util.find_spec  # without plotly, --html fails before the model loads
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "plotly" else find_spec(name, *a))
    assert "pip install plotly" in _one_error(capsys, "sae", "report", "--sae", folder, "--latent", 1, "--dataset",
                                              root / "texts.txt", "--html", root / "r.html", *early)
