"""Probes: a level below the job's own, judged against the level above at the same steps.

A training loss cannot tell a precision penalty of a few percent from the loss still
falling, from a change in the data or from noise, when it is compared with the loss
*before* a switch. And the same weights evaluated at two levels (the reference check,
:mod:`greend.training.reference`) measure what evaluating at the lower level costs, not
what training there costs: weights trained at bf16 adapt to its rounding.

So, for as long as the run is below a level it came down from, the callback runs short
**probe blocks** at the level above, as real training steps: :data:`PROBE_STEPS` steps
at a time, the first :data:`LEAD_STEPS` of them not judged (their losses are taken
before the steps at the upper level have moved the weights: what evaluating there costs,
and weights trained at the lower level score worse there, which hides part of the
penalty). The first :data:`DENSE_BLOCKS` blocks run back to back from
:data:`SETTLE_STEPS` steps after the switch (each block's lower window after being the
next one's before, or part of it where the drawn gap is under 16 steps), then the gaps
double up to ``probe_every`` steps (400 by default) until the run goes back up
(:func:`block_start`). Every gap is drawn (the same draw on every rank): a data order
that repeats (an epoch of a few dozen batches read in order) would otherwise meet every
block at the same point.

Each block is compared with the :data:`WINDOW_STEPS` steps at the lower level just
before it and just after it (after :data:`SETTLE_STEPS` steps to settle): a falling
trend and a change in the data move both sides alike and cancel in the mean of the two,
noise averages out over blocks. One block gives the **penalty**
``(the lower level's loss at the probe steps - mean of the probe steps) / the former``, the
former from the two sides' means, weighted by how near each side is to the probe steps,
each group's losses first pulled in to :data:`CLIP` robust deviations of its median (a
heavy-tailed loss, a rare batch many times harder than the rest at either level, moves
neither the penalty nor the noise much). Its standard error comes from the job's own
noise (:class:`Noise`): the spread of the lower steps around their window means, pooled
over the blocks; its correlation from step to step (batches alike in a row vary a mean of
a few steps more than independent ones); the covariance of two blocks that share a
window; and the spread of the blocks' penalties beyond all that, where they disagree
more than that noise says (blocks that met the data at different points). So a noisy job
needs more blocks for a verdict and a quiet one fewer. A block whose two sides differ by
more than :data:`SHIFT_Z` standard errors and by :data:`SHIFT_MIN` times the tolerance or
more straddles a move of the data and is left out.

The level is rolled back when, over the last :data:`MIN_BLOCKS` to :data:`KEEP_BLOCKS`
blocks (every suffix is tried, so a penalty that appears late is not diluted by the
early blocks), the mean penalty is over ``tolerance`` by more than :data:`GUARD_Z`
standard errors (surely worse than the tolerance), or it is over ``tolerance`` and more
than :data:`SURE_Z` standard errors over 0 (worse than the tolerance, and surely worse:
a penalty of 1.5 times the tolerance in a job with 5 % step-to-step noise needs some 50
probe steps for the first rule, 8 for the second), or when the penalty grows: over at
least :data:`GROW_BLOCKS` blocks, a line through their penalties rises by :data:`GROW_Z`
standard errors and its value at the latest block is over :data:`GROW_SHARE` of the
tolerance by :data:`GROW_NOW_Z` standard errors. No one block carries a verdict: with
any one block left out, the mean (or the line's value now) must still be over
:data:`LOO_SHARE` of the tolerance (:data:`GROW_SHARE` of it). And from the first sparse
block on (:data:`CONFIRM_FROM`), a verdict stands only when the next block, run at once
at another drawn point, says it again; a block alone over the tolerance by
:data:`SUSPECT_Z` standard errors calls the next block at once too, and that block's
verdict, with the one before among its evidence, stands at once (a penalty that appears
late is looked at again within 50 to 82 steps, not ``probe_every``). Blocks that lean over
the tolerance without saying it (:meth:`Prober._leans`: over the latest
:data:`LEAN_BLOCKS` or more, their mean penalty, each block weighed by its precision, over
:data:`LEAN_SHARE` of the tolerance by :data:`LEAN_Z` standard errors, not surely under
the tolerance, and known to better than the tolerance) call the next block at once too, a
long one (:data:`LONG_STEPS`): in a noisy job one block of 4 judged steps reads a penalty
to +/- 5 points or worse, and blocks ``probe_every`` apart are too few to say that a
penalty growing as the loss converges has passed the tolerance before the harm is done (a
neural field fitting raw pixel values, bf16 rounding its outputs: kept to the end at +5.6
and +13 % held-out over its fp32 twin; now rolled back, the evidence gathered where it may
decide something). Its price: a penalty within the tolerance but near it is rolled back
more often (3 % under 10 % step-to-step noise: 20 of 60 runs of 4,000 steps, 13 before, in
one draw). In a job of several ranks, each with its own share of the data, the ranks
judge each block together, on their mean loss at each step, and take the same decision at
the same step (:mod:`greend.training._probe_ranks`); without a store to meet in each rank
judges its own losses and does not lean (a long block on some ranks only would put the
ranks at two levels in one step). The rollback's reason names the blocks, the penalty
(or its rise per 100 steps), its error and the noise it used. The same rule turned round
(not in a trial) rolls back where the level above runs worse than the lower level on these
weights by :data:`DEPEND_SHARE` times the tolerance: weights trained below have come to
fit its rounding (bf16's of a model's input features, fixed per input), and the harm to
the trajectory is carried in them, where the penalty cannot show it. ``tolerance`` is the
job's ``probe_tolerance``, else the daemon precision policy's (its register reply), else
:data:`TOLERANCE`.

**A trial first.** A step down (``arm(..., trial=True)``) does not run the new level at
once: the run stays at the level above (the job's own steps, as the daemon books them) but
for :data:`TRIAL_BLOCKS` blocks at the new level (sent as probe steps; placed by
:func:`trial_start` at the same step on every rank however late each reads its losses),
each judged the same way turned round (the penalty still the lower level's excess; a
shift only a move beyond the line each side shows: the level the job trained at so far
often still falls fast). A verdict turns the level down after ``TRIAL_BLOCKS *
PROBE_STEPS`` steps at it; else the run goes down at :func:`trial_end` and the probes begin
there. A penalty that shows at once (bf16's rounding of outputs near a loss floor) is so
turned down before it has done its harm; one that builds as it trains is the probes'.

Why soon: the time a harmful level runs is not undone by the rollback (a regression near its
loss floor: 100 / 200 / 400 steps at bf16, then fp32, ended +0.4 / +2.0 / +5.1 % held-out
over its fp32 twin); hence the trial, and the first blocks back to back.

What it costs: the trial, 106 to 138 steps at the upper level each time the run steps
down; the probe steps (20 until the fourth block is judged, 159 to 255 steps after the run
went down, then 5 every 300 to 500 steps, 1.25 % in the long run, 5 more for each verdict
a block confirms, 13 for each lean: 1.7 % in the long run for a harmless job with 10 %
step-to-step noise, 2.1-2.3 % at the most in 60 runs of 10,000 steps, 1.5 % before; 1.5 % as
before with 40 % noise, where a lean decides nothing), ordinary steps of the user's loop
at the upper level, never above the job's own; one integer compare a step outside the windows.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ._lines import fit, line_at, residuals
from ._lines import mean as _mean
from ._probe_noise import CLIP, LAGS, SPIKE_SHARE, Noise, Verdict, clipped, factor, mean_se, noise_of

__all__ = [
    "CLIP",
    "CONFIRM_FROM",
    "DENSE_BLOCKS",
    "DENSE_JITTER",
    "DENSE_EVERY",
    "GROW_BLOCKS",
    "GROW_NOW_Z",
    "GROW_SHARE",
    "GROW_Z",
    "GUARD_Z",
    "KEEP_BLOCKS",
    "LAGS",
    "LEAD_STEPS",
    "LOO_SHARE",
    "MIN_BLOCKS",
    "PROBE_STEPS",
    "SETTLE_STEPS",
    "SHIFT_MIN",
    "SHIFT_Z",
    "SPIKE_SHARE",
    "SUSPECT_Z",
    "SURE_BLOCKS",
    "SURE_Z",
    "TOLERANCE",
    "TRIAL_BLOCKS",
    "WINDOW_STEPS",
    "Noise",
    "Prober",
    "block_start",
    "judged_by",
    "probe_level",
    "probe_tag",
    "trial_end",
    "trial_start",
]

PROBE_STEPS = 5  # steps of one probe block at the level above ...
LEAD_STEPS = 1  # ... the first of them not judged: its loss is taken before any step at the
# level above moved the weights (what evaluating there costs, not what training there costs)
LONG_STEPS = 13  # a block called at once because the blocks lean over the tolerance (LEAN_*) runs this many
WINDOW_STEPS = 16  # lower-level steps compared on either side of a block
SETTLE_STEPS = 12  # lower-level steps after a switch or a block left out (the weights settle
# back; the spike rule ignores the steps from the block's end to its last window step)
DENSE_BLOCKS = 4  # the first blocks after a switch run back to back (their lower windows
DENSE_EVERY = PROBE_STEPS + SETTLE_STEPS + WINDOW_STEPS  # shared where the drawn gap allows); then probe_every
KEEP_BLOCKS = 8  # the blocks the rule looks at: the latest
MIN_BLOCKS = 2  # no verdict on fewer blocks: a first block is confirmed at another point of the data
GUARD_Z = 3.0  # standard errors the penalty must be over the tolerance ...
SURE_Z = 3.0  # ... or, over at least SURE_BLOCKS blocks, over it and this many over 0
SURE_BLOCKS = 2
# Probes this many tolerances *worse* at the level above than below (not in a trial): weights
# trained below fit its rounding (a fixed rounding of the inputs' features), and the harm to
# the trajectory is carried in them, where a penalty cannot show.
DEPEND_SHARE = 2.0
TOLERANCE = 0.05  # the penalty a level may have where neither the job nor the daemon says (the policy's default)
SHIFT_Z = 3.0  # a block whose two sides differ by this many standard errors straddles a shift ...
SHIFT_MIN = 1.0  # ... where they differ by this share of the tolerance or more (a smaller move, such
# as a quiet job's falling trend, biases a block's penalty by half of it at most, and the trend
# cancels in the mean of the two sides)
GROW_BLOCKS = 4  # a penalty that grows: judged over at least this many blocks ...
GROW_Z = 3.5  # ... its rise per step this many standard errors over 0 ...
GROW_SHARE = 0.5  # ... and its value on the line at the latest block over this share of the tolerance ...
GROW_NOW_Z = 2.0  # ... by this many standard errors (a line through noisy blocks swings widely)
LOO_SHARE = GROW_SHARE  # with any one block left out, the mean must still be over this share of the tolerance
TRIAL_BLOCKS = 2  # a step down starts with a trial: this many blocks at the new level among steps at the level above
CONFIRM_FROM = DENSE_BLOCKS  # from this block on, a verdict waits for the next block, run at once ...
LEAN_BLOCKS = 2  # the blocks lean over the tolerance where the mean of the latest this many or more ...
LEAN_Z = 1.0  # ... less this many standard errors ...
LEAN_SHARE = 0.5  # ... is over this share of the tolerance
SUSPECT_Z = 2.0  # ... which also comes at once after a block alone this many standard errors over the tolerance
READ_LAG = 17  # the callback reads losses in batches of 16 while no spike rule holds (+1)
DENSE_JITTER = DENSE_EVERY  # a block back to back comes 0 to this many steps minus 1 later (drawn)
NEVER = sys.maxsize
_SUSPECT = "one block over the tolerance"

# A probe step's record names its level with this suffix (the sender sends it as the
# row's level with "probe": true); a step record's level is otherwise a plain level.
_TAG = ":probe"


def probe_tag(level: str) -> str:
    """The record's level for a probe step run at ``level``."""
    return level + _TAG


