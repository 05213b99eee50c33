"""The evidence the ``efficient`` policy keeps per setting (:class:`Evidence`: sums of
a job's steps, FLOPs, time and energy, with their squares for the noise) and the
monotone fit of step times over the settings (:func:`antitonic_fit`); which candidate is best
within the noise (:func:`best_candidate`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .base import JobMeasure

__all__ = ["Evidence", "antitonic_fit", "best_candidate", "n_measured", "open_boundary"]


@dataclass(frozen=True)
class Evidence:
    """Sums over the steps measured at one setting (possibly several visits)."""

    steps: int = 0
    flops: float = 0.0
    time_s: float = 0.0
    energy_j: float = 0.0
    time_sq_s2: float | None = 0.0  # None: unknown (noise assumed)
    energy_sq_j2: float | None = 0.0

    @staticmethod
    def of(m: JobMeasure) -> Evidence:
        return Evidence(m.steps, m.flops, m.time_s, m.energy_j, m.time_sq_s2, m.energy_sq_j2)

    def plus(self, o: Evidence) -> Evidence:
        if self.steps == 0:
            return o
        if o.steps == 0:
            return self

        def add(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else a + b

        return Evidence(
            self.steps + o.steps,
            self.flops + o.flops,
            self.time_s + o.time_s,
            self.energy_j + o.energy_j,
            add(self.time_sq_s2, o.time_sq_s2),
            add(self.energy_sq_j2, o.energy_sq_j2),
        )

    def minus(self, o: Evidence) -> Evidence:
        """The steps of this measure after ``o`` (an earlier part of it): the sums, their
        squares too where both are known."""

        def sub(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else max(0.0, a - b)

        return Evidence(
            self.steps - o.steps,
            self.flops - o.flops,
            self.time_s - o.time_s,
            self.energy_j - o.energy_j,
            sub(self.time_sq_s2, o.time_sq_s2),
            sub(self.energy_sq_j2, o.energy_sq_j2),
        )

    def after(self, earlier: Evidence | None) -> Evidence:
        """These sums less ``earlier``'s, where ``earlier`` is a part of the same measure
        (fewer steps); else these sums as they are."""
        return self if earlier is None or earlier.steps > self.steps else self.minus(earlier)

    def scaled(self, time_k: float, energy_k: float) -> Evidence:
        """The same steps, their times ``time_k`` and energies ``energy_k`` times as long
        and as large (the spread scales with them)."""

        def sq(v: float | None, k: float) -> float | None:
            return None if v is None else v * k * k

        return Evidence(
            self.steps,
            self.flops,
            self.time_s * time_k,
            self.energy_j * energy_k,
            sq(self.time_sq_s2, time_k),
            sq(self.energy_sq_j2, energy_k),
        )

    @property
    def time_per_flop_s(self) -> float:
        return self.time_s / self.flops if self.flops > 0 else math.inf

    @property
    def energy_per_flop_j(self) -> float:
        return self.energy_j / self.flops if self.flops > 0 else math.inf

    @property
    def power_w(self) -> float:
        return self.energy_j / self.time_s if self.time_s > 0 else 0.0

    def _rel_sd(self, total: float, sq: float | None, assumed: float) -> float:
        n = self.steps
        if sq is None or n < 2 or total <= 0:
            return assumed
        mean = total / n
        var = max(0.0, sq / n - mean * mean) * n / (n - 1)
        return math.sqrt(var) / mean

    def se_time(self, assumed: float) -> float:
        """Relative standard error of the mean step time."""
        return self._rel_sd(self.time_s, self.time_sq_s2, assumed) / math.sqrt(max(1, self.steps))

    def se_energy(self, assumed: float) -> float:
        return self._rel_sd(self.energy_j, self.energy_sq_j2, assumed) / math.sqrt(max(1, self.steps))


def antitonic_fit(
    idx: list[int], value: dict[int, float], se: dict[int, float], weight: dict[int, int]
) -> tuple[dict[int, float], dict[int, float]]:
    """The weighted least-squares fit of ``value`` that does not rise with the index
    (pool adjacent violators): time can only fall as the clock or the limit rises,
    so a measurement that breaks this is pooled with its neighbours, not trusted
    alone. Returns the fitted value and its standard error per index."""
    blocks: list[list[Any]] = []  # [sum w, sum w*v, sum (w*se)^2, members]
    for i in sorted(idx):
        w = float(max(1, weight[i]))
        blocks.append([w, w * value[i], (w * se[i]) ** 2, [i]])
        while len(blocks) >= 2 and blocks[-2][1] / blocks[-2][0] < blocks[-1][1] / blocks[-1][0]:
            b = blocks.pop()
            a = blocks[-1]
            a[0] += b[0]
            a[1] += b[1]
            a[2] += b[2]
            a[3] += b[3]
    fit: dict[int, float] = {}
    fit_se: dict[int, float] = {}
    for w, wv, w2, members in blocks:
        for i in members:
            fit[i] = wv / w
            fit_se[i] = math.sqrt(w2) / w
    return fit, fit_se


def n_measured(ev: dict[Any, Evidence]) -> int:
    """How many capped settings (keys with ``uncapped`` false) have steps measured."""
    return sum(1 for s, e in ev.items() if not s.uncapped and e.steps > 0)


def best_candidate(
    candidates: list[int],
    objective: Callable[[int], float],
    tol: Callable[[int, int], float],
    incumbent: int | None,
) -> int:
    """The candidate with the least objective; among those within the noise of it
    (``tol``, relative), the one we hold (hysteresis), else the highest setting (the
    fastest)."""
    least = min(candidates, key=objective)
    close = [i for i in candidates if objective(i) <= objective(least) * (1 + tol(i, least))]
    if incumbent is not None and incumbent in close:
        return incumbent
    return max(close)


def open_boundary(
    measured: list[int], candidates: list[int], floor: int, objective: Callable[[int], float], best: int
) -> int | None:
    """A setting to measure between the lowest one within the bound and the measured one
    below it, where unmeasured settings lie between them and the one below costs less than
    the best (energy still falls across the boundary: a setting between may beat the best,
    though the best is far above, as where the settings above tie); else None."""
    ok_low = min(candidates)
    below = max((i for i in measured if i < ok_low), default=None)
    if below is None or ok_low - below < 2 or objective(below) >= objective(best):
        return None
    mid = (ok_low + below + 1) // 2
    return mid if mid >= floor else None
