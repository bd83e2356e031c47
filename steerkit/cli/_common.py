"""What every verb group shares: running a verb with the command line's error behaviour, the model
options (``--model --device --dtype``, and ``--backend`` where a verb takes one), the Ray options of the
verbs that spread work over Ray workers (``--ray --workers --cpus-per-worker --gpus-per-worker``), prompt
files, hook lists, output paths and ports as the command line reads them."""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

from steerkit.backends import BACKENDS
from steerkit.errors import BackendUnavailableError, InputError, SteerkitError
from steerkit.executors import ModelSpec, RayExecutor
from steerkit.hooks.names import BLOCK_HOOKS, layer_names, parse_layers
from steerkit.loading.device import DTYPE_NAMES
from steerkit.model import SteerModel, load_model
from steerkit.storage import jsontext

PROMPT_KEYS = ("prompt", "instruction", "text", "question")


def add_model_options(parser: argparse.ArgumentParser, *, backend: bool = False) -> None:
    """``--model``, ``--device`` and ``--dtype`` (and ``--backend``), as every verb that loads a model has
    them; :func:`load_model_from` loads what they say."""
    g = parser.add_argument_group("model")
    g.add_argument("--model", default=None, help="model folder, .gguf file or Hugging Face Hub id such as "
                   "Qwen/Qwen2.5-1.5B-Instruct (downloaded once into the Hub cache; HF_HUB_OFFLINE=1 reads the "
                   "cache only) (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--device", default="auto", help="torch device: auto (CUDA, then MPS, then the CPU), cpu, cuda, "
                   "cuda:1, mps (default auto)")
    g.add_argument("--dtype", default="auto", choices=("auto", *DTYPE_NAMES), help="weights' and activations' "
                   "type; auto: bfloat16 on a CUDA device that supports it, float32 elsewhere (default auto)")
    if backend:
        g.add_argument("--backend", default="hf", choices=BACKENDS,
                       help="hf (PyTorch hooks), tlens (TransformerLens 4) or nnsight (default hf)")


def model_options(args: argparse.Namespace) -> dict:
    """The keyword arguments of ``steerkit.load_model`` the model options give (all but ``--model``)."""
    out = dict(device=args.device, dtype=args.dtype)
    if getattr(args, "backend", None) is not None:
        out["backend"] = args.backend
    return out


def load_model_from(args: argparse.Namespace) -> SteerModel:
    """``steerkit.load_model`` of the verb's model options (:func:`add_model_options`)."""
    return load_model(args.model, **model_options(args))


RAY_GROUP = "Ray (pip install 'steerkit[ray]')"


def add_ray_options(parser: argparse.ArgumentParser, *, work: str = "record the shards",
                    here: str | None = None) -> None:
    """The ``Ray`` option group: ``--ray [ADDRESS]`` (``"local"`` without an address), ``--workers``,
    ``--cpus-per-worker``, ``--gpus-per-worker``; ``work`` says what runs on the workers and ``here`` what
    this process still does with its own copy of the model. :func:`ray_executor` builds the executor."""
    g = parser.add_argument_group(RAY_GROUP)
    g.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help=f"{work} on Ray workers: a running cluster's address (auto, ray://host:10001, "
                   "host:6379), or none to start a local one" + (f"; {here}" if here else ""))
    g.add_argument("--workers", type=int, default=2, help="Ray workers, each loading the model once (default 2)")
    g.add_argument("--cpus-per-worker", type=float, default=1, help="CPUs Ray gives each worker (default 1; a CPU "
                   "worker runs that many torch threads)")
    g.add_argument("--gpus-per-worker", type=float, default=0, help="GPUs Ray gives each worker (default 0; with "
                   "--device auto a worker with a GPU uses it)")


