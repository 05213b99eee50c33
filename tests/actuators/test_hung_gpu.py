"""One GPU that starts hanging mid-run (the fake NVML's ``hung`` fault, the stand-in's
``NVML_STUB_HANG_GPUS``) costs the others nothing: their readings, their restore, and
the whole of a tick or a restore is bounded by one call deadline, not one per GPU."""

from __future__ import annotations

import time
from pathlib import Path

from greend.actuators import Controller, NvmlGpuBackend
from greend.actuators._gpu_knobs import restore_wait_s
from greend.probes.fake_nvml import FakeNvml
from greend.probes.nvml import NvmlProbe
from greend.settings import Setting

DEADLINE_S = 0.5


def open_sim(tmp_path: Path, n: int = 4) -> tuple[FakeNvml, NvmlProbe, NvmlGpuBackend]:
    fake = FakeNvml(tmp_path / "sim", n=n)
    probe = NvmlProbe(nvml=fake, source="sim")
    probe.devices.deadline_s = DEADLINE_S
    probe.open()
    return fake, probe, NvmlGpuBackend(probe)


def test_restore_reaches_every_gpu_that_answers_while_one_hangs(tmp_path: Path) -> None:
    fake, probe, backend = open_sim(tmp_path)
    ctl = Controller(tmp_path / "state", backend)
    for i in range(4):
        ctl.apply_gpu(i, Setting(1200, 450.0), "job")
    fake.inject(3, hung=True)  # every call on gpu3 hangs until cleared
    try:
        t0 = time.monotonic()
        report = ctl.restore_all()
        took_s = time.monotonic() - t0
        # Read while the hang holds: once cleared, the call that hung returns late and
        # does its work (a driver that answers after the deadline), a race with this read.
        locked3 = fake.sim_gpu(3).locked_clocks_mhz()
    finally:
        fake.inject(3, hung=False)
    assert took_s < restore_wait_s(DEADLINE_S), took_s
    assert {f.device.split()[0] for f in report.failed} == {"gpu3"}
    for i in range(3):
        assert fake.sim_gpu(i).locked_clocks_mhz() is None and fake.sim_gpu(i).power_limit_w() == 700.0
    assert locked3 == (345, 1200)  # not reached: it stays saved
    assert [g.index for g in ctl.state_file.load().gpus] == [3]
    probe.close()


def test_a_gpu_that_hangs_mid_run_costs_one_tick_one_deadline_and_later_ticks_nothing(tmp_path: Path) -> None:
    fake, probe, _ = open_sim(tmp_path, n=8)
    probe.sample(0.0)
    for i in (2, 5, 6):
        fake.inject(i, hung=True)
    try:
        t0 = time.monotonic()
        r = probe.sample(1.0)
        first_s = time.monotonic() - t0
        t0 = time.monotonic()
        r2 = probe.sample(2.0)
        second_s = time.monotonic() - t0
        states = {g["index"]: g["state"] for g in probe.gpu_states()}
    finally:
        for i in (2, 5, 6):
            fake.inject(i, hung=False)
    assert sorted(g.index for g in r.gpus) == [0, 1, 3, 4, 7]
    assert sorted(g.index for g in r2.gpus) == [0, 1, 3, 4, 7]
    assert first_s < 2 * DEADLINE_S, first_s  # three hung GPUs, read at once: one deadline
    assert second_s < DEADLINE_S / 2, second_s  # their calls fail at once now
    assert states == {
        0: "ok",
        1: "ok",
        2: "unresponsive",
        3: "ok",
        4: "ok",
        5: "unresponsive",
        6: "unresponsive",
        7: "ok",
    }
    probe.close()


def test_a_gpu_hung_at_open_is_unresponsive_not_absent(tmp_path: Path) -> None:
    fake = FakeNvml(tmp_path / "sim", n=4)
    fake.inject(1, hung=True)
    probe = NvmlProbe(nvml=fake, source="sim")
    probe.devices.deadline_s = DEADLINE_S
    try:
        t0 = time.monotonic()
        probe.open()
        took_s = time.monotonic() - t0
        info = probe.info()
        states = {g["index"]: g["state"] for g in probe.gpu_states()}
    finally:
        fake.inject(1, hung=False)
    assert took_s < 3 * DEADLINE_S, took_s  # opened in parallel: the hung GPU costs one wait
    assert states == {0: "ok", 1: "unresponsive", 2: "ok", 3: "ok"}
    assert "unresponsive: gpu1" in info.detail and "found no GPUs" not in info.detail
    probe.close()
