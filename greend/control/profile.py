"""Profile recordings (``greenctl profile record``): one GPU's power limit stepped down
while a job runs, one limit per ``steps_per_limit`` of the job's steps, from the control
loop's period. The job's step time and the GPU's average power at each limit become a
profile in greend's trace format.

A :class:`ProfileRecorder` holds the running (or last) :class:`ProfileRecording`; the
control loop that owns it calls :meth:`ProfileRecorder.step` every period and ends the
recording when its job ends or the daemon stops; the socket op ``profile``
(:mod:`greend.control.ops`) starts, shows and aborts it. The recording sets its limits
as the owner ``profile`` through the loop's controller, which saves the original before
the first write and puts it back when the recording ends, however it ends.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from greend.control.context import ControlContext
from greend.errors import ActuatorError, ProtocolError, StateError
from greend.points import Point, ts_ns
from greend.protocol import PROFILE_OWNER
from greend.settings import Setting

if TYPE_CHECKING:
    from greend.actuators.controller import Controller
    from greend.actuators.report import RestoreReport
    from greend.jobs.records import Job
    from greend.policies.base import JobMeasure

__all__ = ["ControlSide", "ProfileRecorder", "ProfileRecording", "profile_limits"]

log = logging.getLogger(__name__)


class ControlSide(Protocol):
    """What a recording uses of the control loop that runs it."""

    @property
    def ctrl(self) -> Controller | None: ...

    @property
    def policy_name(self) -> str: ...

    def need_ctrl(self) -> Controller: ...

    def cap_point(self, ts: int, in_force: Setting, reason: str, *, gpu: int, job: str = "") -> Point: ...

    def report_restore(self, rep: RestoreReport, why: str) -> None: ...


def profile_limits(top_w: float, bottom_w: float, step_w: float) -> list[float]:
    """The limits a recording visits, descending: ``top_w``, then every ``step_w`` down,
    and ``bottom_w`` last (even when the steps do not land on it)."""
    limits = [round(top_w, 3)]
    w = top_w - step_w
    while w > bottom_w + 1e-6:
        limits.append(round(w, 3))
        w -= step_w
    limits.append(round(bottom_w, 3))
    return limits


@dataclass
class ProfileRecording:
    """One power-limit sweep on one GPU while a job runs (``greenctl profile record``)."""

    gpu: int
    job: str
    limits_w: list[float]  # descending: the order they are visited
    steps_per_limit: int
    gpu_name: str = ""
    source: str = ""
    original_w: float | None = None  # the limit in force before the recording
    started_wall: float = 0.0
    host: str = ""
    stall_s: float = 60.0
    state: str = "running"  # running | done | aborted | failed
    reason: str = ""
    index: int = 0  # which limit is in force now
    rows: list[dict[str, Any]] = field(default_factory=list)
    steps_now: int = 0
    last_steps: int = 0
    last_progress_s: float = 0.0
    limit_since_s: float = 0.0
    ended_wall: float | None = None
    restored: list[str] = field(default_factory=list)
    restore_ok: bool | None = None

    def to_json(self) -> dict[str, Any]:
        running = self.state == "running"
        return {
            "state": self.state,
            "reason": self.reason,
            "gpu": self.gpu,
            "job": self.job,
            "gpu_name": self.gpu_name,
            "source": self.source,
            "host": self.host,
            "limits_w": list(self.limits_w),
            "steps_per_limit": self.steps_per_limit,
            "current_limit_w": self.limits_w[self.index] if running else None,
            "steps_now": self.steps_now if running else None,
            "original_w": self.original_w,
            "rows": [dict(r) for r in self.rows],
            "started_wall": self.started_wall,
            "ended_wall": self.ended_wall,
            "restored": list(self.restored),
            "restore_ok": self.restore_ok,
        }


class ProfileRecorder:
    """The profile recordings of one control loop (one at a time).

    ``lock`` is the loop's own (its policies and their states): a recording starts only
    while no policy but ``none`` runs, checked and begun under that lock."""

    def __init__(self, ctx: ControlContext, control: ControlSide, lock: threading.RLock) -> None:
        self.ctx = ctx
        self.control = control
        self._lock = lock
        self.recording: ProfileRecording | None = None  # the running (or last) one

    def running(self, gpu: int | None = None) -> ProfileRecording | None:
        """The running profile recording (on ``gpu``, if given), or None."""
        rec = self.recording
        if rec is None or rec.state != "running" or (gpu is not None and rec.gpu != gpu):
            return None
        return rec

    def start(
        self,
        gpu: int,
        job_id: str,
        *,
        from_w: float | None = None,
        to_w: float | None = None,
        step_w: float | None = None,
        steps_per_limit: int = 20,
    ) -> dict[str, Any]:
        """Start stepping ``gpu``'s power limit down while job ``job_id`` runs on it.

        Refused (ProtocolError, with the reason) when control is off or dry-run, when a
        policy other than ``none`` is active (it would move the same limit), when a
        recording runs already, when the job does not run on the GPU, when anyone holds
        a setting of that GPU (an admin's cap, a job's), or when the limits are outside
        the GPU's range."""
        ctrl = self.control.need_ctrl()
        if ctrl.dry_run:
            raise StateError("the daemon runs --dry-run: a sweep that sets nothing measures nothing")
        with self._lock:
            policy_name = self.control.policy_name
            if policy_name != "none":
                raise StateError(
                    f"policy {policy_name!r} is active and would move the same power limit; "
                    "switch to none first (greenctl policy set none), record, then switch back"
                )
            if self.running() is not None:
                running = self.recording
                assert running is not None
                raise StateError(f"a profile recording runs already (gpu {running.gpu}, job {running.job})")
            reading = next((g for g in self.ctx.latest().gpus if g.index == gpu), None)
            if reading is None:
                raise ProtocolError(f"no GPU {gpu} on this node", field="gpu")
            job = self.ctx.jobs.get(job_id)
            if job is None or not job.running:
                raise ProtocolError(f"no running job {job_id!r} on this node", field="job")
            if gpu not in job.gpus:
                raise StateError(f"job {job_id} does not run on GPU {gpu} (its GPUs: {sorted(job.gpus) or 'none'})")
            others = self.ctx.jobs.other_users(gpu, job_id)
            if others:  # a sweep of the power limit would slow their work (greend.jobs.claims)
                raise StateError(
                    f"GPU {gpu} is in use by job(s) {', '.join(others)} too: a profile recording needs a GPU "
                    f"that job {job_id} does not share"
                )
            held = [
                f"{k} ({owner})" for owner, knobs in ctrl.owners().items() for k in knobs if k.startswith(f"gpu{gpu}.")
            ]
            if held:
                raise StateError(
                    f"GPU {gpu} has settings in force: {', '.join(held)}; "
                    f"lift them first (greenctl cap reset --gpu {gpu})"
                )
            lo, hi = reading.power_limit_min_w, reading.power_limit_max_w
            if lo is None or hi is None:
                raise StateError(f"GPU {gpu} has no settable power limit")
            top = float(from_w) if from_w is not None else float(reading.power_limit_default_w or hi)
            bottom = float(to_w) if to_w is not None else float(lo)
            for name, w in (("from_w", top), ("to_w", bottom)):
                if not lo - 1e-9 <= w <= hi + 1e-9:
                    raise StateError(f"{name} = {w:g} W is outside GPU {gpu}'s range {lo:g}-{hi:g} W")
            if bottom >= top:
                raise ProtocolError(f"to_w ({bottom:g} W) must be below from_w ({top:g} W)", field="to_w")
            step = float(step_w) if step_w is not None else max(1.0, round((top - bottom) / 8.0))
            limits = profile_limits(top, bottom, step)
            rec = ProfileRecording(
                gpu=gpu,
                job=job_id,
                limits_w=limits,
                steps_per_limit=int(steps_per_limit),
                gpu_name=reading.name,
                source=reading.source,
                original_w=reading.power_limit_w,
                started_wall=self.ctx.wall(),
                host=self.ctx.hostname,
                stall_s=max(60.0, 20.0 * self.ctx.cfg.policy.period_s),
            )
            self.recording = rec
            log.info(
                "profile recording on gpu%d for job %s: %s W, %d steps each",
                gpu,
                job_id,
                ", ".join(f"{w:g}" for w in limits),
                rec.steps_per_limit,
            )
            self._set(rec, self.ctx.monotonic())
            return rec.to_json()

    def status(self) -> dict[str, Any]:
        with self._lock:
            return self.recording.to_json() if self.recording is not None else {"state": "none"}

    def abort(self, why: str) -> dict[str, Any]:
        with self._lock:
            if self.running() is None:
                raise ProtocolError("no profile recording runs")
            self._finish("aborted", why)
            return self.status()

    def step(self, now_s: float) -> None:
        """One period of the running recording, if any: enough steps at this limit? Then
        the next one."""
        with self._lock:
            if self.running() is not None:
                self._step(now_s)

    def job_ended(self, job: Job) -> None:
        """``job`` ended: a recording that runs on it is aborted (its limit goes back)."""
        with self._lock:
            rec = self.running()
            if rec is not None and rec.job == job.job:
                self._finish("aborted", f"job {job.job} ended ({job.end_reason})")

    def close(self) -> None:
        """The daemon stops: a running recording is aborted (its limit goes back)."""
        with self._lock:
            if self.running() is not None:
                self._finish("aborted", "the daemon is stopping")

    def _set(self, rec: ProfileRecording, now_s: float) -> None:
        """Put the recording's current limit in force and measure afresh after it settles."""
        ctrl = self.control.ctrl
        assert ctrl is not None
        limit = rec.limits_w[rec.index]
        reason = f"profile recording ({rec.index + 1}/{len(rec.limits_w)}: {limit:g} W)"
        try:
            in_force = ctrl.apply_gpu(rec.gpu, Setting(power_limit_w=limit), PROFILE_OWNER, keep=("clock_cap_mhz",))
        except (ActuatorError, StateError) as e:
            self._finish("failed", f"cannot set the power limit to {limit:g} W: {e}")
            return
        self.ctx.emit([self.control.cap_point(ts_ns(self.ctx.wall()), in_force, reason, gpu=rec.gpu, job=rec.job)])
        self.ctx.jobs.reset_measure(rec.job, now_s + self.ctx.cfg.policy.settle_s)
        self.ctx.jobs.record_cap_change(
            rec.job, clock_cap_mhz=in_force.clock_cap_mhz, power_limit_w=in_force.power_limit_w, reason=reason
        )
        rec.limit_since_s = now_s
        rec.last_steps, rec.last_progress_s = 0, now_s

    def _step(self, now_s: float) -> None:
        rec = self.recording
        assert rec is not None and self.control.ctrl is not None
        jobs = self.ctx.jobs
        job = jobs.get(rec.job)
        if job is None or not job.running:
            # (The same words as job_ended's, which may come just after this period.)
            why = f"job {rec.job} ended ({job.end_reason})" if job is not None else f"job {rec.job} is not running"
            self._finish("aborted", why)
            return
        limit = rec.limits_w[rec.index]
        m = jobs.measure(job, Setting(power_limit_w=limit))
        steps = m.steps if m is not None else 0
        if steps > rec.last_steps:
            rec.last_steps, rec.last_progress_s = steps, now_s
        elif now_s - rec.last_progress_s > rec.stall_s:
            self._finish("aborted", f"job {rec.job} reported no step for {rec.stall_s:g} s")
            return
        rec.steps_now = steps
        if m is None or steps < rec.steps_per_limit or m.time_s <= 0:
            return
        power = self._power(rec, job, m)
        if power is None:
            return  # the ledger does not cover the window yet: next period
        rec.rows.append(
            {
                "power_limit_w": limit,
                "steps": steps,
                "step_time_s": m.time_s / steps,
                "avg_power_w": power,
                "seconds": now_s - rec.limit_since_s,
            }
        )
        log.info(
            "profile gpu%d job %s: %g W: %.4g s/step, %.1f W (%d steps)",
            rec.gpu,
            rec.job,
            limit,
            m.time_s / steps,
            power,
            steps,
        )
        rec.index += 1
        rec.steps_now = 0
        if rec.index >= len(rec.limits_w):
            self._finish("done", f"{len(rec.rows)} limits measured")
            return
        self._set(rec, now_s)

    def _power(self, rec: ProfileRecording, job: Job, m: JobMeasure) -> float | None:
        """The profiled GPU's average power over the measured steps: where a device model
        runs the steps, the model's energy of the steps (the job's share on this GPU), else
        the ledger's joules of this GPU over the steps' window."""
        n = max(1, len(job.gpus))
        if self.ctx.jobs.modelled_gpu(rec.gpu):
            return float(m.energy_j) / float(m.time_s) / n
        t0, t1 = job.measure.t0_s, job.measure.t1_s
        if t0 is None or t1 is None or t1 <= t0:
            return None
        joules = self.ctx.ledger.energy_between(f"gpu{rec.gpu}", t0, t1)
        if joules is None or not math.isfinite(joules):
            return None
        return joules / (t1 - t0)

    def _finish(self, state: str, why: str) -> None:
        """End the recording: its limit goes back to the original (the controller saved
        it before the first write), and the job measures afresh."""
        rec = self.recording
        assert rec is not None
        rec.state, rec.reason = state, why
        rec.ended_wall = self.ctx.wall()
        ctrl = self.control.ctrl
        if ctrl is not None:
            rep = ctrl.restore_owner(PROFILE_OWNER)
            self.control.report_restore(rep, f"profile recording {state}: {why}")
            rec.restored = rep.lines()
            rec.restore_ok = rep.ok
            job = self.ctx.jobs.get(rec.job)
            if job is not None and job.running:
                self.ctx.jobs.reset_measure(rec.job, self.ctx.monotonic() + self.ctx.cfg.policy.settle_s)
                self.ctx.jobs.record_cap_change(
                    rec.job, clock_cap_mhz=None, power_limit_w=None, reason=f"profile recording {state}: limit restored"
                )
        log.info("profile recording on gpu%d for job %s %s: %s", rec.gpu, rec.job, state, why)