def ray_executor(args: argparse.Namespace) -> RayExecutor:
    """The :class:`~steerkit.executors.RayExecutor` of the Ray options (:func:`add_ray_options`) and the
    model options: a local ``--model`` path made absolute (every worker finds it), ``--device``, ``--dtype``
    (and ``--backend``) as given, resolved on each worker, and ``--cpus-per-worker`` torch threads a worker.
    The flags are checked here; nothing starts until the executor is used."""
    check_min(args.workers, "--workers", 1)
    if not args.cpus_per_worker > 0:
        raise InputError(f"expected --cpus-per-worker > 0, found {args.cpus_per_worker:g}; a worker needs a CPU "
                         "(or a share of one, such as 0.5)")
    check_min(args.gpus_per_worker, "--gpus-per-worker", 0, "0 runs the workers on CPUs")
    model = args.model
    if model is not None and Path(model).exists():  # a local path: absolute, so every worker finds it
        model = str(Path(model).resolve())
    spec = ModelSpec(model, threads=max(1, int(args.cpus_per_worker)), **model_options(args))
    address = None if args.ray == "local" else args.ray
    return RayExecutor(spec, workers=args.workers, address=address, cpus_per_worker=args.cpus_per_worker,
                       gpus_per_worker=args.gpus_per_worker)


def _fingerprint(sm: SteerModel) -> str:
    return sm.fingerprint()


@contextlib.contextmanager
def model_with_workers(args: argparse.Namespace, executor: Optional[RayExecutor]) -> Iterator[SteerModel]:
    """The verb's model, loaded here (:func:`load_model_from`); with an ``executor``, its workers are started
    first (so a missing Ray, an unreachable cluster or a model a worker cannot load fails before the load
    here), checked to hold the model loaded here, and stopped on exit."""
    if executor is None:
        yield load_model_from(args)
        return
    with executor:
        theirs = executor.first(_fingerprint)
        sm = load_model_from(args)
        if theirs != sm.fingerprint():
            raise BackendUnavailableError(f"expected the Ray workers to load the model loaded here (fingerprint "
                                          f"{sm.fingerprint()}), found {theirs}; give every node the same model "
                                          "files (a Hub id: the same revision in each node's Hub cache)")
        yield sm


def error_line(error: BaseException | str) -> str:
    """The one stderr line of a failed command: ``steerkit: error: <message>``, newlines folded to spaces."""
    text = re.sub(r"\s*[\r\n]\s*", " ", str(error)).strip()
    return f"steerkit: error: {text or type(error).__name__}"


