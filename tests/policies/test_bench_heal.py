"""bench/bench_heal.py runs and prints a row per case and its summary (the figures are
measurements, printed for people to read; the bound itself is asserted in
tests/policies/test_pacing.py)."""

from __future__ import annotations

import re

import pytest

from tests.support import load_bench


def test_prints_a_row_per_case_and_the_summary(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("bench_heal")
    assert bench.main(["--nodes", "2", "--heals", "700", "--noise", "0", "--steps", "1100"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [ln for ln in lines if re.match(r"\s+2\s+\d+-\d+\s+0\.00\s", ln)]
    assert len(rows) == 1 and rows[0].split()[1] == "0-700", lines
    assert re.search(r"([+-]\d+\.\d\d%\s+){3}\d+\.\d%$", rows[0]), rows[0]
    summary = r"from the heal \+ 300 steps: worst [+-]\d+\.\d\d%, mean [+-]\d+\.\d\d%, over the bound: [01] of 1$"
    assert re.match(summary, lines[-4]), lines[-4]
    assert lines[-1].startswith("GPU energy saved against none:") and lines[-1].endswith("(sim)")


def test_a_heal_too_near_the_end_is_no_case(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("bench_heal")
    assert bench.main(["--nodes", "2", "--heals", "900", "--noise", "0", "--steps", "1100"]) == 1
    assert "no case" in capsys.readouterr().out


def test_a_measured_profile_runs_on_the_power_knob(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("bench_heal")
    argv = ["--nodes", "2", "--heals", "700", "--noise", "0", "--steps", "1100", "--profile", "A40+resnet50+gpu0"]
    assert bench.main(argv) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if re.match(r"\s+2\s+0-700\s+0\.00\s", ln)]
    assert len(rows) == 1, rows
