"""The latest tick as the daemon's parts read it: the readings of every probe sampled
(or standing from its last sample), and the tick counters ``status`` reports."""

from __future__ import annotations

from dataclasses import dataclass, field

from greend.probes import CpuReading, GpuReading, HostReading, Readings

__all__ = ["TickReadings", "TickCounts"]


@dataclass
class TickReadings:
    """The latest tick, as the status op, the control loop and the stores see it.
    Filled while its tick runs, then replaced whole by the next: never changed after."""

    t_s: float = 0.0
    wall_s: float = 0.0
    gpus: list[GpuReading] = field(default_factory=list)
    cpus: list[CpuReading] = field(default_factory=list)
    host: HostReading | None = None

    def merge(self, r: Readings) -> None:
        self.gpus.extend(r.gpus)
        self.cpus.extend(r.cpus)
        if r.host is not None:
            self.host = r.host


@dataclass(frozen=True)
class TickCounts:
    """The tick loop's counters at one moment (``status``)."""

    ticks: int  # ticks run
    skipped: int  # ticks an overrun skipped
    errors: int  # ticks that raised (logged; the next ran as usual)
    last_error: str | None  # the last one's exception
    duration_s: float  # the last tick's
    lateness_s: tuple[float, ...]  # how late each recent tick started after it was due
