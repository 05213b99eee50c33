"""The daemon with several stores at once: SQLite, InfluxDB protocol (a real
victoria-metrics) and Prometheus, each failing on its own; an outage and a SIGKILL
of the daemon during it lose nothing."""

from __future__ import annotations

import grp
import os
import signal
import socket
import sqlite3
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests import vmserver
from tests.support import DaemonProc, start_daemon, wait_for

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


def test_three_stores_at_once_and_one_failing_alone(
    tmp_path: Path, daemons: list[DaemonProc], vm: vmserver.VmServer
) -> None:
    prom_port = vmserver.free_port()
    dead_port = vmserver.free_port()  # nothing listens there
    db = tmp_path / "s.db"
    d = start_daemon(
        tmp_path,
        "--sim",
        "2",
        "--hz",
        "10",
        "--store",
        f"sqlite:///{db}",
        "--store",
        vm.influx_url,
        "--store",
        f"influx://127.0.0.1:{dead_port}?org=o&bucket=b",
        "--store",
        f"prometheus://127.0.0.1:{prom_port}",
    )
    daemons.append(d)
    got = vm.wait_samples("greend_gpu_energy_j", 3, gpu="0")
    assert len(got) >= 3
    text = urllib.request.urlopen(f"http://127.0.0.1:{prom_port}/metrics", timeout=5).read().decode()
    assert "greend_gpu_energy_joules_total{" in text and 'gpu="1"' in text
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


@pytest.mark.slow
def test_outage_and_daemon_sigkill_lose_nothing(
    tmp_path: Path, daemons: list[DaemonProc], vm: vmserver.VmServer
) -> None:
    # Each daemon also writes an SQLite store, which never goes down: it is the record
    # of what was sampled, against which the InfluxDB-protocol store is checked.
    state = tmp_path / "state"
    db1, db2 = tmp_path / "one.db", tmp_path / "two.db"
    d = start_daemon(
        tmp_path, "--sim", "1", "--hz", "10", "--store", vm.influx_url, "--store", f"sqlite:///{db1}", state_dir=state
    )
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
    d2 = start_daemon(
        tmp_path,
        "--sim",
        "1",
        "--hz",
        "10",
        "--store",
        vm.influx_url,
        "--store",
        f"sqlite:///{db2}",
        state_dir=state,
        name="d2",
    )
    daemons.append(d2)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        s = d2.status()["stores"][0]
        if s["pending"] == 0 and s["written"] > 0:
            break
        time.sleep(0.2)
    time.sleep(1.0)
    d2.stop()
    truth = sqlite_gpu0_ts_ms(db1) + sqlite_gpu0_ts_ms(db2)
    ts: list[int] = []

    def all_in() -> bool:  # the newest points may take a moment to be queryable
        ts[:] = [t for t, _ in gpu0_samples(vm)]
        return set(truth) <= set(ts)

    wait_for(all_in, 10)
    assert len(ts) == len(set(ts)), "no duplicates"
    # Nothing lost: every sample either daemon committed to SQLite is in the store. (The
    # store may hold a few more: the killed daemon's last points, spooled to disk but
    # not yet committed to its SQLite batch.) The order in which they were sent is
    # asserted in test_influx_store, where arrivals can be watched; a query sorts them.
    missing = sorted(set(truth) - set(ts))
    assert not missing, f"{len(missing)} of {len(truth)} points lost, first {missing[:5]}"
    extra = [t for t in set(ts) - set(truth) if not killed_ms - 3000 <= t <= killed_ms]
    assert not extra, f"points in the store that no daemon sampled: {sorted(extra)[:5]}"
    during_outage = [t for t in ts if outage_ms <= t <= killed_ms]
    assert len(during_outage) >= int((killed_ms - outage_ms) / 1000) - 1 >= OUTAGE_S - 1


