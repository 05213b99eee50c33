"""The daemon's memory under one hostile uid's floods.

Run:  python bench/bench_hostile.py [--seconds 20] [--user NOBODY]

Starts a real greend (2 simulated GPUs) on temp paths, then one client uid (``--user``,
default the current one; as root pass an unprivileged user to exercise the per-uid
limits) floods it for ``--seconds``: idle connections up to its limit, precision_event
messages with 500-byte reasons, and step reports as fast as it can send them. Prints the
daemon's RSS (and greend.db's size) before, during and after, with the counts of what
was accepted and refused. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

FLOOD = r"""
import json, socket, sys, time
path, seconds = sys.argv[1], float(sys.argv[2])
s = socket.socket(socket.AF_UNIX)
s.connect(path)
f = s.makefile("rb")
idle = []
for i in range(300):
    c = socket.socket(socket.AF_UNIX)
    try:
        c.connect(path)
    except OSError:
        break
    idle.append(c)
def req(obj):
    s.sendall(json.dumps(obj).encode() + b"\n")
    return json.loads(f.readline())
reg = req({"v": 1, "op": "register", "job": "hostile", "gpus": [0]})
ok = refused = steps = 0
end = time.monotonic() + seconds
i = 0
while time.monotonic() < end:
    r = req({"v": 1, "op": "precision_event", "kind": "refused", "from": "fp32", "reason": "x" * 500, "step": i})
    ok += r["ok"]
    refused += not r["ok"]
    t = time.monotonic()
    batch = [{"step": i * 256 + k, "t0_s": t - 0.002, "t1_s": t - 0.001, "flops": 1e9, "loss": 1.0} for k in range(256)]
    s.sendall(json.dumps({"v": 1, "op": "steps", "steps": batch}).encode() + b"\n")
    steps += len(batch)
    i += 1
print(json.dumps({"idle_connections_opened": len(idle), "registered": reg["ok"], "events_ok": ok,
                  "events_refused": refused, "steps_sent": steps}))
"""


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--user", default=None, help="the hostile uid's user name (default: the current user)")
    args = ap.parse_args()
    shared = Path(tempfile.mkdtemp(prefix="greend-hostile-"))
    shared.chmod(0o755)
    state = shared / "state"
    sock = shared / "g.sock"
    cfg = shared / "greend.toml"
    cfg.write_text('[daemon]\nsocket_group = ""\nsocket_mode = "0666"\nadmin_group = ""\n')
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log = open(shared / "greend.log", "wb")
    d = subprocess.Popen(
        [sys.executable, "-m", "greend.daemon_main", "run", "--config", str(cfg), "--socket", str(sock),
         "--state-dir", str(state), "--sim", "2", "--hz", "10"],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            if d.poll() is not None or time.monotonic() > deadline:
                print((shared / "greend.log").read_text())
                return 1
            time.sleep(0.1)
        time.sleep(1.0)
        print(f"daemon RSS before: {rss_mb(d.pid):.1f} MB")
        user = args.user or pwd.getpwuid(os.getuid()).pw_name
        py = "/usr/bin/python3" if args.user else sys.executable
        flood = subprocess.Popen(
            [py, "-c", FLOOD, str(sock), str(args.seconds)], user=user, stdout=subprocess.PIPE, text=True, cwd="/"
        )
        peak = 0.0
        while flood.poll() is None:
            peak = max(peak, rss_mb(d.pid))
            time.sleep(0.5)
        print(f"hostile uid {pwd.getpwnam(user).pw_uid}: {flood.stdout.read().strip() if flood.stdout else ''}")
        print(f"daemon RSS peak during the flood: {peak:.1f} MB")
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(sock))
            s.sendall(b'{"v":1,"op":"report","job":"hostile"}\n')
            buf = b""
            while not buf.endswith(b"\n"):
                buf += s.recv(1 << 20)
        rep = json.loads(buf).get("result") or {}
        print(f"job report: {len(buf) / 1024:.0f} KiB, precision_log {len(rep.get('precision_log') or [])} entries, "
              f"dropped {rep.get('log_dropped', {})}")  # fmt: skip
        time.sleep(2.0)
        db_mb = os.path.getsize(state / "greend.db") / 1e6
        print(f"daemon RSS after: {rss_mb(d.pid):.1f} MB; greend.db {db_mb:.1f} MB")
    finally:
        d.terminate()
        d.wait(15)
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
