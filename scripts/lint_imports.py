"""Check the package's layering with import-linter (the contract is in pyproject.toml).

steerkit installs five source folders as one package (``package-dir``: ``probes/`` is
``steerkit.probes`` and so on), which import-linter cannot see in the source tree: this script lays
the Python files out as the installed package has them, in a temporary folder, and runs
``lint-imports`` there. Exit code: lint-imports's (0 when every contract is kept).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = {"probes": "probes", "vectors": "vectors", "kernels": "kernels", "apps": "apps"}


def assemble(dest: Path) -> Path:
    pkg = dest / "steerkit"
    shutil.copytree(ROOT / "steerkit", pkg, ignore=shutil.ignore_patterns("__pycache__", "data"))
    for name, folder in SUBPACKAGES.items():
        shutil.copytree(ROOT / folder, pkg / name, ignore=shutil.ignore_patterns("__pycache__"))
    return pkg


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="steerkit-layers-") as tmp:
        assemble(Path(tmp))
        env = {**os.environ, "PYTHONPATH": tmp + os.pathsep + os.environ.get("PYTHONPATH", "")}
        exe = Path(sys.executable).with_name("lint-imports")
        cmd = [str(exe) if exe.exists() else "lint-imports", "--config", str(ROOT / "pyproject.toml"), "--no-cache"]
        return subprocess.run(cmd, cwd=tmp, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
