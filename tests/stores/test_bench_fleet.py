"""bench/bench_fleet.py runs against a real victoria-metrics and prints every column it
promises; the cluster report it times finds each job it asks for (its figures are
measurements, printed for people to read, not asserted)."""

from __future__ import annotations

import pytest

from tests import vmserver
from tests.support import load_bench

# A real victoria-metrics subprocess fed 12 simulated minutes for two fleet sizes: an
# end-to-end run of the benchmark, in the full suite (``slow``), not in the fast tests.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not vmserver.available(), reason="victoria-metrics is not installed"),
]


def test_prints_a_row_per_fleet_size(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("bench_fleet")
    assert bench.main(["--nodes", "2", "3", "--minutes", "12", "--reports", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["nodes", "points"])
    rows = [ln.split() for ln in lines[head + 1 : head + 3]]
    assert [r[0] for r in rows] == ["2", "3"]
    for r in rows:
        points, series, jobs = int(r[1]), int(r[4]), int(r[8])
        assert points > 2 * 720 * 20 and series > 0 and jobs >= 1  # 12 min of 20+ points a second a node
        assert "/" in r[9] and r[9] != "-/-"  # the report's p50/p99 were timed
