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


OUTAGE_S = 70.0  # "the store unreachable for minutes": longer than a minute, many back-offs


def sqlite_gpu0_ts_ms(db: Path) -> list[int]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    rows = [r[0] // 1_000_000 for r in con.execute("SELECT ts_ns FROM greend_gpu WHERE gpu = '0' ORDER BY ts_ns")]
    con.close()
    return rows


def test_outage_and_daemon_sigkill_lose_nothing(tmp_path: Path, daemons: list[DaemonProc],
                                                vm: vmserver.VmServer) -> None:
    # Each daemon also writes an SQLite store, which never goes down: it is the record
    # of what was sampled, against which the InfluxDB-protocol store is checked.
    state = tmp_path / "state"
    db1, db2 = tmp_path / "one.db", tmp_path / "two.db"
    d = start_daemon(tmp_path, "--sim", "1", "--hz", "10", "--store", vm.influx_url,
                     "--store", f"sqlite:///{db1}", state_dir=state)
    daemons.append(d)
    vm.wait_samples("greend_gpu_energy_j", 2, gpu="0")
    vm.stop()  # the store goes away ...
    outage_ms = time.time() * 1000
    time.sleep(OUTAGE_S)  # ... for over a minute, while the daemon samples on (1 point/s/series)
    during = d.status()["stores"][0]
    assert during["pending"] >= OUTAGE_S - 5 and not during["ok"], during
    d.stop(signal.SIGKILL)  # ... and the daemon is killed during the outage
    killed_ms = time.time() * 1000
    vm.start()
    d2 = start_daemon(tmp_path, "--sim", "1", "--hz", "10", "--store", vm.influx_url,
                      "--store", f"sqlite:///{db2}", state_dir=state, name="d2")
    daemons.append(d2)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        s = d2.status()["stores"][0]
        if s["pending"] == 0 and s["written"] > 0:
            break
        time.sleep(0.2)
    time.sleep(1.0)
    d2.stop()
    ts = [t for t, _ in gpu0_samples(vm)]
    assert len(ts) == len(set(ts)), "no duplicates"
    # Nothing lost: every sample either daemon committed to SQLite is in the store. (The
    # store may hold a few more: the killed daemon's last points, spooled to disk but
    # not yet committed to its SQLite batch.) The order in which they were sent is
    # asserted in test_influx_sink, where arrivals can be watched; a query sorts them.
    truth = sqlite_gpu0_ts_ms(db1) + sqlite_gpu0_ts_ms(db2)
    missing = sorted(set(truth) - set(ts))
    assert not missing, f"{len(missing)} of {len(truth)} points lost, first {missing[:5]}"
    extra = [t for t in set(ts) - set(truth) if not killed_ms - 3000 <= t <= killed_ms]
    assert not extra, f"points in the store that no daemon sampled: {sorted(extra)[:5]}"
    during_outage = [t for t in ts if outage_ms <= t <= killed_ms]
    assert len(during_outage) >= int((killed_ms - outage_ms) / 1000) - 1 >= OUTAGE_S - 1
