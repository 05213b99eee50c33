"""Pacing within a node: the GPUs of one job that wait for a slower one are slowed to its pace.

A synchronous job steps at the pace of its slowest rank. When the ranks on one node
run at different speeds (a GPU that runs hot and throttles, one with more work: an
uneven stage or uneven data), the others finish early and wait at the collective:
their speed is wasted energy. Pacing gives each GPU off the critical path a deeper
setting (a lower clock cap or power limit than the job's) until it just keeps the
critical pace, without slowing the job.

How (``efficient`` calls :meth:`Pacer.step` each period, once the job is settled):

* **Who is critical.** Each GPU's busy share over the last period (:func:`busy_of`: its
  SM activity where every GPU of the job has NVML's GPM, else ``GpuView.util_pct``, the
  share of time a kernel ran; a job that had SM activity on every GPU holds its pacing
  through a period where some GPU's read failed, for up to ``GPM_HOLD`` periods)
  against the busiest GPU at the job's setting (the critical pace). A GPU at the job's
  setting below ``1 - SLACK`` of it has slack.
* **How deep.** Each move takes a GPU to the deepest grid level predicted to keep its
  share under ``TARGET``. The prediction is the GPU's own stretch curve (its busy time
  per level over its time at the job's setting), learnt from its moves: measured
  levels as they were, read between them, carried on past the deepest along its last
  two points. Before any move the curve is ``1 / level`` (a compute-bound step on a
  clock stretches so; a memory-bound step, or a power limit above the job's draw,
  stretches less, and the first move is short of the pace). A move goes at most twice
  as many notches as the GPU's last one, and never where a ``1 / level`` step would run
  over ``WORST`` of the pace; a GPU with more than ``SLACK`` left where nothing is
  predicted to fit goes one notch. After each checked move the next one needs no new
  reference: moves follow each other every ``min_steps`` steps.
* **Room.** Where the job's setting runs faster than its bound allows (a power limit
  both cheaper and quicker than uncapped), ``efficient`` passes the room left
  (``room``: the allowed step over the critical GPU's, at least 1): the paced GPUs are
  paced to ``TARGET * room`` of the critical pace, and a move is undone only when the
  job runs slower by more than the room and the noise. The critical GPU, and any GPU
  at the job's setting without slack, is never paced.
* **Noise.** A period's busy share varies on real GPUs (by a percent or more): a
  paced GPU's share is the mean of its periods since its setting last changed, and
  the readings' spread (``PaceState.spread``) is learnt from how each GPU's share
  changes from one period to the next at an unchanged setting. A paced GPU is on the
  critical path when its share is at or over ``NEAR`` and beyond that noise: in two
  periods in a row its mean over its last periods is over ``TARGET`` by ``CLEAR``
  spreads of that mean, or in one period it is over the pace by ``CLEAR`` spreads
  (noise-free: one period at ``NEAR``). A paced GPU goes deeper only where its mean
  share is under the line by more than ``Z`` spreads of that mean.
* **Too deep.** A GPU the last move took past the pace (on the critical path, as
  above) goes back where it was, and that level is its floor while the straggler
  lasts: it converges on the deepest level that keeps the pace and does not start over.
* **Followed.** A paced GPU that becomes as busy as the pace without a move of its own
  (the straggler healed, or the paced GPU became one) gets the job's setting back at
  once, and the floors go (the next straggler has its own); the curves stay, so the
  next straggler is paced in a move or two. ``efficient`` keeps a settled job's
  setting and evidence when a straggler comes or heals (:func:`straggle_shown`) instead
  of re-tuning it. A change in the job's setting or a new search lifts all pacing and
  forgets the curves.
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

__all__ = ["PaceState", "Pacer", "as_job", "busy_of", "straggle_shown"]

SLACK = 0.03  # a GPU at its job's setting less busy than 1 - SLACK of the busiest has slack to give
TARGET = 0.99  # pace a GPU up to this share of the critical GPU's busy time
NEAR = 0.995  # a paced GPU this busy (at least, and beyond the readings' noise) is on the critical path
CLEAR = 4.0  # standard deviations of the readings' spread that make a paced GPU's share clearly over TARGET
WINDOW = 8  # periods of a GPU's share kept since its setting last changed (its mean is read, not one period)
GPM_HOLD = 30  # periods a job that had SM activity on every GPU waits for it back before it reads utilisation
WORST = 1.25  # a move never risks a paced GPU's step longer than this share of the pace, at worst
UNDO_MIN = 0.01  # a slowdown below this is never read as one (noise)
BACKOFF_S = 30.0
BACKOFF_MAX_S = 600.0


def busy_of(views: Sequence[GpuView], gpm_seen: bool = False) -> dict[int, float] | None:
    """Each GPU's busy share over the last period in percent (the one signal pacing
    reads); None where a GPU's is not read. Its SM activity (``GpuView.sm_active_pct``,
    NVML's GPM, Hopper and newer) where every GPU of the job has it, else its utilisation
    (``GpuView.util_pct``: the share of time a kernel ran). Never a mix: the two are not
    on one scale. On real GPUs only SM activity finds slack: NCCL's wait kernels keep a
    waiting GPU's utilisation near 100 %, while few of its SMs are busy. ``gpm_seen``:
    the job had SM activity on every GPU before; a period where some GPU's is missing (a
    failed GPM read) is not read (None), not one of utilisation (which reads ~100 % on
    every GPU, as if a straggler healed)."""
    gpm = bool(views) and all(g.sm_active_pct is not None for g in views)
    if gpm_seen and not gpm:
        return None
    out: dict[int, float] = {}
    for g in views:
        u = g.sm_active_pct if gpm else g.util_pct
        if u is None:
            return None
        out[g.index] = float(u)
    return out


def _shares(busy: dict[int, float], held: dict[int, int]) -> dict[int, float] | None:
    """Each GPU's busy time over the busiest GPU's among those at the job's setting (the
    critical pace: a paced GPU that runs over it shows a share above 1)."""
    free = [b for i, b in busy.items() if i not in held] or list(busy.values())
    ref = max(free, default=0.0)
    if ref <= 0.0:
        return None
    return {i: b / ref for i, b in busy.items()}


def _busy(ps: PaceState, views: Sequence[GpuView], count: bool = False) -> dict[int, float] | None:
    """:func:`busy_of` for the job whose pacing is ``ps``; it remembers that the job's
    GPUs all had SM activity, and (``count``: once a period) forgets it after
    ``GPM_HOLD`` periods without."""
    if views and all(g.sm_active_pct is not None for g in views):
        ps.gpm_seen, ps.gpm_missing = True, 0
    elif ps.gpm_seen and count:
        ps.gpm_missing += 1
        if ps.gpm_missing > GPM_HOLD:
            # gone for good: utilisation from now on, on its own scale
            ps.gpm_seen, ps.gpm_missing = False, 0
            ps.window, ps.win_at, ps.spread, ps.spread_n = {}, {}, 0.0, 0
    return busy_of(views, ps.gpm_seen)


def _window(ps: PaceState, i: int, at: int, x: float | None = None) -> list[float]:
    """GPU ``i``'s shares since its setting (grid index ``at``) last changed, with ``x``
    (this period's, not yet kept) last."""
    w = ps.window.get(i, []) if ps.win_at.get(i) == at else []
    return w if x is None else [*w, x]


def _over(ps: PaceState, w: Sequence[float]) -> bool:
    """Whether a paced GPU whose shares since its last change are ``w`` runs on the
    critical path: this period's share clearly over the pace (at least ``NEAR`` and 1
    plus ``CLEAR`` spreads of the readings), or, in this period and the one before, the
    mean of its last periods (one or more) at or over ``NEAR`` and clearly over
    ``TARGET`` (``CLEAR`` spreads of that mean). Noise-free, a share at ``NEAR`` is
    enough; with noise, a reading over the line by chance is not (nor one period's low
    reading of the critical GPU, which lifts every paced GPU's share at once). Until
    the spread is learnt (two periods), only a share ``SLACK`` over the pace counts."""
    if ps.spread_n < 2:  # (the spread not learnt yet: only a share off by a straggler's margin)
        return bool(w) and w[-1] >= (1.0 + SLACK) * ps.room
    if w and w[-1] >= max(NEAR, 1.0 + CLEAR * ps.spread) * ps.room:
        return True
    return len(w) >= 2 and _mean_over(ps, w) and _mean_over(ps, w[:-1])


def _mean_over(ps: PaceState, w: Sequence[float]) -> bool:
    total = 0.0
    for m, x in enumerate(reversed(w), start=1):
        total += x
        if total / m >= max(NEAR, TARGET + CLEAR * ps.spread / math.sqrt(m)) * ps.room:
            return True
    return False


def _observe(ps: PaceState, r: dict[int, float], at: dict[int, int]) -> None:
    """Keep this period's shares (GPU -> its share, ``at``: its grid index) in each GPU's
    window, and learn the readings' spread from the change of each GPU's share since the
    last period at an unchanged setting (the reference GPU, share 1 by its definition,
    aside). A jump (a straggler that came) counts no more than ``4`` spreads (or 2 %)."""
    free = [i for i in r if i not in ps.held] or list(r)
    ref = max(free, key=lambda i: r[i])
    diffs = []
    for i, x in r.items():
        w = _window(ps, i, at[i])
        if w and i != ref:
            diffs.append(x - w[-1])
        ps.window[i], ps.win_at[i] = [*w, x][-WINDOW:], at[i]
    if not diffs:
        return
    cap = max(4.0 * ps.spread, 0.02)
    var = sum(min(abs(d), cap) ** 2 for d in diffs) / len(diffs) / 2.0  # (a difference of two readings)
    ps.spread_n += 1
    a = max(0.05, 1.0 / ps.spread_n)
    ps.spread = math.sqrt((1.0 - a) * ps.spread**2 + a * var)


def straggle_shown(ps: PaceState, views: Sequence[GpuView], was: bool | None = None) -> bool | None:
    """Whether the job's GPUs run at different paces this period (a GPU at the job's
    setting with slack, or a paced GPU that still keeps under the critical pace); None
    where it is not read. A change from one period to the next is a straggler that came
    or healed (or work that moved between the GPUs), not a change of the job's work.
    ``was``: last period's answer; a straggler once shown is gone only when every GPU at
    the job's setting is within ``SLACK / 2`` of the pace (a share near the line does not
    flicker between the two)."""
    busy = _busy(ps, views)
    if busy is None or len(busy) < 2:
        return None
    r = _shares(busy, ps.held)
    if r is None:
        return None
    line = 1.0 - (SLACK / 2 if was else SLACK)
    pending = ps.before if ps.ref is not None else None  # (a GPU the last move took too deep still keeps its straggler)
    return any(
        x < line
        if i not in ps.held
        else not _over(ps, _window(ps, i, ps.held[i], x)) or (pending is not None and pending.get(i) != ps.held[i])
        for i, x in r.items()
    )


@dataclass
class PaceState:
    """One job's pacing: which GPUs are held below the job's setting, the check of the
    last move, and what the moves taught (per GPU: how its step stretches per setting,
    and the shallowest setting found too deep for the present straggler)."""

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
    # GPU -> grid index -> its busy time there over its busy time at the job's setting
    # (learnt from the moves; kept while the job's setting stands, across stragglers)
    stretch: dict[int, dict[int, float]] = field(default_factory=dict)
    floor: dict[int, int] = field(default_factory=dict)  # GPU -> a grid index found too deep (this straggler)
    from_: dict[int, tuple[int, float]] = field(default_factory=dict)  # GPU -> (index, share) before its last move
    jump: dict[int, int] = field(default_factory=dict)  # GPU -> grid notches of its last move
    room: float = 1.0  # the job's allowed step time over the critical GPU's at the job's setting (>= 1)
    window: dict[int, list[float]] = field(default_factory=dict)  # GPU -> its shares since its setting changed
    win_at: dict[int, int] = field(default_factory=dict)  # GPU -> the grid index its window is at
    spread: float = 0.0  # standard deviation of one period's share reading (learnt; 0: noise-free)
    spread_n: int = 0  # periods the spread was learnt from
    gpm_seen: bool = False  # every GPU of the job had SM activity (a period without is not read)
    gpm_missing: int = 0  # periods since, without it on every GPU
    unpaced_tpf: float | None = None  # the job's time per FLOP before its first paced GPU (for ``room``)
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
        """Every held GPU back at the job's setting; what the moves taught is forgotten
        (it is relative to the job's setting and its work)."""
        out = {i: job_setting for i in ps.held}
        if out:
            ps.last_event = f"pacing lifted: {why}"
        ps.held, ps.before, ps.ref, ps.base = {}, None, None, None
        ps.stretch, ps.floor, ps.from_, ps.jump = {}, {}, {}, {}
        ps.unpaced_tpf = None
        return out

    # ---- what the moves taught

    def _learn(self, ps: PaceState, i: int, at: int, share: float) -> None:
        """GPU ``i`` ran at grid index ``at`` with ``share`` of the critical pace: its
        stretch there, from where its last move started."""
        prev = ps.from_.pop(i, None)
        if prev is None or ps.base is None:
            return
        k0, share0 = prev
        s0 = 1.0 if k0 == ps.base else ps.stretch.get(i, {}).get(k0)
        if s0 is None or share0 <= 0.0:
            return
        ps.stretch.setdefault(i, {})[at] = s0 * share / share0

    def _stretch_at(self, ps: PaceState, i: int, k: int, levels: Sequence[float], base: int) -> float:
        """GPU ``i``'s busy time at grid index ``k`` over its time at the job's setting:
        measured, else read between the measured points, else carried on past the
        deepest one along the last two (with nothing measured: a step that stretches as
        ``1 / level``, the most a compute-bound step does on a clock)."""
        pts = {base: 1.0, **ps.stretch.get(i, {})}
        if k in pts:
            return pts[k]

        def x(j: int) -> float:
            return levels[base] / max(levels[j], 1e-9) - 1.0

        xs = sorted((x(j), v) for j, v in pts.items())
        xk = x(k)
        for (xa, va), (xb, vb) in zip(xs, xs[1:], strict=False):
            if xa <= xk <= xb:
                return va + (vb - va) * (xk - xa) / (xb - xa) if xb > xa else vb
        if len(xs) < 2:
            return 1.0 + xk
        (xa, va), (xb, vb) = xs[-2], xs[-1]
        slope = max(0.0, (vb - va) / (xb - xa)) if xb > xa else 1.0
        return vb + slope * (xk - xb)

    def _deeper(self, ps: PaceState, i: int, share: float, levels: Sequence[float], base: int) -> int | None:
        """Where GPU ``i`` (now ``share`` of the critical pace) goes next, if paced already
        or at the job's setting with more than ``SLACK`` to give: the deepest grid
        index predicted to keep it under ``TARGET`` of the pace, above any found too
        deep, at most twice its last move's notches further and never where a step that
        stretches as ``1 / level`` would run over ``WORST`` of the pace; else one notch
        where it has more than ``SLACK`` to give; None: it stays."""
        at = ps.held.get(i, base)
        low = ps.floor.get(i, -1) + 1
        if at - 1 < low or (i not in ps.held and share >= 1.0 - SLACK):
            return None  # (a GPU at the job's setting with no slack: the critical path, or as busy)
        if i in ps.jump:
            low = max(low, at - 2 * ps.jump[i])
        # at worst a step stretches as 1 / level (compute-bound, on a clock): a move too
        # deep for the pace costs the job at most WORST for a period before it steps back
        low = max(low, next((k for k in range(at) if share * levels[at] / max(levels[k], 1e-9) <= WORST), at - 1))
        s_at = self._stretch_at(ps, i, at, levels, base)
        for k in range(low, at):
            if share * self._stretch_at(ps, i, k, levels, base) / s_at <= TARGET * ps.room:
                return k
        return at - 1 if share < 1.0 - SLACK else None

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
        room: float = 1.0,
    ) -> dict[int, Setting]:
        """This period's per-GPU changes (GPU -> setting); {} when nothing moves.
        ``since_s``: when the daemon's measure behind ``live`` started; a new value is a
        new measure even where it already holds more steps than the old one. ``room``:
        how much longer than the critical GPU's step at the job's setting the job may
        step (its bound: a job whose setting runs faster than uncapped leaves room that
        the paced GPUs may take); paced GPUs are paced to it and moves checked against it."""
        ps.room = max(1.0, room)
        if ps.base is not None and ps.base != base:
            return self.release(ps, grid[base], "the job's setting changed")
        ps.base = base
        busy = _busy(ps, views, count=True)
        if busy is None and len(views) >= 2 and ps.gpm_seen:
            return {}  # (some GPU's SM activity not read this period: it holds, for a while)
        if len(views) < 2 or busy is None:
            return self.release(ps, grid[base], "its GPUs' utilisation is not read")
        r = _shares(busy, ps.held)
        if r is None:
            return {}
        _observe(ps, r, {i: ps.held.get(i, base) for i in r})
        # a paced GPU's share is the mean since its setting last changed (one period's is noisy)
        share = {i: sum(ps.window[i]) / len(ps.window[i]) if i in ps.held else x for i, x in r.items()}
        out: dict[int, Setting] = {}
        restarted = since_s is not None and ps.since_s is not None and since_s != ps.since_s
        if live is None or restarted or (ps.seen and live.steps < ps.seen[-1].steps):
            # the daemon's measure started again (after a move): nothing of the old one is
            # a reference for the new one
            ps.seen, ps.fresh, ps.mark = [], True, None
        ps.since_s = since_s
        if live is not None:
            ps.seen = [*ps.seen[-63:], live]
        # ---- paced GPUs now on the critical path
        critical = [i for i in sorted(ps.held) if i in r and _over(ps, ps.window[i])]
        if critical:
            before = ps.before if ps.ref is not None else None
            stepped = [i for i in critical if before is not None and before.get(i, base) != ps.held[i]]
            healed = [i for i in critical if i not in stepped]
            for i in stepped:
                # the last move took it too deep: back to where it kept the pace, and
                # never as deep again while this straggler lasts
                k, back = ps.held[i], (before or {}).get(i, base)
                self._learn(ps, i, k, share[i])
                ps.floor[i] = max(ps.floor.get(i, -1), k)
                ps.jump[i] = 1
                if back == base:
                    del ps.held[i]
                else:
                    ps.held[i] = back
                out[i] = grid[back]
            for i in healed:
                # the straggler healed (or this GPU got more work): the job's setting back
                del ps.held[i]
                out[i] = grid[base]
            if healed:
                ps.floor.clear()  # what was too deep for the old straggler is not for the next
                ps.jump.clear()
                ps.from_.clear()
                ps.before, ps.ref = None, None  # (nothing left to check: the job's pace rules)
                ps.unpaced_tpf = None if not ps.held else ps.unpaced_tpf
            else:
                ps.fresh = False  # the move's check waits for the measure after the step back
            ps.last_event = "pacing: " + "; ".join(
                [
                    *(f"gpu{i} back to {out[i].label} (deeper fell behind the pace)" for i in stepped),
                    *(f"gpu{i} back on the critical path" for i in healed),
                ]
            )
            return out
        # ---- the last move's check: slower by more than the noise undoes it
        if ps.ref is not None:
            if live is None or not ps.fresh or live.steps < self.min_steps:
                return {}  # (until the daemon's measure restarts after the move, it is the old one)
            se = math.hypot(live.se_time(self.noise), ps.ref.se_time(self.noise))
            slower = live.time_per_flop_s / ps.ref.time_per_flop_s - 1.0
            # the room is the job's whole: what earlier moves took of it is not left
            base_tpf = ps.unpaced_tpf or ps.ref.time_per_flop_s
            left = max(0.0, ps.room * base_tpf / ps.ref.time_per_flop_s - 1.0)
            if slower > left + max(UNDO_MIN, self.z * se):
                prev = ps.before or {}
                for i in set(ps.held) | set(prev):
                    out[i] = grid[prev.get(i, base)]
                    if ps.held.get(i, base) != prev.get(i, base):
                        ps.floor[i] = max(ps.floor.get(i, -1), ps.held.get(i, base))
                ps.held = dict(prev)
                ps.from_.clear()
                ps.undos += 1
                ps.wait_until_s = t_s + ps.backoff_s
                ps.last_event = f"pacing undone: the job ran {slower:+.1%} slower; next try in {ps.backoff_s:.0f} s"
                ps.backoff_s = min(BACKOFF_MAX_S, 2 * ps.backoff_s)
                ps.before, ps.ref = None, None
                return out
            for i, at in ps.held.items():
                if i in ps.from_:
                    self._learn(ps, i, at, share[i])
            # kept: the steps since the move are the reference for the next one
            ps.before, ps.ref, ps.mark = None, None, Evidence()
        # ---- GPUs with slack: deeper, to just keep the pace
        # (a paced GPU goes deeper only where its mean share is under the line by more than
        # the noise of that mean: a low reading by chance would take it too deep)
        upper = {
            i: x + (self.z * ps.spread / math.sqrt(len(ps.window[i])) if i in ps.held else 0.0)
            for i, x in share.items()
        }
        deeper = {i: self._deeper(ps, i, upper[i], levels, base) for i in sorted(r)}
        want = {i: k for i, k in deeper.items() if k is not None}
        if live is None or not want:
            ps.mark = None
            return {}
        # The reference: the job's steps since the slack showed (not older ones: a straggler
        # that just came would read as the move's slowdown), at least min_steps of them.
        if ps.mark is None or ps.mark.steps > live.steps:
            ps.mark = live if len(ps.seen) < 2 else ps.seen[-2]
        recent = live.minus(ps.mark) if live.steps > ps.mark.steps else live
        if t_s < ps.wait_until_s or recent.steps < self.min_steps:
            return {}
        before = dict(ps.held)
        if not before:
            ps.unpaced_tpf = recent.time_per_flop_s
        for i, k in want.items():
            at = ps.held.get(i, base)
            ps.from_[i] = (at, share[i])
            ps.jump[i] = at - k
            ps.held[i] = k
            out[i] = grid[k]
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
