"""The SQLite store heals: a failed transaction teaches the schema cache nothing, a bad
point loses only itself, a file that cannot be written holds its points in memory until
it can, a corrupt file is moved aside; every lost point is counted."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from greend.points import Point
from greend.stores.sqlite import SqliteStore, read_rows


class DiskFull:
    """The store's connection, with INSERTs failing as on a full disk while ``full``."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.full = True

    def execute(self, sql: str, *args: Any) -> Any:
        return self.db.execute(sql, *args)

    def executescript(self, sql: str) -> Any:
        return self.db.executescript(sql)

    def executemany(self, sql: str, rows: Any) -> Any:
        if self.full:
            raise sqlite3.OperationalError("database or disk is full")
        return self.db.executemany(sql, rows)

    def close(self) -> None:
        self.db.close()


def step(i: int) -> Point:
    return Point("greend_job_step", {"host": "h", "job": "j"}, {"step": i, "flops": 1e9}, time.time_ns() + i)


def test_disk_full_at_a_jobs_first_steps_loses_nothing_once_there_is_room(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    store = SqliteStore(db, batch_s=0.02)
    disk = DiskFull(store._db)
    store._db = disk  # type: ignore[assignment]
    store.write([step(i) for i in range(5)])  # the table is created, then the INSERT fails
    assert store.flush(5.0)
    st = store.status()
    assert st.dropped == 0 and st.pending == 5 and not st.ok, st
    assert "full" in (st.last_error or "") and "5 points held in memory" in (st.last_error or "")
    assert "greend_job_step" not in store._columns  # the CREATE rolled back: not cached
    disk.full = False  # space is back: the held points are tried again after the back-off
    store._held.retry_s = 0.0
    store._held.failed()  # (the next try: now)
    store.write([step(i) for i in range(5, 9)])
    assert store.flush(5.0)
    st = store.status()
    assert st.ok and st.written == 9 and st.dropped == 0 and st.pending == 0, st
    store.close()
    assert [r["step"] for r in read_rows(db, "greend_job_step")] == list(range(9))


def _limit_pages(store: SqliteStore, pages: int | None) -> None:
    """SQLite's own size limit on the store's file (``PRAGMA max_page_count``): past it
    every write fails with SQLITE_FULL, as on a full disk; None lifts it."""
    n = pages if pages is not None else 1_073_741_823
    store._db.execute(f"PRAGMA max_page_count = {n}")


def _full(db: Path, n: int, **kw: Any) -> SqliteStore:
    """A store with one row written, then its file held at its size (a real SQLITE_FULL
    from then on), and ``n`` more points (steps 1..n) given to it."""
    store = SqliteStore(db, batch_s=0.02, **kw)
    store.write([step(0)])
    assert store.flush(5.0) and store.status().ok
    _limit_pages(store, store._db.execute("PRAGMA page_count").fetchone()[0])
    store.write([step(i) for i in range(1, n + 1)])
    assert store.flush(5.0)
    return store


def _all_written(store: SqliteStore, db: Path, n: int, timeout_s: float = 5.0) -> None:
    """One more point lands every held one: ``n`` points in all written, in order, none lost."""
    store.write([step(n - 1)])
    assert store.flush(timeout_s)
    st = store.status()
    assert st.ok and st.written == n and st.pending == 0 and st.dropped == 0, st
    store.close()
    assert [r["step"] for r in read_rows(db, "greend_job_step")] == list(range(n))


def test_a_file_sqlite_cannot_grow_holds_the_points_until_it_can(tmp_path: Path) -> None:
    """A real SQLITE_FULL (the page limit reached): the points wait in memory, counted
    pending, and are written first, in order, once the file can grow again."""
    db = tmp_path / "full.db"
    store = _full(db, 2000)
    st = store.status()
    assert not st.ok and st.pending == 2000 and st.dropped == 0 and st.written == 1, st
    assert "full" in (st.last_error or "") and "2000 points held" in (st.last_error or "")
    now = [0.0]
    store._held.clock = lambda: now[0]  # (the back-off's clock)
    store._held.failed()
    _limit_pages(store, None)
    store.write([step(2001)])  # room again, but before the back-off's end: not tried, held behind the others
    assert store.flush(5.0) and store.status().pending == 2001 and store.status().written == 1
    now[0] += store._held.retry_s
    _all_written(store, db, 2003)


def test_points_held_past_the_bound_drop_the_oldest_and_a_close_still_full_counts_the_rest(
    tmp_path: Path,
) -> None:
    db = tmp_path / "bound.db"
    store = SqliteStore(db, batch_s=0.02)
    store._held.max_points = 100
    store.write([step(0)])
    assert store.flush(5.0)
    store._db = DiskFull(store._db)  # type: ignore[assignment]  # (every INSERT fails, to the end)
    store.write([step(i) for i in range(1, 1001)])
    assert store.flush(5.0)
    st = store.status()
    assert st.pending == 100 and st.dropped == 900, st
    assert "900 older ones dropped beyond 100" in (st.last_error or "")
    assert [p.fields["step"] for p in store._held.points] == list(range(901, 1001))  # the newest kept
    store.close()  # still full: tried once more, then counted
    st = store.status()
    assert st.dropped == 1000 and st.pending == 0 and st.written == 1, st


def test_a_batch_with_one_bad_point_loses_only_that_point(tmp_path: Path) -> None:
    db = tmp_path / "b.db"
    store = SqliteStore(db, batch_s=0.2)
    bad = Point("greend_gpu", {"host": "h"}, {"bad name": 1.0}, time.time_ns())
    store.write([step(0), bad, step(1)])
    assert store.flush(5.0)
    st = store.status()
    assert st.written == 2 and st.dropped == 1, st
    store.close()
    assert len(read_rows(db, "greend_job_step")) == 2


def test_a_corrupt_file_is_moved_aside_and_a_fresh_store_started(tmp_path: Path) -> None:
    db = tmp_path / "c.db"
    db.write_bytes(b"SQLite format 3\x00" + b"its pages overwritten" * 200)  # a damaged store keeps its header
    store = SqliteStore(db, batch_s=0.02)
    st = store.status()
    assert st.extra["moved_aside"] and Path(st.extra["moved_aside"][0]).exists()
    assert "corrupt" in (st.last_error or "") and "moved aside" in (st.last_error or "")
    store.write([step(1)])
    assert store.flush(5.0)
    assert store.status().ok and store.status().written == 1
    store.close()
    assert len(read_rows(db, "greend_job_step")) == 1


def test_a_file_that_is_no_sqlite_database_is_left_as_it_is(tmp_path: Path) -> None:
    """A store path that names someone's file (a typo: the config file) is refused; the
    file was moved aside and an SQLite database put in its place."""
    import pytest

    from greend.errors import StoreError

    cfg = tmp_path / "greend.toml"
    cfg.write_text("[daemon]\nhz = 10\n")
    with pytest.raises(StoreError, match="not an SQLite database .*greend leaves it as it is"):
        SqliteStore(cfg, batch_s=0.02)
    assert cfg.read_text() == "[daemon]\nhz = 10\n" and sorted(p.name for p in tmp_path.iterdir()) == ["greend.toml"]


def test_a_bug_met_while_writing_loses_that_batch_only_and_the_writer_goes_on(tmp_path: Path) -> None:
    """An error no one foresaw in a write (here an OverflowError, as a prune's cut-off past
    SQLite's integers gave) loses its batch, counted and shown in status; the writer
    thread lives on, and the next points are written."""
    store = SqliteStore(tmp_path / "w.db", batch_s=0.02)
    real = store._transaction
    calls = {"n": 0}

    def once(batch: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OverflowError("Python int too large to convert to SQLite INTEGER")
        return real(batch)

    store._transaction = once  # type: ignore[method-assign]
    store.write([step(0), step(1)])
    assert store.flush(5.0)
    st = store.status()
    assert st.dropped == 2 and not st.ok and "OverflowError" in (st.last_error or "")
    store.write([step(2)])
    assert store.flush(5.0)
    st = store.status()
    assert st.ok and st.written == 1 and store._thread.is_alive()
    store.close()


def test_a_store_file_deleted_under_greend_is_opened_anew_and_said(tmp_path: Path, monkeypatch: Any) -> None:
    """rm greend.db while the daemon writes: the rows would go to a deleted file, lost at
    close, with status ok. The writer sees the path no longer names its file, says so, and
    writes the next points to a new file at the path."""
    import greend.stores.sqlite as sqlite_mod

    monkeypatch.setattr(sqlite_mod, "IDENTITY_CHECK_S", 0.0)
    db = tmp_path / "g.db"
    store = SqliteStore(db, batch_s=0.02)
    store.write([step(0)])
    assert store.flush(5.0)
    for p in tmp_path.glob("g.db*"):
        p.unlink()
    store.write([step(1)])
    assert store.flush(5.0)
    st = store.status()
    assert not st.ok and "deleted or replaced" in (st.last_error or "")
    store.write([step(2)])
    assert store.flush(5.0)
    assert store.status().ok
    store.close()
    assert [r["step"] for r in read_rows(db, "greend_job_step")] == [1, 2]


def test_an_integer_past_64_bits_is_kept_as_a_real(tmp_path: Path) -> None:
    """A job's summed counts (each row's in range) can pass SQLite's 64-bit integers: the
    point is kept, the figure as a REAL, never lost."""
    db = tmp_path / "i.db"
    store = SqliteStore(db, batch_s=0.02)
    big = 3 * (1 << 62)
    store.write([Point("greend_job", {"host": "h", "job": "j"}, {"samples": big, "steps": 3}, time.time_ns())])
    assert store.flush(5.0)
    st = store.status()
    assert st.written == 1 and st.dropped == 0, st
    store.close()
    (row,) = read_rows(db, "greend_job")
    assert row["samples"] == float(big) and row["steps"] == 3


def _hold_lock(db: Path, seconds: float) -> Any:
    """Another process's connection holding the file's write lock (a manual DELETE, a
    VACUUM, a backup) for ``seconds``: a subprocess, as an operator's sqlite3 would be."""
    import subprocess
    import sys

    code = (
        "import sqlite3, sys, time\n"
        "c = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)\n"
        "c.execute('BEGIN IMMEDIATE'); print('locked', flush=True)\n"
        "time.sleep(float(sys.argv[2])); c.execute('COMMIT')\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(db), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def _one_point_store(tmp_path: Path, monkeypatch: Any, name: str, **constants: float) -> tuple[Path, SqliteStore]:
    """A store at ``tmp_path / name`` with one point written, the module's ``constants``
    (BUSY_TIMEOUT_S, BUSY_RETRY_S) set for the test."""
    import greend.stores.sqlite as m

    for key, value in constants.items():
        monkeypatch.setattr(m, key, value)
    db = tmp_path / name
    store = SqliteStore(db, batch_s=0.02)
    store.write([step(0)])
    assert store.flush(5.0)
    return db, store


def _closed_while_locked(store: SqliteStore, db: Path, points: int, settle_s: float) -> float:
    """``points`` more written while another process holds the lock, then the store closed
    after ``settle_s``: how long close() took."""
    holder = _hold_lock(db, 30)
    try:
        store.write([step(i) for i in range(1, points + 1)])
        time.sleep(settle_s)
        t0 = time.monotonic()
        store.close(timeout_s=1.0)
        return time.monotonic() - t0
    finally:
        holder.kill()
        holder.wait()


def test_a_file_locked_by_another_process_beyond_the_busy_timeout_loses_no_point(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Another process holds the store's lock longer than SQLite's busy timeout: the batch
    waits and is written once the lock goes (before: written point by point, each point
    waiting the timeout again, and most of them lost as "database is locked")."""
    db, store = _one_point_store(tmp_path, monkeypatch, "l.db", BUSY_TIMEOUT_S=0.2)
    holder = _hold_lock(db, 2.5)
    store.write([step(i) for i in range(1, 6)])
    assert not store.flush(1.0)  # waiting for the lock, not dropping
    holder.wait(10)
    assert store.flush(10.0)
    st = store.status()
    assert st.written == 6 and st.dropped == 0, st
    store.close()
    assert [r["step"] for r in read_rows(db, "greend_job_step")] == list(range(6))


def test_closing_while_another_process_holds_the_lock_counts_the_points_and_does_not_crash(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """SIGTERM while an operator's sqlite3 holds the store's lock: close() interrupts the
    writer and closes the connection only once it has ended (closing it under the writer
    crashed the daemon with a segmentation fault); the points not written are counted."""
    db, store = _one_point_store(tmp_path, monkeypatch, "c.db", BUSY_TIMEOUT_S=0.5)
    assert _closed_while_locked(store, db, 5, settle_s=0.2) < 5.0
    assert not store._thread.is_alive()
    st = store.status()
    assert st.written == 1 and st.dropped == 5 and "lock" in (st.last_error or ""), st


def test_closing_while_a_locked_batch_is_written_point_by_point_stops_and_counts_it(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """The lock outlasted the batch's waits, so its points are tried one by one (each the
    busy timeout) when the daemon stops: the writer stops there and the batch is counted
    (it went on point by point, outlived close() and left the points uncounted)."""
    db, store = _one_point_store(tmp_path, monkeypatch, "p.db", BUSY_TIMEOUT_S=0.5, BUSY_RETRY_S=0.0)
    # (after 0.3 s the batch is in hand, its points tried one by one)
    assert _closed_while_locked(store, db, 20, settle_s=0.3) < 5.0
    assert not store._thread.is_alive()
    st = store.status()
    assert st.written == 1 and st.dropped == 20, st


def test_a_backlog_larger_than_the_room_that_comes_back_is_written_a_chunk_at_a_time(tmp_path: Path) -> None:
    """The held points go a chunk (``batch_max``) a transaction: some room is some progress
    (one transaction of the whole backlog needs room for all of it, and its WAL fills the
    disk again), and what the room did not take stays held, in order."""
    db = tmp_path / "chunks.db"
    store = SqliteStore(db, batch_s=0.02, batch_max=500)
    store._held.retry_s = 0.0
    store.write([step(0)])
    assert store.flush(5.0)
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    _limit_pages(store, pages)
    store.write([step(i) for i in range(1, 20_001)])
    assert store.flush(10.0) and store.status().pending == 20_000
    _limit_pages(store, pages + 40)  # room for a few thousand rows, not for 20,000
    store.write([step(20_001)])
    assert store.flush(10.0)
    st = store.status()
    assert 500 <= st.written - 1 < 20_000 and st.pending == 20_001 - (st.written - 1) and st.dropped == 0, st
    _limit_pages(store, None)
    _all_written(store, db, 20_003, timeout_s=10.0)


def test_a_bad_point_among_those_a_full_disk_holds_loses_only_itself(tmp_path: Path) -> None:
    db = tmp_path / "mixed.db"
    store = SqliteStore(db, batch_s=0.02)
    store._held.retry_s = 0.0
    store.write([step(0)])
    assert store.flush(5.0)
    disk = DiskFull(store._db)
    store._db = disk  # type: ignore[assignment]
    bad = Point("greend_job_step", {"host": "h", "job": "j"}, {"bad name": 1.0}, time.time_ns())
    store.write([step(i) for i in range(1, 501)] + [bad] + [step(i) for i in range(501, 1001)])
    assert store.flush(5.0)
    st = store.status()
    assert st.dropped <= 1 and st.pending >= 1000 and "full" in (st.last_error or ""), st
    disk.full = False
    store.write([step(1001)])
    assert store.flush(5.0)
    st = store.status()
    assert st.written == 1002 and st.dropped == 1 and st.pending == 0 and "bad name" in (st.last_error or ""), st
    store.close()
    assert [r["step"] for r in read_rows(db, "greend_job_step")] == list(range(1002))


def test_held_points_are_written_when_due_with_no_new_point_to_carry_them(tmp_path: Path) -> None:
    db = tmp_path / "idle.db"
    store = _full(db, 2000)
    assert store.status().pending == 2000
    store._held.retry_s = 0.0
    store._held.failed()  # (the next try: now)
    _limit_pages(store, None)
    deadline = time.monotonic() + 5.0
    while store.status().pending and time.monotonic() < deadline:  # (nothing written meanwhile)
        time.sleep(0.02)
    st = store.status()
    assert st.pending == 0 and st.written == 2001 and st.dropped == 0, st
    store.close()
    assert len(read_rows(db, "greend_job_step")) == 2001


def test_a_bug_while_points_are_held_counts_each_point_once(tmp_path: Path, monkeypatch: Any) -> None:
    """A bug in a held chunk's write: that chunk is counted lost (never written twice), the
    batch that joined the held points stays held, and every point is counted once."""
    db = tmp_path / "bug.db"
    store = _full(db, 1000, batch_max=100)
    assert store.status().pending >= 800  # (the file's free pages may take a chunk)
    now = [0.0]
    store._held.clock = lambda: now[0]  # (no idle try before the bug is in place)
    store._held.failed()
    _limit_pages(store, None)
    real, calls = store._write, []

    def once(batch: list[Point]) -> list[Point]:
        calls.append(len(batch))
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return real(batch)

    monkeypatch.setattr(store, "_write", once)
    now[0] += store._held.retry_s
    store.write([step(1001)])
    assert store.flush(5.0)
    monkeypatch.setattr(store, "_write", real)
    store.write([step(1002)])
    assert store.flush(5.0)
    st = store.status()
    assert st.dropped == 100 and st.written + st.pending + st.dropped == 1003, st
    store.close()
    steps = [r["step"] for r in read_rows(db, "greend_job_step")]
    assert steps == sorted(set(steps)) and len(steps) == store.status().written


def test_a_bug_in_an_idle_try_of_the_held_points_never_stops_the_writer(tmp_path: Path, monkeypatch: Any) -> None:
    db = tmp_path / "idlebug.db"
    store = _full(db, 1000, batch_max=100)
    real = store._write

    def broken(batch: list[Point]) -> list[Point]:
        raise RuntimeError("a bug")

    monkeypatch.setattr(store, "_write", broken)
    store._held.retry_s = 0.0
    store._held.failed()
    deadline = time.monotonic() + 5.0
    while "a bug" not in (store.status().last_error or "") and time.monotonic() < deadline:
        time.sleep(0.02)  # (the writer's idle wake-up meets the bug)
    assert "a bug" in (store.status().last_error or "")
    monkeypatch.setattr(store, "_write", real)
    _limit_pages(store, None)
    store.write([step(1001)])
    assert store.flush(5.0) and store._thread.is_alive()  # the writer goes on
    st = store.status()
    assert st.pending == 0 and st.written + st.dropped == 1002, st
    store.close()


@pytest.mark.parametrize(
    "code", [sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN]
)
def test_the_errors_of_a_file_that_cannot_be_written_are_told_from_a_bad_point(code: int) -> None:
    from greend.stores._sqlite_file import no_room

    e = sqlite3.OperationalError("x")
    e.sqlite_errorcode = code | (1 << 8)  # type: ignore[attr-defined]  # (an extended code, as SQLite gives)
    assert no_room(e)
    bad = sqlite3.OperationalError("no such column")
    bad.sqlite_errorcode = sqlite3.SQLITE_ERROR  # type: ignore[attr-defined]  # (a statement's own error)
    assert not no_room(bad)
    assert no_room(OSError(28, "No space left on device")) and no_room(OSError(30, "Read-only file system"))
    assert not no_room(OSError(2, "No such file or directory"))
