"""Drive a policy against simulated GPUs, the way the daemon does, without a daemon.

:func:`run_policy` is the daemon's decision loop in miniature, on a fake clock:

1. every iteration each active job runs one step on each of its GPUs with
   :meth:`greend.probes.sim.SimGpu.run_step` at the setting in force; the fake clock
   advances by the slowest step (jobs on disjoint GPUs run side by side);
2. the job's :class:`~greend.policies.base.JobMeasure` accumulates those steps (sim
   durations and energies, times optional multiplicative noise, as a real
   measurement would carry), skipping ``settle_steps`` after each change;
3. every ``decision_every_steps`` iterations (or every ``decision_period_s``
   simulated seconds) it builds a :class:`~greend.policies.base.Snapshot`, calls
   ``policy.decide(snap, state)`` and applies the decision with
   ``set_locked_clocks`` / ``reset_locked_clocks`` / ``set_power_limit_w``;
   a job whose GPUs' setting changed gets a fresh measure.

Phase changes (a job's FLOPs or memory share switching at a step), jobs that
arrive later, and stragglers are described by :class:`SimJob`: a GPU that is slower
from the start or throttles for a span of the job's steps (:class:`Straggle`), and an
uneven stage (``work``: one GPU's share of the FLOPs above the others'). The result holds a per-step
trace, totals, and per job the steps its search took (until the policy first
said ``settled``) and the final setting. Everything is ``source="sim"``.

Use :func:`make_sim_gpus` for GPUs on a :class:`FakeClock` in a temporary
directory (on ``/dev/shm`` when there is one: each step writes the device file).
"""

from __future__ import annotations

import math
import os
import random
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from greend.policies.base import Decision, GpuView, JobMeasure, JobView, Setting, Snapshot
from greend.probes.sim import H100, SimGpu, SimSpec

__all__ = [
    "FakeClock",
    "HarnessResult",
    "JobResult",
    "SimJob",
    "StepRecord",
    "Straggle",
    "make_sim_gpus",
    "run_policy",
]


# A job given a pace_s of its own (a slower node's, constant): its ranks agree it every this
# many steps (sync_every), the first agreement that carries it the second (a node's pace
# goes out after its baseline, the ranks write it at the next agreement, read it at the one after).
PACE_EVERY = 100


class FakeClock:
    """A clock the harness advances by simulated step durations."""

    def __init__(self, t0_s: float = 1000.0) -> None:
        self.t_s = t0_s

    def __call__(self) -> float:
        return self.t_s

    def advance(self, dt_s: float) -> None:
        self.t_s += max(0.0, dt_s)


def make_sim_gpus(
    n: int, clock: FakeClock | None = None, *, spec: SimSpec = H100, state_dir: Path | str | None = None
) -> tuple[list[SimGpu], FakeClock]:
    """``n`` fresh simulated GPUs at default settings on a fake clock. Without
    ``state_dir`` their files go to a directory of their own that no other object
    writes, so they never look at the files again for another writer's changes (their
    own are seen at once) where they would stat the file at every reading."""
    clock = clock or FakeClock()
    refresh_s = 0.0
    if state_dir is None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        state_dir = tempfile.mkdtemp(prefix="greend-harness-", dir=base)
        refresh_s = math.inf
    return [SimGpu(state_dir, i, spec, clock, refresh_s=refresh_s) for i in range(n)], clock


@dataclass(frozen=True)
class Phase:
    at_step: int  # the job's own step count at which this phase begins
    flops_per_step: float
    mem_share: float


@dataclass(frozen=True)
class Straggle:
    """One of a job's GPUs runs ``factor`` times slower (its speed factor: a GPU that runs
    hot and throttles) from the job's step ``start_step`` until ``stop_step`` (None: to
    the end). Start 0 and no stop: a GPU slower all along."""

    gpu: int
    factor: float
    start_step: int = 0
    stop_step: int | None = None

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"straggle on gpu{self.gpu}: factor must be > 0, got {self.factor}")
        if self.stop_step is not None and self.stop_step <= self.start_step:
            raise ValueError(f"straggle on gpu{self.gpu}: stop_step {self.stop_step} <= start_step {self.start_step}")

    def active(self, step: int) -> bool:
        return step >= self.start_step and (self.stop_step is None or step < self.stop_step)


