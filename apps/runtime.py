"""What the running app holds: the model (loaded once per process), a result cache, and a
background-callback manager that runs jobs in threads of this process.

Why threads: Dash's ``DiskcacheManager`` runs each background callback in a forked process. A
forked child of a process that has already run PyTorch on several CPU threads can deadlock in the
OpenMP runtime (we saw exactly that), and a child would otherwise have to load the model again.
:class:`ThreadedDiskcacheManager` keeps Dash's protocol (progress, ``set_props``, results in a
``diskcache.Cache``, cancel) but starts a thread instead; cancelling sets a flag that the
computations poll between batches (:func:`should_stop`). Model work is serialised by
``ModelHost.lock`` because hooks are per model, not per thread.

A page asks for its running job's result every 0.3-0.5 s. A job that nobody has asked about for
``ABANDONED_AFTER_S`` seconds -- its page was closed or reloaded -- is cancelled the same way, so an
abandoned job ends within that time or its own time limit, whichever comes first.
"""
from __future__ import annotations

import contextvars
import hashlib
import itertools
import json
import sys
import threading
import time
from typing import Any, Callable, Optional

import torch
from dash import DiskcacheManager

import steerkit
from steerkit.bounded import BoundedDict

_cancel_event: contextvars.ContextVar[Optional[threading.Event]] = contextvars.ContextVar("steerkit_app_cancel",
                                                                                         default=None)


#: seconds without a poll after which a running job counts as abandoned and is cancelled (a hidden tab's
#: timers are slowed to one run a minute at most, so a page that is only hidden keeps its job)
ABANDONED_AFTER_S = 180.0


def should_stop() -> bool:
    """True when the background job running in this thread was cancelled."""
    ev = _cancel_event.get()
    return bool(ev is not None and ev.is_set())


class ThreadedDiskcacheManager(DiskcacheManager):
    """A ``DiskcacheManager`` whose jobs are threads of this process (see the module docstring)."""

    _ids = itertools.count(1)

    def __init__(self, cache=None, cache_by=None, expire=None, *, abandoned_after: float = ABANDONED_AFTER_S):
        super().__init__(cache, cache_by, expire)
        self._jobs: dict[int, tuple[threading.Thread, threading.Event]] = {}
        self._jobs_lock = threading.Lock()
        self._counts = {"started": 0, "finished": 0, "cancelled": 0, "abandoned": 0}
        #: when each running job was started or last asked about (``job_running``, on every poll)
        self._seen: dict[int, float] = {}
        self.abandoned_after = float(abandoned_after)
        self._reaper: Optional[threading.Thread] = None

    def call_job_fn(self, key, job_fn, args, context):
        job = next(self._ids)
        ev = threading.Event()

        def target():
            _cancel_event.set(ev)
            try:
                job_fn(key, self._make_progress_key(key), args, context)
            finally:
                with self._jobs_lock:
                    self._jobs.pop(job, None)
                    self._seen.pop(job, None)
                    self._counts["finished"] += 1

        t = threading.Thread(target=target, name=f"steerkit-app-job-{job}", daemon=True)
        with self._jobs_lock:
            self._jobs[job] = (t, ev)
            self._seen[job] = time.monotonic()
            self._counts["started"] += 1
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap, name="steerkit-app-reaper", daemon=True)
                self._reaper.start()
        t.start()
        return job

    def _reap(self) -> None:
        """Cancel the jobs nobody has asked about for ``abandoned_after`` seconds; ends when no job runs."""
        while True:
            time.sleep(min(5.0, self.abandoned_after / 4))
            with self._jobs_lock:
                now = time.monotonic()
                for job, (_, ev) in self._jobs.items():
                    if now - self._seen.get(job, now) > self.abandoned_after and not ev.is_set():
                        ev.set()
                        self._counts["abandoned"] += 1
                if not self._jobs:
                    self._reaper = None
                    return

    def terminate_job(self, job):
        if job is None:
            return
        with self._jobs_lock:
            entry = self._jobs.get(int(job))
            if entry is not None and not entry[1].is_set():
                entry[1].set()
                self._counts["cancelled"] += 1

    def job_counts(self) -> dict[str, int]:
        """Jobs ``started``, ``finished`` (returned, cancelled ones included), ``cancelled`` (asked to
        stop while running: a cancel click, a new request of the same callback, or a fetched result),
        ``abandoned`` (cancelled after ``abandoned_after`` seconds without a poll) and ``running`` now,
        since this manager was made."""
        with self._jobs_lock:
            return {**self._counts, "running": len(self._jobs)}

    def terminate_unhealthy_job(self, job):
        return False

    def job_running(self, job):
        """Whether ``job`` still runs; Dash asks on every poll of its page, which keeps the job alive."""
        with self._jobs_lock:
            entry = self._jobs.get(int(job)) if job else None
            if entry is not None:
                self._seen[int(job)] = time.monotonic()
        return bool(entry is not None and entry[0].is_alive())


