"""Crash-safe writes: a file or a folder appears whole or not at all.

* :func:`atomic_path` / :func:`atomic_write_bytes` -- write to a temporary file in the same folder,
  fsync, rename over the target, fsync the folder (readers see the old file or the whole new one).
* :func:`atomic_folder` -- the same for a folder (a converted model, an exported model).

The store, the exporters, the model cache and the recorders all write through these.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from steerkit.errors import PathExistsError

__all__ = ["atomic_path", "atomic_folder", "atomic_write_bytes", "make_temp", "fsync_dir"]


def _umask_mode(folder: bool = False) -> int:
    """The mode a new file (or folder) gets under the current umask."""
    mask = os.umask(0)
    os.umask(mask)
    return (0o777 if folder else 0o666) & ~mask


def make_temp(target: Path) -> str:
    """A temporary file next to ``target`` (same filesystem, so rename is atomic), normal permissions."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=str(target.parent))
    os.close(fd)
    os.chmod(tmp, _umask_mode())
    return tmp


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary file path next to ``path``; when the block succeeds the file is fsynced and
    renamed onto ``path`` (readers see the old file or the whole new one), else it is removed."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp(p)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(p.parent)


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike, *, if_exists: str = "error") -> Iterator[Path]:
    """Yield a temporary folder next to ``path``, renamed onto ``path`` when the block succeeds (else
    removed), so nobody ever sees a half-written folder. If ``path`` exists by then: ``"keep"`` it
    (another process finished first; the new one is dropped), ``"replace"`` it (the old folder is
    restored if the swap fails), or ``"error"``."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{p.name}.tmp-", dir=p.parent))
    try:
        yield tmp
        os.chmod(tmp, _umask_mode(folder=True))  # mkdtemp makes 0700
        if not p.exists():
            os.replace(tmp, p)
        elif if_exists == "keep":
            shutil.rmtree(tmp)
        elif if_exists == "replace":
            old = Path(tempfile.mkdtemp(prefix=f".{p.name}.old-", dir=p.parent))
            os.replace(p, old / "x")
            try:
                os.replace(tmp, p)
            except BaseException:
                os.replace(old / "x", p)  # put the previous folder back
                raise
            finally:
                shutil.rmtree(old, ignore_errors=True)
        else:
            raise PathExistsError(f"expected nothing at {p}, found an existing folder; remove it or "
                                  "write with if_exists='replace' or 'keep'")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(p.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: temp file in the same folder, fsync, rename."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
