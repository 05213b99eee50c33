"""The embedded store: one SQLite file, a table per measurement.

Each measurement (``greend_gpu``, ``greend_cpu``, ...) becomes a table with a
``ts_ns`` column (Unix time, nanoseconds), one TEXT column per tag and one column
per field; columns appear as new tags or fields do. The file is in WAL mode so
``greenctl`` and ``sqlite3`` can read while the daemon writes.

Writes are batched off the tick path: ``write()`` only appends to a queue; a
writer thread commits one transaction per batch (every ``batch_s`` or when the
queue holds ``batch_max`` points) and prunes rows older than the retention.

A store that heals: the schema cache learns a table or column only once the
transaction that made it committed; a batch that fails is written again point by
point, so one bad point (or a moment of full disk) loses only itself; a file
SQLite calls corrupt is moved aside (``<name>.corrupt-<timestamp>``, said in the
log and ``last_error``) and a fresh one started. A batch that meets another process's
lock on the file (an operator's ``sqlite3``, a backup) waits for it, up to
``BUSY_RETRY_S``; at close the writer is interrupted, never closed under. What the file
cannot take at all (a full disk) is held in memory (``_held``) and goes first once it can.
Every lost point is counted in ``dropped`` (``greenctl status``, ``greend_store_points_dropped``).
"""

from __future__ import annotations

import logging
import os
import queue
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult, urlsplit

from greend.errors import ConfigError, StoreError
from greend.points import Point
from greend.stores import StoreOptions, StoreStatus, redact_url, register_store
from greend.stores._held import Held
from greend.stores._repeats import RepeatedErrors
from greend.stores._sqlite_file import (
    busy,
    connect_readonly,
    corrupt,
    describe,
    fit,
    ident,
    no_room,
    open_fds,
    read_rows,
    sql_type,
    sqlite_header,
)
from greend.stores._sqlite_rollup import ROLLUP_LAST, ROLLUP_SUM

__all__ = ["SqliteStore", "read_rows", "connect_readonly"]

log = logging.getLogger(__name__)
IDENTITY_CHECK_S = 5.0  # how often the writer checks that the store's file is still the one open
BUSY_TIMEOUT_S = 5.0  # SQLite waits this long for another connection's lock (PRAGMA busy_timeout) ...
BUSY_RETRY_S = 120.0  # ... and a batch is tried again for this long before its points are tried one by one


