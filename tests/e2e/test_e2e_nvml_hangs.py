"""A whole daemon on the real ``pynvml`` over the C stand-in of ``libnvidia-ml.so.1``
(tests/nvml_stub) under the faults real nodes show: a GPU that starts hanging mid-run,
every NVML call hanging, a slow ``nvmlInit``, a driver that clamps a clock lock, a
card without clock locks, and MIG GPUs. Hangs are configured short (seconds) and the
call deadline small (``GREEND_NVML_DEADLINE_S=1``), so the whole file runs in seconds."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from greend.errors import DaemonUnavailable, GreendError
from greend.ipc.client import Client
from greend.testing.daemon_proc import daemon_command
from tests.e2e.test_e2e_real_nvml import gpus_of, locked_clocks, start_on_stub
from tests.nvml_stub import REPO, stub_env
from tests.support import DaemonProc, wait_for

pytestmark = pytest.mark.e2e

FAST = {"GREEND_NVML_DEADLINE_S": "1"}


def spawn_on_stub(tmp: Path, cfg_text: str = "", **faults: object) -> tuple[DaemonProc, float]:
    """``greend run`` on the stand-in without waiting for it; (daemon, monotonic start)."""
    state, sock, log, cfg = tmp / "state", tmp / "d.sock", tmp / "d.log", tmp / "d.toml"
    cfg.write_text('[daemon]\nsocket_group = ""\n' + cfg_text)
    faults.setdefault("state", tmp / "gpus.txt")
    args = daemon_command(cfg, sock, state, "--sysfs-root", str(tmp / "no-sysfs"), "--hz", "10")
    t0 = time.monotonic()
    with open(log, "ab") as fh:
        proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env={**stub_env(**faults), **FAST})
    return DaemonProc(proc, sock, state, state / "greend.db", log, args), t0


def first_status(d: DaemonProc, timeout_s: float = 30.0) -> tuple[dict[str, Any], float]:
    """The first status the daemon answers over its socket, and when (monotonic)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        assert d.proc.poll() is None, d.log_text()
        try:
            with Client(d.socket, timeout_s=2.0) as c:
                return c.request("status"), time.monotonic()
        except (DaemonUnavailable, GreendError, OSError):
            time.sleep(0.02)
    raise AssertionError(f"no status within {timeout_s} s:\n{d.log_text()}")


def status_now(d: DaemonProc) -> dict[str, Any]:
    with Client(d.socket, timeout_s=5.0) as c:
        st: dict[str, Any] = c.request("status")
        return st


def gpu_states(st: dict[str, Any]) -> dict[int, str]:
    return {g["index"]: g["state"] for g in (st.get("gpu_probe") or {}).get("gpus") or []}


