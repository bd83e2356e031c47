"""Store and export throughput: ``python benchmarks/vectors_store.py [--n 200] [--d 576] [--layers 30]``.

Saves N steering vectors (one direction per layer) into a fresh store, loads them back, lists,
and exports one vector to every format; prints a JSON line of timings.  The store fsyncs every
file and the index on each save, so the save rate mostly measures the disk's fsync latency.
``--quick`` saves 20 vectors. Rows go to ``benchmarks/results/vectors_store.csv`` (``--out``: one
per operation, and per format for export and import).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from steerkit.vectors import FORMATS, Provenance, SteeringVector, Store, export, import_artifact

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

SUFFIX = {"llama.cpp": ".gguf", "repeng": ".gguf", "easysteer": ".gguf", "easysteer-v1": ".gguf", "tlens": ".json", "svec": ".svec",
          "safetensors": ".safetensors"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="20 vectors")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--d", type=int, default=576)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--out", default=str(C.ROOT / "benchmarks" / "results" / "vectors_store.csv"),
                    help="CSV of the rows")
    a = ap.parse_args()
    if a.quick:
        a.n = 20
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
    base = {"mode": "quick" if a.quick else "full", "n": a.n, "d_model": a.d, "layers": a.layers - 1}
    rows = [{**base, "operation": "save", "format": "store", "count": a.n, "total_ms": round(1e3 * t_save, 2),
             "per_s": round(a.n / t_save, 1), "bytes": ""},
            {**base, "operation": "load", "format": "store", "count": a.n, "total_ms": round(1e3 * t_load, 2),
             "per_s": round(a.n / t_load, 1), "bytes": ""},
            {**base, "operation": "list", "format": "store", "count": 1, "total_ms": round(1e3 * t_list, 2),
             "per_s": round(1 / t_list, 1) if t_list else "", "bytes": ""}]
    for fmt, e in exports.items():
        for op in ("export", "import"):
            ms = e[f"{op}_ms"]
            rows.append({**base, "operation": op, "format": fmt, "count": 1, "total_ms": ms,
                         "per_s": round(1e3 / ms, 1) if ms else "", "bytes": e["bytes"]})
    print(f"wrote {len(rows)} rows to {C.csv_rows(Path(a.out), rows)}")


if __name__ == "__main__":
    main()
