"""Every point greend writes, one constructor per measurement.

The measurements, their tags and their fields are documented in ``docs/stores.md``;
a point is built here and nowhere else, so that a measurement has one tag set
whichever module writes it. Units are in every field name; timestamps are Unix
nanoseconds. Fields are numbers: the one text field, a decision's ``reason``, goes to
SQLite and the log only (the influx store leaves strings out).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from greend.probes import CpuReading, GpuReading, HostReading

__all__ = [
    "DECISION_TAGS",
    "FieldValue",
    "Point",
    "cap_fields",
    "cpu_point",
    "decision_point",
    "efficiency_point",
    "gpu_point",
    "host_point",
    "job_point",
    "job_step_point",
    "job_steps_point",
    "precision_fields",
    "probe_point",
    "ts_ns",
]

FieldValue = float | int | str | bool


@dataclass(slots=True)
class Point:
    """One row of a measurement: InfluxDB's model, which SQLite mirrors as tables."""

    measurement: str
    tags: dict[str, str]
    fields: dict[str, FieldValue]
    ts_ns: int


# Every greend_decision point carries all of these ("" where one does not apply: the
# influx store leaves empty tags out, SQLite stores ""), whatever made the decision.
DECISION_TAGS = ("host", "gpu", "job", "policy", "kind", "precision", "zone", "path")

# Summary fields of a job's report that its greend_job point carries, when numbers.
JOB_SUMMARY_FIELDS = (
    "world_size",
    "ranks_here",
    "steps",
    "windows",  # a command measured whole: the windows it reported its time in (it has no steps)
    "flops",
    "samples",
    "tokens",
    "duration_s",
    "gpu_energy_j",
    "cpu_energy_j",
    "energy_j",
    "energy_kwh",
    "avg_power_w",
    "gflops_per_w",
    "co2_g",
    "last_loss",
    "saved_gpu_energy_j",
    "saved_pct",
    "slowdown_pct",
    "started_at",  # (wall seconds: a record the daemon continued starts when its earlier copy did)
    "sent_before",  # steps its ranks sent before it began (to a daemon that stopped)
)

_GPU_FIELDS = (
    "power_w",
    "sm_clock_mhz",
    "mem_clock_mhz",
    "util_gpu_pct",
    "util_mem_pct",
    "sm_active_pct",
    "temperature_c",
    "clock_cap_mhz",
    "power_limit_w",
)


def ts_ns(wall_s: float) -> int:
    """Unix seconds as a point's timestamp."""
    return int(wall_s * 1e9)


def gpu_point(ts: int, host: str, g: GpuReading, energy_j: float) -> Point:
    """``greend_gpu``: one GPU's reading; ``energy_j`` is the ledger's since start."""
    fields: dict[str, FieldValue] = {"energy_j": energy_j}
    for name in _GPU_FIELDS:
        v = getattr(g, name)
        if v is not None:
            fields[name] = float(v)
    # A bound is always in force: unlocked, the SM clock's is the device's maximum.
    # Writing it every time keeps "the last value" queries true once a cap is lifted.
    fields["clock_locked"] = int(g.clock_cap_mhz is not None)
    if g.clock_cap_mhz is None and g.sm_clock_max_mhz is not None:
        fields["clock_cap_mhz"] = float(g.sm_clock_max_mhz)
    return Point(
        "greend_gpu", {"host": host, "gpu": str(g.index), "source": g.source, "method": g.energy_method}, fields, ts
    )


def cpu_point(ts: int, host: str, c: CpuReading, energy_j: float) -> Point:
    """``greend_cpu``: one RAPL zone (or the estimate); ``energy_j`` is the ledger's since start."""
    fields: dict[str, FieldValue] = {"energy_j": energy_j, "counted": int(c.counted)}
    if c.power_w is not None:
        fields["power_w"] = float(c.power_w)
    return Point("greend_cpu", {"host": host, "zone": c.zone, "path": c.path, "source": c.source}, fields, ts)


def host_point(ts: int, host: str, h: HostReading) -> Point:
    """``greend_host``: the node's load."""
    return Point(
        "greend_host",
        {"host": host},
        {
            "cpu_util_pct": float(h.cpu_util_pct),
            "mem_used_bytes": int(h.mem_used_bytes),
            "mem_total_bytes": int(h.mem_total_bytes),
            "load_1m": float(h.load_1m),
        },
        ts,
    )


def probe_point(ts: int, host: str, probe: str, *, success: bool, duration_s: float) -> Point:
    """``greend_probe``: whether a probe's last sample succeeded, and its wall time."""
    return Point(
        "greend_probe", {"host": host, "probe": probe}, {"success": int(success), "duration_s": float(duration_s)}, ts
    )