class SqliteStore:
    name = "sqlite"

    def __init__(
        self,
        path: Path,
        *,
        url: str | None = None,
        retention_days: float = 30.0,
        raw_hours: float = 24.0,
        rollup_s: float = 300.0,
        batch_s: float = 0.5,
        batch_max: int = 5000,
        queue_max: int = 200_000,
        held_dir: Path | None = None,
    ) -> None:
        self.path = path
        # Where the file is opened: through the daemon's held state dir
        # (``/proc/self/fd/N/<name>``, see :meth:`_open`) when ``held_dir`` is given.
        self.held_dir = held_dir
        self.file = held_dir / path.name if held_dir is not None else path
        self.url = url or f"sqlite:///{path}"
        self.retention_days = retention_days
        self.raw_hours = raw_hours
        self.rollup_s = rollup_s
        self._rolled_until_ns = 0  # rows before this were rolled up already (this process)
        self._batch_s = batch_s
        self._batch_max = batch_max
        self._queue: queue.Queue[Point | None] = queue.Queue(maxsize=queue_max)
        self._columns: dict[str, set[str]] = {}
        self._written = 0
        self._dropped = 0  # points lost, all causes (status: dropped)
        self._errors = RepeatedErrors(log)  # (a full disk fails every batch: logged once per 5 min)
        self._reopened: str | None = None  # why the file was opened anew, said with the next batch
        self._queue_full = 0  # of them, refused by a full queue
        self._held = Held()  # what the file could not take (changed by the writer thread only): written first
        self._full_at_close = False  # closing, the file took nothing: what is left is counted at once
        self._batch_held = False  # the batch being committed joined the held points (not counted lost on a bug)
        self._last_error: str | None = None
        self.moved_aside: list[str] = []  # corrupt files set aside, newest last
        try:
            if held_dir is None:
                path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self._open()
            except sqlite3.DatabaseError as e:
                if not corrupt(e):
                    raise
                if not sqlite_header(self.file):  # not a damaged store: someone's file (a typo'd path)
                    raise StoreError(
                        f"the store path {path} holds a file that is not an SQLite database ({e}): greend leaves it "
                        "as it is; give the SQLite store a path of its own (sqlite:///var/lib/greend/greend.db)"
                    ) from None
                self._move_aside(e)
                self._open()
        except (OSError, sqlite3.Error) as e:
            raise StoreError(
                f"cannot open the SQLite store {path}: {e} (check that the state dir exists and is writable by greend)"
            ) from e
        self._last_prune = 0.0
        self._closing = threading.Event()  # close() has begun: a locked file is not waited for again
        self._locked_out = False  # closing met the lock: the points left are counted, not written
        self._thread = threading.Thread(target=self._run, name="store-sqlite", daemon=True)
        self._thread.start()

    def _open(self) -> None:
        """Open the file (and its -wal and -shm), in the held state dir where there is one.

        The store is greend's own (0600, whatever the umask): created here, never through
        a link (``O_NOFOLLOW``); SQLite gives its -wal and -shm files the same mode.

        In the daemon, the default store lives in the state dir, which greend holds open
        (:class:`greend.fsutil.StateDir`) because whoever owns a directory above it could
        swap it for a symlink after start. Why the store cannot be redirected then:

        * The name SQLite is given is ``/proc/self/fd/N/greend.db``: ``/proc/self/fd/N``
          is the kernel's link to the held directory itself, not a path walked by name,
          so a swapped path above it is never followed; the file name is created with
          ``O_NOFOLLOW`` first, so a link planted in its place is refused. Nobody but
          greend's uid (and root) can plant one: the state dir was checked to be private
          (0700, greend's) when it was opened.
        * SQLite turns the name into a full path of its own (it resolves links: the
          held directory's current name, as the kernel reports it) and opens that, and
          names its -wal and -shm files after it. Between that resolution and the open,
          an owner of a parent directory could still move the directory and put a link
          there. So after the open, every descriptor SQLite opened for these three
          files is checked (``fstat``) to be the very file inside the held directory
          (device and inode of the name looked up through the descriptor, without
          following a link); any other file is refused (StoreError, the connection
          closed) and the store retried as a store that failed to open.
        """
        fd = os.open(self.file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.close(fd)
        before = open_fds() if self.held_dir is not None else {}
        self._db = sqlite3.connect(str(self.file), check_same_thread=False, isolation_level=None)
        # Pages freed by the retention go back to the file system (incremental vacuum
        # after each prune); settable only while the file has no tables, so a store made
        # by an older greend keeps its size until a manual VACUUM.
        if not self._db.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchone():
            self._db.execute("PRAGMA auto_vacuum=INCREMENTAL")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
        if self.held_dir is not None:
            try:
                self._check_opened_inside(before)
            except StoreError:
                self._db.close()
                raise
        self._columns = {}
        self._load_schema()
        st = os.stat(self.file, follow_symlinks=False)
        self._identity, self._identity_checked = (st.st_dev, st.st_ino), time.monotonic()

    def _still_there(self) -> None:
        """Every few seconds, on the writer thread: the file at the store's path is still
        the one open. One deleted or replaced under greend (rows written to it would be
        lost at close, unseen) is said in status and the log, and a new one is opened."""
        now = time.monotonic()
        if now - self._identity_checked < IDENTITY_CHECK_S:
            return
        self._identity_checked = now
        try:
            st = os.stat(self.file, follow_symlinks=False)
            same = (st.st_dev, st.st_ino) == self._identity
        except OSError:
            same = False
        if same:
            return
        why = f"the SQLite store {self.path} was deleted or replaced while greend wrote to it: opened anew"
        log.error("sqlite store: %s", why)
        try:
            self._db.close()
        except sqlite3.Error:
            pass
        self._open()
        self._reopened = self._last_error = why

    def _check_opened_inside(self, before: dict[int, tuple[int, int]]) -> None:
        """Each descriptor opened since ``before`` for the store's files (the database,
        -wal, -shm: by the name the kernel gives it) is the file of that name inside the
        held state dir (see :meth:`_open`)."""
        assert self.held_dir is not None
        names = {self.path.name + suffix for suffix in ("", "-wal", "-shm")}
        for n, file_id in sorted(open_fds().items()):
            if before.get(n) == file_id:
                continue
            try:
                target = os.readlink(f"/proc/self/fd/{n}")
                if os.path.basename(target) not in names:
                    continue
                want = os.lstat(self.held_dir / os.path.basename(target))
            except FileNotFoundError:
                continue  # a descriptor closed meanwhile (another thread's)
            if file_id != (want.st_dev, want.st_ino):
                raise StoreError(
                    f"the SQLite store {self.path}: SQLite opened {target}, not the file in the state dir greend "
                    "holds open (the state dir was moved or replaced by a link after greend started): refused"
                )

    def _move_aside(self, e: Exception) -> None:  # (only a file with SQLite's header: sqlite_header)
        """The file is corrupt: rename it (and its WAL) aside and start a fresh one."""
        try:
            self._db.close()
        except (AttributeError, sqlite3.Error):
            pass
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        dest = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        moved = self.file.with_name(dest.name)  # in the held state dir, where there is one
        for suffix in ("", "-wal", "-shm"):
            src = Path(str(self.file) + suffix)
            if src.exists():
                os.replace(src, Path(str(moved) + suffix))
        self.moved_aside.append(str(dest))
        msg = (
            f"the SQLite store {self.path} is corrupt ({e}): moved aside to {dest} (inspect or delete it), "
            "a fresh store started"
        )
        log.error("%s", msg)
        self._last_error = msg

    # Public API ----------------------------------------------------------------------
    def write(self, points: list[Point]) -> None:
        full = 0
        for p in points:
            try:
                self._queue.put_nowait(p)
            except queue.Full:
                full += 1
        if full:
            before = self._queue_full
            self._queue_full += full
            self._dropped += full
            if before == 0 or before // 10_000 != self._queue_full // 10_000:  # the first, then every 10,000
                log.error("sqlite store queue full: %d points dropped so far", self._queue_full)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued point is committed, held (the file cannot be written:
        ``pending``), or has failed and been counted."""
        # The writer marks each point done only after its batch's COMMIT: unlike an
        # "empty queue and idle writer" check, this cannot pass while a batch is in hand.
        deadline = time.monotonic() + timeout_s
        q = self._queue
        with q.all_tasks_done:
            while q.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                q.all_tasks_done.wait(left)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        self.flush(timeout_s)
        self._closing.set()
        try:
            self._queue.put(None, timeout=timeout_s)  # (a full queue of a writer that stopped: never wait for good)
        except queue.Full:
            log.warning("sqlite store %s: closed with %d points not written", self.path, self._queue.qsize())
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            # The writer is inside a statement (another process holds the file's lock):
            # interrupt it (sqlite3_interrupt is safe from another thread) and let it end.
            # Closing the connection under it would crash the process.
            try:
                self._db.interrupt()
            except sqlite3.Error:
                pass
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error(
                "sqlite store %s: closed with its writer still waiting on the file (%d points not written)",
                self.path,
                self._queue.qsize(),
            )
            return  # (the connection is left to the process's exit)
        left = self._queue.qsize()
        if left:
            log.warning("sqlite store %s: closed with %d points not written", self.path, left)
        try:
            self._db.close()
        except sqlite3.Error:
            pass

    def status(self) -> StoreStatus:
        last_error = self._last_error  # read once: the writer thread may change it meanwhile
        return StoreStatus(
            name=self.name,
            url=self.url,
            ok=last_error is None,
            written=self._written,
            pending=self._queue.qsize() + len(self._held),
            dropped=self._dropped,
            last_error=last_error,
            extra={"path": str(self.path), **({"moved_aside": self.moved_aside} if self.moved_aside else {})},
        )

    # Writer thread -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            batch: list[Point] = []
            try:
                first = self._queue.get(timeout=self._batch_s)
            except queue.Empty:
                self._try_held(at_close=False)  # (held points, if any, are tried when due, new points or none)
                self._maybe_prune()
                continue
            if first is None:
                self._queue.task_done()
                self._try_held()
                return
            batch.append(first)
            deadline = time.monotonic() + self._batch_s
            stop = False
            while len(batch) < self._batch_max:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    p = self._queue.get(timeout=left)
                except queue.Empty:
                    break
                if p is None:
                    stop = True
                    self._queue.task_done()
                    break
                batch.append(p)
            try:
                self._commit(batch)
            except Exception as e:  # a bug: the batch is lost, counted (unless held), and the writer goes on
                self._dropped += 0 if self._batch_held else len(batch)
                self._last_error = f"writing {len(batch)} points failed: {type(e).__name__}: {e}"
                log.exception("sqlite store: writing %d points failed", len(batch))
            finally:
                for _ in batch:
                    self._queue.task_done()
            self._maybe_prune()
            if stop:
                self._try_held()
                return

    def _commit(self, batch: list[Point]) -> None:
        held, self._batch_held = self._held, False
        if not held:
            if batch and (keep := self._write(batch)):
                self._dropped += held.add(keep)
                self._last_error = held.failed(self._last_error or "", self.path)
                self._errors.error("sqlite store: %s", self._last_error)
            return
        self._dropped += held.add(batch)  # (behind what waits: in order)
        self._batch_held = True
        if not held.due() and not self._closing.is_set():
            self._last_error = held.say(self.path)  # (the counts as they are now)
            return
        n = len(held)
        while held:  # a chunk a transaction: the WAL never holds more, and some room is some progress
            chunk = held.head(self._batch_max)
            try:
                keep = self._write(chunk)
            except Exception:  # a bug: the chunk leaves the held points, counted lost (never written twice)
                held.done(len(chunk))
                self._dropped += len(chunk)
                raise
            held.done(len(chunk) - len(keep))
            if keep:
                self._last_error = held.failed(self._last_error or "", self.path)
                self._errors.error("sqlite store: %s", self._last_error)
                return
            if self._full_at_close:  # (the chunk counted: the rest with it)
                self._dropped += held.clear()
        if not self._closing.is_set():
            log.warning("sqlite store %s: writes again; the %d points held are written", self.path, n)

    def _try_held(self, at_close: bool = True) -> None:
        """The held points tried (when due; at close, once more): a bug there never stops
        the writer (the chunk it met is counted lost; at close, all of them)."""
        try:
            self._commit([])
        except Exception as e:
            self._dropped += self._held.clear() if at_close else 0
            self._last_error = f"writing the held points failed: {type(e).__name__}: {e}"
            log.exception("sqlite store %s: writing the held points failed", self.path)

    def _write(self, batch: list[Point]) -> list[Point]:
        """Write ``batch``; the tail of it to hold (the file cannot be written at all), else
        nothing: what is not written is counted lost."""
        if self._locked_out:  # closing, the file locked by another process: not waited for again
            self._dropped += len(batch)
            return []
        try:
            self._still_there()
        except (OSError, sqlite3.Error, StoreError) as e:
            self._last_error = f"the SQLite store {self.path} cannot be opened again: {e}"
            if not self._closing.is_set():
                return batch
            self._dropped += len(batch)
            self._errors.error("sqlite store: %s", self._last_error)
            return []
        reopened, self._reopened = self._reopened, None
        error = self._transaction(batch)
        waited = 0.0
        while error is not None and busy(error) and waited < BUSY_RETRY_S and not self._closing.is_set():
            # Another process holds the file's lock (a manual DELETE, a VACUUM, a backup)
            # beyond the busy timeout: the batch is kept and tried again, not lost.
            if waited == 0.0:
                log.warning("sqlite store %s: %s; the batch of %d points waits for it", self.path, error, len(batch))
            time.sleep(1.0)
            waited += 1.0 + BUSY_TIMEOUT_S
            error = self._transaction(batch)
        if error is not None and self._closing.is_set() and (busy(error) or "interrupt" in str(error).lower()):
            self._locked_out = True
            self._dropped += len(batch)
            self._last_error = f"closed while another process held the store's lock: {error}"
            log.error("sqlite store %s: %s; %d points not written", self.path, self._last_error, len(batch))
            return []
        if error is None:
            self._written += len(batch)
            self._last_error = reopened  # (said once more in status, cleared at the next batch)
            return []
        if corrupt(error):
            try:
                self._move_aside(error)
                self._open()
            except (OSError, sqlite3.Error) as e:
                self._dropped += len(batch)
                self._last_error = f"the SQLite store {self.path} is corrupt and cannot be replaced: {e}"
                self._errors.error("sqlite store: %s", self._last_error)
                return []
            moved = self._last_error
            if (error := self._transaction(batch)) is None:  # (the fresh file's error, if any, is judged below)
                self._written += len(batch)
                self._last_error = moved
                return []
        if no_room(error):
            return self._no_room(batch, error)
        # Point by point: one bad point loses only itself.
        lost, last = 0, error
        for k, p in enumerate(batch):
            if self._closing.is_set() and busy(last):
                # Closing, the file still locked: not waited for point by point (the busy
                # timeout each); what is left of the batch is counted.
                self._locked_out = True
                lost += len(batch) - k
                break
            point_error = self._transaction([p])
            if point_error is None:
                self._written += 1
            elif no_room(point_error):  # (a bad point's error first, then the full disk)
                self._dropped += lost
                return self._no_room(batch[k:], point_error)
            else:
                lost += 1
                last = point_error
        self._dropped += lost
        if lost:
            self._last_error = describe(last)
            self._errors.error("sqlite store: %d of a batch of %d points lost: %s", lost, len(batch), self._last_error)
        else:
            self._last_error = None
        return []

    def _no_room(self, batch: list[Point], error: Exception) -> list[Point]:
        """The file cannot be written at all: ``batch`` to hold, or at close counted lost."""
        self._last_error = describe(error)
        if not self._closing.is_set():
            return batch
        self._full_at_close, self._dropped = True, self._dropped + len(batch)
        self._last_error = f"closed while the file could not be written: {self._last_error}"
        n = len(self._held) or len(batch)  # (a chunk of the held points: all of them)
        log.error("sqlite store %s: %s; %d points not written", self.path, self._last_error, n)
        return []

    def _transaction(self, batch: list[Point]) -> Exception | None:
        """Write ``batch`` in one transaction; the error, rolled back, or None. The schema
        cache learns new tables and columns only after the COMMIT."""
        added: dict[str, set[str]] = {}
        try:
            by_table: dict[str, list[Point]] = {}
            for p in batch:
                by_table.setdefault(p.measurement, []).append(p)
            self._db.execute("BEGIN")
            for table, pts in by_table.items():
                self._ensure_columns(table, pts, added)
                cols = sorted({c for p in pts for c in (*p.tags, *p.fields)})
                sql = (
                    f"INSERT INTO {ident(table)} (ts_ns, {', '.join(ident(c) for c in cols)}) "
                    f"VALUES (?, {', '.join('?' for _ in cols)})"
                )
                rows = []
                for p in pts:
                    merged: dict[str, Any] = {**p.tags, **p.fields}
                    rows.append((p.ts_ns, *(fit(merged.get(c)) for c in cols)))
                self._db.executemany(sql, rows)
            self._db.execute("COMMIT")
        except (sqlite3.Error, StoreError, OSError, ValueError, OverflowError) as e:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            return e
        for table, new_cols in added.items():
            self._columns.setdefault(table, set()).update(new_cols)
        return None

    def _load_schema(self) -> None:
        tables = [r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for t in tables:
            self._columns[t] = {r[1] for r in self._db.execute(f"PRAGMA table_info({ident(t)})")}

    def _ensure_columns(self, table: str, pts: list[Point], added: dict[str, set[str]]) -> None:
        """Create the table and columns ``pts`` need, inside the open transaction; what
        was created goes to ``added`` (into the cache only after the COMMIT)."""
        new = added.setdefault(table, set())
        have = self._columns.get(table)
        if have is None or any(k not in have for p in pts for k in (*p.tags, *p.fields)):
            # Not all known here: the file as it is now (another daemon writing the same file,
            # a node sharing it, may have added them since; an ALTER of a column it added
            # failed every batch of the table, for good).
            fresh = {r[1] for r in self._db.execute(f"PRAGMA table_info({ident(table)})")}
            if fresh:
                have = self._columns[table] = fresh
        if have is None and not new:
            self._db.execute(f"CREATE TABLE IF NOT EXISTS {ident(table)} (ts_ns INTEGER NOT NULL)")
            self._db.execute(f"CREATE INDEX IF NOT EXISTS {ident('idx_' + table + '_ts')} ON {ident(table)} (ts_ns)")
            new.add("ts_ns")
        known = (have or set()) | new
        for p in pts:
            for name, value in (*((k, "") for k in p.tags), *p.fields.items()):
                if name not in known:
                    self._db.execute(f"ALTER TABLE {ident(table)} ADD COLUMN {ident(name)} {sql_type(value)}")
                    new.add(name)
                    known.add(name)

    def _maybe_prune(self) -> None:
        """The hourly upkeep (retention, roll-up, vacuum); a failure is logged, never raised."""
        try:
            self._prune()
        except Exception as e:
            try:
                self._db.execute("ROLLBACK")  # (a roll-up cut short leaves no transaction open)
            except sqlite3.Error:
                pass
            log.warning("sqlite store: the hourly upkeep failed: %s: %s", type(e).__name__, e)

    def _prune(self) -> None:
        now = time.time()
        if now - self._last_prune < 3600:
            return
        self._last_prune = now
        if self.retention_days > 0:
            cutoff_ns = int((now - self.retention_days * 86400) * 1e9)
            # greend's own tables only (greend_*, with their ts_ns): a file shared with
            # another program keeps that program's rows, and one table that fails is
            # skipped alone.
            for table, columns in list(self._columns.items()):
                if not table.startswith("greend_") or "ts_ns" not in columns:
                    continue
                try:
                    self._db.execute(f"DELETE FROM {ident(table)} WHERE ts_ns < ?", (cutoff_ns,))
                except sqlite3.Error as e:
                    log.warning("sqlite store: retention prune of %s failed: %s", table, e)
        try:
            if self.raw_hours > 0:
                self.roll_up(now)
            # sqlite3_exec steps it to the end (execute() frees a single page per call)
            self._db.executescript("PRAGMA incremental_vacuum;")
        except sqlite3.Error as e:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            log.warning("sqlite store: retention prune failed: %s", e)

    def roll_up(self, now_s: float) -> None:
        """Rows older than ``raw_hours`` become one row per series per ``rollup_s`` bucket:
        the bucket's last row for the sample tables (:data:`ROLLUP_LAST`: their energy is a
        running total, so differences of kept rows stay exact), the bucket's sums for the
        per-interval job rows (:data:`ROLLUP_SUM`). Events (jobs, decisions) and per-step
        detail are kept as they are. Idempotent: a rolled bucket holds one row. Runs on the
        writer thread (the hourly prune); tests call it with their own ``now_s``."""
        bucket = int(self.rollup_s * 1e9)
        cut = int((now_s - self.raw_hours * 3600) * 1e9) // bucket * bucket
        lo = max(0, self._rolled_until_ns - bucket)
        if cut <= lo:
            return
        self._db.execute("BEGIN")
        for table, series in ROLLUP_LAST.items():
            cols = self._columns.get(table)
            if cols is None:
                continue
            part = ", ".join([*(f"COALESCE({ident(c)}, '')" for c in series if c in cols), f"ts_ns / {bucket}"])
            t = ident(table)
            self._db.execute(
                f"DELETE FROM {t} WHERE ts_ns >= ? AND ts_ns < ? AND rowid NOT IN ("
                f"SELECT rid FROM (SELECT rowid AS rid, ROW_NUMBER() OVER "
                f"(PARTITION BY {part} ORDER BY ts_ns DESC, rowid DESC) AS rn "
                f"FROM {t} WHERE ts_ns >= ? AND ts_ns < ?) WHERE rn = 1)",
                (lo, cut, lo, cut),
            )
        for table, (series, aggs) in ROLLUP_SUM.items():
            cols = self._columns.get(table)
            if cols is None:
                continue
            self._sum_up(table, [c for c in series if c in cols], {f: a for f, a in aggs.items() if f in cols}, lo, cut)
        self._db.execute("COMMIT")
        self._rolled_until_ns = cut

    def _sum_up(self, table: str, series: list[str], aggs: dict[str, str], lo: int, cut: int) -> None:
        t = ident(table)
        bucket = int(self.rollup_s * 1e9)
        keys = [f"COALESCE({ident(c)}, '')" for c in series]
        group = ", ".join([*keys, f"ts_ns / {bucket}"])
        exprs = []
        for f, agg in aggs.items():
            c = ident(f)
            if agg.startswith("wmean:"):
                w = ident(agg.split(":", 1)[1])
                exprs.append(f"SUM({c} * {w}) / NULLIF(SUM(CASE WHEN {c} IS NULL THEN 0 ELSE {w} END), 0)")
            else:
                exprs.append(f"{agg.upper()}({c})")
        selected = ", ".join(
            [
                *(ident(c) for c in series),
                *(f"{e} AS {ident(f)}" for f, e in zip(aggs, exprs, strict=True)),
                *(f"{k} AS k{i}" for i, k in enumerate(keys)),
            ]
        )
        self._db.execute("DROP TABLE IF EXISTS temp.greend_rollup")
        self._db.execute(
            f"CREATE TEMP TABLE greend_rollup AS SELECT MAX(ts_ns) AS ts_ns, {selected}, ts_ns / {bucket} AS b "
            f"FROM {t} WHERE ts_ns >= ? AND ts_ns < ? GROUP BY {group} HAVING COUNT(*) > 1",
            (lo, cut),
        )
        match = ", ".join([*keys, f"ts_ns / {bucket}"])
        ks = ", ".join([*(f"k{i}" for i in range(len(keys))), "b"])
        self._db.execute(
            f"DELETE FROM {t} WHERE ts_ns >= ? AND ts_ns < ? AND ({match}) IN (SELECT {ks} FROM temp.greend_rollup)",
            (lo, cut),
        )
        out = ", ".join(["ts_ns", *(ident(c) for c in series), *(ident(f) for f in aggs)])
        self._db.execute(f"INSERT INTO {t} ({out}) SELECT {out} FROM temp.greend_rollup")
        self._db.execute("DROP TABLE temp.greend_rollup")


def _check_sqlite_url(url: str, parts: SplitResult) -> None:
    if parts.netloc or not parts.path.startswith("/"):
        raise ConfigError(f"store URL {redact_url(url)!r}: expected sqlite:///ABSOLUTE/PATH.db (three slashes)")


@register_store("sqlite", form="sqlite:///ABSOLUTE/PATH.db", check=_check_sqlite_url)
def _open_sqlite(url: str, options: StoreOptions) -> SqliteStore:
    # sqlite:///ABS and sqlite:////ABS alike (a path with two leading slashes stays so in Python)
    path = Path("/" + urlsplit(url).path.lstrip("/"))
    held = options.state_dir_path
    inside = held is not None and options.state_dir != held and path.parent == Path(os.path.abspath(held))
    return SqliteStore(
        path,
        url=url,
        retention_days=options.retention_days,
        raw_hours=options.raw_hours,
        rollup_s=options.rollup_s,
        held_dir=options.state_dir if inside else None,
    )
