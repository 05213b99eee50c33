"""The reference check: after a downgrade, the loss of a fixed batch at the level in
force against fp32 (or the job's own level, where that is below fp32: a bf16 job at fp8
is judged against bf16), on the same weights, for the rest of the run.

A training loss cannot tell a precision penalty of a few percent from the loss still
falling, or from a shift in the data: every batch is different, and the loss moves for
reasons of its own. A fixed batch evaluated twice on the same weights, once in fp32 and
once at the level in force, differs only by the precision. So, with
``GreenCallback(reference_loss=...)`` (a function of no arguments that returns the loss
of a batch the caller keeps aside), every ``reference_every`` steps while the run is
below a level it came down from, the callback evaluates it both ways (``torch.no_grad``,
the model in eval mode, restored after) and books the **excess**
``(loss at the level - loss in fp32) / loss in fp32``.

The excess of one check moves with the weights: the rounding of a given set of weights
may help or hurt a given batch by a few percent either way. So the rule is statistical,
over the last :data:`KEEP` checks at the level: the level is rolled back when their mean
excess is over ``tolerance`` and also at least :data:`GUARD_Z` standard errors above 0
(surely worse, not just unlucky), after at least :data:`MIN_CHECKS` checks. A non-finite
loss at the level where fp32's is finite rolls back at once. The checks go on for as
long as the level is in force. They compare the same weights at two levels: what
evaluating at the lower level costs, not what training there costs (weights trained at
bf16 adapt to its rounding), so a penalty to the trajectory, such as one that grows as the
model converges toward a loss floor, is the probes' to find
(:mod:`greend.training.probe`: the level against the level above at the same point in
training).

What it costs: two forward passes of the reference batch every ``reference_every``
steps, read without a stream synchronisation (the values are judged once they have
landed, like the step losses).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GUARD_Z", "KEEP", "MIN_CHECKS", "REFERENCE_TOLERANCE", "ReferenceJudge", "excess"]

KEEP = 8  # the checks the rule looks at: the latest, so a penalty that grows shows
MIN_CHECKS = 3
REFERENCE_TOLERANCE = 0.02  # the default: at most this, else the daemon's tolerance when lower
GUARD_Z = 2.0


def excess(fp32: float, loss: float) -> float:
    """How much worse (relative) the level's loss is than fp32's on the same batch."""
    return (loss - fp32) / max(abs(fp32), 1e-12)


@dataclass
class ReferenceJudge:
    """Books the reference checks of one level and says when it must go."""

    tolerance: float = REFERENCE_TOLERANCE
    level: str | None = None
    # The level the upper pass ran at ("fp32" in the entries' key): the job's own where
    # that is below fp32 (PrecisionControl.reference_level).
    against: str = "fp32"
    excess: deque[float] = field(default_factory=lambda: deque(maxlen=KEEP))
    log: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=256))

    def judge(self, step: int, level: str, fp32: float, loss: float) -> str | None:
        """Book one check made at ``step`` running ``level``; the reason to roll back, or None."""
        if level != self.level:
            self.level = level
            self.excess.clear()
        entry: dict[str, Any] = {
            "step": step, "level": level, "fp32": fp32, "against": self.against, "loss": loss, "excess": None,
        }  # fmt: skip
        self.log.append(entry)
        if not math.isfinite(fp32):
            return None  # nothing to compare with (the model itself diverged: not precision's doing)
        if not math.isfinite(loss):
            return f"the reference batch's loss is {loss} at {level} and {fp32:.6g} at {self.against}"
        x = excess(fp32, loss)
        entry["excess"] = x
        self.excess.append(x)
        n = len(self.excess)
        if n < MIN_CHECKS:
            return None
        mean = sum(self.excess) / n
        se = math.sqrt(sum((v - mean) ** 2 for v in self.excess) / (n - 1) / n)
        if mean > self.tolerance and mean - GUARD_Z * se > 0:
            return (
                f"on the reference batch {level} is {mean:+.1%} (+/- {se:.1%}) over {self.against} "
                "on the same weights, "
                f"mean of the last {n} checks (tolerance {self.tolerance:.0%})"
            )
        return None

    def summary(self) -> dict[str, Any] | None:
        """The checks of the level in force: count, mean excess and its standard error."""
        n = len(self.excess)
        if n == 0:
            return None
        mean = sum(self.excess) / n
        se = math.sqrt(sum((v - mean) ** 2 for v in self.excess) / (n - 1) / n) if n > 1 else math.nan
        return {"level": self.level, "checks": n, "mean_excess": mean, "se": se}
