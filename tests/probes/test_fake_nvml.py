"""The fake pynvml: same names, units, return types and error classes as the real one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pynvml
import pytest

from greend.probes.fake_nvml import (
    FakeHandle,
    FakeNvml,
    fake_process_init_count,
    fake_reset_process_init,
    read_faults,
)
from greend.probes.sim import H100
from tests.support import ManualClock


@pytest.fixture(autouse=True)
def fresh_process_init() -> Any:
    """The fake's init count is per process, as NVML's: each test starts as a new process."""
    fake_reset_process_init()
    yield
    fake_reset_process_init()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(5_000.0)


@pytest.fixture
def nvml(tmp_path: Path, clock: ManualClock) -> FakeNvml:
    fake = FakeNvml(tmp_path, n=2, clock=clock)
    fake.nvmlInit()
    return fake


def nvml_code(exc_info: pytest.ExceptionInfo[Any]) -> int:
    return int(exc_info.value.value)


def test_constants_and_error_classes_are_pynvmls_own(tmp_path: Path) -> None:
    fake = FakeNvml(tmp_path, n=1)
    for name in (
        "NVML_CLOCK_SM",
        "NVML_CLOCK_MEM",
        "NVML_TEMPERATURE_GPU",
        "NVML_ERROR_GPU_IS_LOST",
        "NVML_ERROR_NOT_SUPPORTED",
        "NVML_ERROR_UNKNOWN",
        "nvmlClocksEventReasonSwPowerCap",
    ):
        assert getattr(fake, name) == getattr(pynvml, name)
    assert fake.NVMLError is pynvml.NVMLError
    assert fake.NVMLError_GpuIsLost is pynvml.NVMLError_GpuIsLost


def test_calls_before_init_are_uninitialized(tmp_path: Path) -> None:
    fake = FakeNvml(tmp_path, n=1)
    with pytest.raises(pynvml.NVMLError_Uninitialized) as e:
        fake.nvmlDeviceGetCount()
    assert nvml_code(e) == pynvml.NVML_ERROR_UNINITIALIZED
    fake.nvmlInit()
    fake.nvmlInit()  # reference counted, like NVML
    h = fake.nvmlDeviceGetHandleByIndex(0)
    fake.nvmlShutdown()
    assert fake.nvmlDeviceGetCount() == 1
    fake.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetName(h)


def test_enumeration_and_static_facts(nvml: FakeNvml) -> None:
    assert nvml.nvmlDeviceGetCount() == 2
    assert isinstance(nvml.nvmlSystemGetDriverVersion(), str)
    h = nvml.nvmlDeviceGetHandleByIndex(1)
    again = nvml.nvmlDeviceGetHandleByIndex(1)
    assert again != h and again is not h  # a new opaque handle per call, as in pynvml
    assert nvml.nvmlDeviceGetIndex(again) == nvml.nvmlDeviceGetIndex(h) == 1
    assert nvml.nvmlDeviceGetName(h) == H100.name
    uuid = nvml.nvmlDeviceGetUUID(h)
    assert uuid.startswith("GPU-")
    by_uuid = nvml.nvmlDeviceGetHandleByUUID(uuid)
    assert by_uuid != h and nvml.nvmlDeviceGetIndex(by_uuid) == 1
    assert nvml.nvmlDeviceGetCudaComputeCapability(h) == (9, 0)
    assert nvml.nvmlDeviceGetSupportedMemoryClocks(h) == [2619]
    clocks = nvml.nvmlDeviceGetSupportedGraphicsClocks(h, 2619)
    assert clocks[0] == 1980 and clocks[-1] == 345 and len(clocks) == 110
    assert nvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM) == 1980
    assert nvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM) == 2619
    assert nvml.nvmlDeviceGetPowerManagementLimitConstraints(h) == [200_000, 700_000]  # mW
    assert nvml.nvmlDeviceGetPowerManagementDefaultLimit(h) == 700_000
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetSupportedGraphicsClocks(h, 1234)


def test_bad_index_and_bad_handle_are_invalid_argument(nvml: FakeNvml) -> None:
    with pytest.raises(pynvml.NVMLError_InvalidArgument) as e:
        nvml.nvmlDeviceGetHandleByIndex(2)
    assert nvml_code(e) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetName(FakeHandle(0, owner=-1))
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetClockInfo(nvml.nvmlDeviceGetHandleByIndex(0), 99)


def test_units_are_mw_and_mj_ints(nvml: FakeNvml, clock: ManualClock) -> None:
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    p = nvml.nvmlDeviceGetPowerUsage(h)
    e0 = nvml.nvmlDeviceGetTotalEnergyConsumption(h)
    assert isinstance(p, int) and isinstance(e0, int)
    assert p == 70_000  # 70 W idle, in mW
    clock.advance(2.0)
    e1 = nvml.nvmlDeviceGetTotalEnergyConsumption(h)
    assert e1 - e0 == pytest.approx(140_000, abs=1)  # 70 W x 2 s, in mJ
    assert nvml.nvmlDeviceGetEnforcedPowerLimit(h) == 700_000
    assert nvml.nvmlDeviceGetPowerManagementLimit(h) == 700_000
    util = nvml.nvmlDeviceGetUtilizationRates(h)
    assert (util.gpu, util.memory) == (0, 0)
    assert isinstance(nvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU), int)
    assert nvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM) == 345
    assert nvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM) == 2619
    assert nvml.nvmlDeviceGetCurrentClocksEventReasons(h) == pynvml.nvmlClocksEventReasonGpuIdle


def test_busy_gpu_readings(nvml: FakeNvml, clock: ManualClock) -> None:
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlDeviceSetPowerManagementLimit(h, 300_000)
    nvml.sim_gpu(0).run_step(1e15, 0.0, "bf16")
    sm = nvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
    assert 345 < sm < 1980
    assert nvml.nvmlDeviceGetUtilizationRates(h).gpu == 100
    reasons = nvml.nvmlDeviceGetCurrentClocksEventReasons(h)
    assert reasons & pynvml.nvmlClocksEventReasonSwPowerCap
    assert not reasons & pynvml.nvmlClocksEventReasonGpuIdle


def test_setters_change_the_device(nvml: FakeNvml) -> None:
    h = nvml.nvmlDeviceGetHandleByIndex(1)
    nvml.nvmlDeviceSetGpuLockedClocks(h, 345, 1410)
    assert nvml.fake_get_locked_clocks(h) == (345, 1410)
    assert nvml.sim_gpu(1).locked_clocks_mhz() == (345, 1410)
    nvml.nvmlDeviceResetGpuLockedClocks(h)
    assert nvml.fake_get_locked_clocks(h) is None
    nvml.nvmlDeviceSetPowerManagementLimit(h, 450_000)
    assert nvml.nvmlDeviceGetEnforcedPowerLimit(h) == 450_000
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceSetPowerManagementLimit(h, 150_000)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceSetPowerManagementLimit(h, 701_000)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceSetGpuLockedClocks(h, 1500, 1000)
    assert nvml.nvmlDeviceGetEnforcedPowerLimit(h) == 450_000


def test_unimplemented_functions_raise_function_not_found(nvml: FakeNvml) -> None:
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        nvml.nvmlDeviceGetEccMode(nvml.nvmlDeviceGetHandleByIndex(0))
    with pytest.raises(AttributeError):
        nvml.not_a_pynvml_name  # noqa: B018


def test_faults_injected_by_another_instance(tmp_path: Path, clock: ManualClock) -> None:
    daemon_side = FakeNvml(tmp_path, n=2, clock=clock)
    daemon_side.nvmlInit()
    h0 = daemon_side.nvmlDeviceGetHandleByIndex(0)
    h1 = daemon_side.nvmlDeviceGetHandleByIndex(1)
    test_side = FakeNvml(tmp_path)  # n=None: attaches to the GPUs already there
    assert len(test_side.sim_gpus) == 2

    test_side.inject(1, lost=True)
    with pytest.raises(pynvml.NVMLError_GpuIsLost) as e:
        daemon_side.nvmlDeviceGetPowerUsage(h1)
    assert e.value.value == pynvml.NVML_ERROR_GPU_IS_LOST
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        daemon_side.nvmlDeviceGetHandleByIndex(1)
    assert daemon_side.nvmlDeviceGetPowerUsage(h0) > 0  # the other GPU is fine

    test_side.inject(0, no_energy_counter=True)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        daemon_side.nvmlDeviceGetTotalEnergyConsumption(h0)
    assert daemon_side.nvmlDeviceGetCudaComputeCapability(h0) == (6, 0)

    test_side.inject(0, no_permission=True)
    with pytest.raises(pynvml.NVMLError_NoPermission):
        daemon_side.nvmlDeviceSetGpuLockedClocks(h0, 345, 1000)
    with pytest.raises(pynvml.NVMLError_NoPermission):
        daemon_side.nvmlDeviceSetPowerManagementLimit(h0, 300_000)
    with pytest.raises(pynvml.NVMLError_NoPermission):
        daemon_side.nvmlDeviceResetGpuLockedClocks(h0)
    assert daemon_side.nvmlDeviceGetPowerUsage(h0) > 0  # readers still work

    test_side.clear_faults()
    assert daemon_side.nvmlDeviceGetPowerUsage(h1) > 0
    daemon_side.nvmlDeviceSetGpuLockedClocks(h0, 345, 1000)
    assert read_faults(tmp_path).gpus == {}


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        ("LIBRARY_NOT_FOUND", pynvml.NVMLError_LibraryNotFound),
        ("DRIVER_NOT_LOADED", pynvml.NVMLError_DriverNotLoaded),
        (pynvml.NVML_ERROR_NO_PERMISSION, pynvml.NVMLError_NoPermission),
    ],
)
def test_init_error(tmp_path: Path, code: int | str, cls: type[Exception]) -> None:
    FakeNvml(tmp_path, n=1).set_init_error(code)
    fake = FakeNvml(tmp_path)
    with pytest.raises(cls):
        fake.nvmlInit()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    fake.set_init_error(None)
    fake.nvmlInit()
    assert fake.nvmlDeviceGetCount() == 1


def test_code_written_for_pynvml_runs_unchanged(nvml: FakeNvml) -> None:
    def total_power_w(m: Any) -> float:
        out = 0.0
        for i in range(m.nvmlDeviceGetCount()):
            h = m.nvmlDeviceGetHandleByIndex(i)
            try:
                out += m.nvmlDeviceGetPowerUsage(h) / 1000.0
            except m.NVMLError as e:
                if e.value != m.NVML_ERROR_NOT_SUPPORTED:
                    raise
        return out

    assert total_power_w(nvml) == pytest.approx(140.0)


# --------------------------------------------------------------------------- as strict as the bindings


def test_unsigned_int_arguments_are_checked_as_ctypes_does(nvml: FakeNvml) -> None:
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(TypeError):
        nvml.nvmlDeviceSetPowerManagementLimit(h, 300_000.0)
    with pytest.raises(TypeError):
        nvml.nvmlDeviceSetGpuLockedClocks(h, 345, 1410.0)
    with pytest.raises(TypeError):
        nvml.nvmlDeviceGetHandleByIndex(0.0)
    with pytest.raises(TypeError):
        nvml.nvmlDeviceGetSupportedGraphicsClocks(h, 2619.0)
    with pytest.raises(TypeError):
        nvml.nvmlDeviceGetClockInfo(h, float(pynvml.NVML_CLOCK_SM))
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # -1 wraps to 4294967295 mW
        nvml.nvmlDeviceSetPowerManagementLimit(h, -1)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetHandleByIndex(-1)
    assert nvml.nvmlDeviceGetEnforcedPowerLimit(h) == 700_000  # nothing was written


def test_the_init_count_is_per_process_and_an_extra_shutdown_is_fine(tmp_path: Path) -> None:
    a = FakeNvml(tmp_path, n=1)
    b = FakeNvml(tmp_path)
    a.nvmlInit()
    assert b.nvmlDeviceGetCount() == 1  # one library per process: b is initialised too
    b.nvmlInit()
    a.nvmlShutdown()
    assert fake_process_init_count() == 1
    assert a.nvmlDeviceGetCount() == 1
    b.nvmlShutdown()
    b.nvmlShutdown()  # not an error, as in NVML
    assert fake_process_init_count() == 0
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        a.nvmlDeviceGetCount()


# --------------------------------------------------------------------------- the C stand-in's faults


def test_mig_reset_required_and_persistence_faults(tmp_path: Path, nvml: FakeNvml) -> None:
    h0, h1 = nvml.nvmlDeviceGetHandleByIndex(0), nvml.nvmlDeviceGetHandleByIndex(1)
    assert nvml.nvmlDeviceGetMigMode(h0) == [0, 0]
    assert nvml.nvmlDeviceGetPersistenceMode(h0) == pynvml.NVML_FEATURE_ENABLED
    other = FakeNvml(tmp_path)
    other.inject(0, mig=True, persistence_off=True)
    assert nvml.nvmlDeviceGetMigMode(h0) == [1, 1]
    assert nvml.nvmlDeviceGetPersistenceMode(h0) == pynvml.NVML_FEATURE_DISABLED
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceSetGpuLockedClocks(h0, 345, 1410)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetUtilizationRates(h0)
    assert nvml.nvmlDeviceGetPowerUsage(h0) > 0
    other.inject(1, reset_required=True)
    with pytest.raises(pynvml.NVMLError_ResetRequired):
        nvml.nvmlDeviceGetPowerUsage(h1)
    other.inject(1, no_locked_clocks=True, reset_required=False)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceResetGpuLockedClocks(h1)
    nvml.nvmlDeviceSetPowerManagementLimit(h1, 400_000)


def test_nvml_shut_down_under_the_process_mid_run(tmp_path: Path, nvml: FakeNvml) -> None:
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    FakeNvml(tmp_path).drop_init()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetPowerUsage(h)
    nvml.nvmlInit()  # what greend does on UNINITIALIZED
    assert nvml.nvmlDeviceGetPowerUsage(h) > 0  # once per drop, not again
    late = FakeNvml(tmp_path)
    late.nvmlInit()  # a drop made before this init does not apply to it
    assert late.nvmlDeviceGetCount() == 2


def test_slow_and_hung_calls(tmp_path: Path, nvml: FakeNvml) -> None:
    import threading
    import time

    h0, h1 = nvml.nvmlDeviceGetHandleByIndex(0), nvml.nvmlDeviceGetHandleByIndex(1)
    other = FakeNvml(tmp_path)
    other.set_slow(50)
    t0 = time.monotonic()
    nvml.nvmlDeviceGetPowerUsage(h0)
    assert time.monotonic() - t0 >= 0.05
    other.set_slow(0)

    other.set_hang("nvmlDeviceSetPowerManagementLimit", gpu=1, seconds=0.2)
    t0 = time.monotonic()
    nvml.nvmlDeviceSetPowerManagementLimit(h1, 500_000)
    assert time.monotonic() - t0 >= 0.2
    t0 = time.monotonic()
    nvml.nvmlDeviceSetPowerManagementLimit(h0, 500_000)  # other GPUs do not hang
    assert time.monotonic() - t0 < 0.2

    other.set_hang("nvmlDeviceGetPowerUsage", gpu=1)  # until cleared
    done = threading.Event()
    threading.Thread(target=lambda: (nvml.nvmlDeviceGetPowerUsage(h1), done.set()), daemon=True).start()
    assert not done.wait(0.3)
    assert nvml.nvmlDeviceGetPowerUsage(h0) > 0  # another thread's call on another GPU answers
    other.set_hang(None)
    assert done.wait(2.0)


def test_greend_over_the_strict_fake_recovers_and_refuses_mig(tmp_path: Path, clock: ManualClock) -> None:
    from greend.actuators.gpu import NvmlGpuBackend
    from greend.errors import NotSupported
    from greend.probes.nvml import NvmlProbe
    from greend.probes.nvml_device import NvmlUninitialized

    fake = FakeNvml(tmp_path, n=2, clock=clock)
    fake.inject(1, mig=True)
    probe = NvmlProbe(nvml=fake, source="sim")
    probe.open()
    backend = NvmlGpuBackend(probe)
    assert probe.is_mig(1) and not probe.is_mig(0)
    backend.set_power_limit_w(0, 450.4)  # W float -> int mW for NVML
    assert fake.nvmlDeviceGetEnforcedPowerLimit(fake.nvmlDeviceGetHandleByIndex(0)) == 450_400
    backend.set_locked_clocks_mhz(0, 345, 1410)
    with pytest.raises(NotSupported, match="MIG"):
        backend.set_power_limit_w(1, 400.0)
    fake.drop_init()
    with pytest.raises(NvmlUninitialized):  # every GPU answers UNINITIALIZED this tick
        probe.sample(0.0)
    assert [g.index for g in probe.sample(1.0).gpus] == [0, 1]  # initialised again
    probe.close()


def test_reorder_is_a_driver_reload_that_renumbers_the_gpus(tmp_path: Path, clock: ManualClock) -> None:
    nvml = FakeNvml(tmp_path / "sim", n=3, clock=clock)
    nvml.nvmlInit()
    old = nvml.nvmlDeviceGetHandleByIndex(0)
    uuids = [nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(3)]
    nvml.reorder([2, 0, 1])
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()  # NVML was shut down under this process
    nvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetUUID(old)  # a handle of the old numbering is stale
    now = [nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(3)]
    assert now == [uuids[2], uuids[0], uuids[1]]
    h = nvml.nvmlDeviceGetHandleByUUID(uuids[0])
    assert nvml.nvmlDeviceGetIndex(h) == 1
    with pytest.raises(ValueError):
        nvml.reorder([0, 0, 1])


def test_compute_processes_are_the_simulators_live_attached_pids(nvml: FakeNvml) -> None:
    import os
    import subprocess
    import sys

    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetComputeRunningProcesses(h) == []
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    nvml.sim_gpu(0).attach_process(os.getpid())
    nvml.sim_gpu(0).attach_process(gone.pid)  # exited: not listed, as the driver drops its context
    procs = nvml.nvmlDeviceGetComputeRunningProcesses(h)
    assert [p.pid for p in procs] == [os.getpid()] and procs[0].usedGpuMemory is None
    assert nvml.nvmlDeviceGetComputeRunningProcesses(nvml.nvmlDeviceGetHandleByIndex(1)) == []


def test_shutdown_writes_the_deferred_steps_and_a_new_init_defers_again(tmp_path: Path) -> None:
    """The daemon's steps on a simulated GPU wait in memory (run_steps(defer=True));
    nvmlShutdown writes them, later steps go straight to the file, and an nvmlInit after
    it lets them wait again."""
    fake = FakeNvml(tmp_path, n=1)
    fake.nvmlInit()
    g = fake.sim_gpu(0)

    def in_file() -> float:
        return float(json.loads(g.path.read_text())["energy_mj"])

    work = [(5e13, None, "bf16")]
    before = in_file()
    g.run_steps(work, defer=True)
    assert in_file() == before  # waiting in memory
    fake.nvmlShutdown()
    after_shutdown = in_file()
    assert after_shutdown > before
    g.run_steps(work, defer=True)  # a connection still closing: written at once
    assert in_file() > after_shutdown
    fake.nvmlInit()
    written = in_file()
    g.run_steps(work, defer=True)
    assert in_file() == written  # deferred again
    fake.nvmlShutdown()
    assert in_file() > written
