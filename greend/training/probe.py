"""Probes: a level below the job's own, judged against the level above at the same steps.

A training loss cannot tell a precision penalty of a few percent from the loss still
falling, from a change in the data or from noise, when it is compared with the loss
*before* a switch. And the same weights evaluated at two levels (the reference check,
:mod:`greend.training.reference`) measure what evaluating at the lower level costs, not
what training there costs: weights trained at bf16 adapt to its rounding.

So, for as long as the run is below a level it came down from, the callback runs
short **probe blocks** at the level above, as real training steps: :data:`PROBE_STEPS`
steps at a time, the first :data:`LEAD_STEPS` of them not judged (their losses are
taken before the steps at the upper level have moved the weights: what evaluating there
costs, and weights trained at the lower level score worse there, which hides part of the
penalty). The first :data:`DENSE_BLOCKS` blocks run back to back from
:data:`SETTLE_STEPS` steps after the switch (:data:`DENSE_EVERY` steps apart, each
block's lower window after being the next one's before), then the gaps double up to
``probe_every`` steps (400 by default) until the run goes back up (:func:`block_start`).
Each block is compared with the :data:`WINDOW_STEPS` steps at the lower level just
before it and just after it (after :data:`SETTLE_STEPS` steps to settle): a falling
trend and a change in the data move both sides alike and cancel in the mean of the two,
noise averages out over blocks. One block gives the **penalty**
``(mean of the lower steps around it - mean of the probe steps) / mean of the lower steps``,
with a standard error from the job's own step-to-step noise (the spread of the lower
steps around their window means, pooled over the blocks; two blocks back to back share
a window, and their covariance is counted), so a noisy job needs more blocks for a
verdict and a quiet one fewer. A block whose two sides differ by more than
:data:`SHIFT_Z` standard errors and by :data:`SHIFT_MIN` times the tolerance or more
straddles a move of the data and is left out.

The level is rolled back when, over the last 1 to :data:`KEEP_BLOCKS` blocks (every
suffix is tried, so a penalty that appears late is not diluted by the early blocks),
the mean penalty is over ``tolerance`` by more than :data:`GUARD_Z` standard errors
(surely worse than the tolerance; :data:`ONE_Z` for one block alone), or, over at
least :data:`SURE_BLOCKS` blocks, it is over ``tolerance`` and more than :data:`SURE_Z`
standard errors over 0 (worse than the tolerance, and surely worse: a penalty of 1.5
times the tolerance in a job with 5 % step-to-step noise needs some 50 probe steps for
the first rule, 8 for the second), or when the penalty grows: over at least
:data:`GROW_BLOCKS` blocks, a line through their penalties rises by :data:`GROW_Z`
standard errors and its value at the latest block is over :data:`GROW_SHARE` of the
tolerance by :data:`GROW_NOW_Z` standard errors. The rollback's reason names the blocks,
the penalty (or its rise per 100 steps), its error and the noise it used.
``tolerance`` is the job's ``probe_tolerance``, else the daemon precision policy's (its
register reply), else :data:`TOLERANCE`.

Why soon: the time a harmful level runs is not undone by the rollback. On a regression
near its loss floor with a decaying learning rate, 100 / 200 / 400 steps at bf16 then
fp32 to the end left the held-out loss +0.4 / +2.0 / +5.1 % over the fp32 twin (one
seed; the gap is ~0 right after the rollback and grows as training goes on, carried in
the weights and the optimizer's state alike); hence blocks back to back right after a
switch, and a verdict from the first blocks where the evidence is strong.

What it costs: the probe steps run at the upper level (their energy is not saved: 20
steps in the first 159 after a switch, 30 in the first 357, 35 in the first 621, then 5
every 400 steps, 1.25 % in the long run); nothing else. The judge sees only the steps inside its windows (one
integer compare per step elsewhere), and a probe step is an ordinary step at the upper
level: the user's model, batch and optimizer, never a step above the job's own level.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DENSE_BLOCKS",
    "DENSE_EVERY",
    "GROW_BLOCKS",
    "GROW_NOW_Z",
    "GROW_SHARE",
    "GROW_Z",
    "GUARD_Z",
    "KEEP_BLOCKS",
    "LEAD_STEPS",
    "MIN_BLOCKS",
    "ONE_Z",
    "PROBE_STEPS",
    "SETTLE_STEPS",
    "SHIFT_MIN",
    "SHIFT_Z",
    "SURE_BLOCKS",
    "SURE_Z",
    "TOLERANCE",
    "WINDOW_STEPS",
    "Prober",
    "block_start",
    "judged_by",
    "probe_level",
    "probe_tag",
]

PROBE_STEPS = 5  # steps of one probe block at the level above ...
LEAD_STEPS = 1  # ... the first of them not judged: its loss is taken before any step at the
# level above moved the weights (what evaluating there costs, not what training there costs)
WINDOW_STEPS = 16  # lower-level steps compared on either side of a block
SETTLE_STEPS = 12  # lower-level steps after a switch or a block left out (the weights settle
# back; the spike rule ignores the steps from the block's end to its last window step)
DENSE_BLOCKS = 4  # the first blocks after a switch run back to back, each sharing its lower
DENSE_EVERY = (
    PROBE_STEPS + SETTLE_STEPS + WINDOW_STEPS
)  # window with the next (this many steps apart); then probe_every
KEEP_BLOCKS = 8  # the blocks the rule looks at: the latest
MIN_BLOCKS = 2  # fewer blocks are a verdict only under ONE_Z (a few unlucky probe steps)
GUARD_Z = 3.0  # standard errors the penalty must be over the tolerance ...
SURE_Z = 3.0  # ... or, over at least SURE_BLOCKS blocks, over it and this many over 0
SURE_BLOCKS = 2
ONE_Z = 5.0  # one block alone: a verdict when its penalty is this many standard errors over the tolerance
TOLERANCE = 0.05  # the penalty a level may have where neither the job nor the daemon says (the policy's default)
SHIFT_Z = 3.0  # a block whose two sides differ by this many standard errors straddles a shift ...
SHIFT_MIN = 1.0  # ... where they differ by this share of the tolerance or more (a smaller move, such
# as a quiet job's falling trend, biases a block's penalty by half of it at most, and the trend
# cancels in the mean of the two sides)
GROW_BLOCKS = 4  # a penalty that grows: judged over at least this many blocks ...
GROW_Z = 3.5  # ... its rise per step this many standard errors over 0 ...
GROW_SHARE = 0.5  # ... and its value on the line at the latest block over this share of the tolerance ...
GROW_NOW_Z = 2.0  # ... by this many standard errors (a line through noisy blocks swings widely)
NEVER = sys.maxsize

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
    before: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    after: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    shared: bool = False  # its lower steps before are the previous block's after

    @property
    def end(self) -> int:  # one past the last probe step
        return self.start + PROBE_STEPS

    @property
    def after_from(self) -> int:
        return self.end + SETTLE_STEPS

    @property
    def last(self) -> int:  # the last step the block looks at
        return self.after_from + WINDOW_STEPS - 1


@dataclass
class Verdict:
    """One judged block: its penalty (relative) and the spread it was judged with."""

    seq: int
    start: int
    penalty: float
    rel_var: float  # the lower steps' squared spread around their window means, over the scale squared
    dof: int  # its degrees of freedom
    n_upper: int
    n_lower: int  # per side (the smaller)
    shifted: bool
    shared: bool  # its lower window before is the previous block's after (their penalties covary)


class Prober:
    """Probe blocks below a level the run came down from, and the rule that judges them.

    The callback asks :meth:`level_at` at a step's start while :attr:`watch_from` has
    come (the next block's first window step), and :meth:`record` with each recorded
    step from :attr:`watch_from` on; everything else costs one integer compare."""

    def __init__(self, *, tolerance: float | None, every: int) -> None:
        # The job's own tolerance, else the daemon policy's (told at registration), else the default.
        self.given = float(tolerance) if tolerance is not None else None
        self.policy_tolerance: float | None = None
        self.every = int(every)
        self.upper: str | None = None
        self.lower: str | None = None
        self.anchor = 0  # the first step at the lower level
        self.blocks_done = 0
        self.block: _Block | None = None
        self.watch_from = NEVER  # the first step index record() wants
        self.verdicts: deque[Verdict] = deque(maxlen=KEEP_BLOCKS)
        self.log: deque[dict[str, Any]] = deque(maxlen=256)
        self.probe_steps = 0  # steps run at the upper level for the probes

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

    def arm(self, upper: str, lower: str, anchor: int) -> None:
        """The run is at ``lower`` since step ``anchor``, below ``upper``: probe from now."""
        self.upper, self.lower, self.anchor = upper, lower, anchor
        self.blocks_done = 0
        self.verdicts.clear()
        self._next_block(None)

    def disarm(self) -> None:
        self.upper = self.lower = None
        self.block = None
        self.watch_from = NEVER
        self.verdicts.clear()

    def _next_block(self, previous: _Block | None) -> None:
        b = self.blocks_done
        start = block_start(b, self.every) + self.anchor
        blk = _Block(b, start)
        if previous is not None and start - WINDOW_STEPS <= previous.last:
            # Back to back: the previous block's lower window after is this one's before.
            blk.before = [v for i, v in previous.after if i >= start - WINDOW_STEPS]
            blk.shared = True
        self.block = blk
        self.watch_from = blk.start - WINDOW_STEPS

    def level_at(self, index: int) -> str | None:
        """The level step ``index`` runs at for a probe, or None (the level in force)."""
        blk = self.block
        if blk is not None and blk.start <= index < blk.end:
            return self.upper
        return None

    def record(self, index: int, level: str, loss: float | None) -> str | None:
        """A recorded step (``level``: as it ran; ``loss``: None where non-finite or
        not reported). The reason to roll back, or None."""
        blk = self.block
        if blk is None or index < blk.start - WINDOW_STEPS:
            return None
        if loss is not None and math.isfinite(loss):
            if index < blk.start:
                if level == self.lower and not blk.shared:
                    blk.before.append(loss)
            elif index < blk.end:
                if level == self.upper:
                    self.probe_steps += 1
                    if index >= blk.start + LEAD_STEPS:
                        blk.upper.append(loss)
            elif blk.after_from <= index <= blk.last and level == self.lower:
                blk.after.append((index, loss))
        if index < blk.last:
            return None
        self.blocks_done += 1
        why = self._judge(blk)
        if self.upper is not None:
            self._next_block(blk)
        return why

    def _judge(self, blk: _Block) -> str | None:
        half = WINDOW_STEPS // 2
        after = [v for _, v in blk.after]
        if not blk.upper or len(blk.before) < half or len(after) < half:
            self.log.append({"start": blk.start, "level": self.lower, "upper": self.upper, "penalty": None,
                             "why": "too few losses around the block"})  # fmt: skip
            return None
        m1, m2 = _mean(blk.before), _mean(after)
        mu = _mean(blk.upper)
        # Relative to the lower level's loss around the block: 2 * WINDOW_STEPS losses, a
        # steadier scale than the few probe steps (a ratio to a noisy mean is skewed).
        scale = max(abs(m1 + m2) / 2, 1e-12)
        ss1 = sum((v - m1) ** 2 for v in blk.before)
        ss2 = sum((v - m2) ** 2 for v in after)
        dof = len(blk.before) + len(after) - 2
        rel_var = (ss1 + ss2) / dof / (scale * scale)
        penalty = ((m1 + m2) / 2 - mu) / scale
        # Each side with its own spread: a level that moved (a shift) is noisier after it.
        n1, n2 = len(blk.before), len(after)
        se_sides = math.sqrt(ss1 / (n1 - 1) / n1 + ss2 / (n2 - 1) / n2)
        move = (m2 - m1) / scale
        shifted = abs(m2 - m1) > SHIFT_Z * se_sides and abs(move) > SHIFT_MIN * self.tolerance
        v = Verdict(blk.seq, blk.start, penalty, rel_var, dof, len(blk.upper), min(n1, n2), shifted, blk.shared)
        self.log.append({"start": blk.start, "level": self.lower, "upper": self.upper, "penalty": penalty,
                         "se": math.sqrt(rel_var * (1 / len(blk.upper) + 0.25 / n1 + 0.25 / n2)),
                         "move": move, "shifted": shifted})  # fmt: skip
        if shifted:
            return None  # the data moved across the block: the two sides say different things
        self.verdicts.append(v)
        return self._rule()

    def _rule(self) -> str | None:
        vs = list(self.verdicts)
        # The job's noise, pooled over the blocks kept (relative to each block's scale).
        dof = sum(v.dof for v in vs)
        rel_var = sum(v.rel_var * v.dof for v in vs) / dof if dof > 0 else math.inf
        tol = self.tolerance
        for n in range(1, len(vs) + 1):
            tail = vs[-n:]
            mean, se = _mean_se(tail, [1.0 / n] * n, rel_var)
            clearly = mean - (GUARD_Z if n >= MIN_BLOCKS else ONE_Z) * se > tol
            surely = n >= SURE_BLOCKS and mean > tol and mean - SURE_Z * se > 0
            if clearly or surely:
                return (
                    f"probes at {self.upper}: {self.lower} is {mean:+.1%} (+/- {se:.1%}) over {self.upper} at the "
                    f"same point in training, over {_blocks(tail)}), each against the {WINDOW_STEPS} {self.lower} "
                    f"steps on either side {_noise(rel_var, tol)}"
                )
        return self._growth(vs, rel_var, tol)

    def _growth(self, vs: list[Verdict], rel_var: float, tol: float) -> str | None:
        """A penalty that grows: a line through the blocks' penalties (weighted by their
        errors) rising by :data:`GROW_Z` standard errors, its value at the latest block
        already :data:`GROW_SHARE` of the tolerance or more."""
        n = len(vs)
        if n < GROW_BLOCKS:
            return None
        w = [1.0 / (rel_var * (1 / v.n_upper + 0.5 / v.n_lower)) for v in vs]
        sw = sum(w)
        x = [float(v.start) for v in vs]
        xm = sum(wi * xi for wi, xi in zip(w, x, strict=True)) / sw
        sxx = sum(wi * (xi - xm) ** 2 for wi, xi in zip(w, x, strict=True))
        if sxx <= 0:
            return None
        slope_c = [wi * (xi - xm) / sxx for wi, xi in zip(w, x, strict=True)]  # slope = sum(c * penalty)
        slope, slope_se = _mean_se(vs, slope_c, rel_var)
        now_c = [wi / sw + (x[-1] - xm) * c for wi, c in zip(w, slope_c, strict=True)]  # the line at the latest
        now, now_se = _mean_se(vs, now_c, rel_var)
        if slope - GROW_Z * slope_se <= 0 or now - GROW_NOW_Z * now_se < GROW_SHARE * tol:
            return None
        return (
            f"probes at {self.upper}: {self.lower}'s penalty over {self.upper} grows by {100 * slope:+.1%} per 100 "
            f"steps (+/- {100 * slope_se:.1%}) over {_blocks(vs)}; {vs[0].penalty:+.1%} at the first, "
            f"{vs[-1].penalty:+.1%} at the latest), {now:+.1%} (+/- {now_se:.1%}) now on the line through them "
            f"{_noise(rel_var, tol)}"
        )

    def summary(self) -> dict[str, Any] | None:
        """The blocks judged at the level in force: count, mean penalty and its standard error."""
        vs = list(self.verdicts)
        if not vs:
            return None
        dof = sum(v.dof for v in vs)
        rel_var = sum(v.rel_var * v.dof for v in vs) / dof if dof > 0 else math.nan
        n = len(vs)
        mean, se = _mean_se(vs, [1.0 / n] * n, rel_var)
        return {"level": self.lower, "upper": self.upper, "blocks": n, "mean_penalty": mean, "se": se}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _mean_se(vs: list[Verdict], coef: list[float], rel_var: float) -> tuple[float, float]:
    """``sum(coef * penalty)`` over ``vs`` and its standard error: each block's own
    variance, and the covariance of two blocks back to back (they share a window)."""
    value = sum(c * v.penalty for c, v in zip(coef, vs, strict=True))
    var = sum(c * c * rel_var * (1 / v.n_upper + 0.5 / v.n_lower) for c, v in zip(coef, vs, strict=True))
    for i in range(1, len(vs)):
        if vs[i].shared and vs[i].seq == vs[i - 1].seq + 1:
            var += 2 * coef[i] * coef[i - 1] * rel_var * 0.25 / vs[i].n_lower
    return value, math.sqrt(max(var, 0.0))


def _blocks(vs: list[Verdict]) -> str:
    """Which blocks a rollback's reason rests on ("N probe blocks of 5 steps (at steps
    a, b", its parenthesis left open for the caller to go on or close)."""
    return f"{len(vs)} probe blocks of {PROBE_STEPS} steps (at steps {', '.join(str(v.start) for v in vs)}"


def _noise(rel_var: float, tol: float) -> str:
    """The noise and the tolerance a rollback's reason was judged with."""
    return f"(step-to-step noise {math.sqrt(rel_var):.1%}; tolerance {tol:.0%})"


def block_start(b: int, every: int) -> int:
    """The first step of probe block ``b`` (0: the first after the switch), counted from
    the switch: its lower window before starts once the switch has settled; the first
    :data:`DENSE_BLOCKS` run back to back, then the gaps double (a penalty that starts
    small and grows is looked at again soon) up to ``every`` steps."""
    start = SETTLE_STEPS + WINDOW_STEPS + DENSE_EVERY * min(b, DENSE_BLOCKS - 1)
    gap = DENSE_EVERY
    for _ in range(DENSE_BLOCKS, b + 1):
        gap = max(DENSE_EVERY, min(2 * gap, every))
        start += gap
    return start


def judged_by(b: int, every: int) -> int:
    """The step (counted from the switch) at which probe block ``b`` is judged."""
    return block_start(b, every) + PROBE_STEPS + SETTLE_STEPS + WINDOW_STEPS - 1
