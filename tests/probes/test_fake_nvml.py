"""The fake pynvml: same names, units, return types and error classes as the real one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pynvml
import pytest

from greend.probes.fake_nvml import FakeHandle, FakeNvml, read_faults
from greend.probes.sim import H100
from tests.support import ManualClock


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
    assert nvml.nvmlDeviceGetHandleByIndex(1) == h
    assert nvml.nvmlDeviceGetName(h) == H100.name
    uuid = nvml.nvmlDeviceGetUUID(h)
    assert uuid.startswith("GPU-")
    assert nvml.nvmlDeviceGetHandleByUUID(uuid) == h
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
