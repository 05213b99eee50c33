"""``greenctl demo`` end to end: the same training as it is and with greend's controller
on, the closing table with the saving, and what happens when it is stopped."""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from greend.cli.greenctl import ctl_app
from tests.support import REPO, env, wait_for

pytestmark = [pytest.mark.e2e]


@pytest.mark.slow
@pytest.mark.torch
def test_demo_runs_twice_and_ends_with_the_saving(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    keep = tmp_path / "demo"
    r = subprocess.run(
        # (200 steps: the step down to fp8, asked after some 30, runs after its trial, ~100 later)
        [sys.executable, "-m", "greend.ctl", "demo", "--seconds", "20", "--gpus", "sim", "--keep", str(keep)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
        env=env(),
    )
    # (How long the demo takes is the README's measured figure, not a timed assertion here:
    # a loaded machine runs it several times slower; the timeout above bounds a hang.)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "a simulated H100" in out
    # The closing table: both runs, every simulated figure labelled, and the saving.
    for row in ("time (s) (sim)", "GPU energy (J) (sim)", "GFLOPS/W (sim)", "final loss"):
        assert row in out, out
    assert "as it is" in out and "with greend" in out
    saved = [ln for ln in out.splitlines() if ln.startswith("saved (sim): ")]
    assert saved, out
    joules = float(saved[0].split()[2])
    assert joules > 0, saved
    # The job trains in bf16 on its own (most GPU training does): the controlled run took it
    # down to fp8 (emulated on the CPU, priced as fp8 on the simulated GPU), never above
    # bf16, and its own report's estimate is printed beside the two runs' comparison.
    assert "the same bf16 training" in out
    assert "switch: bf16 -> fp8-emulated" in out and "-> fp32" not in out and "fp32 ->" not in out
    assert "the job's own report (sim): " in out
    # The store has both jobs.
    for name, job in (("as-it-is", "demo-as-it-is"), ("with-greend", "demo-with-greend")):
        con = sqlite3.connect(keep / name / "state" / "greend.db")
        rows = con.execute("SELECT job, flops, gflops_per_w FROM greend_job").fetchall()
        con.close()
        assert [row[0] for row in rows] == [job] and rows[0][1] > 0
        assert not (keep / name / "greend.sock").exists(), "the demo's daemon was stopped"
    # GPU-sized steps: the simulated GPU was busy, not idling at 70 W.
    line = [ln for ln in out.splitlines() if ln.startswith("avg GPU power (W) (sim)")][0]
    assert float(line.split()[-2]) > 300


def test_demo_refuses_a_bad_length() -> None:
    for bad in ("-1", "0", "nan"):
        r = CliRunner().invoke(ctl_app, ["demo", "--seconds", bad])
        assert r.exit_code == 2, r.output
        assert "--seconds" in r.output and "Traceback" not in r.output


def test_demo_without_torch_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    r = CliRunner().invoke(ctl_app, ["demo", "--gpus", "sim"])
    assert r.exit_code == 2, r.output
    assert "pip install 'greend[train]'" in r.output
    assert "ModuleNotFoundError" not in r.output


@pytest.mark.slow
@pytest.mark.torch
def test_sigterm_stops_the_demo_its_daemon_and_removes_its_files() -> None:
    pytest.importorskip("torch")
    # The demo puts its daemons' sockets under $TMPDIR: a short one (a Unix socket's path
    # holds 107 bytes; pytest's tmp_path under xdist, pytest-of-root/pytest-NNN/popen-gwN/
    # and the test's name, made it 114, and the demo's daemon refused it).
    tmp = Path(tempfile.mkdtemp(prefix="gd-", dir="/tmp"))
    try:
        _sigterm_demo(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _sigterm_demo(tmp_path: Path) -> None:
    e = env()
    e["TMPDIR"] = str(tmp_path)
    p = subprocess.Popen(
        [sys.executable, "-m", "greend.ctl", "demo", "--seconds", "30", "--gpus", "sim"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=e,
    )
    try:
        assert wait_for(lambda: list(tmp_path.glob("greend-demo-*/as-it-is/greend.sock")), 60)
        from greend.ipc.client import Client

        (sock,) = tmp_path.glob("greend-demo-*/as-it-is/greend.sock")
        with Client(sock) as c:
            daemon_pid = c.request("status")["pid"]
        time.sleep(1.0)  # training
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 143, err
    assert "stopped by SIGTERM" in err and "reconnecting" not in err
    assert "Traceback" not in err

    def gone() -> bool:
        try:
            os.kill(daemon_pid, 0)
        except ProcessLookupError:
            return True
        return False

    assert wait_for(gone, 10), "the demo's daemon is still running"
    assert not list(tmp_path.glob("greend-demo-*")), "the demo's temp dir was left behind"
