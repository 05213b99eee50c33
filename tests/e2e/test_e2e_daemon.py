"""The daemon as a user runs it: a real subprocess, a real socket, a real SQLite file."""

from __future__ import annotations

import signal
import sqlite3
import time
from pathlib import Path

import pytest

from greend.probes.fake_sysfs import make_standard_tree
from tests.support import DaemonProc, start_daemon

pytestmark = pytest.mark.e2e


def test_sim_gpus_and_rapl_fixture_end_to_end(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    sysfs = tmp_path / "sys"
    tree = make_standard_tree(sysfs)
    db = tmp_path / "store.db"
    d = start_daemon(tmp_path, "--sim", "2", "--sysfs-root", str(sysfs), "--hz", "20", "--store", f"sqlite:///{db}")
    daemons.append(d)
    # Burn 50 J in package-0 between two status reads: the daemon must see exactly that.
    first = d.status()
    pkg0 = next(c for c in first["cpus"] if c["zone"] == "package-0")
    before = pkg0["energy_j"]
    tree.advance(pkg0["path"], 50.0)

    def pkg0_energy(st: dict) -> float:
        return next(c for c in st["cpus"] if c["path"] == pkg0["path"])["energy_j"]

    deadline = time.monotonic() + 10  # a tick that read the zone after the advance
    st = d.status()
    while pkg0_energy(st) - before < 50.0 - 0.05 and time.monotonic() < deadline:
        time.sleep(0.1)
        st = d.status()

    assert [g["index"] for g in st["gpus"]] == [0, 1]
    for g in st["gpus"]:
        assert g["source"] == "sim"
        assert g["power_w"] > 0 and g["energy_j"] >= 0
        assert g["sm_clock_mhz"] > 0 and g["power_limit_w"] == pytest.approx(700.0)
        for key in ("index", "name", "source", "power_w", "energy_j", "sm_clock_mhz", "clock_cap_mhz", "power_limit_w"):
            assert key in g
    zones = {c["path"]: c for c in st["cpus"]}
    assert {c["zone"] for c in st["cpus"]} >= {"package-0", "package-1", "core", "uncore", "dram", "psys"}
    assert all(c["source"] == "rapl" for c in st["cpus"])
    assert zones[pkg0["path"]]["energy_j"] - before == pytest.approx(50.0, rel=1e-3)
    assert not next(c for c in st["cpus"] if c["zone"] == "psys")["counted"]
    assert st["totals"]["cpu_energy_j"] >= 50.0 - 1e-6
    assert "jobs" in st and "policy" in st
    assert all(p["success"] for p in st["probes"] if p["open"])

    # The readable table says the same thing.
    table = d.ctl("status").stdout
    assert "package-0" in table and "sim" in table

    probes = d.ctl("probes").stdout
    assert "sim" in probes and "rapl" in probes

    # Rows reach the SQLite file while the daemon runs.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
            n_gpu = con.execute("SELECT COUNT(*) FROM greend_gpu").fetchone()[0]
            n_cpu = con.execute("SELECT COUNT(*) FROM greend_cpu").fetchone()[0]
            con.close()
            if n_gpu >= 2 and n_cpu >= 6:
                break
        except sqlite3.OperationalError:
            pass
        time.sleep(0.2)
    assert n_gpu >= 2 and n_cpu >= 6

    assert d.stop(signal.SIGTERM) == 0, d.log_text()
    assert not d.socket.exists(), "the socket is removed on a clean stop"
    assert "stopped" in d.log_text()


def test_bad_config_is_refused_at_start_naming_the_key(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.support import REPO, env

    cfg = tmp_path / "bad.toml"
    cfg.write_text("[daemon]\nhz = 0\n")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "greend.daemon_main",
            "run",
            "--config",
            str(cfg),
            "--socket",
            str(tmp_path / "s.sock"),
            "--state-dir",
            str(tmp_path / "st"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO,
        env=env(),
    )
    assert r.returncode == 2
    assert "hz = 0.0: must be > 0" in r.stderr and str(cfg) in r.stderr


def test_greenctl_without_daemon_says_what_to_do(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.support import REPO, env

    r = subprocess.run(
        [sys.executable, "-m", "greend.ctl", "--socket", str(tmp_path / "none.sock"), "status"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO,
        env=env(),
    )
    assert r.returncode == 3
    assert "is the daemon running" in r.stderr


def test_daemon_notifies_systemd_ready_and_feeds_the_watchdog(
    tmp_path: Path, daemons: list[DaemonProc], monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket as socketlib

    ns = tmp_path / "notify.sock"
    rx = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_DGRAM)
    rx.bind(str(ns))
    rx.settimeout(10)
    monkeypatch.setenv("NOTIFY_SOCKET", str(ns))
    monkeypatch.setenv("WATCHDOG_USEC", "400000")  # 0.4 s: pings every 0.2 s
    d = start_daemon(tmp_path, "--sim", "1", "--hz", "2", wait=False)
    daemons.append(d)
    got: list[str] = []
    listening_at_ready = None
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and got.count("WATCHDOG=1") < 3:
        lines = rx.recv(4096).decode().splitlines()
        if "READY=1" in lines:  # systemd starts dependants now: the socket must answer
            from greend.ipc.client import Client

            with Client(d.socket, timeout_s=2.0) as c:
                listening_at_ready = c.request("ping")["pong"]
        got.extend(lines)
    assert "READY=1" in got and listening_at_ready is True
    # At 2 Hz the tick alone would ping twice a second; the slices keep 0.2 s.
    assert got.count("WATCHDOG=1") >= 3
    assert d.stop() == 0
    rest = []
    rx.settimeout(0.5)
    try:
        while True:
            rest.extend(rx.recv(4096).decode().splitlines())
    except TimeoutError:
        pass
    assert "STOPPING=1" in rest