@dataclass
class SimJob:
    """A simulated training job: where it runs, what its steps are, when it runs."""

    job: str
    gpus: tuple[int, ...]
    flops_per_step: float  # per GPU per step
    mem_share: float
    precision: str = "fp32"
    start_iter: int = 0  # harness iteration at which it arrives
    steps: int | None = None  # how many steps it runs (None: to the end)
    phases: tuple[Phase, ...] = ()  # later phases (at the job's own step count)
    pace_s: float | None = None
    pace_count: int | None = None  # agreements on pace_s received so far (None: as PACE_EVERY says)
    floor_s: float | None = None  # the fastest uncapped step any node measured, as agreed (run_nodes)
    recheck_at: int = 0  # the latest job step a node asked every node to re-check from, as agreed (run_nodes)
    straggles: tuple[Straggle, ...] = ()  # slower or throttling GPUs (their speed factor)
    work: dict[int, float] = field(default_factory=dict)  # GPU -> FLOPs multiplier (an uneven stage)

    def speed_of(self, gpu: int, step: int) -> float:
        """The speed factor of ``gpu`` at the job's step ``step`` (1: at full speed)."""
        f = 1.0
        for s in self.straggles:
            if s.gpu == gpu and s.active(step):
                f *= s.factor
        return f

    def workload(self, step: int) -> tuple[float, float]:
        flops, m = self.flops_per_step, self.mem_share
        for p in sorted(self.phases, key=lambda p: p.at_step):
            if step >= p.at_step:
                flops, m = p.flops_per_step, p.mem_share
        return flops, m


@dataclass(frozen=True)
class StepRecord:
    iteration: int
    job: str
    job_step: int
    setting: Setting
    duration_s: float  # true (model) duration of the step
    energy_j: float  # true energy of the step, all the job's GPUs
    measured_duration_s: float  # what the measure saw (with noise)
    measured_energy_j: float
    flops: float  # all the job's GPUs
    mem_share: float
    sm_clock_mhz: int
    phase: str  # the policy's phase for this job when the step ran ("" if none)
    counted: bool  # False during settle steps


@dataclass
class JobResult:
    job: str
    steps: int = 0
    energy_j: float = 0.0
    time_s: float = 0.0
    flops: float = 0.0
    search_steps: int | None = None  # steps before the policy first said settled
    final_setting: Setting = field(default_factory=Setting)
    settings_applied: int = 0


@dataclass
class HarnessResult:
    trace: list[StepRecord]
    jobs: dict[str, JobResult]
    decisions: list[tuple[float, Decision]]
    total_energy_j: float
    total_time_s: float
    source: str = "sim"

    @property
    def search_steps(self) -> int | None:
        """The first job's search steps (the single-job case)."""
        return next(iter(self.jobs.values())).search_steps if self.jobs else None

    @property
    def final_setting(self) -> Setting:
        return next(iter(self.jobs.values())).final_setting if self.jobs else Setting()

    def settled_steps(self, job: str | None = None) -> list[StepRecord]:
        """Steps that ran while the policy said the job was settled."""
        return [r for r in self.trace if r.phase == "settled" and (job is None or r.job == job)]


@dataclass
class _Acc:
    setting: Setting
    steps: int = 0
    flops: float = 0.0
    time_s: float = 0.0
    energy_j: float = 0.0
    time_sq: float = 0.0
    energy_sq: float = 0.0
    skip: int = 0
    since_s: float = 0.0  # the simulated time it started: a new measure, as the daemon's

    def count(self, time_s: float, energy_j: float, flops: float) -> bool:
        """One step (its measured time and energy), or one of the steps left out after a
        change (``skip``): whether it counted."""
        if self.skip > 0:
            self.skip -= 1
            return False
        self.steps += 1
        self.flops += flops
        self.time_s += time_s
        self.energy_j += energy_j
        self.time_sq += time_s * time_s
        self.energy_sq += energy_j * energy_j
        return True

    def measure(self) -> JobMeasure | None:
        if self.steps == 0:
            return None
        return JobMeasure(
            setting=self.setting,
            steps=self.steps,
            flops=self.flops,
            time_s=self.time_s,
            energy_j=self.energy_j,
            power_w=self.energy_j / self.time_s if self.time_s > 0 else None,
            time_sq_s2=self.time_sq,
            energy_sq_j2=self.energy_sq,
            since_s=self.since_s,
        )


