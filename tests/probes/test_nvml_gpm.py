"""SM activity (``sm_active_pct``, NVML's GPM metrics) in-process: on the fake NVML's
simulated GPUs (a Hopper model answers GPM, an older one does not) and the probe's
fault paths, which never cost more than the figure (a lost GPU excepted: it is lost)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pynvml
import pytest

from greend.errors import ProbeError
from greend.probes.fake_nvml import FakeNvml
from greend.probes.nvml import NvmlProbe
from greend.probes.trace import A40_MODEL
from tests.support import ManualClock

FLOPS = 1e12


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(10_000.0)


def open_probe(nvml: Any) -> NvmlProbe:
    p = NvmlProbe(nvml=nvml, source="sim")
    p.open()
    return p


def run_for(fake: FakeNvml, clock: ManualClock, seconds: float, shares: dict[int, float]) -> None:
    """Each GPU busy ``shares[i]`` of the next ``seconds`` (steps of 0.1 s of wall time)."""
    for _ in range(int(round(seconds / 0.1))):
        for i, share in shares.items():
            gpu = fake.sim_gpu(i)
            cost = gpu.step_cost(FLOPS)
            if share > 0:
                gpu.run_steps([(FLOPS * share * 0.1 / cost.duration_s, None, "fp32")])
        clock.advance(0.1)


def sm(probe: NvmlProbe, now_s: float) -> dict[int, float | None]:
    return {g.index: g.sm_active_pct for g in probe.sample(now_s).gpus}


def test_simulated_hopper_gpus_report_their_busy_share(tmp_path: Path, clock: ManualClock) -> None:
    fake = FakeNvml(tmp_path, n=2, clock=clock)
    p = open_probe(fake)
    assert sm(p, 0.0) == {0: None, 1: None}  # one sample: no interval yet
    run_for(fake, clock, 1.0, {0: 1.0, 1: 0.5})
    got = sm(p, 1.0)
    assert got[0] == pytest.approx(100.0, abs=0.5) and got[1] == pytest.approx(50.0, abs=1.0)
    run_for(fake, clock, 0.5, {0: 1.0, 1: 0.5})
    assert sm(p, 1.5) == got  # not a slow read: the last figure stands
    run_for(fake, clock, 1.0, {0: 0.25, 1: 0.5})
    assert sm(p, 2.5)[0] == pytest.approx(25.0 + 0.5 * 75.0 / 1.5, abs=1.0)  # the 1.5 s since the last sample
    p.close()
    assert not p._gpm._gpus  # the buffers are freed


def test_an_older_simulated_model_has_no_gpm(tmp_path: Path, clock: ManualClock) -> None:
    fake = FakeNvml(tmp_path, n=1, clock=clock, spec=A40_MODEL)
    p = open_probe(fake)
    h = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlGpmQueryDeviceSupport(h).isSupportedDevice == 0
    with pytest.raises(pynvml.NVMLError) as e:
        fake.nvmlGpmSampleGet(h, fake.nvmlGpmSampleAlloc())
    assert e.value.value == pynvml.NVML_ERROR_NOT_SUPPORTED
    sm(p, 0.0)
    run_for(fake, clock, 1.0, {0: 1.0})
    g = p.sample(1.0).gpus[0]
    assert g.sm_active_pct is None and g.util_gpu_pct == pytest.approx(100.0)
    assert p.device_errors == {}


def test_mig_and_pre_volta_gpus_read_none_without_error(tmp_path: Path, clock: ManualClock) -> None:
    fake = FakeNvml(tmp_path, n=3, clock=clock)
    fake.inject(1, mig=True)
    fake.inject(2, no_energy_counter=True)
    p = open_probe(fake)
    sm(p, 0.0)
    run_for(fake, clock, 1.0, {0: 1.0, 1: 1.0, 2: 1.0})
    got = sm(p, 1.0)
    assert got[0] == pytest.approx(100.0, abs=0.5) and got[1] is None and got[2] is None
    assert not any("Gpm" in k for errs in p.device_errors.values() for k in errs)


def test_the_fakes_gpm_calls_check_as_nvml_does(tmp_path: Path, clock: ManualClock) -> None:
    fake = FakeNvml(tmp_path, n=2, clock=clock)
    fake.nvmlInit()
    h0, h1 = fake.nvmlDeviceGetHandleByIndex(0), fake.nvmlDeviceGetHandleByIndex(1)
    a, b = fake.nvmlGpmSampleAlloc(), fake.nvmlGpmSampleAlloc()
    fake.nvmlGpmSampleGet(h0, a)
    clock.advance(1.0)
    fake.nvmlGpmSampleGet(h1, b)

    def code(query: Any) -> int:
        with pytest.raises(pynvml.NVMLError) as e:
            fake.nvmlGpmMetricsGet(query)
        return int(e.value.value)

    q = fake.c_nvmlGpmMetricsGet_t()
    q.version, q.numMetrics, q.sample1, q.sample2 = pynvml.NVML_GPM_METRICS_GET_VERSION, 1, a, b
    q.metrics[0].metricId = pynvml.NVML_GPM_METRIC_SM_UTIL
    assert code(q) == pynvml.NVML_ERROR_INVALID_ARGUMENT  # two GPUs
    fake.nvmlGpmSampleGet(h0, b)
    q.version = 2
    assert code(q) == pynvml.NVML_ERROR_INVALID_ARGUMENT  # a wrong version
    q.version, q.sample1, q.sample2 = pynvml.NVML_GPM_METRICS_GET_VERSION, b, a
    assert code(q) == pynvml.NVML_ERROR_INVALID_ARGUMENT  # the wrong order
    q.sample1, q.sample2 = a, b
    q.metrics[1].metricId, q.numMetrics = pynvml.NVML_GPM_METRIC_SM_OCCUPANCY, 2
    fake.nvmlGpmMetricsGet(q)
    assert q.metrics[0].nvmlReturn == 0 and q.metrics[0].value == pytest.approx(0.0)  # idle
    assert q.metrics[1].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    fake.nvmlGpmSampleFree(a)
    with pytest.raises(pynvml.NVMLError):
        fake.nvmlGpmSampleFree(a)  # a second free


class Failing:
    """The fake NVML with one GPM call failing (``error``: an NVML code, or an exception
    raised as a binding's bug would be) while ``on``."""

    def __init__(self, fake: FakeNvml, fn: str, error: int | Exception) -> None:
        self._fake, self._fn, self._error, self.on = fake, fn, error, False

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._fake, name)
        if name != self._fn:
            return target

        def call(*args: Any) -> Any:
            if self.on:
                if isinstance(self._error, Exception):
                    raise self._error
                raise pynvml.NVMLError(self._error)
            return target(*args)

        return call


