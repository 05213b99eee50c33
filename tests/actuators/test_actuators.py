"""The Controller over simulated GPUs (fake NVML) and a fake powercap tree."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
import pytest

from greend.actuators.controller import Controller
from greend.actuators.gpu import NvmlGpuBackend
from greend.actuators.rapl import RaplBackend
from greend.actuators.state import STATE_FILE
from greend.errors import ActuatorError, DeviceLost, KnobError, NoPermission, ProbeError, StateError
from greend.probes.fake_nvml import FakeNvml
from greend.probes.fake_sysfs import make_standard_tree
from greend.probes.nvml import NvmlProbe
from greend.settings import UNCAPPED, Setting
from tests.support import wait_for

SETTERS = ("nvmlDeviceSetGpuLockedClocks", "nvmlDeviceResetGpuLockedClocks", "nvmlDeviceSetPowerManagementLimit")


class CountingNvml:
    """Wraps a FakeNvml: records setter calls; ``before`` runs before each one."""

    def __init__(self, inner: FakeNvml) -> None:
        self._inner = inner
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.before: Callable[[str], None] | None = None

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name in SETTERS:

            def wrapped(*args: Any) -> Any:
                if self.before is not None:
                    self.before(name)
                self.calls.append((name, args[1:]))
                return attr(*args)

            return wrapped
        return attr


@pytest.fixture()
def sim(tmp_path: Path) -> tuple[FakeNvml, CountingNvml, NvmlGpuBackend]:
    fake = FakeNvml(tmp_path / "sim", n=3)
    counting = CountingNvml(fake)
    probe = NvmlProbe(nvml=counting, source="sim")
    probe.open()
    return fake, counting, NvmlGpuBackend(probe)


def state_json(state_dir: Path) -> dict[str, Any]:
    return json.loads((state_dir / STATE_FILE).read_text())


def gpu_entry(state_dir: Path, index: int) -> dict[str, Any]:
    (entry,) = [g for g in state_json(state_dir)["gpus"] if g["index"] == index]
    return entry


# --------------------------------------------------------------------------- GPUs


def test_original_is_saved_before_the_first_write(tmp_path: Path, sim: Any) -> None:
    fake, counting, backend = sim
    state = tmp_path / "state"
    ctl = Controller(state, backend)
    seen: list[dict[str, Any]] = []

    def check(name: str) -> None:  # runs just before the setter reaches the device
        seen.append(state_json(state))
        assert fake.sim_gpu(0).power_limit_w() == 700.0

    counting.before = check
    ctl.apply_gpu(0, Setting(power_limit_w=400.0), "job-1")
    (before,) = seen
    (entry,) = before["gpus"]
    assert entry["knobs"]["power_limit_w"]["original"] == 700.0
    assert entry["uuid"] == fake.sim_gpu(0).uuid and entry["backend"] == "sim"
    assert fake.sim_gpu(0).power_limit_w() == 400.0
    assert gpu_entry(state, 0)["knobs"]["power_limit_w"]["set"] == 400.0


def test_failed_write_leaves_the_original_saved(tmp_path: Path, sim: Any) -> None:
    fake, counting, backend = sim
    state = tmp_path / "state"
    fake.sim_gpu(0).set_power_limit_w(650.0)  # an admin's setting before greend
    fake.inject(0, no_permission=True)
    ctl = Controller(state, backend)
    with pytest.raises(KnobError) as ei:
        ctl.apply_gpu(0, Setting(power_limit_w=400.0), "job-1")
    err = ei.value
    assert isinstance(err, ActuatorError) and isinstance(err.__cause__, NoPermission)
    assert err.reason == "no_permission" and err.knob == "power_limit_w"
    msg = str(err)
    assert "gpu0" in msg and "power_limit_w" in msg and "CAP_SYS_ADMIN" in msg
    knob = gpu_entry(state, 0)["knobs"]["power_limit_w"]
    assert knob["original"] == 650.0 and knob["set"] is None
    assert fake.sim_gpu(0).power_limit_w() == 650.0
    assert ctl.current(0) == UNCAPPED
    # Kept for the restore, but nothing is held: `status` said "set by job-1: gpu0.power_limit_w".
    assert ctl.owners() == {"job-1": ["gpu0.power_limit_w"]} and ctl.owners(in_force=True) == {}
    fake.inject(0, no_permission=False)
    report = ctl.restore_all()
    assert report.ok and fake.sim_gpu(0).power_limit_w() == 650.0
    assert not (state / STATE_FILE).exists()


def test_setters_are_idempotent(tmp_path: Path, sim: Any) -> None:
    fake, counting, backend = sim
    ctl = Controller(tmp_path / "state", backend)
    assert ctl.apply_gpu(1, Setting(1500, 400.0), "job-1") == Setting(1500, 400.0)
    assert [c[0] for c in counting.calls] == ["nvmlDeviceSetGpuLockedClocks", "nvmlDeviceSetPowerManagementLimit"]
    counting.calls.clear()
    assert ctl.apply_gpu(1, Setting(1500, 400.0), "job-1") == Setting(1500, 400.0)
    assert counting.calls == []
    # A different owner asking for the same thing: no device call, new owner recorded.
    ctl.apply_gpu(1, Setting(1500, 400.0), "node")
    assert counting.calls == []
    assert ctl.owners() == {"node": ["gpu1.clock_cap_mhz", "gpu1.power_limit_w"]}
    # Asking for the limit already in force before greend: no write either.
    ctl.apply_gpu(2, Setting(power_limit_w=700.0), "node")
    assert counting.calls == []


def test_clock_snaps_and_power_clamps(tmp_path: Path, sim: Any) -> None:
    fake, counting, backend = sim
    ctl = Controller(tmp_path / "state", backend)
    h0 = fake.nvmlDeviceGetHandleByIndex(0)
    assert ctl.apply_gpu(0, Setting(1503, 100.0), "j").clock_cap_mhz == 1500
    assert fake.fake_get_locked_clocks(h0) == (345, 1500)  # the lowest clock stays reachable
    assert fake.sim_gpu(0).power_limit_w() == 200.0  # the constraint's minimum
    assert ctl.current(0) == Setting(1500, 200.0)
    assert ctl.apply_gpu(0, Setting(100, 900.0), "j") == Setting(345, 700.0)
    assert fake.fake_get_locked_clocks(h0) == (345, 345)
    assert ctl.apply_gpu(0, Setting(5000, None), "j").clock_cap_mhz == 1980
    with pytest.raises(KnobError):
        ctl.apply_gpu(0, Setting(power_limit_w=-5.0), "j")


def test_none_field_restores_that_knob(tmp_path: Path, sim: Any) -> None:
    fake, counting, backend = sim
    state = tmp_path / "state"
    ctl = Controller(state, backend)
    h = fake.nvmlDeviceGetHandleByIndex(0)
    ctl.apply_gpu(0, Setting(1200, 350.0), "j")
    assert ctl.apply_gpu(0, Setting(1200, None), "j") == Setting(1200, None)
    assert fake.sim_gpu(0).power_limit_w() == 700.0
    assert fake.fake_get_locked_clocks(h) == (345, 1200)
    assert set(gpu_entry(state, 0)["knobs"]) == {"clock_cap_mhz"}
    ctl.apply_gpu(0, UNCAPPED, "j")
    assert fake.fake_get_locked_clocks(h) is None
    assert not (state / STATE_FILE).exists()
    counting.calls.clear()
    ctl.apply_gpu(0, UNCAPPED, "j")  # nothing greend set: nothing to do
    assert counting.calls == []


def test_dry_run_touches_nothing(tmp_path: Path, sim: Any) -> None:
    fake, counting, backend = sim
    state = tmp_path / "state"
    sysfs = tmp_path / "sys"
    rapl_tree = make_standard_tree(sysfs)
    limit_file = rapl_tree.dir_of("intel-rapl:0") / "constraint_0_power_limit_uw"
    before = limit_file.read_text()
    ctl = Controller(state, backend, RaplBackend(sysfs), dry_run=True)
    assert ctl.apply_gpu(0, Setting(1503, 350.0), "job-1") == Setting(1500, 350.0)
    assert ctl.apply_cpu_limit("intel-rapl:0", 150.0, "node") == 150.0
    assert counting.calls == []
    assert fake.fake_get_locked_clocks(fake.nvmlDeviceGetHandleByIndex(0)) is None
    assert fake.sim_gpu(0).power_limit_w() == 700.0
    assert limit_file.read_text() == before
    assert not (state / STATE_FILE).exists()
    # ...but it remembers what it would have set, for greenctl status.
    assert ctl.current(0) == Setting(1500, 350.0)
    assert ctl.current_cpu_limit_w("intel-rapl:0") == 150.0
    assert ctl.owners() == {
        "job-1": ["gpu0.clock_cap_mhz", "gpu0.power_limit_w"],
        "node": ["class/powercap/intel-rapl:0"],
    }
    assert ctl.snapshot()["dry_run"] is True
    report = ctl.restore_owner("job-1")
    assert report.dry_run and report.restored == ["gpu0"] and ctl.current(0) == UNCAPPED
    assert ctl.restore_all().restored == ["class/powercap/intel-rapl:0"]
    assert counting.calls == [] and not (state / STATE_FILE).exists()


def test_lost_gpu_names_device_knob_and_fix(tmp_path: Path, sim: Any) -> None:
    fake, counting, backend = sim
    ctl = Controller(tmp_path / "state", backend)
    ctl.apply_gpu(2, Setting(1500, None), "j")
    fake.inject(2, lost=True)
    with pytest.raises(KnobError) as ei:
        ctl.apply_gpu(2, Setting(1400, None), "j")
    assert ei.value.reason == "lost" and isinstance(ei.value.__cause__, DeviceLost)
    assert "gpu2" in str(ei.value) and "clock_cap_mhz" in str(ei.value) and "nvidia-smi" in str(ei.value)
    assert ctl.current(2) == Setting(1500, None)  # still what is in force


def test_unsavable_state_means_no_write(tmp_path: Path, sim: Any) -> None:
    fake, counting, backend = sim
    state = tmp_path / "state"
    state.mkdir()
    ctl = Controller(state, backend)
    (state / f".{STATE_FILE}.{os.getpid()}.tmp").mkdir()  # the temp file cannot be made
    with pytest.raises(StateError, match="cannot write the saved-settings file"):
        ctl.apply_gpu(0, Setting(power_limit_w=400.0), "j")
    assert counting.calls == [] and fake.sim_gpu(0).power_limit_w() == 700.0
    assert ctl.current(0) == UNCAPPED


def test_restore_owner_restores_only_that_job(tmp_path: Path, sim: Any) -> None:
    fake, counting, backend = sim
    state = tmp_path / "state"
    sysfs = tmp_path / "sys"
    tree = make_standard_tree(sysfs)
    ctl = Controller(state, backend, RaplBackend(sysfs))
    ctl.apply_gpu(0, Setting(1500, 400.0), "job-a")
    ctl.apply_gpu(1, Setting(1400, None), "job-a")
    ctl.apply_gpu(2, Setting(1305, 500.0), "job-b")
    ctl.apply_cpu_limit("intel-rapl:1", 150.0, "node")
    report = ctl.restore_owner("job-a")
    assert report.ok and len(report.restored) == 3
    h = [fake.nvmlDeviceGetHandleByIndex(i) for i in range(3)]
    assert fake.fake_get_locked_clocks(h[0]) is None and fake.sim_gpu(0).power_limit_w() == 700.0
    assert fake.fake_get_locked_clocks(h[1]) is None
    assert fake.fake_get_locked_clocks(h[2]) == (345, 1305) and fake.sim_gpu(2).power_limit_w() == 500.0
    assert (tree.dir_of("intel-rapl:1") / "constraint_0_power_limit_uw").read_text().strip() == "150000000"
    saved = state_json(state)
    assert [g["index"] for g in saved["gpus"]] == [2] and len(saved["cpus"]) == 1
    assert ctl.owners() == {"job-b": ["gpu2.clock_cap_mhz", "gpu2.power_limit_w"], "node": ["package-1 (intel-rapl:1)"]}
    assert ctl.restore_owner("nobody").restored == []


def test_restore_all_survives_a_lost_gpu(tmp_path: Path, sim: Any) -> None:
    fake, counting, backend = sim
    state = tmp_path / "state"
    ctl = Controller(state, backend)
    for i in range(3):
        ctl.apply_gpu(i, Setting(1500, 450.0), "job")
    fake.inject(1, lost=True)
    report = ctl.restore_all()
    assert report.exit_code == 1
    assert {f.device.split()[0] for f in report.failed} == {"gpu1"}
    assert [g["index"] for g in state_json(state)["gpus"]] == [1]
    for i in (0, 2):
        assert fake.sim_gpu(i).power_limit_w() == 700.0
        assert fake.sim_gpu(i).locked_clocks_mhz() is None
    fake.inject(1, lost=False)
    assert ctl.restore_all().ok
    assert fake.sim_gpu(1).locked_clocks_mhz() is None and fake.sim_gpu(1).power_limit_w() == 700.0
    assert not (state / STATE_FILE).exists()


def test_controller_adopts_leftover_originals(tmp_path: Path, sim: Any) -> None:
    fake, counting, backend = sim
    state = tmp_path / "state"
    Controller(state, backend).apply_gpu(0, Setting(power_limit_w=400.0), "job")
    # A new controller (a restarted daemon) must not take 400 W for the original.
    ctl = Controller(state, backend)
    assert ctl.current(0) == Setting(None, 400.0)
    ctl.apply_gpu(0, Setting(power_limit_w=300.0), "job")
    assert gpu_entry(state, 0)["knobs"]["power_limit_w"]["original"] == 700.0
    assert ctl.restore_gpu(0).ok and fake.sim_gpu(0).power_limit_w() == 700.0


# --------------------------------------------------------------------------- RAPL


def read_uw(tree: Any, zone: str, n: int) -> int:
    return int((tree.dir_of(zone) / f"constraint_{n}_power_limit_uw").read_text())


def test_rapl_limit_within_max_and_restored_exactly(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    tree = make_standard_tree(sysfs)
    state = tmp_path / "state"
    (tree.dir_of("intel-rapl:0") / "constraint_0_power_limit_uw").write_text("180123456\n")
    ctl = Controller(state, rapl_backend=RaplBackend(sysfs))
    assert ctl.apply_cpu_limit("intel-rapl:0", 150.0, "node") == 150.0
    assert (read_uw(tree, "intel-rapl:0", 0), read_uw(tree, "intel-rapl:0", 1)) == (150_000_000, 150_000_000)
    (cpu,) = state_json(state)["cpus"]
    assert cpu["zone_path"] == "class/powercap/intel-rapl:0" and cpu["name"] == "package-0"
    assert cpu["sysfs_root"] == str(sysfs.resolve())
    assert [(c["index"], c["name"], c["original_uw"]) for c in cpu["constraints"]] == [
        (0, "long_term", 180_123_456),
        (1, "short_term", 246_000_000),
    ]
    # Above the max: long term clamps to constraint_0_max_power_uw, short term
    # never goes above its original.
    assert ctl.apply_cpu_limit("intel-rapl:0", 1000.0, "node") == 205.0
    assert (read_uw(tree, "intel-rapl:0", 0), read_uw(tree, "intel-rapl:0", 1)) == (205_000_000, 246_000_000)
    # An absolute path and the hex psys zone work too.
    assert ctl.apply_cpu_limit(sysfs / "class/powercap/intel-rapl:a", 400.0, "node") == 400.0
    assert ctl.current_cpu_limit_w("intel-rapl:a") == 400.0
    report = ctl.restore_all()
    assert report.ok and len(report.restored) == 4
    assert (read_uw(tree, "intel-rapl:0", 0), read_uw(tree, "intel-rapl:0", 1)) == (180_123_456, 246_000_000)
    assert (read_uw(tree, "intel-rapl:a", 0), read_uw(tree, "intel-rapl:a", 1)) == (500_000_000, 600_000_000)
    assert not (state / STATE_FILE).exists()


def test_rapl_none_restores_and_failed_write_keeps_originals(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    tree = make_standard_tree(sysfs)
    state = tmp_path / "state"
    writes: list[Path] = []

    def denied(path: Path, text: str) -> None:
        writes.append(path)
        raise PermissionError(13, "Permission denied", str(path))

    ctl = Controller(state, rapl_backend=RaplBackend(sysfs, write=denied))
    with pytest.raises(KnobError) as ei:
        ctl.apply_cpu_limit("intel-rapl:1", 120.0, "node")
    assert "package-1" in str(ei.value) and "root" in str(ei.value)
    assert writes  # it tried, after saving:
    (cpu,) = state_json(state)["cpus"]
    assert [c["original_uw"] for c in cpu["constraints"]] == [205_000_000, 246_000_000]
    ok = Controller(state, rapl_backend=RaplBackend(sysfs))
    assert ok.apply_cpu_limit("intel-rapl:1", 120.0, "node") == 120.0
    assert ok.apply_cpu_limit("intel-rapl:1", None, "node") is None
    assert (read_uw(tree, "intel-rapl:1", 0), read_uw(tree, "intel-rapl:1", 1)) == (205_000_000, 246_000_000)
    assert not (state / STATE_FILE).exists()
    with pytest.raises(KnobError, match="no RAPL zone"):
        ok.apply_cpu_limit("intel-rapl:7", 100.0, "node")


def test_restore_owner_survives_an_unexpected_error_on_one_gpu(tmp_path: Path, sim: Any) -> None:
    # A job's GPUs go back when it ends; a bug or driver surprise on one must not keep
    # the others capped (the same per-device isolation as restore_all).
    fake, counting, backend = sim
    ctl = Controller(tmp_path / "state", backend)
    for i in range(3):
        ctl.apply_gpu(i, Setting(1500, 450.0), "job")
    real = ctl._gpus.restore_entry

    def flaky(entry: Any, knobs: list[str], report: Any) -> None:
        if entry.index == 1:
            raise RuntimeError("driver surprise")
        real(entry, knobs, report)

    ctl._gpus.restore_entry = flaky  # type: ignore[method-assign]  # a fault on one GPU, in place of the real method
    report = ctl.restore_owner("job")
    assert {f.device.split()[0] for f in report.failed} == {"gpu1"}
    assert "RuntimeError: driver surprise" in report.failed[0].message
    for i in (0, 2):
        assert fake.sim_gpu(i).locked_clocks_mhz() is None and fake.sim_gpu(i).power_limit_w() == 700.0
    assert fake.sim_gpu(1).locked_clocks_mhz() is not None  # kept, and kept saved for the next try
    assert [g["index"] for g in state_json(tmp_path / "state")["gpus"]] == [1]


def test_a_lock_greend_never_made_is_not_reset(tmp_path: Path, sim: Any) -> None:
    fake, counting, backend = sim
    ctl = Controller(tmp_path / "state", backend)

    def refuse(name: str) -> None:
        if name == "nvmlDeviceSetGpuLockedClocks":
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    counting.before = refuse
    with pytest.raises(KnobError):
        ctl.apply_gpu(0, Setting(clock_cap_mhz=1200), "job-1")
    counting.before = None
    report = ctl.restore_all()
    assert report.ok and "left as it is" in " ".join(report.restored)
    assert not [c for c in counting.calls if c[0] == "nvmlDeviceResetGpuLockedClocks"]


def test_a_refused_knob_is_not_tried_again(tmp_path: Path, sim: Any) -> None:
    fake, counting, backend = sim
    fake.inject(1, no_permission=True)
    ctl = Controller(tmp_path / "state", backend)
    for _ in range(3):
        with pytest.raises(KnobError, match="CAP_SYS_ADMIN"):
            ctl.apply_gpu(1, Setting(power_limit_w=400.0), "job-1")
    assert len([c for c in counting.calls if c[0] == "nvmlDeviceSetPowerManagementLimit"]) == 1
    assert "power_limit_w" in ctl.snapshot()["refused"]["1"]


def test_a_hung_setter_holds_only_its_own_gpu(tmp_path: Path, sim: Any) -> None:
    """A power-limit write stuck in the driver on gpu1: status, the owners, what is in
    force and a write to gpu0 all answer while it hangs (the state lock is not held
    across the call); once the driver answers, the write completes."""
    fake, counting, backend = sim
    backend.devices.deadline_s = 60.0  # the hang outlasts everything below
    fake.set_hang("nvmlDeviceSetPowerManagementLimit", gpu=1)  # until cleared
    ctl = Controller(tmp_path / "state", backend)
    outcome: list[object] = []

    def write_gpu1() -> None:
        try:
            outcome.append(ctl.apply_gpu(1, Setting(power_limit_w=400.0), "job-1"))
        except Exception as e:
            outcome.append(e)

    t = threading.Thread(target=write_gpu1, daemon=True)
    t.start()
    try:
        assert wait_for(lambda: any(c[0] == "nvmlDeviceSetPowerManagementLimit" for c in counting.calls), 10)
        assert ctl.snapshot()["gpus"]["1"]["power_limit_w"] is None  # saved original, not set yet
        assert ctl.current(1) == UNCAPPED
        assert ctl.apply_gpu(0, Setting(power_limit_w=350.0), "job-2").power_limit_w == 350.0
        assert ctl.owners() == {"job-1": ["gpu1.power_limit_w"], "job-2": ["gpu0.power_limit_w"]}
        assert t.is_alive(), "all of the above ran while gpu1's setter hung"
    finally:
        fake.set_hang(None)
        t.join(30)
    assert outcome and outcome[0] == Setting(power_limit_w=400.0), outcome
    assert fake.sim_gpu(1).power_limit_w() == 400.0


def test_a_gpu_whose_setter_hung_fails_its_next_write_at_once(tmp_path: Path, sim: Any) -> None:
    """The write that hangs fails at its deadline; the next one on that GPU fails at
    once with the reason (its calls are stuck), and the other GPUs are still written."""
    fake, _counting, backend = sim
    backend.devices.deadline_s = 0.5
    fake.set_hang("nvmlDeviceSetPowerManagementLimit", gpu=2)
    ctl = Controller(tmp_path / "state", backend)
    errors: list[BaseException] = []
    try:
        for w in (400.0, 380.0):
            try:
                ctl.apply_gpu(2, Setting(power_limit_w=w), "job-1")
            except KnobError as e:
                errors.append(e)
        assert len(errors) == 2
        assert "did not return within 0.5 s" in str(errors[0])
        assert "not called" in str(errors[1])  # the GPU is unresponsive: failed at once
        assert ctl.apply_gpu(0, Setting(power_limit_w=300.0), "job-1").power_limit_w == 300.0
    finally:
        fake.set_hang(None)


def test_a_refused_write_does_not_stop_greend_undoing_what_it_set_before(tmp_path: Path, sim: Any) -> None:
    """A knob greend has written once is never taken as refused for good: one refused
    write later (NO_PERMISSION) does not stop greend from resetting its own lock."""
    fake, counting, backend = sim
    ctl = Controller(tmp_path / "state", backend)
    ctl.apply_gpu(0, Setting(clock_cap_mhz=1400), "job-1")
    assert fake.sim_gpu(0).locked_clocks_mhz() == (345, 1395)  # (the nearest supported clock)
    fake.inject(0, no_permission=True)
    with pytest.raises(KnobError) as ei:
        ctl.apply_gpu(0, Setting(clock_cap_mhz=1200), "job-1")
    assert ei.value.reason == "no_permission"
    fake.inject(0, no_permission=False)
    counting.calls.clear()
    report = ctl.restore_all()
    assert report.ok, report.failed
    assert [c[0] for c in counting.calls] == ["nvmlDeviceResetGpuLockedClocks"]
    assert fake.sim_gpu(0).locked_clocks_mhz() is None
    assert backend.refused == {}


def test_a_refusal_stays_with_its_gpu_when_the_driver_numbers_the_gpus_anew(tmp_path: Path) -> None:
    """Refusals are kept by UUID: after a driver reload that swaps two GPUs' indices, the
    GPU that refused clock locks is still the refused one, at its new index, and the
    other one's lock is reset at exit."""
    fake = FakeNvml(tmp_path / "sim", n=2)
    probe = NvmlProbe(nvml=fake, source="sim")
    probe.open()
    backend = NvmlGpuBackend(probe)
    ctl = Controller(tmp_path / "state", backend)
    fake.inject(0, no_locked_clocks=True)  # a card without clock locks
    with pytest.raises(KnobError):
        ctl.apply_gpu(0, Setting(clock_cap_mhz=1400), "job-1")
    ctl.apply_gpu(1, Setting(clock_cap_mhz=1400), "job-1")
    refused_uuid = fake.sim_gpu(0).uuid
    fake.reorder([1, 0])  # NVML's gpu0 is the locked one now, gpu1 the one that refuses
    with pytest.raises(ProbeError):
        probe.sample(1.0)  # NVML was shut down under the probe: it enumerates again
    probe.sample(2.0)
    assert backend.known_uuid(1) == refused_uuid
    assert set(backend.refused) == {1} and backend.refused_knobs(0) == {}
    report = ctl.restore_all()
    assert report.ok, report.failed
    assert all(fake.sim_gpu(i).locked_clocks_mhz() is None for i in (0, 1))
    probe.close()


