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
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from greend.ipc.server import Connection
from greend.protocol import JOB_ID_RE, MAX_STEPS_PER_MESSAGE, PRECISIONS, RESERVED_OWNERS, STEP_FIELDS, validate
from greend.jobs.ledger import Ledger
from greend.sinks import Point
from greend.units import j_to_kwh

__all__ = ["Job", "JobRegistry", "RankSession"]

log = logging.getLogger(__name__)

# An ended job waits at most this long past its end for every CPU zone's next reading
# (the host probe's estimate comes once a second; a loaded node may tick late) before its
# summary is made. Only a zone that stopped reading makes a job wait this long.
CPU_END_WAIT_S = 3.0


def _rates(flops: float, energy_j: float | None, span_s: float) -> tuple[float | None, float | None, float | None]:
    """Average power (W), FLOP/s and GFLOPS/W of ``flops`` run on ``energy_j`` over ``span_s``."""
    power = energy_j / span_s if energy_j is not None and span_s > 0 else None
    flop_per_s = flops / span_s if span_s > 0 else None
    return power, flop_per_s, (flops / energy_j / 1e9 if energy_j else None)


@dataclass
class RankSession:
    session: int
    job: str
    rank: int
    local_rank: int
    world_size: int
    gpus: list[int]
    pid: int
    uid: int
    host: str
    precisions: list[str]
    mem_share: float | None
    conn: Connection | None
    last_seen_s: float
    steps: int = 0
    cpu_last_s: float | None = None  # the rank's process CPU time at the previous tick


@dataclass
class StepRecord:
    t0_s: float
    t1_s: float
    flops: float
    samples: int
    tokens: int
    sim_duration_s: float | None


