"""The daemon with several stores at once: SQLite, InfluxDB protocol (a real
victoria-metrics) and Prometheus, each failing on its own; an outage and a SIGKILL
of the daemon during it lose nothing."""

from __future__ import annotations

import signal
import sqlite3
import time
import urllib.request
from pathlib import Path

import pytest

from . import vmserver
from .conftest import DaemonProc, start_daemon

pytestmark = pytest.mark.e2e


@pytest.fixture()
def vm(tmp_path: Path):
    if not vmserver.available():
        pytest.skip(f"{vmserver.VM_BIN} is absent (apt-get install victoria-metrics)")
    server = vmserver.VmServer(tmp_path / "vm", dedup=False).start()
    yield server
    server.close()


def gpu0_samples(vm: vmserver.VmServer, host_tag: str | None = None) -> list[tuple[int, float]]:
    vm.force_flush()
    return vm.samples("greend_gpu_energy_j", gpu="0")


def test_three_stores_at_once_and_one_failing_alone(tmp_path: Path, daemons: list[DaemonProc],
                                                    vm: vmserver.VmServer) -> None:
    prom_port = vmserver.free_port()
    dead_port = vmserver.free_port()  # nothing listens there
    db = tmp_path / "s.db"
    d = start_daemon(tmp_path, "--sim", "2", "--hz", "10",
                     "--store", f"sqlite:///{db}",
                     "--store", vm.influx_url,
                     "--store", f"influx://127.0.0.1:{dead_port}?org=o&bucket=b",
                     "--store", f"prometheus://127.0.0.1:{prom_port}")
    daemons.append(d)
    got = vm.wait_samples("greend_gpu_energy_j", 3, gpu="0")
    assert len(got) >= 3
    text = urllib.request.urlopen(f"http://127.0.0.1:{prom_port}/metrics", timeout=5).read().decode()
    assert 'greend_gpu_energy_joules_total{' in text and 'gpu="1"' in text
    st = d.status()
    stores = {s["url"]: s for s in st["stores"]}
    assert stores[f"sqlite:///{db}"]["ok"]
    assert stores[vm.influx_url]["ok"]
    dead = stores[f"influx://127.0.0.1:{dead_port}?org=o&bucket=b"]
    assert dead["pending"] > 0, "points for the dead store wait in its spool"
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    assert con.execute("SELECT COUNT(*) FROM greend_gpu").fetchone()[0] > 0
    con.close()


def test_outage_and_daemon_sigkill_lose_nothing(tmp_path: Path, daemons: list[DaemonProc],
                                                vm: vmserver.VmServer) -> None:
    state = tmp_path / "state"
    d = start_daemon(tmp_path, "--sim", "1", "--hz", "10", "--store", vm.influx_url, state_dir=state)
    daemons.append(d)
    vm.wait_samples("greend_gpu_energy_j", 2, gpu="0")
    vm.stop()  # the store goes away ...
    outage_ms = time.time() * 1000
    time.sleep(4.0)  # ... while the daemon samples on (1 point per second per series)
    during = d.status()["stores"][0]
    assert during["pending"] > 0
    d.stop(signal.SIGKILL)  # ... and the daemon is killed during the outage
    killed_ms = time.time() * 1000
    vm.start()
    d2 = start_daemon(tmp_path, "--sim", "1", "--hz", "10", "--store", vm.influx_url, state_dir=state,
                      name="d2")
    daemons.append(d2)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        s = d2.status()["stores"][0]
        if s["pending"] == 0 and s["written"] > 0:
            break
        time.sleep(0.2)
    time.sleep(1.0)
    d2.stop()
    samples = gpu0_samples(vm)
    ts = [t for t, _ in samples]
    assert ts == sorted(ts), "replayed in order"
    assert len(ts) == len(set(ts)), "no duplicates"
    # Nothing lost: one point a second from the first daemon's start to the second's stop,
    # with no gap longer than the restart took.
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    assert max(gaps) < 15_000, f"a gap of {max(gaps)} ms: points were lost"
    # The points sampled during the outage, all of them, from the killed daemon's spool.
    during_outage = [t for t in ts if outage_ms <= t <= killed_ms]
    assert len(during_outage) >= int((killed_ms - outage_ms) / 1000) - 1 >= 3