def test_a_power_limit_greend_never_changed_is_not_restored_over_the_operators(tmp_path: Path, sim: Any) -> None:
    """greend's only write of the limit failed; an operator then sets one by hand: at
    exit greend leaves it (it never changed the limit), and forgets the entry."""
    fake, counting, backend = sim
    fake.inject(0, no_permission=True)
    state = tmp_path / "state"
    ctl = Controller(state, backend)
    with pytest.raises(KnobError):
        ctl.apply_gpu(0, Setting(power_limit_w=400.0), "job-1")
    fake.inject(0, no_permission=False)
    assert gpu_entry(state, 0)["knobs"]["power_limit_w"]["set"] is None
    fake.sim_gpu(0).set_power_limit_w(500.0)  # the operator, by hand
    counting.calls.clear()
    report = ctl.restore_all()
    assert report.ok and counting.calls == []
    assert fake.sim_gpu(0).power_limit_w() == 500.0
    assert not (state / STATE_FILE).exists()


def test_a_lock_whose_write_outlived_its_deadline_is_undone_at_exit(tmp_path: Path, sim: Any) -> None:
    """A setter that does not return within the deadline may still land (a driver that
    answers late): greend counts it as set, so the restore resets it."""
    fake, _counting, backend = sim
    backend.devices.deadline_s = 0.3
    fake.set_hang("nvmlDeviceSetGpuLockedClocks", gpu=1, seconds=0.8)  # lands after the deadline
    state = tmp_path / "state"
    ctl = Controller(state, backend)
    with pytest.raises(KnobError) as ei:
        ctl.apply_gpu(1, Setting(clock_cap_mhz=1400), "job-1")
    assert ei.value.reason == "unresponsive"
    assert gpu_entry(state, 1)["knobs"]["clock_cap_mhz"]["set"] == 1395  # (the nearest supported clock)
    fake.set_hang(None)
    assert wait_for(lambda: fake.sim_gpu(1).locked_clocks_mhz() is not None, timeout_s=10)  # the late write landed
    assert "clock_cap_mhz" in ctl.unverified(1)
    assert wait_for(lambda: _answers(backend, 1), timeout_s=30)  # its calls answer again
    report = ctl.restore_all()
    assert report.ok, report.failed
    assert fake.sim_gpu(1).locked_clocks_mhz() is None
    assert not (state / STATE_FILE).exists()


