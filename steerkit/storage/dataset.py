"""Activation data sets on disk: the sharded file format, its writer and its lazy reader.

A data set is a folder of shards of ``shard_size`` prompts each (``shard-00000.safetensors``: a tensor per
hook name, plus ``lengths`` per hook when positions vary), each written first to a temporary name, flushed,
then renamed, so a shard file either exists whole or not at all. The ``manifest.json`` (also written
atomically) records the hooks, positions, model, a hash of the prompts and the finished shards: it is the
commit point. :func:`write_shards` writes the shards that the manifest does not list yet, so re-running a
recording after an interruption keeps finished shards and records only the missing ones
(:func:`resume_state`); a different prompt set, hook list or model in the same folder is an error rather than
a silent mix. What runs the model and fills the shards is above the model:
:func:`steerkit.recording.record_dataset` (a loaded model or Ray workers) and
:func:`steerkit.serving.capture.record_dataset_vllm` (a vLLM engine) both write through here.

:class:`ActivationDataset` opens such a folder and reads tensors lazily with
``safetensors.safe_open``: ``ds.load(hook)`` concatenates every shard,
``ds.iter(hook)`` yields shard by shard, ``ds[hook, i]`` reads one row.

Sparse rows (format ``steerkit.activations/2``): the latents of an attached sparse autoencoder are mostly
zeros, so a shard keeps only the active ones, row by row in the order of the dense rows (CSR without its
offsets): ``{hook}::nnz`` ``[rows]`` (int32, each row's count of nonzero latents), ``{hook}::indices``
``[sum(nnz)]`` (int32, the latents, ascending within a row) and ``{hook}::values`` ``[sum(nnz)]`` (their
values); the manifest's ``sparse`` gives each such hook's width (``d_sae``) and ``saes`` each SAE's facts (a
resumed recording must use the same SAE). A recording writes format 2 only when it records such a hook, and
format 1 otherwise, which reads as before. ``ds.load(hook)`` of a sparse hook is the dense
``[rows, d_sae]`` tensor, as a recording in memory is; ``ds.load(hook, sparse=True)`` is a
``torch.sparse_csr_tensor`` of the same values, which never makes the dense one.

The recording functions that lived here (``record_dataset``, ``record_shard``, ``is_sparse_hook``,
``SPARSE_KINDS``) are :mod:`steerkit.recording`; their old names here still work and warn with the new place.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
from torch import Tensor

from steerkit.deprecation import moved
from steerkit.storage.documents import read_document
from steerkit.errors import HookNameError, InputError, RowIndexError
from safetensors import safe_open
from safetensors.torch import save
from tqdm.auto import tqdm

MANIFEST = "manifest.json"
FORMAT = "steerkit.activations/1"
#: the format with sparse hooks (an SAE's latents as indices and values of the active ones)
FORMAT_SPARSE = "steerkit.activations/2"
FORMATS = (FORMAT, FORMAT_SPARSE)
#: the recording names that moved to :mod:`steerkit.recording`
MOVED_TO_RECORDING = ("record_dataset", "record_shard", "is_sparse_hook", "SPARSE_KINDS")


def __getattr__(name: str):
    if name in MOVED_TO_RECORDING:
        return moved(__name__, name, "steerkit.recording")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class ShardRunner(Protocol):
    """Where :func:`write_shards` runs its task: ``imap_unordered(fn, items)`` yields ``(index, fn(state,
    item))`` as results arrive (:class:`steerkit.executors.LocalExecutor` here,
    :class:`steerkit.executors.RayExecutor` on workers); ``in_process`` says whether results come from this
    process (the progress bar then moves batch by batch, else shard by shard)."""

    in_process: bool

    def imap_unordered(self, fn: Callable[[Any, Any], Any], items: Sequence) -> Iterator[tuple[int, Any]]: ...

def to_sparse_rows(rows: Tensor, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(nnz, indices, values)`` of ``rows`` ``[n, width]``: each row's count of nonzero entries (int32), their
    column indices (int32, ascending within a row, rows one after another) and their values (in ``dtype``).

    Examples:
        >>> nnz, idx, val = to_sparse_rows(torch.tensor([[0.0, 2.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [3.0, 0, 0, 0]]))
        >>> nnz.tolist(), idx.tolist(), val.tolist()
        ([2, 0, 1], [1, 3, 0], [2.0, 1.0, 3.0])
        >>> torch.equal(from_sparse_rows(nnz, idx, val, 4).to_dense(), torch.tensor([[0.0, 2, 0, 1], [0, 0, 0, 0], [3, 0, 0, 0]]))
        True
    """
    nz = rows != 0
    _, cols = nz.nonzero(as_tuple=True)
    values = rows[nz]
    return (nz.sum(-1).to(torch.int32), cols.to(torch.int32),
            values if dtype is None else values.to(dtype))


