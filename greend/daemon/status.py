"""What the daemon says of itself: the ``status`` document (``greenctl status --json``)
and its rows for GPUs and CPU zones."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from greend import __version__
from greend.jobs.ledger import Ledger
from greend.probes import CpuReading, GpuReading

if TYPE_CHECKING:
    from greend.daemon.core import Daemon

__all__ = ["cpu_row", "gpu_row", "status_document"]


def gpu_row(g: GpuReading, ledger: Ledger) -> dict[str, Any]:
    return {
        "index": g.index,
        "name": g.name,
        "uuid": g.uuid,
        "source": g.source,
        "power_w": g.power_w,
        "energy_j": ledger.total_j(g.key),
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


def cpu_row(c: CpuReading, ledger: Ledger) -> dict[str, Any]:
    power = c.power_w if c.power_w is not None else ledger.power_w(c.key)
    return {
        "zone": c.zone,
        "path": c.path,
        "source": c.source,
        "power_w": power,
        "energy_j": ledger.total_j(c.key),
        "counted": c.counted,
        "parent": c.parent,
        "power_limit_w": c.power_limit_w,
    }


def status_document(d: Daemon) -> dict[str, Any]:
    """The daemon's state now: readings, totals, jobs, policy, probes and stores."""
    snap = d.latest()
    h = snap.host
    return {
        "version": __version__,
        "host": d.hostname,
        "pid": os.getpid(),
        "uptime_s": d.monotonic() - d.started_s,
        "started_at": d.started_wall_s,
        "hz": d.cfg.daemon.hz,
        "dry_run": d.cfg.daemon.dry_run,
        "state_dir": str(d.cfg.daemon.state_dir),
        "ticks": d.ticks,
        "ticks_skipped": d.ticks_skipped,
        "tick_duration_s": d.tick_duration_s,
        "gpus": [gpu_row(g, d.ledger) for g in snap.gpus],
        "cpus": [cpu_row(c, d.ledger) for c in snap.cpus],
        "host_load": None
        if h is None
        else {
            "cpu_util_pct": h.cpu_util_pct,
            "cpu_count": h.cpu_count,
            "mem_used_bytes": h.mem_used_bytes,
            "mem_total_bytes": h.mem_total_bytes,
            "load_1m": h.load_1m,
        },
        "totals": {
            "gpu_energy_j": d.ledger.totals("gpu"),
            "cpu_energy_j": d.ledger.totals("cpu:"),
        },
        "jobs": d.jobs.list_jobs(),
        "policy": d.control.status(),
        "probes": d.probing.rows(),
        "stores": d.stores.rows(),
        "config": d.cfg.source,
    }
