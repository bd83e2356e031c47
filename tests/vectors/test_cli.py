"""``steerkit vectors`` verbs: output and exit codes."""

from __future__ import annotations

import json

import pytest
import torch

from steerkit.cli.vectors import main
from steerkit.vectors import Provenance, SteeringVector, Store, import_artifact


def test_cli_verbs(tmp_path, capsys):
    root = tmp_path / "store"
    s = Store(root)
    v = SteeringVector({3: torch.randn(8)}, provenance=Provenance(d_model=8, n_layers=6, model_arch="llama", method="caa"))
    s.save("happy", v)
    s.save("happy", v * 2)
    def cli(*a):
        return main(["--store", str(root), *a])

    assert cli("list") == 0
    out = capsys.readouterr().out
    assert "happy@1" in out and "happy@2" in out and "latest" in out and "caa" in out
    assert cli("show", "happy@1", "--json") == 0
    assert json.loads(capsys.readouterr().out)["ref"] == "happy@1"
    assert cli("show", "happy") == 0
    assert "provenance.method: caa" in capsys.readouterr().out
    f = tmp_path / "h.gguf"
    assert cli("export", "happy@2", "--format", "llama.cpp", "-o", str(f)) == 0
    assert f"wrote {f}" in capsys.readouterr().out
    assert import_artifact(f) == (v * 2).effective()
    assert cli("import", str(f), "--name", "imported", "--tag", "prod") == 0
    assert "imported@1" in capsys.readouterr().out
    assert s.load("imported@prod") == v * 2
    assert cli("tag", "happy@1", "stable") == 0 and "stable -> happy@1" in capsys.readouterr().out
    assert cli("search", "caa", "--json") == 0
    assert {r["name"] for r in json.loads(capsys.readouterr().out)} == {"happy", "imported"}
    assert cli("rm", "happy@1") == 0 and "removed happy@1" in capsys.readouterr().out
    # errors: exit 2 with one line on stderr
    assert cli("show", "happy@1") == 2
    assert capsys.readouterr().err.startswith("steerkit: error: expected version 1")
    assert cli("show", "../etc") == 2
    assert capsys.readouterr().err.count("\n") == 1
    # a missing output folder is refused (never created), and the message names it
    assert cli("export", "happy@2", "--format", "svec", "-o", str(tmp_path / "no" / "x.svec")) == 2
    err = capsys.readouterr().err
    assert f"existing folder {tmp_path / 'no'} " in err and "mkdir" in err and not (tmp_path / "no").exists()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00")
    assert cli("import", str(bad), "--name", "bad") == 2
    assert "truncated" in capsys.readouterr().err
    zero = SteeringVector({0: torch.randn(8)}, provenance=Provenance(d_model=8, n_layers=6))
    s.save("zero", zero)
    assert cli("export", "zero", "--format", "llama.cpp", "-o", str(tmp_path / "z.gguf")) == 2
    assert "block 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli("export", "happy", "--format", "onnx", "-o", "x")
    assert e.value.code == 2


def test_main_entry_point(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("STEERKIT_STORE", str(tmp_path / "s"))
    assert main(["list"]) == 0
    assert "(no artifacts)" in capsys.readouterr().out
