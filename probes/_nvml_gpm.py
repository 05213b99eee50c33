"""SM activity from NVML's GPM metrics (Hopper and newer), for the NVML probe
(:mod:`greend.probes.nvml`): ``GpuReading.sm_active_pct``.

Why: NVML's ``utilization.gpu`` (``util_gpu_pct``) is the share of time *some* kernel
ran. A rank that waits in an NCCL collective runs NCCL's wait kernels (a few CTAs
spinning on a flag) all that time, so a GPU that only waits for a slower peer reads near
100 % there. GPM's ``NVML_GPM_METRIC_SM_UTIL`` is the share of the SMs busy over the
interval between two samples: the same GPU reads low, which is the slack within-node
pacing (:mod:`greend.policies._pacing`) looks for.

How: at a GPU's first read, where ``nvmlGpmQueryDeviceSupport`` says it supports GPM
(Hopper and newer, not in MIG mode), two sample buffers are allocated for it, once. Each
read of the GPU's slow fields (at most once a second, with utilisation) takes a sample
(``nvmlGpmSampleGet``) into the buffer that does not hold the last one and computes
SM_UTIL over the two (``nvmlGpmMetricsGet``): the figure covers the time since the last
read, about the policy's period. The buffers are freed at :meth:`Gpm.close` (the probe's
close), on each GPU's own worker, after any read still out there.

Faults never leave this module as anything but ``None``, except a lost GPU and NVML shut
down under greend (``DeviceLost``, ``NvmlUninitialized``, as from every other read).
Unsupported (pre-Hopper, MIG, a driver or ``pynvml`` without GPM, ``NOT_SUPPORTED``)
reads None with no error; any other NVML error (or a binding's bug) reads None, is
logged once and kept in the GPU's errors until GPM answers again, and starts the pair
again (the next read takes a first sample, the one after gives a figure). A GPU found
again with a new handle (a reset, NVML initialised again) starts the pair again too:
samples of two handles are not compared. A GPU lost, or NVML shut down, while its
support is asked or its buffers allocated is asked again at its next read. Where the
probe initialises NVML again (someone's ``nvmlShutdown``), every GPU gets new buffers
(:meth:`Gpm.forget`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from greend.errors import DeviceLost, NotSupported, ProbeError

from ._nvml_state import TrackedGpu
from .nvml_device import NvmlDevices, NvmlUninitialized

__all__ = ["Gpm"]

log = logging.getLogger(__name__)

_FAILED = object()  # a call that failed (a call may answer None)
_UNSUPPORTED = object()  # a call that answered NOT_SUPPORTED
_NO_ANSWER = (_FAILED, _UNSUPPORTED)  # compared by identity: `in` tries `is` first
_CALLS = ("nvmlGpmQueryDeviceSupport", "nvmlGpmSampleAlloc", "nvmlGpmSampleGet", "nvmlGpmMetricsGet")
_NEEDED = (*_CALLS, "nvmlGpmSampleFree", "c_nvmlGpmMetricsGet_t")  # what the module must have


@dataclass
class _GpuGpm:
    """One GPU's GPM buffers: ``last`` is which of the two holds the last sample (None:
    none yet), taken with ``handle``; ``value`` the last figure."""

    gpu: TrackedGpu
    samples: list[Any] = field(default_factory=list)
    last: int | None = None
    handle: Any = None
    value: float | None = None


class Gpm:
    """GPM SM activity of the GPUs that support it, by UUID. See the module docstring."""

    def __init__(self, devices: NvmlDevices) -> None:
        self._devices = devices
        self._gpus: dict[str, _GpuGpm] = {}
        self._asked: set[str] = set()  # UUIDs whose support was asked (and answered)
        self._lock = threading.Lock()  # each GPU's reads run on its own worker, at once
        self._generation = 0  # one more at each forget(): buffers of an earlier one are not kept

    def _call(self, gpu: TrackedGpu, fn: str, *args: Any) -> Any:
        """``nvml.<fn>(*args)`` on the GPU's worker: ``_UNSUPPORTED`` where it answered
        NOT_SUPPORTED, ``_FAILED`` where it failed otherwise (logged once and kept in
        ``gpu.errors``); a lost GPU raises, and so does NVML shut down under greend (the
        probe initialises it again)."""
        try:
            return self._devices.call(f"gpu{gpu.index}", fn, *args)
        except (DeviceLost, NvmlUninitialized):
            raise
        except NotSupported:
            return _UNSUPPORTED
        except ProbeError as e:
            if gpu.errors.get(fn) != str(e):
                log.warning("%s (its SM activity is not read meanwhile)", e)
            gpu.errors[fn] = str(e)
            return _FAILED

    def _open(self, gpu: TrackedGpu) -> _GpuGpm | None:
        """The GPU's two sample buffers where it supports GPM. Asked once per UUID: marked
        asked only on an answer (supported, unsupported, NOT_SUPPORTED); an error leaves
        it to be asked at the next read, and so does a lost GPU or NVML shut down under
        greend (raised, after freeing what was allocated, or dropping it: :meth:`forget`)."""
        nvml = self._devices.nvml
        if gpu.mig or not all(hasattr(nvml, name) for name in _NEEDED):
            self._asked.add(gpu.uuid)  # MIG: GPM is per GPU instance there; or an nvidia-ml-py without GPM
            return None
        generation = self._generation
        support = self._call(gpu, "nvmlGpmQueryDeviceSupport", gpu.handle)
        if support is _FAILED:
            return None  # an error, not an answer: asked again at the next read
        if support is _UNSUPPORTED or not int(getattr(support, "isSupportedDevice", 0)):
            self._asked.add(gpu.uuid)
            log.info("gpu%d (%s) has no GPM metrics: its SM activity is not read", gpu.index, gpu.name)
            return None
        st = _GpuGpm(gpu)
        try:
            for _ in range(2):
                sample = self._call(gpu, "nvmlGpmSampleAlloc")
                if sample is _FAILED or sample is _UNSUPPORTED:
                    self._free(st)
                    if sample is _UNSUPPORTED:
                        self._asked.add(gpu.uuid)
                    return None
                st.samples.append(sample)
        except NvmlUninitialized:
            self._forget(st)  # allocated before NVML was shut down under greend
            raise
        except BaseException:
            self._free(st)
            raise
        with self._lock:
            if generation != self._generation:  # NVML was initialised again meanwhile
                self._forget(st)
                return None
            self._gpus[gpu.uuid] = st
            self._asked.add(gpu.uuid)
        return st

    def read(self, gpu: TrackedGpu, fresh: bool) -> float | None:
        """The GPU's SM activity in percent (None: not read). ``fresh``: take a sample and
        compute the figure over the last two (the slow fields are read this tick); else
        the last figure. On the GPU's worker; raises only ``DeviceLost`` and
        ``NvmlUninitialized``, as every read does."""
        try:
            return self._read(gpu, fresh)
        except (DeviceLost, NvmlUninitialized):
            raise
        except Exception as e:  # a binding's or this module's bug costs the figure only
            key = "gpm"
            if gpu.errors.get(key) != f"{type(e).__name__}: {e}":
                log.warning("gpu%d: reading SM activity (GPM) failed: %s: %s", gpu.index, type(e).__name__, e)
            gpu.errors[key] = f"{type(e).__name__}: {e}"
            st = self._gpus.get(gpu.uuid)
            if st is not None:
                st.last, st.value = None, None
            return None

    def _read(self, gpu: TrackedGpu, fresh: bool) -> float | None:
        generation = self._generation
        st = self._gpus.get(gpu.uuid)
        if st is None and fresh and gpu.uuid not in self._asked:
            st = self._open(gpu)
        if st is None or not fresh:
            return None if st is None else st.value
        samples = st.samples
        if len(samples) < 2:
            return None  # forgotten meanwhile (NVML initialised again): the next read opens anew
        st.gpu = gpu
        if st.handle is not gpu.handle:  # found again with a fresh handle: a new pair
            st.last, st.handle = None, gpu.handle
        k = 0 if st.last is None else 1 - st.last
        if self._call(gpu, "nvmlGpmSampleGet", gpu.handle, samples[k]) in _NO_ANSWER:
            st.last, st.value = None, None  # the next read starts a new pair
            return None
        prev, st.last = st.last, k
        st.value = None if prev is None else self._sm_util(gpu, samples[prev], samples[k])
        if generation != self._generation:
            return None  # buffers of before NVML was initialised again
        if st.value is not None:
            for key in (*_CALLS, "gpm"):
                gpu.errors.pop(key, None)  # it answers again
        return st.value

    def _sm_util(self, gpu: TrackedGpu, older: Any, newer: Any) -> float | None:
        nvml = self._devices.nvml
        query = nvml.c_nvmlGpmMetricsGet_t()
        query.version = nvml.NVML_GPM_METRICS_GET_VERSION
        query.numMetrics = 1
        query.sample1, query.sample2 = older, newer
        query.metrics[0].metricId = nvml.NVML_GPM_METRIC_SM_UTIL
        if self._call(gpu, "nvmlGpmMetricsGet", query) in _NO_ANSWER:
            return None
        metric = query.metrics[0]
        if int(metric.nvmlReturn) != 0:  # this metric's own status: its value is not valid
            return None
        return min(100.0, max(0.0, float(metric.value)))

    def _free(self, st: _GpuGpm) -> None:
        for sample in st.samples:
            try:
                self._devices.call(f"gpu{st.gpu.index}", "nvmlGpmSampleFree", sample)
            except Exception as e:  # a hung or lost GPU keeps its buffers: freeing must not fail close
                log.debug("gpu%d nvmlGpmSampleFree: %s", st.gpu.index, e)
        st.samples, st.last, st.value = [], None, None

    @staticmethod
    def _forget(st: _GpuGpm) -> None:
        st.samples, st.last, st.value = [], None, None

    def forget(self) -> None:
        """NVML was shut down under greend and is being initialised again (called before
        ``nvmlInit``): forget every GPU's buffers and ask each GPU again, so that each gets
        new buffers. They are dropped, not freed: nvml.h does not say that a sample buffer
        outlives ``nvmlShutdown``, nor that freeing one after it is safe, so one allocated
        before is never handed to NVML again (two buffers per GPU left, each time someone
        shuts NVML down under greend). A read already under way on the old buffers
        reads None."""
        with self._lock:
            gpus, self._gpus, self._asked = list(self._gpus.values()), {}, set()
            self._generation += 1
            for st in gpus:
                self._forget(st)
        if gpus:
            log.info("GPM buffers of %d GPU(s) dropped: new ones once NVML is initialised again", len(gpus))

    def close(self) -> None:
        """Free every GPU's buffers (before ``nvmlShutdown``)."""
        with self._lock:
            gpus, self._gpus, self._asked = list(self._gpus.values()), {}, set()
        for st in gpus:
            self._free(st)