def probe_level(tagged: str) -> tuple[str, bool]:
    """(level, is a probe) of a step record's level."""
    if tagged.endswith(_TAG):
        return tagged[: -len(_TAG)], True
    return tagged, False


@dataclass
class _Block:
    seq: int  # the block's number since the switch
    start: int  # the first probe step
    before: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    upper: list[float] = field(default_factory=list)
    after: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    before_from: int = 0  # the first step whose loss it records for its lower window before
    shared: int = 0  # how many of its lower steps before are the previous block's after
    steps: int = PROBE_STEPS  # its steps at the level above (LONG_STEPS: called by a lean)

    @property
    def end(self) -> int:  # one past the last probe step
        return self.start + self.steps

    @property
    def after_from(self) -> int:
        return self.end + SETTLE_STEPS

    @property
    def last(self) -> int:  # the last step the block looks at
        return self.after_from + WINDOW_STEPS - 1


class Prober:
    """Probe blocks below a level the run came down from, and the rule that judges them.

    The callback asks :meth:`level_at` at a step's start while :attr:`watch_from` has
    come (the next block's first window step), and :meth:`record` with each recorded
    step from :attr:`watch_from` on; everything else costs one integer compare."""

    def __init__(self, *, tolerance: float | None, every: int, trials: bool = True, ranks: int = 1) -> None:
        # The job's own tolerance, else the daemon policy's (told at registration), else the default.
        self.given = float(tolerance) if tolerance is not None else None
        # Blocks that lean call a long one at once with one rank, or where the ranks judge the
        # blocks together (``agreed``, set by the caller: they meet in the job's store, :meth:`decide`).
        # Not else: a long block on some ranks only would put the ranks at two levels (fp16
        # through the GradScaler beside fp32: DDP averages scaled and unscaled gradients).
        self.ranks, self.solo, self.agreed = ranks, ranks <= 1, False
        # (agreed) The block judged last, to judge with the other ranks' losses at the start
        # of step decide_at, and whether the next block's place waits for that.
        self.decide_at = NEVER
        self.held: tuple[_Block, bool] | None = None
        self._recent: deque[tuple[int, str, float]] = deque(maxlen=WINDOW_STEPS)  # the next block's window before
        self.policy_tolerance: float | None = None
        self.every = int(every)
        self.upper: str | None = None
        self.lower: str | None = None
        self.anchor = 0  # the first step at the lower level (and the seed of the blocks' jitter)
        self.blocks_done = 0
        self.block: _Block | None = None
        self.watch_from = NEVER  # the first step index record() wants
        self.verdicts: deque[Verdict] = deque(maxlen=KEEP_BLOCKS)
        self.log: deque[dict[str, Any]] = deque(maxlen=256)
        self.probe_steps = 0  # steps run at the upper level for the probes
        self._after_n = 0  # the lower steps after the block judged last (kept), for the covariance ...
        self._after_w = 0.0  # ... and their weight in its penalty
        self.pending: str | None = None  # a verdict waiting for the next block to confirm it
        self.lean = False  # the blocks so far lean over the tolerance: the next one comes at once, long
        self.horizon = 0  # the first step not yet started (the caller's, where it reads losses late)
        # A trial (a step down's first steps): the roles turned round, the run at ``upper``
        # but for blocks at ``lower``, judged the same way; the run goes down once it passes.
        self.trial = False
        self.trials = trials  # whether a step down starts with one (GreenCallback(probe_trial=))
        self.held_from = 0  # a trial passed: the steps from here to the anchor run the level above

    @property
    def tolerance(self) -> float:
        """The penalty the level may have: ``probe_tolerance`` where the job gave one, else
        the daemon policy's (:meth:`PrecisionControl.follow_tolerance`), else :data:`TOLERANCE`."""
        if self.given is not None:
            return self.given
        told = self.policy_tolerance
        return told if told is not None else TOLERANCE

    @property
    def armed(self) -> bool:
        return self.block is not None

    def arm(self, upper: str, lower: str, anchor: int, *, trial: bool = False) -> None:
        """The run is at ``lower`` since step ``anchor``, below ``upper``: probe from now
        (``trial``: a step down just taken: its trial first, then the probes)."""
        self.upper, self.lower, self.anchor = upper, lower, anchor
        self.trial = trial and self.trials
        self.held_from = anchor  # (the steps before the anchor after a trial passed: none here)
        self.blocks_done = 0
        self._after_n = 0
        self.pending = None
        self.lean = False
        self.verdicts.clear()
        self.decide_at, self.held = NEVER, None
        self._next_block(None)

    def disarm(self) -> None:
        self.upper = self.lower = None
        self.trial = False
        self.block = None
        self.watch_from = NEVER
        self.verdicts.clear()
        self.decide_at, self.held = NEVER, None

    def _next_block(self, previous: _Block | None) -> None:
        b = self.blocks_done
        if self.trial and b >= TRIAL_BLOCKS and previous is not None and self.upper and self.lower:
            # The trial passed: the run goes down at trial_end (the same step on every rank,
            # however late each read the last block's losses), and the probes begin there.
            down = max(self.anchor + trial_end(self.every, self.anchor), self.horizon)
            self.arm(self.upper, self.lower, down)
            self.held_from = previous.last + 1  # (until then, the level above, as the job's own steps)
            return
        if self.trial:
            start = self.anchor + trial_start(b, self.every, self.anchor)
        elif previous is None:
            start = block_start(0, self.every, self.anchor) + self.anchor
        elif self.pending is not None or self.lean:
            # At once, after the losses read late in the sparse phase (READ_LAG steps at most)
            start = previous.end - PROBE_STEPS + DENSE_EVERY + READ_LAG + _jitter(self.anchor, b, DENSE_JITTER)
        else:
            gap = block_start(b, self.every, self.anchor) - block_start(b - 1, self.every, self.anchor)
            start = previous.end - PROBE_STEPS + gap  # (a long block's extra steps on top)
        # Never a step that has started already (losses read later than READ_LAG: a rank whose
        # reads lag this much may start the block later than the others).
        start = max(start, self.horizon)
        blk = _Block(b, start, before_from=start - WINDOW_STEPS, steps=LONG_STEPS if self.lean else PROBE_STEPS)
        self.lean = False
        if previous is not None and blk.before_from <= previous.last:
            # Back to back: the previous block's lower window after is (the first part of) this one's before.
            blk.before = [(i, v) for i, v in previous.after if i >= blk.before_from]
            blk.shared = len(blk.before)
            blk.before_from = previous.last + 1
        self.block = blk
        self.watch_from = start - WINDOW_STEPS

    def level_at(self, index: int) -> str | None:
        """The level step ``index`` runs at for a probe (in a trial: every step but the blocks'), or None."""
        blk = self.block
        inside = blk is not None and blk.start <= index < blk.end
        if self.trial:
            return None if inside or blk is None or index < self.anchor else self.upper
        if self.held_from <= index < self.anchor:
            return self.upper  # (a trial passed; the run goes down at the anchor)
        return self.upper if inside else None

    def reported_as_probe(self, index: int, level: str, in_force: str) -> bool:
        """Whether step ``index`` run at ``level`` goes to the daemon as a probe step: a
        block's step at the level above; in a trial, a block's at the new level (its other
        steps are the job's own: the daemon's record of its level moves once it passed)."""
        blk = self.block
        if blk is None:
            return False
        if self.trial:
            return level == in_force and blk.start <= index < blk.end
        return level != in_force and index >= self.anchor and self.level_at(index) == level

    def record(self, index: int, level: str, loss: float | None) -> str | None:
        """A recorded step (``level``: as it ran; ``loss``: None where non-finite or
        not reported). The reason to roll back, or None."""
        blk = self.block
        if self.held is not None and self.held[1]:  # the next block awaits the ranks' verdict
            if loss is not None and math.isfinite(loss):
                self._recent.append((index, level, loss))
            return None
        if blk is None or index < blk.start - WINDOW_STEPS:
            return None
        # The level of the steps around a block, and the block's (turned round in a trial).
        around, inside = (self.upper, self.lower) if self.trial else (self.lower, self.upper)
        if loss is not None and math.isfinite(loss):
            if index < blk.start:
                if level == around and index >= blk.before_from:
                    blk.before.append((index, loss))
            elif index < blk.end:
                if level == inside:
                    self.probe_steps += not self.trial
                    if index >= blk.start + LEAD_STEPS:
                        blk.upper.append(loss)
            elif blk.after_from <= index <= blk.last and level == around:
                blk.after.append((index, loss))
        if index < blk.last:
            return None
        self.blocks_done += 1
        if self.agreed and self.upper is not None:
            # Judged by the job's ranks together, at decide_at, on their mean loss at each step.
            # Where the next block's place depends on the verdict (a block called at once, or a
            # trial that passes), it is placed then.
            waits = blk.seq >= CONFIRM_FROM if not self.trial else blk.seq >= TRIAL_BLOCKS - 1
            self.decide_at, self.held = blk.last + READ_LAG, (blk, waits)
            self._recent.clear()
            if waits:
                self.watch_from = blk.last + 1  # (the steps till then: the next block's window before)
            else:
                self._next_block(blk)  # (its place depends on no verdict)
            return None
        v = self._verdict(blk)
        return self._conclude(blk, self._keep(v), v is not None and not v.shifted, place=True)

    def decide(self, job: _Block | None, ranks: int) -> str | None:
        """At the start of step :attr:`decide_at` on every rank: the block judged last, judged
        on ``job`` (:attr:`held`'s block with the mean of ``ranks`` ranks' losses at each step:
        :func:`greend.training._probe_ranks.pooled`; None: this rank's own). The reason to
        roll back, or None."""
        if self.held is None:
            return None
        # (a block placed now starts at decide_at at the earliest: the same step on every rank)
        (blk, waits), self.horizon, self.held = self.held, max(self.horizon, self.decide_at), None
        self.decide_at = NEVER
        v = self._verdict(job or blk)
        why = self._conclude(blk, self._keep(v), v is not None and not v.shifted, place=waits)
        if why is not None and ranks > 1:
            why += f"; the mean loss of {ranks} ranks"
        if waits and self.block is not None and self.block is not blk and not self.trial:
            blk = self.block  # its window before, from the steps recorded while the verdict was awaited
            blk.before = [(i, x) for i, lv, x in self._recent if lv == self.lower and i >= blk.before_from]
        self._recent.clear()
        return why

    def _keep(self, v: Verdict | None) -> str | None:
        """Keep a block's verdict (not one that straddles a shift) and apply the rule."""
        if v is None or v.shifted:
            return None
        self.verdicts.append(v)
        return self._rule()

    def _conclude(self, blk: _Block, why: str | None, judged: bool, place: bool) -> str | None:
        """What a judged block leads to: from :data:`CONFIRM_FROM` on, a verdict waits for the
        next block to say it again; the next block at once, long where the blocks lean."""
        if blk.seq >= CONFIRM_FROM:
            if why is not None and self.pending is None:
                # A verdict stands once a block at another point of the data, right after, says it again.
                self.pending, why = why, None
            elif why is not None:
                self.pending = None  # it stands
            elif judged:
                # One block far over the tolerance (no verdict alone): the next one comes at
                # once; blocks that lean over it call one at once too, a long one.
                self.pending = _SUSPECT if self._suspect() else None
                self.lean = (self.solo or self.agreed) and self.pending is None and self._leans()
            # (a block left out, shifted or short of losses, says nothing: what waited, waits on)
        if place and self.upper is not None and not (self.trial and why is not None):
            self._next_block(blk)  # (a trial turned down places nothing: its last block would arm the probes)
        return why

    def _verdict(self, blk: _Block) -> Verdict | None:
        """A block's verdict on its losses (None: too few to judge it), logged."""
        half = WINDOW_STEPS // 2
        after = [v for _, v in blk.after]
        if not blk.upper or len(blk.before) < half or len(blk.after) < half:
            self.log.append({"start": blk.start, "level": self.lower, "upper": self.upper, "penalty": None,
                             "why": "too few losses around the block"})  # fmt: skip
            return None
        # Robust: a batch far harder than the rest (a heavy-tailed loss spikes now and then at
        # either level) counts as CLIP robust standard deviations from its group's median, so
        # a spike moves neither the penalty nor the noise the rule judges it with much.
        before, upper, after = clipped(([v for _, v in blk.before], blk.upper, after))
        m1, m2 = _mean(before), _mean(after)
        mu = _mean(upper)
        # The lower level's loss at the probe steps: the two sides' means weighted by how
        # near each side's middle step is to the probe steps' (a falling trend cancels).
        c1, c2 = _mean([float(i) for i, _ in blk.before]), _mean([float(i) for i, _ in blk.after])
        w2 = min(1.0, max(0.0, (blk.start + LEAD_STEPS + (blk.steps - LEAD_STEPS - 1) / 2 - c1) / (c2 - c1)))
        w1 = 1.0 - w2
        lower = w1 * m1 + w2 * m2
        # Relative to the lower level's loss around the block: 2 * WINDOW_STEPS losses, a
        # steadier scale than the few probe steps (a ratio to a noisy mean is skewed).
        scale = max(abs(lower), 1e-12)
        # The noise: each lower window's losses around its own line (a loss still falling
        # within 16 steps is a trend, which the two sides' mean cancels, not noise).
        d1 = residuals([float(t) for t in range(len(before))], before)
        d2 = residuals([float(t) for t in range(len(after))], after)
        ss1 = sum(d * d for d in d1)
        ss2 = sum(d * d for d in d2)
        n1, n2 = len(before), len(after)
        dof = n1 + n2 - 4
        rel_var = (ss1 + ss2) / dof / (scale * scale)
        # (a trial's block runs at the lower level: its excess over the steps around it)
        penalty = (mu - lower) / scale if self.trial else (lower - mu) / scale
        # Each side with its own spread around its mean (a level that moved, a shift, is
        # noisier after it; a trend within the windows widens it, so a trend is no shift).
        se_sides = math.sqrt(
            sum((v - m1) ** 2 for v in before) / (n1 - 1) / n1 + sum((v - m2) ** 2 for v in after) / (n2 - 1) / n2
        )
        move = (m2 - m1) / scale
        jump, one_sided = m2 - m1, False
        if self.trial:
            # A trial's windows run at the level the job trained at until now, a loss often
            # still falling fast (a quiet one near its floor: its windows' spread is tiny): the
            # move beyond the line each window shows (their mean slope over the gap) is the shift.
            x1, x2 = [float(i) for i, _ in blk.before], [float(i) for i, _ in blk.after]
            slope = (fit(x1, before)[2] + fit(x2, after)[2]) / 2
            sxx = sum((x - c1) ** 2 for x in x1) + sum((x - c2) ** 2 for x in x2)
            jump -= slope * (c2 - c1)
            se_sides = math.sqrt(se_sides**2 + ((c2 - c1) / 2) ** 2 * 4 * (ss1 + ss2) / dof / max(sxx, 1.0))
            move = jump / scale
        shifted = abs(jump) > SHIFT_Z * se_sides and abs(move) > SHIFT_MIN * self.tolerance
        if self.trial and shifted and jump > 0:
            # The level above runs higher after a trial's block than before it: what a level
            # that hurts the weights leaves (a move of the data may too): judged against the
            # steps before it alone (their mean: on a falling loss, a penalty read short).
            w1, w2, penalty, shifted, one_sided = 1.0, 0.0, (mu - m1) / scale, False, True
        # A window shared with the previous block: the two penalties hold the same lower
        # steps (the previous block's after, this one's before), each with its weight.
        shared = w1 * self._after_w * blk.shared / (n1 * self._after_n) if blk.shared and self._after_n else 0.0
        self._after_n, self._after_w = n2, w2
        lags = tuple(
            (sum(a * b for a, b in zip(d1, d1[k:])) + sum(a * b for a, b in zip(d2, d2[k:]))) / (scale * scale)
            for k in range(1, LAGS + 1)
        )
        v = Verdict(blk.seq, blk.start, penalty, rel_var, dof, len(upper), blk.steps, w1 * w1 / n1 + w2 * w2 / n2,
                    shifted, shared, lags, (ss1 + ss2) / (scale * scale), one_sided)  # fmt: skip
        self.log.append({"start": blk.start, "level": self.lower, "upper": self.upper, "penalty": penalty,
                         "se": math.sqrt(_noise([v]).var(v)), "move": move, "shifted": shifted,
                         "trial": self.trial, "one_sided": one_sided})  # fmt: skip
        if shifted:  # the data moved across the block: the two sides say different things
            self._after_n = 0  # (left out: the next block covaries with none kept)
        return v

    def _leans(self) -> bool:
        """Whether the blocks lean over the tolerance without saying it: over the latest
        :data:`LEAN_BLOCKS` or more, their mean penalty is over :data:`LEAN_SHARE` of the
        tolerance by :data:`LEAN_Z` standard errors and within that many of it or over it,
        its standard error under the tolerance (where the error puts the penalty surely
        under the tolerance, or the noise is so large that one block more decides nothing,
        more blocks would only cost steps). Each block weighs by its own precision (a long
        block's 12 judged steps against a short one's 4: with equal weights one noisy short
        block kept a chain of long ones reading 0 leaning, 6 to 7 of them)."""
        vs = list(self.verdicts)
        noise = _noise(vs)
        for n in range(LEAN_BLOCKS, len(vs) + 1):
            w = [1.0 / noise.var(v) for v in vs[-n:]]
            sw = sum(w)
            m, se = mean_se(vs[-n:], [x / sw for x in w], noise)
            if m - LEAN_Z * se > LEAN_SHARE * self.tolerance and m + LEAN_Z * se > self.tolerance > se:
                return True
        return False

    def _suspect(self) -> bool:
        """Whether the latest block alone is over the tolerance by :data:`SUSPECT_Z` standard errors."""
        vs = list(self.verdicts)
        if not vs or vs[-1].seq != self.blocks_done - 1:
            return False  # (the latest was left out)
        return vs[-1].penalty - SUSPECT_Z * math.sqrt(_noise(vs).var(vs[-1])) > self.tolerance

    def _rule(self) -> str | None:
        vs = list(self.verdicts)
        noise = _noise(vs)
        tol = self.tolerance
        for n, sign in ((n, s) for n in range(MIN_BLOCKS, len(vs) + 1) for s in (1, -1)):
            tail, line = vs[-n:], tol if sign > 0 else DEPEND_SHARE * tol  # (-1: DEPEND_SHARE)
            if sign < 0 and self.trial:
                continue
            mean, se = mean_se(tail, [1.0 / n] * n, noise)
            m = sign * mean
            clearly = m - GUARD_Z * se > line
            surely = n >= SURE_BLOCKS and m > line and m - SURE_Z * se > 0
            # No one block carries a verdict: with any one left out the mean is still over
            # LOO_SHARE of the line (a block that met the data's easiest batches alone is no penalty).
            held = all(sign * (n * mean - v.penalty) / (n - 1) > LOO_SHARE * line for v in tail)
            if (clearly or surely) and held and sign < 0:
                return (
                    f"probes at {self.upper}: {self.upper} runs {-mean:+.1%} (+/- {se:.1%}) over {self.lower} on "
                    f"these weights at the same point in training, over {_blocks(tail, 'probe')}): trained at "
                    f"{self.lower}, the model came to depend on its rounding by more than {DEPEND_SHARE:g} times the "
                    f"tolerance, a harm carried in the weights {_said(noise, tol)}"
                )
            if (clearly or surely) and held:
                # (a trial's blocks run the lower level, among steps at the level above)
                head, at, around = (
                    (f"trial of {self.lower} among {self.upper} steps", str(self.lower), self.upper)
                    if self.trial
                    else (f"probes at {self.upper}", "probe", self.lower)
                )
                alone = " (or before it alone, where they ran higher after it)" * any(v.one_sided for v in tail)
                return (
                    f"{head}: {self.lower} is {mean:+.1%} (+/- {se:.1%}) over {self.upper} at the same point in "
                    f"training, over {_blocks(tail, at)}), each against the {WINDOW_STEPS} {around} steps on either "
                    f"side{alone} {_said(noise, tol)}"
                )
        return self._growth(vs, noise, tol)

    def _growth(self, vs: list[Verdict], noise: Noise, tol: float) -> str | None:
        """A penalty that grows: a line through the blocks' penalties (weighted by their
        errors) rising by :data:`GROW_Z` standard errors, its value at the latest block
        already :data:`GROW_SHARE` of the tolerance or more."""
        n = len(vs)
        if n < GROW_BLOCKS:
            return None
        w = [1.0 / noise.var(v) for v in vs]
        sw = sum(w)
        x = [float(v.start) for v in vs]
        xm = sum(wi * xi for wi, xi in zip(w, x, strict=True)) / sw
        sxx = sum(wi * (xi - xm) ** 2 for wi, xi in zip(w, x, strict=True))
        if sxx <= 0:
            return None
        slope_c = [wi * (xi - xm) / sxx for wi, xi in zip(w, x, strict=True)]  # slope = sum(c * penalty)
        slope, slope_se = mean_se(vs, slope_c, noise)
        now_c = [wi / sw + (x[-1] - xm) * c for wi, c in zip(w, slope_c, strict=True)]  # the line at the latest
        now, now_se = mean_se(vs, now_c, noise)
        if slope - GROW_Z * slope_se <= 0 or now - GROW_NOW_Z * now_se < GROW_SHARE * tol:
            return None
        # No one block carries it: the line through the others, at the latest block, is
        # still over its share of the tolerance; and the latest two blocks say so too (a
        # line pulled up by blocks in the middle is no penalty now).
        if (vs[-1].penalty + vs[-2].penalty) / 2 <= GROW_SHARE * tol:
            return None
        for i in range(n):
            rest = [(xj, v.penalty) for j, (xj, v) in enumerate(zip(x, vs, strict=True)) if j != i]
            if line_at(rest, x[-1]) <= GROW_SHARE * tol:
                return None
        return (
            f"probes at {self.upper}: {self.lower}'s penalty over {self.upper} grows by {100 * slope:+.1%} per 100 "
            f"steps (+/- {100 * slope_se:.1%}) over {_blocks(vs)}; {vs[0].penalty:+.1%} at the first, "
            f"{vs[-1].penalty:+.1%} at the latest), {now:+.1%} (+/- {now_se:.1%}) now on the line through them "
            f"{_said(noise, tol)}"
        )

    def summary(self) -> dict[str, Any] | None:
        """The blocks judged at the level in force: count, mean penalty and its standard error."""
        vs = list(self.verdicts)
        if not vs:
            return None
        n = len(vs)
        mean, se = mean_se(vs, [1.0 / n] * n, _noise(vs))
        return {"level": self.lower, "upper": self.upper, "blocks": n, "mean_penalty": mean, "se": se}


