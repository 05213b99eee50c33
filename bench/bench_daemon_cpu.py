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

from greend.probes.fake_sysfs import FakePowercap  # noqa: E402


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
        (tmp / "cfg.toml").write_text('[daemon]\nsocket_group = ""\n')
        env = dict(os.environ, PYTHONPATH=str(REPO))
        cmd = [
            sys.executable,
            "-m",
            "greend.daemon_main",
            "run",
            "--config",
            str(tmp / "cfg.toml"),
            "--sim",
            str(args.gpus),
            "--sysfs-root",
            str(tmp / "sys"),
            "--hz",
            str(args.hz),
            "--socket",
            str(tmp / "g.sock"),
            "--state-dir",
            str(tmp / "state"),
            "--log-level",
            "warning",
        ]
        proc = subprocess.Popen(cmd, env=env, cwd=REPO)
        try:
            time.sleep(3.0)  # imports, probe open, first store batch
            p = psutil.Process(proc.pid)
            probes0 = _probes(tmp / "g.sock")
            c0 = p.cpu_times()
            t0 = time.monotonic()
            time.sleep(args.seconds)
            c1 = p.cpu_times()
            wall = time.monotonic() - t0
            probes1 = _probes(tmp / "g.sock")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(15)
        cpu = (c1.user - c0.user) + (c1.system - c0.system)
        pct = 100.0 * cpu / wall
        print(
            f"daemon CPU while sampling {args.gpus} simulated GPUs + 4 RAPL zones at {args.hz:g} Hz "
            f"(SQLite store, 1 s store interval):"
        )
        print(
            f"  {cpu:.3f} CPU s over {wall:.1f} wall s = {pct:.2f}% of one core "
            f"({1000 * cpu / (wall * args.hz):.2f} ms CPU per tick)   target < 1%"
        )
        # The daemon's own per-probe totals (wall time inside sample(), from `probes`):
        # what the simulator and its fake NVML cost, apart from greend itself.
        for name in sorted(probes1):
            n = probes1[name]["samples"] - probes0[name]["samples"]
            busy = probes1[name]["duration_total_s"] - probes0[name]["duration_total_s"]
            if n <= 0:
                continue
            note = {"sim": "  <- the simulator and its fake NVML, not real NVML calls"}.get(name, "")
            print(
                f"  probe {name:5s} {1e6 * busy / n:7.1f} us per sample (wall), {n / wall:4.1f}/s = "
                f"{100.0 * busy / wall:.2f}% of one core{note}"
            )


def _probes(sock: Path) -> dict[str, dict]:
    from greend.ipc.client import Client

    with Client(sock) as c:
        return {p["name"]: p for p in c.request("probes")["probes"]}


if __name__ == "__main__":
    main()
