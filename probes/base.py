"""The probe protocol and the records probes return.

A probe is one source of readings (NVML GPUs, RAPL zones, the host, simulated
GPUs). The tick loop calls ``sample(now_s)`` on every enabled probe; a probe that
raises is recorded as failed for that tick and the others carry on.

Energy is always a *cumulative, monotonic* figure in joules, counted by the probe
from its own ``open()``: probes hide counter units (mJ, µJ), counter origins and
wraparound, so the ledger only ever subtracts two readings of the same key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "CpuReading",
    "GpuReading",
    "HostReading",
    "MeasuresProcesses",
    "Probe",
    "ProbeInfo",
    "Readings",
    "SampledEvery",
    "ShowsClockCaps",
    "SimulatesGpus",
]


@dataclass(slots=True)
class GpuReading:
    """One GPU at one instant. SI units; ``None`` where the device cannot say."""

    index: int
    name: str
    uuid: str
    source: str  # "nvml" or "sim"
    energy_j: float  # cumulative since the probe opened
    energy_method: str  # "counter" or "power_integration"
    power_w: float | None = None
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    util_gpu_pct: float | None = None
    util_mem_pct: float | None = None
    # Percent of the SMs busy since the last slow read (NVML GPM SM_UTIL, Hopper and newer;
    # the simulator: its busy share). Unlike util_gpu_pct it drops on a GPU that only runs
    # NCCL's wait kernels. None where the GPU has no GPM (pre-Hopper, MIG) or it failed.
    sm_active_pct: float | None = None
    temperature_c: float | None = None
    clock_cap_mhz: float | None = None  # locked max SM clock, None = uncapped
    power_limit_w: float | None = None
    power_limit_min_w: float | None = None
    power_limit_max_w: float | None = None
    power_limit_default_w: float | None = None
    sm_clock_max_mhz: float | None = None
    supported_sm_clocks_mhz: tuple[int, ...] = ()
    compute_capability: tuple[int, int] | None = None
    # Which opening of the GPU energy_j counts from (a new number each time the probe opens
    # it, so its count restarts from 0; a count that falls within one opening is the probe
    # taking back what it booked, not a restart). 0: the probe does not say.
    energy_epoch: int = 0
    # Seconds since this reading was taken, where the GPU's read this tick was still out
    # (its last reading stands in; the ledger books no energy from it); None: read now.
    stale_s: float | None = None

    @property
    def key(self) -> str:
        return f"gpu{self.index}"


@dataclass(slots=True)
class CpuReading:
    """One CPU energy zone (RAPL) or the host estimate.

    ``zone`` is the name the kernel gives it (``package-0``, ``dram``, ``core``,
    ``psys``); ``path`` tells zones of the same name apart (``intel-rapl:0:1``).
    ``counted`` is False for zones whose energy is already inside another one
    (``core``/``uncore`` are in their package; ``psys`` is the whole platform), so
    totals never double count.
    """

    zone: str
    path: str
    source: str  # "rapl" or "estimate"
    energy_j: float  # cumulative since the probe opened
    power_w: float | None = None
    counted: bool = True
    parent: str | None = None
    power_limit_w: float | None = None

    @property
    def key(self) -> str:
        return f"cpu:{self.path}"


@dataclass(slots=True)
class HostReading:
    cpu_util_pct: float
    cpu_count: int
    mem_used_bytes: int
    mem_total_bytes: int
    load_1m: float
    process_cpu_s: dict[int, float] = field(default_factory=dict)  # pid -> user+system s


@dataclass(slots=True)
class Readings:
    """What one probe returned for one tick."""

    gpus: list[GpuReading] = field(default_factory=list)
    cpus: list[CpuReading] = field(default_factory=list)
    host: HostReading | None = None


@dataclass(slots=True)
class ProbeInfo:
    """What ``greenctl probes`` shows: what was found, and if not, why and the fix."""

    name: str
    available: bool
    detail: str
    fix: str | None = None
    devices: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "available": self.available,
            "detail": self.detail,
            "fix": self.fix,
            "devices": list(self.devices),
        }


@runtime_checkable
class Probe(Protocol):
    """A source of readings.

    ``open()`` detects the source and raises :class:`greend.errors.NoData` when it is
    absent (or ``NoPermission``); it is called once. ``sample(now_s)`` returns this
    tick's readings; ``now_s`` is the tick's monotonic time in seconds. ``info()``
    describes what was found. ``close()`` releases handles.

    What a probe may do besides is one of the small protocols below; callers ask with
    ``isinstance(probe, SampledEvery)`` and so on, never by looking for attributes.
    """

    name: str

    def open(self) -> None: ...

    def sample(self, now_s: float) -> Readings: ...

    def info(self) -> ProbeInfo: ...

    def close(self) -> None: ...


# --------------------------------------------------------------------------- optional abilities


@runtime_checkable
class SampledEvery(Protocol):
    """A probe sampled less often than every tick: at most every ``interval_s``
    seconds; the tick loop carries its last readings in between."""

    interval_s: float


@runtime_checkable
class ShowsClockCaps(Protocol):
    """A GPU probe whose readings carry ``clock_cap_mhz``, which the device cannot tell:
    ``cap_lookup(index)`` (the actuators' record) answers the locked max SM clock."""

    def use_cap_lookup(self, cap_lookup: Callable[[int], float | None] | None) -> None: ...


@runtime_checkable
class SimulatesGpus(Protocol):
    """A GPU probe that may stand in front of simulated GPUs: ``sim_gpu(index)`` is the
    simulator's device behind GPU ``index``, or None for a real one."""

    def sim_gpu(self, index: int) -> Any | None: ...


@runtime_checkable
class MeasuresProcesses(Protocol):
    """A probe that can tell the CPU seconds of processes (descendants included)."""

    def process_cpu_s(self, pids: list[int]) -> dict[int, float]: ...
