"""greenctl profile record end to end: a real daemon on a simulated H100, a real training
process, a power-limit sweep driven from the control loop, a profile that --sim-trace
replays, and the original limit back afterwards (figures: source=sim)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from greend.ipc.client import Client
from greend.probes.sim import H100
from greend.probes.trace import load_trace, trace_spec
from tests.support import REPO, DaemonProc, env, start_daemon

pytestmark = [pytest.mark.e2e, pytest.mark.torch]
pytest.importorskip("torch")

TRAINER = REPO / "tests" / "scripts" / "trainer.py"
CONFIG = '[daemon]\nsocket_group = ""\n[policy]\nperiod_s = 0.2\nsettle_s = 0.1\n'
MEM_SHARE = 0.3  # what tests/scripts/trainer.py registers


def trainer(sock: Path, job: str, steps: int = 4000) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(TRAINER), "--socket", str(sock), "--job", job, "--steps", str(steps)]
        + ["--width", "64", "--step-sleep", "0.01"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env(),
    )


def wait_steps(d: DaemonProc, job: str, n: int = 5, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    with Client(d.socket) as c:
        while time.monotonic() < deadline:
            try:
                if c.request("report", job=job)["steps"] >= n:
                    return
            except Exception:
                pass
            time.sleep(0.1)
    raise AssertionError(f"job {job} reported no steps:\n{d.log_text()}")


def gpu0(d: DaemonProc) -> dict:
    return next(g for g in d.status()["gpus"] if g["index"] == 0)


def sim_limit_w(d: DaemonProc) -> float:
    sim_dir = Path(d.args[d.args.index("--sim-dir") + 1])
    return json.loads((sim_dir / "gpu0.json").read_text())["power_limit_mw"] / 1000.0


def record_from(d: DaemonProc, top_w: int, out: str) -> subprocess.Popen[str]:
    """A long ``greenctl profile record`` from ``top_w`` down, running once the GPU is there."""
    rec = subprocess.Popen(
        [sys.executable, "-m", "greend.ctl", "--socket", str(d.socket), "profile", "record"]
        + ["--gpu", "0", "--job", "j", "--from", str(top_w), "--steps-per-limit", "100000", "--out", out],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env(),
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and sim_limit_w(d) != float(top_w):
        time.sleep(0.05)
    assert sim_limit_w(d) == float(top_w)
    return rec


def stop(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


@pytest.mark.slow
def test_record_a_profile_that_sim_trace_replays(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    sim_dir = tmp_path / "sim"
    d = start_daemon(tmp_path, "--sim", "1", "--sim-dir", str(sim_dir), "--hz", "20", config=CONFIG)
    daemons.append(d)
    job = trainer(d.socket, "prof")
    try:
        wait_steps(d, "prof")
        out = tmp_path / "prof.csv"
        r = d.ctl(
            "profile",
            "record",
            "--gpu",
            "0",
            "--job",
            "prof",
            "--from",
            "700",
            "--to",
            "200",
            "--step",
            "100",
            "--steps-per-limit",
            "6",
            "--out",
            str(out),
            timeout=180,
        )
        assert "done" in r.stdout and f"wrote {out}" in r.stdout, r.stdout
        # The original limit is back, on the device and in the controller (nothing held).
        assert json.loads((sim_dir / "gpu0.json").read_text())["power_limit_mw"] == 700_000
        show = json.loads(d.ctl("policy", "show", "--json").stdout)
        assert not show["owners"], show["owners"]
        # The job's report shows the sweep's limits as cap changes.
        with Client(d.socket) as c:
            rep = c.request("report", job="prof")
        assert "profile recording" in json.dumps(rep)
    finally:
        stop(job)

    # The file is greend's trace format, and its curve is the sim's (source=sim).
    text = out.read_text()
    assert text.startswith("# name: prof+gpu0\n") and "power_limit_w,step_time_s,avg_power_w" in text
    prof = load_trace(out)
    assert prof.limits_w == (200.0, 300.0, 400.0, 500.0, 600.0, 700.0)
    flops = 1e12  # the ratios do not depend on the step's FLOPs
    base = H100.step_cost(flops, MEM_SHARE)
    for w in prof.limits_w:
        want = H100.step_cost(flops, MEM_SHARE, power_limit_w=w)
        assert prof.time_ratio(w) == pytest.approx(want.duration_s / base.duration_s, rel=1e-4), w
        assert prof.energy_ratio(w) == pytest.approx(want.energy_j / base.energy_j, rel=1e-4), w
    # ... so it has the measured shape: flat at the top, steep at the bottom, U-shaped energy.
    assert prof.time_ratio(500) < 1.10 and prof.time_ratio(200) > 2.0
    best = min(prof.limits_w, key=prof.energy_ratio)
    assert prof.min_w < best < prof.max_w

    # --sim-trace loads it: a simulated fleet that follows the recorded curve.
    spec = trace_spec(out)
    assert (spec.power_limit_min_w, spec.power_limit_max_w) == (200.0, 700.0)
    replay = start_daemon(tmp_path, "--sim", "1", "--sim-trace", str(out), "--hz", "20", name="replay", config=CONFIG)
    daemons.append(replay)
    assert "(simulated, trace prof+gpu0)" in gpu0(replay)["name"]
    assert (replay.state_dir / "sim" / "trace.csv").read_text() == text


@pytest.mark.slow
def test_refusals_and_restores(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "--sim", "2", "--sim-dir", str(tmp_path / "sim"), "--hz", "20", config=CONFIG)
    daemons.append(d)
    job = trainer(d.socket, "j")
    try:
        wait_steps(d, "j")
        out = str(tmp_path / "p.csv")
        # Not on the job's GPU; limits outside the range; a policy that moves limits.
        r = d.ctl("profile", "record", "--gpu", "1", "--job", "j", "--out", out, check=False)
        assert (
            r.returncode == 2 and "does not run on GPU 1" in r.stderr and "[refused]" in r.stderr
        )  # (docs/protocol.md)
        r = d.ctl("profile", "record", "--gpu", "0", "--job", "j", "--to", "100", "--out", out, check=False)
        assert r.returncode == 2 and "outside GPU 0's range 200-700 W" in r.stderr
        d.ctl("policy", "set", "static", "--param", "clock_cap_mhz=1500")
        r = d.ctl("profile", "record", "--gpu", "0", "--job", "j", "--out", out, check=False)
        assert r.returncode == 2 and "policy 'static' is active" in r.stderr and "[refused]" in r.stderr
        d.ctl("policy", "set", "none")
        # An admin's cap on the GPU: refused (its limit would not come back as the admin set it).
        d.ctl("cap", "set", "--gpu", "0", "--power-limit", "650")
        r = d.ctl("profile", "record", "--gpu", "0", "--job", "j", "--out", out, check=False)
        assert r.returncode == 2 and "settings in force" in r.stderr
        d.ctl("cap", "reset", "--gpu", "0")

        # Aborted from another greenctl: the limit goes back, exit 1, no complete profile.
        rec = record_from(d, 600, out)
        # While it runs: no policy, no cap on that GPU.
        r = d.ctl("policy", "set", "efficient", check=False)
        assert r.returncode == 2 and "profile recording runs" in r.stderr
        r = d.ctl("cap", "set", "--gpu", "0", "--power-limit", "500", check=False)
        assert r.returncode == 2 and "profile recording" in r.stderr
        st = json.loads(d.ctl("profile", "status", "--json").stdout)
        assert st["state"] == "running" and st["current_limit_w"] == 600.0 and st["original_w"] == 700.0
        d.ctl("profile", "abort")
        so, se = rec.communicate(timeout=30)
        assert rec.returncode == 1 and "aborted" in so and "not written" in se, (so, se)
        assert sim_limit_w(d) == 700.0

        # The job ends mid-sweep: the limit goes back.
        rec = record_from(d, 550, out)
        stop(job)
        so, se = rec.communicate(timeout=60)
        assert rec.returncode == 1 and "job j ended" in so, (so, se)
        assert sim_limit_w(d) == 700.0
    finally:
        stop(job)


@pytest.mark.slow
def test_the_daemon_stopping_restores_the_limit(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "--sim", "1", "--sim-dir", str(tmp_path / "sim"), "--hz", "20", config=CONFIG)
    daemons.append(d)
    job = trainer(d.socket, "k")
    try:
        wait_steps(d, "k")
        with Client(d.socket) as c:
            st = c.request("profile", action="start", gpu=0, job="k", from_w=450.0, steps_per_limit=100000)
        assert st["state"] == "running" and st["limits_w"][0] == 450.0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sim_limit_w(d) != 450.0:
            time.sleep(0.05)
        assert sim_limit_w(d) == 450.0
        assert d.stop() == 0
        assert sim_limit_w(d) == 700.0
        assert "profile recording on gpu0 for job k aborted: the daemon is stopping" in d.log_text()
    finally:
        stop(job)
