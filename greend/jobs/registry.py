"""Training jobs: who runs on which GPUs, what their steps did, and what it cost.

A job is one or more ranks (training processes) that registered over the socket
with the same job id. Each rank reports its steps (FLOPs, samples, loss, the
monotonic window ``[t0_s, t1_s]``); the job's GPUs are the union of its ranks'.
The registry keeps the sessions, the jobs' lifecycle and the tick; the socket side
is :mod:`greend.jobs.ops` (the only jobs code that sees connections and message
dicts), the booking of typed rows is :mod:`greend.jobs.booking` (pure), and the
jobs under one lock with their figures are :mod:`greend.jobs.table`.

Accounting windows
------------------
The job's life runs from its first step's ``t0_s`` to the moment its last rank
left (``end``, a closed connection, or no heartbeat for ``heartbeat_timeout_s``).
Its GPU energy is the ledger's energy of the job's GPUs over exactly that
window, so idle gaps between steps (data loading, checkpoints) are paid for, as
they are on the electricity bill. GFLOPS/W is the job's FLOPs over the same
joules (FLOP per joule / 1e9 = GFLOP/s per W). A sliding window (the last
``window_s``) gives the same figures for the recent past.

The CPU share beside it: the node's counted CPU energy over the window times the
job processes' share of the node's busy CPU time (from the host probe), or the
whole node's CPU energy where per-process times are unknown (labelled so).

Where a device model stands for a GPU (the simulator), every reported step is
executed on it at the GPU's current settings through the injected
:class:`greend.jobs.execution.StepExecutor` (its time and energy come from the
model, for the step's FLOPs; the job's ``modelled_*`` figures); the training itself
runs for real on the CPU.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from greend.errors import ProtocolError, StateError
from greend.jobs.archive import evict_fairly
from greend.jobs.booking import (
    append_bounded,
    book_host_cpu,
    book_precision_event,
    book_process_cpu,
    book_row,
    shed_step_records,
)
from greend.jobs.claims import PENDING, Lookout, claim_state, merge, note_use, process_tree, strangers
from greend.jobs.execution import ExecutedRow, StepExecutor, no_model
from greend.jobs.ledger import GPU_END_WAIT_S, Ledger, end_wait_s
from greend.jobs.records import (
    DISCONNECTED,
    EXPIRED,
    INTERRUPTED,
    Caller,
    ClaimState,
    Job,
    RankLeft,
    RankSession,
    StepAggregate,
)
from greend.jobs.table import JobTable
from greend.points import Point, decision_point, job_step_point, job_steps_point, precision_fields, ts_ns
from greend.protocol import PrecisionEventEntry, Registration, StepEntry, StepsRow, may_run

__all__ = ["HostCpu", "Job", "JobRegistry", "QuotaExceeded", "RankSession", "Registered"]

log = logging.getLogger(__name__)

# A gap this long between two ticks is the daemon's own stall (SIGSTOP, a paused VM, a
# stuck driver call), not its clients': the stall's length is not held against them.
STALL_GAP_S = 2.0
CLAIM_LOOK_S = 1.0  # pending GPU claims are looked at again this often (greend.jobs.claims)
ENDED_SERIES_POINTS = 600  # an ended job's series (its report's plot) is thinned to this


class QuotaExceeded(Exception):
    """A per-user limit of the registry refused a request; the message names the
    limit's config key (the socket answers it ``refused``)."""


class HostCpu(Protocol):
    """What the tick needs of the host probe's reading: the node's CPU use and the CPU
    seconds of processes (by pid)."""

    @property
    def cpu_util_pct(self) -> float: ...

    @property
    def cpu_count(self) -> int: ...

    @property
    def process_cpu_s(self) -> Mapping[int, float]: ...