def _in_force(g: SimGpu) -> Setting:
    lc = g.locked_clocks_mhz()
    pl = g.power_limit_w()
    return Setting(
        clock_cap_mhz=lc[1] if lc else None,
        power_limit_w=None if abs(pl - g.spec.power_limit_default_w) < 0.5 else pl,
    )


def _apply(g: SimGpu, s: Setting) -> None:
    """Apply a Setting like the daemon's actuators: idempotent, clamped."""
    cur = _in_force(g)
    if s.clock_cap_mhz != cur.clock_cap_mhz:
        if s.clock_cap_mhz is None:
            g.reset_locked_clocks()
        else:
            g.set_locked_clocks(g.spec.sm_clock_min_mhz, int(s.clock_cap_mhz))
    want_pl = g.spec.power_limit_default_w if s.power_limit_w is None else s.power_limit_w
    want_pl = min(max(want_pl, g.spec.power_limit_min_w), g.spec.power_limit_max_w)
    if abs(want_pl - g.power_limit_w()) >= 0.001:
        g.set_power_limit_w(want_pl)


def _apply_decision(decision: Decision, jobs: Sequence[SimJob], by_index: dict[int, SimGpu]) -> None:
    """Apply a decision as the daemon does: each job's setting on its GPUs, then its
    per-GPU settings (pacing) on those of its GPUs, then the node's own per-GPU settings."""
    for job, s in decision.settings.items():
        target = next((x for x in jobs if x.job == job), None)
        for i in target.gpus if target is not None else ():
            _apply(by_index[i], s)
    for job, per_gpu in decision.job_gpu_settings.items():
        target = next((x for x in jobs if x.job == job), None)
        for i, s in per_gpu.items():
            if target is not None and i in target.gpus:
                _apply(by_index[i], s)
    for i, s in decision.gpu_settings.items():
        if i in by_index:
            _apply(by_index[i], s)


