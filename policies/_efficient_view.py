"""What ``efficient`` says about a job: its status line and the details a decision carries
(``greenctl status``, the daemon's pace push, the reports)."""

from __future__ import annotations

from typing import Any

from ._evidence import Evidence, n_measured
from .base import UNCAPPED, Setting
from .efficient_state import JobSearch

__all__ = ["bound_text", "job_details", "settled_line"]


def bound_text(objective: str, eta: float, bound: float, job: JobSearch | None = None) -> str:
    """The job's bound as a status line states it: where the job's pace widens it or its
    floor narrows it (policies/efficient_state.py), what that leaves locally."""
    if objective == "cost":
        return f"cost eta={eta:g}"
    if job is not None and job.allowed > 1.0 + bound + 1e-9:
        return f"bound {bound:.0%} over the job's pace, {job.allowed - 1:+.1%} locally"
    if job is not None and job.allowed < 1.0 + bound - 1e-9:
        return f"bound {bound:.0%} over the job's floor, {job.allowed - 1:+.1%} locally"
    return f"bound {bound:.0%}"


def settled_line(name: str, job: JobSearch, ev: dict[Setting, Evidence], s: Setting, bound: str) -> str:
    base, here = ev.get(UNCAPPED), ev.get(s)
    if s.uncapped or base is None or here is None or here.steps == 0 or min(base.energy_j, base.time_s) <= 0:
        return f"job {name} settled at {s.label} ({bound})"
    de = here.energy_per_flop_j / base.energy_per_flop_j - 1.0
    dt = here.time_per_flop_s / base.time_per_flop_s - 1.0
    return f"job {name} settled at {s.label}: {de:+.0%} energy/FLOP, {dt:+.1%} time ({bound})"


def job_details(
    job: JobSearch, ev: dict[Setting, Evidence], objective: str, bound: float, flops_per_step: float | None
) -> dict[str, Any]:
    base = ev.get(UNCAPPED)
    measured = {s.label: e.steps for s, e in ev.items() if e.steps > 0}
    best: dict[str, Any] | None = None
    s = job.settled
    if s is not None and base is not None and s in ev and ev[s].steps > 0 and min(base.energy_j, base.time_s) > 0:
        best = {
            "setting": {"clock_cap_mhz": s.clock_cap_mhz, "power_limit_w": s.power_limit_w},
            "label": s.label,
            "energy_per_flop_change": ev[s].energy_per_flop_j / base.energy_per_flop_j - 1.0,
            "time_per_flop_change": ev[s].time_per_flop_s / base.time_per_flop_s - 1.0,
        }
    return {
        "knob": job.knob,
        "phase": job.phase,
        "current": job.current.label,
        "candidates_measured": n_measured(ev),
        "measured_steps": measured,
        "best": best,
        "bound": None if objective == "cost" else bound,
        "allowed_slowdown": None if objective == "cost" else job.allowed - 1.0,
        "search_steps": job.settled_job_steps,
        "retunes": job.retunes,
        "paced": {str(i): job.grid[k].label for i, k in sorted(job.pace.held.items())},
        "last_event": job.last_event,
        # This node's uncapped time per FLOP: the daemon turns it into the job's local
        # step time and the ranks agree the job's pace from it (docs/protocol.md); and the
        # lowest it measured at the job's level, from which they agree the job's floor.
        "baseline_time_per_flop_s": base.time_per_flop_s if base is not None and base.flops > 0 else None,
        "floor_time_per_flop_s": job.low_tpf,
        # The job step this node asks every node to re-check their baselines from (0: none; agreed
        # by the ranks as a MAX with the pace, JobView.recheck_at: policies/_recheck.py).
        "recheck_at": job.ask,
        "flops_per_step": flops_per_step,  # (now: what the daemon turns those into step times with)
    }
