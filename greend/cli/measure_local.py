"""``greenctl measure -- CMD`` with no daemon answering: the command runs all the same
(a batch script that wraps its training in ``measure`` never loses its run), measured
in this process from the probes directly, as ``codecarbon monitor`` and ``python -m
zeus.monitor`` do: NVML's energy counters for the GPUs, RAPL's for the CPU zones, read
every ``interval_s`` while the command runs and once when it ends. What is missing is
said (no NVML, no RAPL: the probe's own reason), never guessed; a simulated GPU is not
used here, since it models only the work a daemon's jobs report to it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from greend.errors import GreendError
from greend.probes import ProbeContext, Readings, build

__all__ = ["LocalMeasure", "measure_locally"]


@dataclass
class LocalMeasure:
    returncode: int
    report: dict[str, Any]
    notes: list[str] = field(default_factory=list)


def _visible_gpus() -> list[int] | None:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return None
    try:
        return [int(x) for x in visible.split(",") if x.strip()]
    except ValueError:
        return None  # UUIDs: every GPU


def measure_locally(
    cmd: list[str],
    *,
    job: str,
    gpus: list[int] | None = None,
    flops: float | None = None,
    interval_s: float = 1.0,
    sysfs_root: Path = Path("/sys"),
    grid_gco2_per_kwh: float = 400.0,
    on_sample: Callable[[dict[str, Any]], None] | None = None,
    why_local: str = "no daemon answered",
) -> LocalMeasure:
    """Run ``cmd`` and measure it from the probes of this process; ``on_sample`` gets
    a status-shaped dict (``gpus``, ``cpus``) at each reading, for logging."""
    notes: list[str] = [f"{why_local}: measured in this process from the probes (NVML, RAPL), no daemon"]
    probes = build(["nvml", "rapl"], ProbeContext(sysfs_root=sysfs_root))
    opened = []
    for p in probes:
        try:
            p.open()
            opened.append(p)
        except Exception as e:  # NoData, NoPermission, a broken driver: said, and the run goes on
            notes.append(f"no {p.name}: {e}")
    chosen = gpus if gpus is not None else _visible_gpus()

    def read() -> tuple[float, Readings]:
        now = time.monotonic()
        merged = Readings()
        for p in opened:
            try:
                r = p.sample(now)
            except Exception as e:
                notes.append(f"{p.name} failed to read: {e}")
                continue
            merged.gpus += [g for g in r.gpus if chosen is None or g.index in chosen]
            merged.cpus += r.cpus
        return now, merged

    def as_status(r: Readings) -> dict[str, Any]:
        return {
            "gpus": [
                {
                    "index": g.index,
                    "name": g.name,
                    "source": g.source,
                    "power_w": g.power_w,
                    "energy_j": g.energy_j,
                    "sm_clock_mhz": g.sm_clock_mhz,
                    "clock_cap_mhz": g.clock_cap_mhz,
                    "power_limit_w": g.power_limit_w,
                    "util_gpu_pct": g.util_gpu_pct,
                }
                for g in r.gpus
            ],
            "cpus": [
                {"zone": c.zone, "path": c.path, "source": c.source, "power_w": c.power_w, "energy_j": c.energy_j}
                for c in r.cpus
            ],
        }

    t0, first = read()
    wall0 = time.time()
    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the command; it ends the run
    try:
        try:
            proc = subprocess.Popen(cmd, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        except OSError as e:
            raise GreendError(f"cannot run {cmd[0]!r}: {e.strerror or e}") from None
        if on_sample is not None:
            on_sample(as_status(first))
        while True:
            try:
                rc = proc.wait(timeout=interval_s)
                done = True
            except subprocess.TimeoutExpired:
                rc, done = 0, False
            _, last = read()
            if on_sample is not None:
                on_sample(as_status(last))
            if done:
                break
    finally:
        signal.signal(signal.SIGINT, old_int)
        for p in opened:
            try:
                p.close()
            except Exception:
                pass
    t1 = time.monotonic()
    duration = t1 - t0
    before = {g.index: g for g in first.gpus}
    per_gpu: list[dict[str, Any]] = []
    for g in last.gpus:
        b = before.get(g.index)
        if b is None:
            continue
        used_j = max(0.0, g.energy_j - b.energy_j)
        per_gpu.append(
            {
                "gpu": g.index,
                "name": g.name,
                "source": g.source,
                "method": g.energy_method,
                "energy_j": used_j,
                "avg_power_w": used_j / duration if duration > 0 else None,
            }
        )
    lost = sorted(set(before) - {g["gpu"] for g in per_gpu})
    if lost:
        notes.append(f"GPUs {', '.join(map(str, lost))} stopped answering during the run: not counted")
    cpu_before = {c.key: c for c in first.cpus}
    cpu_e = sum(
        max(0.0, c.energy_j - cpu_before[c.key].energy_j) for c in last.cpus if c.counted and c.key in cpu_before
    )
    gpu_e = sum(g["energy_j"] for g in per_gpu) if per_gpu else None
    cpu_energy = cpu_e if last.cpus else None
    energy = (gpu_e or 0.0) + (cpu_energy or 0.0) if (gpu_e is not None or cpu_energy is not None) else None
    if gpu_e is None and cpu_energy is None:
        notes.append("no energy source here: the command ran and its time is reported, no joules")
    report = {
        "job": job,
        "measured_by": "greenctl measure, in-process (no daemon)",
        "command": cmd,
        "state": "ended",
        "end_reason": f"command exited with {rc}",
        "returncode": rc,
        "started_at": wall0,
        "duration_s": duration,
        "gpus": [g["gpu"] for g in per_gpu],
        "gpu_source": ",".join(sorted({g["source"] for g in per_gpu})) or None,
        "per_gpu": per_gpu,
        "gpu_energy_j": gpu_e,
        "cpu_energy_j": cpu_energy,
        "cpu_source": ",".join(sorted({c.source for c in last.cpus})) or None,
        "energy_j": energy,
        "avg_gpu_power_w": gpu_e / duration if gpu_e is not None and duration > 0 else None,
        "flops": flops,
        "gflops_per_w": flops / gpu_e / 1e9 if flops and gpu_e else None,
        "co2_g": energy / 3.6e6 * grid_gco2_per_kwh if energy else None,  # J -> kWh -> g
        "steps": None,  # a command measured whole has no steps
        "precision": None,  # nor a precision greend knows
    }
    return LocalMeasure(rc, report, notes)


def render_local(report: dict[str, Any]) -> str:
    """The in-process measurement as text."""

    def num(v: Any, spec: str, unit: str = "") -> str:
        return "-" if v is None else f"{v:{spec}}{unit}"

    lines = [
        f"job {report['job']}  ({report['measured_by']})",
        f"  command          {' '.join(report['command'])}  (exit {report['returncode']})",
        f"  duration         {report['duration_s']:.1f} s",
    ]
    if report["per_gpu"]:
        lines.append(
            f"  GPU energy       {num(report['gpu_energy_j'], '.1f', ' J')}  "
            f"avg {num(report['avg_gpu_power_w'], '.1f', ' W')}  ({report['gpu_source']})"
        )
        for g in report["per_gpu"]:
            lines.append(
                f"    gpu{g['gpu']} {g['name']}: {g['energy_j']:.1f} J, "
                f"{num(g['avg_power_w'], '.1f', ' W')} ({g['method']})"
            )
    else:
        lines.append("  GPU energy       - (no GPU measured)")
    lines.append(
        f"  CPU energy       {num(report['cpu_energy_j'], '.1f', ' J')}  ({report['cpu_source'] or 'no RAPL'})"
    )
    lines.append(f"  CO2              {num(report['co2_g'], '.2f', ' g')} (estimate, configured grid intensity)")
    lines.append(
        f"  GFLOPS/W         {num(report['gflops_per_w'], '.3f')}"
        + ("" if report["flops"] else "  (FLOPs unknown: --flops N)")
    )
    return "\n".join(lines)
