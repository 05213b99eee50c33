"""The NVML probe's per-tick reads (:mod:`greend.probes.nvml`), which never hold the
tick on a GPU that hangs.

:class:`Reads` starts each GPU's read on that GPU's own worker, all at once, and waits
for them together at most ``wait_s`` (the daemon: a quarter of its tick period). A
read still out then is not waited for: the first tick that finds it done takes it
(the energy counter is cumulative, so a late read loses nothing), and meanwhile the
GPU's last reading stands in, marked stale (``stale_s``; the ledger books no energy
from it, so nothing counts twice). A read out past the call deadline makes its GPU
unresponsive, as a call past its deadline always does.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from . import ProbeContext
from ._nvml_state import TrackedGpu
from .base import GpuReading
from .nvml_device import NvmlDevices

__all__ = ["READ_WAIT_SHARE", "Read", "Reads", "tick_read_wait_s"]

log = logging.getLogger(__name__)

# The share of the daemon's tick period that its tick waits for the GPUs' reads (a
# healthy read takes a few ms); a read still out then is taken by a later tick.
READ_WAIT_SHARE = 0.25


@dataclass
class Read:
    """One GPU's read on its worker: started at ``since_s`` (monotonic) as ``what``
    (``"gpu3"``), taken by the first tick that finds it done."""

    future: Future[Any]
    what: str
    since_s: float


class Reads:
    """The reads in flight, one per GPU (by UUID), and each GPU's last reading.

    ``read(gpu, now_s, since_s)`` makes one GPU's driver calls and returns its reading
    (``since_s``: when the read was handed to its worker, monotonic: a read that stalled
    knows how late its values are);
    ``wait_s``: how long :meth:`take` waits for the reads, all together (None: up to
    the call deadline, the tick then waiting on a GPU that starts hanging)."""

    def __init__(
        self, devices: NvmlDevices, read: Callable[[TrackedGpu, float, float], GpuReading], wait_s: float | None
    ) -> None:
        self._devices = devices
        self._read = read
        self.wait_s = wait_s
        self._out: dict[str, Read] = {}  # UUID -> the read in flight
        self._last: dict[str, tuple[GpuReading, float]] = {}  # UUID -> last reading, when taken (monotonic)

    def take(self, live: list[TrackedGpu], now_s: float) -> list[tuple[TrackedGpu, GpuReading | BaseException]]:
        """Each live GPU with its reading this tick (stale where its read is still out)
        or the error its read raised; a GPU whose read is out with no earlier reading
        to stand in is left out."""
        deadline_s = self._devices.deadline_s
        wait_s = deadline_s if self.wait_s is None else min(self.wait_s, deadline_s)
        uuids = {g.uuid for g in live}
        for uuid in [u for u in self._out if u not in uuids and self._out[u].future.done()]:
            del self._out[uuid]  # a GPU lost or gone meanwhile: its read is of no use now
        for gpu in live:
            if gpu.uuid not in self._out:
                what, since_s = f"gpu{gpu.index}", time.monotonic()
                fut = self._devices.submit(what, "read", partial(self._read, gpu, now_s, since_s))
                self._out[gpu.uuid] = Read(fut, what, since_s)
        wait_futures([self._out[g.uuid].future for g in live], timeout=wait_s)
        taken = time.monotonic()
        got: list[tuple[TrackedGpu, GpuReading | BaseException]] = []
        for gpu in live:
            read = self._out[gpu.uuid]
            if read.future.done():
                del self._out[gpu.uuid]
                error = read.future.exception()
                if error is not None:
                    got.append((gpu, error))
                    continue
                reading: GpuReading = read.future.result()
                if reading.index != gpu.index:  # found at another index while it was read
                    reading = replace(reading, index=gpu.index)
                self._last[gpu.uuid] = (reading, taken)
                got.append((gpu, reading))
            elif taken - read.since_s >= deadline_s - 1e-3:
                del self._out[gpu.uuid]
                self._last.pop(gpu.uuid, None)
                got.append((gpu, self._devices.overdue(read.what, "read", read.future, deadline_s)))
            elif (last := self._last.get(gpu.uuid)) is not None:
                got.append((gpu, replace(last[0], index=gpu.index, stale_s=taken - last[1])))
        return got


def tick_read_wait_s(ctx: ProbeContext) -> float:
    """How long the daemon's tick waits for the GPUs' reads: ``READ_WAIT_SHARE`` of its
    period, or ``GREEND_NVML_READ_WAIT_S`` (a wait as long as the call deadline makes
    the tick wait on a GPU that starts hanging, as greend did before it read ahead)."""
    raw = os.environ.get("GREEND_NVML_READ_WAIT_S", "").strip()
    if not raw:
        return READ_WAIT_SHARE * ctx.tick_period_s
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 600.0:  # (NaN too: a negative or an infinite wait means nothing)
        log.warning("GREEND_NVML_READ_WAIT_S=%r is not seconds from 0 to 600: ignored", raw)
        return READ_WAIT_SHARE * ctx.tick_period_s
    return value
