"""The daemon's memory after many jobs, and its SQLite store's size per GPU-month.

Two runs of the real daemon (``greend run --sim 8``, default store settings: one SQLite
row set per store interval of 1 s, 30 days' retention), over its socket:

1. **Memory.** ``--jobs`` jobs of ``--ranks`` ranks each, one after the other, as the
   callback would report them (register, step reports, end). Then the daemon's RSS
   (``VmRSS``) and peak (``VmHWM``) from ``/proc``: it keeps the last 200 ended jobs'
   summaries, not their step histories. The jobs are short: what is measured is the
   bookkeeping per job, not per day (a month of 10 Hz ticks is the store's, below).
2. **Disk.** One job of ``--ranks`` ranks on the 8 simulated GPUs, each rank reporting
   ``--rate`` steps per second for ``--seconds`` seconds of wall time; the store file's
   growth between two stops of the daemon (each folds the WAL into the file) per GPU per
   second, extrapolated to a GPU-day and a GPU-month: an extrapolation, labelled so.
   Rows older than ``[store] raw_hours`` (24) are rolled up to one per series per
   ``rollup_s`` (300 s), so a month holds one raw day and 29 rolled ones: the rolled days
   are estimated from the run's series counts and its mean bytes per row (an estimate,
   labelled so; tests/stores/test_sqlite_rollup.py checks the rollup itself).

    python bench/bench_month.py [--jobs 1000] [--ranks 8] [--seconds 60] [--rate 10]
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from greend.config import StoreConfig  # noqa: E402
from greend.ipc.client import Client  # noqa: E402
from greend.ipc.server import encode  # noqa: E402
from greend.stores.sqlite import ROLLUP_LAST, ROLLUP_SUM  # noqa: E402
from greend.testing.daemon_proc import daemon_command, wait_until_up  # noqa: E402

GPUS = 8
CONFIG = '[daemon]\nsocket_group = ""\nlog_level = "warning"\n'


def proc_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def start(tmp: Path, name: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    (tmp / "cfg.toml").write_text(CONFIG)
    sock, state, log = tmp / f"{name}.sock", tmp / f"{name}-state", tmp / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            daemon_command(tmp / "cfg.toml", sock, state, "--sim", str(GPUS)),
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    wait_until_up(proc, sock, log)
    return proc, sock, state


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)


class Rank:
    """One rank's connection, speaking the protocol as the callback does."""

    def __init__(self, sock: Path, job: str, rank: int, ranks: int) -> None:
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.connect(str(sock))
        self.step = 0
        self.ask({"op": "register", "job": job, "gpus": [rank % GPUS], "rank": rank, "world_size": ranks})

    def ask(self, msg: dict) -> None:
        self.s.sendall(encode({"v": 1, "id": 1, **msg}))
        buf = b""
        while b"\n" not in buf:
            chunk = self.s.recv(65536)
            if not chunk:
                raise RuntimeError("the daemon closed the connection")
            buf += chunk

    def steps(self, n: int, step_s: float) -> None:
        t1 = time.monotonic()
        rows = []
        for i in range(n):
            t0 = t1 - (n - i) * step_s
            rows.append({"step": self.step, "t0_s": t0, "t1_s": t0 + step_s * 0.9, "flops": 1e12, "samples": 32,
                         "loss": 1.0 / (1 + self.step)})  # fmt: skip
            self.step += 1
        self.s.sendall(encode({"v": 1, "op": "steps", "steps": rows}))

    def end(self) -> None:
        self.ask({"op": "end", "reason": "finished"})
        self.s.close()