def _blocks(vs: list[Verdict], at: str = "probe") -> str:
    """Which blocks a reason rests on ("N probe blocks of 5 steps (at steps a, b", left open;
    "of 5 and 13 steps" where a lean called long ones)."""
    sizes = " and ".join(str(n) for n in sorted({v.steps for v in vs}))
    return f"{len(vs)} {at} blocks of {sizes} steps (at steps {', '.join(str(v.start) for v in vs)}"


def _noise(vs: list[Verdict]) -> Noise:
    """The noise blocks ``vs`` are judged with (:func:`greend.training._probe_noise.noise_of`)."""
    return noise_of(vs, WINDOW_STEPS, GROW_BLOCKS)


def _said(noise: Noise, tol: float) -> str:
    """The noise and the tolerance a rollback's reason was judged with."""
    upper = factor(noise.rho, PROBE_STEPS - LEAD_STEPS)  # (a block of PROBE_STEPS's probe steps)
    alike = f", x{upper:.2g} for steps in a row alike" if upper > 1.05 else ""
    spread = f", the blocks' spread beyond it {math.sqrt(noise.between):.1%}" if noise.between > 0 else ""
    return f"(step-to-step noise {math.sqrt(noise.rel_var):.1%}{alike}{spread}; tolerance {tol:.0%})"


