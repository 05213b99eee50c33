"""HostProbe with the real psutil on this machine, and with small doubles for the edges."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from greend.probes import ProbeContext
from greend.probes.base import MeasuresProcesses, Probe, SampledEvery, ShowsClockCaps, SimulatesGpus
from greend.probes.host import IDLE_FRACTION, HostProbe, estimate_cpu_power_w


def busy(seconds: float) -> None:
    end = time.process_time() + seconds
    x = 0
    while time.process_time() < end:
        x += 1


def opened(**kw: Any) -> HostProbe:
    probe = HostProbe(**kw)
    probe.open()
    return probe


# -- real psutil ------------------------------------------------------------------


def test_real_host_figures_plausible() -> None:
    probe = opened()
    assert isinstance(probe, Probe)
    # Its optional abilities, as the daemon asks for them.
    assert isinstance(probe, SampledEvery) and isinstance(probe, MeasuresProcesses)
    assert not isinstance(probe, ShowsClockCaps) and not isinstance(probe, SimulatesGpus)
    busy(0.05)
    host = probe.sample(1.0).host
    assert host is not None
    assert 0.0 <= host.cpu_util_pct <= 100.0
    assert host.cpu_count == psutil.cpu_count(logical=True) >= 1
    assert 16 * 2**20 < host.mem_total_bytes == psutil.virtual_memory().total
    assert 0 < host.mem_used_bytes < host.mem_total_bytes
    assert host.load_1m >= 0.0
    assert host.process_cpu_s == {}


def test_own_cpu_time_grows_after_busy_work() -> None:
    me = os.getpid()
    probe = opened(job_pids=lambda: [me])
    first = probe.sample(1.0).host
    assert first is not None
    busy(0.2)
    second = probe.sample(2.0).host
    assert second is not None
    assert second.process_cpu_s[me] - first.process_cpu_s[me] >= 0.15


def test_live_child_cpu_time_counted_once() -> None:
    code = "import time\nend=time.process_time()+0.3\nwhile time.process_time()<end: pass\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        me = os.getpid()
        deadline = time.monotonic() + 10
        while psutil.Process(child.pid).cpu_times().user + psutil.Process(child.pid).cpu_times().system < 0.25:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        own = psutil.Process(me).cpu_times()
        own_s = own.user + own.system + own.children_user + own.children_system
        alone = opened(job_pids=lambda: [me]).sample(0.0).host
        both = opened(job_pids=lambda: [me, child.pid]).sample(0.0).host
        assert alone is not None and both is not None
        # Alone, the parent's figure includes its live child; listed, the child has its own.
        assert alone.process_cpu_s[me] >= own_s + 0.24
        assert both.process_cpu_s[child.pid] >= 0.25
        assert both.process_cpu_s[me] < alone.process_cpu_s[me] - 0.2
    finally:
        child.kill()
        child.wait()


def test_vanished_pid_is_dropped() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    me = os.getpid()
    host = opened(job_pids=lambda: [gone.pid, me]).sample(1.0).host
    assert host is not None
    assert set(host.process_cpu_s) == {me}


class _Denied:
    def __init__(self, pid: int) -> None:
        raise psutil.AccessDenied(pid)


def test_access_denied_pid_is_dropped() -> None:
    fake = SimpleNamespace(**{n: getattr(psutil, n) for n in dir(psutil) if not n.startswith("_")})
    fake.Process = _Denied
    host = opened(job_pids=lambda: [1], psutil_module=fake).sample(1.0).host
    assert host is not None and host.process_cpu_s == {}


# -- the estimate -----------------------------------------------------------------


class FakePsutil:
    """Just enough psutil: utilisation scripted per call."""

    NoSuchProcess = psutil.NoSuchProcess
    AccessDenied = psutil.AccessDenied
    __version__ = "fake"

    def __init__(self, utils: list[float]) -> None:
        self.utils = list(utils)
        self.calls = 0

    def cpu_percent(self, interval: float | None = None) -> float:
        assert interval is None
        self.calls += 1
        return self.utils.pop(0) if self.utils else 0.0

    def cpu_count(self, logical: bool = True) -> int:
        return 8

    def virtual_memory(self) -> Any:
        return SimpleNamespace(total=64 * 2**30, available=48 * 2**30)

    def getloadavg(self) -> tuple[float, float, float]:
        return (1.5, 1.0, 0.5)

    def Process(self, pid: int) -> Any:
        raise psutil.NoSuchProcess(pid)


def test_model() -> None:
    assert estimate_cpu_power_w(0.0, 200.0) == pytest.approx(200.0 * IDLE_FRACTION)
    assert estimate_cpu_power_w(100.0, 200.0) == pytest.approx(200.0)
    assert estimate_cpu_power_w(50.0, 200.0) == pytest.approx(200.0 * 0.65)
    assert estimate_cpu_power_w(150.0, 200.0) == pytest.approx(200.0)  # clamped


def test_estimate_labelled_and_integrated_with_injected_now() -> None:
    ps = FakePsutil([0.0, 50.0, 100.0, 0.0])  # the first is open()'s priming call
    probe = opened(cpu_tdp_w=100.0, psutil_module=ps)
    assert ps.calls == 1
    r1 = probe.sample(10.0)
    (est,) = r1.cpus
    assert (est.zone, est.path, est.source, est.counted) == ("package", "estimate", "estimate", True)
    assert est.power_w == pytest.approx(65.0)
    assert est.energy_j == 0.0  # no interval yet
    r2 = probe.sample(12.0)  # 2 s at a mean 100 %: 2 x 100 W
    assert r2.cpus[0].energy_j == pytest.approx(200.0)
    r3 = probe.sample(12.5)  # 0.5 s idle: 0.5 x 30 W
    assert r3.cpus[0].energy_j == pytest.approx(215.0)
    assert r3.cpus[0].power_w == pytest.approx(30.0)
    host = r3.host
    assert host is not None and host.cpu_count == 8 and host.mem_used_bytes == 16 * 2**30
    assert host.load_1m == 1.5
    info = probe.info()
    assert "ESTIMATED" in info.detail and "source=estimate" in info.detail and info.fix is None


def test_real_psutil_estimate_in_range() -> None:
    probe = opened(cpu_tdp_w=120.0)
    probe.sample(0.0)
    busy(0.1)
    (est,) = probe.sample(1.0).cpus
    assert est.source == "estimate"
    assert 36.0 <= (est.power_w or 0.0) <= 120.0
    assert 36.0 <= est.energy_j <= 120.0


def test_no_estimate_without_tdp_and_info_says_how() -> None:
    probe = opened(psutil_module=FakePsutil([0.0, 80.0]))
    assert probe.sample(1.0).cpus == []
    info = probe.info()
    assert info.available and info.fix is not None and "cpu_tdp_w" in info.fix


def test_no_estimate_when_rapl_present() -> None:
    rapl = {"present": True}
    probe = opened(cpu_tdp_w=100.0, rapl_present=lambda: rapl["present"], psutil_module=FakePsutil([0.0] * 5))
    assert probe.sample(1.0).cpus == []
    assert "rapl" in probe.info().detail
    rapl["present"] = False  # RAPL went away: the estimate starts without counting the gap
    assert probe.sample(100.0).cpus[0].energy_j == 0.0
    assert probe.sample(101.0).cpus[0].energy_j == pytest.approx(30.0)


def test_negative_tdp_refused() -> None:
    with pytest.raises(ValueError):
        HostProbe(cpu_tdp_w=-1.0)


def test_registered_factory_uses_context() -> None:
    from greend.probes import REGISTRY

    reg = REGISTRY["host"]
    assert reg.default is True
    probe = reg.factory(ProbeContext(cpu_tdp_w=77.0, job_pids=lambda: [os.getpid()]))
    assert isinstance(probe, HostProbe) and probe.cpu_tdp_w == 77.0
    probe.open()
    host = probe.sample(0.0).host
    assert host is not None and os.getpid() in host.process_cpu_s