@pytest.mark.parametrize(
    ("fn", "error"),
    [
        ("nvmlGpmSampleGet", 999),  # an NVML error greend has no name for
        ("nvmlGpmMetricsGet", pynvml.NVML_ERROR_INVALID_ARGUMENT),
        ("nvmlGpmSampleGet", TypeError("argument 2: wrong type")),  # a binding's bug
    ],
)
def test_an_error_mid_run_costs_the_figure_only(
    tmp_path: Path, clock: ManualClock, caplog: pytest.LogCaptureFixture, fn: str, error: int | Exception
) -> None:
    fake = FakeNvml(tmp_path, n=2, clock=clock)
    nvml = Failing(fake, fn, error)
    p = open_probe(nvml)
    sm(p, 0.0)
    run_for(fake, clock, 1.0, {0: 1.0, 1: 0.5})
    assert sm(p, 1.0)[1] == pytest.approx(50.0, abs=1.0)
    nvml.on = True
    with caplog.at_level(logging.WARNING):
        for t in (2.0, 3.0, 4.0):
            run_for(fake, clock, 1.0, {0: 1.0, 1: 0.5})
            r = {g.index: g for g in p.sample(t).gpus}
            assert r[0].sm_active_pct is None and r[1].sm_active_pct is None
            assert r[1].util_gpu_pct == pytest.approx(50.0, abs=1.0) and r[1].energy_j > 0  # the rest reads on
    assert len([m for m in caplog.messages if "SM activity" in m and "gpu1" in m]) == 1  # logged once
    assert any(fn in k or k == "gpm" for k in p.device_errors[1])
    nvml.on = False
    for t in (5.0, 6.0):
        run_for(fake, clock, 1.0, {0: 1.0, 1: 0.5})
        got = sm(p, t)
    assert got[1] == pytest.approx(50.0, abs=1.0) and p.device_errors == {}  # back, the error cleared


def test_a_lost_gpu_is_lost_and_the_others_read_on(tmp_path: Path, clock: ManualClock) -> None:
    fake = FakeNvml(tmp_path, n=2, clock=clock)
    p = open_probe(fake)
    sm(p, 0.0)
    run_for(fake, clock, 1.0, {0: 1.0, 1: 0.5})
    sm(p, 1.0)
    fake.inject(1, lost=True)
    run_for(fake, clock, 1.0, {0: 1.0})
    assert sm(p, 2.0) == {0: pytest.approx(100.0, abs=0.5)}
    assert 1 in p.lost_gpus
    p.close()  # frees the lost GPU's buffers too (freeing needs no device)
    assert not p._gpm._gpus


