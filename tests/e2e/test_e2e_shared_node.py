"""A node shared by many users, attacked as a red team would: a real daemon in a
subprocess, clients of real unprivileged users (created with useradd; root only)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from greend.fsutil import write_atomic
from tests.support import REPO, DaemonProc, env, start_daemon, wait_for

pytestmark = pytest.mark.e2e

USER = "greend-redteam"

# The attackers' interpreter: a system one an unprivileged user may run (a venv under
# root's home may not be reachable); their scripts use the standard library only.
USER_PY = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(p, os.X_OK)), None)

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None or USER_PY is None,
    reason="needs root, useradd and /usr/bin/python3: the attacks run as a real unprivileged user",
)


@pytest.fixture(scope="module")
def user() -> str:
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER], check=True)
    return USER


@pytest.fixture()
def shared_dir() -> Iterator[Path]:
    """A socket dir every user can reach (pytest's tmp dirs are root's 0700)."""
    d = Path(tempfile.mkdtemp(prefix="greend-shared-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def as_user(user: str, code: str, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(USER_PY), "-c", code, *args],
        user=user,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/",
        env=env(),
    )


def request(path: Path, op: str, **fields: object) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        s.sendall(json.dumps({"v": 1, "op": op, **fields}).encode() + b"\n")
        buf = b""
        while b"\n" not in buf:
            chunk = s.recv(65536)
            assert chunk
            buf += chunk
        return json.loads(buf.split(b"\n")[0])


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


SHARED_CFG = '[daemon]\nsocket_group = ""\nsocket_mode = "0666"\nadmin_group = ""\n'


def test_a_refused_second_daemon_leaves_the_live_one_alone(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d1 = start_daemon(tmp_path, "--sim", "1", "--hz", "20", name="one")
    daemons.append(d1)
    # The same state dir: refused by the lock, naming the running pid.
    d2 = start_daemon(tmp_path, "--sim", "1", name="two", state_dir=d1.state_dir, wait=False)
    daemons.append(d2)
    assert d2.proc.wait(30) != 0
    assert f"pid {d1.proc.pid}" in d2.log_text() and "state dir" in d2.log_text()
    # Another state dir but the same socket: refused, and the live socket stays.
    d3 = start_daemon(tmp_path, "--sim", "1", name="three", socket=d1.socket, wait=False)
    daemons.append(d3)
    assert d3.proc.wait(30) != 0
    assert f"pid {d1.proc.pid}" in d3.log_text()
    assert d1.socket.exists() and d1.status()["ticks"] > 0
    # greend restore will not pull the running daemon's settings from under it.
    r = subprocess.run(
        [sys.executable, "-m", "greend.actuators.restore", "--state-dir", str(d1.state_dir)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env(),
        timeout=30,
    )
    assert r.returncode == 2 and f"pid {d1.proc.pid}" in r.stderr and "--force" in r.stderr
    # The greend command takes the same --force (nothing is capped here: nothing to restore).
    r = subprocess.run(
        [sys.executable, "-m", "greend.daemon_main", "restore", "--state-dir", str(d1.state_dir), "--force"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env(),
        timeout=30,
    )
    assert r.returncode == 0, r.stderr


def test_a_planted_symlink_at_the_temp_path_is_never_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    target = tmp_path / "saved-settings.json"
    (tmp_path / f".{target.name}.{os.getpid()}.tmp").symlink_to(victim)
    write_atomic(target, "{}\n")
    assert victim.read_text() == "precious\n"
    assert target.read_text() == "{}\n" and not target.is_symlink()


def test_a_state_dir_others_can_write_is_refused(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    state = tmp_path / "open-state"
    state.mkdir()
    state.chmod(0o777)
    d = start_daemon(tmp_path, "--sim", "1", name="open", state_dir=state, wait=False)
    daemons.append(d)
    assert d.proc.wait(30) != 0
    assert "writable by its group or by others" in d.log_text()


IDLE = """
import socket, sys, time
socks = []
refused = 0
for i in range(300):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    socks.append(s)
time.sleep(0.5)
print(len(socks), flush=True)
time.sleep(float(sys.argv[2]))
"""


@needs_root
def test_300_idle_connections_of_one_user_do_not_lock_root_out(
    tmp_path: Path, shared_dir: Path, user: str, daemons: list[DaemonProc]
) -> None:
    d = start_daemon(tmp_path, "--sim", "2", "--hz", "20", config=SHARED_CFG, socket=shared_dir / "g.sock")
    daemons.append(d)
    hog = subprocess.Popen(
        [str(USER_PY), "-c", IDLE, str(d.socket), "30"], user=user, env=env(), cwd="/", stdout=subprocess.PIPE
    )
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == b"300"
        st = d.status()  # root is still served
        assert st["ticks"] > 0
        d.ctl("cap", "reset")
        # The user's own new connection is refused, naming the limit to raise.
        reply = as_user(
            user,
            "import socket, sys\ns = socket.socket(socket.AF_UNIX)\ns.connect(sys.argv[1])\n"
            "s.settimeout(5)\nprint(s.recv(4096).decode())",
            str(d.socket),
        )
        assert "max_connections_per_uid" in reply.stdout, reply
    finally:
        hog.kill()
        hog.wait(10)


@needs_root
def test_a_job_cannot_squat_gpus_that_do_not_exist(
    tmp_path: Path, shared_dir: Path, user: str, daemons: list[DaemonProc]
) -> None:
    d = start_daemon(tmp_path, "--sim", "2", "--hz", "20", config=SHARED_CFG, socket=shared_dir / "g.sock")
    daemons.append(d)
    code = (
        "import json, socket, sys\ns = socket.socket(socket.AF_UNIX)\ns.connect(sys.argv[1])\n"
        "s.sendall(json.dumps({'v': 1, 'op': 'register', 'job': 'squat', 'gpus': list(range(64))}).encode() + b'\\n')\n"
        "print(s.recv(65536).decode())"
    )
    r = as_user(user, code, str(d.socket))
    reply = json.loads(r.stdout)
    assert reply["ok"] is False and "do not exist" in reply["error"]["message"], reply
    assert not d.status()["jobs"]


# A training rank that registers GPU 0, reports steps (so the simulated GPU lists it
# as a compute process) and stays alive until its stdin closes.
LEGIT = """
import json, socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
f = s.makefile("rb")
s.sendall(json.dumps({"v": 1, "op": "register", "job": "legit", "gpus": [0]}).encode() + b"\\n")
assert json.loads(f.readline())["ok"]
t = time.monotonic()
steps = [{"step": i, "t0_s": t - 0.01, "t1_s": t, "flops": 1e12} for i in range(3)]
s.sendall(json.dumps({"v": 1, "op": "steps", "steps": steps}).encode() + b"\\n")
print("ready", flush=True)
sys.stdin.read()
"""


@needs_root
def test_a_job_cannot_squat_a_simulated_gpu_another_job_uses(
    tmp_path: Path, shared_dir: Path, user: str, daemons: list[DaemonProc]
) -> None:
    """gpu0 runs a legitimate rank (in the simulator's process table once its steps ran
    there); an unprivileged user's job that claims gpu0 without a process on it is
    refused; the idle gpu1 may still be claimed (CUDA may start after registration)."""
    d = start_daemon(tmp_path, "--sim", "2", "--hz", "20", config=SHARED_CFG, socket=shared_dir / "g.sock")
    daemons.append(d)
    legit = subprocess.Popen(
        [sys.executable, "-c", LEGIT, str(d.socket)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env()
    )
    try:
        assert legit.stdout is not None and legit.stdout.readline().strip() == b"ready"
        procs = d.state_dir / "sim" / "gpu0.procs.json"
        assert wait_for(lambda: procs.exists() and legit.pid in json.loads(procs.read_text())["pids"], 10)
        code = (
            "import json, socket, sys\ns = socket.socket(socket.AF_UNIX)\ns.connect(sys.argv[1])\n"
            "f = s.makefile('rb')\n"
            "for gpus in ([0], [1]):\n"
            "    s.sendall(json.dumps({'v': 1, 'op': 'register', 'job': 'squat' + str(gpus[0]), 'gpus': gpus}).encode()"
            " + b'\\n')\n"
            "    print(f.readline().decode().strip())"
        )
        r = as_user(user, code, str(d.socket))
        on_busy, on_idle = (json.loads(ln) for ln in r.stdout.splitlines())
        assert on_busy["ok"] is False and "none of this job's" in on_busy["error"]["message"], on_busy
        assert on_idle["ok"] is True, on_idle
        assert {j["job"] for j in d.status()["jobs"]} >= {"legit"}
        assert "squat0" not in {j["job"] for j in d.status()["jobs"]}
    finally:
        legit.communicate(timeout=10)


FLOOD = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
f = s.makefile("rb")
def req(obj):
    s.sendall(json.dumps(obj).encode() + b"\\n")
    return json.loads(f.readline())
assert req({"v": 1, "op": "register", "job": "flood", "gpus": [0]})["ok"]
ok = refused = 0
reason = "x" * 500
for i in range(int(sys.argv[2])):
    r = req({"v": 1, "op": "precision_event", "kind": "refused", "from": "fp32", "reason": reason, "step": i})
    if r["ok"]:
        ok += 1
    else:
        refused += 1
        last = r["error"]["message"]
print(json.dumps({"ok": ok, "refused": refused, "last": last}), flush=True)
sys.stdin.read()
"""