def _answers(backend: NvmlGpuBackend, index: int) -> bool:
    try:
        backend.power_limit_w(index)
        return True
    except Exception:
        return False


def test_a_gpu_found_again_after_a_reset_gets_greends_settings_written_again(tmp_path: Path) -> None:
    """A GPU reset (lost, then found again) drops its clock lock and power limit: the
    next check writes greend's settings again, once; a GPU never lost is not written."""
    fake = FakeNvml(tmp_path / "sim", n=2)
    counting = CountingNvml(fake)
    probe = NvmlProbe(nvml=counting, source="sim")
    probe.open()
    ctl = Controller(tmp_path / "state", NvmlGpuBackend(probe))
    for i in (0, 1):
        ctl.apply_gpu(i, Setting(1400, 450.0), "job-1")
    assert ctl.reassert(0) == [] and ctl.reassert(1) == []
    fake.inject(0, lost=True)
    probe.sample(1.0)
    assert probe.lost_gpus.keys() == {0}
    gpu = fake.sim_gpu(0)
    gpu.reset_locked_clocks()  # what the reset did to the device
    gpu.set_power_limit_w(700.0)
    fake.inject(0, lost=False)
    assert wait_for(lambda: probe.sample(2.0) is not None and not probe.lost_gpus, timeout_s=10)
    counting.calls.clear()
    assert ctl.reassert(1) == []  # found again with its settings never lost: not written
    assert sorted(ctl.reassert(0)) == ["clock_cap_mhz", "power_limit_w"]
    assert gpu.locked_clocks_mhz() == (345, 1395) and gpu.power_limit_w() == 450.0
    assert ctl.current(0) == Setting(1395, 450.0)
    assert ctl.reassert(0) == []  # once
    assert [c[0] for c in counting.calls] == ["nvmlDeviceSetGpuLockedClocks", "nvmlDeviceSetPowerManagementLimit"]
    probe.close()


