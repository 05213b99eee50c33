"""Pacing within a node: the GPUs of one job that wait for a slower one are slowed to its pace.

A synchronous job steps at the pace of its slowest rank. When the ranks on one node
run at different speeds (a GPU that runs hot and throttles, one with more work: an
uneven stage or uneven data), the others finish early and wait at the collective:
their speed is wasted energy. Pacing gives each GPU off the critical path a deeper
setting (a lower clock cap or power limit than the job's) until it just keeps the
critical pace, without slowing the job.

How (``efficient`` calls :meth:`Pacer.step` each period, once the job is settled):

* **Who is critical.** Each GPU's busy share over the last period against the job's
  busiest GPU (:func:`busy_shares`). A GPU below ``1 - SLACK`` of it has slack.
* **How deep.** A GPU with slack ``r = util / util_max`` is moved to the grid level
  ``level * r / TARGET`` (or the next one down, at least): a compute-bound step
  stretches as ``1 / clock``, so this is the deepest setting that keeps the pace for
  such a step; a memory-bound one stretches less, and the next periods go further.
* **Followed.** A paced GPU that becomes as busy as the busiest (the straggler
  healed, or the paced GPU became one) gets the job's setting back at once; a GPU
  that gains slack later is paced then. A change in the job's setting or a new
  search lifts all pacing.
* **Never slower.** Each move is checked: the job's time per FLOP over at least
  ``min_steps`` steps after it against before it; slower by more than the noise
  (``max(1 %, Z`` standard errors``)``) undoes the move, and pacing waits (30 s,
  doubling after each undo, at most 10 min) before it tries again.

The pacer is pure like the policy: its memory is the :class:`PaceState` in the job's
search state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ._evidence import Evidence
from .base import GpuView, JobView, Setting
from .static import same_setting

__all__ = ["PaceState", "Pacer", "as_job", "busy_shares"]

SLACK = 0.03  # a GPU less busy than 1 - SLACK of the busiest has slack to give
TARGET = 0.985  # pace a GPU to this share of the busiest one's busy time
NEAR = 0.995  # a paced GPU this busy is on the critical path: the job's setting back
UNDO_MIN = 0.01  # a slowdown below this is never read as one (noise)
BACKOFF_S = 30.0
BACKOFF_MAX_S = 600.0


@dataclass
class PaceState:
    """One job's pacing: which GPUs are held below the job's setting, and the check of
    the last move."""

    held: dict[int, int] = field(default_factory=dict)  # GPU -> grid index (below the job's)
    base: int | None = None  # the job's grid index the held ones are relative to
    before: dict[int, int] | None = None  # ``held`` before the last move (for an undo)
    ref: Evidence | None = None  # the job's steps just before the last move
    wait_until_s: float = 0.0
    backoff_s: float = BACKOFF_S
    seen: list[Evidence] = field(default_factory=list)  # the job's measure, period by period
    fresh: bool = True  # the measure started again since the last move
    since_s: float | None = None  # when the measure in ``seen`` started (the daemon's word)
    mark: Evidence | None = None  # the job's measure when the slack showed
    moves: int = 0
    undos: int = 0
    last_event: str = ""


class Pacer:
    """Within-node pacing of one job's GPUs, given its settled setting on a grid."""

    def __init__(self, min_steps: int, z: float, noise: float) -> None:
        self.min_steps = min_steps
        self.z = z
        self.noise = noise

    def release(self, ps: PaceState, job_setting: Setting, why: str) -> dict[int, Setting]:
        """Every held GPU back at the job's setting."""
        out = {i: job_setting for i in ps.held}
        if out:
            ps.last_event = f"pacing lifted: {why}"
        ps.held, ps.before, ps.ref, ps.base = {}, None, None, None
        return out

    def step(
        self,
        ps: PaceState,
        t_s: float,
        grid: Sequence[Setting],
        levels: Sequence[float],
        base: int,
        views: Sequence[GpuView],
        live: Evidence | None,
        since_s: float | None = None,
    ) -> dict[int, Setting]:
        """This period's per-GPU changes (GPU -> setting); {} when nothing moves.
        ``since_s``: when the daemon's measure behind ``live`` started; a new value is a
        new measure even where it already holds more steps than the old one."""
        if ps.base is not None and ps.base != base:
            return self.release(ps, grid[base], "the job's setting changed")
        ps.base = base
        utils = busy_shares(views)
        if len(views) < 2 or any(u is None for u in utils.values()):
            return self.release(ps, grid[base], "its GPUs' utilisation is not read")
        busy = {i: float(u or 0.0) for i, u in utils.items()}
        top = max(busy.values())
        if top <= 0.0:
            return {}
        out: dict[int, Setting] = {}
        restarted = since_s is not None and ps.since_s is not None and since_s != ps.since_s
        if live is None or restarted or (ps.seen and live.steps < ps.seen[-1].steps):
            # the daemon's measure started again (after a move): nothing of the old one is
            # a reference for the new one
            ps.seen, ps.fresh, ps.mark = [], True, None
        ps.since_s = since_s
        if live is not None:
            ps.seen = [*ps.seen[-63:], live]
        # ---- paced GPUs now on the critical path: the job's setting back, at once
        for i in list(ps.held):
            if busy.get(i, top) >= NEAR * top:
                out[i] = grid[base]
                del ps.held[i]
        if out:
            ps.before, ps.ref = None, None  # (nothing left to check: the job's pace rules)
            ps.last_event = "pacing: " + ", ".join(f"gpu{i}" for i in sorted(out)) + " back on the critical path"
            return out
        # ---- the last move's check: slower by more than the noise undoes it
        if ps.ref is not None:
            if live is None or not ps.fresh or live.steps < self.min_steps:
                return {}  # (until the daemon's measure restarts after the move, it is the old one)
            se = math.hypot(live.se_time(self.noise), ps.ref.se_time(self.noise))
            slower = live.time_per_flop_s / ps.ref.time_per_flop_s - 1.0
            if slower > max(UNDO_MIN, self.z * se):
                prev = ps.before or {}
                for i in set(ps.held) | set(prev):
                    out[i] = grid[prev.get(i, base)]
                ps.held = dict(prev)
                ps.undos += 1
                ps.wait_until_s = t_s + ps.backoff_s
                ps.last_event = f"pacing undone: the job ran {slower:+.1%} slower; next try in {ps.backoff_s:.0f} s"
                ps.backoff_s = min(BACKOFF_MAX_S, 2 * ps.backoff_s)
                ps.before, ps.ref = None, None
                return out
            ps.before, ps.ref = None, None
        # The reference: the job's steps since the slack showed (not older ones: a straggler
        # that just came would read as the move's slowdown), at least min_steps of them.
        if live is None or not any(u / top < 1.0 - SLACK for u in busy.values()):
            ps.mark = None
            return {}
        if ps.mark is None or ps.mark.steps > live.steps:
            ps.mark = live if len(ps.seen) < 2 else ps.seen[-2]
        recent = live.minus(ps.mark) if live.steps > ps.mark.steps else live
        if t_s < ps.wait_until_s or recent.steps < self.min_steps:
            return {}
        # ---- GPUs with slack: deeper, to just keep the pace
        before = dict(ps.held)
        for i, u in sorted(busy.items()):
            r = u / top
            if r >= 1.0 - SLACK:
                continue
            at = ps.held.get(i, base)
            want = levels[at] * r / TARGET
            k = next((x for x in range(len(levels)) if levels[x] >= want - 1e-9), at)
            k = max(0, min(k, at - 1))
            if k == at:
                continue
            ps.held[i] = k
            out[i] = grid[k]
        if out:
            ps.before, ps.ref, ps.fresh, ps.mark = before, recent, False, None
            ps.moves += 1
            ps.last_event = "pacing: " + ", ".join(f"gpu{i} to {grid[k].label}" for i, k in sorted(ps.held.items()))
        return out


def as_job(j: JobView, ps: PaceState, grid: Sequence[Setting], current: Setting) -> JobView:
    """The job as its search sees it: the daemon shows a job's setting as its first
    GPU's; where that GPU is paced, the job's own setting is the one searched for."""
    k = ps.held.get(min(j.gpus)) if j.gpus else None
    if k is None or k >= len(grid) or not same_setting(j.setting, grid[k]):
        return j
    m = j.measure
    return replace(j, setting=current, measure=None if m is None else replace(m, setting=current))


def busy_shares(views: Sequence[GpuView]) -> dict[int, float | None]:
    """Each GPU's busy share in percent: its SM activity (``GpuView.sm_active_pct``, NVML's
    GPM, Hopper and newer) where every GPU of the job has it, else its utilisation
    (``GpuView.util_pct``: the share of time a kernel ran). Never a mix: the two are not on
    one scale. On real GPUs only SM activity finds slack: NCCL's wait kernels keep a
    waiting GPU's utilisation near 100 %, while few of its SMs are busy."""
    gpm = bool(views) and all(g.sm_active_pct is not None for g in views)
    return {g.index: g.sm_active_pct if gpm else g.util_pct for g in views}
