"""Core verbs: ``info`` (a model summary and its hook names), ``record`` (a prompts file into a
sharded, resumable activations folder) and ``demo`` (the quick-start pipeline)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from steerkit.cli._common import (add_model_options, add_ray_options, check_min, check_output_path, load_model_from,
                                  parse_hooks, ray_executor, read_prompts, resolve_hooks)
from steerkit.storage import jsontext
from steerkit.recording import record_dataset
from steerkit.storage.dataset import ActivationDataset
from steerkit.demo import main as demo_main
from steerkit.errors import BackendUnavailableError, InputError
from steerkit.hooks.positions import positions_from_text
from steerkit.model import SteerModel
from steerkit.serving import capture


def cmd_info(args) -> int:
    sm = load_model_from(args)
    info = {"name": sm.name, "backend": sm.backend_name, "adapter": sm.adapter.name,
            "architecture": type(sm.hf_model).__name__, "n_layers": sm.n_layers, "d_model": sm.d_model,
            "n_ctx": sm.n_ctx, "dtype": str(sm.dtype), "device": str(sm.device),
            "parameters": sum(p.numel() for p in sm.hf_model.parameters()), "fingerprint": sm.fingerprint(),
            "source_gguf": str(sm.source_gguf) if sm.source_gguf else None}
    if args.json:
        print(json.dumps({**info, "hooks": sm.hook_names()}, indent=1))
        return 0
    for k, v in info.items():
        print(f"{k:12s} {v}")
    names = sm.hook_names()
    print(f"hooks        {len(names)} (blocks.{{0..{sm.n_layers - 1}}}.hook_resid_pre|resid_mid|resid_post|"
          "attn_out|mlp_out, ln_final.hook_scale|hook_normalized|hook_out)")
    if args.all_hooks:
        print("\n".join(names))
    return 0


def _config_layers(model_dir: str | None) -> int:
    """``num_hidden_layers`` of a Hugging Face model folder (for ``--engine vllm``)."""
    cfg_path = Path(model_dir or "") / "config.json"
    if model_dir is None or not cfg_path.is_file():
        raise InputError(f"expected --model MODEL_DIR, a Hugging Face model folder vLLM loads, with --engine vllm, "
                         f"found {model_dir!r}; write one with: steerkit model export --format hf DIR")
    try:
        cfg = json.loads(cfg_path.read_text())
        return int((cfg.get("text_config") or cfg)["num_hidden_layers"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise InputError(f"expected num_hidden_layers in {cfg_path}, could not read it ({type(e).__name__}: {e}); "
                         "is it a decoder language model's folder?") from None


def _record_vllm(args, pos, parsed_hooks) -> int:
    """``steerkit record --engine vllm``: the data set of the HF path, recorded by vLLM in its own Python
    (``--vllm-python``, ``$STEERKIT_VLLM_PYTHON`` or this one), run from a temporary folder so no folder
    of the working directory shadows a package vLLM imports."""
    hooks = resolve_hooks(parsed_hooks, _config_layers(args.model))
    try:
        engine = jsontext.loads(args.engine_args)
    except ValueError as e:
        raise InputError(f"expected --engine-args as a JSON object of vllm.LLM arguments such as "
                         f"'{{\"max_num_batched_tokens\": 2048}}', could not parse it ({e})") from None
    if not isinstance(engine, dict):
        raise InputError(f"expected --engine-args as a JSON object, found {type(engine).__name__}")
    prompts = read_prompts(args.prompts)
    out = Path(args.out).resolve()
    _, todo = capture.dataset_plan(args.model, prompts, hooks, out, positions=pos, shard_size=args.shard_size,
                                   chat=not args.no_chat)
    if not todo:
        ds = ActivationDataset(out)
        print(f"nothing to record: {args.out} already holds {len(ds)} prompts x {len(hooks)} hooks "
              f"({len(ds.shards)} shards)")
        return 0
    python = args.vllm_python or os.environ.get("STEERKIT_VLLM_PYTHON") or sys.executable
    if not Path(python).is_file():
        raise InputError(f"expected --vllm-python to name a Python with vLLM and steerkit installed, found no file "
                         f"at {python}")
    with tempfile.TemporaryDirectory(prefix="steerkit-record-") as tmp:
        job = {"model": str(Path(args.model).resolve()), "prompts": prompts, "hooks": hooks, "positions": pos,
               "out": str(out), "shard_size": args.shard_size, "batch_size": args.batch_size,
               "chat": not args.no_chat, "engine": engine, "progress": not args.quiet}
        if args.ray is not None:  # the workers start in vLLM's Python too: it needs Ray there
            job["ray"] = {"address": None if args.ray == "local" else args.ray, "workers": args.workers,
                          "cpus_per_worker": args.cpus_per_worker, "gpus_per_worker": args.gpus_per_worker,
                          "threads": max(1, int(args.cpus_per_worker)) if args.gpus_per_worker == 0 else None}
        job_path = Path(tmp) / "job.json"
        job_path.write_text(json.dumps(job))
        env = dict(os.environ)
        plugins = [p for p in env.get("VLLM_PLUGINS", "").split(",") if p.strip()]
        env["VLLM_PLUGINS"] = ",".join(dict.fromkeys(plugins + ["steerkit"]))
        env[capture.ENV] = str(Path(tmp) / "spool")
        code = ("import sys; from steerkit.cli._common import run_verb; from steerkit.serving.capture import main; "
                "sys.exit(run_verb(main, sys.argv[1:]))")
        rc = subprocess.run([python, "-c", code, str(job_path)], cwd=tmp, env=env).returncode
    if rc == 2:  # a steerkit error there: it printed its one line
        return 2
    if rc != 0:
        raise BackendUnavailableError(f"expected the vLLM recording ({python}) to finish, found it exit with status "
                                      f"{rc} (its output above says why); finished shards are kept, run the same "
                                      "command again to resume, and check that this Python has vllm and steerkit "
                                      "(--vllm-python)")
    ds = ActivationDataset(out)
    where = f", {args.workers} Ray workers" if args.ray is not None else ""
    print(f"recorded {len(ds)} prompts x {len(hooks)} hooks into {args.out} ({len(ds.shards)} shards, vLLM{where})")
    return 0


def cmd_record(args) -> int:
    check_output_path(args.out, "--out", folder=True)
    check_min(args.batch_size, "--batch-size", 1)
    check_min(args.shard_size, "--shard-size", 1)
    pos = positions_from_text(args.positions, "--positions")
    if args.ray is not None:
        check_min(args.workers, "--workers", 1)
    if getattr(args, "engine", "hf") == "vllm":
        return _record_vllm(args, pos, parse_hooks(args.hooks))
    parsed_hooks = parse_hooks(args.hooks)
    prompts = read_prompts(args.prompts)
    if args.ray is not None:
        return _record_ray(args, pos, parsed_hooks, prompts)
    sm = load_model_from(args)
    hooks = resolve_hooks(parsed_hooks, sm.n_layers)
    ds = record_dataset(sm, prompts, hooks, args.out, positions=pos, batch_size=args.batch_size,
                        shard_size=args.shard_size, chat=not args.no_chat, progress=not args.quiet)
    print(f"recorded {len(ds)} prompts x {len(hooks)} hooks into {args.out} ({len(ds.shards)} shards)")
    return 0


def _record_ray(args, pos, parsed_hooks, prompts) -> int:
    """``steerkit record --ray``: the shards recorded by Ray workers that each load the model once; this
    process writes every shard and the manifest (see :mod:`steerkit.executors`)."""
    with ray_executor(args) as ex:
        hooks = resolve_hooks(parsed_hooks, ex.first(_n_layers))
        ds = record_dataset(None, prompts, hooks, args.out, positions=pos, batch_size=args.batch_size,
                            shard_size=args.shard_size, chat=not args.no_chat, progress=not args.quiet,
                            executor=ex)
    print(f"recorded {len(ds)} prompts x {len(hooks)} hooks into {args.out} ({len(ds.shards)} shards, "
          f"{args.workers} Ray workers)")
    return 0


def _n_layers(sm: SteerModel) -> int:
    return sm.n_layers


def cmd_demo(args) -> int:
    return demo_main(quick=args.quick, model=args.model, device=args.device, dtype=args.dtype)


def model_args(sp) -> None:
    add_model_options(sp, backend=True)


def register(sub) -> None:
    sp = sub.add_parser("info", help="model summary and hook names")
    model_args(sp)
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.add_argument("--all-hooks", action="store_true", help="list every hook name")
    sp.set_defaults(func=cmd_info)

    sp = sub.add_parser("record", help="record activations of a prompts file into sharded safetensors")
    model_args(sp)
    sp.add_argument("prompts", help="prompts file: .jsonl, .json list, or one prompt per line")
    sp.add_argument("-o", "--out", required=True, help="output folder (resumable)")
    sp.add_argument("--hooks", default="resid_post:all", help="e.g. resid_post:all, resid_pre:10-14, "
                    "or comma-separated hook names (default: resid_post:all)")
    sp.add_argument("--positions", default="last", help="last | all | prompt | comma-separated indices")
    sp.add_argument("--batch-size", type=int, default=16)
    sp.add_argument("--shard-size", type=int, default=256)
    sp.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    sp.add_argument("--quiet", action="store_true", help="no progress bar")
    sp.add_argument("--engine", default="hf", choices=["hf", "vllm"], help="hf: steerkit's own forward (default); "
                    "vllm: through vLLM's continuous batching (--model must be a Hugging Face folder)")
    sp.add_argument("--vllm-python", default=None, help="the Python with vLLM for --engine vllm (default: "
                    "$STEERKIT_VLLM_PYTHON, else this one)")
    sp.add_argument("--engine-args", default="{}", help="vllm.LLM arguments as JSON for --engine vllm, e.g. "
                    "'{\"max_num_batched_tokens\": 2048}' (default: float32, eager)")
    add_ray_options(sp, here="with --engine vllm each worker runs a vLLM engine (Ray must be installed in "
                    "--vllm-python's environment)")
    sp.set_defaults(func=cmd_record)

    sp = sub.add_parser("demo", help="the quick-start pipeline on the default model")
    sp.add_argument("--quick", action="store_true")
    add_model_options(sp)
    sp.set_defaults(func=cmd_demo)