def test_after_a_driver_reload_every_gpu_gets_greends_settings_written_again(tmp_path: Path) -> None:
    """A driver reload (NVML shut down under greend, the GPUs numbered anew) drops every
    GPU's settings: each is written again, at the GPU's new index."""
    fake = FakeNvml(tmp_path / "sim", n=2)
    probe = NvmlProbe(nvml=fake, source="sim")
    probe.open()
    ctl = Controller(tmp_path / "state", NvmlGpuBackend(probe))
    ctl.apply_gpu(0, Setting(clock_cap_mhz=1400), "job-1")
    ctl.apply_gpu(1, Setting(power_limit_w=450.0), "job-1")
    locked, limited = fake.sim_gpu(0), fake.sim_gpu(1)
    fake.reorder([1, 0])
    locked.reset_locked_clocks()  # what the reload did to the devices
    limited.set_power_limit_w(700.0)
    with pytest.raises(ProbeError):
        probe.sample(1.0)  # NVML was shut down under the probe: it enumerates again
    probe.sample(2.0)
    assert ctl.reassert(0) == ["power_limit_w"] and ctl.reassert(1) == ["clock_cap_mhz"]
    assert locked.locked_clocks_mhz() == (345, 1395) and limited.power_limit_w() == 450.0
    probe.close()


