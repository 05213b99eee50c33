"""A new phase of a settled job: its FLOP rate or power moved, beyond its own noise.

The ``efficient`` policy keeps, while a job is settled, the evidence of its steps since it
settled (``job.samples``: the running totals, one per decision) and the reference the
setting showed when it settled (``job.ref``). A window of the latest steps that differs
from the reference by more than ``retune_drift`` *and* by :data:`DRIFT_Z` standard errors
(the window's own step-to-step spread and the reference's) is a new phase: the search
starts again. Two windows are looked at, the last ``min_steps`` steps (a sudden change is
seen within a policy period or two) and the last ``4 * min_steps`` (a smaller change in a
noisy job). The standard errors make one long step (a checkpoint every N steps, a data
loader's stall) or a noisy patch no phase: a 10x step among 8 reads as a 53 % drop of the
FLOP rate, with a standard error of about as much.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from ._evidence import Evidence
from .efficient_state import JobSearch

__all__ = ["DRIFT_Z", "WINDOWS", "phase_change", "windows"]

DRIFT_Z = 4.0  # standard errors a drift must also be (the check runs every period: rare false alarms)
WINDOWS = (1, 4)  # the windows looked at, in ``min_steps``


def phase_change(job: JobSearch, min_steps: int, threshold: float, noise: float) -> str | None:
    """Why the settled ``job`` is in a new phase (its reason), or None."""
    ref, now = job.ref, job.live
    if ref is None or now is None or not job.samples or min(ref.flops, ref.time_s, ref.energy_j) <= 0:
        return None
    for _, window in windows(job, now, min_steps):
        dfps = ref.time_per_flop_s / window.time_per_flop_s - 1.0
        dp = window.power_w / ref.power_w - 1.0
        # The window's spread is read from few steps: never below the reference's (more steps).
        n = math.sqrt(window.steps)
        sd_t = max(window.se_time(noise), ref.se_time(noise) * math.sqrt(ref.steps) / n)
        sd_e = max(window.se_energy(noise), ref.se_energy(noise) * math.sqrt(ref.steps) / n)
        se_t = math.hypot(sd_t, ref.se_time(noise))
        se_p = math.hypot(sd_e, ref.se_energy(noise), se_t)
        if (abs(dfps) > threshold and abs(dfps) > DRIFT_Z * se_t) or (abs(dp) > threshold and abs(dp) > DRIFT_Z * se_p):
            return f"phase change ({dfps:+.0%} FLOP/s, {dp:+.0%} power)"
    return None


def windows(job: JobSearch, now: Evidence, min_steps: int) -> Iterator[tuple[Evidence, Evidence]]:
    """Each window of the latest steps (:data:`WINDOWS`) that ran and counted FLOPs,
    shortest first: (the running totals where it starts, its evidence)."""
    for k in WINDOWS:
        start = next((s for s in reversed(job.samples) if now.steps - s.steps >= k * min_steps), None)
        window = None if start is None else now.minus(start)
        if start is not None and window is not None and window.flops > 0 and window.time_s > 0:
            yield start, window
