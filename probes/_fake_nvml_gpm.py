"""The GPM part of the fake NVML (:class:`~greend.probes.fake_nvml.FakeNvml`): the SM
activity of simulated GPUs, through ``pynvml``'s GPM calls.

A simulated GPU whose model is a Hopper part or newer (compute capability 9.0 and up,
as the ``H100`` spec) supports GPM; one of an older model (the trace replay's A40), a
pre-Volta one (the ``no_energy_counter`` fault) does not: ``nvmlGpmQueryDeviceSupport``
says ``isSupportedDevice`` 0 and its samples ``NOT_SUPPORTED``, as do a MIG-mode GPU's
whole-device samples. ``NVML_GPM_METRIC_SM_UTIL`` over two samples is the GPU's busy
share over the time between them: the share of it during which a step ran, plus the
background load over the rest (its utilisation's rule, over the samples' interval
instead of NVML's utilisation window). The simulator has no NCCL: a GPU that waits for a
slower one is idle, so its SM activity and its utilisation read alike.

The calls keep ``pynvml``'s shapes: ``nvmlGpmSampleAlloc()`` returns an opaque sample,
``nvmlGpmSampleGet(handle, sample)`` fills it, ``nvmlGpmMetricsGet(query)`` takes an
object with ``c_nvmlGpmMetricsGet_t``'s fields (``FakeNvml.c_nvmlGpmMetricsGet_t``
makes one) and fills each metric's ``nvmlReturn`` and ``value``; a wrong ``version``, or
samples not filled, of two GPUs or in the wrong order, raise ``INVALID_ARGUMENT``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

import pynvml

from ._fake_nvml_faults import Faults
from ._sim_device import SimGpu

__all__ = ["FakeGpm", "FakeGpmMetricsGet", "FakeGpmSample"]

HOPPER = (9, 0)


class FakeGpmSample:
    """An opaque GPM sample buffer (``c_nvmlGpmSample_t`` for real)."""

    __slots__ = ("alive", "gpu", "serial", "t_s", "busy_s", "background_load")

    def __init__(self) -> None:
        self.alive = True
        self.gpu: int | None = None  # the simulated GPU sampled; None: not filled
        self.serial = 0  # the numbering the handle was issued under (FakeHandle.serial)
        self.t_s = 0.0
        self.busy_s = 0.0
        self.background_load = 0.0


class FakeGpmMetricInfo:
    __slots__ = ("longName", "shortName", "unit")

    def __init__(self) -> None:
        self.shortName: bytes | None = None
        self.longName: bytes | None = None
        self.unit: bytes | None = None


class FakeGpmMetric:
    """``c_nvmlGpmMetric_t``'s fields."""

    __slots__ = ("metricId", "metricInfo", "nvmlReturn", "value")

    def __init__(self) -> None:
        self.metricId = 0
        self.nvmlReturn = 0
        self.value = 0.0
        self.metricInfo = FakeGpmMetricInfo()


class FakeGpmMetricsGet:
    """``c_nvmlGpmMetricsGet_t``'s fields: ``version``, ``numMetrics``, ``sample1``,
    ``sample2`` and ``metrics`` (``NVML_GPM_METRIC_MAX`` of them, as in the bindings)."""

    def __init__(self) -> None:
        self.version = 0
        self.numMetrics = 0
        self.sample1: Any = None
        self.sample2: Any = None
        self.metrics = [FakeGpmMetric() for _ in range(int(getattr(pynvml, "NVML_GPM_METRIC_MAX", 98)))]


def _raise(code: int) -> NoReturn:
    raise pynvml.NVMLError(code)


def _gpm_support() -> Any:
    """``pynvml``'s support struct where it has one (a plain object with its fields else)."""
    cls = getattr(pynvml, "c_nvmlGpmSupport_t", None)
    return cls() if cls is not None else type("GpmSupport", (), {"version": 1, "isSupportedDevice": 0})()


