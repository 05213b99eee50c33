"""Measured power-limit profiles, and simulated GPUs that replay them.

A *profile* is what a real GPU showed for one training job at each power limit:
the step time and the power (or energy). ``greend run --sim N --sim-trace FILE``
(or ``[sim] trace = "FILE"``) makes every simulated GPU follow such a profile
instead of the built-in model, so policies can be tried on curves that real
hardware produced. Everything stays labelled ``source="sim"``.

Formats (CSV, one row per power limit, any order; detected from the header)
-------------------------------------------------------------------------

*Zeus* (the power-limit optimizer's profile, as in ``traces/zeus-gplo-a40/``)::

    start_time,window_name,elapsed_time,gpu0_energy[,gpu1_energy,...]
    13585781.0,__GlobalPowerLimitOptimizer_300,24.01,6224.9

``window_name`` ends in the limit in W; ``elapsed_time`` is the window's seconds
and ``gpuN_energy`` each GPU's joules over it. The step count of a window is not
recorded: only ratios between limits are used, so it does not matter. With several
GPUs the profile uses their mean energy (each simulated GPU follows that mean).

*greend's own* (``#`` lines are comments)::

    power_limit_w,step_time_s,avg_power_w
    300,0.600,259.3

``greenctl profile record`` writes this format from a real job (:func:`format_profile`).

How a traced GPU behaves
------------------------

* Its power-limit range is the profile's: lowest to highest measured limit; the
  default (uncapped) limit is the highest. Limits outside are refused like on a
  real GPU.
* A step's time is the model's time for the step's FLOPs (an A40 model: the FLOPs
  the client reports set how long a step is) times ``T(L) / T(top)``, the
  profile's step time at limit ``L`` over its time at the top limit. Its energy is
  the step time times the profile's average power at ``L``. Between measured
  limits time and energy per step are interpolated linearly (power = their ratio).
* Clocks: a profile is a power-limit profile and says nothing about clock caps.
  A traced GPU therefore reports a single supported SM clock (the A40's 1740 MHz):
  a clock cap changes nothing, and ``efficient`` with ``knob = "clock"`` reports
  the GPUs as not tunable. Use ``knob = "power"``.
* Memory share and precision only scale the model's step time.

:func:`bundled_trace` finds the profiles that ship with greend by name (e.g.
``A40+resnet50+gpu0``); any other path is read as given.
"""

from __future__ import annotations

import csv
import io
import re
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from greend.errors import ConfigError

from ._sim_model import PeakFlops, SimSpec, StepCost

__all__ = [
    "A40_MODEL",
    "TRACE_DIR",
    "TRACE_FILE_NAME",
    "TracePoint",
    "TraceProfile",
    "TraceSpec",
    "bundled_trace",
    "bundled_traces",
    "format_profile",
    "install_trace",
    "load_trace",
    "trace_spec",
]

TRACE_DIR = Path(__file__).resolve().parent / "traces"
TRACE_FILE_NAME = "trace.csv"  # the copy a simulated fleet's state dir holds
_ZEUS_WINDOW = re.compile(r"_(\d+(?:\.\d+)?)$")


@dataclass(frozen=True)
class TracePoint:
    power_limit_w: float
    step_time_s: float  # relative units are fine: only ratios between limits are used
    energy_j: float  # energy of one such step (per GPU)

    @property
    def power_w(self) -> float:
        return self.energy_j / self.step_time_s


