"""deploy/slurm/epilog.sh against a real daemon on simulated GPUs: it waits for the job's
runs to end, saves each run's report on this node, and never fails (a failing Epilog
drains a Slurm node)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
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


# Registers a run under another user's Slurm job id and stays connected.
SQUAT = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
f = s.makefile("rb")
s.sendall(json.dumps({"v": 1, "op": "register", "job": sys.argv[2], "gpus": []}).encode() + b"\\n")
print(f.readline().decode().strip(), flush=True)
sys.stdin.read()
"""


def test_the_epilog_saves_only_the_job_owners_runs(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    from tests.e2e.test_e2e_shared_node import USER_PY, needs_root

    if needs_root.args[0]:
        pytest.skip(needs_root.kwargs["reason"])
    shared = Path(tempfile.mkdtemp(prefix="greend-shared-"))
    shared.chmod(0o755)
    cfg = '[daemon]\nsocket_group = ""\nsocket_mode = "0666"\n'
    # No Slurm controller here for greend to ask: the registration is accepted (and the
    # failure logged), so the Epilog's own filter is what keeps the run out.
    d = start_daemon(tmp_path, "--sim", "1", config=cfg, socket=shared / "g.sock")
    daemons.append(d)
    r = d.ctl("measure", "--job", "4243.0", "--gpus", "0", "--", sys.executable, "-c", "import time; time.sleep(0.3)")
    assert r.returncode == 0, r.stderr
    squat = subprocess.Popen(
        [str(USER_PY), "-c", SQUAT, str(d.socket), "4243.9"],
        user="nobody", env=env(), cwd="/", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert squat.stdout is not None and json.loads(squat.stdout.readline())["ok"]
        t0 = time.monotonic()
        r = epilog(d, tmp_path, SLURM_JOB_ID="4243", SLURM_JOB_UID="0")
        took_s = time.monotonic() - t0
    finally:
        squat.communicate(timeout=10)
        shutil.rmtree(shared, ignore_errors=True)
    assert r.returncode == 0, r.stderr
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    assert sorted(p.name for p in (tmp_path / "reports").iterdir()) == [f"4243.0.{host}.json"], r.stderr
    assert "run 4243.9 is uid 65534's, not the job owner's (uid 0): not saved" in r.stderr
    assert took_s < 8.0, f"the epilog waited on another user's run ({took_s:.1f} s; its limit is 10 s)"
