"""Type-check the core, the kernels and the vectors with mypy (configuration in pyproject.toml).

As for the import contract (``scripts/lint_imports.py``), the files are laid out as the installed
package has them, here in ``build/typecheck/`` (copied anew each run, their times kept), so mypy sees
``steerkit.kernels`` where ``kernels/`` is; mypy's cache stays beside them, so a run after a small change
re-checks what changed only. Paths in the report are given relative to that layout
(``steerkit/kernels/fused.py`` is ``kernels/fused.py`` here). Exit code: mypy's.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lint_imports import ROOT, assemble  # noqa: E402

CHECKED = ("steerkit", "steerkit/kernels", "steerkit/vectors")
NOT_CHECKED = ("probes", "apps")  # laid out so imports resolve; reported on by their own tests


WHERE = ROOT / "build" / "typecheck"


def main() -> int:
    shutil.rmtree(WHERE / "steerkit", ignore_errors=True)
    WHERE.mkdir(parents=True, exist_ok=True)
    assemble(WHERE)
    excludes = [f"--exclude=^steerkit/{d}/" for d in NOT_CHECKED]
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), *excludes,
           "--cache-dir", str(WHERE / ".mypy_cache"), "-p", "steerkit"]
    env = {**os.environ, "MYPYPATH": str(WHERE)}
    return subprocess.run(cmd, cwd=WHERE, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