class FakeGpm:
    """The ``nvmlGpm*`` calls of :class:`~greend.probes.fake_nvml.FakeNvml` (a mixin)."""

    c_nvmlGpmMetricsGet_t = FakeGpmMetricsGet

    if TYPE_CHECKING:  # FakeNvml's

        def _maybe_wait(self, fn: str, first_arg: Any) -> None: ...
        def _check_init(self) -> None: ...
        def _gpu(self, handle: Any) -> SimGpu: ...
        def faults(self) -> Faults: ...

    def _gpm_gpu(self, fn: str, handle: Any) -> tuple[SimGpu, bool, bool]:
        """The simulated GPU behind ``handle`` (the usual faults first), whether it is a
        GPM device (Hopper and newer) and whether it is in MIG mode."""
        self._maybe_wait(fn, handle)
        gpu = self._gpu(handle)
        f = self.faults().gpu(handle.index)
        return gpu, tuple(gpu.spec.compute_capability) >= HOPPER and not f.no_energy_counter, f.mig

    def nvmlGpmQueryDeviceSupport(self, handle: Any) -> Any:
        _, hopper, _ = self._gpm_gpu("nvmlGpmQueryDeviceSupport", handle)
        support = _gpm_support()
        support.version, support.isSupportedDevice = 1, int(hopper)
        return support

    def nvmlGpmSampleAlloc(self) -> FakeGpmSample:
        self._maybe_wait("nvmlGpmSampleAlloc", None)
        self._check_init()
        return FakeGpmSample()

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        self._maybe_wait("nvmlGpmSampleFree", None)
        if not isinstance(sample, FakeGpmSample) or not sample.alive:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        sample.alive = False

    def nvmlGpmSampleGet(self, handle: Any, sample: Any) -> Any:
        gpu, hopper, mig = self._gpm_gpu("nvmlGpmSampleGet", handle)
        if not isinstance(sample, FakeGpmSample) or not sample.alive:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not hopper or mig:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        sample.t_s, sample.busy_s = gpu.busy_time_s()
        sample.gpu, sample.serial, sample.background_load = handle.index, handle.serial, gpu.background_load()
        return sample

    def nvmlGpmMigSampleGet(self, handle: Any, gpuInstanceId: int, sample: Any) -> Any:
        _, hopper, mig = self._gpm_gpu("nvmlGpmMigSampleGet", handle)
        if not isinstance(sample, FakeGpmSample) or not sample.alive:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not hopper or not mig:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        _raise(pynvml.NVML_ERROR_NOT_FOUND)  # the simulator models no GPU instances

    def nvmlGpmMetricsGet(self, query: Any) -> Any:
        self._maybe_wait("nvmlGpmMetricsGet", None)
        self._check_init()
        a, b = getattr(query, "sample1", None), getattr(query, "sample2", None)
        if (
            getattr(query, "version", None) != getattr(pynvml, "NVML_GPM_METRICS_GET_VERSION", 1)
            or not 0 <= int(query.numMetrics) <= len(query.metrics)
            or not isinstance(a, FakeGpmSample)
            or not isinstance(b, FakeGpmSample)
            or not (a.alive and b.alive)
            or a.gpu is None
            or (a.gpu, a.serial) != (b.gpu, b.serial)
            or b.t_s <= a.t_s
        ):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        frac = min(1.0, max(0.0, (b.busy_s - a.busy_s) / (b.t_s - a.t_s)))
        for m in query.metrics[: int(query.numMetrics)]:
            if m.metricId != pynvml.NVML_GPM_METRIC_SM_UTIL:
                m.nvmlReturn, m.value = pynvml.NVML_ERROR_NOT_SUPPORTED, 0.0
                continue
            m.nvmlReturn, m.value = pynvml.NVML_SUCCESS, 100.0 * (frac + b.background_load * (1.0 - frac))
            m.metricInfo.shortName, m.metricInfo.longName, m.metricInfo.unit = b"sm_util", b"SM utilization", b"%"
        return query
