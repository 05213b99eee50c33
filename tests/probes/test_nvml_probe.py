"""The NVML probe, on the fake NVML (simulated GPUs) and against the real pynvml."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pynvml
import pytest

from greend.actuators.gpu import NvmlGpuBackend
from greend.errors import DeviceLost, InvalidArgument, NoData, NoPermission, NotSupported, ProbeError
from greend.probes import REGISTRY, ProbeContext
from greend.probes.base import MeasuresProcesses, Probe, SampledEvery, ShowsClockCaps, SimulatesGpus
from greend.probes.fake_nvml import FakeNvml
from greend.probes.nvml import NVML_ERROR_MAP, NvmlProbe, translate_nvml_error
from greend.probes.nvml_device import DriverMismatch, NvmlUninitialized, ResetRequired
from greend.probes.sim import H100
from tests.support import ManualClock


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(10_000.0)


@pytest.fixture
def fake(tmp_path: Path, clock: ManualClock) -> FakeNvml:
    return FakeNvml(tmp_path, n=2, clock=clock, initial_energy_mj=123_456_789)


@pytest.fixture
def probe(fake: FakeNvml) -> NvmlProbe:
    p = NvmlProbe(nvml=fake, source="sim")
    p.open()
    return p


def by_index(probe: NvmlProbe, now_s: float) -> dict[int, Any]:
    return {g.index: g for g in probe.sample(now_s).gpus}


def test_is_a_probe_and_reads_static_facts(probe: NvmlProbe) -> None:
    assert isinstance(probe, Probe)
    assert isinstance(probe, ShowsClockCaps) and isinstance(probe, SimulatesGpus)
    assert not isinstance(probe, SampledEvery) and not isinstance(probe, MeasuresProcesses)
    assert probe.sim_gpu(0) is not None  # simulated GPUs behind the fake NVML
    gpus = by_index(probe, 0.0)
    assert sorted(gpus) == [0, 1]
    g = gpus[0]
    assert g.source == "sim" and g.name == H100.name and g.uuid.startswith("GPU-")
    assert g.energy_j == 0.0 and g.energy_method == "counter"  # counted from open()
    assert g.power_w == pytest.approx(70.0)
    assert g.sm_clock_max_mhz == 1980 and g.supported_sm_clocks_mhz[0] == 1980
    assert (g.power_limit_min_w, g.power_limit_max_w, g.power_limit_default_w) == (200, 700, 700)
    assert g.power_limit_w == 700
    assert g.compute_capability == (9, 0)
    assert g.util_gpu_pct == 0.0 and g.temperature_c is not None
    assert g.clock_cap_mhz is None  # no cap_lookup given
    info = probe.info()
    assert info.available and len(info.devices) == 2


def test_counter_energy_matches_the_simulator(probe: NvmlProbe, fake: FakeNvml, clock: ManualClock) -> None:
    truth0 = {i: fake.sim_gpu(i).energy_j() for i in (0, 1)}
    now = 0.0
    probe.sample(now)
    for k in range(20):
        fake.sim_gpu(0).run_step(3e14, 0.1 * (k % 5), "bf16")
        if k % 2:
            fake.sim_gpu(1).run_step(1e14, 0.6, "bf16")
        clock.advance(0.5)
        now += 0.5
        probe.sample(now)
    gpus = by_index(probe, now)
    for i in (0, 1):
        truth = fake.sim_gpu(i).energy_j() - truth0[i]
        assert gpus[i].energy_j == pytest.approx(truth, rel=1e-3)
        assert gpus[i].energy_method == "counter"
    assert gpus[0].energy_j > gpus[1].energy_j > 0


def test_pre_volta_gpu_integrates_power(tmp_path: Path, clock: ManualClock) -> None:
    fake = FakeNvml(tmp_path, n=2, clock=clock, background_load=[0.5, 0.0])
    fake.inject(0, no_energy_counter=True)
    probe = NvmlProbe(nvml=fake, source="sim")
    probe.open()
    power = fake.sim_gpu(0).instant_power_w()
    assert power > 2 * H100.idle_w
    now = 100.0
    for _ in range(10):
        probe.sample(now)
        clock.advance(0.25)
        now += 0.25
    g = by_index(probe, now)
    assert g[0].energy_method == "power_integration"
    assert g[0].compute_capability == (6, 0)
    assert g[0].energy_j == pytest.approx(power * 2.5, rel=1e-3)  # 10 intervals of 0.25 s
    assert g[1].energy_method == "counter"
    assert g[1].energy_j == pytest.approx(H100.idle_w * 2.5, rel=1e-3)


def test_trapezoid_bridges_a_ramp(tmp_path: Path, clock: ManualClock) -> None:
    fake = FakeNvml(tmp_path, n=1, clock=clock)
    fake.inject(0, no_energy_counter=True)
    probe = NvmlProbe(nvml=fake, source="sim")
    probe.open()
    probe.sample(0.0)  # 70 W
    fake.sim_gpu(0).set_background_load(1.0)  # 680 W from here on
    clock.advance(2.0)
    g = probe.sample(2.0).gpus[0]
    assert g.energy_j == pytest.approx(0.5 * (70.0 + 680.0) * 2.0, rel=1e-6)


@pytest.mark.parametrize("bogus_mw", [65_535_000, 0])
def test_a_power_read_no_gpu_draws_is_not_integrated(tmp_path: Path, clock: ManualClock, bogus_mw: int) -> None:
    """A GPU without an energy counter that reads 65,535 W (or 0 W) for a while: those
    reads were integrated as they came (125x the energy in 4 s; half of it lost at 0 W)
    and shown as its power. They are left out, the GPU with them (its energy is unknown
    there: the probe's only GPU, so the probe fails those ticks), and the reads around them
    bridge the gap."""

    class BogusPower:
        armed = False

        def __init__(self, inner: FakeNvml) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

        def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
            return bogus_mw if self.armed else int(self._inner.nvmlDeviceGetPowerUsage(handle))

    fake = FakeNvml(tmp_path, n=1, clock=clock, background_load=0.5)
    fake.inject(0, no_energy_counter=True)
    nvml = BogusPower(fake)
    probe = NvmlProbe(nvml=nvml, source="sim")
    probe.open()
    power = fake.sim_gpu(0).instant_power_w()
    shown = []
    for k in range(41):  # 10 s, 4 ticks a second; bogus from 2 s to 4 s
        nvml.armed = 8 <= k < 16
        if nvml.armed:
            with pytest.raises(ProbeError, match="no power reading"):
                probe.sample(k * 0.25)
            shown.append(None)
        else:
            shown.append(probe.sample(k * 0.25).gpus[0].power_w)
        clock.advance(0.25)
    assert probe.sample(10.0).gpus[0].energy_j == pytest.approx(power * 10.0, rel=1e-3)
    assert all(w is None for w in shown[8:16]) and all(w == pytest.approx(power) for w in shown[16:])


class CallCounter:
    """The fake NVML with a count of every call the probe makes, by name."""

    def __init__(self, nvml: FakeNvml) -> None:
        self._nvml = nvml
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._nvml, name)
        if not (name.startswith("nvml") and callable(attr)):
            return attr

        def counted(*args: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*args)

        return counted


def test_power_is_read_with_the_slow_fields_while_the_counter_works_and_every_tick_when_integrated(
    tmp_path: Path, clock: ManualClock
) -> None:
    fake = FakeNvml(tmp_path, n=2, clock=clock, background_load=0.5)
    fake.inject(1, no_energy_counter=True)
    nvml = CallCounter(fake)
    probe = NvmlProbe(nvml=nvml, source="sim")
    probe.open()
    nvml.calls.clear()
    now = 0.0
    for _ in range(20):  # 2 s at 10 Hz
        probe.sample(now)
        clock.advance(0.1)
        now += 0.1
    # gpu0 (counter): energy every tick, power with the slow fields (t = 0 s, 1 s);
    # gpu1 (integrating): its counter is NOT_SUPPORTED, so power every tick, and its counter
    # tried again at the first tick (then every COUNTER_RETRY_S, 60 s: not within these 2 s).
    assert nvml.calls["nvmlDeviceGetTotalEnergyConsumption"] == 20 + 1
    assert nvml.calls["nvmlDeviceGetPowerUsage"] == 2 + 20
    assert nvml.calls["nvmlDeviceGetTemperature"] == 2 * 2
    g = by_index(probe, now)
    assert g[0].power_w == pytest.approx(fake.sim_gpu(0).power_w(), rel=0.02)  # the last read stands
    assert g[1].energy_j == pytest.approx(fake.sim_gpu(1).instant_power_w() * 2.0, rel=1e-3)


def test_a_counter_that_stops_mid_run_hands_over_to_power_at_once(tmp_path: Path, clock: ManualClock) -> None:
    fake = FakeNvml(tmp_path, n=1, clock=clock, background_load=0.5)
    probe = NvmlProbe(nvml=fake, source="sim")
    probe.open()
    power = fake.sim_gpu(0).instant_power_w()
    probe.sample(0.0)
    clock.advance(0.3)
    probe.sample(0.3)  # between two power reads (they come once a second)
    counted = probe.sample(0.3).gpus[0].energy_j
    fake.inject(0, no_energy_counter=True)
    for k in range(1, 6):  # 0.4 .. 0.8 s: the first tick without the counter reads power
        clock.advance(0.1)
        probe.sample(0.3 + 0.1 * k)
    g = probe.sample(0.8).gpus[0]
    assert g.energy_method == "power_integration"
    # Integrated from the first tick without the counter (0.4 s) to 0.8 s.
    assert g.energy_j - counted == pytest.approx(power * 0.4, rel=1e-3)


def test_lost_gpu_is_dropped_and_the_other_goes_on(
    probe: NvmlProbe, fake: FakeNvml, clock: ManualClock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert sorted(by_index(probe, 0.0)) == [0, 1]
    FakeNvml(tmp_path).inject(1, lost=True)  # from "another process"
    with caplog.at_level(logging.ERROR, logger="greend.probes.nvml"):
        for t in (1.0, 2.0, 3.0):
            clock.advance(1.0)
            gpus = by_index(probe, t)
            assert sorted(gpus) == [0]
    assert gpus[0].energy_j == pytest.approx(3 * 70.0, rel=1e-3)
    lost_lines = [r for r in caplog.records if "gpu1 is lost" in r.getMessage()]
    assert len(lost_lines) == 1 and lost_lines[0].levelno == logging.ERROR
    assert list(probe.lost_gpus) == [1]
    info = probe.info()
    assert info.available and "lost: gpu1" in info.detail
    assert any("gpu1: LOST" in d for d in info.devices)
    with pytest.raises(DeviceLost):  # the GPU back end writes through the probe's devices
        NvmlGpuBackend(probe).set_power_limit_w(1, 300)


def test_all_gpus_lost_gives_empty_readings(probe: NvmlProbe, fake: FakeNvml) -> None:
    fake.inject(0, lost=True)
    fake.inject(1, lost=True)
    assert probe.sample(1.0).gpus == []
    assert not probe.info().available


def test_a_gpu_lost_before_open_is_reported(fake: FakeNvml) -> None:
    fake.inject(0, lost=True)
    probe = NvmlProbe(nvml=fake, source="sim")
    probe.open()
    assert [g.index for g in probe.sample(0.0).gpus] == [1]
    assert probe.lost_gpus.keys() == {0}


class _NoTemperature(FakeNvml):
    """A GPU model without a temperature sensor reading."""

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)


def test_unsupported_optional_fields_read_none(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    probe = NvmlProbe(nvml=_NoTemperature(tmp_path, n=1), source="sim")
    probe.open()
    with caplog.at_level(logging.WARNING, logger="greend.probes.nvml"):
        for t in (0.0, 1.0):
            g = probe.sample(t).gpus[0]
    assert g.temperature_c is None  # NOT_SUPPORTED: quietly None
    assert g.util_gpu_pct is None and g.util_mem_pct is None  # an error: None, logged once
    assert g.power_w is not None and g.sm_clock_mhz is not None
    assert len([r for r in caplog.records if "Utilization" in r.getMessage()]) == 1
    assert "nvmlDeviceGetUtilizationRates" in probe.device_errors[0]


def test_setters_map_errors(probe: NvmlProbe, fake: FakeNvml) -> None:
    """The probe only reads; the GPU back end writes over the same NVML devices."""
    assert not any(hasattr(probe, n) for n in ("set_locked_clocks_mhz", "reset_locked_clocks", "set_power_limit_w"))
    gpus = NvmlGpuBackend(probe)
    gpus.set_locked_clocks_mhz(0, 345, 1500)
    assert fake.fake_get_locked_clocks(fake.nvmlDeviceGetHandleByIndex(0)) == (345, 1500)
    gpus.reset_locked_clocks(0)
    gpus.set_power_limit_w(1, 400.0)
    assert by_index(probe, 0.0)[1].power_limit_w == 400.0
    fake.inject(0, no_permission=True)
    with pytest.raises(NoPermission) as e:
        gpus.set_locked_clocks_mhz(0, 345, 1200)
    assert isinstance(e.value.__cause__, pynvml.NVMLError_NoPermission)
    with pytest.raises(NoPermission):
        gpus.set_power_limit_w(0, 300.0)
    with pytest.raises(InvalidArgument):  # INVALID_ARGUMENT: a ProbeError of its own type
        gpus.set_power_limit_w(1, 50.0)


class SetsDuringTheRead(CallCounter):
    """A setter (the IPC thread, in the daemon) runs while the tick reads the limit."""

    def __init__(self, nvml: FakeNvml) -> None:
        super().__init__(nvml)
        self.during_read: Any = None

    def __getattr__(self, name: str) -> Any:
        attr = super().__getattr__(name)
        if name != "nvmlDeviceGetEnforcedPowerLimit" or self.during_read is None:
            return attr

        def read_then_set(*args: Any) -> Any:
            value = attr(*args)  # the old limit is in hand ...
            setter, self.during_read = self.during_read, None
            setter()  # ... when the new one is set
            return value

        return read_then_set


def test_a_setting_changed_during_the_slow_read_is_read_again_next_tick(tmp_path: Path, clock: ManualClock) -> None:
    nvml = SetsDuringTheRead(FakeNvml(tmp_path, n=1, clock=clock))
    probe = NvmlProbe(nvml=nvml, source="sim")
    probe.open()
    assert by_index(probe, 0.0)[0].power_limit_w == 700
    gpus = NvmlGpuBackend(probe)
    nvml.during_read = lambda: gpus.set_power_limit_w(0, 450.0)
    gpus.set_locked_clocks_mhz(0, 345, 1500)  # makes the slow fields due at once
    assert by_index(probe, 0.1)[0].power_limit_w == 700  # read before the set landed
    # Not a second later: the very next tick reads it again.
    assert by_index(probe, 0.2)[0].power_limit_w == 450


def test_cap_lookup_fills_clock_cap(fake: FakeNvml) -> None:
    caps = {0: 1410.0}
    probe = NvmlProbe(nvml=fake, source="sim", cap_lookup=caps.get)
    probe.open()
    gpus = by_index(probe, 0.0)
    assert gpus[0].clock_cap_mhz == 1410.0 and gpus[1].clock_cap_mhz is None
    probe.use_cap_lookup({1: 1305.0}.get)  # what the control loop does once it has a Controller
    gpus = by_index(probe, 0.1)
    assert gpus[0].clock_cap_mhz is None and gpus[1].clock_cap_mhz == 1305.0


def test_init_failure_is_no_data_with_a_clear_message(fake: FakeNvml) -> None:
    fake.set_init_error("DRIVER_NOT_LOADED")
    probe = NvmlProbe(nvml=fake)
    with pytest.raises(NoData, match="no NVML on this node: Driver Not Loaded") as e:
        probe.open()
    assert "install the NVIDIA driver" in str(e.value)
    assert isinstance(e.value.__cause__, pynvml.NVMLError_DriverNotLoaded)
    info = probe.info()
    assert not info.available and "Driver Not Loaded" in info.detail
    assert info.fix and "nvidia-ml-py" in info.fix


def test_real_pynvml_without_a_driver_is_no_data() -> None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver")
    probe = NvmlProbe()  # imports the real pynvml
    with pytest.raises(NoData, match="no NVML on this node"):
        probe.open()
    assert not probe.info().available


def test_one_error_table() -> None:
    for code, (name, _cls) in NVML_ERROR_MAP.items():
        assert getattr(pynvml, name) == code
    cases = {
        pynvml.NVML_ERROR_INVALID_ARGUMENT: InvalidArgument,
        pynvml.NVML_ERROR_NOT_SUPPORTED: NotSupported,
        pynvml.NVML_ERROR_NO_PERMISSION: NoPermission,
        pynvml.NVML_ERROR_GPU_IS_LOST: DeviceLost,
        pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: NoData,
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED: NoData,
    }
    for code, cls in cases.items():
        err = translate_nvml_error(pynvml.NVMLError(code), "gpu0 call")
        assert type(err) is cls and "gpu0 call" in str(err)
    assert type(translate_nvml_error(pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN), "x")) is ProbeError


@pytest.mark.parametrize(
    ("code", "cls", "fix"),
    [
        (1, NvmlUninitialized, "initialises it again"),
        (16, ResetRequired, "nvidia-smi -r"),
        (18, DriverMismatch, "reboot"),
        (19, ProbeError, "retry"),
        (8, ProbeError, "PCIe power cables"),
        (10, ProbeError, "transient"),
        (999, ProbeError, "transient"),
    ],
)
def test_codes_with_a_name_and_a_fix(code: int, cls: type[ProbeError], fix: str) -> None:
    err = translate_nvml_error(pynvml.NVMLError(code), "gpu3 nvmlDeviceGetPowerUsage")
    assert type(err) is cls
    assert NVML_ERROR_MAP[code][0] in str(err) and fix in str(err)
    assert issubclass(ResetRequired, DeviceLost)  # the GPU is out until it is reset


def test_a_non_nvml_exception_fails_only_its_gpu(fake: FakeNvml) -> None:
    probe = NvmlProbe(nvml=fake, source="sim")
    probe.open()
    real = fake.nvmlDeviceGetTotalEnergyConsumption

    def broken(handle: object) -> int:
        if fake.nvmlDeviceGetIndex(handle) == 1:
            raise TypeError("wrong type")  # what ctypes raises for a float
        return real(handle)

    fake.nvmlDeviceGetTotalEnergyConsumption = broken  # type: ignore[method-assign]
    gpus = probe.sample(0.0).gpus
    assert 1 not in [g.index for g in gpus] and len(gpus) == fake.nvmlDeviceGetCount() - 1
    assert "TypeError" in probe.device_errors[1]["sample"]


def test_sample_before_open_and_close_twice(fake: FakeNvml) -> None:
    probe = NvmlProbe(nvml=fake, source="sim")
    with pytest.raises(ProbeError, match="before open"):
        probe.sample(0.0)
    probe.open()
    probe.close()
    probe.close()


def test_registered_sim_probe_drives_the_nvml_path(tmp_path: Path) -> None:
    import greend.probes.nvml
    import greend.probes.sim  # noqa: F401  (registers "sim")

    ctx = ProbeContext(sim_gpus=2, sim_dir=tmp_path, sim_params={"background_load": 0.25})
    sim_probe = REGISTRY["sim"].factory(ctx)
    assert isinstance(sim_probe, NvmlProbe) and sim_probe.name == "sim"
    sim_probe.open()
    gpus = sim_probe.sample(0.0).gpus
    assert [g.source for g in gpus] == ["sim", "sim"]
    assert gpus[0].power_w is not None and gpus[0].power_w > H100.idle_w
    gpu = sim_probe.sim_gpu(1)
    assert gpu is not None and gpu.index == 1
    assert REGISTRY["sim"].default is False and REGISTRY["nvml"].default is True

    real = REGISTRY["nvml"].factory(ProbeContext(nvml_module=FakeNvml(tmp_path)))
    assert isinstance(real, NvmlProbe) and real.sim_gpu(0) is None


def test_gpus_renumbered_by_a_driver_reload_are_matched_by_uuid(tmp_path: Path, clock: ManualClock) -> None:
    """A driver reload numbers the three GPUs differently (NVML shut down under greend,
    old handles stale): each GPU's energy and greend's settings follow its UUID to its
    new index, never the old index to another GPU."""
    from greend.actuators.controller import Controller
    from greend.policies.base import UNCAPPED, Setting

    fake = FakeNvml(tmp_path / "sim", n=3, clock=clock, background_load=[0.9, 0.0, 0.4])
    probe = NvmlProbe(nvml=fake, source="sim")
    probe.open()
    ctl = Controller(tmp_path / "state", NvmlGpuBackend(probe))
    probe.use_cap_lookup(ctl.clock_cap_mhz)
    probe.sample(0.0)
    ctl.apply_gpu(0, Setting(clock_cap_mhz=1500, power_limit_w=450.0), "job-1")
    clock.advance(10.0)
    before = {g.uuid: g for g in probe.sample(10.0).gpus}
    uuid_of = {g.index: g.uuid for g in before.values()}

    fake.reorder([2, 0, 1])  # NVML's gpu0 is the old gpu2, gpu1 the old gpu0, gpu2 the old gpu1
    with pytest.raises(NvmlUninitialized):
        probe.sample(11.0)  # every GPU answers UNINITIALIZED: initialised again, enumerated again
    clock.advance(10.0)
    after = {g.uuid: g for g in probe.sample(21.0).gpus}
    assert {u: g.index for u, g in after.items()} == {uuid_of[2]: 0, uuid_of[0]: 1, uuid_of[1]: 2}
    assert probe.lost_gpus == {}
    for u, g in after.items():  # each counter goes on from its own GPU's energy
        assert g.energy_j > before[u].energy_j
    busy, idle = after[uuid_of[0]], after[uuid_of[1]]
    assert busy.energy_j - before[uuid_of[0]].energy_j > idle.energy_j - before[uuid_of[1]].energy_j
    # greend's cap went with its GPU (UUID ...0, gpu1 now), not to the new gpu0
    assert ctl.current(1) == Setting(clock_cap_mhz=1500, power_limit_w=450.0)
    assert ctl.current(0) == UNCAPPED
    assert after[uuid_of[0]].clock_cap_mhz == 1500 and after[uuid_of[2]].clock_cap_mhz is None
    assert ctl.restore_all().ok
    assert fake.sim_gpu(1).locked_clocks_mhz() is None and fake.sim_gpu(1).power_limit_w() == 700.0


def test_a_gpu_lost_then_back_at_another_index_is_found_by_uuid(tmp_path: Path, clock: ManualClock) -> None:
    fake = FakeNvml(tmp_path / "sim", n=2, clock=clock)
    probe = NvmlProbe(nvml=fake, source="sim")
    probe.open()
    uuids = [g.uuid for g in probe.sample(0.0).gpus]
    fake.inject(1, lost=True)
    probe.sample(1.0)
    assert set(probe.lost_gpus) == {1}
    fake.inject(1, lost=False)
    fake.reorder([1, 0])
    with pytest.raises(NvmlUninitialized):
        probe.sample(2.0)
    gpus = {g.index: g.uuid for g in probe.sample(10.0).gpus}
    assert gpus == {0: uuids[1], 1: uuids[0]} and probe.lost_gpus == {}


def test_a_gpu_lost_for_a_moment_keeps_the_energy_of_the_gap(tmp_path: Path, clock: ManualClock) -> None:
    """GPU_IS_LOST for a moment, no reset: its counter ran on. The GPU was taken back from
    a new baseline and the ~5 s until it was looked for again were lost (half its energy
    in a real 10 s run; 5 % here). Its counter is read on from where it was; one that a reset set back
    to 0 is a new baseline (the next test's glitches, and the stub's resets)."""
    fake = FakeNvml(tmp_path / "sim", n=1, clock=clock, background_load=0.5)
    probe = NvmlProbe(nvml=fake, source="sim")
    probe.open()
    truth0 = fake.sim_gpu(0).energy_j()
    for k in range(1, 41):  # 10 s at 4 ticks a second; lost from 2 s to 2.25 s
        fake.inject(0, lost=k == 8)
        clock.advance(0.25)
        probe.sample(k * 0.25)
    truth = fake.sim_gpu(0).energy_j() - truth0
    g = by_index(probe, 10.0)[0]
    assert probe.lost_gpus == {} and g.energy_j == pytest.approx(truth, rel=0.001), (g.energy_j, truth)


class GlitchingCounter:
    """A FakeNvml whose energy counter answers ``glitch(true_mJ)`` on GPU 0 when ``armed``
    (once): a read of 0, or one that went back, as real nodes show now and then."""

    def __init__(self, inner: FakeNvml) -> None:
        self._inner = inner
        self.armed: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        raw = int(self._inner.nvmlDeviceGetTotalEnergyConsumption(handle))
        if self.armed is not None and self._inner.nvmlDeviceGetUUID(handle) == self._inner.sim_gpu(0).uuid:
            raw, self.armed = self.armed(raw), None
        return raw


def _glitching(fake: FakeNvml) -> tuple[GlitchingCounter, NvmlProbe, float]:
    """A probe over ``fake`` behind a GlitchingCounter, opened and read once at 0 s, and
    GPU 0's energy then (the truth's start)."""
    nvml = GlitchingCounter(fake)
    probe = NvmlProbe(nvml=nvml, source="sim")
    probe.open()
    truth0 = fake.sim_gpu(0).energy_j()
    probe.sample(0.0)
    return nvml, probe, truth0


@pytest.mark.parametrize(
    "glitch", [lambda mj: 0, lambda mj: mj - 1_000_000, lambda mj: mj + 10**12], ids=["zero", "back", "jump"]
)
def test_one_bad_read_of_the_energy_counter_loses_an_interval_at_most(
    fake: FakeNvml, clock: ManualClock, glitch: Any
) -> None:
    """One read of 0, one that went back 1 kJ, or one far ahead of what the GPU can
    draw: the energy booked stays within an interval of the truth; the counter's whole
    count since the driver loaded (123 kJ here) is never booked."""
    nvml, probe, truth0 = _glitching(fake)
    now = 0.0
    for k in range(20):
        fake.sim_gpu(0).run_step(3e14, 0.2, "bf16")
        clock.advance(0.5)
        now += 0.5
        if k == 8:
            nvml.armed = glitch
        probe.sample(now)
    truth = fake.sim_gpu(0).energy_j() - truth0
    booked = by_index(probe, now)[0].energy_j
    per_interval = truth / 20
    assert truth - 2.5 * per_interval <= booked <= truth * 1.001, (booked, truth)


@pytest.mark.parametrize(
    ("glitch", "reads"), [(lambda mj: mj + 500_000, 1), (lambda mj: mj - 1_000_000, 4)], ids=["ahead", "low"]
)
def test_a_counter_read_the_probe_takes_back_is_not_booked_twice_by_the_ledger(
    fake: FakeNvml, clock: ManualClock, glitch: Any, reads: int
) -> None:
    """The probe takes back what a glitching counter read booked (500 J ahead, or a run of
    reads 1 kJ low): its count falls within one opening of the GPU. The daemon's ledger
    read that fall as the probe opened again and booked the whole count once more (a
    red-team's 9,300 J became 19,436 J in a second). Fed as the daemon feeds it, the
    ledger now ends within an interval or two of the truth, and its series never falls."""
    from greend.jobs.ledger import Ledger

    nvml, probe, truth0 = _glitching(fake)
    ledger = Ledger()
    now, series = 0.0, []
    for k in range(40):
        fake.sim_gpu(0).run_step(3e14, 0.2, "bf16")
        clock.advance(0.5)
        now += 0.5
        nvml.armed = glitch if 8 <= k < 8 + reads else None
        for g in probe.sample(now).gpus:
            ledger.record(f"gpu{g.index}", now, g.energy_j, source=g.uuid, epoch=g.energy_epoch)
        series.append(ledger.total_j("gpu0"))
    truth = fake.sim_gpu(0).energy_j() - truth0
    assert series == sorted(series)
    assert truth - 2.5 * truth / 40 <= ledger.total_j("gpu0") <= truth * 1.001, (ledger.total_j("gpu0"), truth)


@pytest.mark.parametrize("low_reads", [2, 5, 20])
def test_a_counter_that_reads_low_for_several_reads_books_the_truth(
    fake: FakeNvml, clock: ManualClock, low_reads: int
) -> None:
    """The counter of an idle GPU (tens of watts) reads 1 kJ low for several reads, then
    right again. The reads after the first low one were booked from it, and the read back
    up booked the 1 kJ as energy (1,133 J where the GPU drew 140 J, in a red-team's run of
    5 low reads). Those reads are taken back once the counter is back above the read
    before the glitch."""
    nvml, probe, truth0 = _glitching(fake)
    now = 0.0
    for k in range(40):
        clock.advance(0.5)
        now += 0.5
        nvml.armed = (lambda mj: mj - 1_000_000) if 8 <= k < 8 + low_reads else None
        probe.sample(now)
    truth = fake.sim_gpu(0).energy_j() - truth0
    booked = by_index(probe, now)[0].energy_j
    assert truth - 2.5 * truth / 40 <= booked <= truth * 1.001, (booked, truth)


def test_on_a_real_node_a_glitch_is_known_by_its_time_not_its_reads() -> None:
    """With read times (real NVML, 10 reads a second), a counter 1 kJ low for 4 s (40
    reads) was a glitch: the 30-read limit is for reads without times. Its way back
    up is booked only as far as the GPU can draw since the glitch began."""
    from greend.probes._nvml_state import TrackedGpu

    gpu = TrackedGpu(index=0, handle=None, name="H100", uuid="GPU-x", energy_method="counter")
    gpu.power_limit_max_w = 700.0
    t, mj = 100.0, 50_000_000
    gpu.book_counter(mj, "gpu0", t)
    for k in range(1, 51):  # 100 W: 10 J a read
        t, mj = t + 0.1, mj + 10_000
        gpu.book_counter(mj - (1_000_000 if 5 <= k < 45 else 0), "gpu0", t)
    assert gpu.energy_j == pytest.approx(500.0)


def test_a_reset_stays_a_new_baseline_after_its_counter_passes_the_value_before_it() -> None:
    """A reset (the counter from 0, staying below): after GLITCH_S its reads are never
    taken back, though the counter passes the value before the reset later on."""
    from greend.probes._nvml_state import GLITCH_S, TrackedGpu

    gpu = TrackedGpu(index=0, handle=None, name="H100", uuid="GPU-x", energy_method="counter")
    gpu.power_limit_max_w = 700.0
    gpu.book_counter(50_000_000, "gpu0", 0.0)
    gpu.book_counter(50_300_000, "gpu0", 1.0)  # 300 J
    gpu.book_counter(0, "gpu0", 2.0)  # a reset
    t, mj = 2.0, 0
    while mj <= 50_300_000:  # 300 J a second until past the value before it
        t, mj = t + 1.0, mj + 300_000
        gpu.book_counter(mj, "gpu0", t)
    assert t - 2.0 > GLITCH_S and gpu.energy_j == pytest.approx(300.0 + mj / 1000.0)


def test_on_a_real_node_a_jump_beyond_what_the_gpu_can_draw_is_not_booked() -> None:
    """With read times (real NVML), a step forward of more than twice the highest power
    limit over the interval is not energy: not booked; the reads after it go on."""
    from greend.probes._nvml_state import TrackedGpu

    gpu = TrackedGpu(index=0, handle=None, name="H100", uuid="GPU-x", energy_method="counter")
    gpu.power_limit_max_w = 700.0
    gpu.book_counter(5_000_000, "gpu0", 100.0)
    gpu.book_counter(5_350_000, "gpu0", 101.0)  # 350 J in 1 s: booked
    gpu.book_counter(9_000_000_000, "gpu0", 102.0)  # 9 MJ in 1 s: not
    gpu.book_counter(9_000_400_000, "gpu0", 103.0)  # the counter goes on from there
    assert gpu.energy_j == pytest.approx(350.0 + 400.0)


class FailingTemperature(GlitchingCounter):
    """The fake NVML whose temperature read answers UNKNOWN while ``failing``."""

    failing = True

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        if self.failing:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
        return int(self._inner.nvmlDeviceGetTemperature(handle, sensor))


def test_an_error_of_one_field_is_shown_until_the_call_answers_again(fake: FakeNvml, clock: ManualClock) -> None:
    """A temperature read that fails (NVML_ERROR_UNKNOWN, as real nodes answer now and then)
    is listed among the GPU's errors while it fails, and no longer once it answers."""

    nvml = FailingTemperature(fake)
    probe = NvmlProbe(nvml=nvml, source="sim")
    probe.open()
    probe.sample(0.0)
    assert "nvmlDeviceGetTemperature" in probe.device_errors[0]
    nvml.failing = False
    clock.advance(5.0)
    probe.sample(5.0)
    assert "nvmlDeviceGetTemperature" not in probe.device_errors.get(0, {})
    assert by_index(probe, 10.0)[0].temperature_c is not None


def test_an_error_that_comes_and_goes_or_counts_seconds_is_logged_once_a_while(
    fake: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    """A read that fails every other tick (real nodes answer UNKNOWN or TIMEOUT now and then)
    was logged at every failure after an answer: 66 ERROR lines in 20 s. And a hung GPU's
    error names the seconds it has hung, so each second's line was a new one: one line a
    second for good. The same error, numbers aside, is logged again after LOG_AGAIN_S,
    with the count of its repeats."""
    from greend.probes._nvml_state import LOG_AGAIN_S, TrackedGpu

    nvml = FailingTemperature(fake)
    probe = NvmlProbe(nvml=nvml, source="sim")
    probe.open()
    with caplog.at_level(logging.WARNING, logger="greend.probes.nvml"):
        for k in range(20):
            nvml.failing = k % 2 == 0
            probe.sample(float(k))
            probe._gpus[0].slow_at_s = float("-inf")  # the temperature read every tick
    assert len([r for r in caplog.records if "gpu0 nvmlDeviceGetTemperature" in r.getMessage()]) == 1
    gpu = TrackedGpu(index=1, handle=None, name="H100", uuid="GPU-y", energy_method="counter")
    lines = [gpu.should_log("sample", f"gpu1 not called: hung (for {s} s)", float(s)) for s in range(5, 65)]
    assert [x for x in lines if x is not None] == ["gpu1 not called: hung (for 5 s)"]
    again = gpu.should_log("sample", "gpu1 not called: hung (for 305 s)", 5.0 + LOG_AGAIN_S)
    assert again is not None and "(and 59 more like it in the last 300 s)" in again
    assert gpu.should_log("sample", "gpu1: GPU is lost", 306.0) is not None  # another error: at once


def test_a_counter_that_comes_back_is_taken_again_from_a_new_baseline(tmp_path: Path, clock: ManualClock) -> None:
    """A transient NOT_SUPPORTED from the energy counter does not leave the GPU on power
    integration for good: the counter is tried again every COUNTER_RETRY_S and, once it
    answers, the energy goes on from it with nothing counted twice."""
    from greend.probes.nvml import COUNTER_RETRY_S

    fake = FakeNvml(tmp_path, n=1, clock=clock, background_load=0.5)
    probe = NvmlProbe(nvml=fake, source="sim")
    probe.open()
    power = fake.sim_gpu(0).instant_power_w()
    probe.sample(0.0)
    fake.inject(0, no_energy_counter=True)
    t = 0.0
    while t < COUNTER_RETRY_S + 2.0:  # a tick a second, the counter gone
        clock.advance(1.0)
        t += 1.0
        g = probe.sample(t).gpus[0]
    assert g.energy_method == "power_integration"
    fake.inject(0, no_energy_counter=False)  # back at t = 62: the next retry is at 121
    methods = {}
    while t < 2 * COUNTER_RETRY_S + 5:
        clock.advance(1.0)
        t += 1.0
        g = probe.sample(t).gpus[0]
        methods[t] = g.energy_method
    assert methods[2 * COUNTER_RETRY_S] == "power_integration"  # (not before its retry)
    assert methods[2 * COUNTER_RETRY_S + 1] == "counter"  # (the retry finds it)
    # From 0 s to now at a steady draw: the counter's part and power's part add up to it
    # (the first tick without the counter read power first: one tick's energy is lost).
    assert g.energy_j == pytest.approx(power * t, rel=0.03)
    assert g.energy_j <= power * t * 1.001


def test_a_counter_not_supported_at_open_is_tried_again(tmp_path: Path, clock: ManualClock) -> None:
    """NOT_SUPPORTED at open (a driver still coming up) is not for good either."""
    from greend.probes.nvml import COUNTER_RETRY_S

    fake = FakeNvml(tmp_path, n=1, clock=clock, background_load=0.5)
    fake.inject(0, no_energy_counter=True)
    probe = NvmlProbe(nvml=fake, source="sim")
    probe.open()
    assert probe.sample(0.0).gpus[0].energy_method == "power_integration"
    fake.inject(0, no_energy_counter=False)
    t = 0.0
    while t < COUNTER_RETRY_S + 2:
        clock.advance(1.0)
        t += 1.0
        g = probe.sample(t).gpus[0]
    assert g.energy_method == "counter"


class FailingCounter(GlitchingCounter):
    """The fake NVML whose energy counter on GPU 1 answers ``code`` while ``failing``."""

    failing, code = True, pynvml.NVML_ERROR_UNKNOWN

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        if self.failing and self._inner.nvmlDeviceGetUUID(handle) == self._inner.sim_gpu(1).uuid:
            raise pynvml.NVMLError(self.code)
        return int(self._inner.nvmlDeviceGetTotalEnergyConsumption(handle))


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_UNKNOWN, pynvml.NVML_ERROR_TIMEOUT], ids=["unknown", "timeout"])
def test_a_gpu_whose_reads_keep_failing_is_listed_as_failing_not_dropped(
    fake: FakeNvml, clock: ManualClock, code: int
) -> None:
    """A GPU whose energy counter keeps answering UNKNOWN or TIMEOUT is left out of the
    readings; ``greenctl status`` listed only the other GPUs, with no word of it. Its state
    is ``failing``, with the error, until a read succeeds."""
    nvml = FailingCounter(fake)
    nvml.code, nvml.failing = code, False
    probe = NvmlProbe(nvml=nvml, source="sim")
    probe.open()
    assert [g.index for g in probe.sample(0.0).gpus] == [0, 1]
    nvml.failing = True  # (mid-run)
    for t in (1.0, 2.0):
        clock.advance(1.0)
        assert [g.index for g in probe.sample(t).gpus] == [0]
    states = {s["index"]: s for s in probe.gpu_states()}
    assert states[0]["state"] == "ok" and states[1]["state"] == "failing"
    assert "nvmlDeviceGetTotalEnergyConsumption" in states[1]["detail"]
    nvml.failing = False
    clock.advance(1.0)
    assert [g.index for g in probe.sample(3.0).gpus] == [0, 1]
    assert [s["state"] for s in probe.gpu_states()] == ["ok", "ok"]


