"""The ``steerkit`` command line.

Subcommands are small functions over the Python API: ``info`` prints a model
summary and its hook names, ``record`` turns a prompts file into a sharded
activations folder (resumable, with progress), ``demo`` runs the quick-start
pipeline. Other packages add subcommands through ``register(subparsers)`` /
``run(args)`` pairs (``steerkit vectors ...``). Exit codes: 0 success, 2 bad
input (the message says what was expected and found), 1 anything else.
"""
from __future__ import annotations

import argparse
import sys

from steerkit.cli import app, core, methods, probes, refusal, serve, vectors
from steerkit.cli._common import PROMPT_KEYS, read_prompts, read_records
from steerkit.errors import SteerkitError

#: the verb groups, each a module with ``register(subparsers)`` (and ``run(args)`` for verbs that set no func)
GROUPS = (core, vectors, probes, refusal, app, methods, serve)


def build_parser() -> argparse.ArgumentParser:
    from steerkit import __version__
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
    try:
        return int(args.func(args) or 0)
    except SteerkitError as e:
        print(f"steerkit: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("steerkit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
