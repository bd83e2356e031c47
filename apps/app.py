"""The Dash app: :func:`create_app` builds it, :func:`run` serves it (127.0.0.1 by default).

One model per process (:class:`~steerkit.apps.runtime.ModelHost`), background callbacks in
threads of this process (:class:`~steerkit.apps.runtime.ThreadedDiskcacheManager`, results of the
Dash protocol in a ``diskcache`` folder), computed results cached by their inputs.

Every request passes :func:`host_guard` first (a Flask ``before_request``): its ``Host`` header,
and its ``Origin`` header when it has one, must name an allowed host -- by default
``127.0.0.1``, ``localhost`` and ``[::1]`` at the app's port -- else it gets 403 and reaches no
callback (a page of another site rebound to 127.0.0.1 by DNS sends its own name as ``Host``).
Request bodies are bounded by ``MAX_REQUEST_BYTES``.

:func:`run` serves the app with waitress, a production WSGI server, in one process (the model and the
background jobs live in it): ``SERVER_THREADS`` requests are answered at once, more wait in its queue,
and a body over ``MAX_REQUEST_BYTES`` is refused with 413 before the app reads it. ``--debug`` uses
Flask's development server instead (Dash's debug tools need it).
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional
from urllib.parse import urlsplit

from steerkit.errors import InputError
from steerkit.loading.resolve import local_models
from steerkit.vectors.store import default_store_path

from .data import MAX_REQUEST_BYTES, MODEL_DEADLINE_S, TUNE_DEADLINE_S

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
#: the names a browser on this machine uses for a local app (the Host check's default)
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
#: bind addresses that name no host a browser would send (every interface)
ANY_ADDRESS = ("0.0.0.0", "::", "")
#: requests the server answers at once (waitress' worker threads; background jobs run in threads of
#: their own, so a long computation holds a worker only for the moment it takes to start)
SERVER_THREADS = 8
#: open connections the server keeps; past that it accepts new ones only as others close
SERVER_CONNECTIONS = 100


@dataclass
class AppEnv:
    host: Any
    store_path: str
    results_path: str
    #: what the model picker may load besides the listed models: the start-up model and the
    #: paths typed into the model box that loaded (value -> label)
    extra_models: dict = field(default_factory=dict)
    #: folders whose models the picker lists (``--model`` folders at start-up)
    model_dirs: list = field(default_factory=list)
    #: seconds of model work one request may take
    deadline: float = MODEL_DEADLINE_S
    #: seconds one tune of the Tune page may take (a background job with progress and cancel)
    tune_deadline: float = TUNE_DEADLINE_S
    lock: Any = field(default_factory=threading.Lock)

    def listed_models(self) -> list[dict]:
        """The models the picker offers: the embedded default, the Hugging Face cache,
        ``$STEERKIT_MODELS`` and the start-up folders, then the start-up model and typed paths."""
        out = local_models(self.model_dirs)
        seen = {m["value"] for m in out}
        with self.lock:
            extra = dict(self.extra_models)
        for value, label in extra.items():
            if value not in seen:
                out.append({"label": label, "value": value, "source": "loaded"})
                seen.add(value)
        return out

    def allow_model(self, value: str, label: str) -> None:
        with self.lock:
            self.extra_models[value] = label


# ============================================================================ Host / Origin check
_HOST_RE = re.compile(r"^(?:\[(?P<v6>[0-9a-fA-F:.]+)\]|(?P<name>[^:\[\]/@\s]+))(?::(?P<port>[0-9]{1,5}))?$")


def parse_host(value: str) -> Optional[tuple[str, Optional[int]]]:
    """``"name:port"`` / ``"[v6]:port"`` / ``"name"`` -> ``(name, port or None)`` (lower case, no
    trailing dot), or ``None`` for anything else."""
    m = _HOST_RE.match((value or "").strip())
    if not m:
        return None
    name = (m.group("v6") or m.group("name")).lower().rstrip(".")
    port = int(m.group("port")) if m.group("port") else None
    return (name, port) if name else None


def allowed_hosts(port: Optional[int] = None, bind: Optional[str] = None,
                  extra: Iterable[str] = ()) -> frozenset:
    """The ``(name, port)`` pairs a request may name in ``Host`` / ``Origin``: the loopback names
    at ``port``, the bind address (unless it is every interface) and each of ``extra`` (``name``
    at ``port``, or ``name:port``). ``port=None``: any port (an app not bound to one, in tests)."""
    names = list(LOOPBACK_NAMES)
    if bind and bind.strip("[]") not in ANY_ADDRESS:
        names.append(bind.strip("[]"))
    out = {(n.lower(), port) for n in names}
    for e in extra:
        parsed = parse_host(e if not (":" in e and e.count(":") > 1 and not e.startswith("[")) else f"[{e}]")
        if parsed is None:
            raise InputError(f"expected an allowed host like 'example.org' or 'example.org:8050', found {e!r}")
        out.add((parsed[0], parsed[1] if parsed[1] is not None else port))
    return frozenset(out)


def host_allowed(value: Optional[str], allowed: frozenset) -> bool:
    parsed = parse_host(value or "")
    if parsed is None:
        return False
    name, port = parsed
    return any(n == name and (p is None or p == port) for n, p in allowed)


def origin_allowed(origin: str, allowed: frozenset) -> bool:
    """An ``Origin`` header (``scheme://host[:port]``) naming an allowed host."""
    try:
        u = urlsplit(origin.strip())
        if u.scheme not in ("http", "https") or not u.netloc or u.path not in ("", "/") or u.username:
            return False
        port = u.port if u.port is not None else (443 if u.scheme == "https" else 80)
    except ValueError:
        return False
    host = u.hostname or ""
    return host_allowed(f"[{host}]:{port}" if ":" in host else f"{host}:{port}", allowed)


def install_host_guard(server, allowed: frozenset) -> None:
    """Refuse, with 403, every request of ``server`` (a Flask app) whose ``Host`` -- or ``Origin``,
    when it sends one -- is not in ``allowed``; runs before every other request hook."""
    from flask import Response, request

    def host_guard():
        host = request.headers.get("Host")
        origin = request.headers.get("Origin")
        if not host_allowed(host, allowed):
            why = "Host"
        elif origin is not None and not origin_allowed(origin, allowed):
            why = "Origin"
        else:
            return None
        return Response(f"forbidden: this steerkit app answers only requests for {sorted_hosts(allowed)}; the "
                        f"request's {why} header names another site (start the app with --allowed-host NAME "
                        "to allow one)\n", status=403, mimetype="text/plain")

    server.before_request_funcs.setdefault(None, []).insert(0, host_guard)
    server.config["MAX_CONTENT_LENGTH"] = MAX_REQUEST_BYTES


def sorted_hosts(allowed: frozenset) -> str:
    def fmt(n, p):
        h = f"[{n}]" if ":" in n else n
        return h if p is None else f"{h}:{p}"
    return ", ".join(fmt(n, p) for n, p in sorted(allowed, key=lambda x: (x[0], x[1] or 0)))


def default_results_path() -> str:
    return os.environ.get("STEERKIT_RESULTS") or "./steerkit-results"


def create_app(model: Any = None, *, store: Optional[str] = None, results: Optional[str] = None,
               preload: bool = True, threads: Optional[int] = None, cache_dir: Optional[str] = None,
               port: Optional[int] = None, bind: Optional[str] = None, allowed: Iterable[str] = (),
               model_dirs: Iterable[str] = (), deadline: float = MODEL_DEADLINE_S,
               load_options: Optional[dict] = None):
    """Build the explorer. ``model``: a loaded SteerModel, a path/name for ``steerkit.load_model``, or
    ``None`` (the default model). ``preload`` loads it now rather than on the first request.

    ``port`` / ``bind`` / ``allowed``: what the Host check lets through (:func:`allowed_hosts`;
    ``port=None`` accepts the loopback names at any port). ``model_dirs``: folders whose models the
    picker lists. ``deadline``: seconds of model work per request. ``load_options``: keywords of
    ``steerkit.load_model`` for every model the app loads (``device``, ``dtype``). ``cache_dir``: the background
    jobs' cache folder; without one the app makes its own and removes it when it closes (``app.steerkit_close()``,
    or at exit)."""
    # dash, diskcache and the modules built on dash load here: ``check_host`` / ``run`` are imported
    # by the CLI, which must start (and say what is missing) without the app extra installed
    import diskcache
    from dash import Dash

    from . import callbacks, layout
    from .runtime import ModelHost, ThreadedDiskcacheManager

    host = ModelHost(model, threads=threads, load_options=load_options)
    if preload:
        host.get()
    if store is None:
        store = str(default_store_path())
    results = results or default_results_path()
    own_cache = cache_dir is None
    cache = diskcache.Cache(cache_dir or tempfile.mkdtemp(prefix="steerkit-app-cache-"))
    manager = ThreadedDiskcacheManager(cache)
    app = Dash(__name__, title="steerkit explorer", background_callback_manager=manager,
               suppress_callback_exceptions=False, update_title=None)
    # the app's own cache folder goes with the app, at exit at the latest; ``app.steerkit_close()`` removes it now
    app.steerkit_close = weakref.finalize(app, _remove_cache, cache) if own_cache else cache.close
    # the layer slider follows the loaded model's facts; with no model loaded yet it has no layers
    n_layers = host.get().facts.n_layers if host.loaded else None
    label = (layout.model_label(host.get()) if host.loaded
             else f"no model loaded ({model or 'the default model'} loads on first use)")
    spec = host.spec
    current = layout.DEFAULT_MODEL_VALUE if spec is None else str(spec)
    env = AppEnv(host=host, store_path=str(store), results_path=str(results), model_dirs=list(model_dirs),
                 deadline=float(deadline))
    if spec is not None:  # the start-up model stays pickable
        env.allow_model(str(spec), f"{host.get().name} ({spec})" if host.loaded else str(spec))
    install_host_guard(app.server, allowed_hosts(port, bind, allowed))
    app.layout = layout.shell(label, n_layers, str(store), str(results), models=env.listed_models(),
                              current_model=current)
    callbacks.register(app, env)
    app.steerkit_env = env  # for tests and benchmarks
    return app


def _remove_cache(cache: Any) -> None:
    """Close a diskcache ``cache`` and remove its folder (the app's own, made when no ``cache_dir`` was given)."""
    cache.close()
    shutil.rmtree(cache.directory, ignore_errors=True)


def check_host(host: str, allow_remote: bool) -> None:
    """Refuse a non-local bind unless ``allow_remote``; warn when it is allowed."""
    if host in LOCAL_HOSTS:
        return
    if not allow_remote:
        raise InputError(f"expected a local host (127.0.0.1), found {host!r}; binding elsewhere exposes the model and "
                         "the store to the network -- pass --allow-remote if you really mean it")
    print(f"WARNING: steerkit app is listening on {host}: anyone who can reach this address can run the model and "
          "read and write the artifact store. There is no authentication.", file=sys.stderr, flush=True)


def run(model: Any = None, *, host: str = "127.0.0.1", port: int = 8050, allow_remote: bool = False,
        store: Optional[str] = None, results: Optional[str] = None, threads: Optional[int] = None,
        debug: bool = False, allowed_host: Iterable[str] = (), load_options: Optional[dict] = None) -> None:
    """Serve the explorer (blocking). ``allowed_host``: more host names the Host check accepts;
    ``load_options``: ``steerkit.load_model``'s keywords for every model the app loads (device, dtype)."""
    check_host(host, allow_remote)
    dirs = [model] if isinstance(model, str) and os.path.isdir(model) else []
    if allow_remote and host.strip("[]") in ANY_ADDRESS and not list(allowed_host):
        print("NOTE: bound to every interface: only requests naming 127.0.0.1, localhost or [::1] are answered; "
              "pass --allowed-host NAME for each name clients use to reach this machine.", file=sys.stderr, flush=True)
    app = create_app(model, store=store, results=results, threads=threads, port=port,
                     bind=host if allow_remote else None, allowed=allowed_host, model_dirs=dirs,
                     load_options=load_options)
    if debug:  # Dash's debug tools need Flask's development server
        print(f"steerkit explorer (debug, development server) on {app_url(host, port)}", file=sys.stderr, flush=True)
        app.run(host=host, port=port, debug=True, use_reloader=False, threaded=True)
        return
    server = make_server(app, host, port)
    print(f"steerkit explorer on {app_url(host, port)}", file=sys.stderr, flush=True)
    server.run()


def app_url(host: str, port: int) -> str:
    return f"http://{host if ':' not in host else f'[{host}]'}:{port}/"


def make_server(app, host: str = "127.0.0.1", port: int = 8050, *, threads: int = SERVER_THREADS):
    """The waitress server of ``app`` (a Dash app of :func:`create_app`) at ``host:port``, bound and not
    yet serving: ``.run()`` serves until interrupted, ``.close()`` stops it.

    One process, ``threads`` worker threads, at most ``SERVER_CONNECTIONS`` open connections; a request
    body over ``MAX_REQUEST_BYTES`` is answered 413 by waitress before the app reads it, and proxy
    headers (``X-Forwarded-*``) are not trusted. The Host / Origin check is the app's own
    (:func:`install_host_guard`) and answers 403 whatever server runs it."""
    from waitress import create_server

    return create_server(app.server, host=host, port=port, threads=threads, connection_limit=SERVER_CONNECTIONS,
                         max_request_body_size=MAX_REQUEST_BYTES, clear_untrusted_proxy_headers=True,
                         ident="steerkit")