def job_step_point(
    ts: int,
    host: str,
    *,
    job: str,
    rank: int,
    precision: str,
    step: int,
    duration_s: float,
    flops: float,
    samples: int,
    tokens: int,
    loss: float | None,
    nonfinite: bool,
    sim_duration_s: float | None,
    sim_energy_j: float,
) -> Point:
    """``greend_job_step``: one reported step (the simulator's figures on simulated GPUs)."""
    fields: dict[str, FieldValue] = {
        "step": step,
        "duration_s": duration_s,
        "flops": flops,
        "samples": samples,
        "tokens": tokens,
    }
    if loss is not None:
        fields["loss"] = float(loss)
    if nonfinite:
        fields["nonfinite"] = 1
    if sim_duration_s is not None:
        fields["sim_duration_s"] = sim_duration_s
        fields["sim_energy_j"] = sim_energy_j
    return Point("greend_job_step", {"host": host, "job": job, "rank": str(rank), "precision": precision}, fields, ts)


def job_steps_point(
    ts: int, host: str, *, job: str, rank: int, precision: str, fields: Mapping[str, FieldValue]
) -> Point:
    """``greend_job_steps``: a rank's steps over one store interval at one precision (the
    default job rows: their number does not grow with the step rate). ``fields`` come from
    ``StepAggregate.fields()``."""
    return Point(
        "greend_job_steps", {"host": host, "job": job, "rank": str(rank), "precision": precision}, dict(fields), ts
    )


def efficiency_point(
    ts: int, host: str, *, job: str, precision: str, window: Mapping[str, Any], life: Mapping[str, Any]
) -> Point:
    """``greend_efficiency``: a running job's sliding window and its life so far."""
    fields: dict[str, FieldValue] = {
        "window_s": window["window_s"],
        "window_flops": window["flops"],
        "window_gpu_energy_j": window["gpu_energy_j"] or 0.0,
        "window_gflops_per_w": window["gflops_per_w"] or 0.0,
        "window_flop_per_s": window["flop_per_s"] or 0.0,
        "gpu_power_w": window["gpu_power_w"] or 0.0,
        "flops": life["flops"],
        "gpu_energy_j": life["gpu_energy_j"],
        "gflops_per_w": life["gflops_per_w"] or 0.0,
        "steps": life["steps"],
    }
    return Point("greend_efficiency", {"host": host, "job": job, "precision": precision}, fields, ts)


def job_point(
    ts: int, host: str, *, job: str, precision: str | None, end_reason: str, summary: Mapping[str, Any], kind: str = ""
) -> Point:
    """``greend_job``: an ended job's summary (its finite numbers). A command measured whole
    (``kind`` ``measure``) is tagged so, and has no precision."""
    fields: dict[str, FieldValue] = {}
    # (a CPU energy no RAPL zone or estimate measured: its 0 J is no figure)
    unmeasured = {"cpu_energy_j"} if summary.get("cpu_energy_method") == "unmeasured" else set()
    for k in JOB_SUMMARY_FIELDS:
        v = None if k in unmeasured else summary.get(k)
        if isinstance(v, (int, float)) and not (isinstance(v, float) and not math.isfinite(v)):
            fields[k] = v
    tags = {"host": host, "job": job, "end_reason": end_reason}
    if kind == "measure":
        tags["kind"] = kind
    elif precision:
        tags["precision"] = precision
    if summary.get("gpu_source"):  # "sim", "nvml" or both: a report from the store keeps its (sim) label
        tags["gpu_source"] = str(summary["gpu_source"])
    return Point("greend_job", tags, fields, ts)


def decision_point(
    ts: int,
    host: str,
    *,
    kind: str,
    reason: str,
    policy: str,
    job: str = "",
    gpu: int | None = None,
    precision: str = "",
    zone: str = "",
    path: str = "",
    fields: Mapping[str, FieldValue] | None = None,
) -> Point:
    """``greend_decision``: a setting or a precision changed, and why.

    ``kind`` is ``cap`` (a GPU's clock or power limit, or a CPU zone's limit: ``zone``
    and ``path``), a precision event: ``switch``, ``rollback``, ``refused``, or ``note``:
    a policy's last word on an ended job (why it was not capped or switched). ``policy``
    is the policy that decided (``callback`` for the training process's own events).
    Every point carries the tags of :data:`DECISION_TAGS`.
    """
    tags = {
        "host": host,
        "gpu": "" if gpu is None else str(gpu),
        "job": job,
        "policy": policy,
        "kind": kind,
        "precision": precision,
        "zone": zone,
        "path": path,
    }
    return Point("greend_decision", tags, {**(fields or {}), "reason": reason}, ts)


def cap_fields(*, clock_cap_mhz: float | None, power_limit_w: float | None, capped: bool) -> dict[str, FieldValue]:
    """A ``kind=cap`` decision's fields: ``capped`` (0/1) and the knobs in force (absent:
    that knob at its original)."""
    fields: dict[str, FieldValue] = {"capped": int(capped)}
    if clock_cap_mhz is not None:
        fields["clock_cap_mhz"] = float(clock_cap_mhz)
    if power_limit_w is not None:
        fields["power_limit_w"] = float(power_limit_w)
    return fields


def precision_fields(*, step: int, loss: float | None, trend: float | None) -> dict[str, FieldValue]:
    """A precision decision's fields: the step it happened at, and the loss then and the
    loss trend it was judged against, where known (as the caller's numbers)."""
    fields: dict[str, FieldValue] = {"step": step}
    if loss is not None:
        fields["loss"] = loss
    if trend is not None:
        fields["trend"] = trend
    return fields
