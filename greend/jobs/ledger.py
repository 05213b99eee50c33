"""Energy accounting: joules per GPU and per CPU zone since the daemon started.

Probes hand over cumulative, monotonic energy per key (``gpu0``,
``cpu:intel-rapl:0``). The ledger keeps, per key, the first reading (the origin
of "since start"), the latest, and a bounded history of ``(t_s, energy_j)`` so
that any recent window can be priced: a job's step from ``t0`` to ``t1`` costs
``energy_between(key, t0, t1)``, interpolated linearly between ticks.

History has two tiers. The fine one holds every tick of the last ``history_s``
(an hour by default). The coarse one holds one point per ``coarse_step_s`` from the
key's first reading on, for as long as the daemon runs: when it reaches
``COARSE_MAX`` points it keeps every other one and doubles its step, so its memory
is bounded and its resolution is always about ``age / (COARSE_MAX / 2)``. A window
that starts before the fine tier (a training job of days) is priced from the coarse
tier at its start and the fine tier at its end: the error is at most the
interpolation over one coarse step at the start, a few seconds in a day.

If a probe is reopened (a lost GPU comes back, a probe restarts) its counter
starts again from zero; the ledger sees the fall and carries the earlier total
forward, so "since start" never goes backwards. A GPU's count that falls within one
opening (its ``epoch``: the NVML probe took back a counter read it had booked, one that
the reads after it showed to be a glitch) is owed instead: the series holds, and the
energy read next pays it off first. A key's series never falls: stores and Prometheus
read it as a counter, and a fall there is a reset.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["COARSE_MAX", "CPU_END_WAIT_S", "GPU_END_WAIT_S", "Ledger", "LedgerEntry", "end_wait_s"]

log = logging.getLogger(__name__)

COARSE_MAX = 8192  # points in a key's coarse history (then it halves them)

# An ended job waits at most this long past its end for every CPU zone's next reading
# (the host probe's estimate comes once a second; a loaded node may tick late) before its
# summary is made. Only a zone that stopped reading makes a job wait this long.
CPU_END_WAIT_S = 3.0
# ...and this long for a GPU of its whose reads failed at its end: the reading after the
# outage bridges it (spread over the gap), and the job's part of the gap is priced only then.
GPU_END_WAIT_S = 30.0


@dataclass
class LedgerEntry:
    key: str
    counted: bool = True
    offset_j: float = 0.0  # carried over probe restarts
    first_j: float | None = None
    last_raw_j: float = 0.0
    last_t_s: float = 0.0
    times: deque[float] = field(default_factory=deque)
    energies: deque[float] = field(default_factory=deque)  # ledger-adjusted cumulative J
    coarse_step_s: float = 1.0
    coarse_times: list[float] = field(default_factory=list)
    coarse_energies: list[float] = field(default_factory=list)
    source: str | None = None  # the device behind the key (a GPU's UUID), where the probe names it
    owed_j: float = 0.0  # taken back by the probe, not paid off yet (see the module)

    @property
    def total_j(self) -> float:
        """Energy since the first reading of this key."""
        if not self.energies or self.first_j is None:
            return 0.0
        return self.energies[-1] - self.first_j


class Ledger:
    """Thread-safe: the tick loop writes, IPC handlers and stores read."""

    def __init__(self, history_s: float = 3600.0, hz: float = 10.0, coarse_step_s: float = 1.0) -> None:
        self._maxlen = max(16, int(history_s * hz) + 1)
        self._coarse_step_s = coarse_step_s
        self._entries: dict[str, LedgerEntry] = {}
        self._last_of: dict[str, tuple[float, int]] = {}  # a device -> its last reading and epoch
        self._lock = threading.Lock()

    def record(
        self, key: str, t_s: float, energy_j: float, *, counted: bool = True, source: str | None = None, epoch: int = 0
    ) -> None:
        """Book a cumulative reading of ``key``. ``source``: the device behind the key (a
        GPU's UUID), whose readings are its own cumulative count; where another device
        reads under the key (NVML renumbered the GPUs after one fell off the bus, or back),
        the key's series goes on from where it was with what that device drew since its
        own last reading, under whichever key (no rise booked in full, no fall read as a
        restart, nothing booked twice). ``epoch``: which opening of the device the count is
        from (0: not said); a fall within one is owed, not a restart (see the module)."""
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                e = LedgerEntry(
                    key,
                    counted=counted,
                    times=deque(maxlen=self._maxlen),
                    energies=deque(maxlen=self._maxlen),
                    coarse_step_s=self._coarse_step_s,
                )
                self._entries[key] = e
            e.counted = counted
            if source is not None:
                # The device behind the key, whose readings are its own cumulative count: the
                # key's series goes on with what it drew since its own last reading, under
                # whichever key that was (NVML renumbered the GPUs, or numbers them as before).
                prev, prev_epoch = self._last_of.get(source, (None, 0))
                if e.energies:
                    if prev is not None and prev <= energy_j:
                        since = prev
                    elif prev is not None and epoch and epoch == prev_epoch:
                        e.owed_j += prev - energy_j  # the probe took back what it booked
                        since = energy_j
                    elif e.source == source:
                        since = 0.0  # its counter restarted: keep what was counted so far
                    else:
                        since = energy_j  # a device not read before (or whose count went back): from now
                    paid = min(e.owed_j, energy_j - since)
                    e.owed_j -= paid
                    e.offset_j += e.last_raw_j - since - paid
                if e.source is not None and e.source != source:
                    log.warning("%s is another device now (%s, was %s): its energy counts on from here",
                                key, source, e.source)  # fmt: skip
                e.source = source
                self._last_of[source] = (energy_j, epoch)
            elif e.energies and energy_j < e.last_raw_j:
                # The probe's counter restarted: keep what was counted so far.
                e.offset_j += e.last_raw_j
            e.last_raw_j = energy_j
            adjusted = e.offset_j + energy_j
            if e.first_j is None:
                e.first_j = adjusted
            if e.times and t_s <= e.times[-1]:
                e.energies[-1] = adjusted  # same tick seen twice: keep the latest value
                if e.coarse_times[-1] == e.times[-1]:
                    e.coarse_energies[-1] = adjusted
            else:
                e.times.append(t_s)
                e.energies.append(adjusted)
                if not e.coarse_times or t_s >= e.coarse_times[-1] + e.coarse_step_s:
                    e.coarse_times.append(t_s)
                    e.coarse_energies.append(adjusted)
                    if len(e.coarse_times) > COARSE_MAX:
                        # Keep the first point (the origin) and every other one after it.
                        del e.coarse_times[1::2], e.coarse_energies[1::2]
                        e.coarse_step_s *= 2.0
            e.last_t_s = t_s

    def keys(self, prefix: str = "", counted_only: bool = False) -> list[str]:
        with self._lock:
            return [k for k, e in self._entries.items() if k.startswith(prefix) and (e.counted or not counted_only)]

    def total_j(self, key: str) -> float:
        with self._lock:
            e = self._entries.get(key)
            return e.total_j if e else 0.0

    def totals(self, prefix: str = "", counted_only: bool = True) -> float:
        with self._lock:
            return sum(
                e.total_j for k, e in self._entries.items() if k.startswith(prefix) and (e.counted or not counted_only)
            )

    def cumulative_at(self, key: str, t_s: float) -> float | None:
        """Ledger energy of ``key`` at time ``t_s`` (interpolated), relative to its origin.

        Before the first reading: None. After the latest tick: the latest value
        (energy is not extrapolated). Older than the fine history: from the coarse one.
        """
        with self._lock:
            e = self._entries.get(key)
            if e is None or not e.times or e.first_j is None:
                return None
            if t_s >= e.times[-1]:
                return e.energies[-1] - e.first_j
            times: Sequence[float] = e.times
            energies: Sequence[float] = e.energies
            if t_s < times[0]:
                times, energies = e.coarse_times, e.coarse_energies
                if t_s < times[0]:
                    return None
            i = bisect.bisect_right(times, t_s)
            t0, e0 = times[i - 1], energies[i - 1]
            if i < len(times):
                t1, e1 = times[i], energies[i]
            else:  # past the last coarse point (a step longer than the fine history)
                t1, e1 = e.times[0], e.energies[0]
            frac = (t_s - t0) / (t1 - t0) if t1 > t0 else 0.0
            return e0 + frac * (e1 - e0) - e.first_j

    def energy_between(self, key: str, t0_s: float, t1_s: float, *, clamp: bool = False) -> float | None:
        """Joules of ``key`` from ``t0_s`` to ``t1_s`` (monotonic seconds).

        A window that starts before the key's first reading is unknown (None), unless
        ``clamp``: then it is priced from the first reading on (a job whose first steps
        ran before the daemon started, or before its first tick, gets what was measured).
        """
        if clamp:
            with self._lock:
                e = self._entries.get(key)
                if e is not None and e.coarse_times:
                    t0_s = max(t0_s, e.coarse_times[0])
        a = self.cumulative_at(key, t0_s)
        b = self.cumulative_at(key, t1_s)
        if a is None or b is None:
            return None
        return max(0.0, b - a)

    def power_w(self, key: str, window_s: float = 1.0) -> float | None:
        """Average power over the last ``window_s`` of history."""
        with self._lock:
            e = self._entries.get(key)
            if e is None or len(e.times) < 2:
                return None
            t1 = e.times[-1]
            t0 = t1 - window_s
        earlier = self.cumulative_at(key, max(t0, e.times[0]))
        latest = self.cumulative_at(key, t1)
        span = t1 - max(t0, e.times[0])
        if earlier is None or latest is None or span <= 0:
            return None
        return (latest - earlier) / span

    def last_time(self, key: str) -> float | None:
        with self._lock:
            e = self._entries.get(key)
            return e.last_t_s if e and e.times else None


def end_wait_s(ledger: Ledger, t_s: float, gpus: Iterable[int]) -> float:
    """How long past its end ``t_s`` a job waits before its window is priced: 0 where each
    of its ``gpus`` the ledger knows and every counted CPU zone has a point at or after
    ``t_s``; else :data:`GPU_END_WAIT_S` for a GPU that has none yet (its reads failed),
    :data:`CPU_END_WAIT_S` for a CPU zone."""

    def late(key: str) -> bool:
        last = ledger.last_time(key)
        return last is None or last < t_s

    known = set(ledger.keys(prefix="gpu"))
    if any(late(f"gpu{g}") for g in gpus if f"gpu{g}" in known):
        return GPU_END_WAIT_S
    return CPU_END_WAIT_S if any(late(k) for k in ledger.keys(prefix="cpu:", counted_only=True)) else 0.0
