"""Misuse of the command line: exit 2, one ``steerkit: error:`` line on stderr, never a traceback.

The cases run in-process through ``steerkit.cli.main`` (tests/support/cli_runs.py); test_cli_misuse.py shows
the real entry point behaves the same.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_runs import assert_one_error_line, run_main  # noqa: E402
from tiny_models import tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli-errors")
    (d / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": f"hi {i}"}) for i in range(3)))
    (d / "binary.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")
    (d / "a-file").write_text("not a folder")
    (d / "store").mkdir()
    return d


def _cases(d: Path):
    p = d / "prompts.jsonl"
    store = ["vectors", "--store", d / "store"]
    return {
        "hooks": (["record", p, "-o", d / "out", "--hooks", "resid_post:abc"], ["--hooks", "'abc'"]),
        "positions": (["record", p, "-o", d / "out", "--positions", "1,x"], ["--positions", "'x'"]),
        "output-under-file": (["record", p, "-o", d / "a-file" / "out"], ["a-file", "in its way"]),
        "binary-prompts": (["record", d / "binary.txt", "-o", d / "out"], ["UTF-8", "binary.txt"]),
        "missing-prompts": (["record", d / "missing.txt", "-o", d / "out"], ["expected a prompts file", "missing.txt"]),
        "app-port": (["app", "--port", "99999"], ["--port", "99999"]),
        "vectors-show-missing": ([*store, "show", "nothing"], ["expected an artifact named 'nothing'"]),
        "vectors-export-missing": ([*store, "export", "nothing", "-f", "svec", "-o", d / "x.json"],
                                   ["expected an artifact named 'nothing'"]),
        "probe-score-missing-file": (["probe", "score", d / "missing.safetensors", "--prompts", p],
                                     ["expected a probe artifact file", "missing.safetensors"]),
        "info-missing-model": (["info", "--model", "/nonexistent"], ["/nonexistent", "found nothing there"]),
        "info-bad-device": (["info", "--device", "gpu"], ["expected a torch device", "'gpu'"]),
        "demo-hub-id-offline": (["demo", "--model", "org/not-in-the-cache"],
                                ["'org/not-in-the-cache'", "HF_HUB_OFFLINE=1 is set: go online", "pass its path"]),
    }


CASES = list(_cases(Path("/d")))


@pytest.mark.parametrize("case", CASES)
def test_misuse_exits_2_with_one_line(files, case, capsys, monkeypatch, quiet_loading):
    argv, fragments = _cases(files)[case]
    monkeypatch.chdir(files)
    code, _, err = run_main(capsys, *argv)
    assert_one_error_line(code, err, *fragments, what=argv)
    assert not (files / "out").exists()  # nothing was written


def test_hooks_beyond_the_model_after_loading(tmp_path, capsys, quiet_loading):
    model, tok = tiny_model("llama", seed=0)  # 2 layers
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    (tmp_path / "p.txt").write_text("hello\nworld\n")
    code, _, err = run_main(capsys, "record", tmp_path / "p.txt", "-o", tmp_path / "out", "--model", tmp_path / "tiny",
                            "--hooks", "resid_post:0-5", "--no-chat", "--quiet")
    assert_one_error_line(code, err, "--hooks below 2 (the model's 2 layers are 0-1)", "found 2-5")
