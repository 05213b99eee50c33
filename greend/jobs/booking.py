"""Booking what a job's ranks report onto the job's records: pure bookkeeping.

Every function here takes typed values (the decoded rows of
:mod:`greend.protocol`, what a device model made of them, the time as a number) and
changes the records it is given (:mod:`greend.jobs.records`); it holds no lock, reads
no clock, knows no socket and runs no device model. The registry calls it under its
lock and emits what it returns.

A row of ``steps`` consecutive steps at one precision is booked as that many steps
equal in FLOPs (and, where a device model executed them, in time and energy). The
job's totals, its recent steps (the sliding window), its losses (the precision
policy's evidence), the policy's measure since the setting in force took effect, its
baseline (uncapped at the level it started at: what its savings are judged against)
and the rank's aggregate for the stores all come from the same row.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any, Literal

from greend.errors import ProtocolError
from greend.jobs.execution import ExecutedRow
from greend.jobs.records import (
    CapChange,
    EfficiencySample,
    Job,
    Measure,
    PrecisionChange,
    Proposal,
    RankSession,
    StepAggregate,
    StepRecord,
)
from greend.protocol import PRECISIONS, PrecisionEventEntry, StepsRow, may_run

__all__ = [
    "MAX_BASELINE_SPANS",
    "NOT_TAKEN_STEPS",
    "add_to_aggregate",
    "append_bounded",
    "book_baseline",
    "book_cap_change",
    "book_host_cpu",
    "book_precision_event",
    "book_process_cpu",
    "book_row",
    "book_proposal",
    "book_proposals_not_taken",
    "book_withdrawal",
    "follow_ranks",
    "run_step",
    "shed_step_records",
    "thinned",
]

MAX_BASELINE_SPANS = 1000  # a baseline keeps at most this many windows of its steps
# A proposal the job ran this many steps past at its old level is logged as not taken,
# or three of its ranks' agreement periods (sync_every, 100 by default: a switch waits up
# to two periods after the last daemon's word) where they said it, whichever is longer.
NOT_TAKEN_STEPS = 100
NOT_TAKEN_PERIODS = 3
# Ranks that probe (they registered probe_every) start a step down with a trial: their
# steps stay at the old level for up to this many steps more, but for the trial's blocks
# (greend.training.probe: 148 at most; tests/training/test_probe.py holds the two together).
TRIAL_STEPS = 150
LogName = Literal["precision_log", "decisions", "gone"]


def book_row(
    job: Job,
    rank: RankSession,
    row: StepsRow,
    executed: ExecutedRow | None,
    now_s: float,
    *,
    t_wall_s: float = 0.0,
    max_entries: int = 256,
    started_s: float = float("-inf"),
) -> None:
    """Book a row of ``row.steps`` consecutive steps of ``rank`` (one of ``job``'s ranks),
    executed by a device model as ``executed`` (None: on a real GPU), and add it to the
    rank's aggregate of its precision for the stores (``now_s``, monotonic, starts one
    where there is none; the registry writes them out once a store interval).

    The job's level follows its ranks' rows: once every rank of the job here has run a
    row at a new level, that is the job's level (logged at ``t_wall_s``, as the switch
    or rollback the daemon proposed, else as the ranks' own switch) and its measure
    starts afresh with this row. Rows at another level than the job's are left out of
    the measure (no level's evidence is another's)."""
    n = row.steps
    flops = row.flops
    precision = row.precision or job.precision
    probe = row.probe and row.precision is not None
    if probe:
        # Probe steps at the level above the job's (or a step down's trial blocks below
        # it): billed at their level, never a switch, and their losses are not the job's
        # level's (the rank judges them). They end a baseline span: the ledger's energy
        # over a span is the baseline's, and theirs is another level's.
        job.probe_steps += n
        job.baseline.span_open = False
    elif job.top_precision is None:
        # A client that did not say its level (an older one): its first steps run at the
        # job's own level, the top of its ladder from now on.
        job.precision = job.top_precision = precision
    if row.precision is not None and not probe and row.last_step >= rank.precision_from_step:
        # (A row of steps before the rank's own rollback, arriving after its event, is
        # that rollback's past: it moves no level.)
        rank.precision = row.precision
        follow_ranks(job, row, t_wall_s=t_wall_s, max_entries=max_entries)
    t0, t1 = row.t0_s, row.t1_s
    modelled_s = executed.duration_s if executed is not None else None
    modelled_j = executed.energy_j if executed is not None else 0.0
    if executed is not None:
        job.modelled_time_s += executed.duration_s
        job.modelled_energy_j += executed.energy_j
        for g in rank.gpus:
            job.gpu_modelled_s[g] = job.gpu_modelled_s.get(g, 0.0) + executed.duration_s
    if job.t_start_s is None or t0 < job.t_start_s:
        # (not before the daemon started: a rank's rows queued while none ran, sent once it
        # registered, stretched the job's span back to before any reading: a 1.5 s record
        # read 1,000 s at 4 W)
        job.t_start_s = max(t0, started_s)
    job.last_step_t1_s = max(job.last_step_t1_s or 0.0, t1)
    rank.steps += n
    # A rank's steps over all its sessions: one that reconnected (a record resumed after
    # its heartbeat or connection was lost) goes on counting where it left off.
    done = job.steps_by_rank[rank.rank] = job.steps_by_rank.get(rank.rank, 0) + n
    job.steps = max(job.steps, done)
    job.step_reports += n
    job.flops += flops
    for g in rank.gpus:
        job.gpu_flops[g] = job.gpu_flops.get(g, 0.0) + flops / len(rank.gpus)
    job.samples += row.samples
    job.tokens += row.tokens
    job.step_time_s += row.busy_s
    if row.nonfinite:
        job.nonfinite_steps += row.nonfinite
        job.nonfinite_recent.extend(row.nonfinite_steps or [row.last_step] * min(row.nonfinite, 64))
    if row.loss_n and not probe:
        job.last_loss = row.loss_last if row.loss_last is not None else row.loss_sum / row.loss_n
        # Per-step losses where the client sent them (a job whose precision greend may
        # change), else the row's mean stands for its steps.
        if row.losses:
            job.losses.extend(row.losses)
        else:
            job.losses.append(row.loss_sum / row.loss_n)
    m = job.measure
    if t0 >= m.since_s and precision == job.precision and not probe:
        # Evidence for the setting now in force (rows that began before it settled are
        # left out). Where a model executed the steps, its time and energy; else the
        # measured step time and, at decision time, the ledger's joules.
        m.steps += n
        m.flops += flops
        m.time_s += modelled_s if modelled_s is not None else row.busy_s
        m.time_sq_s2 += modelled_s * modelled_s / n if modelled_s is not None else row.busy_sq_s2
        m.modelled_energy_j += modelled_j
        m.energy_sq_j2 += modelled_j * modelled_j / n
        m.t0_s = t0 if m.t0_s is None else min(m.t0_s, t0)
        m.t1_s = t1 if m.t1_s is None else max(m.t1_s, t1)
        book_baseline(job, row, precision, executed, rank.gpus)
    job.recent.append(StepRecord(t0, t1, flops, row.samples, row.tokens, modelled_s))
    agg = rank.aggs.get(precision)  # one aggregate per precision in a store interval
    if agg is None:
        agg = rank.aggs[precision] = StepAggregate(precision, now_s)
    add_to_aggregate(agg, row, executed)


def follow_ranks(job: Job, row: StepsRow, *, t_wall_s: float, max_entries: int) -> None:
    """The job's level is the level every one of its ranks here reports running (see
    :func:`book_row`); a move there is logged, and the measure starts at ``row``."""
    levels = {rs.precision for rs in job.ranks.values() if rs.precision is not None}
    if len(levels) != 1:
        return  # ranks in transition (or none known): the job's level stays
    (level,) = levels
    if level == job.precision:
        return
    p = job.proposal
    if p is not None and p.level == level:
        change = PrecisionChange(
            t_wall_s, p.kind, job.precision, level, p.reason, row.first_step, job.last_loss, p.trend
        )
        append_bounded(job, "precision_log", change, max_entries)
    # Else a move this daemon did not ask: the ranks report it themselves (a rollback of
    # their own or another rank's, as a precision_event, logged when it comes), or it is
    # the job's own level seen at its first steps. The level is followed either way.
    job.precision = level
    job.precision_since_steps = job.steps  # (this row's steps are not counted yet: they are the level's)
    job.proposal = None
    job.measure = Measure(since_s=row.t0_s)


def book_baseline(
    job: Job, row: StepsRow, precision: str, executed: ExecutedRow | None, gpus: list[int] | None = None
) -> None:
    """A settled row: book it to the job's baseline if it ran uncapped at the job's own
    level (the one it registered with, else its first row's: a record begun while the
    job ran below its own level, after a daemon restart, measures its baseline once the
    job is back there, not at the level it came in at). The per-step cost per FLOP (the model's joules,
    else seconds) feeds the baseline's standard error: a modelled row's steps are equal;
    measured, its steps' times come as a sum and a sum of squares over equal FLOPs."""
    b = job.baseline
    if b.precision is None:
        b.precision = job.top_precision or precision
    if job.capped or precision != b.precision:
        b.span_open = False
        return
    n, flops = row.steps, row.flops
    b.steps += n
    b.flops += flops
    b.time_s += executed.duration_s if executed is not None else row.busy_s
    b.modelled_energy_j += executed.energy_j if executed is not None else 0.0
    if executed is not None and gpus:
        for g in gpus:  # (the rank's FLOPs split evenly over its GPUs, as the job's are)
            b.gpu_flops[g] = b.gpu_flops.get(g, 0.0) + flops / len(gpus)
            b.gpu_modelled_s[g] = b.gpu_modelled_s.get(g, 0.0) + executed.duration_s
    if flops >= n:  # at least one FLOP a step (the protocol's floor): a per-step cost is defined
        per_step = flops / n
        if executed is not None:
            x = executed.energy_j / flops
            b.x_sum += n * x
            b.x_sq += n * x * x
        else:
            b.x_sum += row.busy_s / per_step
            b.x_sq += row.busy_sq_s2 / (per_step * per_step)
        b.x_n += n
    if b.spans and b.span_open:
        b.spans[-1][1] = max(b.spans[-1][1], row.t1_s)
    elif len(b.spans) < MAX_BASELINE_SPANS:
        b.spans.append([row.t0_s, row.t1_s])
        b.span_open = True


