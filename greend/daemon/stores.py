"""The daemon's stores: opening each configured store, retrying the ones that failed,
writing points to all, and listing them for ``greenctl status``.

Each store fails on its own. One that fails to open is tried again every
``[store] retry_s`` on a thread of its own (a constructor may touch a slow disk: spool
recovery, SQLite locks), so the tick never waits for one. The points written meanwhile
are held for it (the latest :data:`HOLD_POINTS`; older ones are dropped and counted) and
written once it opens: its status shows them as pending, then as written.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from greend.config import Config
from greend.errors import StoreError
from greend.points import Point
from greend.stores import Store, open_store, redact_url

__all__ = ["StoreSet"]

log = logging.getLogger(__name__)

HOLD_POINTS = 20_000  # points held for a store that has not opened yet (about 15 MB)


class StoreSet:
    """Every store of one daemon, open or waiting for its next try."""

    def __init__(
        self, cfg: Config, *, hostname: str, monotonic: Callable[[], float], status: Callable[[], dict[str, Any]]
    ) -> None:
        self.cfg = cfg
        self.hostname = hostname
        self.monotonic = monotonic
        self.status = status  # the daemon's status document, which Prometheus scrapes
        self.state_dir: Path = cfg.daemon.state_dir  # where stores keep their spools
        # The open ones (replaced, never mutated, so that write() on the tick thread may
        # iterate while a retry adds one), and the ones that failed to open.
        self.opened: list[Store] = []
        self.open_errors: dict[str, str] = {}
        self.retry_s: float = cfg.store.retry_s
        self._retry_due_s: dict[str, float] = {}
        self._attempts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._retry_thread: threading.Thread | None = None
        self._closing = False
        # Points for the stores not open yet (written when they open), and those dropped
        # past HOLD_POINTS, counted in the store's status from then on.
        self._held: dict[str, deque[Point]] = {}
        self._dropped_unopened: dict[str, int] = {}  # url -> points, until it opens
        self._dropped_before_open: dict[int, int] = {}  # id(store) -> points, once it opened

    def open_all(self) -> None:
        for url in self.cfg.store_urls:
            self.open(url, first=True)

    def open(self, url: str, *, first: bool) -> bool:
        """Open one store; on failure note why and when it is tried again.

        At start only a StoreError is survived (anything else is a bug that should
        stop the daemon); a retry, on a thread of its own, survives anything.
        """
        try:
            store = open_store(
                url,
                state_dir=self.state_dir,
                host=self.hostname,
                retention_days=self.cfg.store.retention_days,
                raw_hours=self.cfg.store.raw_hours,
                rollup_s=self.cfg.store.rollup_s,
                state_dir_path=self.cfg.daemon.state_dir,
            )
            attach = getattr(store, "attach", None)
            if attach is not None:
                attach(self.status)  # Prometheus scrapes the latest status, not points
        except Exception as e:
            if first and not isinstance(e, StoreError):
                raise
            msg = str(e) if isinstance(e, StoreError) else f"{type(e).__name__}: {e}"
            msg = msg.replace(url, redact_url(url))  # (its secrets: the message goes to the log and status)
            with self._lock:
                self._attempts[url] = self._attempts.get(url, 0) + 1
                same = self.open_errors.get(url) == msg
                self.open_errors[url] = msg
                self._retry_due_s[url] = self.monotonic() + self.retry_s
            (log.error if first else log.debug if same else log.warning)(
                "store %s: %s (retrying every %g s)", redact_url(url), msg, self.retry_s
            )
            return False
        attempts = 0
        with self._lock:
            closing = self._closing
            if not closing:
                # What was held for it first; under the lock, so that no point written
                # meanwhile is held for a store that has just opened (write() takes the
                # lock while any store waits).
                held = self._held.pop(url, None)
                if held:
                    try:
                        store.write(list(held))
                    except Exception as e:
                        log.error(
                            "store %s: write of the %d points held for it failed: %s", redact_url(url), len(held), e
                        )
                        self._dropped_unopened[url] = self._dropped_unopened.get(url, 0) + len(held)
                self._dropped_before_open[id(store)] = self._dropped_unopened.pop(url, 0)
                self.opened = [*self.opened, store]
                self.open_errors.pop(url, None)
                self._retry_due_s.pop(url, None)
                attempts = self._attempts.pop(url, 0)
        if closing:  # the daemon shut down while this retry ran
            try:
                store.close(timeout_s=1.0)
            except Exception as e:
                log.warning("store %s: close failed: %s", redact_url(url), e)
            return False
        if attempts:
            log.info("store %s: open after %d failed attempt%s", redact_url(url), attempts, "s" * (attempts > 1))
        return True

    @property
    def waiting(self) -> bool:
        """Some store failed to open and waits for its next try."""
        return bool(self._retry_due_s)

    def retry_due(self, now_s: float) -> None:
        """Reopen, on a thread, the stores whose next try is due (one thread at a time)."""
        t = self._retry_thread
        if t is not None and t.is_alive():
            return
        with self._lock:
            if self._closing:
                return
            due = [u for u, at in self._retry_due_s.items() if now_s >= at]
        if not due:
            return

        def reopen() -> None:
            for url in due:
                self.open(url, first=False)

        self._retry_thread = threading.Thread(target=reopen, name="greend-store-retry", daemon=True)
        self._retry_thread.start()

    def write(self, points: list[Point]) -> None:
        # open() publishes a store in ``opened`` before it leaves ``open_errors`` (both under
        # the lock): read in this order, a store that opens meanwhile gets the points either
        # way, never neither.
        if not self.open_errors:
            opened = self.opened
        else:
            with self._lock:
                opened = self.opened
                for url in self.open_errors:
                    if url.startswith("prometheus:"):
                        continue  # (it serves the latest status, not points: nothing to hold)
                    held = self._held.setdefault(url, deque())
                    held.extend(points)
                    over = len(held) - HOLD_POINTS
                    if over > 0:
                        for _ in range(over):
                            held.popleft()
                        self._dropped_unopened[url] = self._dropped_unopened.get(url, 0) + over
        for store in opened:
            try:
                store.write(points)
            except Exception as e:
                log.error("store %s: write failed: %s", redact_url(store.url), e)

    def rows(self) -> list[dict[str, Any]]:
        """Every configured store, in config order: the open ones' own status, and the
        ones that failed to open with why and when they are tried again."""
        with self._lock:
            stores = list(self.opened)
            failed = [
                (u, e, self._retry_due_s.get(u, 0.0), self._attempts.get(u, 0), len(self._held.get(u, ())))
                for u, e in self.open_errors.items()
            ]
            dropped_unopened = dict(self._dropped_unopened)
            before_open = [self._dropped_before_open.get(id(s), 0) for s in stores]
        now = self.monotonic()
        rows = [s.status().to_json() for s in stores]
        for r, dropped in zip(rows, before_open, strict=True):  # (and those dropped before it opened)
            r["dropped"] = r.get("dropped", 0) + dropped
        for url, err, due, attempts, held in failed:
            retry_in = max(0.0, due - now)
            rows.append(
                {
                    "name": url.split(":", 1)[0],
                    "url": url,
                    "ok": False,
                    "written": 0,
                    "pending": held,
                    "dropped": dropped_unopened.get(url, 0),
                    "last_error": f"failed to open: {err}; retrying every {self.retry_s:g} s "
                    f"(attempt {attempts} failed, next in {retry_in:.0f} s)",
                    "open_attempts": attempts,
                    "retry_in_s": retry_in,
                }
            )
        order = {u: i for i, u in enumerate(self.cfg.store_urls)}
        rows.sort(key=lambda r: order.get(r.get("url", ""), len(order)))
        for r in rows:  # (status is readable by the socket's group: a store's password never shows)
            r["url"] = redact_url(str(r.get("url", "")))
        return rows

    def close(self) -> None:
        with self._lock:
            self._closing = True  # a retry that opens a store from now on closes it again
            stores = list(self.opened)
            held = {url: len(points) for url, points in self._held.items() if points}
            self._held.clear()
        for url, n in held.items():
            log.error("store %s never opened: the %d points held for it are lost", redact_url(url), n)
        for store in stores:
            try:
                store.close(timeout_s=5.0)
            except Exception as e:
                log.error("store %s: close failed: %s", redact_url(store.url), e)
