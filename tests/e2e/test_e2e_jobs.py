"""Jobs end to end: a real daemon subprocess, real torch training processes, real sockets."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from greend.ipc.client import Client
from tests.support import REPO, DaemonProc, env, start_daemon, wait_for, wait_ready

pytestmark = [pytest.mark.e2e, pytest.mark.torch]
torch = pytest.importorskip("torch")

TRAINER = REPO / "tests" / "scripts" / "trainer.py"


def trainer(sock: Path, job: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(TRAINER), "--socket", str(sock), "--job", job, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env(),
    )


def finish(p: subprocess.Popen[str], timeout: float = 120) -> dict[str, Any]:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def wait_ended(d: DaemonProc, job: str, timeout: float = 15) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    with Client(d.socket) as c:
        while time.monotonic() < deadline:
            r = c.request("report", job=job)
            if r["state"] == "ended":
                return r
            time.sleep(0.05)
    raise AssertionError(f"job {job} did not end: {r}")


def ledger_energy(d: DaemonProc, gpu: int, t0: float, t1: float) -> float:
    with Client(d.socket) as c:
        return c.request("energy", key=f"gpu{gpu}", t0_s=t0, t1_s=t1)["energy_j"]


A_STEPS = "140"  # job-a's steps


@pytest.mark.slow
def test_two_concurrent_jobs_are_accounted_apart(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "--sim", "2", "--hz", "20")
    daemons.append(d)
    # job-a runs about 3 s: its report's --plot needs the once-a-second efficiency samples.
    a = trainer(d.socket, "job-a", "--gpu", "0", "--steps", A_STEPS, "--width", "512", "--step-sleep", "0.02")
    b = trainer(d.socket, "job-b", "--gpu", "1", "--steps", "40", "--width", "128", "--step-sleep", "0.02")
    ra, rb = finish(a), finish(b)
    rep_a, rep_b = wait_ended(d, "job-a"), wait_ended(d, "job-b")

    # FLOPs: what the daemon reports is FlopCounterMode's count for each model.
    assert rep_a["flops"] == ra["flops_per_step"] * int(A_STEPS)
    assert rep_b["flops"] == rb["flops_per_step"] * 40
    assert rep_a["steps"] == int(A_STEPS) and rep_b["steps"] == 40
    assert rep_a["gpus"] == [0] and rep_b["gpus"] == [1]

    for rep, gpu in ((rep_a, 0), (rep_b, 1)):
        w = rep["window"]
        joules = ledger_energy(d, gpu, w["t0_s"], w["t1_s"])
        # The job's GPU energy is the ledger's over exactly its window, and GFLOPS/W is
        # FLOPs over those joules.
        assert rep["gpu_energy_j"] == pytest.approx(joules, rel=1e-9)
        assert rep["gflops_per_w"] == pytest.approx(rep["flops"] / joules / 1e9, rel=1e-9)
        # Sanity of the simulated figure: at least idle power over the window (sim).
        assert joules >= 0.95 * 70.0 * (w["t1_s"] - w["t0_s"])
        assert rep["gpu_source"] == "sim"
        assert rep["end_reason"] == "finished"
        # Per GPU (one each here) and per step: the same joules, split.
        assert [g["gpu"] for g in rep["per_gpu"]] == [gpu]
        assert rep["per_gpu"][0]["energy_j"] == pytest.approx(joules, rel=1e-9)
        assert rep["per_gpu"][0]["flops"] == pytest.approx(rep["flops"], rel=1e-12)
        assert rep["gpu_energy_per_step_j"] == pytest.approx(joules / rep["steps"], rel=1e-9)
        # The sliding window ends where the job did, and holds its last steps' FLOPs.
        assert rep["recent"]["flops"] > 0 and rep["recent"]["window_s"] <= 10.0 + 1e-9
    # Apart: gpu1 burnt real energy during job-a's window too (idle at least), and none
    # of it is in job-a's figure, which equals gpu0's alone (checked above).
    other = ledger_energy(d, 1, rep_a["window"]["t0_s"], rep_a["window"]["t1_s"])
    assert other > 0.5 * rep_a["gpu_energy_j"]
    assert rep_a["gpu_energy_j"] + other > 1.4 * rep_a["gpu_energy_j"]
    assert rep_a["sim_energy_j"] > rep_b["sim_energy_j"]  # the bigger model ran more FLOPs

    # greenctl shows both, readable and as JSON.
    jobs = json.loads(d.ctl("jobs", "--json").stdout)["jobs"]
    assert {j["job"] for j in jobs} == {"job-a", "job-b"}
    text = d.ctl("report", "job-a").stdout
    assert "GFLOPS/W (sim)" in text and "kWh" in text and "CO2" in text and "per step" in text
    rep_json = json.loads(d.ctl("report", "job-a", "--json").stdout)
    for key in (
        "job",
        "steps",
        "flops",
        "duration_s",
        "gpu_energy_j",
        "cpu_energy_j",
        "energy_j",
        "gflops_per_w",
        "avg_power_w",
        "precision",
    ):
        assert key in rep_json
    pytest.importorskip("matplotlib")
    png = tmp_path / "a.png"
    d.ctl("report", "job-a", "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The job summaries are kept in the store.
    d.stop()
    import sqlite3

    con = sqlite3.connect(d.db)
    rows = dict(con.execute("SELECT job, flops FROM greend_job").fetchall())
    # Job rows per rank per store interval, not per step (no greend_job_step by default).
    steps, flops, rows_a = con.execute(
        "SELECT SUM(steps), SUM(flops), COUNT(*) FROM greend_job_steps WHERE job = 'job-a'"
    ).fetchone()
    tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    con.close()
    assert rows == {"job-a": rep_a["flops"], "job-b": rep_b["flops"]}
    assert steps == int(A_STEPS) and flops == pytest.approx(rep_a["flops"]) and rows_a < int(A_STEPS)
    assert "greend_job_step" not in tables


@pytest.mark.slow
def test_training_survives_the_daemon_being_killed(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    plain = finish(trainer(tmp_path / "none.sock", "plain", "--steps", "80", "--no-greend"))
    d = start_daemon(tmp_path, "--sim", "1")
    daemons.append(d)
    ready = tmp_path / "ready"
    p = trainer(d.socket, "victim", "--steps", "80", "--step-sleep", "0.02", "--ready-file", str(ready))
    wait_ready(ready)
    time.sleep(0.5)
    d.stop(signal.SIGKILL)
    r = finish(p)
    assert r["final_loss"] == plain["final_loss"]  # bitwise: greend changed nothing


def test_killed_client_ends_its_job(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "--sim", "1")
    daemons.append(d)
    ready = tmp_path / "ready"
    p = trainer(d.socket, "doomed", "--steps", "100000", "--step-sleep", "0.01", "--ready-file", str(ready))
    wait_ready(ready)

    def booked() -> bool:  # steps and their energy have reached the daemon
        rep = json.loads(d.ctl("report", "doomed", "--json", check=False).stdout or "{}")
        return rep.get("steps", 0) > 0 and rep.get("gpu_energy_j", 0) > 0

    assert wait_for(booked, 20)
    p.kill()
    p.wait(10)
    rep = wait_ended(d, "doomed")
    assert rep["end_reason"] == "client disconnected"
    assert rep["steps"] > 0 and rep["gpu_energy_j"] > 0


def test_the_report_says_how_the_cpu_energy_was_had(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    """RAPL (the job's share of it), the host probe's estimate, or nothing: a 0 J that
    nothing measured is called unmeasured, never passed off as a figure."""
    from greend.probes.fake_sysfs import FakePowercap

    sys_root = tmp_path / "sys"
    FakePowercap(sys_root).add_package(0, dram=True)
    no_rapl = str(tmp_path / "no-sys")
    cases = {
        "rapl": ("--sysfs-root", str(sys_root)),
        "estimate": ("--sysfs-root", no_rapl),
        "none": ("--sysfs-root", no_rapl),
    }
    procs = {}
    for name, extra in cases.items():
        cfg = '[daemon]\nsocket_group = ""\n' + ("[probes]\ncpu_tdp_w = 100\n" if name == "estimate" else "")
        d = start_daemon(tmp_path, "--sim", "1", *extra, name=name, config=cfg)
        daemons.append(d)
        procs[name] = (d, trainer(d.socket, f"cpu-{name}", "--steps", "60", "--step-sleep", "0.01"))
    reps = {}
    for name, (d, p) in procs.items():
        finish(p)
        reps[name] = wait_ended(d, f"cpu-{name}")
        reps[name]["text"] = d.ctl("report", f"cpu-{name}").stdout
    # The fake package ticks only when the test advances it: 0 J, but measured (RAPL).
    assert reps["rapl"]["cpu_energy_method"] == "process_share"
    assert reps["estimate"]["cpu_energy_method"] == "process_share, estimate"
    # 100 W TDP: the node's estimate over the job, and the job's share of it. The job
    # lasts under a second: its CPU time comes from its registration and its end, and
    # the node's estimate is interpolated between the host probe's once-a-second
    # readings (which may all fall outside the job), not booked as jumps.
    est = reps["estimate"]
    assert est["node_cpu_energy_j"] > 0 and 0 < est["cpu_energy_j"] <= est["node_cpu_energy_j"], est
    assert reps["none"]["cpu_energy_method"] == "unmeasured" and reps["none"]["cpu_energy_j"] == 0.0
    assert reps["none"]["gflops_per_w_with_cpu"] is None and reps["none"]["gflops_per_w"] > 0
    assert "CPU energy       not measured" in reps["none"]["text"]
    assert "(with CPU: n/a, CPU not measured)" in reps["none"]["text"] and "(GPU only)" in reps["none"]["text"]
    assert "estimate)" in reps["estimate"]["text"] and "not measured" not in reps["estimate"]["text"]


def test_interval_rows_sum_to_the_per_step_rows(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    """With [store] step_detail on, both kinds of rows are written: the per-interval ones
    hold the same steps, FLOPs, step time and simulated energy as the per-step ones."""
    d = start_daemon(tmp_path, "--sim", "1", config='[daemon]\nsocket_group = ""\n[store]\nstep_detail = true\n')
    daemons.append(d)
    finish(trainer(d.socket, "both", "--gpu", "0", "--steps", "80", "--step-sleep", "0.02"))
    wait_ended(d, "both")
    d.stop()
    import sqlite3

    con = sqlite3.connect(d.db)
    per_step = con.execute(
        "SELECT COUNT(*), SUM(flops), SUM(duration_s), SUM(sim_energy_j), MIN(loss), MAX(loss) "
        "FROM greend_job_step WHERE job = 'both'"
    ).fetchone()
    per_interval = con.execute(
        "SELECT SUM(steps), SUM(flops), SUM(duration_s), SUM(sim_energy_j), MIN(loss_min), MAX(loss_max), COUNT(*) "
        "FROM greend_job_steps WHERE job = 'both'"
    ).fetchone()
    con.close()
    assert per_step[0] == per_interval[0] == 80
    for a, b in zip(per_step[1:], per_interval[1:6]):
        assert b == pytest.approx(a, rel=1e-3)
    assert 1 <= per_interval[6] < 80  # rows per interval (1 s), not per step