class FailingPower(GlitchingCounter):
    """The fake NVML whose power read on GPU 1 answers UNKNOWN while ``failing``."""

    failing = False

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        if self.failing and self._inner.nvmlDeviceGetUUID(handle) == self._inner.sim_gpu(1).uuid:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
        return int(self._inner.nvmlDeviceGetPowerUsage(handle))


def test_a_gap_in_the_power_of_a_gpu_without_an_energy_counter_is_spread_over_the_gap(
    fake: FakeNvml, clock: ManualClock
) -> None:
    """A GPU without an energy counter integrates its power. Its power read failed for 10 s:
    the GPU stayed in the readings with its energy flat, and the whole gap's energy was
    booked in the tick after it (a job that ended in the gap got none of it, the next one
    all). It is now left out while power fails, so the ledger spreads the bridged energy
    over the gap, as for a counter read that failed."""
    from greend.jobs.ledger import Ledger

    for i in (0, 1):
        fake.inject(i, no_energy_counter=True)
    nvml = FailingPower(fake)
    probe = NvmlProbe(nvml=nvml, source="sim")
    probe.open()
    ledger = Ledger()
    for k in range(25):
        nvml.failing = 5 <= k < 15
        readings = probe.sample(float(k))
        assert [g.index for g in readings.gpus] == ([0] if nvml.failing else [0, 1])
        for g in readings.gpus:
            ledger.record(f"gpu{g.index}", float(k), g.energy_j)
        clock.advance(1.0)
    states = probe.gpu_states()
    assert [s["state"] for s in states] == ["ok", "ok"]
    # The same draw on both GPUs (the simulator's idle power): gpu1's energy in the gap,
    # and in a window that ends inside it, matches gpu0's.
    for t0, t1 in ((5.0, 15.0), (2.0, 9.0), (14.0, 20.0)):
        e0, e1 = ledger.energy_between("gpu0", t0, t1), ledger.energy_between("gpu1", t0, t1)
        assert e0 is not None and e1 is not None and e0 > 0
        assert e1 == pytest.approx(e0, rel=0.05), (t0, t1)


