"""The control loop's socket ops: ``cap_set``, ``cap_reset`` (an admin's own caps),
``policy_show``, ``policy_set`` and ``profile`` (a power-limit sweep on one GPU while a
job runs: start, status, abort). Their schemas, and which need an admin, are in
:mod:`greend.protocol`; the daemon routes them (:mod:`greend.daemon.routes`).

A device that refuses a setting raises :class:`~greend.errors.ActuatorError`, which the
server answers ``refused`` with the device's message.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from greend.control.loop import ControlLoop, setting_json
from greend.errors import ConfigError, ProtocolError
from greend.ipc.server import Connection, Handler
from greend.points import cap_fields, decision_point, ts_ns
from greend.protocol import NODE_OWNER
from greend.settings import Setting

if TYPE_CHECKING:
    from greend.actuators.controller import Controller
    from greend.probes import CpuReading

__all__ = ["ControlOps"]

log = logging.getLogger(__name__)


class ControlOps:
    """The socket ops of one :class:`ControlLoop`."""

    def __init__(self, loop: ControlLoop) -> None:
        self.loop = loop
        self.ctx = loop.ctx

    def handlers(self) -> dict[str, Handler]:
        return {
            "cap_set": self.cap_set,
            "cap_reset": self.cap_reset,
            "policy_show": lambda msg, conn: self.loop.show(),
            "policy_set": self.policy_set,
            "profile": self.profile,
        }

    def _cpu_zone(self, name: str) -> CpuReading:
        """The RAPL zone a user names: its kernel name (``package-0``) or id (``intel-rapl:0``)."""
        zones = [c for c in self.ctx.latest().cpus if c.source == "rapl"]
        found = [c for c in zones if name in (c.zone, c.path)]
        if len(found) != 1:
            known = ", ".join(f"{c.zone} ({c.path})" for c in zones) or "none: no readable RAPL zone here"
            what = "is ambiguous" if found else "is not a RAPL zone on this node"
            raise ProtocolError(f"cpu_zone {name!r} {what}; zones: {known}", field="cpu_zone")
        return found[0]

    def _writable_gpu(self, ctrl: Controller, gpu: int, lost_ok: bool = False) -> None:
        """Refuse a GPU that greend cannot write to: one it never enumerated, or one lost
        (fallen off the bus; ``lost_ok``: let it through, a restore reports it). Its
        readings do not decide: one failed read leaves a GPU out of a tick's readings, and
        a GPU whose reads hang may still take settings."""
        backend = ctrl.gpu_backend
        known = backend.indices() if backend is not None else [g.index for g in self.ctx.latest().gpus]
        if gpu in known:
            return
        lost = backend.lost() if backend is not None else {}
        if gpu in lost and not lost_ok:
            raise ProtocolError(
                f"GPU {gpu} is lost ({lost[gpu]}): greend cannot write to it until it answers again "
                "(after a reset or a driver reload greend writes its settings again by itself)",
                field="gpu",
            )
        if gpu not in lost:
            raise ProtocolError(
                f"no GPU {gpu} on this node (GPUs: {', '.join(map(str, known)) or 'none'})", field="gpu"
            )

    def cap_set(self, msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
        ctrl = self.loop.need_ctrl()
        clock, power = msg.get("max_clock_mhz"), msg.get("power_limit_w")
        if (msg.get("gpu") is None) == (msg.get("cpu_zone") is None):
            raise ProtocolError("give exactly one of gpu and cpu_zone", field="gpu")
        if msg.get("cpu_zone") is not None:
            return self._cap_set_cpu(ctrl, msg["cpu_zone"], clock, power, conn)
        if (clock is None) == (power is None):
            raise ProtocolError("give exactly one of max_clock_mhz and power_limit_w", field="max_clock_mhz")
        gpu = msg["gpu"]
        self._writable_gpu(ctrl, gpu)
        rec = self.loop.profiler.running(gpu)
        if rec is not None:
            raise ProtocolError(
                f"a profile recording for job {rec.job} holds GPU {gpu}'s power limit; "
                "wait for it or abort it (greenctl profile abort)",
                field="gpu",
            )
        current = ctrl.current(gpu)
        setting = Setting(
            clock if clock is not None else current.clock_cap_mhz, power if power is not None else current.power_limit_w
        )
        in_force = ctrl.apply_gpu(gpu, setting, NODE_OWNER)  # ActuatorError, StateError: "refused"
        reason = f"greenctl cap set (uid {conn.peer.uid})"
        self.ctx.emit([self.loop.cap_point(ts_ns(self.ctx.wall()), in_force, reason, gpu=gpu)])
        self.ctx.jobs.reset_measures_on_gpu(gpu, self.ctx.monotonic() + self.ctx.cfg.policy.settle_s)
        log.info("gpu%d: cap set by uid %d: %s", gpu, conn.peer.uid, setting_json(in_force))
        # What the GPU holds where it is not what greend wrote (a driver that ignored the
        # write or changed it): greenctl says so instead of blaming the value asked.
        held = {} if ctrl.dry_run else ctrl.mismatches(gpu)
        return {"gpu": gpu, "in_force": setting_json(in_force), "dry_run": ctrl.dry_run, "held": held}

    def _cap_set_cpu(
        self, ctrl: Controller, name: str, clock: int | None, power: float | None, conn: Connection
    ) -> dict[str, Any]:
        if clock is not None or power is None:
            raise ProtocolError("a CPU zone takes a power limit (power_limit_w) only", field="power_limit_w")
        zone = self._cpu_zone(name)
        in_force = ctrl.apply_cpu_limit(zone.path, power, NODE_OWNER)  # ActuatorError, StateError: "refused"
        self.ctx.emit(
            [
                decision_point(
                    ts_ns(self.ctx.wall()),
                    self.ctx.hostname,
                    kind="cap",
                    reason=f"greenctl cap set (uid {conn.peer.uid})",
                    policy=self.loop.policy_name,
                    zone=zone.zone,
                    path=zone.path,
                    fields=cap_fields(clock_cap_mhz=None, power_limit_w=float(in_force or power), capped=True),
                )
            ]
        )
        log.info("%s (%s): power limit set by uid %d: %s W", zone.zone, zone.path, conn.peer.uid, in_force)
        return {
            "cpu_zone": zone.zone,
            "path": zone.path,
            "in_force": {"power_limit_w": in_force},
            "dry_run": ctrl.dry_run,
        }

    def cap_reset(self, msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
        ctrl = self.loop.need_ctrl()
        gpu = msg.get("gpu")
        if gpu is not None and msg.get("cpu_zone") is not None:
            raise ProtocolError("give at most one of gpu and cpu_zone", field="gpu")
        if msg.get("cpu_zone") is not None:
            rep = ctrl.restore_cpu(self._cpu_zone(msg["cpu_zone"]).path)
        else:
            if gpu is not None:
                self._writable_gpu(ctrl, gpu, lost_ok=True)
            if self.loop.profiler.running(gpu) is not None:  # its limit goes back now: the sweep ends
                self.loop.profiler.abort(f"greenctl cap reset by uid {conn.peer.uid}")
            rep = ctrl.restore_all() if gpu is None else ctrl.restore_gpu(gpu)
        self.loop.report_restore(rep, f"greenctl cap reset by uid {conn.peer.uid}")
        return {**rep.to_json(), "lines": rep.lines()}

    def policy_set(self, msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
        self.loop.need_ctrl()
        rec = self.loop.profiler.running()
        if rec is not None and msg["name"] != "none":
            raise ProtocolError(
                f"a profile recording runs on GPU {rec.gpu} (job {rec.job}); a policy would move the same "
                "limit: wait for it or abort it (greenctl profile abort)",
                field="name",
            )
        if msg["name"] == "precision":  # the config refuses it as [policy] name too
            raise ProtocolError(
                "'precision' is not a clock policy: it runs beside one "
                "(greenctl policy set NAME --precision precision; NAME: none, static, efficient or budget)",
                field="name",
            )
        precision = msg.get("precision")
        if precision is not None:
            # Both are checked before either changes: a bad one leaves the policies as they were.
            from greend.policies import POLICIES, get_policy

            if precision not in ("none", "", "precision"):
                hint = " (a clock policy: give it as the policy's name)" if precision in POLICIES else ""
                raise ProtocolError(
                    f"precision policy {precision!r}: expected 'none' or 'precision'{hint}", field="precision"
                )
            try:
                get_policy(msg["name"], **dict(msg.get("params") or {}))
                if precision == "precision":
                    get_policy(precision, **dict(msg.get("precision_params") or {}))
            except (ValueError, TypeError, KeyError) as e:
                raise ProtocolError(str(e), field="params") from None
        self._check_gpus_named(msg.get("params") or {})
        try:
            shown = self.loop.set_policy(msg["name"], dict(msg.get("params") or {}))
            if precision is not None:
                self.loop.set_precision_policy(precision, dict(msg.get("precision_params") or {}))
                shown = self.loop.show()
            return shown
        except ConfigError as e:
            raise ProtocolError(str(e), field="params") from None

    def _check_gpus_named(self, params: dict[str, Any]) -> None:
        """GPUs a policy's parameters name (``gpus``, ``per_gpu``'s keys) are this node's: a
        policy set on a GPU that is not here did nothing, and said so only in its decision
        (as ``cap set`` refuses one)."""
        named: list[Any] = []
        gpus = params.get("gpus")
        if isinstance(gpus, (list, tuple)):
            named += gpus
        elif isinstance(gpus, str):
            named += [g.strip() for g in gpus.strip("[]").split(",") if g.strip()]
        per_gpu = params.get("per_gpu")
        if isinstance(per_gpu, dict):
            named += list(per_gpu)
        here = {g.index for g in self.ctx.latest().gpus}
        missing = []
        for g in named:
            try:
                if int(g) not in here:
                    missing.append(int(g))
            except (TypeError, ValueError):
                pass  # (the policy's own check names a bad value)
        if missing:
            raise ProtocolError(
                f"no GPU {', '.join(map(str, sorted(set(missing))))} on this node "
                f"(it has {', '.join(map(str, sorted(here))) or 'none'})",
                field="params",
            )

    def profile(self, msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
        """``profile``: ``start`` a power-limit sweep of ``gpu`` while ``job`` runs, ask its
        ``status`` (the rows so far), or ``abort`` it (its limit goes back at once)."""
        action = msg["action"]
        if action == "status":
            return self.loop.profiler.status()
        if action == "abort":
            return self.loop.profiler.abort(f"aborted by uid {conn.peer.uid}")
        for name in ("gpu", "job"):
            if msg.get(name) is None:
                raise ProtocolError(f"action start needs {name!r}", field=name)
        kwargs: dict[str, Any] = {k: msg[k] for k in ("from_w", "to_w", "step_w") if msg.get(k) is not None}
        if msg.get("steps_per_limit") is not None:
            kwargs["steps_per_limit"] = msg["steps_per_limit"]
        log.info("profile recording asked by uid %d: gpu %s, job %s", conn.peer.uid, msg["gpu"], msg["job"])
        return self.loop.profiler.start(msg["gpu"], msg["job"], **kwargs)
