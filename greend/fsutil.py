"""Small durable-file helpers shared by the state file and the store spool."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_dir"]


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
