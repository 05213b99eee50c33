"""The control loop: snapshot -> policy -> decision -> actuators, and its socket ops.

Every ``policy.period_s`` the tick loop calls :meth:`ControlLoop.step`: it builds a
:class:`greend.policies.base.Snapshot` from the daemon's readings, the controller's
settings and each job's steps since its current setting took effect, asks the
policy, and applies the :class:`~greend.policies.base.Decision` through the
:class:`~greend.actuators.Controller` (which saves every original before its first
write). A decision's reason is logged, stored (``greend_decision``), kept in the
job's report and shown by ``greenctl status``.

Restores: a job's settings are lifted when it ends (its client said so, hung up or
stopped heartbeating); everything is restored on SIGTERM, on ``greenctl cap reset``
and, after a crash, at the next start (and by systemd's ``ExecStopPost``).

One failing device never stops a tick: every apply is caught and logged on its own.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from greend.policies.base import Decision, GpuView, JobView, Setting, Snapshot

from greend.errors import ActuatorError, ConfigError, GreendError, ProtocolError, StateError
from greend.ipc.server import Connection, Handler
from greend.protocol import NODE_OWNER, POLICY_OWNER
from greend.sinks import Point

if TYPE_CHECKING:
    from greend.actuators.controller import Controller
    from greend.daemon.core import Daemon
    from greend.jobs.registry import Job

__all__ = ["ControlLoop"]

log = logging.getLogger(__name__)



class ControlLoop:
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        self.ctrl: Controller | None = None
        self.policy: Any = None
        self.policy_state: Any = None
        # Beside the clock/power policy, an optional precision policy (its Decision
        # carries only ``precision``); both decide every period.
        self.precision_policy: Any = None
        self.precision_state: Any = None
        self.last_decision: dict[str, Any] | None = None
        self.last_error: str | None = None
        self.disabled: str | None = None  # why control is off (no GPUs, a corrupt state file)
        self._last_s = float("-inf")
        self._pushed_pace: dict[str, float] = {}
        self._lock = threading.RLock()

    # Set-up --------------------------------------------------------------------------
    def restore_leftovers(self) -> None:
        """A previous daemon died without restoring: put its settings back first."""
        from greend.actuators.restore import restore_from_state_dir
        from greend.actuators.state import StateFile

        state_dir = self.d.cfg.daemon.state_dir
        if not StateFile(state_dir).path.exists():
            return
        rep = restore_from_state_dir(state_dir, nvml_module=self.d.probe_context().nvml_module)
        for line in rep.lines():
            (log.warning if not rep.ok else log.info)("restore at start: %s", line)

    def open(self) -> None:
        from greend.actuators.controller import Controller, NvmlGpuBackend, RaplBackend

        gpu_probe = next((p for p in self.d.probes if p.name in ("nvml", "sim") and self.d.stats[p.name].open),
                         None)
        rapl_open = bool(self.d.stats.get("rapl") and self.d.stats["rapl"].open)
        try:
            self.ctrl = Controller(
                self.d.cfg.daemon.state_dir,
                NvmlGpuBackend(gpu_probe) if gpu_probe is not None else None,  # type: ignore[arg-type]
                RaplBackend(self.d.cfg.probes.sysfs_root) if rapl_open else None,
                dry_run=self.d.cfg.daemon.dry_run,
            )
        except StateError as e:
            # Refuse to touch devices rather than lose the saved originals.
            self.disabled = f"control is off: {e}"
            log.error("%s", self.disabled)
            return
        if gpu_probe is not None:
            gpu_probe.cap_lookup = self.ctrl.clock_cap_mhz  # type: ignore[attr-defined]
        self.set_policy(self.d.cfg.policy.name, dict(self.d.cfg.policy.params))
        self.set_precision_policy(self.d.cfg.policy.precision, dict(self.d.cfg.policy.precision_params))

    def set_precision_policy(self, name: str, params: dict[str, Any]) -> None:
        from greend.policies import get_policy

        if name in ("", "none"):
            self.precision_policy = self.precision_state = None
            return
        try:
            policy = get_policy(name, **params)
        except (ValueError, TypeError, KeyError) as e:
            raise ConfigError(f"[policy] precision {name!r}: {e}") from e
        with self._lock:
            self.precision_policy, self.precision_state = policy, policy.new_state()
        log.info("precision policy %s %s", name, policy.params())

    def set_policy(self, name: str, params: dict[str, Any]) -> dict[str, Any]:
        from greend.policies import get_policy

        try:
            policy = get_policy(name, **params)
        except (ValueError, TypeError, KeyError) as e:
            raise ConfigError(f"policy {name!r}: {e}") from e
        with self._lock:
            old = self.policy
            self.policy = policy
            self.policy_state = policy.new_state()
            self.last_decision = None
            self._pushed_pace.clear()
        if old is not None and self.ctrl is not None:
            # What the old policy set (for jobs, or node-wide) goes back; an admin's caps stay.
            for owner in list(self.ctrl.owners()):
                if owner != NODE_OWNER:
                    self._report(self.ctrl.restore_owner(owner), f"policy changed to {name}")
        log.info("policy %s %s", name, policy.params())
        return self.show()

    # The decision step ---------------------------------------------------------------
    def due(self, now_s: float) -> bool:
        return self.ctrl is not None and self.policy is not None and \
            now_s - self._last_s >= self.d.cfg.policy.period_s - 1e-9

    def step(self, now_s: float) -> None:
        if not self.due(now_s):
            return
        self._last_s = now_s
        try:
            snap = self.snapshot(now_s)
            with self._lock:
                decision = self.policy.decide(snap, self.policy_state)
                if self.precision_policy is not None:
                    extra = self.precision_policy.decide(snap, self.precision_state)
                    decision.precision.update(extra.precision)
                    if extra.reason:
                        decision.reason = "; ".join(r for r in (decision.reason, extra.reason) if r)
                    if extra.details:
                        decision.details = {**decision.details, "precision": extra.details}
        except Exception as e:  # noqa: BLE001 - a policy bug never stops the daemon
            msg = f"{type(e).__name__}: {e}"
            if msg != self.last_error:
                log.exception("policy %s failed", getattr(self.policy, "name", "?"))
            self.last_error = msg
            return
        self.last_error = None
        self.apply(decision, now_s)

    def snapshot(self, now_s: float) -> Snapshot:
        assert self.ctrl is not None
        d = self.d
        with d._snap_lock:  # noqa: SLF001 - the daemon's own snapshot
            snap = d.snapshot
        gpus = []
        for g in snap.gpus:
            cur = self.ctrl.current(g.index)
            gpus.append(GpuView(
                index=g.index, source=g.source, power_w=g.power_w, sm_clock_mhz=g.sm_clock_mhz,
                clock_cap_mhz=cur.clock_cap_mhz,
                power_limit_w=g.power_limit_w if cur.power_limit_w is None else cur.power_limit_w,
                supported_sm_clocks_mhz=tuple(g.supported_sm_clocks_mhz),
                power_limit_min_w=g.power_limit_min_w, power_limit_max_w=g.power_limit_max_w,
                power_limit_default_w=g.power_limit_default_w,
            ))
        jobs = []
        reg = d.jobs
        with reg._lock:  # noqa: SLF001
            for job in reg.jobs.values():
                if job.state != "running" or not job.gpus:
                    continue
                setting = self.ctrl.current(min(job.gpus))
                measure = reg.measure(job, setting)
                precisions = sorted({p for rs in job.ranks.values() for p in rs.precisions}) or ["fp32"]
                jobs.append(JobView(
                    job=job.job, gpus=tuple(sorted(job.gpus)), state=job.state, steps=job.steps,
                    precision=job.precision, precisions=tuple(precisions), measure=measure, setting=setting,
                    pace_s=job.pace_s, loss_recent=tuple(job.losses),
                    nonfinite_recent=len(job.nonfinite_recent),
                    precision_events=tuple(job.precision_log[-32:]),
                ))
        cpu_power = None
        zones: dict[str, float] = {}
        for c in snap.cpus:
            p = c.power_w if c.power_w is not None else d.ledger.power_w(c.key)
            if p is None:
                continue
            zones[c.path] = p
            if c.counted:
                cpu_power = (cpu_power or 0.0) + p
        return Snapshot(t_s=now_s, gpus=tuple(gpus), jobs=tuple(jobs), cpu_power_w=cpu_power, cpu_zones=zones)

    def apply(self, decision: Decision, now_s: float) -> None:
        assert self.ctrl is not None
        d = self.d
        reg = d.jobs
        changed: list[str] = []
        points: list[Point] = []
        ts = int(d.wall() * 1e9)
        for job_id, setting in decision.settings.items():
            job = reg.jobs.get(job_id)
            if job is None or job.state != "running":
                continue
            moved = False
            for gpu in sorted(job.gpus):
                before = self.ctrl.current(gpu)
                in_force = self._apply_gpu(gpu, setting, owner=job_id)
                if in_force is not None and in_force != before:
                    moved = True
                    points.append(self._decision_point(ts, gpu, job_id, in_force, decision.reason))
            if moved:
                reg.reset_measure(job_id, now_s + d.cfg.policy.settle_s)
                entry = {"t": d.wall(), "setting": _setting_json(self.ctrl.current(min(job.gpus))),
                         "reason": decision.reason}
                job.decisions.append(entry)
                changed.append(job_id)
        for gpu, setting in decision.gpu_settings.items():
            before = self.ctrl.current(gpu)
            in_force = self._apply_gpu(gpu, setting, owner=POLICY_OWNER)
            if in_force is not None and in_force != before:
                points.append(self._decision_point(ts, gpu, "", in_force, decision.reason))
                for job in reg.jobs.values():
                    if gpu in job.gpus and job.state == "running":
                        reg.reset_measure(job.job, now_s + d.cfg.policy.settle_s)
        for zone, watts in decision.cpu_power_limit_w.items():
            try:
                self.ctrl.apply_cpu_limit(zone, watts, POLICY_OWNER)
            except (ActuatorError, StateError) as e:
                log.error("cpu limit %s: %s", zone, e)
        prec = decision.details.get("precision") or {}
        for job_id, level in decision.precision.items():
            # The precision policy's own line for this job, not the joined reasons.
            reason = (prec.get("reasons") or {}).get(job_id) or decision.reason
            event = ((prec.get("jobs") or {}).get(job_id) or {}).get("event") or {}
            kind = "rollback" if event.get("kind") == "rollback" else "switch"
            self.d.set_precision(job_id, level, reason, kind=kind, trend=event.get("trend"))
        self._push_paces(decision)
        if points:
            d.emit(points)
        if changed or decision.gpu_settings or decision.precision:
            log.info("decision: %s", decision.reason)
        self.last_decision = {"t": d.wall(), "reason": decision.reason, "details": _jsonable(decision.details),
                              "changed_jobs": changed}

    def _apply_gpu(self, gpu: int, setting: Setting, owner: str) -> Setting | None:
        """Apply a policy's setting for ``owner``; a knob the setting leaves at None that an
        admin capped (``greenctl cap set``) is left alone, in force and still the admin's."""
        assert self.ctrl is not None
        admin = self.ctrl.owners().get(NODE_OWNER, [])
        keep = tuple(knob for knob, value in (("clock_cap_mhz", setting.clock_cap_mhz),
                                              ("power_limit_w", setting.power_limit_w))
                     if value is None and f"gpu{gpu}.{knob}" in admin)
        try:
            return self.ctrl.apply_gpu(gpu, setting, owner, keep=keep)
        except (ActuatorError, StateError) as e:
            log.error("gpu%d: cannot apply %s for %s: %s", gpu, _setting_json(setting), owner, e)
            return None

    def _decision_point(self, ts: int, gpu: int, job: str, s: Setting, reason: str) -> Point:
        fields: dict[str, float | int | str | bool] = {"capped": int(not s.uncapped), "reason": reason}
        if s.clock_cap_mhz is not None:
            fields["clock_cap_mhz"] = float(s.clock_cap_mhz)
        if s.power_limit_w is not None:
            fields["power_limit_w"] = float(s.power_limit_w)
        return Point("greend_decision", {"host": self.d.hostname, "gpu": str(gpu), "job": job,
                                         "policy": getattr(self.policy, "name", "none"), "kind": "cap"},
                     fields, ts)

    def _push_paces(self, decision: Decision) -> None:
        """Tell each job's ranks this node's uncapped step time, for the cross-node pace."""
        reg = self.d.jobs
        for job_id, det in (decision.details.get("jobs") or {}).items():
            tpf = det.get("baseline_time_per_flop_s")
            job = reg.jobs.get(job_id)
            if not tpf or job is None or job.steps == 0 or job.step_reports == 0:
                continue
            flops_per_step = job.flops / job.step_reports
            step_s = float(tpf) * flops_per_step
            last = self._pushed_pace.get(job_id)
            if last is not None and abs(step_s - last) <= 0.01 * last:
                continue
            if reg.push(job_id, {"event": "local_pace", "step_s": step_s}):
                self._pushed_pace[job_id] = step_s

    # Restores ------------------------------------------------------------------------
    def job_ended(self, job: Job) -> None:
        if self.ctrl is None:
            return
        self._pushed_pace.pop(job.job, None)
        self._report(self.ctrl.restore_owner(job.job), f"job {job.job} ended ({job.end_reason})")

    def restore_all(self, why: str) -> Any:
        if self.ctrl is None:
            return None
        rep = self.ctrl.restore_all()
        self._report(rep, why)
        return rep

    def _report(self, rep: Any, why: str) -> None:
        lines = rep.lines()
        for line in lines:
            (log.info if rep.ok else log.error)("restore (%s): %s", why, line)

    def close(self) -> None:
        if self.ctrl is not None:
            self.restore_all("daemon stopping")
            self.ctrl.close()

    # Socket ops ----------------------------------------------------------------------
    def handlers(self) -> dict[str, Handler]:
        """The socket ops this loop answers (their schemas are in greend.protocol)."""
        return {
            "cap_set": self.op_cap_set,
            "cap_reset": self.op_cap_reset,
            "policy_show": lambda m, c: self.show(),
            "policy_set": self.op_policy_set,
        }

    def _need_ctrl(self) -> Controller:
        if self.ctrl is None:
            raise ProtocolError(self.disabled or "no devices to control on this node (see greenctl probes)")
        return self.ctrl

    def _cpu_zone(self, name: str) -> Any:
        """The RAPL zone a user names: its kernel name (``package-0``) or id (``intel-rapl:0``)."""
        zones = [c for c in self.d.snapshot.cpus if c.source == "rapl"]
        found = [c for c in zones if name in (c.zone, c.path)]
        if len(found) != 1:
            known = ", ".join(f"{c.zone} ({c.path})" for c in zones) or "none: no readable RAPL zone here"
            what = "is ambiguous" if found else "is not a RAPL zone on this node"
            raise ProtocolError(f"cpu_zone {name!r} {what}; zones: {known}", field="cpu_zone")
        return found[0]

    def op_cap_set(self, msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
        ctrl = self._need_ctrl()
        clock, power = msg.get("max_clock_mhz"), msg.get("power_limit_w")
        if (msg.get("gpu") is None) == (msg.get("cpu_zone") is None):
            raise ProtocolError("give exactly one of gpu and cpu_zone", field="gpu")
        if msg.get("cpu_zone") is not None:
            return self._cap_set_cpu(ctrl, msg["cpu_zone"], clock, power, conn)
        if (clock is None) == (power is None):
            raise ProtocolError("give exactly one of max_clock_mhz and power_limit_w", field="max_clock_mhz")
        gpu = msg["gpu"]
        if gpu not in [g.index for g in self.d.snapshot.gpus]:
            raise ProtocolError(f"no GPU {gpu} on this node", field="gpu")
        cur = ctrl.current(gpu)
        setting = Setting(clock if clock is not None else cur.clock_cap_mhz,
                          power if power is not None else cur.power_limit_w)
        try:
            in_force = ctrl.apply_gpu(gpu, setting, NODE_OWNER)
        except (ActuatorError, StateError) as e:
            raise GreendError(str(e)) from e
        ts = int(self.d.wall() * 1e9)
        self.d.emit([self._decision_point(ts, gpu, "", in_force, f"greenctl cap set (uid {conn.peer.uid})")])
        for job in self.d.jobs.jobs.values():
            if gpu in job.gpus and job.state == "running":
                self.d.jobs.reset_measure(job.job, self.d.monotonic() + self.d.cfg.policy.settle_s)
        log.info("gpu%d: cap set by uid %d: %s", gpu, conn.peer.uid, _setting_json(in_force))
        return {"gpu": gpu, "in_force": _setting_json(in_force), "dry_run": ctrl.dry_run}

    def _cap_set_cpu(self, ctrl: Controller, name: str, clock: int | None, power: float | None,
                     conn: Connection) -> dict[str, Any]:
        if clock is not None or power is None:
            raise ProtocolError("a CPU zone takes a power limit (power_limit_w) only", field="power_limit_w")
        zone = self._cpu_zone(name)
        try:
            in_force = ctrl.apply_cpu_limit(zone.path, power, NODE_OWNER)
        except (ActuatorError, StateError) as e:
            raise GreendError(str(e)) from e
        self.d.emit([Point("greend_decision", {"host": self.d.hostname, "gpu": "", "zone": zone.zone,
                                               "path": zone.path, "job": "", "kind": "cap",
                                               "policy": getattr(self.policy, "name", "none")},
                           {"capped": 1, "power_limit_w": float(in_force or power),
                            "reason": f"greenctl cap set (uid {conn.peer.uid})"}, int(self.d.wall() * 1e9))])
        log.info("%s (%s): power limit set by uid %d: %s W", zone.zone, zone.path, conn.peer.uid, in_force)
        return {"cpu_zone": zone.zone, "path": zone.path, "in_force": {"power_limit_w": in_force},
                "dry_run": ctrl.dry_run}

    def op_cap_reset(self, msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
        ctrl = self._need_ctrl()
        gpu = msg.get("gpu")
        if gpu is not None and msg.get("cpu_zone") is not None:
            raise ProtocolError("give at most one of gpu and cpu_zone", field="gpu")
        if msg.get("cpu_zone") is not None:
            zone = self._cpu_zone(msg["cpu_zone"])
            rep = ctrl.restore_cpu(zone.path)
            self._report(rep, f"greenctl cap reset by uid {conn.peer.uid}")
            return {**rep.to_json(), "lines": rep.lines()}
        rep = ctrl.restore_all() if gpu is None else ctrl.restore_gpu(gpu)
        self._report(rep, f"greenctl cap reset by uid {conn.peer.uid}")
        return {**rep.to_json(), "lines": rep.lines()}

    def op_policy_set(self, msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
        self._need_ctrl()
        try:
            return self.set_policy(msg["name"], dict(msg.get("params") or {}))
        except ConfigError as e:
            raise ProtocolError(str(e), field="params") from None

    def show(self) -> dict[str, Any]:
        from greend.policies import POLICIES

        p = self.policy
        pp = self.precision_policy
        return {
            "name": getattr(p, "name", "none"),
            "params": p.params() if p is not None else {},
            "precision": {"name": pp.name, "params": pp.params()} if pp is not None else None,
            "period_s": self.d.cfg.policy.period_s,
            "available": sorted(POLICIES),
            "last_decision": self.last_decision,
            "last_error": self.last_error,
            "disabled": self.disabled,
            "dry_run": self.d.cfg.daemon.dry_run,
            "settings": self.ctrl.snapshot() if self.ctrl is not None else {},
            "owners": self.ctrl.owners() if self.ctrl is not None else {},
        }


def _setting_json(s: Setting) -> dict[str, Any]:
    return {"clock_cap_mhz": s.clock_cap_mhz, "power_limit_w": s.power_limit_w}


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, Setting):
        return _setting_json(v)
    if isinstance(v, float) and v != v:
        return None
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return str(v)
