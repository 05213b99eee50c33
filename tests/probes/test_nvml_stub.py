"""The NVML probe through the real ``pynvml`` on the C stand-in of
``libnvidia-ml.so.1`` (tests/nvml_stub), each case in a subprocess of its own:
pynvml loads the library once per process, by name, through ``LD_LIBRARY_PATH``."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.nvml_stub import REPO, stub_env

PROBE_SCRIPT = """
import json, sys
from greend.probes.nvml import NvmlProbe
from greend.errors import GreendError
p = NvmlProbe()
out = {}
try:
    p.open()
except GreendError as e:
    out["open_error"] = [type(e).__name__, str(e)]
    print(json.dumps(out)); sys.exit(0)
r1 = p.sample(0.0)
import time; time.sleep(0.2)
r2 = p.sample(0.2)
from dataclasses import asdict
out["gpus"] = [asdict(g) | {"supported_sm_clocks_mhz": len(g.supported_sm_clocks_mhz)} for g in r2.gpus]
info = p.info()
out["info"] = {"available": info.available, "detail": info.detail, "devices": info.devices}
out["errors"] = {str(k): v for k, v in p.device_errors.items()}
p.close()
print(json.dumps(out, default=str))
"""


def run_py(
    code: str, timeout: float = 60.0, env_extra: dict[str, str] | None = None, **faults: object
) -> dict[str, Any]:
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**stub_env(**faults), **(env_extra or {})},
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_real_pynvml_reads_eight_gpus_in_si_units() -> None:
    out = run_py(PROBE_SCRIPT)
    gpus = out["gpus"]
    assert [g["index"] for g in gpus] == list(range(8))
    g = gpus[0]
    assert g["name"] == "NVIDIA H100 80GB HBM3"
    assert g["uuid"].startswith("GPU-") and len({x["uuid"] for x in gpus}) == 8
    assert g["energy_method"] == "counter"
    assert 60 < g["power_w"] < 701  # mW -> W
    assert g["energy_j"] > 0  # mJ deltas -> J
    assert g["power_limit_w"] == 700.0 and g["power_limit_min_w"] == 200.0 and g["power_limit_max_w"] == 700.0
    assert g["sm_clock_max_mhz"] == 1980.0 and g["mem_clock_mhz"] == 2619.0
    assert g["supported_sm_clocks_mhz"] == 110  # the two-call size protocol
    assert g["compute_capability"] == [9, 0]
    assert out["info"]["available"] and "driver 550.54.15" in out["info"]["detail"]


def test_lost_gpu_is_left_out_and_the_others_read() -> None:
    out = run_py(PROBE_SCRIPT, lost="2,5")
    assert [g["index"] for g in out["gpus"]] == [0, 1, 3, 4, 6, 7]
    assert any("gpu2: LOST" in d for d in out["info"]["devices"])


def test_no_energy_counter_integrates_power() -> None:
    out = run_py(PROBE_SCRIPT, no_energy="1")
    by = {g["index"]: g for g in out["gpus"]}
    assert by[1]["energy_method"] == "power_integration" and by[1]["energy_j"] > 0
    assert by[0]["energy_method"] == "counter"


@pytest.mark.parametrize(("code", "kind"), [(9, "NoData"), (12, "NoData")])
def test_init_failure_without_a_driver_is_no_data(code: int, kind: str) -> None:
    out = run_py(PROBE_SCRIPT, init_error=code)
    assert out["open_error"][0] == kind


def test_driver_upgraded_without_reboot_names_the_fix() -> None:
    out = run_py(PROBE_SCRIPT, init_error=18)
    name, msg = out["open_error"]
    assert "LIB_RM_VERSION_MISMATCH" in msg and "reboot" in msg


def test_handles_are_opaque_and_the_init_count_is_per_process() -> None:
    out = run_py(
        """
        import json, pynvml as n
        n.nvmlInit(); n.nvmlInit()
        a, b = n.nvmlDeviceGetHandleByIndex(0), n.nvmlDeviceGetHandleByIndex(0)
        res = {"equal": a == b}
        try:
            n.nvmlDeviceSetPowerManagementLimit(a, 300000.0)
        except TypeError:
            res["float"] = "TypeError"
        n.nvmlShutdown()
        res["after_one_shutdown"] = n.nvmlDeviceGetPowerUsage(a) > 0
        n.nvmlShutdown(); n.nvmlShutdown()  # an extra shutdown is not an error
        try:
            n.nvmlDeviceGetPowerUsage(a)
        except n.NVMLError as e:
            res["after_all"] = e.value
        print(json.dumps(res))
        """
    )
    assert out == {"equal": False, "float": "TypeError", "after_one_shutdown": True, "after_all": 1}


RECOVERY_SCRIPT = """
import json, time
from greend.probes.nvml import NvmlProbe
import greend.probes.nvml as m
m.RECOVER_EVERY_S = 0.0
p = NvmlProbe()
p.open()
seen = []
for k in range(60):
    try:
        r = p.sample(k * 0.5)
    except Exception:  # every GPU failed this tick: the daemon's scheduler counts a failed probe
        seen.append([])
    else:
        seen.append(sorted(g.index for g in r.gpus))
    time.sleep(0.002)
