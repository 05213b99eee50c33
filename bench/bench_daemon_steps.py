"""The real daemon under many training clients: its tick cadence, status latency and CPU.

Starts ``greend run --sim 8`` (10 Hz ticks) as a subprocess and connects ``--clients``
ranks to it over its socket, each registered as its own job on one of the 8 simulated
GPUs and reporting ``--rate`` steps per second as the callback does: every
``rows_every_s`` (what the daemon's register reply asks for: 0.5 s at its default
settings) one ``intervals`` message with the steps since the last,
summed into a row (``docs/protocol.md``), with each step's loss when ``--losses`` (what a
job whose precision greend may change sends). One sender thread drives all the sockets,
so the load generator stays light beside the daemon on a small machine.

Meanwhile it asks ``status`` every 0.5 s and times the answer, and at the end reads the
daemon's own record of how late its last 600 ticks started (``tick_lateness_s``) and its
CPU time from ``/proc``. Then, for comparison, the older per-step form: the same daemon
fed ``steps`` messages (one entry per step, 256 a message) as fast as it takes them, in
step reports per second.

Two runs: the rows only accounted (jobs registered without GPUs: the daemon's own work,
as on a real node where the GPU runs the steps), and executed on the simulated GPUs
as well (each message rewrites the simulator's device file: a cost of the simulator).

    python bench/bench_daemon_steps.py [--clients 64] [--rate 1000] [--seconds 20]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
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

GPUS = 8
TICK_HZ = 10.0


def cpu_s(pid: int) -> float:
    """utime + stime of the process (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def connect(sock: Path, job: str, gpu: int | None, precisions: list[str]) -> tuple[socket.socket, dict]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(sock))
    gpus = [] if gpu is None else [gpu]
    s.sendall(encode({"v": 1, "id": 1, "op": "register", "job": job, "gpus": gpus, "precisions": precisions}))
    buf = b""
    while b"\n" not in buf:
        buf += s.recv(65536)
    reply = json.loads(buf.split(b"\n")[0])
    if not reply.get("ok"):
        raise SystemExit(f"register {job}: {reply}")
    return s, reply["result"]


def row(first: int, n: int, t1: float, step_s: float, losses: bool) -> dict:
    """n steps of step_s seconds ending at t1, as the callback's sender sums them."""
    r = {
        "first_step": first,
        "last_step": first + n - 1,
        "steps": n,
        "t0_s": t1 - n * step_s,
        "t1_s": t1,
        "busy_s": n * step_s * 0.9,
        "busy_sq_s2": n * (step_s * 0.9) ** 2,
        "flops": n * 2e11,
        "samples": n * 32,
        "loss_n": n,
        "loss_sum": 1.5 * n,
        "loss_min": 1.4,
        "loss_max": 1.6,
        "loss_last": 1.5,
        "precision": "fp32",
    }
    if losses:
        r["losses"] = [1.4 + 0.2 * ((first + i) % 7) / 6 for i in range(n)]
    return r


def load(sock: Path, name: str, clients: int, rate: float, seconds: float, losses: bool, on_sim: bool) -> dict:
    """Clients at ``rate`` steps/s for ``seconds``; status timed every 0.5 s meanwhile.
    ``on_sim``: each job on a simulated GPU, which executes its rows (the simulator's
    device file is rewritten per message); else registered without GPUs, so the daemon
    only accounts the rows, as on a real node, where the GPU runs the steps."""
    precisions = ["fp32", "bf16"] if losses else ["fp32"]
    conns = [connect(sock, f"{name}-{i}", i % GPUS if on_sim else None, precisions) for i in range(clients)]
    socks = [s for s, _ in conns]
    every_s = float(conns[0][1]["rows_every_s"])
    stop = threading.Event()
    sent = [0]
    errors: list[str] = []

    def drive() -> None:
        step = 0
        next_t = time.monotonic()
        while not stop.is_set():
            next_t += every_s
            n = int(rate * every_s)
            now = time.monotonic()
            try:
                for s in socks:
                    s.sendall(encode({"v": 1, "op": "intervals", "rows": [row(step, n, now, 1.0 / rate, losses)]}))
            except OSError as e:
                errors.append(str(e))
                return
            step += n
            sent[0] += n * len(socks)
            time.sleep(max(0.0, next_t - time.monotonic()))

    status_ms: list[float] = []
    driver = threading.Thread(target=drive, daemon=True)
    with Client(sock) as c:
        c.request("status")
        driver.start()
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            t0 = time.perf_counter()
            c.request("status")
            status_ms.append((time.perf_counter() - t0) * 1000)
            time.sleep(0.5)
        stop.set()
        driver.join(5)
        st = c.request("status")
        accounted = sum(j.get("steps", 0) for j in st["jobs"] if j["job"].startswith(f"{name}-"))
    for s in socks:
        s.close()
    if errors:
        raise SystemExit(f"a client lost the daemon: {errors[0]}")
    status_ms.sort()
    return {
        "steps_sent": sent[0],
        "steps_accounted": accounted,
        "status_ms_p50": statistics.median(status_ms),
        "status_ms_max": status_ms[-1],
        "rows_every_s": every_s,
        "tick_lateness_s": st["tick_lateness_s"],
        "ticks_skipped": st["ticks_skipped"],
    }