def test_gpu0_is_restored_at_stop_while_gpu3_hangs(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    """Caps on gpu0 and gpu3; then every call on gpu3 hangs (30 s each). SIGTERM: gpu0 is
    unlocked (found by the index and handle greend holds, on its own thread), gpu3 is
    named as not restored and stays in the saved-settings file, and the stop takes
    well under the unit's TimeoutStopSec (30 s)."""
    gpu_file, hang = tmp_path / "gpus.txt", tmp_path / "hang-now"
    d = start_on_stub(tmp_path, state=gpu_file, hang_gpus="3", hang_when=hang, hang_s=30, env_extra=FAST)
    daemons.append(d)
    d.ctl("cap", "set", "--gpu", "0", "--max-clock", "1200")
    d.ctl("cap", "set", "--gpu", "3", "--max-clock", "1200")
    assert locked_clocks(gpu_file, 0)[1] == 1200 and locked_clocks(gpu_file, 3)[1] == 1200
    hang.touch()  # gpu3 hangs from now on
    assert wait_for(lambda: gpu_states(status_now(d)).get(3) == "unresponsive", 15), d.log_text()
    st = status_now(d)
    assert {i for i, s in gpu_states(st).items() if s == "ok"} == {0, 1, 2, 4, 5, 6, 7}
    t0 = time.monotonic()
    assert d.stop(timeout=40) == 0
    stop_s = time.monotonic() - t0
    assert stop_s < 30, f"stop took {stop_s:.1f} s"
    assert locked_clocks(gpu_file, 0) == (0, 0), d.log_text()  # restored
    assert locked_clocks(gpu_file, 3)[1] == 1200  # could not be reached...
    log = d.log_text()
    assert "FAILED gpu3" in log  # ...and is named
    assert "FAILED gpu0" not in log
    saved = (d.state_dir / "saved-settings.json").read_text()
    assert "GPU-5ab1e000-0000-4000-8000-000000000003" in saved  # left for greend restore
    assert "GPU-5ab1e000-0000-4000-8000-000000000000" not in saved


def test_socket_and_status_answer_at_once_while_every_nvml_call_hangs(
    tmp_path: Path, daemons: list[DaemonProc]
) -> None:
    """Every NVML call but nvmlInit hangs 3 s. The socket is up and status answers within
    2 s of the daemon's start, saying "initialising"; then NVML is open with all eight
    GPUs "unresponsive" (never "NVML found no GPUs"), the tick goes on, and SIGTERM stops
    the daemon within the unit's timeout."""
    d, t0 = spawn_on_stub(tmp_path, hang_gpus="all", hang_node=1, hang_s=3)
    daemons.append(d)
    st, answered = first_status(d)
    assert st["uptime_s"] < 2.0, st["uptime_s"]  # from the daemon's start to its first answer
    assert answered - t0 < 15.0
    assert st["gpu_probe"]["state"] == "initialising", st["gpu_probe"]
    probes = {p["name"]: p for p in st["probes"]}
    assert probes["nvml"]["state"] == "initialising"

    def all_unresponsive() -> bool:
        s = status_now(d)
        return s["gpu_probe"]["state"] == "open" and gpu_states(s) == {i: "unresponsive" for i in range(8)}

    assert wait_for(all_unresponsive, 30), status_now(d)["gpu_probe"]
    st = status_now(d)
    assert "found no GPUs" not in str(st)
    ticks = st["ticks"]
    time.sleep(3.0)
    # 10 Hz: ~30 ticks; the GPUs that do not answer are looked for again every 5 s on a
    # thread of their own: no tick waits for those looks (a call deadline is 1 s here)
    assert status_now(d)["ticks"] >= ticks + 20
    t1 = time.monotonic()
    assert d.stop(timeout=40) == 0
    assert time.monotonic() - t1 < 30


def test_a_slow_nvml_init_leaves_the_socket_serving(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    """nvmlInit takes 4 s (as after a driver load): status answers within 2 s, saying
    NVML is initialising and what it waits on; then the eight GPUs are read."""
    d, _ = spawn_on_stub(tmp_path, init_s=4)
    daemons.append(d)
    st, _ = first_status(d)
    assert st["uptime_s"] < 2.0
    assert st["gpu_probe"]["state"] == "initialising"
    assert "nvmlInit" in st["gpu_probe"]["detail"]
    text = d.ctl("status").stdout
    assert "initialising" in text
    assert wait_for(lambda: len(gpus_of(status_now(d))) == 8, 30), d.log_text()
    st = status_now(d)
    assert st["gpu_probe"]["state"] == "open" and set(gpu_states(st).values()) == {"ok"}
    assert d.stop() == 0


def test_the_reported_cap_is_the_clock_the_gpu_holds(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    """The driver clamps a lock of 1200 MHz to 1095 MHz: status reports 1095 MHz as the
    cap, flags the mismatch with both figures, and the log says it once."""
    d = start_on_stub(tmp_path, clock_clamp=1095)
    daemons.append(d)
    d.ctl("cap", "set", "--gpu", "2", "--max-clock", "1200")
    d.ctl("cap", "set", "--gpu", "2", "--max-clock", "1200")  # the same request: no second write

    def row() -> dict[str, Any]:
        return next(g for g in gpus_of(d.status()) if g["index"] == 2)

    assert wait_for(lambda: row()["clock_cap_mhz"] == 1095.0, 5), row()
    assert row()["cap_mismatch"] == {"clock_cap_mhz": {"asked": 1200.0, "held": 1095.0}}
    assert next(g for g in gpus_of(d.status()) if g["index"] == 1)["cap_mismatch"] == {}
    assert d.log_text().count("asked 1200 MHz, the GPU holds 1095 MHz") == 1
    d.ctl("cap", "reset", "--gpu", "2")
    assert wait_for(lambda: row()["clock_cap_mhz"] is None and row()["cap_mismatch"] == {}, 5), row()


def test_a_clamp_on_an_idle_gpu_is_read_back_once_it_runs(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    """gpu2 is idle when a lock of 1200 MHz is written (the driver clamps it to 1095 MHz):
    its clock says nothing of the lock, so status reports the request, unverified, with
    no mismatch claimed. Once the GPU runs (busy), the daemon reads back what it holds:
    status reports 1095 MHz and flags the mismatch, and the cap change is logged once."""
    idle = tmp_path / "idle"
    idle.touch()
    cfg = "[policy]\nperiod_s = 0.2\n"
    d, _ = spawn_on_stub(tmp_path, cfg, clock_clamp=1095, idle="2", idle_when=idle)
    daemons.append(d)
    first_status(d)
    assert wait_for(lambda: len(gpus_of(status_now(d))) == 8, 20)
    d.ctl("cap", "set", "--gpu", "2", "--max-clock", "1200")

    def row() -> dict[str, Any]:
        return next(g for g in gpus_of(status_now(d)) if g["index"] == 2)

    time.sleep(1.0)  # 5 policy periods, the GPU still idle: nothing to read back yet
    assert row()["clock_cap_mhz"] == 1200.0 and row()["cap_mismatch"] == {}, row()
    idle.unlink()  # the GPU runs
    assert wait_for(lambda: row()["clock_cap_mhz"] == 1095.0, 10), row()
    assert row()["cap_mismatch"] == {"clock_cap_mhz": {"asked": 1200.0, "held": 1095.0}}
    time.sleep(0.6)
    log = d.log_text()
    assert log.count("asked 1200 MHz, the GPU holds 1095 MHz") == 1, log[-2000:]
    assert d.stop() == 0


def test_refused_knobs_are_logged_once_per_gpu_and_shown(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    """A static policy caps every GPU's clock and power limit every 0.2 s. gpu4 is in MIG
    mode (both knobs refused), gpu2 refuses clock locks (a consumer card): each refused
    knob is logged once for its GPU over 15 periods, shown in status with its reason,
    and the power limit of gpu2 is still set."""
    cfg = '[policy]\nname = "static"\nperiod_s = 0.2\n[policy.params]\nclock_cap_mhz = 1500\npower_limit_w = 500\n'
    d, _ = spawn_on_stub(tmp_path, cfg, mig="4", no_locked_clocks="2")
    daemons.append(d)
    first_status(d)
    assert wait_for(lambda: len(gpus_of(status_now(d))) == 8, 20)
    time.sleep(3.0)  # 15 policy periods
    st = status_now(d)
    rows = {g["index"]: g for g in gpus_of(st)}
    assert rows[4]["refused_knobs"]["clock_cap_mhz"]["reason"] == "mig"
    assert rows[4]["refused_knobs"]["power_limit_w"]["reason"] == "mig"
    assert rows[2]["refused_knobs"]["clock_cap_mhz"]["reason"] == "not_supported"
    assert "power_limit_w" not in rows[2]["refused_knobs"] and rows[2]["power_limit_w"] == 500.0
    assert rows[0]["refused_knobs"] == {} and rows[0]["clock_cap_mhz"] == 1500.0
    lines = [ln for ln in d.log_text().splitlines() if "refused" in ln and ("WARNING" in ln or "ERROR" in ln)]
    gpu4 = [ln for ln in lines if "gpu4" in ln]
    gpu2 = [ln for ln in lines if "gpu2" in ln]
    assert len([ln for ln in gpu4 if "clock_cap_mhz" in ln]) == 1, gpu4
    assert len([ln for ln in gpu4 if "power_limit_w" in ln]) == 1, gpu4
    assert len(gpu2) == 1, gpu2
    assert "cannot apply" not in d.log_text()
    assert d.stop() == 0


def test_efficient_on_a_card_without_clock_locks_moves_the_power_limit(
    tmp_path: Path, daemons: list[DaemonProc]
) -> None:
    """gpu0 refuses clock locks (NOT_SUPPORTED, as consumer cards do) while a real torch
    job trains on it under the efficient policy (knob "clock"): the refusal is logged
    once, the policy says why it tunes the power limit instead, and the power limit
    moves; no error line per period."""
    from tests.e2e.test_e2e_jobs import trainer

    cfg = (
        '[policy]\nname = "efficient"\nperiod_s = 0.2\nsettle_s = 0.05\n'
        "[policy.params]\nmax_slowdown = 0.05\nmin_steps = 6\n"
    )
    procs = tmp_path / "procs"
    procs.write_text("")
    d, _ = spawn_on_stub(tmp_path, cfg, no_locked_clocks="0", procs=procs)
    daemons.append(d)
    first_status(d)
    assert wait_for(lambda: len(gpus_of(status_now(d))) == 8, 20)
    p = trainer(d.socket, "tuned", "--gpu", "0", "--steps", "100000", "--step-sleep", "0.005")
    procs.write_text(f"0 {p.pid} compute 2048\n")  # its CUDA context: NVML lists it on gpu0, so its claim steers
    try:

        def moved() -> bool:
            st = status_now(d)
            reason = (st["policy"].get("last_decision") or {}).get("reason") or ""
            return "tuning power_limit_w instead" in reason and gpus_of(st)[0]["power_limit_w"] < 700.0

        assert wait_for(moved, 120), (status_now(d)["policy"], d.log_text()[-3000:])
        st = status_now(d)
        assert gpus_of(st)[0]["refused_knobs"]["clock_cap_mhz"]["reason"] == "not_supported"
        assert gpus_of(st)[0]["clock_cap_mhz"] is None
    finally:
        p.kill()
        p.wait(10)
    log = d.log_text()
    refused = [ln for ln in log.splitlines() if "gpu0 clock_cap_mhz refused" in ln]
    assert len(refused) == 1, refused
    assert "cannot apply" not in log
    assert d.stop() == 0


def caps_left_by_a_killed_daemon(tmp: Path, gpu_file: Path) -> Path:
    """A daemon on the stand-in caps gpu0 and gpu3 and is SIGKILLed: the locks stay on
    the GPUs and in its saved-settings file. Returns its state dir."""
    d = start_on_stub(tmp, state=gpu_file, env_extra=FAST)
    try:
        d.ctl("cap", "set", "--gpu", "0", "--max-clock", "1200")
        d.ctl("cap", "set", "--gpu", "3", "--max-clock", "1200")
    finally:
        d.proc.kill()
        d.proc.wait(10)
    assert locked_clocks(gpu_file, 0)[1] == 1200 and locked_clocks(gpu_file, 3)[1] == 1200
    return d.state_dir


def greend_restore(state_dir: Path, **faults: object) -> tuple[subprocess.CompletedProcess[str], float]:
    """``greend restore`` on the stand-in with ``faults``; (its result, seconds taken)."""
    args = [sys.executable, "-P", "-m", "greend.daemon_main", "restore", "--state-dir", str(state_dir)]
    t0 = time.monotonic()
    r = subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=REPO, env={**stub_env(**faults), **FAST})
    return r, time.monotonic() - t0


@pytest.mark.parametrize(
    ("fault", "faults", "restored"),
    [
        ("gpu3 hangs", {"hang_gpus": "3", "hang_s": 30}, [0]),
        ("every call hangs", {"hang_gpus": "all", "hang_node": 1, "hang_s": 30}, []),
        ("nvmlInit hangs", {"init_s": 30}, []),
    ],
)
def test_greend_restore_is_bounded_per_gpu_while_nvml_hangs(
    tmp_path: Path, fault: str, faults: dict[str, object], restored: list[int]
) -> None:
    """After a SIGKILL left caps on gpu0 and gpu3, ``greend restore`` (ExecStopPost) runs
    while NVML hangs (call deadline 1 s here): it returns within a few deadlines, well
    under the unit's TimeoutStopSec (30 s); every GPU that answers is restored; exit 3
    and a last line naming each GPU not restored and what to do; those stay saved."""
    gpu_file = tmp_path / "gpus.txt"
    state_dir = caps_left_by_a_killed_daemon(tmp_path, gpu_file)
    r, took_s = greend_restore(state_dir, state=gpu_file, **faults)
    out = r.stdout + r.stderr
    assert took_s < 12.0, (fault, took_s, out)
    assert r.returncode == 3, (fault, out)
    for i in (0, 3):
        uuid = f"GPU-5ab1e000-0000-4000-8000-00000000000{i}"
        if i in restored:
            assert locked_clocks(gpu_file, i) == (0, 0), out
            assert f"restored gpu{i} ({uuid}) clock_cap_mhz: unlocked" in out
        else:
            assert locked_clocks(gpu_file, i)[1] == 1200, out
            assert uuid in (state_dir / "saved-settings.json").read_text()
    last = out.strip().splitlines()[-1]
    named = [f"gpu{i}" for i in (0, 3) if i not in restored]
    assert last.startswith("not restored, did not answer in time: "), out
    assert all(n in last for n in named) and ("gpu0" in last) == (0 not in restored), last
    assert "nvidia-smi -r -i" in last and f"greend restore --state-dir {state_dir}" in last
    if fault == "nvmlInit hangs":
        assert "nvmlInit did not return within 2 s" in out, out
    if fault == "gpu3 hangs":  # its open did not return: not looked up again by UUID (one more deadline)
        assert "gpu3 (GPU-5ab1e000-0000-4000-8000-000000000003): not looked up by its UUID" in out, out
