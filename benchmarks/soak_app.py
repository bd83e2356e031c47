"""Soak test of the explorer: concurrent headless browsers drive it for a stated time; errors, the longest
response, the app process's memory over time, and what became of every background job.

The app runs in its own process, built and served as ``steerkit app`` serves it (``create_app`` with the
embedded default model, then waitress through ``steerkit.apps.app.make_server``, 127.0.0.1 only), with a
temporary store holding one steering vector (``soak-dir``, a random direction of norm 8 at the middle
layer) and an empty results folder. Besides serving, that process writes its background-job counts
(``ThreadedDiskcacheManager.job_counts``) to a file every 2 s; nothing else is added to it.

``--browsers`` (4) headless Chromium browsers (Debian's ``/usr/bin/chromium`` driven by Playwright), each
in a thread of its own, repeat until ``--duration`` is over (600 s; ``--quick``: 60 s): pick one of the
Profiles, Steer, Patching and Tune pages and one kind of action, fill the page's inputs, press its run
button, and wait for the callback's answer:

* ``valid``: small real work (1-3 built-in pairs, 4-10 new tokens, two patched layers, a 1 x 2 tune grid)
  with random prompts, so that results are rarely cached;
* ``invalid``: a value the page must refuse with a message (unequal lists, a 5,000-digit number in a
  pasted JSON list, layers out of range or not numbers, an answer of two tokens, too many tune layers,
  scales that are not numbers, nothing to tune on ...);
* ``cancel``: a larger job, cancelled with the page's Cancel button 0.3 to 1.5 s after it started;
* ``abandon``: a larger job, then the page is reloaded: nobody fetches that job's result; it must end by
  itself (it finishes, stops at the per-request time limit, or is cancelled after
  ``steerkit.apps.runtime.ABANDONED_AFTER_S`` seconds without a poll).

A response is the time from the click to the final answer of the job that click started (matched by
its Dash ``cacheKey``; for ``cancel``: until the run button is enabled again). Errors are: an HTTP status
of 500 or more from the app, a browser console error, a message of an unexpected error ("Unexpected
error ..."; the server log's tracebacks are counted too), a valid input answered with a warning, an
invalid input answered without one, no answer within 240 s, a job that never started, and an exception
in the driving code. Every ``--sample`` (10) seconds the resident memory (RSS) of the app's process and
its job counts are recorded; growth is the last sample minus the first sample after ``--warmup`` (120 s; quick 20 s),
and the least-squares slope over the samples after the warm-up. After the browsers stop, the script
waits (at most ``--drain``, 300 s) until no job runs: every job started must have finished (completed or
cancelled); one still running is reported as orphaned.

Everything goes to 127.0.0.1 only; the run is bounded in time (duration + 300 s start + 300 s for the
last actions + drain) and in requests (``--max-actions`` per browser), and stops by itself (the app
process exits when its parent does, and after its own lifetime limit).

Usage (repository root; heavy: wrap it in the shared lock)::

    flock /tmp/steerkit-heavy.lock .venv/bin/python benchmarks/soak_app.py            # 10 minutes
    flock /tmp/steerkit-heavy.lock .venv/bin/python benchmarks/soak_app.py --quick    # 1 minute

CSV (``benchmarks/results/soak_app.csv``, ``--out``): columns ``mode`` (quick / full), ``kind``, ``t_s``,
``page``, ``measure``, ``value``, ``unit`` (and the run facts of ``_common.csv_rows``), one row per

* ``kind=rss``: a memory sample: ``t_s`` seconds since the browsers started, ``value`` the app's RSS in MiB;
* ``kind=jobs``: a job-count sample: ``measure`` started / finished / cancelled / abandoned / running,
  ``value`` the count (``ThreadedDiskcacheManager.job_counts``);
* ``kind=action``: per ``page`` and ``measure`` (the action kind) and outcome: ``value`` the count
  (``unit`` count), or the longest / median response (``unit`` s) -- the outcome is in ``measure``
  (``valid ok``, ``invalid warn``, ``cancel cancelled`` ...);
* ``kind=summary``: one figure of the run (``measure``: actions, errors, longest response, RSS after
  warm-up, RSS growth, RSS slope, jobs started / finished / cancelled / abandoned / orphaned, server
  tracebacks).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
sys.path.insert(0, str(C.ROOT / "tests" / "support"))  # the test suite's server helpers
from _servers import free_port  # noqa: E402

ROOT = C.ROOT
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PAGES = ("profiles", "steer", "patching", "tune")
PREFIX = {"profiles": "prof", "steer": "steer", "patching": "patch", "tune": "tune"}
#: a substring of the run callback's ``output`` (Dash's multi-output key) for each page
RUN_OUTPUT = {"profiles": "prof-key.data", "steer": "steer-base.children", "patching": "patch-key.data",
              "tune": "tune-key.data"}
KINDS = ("valid", "invalid", "cancel", "abandon")
WEIGHTS = (0.5, 0.3, 0.15, 0.05)
#: the longest wait for one answer
ANSWER_TIMEOUT_S = 240.0
WORDS = ("river", "lamp", "garden", "robot", "winter", "music", "bread", "train", "ocean", "letter", "forest",
         "coffee", "mountain", "window", "story", "school", "market", "storm", "bicycle", "candle")
HUGE = "9" * 5000
PLACES = ("store", "park", "market", "school", "beach", "office", "station", "garden", "library", "cinema")
#: the layer of the seeded vector ``soak-dir`` (the default model's middle layer, 30 // 2)
SOAK_LAYER = "15"


# ============================================================================ the app's process
def serve(a) -> int:
    """The app process: ``create_app`` + ``make_server`` as ``steerkit app`` does, a seeded store, and a
    thread writing the job counts to ``--stats`` every 2 s."""
    import torch

    from steerkit.apps.app import create_app, make_server
    from steerkit.vectors import SteeringVector, Store

    root = Path(a.root)
    app = create_app(None, store=str(root / "store"), results=str(root / "results"), threads=a.threads,
                     port=a.serve, cache_dir=str(root / "cache"))
    sm = app.steerkit_env.host.get()
    g = torch.Generator().manual_seed(0)
    v = torch.randn(sm.facts.d_model, generator=g)
    Store(root / "store").save("soak-dir", SteeringVector.from_direction(v / v.norm() * 8, sm.n_layers // 2, sm,
                                                                        method="random"))
    manager = app._background_manager
    parent, t_end = os.getppid(), time.monotonic() + a.lifetime
    stats = Path(a.stats)

    def watch():
        while True:
            tmp = stats.with_suffix(".tmp")
            tmp.write_text(json.dumps({"jobs": manager.job_counts(), "threads": threading.active_count()}))
            os.replace(tmp, stats)
            if os.getppid() != parent or time.monotonic() > t_end:  # the soak is gone, or ran past its limit
                os._exit(3)
            time.sleep(2)

    threading.Thread(target=watch, daemon=True).start()
    server = make_server(app, "127.0.0.1", a.serve)
    print(f"soak app on http://127.0.0.1:{a.serve}/", file=sys.stderr, flush=True)
    server.run()
    return 0


def start_app(tmp: Path, threads: int, lifetime: float):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OMP_WAIT_POLICY")}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    (tmp / "results").mkdir(exist_ok=True)
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--root", str(tmp), "--threads",
                             str(threads), "--stats", str(tmp / "stats.json"), "--lifetime", str(int(lifetime))],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while time.monotonic() - t0 < 300:
        if proc.poll() is not None:
            raise SystemExit(f"the app exited: {(tmp / 'server.log').read_text()[-2000:]}")
        try:
            urllib.request.urlopen(url + "/", timeout=5)
            if (tmp / "stats.json").exists():
                return proc, url, time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the app did not start in 300 s")


def job_counts(tmp: Path) -> dict:
    try:
        return json.loads((tmp / "stats.json").read_text())["jobs"]
    except (OSError, ValueError, KeyError):
        return {}


# ============================================================================ one browser
def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Browser(threading.Thread):
    """One headless Chromium repeating random actions until ``t_end`` (or ``max_actions``)."""

    def __init__(self, i: int, url: str, t_end: float, max_actions: int, seed: int, t0: float):
        super().__init__(name=f"soak-browser-{i}", daemon=True)
        self.i, self.url, self.t_end, self.max_actions, self.t0 = i, url, t_end, max_actions, t0
        self.rng = random.Random(seed)
        self.actions: list[dict] = []  # {page, kind, outcome, s, t_s}
        self.errors: list[str] = []
        self.starts: list[tuple[float, str, str]] = []  # (time, page, cacheKey) of each job started
        self.events: list[tuple[float, str, str, str]] = []  # (time, page, cacheKey, final answer as JSON text)
        self.http: dict[int, int] = {}
        self.requests: list[tuple[float, str, str]] = []  # (time, page, first / poll / cancel)
        self.steer_ready = False

    # ---------------------------------------------------------------- the app's answers
    def on_request(self, r) -> None:
        """Every request of a run callback: ``(time, page, first or poll or cancel)``."""
        if "_dash-update-component" not in r.url:
            return
        try:
            out = json.loads(r.post_data or "{}").get("output", "")
        except ValueError:
            return
        page = next((p for p, o in RUN_OUTPUT.items() if o in out), None)
        if page is not None:
            what = "cancel" if "cancelJob" in r.url else "poll" if "cacheKey" in r.url else "first"
            self.requests.append((time.monotonic(), page, what))

    def on_response(self, r) -> None:
        """Count every callback response; for a run callback, note a job's start (its ``cacheKey``) and
        its final answer (the poll of that ``cacheKey`` that carries the outputs, or 204: nothing to update)."""
        if "_dash-update-component" not in r.url:
            return
        self.http[r.status] = self.http.get(r.status, 0) + 1
        if r.status >= 500:
            self.errors.append(f"HTTP {r.status} from {r.url[-80:]}")
        try:
            out = json.loads(r.request.post_data or "{}").get("output", "")
        except ValueError:
            return
        page = next((p for p, o in RUN_OUTPUT.items() if o in out), None)
        if page is None or r.status not in (200, 204):
            return
        key = parse_qs(urlsplit(r.url).query).get("cacheKey", [None])[0]
        if r.status == 204:
            if key:
                self.events.append((time.monotonic(), page, key, "no update"))
            return
        try:
            body = r.json()
        except Exception:  # noqa: BLE001 - a body gone with a reload
            return
        if not isinstance(body, dict):
            return
        if key is None and "cacheKey" in body:
            self.starts.append((time.monotonic(), page, body["cacheKey"]))
        elif key is not None and "response" in body:
            self.events.append((time.monotonic(), page, key, json.dumps(body["response"])))

    def answer(self, pg, page: str, since: float, timeout: float = ANSWER_TIMEOUT_S):
        """The final answer of the first job of ``page``'s run callback started after ``since``:
        ``(time, text)``, or ``None`` when none came within ``timeout`` seconds."""
        end = time.monotonic() + timeout
        while True:
            key = next((k for t, p, k in self.starts if p == page and t >= since), None)
            if key is not None:
                for t, _, k, text in self.events:
                    if k == key:
                        return t, text
            if time.monotonic() >= end:
                return None
            pg.wait_for_timeout(50)

    # ---------------------------------------------------------------- the loop
    def run(self) -> None:
        from playwright.sync_api import sync_playwright
        try:
            with sync_playwright() as p:
                br = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
                pg = br.new_context(viewport={"width": 1300, "height": 1000}).new_page()
                pg.on("console", lambda m: self.errors.append(f"console: {m.text[:300]}") if m.type == "error" else None)
                pg.on("pageerror", lambda e: self.errors.append(f"pageerror: {str(e)[:300]}"))
                pg.on("request", self.on_request)
                pg.on("response", self.on_response)
                pg.set_default_timeout(ANSWER_TIMEOUT_S * 1000)
                pg.goto(self.url + "/profiles")
                pg.wait_for_selector("#prof-run")
                while time.monotonic() < self.t_end and len(self.actions) < self.max_actions:
                    page = self.rng.choice(PAGES)
                    kind = self.rng.choices(KINDS, WEIGHTS)[0]
                    try:
                        self.act(pg, page, kind)
                    except Exception as e:  # noqa: BLE001 - record it, reload, go on
                        self.errors.append(f"driver: {page} {kind}: {type(e).__name__}: {str(e)[:1500]}")
                        self.actions.append({"page": page, "kind": kind, "outcome": "error", "s": None,
                                             "t_s": time.monotonic() - self.t0})
                        pg.goto(self.url + "/" + page)
                        self.steer_ready = False
                    pg.wait_for_timeout(self.rng.uniform(300, 1500))
                br.close()
        except Exception as e:  # noqa: BLE001
            self.errors.append(f"browser {self.i} stopped: {type(e).__name__}: {str(e)[:300]}")

    def show(self, pg, page: str) -> None:
        """Go to ``page`` by its navigation link and wait until it is the one page shown (after a reload
        every page is shown until the app's first callback hides the others)."""
        pg.click(f"#nav-{page}")
        pg.wait_for_function("(p) => Array.from(document.querySelectorAll('[id^=page-]')).every(e => "
                             "(e.id === 'page-' + p) === (e.style.display !== 'none'))", arg=page)

    def act(self, pg, page: str, kind: str) -> None:
        self.show(pg, page)
        prefix = PREFIX[page]
        getattr(self, f"fill_{page}")(pg, kind)
        run = "#steer-run" if page == "steer" else f"#{prefix}-run"
        pg.wait_for_function(f"() => !document.querySelector('{run}').disabled")  # the previous job is over
        t0 = time.monotonic()
        pg.click(run)
        outcome, dt = "?", None
        if kind in ("valid", "invalid"):
            got = self.answer(pg, page, t0)
            if got is None:
                outcome = "timeout"
                self.errors.append(f"no answer: {page} {kind} within {ANSWER_TIMEOUT_S:.0f} s")
            else:
                dt, text = got[0] - t0, got[1]
                outcome = "warn" if "error-message" in text else "ok" if "ok-message" in text else "other"
                if "Unexpected error" in text:
                    self.errors.append(f"unexpected error: {page} {kind}: {text[:300]}")
                    outcome = "unexpected"
                elif kind == "valid" and outcome != "ok":
                    self.errors.append(f"valid input answered {outcome}: {page}: {text[:300]}")
                elif kind == "invalid" and outcome == "ok":
                    self.errors.append(f"invalid input accepted: {page}: {text[:300]}")
        elif kind == "cancel":
            outcome = self.cancel(pg, page, run, f"#{prefix}-cancel", t0)
            dt = time.monotonic() - t0
        else:  # abandon: the page goes away while its job runs
            pg.wait_for_timeout(self.rng.uniform(300, 1000))
            pg.reload()
            pg.wait_for_selector(run)
            self.steer_ready = False
            outcome, dt = "reloaded", time.monotonic() - t0
        self.actions.append({"page": page, "kind": kind, "outcome": outcome, "s": dt, "t_s": time.monotonic() - self.t0})

    def cancel(self, pg, page: str, run: str, cancel: str, t0: float) -> str:
        """Press Cancel 0.3-1.5 s after the job shows its Cancel button, then wait until the page is ready
        again; the outcome: ``cancelled``, ``finished first`` or ``no job`` (an error)."""
        enabled = f"() => !document.querySelector('{cancel}').disabled"
        end = time.monotonic() + ANSWER_TIMEOUT_S
        while time.monotonic() < end and not pg.evaluate(enabled) and not self.answer(pg, page, t0, timeout=0):
            pg.wait_for_timeout(50)
        if not pg.evaluate(enabled) and not self.answer(pg, page, t0, timeout=0):
            sent = [(round(t - t0, 1), what) for t, p, what in self.requests if p == page and t >= t0]
            self.errors.append(f"no job: {page} cancel: neither its Cancel button nor an answer within "
                               f"{ANSWER_TIMEOUT_S:.0f} s; requests of its run callback since the click: {sent[:20]}")
            return "no job"
        pg.wait_for_timeout(self.rng.uniform(300, 1500))
        outcome = "finished first"
        if not self.answer(pg, page, t0, timeout=0) and pg.evaluate(enabled):
            try:
                pg.click(cancel, timeout=5000)
                outcome = "cancelled"
            except Exception:  # noqa: BLE001 - the job ended just then: its button went back
                pass
        pg.wait_for_function(f"() => !document.querySelector('{run}').disabled && "
                             f"document.querySelector('{cancel}').disabled")
        return outcome

    # ---------------------------------------------------------------- the pages' inputs
    def pick(self, pg, dropdown: str, label: str) -> None:
        pg.click(f"#{dropdown}")
        pg.get_by_role("dialog").get_by_text(label, exact=True).click()

    def fill_profiles(self, pg, kind: str) -> None:
        rng = self.rng
        if kind == "valid":
            self.pick(pg, "prof-contrast", rng.choice(["Temporal reversal pairs", "Harmful vs harmless"]))
            pg.fill("#prof-n", str(rng.randint(1, 3)))
            return
        if kind in ("cancel", "abandon"):
            self.pick(pg, "prof-contrast", "Harmful vs harmless")
            pg.fill("#prof-n", str(rng.randint(30, 60)))
            return
        self.pick(pg, "prof-contrast", "My own two prompt lists")
        n = rng.randint(1, 3)
        a, b = [words(rng, 5) for _ in range(n)], [words(rng, 5) for _ in range(n)]
        case = rng.choice(["unequal", "empty", "huge", "bad json"])
        if case == "unequal":
            b = b + [words(rng, 4)]
        elif case == "empty":
            a = b = []
        elif case == "huge":
            a = ["[" + HUGE + "]"]
        else:
            a = ['["' + words(rng, 3) + '", ']
        pg.fill("#prof-a", "\n".join(a))
        pg.fill("#prof-b", "\n".join(b))

    def fill_steer(self, pg, kind: str) -> None:
        rng = self.rng
        if not self.steer_ready:  # the first visit: the picker chose soak-dir and filled the layer box
            pg.wait_for_function("() => document.querySelector('#steer-layers').value !== ''")
            self.steer_ready = True
        pg.fill("#steer-prompt", f"Tell me about {words(rng, 2)}.")
        # soak-dir acts at one layer: the box names it, or is empty (every layer of the artifact)
        if kind == "valid":
            pg.fill("#steer-layers", rng.choice(["", SOAK_LAYER]))
            pg.fill("#steer-max", str(rng.randint(4, 10)))
        elif kind in ("cancel", "abandon"):
            pg.fill("#steer-layers", "")
            pg.fill("#steer-max", str(rng.randint(64, 128)))
        else:
            pg.fill("#steer-max", "8")
            pg.fill("#steer-layers", rng.choice(["abc", "99", "0-999999999999", HUGE[:900], "3,,x", "-5"]))

    def fill_patching(self, pg, kind: str) -> None:
        rng = self.rng
        pg.fill("#patch-answer", " Mary")
        pg.fill("#patch-wrong", " John")
        place = rng.choice(PLACES)  # the same place in both prompts: their tokens line up; results are rarely cached
        pg.fill("#patch-clean", f"When Mary and John went to the {place}, John gave a drink to")
        pg.fill("#patch-corrupted", f"When John and Mary went to the {place}, Mary gave a drink to")
        if kind == "valid":
            lo = rng.randint(0, 28)
            pg.fill("#patch-layers", f"{lo}-{lo + 1}")
        elif kind in ("cancel", "abandon"):
            pg.fill("#patch-layers", "all")
        else:
            case = rng.choice(["layers", "answer", "length", "huge"])
            if case == "layers":
                pg.fill("#patch-layers", rng.choice(["x", "40", "5-2-1", "0-99999999999"]))
            elif case == "answer":
                pg.fill("#patch-layers", "3")
                pg.fill("#patch-answer", " Mary Jane Watson")
            elif case == "length":
                pg.fill("#patch-layers", "3")
                pg.fill("#patch-corrupted", "When John went to the store, Mary gave")
            else:
                pg.fill("#patch-layers", HUGE[:900])

    def fill_tune(self, pg, kind: str) -> None:
        rng = self.rng
        pg.wait_for_function("() => document.querySelector('#tune-layers').value !== ''")
        pg.fill("#tune-prompts", f"Tell me about {words(rng, 2)}.")
        pg.fill("#tune-neutral", "What is the capital of France?")
        pg.fill("#tune-words", ", ".join(rng.sample(WORDS, 3)))
        if kind == "valid":
            pg.fill("#tune-layers", str(rng.randint(10, 20)))
            pg.fill("#tune-scales", f"0, {rng.choice([2, 4, 6, 8])}")
            pg.fill("#tune-max", str(rng.randint(3, 5)))
        elif kind in ("cancel", "abandon"):
            lo = rng.randint(8, 16)
            pg.fill("#tune-layers", f"{lo}-{lo + 2}")
            pg.fill("#tune-scales", "0, 2, 4")
            pg.fill("#tune-max", "12")
        else:
            case = rng.choice(["layers", "scales", "prompts", "words"])
            pg.fill("#tune-max", "4")
            pg.fill("#tune-layers", "0-29" if case == "layers" else "12")
            pg.fill("#tune-scales", rng.choice(["a, b", "1e999", HUGE[:900]]) if case == "scales" else "0, 4")
            if case == "prompts":
                pg.fill("#tune-prompts", "")
            if case == "words":
                pg.fill("#tune-words", " , ")


# ============================================================================ the run
def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``(t, y)`` points (y per second), 0 for fewer than two."""
    if len(points) < 2:
        return 0.0
    return statistics.linear_regression([t for t, _ in points], [y for _, y in points]).slope


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of browsing (default 600)")
    ap.add_argument("--quick", action="store_true", help="60 s of browsing, 20 s warm-up")
    ap.add_argument("--browsers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the app (default 1)")
    ap.add_argument("--sample", type=float, default=10.0, help="seconds between memory samples")
    ap.add_argument("--warmup", type=float, default=None, help="seconds before growth is counted (120; quick 20)")
    ap.add_argument("--drain", type=float, default=300.0, help="seconds to wait for the last jobs at the end")
    ap.add_argument("--max-actions", type=int, default=5000, help="actions per browser at most")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "soak_app.csv"), help="CSV of the results")
    # the app's process (started by this script)
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--root", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--stats", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--lifetime", type=float, default=3600.0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve is not None:
        return serve(a)
    if a.quick:
        a.duration = 60.0
    warmup = a.warmup if a.warmup is not None else (20.0 if a.quick else 120.0)
    mode = "quick" if a.quick else "full"
    tmp = Path(tempfile.mkdtemp(prefix="soak-app-"))
    lifetime = a.duration + 300 + ANSWER_TIMEOUT_S + 60 + a.drain + 120
    proc, url, startup = start_app(tmp, a.threads, lifetime)
    print(f"app up in {startup:.1f} s at {url} (pid {proc.pid}); {a.browsers} browsers for {a.duration:.0f} s",
          flush=True)
    import psutil
    ps = psutil.Process(proc.pid)
    rss: list[tuple[float, float]] = []
    jobs: list[tuple[float, dict]] = []
    stop = threading.Event()
    t0 = time.monotonic()

    def sample():
        while True:
            t = time.monotonic() - t0
            try:
                rss.append((t, ps.memory_info().rss / 2 ** 20))
            except psutil.Error:
                return
            jobs.append((t, job_counts(tmp)))
            if stop.wait(a.sample):
                return

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    browsers = [Browser(i, url, t0 + a.duration, a.max_actions, a.seed * 100 + i, t0) for i in range(a.browsers)]
    try:
        for b in browsers:
            b.start()
            time.sleep(2)  # staggered starts
        for b in browsers:
            b.join(max(1.0, t0 + a.duration + ANSWER_TIMEOUT_S + 60 - time.monotonic()))
        stuck = [b.name for b in browsers if b.is_alive()]
        t_browsers = time.monotonic() - t0
        drain_end = time.monotonic() + a.drain
        while time.monotonic() < drain_end and job_counts(tmp).get("running", 1):
            time.sleep(1)
        final = job_counts(tmp)
        t_drained = time.monotonic() - t0
        rss.append((t_drained, ps.memory_info().rss / 2 ** 20))
        jobs.append((t_drained, final))
    finally:
        stop.set()
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    log = (tmp / "server.log").read_text(errors="replace")
    return report(a, mode, browsers, stuck, rss, jobs, final, warmup, startup, t_browsers, t_drained, log)


def report(a, mode, browsers, stuck, rss, jobs, final, warmup, startup, t_browsers, t_drained, log) -> int:
    actions = [x for b in browsers for x in b.actions]
    errors = [e for b in browsers for e in b.errors] + [f"browser thread still running: {n}" for n in stuck]
    tracebacks = log.count("Traceback (most recent call last)")
    timed = [x for x in actions if x["s"] is not None]
    longest = max(timed, key=lambda x: x["s"]) if timed else None
    after = [(t, y) for t, y in rss if t >= warmup]
    growth = after[-1][1] - after[0][1] if len(after) >= 2 else float("nan")
    rate = slope(after) * 60
    orphaned = final.get("running", -1)
    http = {}
    for b in browsers:
        for k, v in b.http.items():
            http[k] = http.get(k, 0) + v
    rows: list[dict] = []

    def row(kind, measure, value, unit="", t_s="", page=""):
        rows.append({"mode": mode, "kind": kind, "t_s": t_s if t_s == "" else round(t_s, 1), "page": page,
                     "measure": measure, "value": value, "unit": unit})
    for t, y in rss:
        row("rss", "rss", round(y, 1), "MiB", t)
    for t, counts in jobs:
        for k in ("started", "finished", "cancelled", "abandoned", "running"):
            if k in counts:
                row("jobs", k, counts[k], "count", t)
    print(f"\nsoak of the explorer ({mode}): {a.browsers} browsers, {a.duration:.0f} s of browsing, default model, "
          f"{a.threads} torch thread(s); app start {startup:.1f} s")
    table = []
    groups: dict[tuple, list] = {}
    for x in actions:
        groups.setdefault((x["page"], x["kind"], x["outcome"]), []).append(x)
    for (page, kind, outcome), xs in sorted(groups.items()):
        ss = [x["s"] for x in xs if x["s"] is not None]
        row("action", f"{kind} {outcome}", len(xs), "count", page=page)
        if ss:
            row("action", f"{kind} {outcome} longest", round(max(ss), 2), "s", page=page)
            row("action", f"{kind} {outcome} median", round(statistics.median(ss), 2), "s", page=page)
        table.append([page, kind, outcome, len(xs), f"{statistics.median(ss):.2f}" if ss else "",
                      f"{max(ss):.2f}" if ss else ""])
    print(C.table(["page", "action", "outcome", "n", "median s", "longest s"], table))
    summary = [("actions", len(actions), "count"), ("errors", len(errors), "count"),
               ("server tracebacks", tracebacks, "count"),
               ("longest response", round(longest["s"], 2) if longest else "", "s"),
               ("HTTP 5xx", sum(v for k, v in http.items() if k >= 500), "count"),
               ("RSS after warm-up", round(after[0][1], 1) if after else "", "MiB"),
               ("RSS at the end", round(rss[-1][1], 1) if rss else "", "MiB"),
               ("RSS peak", round(max(y for _, y in rss), 1) if rss else "", "MiB"),
               ("RSS growth after warm-up", round(growth, 1), "MiB"),
               ("RSS slope after warm-up", round(rate, 2), "MiB/min"),
               ("jobs started", final.get("started", ""), "count"),
               ("jobs finished", final.get("finished", ""), "count"),
               ("jobs cancelled", final.get("cancelled", ""), "count"),
               ("jobs abandoned (cancelled for want of a poll)", final.get("abandoned", ""), "count"),
               ("jobs orphaned", orphaned, "count"),
               ("seconds until the last job ended", round(t_drained - t_browsers, 1), "s")]
    for m, v, u in summary:
        row("summary", m, v, u)
    w = max(len(m) for m, _, _ in summary)
    for m, v, u in summary:
        print(f"  {m:<{w}}  {v} {u}")
    if longest:
        print(f"  longest response: {longest['page']} {longest['kind']} ({longest['outcome']}) at "
              f"t={longest['t_s']:.0f} s")
    print(f"  HTTP statuses of callback requests: {dict(sorted(http.items()))}")
    for e in errors[:30]:
        print(f"  error: {e}")
    print(f"wrote {len(rows)} rows to {C.csv_rows(Path(a.out), rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
