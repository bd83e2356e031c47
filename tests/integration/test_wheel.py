"""The package users install: a wheel built from this checkout holds every module under ``steerkit.`` (the
five root folders remapped by ``package-dir``, none installed as a top-level package), the data files the
methods and the demo read (prompt sets, the GSM8K subsets, their sources and licences), the console script
and the vLLM plugin entry point, and asks for any torch from 2.4 on (the developer scripts pin theirs)."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROOT_FOLDERS = {"steerkit": "steerkit", "probes": "steerkit/probes", "vectors": "steerkit/vectors",
                "kernels": "steerkit/kernels", "apps": "steerkit/apps"}


@pytest.fixture(scope="module")
def wheel(scratch) -> zipfile.ZipFile:
    out = scratch("wheel")
    # the build backend of this environment (no download), the package alone (no dependencies)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                        str(ROOT)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (path,) = out.glob("steerkit-*.whl")
    return zipfile.ZipFile(path)


def _tracked(folder: str) -> list[str]:
    r = subprocess.run(["git", "ls-files", folder], capture_output=True, text=True, cwd=ROOT, check=True)
    return [line for line in r.stdout.splitlines() if line]


def test_every_module_and_data_file_is_inside(wheel):
    names = set(wheel.namelist())
    for folder, installed in ROOT_FOLDERS.items():
        for f in _tracked(folder):
            rel = f[len(folder) + 1:]
            if f.endswith(".py") or (folder == "steerkit" and rel.startswith("data/")):
                assert f"{installed}/{rel}" in names, f"{f} is not in the wheel as {installed}/{rel}"
    data = {n for n in names if n.startswith("steerkit/data/")}
    assert any("gsm8k" in n.lower() for n in data) and any(n.startswith("steerkit/data/refusal/") for n in data)
    corpus = {"steerkit/data/corpus/sotu_moby_dick.jsonl.xz", "steerkit/data/corpus/README.md",
              "steerkit/data/corpus/LICENSE"}  # the SAE training corpus and its attribution
    assert corpus <= data, sorted(corpus - data)
    assert "steerkit/py.typed" in names
    tops = {n.split("/")[0] for n in names if not n.startswith("steerkit-")}
    assert tops == {"steerkit"}, f"top-level entries besides steerkit: {sorted(tops - {'steerkit'})}"


def test_metadata_entry_points_and_requirements(wheel):
    dist = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(wheel.read(dist).decode())
    requires = meta.get_all("Requires-Dist") or []
    torch_req = [r for r in requires if r.split(";")[0].strip().startswith("torch") and "torchao" not in r
                 and "extra ==" not in r]
    assert torch_req == ["torch>=2.4"], torch_req  # any torch the user has, CUDA builds included
    eps = wheel.read(next(n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "steerkit = steerkit.cli:main" in eps and "steerkit = steerkit.serving.vllm_plugin:register" in eps


def _own_output(text: str) -> list[str]:
    """Output lines that are not about this machine's pip configuration (its extra package indexes)."""
    return [line for line in text.splitlines() if line.strip() and not line.startswith("WARNING: Location ")]


def test_the_build_prints_no_packaging_warnings(tmp_path):
    """`pip wheel --no-deps .` as a user runs it (an isolated build with the newest setuptools it allows)."""
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "--disable-pip-version-check",
                        "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not _own_output(r.stdout + r.stderr), _own_output(r.stdout + r.stderr)[:40]
    assert list(tmp_path.glob("steerkit-*.whl"))