def add_to_aggregate(agg: StepAggregate, row: StepsRow, executed: ExecutedRow | None) -> None:
    """Add a row of steps to a rank's aggregate for the stores."""
    if agg.steps == 0:
        agg.first_step = row.first_step
    agg.steps += row.steps
    agg.last_step = row.last_step
    agg.duration_s += row.busy_s
    agg.duration_sq_s2 += row.busy_sq_s2
    agg.flops += row.flops
    agg.samples += row.samples
    agg.tokens += row.tokens
    agg.nonfinite += row.nonfinite
    if row.loss_n:
        agg.loss_sum += row.loss_sum
        agg.loss_n += row.loss_n
        mean = row.loss_sum / row.loss_n
        agg.loss_min = min(agg.loss_min, row.loss_min if row.loss_min is not None else mean)
        agg.loss_max = max(agg.loss_max, row.loss_max if row.loss_max is not None else mean)
    if executed is not None:
        agg.modelled = True
        agg.modelled_time_s += executed.duration_s
        agg.modelled_energy_j += executed.energy_j


# CPU time ---------------------------------------------------------------------------
def book_process_cpu(job: Job, rank: RankSession, cpu_s: float) -> None:
    """The rank's process is at ``cpu_s`` CPU seconds: add what it used since last seen."""
    if rank.cpu_last_s is not None:
        job.cpu_job_s += max(0.0, cpu_s - rank.cpu_last_s)
    rank.cpu_last_s = cpu_s


