"""bench/bench_fleet_prometheus.py against a real Prometheus and bench/bench_fleet.py's
InfluxDB engine against a real influxd: each prints every column it promises, every node
is scraped or written, and the cluster report it times finds the jobs it asks for (the
figures are measurements printed for people to read; what is asserted is that they were
measured)."""

from __future__ import annotations

import shutil

import pytest

from tests.support import load_bench

# Each test starts a real server (Prometheus scraping for 16 s, influxd) as a subprocess: an
# end-to-end run of a benchmark, in the full suite (``slow``), not in the fast tests.
pytestmark = pytest.mark.slow


def _rows(out: str, first: list[str], n: int) -> list[list[str]]:
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.split()[:2] == first)
    return [ln.split() for ln in lines[head + 1 : head + 1 + n]]


@pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="the Prometheus server is absent (apt-get install prometheus)"
)
def test_prometheus_scrapes_every_node_within_the_series_bound(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("bench_fleet_prometheus")
    args = ["--nodes", "3", "--seconds", "16", "--scrape-interval", "1", "--reports", "3", "--job-seconds", "3", "5"]
    assert bench.main(args) == 0
    (r,) = _rows(capsys.readouterr().out, ["nodes", "up"], 1)
    nodes, up, series = int(r[0]), int(r[1]), int(r[2])
    assert nodes == 3 and up == 3
    # a node's fixed series, Prometheus' 5 per target, and the short jobs' series still in the head
    assert 3 * 106 <= series <= 3 * (bench.series_bound(8, 2, 3, 2) + 5 + 8 * 10)
    found, total = (int(x) for x in r[-2].split("/"))
    assert total >= 1 and found == total  # every ended job the report asked for was found
    assert r[-3] != "-/-"


@pytest.mark.skipif(shutil.which("influxd") is None, reason="InfluxDB is absent (apt-get install influxdb)")
def test_influxdb_engine_takes_the_line_protocol_and_finds_the_jobs(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("bench_fleet")
    assert bench.main(["--engine", "influxdb", "--nodes", "2", "--minutes", "12", "--reports", "3"]) == 0
    (r,) = _rows(capsys.readouterr().out, ["nodes", "points"], 1)
    points, series, jobs = int(r[1]), int(r[4]), int(r[8])
    assert points > 2 * 720 * 20 and series > 0 and jobs >= 1
    assert "/" in r[9] and r[9] != "-/-"  # the report's InfluxQL was timed and found each job
