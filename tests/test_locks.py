"""The development set-up installs from committed locks (scripts/lock.sh makes them, scripts/setup.sh installs them):
one per environment, a ``name==version`` line for every package, PyTorch's CPU build and no CUDA package in any,
each environment holding exactly its locks' packages; users get lower bounds in pyproject.toml."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import lockcheck  # noqa: E402

#: environment -> the locks it holds (.venv: the engines' lock only where the engines set-up ran)
ENVIRONMENTS = {".venv": ["locks/venv.txt"], ".venv-vllm": ["locks/venv-vllm.txt"],
                ".venv-saelens": ["locks/venv-saelens.txt"], ".venv-circuit-tracer": ["locks/venv-circuit-tracer.txt"]}
LOCKS = sorted(ROOT.glob("locks/*.txt"))


def test_every_lock_is_exact_and_cpu_only():
    names = {p.name for p in LOCKS}
    assert {"venv.txt", "venv-engines.txt", "venv-vllm.txt", "venv-saelens.txt", "venv-circuit-tracer.txt"} <= names, names
    for path in LOCKS:
        pins = lockcheck.read_lock(path)  # raises on any line that is not name==version
        assert pins, path
        assert not [n for n in pins if n.startswith("nvidia-")], f"{path.name} holds CUDA packages"
        if path.name != "venv-engines.txt" and path.name != "overrides.txt":
            assert pins.get("torch") == "2.13.0+cpu", f"{path.name}: torch=={pins.get('torch')}"
            assert {"pip", "setuptools", "wheel"} <= pins.keys(), f"{path.name} lacks the build tools"
    vllm = lockcheck.read_lock(ROOT / "locks/venv-vllm.txt")
    assert not {"torchvision", "torchaudio", "torchcodec", "triton"} & vllm.keys()  # the set-up never installs them
    ct = lockcheck.read_lock(ROOT / "locks/venv-circuit-tracer.txt")  # its nnsight backend needs 0.7
    assert ct["nnsight"] == "0.7.0" and "circuit-tracer" in ct and "steerkit" not in ct
    main = lockcheck.read_lock(ROOT / "locks/venv.txt")
    assert "kernels" in main and tuple(int(x) for x in main["transformers"].split(".")[:2]) >= (5, 25)


def test_setup_installs_each_lock_by_its_path():
    setup = (ROOT / "scripts/setup.sh").read_text(encoding="utf-8")
    for path in LOCKS:
        if path.name != "overrides.txt":
            assert f"locks/{path.name}" in setup, f"scripts/setup.sh does not install locks/{path.name}"
    assert "install --no-deps" in setup and "-r" in setup


@pytest.mark.parametrize("env", sorted(ENVIRONMENTS))
def test_each_environment_holds_exactly_its_locks(env):
    python = ROOT / env / "bin" / "python"
    if not python.exists():
        pytest.skip(f"{env} does not exist (scripts/setup.sh makes it)")
    locks = list(ENVIRONMENTS[env])
    if env == ".venv" and list((ROOT / env).glob("lib/python*/site-packages/llama_cpp")):  # the engines set-up
        locks.append("locks/venv-engines.txt")
    r = subprocess.run([str(python), str(ROOT / "scripts/lockcheck.py"), *locks], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, f"{env} differs from {locks} (bash scripts/setup.sh syncs it):\n{r.stdout}{r.stderr}"


def test_users_get_lower_bounds():
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    deps = re.search(r"^dependencies = \[(.*?)^\]", text, flags=re.S | re.M).group(1)
    extras = re.search(r"^\[project\.optional-dependencies\](.*?)^\[", text, flags=re.S | re.M).group(1)
    pinned = re.findall(r'"([^"]*==[^"]*)"', deps + extras)
    assert not pinned, f"exact pins belong in locks/, not in what users install: {pinned}"


def test_lockcheck_reports_differences(tmp_path):
    lock = tmp_path / "x.txt"
    lock.write_text("# a comment\nnot-installed-anywhere==1.0  # why\npytest==0.0.1\n", encoding="utf-8")
    extra, missing, other = lockcheck.differences([lock])
    assert "not-installed-anywhere" in missing and other["pytest"][0] == "0.0.1" and extra
    lock.write_text("torch>=2\n", encoding="utf-8")
    with pytest.raises(ValueError, match="name==version"):
        lockcheck.read_lock(lock)