def book_host_cpu(job: Job, process_cpu_s: Mapping[int, float], node_cpu_busy_s: float) -> None:
    """The host probe's CPU seconds of processes (by pid): each of the job's ranks it
    saw books what it used since last seen. The job's CPU share counts the node's busy
    time from ``node_cpu_busy_s`` on, the first time one of its ranks is seen."""
    seen = False
    for rs in job.ranks.values():
        cpu = process_cpu_s.get(rs.pid)
        if cpu is None:
            continue
        seen = True
        book_process_cpu(job, rs, cpu)
    if seen and job.cpu_busy0_s is None:
        job.cpu_busy0_s = node_cpu_busy_s


# The job's logs ---------------------------------------------------------------------
def append_bounded(job: Job, log_name: LogName, entry: Any, max_entries: int) -> None:
    """Append to one of the job's logs, dropping (and counting) the oldest beyond ``max_entries``."""
    entries = getattr(job, log_name)
    entries.append(entry)
    over = len(entries) - max_entries
    if over > 0:
        del entries[:over]
        setattr(job, f"{log_name}_dropped", getattr(job, f"{log_name}_dropped") + over)


def book_precision_event(
    job: Job, event: PrecisionEventEntry, *, rank: int, t_wall_s: float, now_s: float, max_entries: int
) -> bool:
    """A rank changed or refused a level on its own: log it, and follow it (a rollback
    is the job's level from now, measured afresh from ``now_s``; a refusal leaves the
    job at the level the rank kept). Whether it was logged (not where another rank told
    the same move at the same step). An event that names a level above the job's own is
    refused (:class:`ProtocolError`): greend never runs a job above its own level, and its
    record would then say it did."""
    top = job.top_precision
    ran = [("from", event.from_level)] + ([] if event.kind == "refused" else [("to", event.to_level)])
    for name, level in ran:  # (a refusal's "to" is the level asked, which may be above)
        if top is not None and level in PRECISIONS and not may_run(level, top):
            raise ProtocolError(
                f"'{name}' {level!r} is above the own level {top!r} of job {job.job!r} (greend never runs a job "
                "above its own level)",
                field=name,
            )
    change = PrecisionChange(
        t_wall_s,
        event.kind,
        event.from_level,
        event.to_level,
        event.reason or "",
        event.step,
        event.loss,
        event.trend,
        rank=rank,
    )
    p = job.proposal
    if event.kind == "rollback" and p is not None and p.level == event.from_level != job.precision:
        # The rank ran the proposed level (it rolls back from it) before its rows there
        # arrived: the switch is logged first, so the log tells the whole move.
        switched = PrecisionChange(t_wall_s, p.kind, job.precision, p.level, p.reason, None, job.last_loss, p.trend)
        append_bounded(job, "precision_log", switched, max_entries)
    # The ranks that agree on their level tell the same move at the same step, each: logged
    # once (a 2-rank job's one rollback read as two).
    same = (event.kind, event.from_level, event.to_level, event.step)
    told = event.step is not None and any(
        (c.kind, c.from_level, c.to_level, c.step) == same and c.rank != rank for c in job.precision_log[-8:]
    )
    if not told:
        append_bounded(job, "precision_log", change, max_entries)
    _follow_event(job, event, rank, now_s)
    return not told