@needs_root
def test_a_precision_event_flood_leaves_memory_bounded(
    tmp_path: Path, shared_dir: Path, user: str, daemons: list[DaemonProc]
) -> None:
    d = start_daemon(tmp_path, "--sim", "1", "--hz", "20", config=SHARED_CFG, socket=shared_dir / "g.sock")
    daemons.append(d)
    before = rss_kb(d.proc.pid)
    flood = subprocess.Popen(
        [str(USER_PY), "-c", FLOOD, str(d.socket), "20000"],
        user=user,
        env=env(),
        cwd="/",
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert flood.stdout is not None
        out = json.loads(flood.stdout.readline())
        assert out["ok"] <= 120 and out["refused"] >= 19_000
        assert "max_events_per_min_per_uid" in out["last"]
        report = request(d.socket, "report", job="flood")["result"]
        assert len(report["precision_log"]) <= 256
        assert rss_kb(d.proc.pid) - before < 50_000  # kB: not hundreds of MB
    finally:
        flood.kill()
        flood.wait(10)


HEARTBEAT = """
import json, socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
f = s.makefile("rb")
s.sendall(json.dumps({"v": 1, "op": "register", "job": "patient", "gpus": [0]}).encode() + b"\\n")
assert json.loads(f.readline())["ok"]
s.sendall(json.dumps({"v": 1, "op": "steps", "steps": [
    {"step": 0, "t0_s": time.monotonic() - 0.5, "t1_s": time.monotonic(), "flops": 1e9}]}).encode() + b"\\n")
print("ready", flush=True)
while True:
    s.sendall(json.dumps({"v": 1, "op": "heartbeat"}).encode() + b"\\n")
    time.sleep(0.3)
"""


def test_a_frozen_daemon_keeps_its_healthy_jobs(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    cfg = '[daemon]\nsocket_group = ""\nheartbeat_timeout_s = 2.0\n'
    d = start_daemon(tmp_path, "--sim", "1", "--hz", "20", config=cfg)
    daemons.append(d)
    client = subprocess.Popen(
        [sys.executable, "-c", HEARTBEAT, str(d.socket)], env=env(), cwd=REPO, stdout=subprocess.PIPE
    )
    try:
        assert client.stdout is not None and client.stdout.readline().strip() == b"ready"
        assert wait_for(lambda: request(d.socket, "report", job="patient")["result"]["steps"] == 1, 10)
        d.proc.send_signal(signal.SIGSTOP)
        time.sleep(5.0)  # 2.5 heartbeat timeouts
        d.proc.send_signal(signal.SIGCONT)
        time.sleep(1.5)
        rep = request(d.socket, "report", job="patient")["result"]
        assert rep["state"] == "running" and rep["steps"] == 1, rep
    finally:
        client.kill()
        client.wait(10)
