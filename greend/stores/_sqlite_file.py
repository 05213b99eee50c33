"""What the SQLite store (:mod:`greend.stores.sqlite`) reads of its file and of SQLite's
errors: another connection's lock, a corrupt file, a full disk, the descriptors a
connection opened, and whether a file is an SQLite database at all; and the store's
readers (``greenctl report``, tests), which open it read-only beside the writer."""

from __future__ import annotations

import errno
import os
import re
import sqlite3
from pathlib import Path
from typing import Any

from greend.errors import StoreError

__all__ = [
    "busy",
    "connect_readonly",
    "corrupt",
    "describe",
    "fit",
    "ident",
    "no_room",
    "open_fds",
    "read_rows",
    "sql_type",
    "sqlite_header",
]


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


def no_room(e: BaseException) -> bool:
    """The file cannot be written at all, whatever is written (SQLITE_FULL, SQLITE_IOERR,
    SQLITE_READONLY, SQLITE_CANTOPEN, or the OS's ENOSPC, EROFS, EIO, EDQUOT): not one bad
    point, and no other connection's lock."""
    code = getattr(e, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (
            sqlite3.SQLITE_FULL,
            sqlite3.SQLITE_IOERR,
            sqlite3.SQLITE_READONLY,
            sqlite3.SQLITE_CANTOPEN,
        )
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EROFS, errno.EIO, errno.EDQUOT)
    text = str(e).lower()
    return isinstance(e, sqlite3.OperationalError) and any(
        w in text for w in ("disk is full", "disk i/o error", "readonly database", "unable to open database file")
    )


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


def fit(value: Any) -> Any:
    """An integer past SQLite's 64 bits (a sum of counts a client sent, each in range)
    goes in as a REAL, never losing its row."""
    if type(value) is int and not -(1 << 63) <= value < (1 << 63):
        return float(value)
    return value


def sql_type(value: Any) -> str:
    if isinstance(value, bool) or isinstance(value, int):
        return "INTEGER"
    if isinstance(value, float):
        return "REAL"
    return "TEXT"


_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}\Z")


def ident(name: str) -> str:
    if not _IDENT.match(name):
        raise StoreError(f"not a valid column or table name: {name!r}")
    return f'"{name}"'


def connect_readonly(path: Path) -> sqlite3.Connection:
    """Open the store for reading (greenctl report, tests) without blocking the writer."""
    if not path.exists():
        raise StoreError(f"no SQLite store at {path}")
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    return db


def read_rows(path: Path, measurement: str, where: str = "", params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
    db = connect_readonly(path)
    try:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if measurement not in tables:
            return []
        sql = f"SELECT * FROM {ident(measurement)}"
        if where:
            sql += f" WHERE {where}"
        sql += " ORDER BY ts_ns"
        return [dict(r) for r in db.execute(sql, params)]
    finally:
        db.close()