def _jitter(seed: int, k: int, span: int) -> int:
    """A number in [0, span) from (seed, k), the same in every process (splitmix64)."""
    if span <= 1:
        return 0
    z = (seed * 0x9E3779B97F4A7C15 + k * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) % span


def block_start(b: int, every: int, seed: int = 0) -> int:
    """The first step of probe block ``b`` (0: the first after the switch), counted from
    the switch: its lower window before starts once the switch has settled; the first
    :data:`DENSE_BLOCKS` run back to back, then the gaps double (a penalty that starts
    small and grows is looked at again soon) up to ``every`` steps. Each gap after the
    first block is drawn from ``seed`` (the switch's step: the same on every rank): a block
    back to back comes 0 to :data:`DENSE_JITTER` - 1 steps later than the previous one's
    windows end, a later gap is 0.75 to 1.25 times its length, so blocks meet a data order
    that repeats (an epoch of a few dozen batches read in order) at different points."""
    start = SETTLE_STEPS + WINDOW_STEPS
    gap = DENSE_EVERY
    for k in range(1, b + 1):
        if k < DENSE_BLOCKS:
            start += DENSE_EVERY + _jitter(seed, k, DENSE_JITTER)
        else:
            gap = max(DENSE_EVERY, min(2 * gap, every))
            start += max(DENSE_EVERY, gap - gap // 4 + _jitter(seed, k, gap // 2))
    return start


def trial_start(b: int, every: int, seed: int = 0) -> int:
    """The first step of a trial's block ``b``, counted from the step down: the first
    after one window at the level above (the run has not moved: nothing to settle), the
    second where the probes' second comes, :data:`READ_LAG` steps later (every rank starts
    it at the same step, however late it reads the first block's losses)."""
    return block_start(b, every, seed) - SETTLE_STEPS + (READ_LAG if b else 0)


def trial_end(every: int, seed: int = 0) -> int:
    """The step, counted from the step down, from which a trial that passed runs the new
    level: :data:`READ_LAG` steps after its last block's windows, the same on every rank."""
    return trial_start(TRIAL_BLOCKS - 1, every, seed) + PROBE_STEPS + SETTLE_STEPS + WINDOW_STEPS + READ_LAG


def judged_by(b: int, every: int, seed: int = 0) -> int:
    """The step (counted from the switch) at which probe block ``b`` is judged."""
    return block_start(b, every, seed) + PROBE_STEPS + SETTLE_STEPS + WINDOW_STEPS - 1