def memory(jobs: int, ranks: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp_s:
        proc, sock, _ = start(Path(tmp_s), "mem")
        try:
            rss0 = proc_kb(proc.pid, "VmRSS")
            t0 = time.perf_counter()
            for j in range(jobs):
                rs = [Rank(sock, f"month-{j}", r, ranks) for r in range(ranks)]
                for r in rs:
                    r.steps(50, 0.01)
                for r in rs:
                    r.end()
            deadline = time.monotonic() + 60
            with Client(sock) as c:
                while time.monotonic() < deadline:
                    listed = c.request("jobs")["jobs"]
                    if all(x["state"] == "ended" for x in listed):
                        break
                    time.sleep(0.2)
            wall = time.perf_counter() - t0
            rss, hwm = proc_kb(proc.pid, "VmRSS"), proc_kb(proc.pid, "VmHWM")
        finally:
            stop(proc)
    return {"rss_start_mb": rss0 / 1024, "rss_mb": rss / 1024, "peak_mb": hwm / 1024, "kept": len(listed),
            "wall_s": wall}  # fmt: skip


def disk(ranks: int, seconds: float, rate: float) -> dict[str, float]:
    """The store's growth between two stops of the daemon (each stop checkpoints the WAL
    into the file), over a run of ``seconds`` in between: the schema and the WAL's
    preallocation are outside the difference."""
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        proc, sock, state = start(tmp, "disk")
        time.sleep(2.0)
        stop(proc)
        db = state / "greend.db"
        s0 = db.stat().st_size
        proc, sock, state = start(tmp, "disk")
        t0 = time.monotonic()
        stop_at = t0 + seconds
        errors: list[str] = []

        def run(rank: int) -> None:
            try:
                r = Rank(sock, "month-disk", rank, ranks)
                while time.monotonic() < stop_at:
                    time.sleep(0.5)
                    r.steps(max(1, int(rate * 0.5)), 1.0 / rate)
                r.end()
            except Exception as e:  # reported below, never silently
                errors.append(f"rank {rank}: {e}")

        try:
            threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            time.sleep(2.0)  # the last store interval and the job's summary
        finally:
            t1 = time.monotonic()
            stop(proc)
        if errors:
            raise SystemExit("; ".join(errors))
        s1 = db.stat().st_size
        rolled = rolled_replay(db, tmp)
        with sqlite3.connect(db) as con:
            tables = [t for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
            rows = {t: con.execute(f'SELECT COUNT(*) FROM "{t}"').fetchone()[0] for t in tables}
            series = {}
            for t in tables:
                tags = ROLLUP_LAST.get(t) or (ROLLUP_SUM[t][0] if t in ROLLUP_SUM else None)
                if tags is None:
                    continue
                cols = {c[1] for c in con.execute(f'PRAGMA table_info("{t}")')}
                key = ", ".join(f'"{c}"' for c in tags if c in cols)
                series[t] = con.execute(f'SELECT COUNT(*) FROM (SELECT DISTINCT {key} FROM "{t}")').fetchone()[0]
    span = t1 - t0
    per_gpu_s = (s1 - s0) / span / GPUS
    raw_day = per_gpu_s * 86400
    # A rolled day: one row per series per rollup_s for the rolled tables, the rest (job
    # and decision events) as they came; at the run's mean bytes per row (an estimate).
    cfg = StoreConfig()
    bytes_per_row = (s1 - s0) / max(1, sum(rows.values()))
    rolled_rows = sum(n * 86400 / cfg.rollup_s for n in series.values()) + sum(
        n * 86400 / span for t, n in rows.items() if t not in series
    )
    rolled_day = rolled_rows * bytes_per_row / GPUS
    raw_days = min(30.0, cfg.raw_hours / 24)
    month = raw_days * raw_day + (30 - raw_days) * rolled_day
    rolled_day_measured = rolled["bytes"] / rolled["hours"] * 24 / GPUS
    raw_day_measured = rolled["raw_bytes"] / rolled["hours"] * 24 / GPUS
    month_measured = raw_days * raw_day_measured + (30 - raw_days) * rolled_day_measured
    return {"bytes": s1 - s0, "span_s": span, "rows": rows, "series": series, "bytes_per_row": bytes_per_row,
            "per_gpu_day_mb": raw_day / 1e6, "per_gpu_rolled_day_mb": rolled_day / 1e6,
            "per_gpu_month_raw_mb": raw_day * 30 / 1e6, "per_gpu_month_mb": month / 1e6,
            "replay": rolled, "per_gpu_rolled_day_measured_mb": rolled_day_measured / 1e6,
            "per_gpu_raw_day_measured_mb": raw_day_measured / 1e6,
            "per_gpu_month_measured_mb": month_measured / 1e6}  # fmt: skip


def rolled_replay(db: Path, tmp: Path, hours: float = 24.0) -> dict[str, float]:
    """A raw day and a rolled day, measured on a real file: the run's rows (every table)
    replayed back to back, shifted in time, to fill ``hours`` of a node's store (its size
    then: the raw rows), then rolled up by the store's own ``roll_up`` (as its hourly prune
    does once they are ``raw_hours`` old) and the freed pages returned (``PRAGMA
    incremental_vacuum``): the size of those hours rolled. Sizes are over that of the
    same file emptied."""
    cfg = StoreConfig()
    empty, month = tmp / "empty.db", tmp / "rolled.db"
    for target in (empty, month):
        with sqlite3.connect(db) as src, sqlite3.connect(target) as dst:
            src.backup(dst)
    with sqlite3.connect(empty) as con:
        tables = [t for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        for t in tables:
            con.execute(f'DELETE FROM "{t}"')
    con = sqlite3.connect(empty, isolation_level=None)
    con.execute("VACUUM")
    con.close()
    con = sqlite3.connect(month, isolation_level=None)
    ranges = [con.execute(f'SELECT MIN(ts_ns), MAX(ts_ns) FROM "{t}"').fetchone() for t in tables]
    lo = min(r[0] for r in ranges if r[0] is not None)
    hi = max(r[1] for r in ranges if r[1] is not None)
    span_ns = int(hi - lo) + 1_000_000_000
    copies = max(1, int(hours * 3600e9 / span_ns))
    cols = {t: [c[1] for c in con.execute(f'PRAGMA table_info("{t}")')] for t in tables}
    con.execute("BEGIN")
    for k in range(1, copies):
        for t in tables:
            rest = ", ".join(f'"{c}"' for c in cols[t] if c != "ts_ns")
            con.execute(
                f'INSERT INTO "{t}" (ts_ns, {rest}) SELECT ts_ns + ?, {rest} FROM "{t}" WHERE ts_ns <= ?',
                (k * span_ns, hi),
            )
    con.execute("COMMIT")
    replayed = sum(con.execute(f'SELECT COUNT(*) FROM "{t}"').fetchone()[0] for t in tables)
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    raw_bytes = month.stat().st_size - empty.stat().st_size
    from greend.stores.sqlite import SqliteStore

    # batch_s of an hour: its writer thread waits on the (empty) queue and never prunes
    # meanwhile, so the rollup below runs alone on the connection, as it would on the writer.
    store = SqliteStore(
        month, raw_hours=cfg.raw_hours, rollup_s=cfg.rollup_s, retention_days=cfg.retention_days, batch_s=3600.0
    )
    end_s = (lo + copies * span_ns) / 1e9
    store.roll_up(end_s + cfg.raw_hours * 3600 + cfg.rollup_s)  # every replayed row is old enough now
    store._db.executescript("PRAGMA incremental_vacuum;")
    store.close()
    with sqlite3.connect(month) as c2:
        kept = sum(c2.execute(f'SELECT COUNT(*) FROM "{t}"').fetchone()[0] for t in tables)
    con = sqlite3.connect(month, isolation_level=None)
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    hours_filled = copies * span_ns / 3600e9
    return {"hours": hours_filled, "rows_replayed": replayed, "rows_kept": kept, "raw_bytes": raw_bytes,
            "bytes": month.stat().st_size - empty.stat().st_size}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=60.0, help="wall time of the disk run")
    ap.add_argument("--rate", type=float, default=10.0, help="steps per second per rank in the disk run")
    args = ap.parse_args()
    m = memory(args.jobs, args.ranks)
    print(f"memory: {args.jobs} jobs of {args.ranks} ranks on {GPUS} simulated GPUs, one after the other "
          f"({m['wall_s']:.0f} s)")  # fmt: skip
    print(f"  daemon RSS {m['rss_start_mb']:.1f} MB at start, {m['rss_mb']:.1f} MB after the jobs "
          f"(peak {m['peak_mb']:.1f} MB; target < 150 MB); {m['kept']} ended jobs kept")  # fmt: skip
    d = disk(args.ranks, args.seconds, args.rate)
    print(f"disk: SQLite store (default settings), {GPUS} simulated GPUs, one job of {args.ranks} ranks at "
          f"{args.rate:g} steps/s each, {d['span_s']:.0f} s: {d['bytes'] / 1e6:.2f} MB")  # fmt: skip
    print(f"  rows: {d['rows']}")
    print(f"  extrapolated: {d['per_gpu_day_mb']:.1f} MB per GPU-day of raw rows ({d['bytes_per_row']:.0f} bytes "
          f"per row); {d['per_gpu_month_raw_mb']:.0f} MB per GPU-month if every row were kept")  # fmt: skip
    print(f"  estimated with the rollup (1 raw day, 29 days at one row per series per 300 s; series {d['series']}): "
          f"{d['per_gpu_rolled_day_mb']:.2f} MB per rolled GPU-day, {d['per_gpu_month_mb']:.0f} MB per GPU-month "
          "(target < 50 MB)")  # fmt: skip
    r = d["replay"]
    print(f"  measured: the run's rows replayed to fill {r['hours']:.1f} h of the node's store "
          f"({r['rows_replayed']:,} rows, {r['raw_bytes'] / 1e6:.1f} MB: {d['per_gpu_raw_day_measured_mb']:.1f} MB "
          f"per raw GPU-day), then rolled up by the store itself and vacuumed ({r['rows_kept']:,} rows, "
          f"{r['bytes'] / 1e6:.2f} MB: {d['per_gpu_rolled_day_measured_mb']:.2f} MB per rolled GPU-day); "
          f"a month at the default settings (1 raw day + 29 rolled): {d['per_gpu_month_measured_mb']:.1f} MB "
          "per GPU-month (target < 50 MB)")  # fmt: skip
    print(json.dumps({"memory": m, "disk": d}))


if __name__ == "__main__":
    main()