def from_sparse_rows(nnz: Tensor, indices: Tensor, values: Tensor, width: int) -> Tensor:
    """The ``torch.sparse_csr_tensor`` ``[len(nnz), width]`` of :func:`to_sparse_rows`'s parts."""
    crow = torch.zeros(nnz.numel() + 1, dtype=torch.long)
    torch.cumsum(nnz.long(), 0, out=crow[1:])
    with warnings.catch_warnings():  # torch's note that its CSR support is in beta
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        # the invariants checked: a file's indices out of range raise here instead of corrupting memory later
        try:
            return torch.sparse_csr_tensor(crow, indices.long(), values, size=(int(nnz.numel()), int(width)),
                                           check_invariants=True)
        except RuntimeError as e:
            raise InputError(f"expected sparse rows with {int(crow[-1])} entries of columns in 0..{width - 1}, "
                             f"ascending within each row, found {indices.numel()} indices and {values.numel()} values "
                             f"that break it ({e}); the shard is damaged: record it again") from None


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _prompts_hash(prompts: Sequence[str]) -> str:
    h = hashlib.sha256()
    for p in prompts:
        h.update(p.encode("utf-8"))
        h.update(b"\x00")
    return h.hexdigest()[:16]


def write_shards(ex: ShardRunner, task: Callable[..., tuple[int, dict[str, Tensor]]], meta: dict,
                 prompts: list[str], out: Path, *, progress: bool = True,
                 desc: str = "recording") -> "ActivationDataset":
    """Record into ``out`` the shards of ``prompts`` that its manifest does not list yet: ``task(state,
    (i, chunk), on_batch=)`` returns ``(i, {name: tensor})`` for shard ``i`` on the executor (this process or
    a Ray worker), and this process writes each shard atomically, then the manifest (``meta`` plus the shards
    done), which is the commit point: a shard it does not list is recorded again on resume, and a shard that
    ran twice (a dead worker's, redone elsewhere) is written once. ``on_batch(n)`` moves the progress bar
    batch by batch in this process; results from workers move it shard by shard. The HF path
    (:func:`steerkit.recording.record_dataset`) and vLLM's (:func:`steerkit.serving.capture.record_dataset_vllm`)
    both write through here.

    Examples:
        >>> from steerkit.executors import LocalExecutor
        >>> def task(_, item, on_batch=None):
        ...     i, chunk = item
        ...     return i, {"h": torch.full((len(chunk), 2), float(i))}
        >>> meta = {"format": FORMAT, "hooks": ["h"], "positions": "last", "model": "m", "fingerprint": "f",
        ...         "n_prompts": 3, "prompts_sha256": "0", "shard_size": 2, "chat": False, "d_model": 2}
        >>> ds = write_shards(LocalExecutor(tiny), task, meta, ["a", "b", "c"], tmp_dir / "ws", progress=False)
        >>> ds.load("h")[:, 0].tolist(), len(ds.shards)
        ([0.0, 0.0, 1.0], 2)
    """
    shard_size = int(meta["shard_size"])
    man_path = out / MANIFEST
    out.mkdir(parents=True, exist_ok=True)
    done, todo = resume_state(out, meta, len(prompts), shard_size)
    bar = None
    if progress:
        bar = tqdm(total=len(prompts), desc=desc, unit="prompt",
                   initial=len(prompts) - sum(min(shard_size, len(prompts) - i * shard_size) for i in todo))
    here = bool(getattr(ex, "in_process", False))  # a bar that moves batch by batch here, shard by shard from workers
    task = functools.partial(task, on_batch=bar.update if bar is not None and here else None)
    items = [(i, prompts[i * shard_size:(i + 1) * shard_size]) for i in todo]
    for _, (i, payload) in ex.imap_unordered(task, items):
        fname = f"shard-{i:05d}.safetensors"
        if fname in done:  # (an item that ran twice: the first result is the one written)
            continue
        _atomic_write_bytes(out / fname, save(payload, metadata={"format": meta["format"], "shard": str(i)}))
        done[fname] = len(items[todo.index(i)][1])
        _atomic_write_bytes(man_path, json.dumps({**meta, "shards": dict(sorted(done.items()))}, indent=1).encode())
        if bar is not None and not here:
            bar.update(done[fname])
    if bar is not None:
        bar.close()
    if not man_path.exists():
        _atomic_write_bytes(man_path, json.dumps({**meta, "shards": done}, indent=1).encode())
    return ActivationDataset(out)


