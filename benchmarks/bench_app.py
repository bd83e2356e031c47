"""The explorer's latency, measured in a real headless browser (Debian chromium + Playwright).

1. **Request -> rendered profile**: click Compute on the Profiles page (temporal reversal pairs, 20 by
   default) and wait until the plot shows one point per layer; cold (computed) and again (cached).
2. **Responsiveness during a background computation**: while a second, uncached 20-pair profile
   (harmful vs harmless) computes in the background, (a) repeatedly
   switch pages Profiles -> Store (a callback round trip), and (b) fetch ``/_dash-layout`` over HTTP;
   the same measured on an idle server for comparison.

Usage (repository root)::

    .venv/bin/python benchmarks/bench_app.py            # 20 pairs
    .venv/bin/python benchmarks/bench_app.py --quick    # 5 pairs
    .venv/bin/python benchmarks/bench_app.py --json out.json

Rows go to ``benchmarks/results/app.csv`` (``--out``): one row per measure, its value and unit.
The server runs with one torch thread (``--threads 1``); numbers are wall-clock, so a busy shared
machine inflates them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
sys.path.insert(0, str(C.ROOT / "tests" / "support"))  # the test suite's server helpers
from _servers import free_port  # noqa: E402

ROOT = C.ROOT
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def start_server(tmp: Path, threads: int):
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "steerkit.apps", "--port", str(port), "--threads", str(threads),
                             "--store", str(tmp / "store"), "--results", str(tmp / "results")],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 300:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {(tmp / 'server.log').read_text()[-2000:]}")
        try:
            urllib.request.urlopen(url + "/", timeout=5)
            return proc, url, time.perf_counter() - t0
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not start in 300 s")


def http_latencies(url, stop: threading.Event, out: list):
    while not stop.is_set():
        t = time.perf_counter()
        urllib.request.urlopen(url + "/_dash-layout", timeout=60).read()
        out.append(time.perf_counter() - t)
        time.sleep(0.2)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="5 pairs")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "app.csv"), help="CSV of the results")
    a = ap.parse_args(argv)
    pairs = 5 if a.quick else a.pairs
    from playwright.sync_api import sync_playwright

    tmp = Path(tempfile.mkdtemp(prefix="bench-app-"))
    proc, url, startup = start_server(tmp, a.threads)
    res = {"pairs": pairs, "threads": a.threads, "server_start_s": round(startup, 2)}
    try:
        with sync_playwright() as p:
            br = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            pg = br.new_page(viewport={"width": 1300, "height": 1000})
            pg.set_default_timeout(600_000)
            pg.goto(url + "/profiles")
            pg.wait_for_selector("#prof-run")
            pg.fill("#prof-n", str(pairs))

            def rendered(n_pairs, contrast):
                pg.wait_for_function(
                    "([n, c]) => { const s = document.querySelector('#prof-status').innerText;"
                    " const d = document.querySelector('#prof-graph .js-plotly-plot');"
                    " const t = d && d.data && d.data.find(t => t.name === 'relative divergence');"
                    " return s.includes(n + ' pairs') && t && t.x.length === 30"
                    " && d.layout.title.text.includes(c); }", arg=[n_pairs, contrast], timeout=600_000)

            t = time.perf_counter()
            pg.click("#prof-run")
            rendered(pairs, "temporal")
            res["profile_cold_s"] = round(time.perf_counter() - t, 3)
            pg.evaluate("() => { document.querySelector('#prof-status').innerText = ''; }")
            t = time.perf_counter()
            pg.click("#prof-run")
            rendered(pairs, "temporal")
            res["profile_cached_s"] = round(time.perf_counter() - t, 3)

            def toggle_latency():
                """Navigate Profiles -> Store (a callback round trip that does not depend on the running
                job: callbacks whose inputs are the job's outputs wait for it by Dash's design)."""
                t = time.perf_counter()
                pg.click("#nav-store")
                pg.wait_for_function("() => document.querySelector('#page-store').style.display !== 'none'"
                                     " && document.querySelector('#page-profiles').style.display === 'none'")
                dt = time.perf_counter() - t
                pg.click("#nav-profiles")
                pg.wait_for_function("() => document.querySelector('#page-profiles').style.display !== 'none'")
                return dt

            idle_toggle = [toggle_latency() for _ in range(5)]
            stop, idle_http = threading.Event(), []
            th = threading.Thread(target=http_latencies, args=(url, stop, idle_http))
            th.start()
            time.sleep(2)
            stop.set()
            th.join()

            # second, uncached profile in the background; measure while it runs
            pg.click("#prof-contrast")
            pg.get_by_text("Harmful vs harmless").click()
            busy_http, stop = [], threading.Event()
            th = threading.Thread(target=http_latencies, args=(url, stop, busy_http))
            t = time.perf_counter()
            pg.click("#prof-run")
            th.start()
            busy_toggle = []
            while True:
                busy_toggle.append(toggle_latency())
                status = pg.inner_text("#prof-status")
                if f"{pairs} pairs" in status and "harmful" in pg.evaluate(
                        "() => document.querySelector('#prof-graph .js-plotly-plot').layout.title.text"):
                    break
                if time.perf_counter() - t > 600:
                    break
            stop.set()
            th.join()
            res["background_profile_s"] = round(time.perf_counter() - t, 3)

            def med(xs: list[float]) -> float | None:
                return round(statistics.median(xs) * 1000, 1) if xs else None

            res.update({"idle_toggle_ms": med(idle_toggle), "busy_toggle_ms": med(busy_toggle),
                        "busy_toggle_max_ms": round(max(busy_toggle) * 1000, 1), "busy_toggle_n": len(busy_toggle),
                        "idle_http_ms": med(idle_http), "busy_http_ms": med(busy_http),
                        "busy_http_max_ms": round(max(busy_http) * 1000, 1) if busy_http else None})
            br.close()
    finally:
        proc.terminate()
        proc.wait(10)
    print(f"explorer latency, {pairs} pairs, {a.threads} torch thread(s), default model")
    rows = [("server start (model load included)", f"{res['server_start_s']:.1f} s"),
            (f"request -> rendered profile, {pairs} pairs (computed)", f"{res['profile_cold_s']:.2f} s"),
            (f"request -> rendered profile, {pairs} pairs (cached)", f"{res['profile_cached_s']:.2f} s"),
            ("second profile in the background, total", f"{res['background_profile_s']:.2f} s"),
            ("page switch (callback round trip), idle (median)", f"{res['idle_toggle_ms']} ms"),
            ("page switch (callback round trip), during background job (median / max)",
             f"{res['busy_toggle_ms']} / {res['busy_toggle_max_ms']} ms (n={res['busy_toggle_n']})"),
            ("GET /_dash-layout, idle (median)", f"{res['idle_http_ms']} ms"),
            ("GET /_dash-layout, during background job (median / max)",
             f"{res['busy_http_ms']} / {res['busy_http_max_ms']} ms")]
    w = max(len(r[0]) for r in rows)
    for k, v in rows:
        print(f"  {k:<{w}}  {v}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    units = {"_s": "s", "_ms": "ms", "_n": "count"}
    out = [{"mode": "quick" if a.quick else "full", "pairs": pairs, "threads": a.threads, "measure": k,
            "value": "" if v is None else v, "unit": next((u for sfx, u in units.items() if k.endswith(sfx)), "")}
           for k, v in res.items() if k not in ("pairs", "threads")]
    print(f"wrote {len(out)} rows to {C.csv_rows(Path(a.out), out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