end = time.monotonic() + 20  # the last look may still run in the background
while True:
    try:
        last = {g.index: g.energy_j for g in p.sample(31.0).gpus}
    except Exception:
        last = {}
    if len(last) == 8 or time.monotonic() > end:
        break
    time.sleep(0.05)
print(json.dumps({"seen": seen, "last": sorted(last), "lost": sorted(p.lost_gpus)}))
"""


def test_nvml_shut_down_under_greend_is_initialised_again() -> None:
    out = run_py(RECOVERY_SCRIPT, uninit_after=150)
    assert any(len(s) < 8 for s in out["seen"])  # a tick lost to UNINITIALIZED
    assert out["last"] == list(range(8))


def test_a_reset_gpu_comes_back_without_a_restart() -> None:
    out = run_py(RECOVERY_SCRIPT, reset="2:150:2")
    assert any(2 not in s for s in out["seen"])  # lost for a while
    assert out["last"] == list(range(8)) and out["lost"] == []


OFF_THE_TICK_SCRIPT = """
import json, time
from greend.probes.nvml import NvmlProbe
import greend.probes.nvml as m
m.RECOVER_EVERY_S = 0.0
p = NvmlProbe(open_wait_s=30)
p.open()
longest, states, details, n, settled = 0.0, set(), set(), 0, 0
end = time.monotonic() + SECONDS
while time.monotonic() < end and settled < 25:  # 25 ticks once what is awaited came about
    t = time.monotonic()
    try:
        n = len(p.sample(t).gpus)
    except Exception:  # every GPU failed this tick (UNINITIALIZED): the scheduler counts it
        n = 0
    longest = max(longest, time.monotonic() - t)
    states |= {g["state"] for g in p.gpu_states()}
    if p.reopening:
        details.add(p.info().detail)
    settled = settled + 1 if DONE else 0
    time.sleep(0.02)
print(json.dumps({"longest_s": longest, "states": sorted(states), "details": sorted(details), "last": n}))
"""


def test_nvml_initialised_again_off_the_tick() -> None:
    """NVML is shut down under greend mid-run and nvmlInit takes 1 s (a driver load):
    no sample waits for it (the re-init and the new enumeration run in the background),
    the GPUs read "initialising" meanwhile, and all eight are read again after it."""
    script = OFF_THE_TICK_SCRIPT.replace("SECONDS", "7").replace("DONE", '"initialising" in states and n == 8')
    # The first nvmlInit (the open) is at once: only the one after the shutdown takes 1 s,
    # and a sample that waited on it would take 1 s.
    out = run_py(script, uninit_after=400, reinit_s=1)
    assert out["longest_s"] < 0.5, out
    assert "initialising" in out["states"], out
    assert any("initialising NVML again (waiting on nvmlInit" in d for d in out["details"]), out
    assert out["last"] == 8, out


def test_gpus_that_do_not_answer_are_looked_for_off_the_tick() -> None:
    """gpu3 never answers in time (every call 2 s, deadline 0.5 s): the looks for it run
    in the background, so no sample waits on them; the seven others are read throughout."""
    env = {"GREEND_NVML_DEADLINE_S": "0.5"}
    # gpu3's worker stays inside its open's calls (2 s each) for the whole run, so every
    # tick meets the same state, and a look starts every tick or two (RECOVER_EVERY_S is
    # 0; each fails at once on the busy worker): 1.5 s of ticks hold dozens of looks.
    script = OFF_THE_TICK_SCRIPT.replace("SECONDS", "1.5").replace("DONE", "False")
    out = run_py(script, hang_gpus="3", hang_s=2, env_extra=env)
    assert out["longest_s"] < 0.4, out
    assert out["states"] == ["ok", "unresponsive"] and out["last"] == 7, out


READ_AHEAD_SCRIPT = """
import json, os, pathlib, time
import pynvml
from greend.probes.nvml import NvmlProbe
hang = pathlib.Path(os.environ["NVML_STUB_HANG_WHEN"])
pynvml.nvmlInit()
raw = lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(pynvml.nvmlDeviceGetHandleByIndex(3))
raw0, t_raw0 = raw(), time.monotonic()
p = NvmlProbe(read_wait_s=READ_WAIT)
p.open()
t0 = time.monotonic()
ticks, back, left_out = [], 0, False
while time.monotonic() - t0 < RUN_S:
    t = time.monotonic()
    if 0.5 < t - t0 < 1.1:
        hang.touch()  # gpu3's next call hangs (1.5 s)
    elif t - t0 >= 1.1:
        hang.unlink(missing_ok=True)  # the call under way still takes its 1.5 s
    g3 = next((g for g in p.sample(t).gpus if g.index == 3), None)
    ticks.append({"at": t - t0, "took": time.monotonic() - t,
                  "g3": None if g3 is None else [g3.stale_s, g3.energy_j],
                  "states": sorted({s["state"] for s in p.gpu_states()})})
    left_out = left_out or g3 is None
    back = back + 1 if left_out and g3 is not None and g3.stale_s is None else 0
    if back == 5:  # gpu3 read again for 5 ticks after it was left out: the counter read at once
        break
    time.sleep(max(0.0, 0.1 - (time.monotonic() - t)))
