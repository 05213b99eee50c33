"""deploy/slurm/epilog.sh against a real daemon on simulated GPUs: it waits for the job's
runs to end, saves each run's report on this node, and never fails (a failing Epilog
drains a Slurm node)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO, DaemonProc, env, start_daemon

pytestmark = [pytest.mark.e2e]
EPILOG = REPO / "deploy" / "slurm" / "epilog.sh"


def epilog(d: DaemonProc, tmp: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in env().items() if k != "SLURM_JOB_ID"} | {
        "GREENCTL": f"{sys.executable} -m greend.ctl --socket {d.socket}",
        "PYTHON": sys.executable,
        "GREEND_REPORT_DIR": str(tmp / "reports"),
        "GREEND_EPILOG_WAIT_S": "10",
        **extra,
    }
    return subprocess.run(["sh", str(EPILOG)], env=e, capture_output=True, text=True, timeout=60, cwd=REPO)


def test_the_epilog_saves_each_run_of_the_job_and_always_exits_0(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    assert os.access(EPILOG, os.X_OK)
    d = start_daemon(tmp_path, "--sim", "1", config='[daemon]\nsocket_group = ""\n')
    daemons.append(d)
    # Two srun steps of Slurm job 4242 and an unrelated job 42420 on this node.
    for run in ("4242.0", "4242.1", "42420"):
        r = d.ctl("measure", "--job", run, "--gpus", "0", "--", sys.executable, "-c", "import time; time.sleep(0.3)")
        assert r.returncode == 0, r.stderr
    r = epilog(d, tmp_path, SLURM_JOB_ID="4242")
    assert r.returncode == 0, r.stderr
    saved = sorted(p.name for p in (tmp_path / "reports").iterdir())
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    assert saved == [f"4242.0.{host}.json", f"4242.1.{host}.json"], (saved, r.stderr)
    rep = json.loads((tmp_path / "reports" / saved[0]).read_text())
    assert rep["job"] == "4242.0" and rep["state"] == "ended" and rep["gpu_energy_j"] > 0
    assert "saved to" in r.stderr

    # No SLURM_JOB_ID, or no daemon: it says so and still exits 0.
    r = epilog(d, tmp_path)
    assert r.returncode == 0 and "SLURM_JOB_ID is not set" in r.stderr
    d.stop()
    r = epilog(d, tmp_path, SLURM_JOB_ID="4242")
    assert r.returncode == 0 and "greend is not reachable" in r.stderr
