"""What the control loop and its profile recordings use of the node: a
:class:`ControlContext` (readings, jobs, ledger, stores, clocks, config), given
explicitly by whoever runs the loop, never the daemon itself."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from greend.config import Config
from greend.jobs.ledger import Ledger
from greend.jobs.registry import JobRegistry
from greend.points import Point

if TYPE_CHECKING:
    from greend.probes import CpuReading, GpuReading

__all__ = ["ControlContext", "NodeReadings"]


class NodeReadings(Protocol):
    """The latest tick's readings: every GPU and CPU zone the probes read."""

    @property
    def gpus(self) -> Sequence[GpuReading]: ...

    @property
    def cpus(self) -> Sequence[CpuReading]: ...


@dataclass(frozen=True)
class ControlContext:
    """What the control loop uses of the node, given explicitly by whoever runs it."""

    cfg: Config
    hostname: str
    jobs: JobRegistry
    ledger: Ledger
    latest: Callable[[], NodeReadings]  # the latest tick's readings (a consistent copy)
    emit: Callable[[list[Point]], None]  # to the stores
    wall: Callable[[], float]
    monotonic: Callable[[], float]
    # The state dir the daemon opened (a greend.fsutil.StateDir: its saved settings are
    # written through its descriptor); None: by the configured path.
    state_dir: os.PathLike[str] | None = None
