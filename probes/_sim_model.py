"""The simulator's GPU model: power, clocks, step time and energy, at each precision.

A :class:`SimSpec` holds what NVML would report about a GPU (supported clocks, power-limit
constraints) and the constants of the model below; its methods are pure (no state, no
I/O). :class:`greend.probes.sim.SimGpu` books what they return on a device kept on disk.

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
``T0 = F / (rate[p] * mfu * (1 - m))`` (``rate``: :meth:`SimSpec.compute_rate`) of
which ``(1 - m)`` is compute and ``m`` is memory traffic; at clock ``f`` the compute part stretches by ``fmax / f``
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
precision the compute part shrinks by the ratio of the level's compute rate
(:meth:`SimSpec.compute_rate`) and the memory part only by the bytes per element
(4 for fp32 and tf32, 2 for bf16, fp16 and fp8), so a lower precision makes a step
more memory bound (:meth:`SimSpec.mem_share_at`: a 0.3 fp32 workload is 0.76 memory
bound in bf16 on the H100), and power and the power limit's clock follow that share.

FP8, calibrated against published training runs, not the datasheet
---------------------------------------------------------------------

The H100's datasheet doubles the dense FLOP/s from bf16 to fp8, but fp8 *training*
(torchao ``float8``: each linear casts its inputs to fp8 with dynamic scales, runs the
matmul in fp8 and keeps activations, weights and every other op in bf16) gains far
less. Published end-to-end figures: Llama3-8B on 8 H100s under torchtitan with
``torch.compile``, 5,760 tokens/s in bf16 against 6,424 with rowwise fp8 (1.12x) and
7,186 with tensorwise fp8 and fp8 all-gather (1.25x) (pytorch/torchtitan commit
7a04053; torchao's docs quote "up to 1.25x at 8 GPU / 8B parameters" and up to 1.5x
at 512 GPUs / 405B). So here fp8 runs the compute part of a step at
``fp8_training_gain`` (1.4) times bf16's rate and moves bf16's bytes (the casts add
traffic, nothing of a step's memory is halved): a workload that is 0.3 memory bound
in bf16 runs 1.25x faster in fp8 at the same clock, in line with the 8B figure; a
memory-bound one gains little (0.76 in bf16: 1.07x). ``fp8-emulated``, torchao's
emulation of fp8 numerics that the CPU tests run, is priced as the fp8 it stands in
for: on a simulated GPU a CPU job's emulated steps are what its fp8 steps would cost.
These are simulated figures; ``bench/device_check.py`` measures the ratios on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

PRECISIONS: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16", "fp8")
# Levels priced as another: fp8 numerics emulated by torchao (the CPU tests' stand-in
# for fp8 training) cost what the fp8 they stand in for costs on the simulated GPU.
PRECISION_ALIASES: dict[str, str] = {"fp8-emulated": "fp8"}
# Bytes per element moved by a step at each level: the memory-bound part scales with
# these. fp8 training keeps activations and weights in bf16 (only matmul inputs are cast).
BYTES_PER_ELEMENT: dict[str, int] = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 2}
# fp8 training's compute rate over bf16's (see "FP8, calibrated" above), not the datasheet's 2x.
FP8_TRAINING_GAIN = 1.4
MAX_MEM_SHARE = 0.95


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


def check_mem_share(mem_share: float) -> float:
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
    fp8_training_gain: float = FP8_TRAINING_GAIN  # fp8 training's compute rate over bf16's
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
        m = check_mem_share(mem_share)
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

    def compute_rate(self, precision: str) -> float:
        """The FLOP/s a training step's compute part runs at, at ``precision`` and fmax
        (before ``mfu``): the datasheet peak, but fp8 at ``fp8_training_gain`` times
        bf16's (at most its datasheet peak)."""
        peak = self.peak_flops.for_precision(precision)  # validates the level
        if PRECISION_ALIASES.get(precision, precision) == "fp8":
            return min(peak, self.peak_flops.bf16 * self.fp8_training_gain)
        return peak

    def mem_share_at(self, mem_share: float, precision: str = "fp32") -> float:
        """The memory-bound share at ``precision`` of a workload whose share at fp32 is
        ``mem_share``: compute time scales with the level's peak FLOP/s, memory time
        with its bytes per element (capped at MAX_MEM_SHARE)."""
        m = check_mem_share(mem_share)
        rate = self.compute_rate(precision)  # validates the level
        if m == 0.0:
            return 0.0
        level = PRECISION_ALIASES.get(precision, precision)
        compute = self.peak_flops.fp32 / rate  # relative to fp32's compute time
        memory = m / (1.0 - m) * BYTES_PER_ELEMENT[level] / BYTES_PER_ELEMENT["fp32"]
        return min(MAX_MEM_SHARE, memory / (compute + memory))

    def fp32_mem_share(self, share: float, precision: str) -> float:
        """The inverse of :meth:`mem_share_at`: the fp32 share (what ``mem_share`` takes)
        of a workload that is ``share`` memory bound at ``precision``."""
        s = check_mem_share(share)
        level = PRECISION_ALIASES.get(precision, precision)
        compute = self.peak_flops.fp32 / self.compute_rate(precision)
        ratio = s / (1.0 - s) * compute * BYTES_PER_ELEMENT["fp32"] / BYTES_PER_ELEMENT[level]  # m / (1 - m)
        return ratio / (1.0 + ratio)

    def _time_at(self, flops: float, clock_mhz: float, m: float, precision: str, speed_factor: float) -> float:
        if flops < 0:
            raise ValueError(f"flops must be >= 0, got {flops}")
        if clock_mhz <= 0:
            raise ValueError(f"clock_mhz must be > 0, got {clock_mhz}")
        t0 = flops / (self.compute_rate(precision) * self.mfu * (1.0 - m))
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
