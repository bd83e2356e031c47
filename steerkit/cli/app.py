"""``steerkit app``: serve the visual explorer (``steerkit.apps``) on 127.0.0.1.

Wiring: the main CLI calls :func:`register` with its sub-parsers and :func:`run` with the parsed
arguments. ``python -m steerkit.apps`` runs :func:`main`. Binding anywhere but localhost needs
``--allow-remote`` and prints a warning; the app answers only requests whose ``Host`` (and
``Origin``) name 127.0.0.1, localhost, [::1], the bound address or an ``--allowed-host``.
"""
from __future__ import annotations

import argparse
import importlib.util
from typing import Any

from steerkit.apps.app import allowed_hosts, check_host
from steerkit.apps.app import run as serve_app
from steerkit.cli._common import add_model_options, check_min, check_port, check_store_path, model_options, run_group
from steerkit.errors import InputError

#: what the explorer imports when it starts (the 'app' extra)
APP_DEPENDENCIES = ("dash", "diskcache", "plotly", "waitress")


def register(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("app", help="the visual explorer: divergence profiles, probes, live steering",
                              description="Serve the steerkit explorer (a local Plotly Dash app).")
    add_model_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8050)
    p.add_argument("--allow-remote", action="store_true", help="allow binding a non-local address (no auth!)")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME[:PORT]",
                   help="a host name the app answers besides 127.0.0.1, localhost and [::1] (repeatable); "
                   "requests whose Host or Origin header names any other host get 403")
    p.add_argument("--store", default=None, help="artifact store (default: $STEERKIT_STORE or ./steerkit-store)")
    p.add_argument("--results", default=None, help="folder with saved probe sweeps / MI results "
                   "(default: $STEERKIT_RESULTS or ./steerkit-results)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--debug", action="store_true", help="Dash debug mode (development only)")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    check_port(args.port)
    check_host(args.host, args.allow_remote)
    check_store_path(args.store)
    check_store_path(args.results, "--results")
    check_min(args.threads, "--threads", 1)
    allowed_hosts(args.port, None, args.allowed_host)  # a malformed --allowed-host fails before the model loads
    missing = [m for m in APP_DEPENDENCIES if importlib.util.find_spec(m) is None]
    if missing:
        raise InputError(f"expected the app's dependencies {list(APP_DEPENDENCIES)} in this Python environment, "
                         f"found {missing} missing; install the 'app' extra: pip install 'steerkit[app]'")
    serve_app(args.model, host=args.host, port=args.port, allow_remote=args.allow_remote, store=args.store,
              results=args.results, threads=args.threads, debug=args.debug, allowed_host=args.allowed_host,
              load_options=model_options(args))
    return 0


def main(argv=None) -> int:
    """``steerkit app ARGV...`` (``python -m steerkit.apps``)."""
    return run_group(register, "app", argv)
