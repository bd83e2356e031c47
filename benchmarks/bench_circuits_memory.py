"""Attribution graphs of long prompts: the peak resident memory of steerkit's ``attribution_graph`` and of
circuit-tracer 0.5.0's ``attribute`` on the same model, transcoders and prompt as ``bench_circuits.py`` (its workers,
its setup in ``.bench-circuits``: run ``bench_circuits.py --tokens 16 --threads 1`` once first to make the model folder
and the transcoders).

Each side runs in its own process; this script samples the process's peak resident memory (``VmHWM`` of
``/proc/PID/status``) every second. ``--time-limit`` stops a run that takes longer (circuit-tracer takes over an hour
at 512 tokens on a 2-core CPU): the row then says ``completed=False`` and its ``peak_rss_mib`` is the peak *so far*, a
lower bound of the run's peak. ``--rss-cap-mib`` stops a run whose memory passes it (again a lower bound), so that a
run cannot exhaust the machine.

Usage:  python benchmarks/bench_circuits_memory.py --side steerkit --tokens 512 --options '{"offload": true}'
        python benchmarks/bench_circuits_memory.py --side steerkit --quick --out /tmp/memory.csv
        python benchmarks/bench_circuits_memory.py --side circuit-tracer --tokens 512 --time-limit 1200

Rows are added to ``benchmarks/results/circuits_memory.csv`` (``--out``).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, csv_rows, run_facts  # noqa: E402
from bench_circuits import CT_PY, _prompts  # noqa: E402


def _status(pid: int, key: str) -> float:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", choices=["steerkit", "circuit-tracer"], required=True)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-feature-nodes", type=int, default=8192)
    ap.add_argument("--d-sae", type=int, default=16384)
    ap.add_argument("--l0", type=float, default=12.0)
    ap.add_argument("--options", default="{}", help="steerkit's extra attribution_graph keywords, as JSON")
    ap.add_argument("--time-limit", type=float, default=None, help="seconds; stop the run after them")
    ap.add_argument("--rss-cap-mib", type=float, default=12288, help="stop the run when its memory passes this")
    ap.add_argument("--work", default=str(ROOT / ".bench-circuits"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "circuits_memory.csv"))
    ap.add_argument("--quick", action="store_true", help="16 tokens, 2048 features per block (a check that it runs)")
    a = ap.parse_args()
    if a.quick:
        a.tokens, a.d_sae = 16, 2048
    import steerkit

    work = Path(a.work)
    tc_path = work / "transcoders" / f"jumprelu-{a.d_sae}-l0-{a.l0:g}"
    if not (tc_path / "config.yaml").exists() or not (work / "model" / "config.json").exists():
        raise SystemExit(f"no benchmark setup in {work}: run benchmarks/bench_circuits.py --tokens 16 --threads 1 first")
    sm = steerkit.load_model()
    ids = _prompts(sm.tokenizer, [a.tokens])[a.tokens]
    del sm
    options = json.loads(a.options)
    job = dict(model=str(work / "model"), transcoders=str(tc_path), batch_size=a.batch_size,
               max_feature_nodes=a.max_feature_nodes, ids=ids, tokens=a.tokens, threads=a.threads, options=options,
               graph_out=str(work / f"graph-memory-{a.side}-{a.tokens}.safetensors"))
    path = work / f"job-memory-{a.side}-{a.tokens}.json"
    path.write_text(json.dumps(job))
    py = sys.executable if a.side == "steerkit" else str(CT_PY)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "VIRTUAL_ENV"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(a.threads))
    t0 = time.perf_counter()
    proc = subprocess.Popen([py, str(ROOT / "benchmarks" / "bench_circuits.py"), "--worker", a.side, "--job",
                             str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=work)
    peak, stopped = 0.0, ""
    while proc.poll() is None:
        hwm = _status(proc.pid, "VmHWM")
        peak = max(peak, hwm) if hwm == hwm else peak
        elapsed = time.perf_counter() - t0
        if a.time_limit is not None and elapsed > a.time_limit:
            stopped = f"time limit {a.time_limit:g} s"
        elif peak > a.rss_cap_mib:
            stopped = f"memory cap {a.rss_cap_mib:g} MiB"
        if stopped:
            proc.kill()
            break
        time.sleep(1.0)
    out, err = proc.communicate()
    seconds = time.perf_counter() - t0
    row = {"library": a.side, "tokens": a.tokens, "threads": a.threads, "batch_size": a.batch_size,
           "max_feature_nodes": a.max_feature_nodes, "d_sae": a.d_sae, "options": json.dumps(options),
           "completed": not stopped, "stopped_by": stopped, "process_s": round(seconds, 1),
           "peak_rss_mib": round(peak), "graph_s": "", "graph_peak_mib": "", "n_active": "", "n_features": ""}
    if not stopped:
        if proc.returncode != 0:
            raise SystemExit(f"{a.side} worker failed:\n{out[-3000:]}\n{err[-6000:]}")
        res = json.loads(out.strip().splitlines()[-1])
        row.update(graph_s=round(res["seconds"], 2), peak_rss_mib=round(res["peak_rss_mib"]),
                   graph_peak_mib=round(res["graph_peak_mib"]), n_active=res["n_active"],
                   n_features=res["n_features"])
    print(json.dumps(row))
    out_path = Path(a.out)
    if not out_path.exists():
        csv_rows(out_path, [row])
        return
    with open(out_path, newline="") as f:  # earlier rows keep their own facts (commit, machine)
        header = next(csv.reader(f))
    with open(out_path, "a", newline="") as f:
        csv.DictWriter(f, fieldnames=header, restval="", extrasaction="ignore").writerow({**row, **run_facts()})


if __name__ == "__main__":
    main()
