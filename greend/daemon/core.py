"""The daemon: probes -> ledger -> snapshot -> sinks, and the socket that serves it.

One tick (default every 100 ms) samples every open probe, each timed and
isolated: a probe that raises is marked failed for that tick and the others go on.
Readings update the :class:`~greend.jobs.ledger.Ledger` and the snapshot that
``greenctl status`` reads. Every ``store.interval_s`` the latest readings become
points for the sinks, which queue them and write from threads of their own.

The schedule is drift-free: tick *k* is due at ``start + k * period`` on the
monotonic clock; a tick that overruns skips the ticks it missed (counted in
``ticks_skipped``) instead of bunching them up.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import greend.probes as probe_registry
from greend.probes import CpuReading, GpuReading, HostReading, Probe, ProbeContext, ProbeInfo, Readings

from greend import __version__
from greend.config import Config
from greend.control.loop import ControlLoop
from greend.errors import ConfigError, NoData, NoPermission, ProbeError, StoreError
from greend.ipc.server import NO_REPLY, Connection, Handler, IpcServer, Peer
from greend.jobs.registry import JobRegistry
from greend.jobs.ledger import Ledger
from greend.daemon.sdnotify import WatchdogPinger
from greend.sinks import Point, Sink, open_sink

__all__ = ["Daemon", "ProbeStats"]

log = logging.getLogger(__name__)

PROBE_RETRY_S = 30.0


@dataclass
class ProbeStats:
    """Per-probe self-metrics, in the style of node_scrape_collector_*."""

    name: str
    open: bool = False
    success: bool = False
    duration_s: float = 0.0  # the last sample's wall time
    duration_total_s: float = 0.0  # wall time inside sample() since start
    samples: int = 0
    failures: int = 0
    last_error: str | None = None
    info: ProbeInfo | None = None
    next_open_s: float = 0.0
    next_due_s: float = float("-inf")
    last: Readings | None = None  # carried into ticks where the probe is not due

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "open": self.open,
            "success": self.success,
            "duration_s": self.duration_s,
            "duration_total_s": self.duration_total_s,
            "samples": self.samples,
            "failures": self.failures,
            "last_error": self.last_error,
        }
        if self.info is not None:
            d.update({k: v for k, v in self.info.to_json().items() if k != "name"})
        return d


@dataclass
class Snapshot:
    """The latest tick, as the status op and the sinks see it."""

    t_s: float = 0.0
    wall_s: float = 0.0
    gpus: list[GpuReading] = field(default_factory=list)
    cpus: list[CpuReading] = field(default_factory=list)
    host: HostReading | None = None


class Daemon:
    def __init__(
        self,
        cfg: Config,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        hostname: str | None = None,
        nvml_module: Any | None = None,
    ) -> None:
        self.cfg = cfg
        self.monotonic = monotonic
        self.wall = wall
        self.hostname = hostname or socket.gethostname()
        self.ledger = Ledger(history_s=3600.0, hz=cfg.daemon.hz)
        self.stop_event = threading.Event()
        self.started_wall_s = wall()
        self.started_s = monotonic()
        self.ticks = 0
        self.ticks_skipped = 0
        self.tick_duration_s = 0.0
        self.snapshot = Snapshot()
        self._snap_lock = threading.Lock()
        self._store_due_s = -math.inf
        self.probes: list[Probe] = []
        self.stats: dict[str, ProbeStats] = {}
        # Stores: the open ones (replaced, never mutated, so that emit() on the tick
        # thread may iterate while a retry adds one), and the ones that failed to open,
        # retried every store_retry_s off the tick thread (see _retry_sinks).
        self.sinks: list[Sink] = []
        self.sink_errors: dict[str, str] = {}
        self.store_retry_s: float = cfg.store.retry_s
        self._sink_retry_due: dict[str, float] = {}
        self._sink_attempts: dict[str, int] = {}
        self._sink_lock = threading.Lock()
        self._sink_thread: threading.Thread | None = None
        self._closing = False
        self._nvml_module = nvml_module
        self.server: IpcServer | None = None
        # systemd's WatchdogSec=: pinged from the tick loop itself, so that a tick stuck
        # in a driver call stops the pings and systemd restarts the daemon.
        self.watchdog = WatchdogPinger()
        self.control = ControlLoop(self)
        self.jobs = JobRegistry(
            self.ledger,
            hostname=self.hostname,
            monotonic=monotonic,
            wall=wall,
            heartbeat_timeout_s=cfg.daemon.heartbeat_timeout_s,
            sim_gpu=self.sim_gpu,
            emit=self.emit,
            grid_gco2_per_kwh=cfg.report.grid_gco2_per_kwh,
            window_s=cfg.report.window_s,
            process_cpu=self.process_cpu_s,
        )
        self.jobs.on_job_end.append(self.control.job_ended)

    # Set-up --------------------------------------------------------------------------
    def probe_context(self) -> ProbeContext:
        cfg = self.cfg
        nvml_module = self._nvml_module
        if nvml_module is None and cfg.probes.nvml_fake_dir:
            from greend.probes.fake_nvml import FakeNvml

            nvml_module = FakeNvml(Path(cfg.probes.nvml_fake_dir))
        return ProbeContext(
            sysfs_root=cfg.probes.sysfs_root,
            sim_gpus=cfg.sim.gpus,
            sim_dir=cfg.sim_dir,
            sim_params={"background_load": cfg.sim.load, "mem_share": cfg.sim.mem_share,
                        "speed_factor": cfg.sim.speed_factor},
            cpu_tdp_w=cfg.probes.cpu_tdp_w,
            nvml_module=nvml_module,
            job_pids=self.job_pids,
            rapl_present=lambda: bool(self.stats.get("rapl") and self.stats["rapl"].open),
        )

    def job_pids(self) -> list[int]:
        return self.jobs.job_pids()

    def process_cpu_s(self, pid: int) -> float | None:
        """A job process's CPU seconds (descendants included) through the host probe,
        or None where it is off or not open."""
        for p in self.probes:
            st = self.stats.get(p.name)
            if p.name == "host" and st is not None and st.open:
                return p.process_cpu_s([pid]).get(pid)
        return None

    def sim_gpu(self, index: int) -> Any | None:
        """The simulated device behind GPU ``index``, or None on real hardware."""
        for p in self.probes:
            lookup = getattr(p, "sim_gpu", None)
            if lookup is not None and self.stats.get(p.name) and self.stats[p.name].open:
                try:
                    return lookup(index)
                except (IndexError, KeyError, ValueError):
                    return None
        return None

    def open_probes(self) -> None:
        try:
            self.probes = probe_registry.build(self.cfg.enabled_probes, self.probe_context())
        except KeyError as e:
            raise ConfigError(f"[probes] enabled: unknown probe {e}") from None
        for p in self.probes:
            self.stats[p.name] = ProbeStats(p.name)
            self._try_open(p, first=True)

    def _try_open(self, p: Probe, *, first: bool) -> None:
        st = self.stats[p.name]
        try:
            p.open()
        except NoData as e:
            st.open, st.last_error = False, str(e)
            (log.info if first else log.debug)("probe %s: %s", p.name, e)
        except ProbeError as e:
            st.open, st.last_error = False, str(e)
            (log.warning if first else log.debug)("probe %s: %s", p.name, e)
        except Exception as e:  # noqa: BLE001 - one broken probe never stops the daemon
            st.open, st.last_error = False, f"{type(e).__name__}: {e}"
            log.exception("probe %s failed to open", p.name)
        else:
            st.open, st.last_error = True, None
            log.info("probe %s: open", p.name)
        st.next_open_s = self.monotonic() + PROBE_RETRY_S
        try:
            st.info = p.info()
        except Exception as e:  # noqa: BLE001
            st.info = ProbeInfo(p.name, False, f"info() failed: {e}")

    def open_sinks(self) -> None:
        for url in self.cfg.store_urls:
            self._open_sink(url, first=True)

    def _open_sink(self, url: str, *, first: bool) -> bool:
        """Open one store; on failure note why and when it is tried again.

        At start only a StoreError is survived (anything else is a bug that should
        stop the daemon, as before); a retry, on a thread of its own, survives anything.
        """
        try:
            sink = open_sink(
                url,
                state_dir=self.cfg.daemon.state_dir,
                host=self.hostname,
                retention_days=self.cfg.store.retention_days,
            )
            attach = getattr(sink, "attach", None)
            if attach is not None:
                attach(self.status)  # Prometheus scrapes the latest status, not points
        except Exception as e:  # noqa: BLE001 - one store never takes the daemon down
            if first and not isinstance(e, StoreError):
                raise
            msg = str(e) if isinstance(e, StoreError) else f"{type(e).__name__}: {e}"
            with self._sink_lock:
                self._sink_attempts[url] = self._sink_attempts.get(url, 0) + 1
                same = self.sink_errors.get(url) == msg
                self.sink_errors[url] = msg
                self._sink_retry_due[url] = self.monotonic() + self.store_retry_s
            (log.error if first else log.debug if same else log.warning)(
                "store %s: %s (retrying every %g s)", url, msg, self.store_retry_s)
            return False
        attempts = 0
        with self._sink_lock:
            closing = self._closing
            if not closing:
                self.sinks = [*self.sinks, sink]
                self.sink_errors.pop(url, None)
                self._sink_retry_due.pop(url, None)
                attempts = self._sink_attempts.pop(url, 0)
        if closing:  # the daemon shut down while this retry ran
            try:
                sink.close(timeout_s=1.0)
            except Exception as e:  # noqa: BLE001
                log.warning("store %s: close failed: %s", url, e)
            return False
        if attempts:
            log.info("store %s: open after %d failed attempt%s", url, attempts, "s" * (attempts > 1))
        return True

    def _retry_sinks(self, now_s: float) -> None:
        """Reopen the stores whose retry is due, like probes' ``next_open_s``, but on
        a thread: a constructor may touch a slow disk (spool recovery, SQLite locks),
        and the tick never waits for one."""
        t = self._sink_thread
        if t is not None and t.is_alive():
            return
        with self._sink_lock:
            if self._closing:
                return
            due = [u for u, at in self._sink_retry_due.items() if now_s >= at]
        if not due:
            return

        def reopen() -> None:
            for url in due:
                self._open_sink(url, first=False)

        self._sink_thread = threading.Thread(target=reopen, name="greend-store-retry", daemon=True)
        self._sink_thread.start()

    def store_rows(self) -> list[dict[str, Any]]:
        """Every configured store, in config order: the open ones' own status, and the
        ones that failed to open with why and when they are tried again."""
        with self._sink_lock:
            sinks = list(self.sinks)
            failed = [(u, e, self._sink_retry_due.get(u, 0.0), self._sink_attempts.get(u, 0))
                      for u, e in self.sink_errors.items()]
        now = self.monotonic()
        rows = [s.status().to_json() for s in sinks]
        for url, err, due, attempts in failed:
            retry_in = max(0.0, due - now)
            rows.append({
                "name": url.split(":", 1)[0], "url": url, "ok": False,
                "written": 0, "pending": 0, "dropped": 0,
                "last_error": f"failed to open: {err}; retrying every {self.store_retry_s:g} s "
                              f"(attempt {attempts} failed, next in {retry_in:.0f} s)",
                "open_attempts": attempts, "retry_in_s": retry_in,
            })
        order = {u: i for i, u in enumerate(self.cfg.store_urls)}
        rows.sort(key=lambda r: order.get(r.get("url", ""), len(order)))
        return rows

    def start_server(self) -> None:
        d = self.cfg.daemon
        self.server = IpcServer(
            d.socket,
            mode=int(d.socket_mode, 8),
            group=d.socket_group or None,
            is_admin=self.is_admin,
            admin_needs=(f"root or a member of the group {d.admin_group!r} ([daemon] admin_group)"
                         if d.admin_group else "root (no [daemon] admin_group is set)"),
            on_disconnect=self.jobs.disconnected,
        )
        jobs = self.jobs
        handlers: dict[str, Handler] = {
            "ping": lambda m, c: {"pong": True, "version": __version__},
            "status": lambda m, c: self.status(),
            "probes": lambda m, c: {"probes": self.probe_rows()},
            "energy": self._op_energy,
            "register": jobs.register,
            "steps": self._op_steps,
            "heartbeat": jobs.heartbeat,
            "end": jobs.end,
            "jobs": lambda m, c: {"jobs": jobs.list_jobs()},
            "report": self._op_report,
            "pace": jobs.pace,
            "precision_event": jobs.precision_event,
            **self.control.handlers(),
        }
        # Each op's schema and whether it needs an admin come from greend.protocol.
        for op, handler in handlers.items():
            self.server.route(op, handler)
        self.server.start()

    def _op_steps(self, msg: dict[str, Any], conn: Connection) -> Any:
        self.jobs.report_steps(msg, conn)
        return NO_REPLY

    def _op_report(self, msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
        from greend.errors import ProtocolError

        job = self.jobs.jobs.get(msg["job"])
        if job is None:
            known = ", ".join(sorted(self.jobs.jobs)) or "none yet"
            raise ProtocolError(f"no job {msg['job']!r} on this node (known: {known})", field="job")
        return self.jobs.report_with_series(job)

    def is_admin(self, peer: Peer) -> bool:
        if peer.uid == 0:
            return True
        group = self.cfg.daemon.admin_group
        if not group:
            return False
        import grp
        import pwd

        try:
            g = grp.getgrnam(group)
        except KeyError:
            return False
        if peer.gid == g.gr_gid:
            return True
        try:
            user = pwd.getpwuid(peer.uid).pw_name
        except KeyError:
            return False
        return user in g.gr_mem

    def start(self) -> None:
        self.cfg.daemon.state_dir.mkdir(parents=True, exist_ok=True)
        self.control.restore_leftovers()  # a crashed predecessor's caps go back first
        self.open_probes()
        self.control.open()
        self.open_sinks()
        self.start_server()

    # The loop ------------------------------------------------------------------------
    def run(self, max_ticks: int | None = None, on_tick: Callable[[], None] | None = None) -> None:
        period = 1.0 / self.cfg.daemon.hz
        t0 = self.monotonic()
        k = 0
        while not self.stop_event.is_set():
            due = t0 + k * period
            now = self.monotonic()
            if now < due:
                wait_s = due - now
                if self.watchdog.enabled:
                    # A slow --hz must not starve the watchdog: wait in slices.
                    wait_s = min(wait_s, (self.watchdog.interval_s or wait_s) / 4)
                if self.stop_event.wait(wait_s):
                    break
                self.watchdog.tick()
                if self.monotonic() < due:
                    continue
            started = self.monotonic()
            self.tick(started)
            self.watchdog.tick()
            self.tick_duration_s = self.monotonic() - started
            if on_tick is not None:
                on_tick()
            self.ticks += 1
            if max_ticks is not None and self.ticks >= max_ticks:
                break
            # Next due tick strictly after now; count the ones an overrun skipped.
            next_k = max(k + 1, math.floor((self.monotonic() - t0) / period) + 1)
            self.ticks_skipped += next_k - k - 1
            k = next_k

    def tick(self, now_s: float) -> None:
        snap = Snapshot(t_s=now_s, wall_s=self.wall())
        fresh: list[Readings] = []  # sampled this tick (the ledger books only these)
        for p in self.probes:
            st = self.stats[p.name]
            if not st.open:
                if now_s >= st.next_open_s:
                    self._try_open(p, first=False)
                if not st.open:
                    st.success = False
                    continue
            if now_s < st.next_due_s:
                # A probe may ask to be sampled less often than the tick (``interval_s``):
                # its last readings stand in until it is due.
                if st.last is not None and st.success:
                    self._merge(snap, st.last)
                continue
            st.next_due_s = now_s + getattr(p, "interval_s", 0.0) - 1e-6
            t = time.perf_counter()
            try:
                r = p.sample(now_s)
            except Exception as e:  # noqa: BLE001 - isolate every probe
                st.success = False
                st.failures += 1
                msg = f"{type(e).__name__}: {e}" if not isinstance(e, ProbeError) else str(e)
                if msg != st.last_error:
                    log.error("probe %s failed: %s", p.name, msg)
                st.last_error = msg
                if isinstance(e, (NoData, NoPermission)):
                    st.open = False
                    st.next_open_s = now_s + PROBE_RETRY_S
            else:
                st.success = True
                st.samples += 1
                st.last = r
                self._merge(snap, r)
                fresh.append(r)
            st.duration_s = time.perf_counter() - t
            st.duration_total_s += st.duration_s
        # A probe that was not due this tick (the host probe's estimate, once a second)
        # stands in the snapshot with its last readings, but its energy is booked only at
        # the time it was read: booked again now, the ledger would see no energy flow
        # between its samples, then a jump.
        for r in fresh:
            for g in r.gpus:
                self.ledger.record(g.key, now_s, g.energy_j)
            for c in r.cpus:
                self.ledger.record(c.key, now_s, c.energy_j, counted=c.counted)
        with self._snap_lock:
            self.snapshot = snap
        ended = self.jobs.tick(now_s, snap.host)
        if ended:
            self.emit(ended)
        self.control.step(now_s)
        if self._sink_retry_due:
            self._retry_sinks(now_s)
        # Store points on a schedule of their own, due every interval_s from the first:
        # the tick nearest each due time (half a tick of slack) writes them, so a 1 s
        # interval averages 1 s, whatever the wake-ups' jitter (not 1.1 s at 10 Hz).
        if now_s >= self._store_due_s - 0.5 / self.cfg.daemon.hz:
            self._store_due_s += self.cfg.store.interval_s
            if self._store_due_s < now_s:  # first time, or the loop stalled: start afresh
                self._store_due_s = now_s + self.cfg.store.interval_s
            self.emit(self.sample_points(snap) + self.jobs.efficiency_points(now_s))

    @staticmethod
    def _merge(snap: Snapshot, r: Readings) -> None:
        snap.gpus.extend(r.gpus)
        snap.cpus.extend(r.cpus)
        if r.host is not None:
            snap.host = r.host

    def emit(self, points: list[Point]) -> None:
        for sink in self.sinks:
            try:
                sink.write(points)
            except Exception as e:  # noqa: BLE001 - one sink never takes the loop down
                log.error("store %s: write failed: %s", sink.url, e)

    # Views ---------------------------------------------------------------------------
    def sample_points(self, snap: Snapshot) -> list[Point]:
        ts = int(snap.wall_s * 1e9)
        host = self.hostname
        pts: list[Point] = []
        for g in snap.gpus:
            fields: dict[str, float | int | str | bool] = {"energy_j": self.ledger.total_j(g.key)}
            for name in ("power_w", "sm_clock_mhz", "mem_clock_mhz", "util_gpu_pct", "util_mem_pct",
                         "temperature_c", "clock_cap_mhz", "power_limit_w"):
                v = getattr(g, name)
                if v is not None:
                    fields[name] = float(v)
            # A bound is always in force: unlocked, the SM clock's is the device's maximum.
            # Writing it every time keeps "the last value" queries true once a cap is lifted.
            fields["clock_locked"] = int(g.clock_cap_mhz is not None)
            if g.clock_cap_mhz is None and g.sm_clock_max_mhz is not None:
                fields["clock_cap_mhz"] = float(g.sm_clock_max_mhz)
            pts.append(Point("greend_gpu", {"host": host, "gpu": str(g.index), "source": g.source,
                                            "method": g.energy_method}, fields, ts))
        for c in snap.cpus:
            fields = {"energy_j": self.ledger.total_j(c.key), "counted": int(c.counted)}
            if c.power_w is not None:
                fields["power_w"] = float(c.power_w)
            pts.append(Point("greend_cpu", {"host": host, "zone": c.zone, "path": c.path,
                                            "source": c.source}, fields, ts))
        if snap.host is not None:
            h = snap.host
            pts.append(Point("greend_host", {"host": host}, {
                "cpu_util_pct": float(h.cpu_util_pct), "mem_used_bytes": int(h.mem_used_bytes),
                "mem_total_bytes": int(h.mem_total_bytes), "load_1m": float(h.load_1m)}, ts))
        for st in self.stats.values():
            pts.append(Point("greend_probe", {"host": host, "probe": st.name},
                             {"success": int(st.success), "duration_s": float(st.duration_s)}, ts))
        return pts

    def gpu_row(self, g: GpuReading) -> dict[str, Any]:
        return {
            "index": g.index,
            "name": g.name,
            "uuid": g.uuid,
            "source": g.source,
            "power_w": g.power_w,
            "energy_j": self.ledger.total_j(g.key),
            "energy_method": g.energy_method,
            "sm_clock_mhz": g.sm_clock_mhz,
            "mem_clock_mhz": g.mem_clock_mhz,
            "util_gpu_pct": g.util_gpu_pct,
            "temperature_c": g.temperature_c,
            "clock_cap_mhz": g.clock_cap_mhz,
            "power_limit_w": g.power_limit_w,
            "power_limit_range_w": [g.power_limit_min_w, g.power_limit_max_w],
            "sm_clock_max_mhz": g.sm_clock_max_mhz,
        }

    def cpu_row(self, c: CpuReading) -> dict[str, Any]:
        power = c.power_w if c.power_w is not None else self.ledger.power_w(c.key)
        return {
            "zone": c.zone,
            "path": c.path,
            "source": c.source,
            "power_w": power,
            "energy_j": self.ledger.total_j(c.key),
            "counted": c.counted,
            "parent": c.parent,
            "power_limit_w": c.power_limit_w,
        }

    def status(self) -> dict[str, Any]:
        with self._snap_lock:
            snap = self.snapshot
        h = snap.host
        return {
            "version": __version__,
            "host": self.hostname,
            "pid": os.getpid(),
            "uptime_s": self.monotonic() - self.started_s,
            "started_at": self.started_wall_s,
            "hz": self.cfg.daemon.hz,
            "dry_run": self.cfg.daemon.dry_run,
            "ticks": self.ticks,
            "ticks_skipped": self.ticks_skipped,
            "tick_duration_s": self.tick_duration_s,
            "gpus": [self.gpu_row(g) for g in snap.gpus],
            "cpus": [self.cpu_row(c) for c in snap.cpus],
            "host_load": None if h is None else {
                "cpu_util_pct": h.cpu_util_pct, "cpu_count": h.cpu_count,
                "mem_used_bytes": h.mem_used_bytes, "mem_total_bytes": h.mem_total_bytes,
                "load_1m": h.load_1m,
            },
            "totals": {
                "gpu_energy_j": self.ledger.totals("gpu"),
                "cpu_energy_j": self.ledger.totals("cpu:"),
            },
            "jobs": self.jobs.list_jobs(),
            "policy": self.policy_status(),
            "probes": self.probe_rows(),
            "stores": self.store_rows(),
            "config": self.cfg.source,
        }

    def probe_rows(self) -> list[dict[str, Any]]:
        """Per-probe self-metrics with what each probe says of itself now (a GPU lost
        mid-run shows up here)."""
        for p in self.probes:
            st = self.stats[p.name]
            if st.open:
                try:
                    st.info = p.info()
                except Exception as e:  # noqa: BLE001
                    st.info = ProbeInfo(p.name, False, f"info() failed: {e}")
        return [s.to_json() for s in self.stats.values()]

    def policy_status(self) -> dict[str, Any]:
        c = self.control
        return {
            "name": getattr(c.policy, "name", "none"),
            "params": c.policy.params() if c.policy is not None else {},
            "precision": {"name": c.precision_policy.name, "params": c.precision_policy.params()}
            if c.precision_policy is not None else None,
            "last_decision": c.last_decision,
            "last_error": c.last_error,
            "disabled": c.disabled,
            "owners": c.ctrl.owners() if c.ctrl is not None else {},
        }

    def set_precision(self, job_id: str, level: str, reason: str, *, kind: str = "switch",
                      trend: float | None = None) -> bool:
        """Ask a job's ranks to run at ``level`` from their next step (a pushed directive).

        ``kind`` is "switch" or "rollback" (the policy found the loss worse than its
        pre-switch ``trend``). The job's measure starts afresh: evidence at one level
        must not be booked to the next.
        """
        job = self.jobs.jobs.get(job_id)
        if job is None or job.state != "running" or job.precision == level:
            return False
        entry = {"t": self.wall(), "kind": kind, "from": job.precision, "to": level, "reason": reason,
                 "step": job.steps, "loss": job.last_loss, "trend": trend}
        job.precision = level
        job.precision_log.append(entry)
        self.jobs.reset_measure(job_id, self.monotonic() + self.cfg.policy.settle_s)
        self.jobs.push(job_id, {"event": "directive", "precision": level, "reason": reason})
        fields: dict[str, float | int | str | bool] = {"step": job.steps, "reason": reason}
        if job.last_loss is not None:
            fields["loss"] = job.last_loss
        if trend is not None:
            fields["trend"] = float(trend)
        self.emit([Point("greend_decision", {"host": self.hostname, "job": job_id, "gpu": "",
                                             "kind": kind, "precision": level,
                                             "policy": getattr(self.control.policy, "name", "none")},
                         fields, int(self.wall() * 1e9))])
        log.info("job %s: precision -> %s (%s)", job_id, level, reason)
        return True

    def _op_energy(self, msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
        return {"energy_j": self.ledger.energy_between(msg["key"], msg["t0_s"], msg["t1_s"])}

    # Shut-down -----------------------------------------------------------------------
    def stop(self) -> None:
        self.stop_event.set()

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.control.close()  # every setting greend made goes back to its original
        with self._sink_lock:
            self._closing = True  # a retry that opens a store from now on closes it again
            sinks = list(self.sinks)
        for sink in sinks:
            try:
                sink.close(timeout_s=5.0)
            except Exception as e:  # noqa: BLE001
                log.error("store %s: close failed: %s", sink.url, e)
        for p in self.probes:
            try:
                p.close()
            except Exception as e:  # noqa: BLE001
                log.warning("probe %s: close failed: %s", p.name, e)
