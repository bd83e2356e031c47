"""The per-step steering overhead of this tree against another commit, measured side by side.

``bench_step_overhead.py`` measures, inside one process, what steering adds to a decoding step
(conditions interleaved step by step, paired with an unsteered step next to them in time). Two
versions of steerkit cannot share a process, so this script lays out both as installed packages
(``git archive REF`` for the reference, the working tree for this one), runs each version's own
``bench_step_overhead.py`` in turn, alternating the order run by run, and compares the paired
overheads: each is a ratio against its own interleaved unsteered steps, so a machine that speeds up
or slows down between runs cancels out.

Writes ``benchmarks/results/step_vs_ref.csv`` (one row per run, version, batch and condition) and
prints the median overhead per version and condition over the runs.

Usage: python benchmarks/bench_step_vs_ref.py --ref REV [--runs 4] [--rounds 150] [--batches 1,8]
       python benchmarks/bench_step_vs_ref.py --ref REV --quick    # 1 run of 10 rounds, 16-token context
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from lint_imports import SUBPACKAGES  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import csv_rows  # noqa: E402

ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(add|ablate|torch-ablate|base-2)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|"
                 r"\s*([+-][\d.]+)%\s*\|\s*\[([+-][\d.]+),\s*([+-][\d.]+)\]\s*\|\s*(\S+)\s*\|")


def layout(src: Path, dest: Path) -> Path:
    """``src`` (a source tree) laid out as the installed package under ``dest``; returns ``dest``."""
    import shutil
    shutil.copytree(src / "steerkit", dest / "steerkit", ignore=shutil.ignore_patterns("__pycache__"))
    for name, folder in SUBPACKAGES.items():
        shutil.copytree(src / folder, dest / "steerkit" / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(src / "benchmarks", dest / "benchmarks", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def checkout(ref: str, dest: Path) -> Path:
    data = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def run_one(tree: Path, args) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(tree / "benchmarks" / "bench_step_overhead.py"), "--batches", args.batches,
           "--rounds", str(args.rounds), "--context", str(args.context)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode:
        raise SystemExit(f"bench_step_overhead failed in {tree}:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    rows = []
    for line in out.stdout.splitlines():
        m = ROW.match(line.strip())
        if m:
            b, cond, base, val, ovh, lo, hi, us = m.groups()
            rows.append(dict(batch=int(b), condition=cond, base_ms=float(base), cond_ms=float(val),
                             overhead_pct=float(ovh), ci_lo=float(lo), ci_hi=float(hi),
                             hook_us_per_call=None if us == "-" else float(us)))
    if not rows:
        raise SystemExit(f"no result rows in the output of {tree}:\n{out.stdout[-3000:]}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", required=True, help="the commit to compare against (e.g. HEAD~1)")
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batches", default="1")
    ap.add_argument("--quick", action="store_true", help="1 run of 10 rounds with a 16-token context (a smoke run)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "step_vs_ref.csv"))
    a = ap.parse_args(argv)
    if a.quick:
        a.runs, a.rounds, a.context = 1, 10, 16
    ref_sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", a.ref], check=True,
                             capture_output=True, text=True).stdout.strip()
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True,
                                text=True).stdout.strip())
    this = f"{head}{'+changes' if dirty else ''}"
    results = []
    with tempfile.TemporaryDirectory(prefix="steerkit-vs-") as tmp:
        t = Path(tmp)
        trees = {ref_sha: layout(checkout(a.ref, t / "ref-src"), t / "ref"), this: layout(ROOT, t / "this")}
        names = list(trees)
        for r in range(a.runs):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                print(f"run {r + 1}/{a.runs}: {name}", flush=True)
                for row in run_one(trees[name], a):
                    results.append({"run": r, "version": name, **row})
    out = csv_rows(Path(a.out), [{"mode": "quick" if a.quick else "full", **r, "rounds": a.rounds,
                                  "context": a.context} for r in results])
    print(f"\nmedian paired overhead over {a.runs} runs ({a.rounds} rounds each; rows in {out}):")
    print(f"{'batch':>5} {'condition':14} " + " ".join(f"{n:>16}" for n in names) + f" {'hook us/call':>24}")
    for b in sorted({r["batch"] for r in results}):
        for cond in ("add", "ablate", "torch-ablate", "base-2"):
            med = [statistics.median([r["overhead_pct"] for r in results
                                      if r["version"] == n and r["batch"] == b and r["condition"] == cond])
                   for n in names]
            us = [[r["hook_us_per_call"] for r in results if r["version"] == n and r["batch"] == b
                   and r["condition"] == cond and r["hook_us_per_call"] is not None] for n in names]
            us_s = " / ".join(f"{statistics.median(u):.0f}" if u else "-" for u in us)
            print(f"{b:>5} {cond:14} " + " ".join(f"{m:+15.2f}%" for m in med) + f" {us_s:>24}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
