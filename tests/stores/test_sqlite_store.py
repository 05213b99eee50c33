from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from greend.points import Point
from greend.stores.sqlite import SqliteStore, read_rows


def test_points_land_in_tables_with_columns_per_tag_and_field(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    store = SqliteStore(db, batch_s=0.05)
    t0 = time.time_ns()
    store.write(
        [
            Point("greend_gpu", {"host": "h", "gpu": str(i % 2)}, {"power_w": 100.0 + i, "energy_j": float(i)}, t0 + i)
            for i in range(1000)
        ]
    )
    store.write([Point("greend_gpu", {"host": "h", "gpu": "0"}, {"power_w": 1.0, "sm_clock_mhz": 1980.0}, t0 + 5000)])
    assert store.flush(5.0)
    rows = read_rows(db, "greend_gpu")
    assert len(rows) == 1001
    assert rows[0]["power_w"] == 100.0 and rows[0]["gpu"] == "0"
    assert rows[-1]["sm_clock_mhz"] == 1980.0  # a new field became a column
    assert [r["ts_ns"] for r in rows] == sorted(r["ts_ns"] for r in rows)
    st = store.status()
    assert st.written == 1001 and st.ok and st.dropped == 0
    store.close()
    # WAL mode, so readers never block the daemon.
    assert sqlite3.connect(db).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_retention_prunes_old_rows(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    store = SqliteStore(db, batch_s=0.05, retention_days=1.0)
    now = time.time_ns()
    old = now - 3 * 86400 * 10**9
    store.write(
        [
            Point("greend_host", {"host": "h"}, {"load_1m": 1.0}, old),
            Point("greend_host", {"host": "h"}, {"load_1m": 2.0}, now),
        ]
    )
    assert store.flush()
    store._last_prune = 0.0  # due now
    store._maybe_prune()
    assert [r["load_1m"] for r in read_rows(db, "greend_host")] == [2.0]
    store.close()


def test_retention_gives_the_disk_back(tmp_path: Path) -> None:
    db = tmp_path / "v.db"
    store = SqliteStore(db, batch_s=0.05, retention_days=1.0)
    old = time.time_ns() - 3 * 86400 * 10**9
    for chunk in range(10):
        store.write(
            [Point("greend_host", {"host": "h"}, {"load_1m": float(i), "pad": "x" * 200}, old + chunk * 10_000 + i)
             for i in range(2000)]
        )  # fmt: skip
        assert store.flush()
    store.write([Point("greend_host", {"host": "h"}, {"load_1m": -1.0}, time.time_ns())])
    assert store.flush()
    store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    full = db.stat().st_size
    store._last_prune = 0.0  # due now
    store._maybe_prune()
    store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert [r["load_1m"] for r in read_rows(db, "greend_host")] == [-1.0]
    assert store._db.execute("PRAGMA freelist_count").fetchone()[0] == 0
    assert db.stat().st_size < full / 5, (full, db.stat().st_size)  # the file shrank with its rows
    store.close()


def test_reopening_keeps_the_schema_and_appends(tmp_path: Path) -> None:
    db = tmp_path / "a.db"
    for run in range(2):
        store = SqliteStore(db, batch_s=0.05)
        store.write([Point("greend_cpu", {"zone": "package-0"}, {"energy_j": float(run)}, time.time_ns())])
        assert store.flush()
        store.close()
    assert [r["energy_j"] for r in read_rows(db, "greend_cpu")] == [0.0, 1.0]


def test_flush_returns_only_once_every_point_is_committed(tmp_path: Path) -> None:
    # One point at a time, each flushed: flush's True means committed, every time
    # (with a 1 ms batch the writer is often mid-batch when the next write lands).
    db = tmp_path / "f.db"
    store = SqliteStore(db, batch_s=0.001)
    t0 = time.time_ns()
    for i in range(300):
        store.write([Point("greend_host", {"host": "h"}, {"n": float(i)}, t0 + i)])
        assert store.flush(5.0)
        assert store.status().written == i + 1, f"flush returned with point {i} not yet committed"
    assert len(read_rows(db, "greend_host")) == 300
    store.close()


def test_a_point_lost_to_a_write_error_is_not_reported_as_a_full_queue(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A point SQLite cannot hold (here a lone surrogate in a tag) is lost alone and
    counted; the queue is not full, and the log does not say it is on later writes."""
    store = SqliteStore(tmp_path / "e.db", batch_s=0.05)
    t0 = time.time_ns()
    with caplog.at_level("ERROR"):
        store.write([Point("greend_host", {"host": "h"}, {"load_1m": 1.0}, t0),
                     Point("greend_host", {"host": "\udcff"}, {"load_1m": 2.0}, t0 + 1)])  # fmt: skip
        assert store.flush(5.0)
        for i in range(3):
            store.write([Point("greend_host", {"host": "h"}, {"load_1m": 3.0}, t0 + 10 + i)])
        assert store.flush(5.0)
    st = store.status()
    assert st.written == 4 and st.dropped == 1
    assert not [r for r in caplog.records if "queue full" in r.getMessage()]
    assert any("1 of a batch of 2 points lost" in r.getMessage() for r in caplog.records)
    store.close()


def test_retention_prunes_greends_tables_only_and_one_failing_table_stops_nothing(tmp_path: Path) -> None:
    """A file shared with another program keeps that program's rows (it lost them), and a
    table of its own without ts_ns no longer stops greend's prune."""
    db = tmp_path / "shared.db"
    now = time.time_ns()
    old = now - 3 * 86400 * 10**9
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE app_events (ts_ns INTEGER, what TEXT)")
    con.execute("INSERT INTO app_events VALUES (?, 'not greend data')", (old,))
    con.execute("CREATE TABLE notes (note TEXT)")
    con.commit()
    con.close()
    store = SqliteStore(db, batch_s=0.05, retention_days=1.0)
    store.write([Point("greend_host", {"host": "h"}, {"load_1m": 1.0}, old),
                 Point("greend_host", {"host": "h"}, {"load_1m": 2.0}, now)])  # fmt: skip
    assert store.flush()
    store._last_prune = 0.0  # due now
    store._maybe_prune()
    assert [r["load_1m"] for r in read_rows(db, "greend_host")] == [2.0]
    store.close()
    con = sqlite3.connect(db)
    assert con.execute("SELECT what FROM app_events").fetchall() == [("not greend data",)]
    con.close()
