"""Training jobs: who runs on which GPUs, what their steps did, and what it cost.

A job is one or more ranks (training processes) that registered over the socket
with the same job id. Each rank reports its steps (FLOPs, samples, loss, the
monotonic window ``[t0_s, t1_s]``); the job's GPUs are the union of its ranks'.

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

On simulated GPUs every reported step is executed by the simulator at the GPU's
current settings (its time and energy come from the model, for the step's
FLOPs); the training itself runs for real on the CPU.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from greend.errors import ProtocolError
from greend.ipc.server import Connection, LimitExceeded
from greend.jobs.ledger import Ledger
from greend.jobs.records import (
    CapChange,
    EfficiencySample,
    Job,
    Measure,
    PrecisionChange,
    RankLeft,
    RankSession,
    StepAggregate,
    StepRecord,
)
from greend.jobs.report import JobFigures
from greend.points import (
    decision_point,
    efficiency_point,
    job_point,
    job_step_point,
    job_steps_point,
    precision_fields,
    ts_ns,
)
from greend.protocol import (
    JOB_ID_RE,
    MAX_ROWS_PER_MESSAGE,
    MAX_STEPS_PER_MESSAGE,
    PRECISIONS,
    RESERVED_OWNERS,
    RUN_ID_RE,
    check_entries,
    check_row,
    check_step,
    step_row,
)
from greend.sinks import Point

if TYPE_CHECKING:
    from greend.policies.base import JobMeasure, JobView, Setting

__all__ = ["Job", "JobRegistry", "RankSession"]

log = logging.getLogger(__name__)

# An ended job waits at most this long past its end for every CPU zone's next reading
# (the host probe's estimate comes once a second; a loaded node may tick late) before its
# summary is made. Only a zone that stopped reading makes a job wait this long.
CPU_END_WAIT_S = 3.0

# A gap this long between two ticks is the daemon's own stall (SIGSTOP, a paused VM, a
# stuck driver call), not its clients': the stall's length is not held against them.
STALL_GAP_S = 2.0
ENDED_SERIES_POINTS = 600  # an ended job's series (its report's plot) is thinned to this
MAX_NOTE_CHARS = 1000  # a policy's note on a job is cut to this many characters
EXPIRED = "no heartbeat"  # how an expired rank's leaving reason starts


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


class JobRegistry:
    """Jobs of this node. Thread-safe: IPC threads report, the tick loop accounts."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        hostname: str,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        heartbeat_timeout_s: float = 15.0,
        window_s: float = 10.0,
        sim_gpu: Callable[[int], Any] = lambda i: None,
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
    ) -> None:
        self.ledger = ledger
        # Job rows in the stores: one per rank per store interval (greend_job_steps),
        # and with step_detail also one per step (greend_job_step).
        self.step_interval_s = step_interval_s
        self.step_detail = step_detail
        self.rows_every_s = rows_every_s  # how often callbacks send their rows (register reply)
        self._flushed: list[Point] = []  # aggregates made under the lock, emitted after it
        # The node's GPU indices (None: no GPU probe, nothing to claim or cap), and the
        # pids of compute processes on one GPU (None: the device cannot say).
        self.gpu_indices = gpu_indices
        self.gpu_processes = gpu_processes
        self.max_jobs_per_uid = max_jobs_per_uid
        self.max_events_per_min_per_uid = max_events_per_min_per_uid
        self.max_log_entries = max_log_entries
        self.max_recent_steps = max_recent_steps
        self._events: dict[int, deque[float]] = {}  # per uid: monotonic times of recent precision_events
        self._last_tick_s: float | None = None
        self.stalls = 0  # tick gaps over STALL_GAP_S (the daemon's own stalls)
        self.events_refused = 0
        # A rank's process CPU seconds now (None: unknown). Read when a rank registers
        # and when it leaves, so a job's CPU share does not hang on the host probe's
        # once-a-second samples (a job of a few seconds would otherwise show none).
        self.process_cpu = process_cpu
        self.hostname = hostname
        self.monotonic = monotonic
        self.wall = wall
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.window_s = window_s
        self.sim_gpu = sim_gpu
        self.emit = emit
        self.grid_gco2_per_kwh = grid_gco2_per_kwh
        self.keep_ended = keep_ended
        self.jobs: dict[str, Job] = {}
        # Jobs whose id a new run took while they were still ending: the tick closes them.
        self._closing: list[Job] = []
        self.sessions: dict[int, RankSession] = {}
        self._lock = threading.RLock()
        self._node_cpu_busy_s = 0.0  # integral of host utilisation * cpus, for CPU shares
        self.figures = JobFigures(
            ledger,
            hostname=hostname,
            window_s=window_s,
            grid_gco2_per_kwh=grid_gco2_per_kwh,
            sim_gpu=sim_gpu,
            node_cpu_busy_s=lambda: self._node_cpu_busy_s,
        )
        self._last_host_t: float | None = None
        self.on_job_end: list[Callable[[Job], None]] = []

    # Registration --------------------------------------------------------------------
    def register(self, msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
        job_id = msg["job"]
        if not JOB_ID_RE.match(job_id):
            raise ProtocolError("'job' must be 1-128 characters of letters, digits and . _ : @ / -", field="job")
        if job_id in RESERVED_OWNERS:
            raise ProtocolError(
                f"job id {job_id!r} is reserved (greend's own settings go by "
                f"{' and '.join(map(repr, RESERVED_OWNERS))}): use another",
                field="job",
            )
        run = msg.get("run") or None
        if run is not None and not RUN_ID_RE.match(run):
            raise ProtocolError("'run' must be 1-64 characters of letters, digits and . _ -", field="run")
        precisions = msg.get("precisions") or ["fp32"]
        bad = [p for p in precisions if p not in PRECISIONS]
        if bad:
            raise ProtocolError(
                f"'precisions' has unknown level {bad[0]!r}; known: {', '.join(PRECISIONS)}", field="precisions"
            )
        gpus = sorted(set(msg.get("gpus") or []))
        if any(g < 0 for g in gpus):
            raise ProtocolError("'gpus' must be node-local indices >= 0", field="gpus")
        if "session" in conn.state:
            raise ProtocolError("this connection already registered a rank; open another connection", field="op")
        self._check_gpus_exist(gpus)
        if conn.peer.uid != 0:
            self._check_gpus_used(gpus, conn.peer.pid, job_id)
        now = self.monotonic()
        cpu_now_s = self._process_cpu(conn.peer.pid)
        with self._lock:
            job = self.jobs.get(job_id)
            if job is not None and run is not None and job.run != run:
                if job.state == "running":
                    # Another run under an id in use here (two launches given one GREEND_JOB):
                    # never merged; this run is booked as <id>.<run>.
                    job_id = f"{job_id[: 128 - 1 - len(run)]}.{run}"
                    log.warning(
                        "job id %s is in use by run %s; run %s is booked as %s", msg["job"], job.run, run, job_id
                    )
                    job = self.jobs.get(job_id)
                else:
                    job = None  # a rerun of an ended job's id: a fresh record, never resumed
            if job is not None and job.state != "running" and not self._resumable(job, conn.peer.uid):
                # A new run under an ended job's id: start a fresh record.
                job = None
            if job is not None and job.uid != conn.peer.uid and conn.peer.uid != 0:
                raise PermissionError(
                    f"job {job_id!r} belongs to uid {job.uid}; a process of uid {conn.peer.uid} "
                    "cannot join it (use another job id)"
                )
            if conn.peer.uid != 0:
                # A job's client steers its own GPUs only: GPUs that a running job of
                # another user holds cannot be claimed (caps would follow the claim).
                for other in self.jobs.values():
                    held = sorted(other.gpus.intersection(gpus))
                    if other.state == "running" and other.uid != conn.peer.uid and held:
                        raise PermissionError(
                            f"GPU(s) {held} are in use by job {other.job!r} of uid {other.uid}; a "
                            f"process of uid {conn.peer.uid} cannot register them (check "
                            "CUDA_VISIBLE_DEVICES, or ask an admin)"
                        )
            if job is None and not conn.state.get("_admin"):
                mine = sum(1 for j in self.jobs.values() if j.uid == conn.peer.uid and j.state != "ended")
                if mine >= self.max_jobs_per_uid:
                    raise LimitExceeded(
                        f"uid {conn.peer.uid} runs {mine} jobs on this node, the limit per user "
                        f"([daemon] max_jobs_per_uid = {self.max_jobs_per_uid}): end one, or ask an admin to raise it"
                    )
            if job is not None and job.state != "running":
                # The same job back after its ranks expired: its record continues.
                log.info("job %s resumes its record (was %s: %s)", job_id, job.state, job.end_reason)
                job.state, job.end_reason, job.t_end_s, job.summary = "running", None, None, None
            if job is None:
                old = self.jobs.get(job_id)
                if old is not None and old.state == "ending":
                    self._closing.append(old)  # its summary is still to be written
                job = Job(job_id, conn.peer.uid, now, self.wall(), run=run or uuid.uuid4().hex[:12])
                job.recent = deque(maxlen=self.max_recent_steps)
                self.jobs[job_id] = job
                self._trim_ended()
                log.info("job %s registered (uid %d)", job_id, conn.peer.uid)
            rs = RankSession(
                session=conn.id,
                job=job_id,
                rank=msg.get("rank") or 0,
                local_rank=msg.get("local_rank") or 0,
                world_size=msg.get("world_size") or 1,
                gpus=gpus,
                pid=conn.peer.pid,
                uid=conn.peer.uid,
                host=msg.get("host") or self.hostname,
                precisions=list(precisions),
                mem_share=msg.get("mem_share"),
                reference_every=msg.get("reference_every"),
                conn=conn,
                last_seen_s=now,
                cpu_last_s=cpu_now_s,
            )
            if cpu_now_s is not None and job.cpu_busy0_s is None:
                job.cpu_busy0_s = self._node_cpu_busy_s
            job.ranks[conn.id] = rs
            job.gpus.update(gpus)
            job.world_size = max(job.world_size, rs.world_size)
            job.ranks_seen.add(rs.rank)
            self.sessions[conn.id] = rs
            conn.state["session"] = conn.id
            return {
                "job": job_id,
                "run": job.run,
                "session": conn.id,
                "heartbeat_s": max(0.5, self.heartbeat_timeout_s / 3.0),
                "directive": {"precision": job.precision},
                # How to send steps: rows summed at the source, or (with [store]
                # step_detail, which stores each step) one entry per step.
                "report": "steps" if self.step_detail else "intervals",
                "rows_every_s": self.rows_every_s,
            }

    @staticmethod
    def _resumable(job: Job, uid: int) -> bool:
        """A job record that a re-registration of the same job continues: one that
        ended (or is ending) only because its ranks' heartbeats stopped; a job that
        ended or disconnected leaves its id to a new run and a fresh record."""
        if job.uid != uid and uid != 0:
            return False
        return (job.end_reason or "").startswith(EXPIRED)

    def _check_gpus_exist(self, gpus: list[int]) -> None:
        present = self.gpu_indices()
        if present is None:
            return
        missing = [g for g in gpus if g not in present]
        if missing:
            raise ProtocolError(
                f"GPU(s) {missing} do not exist on this node (its GPUs: {sorted(present) or 'none'})", field="gpus"
            )

    def _check_gpus_used(self, gpus: list[int], pid: int, job_id: str) -> None:
        """A rank may claim a GPU only where the job's processes run: where the device
        lists compute processes and none is this rank's or a child's, the claim is refused
        (a GPU with no process yet is accepted: CUDA may start after registration)."""
        mine: set[int] | None = None
        for g in gpus:
            procs = self.gpu_processes(g)
            if not procs:
                continue
            if mine is None:
                mine = _process_tree(pid)
                with self._lock:
                    job = self.jobs.get(job_id)
                    if job is not None:
                        for rs in job.ranks.values():
                            mine |= _process_tree(rs.pid)
            if not procs & mine:
                raise PermissionError(
                    f"GPU {g} runs other processes and none of this job's (pid {pid} and its children): "
                    "a job may claim only the GPUs it uses (check CUDA_VISIBLE_DEVICES)"
                )

    def _bounded(self, job: Job, log_name: str, entry: Any) -> None:
        """Append to one of the job's logs, dropping (and counting) the oldest beyond the bound."""
        entries = getattr(job, log_name)
        entries.append(entry)
        over = len(entries) - self.max_log_entries
        if over > 0:
            del entries[:over]
            setattr(job, f"{log_name}_dropped", getattr(job, f"{log_name}_dropped") + over)

    def _session(self, conn: Connection) -> RankSession:
        sid = conn.state.get("session")
        rs = self.sessions.get(sid) if sid is not None else None
        if rs is None:
            raise ProtocolError("register a job on this connection first (op 'register')", field="op")
        return rs

    # Reports -------------------------------------------------------------------------
    # Two forms reach one accounting path (_account_row): "intervals" rows, a rank's
    # steps summed at the source (what the callback sends), and the older per-step
    # "steps" entries, each taken as a row of one step (old clients, and the callback
    # when [store] step_detail asks for a row per step).
    def report_steps(self, msg: dict[str, Any], conn: Connection) -> None:
        steps = self._checked("steps", msg["steps"], MAX_STEPS_PER_MESSAGE, check_step)
        self._account(conn, [step_row(s) for s in steps], detail=steps)

    def report_intervals(self, msg: dict[str, Any], conn: Connection) -> None:
        self._account(conn, self._checked("rows", msg["rows"], MAX_ROWS_PER_MESSAGE, check_row), detail=None)

    def _checked(
        self, name: str, entries: list[Any], limit: int, check: Callable[[dict[str, Any]], dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """The message's entries, each checked (:func:`greend.protocol.check_entries`);
        nothing of a message with a bad entry is booked, nor of one that ends in the future."""
        self._check_not_future(name, check_entries(name, entries, limit, check))
        return entries

    def _check_not_future(self, name: str, entries: list[dict[str, Any]]) -> None:
        now = self.monotonic()
        for i, s in enumerate(entries):
            if s["t1_s"] > now + 1.0:
                raise ProtocolError(
                    f"{name}[{i}]: t1_s = {s['t1_s']} is in the future (send time.monotonic() seconds)",
                    field=f"{name}[{i}].t1_s",
                )

    def _account(self, conn: Connection, rows: list[dict[str, Any]], detail: list[dict[str, Any]] | None) -> None:
        """Book ``rows`` to the connection's rank, under the lock; ``detail`` (the same
        steps as sent, one per row) also becomes greend_job_step points when asked for."""
        now = self.monotonic()
        points: list[Point] = []
        with self._lock:
            rs = self._session(conn)
            job = self.jobs[rs.job]
            rs.last_seen_s = now
            on_sims = self._sim_work(job, rs, rows)
        # The simulated GPUs run the rows outside the registry's lock: each run writes a
        # device file (about 0.2 ms), and 64 clients' messages queued behind that lock
        # held up `status` and each other. (This connection's messages stay in order:
        # one thread serves it.)
        sim = self._run_on_sims(*on_sims) if on_sims is not None else []
        with self._lock:
            rs = self._session(conn)
            job = self.jobs[rs.job]
            for i, r in enumerate(rows):
                sim_duration, sim_energy = sim[i] if sim else (None, 0.0)
                self._account_row(job, rs, r, sim_duration, sim_energy)
                if detail is not None and self.step_detail:
                    points.append(self._detail_point(job, rs, detail[i], sim_duration, sim_energy))
            if rs.agg is not None and now - rs.agg.since_s >= self.step_interval_s:
                self._flushed.append(self._flush_steps(job, rs))
            points += self._flushed
            self._flushed = []
        if points:
            self.emit(points)

    def _flush_steps(self, job: Job, rs: RankSession) -> Point:
        """The rank's aggregate as a point; a fresh one begins."""
        agg = rs.agg
        assert agg is not None
        rs.agg = None
        return job_steps_point(
            ts_ns(self.wall()), self.hostname, job=job.job, rank=rs.rank, precision=agg.precision, fields=agg.fields()
        )

    def _sim_work(
        self, job: Job, rs: RankSession, rows: list[dict[str, Any]]
    ) -> tuple[list[Any], list[tuple[float, float | None, str]], int] | None:
        """What the rows ask of the rank's simulated GPUs (each GPU's share of the FLOPs),
        taken under the lock: (the GPUs, the steps, the rank's pid). None on real GPUs."""
        sims = [g for g in (self.sim_gpu(i) for i in rs.gpus) if g is not None]
        if not sims:
            return None
        work = [(float(r["flops"]) / len(sims), rs.mem_share, r.get("precision") or job.precision) for r in rows]
        return sims, work, rs.pid

    @staticmethod
    def _run_on_sims(
        sims: list[Any], work: list[tuple[float, float | None, str]], pid: int
    ) -> list[tuple[float, float]]:
        """Execute the rows on the simulated GPUs, one device update per GPU for the whole
        message: per row, the slowest GPU's duration and the GPUs' summed energy (a step's
        cost is linear in its FLOPs at fixed settings, so a row costs what its steps would
        one by one)."""
        for g in sims:  # the rank computes there: the GPU's process table lists it
            g.attach_process(pid)
        # Booked at once, written into the device files about once a second (defer).
        per_gpu = [g.run_steps(work, defer=True) for g in sims]
        return [(max(c[i].duration_s for c in per_gpu), sum(c[i].energy_j for c in per_gpu)) for i in range(len(work))]

    def _account_row(
        self, job: Job, rs: RankSession, r: dict[str, Any], sim_duration: float | None, sim_energy: float
    ) -> None:
        """Book a row of ``r["steps"]`` consecutive steps at one precision. Within a row the
        steps are taken as equal in FLOPs (and, on simulated GPUs, in time and energy)."""
        n = int(r["steps"])
        flops = float(r["flops"])
        precision = r.get("precision") or job.precision
        t0, t1 = float(r["t0_s"]), float(r["t1_s"])
        if sim_duration is not None:
            job.sim_time_s += sim_duration
            job.sim_energy_j += sim_energy
        if job.t_start_s is None or t0 < job.t_start_s:
            job.t_start_s = t0
        job.last_step_t1_s = max(job.last_step_t1_s or 0.0, t1)
        rs.steps += n
        job.steps = max(job.steps, max(x.steps for x in job.ranks.values()))
        job.step_reports += n
        job.flops += flops
        for g in rs.gpus:
            job.gpu_flops[g] = job.gpu_flops.get(g, 0.0) + flops / len(rs.gpus)
        samples, tokens = int(r.get("samples") or 0), int(r.get("tokens") or 0)
        job.samples += samples
        job.tokens += tokens
        busy = float(r["busy_s"])
        job.step_time_s += busy
        nonfinite = int(r.get("nonfinite") or 0)
        if nonfinite:
            job.nonfinite_steps += nonfinite
            job.nonfinite_recent.extend(r.get("nonfinite_steps") or [r["last_step"]] * min(nonfinite, 64))
        loss_n = int(r.get("loss_n") or 0)
        if loss_n:
            job.last_loss = float(r["loss_last"]) if r.get("loss_last") is not None else float(r["loss_sum"]) / loss_n
            losses = r.get("losses")
            # Per-step losses where the client sent them (a job whose precision greend may
            # change), else the row's mean stands for its steps.
            if losses:
                job.losses.extend(losses)
            else:
                job.losses.append(float(r["loss_sum"]) / loss_n)
        m = job.measure
        if t0 >= m.since_s:
            # Evidence for the setting now in force (rows that began before it settled
            # are left out). On simulated GPUs the model's time and energy, else the
            # measured step time and, at decision time, the ledger's joules.
            m.steps += n
            m.flops += flops
            step_time = sim_duration if sim_duration is not None else busy
            m.time_s += step_time
            m.time_sq_s2 += sim_duration * sim_duration / n if sim_duration is not None else float(r["busy_sq_s2"])
            m.sim_energy_j += sim_energy
            m.energy_sq_j2 += sim_energy * sim_energy / n
            m.t0_s = t0 if m.t0_s is None else min(m.t0_s, t0)
            m.t1_s = t1 if m.t1_s is None else max(m.t1_s, t1)
            self._book_baseline(job, r, precision, sim_duration, sim_energy)
        job.recent.append(StepRecord(t0, t1, flops, samples, tokens, sim_duration))
        if rs.agg is not None and rs.agg.precision != precision:  # one precision per row
            self._flushed.append(self._flush_steps(job, rs))
        if rs.agg is None:
            rs.agg = StepAggregate(precision, self.monotonic())
        rs.agg.add_row(r, sim_duration, sim_energy)

    def _detail_point(
        self, job: Job, rs: RankSession, s: dict[str, Any], sim_duration: float | None, sim_energy: float
    ) -> Point:
        """One reported step as a greend_job_step point ([store] step_detail)."""
        # The step's end on the wall clock: its monotonic end, as far back from now.
        ts = ts_ns(self.wall() - (self.monotonic() - s["t1_s"]))
        return job_step_point(
            ts,
            self.hostname,
            job=job.job,
            rank=rs.rank,
            precision=s.get("precision") or job.precision,
            step=int(s["step"]),
            duration_s=s["t1_s"] - s["t0_s"],
            flops=float(s["flops"]),
            samples=int(s.get("samples") or 0),
            tokens=int(s.get("tokens") or 0),
            loss=s.get("loss"),
            nonfinite=bool(s.get("nonfinite")),
            sim_duration_s=sim_duration,
            sim_energy_j=sim_energy,
        )

    @staticmethod
    def _book_baseline(
        job: Job, r: dict[str, Any], precision: str, sim_duration: float | None, sim_energy: float
    ) -> None:
        """A settled row: book it to the job's baseline if it ran uncapped at the level
        the job started at (the first row's). The per-step cost per FLOP (simulated
        joules, else seconds) feeds the baseline's standard error: on simulated GPUs a
        row's steps are equal; measured, its steps' times come as a sum and a sum of
        squares over equal FLOPs."""
        b = job.baseline
        if b.precision is None:
            b.precision = precision
        if job.capped or precision != b.precision:
            b.span_open = False
            return
        n, flops = int(r["steps"]), float(r["flops"])
        b.steps += n
        b.flops += flops
        b.time_s += sim_duration if sim_duration is not None else float(r["busy_s"])
        b.sim_energy_j += sim_energy
        if flops > 0:
            per_step = flops / n
            if sim_duration is not None:
                x = sim_energy / flops
                b.x_sum += n * x
                b.x_sq += n * x * x
            else:
                b.x_sum += float(r["busy_s"]) / per_step
                b.x_sq += float(r["busy_sq_s2"]) / (per_step * per_step)
            b.x_n += n
        t0, t1 = float(r["t0_s"]), float(r["t1_s"])
        if b.spans and b.span_open:
            b.spans[-1][1] = max(b.spans[-1][1], t1)
        elif len(b.spans) < 1000:
            b.spans.append([t0, t1])
            b.span_open = True

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
        sim = any(self.sim_gpu(g) is not None for g in job.gpus)
        if sim:
            energy: float | None = m.sim_energy_j
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
            energy_sq_j2=m.energy_sq_j2 if sim else None,
        )

    def views(self, setting_of: Callable[[int], Setting]) -> list[JobView]:
        """What a policy sees of each running job with GPUs (``setting_of(gpu)``: the
        setting in force on a GPU; a job's is its lowest GPU's), made under the lock."""
        from greend.policies.base import JobView

        out = []
        with self._lock:
            for job in self.jobs.values():
                if not job.running or not job.gpus:
                    continue
                setting = setting_of(min(job.gpus))
                job.capped = not setting.uncapped
                precisions = sorted({p for rs in job.ranks.values() for p in rs.precisions}) or ["fp32"]
                checks = [rs.reference_every for rs in job.ranks.values()]
                out.append(
                    JobView(
                        job=job.job,
                        gpus=tuple(sorted(job.gpus)),
                        state=job.state,
                        steps=job.steps,
                        precision=job.precision,
                        precisions=tuple(precisions),
                        measure=self.measure(job, setting),
                        setting=setting,
                        pace_s=job.pace_s,
                        loss_recent=tuple(job.losses),
                        nonfinite_recent=len(job.nonfinite_recent),
                        precision_events=tuple(e.to_json() for e in job.precision_log[-32:]),
                        # Every rank checks on a reference batch: their verdicts (rollbacks) rule.
                        reference_every=max(checks) if checks and None not in checks else None,  # type: ignore[type-var]
                    )
                )
        return out

    def get(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)

    def running_ids(self) -> list[str]:
        with self._lock:
            return [j.job for j in self.jobs.values() if j.running]

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
                self._bounded(job, "decisions", CapChange(self.wall(), clock_cap_mhz, power_limit_w, reason))
                job.capped = clock_cap_mhz is not None or power_limit_w is not None
                job.cap_changes += 1

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
        settle_until_s: float,
        policy: str,
    ) -> bool:
        """Ask a running job's ranks to run at ``level`` from their next step (a pushed
        directive); False if the job is not running or already there.

        ``kind`` is "switch" or "rollback" (the policy found the loss worse than its
        pre-switch ``trend``). The job's measure starts afresh at ``settle_until_s``:
        evidence at one level must not be booked to the next.
        """
        with self._lock:
            job = self.jobs.get(job_id)
            if job is None or not job.running or job.precision == level:
                return False
            change = PrecisionChange(self.wall(), kind, job.precision, level, reason, job.steps, job.last_loss, trend)
            job.precision = level
            self._bounded(job, "precision_log", change)
            job.measure = Measure(since_s=settle_until_s)
            steps, last_loss = job.steps, job.last_loss
        self.push(job_id, {"event": "directive", "precision": level, "reason": reason})
        fields = precision_fields(step=steps, loss=last_loss, trend=None if trend is None else float(trend))
        self.emit(
            [
                decision_point(
                    ts_ns(self.wall()),
                    self.hostname,
                    kind=kind,
                    reason=reason,
                    policy=policy,
                    job=job_id,
                    precision=level,
                    fields=fields,
                )
            ]
        )
        log.info("job %s: precision -> %s (%s)", job_id, level, reason)
        return True

    def pace(self, msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
        """The ranks agreed on the job's pace (the slowest node's uncapped step time)."""
        with self._lock:
            rs = self._session(conn)
            job = self.jobs[rs.job]
            job.pace_s = float(msg["step_s"])
            rs.last_seen_s = self.monotonic()
        return {"ok": True}

    def precision_event(self, msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
        """The callback changed or refused a level on its own (e.g. rolled back after a
        non-finite loss): record it with its reason and loss figures."""
        with self._lock:
            rs = self._session(conn)
            job = self.jobs[rs.job]
            rs.last_seen_s = self.monotonic()
            self._event_rate(conn)
            self._bounded(
                job,
                "precision_log",
                PrecisionChange(
                    self.wall(),
                    msg["kind"],
                    msg.get("from"),
                    msg.get("to"),
                    msg.get("reason") or "",
                    msg.get("step"),
                    msg.get("loss"),
                    msg.get("trend"),
                    rank=rs.rank,
                ),
            )
            if msg["kind"] == "rollback" and msg.get("to"):
                job.precision = msg["to"]
                job.measure = Measure(since_s=self.monotonic())
            elif msg["kind"] == "refused" and msg.get("from"):
                job.precision = msg["from"]  # the rank kept running at its old level
        fields = precision_fields(step=msg.get("step") or 0, loss=msg.get("loss"), trend=msg.get("trend"))
        self.emit(
            [
                decision_point(
                    ts_ns(self.wall()),
                    self.hostname,
                    kind=msg["kind"],
                    reason=str(msg.get("reason") or ""),
                    policy="callback",
                    job=job.job,
                    precision=str(msg.get("to") or ""),
                    fields=fields,
                )
            ]
        )
        log.info(
            "job %s rank %d: precision %s %s -> %s (%s)",
            job.job,
            rs.rank,
            msg["kind"],
            msg.get("from"),
            msg.get("to"),
            msg.get("reason"),
        )
        return {"ok": True}

    def _event_rate(self, conn: Connection) -> None:
        """At most max_events_per_min_per_uid precision_events a minute per non-admin uid."""
        if conn.state.get("_admin"):
            return
        now = self.monotonic()
        times = self._events.setdefault(conn.peer.uid, deque())
        while times and times[0] <= now - 60.0:
            times.popleft()
        if len(times) >= self.max_events_per_min_per_uid:
            self.events_refused += 1
            raise LimitExceeded(
                f"uid {conn.peer.uid} sent {len(times)} precision events in the last minute, the limit per user "
                f"([daemon] max_events_per_min_per_uid = {self.max_events_per_min_per_uid})"
            )
        times.append(now)

    def push(self, job_id: str, event: dict[str, Any]) -> int:
        """Send an event to every rank of a job; returns how many got it."""
        with self._lock:
            job = self.jobs.get(job_id)
            conns = [rs.conn for rs in job.ranks.values() if rs.conn is not None] if job else []
        msg = {"v": 1, "job": job_id, **event}
        return sum(1 for c in conns if c.send(msg, timeout_s=0.2))

    def heartbeat(self, msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
        with self._lock:
            rs = self._session(conn)
            rs.last_seen_s = self.monotonic()
        return {"ok": True}

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
            self._book_cpu(job, rs, cpu)

    @staticmethod
    def _book_cpu(job: Job, rs: RankSession, cpu_s: float) -> None:
        """The rank's process is at ``cpu_s`` CPU seconds: add what it used since last seen."""
        if rs.cpu_last_s is not None:
            job.cpu_job_s += max(0.0, cpu_s - rs.cpu_last_s)
        rs.cpu_last_s = cpu_s

    def end(self, msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
        with self._lock:
            rs = self._session(conn)
            job = self.jobs[rs.job]
            self._final_cpu(rs)  # the client is still there: its last CPU seconds count
            self._leave(rs, msg.get("reason") or "finished")
            conn.state.pop("session", None)
            return self.report(job)

    def disconnected(self, conn: Connection) -> None:
        with self._lock:
            sid = conn.state.get("session")
            rs = self.sessions.get(sid) if sid is not None else None
            if rs is not None:
                self._final_cpu(rs)  # None if the process is gone already
                self._leave(rs, "client disconnected")

    def _leave(self, rs: RankSession, reason: str) -> None:
        job = self.jobs.get(rs.job)
        self.sessions.pop(rs.session, None)
        if job is not None and rs.agg is not None:
            self.emit([self._flush_steps(job, rs)])  # its last interval's steps
        if job is None or rs.session not in job.ranks:
            return
        del job.ranks[rs.session]
        self._bounded(job, "gone", RankLeft(rs.rank, rs.pid, reason, rs.steps))
        log.info("job %s: rank %d left (%s)", job.job, rs.rank, reason)
        if not job.ranks and job.state == "running":
            job.state = "ending"
            job.end_reason = reason
            job.t_end_s = self.monotonic()

    # The tick side -------------------------------------------------------------------
    def tick(self, now_s: float, host: Any | None = None) -> list[Point]:
        """Expire silent ranks, account CPU time, finish jobs whose end the ledger has seen."""
        points: list[Point] = []
        ended: list[Job] = []
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
                    if rs.conn is not None:
                        rs.conn.state.pop("session", None)
            for job in [*self.jobs.values(), *self._closing]:
                if host is not None and job.state == "running":
                    self._account_cpu(job, host)
                if (
                    job.state == "ending"
                    and job.t_end_s is not None
                    and now_s >= job.t_end_s
                    and (self._cpu_booked_until(job.t_end_s) or now_s >= job.t_end_s + CPU_END_WAIT_S)
                ):
                    # The ledger now holds a tick at or after the end (and the CPU zones a
                    # reading, the estimate's once a second): the window is complete.
                    job.state = "ended"
                    job.summary = self.report(job)
                    # An ended job keeps its summary; its step records go, and its
                    # series is thinned to ENDED_SERIES_POINTS (enough for its plot):
                    # up to 200 ended jobs are kept.
                    job.recent.clear()
                    job.losses.clear()
                    job.nonfinite_recent.clear()
                    job.series = thinned(job.series, ENDED_SERIES_POINTS)
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

    def _cpu_booked_until(self, t_s: float) -> bool:
        """Every counted CPU zone has a ledger point at or after ``t_s``."""
        for key in self.ledger.keys(prefix="cpu:", counted_only=True):
            last = self.ledger.last_time(key)
            if last is None or last < t_s:
                return False
        return True

    def _account_cpu(self, job: Job, host: Any) -> None:
        seen = False
        for rs in job.ranks.values():
            cpu = host.process_cpu_s.get(rs.pid)
            if cpu is None:
                continue
            seen = True
            self._book_cpu(job, rs, cpu)
        if seen and job.cpu_busy0_s is None:
            job.cpu_busy0_s = self._node_cpu_busy_s

    def job_pids(self) -> list[int]:
        with self._lock:
            return [rs.pid for rs in self.sessions.values()]

    def efficiency_points(self, now_s: float) -> list[Point]:
        """One ``greend_efficiency`` point per running job: the sliding window and the life."""
        pts = []
        ts = ts_ns(self.wall())
        with self._lock:
            for job in self.jobs.values():
                if job.state != "running" or job.t_start_s is None:
                    continue
                win = self.window(job, now_s)
                life = self.report(job)
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

    # Figures (greend/jobs/report.py computes them) -------------------------------------
    def window(self, job: Job, now_s: float) -> dict[str, Any]:
        """The job's figures over the last ``window_s``, up to ``now_s``."""
        return self.figures.window(job, now_s)

    def report(self, job: Job) -> dict[str, Any]:
        """The job's figures over its life (so far, while it runs), with the count of
        log entries dropped at [daemon] max_log_entries where there were any."""
        r = self.figures.report(job)
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
                row = self.figures.row(job)
                # Once its figures are final (not while it is ending).
                t_end = job.t_end_s if job.state == "ended" else None
                row["ended_at"] = job.registered_wall_s + (t_end - job.registered_s) if t_end is not None else None
                out.append(row)
            return out

    def _trim_ended(self) -> None:
        ended = [j for j in self.jobs.values() if j.state == "ended"]
        for j in ended[: max(0, len(ended) - self.keep_ended)]:
            self.jobs.pop(j.job, None)


def _summary_line(s: dict[str, Any]) -> str:
    g = s.get("gflops_per_w")
    return (
        f"{s.get('steps', 0)} steps, {s.get('flops', 0):.3g} FLOP, {s.get('gpu_energy_j', 0):.1f} J GPU, "
        f"{'-' if g is None else f'{g:.2f}'} GFLOPS/W"
    )


def _process_tree(pid: int) -> set[int]:
    """``pid`` and its descendants (from /proc; just ``pid`` where /proc cannot say)."""
    out: set[int] = set()
    todo = [pid]
    while todo and len(out) < 4096:
        p = todo.pop()
        if p in out or p <= 0:
            continue
        out.add(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                try:
                    todo += [int(c) for c in (task / "children").read_text().split()]
                except (OSError, ValueError):
                    pass
        except OSError:
            pass
    return out