def test_a_write_again_that_fails_stays_due_until_it_lands(tmp_path: Path) -> None:
    """After a reset the write again is refused once (the driver not ready): it is tried
    again at the next call, not given up for good."""
    fake = FakeNvml(tmp_path / "sim", n=1)
    probe = NvmlProbe(nvml=fake, source="sim")
    probe.open()
    ctl = Controller(tmp_path / "state", NvmlGpuBackend(probe))
    ctl.apply_gpu(0, Setting(power_limit_w=450.0), "node")
    fake.inject(0, lost=True)
    probe.sample(1.0)
    fake.sim_gpu(0).set_power_limit_w(700.0)  # the reset dropped it
    fake.inject(0, lost=False)
    assert wait_for(lambda: probe.sample(2.0) is not None and not probe.lost_gpus, timeout_s=10)
    fake.inject(0, no_permission=True)
    assert ctl.reassert(0) == [] and ctl.reassert(0) == []
    fake.inject(0, no_permission=False)
    assert ctl.reassert(0) == ["power_limit_w"] and fake.sim_gpu(0).power_limit_w() == 450.0
    assert ctl.reassert(0) == []
    probe.close()


def test_a_first_write_cut_short_by_a_crash_is_undone_by_the_next_restore(tmp_path: Path, sim: Any) -> None:
    """greend killed between the driver's write and its record of it (SIGKILL, OOM): the
    state file says the first write was pending, so `greend restore` (or the next
    daemon) puts back the limit and the clocks where the write landed."""
    fake, counting, backend = sim
    ctl = Controller(tmp_path / "state", backend)

    def killed(*args: Any) -> None:
        raise SystemExit("killed")  # nothing after the driver's write runs, as under SIGKILL

    ctl._gpus._record_set = killed  # type: ignore[method-assign]  # the process dies right after the driver call
    for s in (Setting(power_limit_w=450.0), Setting(clock_cap_mhz=1200)):
        with pytest.raises(SystemExit):
            ctl.apply_gpu(0, s, "job-1")
    assert fake.sim_gpu(0).power_limit_w() == 450.0 and fake.sim_gpu(0).locked_clocks_mhz() is not None
    knobs = state_json(tmp_path / "state")["gpus"][0]["knobs"]
    report = Controller(tmp_path / "state", backend).restore_all()
    assert report.ok, report.failed
    assert fake.sim_gpu(0).power_limit_w() == 700.0 and fake.sim_gpu(0).locked_clocks_mhz() is None
    assert not (tmp_path / "state" / STATE_FILE).exists()
    assert knobs["power_limit_w"]["set"] is None and knobs["power_limit_w"].get("pending") == 450.0