def _tracked(power_limit_max_w: float = 700.0) -> Any:
    from greend.probes._nvml_state import TrackedGpu

    return TrackedGpu(0, None, "H100", "GPU-0", "counter", power_limit_max_w=power_limit_max_w)


def test_a_counter_that_stalls_then_catches_up_books_the_stall(caplog: pytest.LogCaptureFixture) -> None:
    """A GPU at 300 W whose counter reads one value for 8 s, then the true one (real NVML,
    10 reads a second, no power read at hand): the catch-up is what the GPU drew over the
    stall, checked against the time since the counter last moved (before: against the
    second since the read before, and the whole 2.4 kJ dropped as more than it can draw)."""
    gpu = _tracked()
    true_mj = 0
    for k in range(200):  # 10 reads a second, as the daemon's tick
        true_mj = 30_000 * k
        shown = 30_000 * 50 if 50 <= k < 132 else true_mj  # stalled from 5.0 s to 13.1 s
        gpu.account_energy(lambda v=shown: v, "gpu0", None, k / 10.0, real=True)
    assert gpu.energy_j == pytest.approx(true_mj / 1000.0)
    assert "jumped" not in caplog.text


def test_a_frozen_counter_hands_over_to_power_and_comes_back_once_it_moves(caplog: pytest.LogCaptureFixture) -> None:
    """A counter frozen while the GPU draws 300 W (real NVML): after 5 s without a move it is
    called frozen, its span booked from the power read and the energy integrated from power
    (before: 0 J booked, with no word); the counter is taken again once it moves."""
    import greend.probes._nvml_state as st

    gpu = _tracked()
    gpu.power_w = 300.0
    caplog.set_level(logging.WARNING)
    for t in range(30):  # frozen at 0.6 MJ from t = 2
        gpu.account_energy(lambda t=t: 300_000 * min(t, 2), "gpu0", 300.0, float(t), real=True)
    assert gpu.energy_method == "power_integration"
    assert "has not moved for 5 s while the GPU draws 300 W" in caplog.text
    assert gpu.energy_j == pytest.approx(300.0 * 29, rel=0.01)
    t_back = 29 + st.COUNTER_RETRY_S
    for t in range(30, int(t_back) + 5):  # the counter moves again (from where it froze)
        gpu.account_energy(lambda t=t: 600_000 + 300_000 * (t - 29), "gpu0", 300.0, float(t), real=True)
    assert gpu.energy_method == "counter" and "works again" in caplog.text
    assert gpu.energy_j == pytest.approx(300.0 * (int(t_back) + 4), rel=0.01)
