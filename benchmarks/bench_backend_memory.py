"""Resident memory of the default model with one backend (hf) vs the three backends loaded at once.

Each condition runs in its own Python process, which first imports everything both conditions use
(torch, transformers, TransformerLens, nnsight, steerkit), so the figures compare what the models
and their wrappers take: ``model_mib`` is the resident memory after loading and one forward pass
minus the resident memory after the imports; ``peak_mib`` is the process's peak (``ru_maxrss``).
The tlens and nnsight backends run their own module trees over the HF model's weight tensors
(``steerkit.backends._torch.shell_copy``), so their cost is module objects, not weights.

    .venv/bin/python benchmarks/bench_backend_memory.py            # writes benchmarks/results/backend_memory.csv
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from _common import ROOT, csv_rows, table

WORKER = r"""
import gc, json, resource, sys
import psutil, torch, transformers, transformer_lens, nnsight  # noqa: F401  (imported in both conditions)
import steerkit
proc = psutil.Process()
def rss():
    gc.collect()
    return proc.memory_info().rss / 2**20
base = rss()
backends = sys.argv[1].split(",")
sm = steerkit.load_model()
toks = sm.tokenize(["The capital of France is"], chat=False)
models = [sm] + [steerkit.wrap(sm.hf_model, sm.tokenizer, name=sm.name, backend=b) for b in backends if b != "hf"]
for m in models:
    m.forward(toks)
print(json.dumps({"model_mib": rss() - base, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "import_mib": base}))
"""


def measure(backends: str) -> dict:
    r = subprocess.run([sys.executable, "-c", WORKER, backends], capture_output=True, text=True, cwd=ROOT,
                       env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    if r.returncode:
        raise SystemExit(f"worker failed ({backends}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="accepted for a uniform interface: the full run is already short (two model loads)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "backend_memory.csv"))
    args = ap.parse_args()
    one, three = measure("hf"), measure("hf,tlens,nnsight")
    rows = []
    for cond, m in (("hf", one), ("hf+tlens+nnsight", three)):
        rows.append({"condition": cond, "model_mib": round(m["model_mib"], 1), "peak_mib": round(m["peak_mib"], 1),
                     "import_mib": round(m["import_mib"], 1),
                     "ratio_vs_one": round(m["model_mib"] / one["model_mib"], 3)})
    print(table(list(rows[0]), [list(r.values()) for r in rows], title="default model, resident memory"))
    path = csv_rows(Path(args.out), rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