def legacy_steps(sock: Path, clients: int, steps: int, batch: int) -> float:
    """The per-step form, as fast as the daemon takes it: step reports accounted per second."""

    def client(i: int) -> None:
        s, _ = connect(sock, f"legacy-{i}", i % GPUS, ["fp32"])
        # Stamps on the daemon's clock, never before boot (a negative stamp is refused).
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

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    with Client(sock) as c:
        counted = sum(c.request("report", job=f"legacy-{i}")["step_reports"] for i in range(clients))
    return counted / wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--rate", type=float, default=1000.0, help="steps per second per client")
    ap.add_argument("--seconds", type=float, default=20.0, help="per run")
    ap.add_argument("--no-losses", dest="losses", action="store_false", help="rows without per-step losses")
    ap.add_argument("--legacy-clients", type=int, default=2)
    ap.add_argument("--legacy-steps", type=int, default=50_000, help="per legacy client")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        (tmp / "cfg.toml").write_text('[daemon]\nsocket_group = ""\nmax_jobs_per_uid = 1000\n')
        sock = tmp / "g.sock"
        cmd = [sys.executable, "-m", "greend.daemon_main", "run", "--config", str(tmp / "cfg.toml"), "--sim",
               str(GPUS), "--hz", str(TICK_HZ), "--socket", str(sock), "--state-dir", str(tmp / "state"),
               "--log-level", "warning"]  # fmt: skip
        proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        try:
            deadline = time.monotonic() + 30
            while not sock.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.0)
            idle0, w0 = cpu_s(proc.pid), time.monotonic()
            time.sleep(5.0)
            idle_pct = 100 * (cpu_s(proc.pid) - idle0) / (time.monotonic() - w0)
            runs = {}
            for on_sim in (False, True):
                c0, w0 = cpu_s(proc.pid), time.monotonic()
                r = load(sock, "sim" if on_sim else "acct", args.clients, args.rate, args.seconds, args.losses, on_sim)
                r["daemon_cpu_pct"] = 100 * (cpu_s(proc.pid) - c0) / (time.monotonic() - w0)
                runs["executed_on_sim" if on_sim else "accounted"] = r
                time.sleep(2.0)  # the jobs' ranks leave
            legacy = legacy_steps(sock, args.legacy_clients, args.legacy_steps, 256)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    rate_total = args.clients * args.rate
    print(f"daemon under load: {args.clients} clients x {args.rate:g} steps/s = {rate_total:,.0f} steps/s, "
          f"{GPUS} simulated GPUs ticking at {TICK_HZ:g} Hz, rows every {runs['accounted']['rows_every_s']:g} s"
          f"{' with per-step losses' if args.losses else ''}, {args.seconds:g} s per run; "
          f"the daemon idle before: {idle_pct:.1f}% of one core")  # fmt: skip
    labels = {
        "accounted": "rows accounted (jobs without GPUs: the daemon's work on a real node)",
        "executed_on_sim": "rows executed on the simulated GPUs too (the simulator's cost added)",
    }
    for key, label in labels.items():
        r = runs[key]
        late = r["tick_lateness_s"]
        print(f"  {label}:")
        print(f"    accounted {r['steps_accounted']:,} of {r['steps_sent']:,} steps sent")
        print(f"    tick lateness over the last {late['ticks']} ticks: p50 {late['p50'] * 1000:.1f} ms, "
              f"p99 {late['p99'] * 1000:.1f} ms, max {late['max'] * 1000:.1f} ms (target p99 < 50 ms); "
              f"{r['ticks_skipped']} ticks skipped since start")  # fmt: skip
        print(f"    status: median {r['status_ms_p50']:.1f} ms, max {r['status_ms_max']:.1f} ms (target < 20 ms)")
        print(f"    daemon CPU: {r['daemon_cpu_pct']:.1f}% of one core (target < 10%)")
    print(f"older per-step form ({args.legacy_clients} clients, 256 steps a message, as fast as taken): "
          f"{legacy:,.0f} step reports/s")  # fmt: skip
    print(json.dumps({"runs": runs, "idle_cpu_pct": idle_pct, "legacy_steps_per_s": legacy}))


if __name__ == "__main__":
    main()