def _follow_event(job: Job, event: PrecisionEventEntry, rank: int, now_s: float) -> None:
    """The job's level after a rank's own event (:func:`book_precision_event`)."""
    rs = next((r for r in job.ranks.values() if r.rank == rank), None)
    if event.kind == "rollback" and event.to_level:
        job.precision = event.to_level
        job.precision_since_steps = job.steps
        job.measure = Measure(since_s=now_s)
        if rs is not None:
            rs.precision = event.to_level  # (its next rows say so too)
            if event.step is not None:
                rs.precision_from_step = event.step + 1  # the rolled-back step ran the old level
        if job.proposal is not None and job.proposal.level != event.to_level:
            job.proposal = None  # the ranks decided otherwise
    elif event.kind == "refused" and event.from_level:
        job.precision = event.from_level  # the rank kept running at its old level
        if job.proposal is not None and job.proposal.level == event.to_level:
            job.proposal = None


def run_step(job: Job) -> int:
    """The job's step in its run, as its ranks number them: the steps this record counted,
    after those its ranks had sent before it began (a daemon restarted under the run)."""
    return (job.steps_before or 0) + job.steps


def book_proposal(
    job: Job,
    level: str,
    reason: str,
    *,
    kind: str,
    trend: float | None,
    t_wall_s: float,
    max_entries: int,
) -> None:
    """The daemon asks the job's ranks to run ``level``: log the proposal. The job's level
    and measure stay until the ranks' rows arrive at ``level`` (:func:`follow_ranks`)."""
    change = PrecisionChange(
        t_wall_s, "proposed", job.precision, level, f"{kind}: {reason}", run_step(job), job.last_loss, trend
    )
    append_bounded(job, "precision_log", change, max_entries)
    job.proposal = Proposal(level, job.precision, kind, reason, trend, job.steps, t_wall_s)


