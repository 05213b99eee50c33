"""``greend restore``: a process of its own puts back what greend left behind."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from greend.actuators.controller import Controller
from greend.actuators.gpu import NvmlGpuBackend
from greend.actuators.rapl import RaplBackend
from greend.actuators.restore import main, restore_from_state_dir
from greend.actuators.state import STATE_FILE
from greend.probes.fake_nvml import FakeNvml
from greend.probes.fake_sysfs import FakePowercap, make_standard_tree
from greend.probes.nvml import NvmlProbe
from greend.settings import Setting
from tests.support import REPO

# Applies caps through a Controller on simulated GPUs and a fake powercap tree,
# says so, and waits to be killed.
APPLY_AND_HANG = """
import sys, time
from pathlib import Path
from greend.actuators.controller import Controller
from greend.actuators.gpu import NvmlGpuBackend
from greend.actuators.rapl import RaplBackend
from greend.settings import Setting
from greend.probes.fake_nvml import FakeNvml
from greend.probes.nvml import NvmlProbe

sim, state, sysfs = map(Path, sys.argv[1:4])
probe = NvmlProbe(nvml=FakeNvml(sim), source="sim")
probe.open()
ctl = Controller(state, NvmlGpuBackend(probe), RaplBackend(sysfs))
ctl.apply_gpu(0, Setting(1500, 400.0), "job-7")
ctl.apply_gpu(1, Setting(None, 300.0), "node")
ctl.apply_gpu(2, Setting(1200, None), "job-7")
ctl.apply_cpu_limit("intel-rapl:0", 150.0, "node")
print("applied", flush=True)
time.sleep(120)
"""


def sim_controller(sim_dir: Path, state: Path, sysfs: Path | None = None) -> Controller:
    probe = NvmlProbe(nvml=FakeNvml(sim_dir), source="sim")
    probe.open()
    return Controller(state, NvmlGpuBackend(probe), RaplBackend(sysfs) if sysfs else None)


def uw(tree: FakePowercap, zone: str, n: int) -> int:
    return int((tree.dir_of(zone) / f"constraint_{n}_power_limit_uw").read_text())


def test_restore_after_sigkill(tmp_path: Path) -> None:
    sim_dir, state, sysfs = tmp_path / "sim", tmp_path / "state", tmp_path / "sys"
    fake = FakeNvml(sim_dir, n=3)
    fake.nvmlInit()
    fake.sim_gpu(1).set_power_limit_w(650.0)  # not the default: restore must bring back 650
    tree = make_standard_tree(sysfs)
    before_uw = (uw(tree, "intel-rapl:0", 0), uw(tree, "intel-rapl:0", 1))
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-c", APPLY_AND_HANG, str(sim_dir), str(state), str(sysfs)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        env=env,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30.0)
        line = proc.stdout.readline() if ready else b""
        assert line.strip() == b"applied", proc.stderr.read().decode() if proc.poll() is not None else "timeout"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    # The caps outlived the process, as they outlive a crashed daemon.
    h = [fake.nvmlDeviceGetHandleByIndex(i) for i in range(3)]
    assert fake.fake_get_locked_clocks(h[0]) == (345, 1500)
    assert fake.sim_gpu(1).power_limit_w() == 300.0
    assert uw(tree, "intel-rapl:0", 0) == 150_000_000

    report = restore_from_state_dir(state)
    assert report.exit_code == 0, report.lines()
    assert [fake.fake_get_locked_clocks(x) for x in h] == [None, None, None]
    assert [fake.sim_gpu(i).power_limit_w() for i in range(3)] == [700.0, 650.0, 700.0]
    assert (uw(tree, "intel-rapl:0", 0), uw(tree, "intel-rapl:0", 1)) == before_uw
    assert not (state / STATE_FILE).exists()
    assert restore_from_state_dir(state).lines() == ["nothing to restore"]


def test_failing_device_mid_restore_is_kept_for_the_next_try(tmp_path: Path) -> None:
    sim_dir, state = tmp_path / "sim", tmp_path / "state"
    fake = FakeNvml(sim_dir, n=3)
    ctl = sim_controller(sim_dir, state)
    for i in range(3):
        ctl.apply_gpu(i, Setting(1400, 420.0), f"job-{i}")
    fake.inject(1, lost=True)
    report = restore_from_state_dir(state)
    assert report.exit_code == 1
    assert {(f.device.split()[0], f.knob) for f in report.failed} == {
        ("gpu1", "clock_cap_mhz"),
        ("gpu1", "power_limit_w"),
    }
    assert "lost" in report.failed[0].message.lower()
    for i in (0, 2):
        assert fake.sim_gpu(i).locked_clocks_mhz() is None and fake.sim_gpu(i).power_limit_w() == 700.0
    saved = json.loads((state / STATE_FILE).read_text())
    assert [g["index"] for g in saved["gpus"]] == [1]
    assert any(line.startswith("FAILED gpu1") for line in report.lines())

    fake.inject(1, lost=False)  # the GPU is back (driver reset)
    second = restore_from_state_dir(state)
    assert second.exit_code == 0 and len(second.restored) == 2
    assert fake.sim_gpu(1).locked_clocks_mhz() is None and fake.sim_gpu(1).power_limit_w() == 700.0
    assert not (state / STATE_FILE).exists()


def test_nvml_entries_use_the_injected_module(tmp_path: Path) -> None:
    sim_dir, state = tmp_path / "sim", tmp_path / "state"
    fake = FakeNvml(sim_dir, n=2)
    probe = NvmlProbe(nvml=fake, source="nvml")  # as on a real node
    probe.open()
    Controller(state, NvmlGpuBackend(probe)).apply_gpu(1, Setting(1500, 500.0), "node")
    assert json.loads((state / STATE_FILE).read_text())["gpus"][0]["backend"] == "nvml"
    report = restore_from_state_dir(state, nvml_module=FakeNvml(sim_dir))
    assert report.ok and fake.sim_gpu(1).locked_clocks_mhz() is None
    assert fake.sim_gpu(1).power_limit_w() == 700.0


def test_missing_backend_is_reported_and_kept(tmp_path: Path) -> None:
    sim_dir, state = tmp_path / "sim", tmp_path / "state"
    FakeNvml(sim_dir, n=1)
    sim_controller(sim_dir, state).apply_gpu(0, Setting(1500, None), "node")
    for f in sim_dir.iterdir():
        f.unlink()
    sim_dir.rmdir()
    report = restore_from_state_dir(state)
    assert report.exit_code == 1 and str(sim_dir) in report.failed[0].message
    assert (state / STATE_FILE).exists()


def test_corrupt_state_exits_2_and_force_defaults_resets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sim_dir, state = tmp_path / "sim", tmp_path / "state"
    fake = FakeNvml(sim_dir, n=2)
    sim_controller(sim_dir, state).apply_gpu(0, Setting(1500, 400.0), "node")
    path = state / STATE_FILE
    path.write_text(path.read_text()[:40])  # truncated
    assert main(["--state-dir", str(state)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "--force-defaults" in err
    assert path.exists() and fake.sim_gpu(0).power_limit_w() == 400.0

    report = restore_from_state_dir(state, force_defaults=True, sim_dir=sim_dir)
    assert report.exit_code == 0, report.lines()
    assert not path.exists() and len(list(state.glob(f"{STATE_FILE}.corrupt-*"))) == 1
    assert fake.sim_gpu(0).locked_clocks_mhz() is None and fake.sim_gpu(0).power_limit_w() == 700.0


def test_main_reports_and_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sim_dir, state, sysfs = tmp_path / "sim", tmp_path / "state", tmp_path / "sys"
    FakeNvml(sim_dir, n=1)
    make_standard_tree(sysfs)
    ctl = sim_controller(sim_dir, state, sysfs)
    ctl.apply_gpu(0, Setting(1500, None), "node")
    ctl.apply_cpu_limit("intel-rapl:1", 100.0, "node")
    assert main(["--state-dir", str(state), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["exit_code"] == 0 and len(out["restored"]) == 3 and out["failed"] == []
    assert main(["--state-dir", str(state)]) == 0
    assert "nothing to restore" in capsys.readouterr().out