@dataclass(frozen=True)
class TraceProfile:
    """Step time and energy per power limit, as measured; ascending limits."""

    name: str
    points: tuple[TracePoint, ...]
    n_gpus: int = 1
    source: str = ""

    def __post_init__(self) -> None:
        if len(self.points) < 2:
            raise ValueError(f"trace {self.name}: needs at least two power limits, got {len(self.points)}")
        limits = [p.power_limit_w for p in self.points]
        if limits != sorted(limits) or len(set(limits)) != len(limits):
            raise ValueError(f"trace {self.name}: power limits must be distinct and ascending")
        for p in self.points:
            if not (p.power_limit_w > 0 and p.step_time_s > 0 and p.energy_j > 0):
                raise ValueError(f"trace {self.name}: non-positive value at {p.power_limit_w:g} W")

    @property
    def limits_w(self) -> tuple[float, ...]:
        return tuple(p.power_limit_w for p in self.points)

    @property
    def min_w(self) -> float:
        return self.points[0].power_limit_w

    @property
    def max_w(self) -> float:
        return self.points[-1].power_limit_w

    def _interp(self, limit_w: float) -> tuple[float, float]:
        lim = min(max(limit_w, self.min_w), self.max_w)
        xs = self.limits_w
        k = bisect_left(xs, lim)
        if k < len(xs) and abs(xs[k] - lim) < 1e-9:
            p = self.points[k]
            return p.step_time_s, p.energy_j
        a, b = self.points[k - 1], self.points[k]
        w = (lim - a.power_limit_w) / (b.power_limit_w - a.power_limit_w)
        return (a.step_time_s + w * (b.step_time_s - a.step_time_s), a.energy_j + w * (b.energy_j - a.energy_j))

    def time_ratio(self, limit_w: float) -> float:
        """Step time at ``limit_w`` over the step time at the top limit."""
        return self._interp(limit_w)[0] / self.points[-1].step_time_s

    def energy_ratio(self, limit_w: float) -> float:
        return self._interp(limit_w)[1] / self.points[-1].energy_j

    def power_w(self, limit_w: float) -> float:
        """Average power over a step at ``limit_w`` (per GPU)."""
        t, e = self._interp(limit_w)
        return e / t


def _read_rows(text: str) -> list[dict[str, str]]:
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return list(csv.DictReader(io.StringIO("\n".join(lines)), skipinitialspace=True))


def load_trace(path: Path | str) -> TraceProfile:
    """Read a profile in either format (see the module docstring)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"trace {p}: cannot be read: {e.strerror}") from e
    rows = _read_rows(text)
    if not rows:
        raise ConfigError(f"trace {p}: no rows")
    cols = set(rows[0])
    points: list[TracePoint] = []
    n_gpus = 1
    try:
        if {"window_name", "elapsed_time"} <= cols:
            energy_cols = sorted(c for c in cols if re.fullmatch(r"gpu\d+_energy", c))
            if not energy_cols:
                raise ValueError("no gpu<N>_energy column")
            n_gpus = len(energy_cols)
            for r in rows:
                m = _ZEUS_WINDOW.search(r["window_name"].strip())
                if m is None:
                    raise ValueError(f"window_name {r['window_name']!r} does not end in a power limit")
                t = float(r["elapsed_time"])
                energy_j = sum(float(r[c]) for c in energy_cols) / n_gpus
                points.append(TracePoint(float(m.group(1)), t, energy_j))
        elif {"power_limit_w", "step_time_s", "avg_power_w"} <= cols:
            for r in rows:
                t = float(r["step_time_s"])
                points.append(TracePoint(float(r["power_limit_w"]), t, t * float(r["avg_power_w"])))
        else:
            raise ValueError(
                "unknown columns; expected Zeus's (window_name, elapsed_time, gpu0_energy, ...) "
                "or power_limit_w,step_time_s,avg_power_w"
            )
        points.sort(key=lambda x: x.power_limit_w)
        named = re.search(r"^#\s*name:\s*(\S+)", text, re.M)
        name = named.group(1) if named else p.stem
        return TraceProfile(name=name, points=tuple(points), n_gpus=n_gpus, source=str(p))
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"trace {p}: {e}") from e


def format_profile(name: str, rows: list[dict[str, float]], comments: tuple[str, ...] = ()) -> str:
    """A profile in greend's own format (what :func:`load_trace` reads): ``rows`` of
    ``power_limit_w``, ``step_time_s`` and ``avg_power_w``, written in ascending limits,
    after a ``# name:`` line and ``comments`` (one ``#`` line each)."""
    if not re.fullmatch(r"\S+", name):
        raise ValueError(f"profile name {name!r} must be one word")
    out = [f"# name: {name}", *(f"# {c}" for c in comments), "power_limit_w,step_time_s,avg_power_w"]
    for r in sorted(rows, key=lambda r: r["power_limit_w"]):
        out.append(f"{r['power_limit_w']:g},{r['step_time_s']:.6g},{r['avg_power_w']:.6g}")
    text = "\n".join(out) + "\n"
    # What we write must read back (two or more distinct limits, positive values).
    _rows = _read_rows(text)
    points = [
        TracePoint(
            float(r["power_limit_w"]), float(r["step_time_s"]), float(r["step_time_s"]) * float(r["avg_power_w"])
        )
        for r in _rows
    ]
    TraceProfile(name=name, points=tuple(points))
    return text


