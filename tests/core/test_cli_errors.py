"""Misuse of the command line: exit 2, one ``steerkit: error:`` line on stderr, never a traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_models import tiny_model  # noqa: E402


def _cli(*args, cwd=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1"}  # no progress bars around the one error line
    return subprocess.run([sys.executable, "-m", "steerkit", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=600)


def _assert_one_error_line(r, *fragments):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("steerkit: error: "), r.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


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
def test_misuse_exits_2_with_one_line(files, case):
    argv, fragments = _cases(files)[case]
    r = _cli(*argv, cwd=files)
    _assert_one_error_line(r, *fragments)
    assert not (files / "out").exists()  # nothing was written


def test_hooks_beyond_the_model_after_loading(tmp_path):
    model, tok = tiny_model("llama", seed=0)  # 2 layers
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    (tmp_path / "p.txt").write_text("hello\nworld\n")
    r = _cli("record", tmp_path / "p.txt", "-o", tmp_path / "out", "--model", tmp_path / "tiny", "--hooks",
             "resid_post:0-5", "--no-chat", "--quiet")
    _assert_one_error_line(r, "--hooks below 2 (the model's 2 layers are 0-1)", "found 2-5")
