"""``efficient``: find, online, the GPU setting with the least energy per FLOP.

The product's core. For every running job the policy searches the SM clock cap
(``knob="clock"``, the default) or the power limit (``knob="power"``) that
minimises the job's energy per FLOP, measured on the job's own steps, subject to
a slowdown bound; or (``objective="cost"``) the Zeus cost per FLOP
``eta * energy + (1 - eta) * max_power * time``.

How the search works (a newcomer's tour)
----------------------------------------

Everything a job teaches us is kept as *evidence*: per setting, the sums of its
steps, FLOPs, time and energy (and their squares, for the noise). The search is
a pure function of that evidence (:meth:`EfficientPolicy._plan`): each decision
it replays the whole search from the cache and says "measure setting S until it
has N steps" or "settle at S". Replaying makes the search robust: when a new
baseline arrives, or a measurement gets more precise, the same code simply
reaches a (possibly different) answer.

The settings form a *grid*, ascending: the supported clocks below the maximum
(or power limits every ``power_step_w`` from the minimum up to what the job
draws uncapped; higher limits change nothing), and on top "uncapped".

1. **Baseline.** Measure the job uncapped (``2 * min_steps`` steps). Its time
   per FLOP sets the time budget ``(1 + max_slowdown) * baseline``; when the job
   has a ``pace_s`` (the step time agreed across nodes) slower than our own
   uncapped step, the budget is ``(1 + max_slowdown) * pace_s`` instead: a fast
   node may cap deeper without becoming the straggler.

2. **Boundary (slowdown mode).** Time grows monotonically as the clock goes
   down, so the feasible settings are the top of the grid, down to a boundary.
   We bracket it: the first probe is where a purely compute-bound job would hit
   the budget (``fmax / (1 + bound)``: feasible for every job); then a model
   ``time = a + b / clock`` (compute part scales with 1/clock, memory part does
   not) fitted to what we measured predicts the boundary, twice; after that,
   plain bisection. Settings the model predicts to be clearly over the budget
   are never measured.

   Noise: a setting is *feasible* when its time ratio is below the budget by
   ``Z`` standard errors, *over* when above by as much; in between we keep
   measuring it (up to ``4 * min_steps`` steps) and then call it over. So a
   noisy run errs to the safe side.

3. **Energy.** Energy per FLOP is convex in the clock (power grows faster than
   linearly, time shrinks as 1/clock): the best feasible setting is at the
   boundary unless energy already rises going down there. One probe just above
   the boundary tells which; if energy still falls going up, we gallop upwards
   (1, 2, 4, ... grid steps) to bracket the minimum, then narrow it by
   golden-section search.

4. **Cost mode** (no bound): the model's predicted time alone rules out
   settings whose time cost exceeds the uncapped cost; golden-section search on
   the measured cost narrows the rest.

5. **Settled.** We hold the best setting and keep watching: once after settling,
   and every ``recheck_s`` seconds, the baseline is measured again (warm-up
   makes first steps slow, and the budget depends on it); while settled, a
   window of recent steps is compared with what the setting showed when we
   settled: a FLOP/s or power drift beyond ``retune_drift`` (a new phase of
   the job) starts the search again. A new job that shares a job's GPUs
   re-tunes it too.

The policy is pure: no I/O, no clocks (``snap.t_s`` only); all memory lives in
the state object from :meth:`EfficientPolicy.new_state`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from . import Param, validate_params
from .base import UNCAPPED, Decision, GpuView, JobMeasure, JobView, Setting, Snapshot
from .static import same_setting

__all__ = ["EfficientPolicy", "EfficientState", "Evidence"]

Z = 1.64  # one-sided 95 %: standard errors of margin for feasibility and energy comparisons
SKIP_MARGIN = 0.02  # predicted ratio this far over the budget: not worth measuring
MIN_ENERGY_TOL = 0.003  # relative energy differences below this are ties
_SAMPLES_KEEP = 64


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
        return Evidence(self.steps - o.steps, self.flops - o.flops, self.time_s - o.time_s, self.energy_j - o.energy_j, None, None)

    @property
    def tpf(self) -> float:
        return self.time_s / self.flops if self.flops > 0 else math.inf

    @property
    def epf(self) -> float:
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


@dataclass
class _Job:
    """One job's search: the grid, the evidence, and where we are."""

    gpus: tuple[int, ...]
    start_steps: int
    phase: str = "baseline"  # baseline | search | settled | recheck
    grid: tuple[Setting, ...] = ()  # ascending; last = UNCAPPED (built after the baseline)
    levels: tuple[float, ...] = ()  # MHz or W of each grid point (top: fmax or uncapped draw)
    cache: dict[Setting, Evidence] = field(default_factory=dict)  # banked evidence per setting
    current: Setting = UNCAPPED  # the setting we want in force
    live: Evidence | None = None  # the daemon's measure for `current`, this visit
    recheck: Evidence | None = None  # the baseline re-check being measured
    rechecked_once: bool = False
    next_recheck_s: float = math.inf
    settled: Setting | None = None
    settled_job_steps: int | None = None  # job steps before the first settle
    ref: Evidence | None = None  # the settled setting's evidence when watching began
    samples: list[Evidence] = field(default_factory=list)  # live cumulatives while settled
    allowed: float = 1.0  # the allowed time ratio to our uncapped baseline (last plan)
    need: int = 0  # steps the current candidate must have before the search moves on
    retunes: int = 0
    last_event: str = ""


