"""The daemon's own CPU cost: CPU seconds per wall second while sampling.

Starts ``greend run --sim 8`` against a 4-zone RAPL fixture (two packages, each
with dram) at 10 Hz with the embedded SQLite store, lets it settle, then reads the
process's user+system CPU time over a measured window. Target: under 1% of one
core. Figures are measured on this machine; the GPUs are simulated.

    python bench/bench_daemon_cpu.py [--seconds 20] [--gpus 8] [--hz 10]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from probes.fake_sysfs import FakePowercap  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--hz", type=float, default=10.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        fake = FakePowercap(tmp / "sys")
        for pkg in (0, 1):
            fake.add_package(pkg, dram=True)
        (tmp / "cfg.toml").write_text("[daemon]\nsocket_group = \"\"\n")
        env = dict(os.environ, PYTHONPATH=str(REPO))
        cmd = [sys.executable, "-m", "greend.daemon_main", "run", "--config", str(tmp / "cfg.toml"),
               "--sim", str(args.gpus), "--sysfs-root", str(tmp / "sys"), "--hz", str(args.hz),
               "--socket", str(tmp / "g.sock"), "--state-dir", str(tmp / "state"), "--log-level", "warning"]
        proc = subprocess.Popen(cmd, env=env, cwd=REPO)
        try:
            time.sleep(3.0)  # imports, probe open, first store batch
            p = psutil.Process(proc.pid)
            c0 = p.cpu_times()
            t0 = time.monotonic()
            time.sleep(args.seconds)
            c1 = p.cpu_times()
            wall = time.monotonic() - t0
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(15)
        # The daemon's own per-probe timings (wall time inside sample(), once a second in
        # the store): what the simulator and its fake NVML cost, apart from greend itself.
        import sqlite3

        con = sqlite3.connect(tmp / "state" / "greend.db")
        per_probe = dict(con.execute("SELECT probe, AVG(duration_s) FROM greend_probe GROUP BY probe"))
        con.close()
        cpu = (c1.user - c0.user) + (c1.system - c0.system)
        pct = 100.0 * cpu / wall
        print(f"daemon CPU while sampling {args.gpus} simulated GPUs + 4 RAPL zones at {args.hz:g} Hz "
              f"(SQLite store, 1 s store interval):")
        print(f"  {cpu:.3f} CPU s over {wall:.1f} wall s = {pct:.2f}% of one core "
              f"({1000 * cpu / (wall * args.hz):.2f} ms CPU per tick)   target < 1%")
        for name, dur in sorted(per_probe.items()):
            rate = 1.0 if name == "host" else args.hz  # the host probe asks for interval_s = 1
            note = {"sim": "  <- the simulator and its fake NVML, not real NVML calls",
                    "host": "  (sampled once a second)"}.get(name, "")
            print(f"  probe {name:5s} {1000 * dur:6.3f} ms per sample (wall), {rate:g}/s = "
                  f"{100.0 * dur * rate:.2f}% of one core{note}")


if __name__ == "__main__":
    main()
