"""The control loop: snapshot -> policy -> decision -> actuators.

Every ``policy.period_s`` the tick loop calls :meth:`ControlLoop.step`: it builds a
:class:`greend.policies.base.Snapshot` from the node's latest readings, the controller's
settings and each job's steps since its current setting took effect, asks the
policy, and applies the :class:`~greend.policies.base.Decision` through the
:class:`~greend.actuators.Controller` (which saves every original before its first
write). A decision's reason is logged, stored (``greend_decision``), kept in the
job's report and shown by ``greenctl status``.

A profile recording (``greenctl profile record``) steps one GPU's power limit down
while a job runs, from the same period; the loop runs it through its
:class:`~greend.control.profile.ProfileRecorder` (:mod:`greend.control.profile`).

Restores: a job's settings are lifted when it ends (its client said so, hung up or
stopped heartbeating); everything is restored on SIGTERM, on ``greenctl cap reset``
and, after a crash, at the next start (the GPUs once their probe is open, through the
handles it holds) and by systemd's ``ExecStopPost``.

One failing device never stops a tick: every apply is caught and logged on its own.

The loop knows the node through a :class:`~greend.control.context.ControlContext`
(readings, jobs, stores, clocks, config), never through the daemon that runs it. Its
socket ops are in :mod:`greend.control.ops`.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from greend.control.context import ControlContext, NodeReadings
from greend.control.profile import ProfileRecorder
from greend.errors import ActuatorError, ConfigError, ProtocolError, StateError
from greend.points import Point, cap_fields, decision_point, ts_ns
from greend.policies.base import Decision, GpuView, Snapshot
from greend.protocol import NODE_OWNER, PACE_S_RANGE, POLICY_OWNER, is_step
from greend.settings import Setting

if TYPE_CHECKING:
    from greend.actuators.controller import Controller
    from greend.jobs.records import Job
    from greend.probes import Probe

# ControlContext and NodeReadings are defined in greend.control.context; the daemon
# imports them from here too.
__all__ = ["ControlContext", "ControlLoop", "NodeReadings", "setting_json"]

log = logging.getLogger(__name__)


class ControlLoop:
    """The clock/power policy and the precision policy of one node, the controller that
    applies their decisions, and the restores when jobs end or the daemon stops."""

    def __init__(self, ctx: ControlContext) -> None:
        self.ctx = ctx
        self.ctrl: Controller | None = None
        self._closed = False  # close() ran: the settings went back; job ends change nothing more
        self.policy: Any = None
        self.policy_state: Any = None
        # Beside the clock/power policy, an optional precision policy (its Decision
        # carries only ``precision``); both decide every period.
        self.precision_policy: Any = None
        self.precision_state: Any = None
        self._decided_by: Any = None  # the precision policy of the decision being applied
        self.last_decision: dict[str, Any] | None = None
        self.last_error: str | None = None
        self.disabled: str | None = None  # why control is off (no GPUs, a corrupt state file)
        self._last_s = float("-inf")
        self._pushed_pace: dict[str, tuple[float, float, int]] = {}  # job -> (pace, floor, re-check asked) last pushed
        self._lock = threading.RLock()  # the policies and their states: the tick and the socket ops
        self.profiler = ProfileRecorder(ctx, self, self._lock)  # greenctl profile record
        self._attach_lock = threading.Lock()
        self._pending_probe: Probe | None = None  # a GPU probe that opened before the controller existed
        self._attached: Probe | None = None
        self._leftover_keys: set[str] = set()

    # Set-up --------------------------------------------------------------------------
    @property
    def policy_name(self) -> str:
        return getattr(self.policy, "name", "none")

    def open(
        self,
        gpu_probe: Probe | None,
        rapl_open: bool,
        *,
        nvml_module: Callable[[], Any] | None = None,
    ) -> None:
        """Take control of the CPU zones (if RAPL is readable) and of the GPUs ``gpu_probe``
        reads (an open nvml or sim probe; None: none yet, :meth:`attach_gpus` hands them
        over once their probe opens); then start the configured policies.

        What an earlier run left in the saved-settings file (a crash, a SIGKILL) goes
        back first: the RAPL zones now, this greend's GPUs through the handles their
        probe holds once it is open, and any other backend's (another sim dir's, NVML's
        under ``--sim``) on a thread of its own (``nvml_module()``: the NVML to open for
        those)."""
        from greend.actuators import Controller, RaplBackend
        from greend.actuators.state import backend_key

        cfg = self.ctx.cfg
        try:
            ctrl = Controller(
                self.ctx.state_dir or cfg.daemon.state_dir,
                None,
                RaplBackend(cfg.probes.sysfs_root) if rapl_open else None,
                dry_run=cfg.daemon.dry_run,
            )
        except StateError as e:
            # Refuse to touch devices rather than lose the saved originals.
            self.disabled = f"control is off: {e}"
            log.error("%s", self.disabled)
            return
        self._leftover_keys = ctrl.leftover_gpu_keys()
        if ctrl.state_path.exists():
            self._report_leftovers(ctrl.restore_saved((), cpus=True))
        if cfg.sim.gpus > 0:
            own_gpu_key: str | None = backend_key("sim", str(Path(cfg.sim_dir).resolve()))
        else:
            own_gpu_key = "nvml" if "nvml" in cfg.enabled_probes else None
        others = self._leftover_keys - {own_gpu_key}
        if others:
            threading.Thread(
                target=self._restore_other_backends,
                args=(ctrl, others, nvml_module),
                name="restore-leftovers",
                daemon=True,
            ).start()
        with self._attach_lock:
            self.ctrl = ctrl
            pending = gpu_probe or self._pending_probe
        if pending is not None:
            self.attach_gpus(pending)
        self.set_policy(cfg.policy.name, dict(cfg.policy.params))
        self.set_precision_policy(cfg.policy.precision, dict(cfg.policy.precision_params))

    def _restore_other_backends(self, ctrl: Controller, keys: set[str], nvml_module: Callable[[], Any] | None) -> None:
        from greend.actuators.restore import add_recorded_backends

        add_recorded_backends(ctrl, keys, nvml_module() if nvml_module is not None else None)
        self._report_leftovers(ctrl.restore_saved(keys, cpus=False))

    def attach_gpus(self, gpu_probe: Probe) -> None:
        """Drive the GPUs ``gpu_probe`` reads (called when it opens, from the thread that
        opened it): what an earlier run left on them is restored first, through the
        handles the probe holds, then the policies may act on them."""
        from greend.actuators import NvmlGpuBackend
        from greend.probes.base import ShowsClockCaps

        with self._attach_lock:
            ctrl = self.ctrl
            if ctrl is None:
                self._pending_probe = gpu_probe  # open() attaches it
                return
            if self._attached is gpu_probe:
                return
            self._attached = gpu_probe
        backend = NvmlGpuBackend(gpu_probe)  # type: ignore[arg-type]  # the nvml and sim probes are NvmlProbes
        ctrl.add_gpu_backend(backend)
        if backend.key in self._leftover_keys:
            self._report_leftovers(ctrl.restore_saved({backend.key}, cpus=False))
        ctrl.set_gpu_backend(backend)
        if isinstance(gpu_probe, ShowsClockCaps):
            gpu_probe.use_cap_lookup(ctrl.clock_cap_mhz)

    def precision_tolerance(self) -> float | None:
        """The running precision policy's ``tolerance`` (``[policy.precision_params]``, or
        the main policy's own where that is the precision policy), or None where none runs."""
        with self._lock:
            for policy in (self.precision_policy, self.policy):
                if policy is not None and policy.name == "precision":
                    tolerance = policy.params().get("tolerance")
                    return float(tolerance) if isinstance(tolerance, (int, float)) else None
        return None

    def set_precision_policy(self, name: str, params: dict[str, Any]) -> None:
        from greend.policies import get_policy

        policy = None
        if name not in ("", "none"):
            try:
                policy = get_policy(name, **params)
            except (ValueError, TypeError, KeyError) as e:
                raise ConfigError(f"[policy] precision {name!r}: {e}") from e
        with self._lock:
            old = self.precision_policy
            if _same(old, policy):
                return  # the same policy: it goes on as it was
            self.precision_policy = policy
            self.precision_state = None if policy is None else policy.new_state()
        if old is not None:
            # What the old policy set goes back: every job to its own level (the new one,
            # if any, starts from there).
            asked = self.ctx.jobs.back_to_own_levels(
                f"precision policy changed to {name or 'none'}: back to the job's own level",
                policy=name or "none",
            )
            if asked:
                log.info("precision policy changed: %s asked back to their own level", ", ".join(asked))
        if policy is not None:
            log.info("precision policy %s %s", name, policy.params())

    def set_policy(self, name: str, params: dict[str, Any]) -> dict[str, Any]:
        from greend.policies import get_policy

        try:
            policy = get_policy(name, **params)
        except (ValueError, TypeError, KeyError) as e:
            msg = str(e)  # the policy's own errors already name it
            raise ConfigError(msg if msg.startswith(f"policy {name!r}") else f"policy {name!r}: {msg}") from e
        with self._lock:
            old = self.policy
            if _same(old, policy):
                return self.show()  # the same policy: it goes on as it was (its search, its caps)
            self.policy = policy
            self.policy_state = policy.new_state()
            self.last_decision = None
            self._pushed_pace.clear()
        if old is not None and self.ctrl is not None:
            # What the old policy set (for jobs, or node-wide) goes back; an admin's caps stay.
            for owner in list(self.ctrl.owners()):
                if owner != NODE_OWNER:
                    self.report_restore(self.ctrl.restore_owner(owner), f"policy changed to {name}")
        log.info("policy %s %s", name, policy.params())
        return self.show()

    # The decision step ---------------------------------------------------------------
    def due(self, now_s: float) -> bool:
        return (
            self.ctrl is not None
            and self.policy is not None
            and now_s - self._last_s >= self.ctx.cfg.policy.period_s - 1e-9
        )

    def step(self, now_s: float) -> None:
        if not self.due(now_s):
            return
        self._last_s = now_s
        self.profiler.step(now_s)
        try:
            snap = self.snapshot(now_s)
            with self._lock:
                decided_by = self.precision_policy  # (apply() sends its levels only while it holds)
                decision = self.policy.decide(snap, self.policy_state)
                said = [(self.policy.name, decision.details.get("reasons") or {}, decision.reason)]
                if self.precision_policy is not None:
                    by_precision = self.precision_policy.decide(snap, self.precision_state)
                    said.append(
                        (self.precision_policy.name, by_precision.details.get("reasons") or {}, by_precision.reason)
                    )
                    decision.precision.update(by_precision.precision)
                    if by_precision.reason:
                        decision.reason = "; ".join(r for r in (decision.reason, by_precision.reason) if r)
                    if by_precision.details:
                        decision.details = {**decision.details, "precision": by_precision.details}
            for name, per_job, reason in said:  # outside the lock: the registry takes its own
                self._note(snap, name, per_job, reason)
        except Exception as e:
            msg = f"{type(e).__name__}: {e}"
            if msg != self.last_error:
                log.exception("policy %s failed", getattr(self.policy, "name", "?"))
            self.last_error = msg
            return
        self.last_error = None
        self._decided_by = decided_by
        try:
            self.apply(decision, now_s)
        except Exception as e:  # the daemon goes on; the next tick decides again
            msg = f"applying {getattr(self.policy, 'name', '?')}'s decision: {type(e).__name__}: {e}"
            if msg != self.last_error:
                log.exception("applying policy %s's decision failed", getattr(self.policy, "name", "?"))
            self.last_error = msg

    def _note(self, snap: Snapshot, policy: str, per_job: dict[str, str], reason: str) -> None:
        """Keep each running job's latest word from ``policy`` (its own line in
        ``per_job`` where the policy gives one, else its decision's ``reason``): why a job
        was not capped or not switched outlives the job."""
        role = "precision" if policy == "precision" else "clocks"
        for j in snap.jobs:
            if j.state == "running":
                self.ctx.jobs.note(j.job, policy=policy, role=role, reason=per_job.get(j.job) or reason)

    def snapshot(self, now_s: float) -> Snapshot:
        """What the policies see: the GPUs with the settings in force, the running jobs
        and the CPU zones' power."""
        assert self.ctrl is not None
        ctrl = self.ctrl
        readings = self.ctx.latest()
        self._read_back([g.index for g in readings.gpus])
        gpus = []
        for g in readings.gpus:
            cur = self.ctrl.current(g.index)
            asked = ctrl.mismatches(g.index).get("clock_cap_mhz")
            gpus.append(
                GpuView(
                    index=g.index,
                    source=g.source,
                    power_w=g.power_w,
                    sm_clock_mhz=g.sm_clock_mhz,
                    clock_cap_mhz=cur.clock_cap_mhz,
                    power_limit_w=g.power_limit_w if cur.power_limit_w is None else cur.power_limit_w,
                    supported_sm_clocks_mhz=tuple(g.supported_sm_clocks_mhz),
                    power_limit_min_w=g.power_limit_min_w,
                    power_limit_max_w=g.power_limit_max_w,
                    power_limit_default_w=g.power_limit_default_w,
                    refused_knobs={k: r["reason"] for k, r in ctrl.refused_knobs(g.index).items()},
                    clock_cap_asked_mhz=None if asked is None else asked["asked"],
                    util_pct=g.util_gpu_pct,
                    sm_active_pct=g.sm_active_pct,
                )
            )
        self.ctx.jobs.proposals_not_taken()  # logged once each, before the policy looks
        jobs = self.ctx.jobs.views(ctrl.current)
        cpu_power = None
        zones: dict[str, float] = {}
        for c in readings.cpus:
            p = c.power_w if c.power_w is not None else self.ctx.ledger.power_w(c.key)
            if p is None:
                continue
            zones[c.path] = p
            if c.counted:
                cpu_power = (cpu_power or 0.0) + p
        return Snapshot(t_s=now_s, gpus=tuple(gpus), jobs=tuple(jobs), cpu_power_w=cpu_power, cpu_zones=zones)

    def _read_back(self, gpus: list[int]) -> None:
        """Each period, before the policies book a measurement: on each GPU whose
        setting the GPU could not show when it was written (idle then, or held below it
        by power or heat), read back what it holds now. A cap found to differ (a driver
        that clamped the lock) is what the GPU ran at since the write: recorded as a cap
        change (for the jobs on it too), and every measure carries the setting in force."""
        assert self.ctrl is not None
        jobs = self.ctx.jobs
        for gpu in gpus:
            self.ctrl.reassert(gpu)  # a GPU found again after a reset: greend's settings again
            if not self.ctrl.unverified(gpu) or not self.ctrl.verify(gpu):
                continue
            held = self.ctrl.current(gpu)
            reason = f"read back: gpu{gpu} holds a clock cap of {held.clock_cap_mhz} MHz, not the one asked for"
            on_it = [j for j in jobs.running_ids() if gpu in getattr(jobs.get(j), "gpus", ())]
            self.ctx.emit([self.cap_point(ts_ns(self.ctx.wall()), held, reason, gpu=gpu, job=",".join(on_it))])
            for job_id in on_it:
                jobs.record_cap_change(
                    job_id, clock_cap_mhz=held.clock_cap_mhz, power_limit_w=held.power_limit_w, reason=reason
                )

    def _lift_unsteered(self, now_s: float) -> None:
        """A running job's caps on a GPU it no longer steers (another job's work came there:
        a GPU two jobs use is steered by neither) are lifted: no job's setting slows
        another's work. Its caps on the GPUs it still steers stay."""
        assert self.ctrl is not None
        jobs = self.ctx.jobs
        owners = self.ctrl.owners()
        for job_id in jobs.running_ids():
            owned = {int(k[3:].split(".")[0]) for k in owners.get(job_id, []) if k.startswith("gpu")}
            gone = owned - set(jobs.steered_gpus(job_id))
            if not gone:
                continue
            report = self.ctrl.restore_owner(job_id, gpus=gone)
            if report.restored:
                log.info("job %s: caps lifted on %s: another job uses the GPU now", job_id, ", ".join(report.restored))
                jobs.reset_measure(job_id, now_s + self.ctx.cfg.policy.settle_s)

    def apply(self, decision: Decision, now_s: float) -> None:
        assert self.ctrl is not None
        ctx = self.ctx
        jobs = ctx.jobs
        settle_s = ctx.cfg.policy.settle_s
        changed: list[str] = []
        points: list[Point] = []
        ts = ts_ns(ctx.wall())
        self._lift_unsteered(now_s)
        for job_id in list(decision.settings) + [k for k in decision.job_gpu_settings if k not in decision.settings]:
            job = jobs.get(job_id)
            if job is None or not job.running:
                continue
            job_gpus = jobs.steered_gpus(job_id)  # its GPUs in use, none that is idle or shared
            moved = False
            setting = decision.settings.get(job_id)
            per_gpu = decision.job_gpu_settings.get(job_id, {})
            for gpu in job_gpus:
                want = per_gpu.get(gpu, setting)  # a paced GPU's own, else the job's
                if want is None:
                    continue
                before = self.ctrl.current(gpu)
                in_force = self._apply_gpu(gpu, want, owner=job_id)
                if in_force is not None and in_force != before:
                    moved = True
                    points.append(self.cap_point(ts, in_force, decision.reason, gpu=gpu, job=job_id))
            if moved:
                jobs.reset_measure(job_id, now_s + settle_s)
                now_in_force = self.ctrl.current(job_gpus[0])
                jobs.record_cap_change(
                    job_id,
                    clock_cap_mhz=now_in_force.clock_cap_mhz,
                    power_limit_w=now_in_force.power_limit_w,
                    reason=decision.reason,
                )
                changed.append(job_id)
        held: list[str] = []
        for gpu, setting in decision.gpu_settings.items():
            before = self.ctrl.current(gpu)
            in_force = self._apply_gpu(gpu, setting, owner=POLICY_OWNER)
            if in_force is not None and in_force != before:
                points.append(self.cap_point(ts, in_force, decision.reason, gpu=gpu))
                jobs.reset_measures_on_gpu(gpu, now_s + settle_s)
            if in_force is not None:
                held += _held_otherwise(gpu, setting, in_force, self.ctrl.owners().get(NODE_OWNER, []))
        if held:
            # What the GPU holds where it could not take what was asked (its range), said
            # beside the decision: "power <= 1 W" read as in force while it held 200 W.
            decision.reason = f"{decision.reason}; {', '.join(held)}" if decision.reason else ", ".join(held)
        for zone, watts in decision.cpu_power_limit_w.items():
            try:
                self.ctrl.apply_cpu_limit(zone, watts, POLICY_OWNER)
            except (ActuatorError, StateError) as e:
                log.error("cpu limit %s: %s", zone, e)
        # The precision policy's details: under "precision" when it runs beside a clock
        # policy, the decision's own when it is the policy (greenctl policy set precision).
        precision_details = decision.details.get("precision") or (
            decision.details if decision.details.get("policy") == "precision" else {}
        )
        decided_by = self._decided_by

        def still_decided() -> bool:
            # The precision policy was turned off or replaced while this decision was made or
            # applied: its levels are void (the change asks every job back to its own, after).
            return self.precision_policy is decided_by

        if not still_decided():
            decision.precision.clear()
        for job_id, level in decision.precision.items():
            # The precision policy's own line for this job, not the joined reasons.
            reason = (precision_details.get("reasons") or {}).get(job_id) or decision.reason
            event = ((precision_details.get("jobs") or {}).get(job_id) or {}).get("event") or {}
            kind = "rollback" if event.get("kind") == "rollback" else "switch"
            jobs.switch_precision(
                job_id,
                level,
                reason,
                kind=kind,
                trend=event.get("trend"),
                policy=self.policy_name,
                valid=still_decided,
            )
        self._push_paces(decision)
        if points:
            ctx.emit(points)
        if changed or decision.gpu_settings or decision.precision:
            log.info("decision: %s", decision.reason)
        self.last_decision = {
            "t": ctx.wall(),
            "reason": decision.reason,
            "details": _jsonable(decision.details),
            "changed_jobs": changed,
        }

    def _apply_gpu(self, gpu: int, setting: Setting, owner: str) -> Setting | None:
        """Apply a policy's setting for ``owner``; a knob an admin capped (``greenctl cap
        set``) is left alone, in force and still the admin's, whatever the policy asks:
        an admin's cap outlives policies (a policy that took it over would hand back the
        factory value when it lets go, not the admin's)."""
        assert self.ctrl is not None
        admin = self.ctrl.owners().get(NODE_OWNER, [])
        # A knob the GPU refused (recorded and logged once) is left alone: asking again
        # every period would only log the same refusal again.
        refused = self.ctrl.refused_knobs(gpu)
        keep = tuple(
            knob for knob in ("clock_cap_mhz", "power_limit_w") if knob in refused or f"gpu{gpu}.{knob}" in admin
        )
        if len(keep) == 2 and refused:
            return self.ctrl.current(gpu)
        try:
            return self.ctrl.apply_gpu(gpu, setting, owner, keep=keep)
        except (ActuatorError, StateError) as e:
            refused_now = set(self.ctrl.refused_knobs(gpu)) - set(refused)
            # A knob refused just now was logged once where it was refused; not twice.
            (log.debug if refused_now else log.error)(
                "gpu%d: cannot apply %s for %s: %s", gpu, setting_json(setting), owner, e
            )
            return None

    def cap_point(self, ts: int, in_force: Setting, reason: str, *, gpu: int, job: str = "") -> Point:
        """The ``greend_decision`` point of a GPU setting now in force (``job``: whose)."""
        return decision_point(
            ts,
            self.ctx.hostname,
            kind="cap",
            reason=reason,
            policy=self.policy_name,
            job=job,
            gpu=gpu,
            fields=cap_fields(
                clock_cap_mhz=in_force.clock_cap_mhz, power_limit_w=in_force.power_limit_w, capped=not in_force.uncapped
            ),
        )

    def _push_paces(self, decision: Decision) -> None:
        """Tell each job's ranks this node's uncapped step time, for the cross-node pace,
        the lowest it measured, for the job's floor, and the job step it asks every node to
        re-check its baseline from (0: none; policies/_recheck.py)."""
        jobs = self.ctx.jobs
        for job_id, details in (decision.details.get("jobs") or {}).items():
            time_per_flop_s = details.get("baseline_time_per_flop_s")
            # (the policy's FLOPs per step now; else the job's mean: the ranks' figures are read back with the same)
            flops_per_step = details.get("flops_per_step") or (jobs.flops_per_step(job_id) if time_per_flop_s else None)
            if not time_per_flop_s or not flops_per_step:  # (a job that counts no FLOPs has no pace here)
                continue
            step_s = float(time_per_flop_s) * flops_per_step
            # And the lowest uncapped step it measured at the job's level (the job's floor; none yet: none).
            low = details.get("floor_time_per_flop_s")
            floor_s = float(low) * flops_per_step if low else 0.0
            lo, hi = PACE_S_RANGE  # (what the ranks may send back in op "pace": a sim's tiny step is out)
            if not (math.isfinite(step_s) and lo <= step_s <= hi and math.isfinite(floor_s) and floor_s >= 0):
                continue
            if not lo <= floor_s <= hi:
                floor_s = 0.0  # (none)
            ask = details.get("recheck_at")
            ask = ask if is_step(ask) else 0
            last = self._pushed_pace.get(job_id)
            if (
                last is not None
                and ask == last[2]
                and all(abs(a - b) <= 0.01 * b for a, b in zip((step_s, floor_s), last[:2], strict=True))
            ):
                continue
            event = {"event": "local_pace", "step_s": step_s, **({"floor_s": floor_s} if floor_s > 0 else {})}
            event["recheck_at"] = ask  # (always: a rank sends it back only to a daemon that pushes it)
            if jobs.push(job_id, event):
                self._pushed_pace[job_id] = (step_s, floor_s, ask)

    # Restores ------------------------------------------------------------------------
    def job_ended(self, job: Job) -> None:
        if self.ctrl is None or self._closed:
            return  # (the jobs the daemon's stop ends: their settings went back with close())
        self.profiler.job_ended(job)
        self._pushed_pace.pop(job.job, None)
        self.report_restore(self.ctrl.restore_owner(job.job), f"job {job.job} ended ({job.end_reason})")

    def restore_all(self, why: str) -> Any:
        if self.ctrl is None:
            return None
        rep = self.ctrl.restore_all()
        self.report_restore(rep, why)
        return rep

    @staticmethod
    def _report_leftovers(rep: Any) -> None:
        """Log what the restore of an earlier run's settings did (nothing when nothing was there)."""
        if not rep.restored and not rep.failed:
            return
        for line in rep.lines():
            (log.warning if not rep.ok else log.info)("restore at start: %s", line)

    def report_restore(self, rep: Any, why: str) -> None:
        """Log what a restore put back (or failed to)."""
        lines = rep.lines()
        for line in lines:
            (log.info if rep.ok else log.error)("restore (%s): %s", why, line)

    def close(self) -> None:
        self._closed = True
        if self.ctrl is not None:
            self.profiler.close()
            self.restore_all("daemon stopping")
            self.ctrl.close()

    def need_ctrl(self) -> Controller:
        """The controller, or a refusal that says why there is none."""
        if self._closed:  # (its settings went back: one written now would outlive the daemon)
            raise StateError("the daemon is stopping: its settings went back; try again once it runs")
        if self.ctrl is None:
            raise ProtocolError(self.disabled or "no devices to control on this node (see greenctl probes)")
        return self.ctrl

    def show(self) -> dict[str, Any]:
        """The ``policy_show`` document: the policies, the last decision and what is held."""
        from greend.policies import POLICIES

        policy = self.policy
        precision = self.precision_policy
        return {
            "name": self.policy_name,
            "params": policy.params() if policy is not None else {},
            "precision": {"name": precision.name, "params": precision.params()} if precision is not None else None,
            "period_s": self.ctx.cfg.policy.period_s,
            "available": sorted(POLICIES),
            "last_decision": self.last_decision,
            "last_error": self.last_error,
            "disabled": self.disabled,
            "dry_run": self.ctx.cfg.daemon.dry_run,
            "settings": self.ctrl.snapshot() if self.ctrl is not None else {},
            "owners": self.ctrl.owners(in_force=True) if self.ctrl is not None else {},
        }

    def status(self) -> dict[str, Any]:
        """The ``policy`` part of the daemon's status."""
        precision = self.precision_policy
        return {
            "name": self.policy_name,
            "params": self.policy.params() if self.policy is not None else {},
            "precision": {"name": precision.name, "params": precision.params()} if precision is not None else None,
            "last_decision": self.last_decision,
            "last_error": self.last_error,
            "disabled": self.disabled,
            "owners": self.ctrl.owners(in_force=True) if self.ctrl is not None else {},
        }