def test_a_first_write_that_failed_leaves_nothing_pending(tmp_path: Path, sim: Any) -> None:
    """A write the driver refused is not pending: a restore leaves the limit as it finds it
    (an operator may have set it since)."""
    fake, counting, backend = sim
    ctl = Controller(tmp_path / "state", backend)

    def refuse(name: str) -> None:
        if name == "nvmlDeviceSetPowerManagementLimit":
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    counting.before = refuse
    with pytest.raises(KnobError):
        ctl.apply_gpu(0, Setting(power_limit_w=450.0), "job-1")
    counting.before = None
    assert "pending" not in state_json(tmp_path / "state")["gpus"][0]["knobs"]["power_limit_w"]
    fake.sim_gpu(0)  # an operator sets 500 W meanwhile
    backend.set_power_limit_w(0, 500.0)
    report = Controller(tmp_path / "state", backend).restore_all()
    assert report.ok and "left as it is" in " ".join(report.restored)
    assert fake.sim_gpu(0).power_limit_w() == 500.0


def _renumber(sysfs: Path, a: str, b: str) -> None:
    """Zones numbered anew (a module reload): the two ids swap the zones they name."""
    base = sysfs / "class" / "powercap"
    ta, tb = os.readlink(base / a), os.readlink(base / b)
    (base / a).unlink()
    (base / b).unlink()
    os.symlink(tb, base / a)
    os.symlink(ta, base / b)