def book_withdrawal(job: Job, reason: str, *, t_wall_s: float, max_entries: int) -> None:
    """The daemon asks the job's level in force again: its standing proposal is withdrawn."""
    p = job.proposal
    if p is None:
        return
    change = PrecisionChange(t_wall_s, "withdrawn", job.precision, p.level, reason, run_step(job), job.last_loss, None)
    append_bounded(job, "precision_log", change, max_entries)
    job.proposal = None


def book_proposals_not_taken(job: Job, *, t_wall_s: float, max_entries: int) -> PrecisionChange | None:
    """A proposal the job ran ``NOT_TAKEN_STEPS`` steps past (or three of its ranks'
    agreement periods, if longer; ``TRIAL_STEPS`` more where they probe) without its ranks applying
    it: logged once as not taken (no rollback, no bar: its level never ran). It stands:
    the ranks may still agree on it (another rank's daemon may ask it later)."""
    p = job.proposal
    periods = [rs.sync_every for rs in job.ranks.values() if rs.sync_every]
    wait = max([NOT_TAKEN_STEPS, *(NOT_TAKEN_PERIODS * n for n in periods)])
    if job.ranks and all(rs.probe_every for rs in job.ranks.values()):
        wait += TRIAL_STEPS  # (a step down's trial, before the ranks run the new level)
    if p is None or p.not_taken_logged or job.steps - p.step < wait:
        return None
    p.not_taken_logged = True
    reason = (
        f"the job's ranks ran {job.steps - p.step} steps at {job.precision} since {p.level} was proposed "
        f"(in a job of several ranks, the ranks agree on the most precise level any of them asks)"
    )
    change = PrecisionChange(t_wall_s, "not taken", job.precision, p.level, reason, run_step(job), job.last_loss, None)
    append_bounded(job, "precision_log", change, max_entries)
    return change


def book_cap_change(
    job: Job,
    *,
    t_wall_s: float,
    clock_cap_mhz: int | None,
    power_limit_w: float | None,
    reason: str,
    max_entries: int,
) -> None:
    """The policy moved the job's GPUs to this setting (kept for its report); the job's
    steps from now are its baseline only if it is uncapped."""
    append_bounded(job, "decisions", CapChange(t_wall_s, clock_cap_mhz, power_limit_w, reason), max_entries)
    job.capped = clock_cap_mhz is not None or power_limit_w is not None
    job.cap_changes += 1


# An ended job -----------------------------------------------------------------------
def thinned(series: deque[EfficiencySample], points: int) -> deque[EfficiencySample]:
    """Every k-th sample of ``series`` and its last, at most ``points`` + 1 of them."""
    n = len(series)
    if n <= points:
        return series
    k = -(-n // points)  # ceil
    kept = [e for i, e in enumerate(series) if i % k == 0]
    if (n - 1) % k:
        kept.append(series[-1])
    return deque(kept, maxlen=series.maxlen)


def shed_step_records(job: Job, series_points: int) -> None:
    """An ended job keeps its summary: its step records go, and its series is thinned to
    ``series_points`` (enough for its report's plot)."""
    job.recent.clear()
    job.losses.clear()
    job.nonfinite_recent.clear()
    job.series = thinned(job.series, series_points)
