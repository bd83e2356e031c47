"""What tests/integration/test_root_imports.py runs from the repository root, in every way Python can be started there.

Run as ``python -m tests.root_session`` (or its text through ``-c``, stdin or a REPL): imports transformers'
modeling code, steerkit and sparsify, reports which ``kernels`` module a bare import gives, then runs the
README's quick start (unless ``ROOT_SESSION_IMPORTS_ONLY`` is set). Prints one ``ROOT-SESSION {json}`` line before the quick start's own output.
"""
import json
import os
import re
import sys
from pathlib import Path

import transformers.modeling_utils  # noqa: F401  (imports Hugging Face's `kernels` where it is installed)
import sparsify  # noqa: F401
import steerkit

ROOT = Path(steerkit.__file__).resolve().parents[1]


def bare_kernels() -> dict:
    """What ``import kernels`` gives here: the module's file, or the error's type and message."""
    try:
        import kernels
    except ImportError as e:
        return {"error": type(e).__name__, "message": str(e)}
    try:
        from kernels import get_kernel  # noqa: F401
    except ImportError as e:
        return {"file": getattr(kernels, "__file__", None), "error": type(e).__name__, "message": str(e)}
    return {"file": kernels.__file__}


def quick_start() -> str:
    """The README's quick start: the first ```python block under '## Quick start'."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Quick start", 1)[1]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


print("ROOT-SESSION " + json.dumps({"path0": sys.path[0], "kernels": bare_kernels(),
                                    "steerkit": steerkit.__file__}), flush=True)
if not os.environ.get("ROOT_SESSION_IMPORTS_ONLY"):
    exec(compile(quick_start(), "README.md (quick start)", "exec"))
