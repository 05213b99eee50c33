"""Power limits between two grid levels, where the slowdown bound falls between them.

The ``efficient`` policy searches the power limit on a grid (every ``power_step_w``,
25 W by default). When the bound falls between two neighbouring levels, the lower one
is over the bound (or too close to it to call under the step noise) and the policy
settles on the upper one (or higher still, where that one saves little), which can
cost several percent more energy than a limit just above the bound: on a measured A40
ResNet-50 profile, 200 W runs 0.11 % under a 5 % bound and 225 W costs 9.6 % more
energy per step; at 2 % step noise no run of a few hundred steps tells 200 W from
"over".

A power limit is a continuous knob (NVML takes milliwatts), so once the job has
settled and its baseline has been re-checked, a *second look* tries limits between the
highest level below the setting held that would save over :data:`GAIN_LONG` more
energy (the *prize*) and the lowest level above it within the bound
(:meth:`greend.policies.efficient.EfficientPolicy._plan`; :func:`may_look` says when):

- the baseline is first measured up to :data:`BASE_LONG` times ``baseline_steps``
  (every ratio leans on it), a prize that may be within the bound :data:`LONG` times
  ``max_steps``, judged by :data:`Z_LONG`; one its steps read within the bound but not by
  that margin is measured as long again and judged again, once (``JobSearch.again_w``;
  a grid level measured on beyond that for a line's sake is within the bound only by
  :data:`Z_LINE_END`); the bracket's
  lower end is measured up to :data:`LINE_LONG` times ``max_steps``, and the grid
  level that would start a line longer where that would let it
  (:meth:`Lines.next_try`);
- :func:`finer_limit` proposes the lowest whole-watt limit between the two that the
  straight line through them predicts to run under the bound by a margin its own
  measurement can confirm, or that the line already vouches for by its own margin;
- the try is measured like any other setting and is within the bound where its own
  steps say so, or where the line through the two grid levels around it does
  (:meth:`Lines.vouched`) and its own steps do not say it is over; one that failed its
  test by less than :data:`Z_LONG` standard errors is measured on and judged again; if it
  is over, it becomes the lower end of the next try; at most :data:`MAX_FINE` tries, one
  look a search, and no new measurement once the look has run :data:`LOOK_STEPS` times
  ``max_steps``.

Real time-versus-limit curves are mostly convex (time rises faster the lower the
limit), so the straight line over-estimates the time between two measured levels: the
error is on the safe side. A line carries the errors of its two ends and of the
baseline (:meth:`Bracket.chord`); it starts only at a grid level within the bound by
:data:`Z_LINE_END` standard errors, never at a try, since a level that passed its test
on a lucky reading would lend the line its luck (:meth:`Lines.between`); and it is
dropped once a try it vouched for runs over the bound by its own steps (the curve is not
convex there).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ._evidence import Evidence
from ._pacing import PaceState
from .base import Setting
from .efficient_state import JobSearch

__all__ = [
    "BASE_LONG",
    "GAIN_LONG",
    "LINE_LONG",
    "LOOK_STEPS",
    "GAIN_MIN",
    "LONG",
    "MAX_FINE",
    "PLATEAU",
    "Z",
    "Z_LINE_END",
    "Z_LONG",
    "Bracket",
    "Lines",
    "finer_limit",
    "may_look",
]

GAIN_MIN = 0.005  # a finer limit is tried only where it is predicted to save this much energy
MAX_FINE = 3  # finer limits tried per search
MIN_STEP_W = 1.0  # nearer than this to a measured level: not worth a try
GAIN_LONG = 0.02  # a setting still unsure after max_steps that would save this much more energy...
LONG = 4  # ...is measured up to this many times max_steps (so is a try)
# In a second look the baseline's error enters every ratio whole and the line's low end's
# most of the line's near it: measured about in proportion to those weights' roots.
BASE_LONG = 8  # the baseline is measured up to this many times baseline_steps
LINE_LONG = 6  # the lower end of the line is measured up to this many times max_steps
LOOK_STEPS = 20  # a look starts no new measurement after this many times max_steps of the job's steps
PLATEAU = 1.1  # a limit over the bound by less than this factor may sit in a zig-zag: look below it
Z = 1.64  # one-sided 95 %: standard errors of margin for feasibility and energy comparisons (all the search)
Z_LONG = 2.6  # one-sided 99.5 %: a setting measured beyond max_steps is judged by this many standard errors
Z_LINE_END = 2 * Z_LONG  # a line vouches for a try only from a level this many standard errors within the bound


@dataclass(frozen=True)
class Bracket:
    """Two measured neighbouring power limits: one within the bound (``hi``) and the
    one below it that is over the bound or unsure (``lo``); their time ratios to the
    uncapped baseline and their energy per FLOP; the standard errors of the two ratios
    (their own steps' part: ``hi_se`` is 0 where ``hi`` is the baseline itself) and of
    the baseline (relative)."""

    hi_w: float
    lo_w: float
    hi_ratio: float
    lo_ratio: float
    hi_energy: float
    lo_energy: float
    hi_se: float = 0.0
    lo_se: float = 0.0
    base_se: float = 0.0
    hi_is_base: bool = False

    def chord(self, w: float) -> tuple[float, float]:
        """The time ratio at ``w`` on the straight line through the two, and its
        standard error: the two levels' own errors weighted by the distance, and the
        baseline's, which every ratio shares."""
        t = (self.hi_w - w) / (self.hi_w - self.lo_w)  # 0 at hi, 1 at lo
        ratio = self.hi_ratio + t * (self.lo_ratio - self.hi_ratio)
        on_base = t * self.lo_ratio + (0.0 if self.hi_is_base else (1.0 - t) * self.hi_ratio)
        return ratio, math.sqrt((t * self.lo_se) ** 2 + ((1 - t) * self.hi_se) ** 2 + (on_base * self.base_se) ** 2)

    def vouches(self, w: float, allowed: float, z: float) -> bool:
        """Whether the line puts ``w`` (between the two) within ``allowed`` by ``z`` of
        its standard errors."""
        if not self.lo_w < w < self.hi_w:
            return False
        ratio, se = self.chord(w)
        return ratio + z * se <= allowed


def finer_limit(
    b: Bracket, allowed: float, se_new: float, z: float, best: float | None = None, line: Bracket | None = None
) -> float | None:
    """The lowest whole-watt limit between ``b.lo_w`` and ``b.hi_w`` that the line
    through the two predicts to run within ``allowed`` (a time ratio) by ``z``
    standard errors of the new limit's own measurement (``se_new``, as a time ratio),
    so that the measurement can confirm it; None where that limit is not predicted to
    save :data:`GAIN_MIN` of ``best`` (the best setting's energy; ``b.hi_energy`` by
    default); ``line``: a line that vouches for a limit by its own standard error
    (:meth:`Bracket.vouches`) at ``z``. A prediction that was wrong costs only the
    measurement: the limit is judged on what it measures."""
    best = b.hi_energy if best is None else best
    if b.lo_w >= b.hi_w - 2 * MIN_STEP_W or b.lo_energy >= best * (1.0 - GAIN_MIN):
        return None
    if b.lo_ratio <= b.hi_ratio:
        return None  # the lower level is not slower: nothing to interpolate
    found = False
    # From the lower level up, the first whole watt whose prediction leaves the margin:
    # that of the limit's own measurement, or the one ``line`` (a line that may vouch
    # for a try: Lines.between) already puts it within by its own.
    w = math.ceil(b.lo_w + MIN_STEP_W)
    while w <= b.hi_w - MIN_STEP_W:
        if b.chord(w)[0] + z * se_new <= allowed or (line is not None and line.vouches(w, allowed, z)):
            found = True
            break
        w += 1
    if not found:
        return None
    t = (b.hi_w - w) / (b.hi_w - b.lo_w)
    if b.hi_energy + t * (b.lo_energy - b.hi_energy) > best * (1.0 - GAIN_MIN):
        return None
    return float(w)


@dataclass(frozen=True)
class Lines:
    """What one plan of the search knows that lines are drawn from: the measured grid
    indices' evidence, their time ratios to the baseline with their standard errors
    (the baseline's included), the baseline's relative error, the allowed ratio, the
    policy's assumed noise and its grid step; and what a second look does with them."""

    seen: dict[int, Evidence]
    ratio: dict[int, float]
    ratio_se: dict[int, float]
    base_se: float
    allowed: float
    noise: float
    step_w: float

    def bracket(self, job: JobSearch, hi: int, lo: int, hi_energy: float = 0.0, lo_energy: float = 0.0) -> Bracket:
        """Two measured indices of the job's grid as a :class:`Bracket`."""
        top = len(job.grid) - 1

        def own(i: int) -> float:  # a ratio's error from its own steps (the baseline's apart)
            return 0.0 if i == top else self.seen[i].se_time(self.noise) * self.ratio[i]

        lv, r = job.levels, self.ratio
        return Bracket(lv[hi], lv[lo], r[hi], r[lo], hi_energy, lo_energy, own(hi), own(lo), self.base_se, hi == top)

    def again(self, job: JobSearch, i: int, n: int) -> bool:
        """Whether a second look's prize (grid index ``i``), not within the bound by
        :data:`Z_LONG` standard errors once measured ``n`` steps (``LONG * max_steps``), is
        measured on to ``2 * n`` and judged again: where its steps read it within the
        bound, once a search (``JobSearch.again_w``), never a level measured on for a
        line's sake (:data:`LINE_LONG`). A dip of a zig-zag curve a few tenths of a percent
        under the bound (A40 ResNet-18 on 4 GPUs: 125 W at 1.092x under 10 %, 6 % less
        energy than the next level within it) is otherwise lost on one unlucky reading.
        Its price: two judgements at Z_LONG pass a level exactly at the bound about 0.8 %
        of the time where one passes it 0.47 % (a Monte Carlo estimate); measured on the A40
        profiles at 1 % noise, 6 bound runs of 360 with a settled step over the bound where
        5 were, each 0.05 % over it (BERT's 225 W). At 3.0 the dip above is lost again."""
        w, steps = job.levels[i], self.seen[i].steps
        again = w in job.again_w
        if not n <= steps < (2 * n if again else LINE_LONG * n // LONG):
            return False
        if not again and self.ratio[i] > self.allowed:
            return False
        job.again_w += () if again else (w,)
        return True

    def between(self, job: JobSearch, below: int, above: int) -> Bracket | None:
        """The line that may vouch for a limit a second look puts between grid indices
        ``below`` and ``above``: through the measured grid levels either side, one grid
        step apart, the upper one within the bound by :data:`Z_LINE_END` standard errors
        of its own (not just by the margin it was chosen on: a level that passed on a
        lucky reading would lend the line its luck; on a V100 ResNet-50 profile a line
        from 200 W, 0.12 % under the bound, held 198 W, 0.2 % over it). A try is never
        an end of a line, for the same reason. None where there is no such line, or
        where a try the line vouched for is over the bound by its own steps (the curve is
        not convex there: the simulated H100's, between 575 and 600 W)."""
        if job.knob != "power":
            return None
        lv = job.levels
        grid = [k for k in self.seen if lv[k] not in job.fine_w]
        a = max((k for k in grid if k <= below), default=None)
        b = min((k for k in grid if k >= above), default=None)
        if a is None or b is None or a >= b or lv[b] - lv[a] > self.step_w + 1e-6:
            return None
        if b != len(job.grid) - 1 and self.ratio[b] + Z_LINE_END * self.ratio_se[b] > self.allowed:
            return None
        line = self.bracket(job, b, a)
        for k in range(a + 1, b):  # a try the line vouched for that its own steps put over: not convex here
            if k in self.seen and line.vouches(lv[k], self.allowed, Z_LONG) and self._over(k):
                return None
        return line

    def _over(self, i: int) -> bool:
        """Over the bound by its own steps (and the baseline's)."""
        return self.ratio[i] - Z * self.ratio_se[i] > self.allowed

    def wants(self, job: JobSearch, below: int, above: int, steps: int) -> int | None:
        """The grid level at or above ``above`` (a second look's bracket's upper end,
        where that is a grid level) that would start a line
        (:meth:`between`) once measured ``steps`` steps, where it is not yet within the
        bound by enough of its own standard errors; None where there is none to measure."""
        lv = job.levels
        b = min((k for k in self.seen if k >= above and lv[k] not in job.fine_w), default=None)
        if job.knob != "power" or b is None or b == len(job.grid) - 1 or self.seen[b].steps >= steps:
            return None
        r, own = self.ratio[b], self.ratio_se[b] / self.ratio[b]  # relative, the baseline's included
        here = math.sqrt(max(0.0, own * own - self.base_se * self.base_se))
        then = math.hypot(here * math.sqrt(self.seen[b].steps / steps), self.base_se) * r
        if r + Z_LINE_END * self.ratio_se[b] <= self.allowed or r + Z_LINE_END * then > self.allowed:
            return None
        return b

    def vouched(self, job: JobSearch, i: int) -> bool:
        """Whether a try of a second look (grid index ``i``) is within the bound by the
        line through the grid levels either side (:meth:`between`; real curves are
        convex, so the line runs above them), and its own steps do not say it is over."""
        if job.levels[i] not in job.fine_w:
            return False
        line = self.between(job, i - 1, i + 1)
        return line is not None and line.vouches(job.levels[i], self.allowed, Z_LONG) and not self._over(i)

    def next_try(
        self, job: JobSearch, hi: int, best: int, steps: int, objective: Callable[[int], float]
    ) -> tuple[int, int] | None:
        """A second look's next measurement in the bracket under grid index ``hi`` (a
        level within the bound, the one below it not): (grid index, steps), or None where
        there is nothing more to try. First the lower end, where a line's error mostly
        is, measured up to :data:`LINE_LONG` times ``steps / LONG`` where it may be within
        the bound (a try that failed its test by less than :data:`Z_LONG` standard
        errors is measured on and judged again at the end); then the grid level that would start a line (:meth:`wants`);
        then a try (:meth:`try_finer`), measured ``steps``. Nothing where the lower end
        would not save :data:`GAIN_MIN` over the best setting (no limit between can)."""
        lo = hi - 1
        if objective(lo) >= objective(best) * (1.0 - GAIN_MIN):
            return None
        m = LINE_LONG * steps // LONG
        near = self.ratio[lo] <= self.allowed + Z_LONG * self.ratio_se[lo]
        if near and self.seen[lo].steps < m:
            return lo, m
        up = self.wants(job, lo, hi, steps)
        if up is not None:
            return up, steps
        se_new = math.hypot(self.seen[hi].se_time(self.noise) * math.sqrt(self.seen[hi].steps / steps), self.base_se)
        if self.try_finer(job, hi, lo, se_new, (objective(hi), objective(lo), objective(best))):
            return hi, steps
        return None

    def try_finer(self, job: JobSearch, hi: int, lo: int, se_new: float, energy: tuple[float, float, float]) -> bool:
        """Put a finer limit between grid indices ``lo`` and ``hi`` into the job's grid,
        where it then sits at index ``hi``: :func:`finer_limit` on the two, with the line
        that may vouch for it (:meth:`between`). ``se_new``: the relative standard error
        the try's own measurement will have; ``energy``: the objective at ``hi``, at
        ``lo`` and at the best setting. False where there is none to try."""
        b = self.bracket(job, hi, lo, energy[0], energy[1])
        w = finer_limit(b, self.allowed, se_new * self.allowed, Z_LONG, energy[2], self.between(job, lo, hi))
        if w is None:
            return False
        job.grid = job.grid[:hi] + (Setting(power_limit_w=w),) + job.grid[hi:]
        job.levels = job.levels[:hi] + (w,) + job.levels[hi:]
        job.fine += 1
        job.fine_w += (w,)
        job.pace = PaceState()  # what the pacer learnt is kept by grid index (no GPU is paced now)
        return True


def may_look(job: JobSearch, best: int) -> bool:
    """Whether the search may take a second look below ``best``: power knob (the clock
    knob's grid is the GPU's own clocks, and on the simulated H100 its second look cost
    more run energy than it won), settled there, with the baseline re-checked (so it is
    precise; uncapped, the baseline grows on its own), no GPU paced (the grid may
    grow, and the pacing holds grid indices), and no look of this search has ended with
    nothing more to try (a line that grows precise as the settled steps add up would
    otherwise start looks at any time in a long job, each a baseline re-check and a try
    for a fraction of a percent)."""
    checked = job.rechecked_once or best == len(job.grid) - 1
    settled = job.phase == "settled" and job.settled_index == best
    return job.knob == "power" and settled and checked and not job.pace.held and not job.looked
