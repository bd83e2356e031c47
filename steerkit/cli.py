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
import json
import sys
from pathlib import Path


PROMPT_KEYS = ("prompt", "instruction", "text", "question")


def read_records(path: str) -> list[dict]:
    """Records ``{"prompt": str, **fields}`` from a .json list, a .jsonl file or a text file (one per
    line); objects give their first field among :data:`PROMPT_KEYS` as the prompt."""
    from .errors import InputError
    p = Path(path)
    if not p.is_file():
        raise InputError(f"expected a prompts file at {p}, found nothing there")
    text = p.read_text(encoding="utf-8")

    def rec(obj, where):
        if isinstance(obj, str):
            return {"prompt": obj}
        if isinstance(obj, dict):
            for k in PROMPT_KEYS:
                if isinstance(obj.get(k), str):
                    return {**obj, "prompt": obj[k]}
        raise InputError(f"expected a string or an object with one of {PROMPT_KEYS} at {where}, found "
                         f"{str(obj)[:80]!r}")

    try:
        if p.suffix == ".jsonl":
            out = [rec(json.loads(l), f"{p}:{i + 1}") for i, l in enumerate(text.splitlines()) if l.strip()]
        elif p.suffix == ".json":
            data = json.loads(text)
            if not isinstance(data, list):
                raise InputError(f"expected a JSON list of prompts in {p}, found {type(data).__name__}")
            out = [rec(o, f"{p}[{i}]") for i, o in enumerate(data)]
        else:
            out = [{"prompt": l} for l in text.splitlines() if l.strip()]
    except json.JSONDecodeError as e:
        raise InputError(f"expected valid JSON in {p}, found a parse error: {e}") from None
    if not out:
        raise InputError(f"expected at least one prompt in {p}, found none")
    return out


def read_prompts(path: str) -> list[str]:
    """Prompts from a file: ``.jsonl`` / ``.json`` list (strings or objects with a field of
    :data:`PROMPT_KEYS`), or one per line (see :func:`read_records`)."""
    return [r["prompt"] for r in read_records(path)]


def _hooks_arg(spec: str, n_layers: int) -> list[str]:
    """``resid_post:10-14`` / ``resid_post:all`` / comma-separated hook names."""
    from .hooknames import layer_names
    out: list[str] = []
    for part in spec.split(","):
        part = part.strip()
        if ":" in part:
            kind, rng = part.split(":", 1)
            kind = kind if kind.startswith("hook_") else f"hook_{kind}"
            if rng == "all":
                layers = range(n_layers)
            elif "-" in rng:
                a, b = rng.split("-")
                layers = range(int(a), int(b) + 1)
            else:
                layers = [int(x) for x in rng.split("+")]
            out += layer_names(layers, kind)
        elif part:
            out.append(part)
    return out


def cmd_info(args) -> int:
    from . import load_model
    sm = load_model(args.model, backend=args.backend)
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
          "attn_out|mlp_out, ln_final.hook_normalized)")
    if args.all_hooks:
        print("\n".join(names))
    return 0


def cmd_record(args) -> int:
    from . import load_model
    from .dataset import record_dataset
    prompts = read_prompts(args.prompts)
    sm = load_model(args.model, backend=args.backend)
    hooks = _hooks_arg(args.hooks, sm.n_layers)
    pos = args.positions
    if pos not in ("all", "prompt", "generated", "last"):
        pos = [int(x) for x in pos.split(",")]
    ds = record_dataset(sm, prompts, hooks, args.out, positions=pos, batch_size=args.batch_size,
                        shard_size=args.shard_size, chat=not args.no_chat, progress=not args.quiet)
    print(f"recorded {len(ds)} prompts x {len(hooks)} hooks into {args.out} ({len(ds.shards)} shards)")
    return 0


def cmd_demo(args) -> int:
    from .demo import main as demo_main
    return demo_main(quick=args.quick)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="steerkit", description="Record, find, edit and deploy directions in "
                                "a language model's residual stream.")
    from . import __version__
    p.add_argument("--version", action="version", version=f"steerkit {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")

    def model_args(sp):
        sp.add_argument("--model", default=None, help="model folder, .gguf file or cached hub id (default: "
                        "the embedded SmolLM2-135M-Instruct)")
        sp.add_argument("--backend", default="hf", choices=["hf", "tlens", "nnsight"])

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
    sp.set_defaults(func=cmd_record)

    sp = sub.add_parser("demo", help="the quick-start pipeline on the default model")
    sp.add_argument("--quick", action="store_true")
    sp.set_defaults(func=cmd_demo)

    for modname in ("steerkit.cli_vectors", "steerkit.cli_probes", "steerkit.cli_refusal", "steerkit.cli_app",
                    "steerkit.cli_methods", "steerkit.cli_serve"):
        try:
            mod = __import__(modname, fromlist=["register"])
        except ModuleNotFoundError as e:  # an optional part not installed; real import errors surface
            if e.name != modname:
                raise
            continue
        mod.register(sub)
        for name, sp in sub.choices.items():
            if sp.get_default("func") is None and hasattr(mod, "run"):
                sp.set_defaults(func=mod.run)
    return p


def main(argv=None) -> int:
    from .errors import SteerkitError
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