def resume_state(out: Path, meta: dict, n_prompts: int, shard_size: int) -> tuple[dict[str, int], list[int]]:
    """What a recording into ``out`` still has to do: ``(done, todo)``, the shards its manifest lists
    whose files exist (``{file name: prompts}``) and the indices of the shards to record. A manifest of
    another run (hooks, positions, fingerprint, prompts, shard size or chat differ from ``meta``) or
    an unreadable one is refused with what to do."""
    man_path = out / MANIFEST
    done: dict[str, int] = {}
    if man_path.exists():
        try:
            old = read_document(man_path, "JSON", fmt="json", error=InputError)
        except InputError as e:
            raise InputError(f"expected a readable manifest in {man_path} to resume the recording in {out}, found: "
                             f"{e}; use another folder or delete this one") from None
        if not isinstance(old, dict):
            raise InputError(f"expected a JSON object in {man_path}, found {type(old).__name__}; use another "
                             "folder or delete this one")
        keys = ("hooks", "positions", "fingerprint", "prompts_sha256", "shard_size", "chat", "saes")
        diff = [k for k in keys if old.get(k) != meta.get(k)]
        if diff:
            raise InputError(f"expected {out} to hold a recording of the same run to resume, found one that "
                             f"differs in {diff}; use another folder or delete this one")
        done = {k: v for k, v in old.get("shards", {}).items() if (out / k).exists()}
    n_shards = (n_prompts + shard_size - 1) // shard_size
    todo = [i for i in range(n_shards) if f"shard-{i:05d}.safetensors" not in done]
    return done, todo


