"""Where an attribution graph's rows are kept while it is computed: :class:`RowStore`.

A graph limited by ``max_feature_nodes`` writes one row per visited feature (and per logit) over *every* active
feature, error and token node: ``[max_feature_nodes + n_logits, n_active + (n_layers + 1) * n_pos]`` in float32, the
largest thing the computation holds (6 GB at 512 tokens, 8192 features and 177k active features on SmolLM2-135M).
The ranking by influence reads every column of it each time, and the graph keeps the columns of the features it
selects in the end, so every value is needed; :class:`RowStore` keeps them either in memory (on the graph's device)
or, with ``offload``, in a temporary file mapped into memory: rows are written there and read back in chunks, and
each chunk's pages leave the process's resident memory once it is used (they stay in the system's page cache while
memory is free, and the file is deleted when the graph is done). The values are the same either way.
"""
from __future__ import annotations

import mmap
import os
import tempfile
import warnings
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from steerkit.errors import InputError

#: rows read back at a time from an offloaded store
CHUNK_ROWS = 256


class RowStore:
    """``rows`` x ``cols`` float32 zeros: on ``device`` (``offload=False``), or in a temporary file (``offload=True``:
    in the system's temporary folder; a folder: there), deleted when the store is closed or collected.

    Examples:
        >>> from steerkit.probes.graph_rows import RowStore
        >>> s = RowStore(4, 3, torch.device("cpu"), offload=tmp_dir)
        >>> s.tensor[1] = torch.tensor([1.0, 2.0, 3.0])
        >>> s.release(0, 2)  # the pages leave the process; the values stay
        >>> s.tensor[1].tolist(), [tuple(c.shape) for _, c in s.chunks(0, 4, step=3)], list(tmp_dir.glob("*.rows"))
        ([1.0, 2.0, 3.0], [(3, 3), (1, 3)], [])
        >>> s.close()
    """

    def __init__(self, rows: int, cols: int, device: torch.device, offload: bool | str | os.PathLike = False):
        self.device, self.offloaded = device, offload is not False and offload is not None
        self._mm: mmap.mmap | None = None
        if not self.offloaded:
            self.tensor = torch.zeros(rows, cols, device=device)
            return
        folder = None if offload is True else Path(offload)  # type: ignore[arg-type]
        if folder is not None and not folder.is_dir():
            raise InputError(f"expected offload= as True or an existing folder for the graph's temporary rows file, "
                             f"found {str(offload)!r}; create the folder or pass offload=True")
        size = max(rows * cols * 4, 1)
        fd, name = tempfile.mkstemp(suffix=".rows", prefix="steerkit-graph-", dir=folder)
        try:
            os.ftruncate(fd, size)  # sparse on disk: zeros until written
            self._mm = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
        finally:
            os.close(fd)
            os.unlink(name)  # the map keeps the file until it is closed: nothing is left behind
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer warns that the buffer is writable: it is meant to be
            self.tensor = torch.frombuffer(self._mm, dtype=torch.float32, count=rows * cols).view(rows, cols)

    def release(self, start: int, stop: int) -> None:
        """Rows ``start:stop`` leave the process's resident memory (an offloaded store; nothing otherwise). Their
        values stay in the file (a shared map's pages are written back, never lost)."""
        if self._mm is None or stop <= start:
            return
        row = self.tensor.shape[1] * 4
        page = mmap.PAGESIZE
        lo, hi = start * row // page * page, min(-(-stop * row // page) * page, len(self._mm))
        try:
            self._mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        except (OSError, ValueError, AttributeError):  # a system without madvise: the pages stay
            pass

    def chunks(self, start: int, stop: int, step: int | None = None) -> Iterator[tuple[int, Tensor]]:
        """``(first row, rows)`` of ``start:stop``, ``step`` (:data:`CHUNK_ROWS`) rows at a time from an offloaded
        store, all at once from memory; on the store's device. An offloaded chunk is released once the next is
        asked for (copy what you keep)."""
        step = (step or CHUNK_ROWS) if self._mm is not None else max(stop - start, 1)
        for i in range(start, stop, step):
            j = min(i + step, stop)
            yield i, self.tensor[i:j].to(self.device)
            self.release(i, j)

    def close(self) -> None:
        """Let go of the rows (an offloaded store's file is gone once no tensor views it)."""
        self.tensor = torch.zeros(0, 0)
        self._mm = None
