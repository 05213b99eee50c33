"""The ``precision`` policy's memory per job and its loss arithmetic.

What :mod:`greend.policies.precision` keeps between decisions (the evidence per
level and GPU setting, the probation, the level asked for and not yet applied, the
barred levels) and the least-squares trend it judges losses by. Pure data and
arithmetic: no decisions here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .base import JobMeasure, Setting

__all__ = [
    "GUARD_Z",
    "PROBATION_EXTEND",
    "PROBE_PROBATION_STEPS",
    "REFERENCE_CHECKS",
    "SEEN_KEEP",
    "STABILITY_WINDOWS",
    "STAND_INS",
    "Evidence",
    "Pending",
    "PrecisionState",
    "Probation",
    "JobMemory",
    "loss_trend",
    "mean_text",
]

# A rung that the job does not run may be stood in for by these (in order).
STAND_INS: dict[str, tuple[str, ...]] = {"bf16": ("tf32",), "fp8": ("fp8-emulated",)}
SEEN_KEEP = 256


@dataclass
class Evidence:
    steps: int = 0
    flops: float = 0.0
    time_s: float = 0.0
    energy_j: float = 0.0

    @property
    def epf(self) -> float:
        """Energy per FLOP; for a job that counts no FLOPs, energy per step (its steps are
        the same work at every level); inf where neither is known."""
        if self.flops > 0:
            return self.energy_j / self.flops
        return self.energy_j / self.steps if self.steps > 0 and self.energy_j > 0 else math.inf


@dataclass
class Probation:
    from_level: str
    to_level: str
    start_steps: int  # job steps when the switch was made
    start_losses: int  # how many losses the job had shown when the switch was made
    trend: float  # the loss level before the switch: the mean of its last window
    noise: float  # residual spread before the switch (absolute)
    trend_se: float = 0.0  # the standard error of ``trend`` (absolute)
    waiting_since_s: float | None = None  # accuracy passed: waiting for an energy figure to compare


@dataclass
class Pending:
    """A level this policy asked for that the job's ranks have not applied yet."""

    from_level: str
    to_level: str
    kind: str  # "switch" (a step down: its probation starts once applied), "rollback", "back"
    steps: int  # the job's steps when it was asked
    why: str


@dataclass
class JobMemory:
    level: str
    level_since_steps: int
    losses_seen: int = 0  # losses counted so far (from JobView.steps deltas)
    last_steps: int = 0
    last_nonfinite: int = 0
    last_probe_steps: int = 0  # the job's probe steps at the last look
    last_nonfinite_prev: int = 0  # the count a look before (a level's first interval judges from it)
    last_measure: JobMeasure | None = None
    last_setting: Setting | None = None
    skip: int = 1  # decision intervals still to skip before booking evidence
    level_losses: list[float] = field(default_factory=list)  # losses at the current level
    nonfinite_at_start: int = 0
    evidence: dict[tuple[str, Setting], Evidence] = field(default_factory=dict)
    probation: Probation | None = None
    pending: Pending | None = None
    barred: dict[str, tuple[float, str]] = field(default_factory=dict)  # level -> (until t_s, why)
    no_gain: dict[str, float] = field(default_factory=dict)  # level -> until t_s
    seen_events: list[tuple[Any, ...]] = field(default_factory=list)
    last_event: str = ""


@dataclass
class PrecisionState:
    jobs: dict[str, JobMemory] = field(default_factory=dict)


def loss_trend(losses: list[float]) -> tuple[float, float, float, float]:
    """Least-squares line through ``losses``: (mean, slope per step, fitted value at the
    last point, residual standard deviation)."""
    n = len(losses)
    if n == 0:
        return (math.nan, 0.0, math.nan, 0.0)
    mean = sum(losses) / n
    if n < 2:
        return (mean, 0.0, mean, 0.0)
    xm = (n - 1) / 2.0
    sxx = sum((i - xm) ** 2 for i in range(n))
    slope = sum((i - xm) * (v - mean) for i, v in enumerate(losses)) / sxx
    resid = [v - (mean + slope * (i - xm)) for i, v in enumerate(losses)]
    sd = math.sqrt(sum(r * r for r in resid) / max(1, n - 2))
    return (mean, slope, mean + slope * (n - 1 - xm), sd)


def mean_text(values: list[float]) -> str:
    return f"{sum(values) / len(values):.6g}" if values else "n/a"


# The callback's reference rule needs this many checks for a verdict
# (greend.training.reference.MIN_CHECKS; a test keeps the two equal).
REFERENCE_CHECKS = 3
FIGURE_WAIT_S = 1800.0  # accuracy passed, no figure of both levels at one GPU setting: wait this long for one
STABILITY_WINDOWS = 8  # the stability test fits up to this many windows of losses
PROBATION_EXTEND = 4  # an undecided probation runs on to this many times probation_steps
# A job whose ranks probe (JobView.probe_every) is on probation until the callback's
# first two probe blocks are in (greend.training.probe: judged_by(1) is 93 to 125 steps
# after the switch, its gap drawn; a few steps more for the verdict to be read; a test
# checks it against every draw).
PROBE_PROBATION_STEPS = 130
GUARD_Z = 2.0  # standard errors a loss must be beyond the tolerance (or the trend) to count
