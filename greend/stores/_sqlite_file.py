"""What the SQLite store (:mod:`greend.stores.sqlite`) reads of its file and of SQLite's
errors: another connection's lock, a corrupt file, a full disk, the descriptors a
connection opened, and whether a file is an SQLite database at all."""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path

__all__ = ["busy", "corrupt", "describe", "open_fds", "sqlite_header"]


def busy(e: BaseException) -> bool:
    """SQLite says another connection holds the file's lock (SQLITE_BUSY, SQLITE_LOCKED)."""
    code = getattr(e, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    return isinstance(e, sqlite3.OperationalError) and "locked" in str(e).lower()


def corrupt(e: BaseException) -> bool:
    """SQLite says the file is not a database, or a malformed one."""
    text = str(e).lower()
    return isinstance(e, sqlite3.DatabaseError) and ("malformed" in text or "not a database" in text)


def describe(e: BaseException) -> str:
    text = str(e)
    if "full" in text.lower() or getattr(e, "errno", None) == errno.ENOSPC:
        return f"{text} (the disk holding the store is full: free space; the store heals by itself)"
    return text


def open_fds() -> dict[int, tuple[int, int]]:
    """This process's open descriptors and the (device, inode) each refers to (empty
    without /proc). By file, not by number alone: a number freed (the listing's own
    descriptor) and taken again by SQLite is a new file."""
    out: dict[int, tuple[int, int]] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for n in names:
        try:
            st = os.stat(f"/proc/self/fd/{n}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor, another thread's)
        out[int(n)] = (st.st_dev, st.st_ino)
    return out


def sqlite_header(path: Path) -> bool:
    """Whether the file starts as every SQLite database does (an empty file counts too):
    a damaged store keeps its header, another program's file has none."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(16)
    except OSError:
        return True  # (cannot tell: as before)
    return not head or head == b"SQLite format 3\x00"
