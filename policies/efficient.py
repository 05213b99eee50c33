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
(or the minimum power limit and the multiples of ``power_step_w`` above it,
under the top limit), and on top "uncapped".

1. **Baseline.** Measure the job uncapped (``2 * min_steps`` steps; a job that reports
   no FLOPs is left uncapped). Its time per FLOP sets the time budget ``(1 +
   max_slowdown) * baseline``; with ``pace_room`` (off: synchronous ranks time the job's
   step, so there is no room) and a fresh ``pace_s`` over our uncapped step, ``pace_s``'s;
   a job over several nodes, over its floor where lower (the fastest uncapped step any
   node measured: a baseline measured while another node was capped has its slowdown in
   it; ``efficient_state.floor_share``).

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
   noisy run errs to the safe side. With the power knob, settings below are ruled
   out only by two neighbours clearly over by their own steps (measured power-limit
   curves zig-zag): the search goes on down past a lone one under ``PLATEAU`` x the bound.

3. **Energy.** Energy per FLOP is convex in the clock (power grows faster than
   linearly, time shrinks as 1/clock): the best feasible setting is at the
   boundary unless energy already rises going down there. One probe just above
   the boundary tells which; if energy still falls going up, we gallop upwards
   (1, 2, 4, ... grid steps) to bracket the minimum, then narrow it by
   golden-section search.

4. **Cost mode** (no bound): the model's predicted time alone rules out
   settings whose time cost exceeds the uncapped cost; golden-section search on
   the measured cost narrows the rest.

5. **A second look** (power knob, ``_finer.py``), once settled with the baseline
   re-checked: where a limit below would save over 2 % more and may be within the
   bound, the baseline and that limit are measured longer (judged once, by
   ``Z_LONG``); then limits between it and the level above it are tried, each
   within the bound by its own steps or by the line through the levels around it.

6. **Settled.** We hold the best setting and keep watching: once after settling,
   and every ``recheck_s`` seconds, the baseline is measured again (warm-up
   makes first steps slow, and the budget depends on it; a job over several nodes at the
   same job steps on every node instead, ``RECHECK_SHARE``, and at two shared ones
   after its step or its agreed pace fell, ``_recheck.py``); while settled, a
   window of recent steps is compared with what the setting showed when we
   settled: a FLOP/s or power drift beyond ``retune_drift`` and beyond the
   job's own noise (a new phase of the job, not a checkpoint step; ``_drift.py``)
   starts the search again. A new job that shares a job's GPUs
   re-tunes it too.

7. **Pacing** (``_pacing.py``): once settled, a job's GPUs that wait for a slower
   one on the node (less busy) get deeper settings, until they just keep its pace.
The policy is pure: no I/O, no clocks (``snap.t_s`` only); all memory lives in
the state object from :meth:`EfficientPolicy.new_state`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ._drift import phase_change
from ._efficient_view import bound_text, job_details, settled_line
from ._evidence import Evidence, antitonic_fit, best_candidate, n_measured, open_boundary
from ._finer import BASE_LONG, GAIN_LONG, LONG, LOOK_STEPS, MAX_FINE, PLATEAU, Z_LINE_END, Z_LONG, Lines, Z, may_look
from ._knobs import knob_for
from ._pacing import Pacer, as_job
from ._recheck import (
    ask_pending,
    asked,
    judge_recheck,
    judge_slot,
    pace_fell,
    place_ask,
    slot_due,
    slot_steps,
    slots,
    sped_up,
    waits_more,
)
from .base import UNCAPPED, Decision, GpuView, JobView, Setting, Snapshot
from .efficient_state import (
    EfficientState,
    floor_share,
    follow_straggle,
    new_since,
    note_flops,
    pace_fresh,
    rebase_waits,
    step_flops,
)
from .efficient_state import JobSearch as _Job
from .params import Param, validate_params
from .static import same_setting

__all__ = ["EfficientPolicy", "EfficientState", "Evidence"]

