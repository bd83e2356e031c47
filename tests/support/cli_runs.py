"""The two ways the tests run the command line, and the check every misuse must pass.

- :func:`run_main`: in this process, through ``steerkit.cli.main`` (milliseconds past the work itself);
  what it printed comes from pytest's ``capsys``.
- :func:`run_entry`: through the real entry point, ``python -m steerkit``, in a fresh interpreter (about 5 s
  each here, mostly importing torch and transformers): for the few cases that show the entry point behaves
  as ``main`` does.
- :func:`assert_one_error_line`: exit 2 and one ``steerkit: error:`` line on stderr, never a traceback.
"""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

ENTRY_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
             "HF_HUB_DISABLE_PROGRESS_BARS": "1"}  # no progress bars around one error line


def run_main(capsys: Any, *argv: Any) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of ``steerkit.cli.main(argv)`` run here (argparse's exits included)."""
    from steerkit.cli import main

    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse: --help, usage errors
        code = e.code
    out, err = capsys.readouterr()
    return int(code or 0), out, err


def run_entry(*argv: Any, cwd: Any = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m steerkit ARGV`` in a fresh interpreter, offline, its output captured as text."""
    return subprocess.run([sys.executable, "-m", "steerkit", *map(str, argv)], capture_output=True, text=True,
                          env={**os.environ, **ENTRY_ENV, **(env or {})}, cwd=cwd, timeout=600)


def assert_one_error_line(code: int, err: str, *fragments: str, what: Any = None) -> str:
    """Check a misuse's exit: code 2, no traceback, one ``steerkit: error:`` line holding every fragment."""
    assert code == 2, (what, code, err)
    assert "Traceback" not in err, (what, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("steerkit: error: "), (what, err)
    for frag in fragments:
        assert frag in lines[0], (what, frag, lines[0])
    return lines[0]
