"""The real daemon's throughput in step reports per second.

Starts ``greend run --sim 2`` as a subprocess and sends step reports to it over its
socket as the callback does (``steps`` messages of up to 1024 steps, docs/protocol.md)
from N client connections at once, each registered as its own job on a simulated GPU;
the daemon validates each step, executes it on the simulator and accounts it. Then
it waits until the daemon's job reports count every step, and prints reports per
second, measured on this machine (the GPUs are simulated).

    python bench/bench_daemon_steps.py [--clients 2] [--steps 50000] [--batch 256]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from greend.ipc.client import Client  # noqa: E402
from greend.ipc.server import encode  # noqa: E402


def client(sock: Path, job: str, gpu: int, steps: int, batch: int) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(sock))
    s.sendall(encode({"v": 1, "id": 1, "op": "register", "job": job, "gpus": [gpu]}))
    buf = b""
    while b"\n" not in buf:
        buf += s.recv(65536)
    # The steps end now and lie 0.1 ms apart (closer on a machine up for less time than
    # they span): stamps on the daemon's clock, never before boot (a negative stamp is
    # refused, and the run measured 0 steps/s).
    now = time.monotonic()
    dt = min(1e-4, now / (steps + 1))
    t = now - steps * dt
    for start in range(0, steps, batch):
        rows = [
            {"step": i, "t0_s": t + i * dt, "t1_s": t + i * dt + dt / 2, "flops": 1e9, "samples": 32, "loss": 1.0}
            for i in range(start, min(steps, start + batch))
        ]
        s.sendall(encode({"v": 1, "op": "steps", "steps": rows}))
    s.sendall(encode({"v": 1, "id": 2, "op": "heartbeat"}))
    buf = b""
    while b'"id":2' not in buf:  # the daemon has handled everything before the heartbeat
        buf += s.recv(65536)
    s.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--steps", type=int, default=50_000, help="per client")
    ap.add_argument("--batch", type=int, default=256, help="steps per message")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        (tmp / "cfg.toml").write_text('[daemon]\nsocket_group = ""\n')
        sock = tmp / "g.sock"
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "greend.daemon_main",
                "run",
                "--config",
                str(tmp / "cfg.toml"),
                "--sim",
                "2",
                "--socket",
                str(sock),
                "--state-dir",
                str(tmp / "state"),
                "--log-level",
                "warning",
            ],
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
        try:
            deadline = time.monotonic() + 30
            while not sock.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.0)
            threads = [
                threading.Thread(target=client, args=(sock, f"bench-{i}", i % 2, args.steps, args.batch))
                for i in range(args.clients)
            ]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            with Client(sock) as c:
                counted = sum(c.request("report", job=f"bench-{i}")["step_reports"] for i in range(args.clients))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    total = args.clients * args.steps
    print(
        f"daemon step-report throughput ({args.clients} clients, {args.batch} steps per message, "
        f"each step executed on a simulated GPU):"
    )
    print(f"  {counted} of {total} steps accounted in {wall:.2f} s = {counted / wall:,.0f} step reports/s")
    print(json.dumps({"step_reports_per_s": round(counted / wall), "accounted": counted, "sent": total}))


if __name__ == "__main__":
    main()
