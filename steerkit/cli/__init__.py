"""The ``steerkit`` command line.

Subcommands are small functions over the Python API: ``info`` prints a model
summary and its hook names, ``record`` turns a prompts file into a sharded
activations folder (resumable, with progress), ``demo`` runs the quick-start
pipeline. Other packages add subcommands through ``register(subparsers)`` /
``run(args)`` pairs (``steerkit vectors ...``). Exit codes: 0 success; 2 bad usage
(argparse) or any :class:`~steerkit.errors.SteerkitError`, printed as one line
``steerkit: error: <message>`` on stderr (the message says what was expected, what
was found and what to do); 1 an operating-system error (disk full, permission
denied...), printed the same way; 130 interrupted.
"""
from __future__ import annotations

import argparse
import sys

from steerkit import __version__
from steerkit.cli import app, circuits, core, methods, probes, refusal, sae, serve, vectors
from steerkit.cli._common import run_verb

#: the verb groups, each a module with ``register(subparsers)`` (and ``run(args)`` for verbs that set no func)
GROUPS = (core, vectors, probes, refusal, app, methods, serve, sae, circuits)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="steerkit", description="Record, find, edit and deploy directions in "
                                "a language model's residual stream.")
    p.add_argument("--version", action="version", version=f"steerkit {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    for mod in GROUPS:
        mod.register(sub)
        for sp in sub.choices.values():
            if sp.get_default("func") is None and hasattr(mod, "run"):
                sp.set_defaults(func=mod.run)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = []
    if argv[:1] == ["serve"] and "--" in argv:  # steerkit serve DIR [options] -- [vLLM's own options]
        i = argv.index("--")
        argv, passthrough = argv[:i], argv[i + 1:]
    args = parser.parse_args(argv)
    if passthrough:
        args.vllm_args = passthrough
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return run_verb(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
