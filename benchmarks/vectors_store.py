"""Store and export throughput: ``python benchmarks/vectors_store.py [--n 200] [--d 576] [--layers 30]``.

Saves N steering vectors (one direction per layer) into a fresh store, loads them back, lists,
and exports one vector to every format; prints a JSON line of timings.  The store fsyncs every
file and the index on each save, so the save rate mostly measures the disk's fsync latency.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from steerkit.vectors import FORMATS, Provenance, SteeringVector, Store, export, import_artifact

SUFFIX = {"llama.cpp": ".gguf", "repeng": ".gguf", "easysteer": ".gguf", "tlens": ".json", "svec": ".svec",
          "safetensors": ".safetensors"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--d", type=int, default=576)
    ap.add_argument("--layers", type=int, default=30)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "store")
        prov = Provenance(d_model=a.d, n_layers=a.layers, model_arch="llama")
        vecs = [SteeringVector({l: torch.randn(a.d) for l in range(1, a.layers)}, provenance=prov) for _ in range(a.n)]
        t = time.perf_counter()
        refs = [store.save(f"v{i % 10}", v) for i, v in enumerate(vecs)]
        t_save = time.perf_counter() - t
        t = time.perf_counter()
        for r in refs:
            store.load(r)
        t_load = time.perf_counter() - t
        t = time.perf_counter()
        rows = store.list()
        t_list = time.perf_counter() - t
        exports = {}
        for fmt in FORMATS:
            p = Path(tmp) / f"x{SUFFIX[fmt]}"
            t = time.perf_counter()
            paths = export(vecs[0], fmt, p)
            t_exp = time.perf_counter() - t
            t = time.perf_counter()
            assert import_artifact(paths[-1]) == vecs[0]
            exports[fmt] = {"export_ms": round(1e3 * t_exp, 2), "import_ms": round(1e3 * (time.perf_counter() - t), 2),
                            "bytes": sum(q.stat().st_size for q in paths)}
    print(json.dumps({"n": a.n, "d_model": a.d, "layers": a.layers - 1, "saves_per_s": round(a.n / t_save, 1),
                      "loads_per_s": round(a.n / t_load, 1), "list_ms": round(1e3 * t_list, 2), "rows": len(rows),
                      "exports": exports}))


if __name__ == "__main__":
    main()