def test_an_nvidia_ml_py_without_gpm_reads_none(tmp_path: Path, clock: ManualClock) -> None:
    class NoGpm:
        def __init__(self, fake: FakeNvml) -> None:
            self._fake = fake

        def __getattr__(self, name: str) -> Any:
            if "Gpm" in name:
                raise AttributeError(name)
            return getattr(self._fake, name)

    fake = FakeNvml(tmp_path, n=1, clock=clock)
    p = open_probe(NoGpm(fake))
    sm(p, 0.0)
    run_for(fake, clock, 1.0, {0: 1.0})
    assert sm(p, 1.0) == {0: None} and p.device_errors == {}


class Once:
    """The fake NVML where call ``fn`` fails once, at its ``at``-th call (1: the first),
    with ``code``; ``then`` runs first (the fault itself, e.g. NVML shut down). ``calls``:
    each GPM call, its arguments and what it answered."""

    def __init__(self, fake: FakeNvml, fn: str, code: int, at: int = 1, then: Any = None) -> None:
        self._fake, self._fn, self._code, self._at, self._then = fake, fn, code, at, then
        self.calls: list[tuple[str, tuple[Any, ...], Any]] = []

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._fake, name)
        if "Gpm" not in name:
            return target

        def call(*args: Any) -> Any:
            if name == self._fn and sum(1 for c in self.calls if c[0] == name) + 1 == self._at:
                self.calls.append((name, args, None))
                if self._then is not None:
                    self._then()
                raise pynvml.NVMLError(self._code)
            got = target(*args)
            self.calls.append((name, args, got))
            return got

        return call


def test_a_gpu_lost_while_its_gpm_support_is_asked_reads_sm_activity_once_back(
    tmp_path: Path, clock: ManualClock
) -> None:
    """The GPU answers GPU_IS_LOST to its first nvmlGpmQueryDeviceSupport: it is lost,
    with no GPM buffers; found again (a fresh handle), its support is asked again and its
    SM activity reads from a new pair of samples."""
    fake = FakeNvml(tmp_path, n=1, clock=clock)
    nvml = Once(fake, "nvmlGpmQueryDeviceSupport", pynvml.NVML_ERROR_GPU_IS_LOST)
    p = open_probe(nvml)
    assert sm(p, 0.0) == {}  # lost at its first query
    assert 0 in p.lost_gpus and not p._gpm._gpus
    readings: list[dict[int, float | None]] = []
    for t in range(1, 10):
        run_for(fake, clock, 1.0, {0: 0.5})
        readings.append(sm(p, float(t)))
    assert readings[-1][0] == pytest.approx(50.0, abs=1.0), readings
    assert not p.lost_gpus and p.device_errors == {}
    queries = [c for c in nvml.calls if c[0] == "nvmlGpmQueryDeviceSupport"]
    assert len(queries) == 2  # the lost one, and once back
    p.close()
    assert not p._gpm._gpus


def test_nvml_shut_down_between_the_two_buffers_drops_the_first_and_asks_again(
    tmp_path: Path, clock: ManualClock
) -> None:
    """NVML is shut down under greend as GPU 0's second buffer is allocated: the read
    raises UNINITIALIZED (the probe initialises NVML again), the first buffer is
    dropped, never handed to NVML again, and the GPU is asked again: SM activity reads."""
    fake = FakeNvml(tmp_path, n=1, clock=clock)
    nvml = Once(fake, "nvmlGpmSampleAlloc", pynvml.NVML_ERROR_UNINITIALIZED, at=2, then=fake.drop_init)
    p = open_probe(nvml)
    with pytest.raises(ProbeError):
        p.sample(0.0)  # every GPU failed this tick: NVML was shut down
    first = nvml.calls[-2]
    assert first[0] == "nvmlGpmSampleAlloc" and nvml.calls[-1][0] == "nvmlGpmSampleAlloc"
    readings = []
    for t in range(1, 5):
        run_for(fake, clock, 1.0, {0: 0.5})
        readings.append(sm(p, float(t)))
    assert readings[-1][0] == pytest.approx(50.0, abs=1.0), readings
    p.close()
    later = [c for c in nvml.calls[nvml.calls.index(first) + 2 :]]
    assert not any(first[2] in args for _, args, _ in later)  # not used, not freed
    freed = [args[0] for name, args, _ in later if name == "nvmlGpmSampleFree"]
    allocated = [got for name, _, got in later if name == "nvmlGpmSampleAlloc"]
    assert len(freed) == 2 and freed == allocated  # the two allocated after the shutdown
