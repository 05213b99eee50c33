"""bench/bench_nodes.py runs and prints a row per case and its summary (the figures are
measurements, printed for people to read; the bound itself is asserted in
tests/policies/test_pacing.py)."""

from __future__ import annotations

import re

import pytest

from tests.support import load_bench


def test_prints_a_row_per_case_and_the_summary(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("bench_nodes")
    assert bench.main(["--cases", "3", "--steps", "450"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [ln for ln in lines if re.match(r"\s+\d+\s+[234]\s+\[", ln)]
    assert [int(r.split()[0]) for r in rows] == [0, 1, 2], lines
    for r in rows:
        assert re.search(r"[+-]\d+\.\d\d%\s+[+-]\d+\.\d\d%\s+-?\d+\.\d%", r), r
    assert re.search(r"over it by over 1 point: \d of 3$", lines[-1]), lines[-1]
