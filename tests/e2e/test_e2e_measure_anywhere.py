"""``greenctl measure`` runs the command in every case (no daemon: measured in-process
from NVML and RAPL, here the real pynvml on the NVML stand-in and the powercap fixture),
labels a measured command honestly (no steps, no precision of its own), and logs
readings as CSV or JSON lines at an interval, as ``greenctl status`` does."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.nvml_stub import stub_env
from tests.support import REPO, DaemonProc, start_daemon

pytestmark = pytest.mark.e2e

FIXTURE_SYS = REPO / "tests" / "fixtures" / "sys"


def _ctl(*args: str, env: dict[str, str] | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "greend.ctl", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=120
    )


def test_measure_with_no_daemon_runs_the_command_and_reports_from_the_probes(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    code = (
        f"import pathlib, time; time.sleep(1.0); pathlib.Path({str(marker)!r}).write_text('yes'); raise SystemExit(3)"
    )
    log = tmp_path / "m.csv"
    r = _ctl(
        "--socket", str(tmp_path / "none.sock"),
        "measure", "--job", "solo", "--json", "--interval", "0.2", "--output", str(log),
        "--sysfs-root", str(FIXTURE_SYS), "--gpus", "0,1",
        "--", sys.executable, "-c", code,
        env=stub_env(gpus=4),
    )  # fmt: skip
    assert r.returncode == 3, r.stderr  # the command's own status
    assert marker.read_text() == "yes"  # it ran
    assert "no greend socket" in r.stderr and "measured in this process from the probes" in r.stderr
    rep = json.loads(r.stdout)
    assert rep["measured_by"] == "greenctl measure, in-process (no daemon)"
    assert rep["gpus"] == [0, 1] and rep["gpu_source"] == "nvml"  # the real pynvml, on the stand-in
    assert rep["gpu_energy_j"] > 0 and rep["duration_s"] >= 0.9
    assert rep["cpu_source"] == "rapl"
    assert rep["steps"] is None and rep["precision"] is None  # a command has neither
    with open(log) as fh:
        rows = list(csv.DictReader(fh))
    gpu_rows = [x for x in rows if x["device"].startswith("gpu")]
    assert {x["device"] for x in gpu_rows} == {"gpu0", "gpu1"}  # --gpus: those only
    assert len(gpu_rows) >= 2 * 5  # a reading every 0.2 s over 1 s, both GPUs
    energies = [float(x["energy_j"]) for x in gpu_rows if x["device"] == "gpu0"]
    assert energies == sorted(energies) and energies[-1] > energies[0]
    assert log.read_text().count("time_unix_s") == 1  # one header


def test_measure_with_no_energy_source_still_runs_and_says_so(tmp_path: Path) -> None:
    env = stub_env(init_error=9)  # NVML's driver not loaded
    r = _ctl(
        "--socket", str(tmp_path / "none.sock"), "measure", "--sysfs-root", str(tmp_path),
        "--", sys.executable, "-c", "print('hello')",
        env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "hello" in r.stdout
    assert "no nvml:" in r.stderr and "no rapl:" in r.stderr
    assert "no energy source here: the command ran and its time is reported" in r.stderr


def test_measure_through_the_daemon_is_labelled_as_a_command(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "--sim", "1", "--hz", "20")
    daemons.append(d)
    log = tmp_path / "m.jsonl"
    r = d.ctl(
        "measure", "--job", "cmd1", "--interval", "0.2", "--output", str(log), "--format", "json",
        "--", sys.executable, "-c", "import time; time.sleep(1)",
    )  # fmt: skip
    assert "steps            - (a command measured whole" in r.stdout
    assert "precision        - (the command's own" in r.stdout
    assert "fp32" not in r.stdout
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(lines) >= 4 and all(x["device"] == "gpu0" and x["source"] == "sim" for x in lines)


def test_status_logs_rows_at_an_interval(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "--sim", "2")
    daemons.append(d)
    out = tmp_path / "status.csv"
    d.ctl("status", "--format", "csv", "--interval", "0.2", "--count", "3", "--output", str(out))
    d.ctl("status", "--format", "csv", "--interval", "0.2", "--count", "2", "--output", str(out))  # appends
    with open(out) as fh:
        rows = list(csv.DictReader(fh))
    assert [x["device"] for x in rows] == ["gpu0", "gpu1"] * 5
    assert all(float(x["power_w"]) > 0 and x["source"] == "sim" for x in rows)
    one = d.ctl("status", "--format", "json").stdout.splitlines()
    assert [json.loads(x)["device"] for x in one] == ["gpu0", "gpu1"]
    bad = d.ctl("status", "--count", "2", check=False)
    assert bad.returncode == 2 and "with --interval" in bad.stderr