def test_a_restore_after_the_zones_were_renumbered_goes_by_name(tmp_path: Path) -> None:
    """greend killed with both packages capped; the zones come back renumbered (package-1 at
    intel-rapl:0): each package gets its own originals back, found by its name, and a
    `cap reset --cpu package-0` at its new id finds what was saved."""
    sysfs, state = tmp_path / "sys", tmp_path / "state"
    tree = make_standard_tree(sysfs)
    p0, p1 = tree.dir_of("intel-rapl:0"), tree.dir_of("intel-rapl:1")
    (p1 / "constraint_0_power_limit_uw").write_text("180000000\n")  # package-1's own original
    ctl = Controller(state, rapl_backend=RaplBackend(sysfs))
    ctl.apply_cpu_limit("intel-rapl:0", 150.0, "node")
    ctl.apply_cpu_limit("intel-rapl:1", 120.0, "node")
    _renumber(sysfs, "intel-rapl:0", "intel-rapl:1")
    report = Controller(state, rapl_backend=RaplBackend(sysfs)).restore_all()
    assert report.ok, report.failed
    assert (p0 / "constraint_0_power_limit_uw").read_text().strip() == "205000000"
    assert (p1 / "constraint_0_power_limit_uw").read_text().strip() == "180000000"
    # cap set at the old id, renumbered, then reset at the new one: the saved original back.
    ctl = Controller(state, rapl_backend=RaplBackend(sysfs))
    ctl.apply_cpu_limit("intel-rapl:1", 150.0, "node")  # package-0 is intel-rapl:1 now
    _renumber(sysfs, "intel-rapl:0", "intel-rapl:1")
    ctl = Controller(state, rapl_backend=RaplBackend(sysfs))
    assert ctl.apply_cpu_limit("intel-rapl:0", None, "node") is None
    assert (p0 / "constraint_0_power_limit_uw").read_text().strip() == "205000000"
    assert not (state / STATE_FILE).exists()


def test_a_cap_set_refused_on_one_constraint_leaves_the_zone_as_it_was(tmp_path: Path) -> None:
    sysfs, state = tmp_path / "sys", tmp_path / "state"
    tree = make_standard_tree(sysfs)
    pkg = tree.dir_of("intel-rapl:0")

    def short_term_refused(path: Path, text: str) -> None:
        if path.name == "constraint_1_power_limit_uw":
            raise OSError(22, "Invalid argument", str(path))
        path.write_text(text + "\n")

    ctl = Controller(state, rapl_backend=RaplBackend(sysfs, write=short_term_refused))
    with pytest.raises(KnobError, match="constraint 1"):
        ctl.apply_cpu_limit("intel-rapl:0", 120.0, "node")
    assert read_uw(tree, "intel-rapl:0", 0) == 205_000_000  # the long-term write taken back
    assert ctl.current_cpu_limit_w("intel-rapl:0") is None
    assert (pkg / "constraint_1_power_limit_uw").read_text().strip() == "246000000"


def test_a_zone_whose_limiting_is_off_is_not_said_capped(tmp_path: Path) -> None:
    sysfs, state = tmp_path / "sys", tmp_path / "state"
    tree = make_standard_tree(sysfs)
    (tree.dir_of("intel-rapl:0") / "enabled").write_text("0\n")
    ctl = Controller(state, rapl_backend=RaplBackend(sysfs))
    with pytest.raises(KnobError, match="limiting is off"):
        ctl.apply_cpu_limit("intel-rapl:0", 150.0, "node")
    assert read_uw(tree, "intel-rapl:0", 0) == 205_000_000


