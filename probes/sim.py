"""Simulated GPUs: a small physical model of an H100, with device state on disk.

Machines without GPUs run the whole daemon on ``greend run --sim N``. The simulator
is a model, not a stub, so that policies see the slowdown and the savings a real
GPU would show. It sits *behind* a fake of the ``pynvml`` module
(:mod:`greend.probes.fake_nvml`), so the daemon drives simulated GPUs through the very
same NVML code path as real ones.

The model (all in :class:`SimSpec`)
-----------------------------------

Power while busy, at SM clock ``f`` for a workload whose memory-bound share of
time is ``m`` (0 = compute bound, at most 0.95)::

    P(f, m) = static_w + dyn_w * g(f / fmax) * (1 - k * m) + mem_w * m
    g(x) = x ** alpha                     for x >= xv   (xv: vfloor_clock_frac)
    g(x) = x * xv ** (alpha - 1)          below xv

``alpha`` > 1 is the DVFS effect (voltage rises with clock, P ~ C V^2 f), so power
grows faster than linearly with clock. Below ``xv`` the voltage sits at its floor
and dynamic power falls only linearly with the clock, so there a lower clock saves
little power while every step takes longer. A memory-bound kernel keeps the SMs
partly stalled (``1 - k*m``) but drives HBM (``mem_w * m``). With the H100
constants a compute-bound job at 1980 MHz draws 680 W, a memory-bound one ~490 W.
A GPU with no work draws ``idle_w``.

The power limit acts like firmware: the effective SM clock is the highest
supported clock <= the locked max clock whose ``P(f, m)`` fits in the limit. If
even the lowest clock does not fit, the GPU runs there duty-cycled: power is held
at the limit and the step stretches by ``P / limit`` (same energy, more time).

Step time for ``F`` FLOPs at precision ``p``: at ``fmax`` the step takes
``T0 = F / (peak[p] * mfu * (1 - m))`` of which ``(1 - m)`` is compute and ``m``
is memory traffic; at clock ``f`` the compute part stretches by ``fmax / f``
and the memory part does not::

    T(f) = T0 * ((1 - m) * fmax / f + m) * speed_factor

Energy of a step is ``P(f, m) * T(f)``.

What the power-limit curves were checked against
------------------------------------------------

The H100 constants (``alpha`` 4, ``xv`` 0.75, ``static_w`` 170 W of the 680 W) were
chosen so that the power-limit curves have the shape real GPUs measure: the six A40
profiles in ``traces/zeus-gplo-a40/`` (ResNet-18/50, ShuffleNetV2, BERT). There, step
time barely moves from the top limit down to well below the job's own average draw,
then climbs steeply, and energy per step is U-shaped, its minimum inside the range.
Side by side, at the same fractions of each job's uncapped draw (A40 ResNet-50 on one
GPU, 259 W; the sim's mixed workload, ``mem_share`` 0.4, 597 W; time / energy per step)::

    fraction of draw   0.87          0.77          0.68          0.58          0.48          0.39
    A40 ResNet-50      +2 % / -12 %  +5 % / -19 %  +16 % / -22 % +53 % / -11 % +135 % / +14 % +189 % / +29 %
    sim, m = 0.4       +4 % / -10 %  +8 % / -18 %  +13 % / -24 % +21 % / -30 % +102 % / -3 %  +329 % / +65 %

The sim's knee is a little lower and its bottom steeper; its energy minimum (350 W
for every ``mem_share``: -33 % at 0.05, -30 % at 0.4, -24 % at 0.8) lies strictly
inside 200-700 W, and 200 W costs far more (+76 %, +65 %, +16 % over uncapped).
``tests/probes/test_sim_shape.py`` checks this shape. Limits above the job's average draw change nothing here (one
power per step: the model has no peaks within a step to trim), unlike on some of
the A40 profiles; policies that need that effect are tried on the traces.

``m`` is a workload's share *at fp32* (what ``mem_share`` sets). At another
precision the compute part shrinks by the peak FLOP/s ratio and the memory part
only by the bytes per element (4 for fp32 and tf32, 2 for bf16 and fp16, 1 for
fp8), so a lower precision makes a step more memory bound
(:meth:`SimSpec.mem_share_at`: a 0.3 fp32 workload is 0.76 memory bound in bf16
on the H100), and power and the power limit's clock follow that share.

Device state and the energy counter
-----------------------------------

A :class:`SimGpu`'s state (energy counter, locked clocks, power limit, workload
parameters) lives in ``<state_dir>/gpu<i>.json``, written atomically under an
``fcntl`` lock, so it outlives the daemon process exactly like hardware does: a
restarted daemon finds the caps a crashed one left, and another process (a test)
sees the same device. Reads do not lock: the file is replaced atomically.

The daemon runs its jobs' step reports with ``run_steps(defer=True)``: the steps are
booked in memory at once (this object's readings count them) and written into the
file about once a second (``_COMMIT_EVERY_S``), before any change of settings, and at
``commit()``/``close()`` (FakeNvml's ``nvmlShutdown``). Another process sees them up
to a second late; a daemon killed outright loses up to a second of them from the
file. One lock covers the booked state, the deferred steps and their write, so a
reading never sees steps gone from memory before they are in the file. When another
process changes the file meanwhile, the deferred steps are booked on its state: the
background power it integrated over their time is then counted beside their energy
(at most ``idle_w`` times a second, per such change).

The counter (mJ, an int, like ``nvmlDeviceGetTotalEnergyConsumption``) is
monotonic and consistent with wall time. Between events it integrates the
background power (``idle_w``, or ``idle_w + load * (P_busy - idle_w)`` with a
background load) over wall-clock time. :meth:`SimGpu.run_step` adds a step's
model energy at once and books its simulated duration as *busy credit*: the
next ``duration_s`` wall-clock seconds are not integrated again at background
power (``counter += P_bg * max(0, dt - credit)``; ``credit = max(0, credit - dt)``).
During that credit the device reports itself busy (clock, utilisation, power).

Everything the simulator produces is labelled ``source="sim"``.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import logging
import math
import os
import tempfile
import threading
import time
import uuid as uuid_mod
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from greend.errors import ConfigError, StateError

from . import ProbeContext, register
from .base import Probe

__all__ = [
    "H100",
    "MAX_MEM_SHARE",
    "PRECISIONS",
    "PRECISION_ALIASES",
    "SPECS",
    "SIM_PARAMS",
    "Optimum",
    "PeakFlops",
    "SimGpu",
    "SimSpec",
    "StepCost",
    "SweepPoint",
    "discover_sim_gpus",
    "file_lock",
    "open_sim_gpus",
    "write_json_atomic",
]

log = logging.getLogger(__name__)

PRECISIONS: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16", "fp8")
# Levels that run at another level's speed on a GPU: FP8 numerics emulated by
# torchao (``emulate=True``) still run bf16 matmuls.
PRECISION_ALIASES: dict[str, str] = {"fp8-emulated": "bf16"}
# Bytes per element moved by a step at each level: the memory-bound part scales with these.
BYTES_PER_ELEMENT: dict[str, int] = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
MAX_MEM_SHARE = 0.95
STATE_VERSION = 1
POWER_WINDOW_S = 1.0  # NVML power on Ampere+ is a ~1 s average
_HISTORY_KEEP_S = 5.0
_HISTORY_STEP_S = 0.02
# How stale another process's changes to a device may be seen by the daemon's sim
# probe (SimGpu.refresh_s, FakeNvml.refresh_s); 0 elsewhere: always fresh.
DAEMON_REFRESH_S = 0.02
_HISTORY_MAX = 256
# Steps run with run_steps(defer=True) are booked in memory and reach the device file
# at the first reading this long after this object last wrote it, at any change of
# settings, at commit() and at close() (FakeNvml's nvmlShutdown): a daemon taking many
# step reports a second writes each file about once a second, not once per report.
_COMMIT_EVERY_S = 1.0

# Workload parameters a caller may pass (``ctx.sim_params``); each is a scalar or
# one value per GPU. They are environment, not hardware state, so an explicit value
# overrides what the state file holds; caps and the counter are never reset.
SIM_PARAMS: tuple[str, ...] = ("background_load", "mem_share", "speed_factor", "spec", "trace")


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class PeakFlops:
    """Dense peak FLOP/s per precision (datasheet figures, no sparsity)."""

    fp32: float
    tf32: float
    bf16: float
    fp16: float
    fp8: float

    def for_precision(self, precision: str) -> float:
        level = PRECISION_ALIASES.get(precision, precision)
        if level not in PRECISIONS:
            allowed = ", ".join((*PRECISIONS, *PRECISION_ALIASES))
            raise ValueError(f"unknown precision {precision!r}; allowed: {allowed}")
        return float(getattr(self, level))


@dataclass(frozen=True)
class StepCost:
    """What one training step costs on the model at given settings."""

    duration_s: float
    energy_j: float
    sm_clock_mhz: int
    power_w: float


@dataclass(frozen=True)
class SweepPoint:
    """One row of :meth:`SimSpec.sweep`: the step locked at ``clock_mhz``."""

    clock_mhz: int  # the clock asked for (the locked max)
    sm_clock_mhz: int  # the clock it ran at (lower if the power limit throttled it)
    duration_s: float
    energy_j: float
    power_w: float


@dataclass(frozen=True)
class Optimum:
    """Ground truth for benchmarks: the best clock under a slowdown bound."""

    clock_mhz: int
    duration_s: float
    energy_j: float
    baseline_clock_mhz: int
    baseline_duration_s: float
    baseline_energy_j: float
    max_slowdown: float

    @property
    def energy_saving(self) -> float:
        """Fraction of the uncapped step energy saved (0.05 = 5 %)."""
        return 1.0 - self.energy_j / self.baseline_energy_j

    @property
    def slowdown(self) -> float:
        """Fractional increase of step time over the uncapped step."""
        return self.duration_s / self.baseline_duration_s - 1.0


def _check_mem_share(mem_share: float) -> float:
    m = float(mem_share)
    if not 0.0 <= m <= MAX_MEM_SHARE:
        raise ValueError(f"mem_share must be in [0, {MAX_MEM_SHARE}], got {mem_share}")
    return m


@dataclass(frozen=True)
class SimSpec:
    """A GPU model: what NVML would report about it plus the power/time constants."""

    name: str
    supported_sm_clocks_mhz: tuple[int, ...]  # descending, as NVML returns them
    mem_clock_mhz: int
    power_limit_min_w: float
    power_limit_max_w: float
    power_limit_default_w: float
    compute_capability: tuple[int, int]
    idle_w: float
    static_w: float  # busy floor: leakage + uncore while kernels run
    dyn_w: float  # dynamic SM power at fmax for a compute-bound kernel
    alpha: float  # clock exponent of dynamic power (> 1: DVFS)
    mem_relief: float  # k: share of dynamic SM power a memory-bound kernel does not draw
    mem_w: float  # HBM/memory-system power at full memory share
    peak_flops: PeakFlops
    # Clock (fraction of fmax) below which the voltage stays at its floor: dynamic power
    # falls only linearly with the clock there (0: no floor, x**alpha all the way down).
    vfloor_clock_frac: float = 0.0
    mfu: float = 0.5  # model-FLOPs utilisation of a training step
    memory_total_mib: int = 81559
    temp_ambient_c: float = 28.0
    temp_c_per_w: float = 0.08

    def __post_init__(self) -> None:
        clocks = self.supported_sm_clocks_mhz
        if not clocks or list(clocks) != sorted(clocks, reverse=True):
            raise ValueError("supported_sm_clocks_mhz must be non-empty and descending")
        if not self.power_limit_min_w <= self.power_limit_default_w <= self.power_limit_max_w:
            raise ValueError("power limits must satisfy min <= default <= max")
        if not 0.0 < self.mfu <= 1.0:
            raise ValueError(f"mfu must be in (0, 1], got {self.mfu}")
        if self.alpha <= 1.0:
            raise ValueError("alpha must be > 1 (power grows faster than clock)")
        if not 0.0 <= self.vfloor_clock_frac < 1.0:
            raise ValueError(f"vfloor_clock_frac must be in [0, 1), got {self.vfloor_clock_frac}")

    @property
    def sm_clock_max_mhz(self) -> int:
        return self.supported_sm_clocks_mhz[0]

    @property
    def sm_clock_min_mhz(self) -> int:
        return self.supported_sm_clocks_mhz[-1]

    # ---- power and throttling

    def busy_power_w(self, clock_mhz: float, mem_share: float = 0.0) -> float:
        """Board power while running a kernel at ``clock_mhz``: ``P(f, m)`` above."""
        m = _check_mem_share(mem_share)
        x = clock_mhz / self.sm_clock_max_mhz
        xv = self.vfloor_clock_frac
        g = x**self.alpha if x >= xv else x * xv ** (self.alpha - 1.0)  # voltage at its floor below xv
        return self.static_w + self.dyn_w * g * (1.0 - self.mem_relief * m) + self.mem_w * m

    def effective_clock_mhz(
        self,
        mem_share: float,
        power_limit_w: float | None = None,
        locked_clocks_mhz: tuple[int, int] | None = None,
    ) -> int:
        """The clock the firmware picks for a busy GPU.

        The highest supported clock in the locked range whose power fits the limit;
        the power limit beats the locked minimum (as on real GPUs); the lowest
        supported clock if even that does not fit.
        """
        limit = self.power_limit_default_w if power_limit_w is None else power_limit_w
        hi = locked_clocks_mhz[1] if locked_clocks_mhz is not None else self.sm_clock_max_mhz
        # Scanning down from the locked max, clocks inside [min, max] come first; one
        # below the locked min is picked only when nothing in the range fits.
        below_max = [f for f in self.supported_sm_clocks_mhz if f <= hi] or [self.sm_clock_min_mhz]
        for f in below_max:
            if self.busy_power_w(f, mem_share) <= limit + 1e-9:
                return f
        return below_max[-1]

    # ---- time and energy

    def step_time_s(
        self,
        flops: float,
        clock_mhz: float,
        mem_share: float = 0.0,
        precision: str = "fp32",
        speed_factor: float = 1.0,
    ) -> float:
        """``T(f)`` above: seconds for a step of ``flops`` at ``clock_mhz`` (``mem_share``
        as at fp32, see :meth:`mem_share_at`)."""
        return self._time_at(flops, clock_mhz, self.mem_share_at(mem_share, precision), precision, speed_factor)

    def mem_share_at(self, mem_share: float, precision: str = "fp32") -> float:
        """The memory-bound share at ``precision`` of a workload whose share at fp32 is
        ``mem_share``: compute time scales with the level's peak FLOP/s, memory time
        with its bytes per element (capped at MAX_MEM_SHARE)."""
        m = _check_mem_share(mem_share)
        peak = self.peak_flops.for_precision(precision)  # validates the level
        if m == 0.0:
            return 0.0
        level = PRECISION_ALIASES.get(precision, precision)
        compute = self.peak_flops.fp32 / peak  # relative to fp32's compute time
        memory = m / (1.0 - m) * BYTES_PER_ELEMENT[level] / BYTES_PER_ELEMENT["fp32"]
        return min(MAX_MEM_SHARE, memory / (compute + memory))

    def _time_at(self, flops: float, clock_mhz: float, m: float, precision: str, speed_factor: float) -> float:
        if flops < 0:
            raise ValueError(f"flops must be >= 0, got {flops}")
        if clock_mhz <= 0:
            raise ValueError(f"clock_mhz must be > 0, got {clock_mhz}")
        t0 = flops / (self.peak_flops.for_precision(precision) * self.mfu * (1.0 - m))
        return t0 * ((1.0 - m) * self.sm_clock_max_mhz / clock_mhz + m) * speed_factor

    def step_cost(
        self,
        flops: float,
        mem_share: float = 0.0,
        precision: str = "fp32",
        *,
        power_limit_w: float | None = None,
        locked_clocks_mhz: tuple[int, int] | None = None,
        speed_factor: float = 1.0,
    ) -> StepCost:
        """Duration and energy of one step at the given settings (no side effects)."""
        m = self.mem_share_at(mem_share, precision)
        f = self.effective_clock_mhz(m, power_limit_w, locked_clocks_mhz)
        t = self._time_at(flops, f, m, precision, speed_factor)
        p = self.busy_power_w(f, m)
        limit = self.power_limit_default_w if power_limit_w is None else power_limit_w
        if p > limit:  # even the lowest clock is over the limit: duty-cycle throttling
            t, p = t * p / limit, limit
        return StepCost(duration_s=t, energy_j=p * t, sm_clock_mhz=f, power_w=p)

    def sweep(
        self,
        flops: float,
        mem_share: float = 0.0,
        precision: str = "fp32",
        *,
        power_limit_w: float | None = None,
        speed_factor: float = 1.0,
    ) -> list[SweepPoint]:
        """The step at every supported clock (locked max = that clock), descending."""
        rows: list[SweepPoint] = []
        for f in self.supported_sm_clocks_mhz:
            c = self.step_cost(
                flops,
                mem_share,
                precision,
                power_limit_w=power_limit_w,
                locked_clocks_mhz=(self.sm_clock_min_mhz, f),
                speed_factor=speed_factor,
            )
            rows.append(SweepPoint(f, c.sm_clock_mhz, c.duration_s, c.energy_j, c.power_w))
        return rows

    def optimum(
        self,
        flops: float,
        mem_share: float = 0.0,
        precision: str = "fp32",
        max_slowdown: float = 0.05,
        *,
        power_limit_w: float | None = None,
        speed_factor: float = 1.0,
    ) -> Optimum:
        """The supported clock that minimises step energy with
        ``time <= (1 + max_slowdown) * uncapped time`` (uncapped: no clock lock,
        the given power limit, default: the spec's default limit)."""
        if max_slowdown < 0:
            raise ValueError(f"max_slowdown must be >= 0, got {max_slowdown}")
        base = self.step_cost(flops, mem_share, precision, power_limit_w=power_limit_w, speed_factor=speed_factor)
        bound_s = (1.0 + max_slowdown) * base.duration_s * (1.0 + 1e-12)
        rows = self.sweep(flops, mem_share, precision, power_limit_w=power_limit_w, speed_factor=speed_factor)
        feasible = [r for r in rows if r.duration_s <= bound_s]
        # Ties (throttled rows run at the same clock): prefer the higher clock.
        best = min(feasible, key=lambda r: (r.energy_j, -r.clock_mhz))
        return Optimum(
            clock_mhz=best.clock_mhz,
            duration_s=best.duration_s,
            energy_j=best.energy_j,
            baseline_clock_mhz=base.sm_clock_mhz,
            baseline_duration_s=base.duration_s,
            baseline_energy_j=base.energy_j,
            max_slowdown=max_slowdown,
        )


H100 = SimSpec(
    name="NVIDIA H100 80GB HBM3 (simulated)",
    supported_sm_clocks_mhz=tuple(range(1980, 344, -15)),  # 1980, 1965, ..., 345
    mem_clock_mhz=2619,
    power_limit_min_w=200.0,
    power_limit_max_w=700.0,
    power_limit_default_w=700.0,
    compute_capability=(9, 0),
    idle_w=70.0,
    static_w=170.0,
    dyn_w=510.0,
    alpha=4.0,
    mem_relief=0.7,
    mem_w=150.0,
    peak_flops=PeakFlops(fp32=67e12, tf32=495e12, bf16=989e12, fp16=989e12, fp8=1979e12),
    mfu=0.5,
    vfloor_clock_frac=0.75,
)

SPECS: dict[str, SimSpec] = {"H100": H100}


# --------------------------------------------------------------------------- state


def write_json_atomic(path: Path, data: Any, *, keep_open: bool = False) -> int | None:
    """Write JSON so a reader sees the old file or the new one, never a torn one.

    No fsync: the simulated device must outlive a crashed *process* (the page cache
    does), not a power cut, and a step executed on the simulator writes this file.
    ``keep_open``: return an open descriptor of the file written (the caller closes
    it): while it is open the file's inode number cannot be given to another file, so
    an unchanged ``(st_ino, st_mtime_ns, st_size)`` shows that no other file replaced it.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    text = json.dumps(data, separators=(",", ":"), sort_keys=True)  # (the C encoder; dump() is not)
    data_b = memoryview(text.encode("utf-8"))
    fd = os.open(tmp, (os.O_RDWR if keep_open else os.O_WRONLY) | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while data_b:
            data_b = data_b[os.write(fd, data_b) :]
        os.replace(tmp, path)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if keep_open:
        return fd
    os.close(fd)
    return None


@contextmanager
def file_lock(lock_path: Path) -> Iterator[None]:
    """An exclusive ``fcntl`` lock on ``lock_path`` (created if missing)."""
    with open(lock_path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


@dataclass
class SimState:
    """What ``gpu<i>.json`` holds. The counter is kept exact (float mJ); NVML reads
    its integer part."""

    index: int
    uuid: str
    spec_name: str
    energy_mj: float = 0.0
    updated_s: float = 0.0  # wall time the counter was integrated to
    busy_credit_s: float = 0.0
    busy_power_w: float = 0.0  # of the steps in the current credit (for readings)
    busy_clock_mhz: int = 0
    busy_mem_share: float = 0.0
    locked_clocks_mhz: tuple[int, int] | None = None
    power_limit_mw: int = 0
    background_load: float = 0.0
    mem_share: float = 0.0
    speed_factor: float = 1.0
    version: int = STATE_VERSION

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)  # (flat fields: asdict's deep copy was a third of a write)
        d["locked_clocks_mhz"] = list(self.locked_clocks_mhz) if self.locked_clocks_mhz else None
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SimState:
        lc = d.get("locked_clocks_mhz")
        return cls(
            index=int(d["index"]),
            uuid=str(d["uuid"]),
            spec_name=str(d["spec_name"]),
            energy_mj=float(d["energy_mj"]),
            updated_s=float(d["updated_s"]),
            busy_credit_s=float(d.get("busy_credit_s", 0.0)),
            busy_power_w=float(d.get("busy_power_w", 0.0)),
            busy_clock_mhz=int(d.get("busy_clock_mhz", 0)),
            busy_mem_share=float(d.get("busy_mem_share", 0.0)),
            locked_clocks_mhz=(int(lc[0]), int(lc[1])) if lc else None,
            power_limit_mw=int(d["power_limit_mw"]),
            background_load=float(d.get("background_load", 0.0)),
            mem_share=float(d.get("mem_share", 0.0)),
            speed_factor=float(d.get("speed_factor", 1.0)),
            version=int(d.get("version", STATE_VERSION)),
        )


@dataclass(frozen=True)
class _View:
    """The state advanced (without writing) to one instant."""

    now_s: float
    energy_mj: float
    credit_left_s: float

    @property
    def busy(self) -> bool:
        return self.credit_left_s > 0.0


class SimGpu:
    """One simulated GPU whose state lives in ``state_dir/gpu<index>.json``.

    Opening a file that exists loads it (the caps and counter a crashed daemon left);
    a new one starts at default settings. Explicit workload parameters
    (``background_load``, ``mem_share``, ``speed_factor``) override the file.
    ``clock`` is the wall clock (seconds), injectable for deterministic tests.
    """

    def __init__(
        self,
        state_dir: Path | str,
        index: int,
        spec: SimSpec = H100,
        clock: Callable[[], float] = time.time,
        *,
        background_load: float | None = None,
        mem_share: float | None = None,
        speed_factor: float | None = None,
        initial_energy_mj: float = 0.0,
        refresh_s: float = 0.0,
    ) -> None:
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        self.state_dir = Path(state_dir)
        self.index = index
        self.spec = spec
        self._clock = clock
        self.path = self.state_dir / f"gpu{index}.json"
        self._lock_path = self.state_dir / f".gpu{index}.lock"
        self._lock_fd: int | None = None  # (opened by _locked)
        self._thread_lock = threading.RLock()
        self._written_fd: int | None = None  # the file this object last wrote, held open (see _mutate)
        self._written_key: tuple[int, int, int] | None = None
        self._written_s = time.monotonic()  # when this object last wrote the file
        # Deferred steps (run_steps(defer=True)), not in the file yet: each (when, cost,
        # memory share), and the state with them booked, made from the cached state
        # _pending_base (a new object per booking: a reader may hold the last one).
        self._deferred: list[tuple[float, StepCost, float]] = []
        self._pending: SimState | None = None
        self._pending_base: SimState | None = None
        self._defer = True  # run_steps(defer=True) defers (close() ends it)
        self._cache_key: tuple[int, int, int] | None = None
        self._cache: SimState | None = None
        self._cache_checked_s = -1e18
        self.refresh_s = refresh_s  # how stale another process's changes may be seen (see _read)
        self._history: deque[tuple[float, float]] = deque(maxlen=_HISTORY_MAX)
        self._last_now_s = float("-inf")
        self._mem_lock = threading.Lock()  # guards the in-memory history and clock
        self._attached: set[int] = set()  # pids this process put in the process table
        self.state_dir.mkdir(parents=True, exist_ok=True)
        wanted = {
            "background_load": None if background_load is None else self._check_load(background_load),
            "mem_share": None if mem_share is None else _check_mem_share(mem_share),
            "speed_factor": None if speed_factor is None else self._check_speed(speed_factor),
        }
        with self._locked():
            if self.path.exists():
                # Opening an existing device only reads it: another process's clock
                # must not integrate the counter unless it changes something.
                st = self._read(force=True)
                if st.spec_name != spec.name:
                    log.warning("%s was created as %r, opened as %r", self.path, st.spec_name, spec.name)
                changes = {k: v for k, v in wanted.items() if v is not None and getattr(st, k) != v}
                if not changes:
                    return
                st = self._advanced(st, self._now())
            else:
                changes = {k: v for k, v in wanted.items() if v is not None}
                st = SimState(
                    index=index,
                    uuid=f"GPU-{uuid_mod.uuid4()}",
                    spec_name=spec.name,
                    energy_mj=float(initial_energy_mj),
                    updated_s=self._now(),
                    power_limit_mw=int(round(spec.power_limit_default_w * 1000)),
                )
                log.debug("created simulated GPU %d at %s", index, self.path)
            for k, v in changes.items():
                setattr(st, k, v)
            self._write(st)

    def __repr__(self) -> str:
        return f"SimGpu(index={self.index}, path={str(self.path)!r})"

    # ---- file I/O

    def _file_key(self) -> tuple[int, int, int]:
        """What tells one version of the device file from another: (inode, mtime, size)."""
        try:
            s = os.stat(self.path)
        except FileNotFoundError as e:
            raise StateError(f"simulated GPU state {self.path} is missing") from e
        return s.st_ino, s.st_mtime_ns, s.st_size

    def _read(self, force: bool = False) -> SimState:
        # Another process (a test, a restarted daemon) may change the device: look at
        # the file again, by default on every call; the daemon's sim probe allows
        # ``refresh_s`` of staleness, since a tick asks a device a dozen questions and
        # each stat costs as much as the model itself. Own writes are seen at once.
        # ``force``: parse the file, whatever the cache holds.
        now = time.monotonic()
        if not force and self._cache is not None and now - self._cache_checked_s < self.refresh_s:
            return self._cache
        self._cache_checked_s = now
        key = self._file_key()
        if not force and self._cache is not None and key == self._cache_key:
            return self._cache
        # Parsed under the lock this object writes under: a parse begun before one of
        # its writes must not install the older state over the newer one.
        with self._thread_lock:
            if not force:
                key = self._file_key()
                if self._cache is not None and key == self._cache_key:
                    return self._cache
            try:
                st = SimState.from_json(json.loads(self.path.read_text(encoding="utf-8")))
            except FileNotFoundError as e:
                raise StateError(f"simulated GPU state {self.path} is missing") from e
            except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
                raise StateError(f"simulated GPU state {self.path} is corrupt: {e}") from e
            self._cache, self._cache_key = st, key
            return st

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """This device's lock, against other threads and other processes. The lock
        file stays open for the object's life; a thread lock comes first, since flock
        does not exclude threads that share one open file."""
        with self._thread_lock:
            if self._lock_fd is None:
                self._lock_fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _write(self, st: SimState) -> None:
        fd = write_json_atomic(self.path, st.to_json(), keep_open=True)
        assert fd is not None
        s = os.fstat(fd)  # (the file now at self.path: a rename keeps its inode and mtime)
        key = (s.st_ino, s.st_mtime_ns, s.st_size)
        old, self._written_fd = self._written_fd, fd
        if old is not None:
            with contextlib.suppress(OSError):  # (the new file is in place: nothing to undo)
                os.close(old)
        self._cache, self._cache_key, self._written_key = st, key, key
        self._cache_checked_s = self._written_s = time.monotonic()

    def close(self) -> None:
        """Write the deferred steps, then close the files this object holds open (the
        lock file, the last file written). The object still works: from now on each
        ``run_steps`` writes the file at once, deferred or not."""
        with self._thread_lock:
            self._defer = False
            try:
                self.commit()
            finally:
                if self._written_fd is not None:
                    os.close(self._written_fd)
                    self._written_fd = self._written_key = None
                if self._lock_fd is not None:
                    os.close(self._lock_fd)
                    self._lock_fd = None

    def defer_again(self) -> None:
        """Let ``run_steps(defer=True)`` defer again after :meth:`close` (a new NVML init)."""
        with self._thread_lock:
            self._defer = True

    def __del__(self) -> None:
        # (No write here: a finaliser may run while this thread holds the device's file
        # lock through another object. Steps still deferred are lost from the file;
        # close() and FakeNvml's nvmlShutdown write them.)
        for fd in (getattr(self, "_written_fd", None), getattr(self, "_lock_fd", None)):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)

    @contextmanager
    def _mutate(self) -> Iterator[SimState]:
        """Lock, load fresh, integrate the counter to now, let the caller edit, save.

        "Fresh" costs a stat where the file is still the one this object last wrote:
        it holds that file open, so its inode number cannot pass to another file, and an
        unchanged (inode, mtime, size) means nobody replaced it. The caller edits a copy:
        readers in other threads never see half an edit."""
        with self._locked():
            key = self._file_key()
            ours = self._cache is not None and key == self._written_key and key == self._cache_key
            st = self._cache if ours else self._read(force=True)
            assert st is not None
            if self._deferred:  # steps run before this change go in first, at their times
                if self._pending is not None and self._pending_base is st:
                    st = self._pending  # booked on this very state already
                else:
                    st = copy.copy(st)
                    for t, cost, mem_share in self._deferred:
                        self._book(self._advanced(st, t), cost, mem_share)
            st = self._advanced(copy.copy(st), self._now())
            yield st
            self._write(st)
            self._deferred, self._pending, self._pending_base = [], None, None

    # ---- the counter

    def _now(self) -> float:
        """The injected wall clock, never going back within this object (a stepped
        wall clock must not make the counter run backwards)."""
        with self._mem_lock:
            self._last_now_s = max(self._last_now_s, self._clock())
            return self._last_now_s

    def _background_power_w(self, st: SimState) -> float:
        """Power with no step running: idle, or idle plus the background load."""
        if st.background_load <= 0.0:
            return self.spec.idle_w
        f = self.spec.effective_clock_mhz(st.mem_share, st.power_limit_mw / 1000.0, st.locked_clocks_mhz)
        busy = min(self.spec.busy_power_w(f, st.mem_share), st.power_limit_mw / 1000.0)
        return self.spec.idle_w + st.background_load * (busy - self.spec.idle_w)

    def _view(self, st: SimState, now: float) -> _View:
        dt = max(0.0, now - st.updated_s)
        idle_dt = max(0.0, dt - st.busy_credit_s)
        energy = st.energy_mj + self._background_power_w(st) * idle_dt * 1000.0
        return _View(now_s=max(now, st.updated_s), energy_mj=energy, credit_left_s=max(0.0, st.busy_credit_s - dt))

    def _advanced(self, st: SimState, now: float) -> SimState:
        v = self._view(st, now)
        st.energy_mj, st.busy_credit_s, st.updated_s = v.energy_mj, v.credit_left_s, v.now_s
        return st

    def _booked(self) -> SimState:
        """The device as a reading sees it: the stored state with the deferred steps
        booked, each at its time (written to the file first once _COMMIT_EVERY_S has
        passed since the last write, or when another process replaced the file). A
        read-only object: a booking makes a new one."""
        if self._pending is None:
            return self._read()
        with self._thread_lock:  # (a commit and the deferred list change together)
            if self._pending is not None:
                base = self._read()
                if base is self._pending_base and time.monotonic() - self._written_s < _COMMIT_EVERY_S:
                    return self._pending
                self.commit()
            return self._read()

    def commit(self) -> None:
        """Write the deferred steps (``run_steps(defer=True)``) into the device file now."""
        with self._thread_lock:
            if self._deferred:
                with self._mutate():
                    pass

    def _current(self) -> tuple[SimState, _View]:
        st = self._booked()
        v = self._view(st, self._now())
        with self._mem_lock:
            h = self._history
            # One point per _HISTORY_STEP_S is plenty for a 1 s average, and keeps
            # power_w()'s scan short however many questions a tick asks.
            if not h or v.now_s >= h[-1][0] + _HISTORY_STEP_S:
                h.append((v.now_s, v.energy_mj))
                while len(h) > 2 and h[1][0] < v.now_s - _HISTORY_KEEP_S:
                    h.popleft()
        return st, v

    # ---- readings (what NVML shows)

    def state(self) -> SimState:
        """A snapshot of the state (the counter as of the last write or booked step)."""
        return copy.copy(self._booked())  # (flat fields: a shallow copy is a whole one)

    @property
    def uuid(self) -> str:
        return self._read().uuid

    def energy_mj(self) -> int:
        """The total-energy counter, mJ, an int (as NVML reports it)."""
        return int(math.floor(self._current()[1].energy_mj))

    def energy_j(self) -> float:
        """The exact counter in joules (the truth tests compare against)."""
        return self._current()[1].energy_mj / 1000.0

    def instant_power_w(self) -> float:
        """Power right now: the running step's, else the background power."""
        st, v = self._current()
        return st.busy_power_w if v.busy else self._background_power_w(st)

    def power_w(self) -> float:
        """Power averaged over the last ~1 s of counter history (Ampere+ NVML).

        Falls back to the instantaneous power until this object has history.
        """
        st, v = self._current()
        # The newest point at least a window old; else the oldest point we have.
        ref: tuple[float, float] | None = None
        with self._mem_lock:
            h = self._history
            for point in reversed(h):  # newest first: the window's start is near the end
                if point[0] <= v.now_s - POWER_WINDOW_S:
                    ref = point
                    break
            else:
                if h and h[0][0] < v.now_s:
                    ref = h[0]
        if ref is None:
            return st.busy_power_w if v.busy else self._background_power_w(st)
        return (v.energy_mj - ref[1]) / 1000.0 / (v.now_s - ref[0])

    def busy(self) -> bool:
        """True while a step's simulated duration is still running."""
        return self._current()[1].busy

    def sm_clock_mhz(self) -> int:
        st, v = self._current()
        if v.busy:
            return st.busy_clock_mhz
        if st.background_load > 0.0:
            return self.spec.effective_clock_mhz(st.mem_share, st.power_limit_mw / 1000.0, st.locked_clocks_mhz)
        return st.locked_clocks_mhz[0] if st.locked_clocks_mhz else self.spec.sm_clock_min_mhz

    def mem_clock_mhz(self) -> int:
        return self.spec.mem_clock_mhz

    def utilization_pct(self) -> tuple[float, float]:
        """(GPU busy %, memory busy %) as NVML's utilisation rates."""
        st, v = self._current()
        if v.busy:
            return 100.0, 100.0 * st.busy_mem_share
        return 100.0 * st.background_load, 100.0 * st.background_load * st.mem_share

    def temperature_c(self) -> float:
        return self.spec.temp_ambient_c + self.spec.temp_c_per_w * self.instant_power_w()

    def locked_clocks_mhz(self) -> tuple[int, int] | None:
        return self._read().locked_clocks_mhz

    def power_limit_w(self) -> float:
        return self._read().power_limit_mw / 1000.0

    def background_load(self) -> float:
        return self._read().background_load

    def mem_share(self) -> float:
        return self._read().mem_share

    def speed_factor(self) -> float:
        return self._read().speed_factor

    def throttle_reasons(self) -> frozenset[str]:
        """Why the clock is below fmax: ``idle``, ``clock_lock``, ``power_cap``."""
        st, v = self._current()
        if not v.busy and st.background_load <= 0.0:
            return frozenset({"idle"})
        m = st.busy_mem_share if v.busy else st.mem_share
        reasons: set[str] = set()
        lock_max = st.locked_clocks_mhz[1] if st.locked_clocks_mhz else self.spec.sm_clock_max_mhz
        if lock_max < self.spec.sm_clock_max_mhz:
            reasons.add("clock_lock")
        unthrottled = self.spec.effective_clock_mhz(m, self.spec.power_limit_max_w * 10, st.locked_clocks_mhz)
        limited = self.spec.effective_clock_mhz(m, st.power_limit_mw / 1000.0, st.locked_clocks_mhz)
        if limited < unthrottled:
            reasons.add("power_cap")
        return frozenset(reasons)

    # ---- settings

    def set_locked_clocks(self, min_mhz: int, max_mhz: int) -> None:
        """Lock the SM clock into [min, max] (clamped to the supported range)."""
        if min_mhz <= 0 or max_mhz <= 0 or min_mhz > max_mhz:
            raise ValueError(f"invalid locked clocks: min={min_mhz} max={max_mhz} (need 0 < min <= max)")
        lo, hi = self.spec.sm_clock_min_mhz, self.spec.sm_clock_max_mhz
        clamped = (min(max(int(min_mhz), lo), hi), min(max(int(max_mhz), lo), hi))
        with self._mutate() as st:
            st.locked_clocks_mhz = clamped

    def reset_locked_clocks(self) -> None:
        with self._mutate() as st:
            st.locked_clocks_mhz = None

    def set_power_limit_w(self, power_w: float) -> None:
        s = self.spec
        if not s.power_limit_min_w <= power_w <= s.power_limit_max_w:
            raise ValueError(f"power limit {power_w} W outside [{s.power_limit_min_w}, {s.power_limit_max_w}] W")
        with self._mutate() as st:
            st.power_limit_mw = int(round(power_w * 1000))

    @staticmethod
    def _check_load(load: float) -> float:
        if not 0.0 <= load <= 1.0:
            raise ValueError(f"background_load must be in [0, 1], got {load}")
        return float(load)

    @staticmethod
    def _check_speed(speed: float) -> float:
        if speed <= 0:
            raise ValueError(f"speed_factor must be > 0, got {speed}")
        return float(speed)

    def set_background_load(self, load: float) -> None:
        """Busy fraction with no job (0..1): lets ``--sim N`` show non-idle power."""
        load = self._check_load(load)
        with self._mutate() as st:
            st.background_load = load

    def set_mem_share(self, mem_share: float) -> None:
        """The default memory-bound share of this GPU's workload (0..0.95)."""
        m = _check_mem_share(mem_share)
        with self._mutate() as st:
            st.mem_share = m

    def set_speed_factor(self, speed_factor: float) -> None:
        """> 1 makes every step slower on this GPU (a straggler)."""
        s = self._check_speed(speed_factor)
        with self._mutate() as st:
            st.speed_factor = s

    # ---- steps

    def _cost(self, st: SimState, flops: float, mem_share: float | None, precision: str) -> StepCost:
        m = st.mem_share if mem_share is None else mem_share
        return self.spec.step_cost(
            flops,
            m,
            precision,
            power_limit_w=st.power_limit_mw / 1000.0,
            locked_clocks_mhz=st.locked_clocks_mhz,
            speed_factor=st.speed_factor,
        )

    def step_cost(self, flops: float, mem_share: float | None = None, precision: str = "fp32") -> StepCost:
        """What a step would cost at the current settings; changes nothing."""
        return self._cost(self._read(), flops, mem_share, precision)

    def run_step(self, flops: float, mem_share: float | None = None, precision: str = "fp32") -> StepCost:
        """Execute one step: add its energy to the counter and book its duration
        as busy credit (see the module docstring). ``mem_share`` None: the GPU's."""
        return self.run_steps([(flops, mem_share, precision)])[0]

    def run_steps(self, steps: Sequence[tuple[float, float | None, str]], *, defer: bool = False) -> list[StepCost]:
        """Execute several steps, ``(flops, mem_share, precision)`` each, in one update
        of the device file (what a batch of step reports from the daemon needs).

        ``defer``: book them in memory now, at the settings in force, and write them into
        the file later (see ``_COMMIT_EVERY_S``). This object's readings count them at
        once; another process sees them in the file about a second later at most."""
        costs: list[StepCost] = []
        with self._thread_lock:  # (decided under the lock: close() may be under way)
            if not (defer and self._defer):
                with self._mutate() as st:
                    for flops, mem_share, precision in steps:
                        cost = self._cost(st, flops, mem_share, precision)
                        self._book(st, cost, st.mem_share if mem_share is None else mem_share)
                        costs.append(cost)
                return costs
            base = self._read()
            if self._pending is not None and self._pending_base is not base:
                self.commit()  # another process changed the device: its file first
                base = self._read()
            st = copy.copy(self._pending if self._pending is not None else base)
            now = self._now()
            self._advanced(st, now)
            booked = []
            for flops, mem_share, precision in steps:  # (a step that cannot run books none)
                cost = self._cost(st, flops, mem_share, precision)
                m = st.mem_share if mem_share is None else mem_share
                self._book(st, cost, m)
                booked.append((now, cost, m))
                costs.append(cost)
            self._deferred += booked
            self._pending, self._pending_base = st, base
            if time.monotonic() - self._written_s >= _COMMIT_EVERY_S:
                self.commit()  # (readings commit too; this one keeps going without them)
        return costs

    @staticmethod
    def _book(st: SimState, cost: StepCost, mem_share: float) -> None:
        """A step's energy into the counter, its duration into the busy credit."""
        total = st.busy_credit_s + cost.duration_s
        if total > 0:  # the power/clock shown while busy: credit-weighted
            w = cost.duration_s / total
            st.busy_power_w = (1 - w) * st.busy_power_w + w * cost.power_w
            st.busy_mem_share = (1 - w) * st.busy_mem_share + w * mem_share
        st.busy_clock_mhz = cost.sm_clock_mhz
        st.energy_mj += cost.energy_j * 1000.0
        st.busy_credit_s = total

    # ---- ground truth

    def sweep(self, flops: float, mem_share: float | None = None, precision: str = "fp32") -> list[SweepPoint]:
        """The step at every supported clock, at this GPU's power limit and speed."""
        st = self._read()
        m = st.mem_share if mem_share is None else mem_share
        return self.spec.sweep(
            flops, m, precision, power_limit_w=st.power_limit_mw / 1000.0, speed_factor=st.speed_factor
        )

    def optimum(
        self,
        flops: float,
        mem_share: float | None = None,
        precision: str = "fp32",
        max_slowdown: float = 0.05,
    ) -> Optimum:
        """:meth:`SimSpec.optimum` at this GPU's power limit and speed factor."""
        st = self._read()
        m = st.mem_share if mem_share is None else mem_share
        return self.spec.optimum(
            flops,
            m,
            precision,
            max_slowdown,
            power_limit_w=st.power_limit_mw / 1000.0,
            speed_factor=st.speed_factor,
        )

    # ---- the process table (what nvmlDeviceGetComputeRunningProcesses lists)

    @property
    def _procs_path(self) -> Path:
        return self.state_dir / f"gpu{self.index}.procs.json"

    def attach_process(self, pid: int) -> None:
        """``pid`` computes on this GPU from now on, as a process with a CUDA context
        on a real one (the daemon attaches a rank when it runs the rank's steps here).
        It stays listed until it exits. One file write per new process."""
        pid = int(pid)
        with self._mem_lock:
            if pid in self._attached:
                return
            self._attached.add(pid)
        with self._locked():
            pids = set(self._read_procs()) | {pid}
            write_json_atomic(self._procs_path, {"pids": sorted(pids)})

    def processes(self) -> list[int]:
        """The live processes computing on this GPU (exited ones are dropped, as the
        driver drops a process's context when it exits)."""
        return sorted(p for p in self._read_procs() if _alive(p))

    def _read_procs(self) -> list[int]:
        try:
            return [int(p) for p in json.loads(self._procs_path.read_text(encoding="utf-8")).get("pids", [])]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, AttributeError, TypeError) as e:
            log.warning("%s unreadable (%s): no processes listed", self._procs_path, e)
            return []


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has exited: its context would be gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's: it exists
            return True
        return True
    return stat.rsplit(")", 1)[-1].split()[:1] != ["Z"]