def cache_key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


class ModelHost:
    """The model of this process (loaded once, lazily or at start), its lock and a result cache."""

    def __init__(self, model: Any = None, *, max_results: int = 64, threads: Optional[int] = None,
                 load_options: Optional[dict] = None):
        self._spec = model
        #: ``steerkit.load_model``'s keywords for every model loaded here (device, dtype)
        self.load_options = dict(load_options or {})
        self._sm = None if (model is None or isinstance(model, str) or hasattr(model, "__fspath__")) else model
        self._load_lock = threading.Lock()
        self.lock = threading.RLock()
        #: computed results by key, the least recently used dropped past ``max_results``
        self.results: BoundedDict[str, Any] = BoundedDict(max_results)
        self._results_lock = threading.Lock()
        self.max_results = max_results
        self.threads = threads
        self.load_seconds: Optional[float] = None
        self.loads = 0

    @property
    def loaded(self) -> bool:
        return self._sm is not None

    def get(self):
        if self._sm is None:
            with self._load_lock:
                if self._sm is None:
                    if self.threads:
                        torch.set_num_threads(int(self.threads))
                    t = time.perf_counter()
                    print(f"steerkit app: loading model {self._spec or '(default)'} ...", file=sys.stderr, flush=True)
                    self._sm = steerkit.load_model(self._spec, **self.load_options)
                    self.load_seconds = time.perf_counter() - t
                    self.loads += 1
                    print(f"steerkit app: model {self._sm.name} ready in {self.load_seconds:.1f}s", file=sys.stderr,
                          flush=True)
        return self._sm

    @property
    def spec(self):
        """What the current model was loaded from (``None``: the default model)."""
        return self._spec if (self._spec is None or isinstance(self._spec, str) or hasattr(self._spec, "__fspath__")) \
            else getattr(self._sm, "name", None)

    def switch(self, spec: Any):
        """Replace this process's model by ``spec`` (a name or path for ``steerkit.load_model``, or
        ``None`` for the default). Waits for the running model work (``lock``), loads the new model,
        and only then drops the old one: a failed load leaves the current model in place. Cached
        results stay (their keys carry the model name), so switching back finds them again."""
        with self.lock, self._load_lock:
            t = time.perf_counter()
            print(f"steerkit app: switching to model {spec or '(default)'} ...", file=sys.stderr, flush=True)
            sm = steerkit.load_model(spec, **self.load_options)
            self._sm, self._spec = sm, spec
            self.load_seconds = time.perf_counter() - t
            self.loads += 1
            print(f"steerkit app: model {sm.name} ready in {self.load_seconds:.1f}s", file=sys.stderr, flush=True)
        return sm

    # --- results ------------------------------------------------------------------------
    def put(self, key: str, value: Any) -> str:
        with self._results_lock:
            self.results[key] = value
        return key

    def result(self, key: Optional[str]):
        if not key or not isinstance(key, str):
            return None
        with self._results_lock:
            return self.results.get(key)

    def forget(self, key: str) -> None:
        """Drop the cached result for ``key`` (a result cut short is not cached)."""
        with self._results_lock:
            self.results.pop(key, None)

    def keep_partial(self, key: str, value: Any) -> str:
        """A result cut short by a time limit is not what its settings give: drop it from ``key`` (the
        settings' entry) and keep it under a key of its own, which is returned."""
        self.forget(key)
        return self.put(cache_key("partial", key, time.time()), value)

    def cached(self, key: str, compute: Callable[[], Any]):
        """The cached result for ``key``, or compute it (holding the model lock) and cache it."""
        hit = self.result(key)
        if hit is not None:
            return hit, True
        with self.lock:
            hit = self.result(key)
            if hit is not None:
                return hit, True
            value = compute()
        self.put(key, value)
        return value, False