class ActivationDataset:
    """A recorded dataset on disk, read lazily shard by shard."""

    def __init__(self, path):
        self.path = Path(path)
        mp = self.path / MANIFEST
        if not mp.is_file():
            raise InputError(f"expected a steerkit activation folder with {MANIFEST} at {self.path}, found none")
        self.meta = read_document(mp, "JSON", fmt="json", error=InputError)
        if not isinstance(self.meta, dict):
            raise InputError(f"expected a JSON object in {mp}, found {type(self.meta).__name__}")
        if self.meta.get("format") not in FORMATS:
            raise InputError(f"expected a format in {FORMATS} in {mp}, found {self.meta.get('format')!r}; a newer "
                             "steerkit wrote it, or it is not an activation folder")
        self.hooks: list[str] = self.meta["hooks"]
        self.shards = sorted(self.meta.get("shards", {}))
        #: the hooks stored sparse, with their width (``d_sae``)
        self.sparse: dict[str, int] = dict(self.meta.get("sparse") or {})

    @property
    def complete(self) -> bool:
        return sum(self.meta["shards"].values()) == self.meta["n_prompts"]

    def __len__(self) -> int:
        return sum(self.meta["shards"].values())

    def _check(self, hook: str) -> None:
        if hook not in self.hooks:
            raise HookNameError(f"expected one of the recorded hooks {self.hooks}, found {hook!r}; "
                                "ask for one of those or record this hook too")

    def _sparse_ok(self, hook: str, sparse: bool) -> None:
        self._check(hook)
        if sparse and hook not in self.sparse:
            raise InputError(f"expected a hook stored sparse (an SAE's latents: {sorted(self.sparse) or 'none here'}) "
                             f"for sparse=True, found {hook!r}, stored dense; load it with sparse=False")

    def _parts(self, f, hook: str) -> tuple[Tensor, Tensor, Tensor]:
        return f.get_tensor(f"{hook}::nnz"), f.get_tensor(f"{hook}::indices"), f.get_tensor(f"{hook}::values")

    def iter(self, hook: str, *, sparse: bool = False) -> Iterator[Tensor]:
        """Yield the tensor of ``hook`` shard by shard (``[n, d_model]``); a sparse hook's dense rows
        ``[n, d_sae]``, or with ``sparse`` its ``torch.sparse_csr_tensor``."""
        self._sparse_ok(hook, sparse)
        for s in self.shards:
            with safe_open(str(self.path / s), framework="pt") as f:
                if hook not in self.sparse:
                    yield f.get_tensor(hook)
                    continue
                t = from_sparse_rows(*self._parts(f, hook), self.sparse[hook])
            yield t if sparse else t.to_dense()

    def load(self, hook: str, *, sparse: bool = False) -> Tensor:
        """Every shard of ``hook`` concatenated: ``[n_prompts, d_model]`` for positions='last'. A sparse hook
        (an SAE's latents) is dense ``[rows, d_sae]``, or with ``sparse`` one ``torch.sparse_csr_tensor``
        (built from the stored parts, without the dense tensor)."""
        if hook in self.sparse and sparse:
            parts = []
            for s in self.shards:
                with safe_open(str(self.path / s), framework="pt") as f:
                    parts.append(self._parts(f, hook))
            nnz, idx, val = (torch.cat(p) for p in zip(*parts))
            return from_sparse_rows(nnz, idx, val, self.sparse[hook])
        return torch.cat(list(self.iter(hook, sparse=sparse)))

    def lengths(self, hook: str) -> Tensor:
        """Rows per prompt when positions vary (``[n_prompts]``)."""
        self._check(hook)
        out = []
        for s in self.shards:
            with safe_open(str(self.path / s), framework="pt") as f:
                if f"{hook}::lengths" not in f.keys():
                    raise InputError("this recording used positions='last': one row per prompt, no lengths")
                out.append(f.get_tensor(f"{hook}::lengths"))
        return torch.cat(out)

    def __getitem__(self, key) -> Tensor:
        """``ds[hook]`` loads everything; ``ds[hook, i]`` reads row ``i`` only (positions='last')."""
        if isinstance(key, str):
            return self.load(key)
        hook, i = key
        self._check(hook)
        if self.meta.get("positions") != "last":
            raise InputError("row access ds[hook, i] needs a positions='last' recording; for varying "
                             "positions use ds.load(hook) with ds.lengths(hook)")
        n = len(self)
        if not -n <= i < n:
            raise RowIndexError(f"expected a row index in [{-n}, {n}), found {i}; this recording has {n} rows")
        i %= n
        for s in self.shards:
            cnt = self.meta["shards"][s]
            if i < cnt:
                with safe_open(str(self.path / s), framework="pt") as f:
                    if hook not in self.sparse:
                        return f.get_slice(hook)[i:i + 1][0]
                    nnz = f.get_tensor(f"{hook}::nnz").long()
                    a, b = int(nnz[:i].sum()), int(nnz[: i + 1].sum())
                    values = f.get_slice(f"{hook}::values")[a:b]
                    row = torch.zeros(self.sparse[hook], dtype=values.dtype)
                    row[f.get_slice(f"{hook}::indices")[a:b].long()] = values
                    return row
            i -= cnt
        raise RowIndexError(f"expected row {key[1]} in one of the shards of {self.path}, found none: the shard "
                            "counts in its meta.json do not add up; record the prompts again")