# --------------------------------------------------------------------------- fleets


def _per_gpu(value: Any, i: int, name: str) -> Any:
    if isinstance(value, (list, tuple)):
        if i >= len(value):
            raise ValueError(f"{name} has {len(value)} values, need one per GPU (gpu{i} missing)")
        return value[i]
    return value


def open_sim_gpus(
    state_dir: Path | str,
    n: int,
    *,
    spec: SimSpec | str = H100,
    clock: Callable[[], float] = time.time,
    background_load: float | Sequence[float] | None = None,
    mem_share: float | Sequence[float] | None = None,
    speed_factor: float | Sequence[float] | None = None,
    initial_energy_mj: float = 0.0,
    refresh_s: float = 0.0,
) -> list[SimGpu]:
    """Open (creating where needed) simulated GPUs 0..n-1 in ``state_dir``.

    Each workload parameter is a scalar for all GPUs or one value per GPU.
    """
    if isinstance(spec, str):
        if spec not in SPECS:
            raise ValueError(f"unknown sim spec {spec!r}; allowed: {', '.join(SPECS)}")
        spec = SPECS[spec]
    return [
        SimGpu(
            state_dir,
            i,
            spec,
            clock,
            background_load=_per_gpu(background_load, i, "background_load"),
            mem_share=_per_gpu(mem_share, i, "mem_share"),
            speed_factor=_per_gpu(speed_factor, i, "speed_factor"),
            initial_energy_mj=initial_energy_mj,
            refresh_s=refresh_s,
        )
        for i in range(n)
    ]


