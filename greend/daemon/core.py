"""The daemon: probes -> ledger -> snapshot -> stores, and the socket that serves it.

One tick (default every 100 ms) samples every open probe that is due
(:mod:`greend.daemon.probing`). Readings update the :class:`~greend.jobs.ledger.Ledger`
and the snapshot that ``greenctl status`` reads (:mod:`greend.daemon.status`). The
job registry and the control loop take their turn; every ``store.interval_s`` the
latest readings become points for the stores (:mod:`greend.daemon.stores`), which
queue them and write from threads of their own. The socket's ops are in
:mod:`greend.daemon.routes`.

The schedule is drift-free: tick *k* is due at ``start + k * period`` on the
monotonic clock; a tick that overruns skips the ticks it missed (counted in
``ticks_skipped``) instead of bunching them up.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from greend.config import Config
from greend.control.loop import ControlContext, ControlLoop
from greend.control.ops import ControlOps
from greend.daemon.probing import ProbeScheduler, ProbeStats
from greend.daemon.routes import RouteContext, admin_needs, is_admin, route_all
from greend.daemon.sdnotify import WatchdogPinger
from greend.daemon.status import StatusContext, status_document
from greend.daemon.stores import StoreSet
from greend.daemon.tick import TickCounts, TickReadings
from greend.fsutil import StateDir, StateDirLock, check_private_dir, check_socket_slot
from greend.ipc.server import IpcServer, Limits
from greend.jobs.archive import ARCHIVE_DIR, JobArchive
from greend.jobs.ledger import Ledger
from greend.jobs.ops import JobOps
from greend.jobs.registry import JobRegistry
from greend.jobs.slurm import SlurmOwners
from greend.points import Point, cpu_point, gpu_point, host_point, probe_point, ts_ns
from greend.probes import Probe, ProbeContext

__all__ = ["Daemon", "ProbeStats"]

log = logging.getLogger(__name__)


class Daemon:
    """One node's greend: wires the probes, the ledger, the job registry, the control
    loop, the stores and the socket together, and runs the tick loop."""

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
        self.hostname = hostname or cfg.daemon.hostname or socket.gethostname()
        self.ledger = Ledger(history_s=3600.0, hz=cfg.daemon.hz)
        self.stop_event = threading.Event()
        self.started_wall_s = wall()
        self.started_s = monotonic()
        self.ticks = 0
        self.ticks_skipped = 0
        self.tick_errors = 0  # ticks that raised (logged; the daemon goes on with the next)
        self._tick_error: str | None = None  # the last one's message (a repeat is not logged again)
        self.tick_duration_s = 0.0
        # How late each of the last 600 ticks started after it was due (s): what client
        # load, a slow probe or a starved thread costs the sampling cadence.
        self.tick_lateness_s: deque[float] = deque(maxlen=600)
        self.snapshot = TickReadings()
        self._snapshot_lock = threading.Lock()
        self._store_due_s = -math.inf
        self._nvml_module = nvml_module
        self.probing = ProbeScheduler(monotonic)
        self.stores = StoreSet(cfg, hostname=self.hostname, monotonic=monotonic, status=self.status)
        self.server: IpcServer | None = None
        # Opened once at start; the saved settings and the lock go through its descriptor.
        self.state_dir = StateDir(cfg.daemon.state_dir)
        self.lock = StateDirLock(self.state_dir)
        self.refused = False  # start() found another daemon: close() then touches nothing
        # systemd's WatchdogSec=: pinged from the tick loop itself, so that a tick stuck
        # in a driver call stops the pings and systemd restarts the daemon.
        self.watchdog = WatchdogPinger()
        self.jobs = JobRegistry(
            self.ledger,
            hostname=self.hostname,
            monotonic=monotonic,
            wall=wall,
            heartbeat_timeout_s=cfg.daemon.heartbeat_timeout_s,
            execute_steps=self.probing.execute_steps,  # the simulated GPUs run the steps reported
            modelled_gpu=self.probing.modelled_gpu,
            emit=self.emit,
            grid_gco2_per_kwh=cfg.report.grid_gco2_per_kwh,
            window_s=cfg.report.window_s,
            process_cpu=self.probing.process_cpu_s,
            gpu_indices=self.probing.gpu_indices,
            gpu_processes=self.probing.gpu_processes,
            max_jobs_per_uid=cfg.daemon.max_jobs_per_uid,
            max_events_per_min_per_uid=cfg.daemon.max_events_per_min_per_uid,
            max_log_entries=cfg.daemon.max_log_entries,
            max_recent_steps=cfg.daemon.max_recent_steps,
            step_interval_s=cfg.store.interval_s,
            step_detail=cfg.store.step_detail,
            # Rows from the callbacks twice per policy period and store interval, at
            # most every 0.5 s: fresh enough for both, and a node of 64 ranks sends the
            # daemon 128 messages a second whatever their step rate.
            rows_every_s=min(0.5, cfg.policy.period_s / 2, cfg.store.interval_s / 2),
            # On a Slurm node (scontrol on PATH): a job id naming a Slurm job is its owner's.
            check_owner=SlurmOwners().check,
        )
        self.jobs.started_s = monotonic()  # (a job's span starts no earlier: greend.jobs.booking.book_row)
        self.control = ControlLoop(
            ControlContext(
                cfg=cfg,
                hostname=self.hostname,
                jobs=self.jobs,
                ledger=self.ledger,
                latest=self.latest,
                emit=lambda points: self.emit(points),
                wall=wall,
                monotonic=monotonic,
                state_dir=self.state_dir,
            )
        )
        self.jobs.on_job_end.append(self.control.job_ended)
        # the jobs' socket ops; ended runs kept in the state dir, for history after a restart
        self.job_ops = JobOps(
            self.jobs,
            JobArchive(lambda: self.state_dir.inside(ARCHIVE_DIR), shown=cfg.daemon.state_dir / ARCHIVE_DIR),
            precision_tolerance=self.control.precision_tolerance,
        )
        self.status_context = StatusContext(
            cfg=cfg,
            hostname=self.hostname,
            started_s=self.started_s,
            started_wall_s=self.started_wall_s,
            monotonic=monotonic,
            latest=self.latest,
            ticks=self.tick_counts,
            ledger=self.ledger,
            job_rows=self.job_ops.live_rows,
            control=self.control,
            probing=self.probing,
            stores=self.stores,
        )

    # The parts, as tests and the CLI reach them -----------------------------------
    @property
    def probes(self) -> list[Probe]:
        return self.probing.probes

    @probes.setter
    def probes(self, probes: list[Probe]) -> None:
        self.probing.probes = probes

    @property
    def stats(self) -> dict[str, ProbeStats]:
        return self.probing.stats

    def _try_open(self, p: Probe, *, first: bool) -> None:
        self.probing.try_open(p, first=first)

    def latest(self) -> TickReadings:
        """The latest tick's snapshot (replaced each tick, never changed after)."""
        with self._snapshot_lock:
            return self.snapshot

    # Set-up --------------------------------------------------------------------------
    def probe_context(self) -> ProbeContext:
        cfg = self.cfg
        return ProbeContext(
            sysfs_root=cfg.probes.sysfs_root,
            sim_gpus=cfg.sim.gpus,
            # <state_dir>/sim by default: through the state dir's descriptor, like its other files.
            sim_dir=Path(cfg.sim.dir) if cfg.sim.dir else self.state_dir.inside("sim"),
            sim_params={
                "background_load": cfg.sim.load,
                "mem_share": cfg.sim.mem_share,
                # One per GPU where some GPU has its own ([sim] gpu_speed_factors); a fleet
                # found in the sim dir ("sim" enabled, no count) has at most 64 GPUs.
                "speed_factor": cfg.sim.speed_factors(cfg.sim.gpus or 64)
                if cfg.sim.gpu_speed_factors
                else cfg.sim.speed_factor,
            },
            cpu_tdp_w=cfg.probes.cpu_tdp_w,
            nvml_module=self.nvml_module(),
            job_pids=self.jobs.job_pids,
            rapl_present=lambda: self.probing.is_open("rapl"),
            tick_period_s=1.0 / cfg.daemon.hz,
        )

    def nvml_module(self) -> Any | None:
        """The NVML the probes use: the one given, the configured fake, or None (the real one)."""
        if self._nvml_module is None and self.cfg.probes.nvml_fake_dir:
            from greend.probes.fake_nvml import FakeNvml

            return FakeNvml(Path(self.cfg.probes.nvml_fake_dir))
        return self._nvml_module

    def open_probes(self) -> None:
        self.probing.open_all(self.cfg.enabled_probes, self.probe_context())

    def open_stores(self) -> None:
        self.stores.state_dir = self.state_dir.inside()  # spools: through the state dir's descriptor
        self.stores.open_all()

    def start_server(self) -> None:
        daemon_cfg = self.cfg.daemon
        self.server = IpcServer(
            daemon_cfg.socket,
            mode=int(daemon_cfg.socket_mode, 8),
            group=daemon_cfg.socket_group or None,
            is_admin=lambda peer: is_admin(peer, daemon_cfg.admin_group, daemon_cfg.root_is_admin),
            admin_needs=admin_needs(daemon_cfg.admin_group, daemon_cfg.root_is_admin),
            on_disconnect=self.job_ops.disconnected,
            limits=Limits.of(daemon_cfg),
            registered=self.job_ops.registered,
        )
        route_all(
            self.server,
            RouteContext(
                status=self.status,
                probe_rows=self.probing.rows,
                ledger=self.ledger,
                jobs=self.job_ops,
                control=ControlOps(self.control),
            ),
        )
        self.server.start()

    def start(self) -> None:
        d = self.cfg.daemon
        self.state_dir.open()  # checked, then held open: nobody else may plant files in it
        d.socket.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
        # A sticky directory such as /tmp is accepted for the socket alone (why it is safe:
        # check_private_dir's docstring), so `greend run --socket /tmp/g.sock` works for a try.
        check_private_dir(d.socket.parent, "the socket's directory", shared_sticky=True)
        check_socket_slot(d.socket)
        try:
            self.lock.acquire()  # one daemon per state dir, before anything is touched
        except BlockingIOError as e:
            self.refused = True
            self.state_dir.close()
            raise OSError(str(e)) from None
        # Real NVML opens on a thread of its own (status says "initialising" meanwhile):
        # the socket serves at once whatever the driver does, and the GPUs are handed to
        # the controller when their probe opens (a crashed predecessor's caps go back first).
        self.probing.on_open = self._probe_opened
        self.open_probes()
        self.control.open(self.probing.gpu_probe(), self.probing.is_open("rapl"), nvml_module=self.nvml_module)
        self.open_stores()
        self.start_server()

    def _probe_opened(self, probe: Probe) -> None:
        if probe.name in ("nvml", "sim") and self.probing.gpu_probe() is probe:
            self.control.attach_gpus(probe)

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
            self.tick_lateness_s.append(max(0.0, started - due))
            try:
                self.tick(started)
            except Exception as e:  # a bug met by one tick never takes the node's daemon down
                self._tick_failed(e)
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

    def _tick_failed(self, e: Exception) -> None:
        self.tick_errors += 1
        msg = f"{type(e).__name__}: {e}"
        if msg != self._tick_error:
            log.exception("a tick failed (%d so far); the next tick runs as usual", self.tick_errors)
        self._tick_error = msg

    def tick(self, now_s: float) -> None:
        snap = TickReadings(t_s=now_s, wall_s=self.wall())
        fresh = self.probing.sample(now_s, snap)
        # A probe that was not due this tick (the host probe's estimate, once a second)
        # stands in the snapshot with its last readings, but its energy is booked only at
        # the time it was read: booked again now, the ledger would see no energy flow
        # between its samples, then a jump. So is a GPU whose read is still out (stale):
        # its last reading stands in the snapshot, and the late read books the energy.
        for r in fresh:
            for g in r.gpus:
                if g.stale_s is None:
                    self.ledger.record(g.key, now_s, g.energy_j, source=g.uuid, epoch=g.energy_epoch)
            for c in r.cpus:
                self.ledger.record(c.key, now_s, c.energy_j, counted=c.counted)
        with self._snapshot_lock:
            self.snapshot = snap
        ended = self.jobs.tick(now_s, snap.host)
        if ended:
            self.emit(ended)
        self.control.step(now_s)
        if self.stores.waiting:
            self.stores.retry_due(now_s)
        # Store points on a schedule of their own, due every interval_s from the first:
        # the tick nearest each due time (half a tick of slack) writes them, so a 1 s
        # interval averages 1 s, whatever the wake-ups' jitter (not 1.1 s at 10 Hz).
        if now_s >= self._store_due_s - 0.5 / self.cfg.daemon.hz:
            self._store_due_s += self.cfg.store.interval_s
            if self._store_due_s < now_s:  # first time, or the loop stalled: start afresh
                self._store_due_s = now_s + self.cfg.store.interval_s
            self.emit(self.sample_points(snap) + self.jobs.efficiency_points(now_s))

    def emit(self, points: list[Point]) -> None:
        self.jobs.tag_runs(points)
        self.stores.write(points)

    def sample_points(self, snap: TickReadings) -> list[Point]:
        """The tick's store points: every GPU, CPU zone, the host and each probe's health."""
        ts = ts_ns(snap.wall_s)
        host = self.hostname
        pts: list[Point] = [gpu_point(ts, host, g, self.ledger.total_j(g.key)) for g in snap.gpus]
        pts += [cpu_point(ts, host, c, self.ledger.total_j(c.key)) for c in snap.cpus]
        if snap.host is not None:
            pts.append(host_point(ts, host, snap.host))
        pts += [
            probe_point(ts, host, st.name, success=st.success, duration_s=st.duration_s) for st in self.stats.values()
        ]
        return pts

    # Views ---------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return status_document(self.status_context)

    def tick_counts(self) -> TickCounts:
        return TickCounts(
            self.ticks,
            self.ticks_skipped,
            self.tick_errors,
            self._tick_error,
            self.tick_duration_s,
            tuple(self.tick_lateness_s),
        )

    def probe_rows(self) -> list[dict[str, Any]]:
        return self.probing.rows()

    # Shut-down -----------------------------------------------------------------------
    def stop(self) -> None:
        self.stop_event.set()

    def close(self) -> None:
        if self.refused:
            return  # refused at start: the running daemon's socket, state and caps are its own
        self.control.close()  # every setting greend made goes back to its original
        if self.server is not None:
            # First the socket: what the ranks sent until now is read and booked (their
            # steps reached the daemon; refused after their jobs ended, they were lost).
            self.server.stop()
        try:  # the jobs still running end here, kept (archived, stored) before the stores close
            self.emit(self.jobs.interrupt_all())
        except Exception:
            log.exception("ending the running jobs at stop failed")
        self.stores.close()
        self.probing.close()
        self.lock.release()
        self.state_dir.close()
