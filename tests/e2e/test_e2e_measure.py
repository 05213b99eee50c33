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
    # A large run's whole count, over a step entry's limit (1e21): reported all the same.
    r = d.ctl(
        "measure", "--job", "m3", "--gpus", "0", "--flops", "3.5e24", "--json", "--", sys.executable, "-c", "pass"
    )
    rep = json.loads(r.stdout)
    assert rep["job"] == "m3" and rep["flops"] == pytest.approx(3.5e24) and rep["gflops_per_w"] > 0
    r = d.ctl("measure", "--job", "m4", "--flops", "nan", "--", sys.executable, "-c", "pass", check=False)
    assert r.returncode == 2 and "--flops nan" in r.stderr and "Traceback" not in r.stderr


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


# A real daemon as one from before job kinds: its register takes no "kind" (an unknown
# field is refused as bad_request naming it, as every daemon refuses unknown fields).
OLDER_DAEMON = """
from greend import protocol
del protocol.SCHEMAS["register"]["kind"]
from greend.cli.greend_cmd import daemon_main
daemon_main()
"""


def test_measure_registers_again_without_kind_at_an_older_daemon(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    """An older daemon refuses register's ``kind``: greenctl measure registers again
    without it, the command runs and is measured, and its report still says windows,
    not steps, and no precision (the older daemon books the job as training at fp32)."""
    import subprocess

    from greend.testing.daemon_proc import daemon_command
    from tests.support import REPO, env, wait_for_socket

    cfg, sock, state, log = tmp_path / "d.toml", tmp_path / "d.sock", tmp_path / "state", tmp_path / "d.log"
    cfg.write_text('[daemon]\nsocket_group = ""\n')
    args = daemon_command(cfg, sock, state, "--sim", "1", "--hz", "20")
    args = [args[0], "-P", "-c", OLDER_DAEMON, *args[4:]]  # python -P -c OLDER_DAEMON run ...
    with open(log, "ab") as fh:
        proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env=env())
    d = DaemonProc(proc, sock, state, state / "greend.db", log, args)
    daemons.append(d)
    wait_for_socket(d)
    from greend.errors import RequestRefused
    from greend.ipc.client import Client

    with Client(sock) as c, pytest.raises(RequestRefused) as refused:  # what greenctl meets first
        c.request("register", job="probe", gpus=[0], kind="measure")
    assert refused.value.code == "bad_request" and refused.value.field == "kind"

    code = "import time; time.sleep(1.0); print('child ran'); raise SystemExit(4)"
    r = d.ctl("measure", "--job", "old1", "--", sys.executable, "-c", code, check=False)
    assert r.returncode == 4, r.stdout + r.stderr  # the command ran, its own status
    assert "child ran" in r.stdout
    assert "job old1  [ended, command exited with 4]" in r.stdout
    text = r.stdout
    assert "no steps of its own" in text and "windows" in text and "fp32" not in text, text
    row = next(j for j in d.status()["jobs"] if j["job"] == "old1")
    assert row["precision"] == "fp32" and row.get("kind") in (None, "training")  # booked as the older daemon does
    rep = json.loads(d.ctl("measure", "--job", "old2", "--json", "--", sys.executable, "-c", "pass").stdout)
    assert rep["job"] == "old2" and rep["measured_whole"] is True and rep["steps"] is None
    assert rep["windows"] >= 1 and rep["precision"] is None and rep["gpu_energy_j"] > 0


def test_a_job_the_daemon_would_refuse_is_refused_before_the_command_runs(
    tmp_path: Path, daemons: list[DaemonProc]
) -> None:
    """A bad --job or --gpus was found only once the command had run to its end (hours,
    unmeasured). Now nothing runs: the error names the option and the fix."""
    d = start_daemon(tmp_path, "--sim", "1", "--hz", "20")
    daemons.append(d)
    marker = tmp_path / "ran"
    cmd = ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    r = d.ctl("measure", "--job", "my run", *cmd, check=False)
    assert r.returncode == 2 and "--job 'my run'" in r.stderr and "no spaces" in r.stderr
    r = d.ctl("measure", "--gpus", "7", *cmd, check=False)
    assert r.returncode == 2 and "GPU 7 not on this node (it has 0)" in r.stderr
    assert not marker.exists()
    assert d.ctl("measure", "--job", "ok-run", "--gpus", "0", *cmd).returncode == 0 and marker.exists()
