"""The fake-device checks (``tests/support/fake_device_checks.py``: no library call moves the model or a tensor to the
CPU behind the caller's back), in a pytest process of their own: the fake device they register is process-wide
(``torch.accelerator`` reports it afterwards), so it must not leak into the rest of the suite."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_call_moves_anything_to_the_cpu_behind_the_callers_back():
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
                        str(ROOT / "tests" / "support" / "fake_device_checks.py")], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    tail = "\n".join(r.stdout.splitlines()[-60:])
    assert r.returncode == 0, f"the fake-device checks failed:\n{tail}\n{r.stderr[-3000:]}"
    assert " passed" in tail and "skipped" not in tail, tail
