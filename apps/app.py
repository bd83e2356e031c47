"""The Dash app: :func:`create_app` builds it, :func:`run` serves it (127.0.0.1 by default).

One model per process (:class:`~steerkit.apps.runtime.ModelHost`), background callbacks in
threads of this process (:class:`~steerkit.apps.runtime.ThreadedDiskcacheManager`, results of the
Dash protocol in a ``diskcache`` folder), computed results cached by their inputs.
"""
from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Optional

from steerkit.errors import InputError
from steerkit.loading import local_models
from steerkit.vectors.store import default_store_path

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass
class AppEnv:
    host: Any
    store_path: str
    results_path: str


def default_results_path() -> str:
    return os.environ.get("STEERKIT_RESULTS") or "./steerkit-results"


def create_app(model: Any = None, *, store: Optional[str] = None, results: Optional[str] = None,
               preload: bool = True, threads: Optional[int] = None, cache_dir: Optional[str] = None):
    """Build the explorer. ``model``: a loaded SteerModel, a path/name for ``steerkit.load_model``, or
    ``None`` (the default model). ``preload`` loads it now rather than on the first request."""
    # dash, diskcache and the modules built on dash load here: ``check_host`` / ``run`` are imported
    # by the CLI, which must start (and say what is missing) without the app extra installed
    import diskcache
    from dash import Dash

    from . import callbacks, layout
    from .runtime import ModelHost, ThreadedDiskcacheManager

    host = ModelHost(model, threads=threads)
    if preload:
        host.get()
    if store is None:
        store = str(default_store_path())
    results = results or default_results_path()
    cache = diskcache.Cache(cache_dir or tempfile.mkdtemp(prefix="steerkit-app-cache-"))
    manager = ThreadedDiskcacheManager(cache)
    app = Dash(__name__, title="steerkit explorer", background_callback_manager=manager,
               suppress_callback_exceptions=False, update_title=None)
    # the layer slider follows the loaded model's facts; with no model loaded yet it has no layers
    n_layers = host.get().facts.n_layers if host.loaded else None
    label = (layout.model_label(host.get()) if host.loaded
             else f"no model loaded ({model or 'the default model'} loads on first use)")
    spec = host.spec
    current = layout.DEFAULT_MODEL_VALUE if spec is None else str(spec)
    app.layout = layout.shell(label, n_layers, str(store), str(results), models=local_models(),
                              current_model=current)
    env = AppEnv(host=host, store_path=str(store), results_path=str(results))
    callbacks.register(app, env)
    app.steerkit_env = env  # for tests and benchmarks
    return app


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
        debug: bool = False) -> None:
    """Serve the explorer (blocking)."""
    check_host(host, allow_remote)
    app = create_app(model, store=store, results=results, threads=threads)
    print(f"steerkit explorer on http://{host if ':' not in host else f'[{host}]'}:{port}/", file=sys.stderr, flush=True)
    app.run(host=host, port=port, debug=debug, use_reloader=False, threaded=True)
