"""Scrapes of ``/metrics`` against the daemon's tick: how many scrapes a second the
endpoint serves while the tick keeps time (lateness p99 < 50 ms).

Starts ``greend run --sim 2 --hz 50`` with a ``prometheus://`` store, then floods
``/metrics`` from client processes (plain HTTP/1.0 GETs, one a connection, as fast as
each client can) for a window as long as the daemon's lateness record (600 ticks), and
reads the tick lateness from ``status`` at the end. ``--jobs`` jobs are registered first
(each scrape then renders every one of them, as on a busy node). Runs the default scrape limit
(``max_scrapes_per_s`` 10: the rest are answered 429 without reading status), and the
limit off, at each client count. Figures are this machine's; the GPUs are simulated.

    python bench/bench_metrics.py [--seconds 12] [--clients 1,4] [--hz 50] [--jobs 200]

Run it as root (the jobs are over one user's max_jobs_per_uid otherwise).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from greend.ipc.client import Client  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _client(port: int, seconds: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    counts: dict[str, int] = {}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                c.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
                buf = b""
                while chunk := c.recv(65536):
                    buf += chunk
            code = buf[9:12].decode() if buf.startswith(b"HTTP/") else "closed"
        except OSError:
            code = "error"
        counts[code] = counts.get(code, 0) + 1
    out.put(counts)


def _register(sock: Path, jobs: int) -> list[socket.socket]:
    """``jobs`` jobs, each a connection that registered and sent a row of 10 steps."""
    import json

    conns = []
    for i in range(jobs):
        c = socket.socket(socket.AF_UNIX)
        c.connect(str(sock))
        c.sendall(b'{"v":1,"id":1,"op":"register","job":"bench-%d"}\n' % i)
        assert b'"ok":true' in c.recv(65536)
        now = time.monotonic()
        row = {"first_step": 0, "last_step": 9, "steps": 10, "t0_s": now - 1, "t1_s": now - 0.1, "busy_s": 0.9,
               "busy_sq_s2": 0.081, "flops": 1e13, "samples": 320, "loss_n": 10, "loss_sum": 20.0}  # fmt: skip
        c.sendall(json.dumps({"v": 1, "op": "intervals", "rows": [row]}).encode() + b"\n")
        conns.append(c)
    return conns


def run(clients: int, limit: float, seconds: float, hz: float, jobs: int = 0) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        (tmp / "cfg.toml").write_text('[daemon]\nsocket_group = ""\n')
        port = _free_port()
        sock = tmp / "g.sock"
        cmd = [sys.executable, "-m", "greend.daemon_main", "run", "--config", str(tmp / "cfg.toml"),
               "--sim", "2", "--hz", str(hz), "--socket", str(sock), "--state-dir", str(tmp / "state"),
               "--store", f"sqlite:///{tmp / 'g.db'}",
               "--store", f"prometheus://127.0.0.1:{port}?max_scrapes_per_s={limit:g}&max_connections=16",
               "--log-level", "warning"]  # fmt: skip
        proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=str(REPO)))
        try:
            deadline = time.monotonic() + 30
            while not sock.exists():
                assert time.monotonic() < deadline and proc.poll() is None, "greend did not start"
                time.sleep(0.05)
            held = _register(sock, jobs)
            time.sleep(2.0)  # settle
            out: mp.Queue = mp.Queue()  # type: ignore[type-arg]
            ps = [mp.Process(target=_client, args=(port, seconds, out)) for _ in range(clients)]
            t0 = time.monotonic()
            for p in ps:
                p.start()
            totals: dict[str, int] = {}
            for _ in ps:
                for k, v in out.get().items():
                    totals[k] = totals.get(k, 0) + v
            for p in ps:
                p.join()
            wall = time.monotonic() - t0
            with Client(sock) as c:
                lat = c.request("status")["tick_lateness_s"]
            for c in held:
                c.close()
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(20)
    return {
        "served_per_s": totals.get("200", 0) / wall,
        "limited_per_s": totals.get("429", 0) / wall,
        "other": sum(v for k, v in totals.items() if k not in ("200", "429")),
        "p99_ms": lat["p99"] * 1e3,
        "max_ms": lat["max"] * 1e3,
        "ticks": lat["ticks"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--hz", type=float, default=50.0)
    ap.add_argument("--jobs", type=int, default=200)
    args = ap.parse_args()
    print(
        f"/metrics flood against greend run --sim 2 --hz {args.hz:g} holding {args.jobs} jobs, "
        f"{args.seconds:g} s a run (sim)"
    )
    head = f"{'limit/s':>8} {'clients':>7} {'served/s':>9} {'429/s':>8} {'tick p99':>9} {'tick max':>9}"
    print(head + "  target p99 < 50 ms")
    for limit in (10.0, 0.0):
        for n in (int(x) for x in args.clients.split(",")):
            r = run(n, limit, args.seconds, args.hz, args.jobs)
            verdict = "met" if r["p99_ms"] < 50 else "NOT met"
            print(
                f"{(f'{limit:g}' if limit else 'off'):>8} {n:>7} {r['served_per_s']:>9.1f} {r['limited_per_s']:>8.1f} "
                f"{r['p99_ms']:>7.1f}ms {r['max_ms']:>7.1f}ms  {verdict} ({r['ticks']} ticks, {r['other']} other)"
            )


if __name__ == "__main__":
    main()
