"""Fault survival with the real daemon as a subprocess: a GPU lost mid-run, a client
that hangs (no heartbeat) with caps applied, a corrupt config, and the daemon's own
file descriptors after many clients come and go."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from greend.errors import DaemonUnavailable
from greend.ipc.client import Client
from greend.probes.fake_nvml import FakeNvml
from greend.probes.sim import SimGpu
from tests.support import DaemonProc, start_daemon, wait_for, wait_ready

pytestmark = pytest.mark.e2e


def test_gpu_lost_mid_run_the_others_go_on(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "--sim", "3", "--hz", "20")
    daemons.append(d)
    assert [g["index"] for g in d.status()["gpus"]] == [0, 1, 2]
    FakeNvml(d.state_dir / "sim").inject(1, lost=True)  # gpu1 falls off the bus, seen through faults.json
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and [g["index"] for g in d.status()["gpus"]] != [0, 2]:
        time.sleep(0.1)
    st = d.status()
    assert [g["index"] for g in st["gpus"]] == [0, 2]
    e0 = st["gpus"][0]["energy_j"]
    deadline = time.monotonic() + 10
    st2 = d.status()
    while time.monotonic() < deadline and st2["gpus"][0]["energy_j"] <= e0:
        time.sleep(0.1)
        st2 = d.status()
    assert st2["gpus"][0]["energy_j"] > e0, "gpu0 is still sampled"
    sim_probe = next(p for p in st2["probes"] if p["name"] == "sim")
    assert sim_probe["success"], "the probe as a whole still succeeds"
    assert any("gpu1" in line and "lost" in line for line in [sim_probe.get("detail") or "", *sim_probe["devices"]])
    # ... and controlled: gpu2 still takes a cap, gpu1 is refused with a clear error.
    d.ctl("cap", "set", "--gpu", "2", "--max-clock", "1200")
    assert SimGpu(d.state_dir / "sim", 2).locked_clocks_mhz() == (345, 1200)
    r = d.ctl("cap", "set", "--gpu", "1", "--max-clock", "1200", check=False)
    assert r.returncode != 0 and "GPU 1" in r.stderr
    assert d.stop() == 0
    assert SimGpu(d.state_dir / "sim", 2).locked_clocks_mhz() is None  # restored on SIGTERM


@pytest.mark.slow
def test_hung_client_loses_its_caps_within_the_heartbeat_timeout(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    from tests.e2e.test_e2e_control import EFFICIENT
    from tests.e2e.test_e2e_jobs import trainer, wait_ended

    # The efficient policy caps the job's GPU on the job's behalf (a job-owned cap, not
    # a node cap): a client that hangs must lose it within the heartbeat timeout.
    cfg = EFFICIENT.replace('socket_group = ""\n', 'socket_group = ""\nheartbeat_timeout_s = 2.0\n')
    d = start_daemon(tmp_path, "--sim", "1", config=cfg)
    daemons.append(d)
    g = SimGpu(d.state_dir / "sim", 0)
    ready = tmp_path / "ready"
    p = trainer(d.socket, "hangs", "--steps", "100000", "--step-sleep", "0.005", "--ready-file", str(ready))
    try:
        wait_ready(ready)
        assert wait_for(
            lambda: (
                g.locked_clocks_mhz() is not None
                and d.status()["policy"]["owners"] == {"hangs": ["gpu0.clock_cap_mhz"]}
            ),
            60,
        ), "the policy never capped the job"
        os.kill(p.pid, signal.SIGSTOP)  # the process hangs: its socket stays open, it says nothing
        t_stop = time.monotonic()
        with Client(d.socket) as c:  # left: "ending" at once, "ended" once its energy is booked
            assert wait_for(lambda: c.request("report", job="hangs")["state"] != "running", 10)
        took = time.monotonic() - t_stop
        assert wait_for(lambda: g.locked_clocks_mhz() is None, 5), "the hung job's cap was not lifted"
        lifted = time.monotonic() - t_stop
        rep = wait_ended(d, "hangs", timeout=10)
        assert rep["end_reason"].startswith("no heartbeat")
        assert took < 2.0 + 2.0, f"left {took:.1f} s after the client hung (timeout 2 s)"
        assert lifted < 2.0 + 2.0, f"cap lifted {lifted:.1f} s after the client hung (timeout 2 s)"
        assert not d.status()["policy"]["owners"]
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)


def test_a_static_node_cap_outlives_jobs_but_not_the_daemon(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    cfg = """[daemon]
socket_group = ""
[policy]
name = "static"
period_s = 0.2
[policy.params]
power_limit_w = 400
"""
    d = start_daemon(tmp_path, "--sim", "2", config=cfg)
    daemons.append(d)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and SimGpu(d.state_dir / "sim", 1).power_limit_w() != 400:
        time.sleep(0.05)
    assert [SimGpu(d.state_dir / "sim", i).power_limit_w() for i in (0, 1)] == [400, 400]
    assert d.stop() == 0
    assert [SimGpu(d.state_dir / "sim", i).power_limit_w() for i in (0, 1)] == [700, 700]


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[daemon]\nhz = 10\nhz = 20\n", "not valid TOML"),
        ("[daemon]\nhz = 1", None),  # truncated but valid: accepted as written
        ('[policy]\nname = "efficent"\n', "[policy] name = 'efficent': expected one of"),
        ('[policy]\nname = "efficient"\n[policy.params]\nmax_slowdown = "a lot"\n', "max_slowdown"),
        ('[store]\nurls = ["influx://h:8086"]\n', "missing org and bucket"),
    ],
)
def test_bad_config_is_refused_with_a_clear_message(tmp_path: Path, text: str, needle: str | None) -> None:
    import subprocess
    import sys

    from tests.support import REPO, env

    cfg = tmp_path / "g.toml"
    cfg.write_text(text)
    args = [
        sys.executable,
        "-m",
        "greend.daemon_main",
        "run",
        "--config",
        str(cfg),
        "--sim",
        "1",
        "--socket",
        str(tmp_path / "s.sock"),
        "--state-dir",
        str(tmp_path / "st"),
    ]
    if needle is None:
        p = subprocess.Popen(args, cwd=REPO, env=env(), stderr=subprocess.PIPE, text=True)

        def serving() -> bool:  # up and ticking, so its SIGTERM handler is in place
            assert p.poll() is None, p.stderr.read() if p.stderr else ""
            try:
                with Client(tmp_path / "s.sock", timeout_s=2.0) as c:
                    return c.request("status")["ticks"] > 0
            except DaemonUnavailable:
                return False

        assert wait_for(serving, 30)
        p.send_signal(signal.SIGTERM)
        assert p.wait(15) == 0
        return
    r = subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=REPO, env=env())
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_clients_that_come_and_go_leak_no_file_descriptors(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "--sim", "1")
    daemons.append(d)
    with Client(d.socket) as c:
        c.request("status")
    time.sleep(0.3)
    before = max(_fds(d.proc.pid) for _ in range(5))  # a file the tick opens for a moment is not a leak
    for i in range(300):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(d.socket))
        if i % 3 == 0:
            s.sendall(b'{"v":1,"op":"register","job":"j%d"}\n' % i)  # registers, then vanishes
        elif i % 3 == 1:
            s.sendall(b'{"v":1,"op":"sta')  # half a message, then gone
        s.close()
    now = [0]

    def closed() -> bool:
        now[0] = _fds(d.proc.pid)
        return now[0] <= before

    assert wait_for(closed, 10), f"{now[0]} file descriptors open, {before} before the clients"
    # The daemon closes a connection before it ends the connection's job: wait for both.
    jobs: list = []

    def all_ended() -> bool:
        jobs[:] = json.loads(d.ctl("jobs", "--json").stdout)["jobs"]
        return all(j["state"] != "running" for j in jobs)

    assert wait_for(all_ended, 15), f"every vanished client's job ended: {jobs}"


def test_a_probe_that_failed_to_open_is_tried_again_within_seconds_then_every_30() -> None:
    """One fault at the start (NVML's GetCount timing out once on a real node) left the
    node without GPU readings for 30 s: the first tries now come 2, 4, 8 and 16 s apart,
    then every PROBE_RETRY_S; a probe that opens is sampled from that tick."""
    from greend.daemon.probing import PROBE_RETRY_S, ProbeScheduler, ProbeStats
    from greend.errors import ProbeError
    from greend.probes.base import ProbeInfo, Readings

    class Flaky:
        name = "flaky"

        def __init__(self, fails: int) -> None:
            self.fails, self.opens = fails, 0

        def open(self) -> None:
            self.opens += 1
            if self.opens <= self.fails:
                raise ProbeError("nvmlDeviceGetCount: Timeout (NVML code 10)")

        def sample(self, now_s: float) -> Readings:
            return Readings()

        def info(self) -> ProbeInfo:
            return ProbeInfo(self.name, True, "")

        def close(self) -> None:
            pass

    class Into:
        def merge(self, r: Readings) -> None:
            pass

    now = [0.0]
    sched = ProbeScheduler(lambda: now[0])
    flaky = Flaky(fails=7)
    sched.probes, sched.stats = [flaky], {"flaky": ProbeStats("flaky")}
    sched.try_open(flaky, first=True)
    tries_at = []
    opens = 1
    while now[0] < 200.0 and not sched.is_open("flaky"):
        now[0] += 0.5
        sched.sample(now[0], Into())
        if flaky.opens > opens:
            opens = flaky.opens
            tries_at.append(now[0])
    assert tries_at[:4] == [2.0, 6.0, 14.0, 30.0], tries_at
    assert [b - a for a, b in zip(tries_at[3:], tries_at[4:])] == [PROBE_RETRY_S] * (len(tries_at) - 4), tries_at
    assert sched.is_open("flaky") and flaky.opens == 8
    # A probe that never opens (no RAPL in a VM): after 1,025 failures (8.5 h) the delay's
    # 2**n overflowed and every tick raised from then on. The delay stays 30 s.
    never = Flaky(fails=10**9)
    never.name = "never"
    sched.probes.append(never)
    sched.stats["never"] = ProbeStats("never", open_failures=5000)
    sched.try_open(never, first=False)
    assert sched.stats["never"].next_open_s == now[0] + PROBE_RETRY_S
    sched.sample(now[0] + PROBE_RETRY_S, Into())  # (tried again: no OverflowError)
