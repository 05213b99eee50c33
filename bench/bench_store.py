"""How fast InfluxStore moves points into a real victoria-metrics, live and on replay.

    python bench/bench_store.py [--points 200000] [--batch 1000]

1. *written*: ``write()`` in batches (encode + spool append on the caller's
   thread) while the sender thread drains the spool; timed until ``flush()``
   says the spool is empty, i.e. until the server has acknowledged every point.
2. *replayed*: the same number of points written to a spool while the store is
   down (a URL with nothing listening), the store closed, then a new InfluxStore
   on the same spool against the live server; timed from its start to an
   empty spool.

Also prints the cost of ``write()`` alone (the tick-path cost). Prints; asserts
nothing. Needs /usr/bin/victoria-metrics (Debian package ``victoria-metrics``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from greend.points import Point  # noqa: E402
from greend.stores.influx import InfluxStore  # noqa: E402
from tests import vmserver  # noqa: E402


def make_points(n: int, t0_ms: int, run: str) -> list[Point]:
    """Points shaped like greend_gpu rows: 8 GPUs, 6 fields, 1 ms apart per GPU."""
    out = []
    for i in range(n):
        g = i % 8
        out.append(
            Point(
                "greend_bench",
                {"run": run, "gpu": str(g), "source": "sim", "method": "counter"},
                {
                    "energy_j": 1000.0 + i,
                    "power_w": 300.5,
                    "sm_clock_mhz": 1980.0,
                    "util_gpu_pct": 87.0,
                    "temperature_c": 61.0,
                    "ticks": i,
                },
                (t0_ms + i // 8) * 1_000_000,
            )
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=1000)
    args = ap.parse_args()
    if not vmserver.available():
        print(f"skipped: {vmserver.VM_BIN} is absent (apt-get install victoria-metrics)")
        return
    n, batch = args.points, args.batch
    with tempfile.TemporaryDirectory(prefix="greend-bench-") as tmp:
        base = Path(tmp)
        vm = vmserver.VmServer(base / "vm").start()
        try:
            t0_ms = time.time_ns() // 1_000_000 - 3_600_000
            pts = make_points(n, t0_ms, "live")

            # 1. Live: write while the sender drains.
            store = InfluxStore(vm.influx_url, state_dir=base / "live", host="bench", segment_age_s=0.2)
            t = time.perf_counter()
            write_s = 0.0
            for i in range(0, n, batch):
                w = time.perf_counter()
                store.write(pts[i : i + batch])
                write_s += time.perf_counter() - w
            ok = store.flush(300)
            live_s = time.perf_counter() - t
            st = store.status()
            store.close()

            # 2. Replay: spool while the store is down, then drain into the live server.
            pts2 = make_points(n, t0_ms, "replay")
            down = f"influx://127.0.0.1:{vmserver.free_port()}?org=o&bucket=b"
            spool_dir = base / "replay-spool"
            s_down = InfluxStore(down, state_dir=base, host="bench", spool_dir=spool_dir, backoff_min_s=60)
            t = time.perf_counter()
            for i in range(0, n, batch):
                s_down.write(pts2[i : i + batch])
            spool_s = time.perf_counter() - t
            s_down.close(0.5)
            spool_mb = sum(p.stat().st_size for p in spool_dir.glob("*.lp")) / 1e6
            t = time.perf_counter()
            s_up = InfluxStore(vm.influx_url, state_dir=base, host="bench", spool_dir=spool_dir)
            recovered = s_up.status().extra["recovered"]
            ok2 = s_up.flush(300)
            replay_s = time.perf_counter() - t
            st2 = s_up.status()
            s_up.close()

            vm.force_flush()
            time.sleep(1.0)
            vm.force_flush()
            landed = {
                run: sum(len(ts) for _m, ts, _v in vm.export("greend_bench_power_w", run=run))
                for run in ("live", "replay")
            }
        finally:
            vm.close()

    print(f"InfluxStore -> victoria-metrics {n:,} points, batches of {batch}, 6 fields a point")
    print(f"{'':24}{'points/s':>12}{'seconds':>10}{'acked':>10}{'landed':>10}")
    print(
        f"{'written (live)':24}{n / live_s:>12,.0f}{live_s:>10.2f}{st.written:>10,}{landed['live']:>10,}"
        f"{'' if ok else '  (flush timed out)'}"
    )
    print(
        f"{'replayed from spool':24}{n / replay_s:>12,.0f}{replay_s:>10.2f}{st2.written:>10,}"
        f"{landed['replay']:>10,}{'' if ok2 else '  (flush timed out)'}"
    )
    print(
        f"write() alone (tick path): {n / write_s:,.0f} points/s, {write_s / (n / batch) * 1e3:.2f} ms a batch;"
        f" spooling while down: {n / spool_s:,.0f} points/s, {spool_mb:.1f} MB on disk,"
        f" {recovered:,} points recovered at start"
    )


if __name__ == "__main__":
    main()
