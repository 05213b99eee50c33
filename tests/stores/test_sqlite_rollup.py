"""The SQLite store's rollup: rows older than raw_hours become one row per series per
rollup_s; energy stays exact (running totals, last row per bucket), job step rows keep
their sums, events stay, and newer rows are untouched."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from greend.points import Point, job_point, job_steps_point
from greend.probes import GpuReading
from greend.stores.sqlite import ROLLUP_LAST, ROLLUP_SUM, SqliteStore

NOW = 1_800_000_000.0  # the test's "now" (s)


def gpu_rows(t0: float, seconds: int) -> list[Point]:
    """Two GPUs at 1 s, energy a running total: gpu i draws 100 * (i + 1) W."""
    out = []
    for k in range(seconds):
        for i in range(2):
            out.append(
                Point(
                    "greend_gpu",
                    {"host": "n", "gpu": str(i), "source": "sim", "method": "total_energy"},
                    {"energy_j": 100.0 * (i + 1) * k, "power_w": 100.0 * (i + 1)},
                    int((t0 + k) * 1e9),
                )
            )
    return out


def step_rows(t0: float, seconds: int) -> list[Point]:
    out = []
    for k in range(seconds):
        fields = {"steps": 10, "first_step": 10 * k, "last_step": 10 * k + 9, "duration_s": 0.5,
                  "duration_sq_s2": 0.025, "flops": 1e12, "samples": 320, "tokens": 0, "nonfinite": 0,
                  "loss_mean": 1.0 + k % 3, "loss_min": 0.5 + k % 3, "loss_max": 2.0 + k % 3, "loss_n": 10}  # fmt: skip
        for rank in (0, 1):
            out.append(job_steps_point(int((t0 + k) * 1e9), "n", job="j", rank=rank, precision="fp32", fields=fields))
    return out


def rows(db: Path, sql: str) -> list[tuple]:
    con = sqlite3.connect(db)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def test_old_rows_roll_up_and_the_figures_survive(tmp_path: Path) -> None:
    db = tmp_path / "g.db"
    store = SqliteStore(db, retention_days=0, raw_hours=1.0, rollup_s=300.0)
    old = NOW - 3 * 3600  # two hours of rows older than raw_hours, then a fresh hour
    store.write(gpu_rows(old, 7200) + step_rows(old, 7200) + gpu_rows(NOW - 1800, 600) + step_rows(NOW - 1800, 600))
    store.write([job_point(int(old * 1e9) + 5, "n", job="j", precision="fp32", end_reason="finished",
                          summary={"flops": 1.0})])  # fmt: skip
    assert store.flush(30)
    before = rows(db, "SELECT gpu, MAX(energy_j) - MIN(energy_j) FROM greend_gpu WHERE ts_ns < "
                      f"{int((NOW - 3600) * 1e9)} GROUP BY gpu ORDER BY gpu")  # fmt: skip
    sums_before = rows(db, "SELECT rank, SUM(steps), SUM(flops), SUM(loss_mean * loss_n) / SUM(loss_n), "
                           "MIN(loss_min), MAX(loss_max), MIN(first_step), MAX(last_step) FROM greend_job_steps "
                           "GROUP BY rank ORDER BY rank")  # fmt: skip
    store.roll_up(NOW)
    cut = int((NOW - 3600) * 1e9) // int(300e9) * int(300e9)
    # Old GPU rows: one per GPU per 300 s bucket, each the bucket's last (its energy total).
    per_bucket = rows(db, f"SELECT gpu, ts_ns / {int(300e9)}, COUNT(*) FROM greend_gpu WHERE ts_ns < {cut} "
                          "GROUP BY 1, 2")  # fmt: skip
    assert per_bucket and all(n == 1 for _, _, n in per_bucket)
    assert len(per_bucket) == 2 * (7200 // 300 + 1) or len(per_bucket) == 2 * (7200 // 300)
    last_energy = rows(db, f"SELECT gpu, MAX(energy_j) FROM greend_gpu WHERE ts_ns < {cut} GROUP BY gpu ORDER BY gpu")
    assert [e for _, e in last_energy] == [100.0 * (i + 1) * (int(cut / 1e9 - old) - 1) for i in range(2)]
    # The energy between any two kept rows is what the 1 s rows said.
    after = rows(db, "SELECT gpu, MAX(energy_j) - MIN(energy_j) FROM greend_gpu WHERE ts_ns < "
                     f"{int((NOW - 3600) * 1e9)} GROUP BY gpu ORDER BY gpu")  # fmt: skip
    assert after[0][1] <= before[0][1] and after[1][1] == pytest.approx(2 * after[0][1])
    # Fresh rows untouched: 600 s of each GPU.
    assert rows(db, f"SELECT COUNT(*) FROM greend_gpu WHERE ts_ns >= {cut}")[0][0] >= 2 * 600
    # Job step rows: fewer, with the same sums, weighted loss mean, extremes and step range.
    assert rows(db, "SELECT COUNT(*) FROM greend_job_steps")[0][0] < 2 * (7200 // 300 + 2) + 2 * 600 + 8
    sums_after = rows(db, "SELECT rank, SUM(steps), SUM(flops), SUM(loss_mean * loss_n) / SUM(loss_n), "
                          "MIN(loss_min), MAX(loss_max), MIN(first_step), MAX(last_step) FROM greend_job_steps "
                          "GROUP BY rank ORDER BY rank")  # fmt: skip
    for b, a in zip(sums_before, sums_after, strict=True):
        assert a == pytest.approx(b)
    # Events stay; a second rollup changes nothing.
    assert rows(db, "SELECT COUNT(*) FROM greend_job")[0][0] == 1
    snapshot = rows(db, "SELECT COUNT(*) FROM greend_gpu UNION ALL SELECT COUNT(*) FROM greend_job_steps")
    store._rolled_until_ns = 0
    store.roll_up(NOW)
    assert rows(db, "SELECT COUNT(*) FROM greend_gpu UNION ALL SELECT COUNT(*) FROM greend_job_steps") == snapshot
    store.close()


def test_the_rollup_series_are_the_tags_the_points_carry() -> None:
    """Each rolled table's series is exactly its measurement's tag set (greend/points.py):
    a tag left out would merge two series into one row."""
    from greend.jobs.ledger import Ledger
    from greend.jobs.records import Job
    from greend.jobs.registry import JobRegistry
    from greend.points import cpu_point, efficiency_point, gpu_point, host_point, probe_point
    from greend.probes import CpuReading, HostReading

    g = GpuReading(index=0, name="H100", uuid="GPU-0", source="sim", energy_j=0.0, energy_method="counter")
    c = CpuReading(zone="package-0", path="intel-rapl:0", source="rapl", energy_j=0.0, power_w=1.0)
    h = HostReading(cpu_util_pct=1.0, cpu_count=2, mem_used_bytes=1, mem_total_bytes=2, load_1m=0.1)
    win = {"window_s": 1.0, "flops": 1.0, "gpu_energy_j": 1.0, "gflops_per_w": 1.0, "flop_per_s": 1.0,
           "gpu_power_w": 1.0}  # fmt: skip
    life = {"flops": 1.0, "gpu_energy_j": 1.0, "gflops_per_w": 1.0, "steps": 1}
    points = {
        "greend_gpu": gpu_point(0, "n", g, 0.0),
        "greend_cpu": cpu_point(0, "n", c, 0.0),
        "greend_host": host_point(0, "n", h),
        "greend_probe": probe_point(0, "n", "nvml", success=True, duration_s=0.0),
        "greend_efficiency": efficiency_point(0, "n", job="j", precision="fp32", window=win, life=life),
    }
    steps = job_steps_point(0, "n", job="j", rank=0, precision="fp32", fields={"steps": 1})
    # The daemon gives a job's points their run tag as it writes them (JobRegistry.tag_runs).
    registry = JobRegistry(Ledger(), hostname="n")
    registry.jobs["j"] = Job("j", 0, 0.0, 0.0, run="r1")
    registry.tag_runs([points["greend_efficiency"], steps])
    assert points["greend_efficiency"].tags["run"] == steps.tags["run"] == "r1"
    for table, series in ROLLUP_LAST.items():
        assert set(series) == set(points[table].tags), table
    assert set(ROLLUP_SUM["greend_job_steps"][0]) == set(steps.tags)


def test_the_writer_rolls_up_on_its_own_with_the_configured_settings(tmp_path: Path) -> None:
    """Through open_store, as the daemon opens it: the writer thread's hourly prune (the
    first right after its first batch) rolls two-day-old rows up at the given rollup_s."""
    import time

    from greend.stores import open_store

    db = tmp_path / "g.db"
    store = open_store(f"sqlite:///{db}", state_dir=tmp_path, host="n", raw_hours=1.0, rollup_s=600.0)
    assert isinstance(store, SqliteStore) and (store.raw_hours, store.rollup_s) == (1.0, 600.0)
    start = (time.time() - 2 * 86400) // 600 * 600  # a bucket's start: 1200 s span two buckets
    store.write(gpu_rows(start, 1200))
    assert store.flush(30)
    deadline = time.monotonic() + 20
    while rows(db, "SELECT COUNT(*) FROM greend_gpu")[0][0] > 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rows(db, "SELECT gpu, energy_j FROM greend_gpu ORDER BY gpu, ts_ns") == [
        ("0", 100.0 * 599), ("0", 100.0 * 1199), ("1", 200.0 * 599), ("1", 200.0 * 1199)
    ]  # fmt: skip
    store.close()


def test_two_writers_of_one_file_each_see_the_columns_the_other_added(tmp_path: Path) -> None:
    """Two daemons sharing one SQLite file (two nodes on a shared file system): each kept
    the columns it knew from its own writes, so the second to write a new field tried to
    add it again, 'duplicate column name', and lost every batch of that table for good."""
    db = tmp_path / "shared.db"
    a, b = SqliteStore(db, retention_days=0), SqliteStore(db, retention_days=0)
    try:
        a.write([Point("greend_job", {"host": "a", "job": "j"}, {"steps": 10, "sm_active_pct": 50.0}, 1)])
        assert a.flush(5)
        b.write([Point("greend_job", {"host": "b", "job": "j"}, {"steps": 20, "sm_active_pct": 60.0}, 2)])
        assert b.flush(5)
        assert b.status().dropped == 0 and b.status().written == 1, b.status()
    finally:
        a.close()
        b.close()
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT host, steps, sm_active_pct FROM greend_job ORDER BY ts_ns").fetchall() == [
            ("a", 10, 50.0),
            ("b", 20, 60.0),
        ]
