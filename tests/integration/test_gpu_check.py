"""The GPU check (scripts/gpu_check.sh) in smoke mode: ``GPU_CHECK_SMOKE=1`` runs every step of the device run on
the CPU at toy sizes, from a bundle scripts/gpu_bundle.sh makes here, so the device run cannot silently break
when tests, benchmarks or their options move."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["install", "install-steerkit", "device-tests", "gpu-kernels", "gpu-steer-graph", "real-size", "tune",
         "refusal"]
CSVS = ["gpu_kernels.csv", "real_size.csv", "tune.csv", "refusal_scoring.csv"]  # the graph step checks arithmetic only


def test_every_step_of_the_gpu_check_runs_in_smoke_mode(tmp_path):
    bundle, out = tmp_path / "bundle", tmp_path / "out"
    r = subprocess.run(["bash", "scripts/gpu_bundle.sh", str(bundle)], cwd=ROOT, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    env = {**os.environ, "GPU_CHECK_SMOKE": "1", "PYTHON": sys.executable, "OUT": str(out), "TMPDIR": str(tmp_path)}
    r = subprocess.run(["bash", "scripts/gpu_check.sh", str(bundle)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=1800)
    log = (out / "gpu_check.log").read_text(encoding="utf-8")
    assert r.returncode == 0, log[-6000:]
    steps = re.findall(r"^== ([\w-]+): exit (\d+) in", log, flags=re.M)
    assert [name for name, _ in steps] == STEPS, log[-6000:]
    assert all(rc == "0" for _, rc in steps), steps
    assert " passed" in log and " failed" not in log
    assert "eager operator vs fused_steer_ref: max |diff|" in log  # the CUDA-graph step's check on the CPU
    for name in CSVS:
        lines = (out / name).read_text(encoding="utf-8").splitlines()
        assert len(lines) >= 2, f"{name}: expected a header and rows, found {lines}"