t_last, raw1 = time.monotonic(), raw()
watts = pynvml.nvmlDeviceGetPowerUsage(pynvml.nvmlDeviceGetHandleByIndex(3)) / 1000.0
# (the counter also counted before the probe opened and after its last read: the seconds it
# counted that the probe did not, at the GPU's power)
print(json.dumps({"ticks": ticks, "counted_j": (raw1 - raw0) / 1000.0,
                  "unseen_j": watts * ((t0 - t_raw0) + (t_last - t))}))
"""


@pytest.mark.parametrize(("read_wait_s", "hang_s", "deadline_s"), [(0.02, 1.5, 1), (None, 1.5, 1), (0.02, 3.0, 5)])
def test_a_gpu_that_starts_hanging_never_holds_the_sample(
    read_wait_s: float | None, hang_s: float, deadline_s: float
) -> None:
    """gpu3 starts hanging mid-run (its next call takes 1.5 s; the call deadline is 1 s).
    Waiting at most 20 ms for the reads, no sample waits on it: gpu3's last reading
    stands in, stale and with the same energy, until the deadline; then gpu3 is left
    out, unresponsive; once its call returns it is read again, and its energy is what
    its counter counted over the whole run (the late read lost nothing, nothing counted
    twice). Waiting up to the deadline (None, as greend did), one sample takes it. A
    stall of 3 s under a 5 s deadline (late, never overdue): the counter's 3 s of
    energy came in one read, checked against the tick's time as if 0.1 s had passed,
    and was dropped as more than the GPU can draw (most of the stall's energy lost)."""
    env = {"GREEND_NVML_DEADLINE_S": str(deadline_s)}
    script = READ_AHEAD_SCRIPT.replace("READ_WAIT", repr(read_wait_s)).replace("RUN_S", repr(hang_s + 4.5))
    with tempfile.TemporaryDirectory() as d:
        hang = Path(d) / "hang-now"
        out = run_py(script, hang_gpus="3", hang_when=hang, hang_s=hang_s, env_extra=env)
    ticks = out["ticks"]
    longest = max(t["took"] for t in ticks)
    assert ticks[-1]["g3"] is not None and ticks[-1]["g3"][0] is None, ticks[-1]  # read again, fresh
    # What the probe counted against the counter itself, less what the counter counted where
    # the probe was not reading (on a loaded machine, tenths of a second: 3 % here once).
    lost = out["counted_j"] - ticks[-1]["g3"][1]
    assert -0.02 * out["counted_j"] <= lost <= 0.02 * out["counted_j"] + out["unseen_j"], out
    if hang_s > deadline_s:
        assert any(t["states"] == ["ok", "unresponsive"] and t["g3"] is None for t in ticks), ticks
    else:  # late, not overdue: the last reading stands in, stale, all along
        assert all(t["g3"] is not None for t in ticks), ticks
        return
    if read_wait_s is None:
        assert longest > 0.9, longest  # the sample that met the hang waited the deadline out
        return
    assert longest < 0.3, [t for t in ticks if t["took"] >= 0.3]
    stale = [t["g3"] for t in ticks if t["g3"] is not None and t["g3"][0] is not None]
    assert len(stale) >= 5, ticks  # about one deadline of ticks at 10 Hz
    before = [t["g3"][1] for t in ticks if t["g3"] is not None and t["g3"][0] is None and t["at"] < 0.5][-1]
    assert all(s[1] == before for s in stale)  # the last reading stands in: no energy made up
    assert max(s[0] for s in stale) < 1.1


OLDEST_NVML_PY = "12.535.77"  # pyproject's lower bound for nvidia-ml-py

OLDEST_SCRIPT = """
import json, time
import pynvml
from greend.actuators.gpu import NvmlGpuBackend
from greend.probes.nvml import NvmlProbe
p = NvmlProbe()
p.open()
p.sample(0.0)
time.sleep(0.2)
r = p.sample(0.2)
b = NvmlGpuBackend(p)
b.set_power_limit_w(2, 450.0)
limit = b.power_limit_w(2)
b.set_locked_clocks_mhz(2, 345, 1400)
b.reset_locked_clocks(2)
b.set_power_limit_w(2, 700.0)
print(json.dumps({"module": pynvml.__file__, "gpus": len(r.gpus), "name": r.gpus[0].name,
                  "energy_j": r.gpus[0].energy_j, "power_w": r.gpus[0].power_w, "limit": limit,
                  "clocks": len(b.supported_sm_clocks_mhz(2))}))
p.close()
"""


@pytest.mark.slow
def test_the_oldest_nvidia_ml_py_allowed_runs_the_probe_and_the_setters(tmp_path: Path) -> None:
    """pyproject allows nvidia-ml-py from OLDEST_NVML_PY: that release, installed apart
    (pip, from the package index), reads the stand-in's GPUs and sets and resets caps."""
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"nvidia-ml-py>={OLDEST_NVML_PY}"' in pyproject, "the test and pyproject name different bounds"
    target = tmp_path / "site"
    pip = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--target",
            str(target),
            f"nvidia-ml-py=={OLDEST_NVML_PY}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if pip.returncode != 0:
        pytest.skip(f"cannot install nvidia-ml-py=={OLDEST_NVML_PY} here: {pip.stderr.strip()[-300:]}")
    env = stub_env()
    env["PYTHONPATH"] = str(target) + os.pathsep + env["PYTHONPATH"]  # the old pynvml before the venv's
    r = subprocess.run(
        [sys.executable, "-c", OLDEST_SCRIPT], capture_output=True, text=True, timeout=120, cwd=REPO, env=env
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["module"].startswith(str(target))
    assert out["gpus"] == 8 and out["name"] == "NVIDIA H100 80GB HBM3"
    assert out["energy_j"] > 0 and 60 < out["power_w"] < 701
    assert out["limit"] == 450.0 and out["clocks"] == 110


PROCS_SCRIPT = """
import ctypes, json, os, sys
import pynvml
pynvml.nvmlInit()
h0, h1 = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlDeviceGetHandleByIndex(1)
out = {}
def pids(fn, h):
    try:
        return sorted((p.pid, p.usedGpuMemory, p.gpuInstanceId) for p in fn(h))
    except pynvml.NVMLError as e:
        return str(e)
out["compute0"] = pids(pynvml.nvmlDeviceGetComputeRunningProcesses, h0)
out["compute0_v2"] = pids(pynvml.nvmlDeviceGetComputeRunningProcesses_v2, h0)
out["graphics0"] = pids(pynvml.nvmlDeviceGetGraphicsRunningProcesses, h0)
out["mps0"] = pids(pynvml.nvmlDeviceGetMPSComputeRunningProcesses, h0)
out["compute1"] = pids(pynvml.nvmlDeviceGetComputeRunningProcesses, h1)
# The unversioned (v1) symbol through ctypes, as older bindings call it: 16-byte records,
# and the size protocol: no room -> INSUFFICIENT_SIZE with the count needed.
lib = pynvml.nvmlLib
class V1(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]
n = ctypes.c_uint(0)
out["v1_probe"] = [lib.nvmlDeviceGetComputeRunningProcesses(h0, ctypes.byref(n), None), n.value]
arr = (V1 * n.value)()
rc = lib.nvmlDeviceGetComputeRunningProcesses(h0, ctypes.byref(n), arr)
out["v1"] = [rc, [(r.pid, r.usedGpuMemory) for r in arr]]
print(json.dumps(out))
"""


def test_the_stub_lists_running_processes_as_nvml_does(tmp_path: Path) -> None:
    import subprocess as sp

    alive = sp.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = sp.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        table = tmp_path / "procs"
        table.write_text(
            f"0 {alive.pid} compute 512\n0 {os.getpid()}\n0 {gone.pid} compute 1\n0 {alive.pid} graphics\n# junk line\n"
        )
        out = run_py(PROCS_SCRIPT, procs=table, no_procs="1")
        na = 0xFFFFFFFF  # gpuInstanceId off MIG
        assert out["compute0"] == sorted([[alive.pid, 512 * 2**20, na], [os.getpid(), 0, na]])  # the exited one is gone
        assert out["compute0_v2"] == out["compute0"]
        assert out["graphics0"] == [[alive.pid, 0, na]] and out["mps0"] == []
        assert out["compute1"] == "Not Supported"
        assert out["v1_probe"] == [7, 2]  # NVML_ERROR_INSUFFICIENT_SIZE, the count needed
        assert out["v1"][0] == 0 and sorted(out["v1"][1]) == sorted([[alive.pid, 512 * 2**20], [os.getpid(), 0]])
    finally:
        alive.kill()
        alive.wait(10)


@pytest.mark.parametrize("raw", ["0", "-1", "abc", "inf", "nan", "1e9"])
def test_a_deadline_setting_that_is_no_deadline_is_named_and_the_default_kept(
    raw: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """GREEND_NVML_DEADLINE_S=0 called every healthy GPU unresponsive ("the driver may be
    hung"), sending the admin after the driver instead of the variable; "abc" was
    ignored without a word. Each is named now, and the default deadline kept."""
    from greend.probes.nvml_device import DEFAULT_DEADLINE_S, _default_deadline_s

    monkeypatch.setenv("GREEND_NVML_DEADLINE_S", raw)
    with caplog.at_level(logging.WARNING):
        assert _default_deadline_s() == DEFAULT_DEADLINE_S
    assert f"GREEND_NVML_DEADLINE_S={raw!r} is not seconds" in caplog.text
    monkeypatch.setenv("GREEND_NVML_DEADLINE_S", "0.5")
    assert _default_deadline_s() == 0.5


RESET_CAP_SCRIPT = """
import json, sys, time
from greend.actuators.controller import Controller
from greend.actuators.gpu import NvmlGpuBackend
from greend.probes.nvml import NvmlProbe
from greend.settings import Setting
import greend.probes.nvml as m
m.RECOVER_EVERY_S = 0.0
p = NvmlProbe()
p.open()
ctl = Controller(sys.argv[1], NvmlGpuBackend(p))
ctl.apply_gpu(1, Setting(1200, 400.0), "node")
lost_looks, written, back = 0, [], False
end = time.monotonic() + 30
k = 0
while time.monotonic() < end:
    k += 1
    try:
        p.sample(k * 0.5)
    except Exception:
        pass
    if 1 in p.lost_gpus:
        lost_looks += 1
    elif lost_looks:
        back = True
        written += ctl.reassert(1)
        if written:
            break
    time.sleep(0.01)
print(json.dumps({"lost_looks": lost_looks, "back": back, "written": sorted(written)}))
"""


def test_a_capped_gpu_reset_while_looked_for_gets_its_settings_written_again(tmp_path: Path) -> None:
    """gpu1 is capped, then reset (its handles stale, GPU_IS_LOST for a while, then a fresh
    handle with the driver's defaults back). Looks for it run while it is still lost (on a
    real node one every few seconds): when it answers again greend knows it was lost and
    writes its cap and limit again (before: a look during the loss forgot its UUID, the
    GPU came back with no new epoch, and the cap was never written again while status
    still showed it in force)."""
    out = run_py(RESET_CAP_SCRIPT.replace("sys.argv[1]", repr(str(tmp_path / "state"))), reset="1:200:40")
    assert out["lost_looks"] >= 2 and out["back"], out  # looked for while lost, then found
    assert out["written"] == ["clock_cap_mhz", "power_limit_w"], out