def run_policy(
    policy: Any,
    gpus: Sequence[SimGpu],
    flops_per_step: float = 1e12,
    mem_share: float = 0.0,
    precision: str = "fp32",
    *,
    steps: int = 1000,
    decision_every_steps: int | None = 1,
    decision_period_s: float | None = None,
    settle_steps: int = 1,
    noise: float = 0.0,
    util_noise: float = 0.0,
    seed: int = 0,
    phase_change_at: int | None = None,
    phase_flops_per_step: float | None = None,
    phase_mem_share: float | None = None,
    pace_s: float | None = None,
    jobs: Sequence[SimJob] | None = None,
    cpu_power_w: float | None = None,
    clock: FakeClock | None = None,
) -> HarnessResult:
    """Run ``steps`` iterations of simulated training under ``policy``.

    Without ``jobs``: one job ``job0`` on all ``gpus`` with ``flops_per_step``
    (per GPU), ``mem_share`` and, optionally, a phase change at step
    ``phase_change_at``. ``noise``: relative standard deviation of the
    multiplicative noise on each measured step time and energy (seeded).
    ``util_noise``: the same on each GPU's busy share per period (``util_pct``, at
    most 100: a real reading over a ~1 s window varies by a percent or more).
    Decisions every ``decision_every_steps`` iterations, or every
    ``decision_period_s`` simulated seconds when that is given.
    """
    if jobs is None:
        phases: tuple[Phase, ...] = ()
        if phase_change_at is not None:
            phases = (
                Phase(
                    phase_change_at,
                    phase_flops_per_step or flops_per_step,
                    mem_share if phase_mem_share is None else phase_mem_share,
                ),
            )
        jobs = [
            SimJob("job0", tuple(range(len(gpus))), flops_per_step, mem_share, precision, phases=phases, pace_s=pace_s)
        ]
    if decision_period_s is None and (decision_every_steps is None or decision_every_steps < 1):
        raise ValueError("give decision_every_steps >= 1 or decision_period_s > 0")
    by_index = {g.index: g for g in gpus}
    for sj in jobs:
        missing = [i for i in sj.gpus if i not in by_index]
        if missing:
            raise ValueError(f"job {sj.job}: GPU(s) {missing} not among the harness GPUs")
    clk = clock if clock is not None else _find_clock(gpus)
    rng = random.Random(seed)
    util_rng = random.Random(seed + 1)  # (its own stream: runs without it draw as before)
    state = policy.new_state()
    trace: list[StepRecord] = []
    decisions: list[tuple[float, Decision]] = []
    results = {sj.job: JobResult(sj.job) for sj in jobs}
    accs: dict[str, _Acc] = {}
    job_steps = {sj.job: 0 for sj in jobs}
    phase_of: dict[str, str] = {}
    period_energy = {g.index: 0.0 for g in gpus}
    period_busy = {g.index: 0.0 for g in gpus}
    period_time = 0.0
    last_clock = {g.index: 0 for g in gpus}
    t_start = clk() if clk is not None else 0.0
    sim_t = 0.0
    next_decision_s = decision_period_s or 0.0
    total_energy = 0.0

    def active(sj: SimJob, it: int) -> bool:
        return it >= sj.start_iter and (sj.steps is None or job_steps[sj.job] < sj.steps)

    def job_setting(sj: SimJob) -> Setting:
        return _in_force(by_index[sj.gpus[0]])

    def job_settings(sj: SimJob) -> tuple[Setting, ...]:
        return tuple(_in_force(by_index[i]) for i in sj.gpus)

    for it in range(steps):
        # ---- run one step of every active job
        dt_iter = 0.0
        for sj in jobs:
            if not active(sj, it):
                continue
            flops, m = sj.workload(job_steps[sj.job])
            setting = job_setting(sj)
            acc = accs.get(sj.job)
            if acc is None:
                acc = accs[sj.job] = _Acc(setting, skip=0, since_s=sim_t)
            dur, en, clk_mhz = 0.0, 0.0, 0
            for i in sj.gpus:
                g = by_index[i]
                speed = sj.speed_of(i, job_steps[sj.job])
                if sj.straggles and abs(g.speed_factor() - speed) > 1e-12:
                    g.set_speed_factor(speed)
                c = g.run_steps([(flops * sj.work.get(i, 1.0), m, sj.precision)], defer=True)[0]
                dur = max(dur, c.duration_s)
                en += c.energy_j
                period_energy[i] += c.energy_j
                period_busy[i] += c.duration_s
                last_clock[i] = c.sm_clock_mhz
                clk_mhz = c.sm_clock_mhz
            n_dur = dur * max(0.05, 1.0 + rng.gauss(0.0, noise)) if noise > 0 else dur
            n_en = en * max(0.05, 1.0 + rng.gauss(0.0, noise)) if noise > 0 else en
            counted = acc.count(n_dur, n_en, flops * len(sj.gpus))
            job_steps[sj.job] += 1
            r = results[sj.job]
            r.steps += 1
            r.energy_j += en
            r.time_s += dur
            r.flops += flops * len(sj.gpus)
            total_energy += en
            trace.append(
                StepRecord(
                    it,
                    sj.job,
                    job_steps[sj.job],
                    setting,
                    dur,
                    en,
                    n_dur,
                    n_en,
                    flops * len(sj.gpus),
                    m,
                    clk_mhz,
                    phase_of.get(sj.job, ""),
                    counted,
                )
            )
            dt_iter = max(dt_iter, dur)
        if dt_iter == 0.0:
            dt_iter = 0.01  # nothing running: time still passes
        sim_t += dt_iter
        period_time += dt_iter
        if clk is not None:
            clk.advance(dt_iter)
        # ---- decide?
        if decision_period_s is not None:
            if sim_t < next_decision_s:
                continue
            next_decision_s = sim_t + decision_period_s
        elif (it + 1) % int(decision_every_steps or 1) != 0:
            continue
        snap = _snapshot(
            t_start + sim_t,
            gpus,
            jobs,
            accs,
            job_steps,
            it,
            active,
            period_energy,
            period_busy,
            last_clock,
            cpu_power_w,
            period_time,
            (util_noise, util_rng),
        )
        period_energy = {g.index: 0.0 for g in gpus}
        period_busy = {g.index: 0.0 for g in gpus}
        period_time = 0.0
        decision = policy.decide(snap, state)
        decisions.append((snap.t_s, decision))
        jd = decision.details.get("jobs", {}) if isinstance(decision.details, dict) else {}
        # ---- apply
        before = {sj.job: job_settings(sj) for sj in jobs}
        _apply_decision(decision, jobs, by_index)
        for sj in jobs:
            if job_settings(sj) != before[sj.job]:
                accs[sj.job] = _Acc(job_setting(sj), skip=settle_steps, since_s=sim_t)
                results[sj.job].settings_applied += 1
            info = jd.get(sj.job) if isinstance(jd, dict) else None
            ph = info.get("phase", "") if isinstance(info, dict) else ""
            phase_of[sj.job] = ph
            r = results[sj.job]
            if ph == "settled" and r.search_steps is None:
                r.search_steps = job_steps[sj.job]
    for g in gpus:
        g.commit()  # (the steps are booked in memory as they run: the files get them now)
    for sj in jobs:
        results[sj.job].final_setting = job_setting(sj)
    return HarnessResult(
        trace=trace, jobs=results, decisions=decisions, total_energy_j=total_energy, total_time_s=sim_t
    )


