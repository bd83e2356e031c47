"""Crash-safe writes: a file or a folder appears whole or not at all.

* :func:`atomic_path` / :func:`atomic_write_bytes` -- write to a temporary file in the same folder,
  fsync, rename over the target, fsync the folder (readers see the old file or the whole new one).
* :func:`atomic_folder` -- the same for a folder (a converted model, an exported model).

The store, the exporters, the model cache and the recorders all write through these.

* :class:`Folder` -- the one confinement helper: every file access of the store and the app goes
  through it, so no path leaves its folder and no symbolic link redirects a read, a write or a delete.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Iterator

from steerkit.errors import PathExistsError, SteerkitError

__all__ = ["atomic_path", "atomic_folder", "atomic_write_bytes", "make_temp", "fsync_dir", "Folder", "ConfinementError"]


def _read_umask() -> int:
    mask = os.umask(0)  # reading the umask means setting it: done once, at import, before any thread writes
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def _umask_mode(folder: bool = False) -> int:
    """The mode a new file (or folder) gets under the process's umask (read once at import)."""
    return (0o777 if folder else 0o666) & ~_UMASK


def make_temp(target: Path) -> str:
    """A temporary file next to ``target`` (same filesystem, so rename is atomic), normal permissions.

    Examples:
        >>> from steerkit.storage.files import make_temp
        >>> tmp = make_temp(tmp_dir / "weights.bin")
        >>> os.path.dirname(tmp) == str(tmp_dir), os.path.getsize(tmp)
        (True, 0)
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=str(target.parent))
    os.close(fd)
    os.chmod(tmp, _umask_mode())
    return tmp


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries to disk (after a rename into it); a folder that cannot be opened is skipped.

    Examples:
        >>> from steerkit.storage.files import fsync_dir
        >>> fsync_dir(tmp_dir), fsync_dir(tmp_dir / "missing")
        (None, None)
    """
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
    renamed onto ``path`` (readers see the old file or the whole new one), else it is removed.

    Examples:
        >>> from steerkit.storage.files import atomic_path
        >>> with atomic_path(tmp_dir / "notes.txt") as tmp:
        ...     _ = Path(tmp).write_text("done")
        >>> (tmp_dir / "notes.txt").read_text(), len(list(tmp_dir.iterdir()))
        ('done', 1)
    """
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
    restored if the swap fails), or ``"error"``.

    Examples:
        >>> from steerkit.storage.files import atomic_folder
        >>> with atomic_folder(tmp_dir / "model") as tmp:
        ...     _ = (tmp / "config.json").write_text("{}")
        >>> sorted(p.name for p in (tmp_dir / "model").iterdir())
        ['config.json']
        >>> with atomic_folder(tmp_dir / "model", if_exists="keep") as tmp:
        ...     _ = (tmp / "other.json").write_text("{}")
        >>> sorted(p.name for p in (tmp_dir / "model").iterdir())
        ['config.json']
    """
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
    """Write ``data`` to ``path`` atomically: temp file in the same folder, fsync, rename.

    Examples:
        >>> from steerkit.storage.files import atomic_write_bytes
        >>> atomic_write_bytes(tmp_dir / "a" / "b.bin", b"steerkit")
        >>> (tmp_dir / "a" / "b.bin").read_bytes()
        b'steerkit'
    """
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


# ============================================================================ confinement
class ConfinementError(SteerkitError, PermissionError):
    """A path leaves its folder, passes through a symbolic link, or is not the kind of file expected.

    Examples:
        >>> from steerkit.storage.files import Folder
        >>> try:
        ...     Folder(tmp_dir).path("../outside.txt")
        ... except PermissionError as e:
        ...     print(type(e).__name__)
        ConfinementError
    """


def _parts(rel: "str | os.PathLike[str]") -> list[str]:
    s = os.fspath(rel)
    if not isinstance(s, str) or "\x00" in s:
        raise ConfinementError(f"expected a relative path as text, found {s!r:.80}")
    p = Path(s)
    if p.is_absolute():
        raise ConfinementError(f"expected a path relative to the folder, found the absolute path {s!r:.200}")
    parts = [x for x in p.parts if x not in ("", ".")]
    if any(x == ".." for x in parts):
        raise ConfinementError(f"expected a path inside the folder, found {s!r:.200} (it uses '..')")
    return parts


