"""/metrics holds a bounded number of series whatever a node's job history: a job's series
while it runs and for a grace after it ends, never the daemon's whole list of ended jobs."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from greend.daemon.core import Daemon
from greend.ipc.client import Client
from greend.stores.prometheus import (
    JOB_GRACE_S,
    MAX_JOBS_EXPORTED,
    SERIES_PER_GPU,
    SERIES_PER_JOB,
    exported_jobs,
    series_bound,
)
from tests.daemon.test_daemon import make_config
from tests.support import wait_for


def series(text: str) -> list[str]:
    """The sample lines of an exposition: one per series."""
    return [ln for ln in text.splitlines() if ln and not ln.startswith("#")]


def test_running_jobs_first_then_the_latest_ended_within_the_grace() -> None:
    now = 10_000.0
    jobs = [
        {"job": "old", "ended_at": now - JOB_GRACE_S - 1},
        {"job": "just-ended", "ended_at": now - 5},
        {"job": "running"},
        {"job": "ended-a-minute-ago", "ended_at": now - 60},
        "not a job",
    ]
    shown, left_out = exported_jobs(jobs, now)
    assert [j["job"] for j in shown] == ["running", "just-ended", "ended-a-minute-ago"] and left_out == 0
    shown, left_out = exported_jobs(jobs, now, max_jobs=2)
    assert [j["job"] for j in shown] == ["running", "just-ended"] and left_out == 1
    assert exported_jobs(jobs, now + JOB_GRACE_S)[0] == [{"job": "running"}]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Daemon]:
    """An in-process daemon on 2 simulated GPUs serving /metrics, ticking in a thread."""
    cfg = make_config(tmp_path, hz=20.0, sim_gpus=2)
    cfg.store.urls.append("prometheus://127.0.0.1:0")
    d = Daemon(cfg)
    d.start()
    t = threading.Thread(target=d.run, daemon=True)
    t.start()
    try:
        yield d
    finally:
        d.stop()
        t.join(10)


def scrape(d: Daemon) -> str:
    listen = next(s["listen"] for s in d.status()["stores"] if s.get("name") == "prometheus")
    with urllib.request.urlopen(listen, timeout=5) as r:
        return r.read().decode()


def test_a_node_that_has_run_more_jobs_than_it_keeps_exports_no_more_series_than_the_bound(node: Daemon) -> None:
    """A job history longer than the daemon keeps (keep_ended, 200 ended jobs) and far
    longer than /metrics shows: 100 jobs past the daemon's own bound take every path that
    1000 would (each beyond it is dropped the same way), in a quarter of the time."""
    sock = node.cfg.daemon.socket
    assert wait_for(lambda: node.ledger.last_time("gpu1") is not None, 5)
    for i in range(node.jobs.keep_ended + 100):
        with Client(sock) as c:
            c.request("register", job=f"job-{i}", gpus=[i % 2])
            c.request("end", reason="finished")

    def all_ended() -> bool:
        return all(j["state"] == "ended" for j in node.status()["jobs"])

    assert wait_for(all_ended, 10)  # the daemon books each end at its next tick
    running = [Client(sock) for _ in range(2)]  # two jobs still running at the scrape
    try:
        for k, c in enumerate(running):
            c.request("register", job=f"live-{k}", gpus=[k])
        st = node.status()
        assert len(st["jobs"]) > MAX_JOBS_EXPORTED  # the daemon keeps far more ended jobs than /metrics shows
        text = scrape(node)
        lines = series(text)
        zones, probes, stores = len(st["cpus"]), len(st["probes"]), len(st["stores"])
        bound = series_bound(len(st["gpus"]), zones, probes, stores)
        assert len(lines) <= bound, (len(lines), bound)
        jobs_shown = {m for ln in lines for m in re.findall(r'job="([^"]+)"', ln)}
        assert {"live-0", "live-1"} <= jobs_shown and len(jobs_shown) == MAX_JOBS_EXPORTED
        left_out = float(next(ln for ln in lines if ln.startswith("greend_jobs_not_exported")).split()[-1])
        assert left_out == len(st["jobs"]) - MAX_JOBS_EXPORTED  # every job the daemon lists ended within the grace
        assert sum(ln.startswith("greend_gpu_") for ln in lines) <= SERIES_PER_GPU * 2
        # Past the grace only the running jobs' series are left.
        node_collector = next(s for s in node.stores.opened if s.name == "prometheus").collector
        node_collector.clock = lambda: time.time() + JOB_GRACE_S + 1
        later = series(scrape(node))
        assert {m for ln in later for m in re.findall(r'job="([^"]+)"', ln)} == {"live-0", "live-1"}
        assert sum('job="' in ln for ln in later) <= SERIES_PER_JOB * 2
    finally:
        for c in running:
            c.close()