@dataclass
class Job:
    job: str
    uid: int
    registered_s: float
    registered_wall_s: float
    ranks: dict[int, RankSession] = field(default_factory=dict)
    gone: list[dict[str, Any]] = field(default_factory=list)
    gpus: set[int] = field(default_factory=set)
    state: str = "running"  # running | ending | ended
    end_reason: str | None = None
    t_start_s: float | None = None
    t_end_s: float | None = None
    last_step_t1_s: float | None = None
    steps: int = 0
    step_reports: int = 0
    flops: float = 0.0
    samples: int = 0
    tokens: int = 0
    last_loss: float | None = None
    nonfinite_steps: int = 0
    step_time_s: float = 0.0  # measured, summed over reports
    gpu_flops: dict[int, float] = field(default_factory=dict)  # each step's FLOPs split over its rank's GPUs
    sim_time_s: float = 0.0
    sim_energy_j: float = 0.0
    precision: str = "fp32"
    precision_log: list[dict[str, Any]] = field(default_factory=list)
    recent: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=20_000))
    series: deque[dict[str, float]] = field(default_factory=lambda: deque(maxlen=7200))
    # Steps since the setting now in force took effect (greend.policies.base.JobMeasure):
    measure_since_s: float = 0.0
    m_steps: int = 0
    m_flops: float = 0.0
    m_time_s: float = 0.0
    m_sim_energy_j: float = 0.0
    m_time_sq_s2: float = 0.0  # sums of squares per step: the policy's noise estimate
    m_energy_sq_j2: float = 0.0  # (simulated GPUs only: real per-step energy is not known)
    m_t0_s: float | None = None
    m_t1_s: float | None = None
    pace_s: float | None = None  # agreed across nodes by the ranks (op "pace")
    losses: deque[float] = field(default_factory=lambda: deque(maxlen=256))
    nonfinite_recent: deque[int] = field(default_factory=lambda: deque(maxlen=256))
    decisions: list[dict[str, Any]] = field(default_factory=list)
    cpu_job_s: float = 0.0  # job processes' CPU seconds over the life, from the host probe
    cpu_busy0_s: float | None = None  # the node's busy CPU seconds when the job's CPU accounting began
    summary: dict[str, Any] | None = None


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
    ) -> None:
        self.ledger = ledger
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
        self.sessions: dict[int, RankSession] = {}
        self._lock = threading.RLock()
        self._node_cpu_busy_s = 0.0  # integral of host utilisation * cpus, for CPU shares
        self._last_host_t: float | None = None
        self.on_job_end: list[Callable[[Job], None]] = []

    # Registration --------------------------------------------------------------------
    def register(self, msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
        from greend.errors import ProtocolError

        job_id = msg["job"]
        if not JOB_ID_RE.match(job_id):
            raise ProtocolError(
                "'job' must be 1-128 characters of letters, digits and . _ : @ / -", field="job"
            )
        if job_id in RESERVED_OWNERS:
            raise ProtocolError(f"job id {job_id!r} is reserved (greend's own settings go by "
                                f"{' and '.join(map(repr, RESERVED_OWNERS))}): use another", field="job")
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
            raise ProtocolError("this connection already registered a rank; open another connection",
                                field="op")
        now = self.monotonic()
        cpu0 = self._process_cpu(conn.peer.pid)
        with self._lock:
            job = self.jobs.get(job_id)
            if job is not None and job.state != "running":
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
            if job is None:
                job = Job(job_id, conn.peer.uid, now, self.wall())
                self.jobs[job_id] = job
                self._trim_ended()
                log.info("job %s registered (uid %d)", job_id, conn.peer.uid)
            rs = RankSession(
                session=conn.id, job=job_id, rank=msg.get("rank") or 0, local_rank=msg.get("local_rank") or 0,
                world_size=msg.get("world_size") or 1, gpus=gpus, pid=conn.peer.pid, uid=conn.peer.uid,
                host=msg.get("host") or self.hostname, precisions=list(precisions),
                mem_share=msg.get("mem_share"), conn=conn, last_seen_s=now, cpu_last_s=cpu0,
            )
            if cpu0 is not None and job.cpu_busy0_s is None:
                job.cpu_busy0_s = self._node_cpu_busy_s
            job.ranks[conn.id] = rs
            job.gpus.update(gpus)
            self.sessions[conn.id] = rs
            conn.state["session"] = conn.id
            return {
                "job": job_id,
                "session": conn.id,
                "heartbeat_s": max(0.5, self.heartbeat_timeout_s / 3.0),
                "directive": {"precision": job.precision},
            }

    def _session(self, conn: Connection) -> RankSession:
        from greend.errors import ProtocolError

        sid = conn.state.get("session")
        rs = self.sessions.get(sid) if sid is not None else None
        if rs is None:
            raise ProtocolError("register a job on this connection first (op 'register')", field="op")
        return rs

    # Reports -------------------------------------------------------------------------
    def report_steps(self, msg: dict[str, Any], conn: Connection) -> None:
        from greend.errors import ProtocolError

        steps = msg["steps"]
        if len(steps) > MAX_STEPS_PER_MESSAGE:
            raise ProtocolError(f"at most {MAX_STEPS_PER_MESSAGE} steps per message", field="steps")
        checked = []
        for i, s in enumerate(steps):
            if not isinstance(s, dict):
                raise ProtocolError(f"steps[{i}] must be an object", field="steps")
            try:
                validate(s, STEP_FIELDS)
            except ProtocolError as e:
                raise ProtocolError(f"steps[{i}]: {e}", field=f"steps[{i}].{e.field}") from None
            if s["t1_s"] < s["t0_s"]:
                raise ProtocolError(f"steps[{i}]: t1_s is before t0_s", field=f"steps[{i}].t1_s")
            checked.append(s)
        now = self.monotonic()
        for i, s in enumerate(checked):
            if s["t1_s"] > now + 1.0:
                raise ProtocolError(
                    f"steps[{i}]: t1_s = {s['t1_s']} is in the future (send time.monotonic() seconds)",
                    field=f"steps[{i}].t1_s",
                )
        points: list[Point] = []
        with self._lock:
            rs = self._session(conn)
            job = self.jobs[rs.job]
            rs.last_seen_s = now
            sim = self._run_on_sims(job, rs, checked)
            for i, s in enumerate(checked):
                points.append(self._account_step(job, rs, s, *(sim[i] if sim else (None, 0.0))))
        self.emit(points)

    def _run_on_sims(self, job: Job, rs: RankSession, steps: list[dict[str, Any]]) -> list[tuple[float, float]]:
        """Execute the steps on the rank's simulated GPUs (each GPU's share of the
        FLOPs), one device update per GPU for the whole message: per step, the
        slowest GPU's duration and the GPUs' summed energy. Empty on real GPUs."""
        sims = [g for g in (self.sim_gpu(i) for i in rs.gpus) if g is not None]
        if not sims:
            return []
        work = [(float(s["flops"]) / len(sims), rs.mem_share, s.get("precision") or job.precision) for s in steps]
        per_gpu = [g.run_steps(work) for g in sims]
        return [(max(c[i].duration_s for c in per_gpu), sum(c[i].energy_j for c in per_gpu))
                for i in range(len(steps))]

    def _account_step(self, job: Job, rs: RankSession, s: dict[str, Any], sim_duration: float | None,
                      sim_energy: float) -> Point:
        flops = float(s["flops"])
        precision = s.get("precision") or job.precision
        if sim_duration is not None:
            job.sim_time_s += sim_duration
            job.sim_energy_j += sim_energy
        if job.t_start_s is None or s["t0_s"] < job.t_start_s:
            job.t_start_s = s["t0_s"]
        job.last_step_t1_s = max(job.last_step_t1_s or 0.0, s["t1_s"])
        rs.steps += 1
        job.steps = max(job.steps, max(r.steps for r in job.ranks.values()))
        job.step_reports += 1
        job.flops += flops
        for g in rs.gpus:
            job.gpu_flops[g] = job.gpu_flops.get(g, 0.0) + flops / len(rs.gpus)
        job.samples += int(s.get("samples") or 0)
        job.tokens += int(s.get("tokens") or 0)
        duration = s["t1_s"] - s["t0_s"]
        job.step_time_s += duration
        if s.get("nonfinite"):
            job.nonfinite_steps += 1
            job.nonfinite_recent.append(s["step"])
        elif s.get("loss") is not None:
            job.last_loss = float(s["loss"])
            job.losses.append(job.last_loss)
        if s["t0_s"] >= job.measure_since_s:
            # Evidence for the setting now in force (steps that began before it settled
            # are left out). On simulated GPUs the model's time and energy, else the
            # measured step time and, at decision time, the ledger's joules.
            job.m_steps += 1
            job.m_flops += flops
            step_time = sim_duration if sim_duration is not None else duration
            job.m_time_s += step_time
            job.m_time_sq_s2 += step_time * step_time
            job.m_sim_energy_j += sim_energy
            job.m_energy_sq_j2 += sim_energy * sim_energy
            job.m_t0_s = s["t0_s"] if job.m_t0_s is None else min(job.m_t0_s, s["t0_s"])
            job.m_t1_s = s["t1_s"] if job.m_t1_s is None else max(job.m_t1_s, s["t1_s"])
        job.recent.append(StepRecord(s["t0_s"], s["t1_s"], flops, int(s.get("samples") or 0),
                                     int(s.get("tokens") or 0), sim_duration))
        fields: dict[str, float | int | str | bool] = {
            "step": int(s["step"]), "duration_s": duration, "flops": flops,
            "samples": int(s.get("samples") or 0), "tokens": int(s.get("tokens") or 0),
        }
        if s.get("loss") is not None:
            fields["loss"] = float(s["loss"])
        if s.get("nonfinite"):
            fields["nonfinite"] = 1
        if sim_duration is not None:
            fields["sim_duration_s"] = sim_duration
            fields["sim_energy_j"] = sim_energy
        return Point("greend_job_step", {"host": self.hostname, "job": job.job, "rank": str(rs.rank),
                                         "precision": precision}, fields,
                     int((self.wall() - (self.monotonic() - s["t1_s"])) * 1e9))

    def reset_measure(self, job_id: str, since_s: float) -> None:
        """A new setting took effect: measure afresh from ``since_s``."""
        with self._lock:
            job = self.jobs.get(job_id)
            if job is None:
                return
            job.measure_since_s = since_s
            job.m_steps, job.m_flops, job.m_time_s, job.m_sim_energy_j = 0, 0.0, 0.0, 0.0
            job.m_time_sq_s2 = job.m_energy_sq_j2 = 0.0
            job.m_t0_s = job.m_t1_s = None

    def measure(self, job: Job, setting: Any) -> Any:
        """The job's :class:`greend.policies.base.JobMeasure` since its setting took effect, or None."""
        from greend.policies.base import JobMeasure

        if job.m_steps == 0:
            return None
        sim = any(self.sim_gpu(g) is not None for g in job.gpus)
        if sim:
            energy: float | None = job.m_sim_energy_j
        elif job.m_t0_s is not None and job.m_t1_s is not None:
            energy = self._gpu_energy(job, job.m_t0_s, job.m_t1_s)
        else:
            energy = None
        if energy is None:
            return None
        return JobMeasure(setting=setting, steps=job.m_steps, flops=job.m_flops, time_s=job.m_time_s,
                          energy_j=energy, power_w=energy / job.m_time_s if job.m_time_s > 0 else None,
                          time_sq_s2=job.m_time_sq_s2, energy_sq_j2=job.m_energy_sq_j2 if sim else None)

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
            entry = {"t": self.wall(), "kind": msg["kind"], "from": msg.get("from"), "to": msg.get("to"),
                     "reason": msg.get("reason") or "", "step": msg.get("step"), "loss": msg.get("loss"),
                     "trend": msg.get("trend"), "rank": rs.rank}
            job.precision_log.append(entry)
            if msg["kind"] == "rollback" and msg.get("to"):
                job.precision = msg["to"]
                self.reset_measure(job.job, self.monotonic())
            elif msg["kind"] == "refused" and msg.get("from"):
                job.precision = msg["from"]  # the rank kept running at its old level
        fields: dict[str, float | int | str | bool] = {}
        for k in ("step", "loss", "trend"):
            if isinstance(msg.get(k), (int, float)) and not isinstance(msg.get(k), bool):
                fields[k] = msg[k]
        fields.setdefault("step", int(msg.get("step") or 0))
        fields["reason"] = str(msg.get("reason") or "")
        self.emit([Point("greend_decision", {"host": self.hostname, "job": job.job, "gpu": "", "kind": msg["kind"],
                                             "precision": str(msg.get("to") or ""), "policy": "callback"},
                         fields, int(self.wall() * 1e9))])
        log.info("job %s rank %d: precision %s %s -> %s (%s)", job.job, rs.rank, msg["kind"], msg.get("from"),
                 msg.get("to"), msg.get("reason"))
        return {"ok": True}

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
        except Exception as e:  # noqa: BLE001 - CPU accounting never fails a request
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
        if job is None or rs.session not in job.ranks:
            return
        del job.ranks[rs.session]
        job.gone.append({"rank": rs.rank, "pid": rs.pid, "reason": reason, "steps": rs.steps})
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
            for rs in list(self.sessions.values()):
                if now_s - rs.last_seen_s > self.heartbeat_timeout_s:
                    self._leave(rs, f"no heartbeat for {self.heartbeat_timeout_s:g} s")
                    if rs.conn is not None:
                        rs.conn.state.pop("session", None)
            for job in self.jobs.values():
                if host is not None and job.state == "running":
                    self._account_cpu(job, host)
                if job.state == "ending" and job.t_end_s is not None and now_s >= job.t_end_s and (
                        self._cpu_booked_until(job.t_end_s) or now_s >= job.t_end_s + CPU_END_WAIT_S):
                    # The ledger now holds a tick at or after the end (and the CPU zones a
                    # reading, the estimate's once a second): the window is complete.
                    job.state = "ended"
                    job.summary = self.report(job)
                    ended.append(job)
        for job in ended:
            log.info("job %s ended (%s): %s", job.job, job.end_reason, _brief(job.summary or {}))
            points.append(self.summary_point(job))
            for cb in self.on_job_end:
                try:
                    cb(job)
                except Exception:  # noqa: BLE001
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
        ts = int(self.wall() * 1e9)
        with self._lock:
            for job in self.jobs.values():
                if job.state != "running" or job.t_start_s is None:
                    continue
                win = self.window(job, now_s)
                life = self.report(job)
                entry = {"t_s": now_s - (job.t_start_s or now_s), "power_w": win["gpu_power_w"] or 0.0,
                         "gflops_per_w": win["gflops_per_w"] or 0.0, "flop_per_s": win["flop_per_s"] or 0.0}
                job.series.append(entry)
                fields: dict[str, float | int | str | bool] = {
                    "window_s": win["window_s"], "window_flops": win["flops"],
                    "window_gpu_energy_j": win["gpu_energy_j"] or 0.0,
                    "window_gflops_per_w": win["gflops_per_w"] or 0.0,
                    "window_flop_per_s": win["flop_per_s"] or 0.0,
                    "gpu_power_w": win["gpu_power_w"] or 0.0,
                    "flops": life["flops"], "gpu_energy_j": life["gpu_energy_j"],
                    "gflops_per_w": life["gflops_per_w"] or 0.0, "steps": life["steps"],
                }
                pts.append(Point("greend_efficiency", {"host": self.hostname, "job": job.job,
                                                       "precision": job.precision}, fields, ts))
        return pts

    # Figures -------------------------------------------------------------------------
    def _gpu_energy(self, job: Job, t0: float, t1: float) -> float | None:
        total = 0.0
        known = False
        for g in sorted(job.gpus):
            e = self.ledger.energy_between(f"gpu{g}", t0, t1, clamp=True)
            if e is not None:
                total += e
                known = True
        return total if known else None

    def _cpu_energy(self, t0: float, t1: float) -> tuple[float | None, bool]:
        """The node's counted CPU energy (packages and dram; never core, uncore or psys),
        and whether any of it is the host probe's estimate rather than RAPL."""
        total = 0.0
        known = estimated = False
        for key in self.ledger.keys(prefix="cpu:", counted_only=True):
            e = self.ledger.energy_between(key, t0, t1, clamp=True)
            if e is not None:
                total += e
                known = True
                estimated |= key == "cpu:estimate"
        return (total if known else None), estimated

    def _per_gpu(self, job: Job, t0: float | None, t1: float | None, duration: float) -> list[dict[str, Any]]:
        """Each of the job's GPUs: its share of the FLOPs (a step's FLOPs split evenly over
        its rank's GPUs), its joules over the job's window, and what they make."""
        out = []
        for g in sorted(job.gpus):
            e = self.ledger.energy_between(f"gpu{g}", t0, t1, clamp=True) if t0 is not None and t1 is not None else None
            flops = job.gpu_flops.get(g, 0.0)
            power, flop_per_s, gflops_per_w = _rates(flops, e, duration)
            out.append({"gpu": g, "flops": flops, "energy_j": e, "avg_power_w": power,
                        "flop_per_s": flop_per_s, "gflops_per_w": gflops_per_w})
        return out

    def window(self, job: Job, now_s: float) -> dict[str, Any]:
        t1 = now_s
        t0 = max(now_s - self.window_s, job.t_start_s or now_s)
        flops = sum(r.flops for r in job.recent if r.t1_s > t0 and r.t1_s <= t1)
        energy = self._gpu_energy(job, t0, t1)
        span = t1 - t0
        power, flop_per_s, gflops_per_w = _rates(flops, energy, span)
        return {"window_s": span, "flops": flops, "gpu_energy_j": energy, "gpu_power_w": power,
                "flop_per_s": flop_per_s, "gflops_per_w": gflops_per_w}

    def report(self, job: Job) -> dict[str, Any]:
        """The job's figures over its life (so far, while it runs)."""
        if job.summary is not None:
            return job.summary
        t0 = job.t_start_s
        if job.t_end_s is not None:
            t1 = job.t_end_s
        else:
            t1 = max(self.ledger.last_time(f"gpu{g}") or 0.0 for g in job.gpus) if job.gpus else None
            if t1 is None or t1 == 0.0:
                t1 = job.last_step_t1_s
        duration = (t1 - t0) if (t0 is not None and t1 is not None) else 0.0
        per_gpu = self._per_gpu(job, t0, t1, duration)
        known = [g["energy_j"] for g in per_gpu if g["energy_j"] is not None]
        gpu_e = sum(known) if known else None  # the job's GPUs' joules, as _gpu_energy sums them
        node_cpu_e, estimated = self._cpu_energy(t0, t1) if t0 is not None and t1 is not None else (None, False)
        # "unmeasured": no RAPL zone was readable and no cpu_tdp_w estimate is configured,
        # so the 0 J beside it is not a measurement.
        cpu_e, cpu_method = node_cpu_e, "node" if node_cpu_e is not None else "unmeasured"
        if node_cpu_e is not None and job.cpu_busy0_s is not None:
            node_busy = self._node_cpu_busy_s - job.cpu_busy0_s
            if node_busy > 0:
                cpu_e = node_cpu_e * min(1.0, job.cpu_job_s / node_busy)
                cpu_method = "process_share"
        if estimated:
            cpu_method += ", estimate"
        energy = (gpu_e or 0.0) + (cpu_e or 0.0)
        co2 = j_to_kwh(energy) * self.grid_gco2_per_kwh if energy else 0.0
        sources = sorted({"sim" if self.sim_gpu(g) is not None else "nvml" for g in job.gpus})
        return {
            "job": job.job,
            "state": job.state,
            "end_reason": job.end_reason,
            "uid": job.uid,
            "host": self.hostname,
            "started_at": job.registered_wall_s,
            "ranks": len(job.ranks),
            "ranks_gone": list(job.gone),
            "gpus": sorted(job.gpus),
            "gpu_source": ",".join(sources) if sources else None,
            "steps": job.steps,
            "step_reports": job.step_reports,
            "flops": job.flops,
            "samples": job.samples,
            "tokens": job.tokens,
            "duration_s": duration,
            "window": {"t0_s": t0, "t1_s": t1},
            "gpu_energy_j": gpu_e or 0.0,
            "cpu_energy_j": cpu_e or 0.0,
            "cpu_energy_method": cpu_method,
            "node_cpu_energy_j": node_cpu_e or 0.0,
            "energy_j": energy,
            "energy_kwh": j_to_kwh(energy),
            "avg_power_w": energy / duration if duration > 0 else None,
            "avg_gpu_power_w": (gpu_e or 0.0) / duration if duration > 0 else None,
            "flop_per_s": job.flops / duration if duration > 0 else None,
            "gflops_per_w": job.flops / gpu_e / 1e9 if gpu_e else None,
            "gflops_per_w_with_cpu": job.flops / energy / 1e9 if energy and cpu_e is not None else None,
            "gflops_per_w_busy": job.flops / job.sim_energy_j / 1e9 if job.sim_energy_j else None,
            "gpu_energy_per_step_j": gpu_e / job.steps if gpu_e is not None and job.steps else None,
            "per_gpu": per_gpu,
            # The last [report] window_s of a running job (its last window once it ended).
            "recent": self.window(job, t1) if t1 is not None else None,
            "samples_per_j": job.samples / energy if energy else None,
            "tokens_per_j": job.tokens / energy if energy else None,
            "co2_g": co2,
            "co2_method": f"estimate: {self.grid_gco2_per_kwh:g} gCO2/kWh configured grid intensity",
            "last_loss": job.last_loss,
            "nonfinite_steps": job.nonfinite_steps,
            "step_time_s": job.step_time_s,
            "sim_time_s": job.sim_time_s if job.sim_time_s else None,
            "sim_energy_j": job.sim_energy_j if job.sim_energy_j else None,
            "precision": job.precision,
            "precision_log": list(job.precision_log),
            "pace_s": job.pace_s,
            "decisions": list(job.decisions[-50:]),
        }

    def summary_point(self, job: Job) -> Point:
        s = job.summary or self.report(job)
        fields: dict[str, float | int | str | bool] = {}
        for k in ("steps", "flops", "samples", "tokens", "duration_s", "gpu_energy_j", "cpu_energy_j",
                  "energy_j", "energy_kwh", "avg_power_w", "gflops_per_w", "co2_g", "last_loss"):
            v = s.get(k)
            if isinstance(v, (int, float)) and not (isinstance(v, float) and not math.isfinite(v)):
                fields[k] = v
        return Point("greend_job", {"host": self.hostname, "job": job.job, "precision": job.precision,
                                    "end_reason": job.end_reason or ""}, fields, int(self.wall() * 1e9))

    def report_with_series(self, job: Job) -> dict[str, Any]:
        """``report(job)`` plus its time series: a copy made under the lock, so the tick
        thread can neither end the job half-way through nor change what is being sent."""
        with self._lock:
            report = dict(self.report(job))
            report["series"] = list(job.series)
            return report

    def list_jobs(self) -> list[dict[str, Any]]:
        with self._lock:
            out = []
            for job in self.jobs.values():
                r = self.report(job)
                out.append({k: r[k] for k in ("job", "state", "ranks", "gpus", "steps", "flops", "duration_s",
                                              "gpu_energy_j", "energy_j", "gflops_per_w", "precision")})
            return out

    def _trim_ended(self) -> None:
        ended = [j for j in self.jobs.values() if j.state == "ended"]
        for j in ended[: max(0, len(ended) - self.keep_ended)]:
            self.jobs.pop(j.job, None)


def _brief(s: dict[str, Any]) -> str:
    g = s.get("gflops_per_w")
    return (f"{s.get('steps', 0)} steps, {s.get('flops', 0):.3g} FLOP, {s.get('gpu_energy_j', 0):.1f} J GPU, "
            f"{'-' if g is None else f'{g:.2f}'} GFLOPS/W")
