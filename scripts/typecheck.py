"""Type-check the core, the kernels and the vectors with mypy (configuration in pyproject.toml).

As for the import contract (``scripts/lint_imports.py``), the files are laid out as the installed
package has them, in a temporary folder, so mypy sees ``steerkit.kernels`` where ``kernels/`` is.
Paths in the report are given relative to that layout (``steerkit/kernels/fused.py`` is
``kernels/fused.py`` here). Exit code: mypy's.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lint_imports import ROOT, assemble  # noqa: E402

CHECKED = ("steerkit", "steerkit/kernels", "steerkit/vectors")
NOT_CHECKED = ("probes", "apps")  # laid out so imports resolve; reported on by their own tests


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="steerkit-types-") as tmp:
        pkg = assemble(Path(tmp))
        excludes = [f"--exclude=^steerkit/{d}/" for d in NOT_CHECKED]
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), *excludes,
               "-p", "steerkit"]
        env = {**os.environ, "MYPYPATH": tmp}
        r = subprocess.run(cmd, cwd=tmp, env=env)
        del pkg
        return r.returncode


if __name__ == "__main__":
    sys.exit(main())
