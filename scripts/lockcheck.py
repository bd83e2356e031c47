"""Compare the Python environment running this script with its locks (scripts/setup.sh, tests/test_locks.py).

    .venv/bin/python scripts/lockcheck.py locks/venv.txt [locks/venv-engines.txt ...]          # report, exit 1 on a difference
    .venv/bin/python scripts/lockcheck.py --prune locks/venv.txt                                # uninstall what no lock names

A lock is a requirements file of ``name==version`` lines (comments after ``#``). The environment matches when it
holds exactly the locked packages at the locked versions, besides steerkit itself.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)")
OWN = {"steerkit"}


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, str]:
    """``{name: version}`` of a lock; raises ValueError on a line that is not ``name==version``."""
    pins: dict[str, str] = {}
    for n, raw in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = LINE.match(line)
        if m is None or m.end() != len(line):
            raise ValueError(f"{path}:{n}: expected a `name==version` line, found {raw!r}")
        name = normalize(m.group(1))
        if name in pins:
            raise ValueError(f"{path}:{n}: {name} is pinned twice")
        pins[name] = m.group(2)
    return pins


def installed() -> dict[str, str]:
    """``{name: version}`` of this environment's distributions, steerkit left out."""
    out = {normalize(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    return {k: v for k, v in out.items() if k not in OWN}


def differences(locks: list[Path]) -> tuple[dict[str, str], dict[str, str], dict[str, tuple[str, str]]]:
    """(installed but not locked, locked but not installed, {name: (locked, installed)} at another version)."""
    want: dict[str, str] = {}
    for lock in locks:
        want.update(read_lock(lock))
    have = installed()
    extra = {k: v for k, v in have.items() if k not in want}
    missing = {k: v for k, v in want.items() if k not in have}
    other = {k: (want[k], have[k]) for k in want.keys() & have.keys() if want[k] != have[k]}
    return extra, missing, other


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("locks", nargs="+", type=Path)
    ap.add_argument("--prune", action="store_true", help="uninstall the packages no lock names")
    a = ap.parse_args(argv)
    extra, missing, other = differences(a.locks)
    if a.prune:
        if extra:
            subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", *sorted(extra)], check=True)
        return 0
    for name, version in sorted(extra.items()):
        print(f"installed, not locked: {name}=={version}")
    for name, version in sorted(missing.items()):
        print(f"locked, not installed: {name}=={version}")
    for name, (want, have) in sorted(other.items()):
        print(f"locked {name}=={want}, installed {have}")
    return 1 if extra or missing or other else 0


if __name__ == "__main__":
    sys.exit(main())
