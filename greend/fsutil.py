"""Small durable-file helpers: the one atomic write, and fsync of a directory."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_dir", "write_atomic"]


def fsync_dir(path: Path) -> None:
    """fsync a directory, so a rename or unlink in it survives a power cut.

    Best effort: a filesystem that cannot fsync directories is not an error.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(
    path: Path,
    data: bytes | str,
    *,
    mode: int = 0o666,
    exact_mode: bool = False,
    durable: bool = True,
) -> None:
    """Replace ``path`` with ``data`` so a reader sees the old file or the new one,
    never a torn one: a temporary file in the same directory, then ``os.replace``.

    ``mode``: the new file's permissions, less the umask (``exact_mode``: exactly
    ``mode``). ``durable``: fsync the file before the rename and the directory after
    it, so the new file also survives a power cut (not only a crashed process).
    The temporary file is ``.<name>.<pid>.tmp``, so one thread at a time may write
    a given path (callers hold their lock); it is removed when the write fails, and
    the OSError is raised.
    """
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view) :]
            if exact_mode:
                os.fchmod(fd, mode)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    if durable:
        fsync_dir(path.parent)