def setting_json(s: Setting) -> dict[str, Any]:
    return {"clock_cap_mhz": s.clock_cap_mhz, "power_limit_w": s.power_limit_w}


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, Setting):
        return setting_json(v)
    if isinstance(v, float) and not math.isfinite(v):  # (JSON has no NaN or infinity)
        return None
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return str(v)


def _same(old: Any, new: Any) -> bool:
    """Whether ``new`` is the policy ``old`` already is (the same name and parameters)."""
    return old is not None and new is not None and old.name == new.name and old.params() == new.params()


def _held_otherwise(gpu: int, asked: Setting, held: Setting, admin: list[str]) -> list[str]:
    """Where ``gpu`` holds other than ``asked`` beyond rounding (a power limit clamped to its
    range; a clock cap more than one 15 MHz step from the asked one, past snapping), and
    why: its range, or an admin's cap (``admin``: the knobs the node's admin holds)."""
    out = []
    for knob, unit, slack in (("power_limit_w", "W", 0.5), ("clock_cap_mhz", "MHz", 15)):
        want, got = getattr(asked, knob), getattr(held, knob)
        if want is not None and got is not None and abs(got - want) > slack:
            why = "an admin's cap" if f"gpu{gpu}.{knob}" in admin else "its range"
            out.append(f"gpu{gpu} holds {got:g} {unit} ({why})")
    return out
