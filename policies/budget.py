"""``budget``: hold the node (GPUs + CPU) under a power budget with GPU power limits.

The watts go where they buy the most FLOP/s. How:

* **Budget for the GPUs**: ``node_budget_w * (1 - margin) - cpu_power_w`` (the
  CPU is measured, not capped, here).
* **What each GPU's watts buy**: each time a GPU's job has run ``min_steps``
  steps at a limit, the policy notes the point (power drawn, FLOP/s per GPU).
  Between two points the slope is the marginal FLOP/s per W; beyond the last,
  the last slope; with a single point, a prior of half the average FLOP/s per
  W (FLOP/s grows slower than power under DVFS). A GPU that draws clearly less
  than its limit shows its *demand*: more watts buy it nothing.
* **Water-filling**: every GPU starts at its minimum limit (an idle GPU stays
  there); GPUs with no evidence yet get an equal share; the rest of the
  budget goes in small chunks to the GPU whose next watt buys the most FLOP/s,
  up to its demand. Watts left when every GPU has what it can use raise the
  limits back towards default (a limit at default is "uncapped").
* **Fairness** (``fair_share``, default 0): before water-filling, every GPU
  with a job gets that fraction of an equal share of the watts above the
  minimum limits (up to its demand), so a memory-bound job is not starved to
  the minimum limit when the watts buy more elsewhere.
* **Stability**: a new allocation is applied only when every GPU's job has
  fresh evidence at the limit in force, and a limit moves by at least
  ``hysteresis_w`` (at most ``max_move_w`` per decision when raising); when the
  node is over budget the policy cuts at once, without waiting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .base import Decision, GpuView, Setting, Snapshot
from .params import Param, validate_params

__all__ = ["BudgetPolicy", "BudgetState"]

CHUNK_W = 5.0
PRIOR_ELASTICITY = 0.5
UNCONSTRAINED_GAP_W = 15.0  # drawing this far below the limit: not limited by it


@dataclass
class _GpuCurve:
    points: dict[int, tuple[float, float]] = field(default_factory=dict)  # limit W -> (power W, FLOP/s)
    demand_w: float | None = None  # what it draws when not limited

    def marginal(self, at_w: float) -> float:
        """FLOP/s per W of the next watt at ``at_w``."""
        if self.demand_w is not None and at_w >= self.demand_w:
            return 0.0
        pts = sorted(set(self.points.values()))
        if not pts:
            return math.nan
        if len(pts) == 1 or pts[-1][0] - pts[0][0] < 1.0:
            p, fps = pts[-1]
            return PRIOR_ELASTICITY * fps / max(p, 1.0)
        segs = [(a, b) for a, b in zip(pts, pts[1:]) if b[0] - a[0] >= 1.0]
        if not segs:
            p, fps = pts[-1]
            return PRIOR_ELASTICITY * fps / max(p, 1.0)
        chosen = segs[-1] if at_w >= segs[-1][1][0] else segs[0]
        for a, b in segs:
            if a[0] <= at_w < b[0]:
                chosen = (a, b)
                break
        (pa, fa), (pb, fb) = chosen
        return max(0.0, (fb - fa) / (pb - pa))


@dataclass
class BudgetState:
    curves: dict[int, _GpuCurve] = field(default_factory=dict)
    jobs_seen: dict[int, str] = field(default_factory=dict)  # gpu -> job whose curve it is
    last_alloc: dict[int, float] = field(default_factory=dict)


class BudgetPolicy:
    """Keep GPUs + CPU under ``node_budget_w`` by water-filling GPU power limits."""

    name = "budget"
    help = "hold GPUs + CPU under node_budget_w, giving GPU watts where they buy the most FLOP/s"
    PARAMS: tuple[Param, ...] = (
        Param(
            "node_budget_w",
            "float",
            None,
            "node power budget, W (GPUs + counted CPU zones)",
            required=True,
            lo=0,
            lo_open=True,
        ),
        Param("margin", "float", 0.03, "aim this fraction below the budget", lo=0, hi=0.5),
        Param("hysteresis_w", "float", 25.0, "move a limit only by at least this much, W", lo=0),
        Param("max_move_w", "float", 100.0, "largest raise of one limit per decision, W", lo=1),
        Param("min_steps", "int", 8, "steps at a limit before its FLOP/s counts", lo=1, hi=10000),
        Param(
            "fair_share",
            "float",
            0.0,
            "every busy GPU first gets this fraction of an equal share "
            "of the watts above the minimum limits (0: all by FLOP/s per W)",
            lo=0,
            hi=1,
        ),
    )

    def __init__(self, **params: Any) -> None:
        p = validate_params(self.name, self.PARAMS, params)
        self._p = p
        self.node_budget_w: float = p["node_budget_w"]
        self.margin: float = p["margin"]
        self.hysteresis_w: float = p["hysteresis_w"]
        self.max_move_w: float = p["max_move_w"]
        self.min_steps: int = p["min_steps"]
        self.fair_share: float = p["fair_share"]

    def params(self) -> dict[str, Any]:
        return dict(self._p)

    def new_state(self) -> BudgetState:
        return BudgetState()

    @staticmethod
    def _limit(g: GpuView) -> float:
        if g.power_limit_w is not None:
            return g.power_limit_w
        return g.power_limit_default_w or g.power_limit_max_w or 0.0

    def decide(self, snap: Snapshot, state: BudgetState) -> Decision:
        d = Decision()
        gpus = {g.index: g for g in snap.gpus if g.power_limit_min_w is not None}
        cpu = snap.cpu_power_w or 0.0
        total = sum(g.power_w or 0.0 for g in snap.gpus) + cpu
        gpu_budget = self.node_budget_w * (1.0 - self.margin) - cpu
        job_of: dict[int, Any] = {}
        for running in snap.jobs:
            if running.state == "running":
                for i in running.gpus:
                    job_of[i] = running
        # ---- learn: one point per GPU per limit, from its job's measure
        fresh: dict[int, bool] = {}
        for i, g in gpus.items():
            j = job_of.get(i)
            if j is None:
                state.curves.pop(i, None)
                state.jobs_seen.pop(i, None)
                continue
            if state.jobs_seen.get(i) != j.job:  # a new job: what we knew is about another
                state.curves[i] = _GpuCurve()
                state.jobs_seen[i] = j.job
            curve = state.curves[i]
            m = j.measure
            lim = self._limit(g)
            # (a job that reports no FLOPs teaches nothing of FLOP/s per watt: its GPU stays
            # unknown, with an equal share, not read as one that gains nothing from watts)
            ok = m is not None and m.steps >= self.min_steps and m.time_s > 0 and m.flops > 0
            ok = ok and _same_limit(m.setting, lim, g)
            fresh[i] = ok
            if ok:
                assert m is not None
                n = max(1, len(j.gpus))
                fps = m.flops / m.time_s / n
                pw = m.energy_j / m.time_s / n
                curve.points[int(round(lim))] = (pw, fps)
                if pw < lim - UNCONSTRAINED_GAP_W:
                    curve.demand_w = max(curve.demand_w or 0.0, pw + UNCONSTRAINED_GAP_W)
                elif curve.demand_w is not None and pw > curve.demand_w - 1.0:
                    curve.demand_w = None  # it draws all it may: demand unknown again
        over = total > self.node_budget_w
        informed = all(fresh.get(i, True) for i in job_of if i in gpus)
        alloc = self._allocate(gpus, job_of, state, gpu_budget)
        current = {i: self._limit(g) for i, g in gpus.items()}
        moves = {i: alloc[i] - current[i] for i in gpus}
        big = any(abs(v) >= self.hysteresis_w for v in moves.values())
        apply = over or (informed and big)
        if apply:
            for i, g in gpus.items():
                target = alloc[i]
                if not over and target > current[i]:
                    target = min(target, current[i] + self.max_move_w)
                if abs(target - current[i]) < 0.5:
                    continue
                default = g.power_limit_default_w or g.power_limit_max_w or target
                d.gpu_settings[i] = Setting(power_limit_w=None if target >= default - 0.5 else round(target, 1))
            state.last_alloc = dict(alloc)
        shown = ", ".join(f"gpu{i} {alloc[i]:.0f} W" for i in sorted(alloc))
        state_word = (
            "over budget, cutting"
            if over
            else ("re-allocating" if apply and d.gpu_settings else ("measuring" if not informed else "holding"))
        )
        d.reason = (
            f"budget {self.node_budget_w:.0f} W: node {total:.0f} W (cpu {cpu:.0f} W), "
            f"{state_word}: {shown or 'no GPU with a power limit'}"
        )
        if gpu_budget < sum(float(g.power_limit_min_w or 0.0) for g in gpus.values()):
            d.reason += " (budget below the GPUs' minimum limits)"
        d.details = {
            "node_power_w": total,
            "cpu_power_w": cpu,
            "gpu_budget_w": gpu_budget,
            "allocation_w": {i: alloc[i] for i in sorted(alloc)},
            "over_budget": over,
            "informed": informed,
            "demand_w": {i: c.demand_w for i, c in state.curves.items()},
        }
        return d

    def _allocate(
        self, gpus: dict[int, GpuView], job_of: dict[int, Any], state: BudgetState, gpu_budget: float
    ) -> dict[int, float]:
        """Water-filling: per-GPU limits summing to at most ``gpu_budget`` (if possible)."""
        lo = {i: float(g.power_limit_min_w or 0.0) for i, g in gpus.items()}
        top = {i: float(g.power_limit_default_w or g.power_limit_max_w or lo[i]) for i, g in gpus.items()}
        alloc = dict(lo)
        left = gpu_budget - sum(alloc.values())
        if left <= 0:
            return alloc
        busy = [i for i in gpus if i in job_of]
        curves = {i: state.curves.get(i, _GpuCurve()) for i in busy}
        ceiling: dict[int, float] = {}
        for i in busy:
            demand_w = curves[i].demand_w
            ceiling[i] = top[i] if demand_w is None else min(top[i], max(lo[i], demand_w))
        unknown = [i for i in busy if not curves[i].points]
        known = [i for i in busy if curves[i].points]
        if self.fair_share > 0 and busy:
            # A floor for every job (up to what its GPU can use), so that one that buys
            # few FLOP/s per watt (memory-bound) is not starved to its minimum limit.
            floor = self.fair_share * left / len(busy)
            for i in busy:
                add = max(0.0, min(floor, ceiling[i] - alloc[i]))
                alloc[i] += add
                left -= add
        if unknown:  # no evidence: an equal share of what is left
            share = left / len(busy)
            for i in unknown:
                add = min(share, ceiling[i] - alloc[i])
                alloc[i] += add
                left -= add
        while left >= CHUNK_W and known:
            best, best_m = None, 0.0
            for i in known:
                if alloc[i] + CHUNK_W > ceiling[i] + 1e-9:
                    continue
                m = curves[i].marginal(alloc[i])
                if math.isnan(m) or m <= 0:
                    continue
                if (
                    best is None
                    or m > best_m * (1 + 1e-9)
                    or (abs(m - best_m) <= best_m * 1e-9 and alloc[i] < alloc[best])
                ):
                    best, best_m = i, m
            if best is None:
                break
            alloc[best] += CHUNK_W
            left -= CHUNK_W
        # Every GPU has what it can use: raise towards default with what is left.
        for i in sorted(busy, key=lambda i: alloc[i]):
            if left <= 0:
                break
            add = min(left, top[i] - alloc[i])
            alloc[i] += add
            left -= add
        return alloc


def _same_limit(s: Setting, limit_w: float, g: GpuView) -> bool:
    want = s.power_limit_w if s.power_limit_w is not None else (g.power_limit_default_w or limit_w)
    return abs(want - limit_w) < 0.5
