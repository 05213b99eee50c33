"""Power limits between two grid levels, where the slowdown bound falls between them.

The ``efficient`` policy searches the power limit on a grid (every ``power_step_w``,
25 W by default). When the bound falls between two neighbouring levels, the lower one
is over the bound (or too close to it to call under the step noise) and the policy
settles on the upper one, which can cost several percent more energy than a limit
just above the bound: on a measured A40 ResNet-50 profile, 200 W runs 0.11 % under a
5 % bound and 225 W costs 9.6 % more energy per step; at 2 % step noise no run of a
few hundred steps tells 200 W from "over".

A power limit is a continuous knob (NVML takes milliwatts), so once the job has
settled and its baseline has been re-checked, :func:`finer_limit` proposes a limit
between the two: the lowest one that a straight line through the two measured levels
predicts to run under the bound by a margin the measurement can confirm. Real
time-versus-limit curves are mostly convex (time rises faster the lower the limit), so
the straight line over-estimates the time between two measured levels: the error is on
the safe side. The policy measures the new limit like any other setting; if it is
over, it becomes the lower level of the next try; at most :data:`MAX_FINE` tries a
search. Before the tries, the baseline and a limit below that may be within the bound
are measured :data:`LONG` times longer, and judged once, by :data:`Z_LONG`
(:meth:`greend.policies.efficient.EfficientPolicy._plan`; :func:`may_look` says when).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ._pacing import PaceState
from .base import Setting
from .efficient_state import JobSearch

__all__ = [
    "GAIN_LONG",
    "GAIN_MIN",
    "LONG",
    "MAX_FINE",
    "PLATEAU",
    "Z_LONG",
    "Bracket",
    "finer_limit",
    "insert_finer",
    "may_look",
]

GAIN_MIN = 0.005  # a finer limit is tried only where it is predicted to save this much energy
MAX_FINE = 3  # finer limits tried per search
MIN_STEP_W = 1.0  # nearer than this to a measured level: not worth a try
GAIN_LONG = 0.02  # a setting still unsure after max_steps that would save this much more energy...
LONG = 4  # ...is measured up to this many times max_steps
PLATEAU = 1.1  # a limit over the bound by less than this factor may sit in a zig-zag: look below it
Z_LONG = 2.6  # one-sided 99.5 %: a setting measured beyond max_steps is judged by this many standard errors


@dataclass(frozen=True)
class Bracket:
    """Two measured neighbouring power limits: the one settled on (``hi``) and the
    one below it that is over the bound or unsure (``lo``); their time ratios to the
    uncapped baseline and their energy per FLOP."""

    hi_w: float
    lo_w: float
    hi_ratio: float
    lo_ratio: float
    hi_energy: float
    lo_energy: float


def finer_limit(b: Bracket, allowed: float, se_new: float, z: float) -> float | None:
    """The lowest whole-watt limit between ``b.lo_w`` and ``b.hi_w`` that the line
    through the two predicts to run within ``allowed`` (a time ratio) by ``z``
    standard errors of the new limit's own measurement (``se_new``, as a time ratio),
    so that the measurement can confirm it; None where that limit is not predicted to
    save :data:`GAIN_MIN` of the energy. A prediction that was wrong costs only the
    measurement: the limit is judged on what it measures."""
    if b.lo_w >= b.hi_w - 2 * MIN_STEP_W or b.lo_energy >= b.hi_energy * (1.0 - GAIN_MIN):
        return None
    rise = b.lo_ratio - b.hi_ratio
    if rise <= 0:
        return None  # the lower level is not slower: nothing to interpolate
    best: float | None = None
    # From the lower level up, the first whole watt whose prediction leaves the margin.
    w = math.ceil(b.lo_w + MIN_STEP_W)
    while w <= b.hi_w - MIN_STEP_W:
        t = (b.hi_w - w) / (b.hi_w - b.lo_w)  # 0 at hi, 1 at lo
        ratio = b.hi_ratio + t * rise
        if ratio + z * se_new <= allowed:
            best = w
            break
        w += 1
    if best is None:
        return None
    t = (b.hi_w - best) / (b.hi_w - b.lo_w)
    if t * (b.hi_energy - b.lo_energy) < GAIN_MIN * b.hi_energy:
        return None
    return float(best)


def may_look(job: JobSearch, best: int) -> bool:
    """Whether the search may take a second look below ``best``: power knob (the clock
    knob's grid is the GPU's own clocks, and on the simulated H100 its second look cost
    more run energy than it won), settled there, with the baseline re-checked (so it is
    precise; uncapped, the baseline grows on its own) and no GPU paced (the grid may
    grow, and the pacing holds grid indices)."""
    checked = job.rechecked_once or best == len(job.grid) - 1
    return (
        job.knob == "power" and job.phase == "settled" and job.settled_index == best and checked and not job.pace.held
    )


def insert_finer(job: JobSearch, best: int, b: Bracket, allowed: float, se_new: float) -> bool:
    """Put a finer limit (:func:`finer_limit`; ``se_new``: the relative standard error
    its measurement will have) into the job's grid just below ``best``, where it then
    sits at index ``best``. False where there is none to try."""
    w = finer_limit(b, allowed, se_new * allowed, Z_LONG)
    if w is None:
        return False
    job.grid = job.grid[:best] + (Setting(power_limit_w=w),) + job.grid[best:]
    job.levels = job.levels[:best] + (w,) + job.levels[best:]
    job.fine += 1
    job.pace = PaceState()  # what the pacer learnt is kept by grid index (no GPU is paced now)
    return True