def scrape(port: int, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        assert r.status == 200
        return r.read().decode()


def store_row(d: DaemonProc, url: str) -> dict:
    return {s["url"]: s for s in d.status()["stores"]}[url]


def test_a_store_that_failed_to_open_is_retried(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    # The Prometheus port is busy when the daemon starts: the store is reported failed,
    # with why and that it will be retried; once the port is free, the next retry
    # (every [store] retry_s, here 1 s instead of 30) serves /metrics.
    retry_s = 1.0
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    url = f"prometheus://127.0.0.1:{port}"
    cfg = f'[daemon]\nsocket_group = ""\n[store]\nretry_s = {retry_s}\n'
    try:
        d = start_daemon(tmp_path, "--sim", "1", "--hz", "10", "--store", url, config=cfg)
        daemons.append(d)
        row = store_row(d, url)
        assert not row["ok"], row
        assert "cannot listen" in row["last_error"] and "retrying every 1 s" in row["last_error"], row
        # Still busy: every retry fails, and the store stays in the status.
        deadline = time.monotonic() + 10 * retry_s
        while store_row(d, url)["open_attempts"] < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        row = store_row(d, url)
        assert not row["ok"] and row["open_attempts"] >= 3, row
        assert 0 <= row["retry_in_s"] <= retry_s
        assert d.proc.poll() is None
    finally:
        holder.close()  # the port is free (a listener that accepted nothing leaves no TIME_WAIT)
    freed = time.monotonic()
    text = None
    while time.monotonic() - freed < retry_s + 3.0:  # one retry period, and slack for a loaded CI
        try:
            text = scrape(port, timeout=2.0)
            break
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.05)
    assert text is not None, f"/metrics not served {retry_s + 3.0} s after the port was freed:\n{d.log_text()}"
    waited = time.monotonic() - freed
    assert "greend_up 1.0" in text and "greend_gpu_energy_joules_total{" in text
    assert f'greend_store_up{{url="{url}"}} 1.0' in text
    row = store_row(d, url)
    assert row["ok"] and row["name"] == "prometheus" and "open_attempts" not in row, row
    assert f"store {url}: open after" in d.log_text()
    print(f"/metrics served {waited:.2f} s after the port was freed (retry_s = {retry_s})")


def test_a_live_daemon_scrape_passes_promtool_and_the_golden_names(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    # The golden file and promtool, on what a real daemon serves rather than a
    # hand-written status: simulated GPUs (one capped), a RAPL fixture tree, a job.
    from greend.ipc.client import Client
    from greend.ipc.server import encode
    from greend.probes.fake_sysfs import make_standard_tree
    from tests.stores.test_prometheus_store import GOLDEN, PROMTOOL, names_and_labels, value

    sysfs = tmp_path / "sys"
    make_standard_tree(sysfs)
    port = vmserver.free_port()
    # The test's own group may cap clocks (greenctl cap set is for admins).
    admin = grp.getgrgid(os.getgid()).gr_name
    cfg = f'[daemon]\nsocket_group = ""\nadmin_group = "{admin}"\n'
    d = start_daemon(
        tmp_path,
        "--sim",
        "2",
        "--hz",
        "20",
        "--sysfs-root",
        str(sysfs),
        "--store",
        f"prometheus://127.0.0.1:{port}",
        config=cfg,
    )
    daemons.append(d)
    d.ctl("cap", "set", "--gpu", "0", "--max-clock", "1500")
    job = "golden-run"
    with Client(d.socket) as c:
        c.request("register", job=job, gpus=[0, 1])
        assert c._sock is not None
        for i in range(20):  # steps get no reply
            now = time.monotonic()
            c._sock.sendall(
                encode({"v": 1, "op": "steps", "steps": [{"step": i, "t0_s": now - 0.01, "t1_s": now, "flops": 4e12}]})
            )
            time.sleep(0.02)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            st = d.status()
            jobs = {j["job"]: j for j in st["jobs"]}
            if (jobs.get(job, {}).get("gflops_per_w") or 0) > 0 and st["gpus"][0]["clock_cap_mhz"]:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"no GFLOPS/W for {job} or no cap on GPU 0: {st['jobs']} {st['gpus']}")
        text = scrape(port)  # while the job is registered
    assert value(text, "greend_job_gflops_per_watt", job=job) > 0
    assert value(text, "greend_job_flops_total", job=job) == 20 * 4e12
    assert value(text, "greend_gpu_clock_cap_hertz", gpu="0") == 1500e6
    got = names_and_labels(text)
    # The end time of a job exists once it ended; this job still runs.
    golden = [ln for ln in GOLDEN.read_text().splitlines() if not ln.startswith("greend_job_end_time_seconds")]
    assert {ln.split()[0] for ln in got} == {ln.split()[0] for ln in golden}
    assert got == golden, "names, types and label names as tests/golden/prometheus_names.txt"
    if PROMTOOL is None:
        pytest.skip("promtool is absent (apt-get install prometheus)")
    r = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr  # no lint warnings either