@dataclass
class EfficientState:
    jobs: dict[str, _Job] = field(default_factory=dict)


@dataclass(frozen=True)
class _Action:
    kind: str  # "measure" | "settle"
    index: int
    steps: int = 0


class EfficientPolicy:
    """Online search for the most energy-efficient clock cap or power limit per job."""

    name = "efficient"
    help = "online search per job for the clock cap (or power limit) with the least energy per FLOP"
    PARAMS: tuple[Param, ...] = (
        Param("knob", "str", "clock", "what to tune: the SM clock cap or the power limit", choices=("clock", "power")),
        Param("objective", "str", "slowdown", "minimise energy under max_slowdown, or the Zeus cost",
              choices=("slowdown", "cost")),
        Param("max_slowdown", "float", 0.05, "allowed step-time increase over uncapped (or pace)", lo=0, hi=1),
        Param("eta", "float", 0.5, "cost objective: weight of energy vs time (1 = energy only)", lo=0, hi=1),
        Param("min_steps", "int", 8, "steps measured per candidate setting", lo=2, hi=10000),
        Param("retune_drift", "float", 0.15, "FLOP/s or power drift (fraction) that starts a re-tune",
              lo=0, lo_open=True, hi=10),
        Param("recheck_s", "float", 600.0, "re-measure the uncapped baseline this often (0: only once)", lo=0),
        Param("power_step_w", "float", 25.0, "power knob: grid step, W", lo=1, hi=500),
        Param("noise", "float", 0.02, "assumed relative step noise when the measure carries no spread",
              lo=0, hi=1),
    )

    def __init__(self, **params: Any) -> None:
        p = validate_params(self.name, self.PARAMS, params)
        self._p = p
        self.knob: str = p["knob"]
        self.objective: str = p["objective"]
        self.max_slowdown: float = p["max_slowdown"]
        self.eta: float = p["eta"]
        self.min_steps: int = p["min_steps"]
        self.retune_drift: float = p["retune_drift"]
        self.recheck_s: float = p["recheck_s"]
        self.power_step_w: float = p["power_step_w"]
        self.noise: float = p["noise"]
        self.baseline_steps = 4 * self.min_steps
        self.max_steps = 8 * self.min_steps

    def params(self) -> dict[str, Any]:
        return dict(self._p)

    def new_state(self) -> EfficientState:
        return EfficientState()

    # ------------------------------------------------------------------ decide

    def decide(self, snap: Snapshot, state: EfficientState) -> Decision:
        d = Decision()
        gpus = {g.index: g for g in snap.gpus}
        running = [j for j in snap.jobs if j.state == "running" and j.gpus]
        for name in list(state.jobs):
            if name not in {j.job for j in running}:
                del state.jobs[name]  # ended: the daemon restores its GPUs
        # A new job sharing GPUs with a tuned one invalidates that one's evidence.
        for j in running:
            if j.job not in state.jobs:
                for other_name, other in state.jobs.items():
                    if set(other.gpus) & set(j.gpus):
                        self._retune(other, f"job {j.job} arrived on its GPUs")
                state.jobs[j.job] = _Job(gpus=tuple(j.gpus), start_steps=j.steps)
        reasons: list[str] = []
        details: dict[str, Any] = {}
        for j in running:
            js = state.jobs[j.job]
            views = [gpus[i] for i in j.gpus if i in gpus]
            if not views or not self._tunable(views[0]):
                reasons.append(f"job {j.job}: not tunable ({self.knob} knob unsupported on its GPUs)")
                continue
            reason = self._step_job(snap, j, js, views[0])
            if not same_setting(j.setting, js.current):
                d.settings[j.job] = js.current
            reasons.append(reason)
            details[j.job] = self._details(js, views[0])
        d.reason = "; ".join(reasons) if reasons else "efficient: no running job"
        d.details = {"policy": self.name, "knob": self.knob, "objective": self.objective, "jobs": details}
        return d

    # ------------------------------------------------------------------ per job

    def _tunable(self, g: GpuView) -> bool:
        if self.knob == "clock":
            return len(g.supported_sm_clocks_mhz) > 1
        return g.power_limit_min_w is not None and g.power_limit_max_w is not None

    def _retune(self, js: _Job, why: str, baseline: Evidence | None = None) -> None:
        js.cache = {UNCAPPED: baseline} if baseline is not None else {}
        js.grid, js.levels = (), ()
        js.phase = "baseline" if baseline is None else "search"
        js.current, js.live, js.recheck = UNCAPPED, None, None
        js.settled, js.ref, js.samples = None, None, []
        js.rechecked_once = False
        js.next_recheck_s = math.inf
        js.retunes += 1
        js.last_event = f"re-tune: {why}"

    def _switch(self, js: _Job, s: Setting) -> None:
        """Want ``s`` from now on; bank what the current visit measured."""
        if same_setting(s, js.current):
            return
        if js.live is not None and js.phase != "recheck":
            js.cache[js.current] = js.cache.get(js.current, Evidence()).plus(js.live)
        js.live = None
        js.current = s

    def _sync_live(self, j: JobView, js: _Job) -> None:
        m = j.measure
        if m is None or not same_setting(m.setting, js.current) or not same_setting(j.setting, js.current):
            return
        ev = Evidence.of(m)
        if js.live is not None and ev.steps < js.live.steps:
            # The daemon started the measure again at the same setting: bank the old one.
            if js.phase == "recheck":
                js.recheck = (js.recheck or Evidence()).plus(js.live)
            else:
                js.cache[js.current] = js.cache.get(js.current, Evidence()).plus(js.live)
        js.live = ev

    def _evidence(self, js: _Job) -> dict[Setting, Evidence]:
        ev = dict(js.cache)
        if js.live is not None and js.phase != "recheck" and js.live.steps > 0:
            ev[js.current] = ev.get(js.current, Evidence()).plus(js.live)
        return ev

    def _build_grid(self, js: _Job, g: GpuView, base: Evidence) -> None:
        if self.knob == "clock":
            clocks = sorted(set(g.supported_sm_clocks_mhz))
            js.grid = tuple(Setting(clock_cap_mhz=f) for f in clocks[:-1]) + (UNCAPPED,)
            js.levels = tuple(float(f) for f in clocks)
        else:
            n = max(1, len(js.gpus))
            draw = base.power_w / n
            lo = float(g.power_limit_min_w or 0.0)
            hi = float(g.power_limit_default_w or g.power_limit_max_w or draw)
            top = min(draw, hi)
            levels: list[float] = []
            x = lo
            while x < top - 1e-9:
                levels.append(round(x, 3))
                x += self.power_step_w
            js.grid = tuple(Setting(power_limit_w=x) for x in levels) + (UNCAPPED,)
            js.levels = tuple(levels) + (max(top, lo),)

    def _step_job(self, snap: Snapshot, j: JobView, js: _Job, g: GpuView) -> str:
        self._sync_live(j, js)
        # ---- the baseline re-check
        if js.phase == "recheck":
            rc = (js.recheck or Evidence()).plus(js.live) if js.live is not None else (js.recheck or Evidence())
            need = self._baseline_need(rc)
            if rc.steps < need:
                return f"job {j.job}: re-checking the uncapped baseline ({rc.steps}/{need} steps)"
            self._finish_recheck(snap, js, rc)
        ev = self._evidence(js)
        base = ev.get(UNCAPPED)
        need = self._baseline_need(base)
        if base is None or base.steps < need:
            js.phase = "baseline"
            self._switch(js, UNCAPPED)
            n = 0 if base is None else base.steps
            return f"job {j.job}: measuring the uncapped baseline ({n}/{need} steps)"
        if not js.grid:
            self._build_grid(js, g, base)
        # ---- drift while settled: a new phase of the job
        if js.phase == "settled" and js.settled is not None and same_setting(js.current, js.settled):
            drift = self._drift(js, ev)
            if drift is not None:
                self._retune(js, drift)
                return f"job {j.job}: {drift}; measuring the uncapped baseline again"
        if js.phase == "search" and not js.current.uncapped:
            have = ev.get(js.current, Evidence()).steps
            if have < js.need:
                return (f"job {j.job}: searching, measuring {self._label(js.current, js)} "
                        f"({have}/{js.need} steps; {self._n_measured(ev)} candidates measured)")
        action = self._plan(js, ev, g, j)
        target = js.grid[action.index]
        if action.kind == "measure":
            if js.phase == "settled":
                js.last_event = "evidence changed: searching again"
            js.phase = "search"
            js.settled = None
            self._switch(js, target)
            js.need = action.steps
            have = ev.get(target, Evidence()).steps if same_setting(target, js.current) else 0
            return (f"job {j.job}: searching, measuring {self._label(target, js)} "
                    f"({have}/{action.steps} steps; {self._n_measured(ev)} candidates measured)")
        # settle
        if js.phase != "settled" or js.settled is None or not same_setting(js.settled, target):
            js.phase = "settled"
            js.settled = target
            js.ref, js.samples = None, []
            if js.settled_job_steps is None:
                js.settled_job_steps = j.steps - js.start_steps
        self._switch(js, target)
        here = self._evidence(js).get(target, Evidence())
        if js.ref is None and js.live is not None and js.live.steps >= self.min_steps:
            js.ref = here
        if js.live is not None:
            js.samples.append(js.live)
            del js.samples[:-_SAMPLES_KEEP]
        # ---- time to re-check the baseline?
        if not target.uncapped and js.ref is not None and (not js.rechecked_once or snap.t_s >= js.next_recheck_s):
            self._switch(js, UNCAPPED)
            js.phase, js.recheck, js.live = "recheck", Evidence(), None
            return f"job {j.job}: re-checking the uncapped baseline (0/{self.baseline_steps} steps)"
        return self._settled_line(j.job, js, ev, target)

    def _baseline_need(self, base: Evidence | None) -> int:
        """Steps the uncapped baseline needs: every comparison leans on it, so a
        noisy job measures it twice as long (``4 * min_steps``) as a quiet one."""
        short = 2 * self.min_steps
        if base is not None and base.steps >= short and base.se_time(self.noise) <= 0.0025:
            return short
        return self.baseline_steps

    def _finish_recheck(self, snap: Snapshot, js: _Job, rc: Evidence) -> None:
        base = js.cache.get(UNCAPPED, Evidence())
        js.recheck, js.live = None, None
        js.rechecked_once = True
        js.next_recheck_s = snap.t_s + self.recheck_s if self.recheck_s > 0 else math.inf
        js.phase = "search"
        if base.steps == 0:
            js.cache[UNCAPPED] = rc
            return
        dt = rc.tpf / base.tpf - 1.0
        dp = rc.power_w / base.power_w - 1.0 if base.power_w > 0 else 0.0
        if abs(dt) > self.retune_drift or abs(dp) > self.retune_drift:
            self._retune(js, f"baseline moved ({dt:+.0%} time, {dp:+.0%} power)", baseline=rc)
            js.rechecked_once = True
            return
        se = math.hypot(rc.se_time(self.noise), base.se_time(self.noise))
        if abs(dt) > max(0.02, 3.0 * se):  # clearly off (warm-up), not just noise
            js.cache[UNCAPPED] = rc  # the first baseline was off (warm-up): trust the new one
            js.last_event = f"baseline corrected by {dt:+.1%}"
        else:
            js.cache[UNCAPPED] = base.plus(rc)
            js.last_event = "baseline confirmed"

    def _drift(self, js: _Job, ev: dict[Setting, Evidence]) -> str | None:
        if js.ref is None or js.live is None or not js.samples:
            return None
        now = js.live
        window = None
        for s in reversed(js.samples):
            if now.steps - s.steps >= self.min_steps:
                window = now.minus(s)
                break
        if window is None or window.flops <= 0 or window.time_s <= 0:
            return None
        dfps = js.ref.tpf / window.tpf - 1.0
        dp = window.power_w / js.ref.power_w - 1.0 if js.ref.power_w > 0 else 0.0
        if abs(dfps) > self.retune_drift or abs(dp) > self.retune_drift:
            return f"phase change ({dfps:+.0%} FLOP/s, {dp:+.0%} power)"
        return None

    # ------------------------------------------------------------------ the search

    def _plan(self, js: _Job, ev: dict[Setting, Evidence], g: GpuView, j: JobView) -> _Action:
        """Replay the search over the evidence: what to measure next, or where to settle."""
        grid = js.grid
        top = len(grid) - 1
        base = ev[UNCAPPED]
        E = [ev.get(s) for s in grid]
        measured = [i for i in range(top) if E[i] is not None and E[i].steps > 0]  # type: ignore[union-attr]
        model = self._fit(js, E)

        if self.objective == "cost":
            n = max(1, len(js.gpus))
            pmax = float(g.power_limit_max_w or 0.0) * n

            def obj(i: int) -> float:
                e = E[i]
                assert e is not None
                return self.eta * e.epf + (1.0 - self.eta) * pmax * e.tpf

            if not measured:
                return _Action("measure", self._prior_index(js, base, 1.05), self.min_steps)
            lo = -1
            if model is not None:
                for i in range(top - 1, -1, -1):
                    if (1.0 - self.eta) * pmax * self._pred(model, js, i) > obj(top) * (1 + SKIP_MARGIN):
                        lo = i
                        break
            return self._golden(lo, top, None, E, obj, candidates=range(max(lo, 0), top + 1))

        # ---- slowdown mode: the boundary
        allowed = self._allowed(base, j)
        js.allowed = allowed
        se_b = base.se_time(self.noise)

        def status(i: int) -> str:
            e = E[i]
            assert e is not None
            r = e.tpf / base.tpf
            se = math.hypot(e.se_time(self.noise), se_b) * r
            if r <= allowed * (1 + 1e-9) - Z * se:
                return "ok"
            if r > allowed + Z * se:
                return "over"
            return "unsure" if e.steps < self.max_steps else "over"

        st = {i: status(i) for i in measured}
        for i in measured:
            if st[i] == "unsure":
                return _Action("measure", i, min(self.max_steps, E[i].steps + self.min_steps))  # type: ignore[union-attr]
        lo = max((i for i in measured if st[i] == "over"), default=-1)
        hi = min((i for i in measured if st[i] == "ok" and i > lo), default=top)
        lo_eff = lo
        if model is not None:
            for i in range(hi - 1, lo, -1):
                if self._pred(model, js, i) / base.tpf > allowed * (1 + SKIP_MARGIN):
                    lo_eff = i
                    break
        if hi - lo_eff > 1:
            n_cap = len(measured)
            if n_cap == 0:
                probe = self._prior_index(js, base, allowed)
            elif n_cap <= 2 and model is not None:
                probe = next((i for i in range(lo_eff + 1, hi) if self._pred(model, js, i) / base.tpf <= allowed), hi)
            else:
                probe = (lo_eff + hi) // 2
            probe = min(max(probe, lo_eff + 1), hi - 1)
            return _Action("measure", probe, self.min_steps)
        k = hi
        if k >= top:
            return _Action("settle", top)

        # ---- the energy above the boundary
        def epf(i: int) -> float:
            e = E[i]
            assert e is not None
            return e.epf

        def tol(a: int, b: int) -> float:
            ea, eb = E[a], E[b]
            assert ea is not None and eb is not None
            return max(MIN_ENERGY_TOL, Z * math.hypot(ea.se_energy(self.noise), eb.se_energy(self.noise)))

        nxt = k + 1
        if E[nxt] is None:
            return _Action("measure", nxt, self.min_steps)
        if epf(nxt) >= epf(k) * (1 - tol(k, nxt)):
            return _Action("settle", k)
        prev, cur, step = k, nxt, 2
        while True:  # gallop upwards until energy rises again
            nxt = min(cur + step, top)
            if E[nxt] is None:
                return _Action("measure", nxt, self.min_steps)
            if epf(nxt) >= epf(cur):
                return self._golden(prev, nxt, cur, E, epf, candidates=range(k, top + 1))
            if nxt == top:
                return _Action("settle", top)
            prev, cur, step = cur, nxt, step * 2

    def _golden(self, a: int, b: int, x: int | None, E: list[Evidence | None], obj: Any,
                candidates: range) -> _Action:
        """Discrete golden-section search for the minimum of ``obj`` strictly inside
        (a, b), replayed over the measured points (a measured neighbour within one
        grid step of a golden point stands in for it). ``x``: an interior point
        already measured, kept as one of the two probes."""
        while b - a > 3:
            if x is None or not a < x < b:
                x = a + max(1, round(0.382 * (b - a)))
            y = a + b - x
            if y == x:
                y = x + 1 if x + 1 < b else x - 1
            p, q = min(x, y), max(x, y)
            p = self._near_measured(p, a, q, E)
            q = self._near_measured(q, p, b, E)
            if E[p] is None:
                return _Action("measure", p, self.min_steps)
            if E[q] is None:
                return _Action("measure", q, self.min_steps)
            if obj(p) <= obj(q):
                b, x = q, p
            else:
                a, x = p, q
        inside = [i for i in range(max(a, candidates.start), min(b, candidates.stop - 1) + 1) if E[i] is not None]
        pool = inside or [i for i in candidates if E[i] is not None]
        return _Action("settle", min(pool, key=lambda i: (obj(i), -i)))

    @staticmethod
    def _near_measured(i: int, lo: int, hi: int, E: list[Evidence | None]) -> int:
        if E[i] is not None:
            return i
        for j in (i - 1, i + 1):
            if lo < j < hi and E[j] is not None:
                return j
        return i

    def _allowed(self, base: Evidence, j: JobView) -> float:
        """The allowed time ratio to the local uncapped baseline."""
        allowed = 1.0 + self.max_slowdown
        if j.pace_s is not None and j.pace_s > 0 and base.steps > 0 and base.flops > 0:
            pace_tpf = j.pace_s * base.steps / base.flops  # s per FLOP at the agreed pace
            if pace_tpf > base.tpf:
                allowed *= pace_tpf / base.tpf
        return allowed

    def _u(self, js: _Job, i: int) -> float:
        """The model's variable: 1/clock, or limit^-1/2 for the power knob."""
        x = js.levels[i]
        return 1.0 / x if self.knob == "clock" else x ** -0.5

    def _fit(self, js: _Job, E: list[Evidence | None]) -> tuple[float, float] | None:
        """Least squares ``tpf = a + b * u`` over the measured points, weighted by steps."""
        pts = [(self._u(js, i), e.tpf, e.steps) for i, e in enumerate(E) if e is not None and e.steps > 0]
        if len({round(u, 12) for u, _, _ in pts}) < 2:
            return None
        sw = sum(w for _, _, w in pts)
        mu = sum(u * w for u, _, w in pts) / sw
        mt = sum(t * w for _, t, w in pts) / sw
        suu = sum(w * (u - mu) ** 2 for u, _, w in pts)
        sut = sum(w * (u - mu) * (t - mt) for u, t, w in pts)
        if suu <= 0:
            return None
        b = sut / suu
        if b <= 0:
            return None  # time not falling with the knob: no model
        return (mt - b * mu, b)

    def _pred(self, model: tuple[float, float], js: _Job, i: int) -> float:
        a, b = model
        return a + b * self._u(js, i)

    def _prior_index(self, js: _Job, base: Evidence, allowed: float) -> int:
        """Where a purely compute-bound job would reach the budget: safe for all jobs."""
        top = len(js.grid) - 1
        target = js.levels[top] / allowed if self.knob == "clock" else js.levels[top] / allowed**2
        for i in range(top):
            if js.levels[i] >= target - 1e-9:
                return i
        return max(0, top - 1)

    # ------------------------------------------------------------------ display

    @staticmethod
    def _n_measured(ev: dict[Setting, Evidence]) -> int:
        return sum(1 for s, e in ev.items() if not s.uncapped and e.steps > 0)

    def _label(self, s: Setting, js: _Job) -> str:
        if s.uncapped:
            return "uncapped"
        if s.clock_cap_mhz is not None:
            return f"{s.clock_cap_mhz} MHz"
        return f"{s.power_limit_w:g} W"

    def _bound_text(self, js: _Job | None = None) -> str:
        if self.objective == "cost":
            return f"cost eta={self.eta:g}"
        if js is not None and js.allowed > 1.0 + self.max_slowdown + 1e-9:
            return f"bound {self.max_slowdown:.0%} over the job's pace, {js.allowed - 1:+.1%} locally"
        return f"bound {self.max_slowdown:.0%}"

    def _settled_line(self, job: str, js: _Job, ev: dict[Setting, Evidence], s: Setting) -> str:
        base, here = ev.get(UNCAPPED), ev.get(s)
        if s.uncapped or base is None or here is None or here.steps == 0:
            return f"job {job} settled at {self._label(s, js)} ({self._bound_text(js)})"
        de = here.epf / base.epf - 1.0
        dt = here.tpf / base.tpf - 1.0
        return (f"job {job} settled at {self._label(s, js)}: {de:+.0%} energy/FLOP, "
                f"{dt:+.1%} time ({self._bound_text(js)})")

    def _details(self, js: _Job, g: GpuView) -> dict[str, Any]:
        ev = self._evidence(js)
        base = ev.get(UNCAPPED)
        measured = {self._label(s, js): e.steps for s, e in ev.items() if e.steps > 0}
        best: dict[str, Any] | None = None
        s = js.settled
        if s is not None and base is not None and s in ev and ev[s].steps > 0 and base.steps > 0:
            best = {
                "setting": {"clock_cap_mhz": s.clock_cap_mhz, "power_limit_w": s.power_limit_w},
                "label": self._label(s, js),
                "energy_per_flop_change": ev[s].epf / base.epf - 1.0,
                "time_per_flop_change": ev[s].tpf / base.tpf - 1.0,
            }
        return {
            "phase": js.phase,
            "current": self._label(js.current, js),
            "candidates_measured": self._n_measured(ev),
            "measured_steps": measured,
            "best": best,
            "bound": None if self.objective == "cost" else self.max_slowdown,
            "allowed_slowdown": None if self.objective == "cost" else js.allowed - 1.0,
            "search_steps": js.settled_job_steps,
            "retunes": js.retunes,
            "last_event": js.last_event,
            # This node's uncapped time per FLOP: the daemon turns it into the job's local
            # step time and the ranks agree the job's pace from it (docs/protocol.md).
            "baseline_time_per_flop_s": base.tpf if base is not None and base.steps > 0 else None,
        }
