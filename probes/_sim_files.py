"""Files that other processes read while this one writes: atomic JSON and a file lock.

The simulated devices (``gpu<i>.json``, their process tables) and the fake NVML's
``faults.json`` live in a directory that a daemon, a test and a restarted daemon share,
as hardware outlives a process: a reader sees an old file or a new one, never a torn one,
and writers that read, edit and write take the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def write_json_atomic(path: Path, data: Any, *, keep_open: bool = False) -> int | None:
    """Write JSON so a reader sees the old file or the new one, never a torn one.

    No fsync: the simulated device must outlive a crashed *process* (the page cache
    does), not a power cut, and a step executed on the simulator writes this file.
    ``keep_open``: return an open descriptor of the file written (the caller closes
    it): while it is open the file's inode number cannot be given to another file, so
    an unchanged ``(st_ino, st_mtime_ns, st_size)`` shows that no other file replaced it.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    text = json.dumps(data, separators=(",", ":"), sort_keys=True)  # (the C encoder; dump() is not)
    data_b = memoryview(text.encode("utf-8"))
    fd = os.open(tmp, (os.O_RDWR if keep_open else os.O_WRONLY) | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while data_b:
            data_b = data_b[os.write(fd, data_b) :]
        os.replace(tmp, path)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if keep_open:
        return fd
    os.close(fd)
    return None


@contextmanager
def file_lock(lock_path: Path) -> Iterator[None]:
    """An exclusive ``fcntl`` lock on ``lock_path`` (created if missing)."""
    with open(lock_path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
