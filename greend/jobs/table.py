"""The node's jobs under one lock, and what the rest of the daemon reads and records of
them: each job's figures and store points (:mod:`greend.jobs.report` computes them),
and the control loop's side (what a policy sees of a job, the setting changes and
precision switches it records, the directives pushed to a job's ranks).

:class:`JobTable` is the base of :class:`greend.jobs.registry.JobRegistry`, which adds
the ranks' sessions, the jobs' lifecycle and the tick; the records change under the
one lock (:attr:`JobTable._lock`) whichever side changes them.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from greend.jobs.booking import book_cap_change, book_proposal, book_proposals_not_taken, book_withdrawal, run_step
from greend.jobs.claims import steered_gpus
from greend.jobs.ledger import Ledger
from greend.jobs.records import EfficiencySample, Job, Measure, PrecisionChange, RankChannel
from greend.jobs.report import JobFigures
from greend.points import Point, decision_point, efficiency_point, job_point, precision_fields, ts_ns
from greend.protocol import may_run, not_above

if TYPE_CHECKING:
    from greend.policies.base import JobMeasure, JobView
    from greend.settings import Setting

__all__ = ["MAX_NOTE_CHARS", "JobTable"]

log = logging.getLogger(__name__)
PUSH_RETRIES = 50  # ticks a push a rank missed (busy sending) is tried again

MAX_NOTE_CHARS = 1000  # a policy's note on a job is cut to this many characters


def finite(figures: dict[str, Any]) -> dict[str, Any]:
    """A job's figures with every float that is not finite as None ("not known"). The
    protocol bounds every number that comes in, so none should be; this is the guarantee
    that a figure gone wrong reads as unknown rather than breaking every reply, point and
    report that carries it."""
    return {k: _finite(v) for k, v in figures.items()}


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class JobTable:
    """The node's jobs (by id) under one lock; see the module's docstring."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        hostname: str,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        window_s: float = 10.0,
        grid_gco2_per_kwh: float = 400.0,
        modelled_gpu: Callable[[int], bool] = lambda i: False,
        emit: Callable[[list[Point]], None] = lambda pts: None,
        max_log_entries: int = 256,
    ) -> None:
        self.ledger = ledger
        self.hostname = hostname
        self.monotonic = monotonic
        # When the daemon started (it sets it): a job's span starts no earlier (-inf: a
        # registry fed made-up times).
        self.started_s = float("-inf")
        self.wall = wall
        self.window_s = window_s
        self.grid_gco2_per_kwh = grid_gco2_per_kwh
        self.modelled_gpu = modelled_gpu  # a device model stands for GPU i (its steps are executed there)
        self.emit = emit
        self.max_log_entries = max_log_entries
        self.jobs: dict[str, Job] = {}
        self._lock = threading.RLock()
        # Held from a directive's booking to its push (never inside _lock): two directives to
        # one job (a policy's, and the one that takes it back) reach its ranks in the order
        # they were booked.
        self._directives = threading.Lock()
        # The latest push of each kind ("directive", "local_pace") to a job that some of its
        # ranks missed, busy sending (Connection.send_bytes with timeout 0): pushed to them
        # again at the next ticks (retry_pushes), at most PUSH_RETRIES times.
        self._unsent: dict[tuple[str, str], tuple[dict[str, Any], list[RankChannel], int]] = {}
        self._node_cpu_busy_s = 0.0  # integral of host utilisation * cpus, for CPU shares
        self.figures = JobFigures(
            ledger,
            hostname=hostname,
            window_s=window_s,
            grid_gco2_per_kwh=grid_gco2_per_kwh,
            modelled_gpu=modelled_gpu,
            node_cpu_busy_s=lambda: self._node_cpu_busy_s,
        )

    # Figures (greend/jobs/report.py computes them) -------------------------------------
    def window(self, job: Job, now_s: float) -> dict[str, Any]:
        """The job's figures over the last ``window_s``, up to ``now_s``."""
        return finite(self.figures.window(job, now_s))

    def report(self, job: Job) -> dict[str, Any]:
        """The job's figures over its life (so far, while it runs), with the count of
        log entries dropped at [daemon] max_log_entries where there were any."""
        r = finite(self.figures.report(job))
        dropped = {
            k: n
            for k, n in (
                ("precision_log", job.precision_log_dropped),
                ("decisions", job.decisions_dropped),
                ("ranks_left", job.gone_dropped),
            )
            if n
        }
        if dropped and "log_dropped" not in r:
            r = {**r, "log_dropped": dropped}
        return r

    def summary_point(self, job: Job) -> Point:
        return job_point(
            ts_ns(self.wall()),
            self.hostname,
            job=job.job,
            precision=job.precision,
            end_reason=job.end_reason or "",
            summary=job.summary or self.report(job),
            kind=job.kind,
        )

    def note_points(self, job: Job, ts: int) -> list[Point]:
        """``greend_decision`` points of kind ``note``: each policy's last word on an
        ended job, at its summary's time ``ts``, for its report from the store."""
        return [
            decision_point(
                ts,
                self.hostname,
                kind="note",
                reason=n["reason"],
                policy=n["policy"],
                job=job.job,
                precision=job.precision if n["role"] == "precision" else "",
            )  # fmt: skip
            for n in job.notes.values()
        ]

    def report_with_series(self, job: Job) -> dict[str, Any]:
        """``report(job)`` plus its time series: a copy made under the lock, so the tick
        thread can neither end the job half-way through nor change what is being sent."""
        with self._lock:
            report = dict(self.report(job))
            report["series"] = [e.to_json() for e in job.series]
            return report

    def tag_runs(self, points: list[Point]) -> None:
        """Give every point of a job its run tag (``run``), so that two runs of one job id
        (a rerun, an id reused) never merge in a store."""
        with self._lock:
            for p in points:
                name = p.tags.get("job")
                if name and "run" not in p.tags:
                    job = self.jobs.get(name)
                    if job is not None:
                        p.tags["run"] = job.run

    def list_jobs(self) -> list[dict[str, Any]]:
        """Every job's row (``greenctl jobs``, ``status``): the columns of its report
        (:data:`greend.jobs.report.ROW_FIELDS`), computed alone."""
        with self._lock:
            out = []
            for job in self.jobs.values():
                row = finite(self.figures.row(job))
                # Once its figures are final (not while it is ending).
                t_end = job.t_end_s if job.state == "ended" else None
                row["ended_at"] = job.registered_wall_s + (t_end - job.registered_s) if t_end is not None else None
                out.append(row)
            return out

    def efficiency_points(self, now_s: float) -> list[Point]:
        """One ``greend_efficiency`` point per running job: the sliding window and the life."""
        pts = []
        ts = ts_ns(self.wall())
        with self._lock:
            for job in self.jobs.values():
                if job.state != "running" or job.t_start_s is None:
                    continue
                try:
                    win = self.window(job, now_s)
                    life = self.report(job)
                except Exception:  # one job's figures gone wrong never stop the tick (a bug: logged)
                    log.exception("job %s: its figures failed; no efficiency point this tick", job.job)
                    continue
                job.series.append(
                    EfficiencySample(
                        t_s=now_s - (job.t_start_s or now_s),
                        power_w=win["gpu_power_w"] or 0.0,
                        gflops_per_w=win["gflops_per_w"] or 0.0,
                        flop_per_s=win["flop_per_s"] or 0.0,
                    )
                )
                pts.append(
                    efficiency_point(ts, self.hostname, job=job.job, precision=job.precision, window=win, life=life)
                )
        return pts

    # What the control loop reads and records ----------------------------------------
    def reset_measure(self, job_id: str, since_s: float) -> None:
        """A new setting took effect: measure afresh from ``since_s``."""
        with self._lock:
            job = self.jobs.get(job_id)
            if job is not None:
                job.measure = Measure(since_s=since_s)

    def reset_measures_on_gpu(self, gpu: int, since_s: float) -> None:
        """A setting of ``gpu`` changed: every running job on it measures afresh."""
        with self._lock:
            for job in self.jobs.values():
                if gpu in job.gpus and job.running:
                    job.measure = Measure(since_s=since_s)

    def measure(self, job: Job, setting: Setting) -> JobMeasure | None:
        """The job's :class:`greend.policies.base.JobMeasure` since its setting took effect, or None."""
        from greend.policies.base import JobMeasure

        m = job.measure
        if m.steps == 0:
            return None
        modelled = any(self.modelled_gpu(g) for g in job.gpus)
        if modelled:
            energy: float | None = m.modelled_energy_j
        elif m.t0_s is not None and m.t1_s is not None:
            energy = self.figures.gpu_energy(job, m.t0_s, m.t1_s)
        else:
            energy = None
        if energy is None:
            return None
        return JobMeasure(
            setting=setting,
            steps=m.steps,
            flops=m.flops,
            time_s=m.time_s,
            energy_j=energy,
            power_w=energy / m.time_s if m.time_s > 0 else None,
            time_sq_s2=m.time_sq_s2,
            energy_sq_j2=m.energy_sq_j2 if modelled else None,
            since_s=m.since_s,
        )

    def views(self, setting_of: Callable[[int], Setting]) -> list[JobView]:
        """What a policy sees of each running job with GPUs (``setting_of(gpu)``: the
        setting in force on a GPU; a job's is its lowest GPU's), made under the lock."""
        from greend.policies.base import JobView

        out = []
        with self._lock:
            running = [j for j in self.jobs.values() if j.running]
            for job in running:
                # A command measured whole has no training level and reports windows, not
                # steps: no policy tunes or switches it. Only the GPUs its work is seen on,
                # not shared with another job in use (greend.jobs.claims): a claim on an
                # idle GPU is never capped.
                steered = steered_gpus(job, running)
                if not steered or job.kind == "measure":
                    continue
                setting = setting_of(min(steered))
                job.capped = not setting.uncapped
                # The levels every rank runs (one a rank cannot run is no level of the job's).
                offered = [set(rs.precisions) for rs in job.ranks.values() if rs.precisions]
                runs = set.intersection(*offered) if offered else {"fp32"}
                # Never above the job's own level; while that is not known (a client that
                # did not say, before its first steps), only the level in force.
                top = job.top_precision
                precisions = sorted(not_above(runs, top)) if top is not None else [job.precision]
                checks = [rs.reference_every for rs in job.ranks.values()]
                known = [c for c in checks if c is not None]
                probing = [rs.probe_every for rs in job.ranks.values()]
                probe_every = max(p for p in probing if p is not None) if probing and None not in probing else None
                out.append(
                    JobView(
                        job=job.job,
                        gpus=tuple(sorted(steered)),
                        state=job.state,
                        steps=job.steps,
                        precision=job.precision,
                        precisions=tuple(precisions),
                        top_precision=top,
                        proposed_precision=job.proposal.level if job.proposal is not None else None,
                        precision_since_step=job.precision_since_steps,
                        measure=self.measure(job, setting),
                        setting=setting,
                        pace_s=job.pace_s,
                        pace_count=job.pace_count,
                        recheck_at=job.recheck_at,
                        held_pace_s=(job.local_pace or {}).get("step_s"),
                        run_steps=run_step(job),  # (its nodes' daemons count alike: greend.jobs.booking)
                        # A job with ranks on other nodes is held to its floor (policies/efficient_state.floor_share).
                        floor_s=job.floor_s if job.world_size > len(job.ranks) else None,
                        loss_recent=tuple(job.losses),
                        nonfinite_recent=len(job.nonfinite_recent),
                        precision_events=tuple(e.to_json() for e in job.precision_log[-32:]),
                        # Every rank checks on a reference batch: their verdicts (rollbacks) rule.
                        reference_every=max(known) if known and len(known) == len(checks) else None,
                        # Every rank probes the level above: their verdicts (rollbacks) rule.
                        probe_every=probe_every,
                        probe_steps=job.probe_steps,
                    )
                )
        return out

    def steered_gpus(self, job_id: str) -> list[int]:
        """The GPUs a policy's setting for ``job_id`` is applied on (greend.jobs.claims)."""
        with self._lock:
            job = self.jobs.get(job_id)
            if job is None or not job.running:
                return []
            return sorted(steered_gpus(job, [j for j in self.jobs.values() if j.running]))

    def other_users(self, gpu: int, job_id: str) -> list[str]:
        """The running jobs other than ``job_id`` whose claim on ``gpu`` is in use
        (active or trusted: greend.jobs.claims)."""
        with self._lock:
            return sorted(
                j.job
                for j in self.jobs.values()
                if j.running and j.job != job_id and j.claims.get(gpu, "pending") != "pending"
            )

    def get(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)

    def running_ids(self) -> list[str]:
        with self._lock:
            return [j.job for j in self.jobs.values() if j.running]

    def back_to_own_levels(self, reason: str, *, policy: str) -> list[str]:
        """Every running job below its own level, or asked to move, is asked back to its own
        level (a precision policy turned off or replaced: what it set goes back). The jobs asked."""
        with self._lock:
            todo = [
                (j.job, j.top_precision)
                for j in self.jobs.values()
                if j.running and j.top_precision is not None and (j.precision != j.top_precision or j.proposal)
            ]
        asked = [job for job, top in todo if self.switch_precision(job, top, reason, policy=policy)]
        with self._lock:  # the old policy's last word (a level the job no longer runs) goes too
            noted = [j.job for j in self.jobs.values() if j.running and "precision" in j.notes]
        for job in noted:
            self.note(job, policy=policy, role="precision", reason=reason)
        return asked

    def flops_per_step(self, job_id: str) -> float | None:
        """The job's mean FLOPs per reported step, or None before its first step."""
        with self._lock:
            job = self.jobs.get(job_id)
            if job is None or job.steps == 0 or job.step_reports == 0:
                return None
            return job.flops / job.step_reports

    def record_cap_change(
        self, job_id: str, *, clock_cap_mhz: int | None, power_limit_w: float | None, reason: str
    ) -> None:
        """The policy moved the job's GPUs to this setting (kept for its report)."""
        with self._lock:
            job = self.jobs.get(job_id)
            if job is not None:
                book_cap_change(
                    job,
                    t_wall_s=self.wall(),
                    clock_cap_mhz=clock_cap_mhz,
                    power_limit_w=power_limit_w,
                    reason=reason,
                    max_entries=self.max_log_entries,
                )

    def note(self, job_id: str, *, policy: str, role: str, reason: str) -> None:
        """A policy's latest word on a running job (``role``: "clocks" or "precision"):
        kept in its report after the end, so a job that was never capped or never
        switched says why."""
        if not reason:
            return
        with self._lock:
            job = self.jobs.get(job_id)
            if job is None or not job.running:
                return
            old = job.notes.get(role)
            if old is not None and old["policy"] == policy and old["reason"] == reason:
                return
            job.notes[role] = {"policy": policy, "role": role, "reason": reason[:MAX_NOTE_CHARS], "since": self.wall()}

    def switch_precision(
        self,
        job_id: str,
        level: str,
        reason: str,
        *,
        kind: str = "switch",
        trend: float | None = None,
        policy: str,
        valid: Callable[[], bool] | None = None,
    ) -> bool:
        """Propose ``level`` to a running job's ranks (a pushed directive they apply at a
        step boundary, or, in a job of several ranks, agree on); False if the job is not
        running, already there, or already asked for it.

        The proposal is logged as such ("proposed"); the job's level, its measure and
        the "switch" (or, ``kind`` "rollback", the policy found the loss worse than its
        pre-switch ``trend``) in its log follow once its ranks' rows arrive at ``level``
        (:func:`greend.jobs.booking.follow_ranks`), from the first of their steps at it.
        Asking the level in force again withdraws a standing proposal. ``valid``: whether
        the decision still stands (its policy still runs), asked where the proposal is
        booked: a policy turned off after that takes it back with a later directive.
        """
        with self._directives:
            return self._switch(job_id, level, reason, kind=kind, trend=trend, policy=policy, valid=valid)

    def _switch(
        self,
        job_id: str,
        level: str,
        reason: str,
        *,
        kind: str,
        trend: float | None,
        policy: str,
        valid: Callable[[], bool] | None,
    ) -> bool:
        again = False
        with self._lock:
            job = self.jobs.get(job_id)
            if job is None or not job.running:
                return False
            if valid is not None and not valid():
                return False
            if job.precision == level:
                if job.proposal is None:
                    return False
                book_withdrawal(job, reason, t_wall_s=self.wall(), max_entries=self.max_log_entries)
                log_kind = "withdrawn"
            elif job.proposal is not None and job.proposal.level == level:
                again = True  # asked already
            else:
                top = job.top_precision
                if top is None or not may_run(level, top):
                    # Never above the job's own level, nor sideways (a rollback returns to it at most).
                    log.warning(
                        "job %s: not moving it to %s: not below its own level %s (%s)",
                        job_id,
                        level,
                        top or "not known yet",
                        reason,
                    )
                    return False
                book_proposal(
                    job, level, reason, kind=kind, trend=trend, t_wall_s=self.wall(), max_entries=self.max_log_entries
                )
                log_kind = "proposed"
            steps, last_loss = run_step(job), job.last_loss
        self.push(job_id, {"event": "directive", "precision": level, "reason": reason})
        if again:
            # Sent again, quietly (nothing booked or logged): a push that found a rank busy
            # skipped it, and a directive is taken once per level, so a rank that has it
            # already is not moved by it twice.
            return False
        fields = precision_fields(step=steps, loss=last_loss, trend=None if trend is None else float(trend))
        self.emit(
            [
                decision_point(
                    ts_ns(self.wall()),
                    self.hostname,
                    kind=log_kind,
                    reason=reason if log_kind == "withdrawn" else f"{kind}: {reason}",
                    policy=policy,
                    job=job_id,
                    precision=level,
                    fields=fields,
                )
            ]
        )
        log.info("job %s: precision %s %s (%s)", job_id, log_kind, level, reason)
        return True

    def precision_points(self, job: Job, changes: list[PrecisionChange]) -> list[Point]:
        """``greend_decision`` points of entries of the job's precision log that the
        daemon booked from its ranks' rows (switches applied, proposals not taken)."""
        out = []
        for change in changes:
            fields = precision_fields(step=change.step or 0, loss=change.loss, trend=change.trend)
            out.append(
                decision_point(
                    ts_ns(change.t_wall_s),
                    self.hostname,
                    kind=change.kind,
                    reason=change.reason,
                    policy="ranks",
                    job=job.job,
                    precision=change.to_level or "",
                    fields=fields,
                )
            )
        return out

    def proposals_not_taken(self) -> None:
        """Log once each standing proposal its job ran far past without applying it."""
        points: list[Point] = []
        with self._lock:
            for job in self.jobs.values():
                if not job.running or job.proposal is None:
                    continue
                change = book_proposals_not_taken(job, t_wall_s=self.wall(), max_entries=self.max_log_entries)
                if change is not None:
                    log.info("job %s: %s not taken: %s", job.job, change.to_level, change.reason)
                    points += self.precision_points(job, [change])
        if points:
            self.emit(points)

    def push(self, job_id: str, event: dict[str, Any]) -> int:
        """Send an event to every rank of a job; returns how many got it. Never waits on a
        rank (the tick thread pushes): one that reads nothing of what it is sent is cut off."""
        with self._lock:
            job = self.jobs.get(job_id)
            channels = [rs.channel for rs in job.ranks.values() if rs.channel is not None] if job else []
            if job is not None and event.get("event") == "local_pace":  # (a rank registering later gets it)
                pace = {k: v for k, v in event.items() if k != "event"}
                if all(isinstance(v, (int, float)) and math.isfinite(v) for v in pace.values()):
                    job.local_pace = pace
        msg = {"v": 1, "job": job_id, **event}
        sent = 0
        missed: list[RankChannel] = []
        for c in channels:
            try:
                if c.send(msg, timeout_s=0.0):
                    sent += 1
                elif not getattr(c, "closed", False):
                    missed.append(c)  # busy sending: pushed again at the next ticks
            except ValueError as e:  # cannot be encoded (a NaN, an infinity): a bug upstream, not the ranks'
                log.error("job %s: not sent to its ranks, cannot be encoded (%s): %r", job_id, e, event)
                return sent  # (the same message fails on every channel)
        with self._lock:
            key = (job_id, str(event.get("event") or event.get("op")))
            if missed:
                self._unsent[key] = (msg, missed, PUSH_RETRIES)
            else:
                self._unsent.pop(key, None)  # (a newer push of the kind reached them all)
        return sent

    def retry_pushes(self) -> None:
        """Once a tick: push again what ranks busy sending missed (the latest push of each
        kind; a directive is taken once per level, so a rank that has it is not moved twice)."""
        with self._directives:  # (in booking order with the directives: never an older one after a newer)
            with self._lock:
                todo = list(self._unsent.items())
            for key, (msg, channels, left) in todo:
                still = [c for c in channels if not c.send(msg, timeout_s=0.0) and not getattr(c, "closed", False)]
                with self._lock:
                    if key not in self._unsent or self._unsent[key][0] is not msg:
                        continue  # a newer push of the kind since
                    if still and left > 1:
                        self._unsent[key] = (msg, still, left - 1)
                    else:
                        self._unsent.pop(key, None)
