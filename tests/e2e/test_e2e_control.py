"""Control end to end: caps through the real daemon on simulated GPUs, and every way
they must come back (SIGTERM, SIGKILL + restart, greend restore, a client that dies,
cap reset), plus the refusal of a non-admin client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from greend.ipc.client import Client
from greend.probes.sim import SimGpu
from tests.support import REPO, DaemonProc, env, start_daemon, wait_for

pytestmark = pytest.mark.e2e


def sim(state: Path, i: int) -> SimGpu:
    return SimGpu(state / "sim", i)


def original(state: Path, i: int) -> tuple[object, float]:
    g = sim(state, i)
    return g.locked_clocks_mhz(), g.power_limit_w()


def test_cap_set_status_and_sigterm_restore(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "--sim", "2")
    daemons.append(d)
    before = [original(d.state_dir, i) for i in range(2)]
    assert before[0] == (None, 700.0)
    out = d.ctl("cap", "set", "--gpu", "0", "--max-clock", "1400").stdout
    assert "clock cap 1395 MHz" in out  # snapped to the highest supported clock <= 1400
    d.ctl("cap", "set", "--gpu", "1", "--power-limit", "450")
    g0, g1 = sim(d.state_dir, 0), sim(d.state_dir, 1)
    assert g0.locked_clocks_mhz() == (345, 1395)
    assert g1.power_limit_w() == pytest.approx(450.0)

    # Status shows the GPUs as the last tick sampled them: wait for a tick after both sets.
    def both_shown(st: dict) -> bool:
        return st["gpus"][0]["clock_cap_mhz"] == 1395 and st["gpus"][1]["power_limit_w"] == pytest.approx(450.0)

    deadline = time.monotonic() + 10
    st = d.status()
    while not both_shown(st) and time.monotonic() < deadline:
        time.sleep(0.05)
        st = d.status()
    assert st["gpus"][0]["clock_cap_mhz"] == 1395
    assert st["gpus"][1]["power_limit_w"] == pytest.approx(450.0)
    assert st["policy"]["owners"] == {"node": ["gpu0.clock_cap_mhz", "gpu1.power_limit_w"]}
    assert "set by node: gpu0.clock_cap_mhz, gpu1.power_limit_w" in d.ctl("status").stdout
    # Out of range is clamped to the constraints, not refused.
    assert "power limit 200.0 W" in d.ctl("cap", "set", "--gpu", "1", "--power-limit", "50").stdout
    import sqlite3

    def stored_rows() -> set:
        con = sqlite3.connect(f"file:{d.db}?mode=ro", uri=True)
        try:
            return set(con.execute("SELECT clock_locked, clock_cap_mhz FROM greend_gpu WHERE gpu = '0'"))
        except sqlite3.OperationalError:  # the table is not there yet
            return set()
        finally:
            con.close()

    assert wait_for(lambda: (1, 1395.0) in stored_rows(), 10)  # a store sample while the cap held
    assert d.stop(signal.SIGTERM) == 0
    assert [original(d.state_dir, i) for i in range(2)] == before
    assert not (d.state_dir / "saved-settings.json").exists()
    # The store has the bound in force on every sample: the lock while it held, the
    # device's maximum clock before and after (so "the last value" is never stale).
    rows = stored_rows()
    assert rows <= {(0, 1980.0), (1, 1395.0)} and (1, 1395.0) in rows, rows


def test_sigkill_then_restart_restores_everything(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "--sim", "2")
    daemons.append(d)
    before = [original(d.state_dir, i) for i in range(2)]
    d.ctl("cap", "set", "--gpu", "0", "--max-clock", "1005")
    d.ctl("cap", "set", "--gpu", "1", "--power-limit", "300")
    d.stop(signal.SIGKILL)
    # The hardware outlives the daemon: still capped.
    assert sim(d.state_dir, 0).locked_clocks_mhz() == (345, 1005)
    assert sim(d.state_dir, 1).power_limit_w() == pytest.approx(300.0)
    d2 = start_daemon(tmp_path, "--sim", "2", state_dir=d.state_dir, name="d2")
    daemons.append(d2)
    assert [original(d.state_dir, i) for i in range(2)] == before
    assert "restore at start" in d2.log_text()


def test_greend_restore_command_after_sigkill(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "--sim", "1")
    daemons.append(d)
    d.ctl("cap", "set", "--gpu", "0", "--power-limit", "250")
    d.stop(signal.SIGKILL)
    r = subprocess.run(
        [sys.executable, "-m", "greend.daemon_main", "restore", "--state-dir", str(d.state_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=env(),
    )
    assert r.returncode == 0, r.stderr
    assert "restored" in r.stdout
    assert original(d.state_dir, 0) == (None, 700.0)
    # Nothing left: a second run says so and exits 0 (as ExecStopPost after a clean stop).
    r2 = subprocess.run(
        [sys.executable, "-m", "greend.daemon_main", "restore", "--state-dir", str(d.state_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=env(),
    )
    assert r2.returncode == 0 and "nothing to restore" in r2.stdout


def test_corrupt_state_file_refuses_control_and_keeps_the_file(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "saved-settings.json").write_text('{"format": "greend-saved-settings", "version": 1, "gp')
    d = start_daemon(tmp_path, "--sim", "1", state_dir=state)
    daemons.append(d)
    r = d.ctl("cap", "set", "--gpu", "0", "--max-clock", "1200", check=False)
    assert r.returncode != 0
    assert "saved-settings.json" in r.stderr
    assert (state / "saved-settings.json").read_text().endswith('"gp')  # not replaced by a default
    assert sim(state, 0).locked_clocks_mhz() is None


def test_cap_reset(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "--sim", "2")
    daemons.append(d)
    d.ctl("cap", "set", "--gpu", "0", "--max-clock", "900")
    d.ctl("cap", "set", "--gpu", "1", "--max-clock", "900")
    out = d.ctl("cap", "reset", "--gpu", "1").stdout
    assert "gpu1" in out
    assert sim(d.state_dir, 1).locked_clocks_mhz() is None
    assert sim(d.state_dir, 0).locked_clocks_mhz() == (345, 900)
    d.ctl("cap", "reset")
    assert sim(d.state_dir, 0).locked_clocks_mhz() is None


@pytest.fixture()
def open_dir() -> Iterator[Path]:
    """A directory any user may enter (pytest's tmp is 0700: nobody could not reach a socket there)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="greend-open-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


# Run as uid 65534 (nobody, group nogroup): everything is imported first, then the
# process drops to nobody and connects: SO_PEERCRED gives the daemon that uid.
AS_NOBODY = """
import json, os, pathlib, sys
sys.path.insert(0, sys.argv[1])
from greend.errors import RequestRefused
from greend.ipc.client import Client
os.setgroups([]); os.setgid(65534); os.setuid(65534)
c = Client(pathlib.Path(sys.argv[2]))
out = {"read": len(c.request("status")["gpus"])}
for op, fields in json.loads(sys.argv[3]):
    try:
        c.request(op, **fields)
        out[op] = "allowed"
    except RequestRefused as e:
        out[op] = e.code
        out[op + ":msg"] = str(e)
print(json.dumps(out))
"""


def as_nobody(d: DaemonProc, requests: list) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", AS_NOBODY, str(REPO), str(d.socket), json.dumps(requests)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env(),
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_non_admin_is_refused_clearly(tmp_path: Path, open_dir: Path, daemons: list[DaemonProc]) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to start a client as another uid")
    d = start_daemon(
        tmp_path,
        "--sim",
        "2",
        socket=open_dir / "g.sock",
        config='[daemon]\nsocket_group = ""\nsocket_mode = "0666"\nadmin_group = ""\n',
    )
    daemons.append(d)
    with Client(d.socket) as root_job:  # root's training job holds GPU 0
        root_job.request("register", job="roots", gpus=[0])
        out = as_nobody(
            d, [["cap_set", {"gpu": 0, "max_clock_mhz": 1000}], ["policy_set", {"name": "static"}], ["cap_reset", {}]]
        )
        assert out["read"] == 2  # any client may read
        assert out["cap_set"] == out["policy_set"] == out["cap_reset"] == "forbidden"
        msg = out["cap_set:msg"]
        assert "needs root (no [daemon] admin_group is set)" in msg and "65534" in msg
        assert sim(d.state_dir, 0).locked_clocks_mhz() is None
        # A job's client steers only its own GPUs: nobody cannot join root's job. Root's
        # claim on GPU 0 shows no process of its (the job reported no steps): it is
        # pending, keeps no one off, and a job of nobody's is registered beside it
        # (greend.jobs.claims; a GPU that runs another job's work is refused, as
        # test_e2e_shared_node shows).
        assert as_nobody(d, [["register", {"job": "mine", "gpus": [0]}]])["register"] == "allowed"
        out = as_nobody(d, [["register", {"job": "roots", "gpus": [1]}]])
        assert out["register"] == "forbidden" and "belongs to uid 0" in out["register:msg"]
        assert as_nobody(d, [["register", {"job": "mine", "gpus": [1]}]])["register"] == "allowed"


def test_a_member_of_the_admin_group_may_steer(tmp_path: Path, open_dir: Path, daemons: list[DaemonProc]) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to start a client as another uid")
    d = start_daemon(
        tmp_path,
        "--sim",
        "1",
        socket=open_dir / "g.sock",
        config='[daemon]\nsocket_group = ""\nsocket_mode = "0666"\nadmin_group = "nogroup"\n',
    )
    daemons.append(d)
    out = as_nobody(d, [["cap_set", {"gpu": 0, "max_clock_mhz": 1005}]])  # snapped to 1005 or below
    assert out["cap_set"] == "allowed", out
    assert wait_for(lambda: sim(d.state_dir, 0).locked_clocks_mhz() is not None, 10)
    assert sim(d.state_dir, 0).locked_clocks_mhz()[1] <= 1005
    assert as_nobody(d, [["cap_reset", {}]])["cap_reset"] == "allowed"
    assert wait_for(lambda: sim(d.state_dir, 0).locked_clocks_mhz() is None, 10)


EFFICIENT = """[daemon]
socket_group = ""
[policy]
name = "efficient"
period_s = 0.2
settle_s = 0.05
[policy.params]
max_slowdown = 0.05
min_steps = 6
"""


@pytest.mark.slow
def test_efficient_policy_caps_a_running_job_and_lifts_the_cap_when_it_dies(
    tmp_path: Path, daemons: list[DaemonProc]
) -> None:
    from tests.e2e.test_e2e_jobs import trainer, wait_ended

    d = start_daemon(tmp_path, "--sim", "1", config=EFFICIENT)
    daemons.append(d)
    ready = tmp_path / "ready"
    p = trainer(d.socket, "tuned", "--steps", "100000", "--step-sleep", "0.005", "--ready-file", str(ready))
    try:
        deadline = time.monotonic() + 90
        capped = None
        while time.monotonic() < deadline:
            st = d.status()
            dec = (st["policy"].get("last_decision") or {}).get("details", {}).get("jobs", {}).get("tuned", {})
            cap = st["gpus"][0]["clock_cap_mhz"]
            # Settled, and the device holds what status says (the policy re-checks its
            # baseline uncapped once after settling: wait for it to come back).
            if dec.get("phase") == "settled" and cap and sim(d.state_dir, 0).locked_clocks_mhz() == (345, cap):
                capped = cap
                break
            time.sleep(0.2)
        assert capped is not None, f"the search did not settle: {d.status()['policy']}"
        # A mixed workload (mem_share 0.3): the efficient clock is below the maximum (sim).
        assert 345 < capped < 1980
        rep = json.loads(d.ctl("report", "tuned", "--json").stdout)
        assert rep["decisions"] and "tuned" in rep["decisions"][-1]["reason"]
    finally:
        p.kill()  # the client dies without a word
        p.wait(10)
    rep = wait_ended(d, "tuned")
    assert rep["end_reason"] == "client disconnected"
    # The restore resets the device first and logs it after: wait for both.
    wait_for(lambda: sim(d.state_dir, 0).locked_clocks_mhz() is None and "restore (job tuned ended" in d.log_text(), 10)
    assert sim(d.state_dir, 0).locked_clocks_mhz() is None, "the dead job's cap was lifted"
    assert "restore (job tuned ended" in d.log_text()


def test_cpu_package_limit_set_reset_and_restored_after_sigkill_and_sigterm(
    tmp_path: Path, daemons: list[DaemonProc]
) -> None:
    from greend.probes.fake_sysfs import make_standard_tree

    tree = make_standard_tree(tmp_path / "sys")
    pkg0 = tree.dir_of("intel-rapl:0")

    def limits() -> tuple[int, int]:
        return tuple(int((pkg0 / f"constraint_{n}_power_limit_uw").read_text()) for n in (0, 1))  # type: ignore

    before = limits()
    state = tmp_path / "state"
    args = ("--sim", "1", "--sysfs-root", str(tmp_path / "sys"))
    d = start_daemon(tmp_path, *args, state_dir=state)
    daemons.append(d)
    # By the kernel's name or the zone id; long and short term both at most the limit.
    assert (
        "package-0 (intel-rapl:0): power limit 120.0 W"
        in d.ctl("cap", "set", "--cpu", "package-0", "--power-limit", "120").stdout
    )
    assert limits() == (120_000_000, min(120_000_000, before[1]))
    assert d.status()["policy"]["owners"] == {"node": ["package-0 (intel-rapl:0)"]}
    d.ctl("cap", "reset", "--cpu", "intel-rapl:0")
    assert limits() == before
    # A zone that is not there, or a clock for a CPU: refused, naming what exists.
    r = d.ctl("cap", "set", "--cpu", "package-7", "--power-limit", "100", check=False)
    assert r.returncode != 0 and "package-7" in r.stderr and "package-1 (intel-rapl:1)" in r.stderr
    r = d.ctl("cap", "set", "--cpu", "package-0", "--max-clock", "1000", check=False)
    assert r.returncode != 0 and "--power-limit W only" in r.stderr
    # Above the zone's maximum: clamped to it, never written beyond.
    d.ctl("cap", "set", "--cpu", "package-0", "--power-limit", "100000")
    assert limits()[0] <= 205_000_000
    # SIGKILL leaves the limit in force (as hardware keeps it); the next start restores it.
    d.ctl("cap", "set", "--cpu", "package-0", "--power-limit", "90")
    d.stop(signal.SIGKILL)
    assert limits()[0] == 90_000_000
    d2 = start_daemon(tmp_path, *args, state_dir=state, name="d2")
    daemons.append(d2)
    assert limits() == before
    # And SIGTERM restores what was set since.
    d2.ctl("cap", "set", "--cpu", "package-0", "--power-limit", "60")
    assert limits()[0] == 60_000_000
    assert d2.stop(signal.SIGTERM) == 0
    assert limits() == before


def test_policy_set_and_show_and_a_switch_lifts_the_old_policys_caps(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "--sim", "2", config='[daemon]\nsocket_group = ""\n[policy]\nperiod_s = 0.2\n')
    daemons.append(d)
    assert "policy none" in d.ctl("policy", "show").stdout
    # An admin's own caps (gpu1's clock, gpu0's power), then a static policy on both GPUs'
    # power: the admin's power cap on gpu0 stays in force and the admin's (it was taken
    # over, and lost for the factory value when the policy let go).
    d.ctl("cap", "set", "--gpu", "1", "--max-clock", "1200")
    d.ctl("cap", "set", "--gpu", "0", "--power-limit", "250")
    out = d.ctl("policy", "set", "static", "--param", "power_limit_w=450", "--param", "gpus=[0,1]").stdout
    assert "policy static {" in out and '"power_limit_w": 450' in out
    shown = json.loads(d.ctl("policy", "show", "--json").stdout)
    assert shown["name"] == "static" and shown["params"]["power_limit_w"] == 450
    assert wait_for(lambda: [sim(d.state_dir, i).power_limit_w() for i in (0, 1)] == [250.0, 450.0], 10)
    owners = d.status()["policy"]["owners"]
    assert owners == {"node": ["gpu0.power_limit_w", "gpu1.clock_cap_mhz"], "policy": ["gpu1.power_limit_w"]}
    # Bad parameters are refused, naming the parameter; the policy in force stays.
    r = d.ctl("policy", "set", "static", "--param", "power_limit_w=-5", check=False)
    assert r.returncode != 0 and "power_limit_w" in r.stderr
    # ... and so are GPUs the node does not have (the policy was set, and did nothing).
    for param in ("gpus=[5]", 'per_gpu={"7": {"clock_cap_mhz": 1200}}'):
        r = d.ctl("policy", "set", "static", "--param", "power_limit_w=400", "--param", param, check=False)
        assert r.returncode != 0 and "on this node (it has 0, 1)" in r.stderr, r.stderr
    assert json.loads(d.ctl("policy", "show", "--json").stdout)["params"]["power_limit_w"] == 450
    # Switching away lifts what the old policy set; the admin's cap stays until reset.
    d.ctl("policy", "set", "none")
    assert [sim(d.state_dir, i).power_limit_w() for i in (0, 1)] == [250.0, 700.0]
    assert sim(d.state_dir, 1).locked_clocks_mhz() == (345, 1200)
    assert d.status()["policy"]["owners"] == {"node": ["gpu0.power_limit_w", "gpu1.clock_cap_mhz"]}
    # The owners' names are no job's: a job cannot take them.
    with Client(d.socket) as c:
        with pytest.raises(Exception, match="reserved"):
            c.request("register", job="policy", gpus=[0])


def test_all_gpus_of_a_job_get_the_same_cap(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    # One rank on GPUs 0 and 1 (a synchronous job: the slowest GPU sets the pace), and
    # GPU 2 free: the efficient policy caps 0 and 1 alike and leaves 2 alone.
    from greend.ipc.server import encode

    d = start_daemon(tmp_path, "--sim", "3", config=EFFICIENT)
    daemons.append(d)
    gpus = [sim(d.state_dir, i) for i in range(3)]
    with Client(d.socket) as c:
        c.request("register", job="wide", gpus=[0, 1], mem_share=0.3)
        deadline = time.monotonic() + 60
        step = 0
        locks: list = [None, None, None]
        owners: dict = {}
        while time.monotonic() < deadline:
            now = time.monotonic()
            assert c._sock is not None
            c._sock.sendall(
                encode(
                    {"v": 1, "op": "steps", "steps": [{"step": step, "t0_s": now - 0.004, "t1_s": now, "flops": 2e12}]}
                )
            )
            step += 1
            time.sleep(0.005)
            if step % 20 == 0:
                # Settled, and the devices read the same twice (not mid-apply, nor in the
                # one uncapped baseline re-check after settling).
                pol = d.status()["policy"]
                dec, owners = (pol.get("last_decision") or {}).get("details", {}), pol["owners"]
                locks = [g.locked_clocks_mhz() for g in gpus]
                if (
                    dec.get("jobs", {}).get("wide", {}).get("phase") == "settled"
                    and locks[0] is not None
                    and locks == [g.locked_clocks_mhz() for g in gpus]
                ):
                    break
        assert locks[0] is not None, "the policy never capped the job"
        assert locks[0] == locks[1], f"GPUs of one job capped apart: {locks}"
        assert locks[2] is None, "a GPU outside the job was capped"
        assert owners == {"wide": ["gpu0.clock_cap_mhz", "gpu1.clock_cap_mhz"]}


def test_sighup_stops_as_cleanly_as_sigterm(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    """SIGHUP (the terminal of a foreground daemon closed, or an admin's "reload") killed
    the daemon outright: the GPU stayed capped until the next start and the running job
    was never kept. It is a clean stop now, and the log says greend has no reload."""
    d = start_daemon(tmp_path, "--sim", "1", "--hz", "20")
    daemons.append(d)
    before = original(d.state_dir, 0)
    d.ctl("cap", "set", "--gpu", "0", "--max-clock", "1400")
    assert sim(d.state_dir, 0).locked_clocks_mhz() == (345, 1395)
    with Client(d.socket) as c:
        c.request("register", job="hup", gpus=[0], precisions=["fp32"], world_size=1, rank=0, local_rank=0)
        assert d.stop(signal.SIGHUP) == 0
    assert original(d.state_dir, 0) == before
    assert not (d.state_dir / "saved-settings.json").exists()
    log = d.log.read_text()
    assert "signal SIGHUP: stopping (greend has no reload" in log
    kept = list((d.state_dir / "jobs").iterdir())
    assert len(kept) == 1 and "hup" in kept[0].name  # the running job ended and was kept


def test_a_policy_setting_the_gpu_clamps_says_what_it_holds(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    """`policy set static --param power_limit_w=1` said "power <= 1 W" while the GPU held its
    minimum, 200 W: the decision says what the GPU holds, and why."""
    d = start_daemon(tmp_path, "--sim", "1", config='[daemon]\nsocket_group = ""\n[policy]\nperiod_s = 0.2\n')
    daemons.append(d)
    d.ctl("policy", "set", "static", "--param", "power_limit_w=1")
    assert wait_for(lambda: "gpu0 holds 200 W, its range's end" in d.ctl("policy", "show").stdout, 10)
    d.ctl("policy", "set", "none")