def bundled_traces() -> list[Path]:
    """The profiles that ship with greend."""
    return sorted(TRACE_DIR.glob("*/*.csv"))


def bundled_trace(name_or_path: str | Path) -> Path:
    """A path as given if it exists, else the bundled profile of that name (with or
    without ``.csv``); a ConfigError lists the bundled ones otherwise."""
    p = Path(name_or_path)
    if p.exists():
        return p
    want = p.name[:-4] if p.name.endswith(".csv") else p.name
    for t in bundled_traces():
        if t.stem == want:
            return t
    names = ", ".join(t.stem for t in bundled_traces())
    raise ConfigError(f"trace {name_or_path}: no such file, and not a bundled trace ({names})")


# The model under a trace: an NVIDIA A40 (datasheet peak FLOP/s, dense). Only its
# step time at the top limit is used (the profile supplies power and slowdown).
A40_MODEL = SimSpec(
    name="NVIDIA A40 (simulated)",
    supported_sm_clocks_mhz=(1740,),
    mem_clock_mhz=7251,
    power_limit_min_w=100.0,
    power_limit_max_w=300.0,
    power_limit_default_w=300.0,
    compute_capability=(8, 6),
    idle_w=30.0,
    static_w=80.0,
    dyn_w=220.0,
    alpha=2.0,
    mem_relief=0.7,
    mem_w=60.0,
    peak_flops=PeakFlops(fp32=37.4e12, tf32=74.8e12, bf16=149.7e12, fp16=149.7e12, fp8=149.7e12),
    mfu=0.5,
    memory_total_mib=46068,
)


@dataclass(frozen=True)
class TraceSpec(SimSpec):
    """A simulated GPU that follows a measured profile (see the module docstring)."""

    profile: TraceProfile | None = field(default=None, compare=False)

    def _prof(self) -> TraceProfile:
        if self.profile is None:
            raise ValueError("TraceSpec without a profile")
        return self.profile

    def busy_power_w(self, clock_mhz: float, mem_share: float = 0.0) -> float:
        return self._prof().power_w(self.power_limit_default_w)

    def effective_clock_mhz(
        self, mem_share: float, power_limit_w: float | None = None, locked_clocks_mhz: tuple[int, int] | None = None
    ) -> int:
        return self.sm_clock_max_mhz

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
        prof = self._prof()
        limit = self.power_limit_default_w if power_limit_w is None else power_limit_w
        m = self.mem_share_at(mem_share, precision)
        t_top = self._time_at(flops, self.sm_clock_max_mhz, m, precision, speed_factor)
        t = t_top * prof.time_ratio(limit)
        p = prof.power_w(limit)
        return StepCost(duration_s=t, energy_j=p * t, sm_clock_mhz=self.sm_clock_max_mhz, power_w=p)


def trace_spec(trace: TraceProfile | Path | str, model: SimSpec = A40_MODEL) -> TraceSpec:
    """A :class:`TraceSpec` whose power-limit range is the profile's."""
    prof = trace if isinstance(trace, TraceProfile) else load_trace(bundled_trace(trace))
    base: dict[str, Any] = {f: getattr(model, f) for f in model.__dataclass_fields__}
    base.update(
        name=f"{model.name.replace(' (simulated)', '')} (simulated, trace {prof.name})",
        power_limit_min_w=prof.min_w,
        power_limit_max_w=prof.max_w,
        power_limit_default_w=prof.max_w,
        profile=prof,
    )
    return TraceSpec(**base)


def install_trace(sim_dir: Path | str, trace: str | Path | None) -> Path | None:
    """Make the simulated fleet in ``sim_dir`` follow ``trace`` (a copy goes to
    ``<sim_dir>/trace.csv``, which the sim probe reads), or stop following one (None or
    ""). Returns the installed copy. The profile is checked before anything is copied."""
    d = Path(sim_dir)
    dest = d / TRACE_FILE_NAME
    if not trace:
        if dest.exists():
            dest.unlink()
        return None
    src = bundled_trace(trace)
    load_trace(src)  # refuse a bad file with a clear message
    d.mkdir(parents=True, exist_ok=True)
    if not dest.exists() or dest.resolve() != src.resolve():
        tmp = d / f".{TRACE_FILE_NAME}.tmp"
        text = src.read_text()
        if not text.lstrip().startswith("# name:"):
            text = f"# name: {src.stem}\n" + text
        tmp.write_text(text)
        tmp.replace(dest)
    return dest