# A job over several nodes re-checks its baseline at the same job steps on every node
# instead (every power of two of its steps under RECHECK_SHARE re-checks' worth, or under
# recheck_s's worth: their uncapped steps 2-6 % of its steps), so that every node runs
# uncapped at once: a node slow from the start that healed leaves the others capped to
# its old step, which nothing else shows (every node times the capped nodes' step), and a
# re-check while the other nodes stay capped reads their step (sim: +20 % over `none`
# under a 5 % bound until the 600 s re-check with 2 nodes; for good with 3 or more).
RECHECK_SHARE = 50
TIGHTER = 0.01  # a bound tighter than this share since we settled: the setting we hold is judged afresh
COARSE_POINTS = 4  # the coarse pass measures about this many settings below the top
MIN_ENERGY_TOL = 0.003  # relative energy differences below this are ties
_SAMPLES_KEEP = 64


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
        Param(
            "objective", "str", "slowdown", "energy under max_slowdown, or Zeus's cost", choices=("slowdown", "cost")
        ),
        Param("max_slowdown", "float", 0.05, "allowed step-time increase over uncapped (or pace)", lo=0, hi=1),
        Param("eta", "float", 0.5, "cost objective: weight of energy vs time (1 = energy only)", lo=0, hi=1),
        Param("min_steps", "int", 8, "steps measured per candidate setting", lo=2, hi=10000),
        Param("retune_drift", "float", 0.15, "FLOP/s or power drift that starts a re-tune", lo=0, lo_open=True, hi=10),
        Param("recheck_s", "float", 600.0, "re-measure the uncapped baseline this often (0: only once)", lo=0),
        Param("power_step_w", "float", 25.0, "power knob: grid step, W", lo=1, hi=500),
        Param("noise", "float", 0.02, "assumed relative step noise when the measure carries no spread", lo=0, hi=1),
        Param("pace_room", "bool", False, "cap down to the job's agreed cross-node pace (nodes that do not wait)"),
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
        self.pace_room: bool = p["pace_room"]
        self.baseline_steps = 4 * self.min_steps
        self.max_steps = 4 * self.min_steps  # a setting still unsure after this many counts as over
        self._pacer = Pacer(self.min_steps, Z, self.noise)

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
                for other in state.jobs.values():
                    if set(other.gpus) & set(j.gpus):
                        self._retune(other, f"job {j.job} arrived on its GPUs")
                        other.low_tpf = None  # (its uncapped step is another one now)
                state.jobs[j.job] = _Job(gpus=tuple(j.gpus), start_steps=j.steps, knob=self.knob)
        reasons: dict[str, str] = {}
        details: dict[str, Any] = {}
        for j in running:
            job = state.jobs[j.job]
            views = [gpus[i] for i in j.gpus if i in gpus]
            j = as_job(j, job.pace, job.grid, job.current)
            knob, why = knob_for(self.knob, views)
            if knob is None:
                reasons[j.job] = f"job {j.job}: cannot act: {why}"
                continue
            note = ""
            if knob != job.knob:
                base = job.cache.get(UNCAPPED)
                self._retune(job, why, baseline=base if base is not None and base.steps > 0 else None)
                job.knob = knob
            if knob != self.knob:
                note = f" ({why})"
            clamp = self._held_instead(j, job, views)
            follow_straggle(job, j, views)
            note_flops(job, j)
            reasons[j.job] = self._step_job(snap, j, job, views[0]) + note + clamp
            paced = self._pace(snap, j, job, views)
            if paced:
                d.job_gpu_settings[j.job] = paced
                reasons[j.job] += f"; {job.pace.last_event}"
            job.asked = None
            if not same_setting(j.setting, job.current):
                d.settings[j.job] = job.current
                job.asked = (job.current, j.setting)
            details[j.job] = job_details(job, self._evidence(job), self.objective, self.max_slowdown, job.fps)
        d.reason = "; ".join(reasons.values()) if reasons else "efficient: no running job"
        d.details = {
            "policy": self.name,
            "knob": self.knob,
            "objective": self.objective,
            "jobs": details,
            "reasons": reasons,
        }
        return d

    # ------------------------------------------------------------------ per job

    def _held_instead(self, j: JobView, job: _Job, views: list[GpuView]) -> str:
        """After a setting was asked for: a GPU that holds another one (a driver that
        clamps a clock lock) is measured at what it holds; the settings it cannot reach
        leave the grid. Returns a note for the reason ("" when nothing happened).
        A lock read back late (the GPU was idle at the write) shows as the GPU asked
        ``job.current`` holding another cap: what was booked meanwhile ran at what it
        holds, and is booked there again from the daemon's measure."""
        asked = job.asked
        cap = job.current.clock_cap_mhz
        if asked is None and cap is not None and any(v.clock_cap_asked_mhz == cap for v in views):
            asked, job.live = (job.current, job.current), None
        if asked is None or not same_setting(asked[0], job.current) or asked[0].uncapped:
            return ""
        held = j.setting
        if same_setting(held, asked[0]) or same_setting(held, asked[1]) or held.uncapped:
            return ""  # in force as asked, or not applied (an error the daemon logs)
        level = held.level
        if level is None or job.live is not None:
            return ""
        keep = [i for i, g in enumerate(job.grid) if g.uncapped or (g.level or 0.0) <= level + 1e-9]
        job.grid = tuple(job.grid[i] for i in keep)
        job.levels = tuple(job.levels[i] for i in keep)
        if not any(same_setting(g, held) for g in job.grid):
            at = max((k for k, g in enumerate(job.grid) if not g.uncapped), default=len(job.grid) - 1)
            job.grid = job.grid[: at + 1] + (held,) + job.grid[at + 1 :]
            job.levels = job.levels[: at + 1] + (level,) + job.levels[at + 1 :]
        job.current, job.live = held, None
        job.last_event = (
            f"the GPU holds {held.label} where {asked[0].label} was asked: "
            f"measured at {held.label}; settings above it left out"
        )
        return f"; {job.last_event}"

    def _pace(self, snap: Snapshot, j: JobView, job: _Job, views: list[GpuView]) -> dict[int, Setting]:
        """Pacing within the node (policies/_pacing.py), once the job is settled; any
        other phase has every GPU at the job's setting."""
        at = job.settled_index
        if job.phase != "settled" or at is None or job.settled is None or not same_setting(job.current, job.settled):
            return self._pacer.release(job.pace, job.current, f"the job is {job.phase}")
        since = j.measure.since_s if j.measure is not None else None
        moves = self._pacer.step(job.pace, snap.t_s, job.grid, job.levels, at, views, job.live, since, self._room(job))
        if moves:
            job.ref, job.samples = None, []  # the drift watch starts again from the paced steps
        return moves

    def _room(self, job: _Job) -> float:
        """The job's allowed step time over its step at its setting, less the noise: room
        the paced GPUs may take where the setting runs faster than the bound (1: none)."""
        ev = self._evidence(job)
        base, here = ev.get(UNCAPPED), ev.get(job.settled) if job.settled is not None else None
        if base is None or here is None or base.steps <= 0 or here.steps <= 0 or here.time_per_flop_s <= 0:
            return 1.0
        se = math.hypot(base.se_time(self.noise), here.se_time(self.noise))
        return max(1.0, job.allowed * base.time_per_flop_s / here.time_per_flop_s * (1.0 - Z * se))

    def _retune(self, job: _Job, why: str, baseline: Evidence | None = None) -> None:
        job.cache = {UNCAPPED: baseline} if baseline is not None else {}
        job.grid, job.levels = (), ()
        job.phase = "baseline" if baseline is None else "search"
        job.stale = job.live if job.current.uncapped and not job.live_paced else None
        job.stale_since_s = job.live_since_s
        job.current, job.live, job.recheck = UNCAPPED, None, None
        job.settled, job.ref, job.samples = None, None, []
        job.rebase, job.fine, job.fine_w, job.again_w, job.look_from, job.looked = False, 0, (), (), None, False
        job.rechecked_once = job.step_quiet = job.ask_quiet = False
        job.next_recheck_s = math.inf
        job.retunes += 1
        job.last_event = f"re-tune: {why}"

    def _switch(self, job: _Job, s: Setting) -> None:
        """Want ``s`` from now on; bank what the current visit measured."""
        if same_setting(s, job.current):
            return
        if job.live is not None and job.phase != "recheck" and not job.live_paced:
            job.cache[job.current] = job.cache.get(job.current, Evidence()).plus(job.live)
        job.live = None
        job.current = s

    def _sync_live(self, j: JobView, job: _Job) -> None:
        m = j.measure
        if m is None or not same_setting(m.setting, job.current) or not same_setting(j.setting, job.current):
            return
        # A new start time is a new measure, even one that already holds more steps than
        # the old one did; without start times, fewer steps than before say so.
        if job.stale is not None and (m.steps < job.stale.steps or new_since(m.since_s, job.stale_since_s)):
            job.stale = None  # the daemon's measure started again since
        ev = Evidence.of(m).after(job.stale)
        restarted = job.live is not None and (new_since(m.since_s, job.live_since_s) or ev.steps < job.live.steps)
        if job.live is not None and restarted and not job.live_paced:
            # The daemon started the measure again at the same setting: bank the old one.
            if job.phase == "recheck":
                job.recheck = (job.recheck or Evidence()).plus(job.live)
            else:
                job.cache[job.current] = job.cache.get(job.current, Evidence()).plus(job.live)
        if job.live is None or restarted:
            job.live_paced = bool(job.pace.held)  # a new measure: paced or not from its start
        job.live, job.live_since_s = ev, m.since_s

    def _evidence(self, job: _Job) -> dict[Setting, Evidence]:
        ev = dict(job.cache)
        if job.live is not None and job.phase != "recheck" and job.live.steps > 0 and not job.live_paced:
            ev[job.current] = ev.get(job.current, Evidence()).plus(job.live)
        return ev

    def _build_grid(self, job: _Job, g: GpuView, base: Evidence) -> None:
        if job.knob == "clock":
            clocks = sorted(set(g.supported_sm_clocks_mhz))
            job.grid = tuple(Setting(clock_cap_mhz=f) for f in clocks[:-1]) + (UNCAPPED,)
            job.levels = tuple(float(f) for f in clocks)
        else:
            # The whole range: under the top limit, round ones (multiples of the step, as measured
            # sweeps take them: 250, 225 W... under 260 W), down to the minimum. Limits above the
            # job's draw can matter (they trim its power peaks).
            low_w, step = float(g.power_limit_min_w or 0.0), self.power_step_w
            top_w = float(g.power_limit_default_w or g.power_limit_max_w or base.power_w / max(1, len(job.gpus)))
            levels: list[float] = []
            k = math.ceil(top_w / step - 1e-9) - 1
            while k * step >= low_w - 1e-9:
                levels.append(round(k * step, 3))
                k -= 1
            if low_w < top_w and (not levels or levels[-1] - low_w > 1e-9):
                levels.append(round(low_w, 3))
            levels.reverse()
            job.grid = tuple(Setting(power_limit_w=x) for x in levels) + (UNCAPPED,)
            job.levels = tuple(levels) + (top_w,)

    def _step_job(self, snap: Snapshot, j: JobView, job: _Job, g: GpuView) -> str:
        self._sync_live(j, job)
        at = slot_due(job, j.run_steps or j.steps, slot_steps(self.baseline_steps)) if job.slots else None
        if at is not None and job.phase not in ("recheck", "baseline"):  # (with the job's other nodes)
            self._switch(job, UNCAPPED)
            job.phase, job.recheck, job.live, job.slot_recheck = "recheck", Evidence(), None, True
            return f"job {j.job}: re-checking the uncapped baseline at its step {at}, as its other nodes do"
        fell = pace_fell(job, j) if job.spans_nodes else None
        if fell is not None and not job.slots:
            self._slots(job, j, f"the job's agreed pace fell {fell:+.0%}", by_step=False)
        ask = asked(job, j) if job.spans_nodes and not job.slots else None  # (one read meanwhile waits for them)
        if ask is not None:
            mine = ask == job.ask  # (its own reading: quiet where its slots find nothing, as for sped_up)
            who = "this node" if mine else "a node of the job"
            self._slots(job, j, f"{who} asked every node to re-check from step {ask}", by_step=mine, asked=True)
        # ---- the baseline re-check
        if job.phase == "recheck":
            recheck_ev = job.recheck or Evidence()
            if job.live is not None:
                recheck_ev = recheck_ev.plus(job.live)
            need = self._baseline_need(recheck_ev)
            if recheck_ev.steps < need:
                return f"job {j.job}: re-checking the uncapped baseline ({recheck_ev.steps}/{need} steps)"
            self._finish_recheck(snap, job, recheck_ev, j.run_steps or j.steps)
        if job.phase == "settled" and job.settled is not None and rebase_waits(job, self.min_steps):
            n = 0 if job.live is None else job.live.steps
            return (
                f"job {j.job} settled at {job.settled.label}; a GPU's pace changed: "
                f"re-basing its evidence ({n}/{self.min_steps} steps)"
            )
        ev = self._evidence(job)
        base = ev.get(UNCAPPED)
        need = self._baseline_need(base)
        if base is None or base.steps < need:
            job.phase = "baseline"
            self._switch(job, UNCAPPED)
            n = 0 if base is None else base.steps
            return f"job {j.job}: measuring the uncapped baseline ({n}/{need} steps)"
        if base.flops <= 0 or base.time_s <= 0 or base.energy_j <= 0:  # every comparison divides by these
            job.phase = "baseline"
            self._switch(job, UNCAPPED)
            if base.flops <= 0:
                return f"job {j.job}: not steered: no FLOPs reported (model= or flops_per_step= in its GreenCallback)"
            job.cache.pop(UNCAPPED, None)  # (never banked: measured again)
            return f"job {j.job}: not steered yet: its uncapped steps read no time or energy (GPU readings stalled?)"
        if not job.grid:
            self._build_grid(job, g, base)
        # ---- drift while settled: a new phase of the job
        if job.phase == "settled" and job.settled is not None and same_setting(job.current, job.settled):
            drift = phase_change(job, self.min_steps, self.retune_drift, self.noise)
            if drift is not None:
                self._retune(job, drift)
                return f"job {j.job}: {drift}; measuring the uncapped baseline again"
            fell = sped_up(job, self.min_steps, self.noise) if job.spans_nodes and not job.slots else None
            if fell is not None:
                self._slots(job, j, f"the job's step fell {fell:+.0%} at the setting held", by_step=True)
            elif job.spans_nodes and not job.slots and not ask_pending(job):
                waits = waits_more(job, self.min_steps, self.noise)
                if waits is not None:  # (its ask comes back to every node in the agreed pace: asked above)
                    job.last_event = (
                        f"{waits:+.0%} energy per FLOP at the same step: its GPUs wait longer on the other "
                        f"nodes; asks every node to re-check from step {place_ask(job, j.run_steps or j.steps)}"
                    )
        if job.phase == "search" and (not job.current.uncapped or job.looking):
            have = ev.get(job.current, Evidence()).steps
            if have < job.need:
                return (
                    f"job {j.job}: searching, measuring {job.current.label} "
                    f"({have}/{job.need} steps; {n_measured(ev)} candidates measured)"
                )
        action = self._plan(job, ev, g, j)
        target = job.grid[action.index]
        if action.kind == "measure":
            if job.phase == "settled":
                job.last_event = "evidence changed: searching again"
            job.phase = "search"
            job.settled = None
            self._switch(job, target)
            job.need = action.steps
            have = ev.get(target, Evidence()).steps if same_setting(target, job.current) else 0
            return (
                f"job {j.job}: searching, measuring {target.label} "
                f"({have}/{action.steps} steps; {n_measured(ev)} candidates measured)"
            )
        # settle
        if job.phase != "settled" or job.settled is None or not same_setting(job.settled, target):
            job.phase, job.look_from = "settled", None
            job.settled, job.held_allowed = target, job.allowed
            job.ref, job.samples = None, []
            if job.settled_job_steps is None:
                job.settled_job_steps = j.steps - job.start_steps
        self._switch(job, target)
        here = self._evidence(job).get(target, Evidence())
        if job.ref is None and job.live is not None and job.live.steps >= self.min_steps and job.pace.ref is None:
            job.ref = job.live if job.pace.held else here  # (paced: once its move is checked)
        if job.live is not None:
            job.samples.append(job.live)
            del job.samples[:-_SAMPLES_KEEP]
        # ---- time to re-check the baseline?
        due = snap.t_s >= job.next_recheck_s
        if job.spans_nodes and self.recheck_s > 0 and here.steps > 0 and here.time_s > 0:
            # (every node of the job at the same steps: a power of two, as often as recheck_s allows)
            fit = min(RECHECK_SHARE * self.baseline_steps, self.recheck_s * here.steps / here.time_s)
            every = 1 << max(int(math.log2(max(fit, 1.0))), (2 * self.baseline_steps).bit_length())
            due = (j.run_steps or j.steps) // every > job.rechecked_steps // every
        if not target.uncapped and job.ref is not None and (not job.rechecked_once or due):
            self._switch(job, UNCAPPED)
            job.phase, job.recheck, job.live = "recheck", Evidence(), None
            return f"job {j.job}: re-checking the uncapped baseline (0/{self.baseline_steps} steps)"
        return settled_line(j.job, job, ev, target, bound_text(self.objective, self.eta, self.max_slowdown, job))

    def _slots(self, job: _Job, j: JobView, why: str, by_step: bool, asked: bool = False) -> None:
        """Re-check the baseline at the job's next two slots, as its other nodes do (_recheck.py)."""
        job.slots, job.slots_by_step = slots(j.run_steps or j.steps, slot_steps(self.baseline_steps)), by_step
        job.slots_asked = asked
        job.last_event = f"{why}: re-checks with its other nodes at steps {job.slots[0]} and {job.slots[1]}"

    def _baseline_need(self, base: Evidence | None) -> int:
        """Steps the uncapped baseline needs: every comparison leans on it, so a
        noisy job measures it twice as long (``4 * min_steps``) as a quiet one."""
        short = 2 * self.min_steps
        if base is not None and base.steps >= short and base.se_time(self.noise) <= 0.0025:
            return short
        return self.baseline_steps

    def _finish_recheck(self, snap: Snapshot, job: _Job, recheck_ev: Evidence, steps: int) -> None:
        base = job.cache.get(UNCAPPED, Evidence())
        slot, job.slot_recheck, retunes = job.slot_recheck, False, job.retunes
        job.recheck, job.live = None, None
        job.rechecked_once = True
        job.next_recheck_s = snap.t_s + self.recheck_s if self.recheck_s > 0 else math.inf
        if not slot:  # (a slot never moves the power-of-two re-checks: _recheck.py)
            job.rechecked_steps = steps
        job.phase = "search"
        if min(recheck_ev.flops, recheck_ev.time_s, recheck_ev.energy_j) <= 0:
            job.last_event = "baseline re-check read no FLOPs, time or energy: not taken"
        elif base.steps == 0 or min(base.time_s, base.energy_j) <= 0:
            job.cache[UNCAPPED] = recheck_ev
        elif not (slot and judge_slot(job, base, recheck_ev, self.noise, self._retune, steps)):
            judge_recheck(job, base, recheck_ev, self.noise, self.retune_drift, self._retune)
        if slot and not job.slots and job.retunes == retunes and job.slots_by_step:  # (its own pair found nothing)
            job.ask_quiet, job.step_quiet = job.ask_quiet or job.slots_asked, job.step_quiet or not job.slots_asked

    # ------------------------------------------------------------------ the search

    def _plan(self, job: _Job, ev: dict[Setting, Evidence], g: GpuView, j: JobView) -> _Action:
        """Replay the search over the evidence: what to measure next, or where to settle."""
        grid = job.grid
        top = len(grid) - 1
        base = ev[UNCAPPED]
        at: list[Evidence | None] = [ev.get(s) for s in grid]
        at[top] = base
        seen = {i: e for i, e in enumerate(at) if e is not None and e.steps > 0}  # the measured settings' evidence
        measured = list(seen)
        base_tpf_s = base.time_per_flop_s
        se_base = base.se_time(self.noise)
        ratio: dict[int, float] = {}
        ratio_se: dict[int, float] = {}
        for i in measured:
            e = at[i]
            assert e is not None
            ratio[i] = e.time_per_flop_s / base_tpf_s
            ratio_se[i] = 0.0 if i == top else math.hypot(e.se_time(self.noise), se_base) * ratio[i]
        fit, fit_se = antitonic_fit(measured, ratio, ratio_se, {i: e.steps for i, e in seen.items()})
        cost_mode = self.objective == "cost"
        n_gpus = max(1, len(job.gpus))
        pmax_w = float(g.power_limit_max_w or 0.0) * n_gpus

        def objective(i: int) -> float:
            e = at[i]
            assert e is not None
            if cost_mode:
                return self.eta * e.energy_per_flop_j + (1.0 - self.eta) * pmax_w * e.time_per_flop_s
            return e.energy_per_flop_j

        def rel_se(i: int) -> float:
            e = at[i]
            assert e is not None
            se_e = e.se_energy(self.noise)
            return max(se_e, e.se_time(self.noise)) if cost_mode else se_e

        def tol(a: int, b: int) -> float:
            return max(MIN_ENERGY_TOL, Z * math.hypot(rel_se(a), rel_se(b)))

        # ---- what each measured setting shows on its own
        if cost_mode:
            allowed = math.inf
            status = {i: "ok" for i in measured}
        else:
            allowed = self._allowed(base, j, job)
            job.allowed = allowed
            status = {}
            held, lines = job.held_index, Lines(seen, ratio, ratio_se, se_base, allowed, self.noise, self.power_step_w)
            for i in measured:
                r, se = ratio[i], ratio_se[i]
                long = seen[i].steps >= LONG * self.max_steps or job.levels[i] in job.fine_w  # (a second look's)
                z = Z_LONG if job.knob == "power" and long else Z
                for_itself = job.fine_w + job.again_w  # (levels measured on for their own sake)
                if seen[i].steps > LONG * self.max_steps and job.levels[i] not in for_itself and z == Z_LONG:
                    z = Z_LINE_END  # (measured on for a line's sake: its own test was the one at LONG)
                by_line = lines.vouched(job, i)  # (a second look's try, by the line through its neighbours)
                # The setting we hold was within the bound when we settled: it stays so
                # until it is clearly over (no flapping at the edge of the bound), unless
                # the bound itself tightened since (a job's floor or pace came in).
                kept = i == held and r <= allowed + Z * se and allowed >= job.held_allowed * (1 - TIGHTER)
                if i == top or r <= allowed * (1 + 1e-9) - z * se or by_line or kept:
                    status[i] = "ok"
                elif r > allowed + Z * se or seen[i].steps >= self.max_steps:
                    status[i] = "over"  # a point still unsure after max_steps: the safe side
                else:
                    status[i] = "unsure"
        candidates = [i for i in measured if status[i] == "ok"]
        best = best_candidate(candidates, objective, tol, job.held_index)
        # ---- a challenger to the setting we hold is measured again before we move: among
        # several candidates one beats the held setting by chance more often than one
        # comparison's noise margin says; measured twice as long, a fluke falls back.
        held = job.held_index
        if held is not None and best != held and held in candidates:
            steps = seen[best].steps
            if steps < 2 * self.min_steps:
                return _Action("measure", best, 2 * self.min_steps)

        def over(i: int) -> bool:
            """Too slow for the bound (or, cost mode: its time cost alone is more than the
            best cost found), by its own measurement and by the monotone fit."""
            if cost_mode:
                lower = (fit[i] - Z * fit_se[i]) * base_tpf_s * (1.0 - self.eta) * pmax_w
                return lower > objective(best) * (1 + MIN_ENERGY_TOL)
            return status[i] == "over" and fit[i] - Z * fit_se[i] > allowed

        zig = job.knob == "power" and not cost_mode  # measured power-limit curves zig-zag

        def own(i: int) -> bool:  # over by its own steps too on zig-zag curves (Z_LONG: a false "over" drops all below)
            return over(i) and (not zig or ratio[i] - Z_LONG * ratio_se[i] > allowed)

        # ---- the floor: two neighbouring settings both over rule out everything below
        floor = 0
        for i in measured:
            if i < top and own(i) and (i == 0 or (i - 1 in fit and own(i - 1))):
                floor = max(floor, i + 1)
        # ---- a setting too close to the bound to call, that might be the best: measure more
        for i in measured:
            if status[i] == "unsure" and i >= floor and objective(i) < objective(best):
                return _Action("measure", i, min(self.max_steps, seen[i].steps + self.min_steps))
        # ---- a coarse pass from the top down, stopping at the first setting over the bound
        stride = max(1, math.ceil(top / COARSE_POINTS))
        for c in range(top - stride, floor - 1, -stride):
            if c not in fit:
                return _Action("measure", c, self.min_steps)
            if over(c) or status[c] == "over":
                break
        # ---- refine around the best: its neighbours on both sides must be measured
        below = max((i for i in measured if floor <= i < best), default=floor - 1)
        if best - below > 1:
            return _Action("measure", best - (best - below) // 2, self.min_steps)
        above = min(i for i in measured if i > best) if best < top else top
        if above - best > 1:
            return _Action("measure", best + (above - best) // 2, self.min_steps)
        if not cost_mode and (mid := open_boundary(measured, candidates, floor, objective, best)) is not None:
            return _Action("measure", mid, self.min_steps)  # (the boundary bracketed to neighbours)

        # ---- one bad setting rules nothing out alone: measure the setting below it. Bad:
        # too slow; or, for the cost, worse than the best by more than the noise (real
        # curves are not smooth: a measured limit can be several percent off its
        # neighbours for no physical reason, and the cost has no bound to stop at).
        def bad(i: int) -> bool:
            if over(i) or status[i] == "over":
                return True
            return cost_mode and objective(i) > objective(best) * (1 + tol(i, best))

        slow = max((i for i in measured if floor <= i < best and bad(i)), default=None)
        if slow is not None and slow - 1 >= floor and slow - 1 not in fit:
            return _Action("measure", slow - 1, self.min_steps)
        low = min(measured)  # the lowest measured, bad but near the bound, no floor below it: the next down
        if zig and floor < low < best and bad(low) and ratio[low] <= allowed * PLATEAU:
            return _Action("measure", low - 1, self.min_steps)
        if job.knob == "power" and floor < low and not bad(low):  # the lowest measured is fine: below it too
            return _Action("measure", low - 1, self.min_steps)  # (a job whose draw stays under the limits)
        # ---- before settling first: the least-cost candidate, if it lost only to the
        # noise margin, is measured longer (up to max_steps), so that a move later is rare
        if job.settled_index is None:
            least = min(candidates, key=objective)
            e = at[least]
            if least != best and e is not None and e.steps < self.max_steps:
                return _Action("measure", least, min(self.max_steps, e.steps + self.min_steps))
        # ---- a second look, once settled with the baseline re-checked (policies/_finer.py)
        if not cost_mode and (job.looking or may_look(job, best)):
            was, n = job.looking, LONG * self.max_steps
            job.look_from = job.look_from if was else job.settled  # (settled there: may_look)
            job.look_start = job.look_start if was else j.steps
            gain = {i: objective(i) < objective(best) * (1 - GAIN_LONG) for i in measured}
            prize = [i for i in measured if i < best and status[i] != "ok" and gain[i]]
            if j.steps - job.look_start >= LOOK_STEPS * self.max_steps:
                prize = []  # the look's time is up (it ends settled well before a 1,000-step job does)
            if prize and base.steps < BASE_LONG * self.baseline_steps and Z * se_base > MIN_ENERGY_TOL / 3:
                return _Action("measure", top, BASE_LONG * self.baseline_steps)  # every ratio leans on it
            for i in prize:  # near the bound: measured longer (judged at the end)
                if ratio[i] <= allowed + Z * ratio_se[i] and seen[i].steps < n:
                    return _Action("measure", i, n)
                if lines.again(job, i, n):  # (read within the bound, but unsure: once more as long)
                    return _Action("measure", i, 2 * n)
            up = min((k for k in measured if k > max(prize)), default=top) if prize else top  # may close a bracket:
            if up != top and status[up] != "ok" and ratio[up] <= allowed + Z_LONG * ratio_se[up] and seen[up].steps < n:
                return _Action("measure", up, n)
            # The bracket: the lowest limit within the bound above the highest prize, and the one below it
            hi = min((k for k in measured if k > max(prize) and status[k] == "ok"), default=None) if prize else None
            if job.fine < MAX_FINE and hi is not None and hi - 1 in seen and status[hi - 1] != "ok":
                if (act := lines.next_try(job, hi, best, n, objective)) is not None:
                    return _Action("measure", *act)
            job.look_from, job.looked = None, job.looked or was or bool(prize)  # (one look a search: finer.may_look)
            job.rechecked_once = job.rechecked_once and not was  # (the job may have changed during a look)
        return _Action("settle", best)

    def _allowed(self, base: Evidence, j: JobView, job: _Job) -> float:
        """The allowed time ratio to the local uncapped baseline (``pace_room``: over a fresh pace, pace_fresh)."""
        allowed = 1.0 + self.max_slowdown
        fresh = False
        if self.pace_room and base.time_s > 0 < base.flops:
            held = j.held_pace_s / step_flops(job, base) if j.held_pace_s else None  # (s per FLOP)
            fresh = pace_fresh(job, base.time_per_flop_s, j.pace_count, held)
        if j.pace_s is not None and j.pace_s > 0 and fresh:
            pace_tpf = j.pace_s / step_flops(job, base)  # s per FLOP at the agreed pace
            if pace_tpf > base.time_per_flop_s:
                allowed *= pace_tpf / base.time_per_flop_s
        share = floor_share(job, base, j) if base.time_s > 0 < base.flops else 1.0  # (kept and reported either way)
        if not self.pace_room:
            allowed *= share
        return allowed
