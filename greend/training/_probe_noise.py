"""The probes' noise (:mod:`greend.training.probe`): what a judged block's penalty is
judged with. A block's :class:`Verdict` (its penalty and the spread of the lower steps
around it), the :class:`Noise` pooled over the blocks kept (the step-to-step variance,
its correlation from step to step, the blocks' spread beyond it), the error of a sum of
penalties (:func:`mean_se`) and the robust clipping of a block's losses (:func:`clipped`)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from ._lines import mean, residuals

__all__ = ["CLIP", "LAGS", "SPIKE_SHARE", "Noise", "Verdict", "clipped", "factor", "mean_se", "noise_of"]

CLIP = 3.0  # a loss further than this many robust standard deviations from its group's median counts as that far
SPIKE_SHARE = 0.2  # the robust deviation leaves out this share of the lower steps, the furthest out
_Z_SPIKE_SHARE = 1.2816  # a normal variable's distance from its mean exceeds this many deviations in 20 % of draws
LAGS = 3  # the noise's correlation from step to step, up to this many steps apart
_MIN_VAR = 1e-18  # a penalty's variance is at least this (a loss without noise divides by it)
_CHI2_99 = {1: 6.63, 2: 9.21, 3: 11.34, 4: 13.28, 5: 15.09, 6: 16.81}  # chi-squared's 99th percentile by dof


@dataclass
class Verdict:
    """One judged block: its penalty (relative) and the spread it was judged with."""

    seq: int
    start: int
    penalty: float
    rel_var: float  # the lower steps' squared spread around their window means, over the scale squared
    dof: int  # its degrees of freedom
    n_upper: int  # its probe steps judged
    steps: int  # its steps at the level above (the prober's LONG_STEPS where a lean called it)
    lower_term: float  # w1^2/n_before + w2^2/n_after: the lower means' share of the penalty's variance
    shifted: bool
    shared: float  # the covariance with the previous block (a shared lower window), over rel_var
    lags: tuple[float, ...] = ()  # sum of d[t] * d[t + k] (k = 1 ... LAGS) over its lower windows' deviations ...
    ss: float = 0.0  # ... and of d[t] ** 2, over the scale squared: the noise's correlation from step to step
    one_sided: bool = False  # a trial's block judged against the steps before it alone


@dataclass(frozen=True)
class Noise:
    """What the rule judges the blocks' penalties with, pooled over the blocks kept."""

    rel_var: float  # step-to-step variance, relative to each block's scale squared
    rho: tuple[float, ...]  # the noise's correlation k = 1 ... LAGS steps apart
    lower_factor: float  # how much more a lower window's mean varies than if its steps were independent
    between: float = 0.0  # the blocks' penalties' spread beyond all that (a variance; 0 where they agree)

    def var(self, v: Verdict) -> float:
        """The variance of block ``v``'s penalty (never 0: a loss without noise is judged by its
        smallest number; never raises on a loss so large its square overflows)."""
        upper = factor(self.rho, v.n_upper) / v.n_upper  # (a long block's probe steps: more of them in a row)
        var = self.rel_var * (upper + self.lower_factor * v.lower_term) + self.between
        return var if var > _MIN_VAR else _MIN_VAR

    def covar(self, v: Verdict) -> float:
        """Its covariance with the block before it (a window they share)."""
        return self.rel_var * self.lower_factor * v.shared


def clipped(groups: tuple[list[float], ...]) -> list[list[float]]:
    """Each group's losses pulled in to within :data:`CLIP` robust standard deviations of
    the group's median. The deviation is the lower windows' (the first and last groups:
    the probe steps are too few): their distances from their medians at the
    :data:`SPIKE_SHARE` quantile, as a normal spread (so batches rarer than that which lie
    far out are spikes; a kind of batch more common than that, such as an easier source
    that one batch in three comes from, is part of the job's noise and is kept whole)."""
    medians = [statistics.median(g) for g in groups]
    lower = sorted(abs(v - m) for g, m in ((groups[0], medians[0]), (groups[-1], medians[-1])) for v in g)
    reach = CLIP * lower[int((1 - SPIKE_SHARE) * (len(lower) - 1))] / _Z_SPIKE_SHARE
    if reach <= 0:
        return [list(g) for g in groups]
    return [[min(max(v, m - reach), m + reach) for v in g] for g, m in zip(groups, medians, strict=True)]


def noise_of(vs: list[Verdict], window_steps: int, line_from: int) -> Noise:
    """The noise the blocks ``vs`` are judged with. The step-to-step variance, pooled over
    the blocks (relative to each block's scale), and its correlation from one step to the
    next up to :data:`LAGS` apart (batches alike in a row: a data order, a slow drift),
    which a mean of a few steps in a row does not average out: the means' variance grows
    by ``1 + 2 * sum((1 - k/m) * rho_k)`` (m steps; at least 1). Then the spread of the
    blocks' penalties beyond what that explains: blocks that disagree more than their
    windows' noise says meet the data at different points (a data order that repeats, a
    batch far harder than the rest), and their spread is the penalty's true noise, added
    to every block's variance, where it is more than their noise makes likely (the sum of
    their squared distances from the line, each over its variance, over chi-squared's
    99th percentile). Around the line through them, from ``line_from``
    blocks on (a penalty that grows is no disagreement; fewer blocks say too little)."""
    dof = sum(v.dof for v in vs)
    rel_var = sum(v.rel_var * v.dof for v in vs) / dof if dof > 0 else math.inf
    ss = sum(v.ss for v in vs)
    rho = tuple(sum(v.lags[k] for v in vs if len(v.lags) > k) / ss if ss > 0 else 0.0 for k in range(LAGS))
    noise = Noise(rel_var, rho, factor(rho, window_steps))
    n = len(vs)
    if n < line_from or not math.isfinite(rel_var):
        return noise
    p = [v.penalty for v in vs]
    resid = residuals([float(v.start) for v in vs], p)
    if sum(r * r / noise.var(v) for r, v in zip(resid, vs, strict=True)) <= _CHI2_99[n - 2]:
        return noise  # no more spread than their noise makes likely
    spread = sum(r * r for r in resid) / (n - 2)
    between = max(0.0, spread - mean([noise.var(v) for v in vs]))
    return Noise(rel_var, rho, noise.lower_factor, between)


def factor(rho: tuple[float, ...], m: int) -> float:
    """How much more a mean of ``m`` steps in a row varies than if they were independent, the
    noise's correlation ``rho[k - 1]`` at k steps apart: ``1 + 2 * sum((1 - k/m) * rho_k)``, at
    least 1 (consecutive batches alike, as in a data order)."""
    return max(1.0, 1 + 2 * sum((1 - k / m) * rho[k - 1] for k in range(1, min(len(rho), m - 1) + 1)))


def mean_se(vs: list[Verdict], coef: list[float], noise: Noise) -> tuple[float, float]:
    """``sum(coef * penalty)`` over ``vs`` and its standard error: each block's own
    variance (:class:`Noise`), and the covariance of two blocks back to back (they
    share a window)."""
    value = sum(c * v.penalty for c, v in zip(coef, vs, strict=True))
    var = sum(c * c * noise.var(v) for c, v in zip(coef, vs, strict=True))
    for i in range(1, len(vs)):
        if vs[i].shared and vs[i].seq == vs[i - 1].seq + 1:
            var += 2 * coef[i] * coef[i - 1] * noise.covar(vs[i])
    return value, math.sqrt(max(var, 0.0))
