"""Points the SQLite store's file could not take (a full disk, a read-only file system, an
I/O error): kept in memory, oldest first, bounded, for the store's writer thread to write a
chunk at a time once the file takes writes again (:class:`greend.stores.sqlite.SqliteStore`).

The list is changed in place (points leave it only once written or counted lost), so
``len()`` read from another thread (``status().pending``) never drops to 0 mid-try."""

from __future__ import annotations

import time
from collections.abc import Callable

from greend.points import Point

__all__ = ["HELD_MAX", "HELD_RETRY_S", "Held"]

HELD_MAX = 50_000  # points at most (about 1 KB each in the daemon: some 50 MB); the oldest dropped beyond
HELD_RETRY_S = 5.0  # while the file cannot be written, the held points are tried this often


class Held:
    def __init__(
        self, max_points: int = HELD_MAX, retry_s: float = HELD_RETRY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.points: list[Point] = []
        self.max_points = max_points
        self.retry_s = retry_s
        self.clock = clock
        self.over = 0  # points dropped beyond the bound, all told
        self.why = ""  # why the file refused them last
        self._retry_at = 0.0

    def __len__(self) -> int:
        return len(self.points)

    def add(self, points: list[Point]) -> int:
        """Put ``points`` behind those held; the number of the oldest dropped beyond the bound."""
        self.points.extend(points)
        over = len(self.points) - self.max_points
        if over <= 0:
            return 0
        del self.points[:over]
        self.over += over
        return over

    def head(self, n: int) -> list[Point]:
        """The ``n`` oldest (a copy: they stay held until :meth:`done`)."""
        return self.points[:n]

    def done(self, n: int) -> None:
        """The ``n`` oldest were written or counted lost."""
        del self.points[:n]

    def clear(self) -> int:
        n = len(self.points)
        self.points.clear()
        return n

    def failed(self, why: str = "", where: object = "") -> str:
        """The file refused them again (``why``): the next try waits ``retry_s``; what to tell."""
        self._retry_at, self.why = self.clock() + self.retry_s, why
        return self.say(where)

    def due(self) -> bool:
        return self.clock() >= self._retry_at

    def say(self, where: object) -> str:
        """Why, how many are held and how many were dropped beyond the bound (``last_error``)."""
        lost = f"; {self.over} older ones dropped beyond {self.max_points}" if self.over else ""
        return (
            f"{self.why}: {len(self.points)} points held in memory, written once the store {where} takes writes "
            f"again (tried every {self.retry_s:g} s){lost}"
        )