class Folder:
    """A folder whose files are only ever reached through it: every access walks the path one
    component at a time from the folder with ``O_NOFOLLOW`` (``openat``-style, so no symbolic link
    anywhere below the folder, planted before or during the call, can redirect a read, a write or a
    delete to somewhere else), refuses ``..`` and absolute paths, and reads only regular files, of a
    bounded size, without blocking (a FIFO or a device is refused, never opened for reading).

    ``root`` itself is resolved once, when the ``Folder`` is made: the user chose it.

    Examples:
        >>> from steerkit.storage.files import Folder
        >>> f = Folder(tmp_dir)
        >>> f.write_bytes("runs/a.json", b"{}")
        >>> f.listdir("runs"), f.read_bytes("runs/a.json", max_bytes=1024)
        (['a.json'], b'{}')
        >>> f.remove("runs"); f.listdir()
        []
    """

    def __init__(self, root: "str | os.PathLike[str]"):
        self.given = Path(root)
        self.root = Path(os.path.realpath(os.fspath(root)))

    def __repr__(self) -> str:
        return f"Folder({str(self.root)!r})"

    # --- walking ----------------------------------------------------------------------
    def _dir_fd(self, parts: list[str], *, create: bool = False) -> int:
        """An fd of the folder ``parts`` below the root (each component opened with O_NOFOLLOW)."""
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root, flags)
        try:
            for i, name in enumerate(parts):
                try:
                    nfd = os.open(name, flags, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    os.mkdir(name, 0o777, dir_fd=fd)
                    nfd = os.open(name, flags, dir_fd=fd)
                except OSError as e:
                    if _is_link(fd, name):
                        raise ConfinementError(f"expected a folder at {self.root.joinpath(*parts[:i + 1])}, found a "
                                               "symbolic link; steerkit never follows links inside its folders") from None
                    raise ConfinementError(f"expected a folder at {self.root.joinpath(*parts[:i + 1])}, found "
                                           f"something else ({e.strerror})") from None
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd

    def mkdir(self, rel: "str | os.PathLike[str]") -> Path:
        """Create the folder ``rel`` and its parents below the root (each component created and opened
        with ``O_NOFOLLOW``, so an existing link on the way is refused, never followed); returns its path."""
        parts = _parts(rel)
        os.close(self._dir_fd(parts, create=True))
        return self.root.joinpath(*parts)

    def path(self, rel: "str | os.PathLike[str]") -> Path:
        """``root / rel`` after checking that ``rel`` stays inside (no ``..``, not absolute) and that no
        component below the root is a symbolic link (for callers that must hand a path to a library)."""
        parts = _parts(rel)
        if parts:
            fd = self._dir_fd(parts[:-1])
            try:
                if _is_link(fd, parts[-1]):
                    raise ConfinementError(f"expected a file or folder at {self.root.joinpath(*parts)}, found a "
                                           "symbolic link; steerkit never follows links inside its folders")
            finally:
                os.close(fd)
        return self.root.joinpath(*parts)

    def lstat(self, rel: "str | os.PathLike[str]") -> "os.stat_result | None":
        """The entry's own status (never a link's target), or ``None`` when it does not exist."""
        parts = _parts(rel)
        if not parts:
            try:
                return os.lstat(self.root)
            except FileNotFoundError:
                return None
        try:
            fd = self._dir_fd(parts[:-1])
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            return os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        finally:
            os.close(fd)

    def listdir(self, rel: "str | os.PathLike[str]" = "") -> list[str]:
        """The names in the folder ``rel`` (empty when it does not exist)."""
        try:
            fd = self._dir_fd(_parts(rel))
        except (FileNotFoundError, NotADirectoryError):
            return []
        try:
            return sorted(os.listdir(fd))
        finally:
            os.close(fd)

    # --- reading ----------------------------------------------------------------------
    def read_bytes(self, rel: "str | os.PathLike[str]", max_bytes: int) -> bytes:
        """The bytes of the regular file ``rel`` (at most ``max_bytes``, else an error before reading)."""
        parts = _parts(rel)
        if not parts:
            raise ConfinementError(f"expected a file below {self.root}, found the folder itself")
        fd = self._dir_fd(parts[:-1])
        try:
            try:
                ffd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0),
                              dir_fd=fd)
            except OSError:
                if _is_link(fd, parts[-1]):
                    raise ConfinementError(f"expected a regular file at {self.root.joinpath(*parts)}, found a "
                                           "symbolic link; steerkit never follows links inside its folders") from None
                raise
        finally:
            os.close(fd)
        try:
            st = os.fstat(ffd)
            if not stat.S_ISREG(st.st_mode):
                raise ConfinementError(f"expected a regular file at {self.root.joinpath(*parts)}, found "
                                       "another kind (a folder, FIFO, socket or device)")
            if st.st_size > max_bytes:
                raise ConfinementError(f"expected a file of at most {max_bytes} bytes at "
                                       f"{self.root.joinpath(*parts)}, found {st.st_size} bytes")
            chunks, n = [], 0
            while True:
                b = os.read(ffd, min(1 << 20, max_bytes + 1 - n))
                if not b:
                    break
                chunks.append(b)
                n += len(b)
                if n > max_bytes:
                    raise ConfinementError(f"{self.root.joinpath(*parts)} grew past {max_bytes} bytes while "
                                           "being read; refusing it")
            return b"".join(chunks)
        finally:
            os.close(ffd)

    # --- writing and removing -------------------------------------------------------------
    def write_bytes(self, rel: "str | os.PathLike[str]", data: bytes) -> None:
        """Write ``rel`` atomically (a temporary file in the same folder, fsync, rename), creating its
        folders; a link at ``rel`` is replaced by the file, never written through."""
        parts = _parts(rel)
        if not parts:
            raise ConfinementError(f"expected a file name below {self.root}, found none")
        fd = self._dir_fd(parts[:-1], create=True)
        tmp = f".{parts[-1]}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        try:
            wfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                          _umask_mode(), dir_fd=fd)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(wfd, view):]
                os.fsync(wfd)
            finally:
                os.close(wfd)
            os.replace(tmp, parts[-1], src_dir_fd=fd, dst_dir_fd=fd)
            os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=fd)
            raise
        finally:
            os.close(fd)

    def remove(self, rel: "str | os.PathLike[str]") -> None:
        """Remove the entry ``rel``: a file or a link is unlinked (a link's target is never touched), a
        folder is removed with everything below it, each entry by its own name inside its own folder
        (``shutil.rmtree``'s fd-based walk), so nothing outside the folder is ever deleted."""
        parts = _parts(rel)
        if not parts:
            raise ConfinementError(f"expected an entry below {self.root} to remove, found the folder itself")
        try:
            fd = self._dir_fd(parts[:-1])
        except (FileNotFoundError, NotADirectoryError):
            return
        try:
            try:
                st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(parts[-1], dir_fd=fd)
            else:
                os.unlink(parts[-1], dir_fd=fd)
        finally:
            os.close(fd)


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False
