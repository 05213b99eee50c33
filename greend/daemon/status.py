"""What the daemon says of itself: the ``status`` document (``greenctl status --json``)
and its rows for GPUs and CPU zones.

The document is made from a :class:`StatusContext`: the parts of the daemon it shows,
given explicitly by the daemon that runs them (as the control loop gets its
:class:`~greend.control.context.ControlContext`), never the daemon itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from greend import __version__
from greend.config import Config
from greend.control.loop import ControlLoop
from greend.daemon.probing import ProbeScheduler
from greend.daemon.stores import StoreSet
from greend.daemon.tick import TickCounts, TickReadings
from greend.jobs.ledger import Ledger
from greend.probes import CpuReading, GpuReading

__all__ = ["StatusContext", "cpu_row", "gpu_origins", "gpu_row", "knob_states", "lateness", "status_document"]


@dataclass(frozen=True)
class StatusContext:
    """What the status document shows of the daemon; the callables are read each time a
    document is made."""

    cfg: Config
    hostname: str
    started_s: float  # monotonic
    started_wall_s: float
    monotonic: Callable[[], float]
    latest: Callable[[], TickReadings]  # the latest tick's snapshot
    ticks: Callable[[], TickCounts]
    ledger: Ledger
    job_rows: Callable[[], list[dict[str, Any]]]  # the jobs held, a run's parts before a restart joined in
    control: ControlLoop
    probing: ProbeScheduler
    stores: StoreSet


# What a GPU's knobs say about who set them (``clock_lock_origin``, ``power_limit_origin``):
#   "greend"   greend's own setting is in force (the saved-settings file holds the original);
#   "default"  the power limit is the GPU's default: nobody changed it;
#   "outside"  the power limit differs from the default and greend did not set it: the
#              site (nvidia-smi -pl, another tool) did, before greend or beside it;
#   "unknown"  the clocks: NVML has no getter for locked clocks, so whether a lock made
#              outside greend is in force cannot be known (greend never resets one).
LOCK_ORIGINS = ("greend", "unknown")
LIMIT_ORIGINS = ("greend", "default", "outside", "unknown")


def gpu_origins(g: GpuReading, held_clock_mhz: float | None, held_power_w: float | None) -> dict[str, str]:
    """``clock_lock_origin`` and ``power_limit_origin`` of one GPU, from greend's own
    settings in force (``held_*``, None: none) and the limits the GPU reports."""
    if held_power_w is not None:
        limit = "greend"
    elif g.power_limit_w is None or g.power_limit_default_w is None:
        limit = "unknown"
    elif round(g.power_limit_w * 1000) == round(g.power_limit_default_w * 1000):
        limit = "default"
    else:
        limit = "outside"
    return {"clock_lock_origin": "greend" if held_clock_mhz is not None else "unknown", "power_limit_origin": limit}


def gpu_row(g: GpuReading, ledger: Ledger, origins: dict[str, str] | None = None) -> dict[str, Any]:
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
        "sm_active_pct": g.sm_active_pct,  # GPM SM activity (Hopper and newer); None elsewhere
        "temperature_c": g.temperature_c,
        "clock_cap_mhz": g.clock_cap_mhz,
        "power_limit_w": g.power_limit_w,
        "power_limit_range_w": [g.power_limit_min_w, g.power_limit_max_w],
        "sm_clock_max_mhz": g.sm_clock_max_mhz,
        "stale_s": g.stale_s,  # its read is still out: the reading is this old (None: read this tick)
        **(origins or gpu_origins(g, None, None)),
    }


def knob_states(ctrl: Any, index: int) -> dict[str, Any]:
    """``refused_knobs`` (knob -> {"reason", "message"}: what the GPU refused, not tried
    again) and ``cap_mismatch`` (knob -> {"asked", "held"}: what the GPU holds where it
    differs from what greend asked; ``clock_cap_mhz`` and ``power_limit_w`` show what it
    holds) of GPU ``index``."""
    if ctrl is None:
        return {"refused_knobs": {}, "cap_mismatch": {}}
    return {"refused_knobs": ctrl.refused_knobs(index), "cap_mismatch": ctrl.mismatches(index)}


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


def status_document(d: StatusContext) -> dict[str, Any]:
    """The daemon's state now: readings, totals, jobs, policy, probes and stores."""
    snap = d.latest()
    ticks = d.ticks()
    h = snap.host
    ctrl = d.control.ctrl
    held = {
        g.index: ctrl.current(g.index) for g in snap.gpus if ctrl is not None and not ctrl.dry_run
    }  # greend's settings in force (none under dry-run: nothing is written)
    knobs = {g.index: knob_states(ctrl, g.index) for g in snap.gpus}
    return {
        "version": __version__,
        "host": d.hostname,
        "pid": os.getpid(),
        "uptime_s": d.monotonic() - d.started_s,
        "started_at": d.started_wall_s,
        "hz": d.cfg.daemon.hz,
        "dry_run": d.cfg.daemon.dry_run,
        "state_dir": str(d.cfg.daemon.state_dir),
        "ticks": ticks.ticks,
        "ticks_skipped": ticks.skipped,
        "tick_errors": ticks.errors,
        "last_tick_error": ticks.last_error,
        "tick_duration_s": ticks.duration_s,
        "tick_lateness_s": lateness(list(ticks.lateness_s)),
        "gpus": [
            gpu_row(
                g,
                d.ledger,
                gpu_origins(
                    g,
                    held[g.index].clock_cap_mhz if g.index in held else None,
                    held[g.index].power_limit_w if g.index in held else None,
                ),
            )
            | knobs[g.index]
            for g in snap.gpus
        ],
        # The GPU probe's state: "initialising" while NVML opens (in the background: the
        # socket serves meanwhile), then each GPU NVML lists, "ok" or "unresponsive",
        # "lost", "not_opened", "failing" with why.
        "gpu_probe": d.probing.gpu_states(),
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
        "jobs": d.job_rows(),
        "policy": d.control.status(),
        "probes": d.probing.rows(),
        "stores": d.stores.rows(),
        "config": d.cfg.source,
    }


def lateness(late: list[float]) -> dict[str, float | int | None]:
    """How late the recent ticks started after they were due: median, p99 and max (s)."""
    if not late:
        return {"ticks": 0, "p50": None, "p99": None, "max": None}
    late.sort()
    return {
        "ticks": len(late),
        "p50": late[len(late) // 2],
        "p99": late[min(len(late) - 1, int(0.99 * len(late)))],
        "max": late[-1],
    }