def _find_clock(gpus: Sequence[SimGpu]) -> FakeClock | None:
    for g in gpus:
        c = getattr(g, "_clock", None)
        if isinstance(c, FakeClock):
            return c
    return None


def _snapshot(
    t_s: float,
    gpus: Sequence[SimGpu],
    jobs: Sequence[SimJob],
    accs: dict[str, _Acc],
    job_steps: dict[str, int],
    it: int,
    active: Any,
    period_energy: dict[int, float],
    period_busy: dict[int, float],
    last_clock: dict[int, int],
    cpu_power_w: float | None,
    period_time: float = 0.0,
    util_noise: tuple[float, random.Random] | None = None,
) -> Snapshot:
    views = []
    for g in gpus:
        s = _in_force(g)
        # Jobs run back to back on their GPUs (the harness's lockstep is only
        # bookkeeping): a busy GPU shows its power while busy, an idle one idle_w.
        busy = period_busy[g.index]
        power = period_energy[g.index] / busy if busy > 0 else g.spec.idle_w
        util = min(100.0, 100.0 * busy / period_time) if period_time > 0 else None
        if util is not None and util_noise is not None and util_noise[0] > 0:
            util = min(100.0, max(0.0, util * (1.0 + util_noise[1].gauss(0.0, util_noise[0]))))
        views.append(
            GpuView(
                index=g.index,
                source="sim",
                power_w=power,
                sm_clock_mhz=float(last_clock[g.index] or 0) or None,
                clock_cap_mhz=s.clock_cap_mhz,
                power_limit_w=g.power_limit_w(),
                supported_sm_clocks_mhz=g.spec.supported_sm_clocks_mhz,
                power_limit_min_w=g.spec.power_limit_min_w,
                power_limit_max_w=g.spec.power_limit_max_w,
                power_limit_default_w=g.spec.power_limit_default_w,
                util_pct=util,
            )
        )
    jvs = []
    for sj in jobs:
        if not active(sj, it + 1) and job_steps[sj.job] == 0:
            continue
        running = sj.steps is None or job_steps[sj.job] < sj.steps
        acc = accs.get(sj.job)
        first = next(g for g in gpus if g.index == sj.gpus[0])
        # The agreements received so far: none yet, no pace (a daemon hears the first one
        # when the ranks read the first epoch any rank wrote one in: step 200 at PACE_EVERY)
        count = sj.pace_count if sj.pace_count is not None else max(0, job_steps[sj.job] // PACE_EVERY - 1)
        jvs.append(
            JobView(
                job=sj.job,
                gpus=tuple(sj.gpus),
                state="running" if running else "ended",
                steps=job_steps[sj.job],
                precision=sj.precision,
                precisions=(sj.precision,),
                measure=acc.measure() if acc is not None else None,
                setting=_in_force(first),
                pace_s=sj.pace_s if count > 0 else None,
                floor_s=sj.floor_s,
                recheck_at=sj.recheck_at,
                pace_count=count,
            )
        )
    return Snapshot(t_s=t_s, gpus=tuple(views), jobs=tuple(jvs), cpu_power_w=cpu_power_w)