def discover_sim_gpus(state_dir: Path | str) -> int:
    """How many consecutive ``gpu<i>.json`` files (from 0) exist in ``state_dir``."""
    n = 0
    while (Path(state_dir) / f"gpu{n}.json").exists():
        n += 1
    return n


# --------------------------------------------------------------------------- probe


def sim_params_from_config(params: Mapping[str, Any]) -> dict[str, Any]:
    """Validate ``ctx.sim_params`` keys (a ConfigError names the bad one)."""
    unknown = sorted(set(params) - set(SIM_PARAMS))
    if unknown:
        raise ConfigError(f"unknown sim parameter(s) {', '.join(unknown)}; allowed: {', '.join(SIM_PARAMS)}")
    return dict(params)


@register(
    "sim",
    default=False,
    help="simulated GPUs (greend run --sim N): an H100 model behind a fake NVML, source=sim",
)
def _sim_probe(ctx: ProbeContext) -> Probe:
    # Imported here: fake_nvml imports this module.
    from .fake_nvml import FakeNvml
    from .nvml import NvmlProbe
    from .trace import TRACE_FILE_NAME, install_trace, trace_spec

    state_dir = ctx.sim_dir
    if state_dir is None:
        state_dir = Path(tempfile.mkdtemp(prefix="greend-sim-"))
        log.info("no --sim-dir given: simulated GPU state in %s", state_dir)
    params = sim_params_from_config(ctx.sim_params)
    trace = params.pop("trace", None)
    if trace:
        install_trace(state_dir, trace)
    # A fleet that follows a measured profile keeps a copy in its state dir
    # (greend run --sim-trace puts it there), like the model a device was made as.
    trace_file = Path(state_dir) / TRACE_FILE_NAME
    if trace_file.exists() and "spec" not in params:
        params["spec"] = trace_spec(trace_file)
        log.info("simulated GPUs follow the measured profile %s (source=sim)", trace_file)
    fake = FakeNvml(state_dir, n=ctx.sim_gpus or None, refresh_s=DAEMON_REFRESH_S, **params)
    return NvmlProbe(nvml=fake, source="sim")