def test_a_limit_the_kernel_rounds_is_reported_as_it_holds(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """... and the same request again (a policy re-asserting its cap every period) is
    what the kernel already holds: no second write; a rounding within a power unit is no
    warning."""
    sysfs, state = tmp_path / "sys", tmp_path / "state"
    tree = make_standard_tree(sysfs)
    writes: list[str] = []

    def rounds(path: Path, text: str) -> None:  # 1/8 W units, as RAPL's
        writes.append(path.name)
        path.write_text(str(int(text) // 125_000 * 125_000) + "\n")

    ctl = Controller(state, rapl_backend=RaplBackend(sysfs, write=rounds))
    with caplog.at_level(logging.WARNING):
        assert ctl.apply_cpu_limit("intel-rapl:0", 150.06, "node") == 150.0
        assert ctl.current_cpu_limit_w("intel-rapl:0") == 150.0
        assert read_uw(tree, "intel-rapl:0", 0) == 150_000_000
        first, warned = len(writes), len([r for r in caplog.records if "the kernel holds" in r.message])
        assert first >= 1 and warned == 0  # (within a power unit: the kernel's rounding, not a refusal)
        assert ctl.apply_cpu_limit("intel-rapl:0", 150.06, "node") == 150.0
        assert len(writes) == first
        assert len([r for r in caplog.records if "the kernel holds" in r.message]) == warned
        assert ctl.apply_cpu_limit("intel-rapl:0", 140.0, "node") == 140.0  # a real change is written
        assert len(writes) > first and read_uw(tree, "intel-rapl:0", 0) == 140_000_000


def test_subzones_of_renumbered_packages_get_their_own_originals(tmp_path: Path) -> None:
    """Every package has a "core": a subzone is told apart by its package's name too
    (saved as package-1/core), so renumbered packages' cores are not swapped."""
    sysfs, state = tmp_path / "sys", tmp_path / "state"
    tree = make_standard_tree(sysfs)
    c0, c1 = tree.dir_of("intel-rapl:0:0"), tree.dir_of("intel-rapl:1:0")
    orig0 = (c0 / "constraint_0_power_limit_uw").read_text().strip()
    (c1 / "constraint_0_power_limit_uw").write_text("30000000\n")  # package-1's core: 30 W its own
    ctl = Controller(state, rapl_backend=RaplBackend(sysfs))
    ctl.apply_cpu_limit("intel-rapl:0:0", 10.0, "node")
    ctl.apply_cpu_limit("intel-rapl:1:0", 12.0, "node")
    assert sorted(c["name"] for c in state_json(state)["cpus"]) == ["package-0/core", "package-1/core"]
    _renumber(sysfs, "intel-rapl:0", "intel-rapl:1")
    _renumber(sysfs, "intel-rapl:0:0", "intel-rapl:1:0")
    report = Controller(state, rapl_backend=RaplBackend(sysfs)).restore_all()
    assert report.ok, report.failed
    assert (c0 / "constraint_0_power_limit_uw").read_text().strip() == orig0
    assert (c1 / "constraint_0_power_limit_uw").read_text().strip() == "30000000"


def test_a_refused_first_cpu_cap_leaves_no_owner_and_no_entry(tmp_path: Path) -> None:
    sysfs, state = tmp_path / "sys", tmp_path / "state"
    make_standard_tree(sysfs)

    def refused(path: Path, text: str) -> None:
        raise OSError(22, "Invalid argument", str(path))

    ctl = Controller(state, rapl_backend=RaplBackend(sysfs, write=refused))
    with pytest.raises(KnobError):
        ctl.apply_cpu_limit("intel-rapl:0", 120.0, "node")
    assert ctl.owners() == {}  # its originals stay saved (a restore at the stop checks them)


def test_a_gpu_that_goes_idle_between_the_reads_is_not_read_as_holding_its_idle_clock(tmp_path: Path) -> None:
    """The clock-event reasons said only the lock held the clock, then the step ended and
    the clock read gave the idle clock: the read-back reported "a clock cap of 345 MHz, not
    the one asked for". The reasons are read again after the clock: a GPU gone idle meanwhile
    cannot tell, and the request stays in force, unverified."""
    fake = FakeNvml(tmp_path / "sim", n=1)
    reasons = iter([0x2, 0x1])  # (held by the lock; then idle)

    class StepEnds(CountingNvml):
        def __getattr__(self, name: str) -> Any:
            if name == "nvmlDeviceGetCurrentClocksEventReasons":
                return lambda handle: next(reasons)
            if name == "nvmlDeviceGetClockInfo":
                return lambda handle, kind: 345
            return super().__getattr__(name)

    probe = NvmlProbe(nvml=StepEnds(fake), source="sim")
    probe.open()
    assert NvmlGpuBackend(probe).held_clock_mhz(0) is None
    reasons = iter([0x2, 0x2])  # the lock alone, before and after: what the GPU holds
    assert NvmlGpuBackend(probe).held_clock_mhz(0) == 345


def test_a_restore_that_meets_a_passing_driver_error_is_tried_again(tmp_path: Path) -> None:
    """At a stop, the driver answers one setter of each knob with NVML_ERROR_UNKNOWN (999) or
    TIMEOUT (10), errors that pass: each is tried again and the GPU is left as before greend
    (before: tried once, the GPU left capped until the next start's restore)."""
    fake = FakeNvml(tmp_path / "sim", n=1)
    counting = CountingNvml(fake)
    probe = NvmlProbe(nvml=counting, source="sim")
    probe.open()
    ctl = Controller(tmp_path / "state", NvmlGpuBackend(probe))
    ctl.apply_gpu(0, Setting(1200, 400.0), "node")
    failed: list[str] = []

    def once(name: str) -> None:
        if name not in failed:
            failed.append(name)
            raise pynvml.NVMLError(999 if "Clocks" in name else 10)

    counting.before = once
    report = ctl.restore_all()
    assert not report.failed, report.failed
    assert sorted(failed) == ["nvmlDeviceResetGpuLockedClocks", "nvmlDeviceSetPowerManagementLimit"]
    gpu = fake.sim_gpu(0)
    assert gpu.locked_clocks_mhz() is None and gpu.power_limit_w() == 700.0
    probe.close()