def run_verb(func: Callable[[argparse.Namespace], Any], args: argparse.Namespace) -> int:
    """Run one verb: its return value as the exit code; a :class:`~steerkit.errors.SteerkitError` becomes
    one ``steerkit: error:`` line on stderr and exit 2, an operating-system error the same line and exit 1,
    Ctrl-C exit 130."""
    try:
        return int(func(args) or 0)
    except SteerkitError as e:
        print(error_line(e), file=sys.stderr)
        return 2
    except OSError as e:
        where = f": {e.filename}" if getattr(e, "filename", None) else ""
        print(error_line(f"{e.strerror or e}{where}"), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("steerkit: interrupted", file=sys.stderr)
        return 130


def run_group(register: Callable[[Any], Any], command: str, argv: Sequence[str] | None = None) -> int:
    """``steerkit COMMAND ARGV...`` for one verb group on its own (a module's ``main``)."""
    parser = argparse.ArgumentParser(prog="steerkit")
    register(parser.add_subparsers(dest="cmd", metavar="COMMAND"))
    args = parser.parse_args([command, *(sys.argv[1:] if argv is None else argv)])
    return run_verb(args.func, args)


def read_text_file(path: str, what: str = "text", formats: str = "a text file") -> str:
    """The UTF-8 text of the file at ``path`` (a ``what`` file, one of ``formats``); an
    :class:`~steerkit.errors.InputError` for a folder, a missing or unreadable file, bytes that are not UTF-8
    or binary data (NUL bytes)."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"expected a {what} file at {p}, found a folder; pass {formats}")
    if not p.is_file():
        raise InputError(f"expected a {what} file at {p}, found nothing there; check the path")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"expected a UTF-8 text {what} file at {p}, found bytes that are not UTF-8 (at offset "
                         f"{e.start}); pass {formats} saved as UTF-8") from None
    except OSError as e:
        raise InputError(f"expected a readable {what} file at {p}, found it unreadable ({e.strerror or e}); "
                         "check its permissions") from None
    if "\x00" in text:
        raise InputError(f"expected a text {what} file at {p}, found binary data (NUL bytes); pass {formats}")
    return text


def read_records(path: str) -> list[dict]:
    """Records ``{"prompt": str, **fields}`` from a .json list, a .jsonl file or a text file (one per
    line); objects give their first field among :data:`PROMPT_KEYS` as the prompt."""
    p = Path(path)
    text = read_text_file(path, "prompts", "a .jsonl, .json or text file")

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
            out = [rec(jsontext.loads(l), f"{p}:{i + 1}") for i, l in enumerate(text.splitlines()) if l.strip()]
        elif p.suffix == ".json":
            data = jsontext.loads(text)
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


def check_output_path(path: str, what: str = "output", *, folder: bool = False) -> Path:
    """Refuse an output path that cannot be written: one of its parents is a file (the folders it needs
    cannot be made), or the path itself is a folder where a file is written (``folder=False``) or a file
    where a folder is written (``folder=True``). Returns the path."""
    p = Path(path)
    if folder and p.exists() and not p.is_dir():
        raise InputError(f"expected the {what} folder {p} to be a folder or not exist yet, found a file; "
                         "choose another path or remove the file")
    if not folder and p.is_dir():
        raise InputError(f"expected the {what} file {p} to be a file path, found a folder; give a file name "
                         "inside it")
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise InputError(f"expected the {what} path {p} to lie in a folder, found the file {parent} in its "
                                 "way; choose a path whose parents are folders")
            break
    return p


def check_store_path(path: str | None, flag: str = "--store") -> str | None:
    """Refuse a store (or results) folder that is a file or lies under one; ``None`` (the default) passes."""
    if path is None:
        return None
    check_output_path(path, flag, folder=True)
    return path


def check_min(value: int | float | None, flag: str, minimum: int | float, hint: str = "") -> None:
    """Refuse ``flag`` below ``minimum`` (``None``, an unset optional flag, passes)."""
    if value is not None and value < minimum:
        raise InputError(f"expected {flag} >= {minimum}, found {value}" + (f"; {hint}" if hint else ""))


_HOOKS_HELP = ("use KIND:all, KIND:A-B, KIND:A+B+C (KIND e.g. resid_post) or comma-separated hook names such "
               "as blocks.3.hook_resid_post")


#: a parsed ``--hooks`` item: a hook name, or ``(kind, layers)`` with ``layers`` a list of ints or "all"
HookItem = Union[str, tuple[str, Union[list[int], str]]]


def parse_hooks(spec: str) -> list[HookItem]:
    """Check the syntax of a ``--hooks`` value without a model: a list of hook names (``str``) and
    ``(kind, layers)`` pairs where ``layers`` is a list of ints or ``"all"``."""
    out: list[HookItem] = []
    for part in spec.split(","):
        part = part.strip()
        if ":" in part:
            kind, rng = part.split(":", 1)
            kind = kind.strip()
            kind = kind if kind.startswith("hook_") else f"hook_{kind}"
            if kind not in BLOCK_HOOKS:
                raise InputError(f"expected a hook kind in {[h[5:] for h in BLOCK_HOOKS]} in --hooks, found "
                                 f"{part!r}; {_HOOKS_HELP}")
            # the layers of one kind are joined by "+" (commas separate the items of --hooks)
            out.append((kind, parse_layers(rng.replace("+", ","), what=f"the layers of --hooks {part!r:.80}")))
        elif part:
            out.append(part)
    if not out:
        raise InputError(f"expected at least one hook in --hooks, found {spec!r}; {_HOOKS_HELP}")
    return out


def resolve_hooks(parsed: Sequence[HookItem], n_layers: int) -> list[str]:
    """Hook names of a :func:`parse_hooks` result for a model with ``n_layers`` blocks."""
    out: list[str] = []
    for item in parsed:
        if isinstance(item, str):
            out.append(item)
            continue
        kind, spec_layers = item
        layers = parse_layers(spec_layers, n_layers, what=f"the layers of {kind} in --hooks")
        out += layer_names(layers, kind)
    return out


def check_port(port: int) -> int:
    """Refuse a TCP port outside 1..65535."""
    if not 1 <= port <= 65535:
        raise InputError(f"expected --port in 1..65535, found {port}; pick a free port in that range")
    return port
