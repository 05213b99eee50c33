"""``greenctl measure -- CMD``: a command measured as a job with no code change."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support import DaemonProc, start_daemon

pytestmark = pytest.mark.e2e


def test_measure_runs_a_command_as_a_job_and_prints_its_report(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "--sim", "1", "--hz", "20")
    daemons.append(d)
    code = "import os, time; time.sleep(1.5); print('child', os.getpid()); raise SystemExit(3)"
    r = d.ctl("measure", "--job", "m1", "--", sys.executable, "-c", code, check=False)
    assert r.returncode == 3, r.stdout + r.stderr  # the command's own status
    out = r.stdout
    assert "child " in out  # the command's output passes through
    assert "job m1  [ended, command exited with 3]" in out
    assert "GPU energy (sim)" in out and "CO2" in out and "kWh" in out
    assert "GPUs 0 (every GPU of this node" in r.stderr
    assert "FLOPs unknown" in r.stderr
    rep = json.loads(d.ctl("report", "m1", "--json").stdout)
    assert rep["gpus"] == [0] and rep["duration_s"] >= 1.4
    assert rep["gpu_energy_j"] >= 0.95 * 70.0 * 1.4  # a simulated H100 idles at 70 W
    assert rep["gflops_per_w"] is None  # no FLOPs: no figure, not 0
    # The daemon itself knows the job for a measured command: windows, not steps; no
    # precision of its own, so none proposed; every view says so, none says fp32.
    assert rep["kind"] == "measure" and rep["measured_whole"] is True
    assert rep["steps"] is None and rep["windows"] >= 1 and rep["precision"] is None
    assert rep["top_precision"] is None and rep["proposed_precision"] is None
    text = d.ctl("report", "m1").stdout
    assert "no steps of its own" in text and "windows" in text and "fp32" not in text
    jobs = d.ctl("jobs").stdout
    m1 = next(line for line in jobs.splitlines() if line.startswith("m1"))
    assert "- (measure)" in m1 and "fp32" not in m1, jobs
    row = next(j for j in d.status()["jobs"] if j["job"] == "m1")
    assert row["kind"] == "measure" and row["steps"] is None and row["precision"] is None

    # With the FLOPs known: GFLOPS/W; --gpus picks the GPUs.
    r = d.ctl("measure", "--job", "m2", "--gpus", "0", "--flops", "1e12", "--json", "--", sys.executable, "-c", "pass")
    rep = json.loads(r.stdout)
    assert rep["job"] == "m2" and rep["flops"] == 1e12 and rep["gflops_per_w"] > 0


def test_measure_without_a_command_or_a_daemon_says_what_to_do(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from greend.cli.greenctl import ctl_app

    # No daemon: the command runs all the same, measured in-process, and says so.
    r = CliRunner().invoke(ctl_app, ["--socket", str(tmp_path / "none.sock"), "measure", "--", "false"])
    assert r.exit_code == 1 and "no greend socket" in r.output and "in this process" in r.output
    r = CliRunner().invoke(ctl_app, ["--socket", str(tmp_path / "none.sock"), "measure"])
    assert r.exit_code == 2 and "give the command after --" in r.output
    r = CliRunner().invoke(ctl_app, ["--socket", str(tmp_path / "none.sock"), "measure", "--gpus", "a,b", "--", "true"])
    assert r.exit_code == 2 and "--gpus" in r.output
