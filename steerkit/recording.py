"""Recording activations of a whole prompt set to disk: the model runs here (or on Ray workers), the
file format and its writer are :mod:`steerkit.storage.dataset`.

``record_dataset(sm, prompts, hooks, out_dir)`` splits the prompts into shards of ``shard_size`` prompts,
records each shard in batches of ``batch_size`` (:func:`record_shard`) and hands it to
:func:`steerkit.storage.dataset.write_shards`, which writes it atomically and then the manifest (the commit
point). Memory is bounded by one shard whatever the number of prompts. Re-running the same call after an
interruption keeps finished shards and records only the missing ones; a different prompt set, hook list or
model in the same folder is an error rather than a silent mix. The result is a
:class:`steerkit.storage.dataset.ActivationDataset`, which reads the folder lazily.

The latents of an attached sparse autoencoder (``{site}.hook_sae_acts_post``, :mod:`steerkit.saesites`,
:func:`is_sparse_hook`) are stored sparse: only the active ones, row by row (format
``steerkit.activations/2``, described in :mod:`steerkit.storage.dataset`).

This module sits above the model and the executors (it runs a model, here or on workers); the storage below
knows files only.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from steerkit.errors import InputError
from steerkit.executors import LocalExecutor, RayExecutor
from steerkit.hooks.names import SAE_ACTS
from steerkit.model import SteerModel
from steerkit.storage.dataset import (FORMAT, FORMAT_SPARSE, ActivationDataset, _prompts_hash, to_sparse_rows,
                                      write_shards)

__all__ = ["record_dataset", "record_shard", "is_sparse_hook", "SPARSE_KINDS"]

#: the kind of hook whose values are stored sparse
SPARSE_KINDS = (SAE_ACTS,)


def is_sparse_hook(name: str) -> bool:
    """Whether a recording stores ``name`` sparse (an attached SAE's latents).

    Examples:
        >>> is_sparse_hook("blocks.3.hook_resid_post.hook_sae_acts_post"), is_sparse_hook("blocks.3.hook_resid_post")
        (True, False)
    """
    return name.rsplit(".", 1)[-1] in SPARSE_KINDS


def record_dataset(sm: SteerModel | None, prompts: Sequence[str], hooks, out_dir, *, positions="last",
                   batch_size: int = 16, shard_size: int = 256, chat: bool = False, dtype: torch.dtype | None = None,
                   progress: bool = True, executor: RayExecutor | None = None) -> ActivationDataset:
    """Record ``hooks`` at ``positions`` for every prompt into sharded safetensors under ``out_dir``.
    Prompts are tokenized as :meth:`SteerModel.forward` does: raw text by default, the chat template
    around each when ``chat`` (recorded in the meta, so a resumed run must pass the same value).
    A run that fails before its first shard (a bad position, a model error) removes the folder it made.
    Inside ``sm.attach_sae(sae)``, the SAE's sub-sites are hooks like any other; its latents
    (``{site}.hook_sae_acts_post``) are stored sparse (format 2, see the module docstring).

    ``executor``: a :class:`steerkit.executors.RayExecutor` records the shards on its workers (``sm`` may be
    ``None``: the workers load the model); each shard comes back to this process, which writes it and then
    the manifest, so a shard is written once even when a dead worker's shard runs again elsewhere. With
    the same batch boundaries and thread count the dataset equals this process's bit for bit.

    Examples:
        >>> ds = record_dataset(tiny, ["Hello there", "A cat sat", "Blue sky"], ["blocks.1.hook_resid_post"],
        ...                     tmp_dir / "acts", shard_size=2, progress=False)
        >>> ds.load("blocks.1.hook_resid_post").shape, len(ds.shards), ds.complete
        (torch.Size([3, 64]), 2, True)
    """
    prompts = list(prompts)
    if not prompts:
        raise InputError("expected at least one prompt to record, found an empty list")
    if isinstance(positions, Tensor):
        raise InputError("record_dataset takes a named or index position spec, not a mask tensor")
    if batch_size < 1 or shard_size < 1:
        raise InputError(f"expected batch_size and shard_size >= 1, found {batch_size}, {shard_size}")
    ex: LocalExecutor | RayExecutor
    if executor is not None:
        ex = executor
    elif sm is not None:
        ex = LocalExecutor(sm)
    else:
        raise InputError("expected a model to record with, found neither sm nor executor=; pass a loaded model or "
                         "a steerkit.executors.RayExecutor")
    facts = ex.first(functools.partial(_facts, hooks=hooks))
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"expected the output folder {out} to be a folder or not exist yet, found a file; "
                         "choose another path or remove the file")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _record_into(ex, facts, prompts, out, positions=positions, batch_size=batch_size,
                            shard_size=shard_size, chat=chat, dtype=dtype, progress=progress)
    except BaseException:
        if created and not any(out.iterdir()):  # a run that failed before its first shard leaves nothing behind
            out.rmdir()
        raise


def _facts(sm: SteerModel, hooks) -> dict:
    """What the manifest says of the model, and the hook names resolved on it (with the SAEs whose
    sub-sites are among them)."""
    names = sm.hooks._names(hooks)
    hosts = dict.fromkeys(p for n in names if (p := sm.hooks.parse(n).parent) is not None)
    saes = {h: sm.hooks.saes[h].facts() for h in hosts}
    return {"names": names, "model": sm.name, "fingerprint": sm.fingerprint(), "d_model": sm.d_model,
            "saes": saes}


def record_shard(sm: SteerModel, chunk: list[str], *, names: list[str], positions, batch_size: int, chat: bool,
                 dtype: torch.dtype | None, on_batch: Callable[[int], Any] | None = None) -> dict[str, Tensor]:
    """One shard's tensors: ``chunk`` recorded in batches of ``batch_size`` (a tensor per hook, and its
    ``::lengths`` where positions vary), on the CPU; ``on_batch(n)`` after each batch of ``n`` prompts.

    Examples:
        >>> shard = record_shard(tiny, ["Hello there", "A cat sat"], names=["blocks.0.hook_resid_post"],
        ...                      positions="all", batch_size=2, chat=False, dtype=None)
        >>> sorted(shard), shard["blocks.0.hook_resid_post"].shape[1]
        (['blocks.0.hook_resid_post', 'blocks.0.hook_resid_post::lengths'], 64)
    """
    tensors: dict[str, list[Tensor]] = {n: [] for n in names}
    lengths: dict[str, list[Tensor]] = {n: [] for n in names}
    for j in range(0, len(chunk), batch_size):
        with sm.record(names, positions=positions, device="cpu") as cache:
            sm.forward(chunk[j:j + batch_size], chat=chat)
        for n in names:
            t = cache[n]
            if dtype is not None:
                t = t.to(dtype)
            if positions == "last":
                tensors[n].append(t)
            else:  # flatten the real rows: [sum(lengths), d_model]
                ln = cache.lengths(n)
                tensors[n].append(torch.cat([t[r, : int(ln[r])] for r in range(t.shape[0])]))
                lengths[n].append(ln)
        if on_batch is not None:
            on_batch(len(chunk[j:j + batch_size]))
    payload = {}
    for n in names:
        rows = torch.cat(tensors[n])
        if is_sparse_hook(n):  # the active latents only (format 2)
            nnz, idx, val = to_sparse_rows(rows)
            payload.update({f"{n}::nnz": nnz, f"{n}::indices": idx, f"{n}::values": val.contiguous()})
        else:
            payload[n] = rows.contiguous()
    if positions != "last":
        payload.update({f"{n}::lengths": torch.cat(lengths[n]) for n in names})
    return payload


def _shard_task(sm: SteerModel, item: tuple[int, list[str]], **options) -> tuple[int, dict[str, Tensor]]:
    i, chunk = item
    return i, record_shard(sm, chunk, **options)


def _record_into(ex: LocalExecutor | RayExecutor, facts: dict, prompts: list[str], out: Path, *, positions,
                 batch_size: int, shard_size: int, chat: bool, dtype: torch.dtype | None,
                 progress: bool) -> ActivationDataset:
    names = facts["names"]
    spec = positions if isinstance(positions, (str, int)) else list(positions) if not isinstance(positions, (range, slice)) else str(positions)
    meta = {"format": FORMAT, "hooks": names, "positions": spec, "model": facts["model"],
            "fingerprint": facts["fingerprint"], "n_prompts": len(prompts), "prompts_sha256": _prompts_hash(prompts),
            "shard_size": shard_size, "chat": chat, "d_model": facts["d_model"]}
    sparse = {n: facts["saes"][n.rsplit(".", 1)[0]]["d_sae"] for n in names if is_sparse_hook(n)}
    if sparse:
        meta.update(format=FORMAT_SPARSE, sparse=sparse)
    if facts.get("saes"):
        meta["saes"] = facts["saes"]
    task = functools.partial(_shard_task, names=names, positions=positions, batch_size=batch_size, chat=chat,
                             dtype=dtype)
    return write_shards(ex, task, meta, prompts, out, progress=progress)