@dataclass(frozen=True, slots=True)
class Registered:
    """A rank's registration as booked: the job it joined (its id may differ from the
    one asked, see ``register``), the job's run and the level the daemon asks of it."""

    job: str
    run: str
    precision: str | None  # a standing proposal's level, else the job's level in force; None while not known
    known: bool = True  # False: a rank that ran before this record (a daemon restart) may run another level
    local_pace: dict[str, float] | None = None  # this node's pace as last pushed to the job's ranks (Job.local_pace)


class JobRegistry(JobTable):
    """Jobs of this node and their ranks' sessions. Thread-safe: IPC threads report, the
    tick loop accounts, the control loop reads and records (:class:`JobTable`)."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        hostname: str,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        heartbeat_timeout_s: float = 15.0,
        window_s: float = 10.0,
        execute_steps: StepExecutor = no_model,
        modelled_gpu: Callable[[int], bool] = lambda i: False,
        emit: Callable[[list[Point]], None] = lambda pts: None,
        grid_gco2_per_kwh: float = 400.0,
        keep_ended: int = 200,
        process_cpu: Callable[[int], float | None] = lambda pid: None,
        gpu_indices: Callable[[], list[int] | None] = lambda: None,
        gpu_processes: Callable[[int], set[int] | None] = lambda i: None,
        max_jobs_per_uid: int = 16,
        max_events_per_min_per_uid: int = 120,
        max_log_entries: int = 256,
        max_recent_steps: int = 4096,
        step_interval_s: float = 1.0,
        step_detail: bool = False,
        rows_every_s: float = 0.5,
        check_owner: Callable[[str, int], None] = lambda job, uid: None,
    ) -> None:
        super().__init__(
            ledger,
            hostname=hostname,
            monotonic=monotonic,
            wall=wall,
            window_s=window_s,
            grid_gco2_per_kwh=grid_gco2_per_kwh,
            modelled_gpu=modelled_gpu,
            emit=emit,
            max_log_entries=max_log_entries,
        )
        # Job rows in the stores: one per rank per store interval (greend_job_steps),
        # and with step_detail also one per step (greend_job_step).
        self.step_interval_s = step_interval_s
        self.step_detail = step_detail
        self.rows_every_s = rows_every_s  # how often callbacks send their rows (register reply)
        # Raises PermissionError where a job id is not its caller's to take (a Slurm job
        # of another user's: greend.jobs.slurm).
        self.check_owner = check_owner
        # The node's GPU indices (None: no GPU probe, nothing to claim or cap), and the
        # pids of compute processes on one GPU (None: the device cannot say).
        self.gpu_indices = gpu_indices
        self.gpu_processes = gpu_processes
        self.max_jobs_per_uid = max_jobs_per_uid
        self.max_events_per_min_per_uid = max_events_per_min_per_uid
        self.max_recent_steps = max_recent_steps
        self._events: dict[int, deque[float]] = {}  # per uid: monotonic times of recent precision_events
        self._last_tick_s: float | None = None
        self.stalls = 0  # tick gaps over STALL_GAP_S (the daemon's own stalls)
        self.closing = False  # the daemon stops: no rank registers any more (interrupt_all)
        self.events_refused = 0
        # A rank's process CPU seconds now (None: unknown). Read when a rank registers
        # and when it leaves, so a job's CPU share does not hang on the host probe's
        # once-a-second samples (a job of a few seconds would otherwise show none).
        self.process_cpu = process_cpu
        self.heartbeat_timeout_s = heartbeat_timeout_s
        # The one callable that executes a rank's rows on the device models behind its
        # GPUs (where there are any; see greend.jobs.execution).
        self.execute_steps = execute_steps
        self.keep_ended = keep_ended
        # Jobs whose id a new run took while they were still ending: the tick closes them.
        self._closing: list[Job] = []
        self.sessions: dict[int, RankSession] = {}  # by session (the connection's id)
        self._claims_looked_s = float("-inf")  # the tick's last look at pending claims
        self._lookout = Lookout()  # ...made on a thread of its own
        self._last_host_t: float | None = None
        self.on_job_end: list[Callable[[Job], None]] = []

    # Registration --------------------------------------------------------------------
    def has_session(self, session: int) -> bool:
        """``session`` (a connection) registered a rank that has not left."""
        return session in self.sessions

    def register(self, reg: Registration, caller: Caller) -> Registered:
        """A rank joins its job (a new record, a running job, or one whose ranks' heartbeats
        stopped). Refused (PermissionError) where the job or its GPUs are another user's,
        and past the caller's quota of jobs (:class:`QuotaExceeded`)."""
        if self.closing:
            raise StateError("the daemon is stopping: register again once it runs (the callback retries by itself)")
        if caller.session in self.sessions:
            raise ProtocolError("this connection already registered a rank; open another connection", field="op")
        job_id, run, gpus = reg.job, reg.run, list(reg.gpus)
        self._check_gpus_exist(gpus)
        if not caller.admin:
            self._check_quota(job_id, caller.uid)  # before the owner check: it may ask Slurm
        if caller.uid != 0:
            self.check_owner(job_id, caller.uid)
        claims = self._claims(gpus, caller, job_id)
        now = self.monotonic()
        cpu_now_s = self._process_cpu(caller.pid)
        with self._lock:
            job = self.jobs.get(job_id)
            if job is not None and run is not None and job.run != run:
                if job.state == "running":
                    # Another run under an id in use here (two launches given one GREEND_JOB):
                    # never merged; this run is booked as <id>.<run>.
                    job_id = f"{job_id[: 128 - 1 - len(run)]}.{run}"
                    log.warning("job id %s is in use by run %s; run %s is booked as %s", reg.job, job.run, run, job_id)
                    job = self.jobs.get(job_id)
                else:
                    job = None  # a rerun of an ended job's id: a fresh record, never resumed
            resumable = job is not None and self._resumable(job, caller.uid, run, reg.steps_before, caller.pid)
            if job is not None and job.state != "running" and not resumable:
                # A new run under an ended job's id: start a fresh record.
                job = None
            if job is not None and job.uid != caller.uid and caller.uid != 0:
                raise PermissionError(
                    f"job {job_id!r} belongs to uid {job.uid}; a process of uid {caller.uid} "
                    "cannot join it (use another job id)"
                )
            # Another job's claim never refuses this one by itself: where that job
            # computes on the GPU and this one does not, _claims refused it already (the
            # GPU lists the other's processes); a claim of its that is pending or trusted
            # keeps no one off (greend.jobs.claims).
            if job is None and not caller.admin:
                self._check_quota(None, caller.uid)
            refused = job.rank_held(reg.rank, caller.pid) if job is not None else None
            if refused is not None:
                raise refused
            if job is not None and job.state != "running":
                # The same job back after its ranks expired: its record continues.
                log.info("job %s resumes its record (was %s: %s)", job_id, job.state, job.end_reason)
                job.state, job.end_reason, job.t_end_s, job.summary = "running", None, None, None
            if job is None:
                old = self.jobs.get(job_id)
                if old is not None and old.state == "ending":
                    self._closing.append(old)  # its summary is still to be written
                job = Job(job_id, caller.uid, now, self.wall(), run=run or uuid.uuid4().hex[:12], kind=reg.kind)
                job.recent = deque(maxlen=self.max_recent_steps)
                if reg.precision is not None:
                    job.precision = job.top_precision = reg.precision
                self.jobs[job_id] = job
                self._trim_ended()
                log.info("job %s registered (uid %d)", job_id, caller.uid)
            rs = RankSession(
                session=caller.session,
                job=job_id,
                rank=reg.rank,
                local_rank=reg.local_rank,
                world_size=reg.world_size,
                gpus=gpus,
                pid=caller.pid,
                uid=caller.uid,
                host=reg.host or self.hostname,
                precisions=list(reg.precisions),
                mem_share=reg.mem_share,
                reference_every=reg.reference_every,
                probe_every=reg.probe_every,
                sync_every=reg.sync_every,
                channel=caller.channel,
                last_seen_s=now,
                cpu_last_s=cpu_now_s,
            )
            if cpu_now_s is not None and job.cpu_busy0_s is None:
                job.cpu_busy0_s = self._node_cpu_busy_s
            job.ranks[caller.session] = rs
            job.gpus.update(gpus)
            self._merge_claims(job, claims)
            job.world_size = max(job.world_size, rs.world_size)
            if rs.rank not in job.steps_by_rank and reg.steps_before is not None:
                # Steps the rank sent before this record (a record it resumes holds its own).
                job.steps_before = max(job.steps_before or 0, reg.steps_before)
            job.ranks_seen.add(rs.rank)
            self.sessions[caller.session] = rs
            if job.top_precision is None and reg.precision is not None and not job.steps:
                job.precision = job.top_precision = reg.precision
            # The level the daemon asks of the job: a standing proposal (ranks that probe
            # run a step down's trial at the old level first: one that registers again
            # meanwhile goes on with it), else the level in force.
            asked = job.proposal.level if job.proposal is not None else job.precision
            top = job.top_precision
            if top is not None and asked is not None and not may_run(asked, top):
                # A rank that ran above the job's own level (an older or a confused client):
                # followed in the record, never asked of another.
                log.warning("job %s: its level %s is above its own %s: rank %s is asked %s", job_id, asked, top,
                            rs.rank, top)  # fmt: skip
                asked = top
            known = not (reg.steps_before and not job.steps and job.proposal is None)
            return Registered(job_id, job.run, asked if top is not None else None, known, job.local_pace)

    @staticmethod
    def _resumable(job: Job, uid: int, run: str | None = None, steps_before: int | None = None, pid: int = 0) -> bool:
        """A job record that a re-registration continues: one that ended (or is ending)
        only because its ranks' heartbeats stopped or their connections dropped, taken up
        by a process of the same run that sent steps before (``steps_before``; a process
        that sent none is a new one: a rerun or an elastic restart, a fresh record). A
        client that says neither (an older one) continues it only from a process that left
        it (another one had its run merged; pid 0: as before; a pid past ``gone``'s bound: new)."""
        if (job.uid != uid and uid != 0) or (run is not None and run != job.run):
            return False
        if steps_before == 0:
            return False  # a new process (None: a callback from before it said, judged as before)
        if run is None and steps_before is None and pid > 0 and all(g.pid != pid for g in job.gone):
            return False
        reason = job.end_reason or ""
        return reason.startswith(EXPIRED) or (reason == DISCONNECTED and run is not None)

    def _check_gpus_exist(self, gpus: list[int]) -> None:
        present = self.gpu_indices()
        if present is None:
            return
        missing = [g for g in gpus if g not in present]
        if missing:
            raise ProtocolError(
                f"GPU(s) {missing} do not exist on this node (its GPUs: {sorted(present) or 'none'})", field="gpus"
            )

    def _claims(self, gpus: list[int], caller: Caller, job_id: str) -> dict[int, ClaimState]:
        """Each GPU's claim state for this rank (greend.jobs.claims). A non-root rank may
        not claim a GPU that runs other processes and none of this job's (the rank's,
        its children's, or the job's other ranks')."""
        if not gpus:
            return {}
        mine = process_tree(caller.pid)
        with self._lock:
            job = self.jobs.get(job_id)
            for rs in job.ranks.values() if job is not None and job.running else ():
                mine |= process_tree(rs.pid)
        out: dict[int, ClaimState] = {}
        for g in gpus:
            procs = self.gpu_processes(g)
            if caller.uid != 0 and strangers(procs, mine):
                raise PermissionError(
                    f"GPU {g} runs other processes and none of this job's (pid {caller.pid} and its children): "
                    "a job may claim only the GPUs it uses (check CUDA_VISIBLE_DEVICES)"
                )
            out[g] = claim_state(procs, mine)
        return out

    def _merge_claims(self, job: Job, claims: Mapping[int, ClaimState]) -> None:
        """Book a rank's claims on its job (the lock held), saying what a claim means."""
        for g, state in claims.items():
            old = job.claims.get(g)
            new = merge(old, state)
            if new == old:
                continue
            job.claims[g] = new
            if new == PENDING:
                log.info(
                    "job %s: claim on GPU %d pending (none of its processes computes there yet): not steered",
                    job.job,
                    g,
                )
            else:
                log.info("job %s: claim on GPU %d %s", job.job, g, new)
                note_use(job, g, self.jobs.values())

    def refresh_claims(self) -> None:
        """Look again at the GPUs of pending claims: a claim whose job's process now
        computes there becomes active. NVML is asked outside the registry's lock."""
        with self._lock:
            todo = [
                (
                    job,
                    [g for g, st in job.claims.items() if st == PENDING],
                    [rs.pid for rs in job.ranks.values()],
                )
                for job in self.jobs.values()
                if job.running and PENDING in job.claims.values()
            ]
        if not todo:
            return
        listed: dict[int, set[int] | None] = {}
        seen: list[tuple[Job, dict[int, ClaimState]]] = []
        for job, pending, pids in todo:
            mine = set().union(*(process_tree(p) for p in pids)) if pids else set()
            if not mine:
                continue  # no rank here now: nothing can show up
            states = {}
            for g in pending:
                if g not in listed:
                    listed[g] = self.gpu_processes(g)
                states[g] = claim_state(listed[g], mine)
            seen.append((job, states))
        with self._lock:
            for job, states in seen:
                if job.running:
                    self._merge_claims(job, states)

    def _session(self, session: int) -> RankSession:
        rs = self.sessions.get(session)
        if rs is None:
            raise ProtocolError("register a job on this connection first (op 'register')", field="op")
        return rs

    # Reports -------------------------------------------------------------------------
    def book(self, session: int, rows: Sequence[StepsRow], detail: Sequence[StepEntry] | None = None) -> None:
        """Book ``rows`` to the session's rank (:func:`greend.jobs.booking.book_row`).
        ``detail`` (the same steps as sent, one per row: a "steps" message) also becomes
        greend_job_step points when [store] step_detail asks for them."""
        now = self.monotonic()
        with self._lock:
            rs = self._session(session)
            job = self.jobs[rs.job]
            rs.last_seen_s = now
            gpus, pid, mem_share, precision = list(rs.gpus), rs.pid, rs.mem_share, job.precision
        # A device model runs the rows outside the registry's lock: each run writes a
        # device file (about 0.2 ms), and 64 clients' messages queued behind that lock
        # held up `status` and each other. (This session's messages stay in order: one
        # thread serves it.)
        executed = self.execute_steps(gpus, rows, mem_share=mem_share, precision=precision, pid=pid) if gpus else None
        points: list[Point] = []
        with self._lock:
            rs = self._session(session)
            job = self.jobs[rs.job]
            if executed and PENDING in job.claims.values():
                # A device model ran the rows and listed the rank on its GPUs just now:
                # the use the next look would see (greend.jobs.claims), booked at once.
                self._merge_claims(job, {g: "active" for g in gpus if self.modelled_gpu(g)})
            booked_s = self.monotonic()
            for i, row in enumerate(rows):
                ex = executed[i] if executed else None
                logged = len(job.precision_log) + job.precision_log_dropped
                book_row(job, rs, row, ex, booked_s, t_wall_s=self.wall(), max_entries=self.max_log_entries,
                         started_s=self.started_s)  # fmt: skip
                if len(job.precision_log) + job.precision_log_dropped > logged:
                    points += self.precision_points(job, [job.precision_log[-1]])  # the ranks ran a proposal
                if detail is not None and self.step_detail:
                    points.append(self._detail_point(job, rs, detail[i], ex))
            if rs.aggs and now - min(a.since_s for a in rs.aggs.values()) >= self.step_interval_s:
                points += self._flush_steps(job, rs)
        if points:
            self.emit(points)

    def _steps_point(self, job: Job, rank: int, agg: StepAggregate) -> Point:
        return job_steps_point(
            ts_ns(self.wall()), self.hostname, job=job.job, rank=rank, precision=agg.precision, fields=agg.fields()
        )

    def _flush_steps(self, job: Job, rs: RankSession) -> list[Point]:
        """The rank's aggregates as points (one per precision, oldest first); fresh ones begin."""
        aggs, rs.aggs = rs.aggs, {}
        return [self._steps_point(job, rs.rank, a) for a in sorted(aggs.values(), key=lambda a: a.since_s)]

    def _detail_point(self, job: Job, rs: RankSession, s: StepEntry, executed: ExecutedRow | None) -> Point:
        """One reported step as a greend_job_step point ([store] step_detail)."""
        # The step's end on the wall clock: its monotonic end, as far back from now.
        ts = ts_ns(self.wall() - (self.monotonic() - s.t1_s))
        return job_step_point(
            ts,
            self.hostname,
            job=job.job,
            rank=rs.rank,
            precision=s.precision or job.precision,
            step=s.step,
            duration_s=s.duration_s,
            flops=s.flops,
            samples=s.samples,
            tokens=s.tokens,
            loss=s.loss,
            nonfinite=s.nonfinite,
            sim_duration_s=executed.duration_s if executed is not None else None,
            sim_energy_j=executed.energy_j if executed is not None else 0.0,
        )

    # The session's other ops ---------------------------------------------------------
    def heartbeat(self, session: int) -> None:
        with self._lock:
            rs = self._session(session)
            rs.last_seen_s = self.monotonic()

    def pace(self, session: int, step_s: float, floor_s: float | None = None, recheck_at: int = 0) -> None:
        """The ranks agreed on the job's pace (the slowest node's uncapped step time), floor
        (the fastest uncapped step a node measured; None: none) and re-check asked (op "pace")."""
        with self._lock:
            rs = self._session(session)
            job = self.jobs[rs.job]
            job.pace_s, job.floor_s, job.recheck_at = step_s, floor_s, max(job.recheck_at, recheck_at)
            n = job.pace_ops[rs.rank] = job.pace_ops.get(rs.rank, 0) + 1  # (a rank that reconnects counts on)
            job.pace_count = max(job.pace_count, n)
            rs.last_seen_s = self.monotonic()

    def precision_event(self, caller: Caller, event: PrecisionEventEntry) -> None:
        """The callback changed or refused a level on its own (e.g. rolled back after a
        non-finite loss): record it with its reason and loss figures."""
        with self._lock:
            rs = self._session(caller.session)
            job = self.jobs[rs.job]
            rs.last_seen_s = self.monotonic()
            self._event_rate(caller)
            logged = book_precision_event(
                job, event, rank=rs.rank, t_wall_s=self.wall(), now_s=self.monotonic(), max_entries=self.max_log_entries
            )
        fields = precision_fields(step=event.step or 0, loss=event.loss, trend=event.trend)
        self.emit(
            [  # (once a move: another rank's word of it is stored already)
                decision_point(
                    ts_ns(self.wall()),
                    self.hostname,
                    kind=event.kind,
                    reason=str(event.reason or ""),
                    policy="callback",
                    job=job.job,
                    precision=str(event.to_level or ""),
                    fields=fields,
                )
            ]
            if logged
            else []
        )
        log.info(
            "job %s rank %d: precision %s %s -> %s (%s)",
            job.job,
            rs.rank,
            event.kind,
            event.from_level,
            event.to_level,
            event.reason,
        )

    def _event_rate(self, caller: Caller) -> None:
        """At most max_events_per_min_per_uid precision_events a minute per non-admin uid."""
        if caller.admin:
            return
        now = self.monotonic()
        times = self._events.setdefault(caller.uid, deque())
        while times and times[0] <= now - 60.0:
            times.popleft()
        if len(times) >= self.max_events_per_min_per_uid:
            self.events_refused += 1
            raise QuotaExceeded(
                f"uid {caller.uid} sent {len(times)} precision events in the last minute, the limit per user "
                f"([daemon] max_events_per_min_per_uid = {self.max_events_per_min_per_uid})"
            )
        times.append(now)

    # Leaving -------------------------------------------------------------------------
    def _process_cpu(self, pid: int) -> float | None:
        if pid <= 0:
            return None
        try:
            return self.process_cpu(pid)
        except Exception as e:
            log.debug("process CPU time of pid %d: %s", pid, e)
            return None

    def _final_cpu(self, rs: RankSession) -> None:
        """Book the rank's CPU time since the host probe last saw it (it is leaving)."""
        cpu = self._process_cpu(rs.pid)
        job = self.jobs.get(rs.job)
        if cpu is not None and job is not None:
            book_process_cpu(job, rs, cpu)

    def end(self, session: int, reason: str | None) -> dict[str, Any]:
        """The rank says it is done: it leaves, and gets its job's report (so far)."""
        with self._lock:
            rs = self._session(session)
            job = self.jobs[rs.job]
            self._final_cpu(rs)  # the client is still there: its last CPU seconds count
            self._leave(rs, reason or "finished")
            return self.report(job)

    def disconnected(self, session: int) -> None:
        """The session's connection closed: its rank (if any) is gone."""
        with self._lock:
            rs = self.sessions.get(session)
            if rs is not None:
                self._final_cpu(rs)  # None if the process is gone already
                self._leave(rs, DISCONNECTED)

    def _leave(self, rs: RankSession, reason: str) -> None:
        job = self.jobs.get(rs.job)
        self.sessions.pop(rs.session, None)
        if job is not None and rs.aggs:
            self.emit(self._flush_steps(job, rs))  # its last interval's steps
        if job is None or rs.session not in job.ranks:
            return
        del job.ranks[rs.session]
        append_bounded(job, "gone", RankLeft(rs.rank, rs.pid, reason, rs.steps), self.max_log_entries)
        log.info("job %s: rank %d left (%s)", job.job, rs.rank, reason)
        if not job.ranks and job.state == "running":
            job.state = "ending"
            job.end_reason = reason
            job.t_end_s = self.monotonic()

    def interrupt_all(self, reason: str = INTERRUPTED) -> list[Point]:
        """At the daemon's stop: every rank leaves with ``reason`` and every job still
        running (or ending) ends now, its summary written and archived as any ended job's:
        the part of a run before a restart is kept, not lost with the daemon's memory.
        Returns the points to store."""
        with self._lock:
            self.closing = True  # no new rank from now: its record would never be kept
            for rs in list(self.sessions.values()):
                self._final_cpu(rs)
                self._leave(rs, reason)
            self._last_tick_s = None  # (the jump below is no stall of the daemon)
        # A tick past every end's wait: each ending job ends now (its window up to its end).
        return self.tick(self.monotonic() + GPU_END_WAIT_S + 1.0)

    # The tick side -------------------------------------------------------------------
    def tick(self, now_s: float, host: HostCpu | None = None) -> list[Point]:
        """Expire silent ranks, account CPU time, finish jobs whose end the ledger has seen."""
        self.retry_pushes()  # (what ranks busy sending missed)
        points: list[Point] = []
        ended: list[Job] = []
        if now_s - self._claims_looked_s >= CLAIM_LOOK_S:
            self._claims_looked_s = now_s
            self._lookout.kick(self.refresh_claims)  # (off the tick: a GPU that hangs holds its list)
        with self._lock:
            if host is not None:
                if self._last_host_t is not None:
                    dt = now_s - self._last_host_t
                    self._node_cpu_busy_s += host.cpu_util_pct / 100.0 * host.cpu_count * dt
                self._last_host_t = now_s
            gap = 0.0 if self._last_tick_s is None else now_s - self._last_tick_s
            self._last_tick_s = now_s
            if gap > STALL_GAP_S:
                # The daemon itself stood still (SIGSTOP, a paused VM): its clients'
                # heartbeats could not be read meanwhile, so the stall is not theirs.
                self.stalls += 1
                log.warning("the daemon stalled %.1f s: every rank's heartbeat clock is moved on by as much", gap)
                for rs in self.sessions.values():
                    rs.last_seen_s = min(now_s, rs.last_seen_s + gap)
            for rs in list(self.sessions.values()):
                if now_s - rs.last_seen_s > self.heartbeat_timeout_s:
                    self._leave(rs, f"{EXPIRED} for {self.heartbeat_timeout_s:g} s")
            for job in [*self.jobs.values(), *self._closing]:
                if host is not None and job.state == "running":
                    book_host_cpu(job, host.process_cpu_s, self._node_cpu_busy_s)
                if (
                    job.state == "ending"
                    and job.t_end_s is not None
                    and now_s >= job.t_end_s + end_wait_s(self.ledger, job.t_end_s, job.gpus)
                ):
                    # The ledger now holds a reading at or after the end of each of its GPUs and
                    # CPU zones (the estimate's once a second), or waited: the window is complete.
                    job.state = "ended"
                    job.summary = self.report(job)
                    # Up to keep_ended (200) ended jobs are kept: each without its step
                    # records, its series thinned to what its plot needs.
                    shed_step_records(job, ENDED_SERIES_POINTS)
                    ended.append(job)
        for job in ended:
            log.info("job %s ended (%s): %s", job.job, job.end_reason, _summary_line(job.summary or {}))
            summary = self.summary_point(job)
            notes = self.note_points(job, summary.ts_ns)
            for p in (summary, *notes):
                p.tags["run"] = job.run  # its own run, whoever holds its id by now
            points.append(summary)
            points += notes
            if job in self._closing:
                self._closing.remove(job)
            for cb in self.on_job_end:
                try:
                    cb(job)
                except Exception:
                    log.exception("job-end hook failed")
        return points

    def job_pids(self) -> list[int]:
        with self._lock:
            return [rs.pid for rs in self.sessions.values()]

    def _check_quota(self, job_id: str | None, uid: int) -> None:
        """QuotaExceeded where ``uid`` runs its quota of jobs already and ``job_id`` (None:
        a new record) is not one of them."""
        with self._lock:
            if job_id is not None and job_id in self.jobs:
                return  # (a job it runs, or a record to resume: judged under the lock later)
            mine = sum(1 for j in self.jobs.values() if j.uid == uid and j.state != "ended")
        if mine >= self.max_jobs_per_uid:
            raise QuotaExceeded(
                f"uid {uid} runs {mine} jobs on this node, the limit per user "
                f"([daemon] max_jobs_per_uid = {self.max_jobs_per_uid}): end one, or ask an admin to raise it"
            )

    def _trim_ended(self) -> None:
        ended = [j for j in self.jobs.values() if j.state == "ended"]
        # The oldest of the uid that holds the most: one user's churn evicts only its own.
        for j in evict_fairly(ended, lambda j: j.uid, len(ended) - self.keep_ended):
            self.jobs.pop(j.job, None)


def _summary_line(s: dict[str, Any]) -> str:
    g = s.get("gflops_per_w")
    return (
        f"{s.get('steps', 0)} steps, {s.get('flops', 0):.3g} FLOP, {s.get('gpu_energy_j', 0):.1f} J GPU, "
        f"{'-' if g is None else f'{g:.2f}'} GFLOPS/W"
    )
