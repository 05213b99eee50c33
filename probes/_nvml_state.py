"""What the NVML probe (:mod:`greend.probes.nvml`) keeps of each GPU, and its recoveries
in the background.

:class:`TrackedGpu` is one device as the probe tracks it. :class:`Looks` runs a recovery
(NVML initialised again after ``UNINITIALIZED``, the GPUs enumerated again after one was
lost or did not answer) on a thread of its own, one at a time, and hands its result,
a :class:`Look`, to the tick that asks for it: the tick never waits on a driver that
may hang, it applies the last look when there is one.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from greend._repeats import LOG_AGAIN_S, Repeats
from greend.errors import NotSupported
from greend.units import mj_to_j

from .nvml_device import Outcome

__all__ = [
    "COUNTER_RETRY_S",
    "FROZEN_S",
    "GLITCH_READS",
    "GLITCH_S",
    "LOG_AGAIN_S",
    "Look",
    "Looks",
    "TrackedGpu",
    "as_text",
]

_EPOCHS = itertools.count(1)  # each TrackedGpu (an opening of a GPU) takes the next

log = logging.getLogger(__name__)

# A counter that stops working mid-run (NOT_SUPPORTED after it worked) is tried again this
# often; the energy is integrated from power meanwhile.
COUNTER_RETRY_S = 60.0
# A counter that has not moved this long while the GPU draws power (real NVML) is frozen: the
# energy is integrated from power instead (an idle GPU draws tens of watts: its counter moves).
FROZEN_S = 5.0
FROZEN_MIN_W = 5.0
# A counter that reads below its last value and comes back to it within this long (this
# many reads where the time is unknown) had a glitch, not a reset (TrackedGpu.book_counter).
GLITCH_S = 60.0
GLITCH_READS = 30


@dataclass
class TrackedGpu:
    """One device as the probe tracks it: static facts read once, plus counters."""

    index: int
    handle: Any
    name: str
    uuid: str
    energy_method: str  # "counter" or "power_integration"
    supported_sm_clocks_mhz: tuple[int, ...] = ()
    sm_clock_max_mhz: float | None = None
    power_limit_min_w: float | None = None
    power_limit_max_w: float | None = None
    power_limit_default_w: float | None = None
    compute_capability: tuple[int, int] | None = None
    mig: bool = False  # MIG mode on: the readings are the whole GPU's, shared by its instances
    energy_j: float = 0.0  # cumulative since open (a read taken back lowers it: energy_epoch says so)
    epoch: int = field(default_factory=lambda: next(_EPOCHS))  # this opening's number (GpuReading.energy_epoch)
    last_counter_mj: int | None = None
    last_counter_s: float | None = None  # when last_counter_mj was read
    counter_dropped: int | None = None  # the counter before a read went back (held for GLITCH_S / GLITCH_READS)
    dropped_at: tuple[float | None, int] = (None, 0)  # (when it went back, reads below it since)
    low_booked_mj: int = 0  # booked from the reads below it: taken back if the counter comes back
    counter_moved_s: float | None = None  # when a read last found the counter moved (or its baseline)
    frozen_mj: int | None = None  # the value a frozen counter held: it works again once it leaves it
    _before_mj: int | None = None  # the counter's read before the last
    _booked_mj: int = 0  # what the last read booked
    last_power: tuple[float, float] | None = None  # (now_s, power_w) for the trapezoid
    # A counter that worked, then read NOT_SUPPORTED: tried again from this time (a
    # transient fault must not leave the GPU on power integration for good).
    counter_retry_s: float | None = None
    errors: dict[str, str] = field(default_factory=dict)  # call -> message, shown until it answers again
    # Per call: an error that comes and goes, or one whose message counts seconds, is
    # logged again only after LOG_AGAIN_S (TrackedGpu.should_log).
    repeats: Repeats = field(default_factory=Repeats)
    slow: tuple[Any, ...] = (None, None, None, None, None)  # util, SM MHz, mem MHz, temp C, limit mW
    slow_at_s: float = float("-inf")
    slow_read_after_writes: int = 0  # the device's settings writes when the slow fields were read
    power_w: float | None = None  # the last power read (with the slow fields, or every tick)

    def book_counter(self, raw_mj: int, what: str, now_s: float | None = None) -> None:
        """A read of the energy counter (mJ since the driver loaded), at ``now_s``.

        The counter only goes forward. One bad read loses at most the interval around it,
        never the whole count since the driver loaded:

        - a read below the last starts a new baseline and books nothing; if a read within
          :data:`GLITCH_S` (:data:`GLITCH_READS` reads where the time is unknown) is back at
          or above the value before it, the low reads were a glitch: the interval across
          them is booked and what the reads between booked is taken back (after a reset or
          a driver reload the counter starts from 0 and stays below: it goes on from its
          new baseline);
        - a read ahead that the next read contradicts (it lands between the two before)
          was a glitch: what it booked is taken back;
        - with ``now_s`` (real NVML; simulated GPUs run faster than the clock), a jump
          forward by more than the GPU can draw meanwhile (:meth:`_most_mj`) is not booked.
        """
        last, was_s, before, booked = self.last_counter_mj, self.last_counter_s, self._before_mj, self._booked_mj
        moved_s = self.counter_moved_s if self.counter_moved_s is not None else was_s
        dropped, (drop_s, low_reads) = self.counter_dropped, self.dropped_at
        expired = now_s - drop_s > GLITCH_S if drop_s is not None and now_s is not None else low_reads >= GLITCH_READS
        if dropped is not None and expired:
            dropped = self.counter_dropped = None  # (a reset, not a glitch: the new baseline stands)
        self.last_counter_mj, self.last_counter_s, self._before_mj, self._booked_mj = raw_mj, now_s, last, 0
        if last is None or raw_mj != last:
            self.counter_moved_s = now_s
        if last is None:
            return  # first good read: the baseline
        if raw_mj < last:
            if before is not None and before <= raw_mj and dropped is None:
                log.warning("%s: energy counter read %d mJ ahead of the reads around it: taken back", what, last)
                self.energy_j -= mj_to_j(booked)
                self._book(raw_mj - before)
                return
            log.warning("%s: energy counter went back (%d -> %d mJ): a new baseline", what, last, raw_mj)
            if dropped is None:  # (lower again within a glitch: the value before it still stands)
                self.counter_dropped, self.dropped_at, self.low_booked_mj = last, (now_s, 1), 0
            else:
                self.dropped_at = (drop_s, low_reads + 1)
            return
        if dropped is not None and dropped <= raw_mj:
            self.counter_dropped, low, self.low_booked_mj = None, self.low_booked_mj, 0
            if raw_mj - dropped <= self._most_mj(drop_s, now_s):  # (else: read on as any read)
                self.energy_j -= mj_to_j(low)  # the low reads were a glitch
                self._book(raw_mj - dropped)
                return
            dropped = None
        # (from when the counter last moved: a counter that stalled, then caught up, drew
        # its energy over the whole stall, not since the read before)
        if raw_mj - last > self._most_mj(moved_s, now_s):
            log.warning("%s: energy counter jumped %d mJ in one read, more than the GPU can draw", what, raw_mj - last)
            return
        self._book(raw_mj - last)
        if dropped is not None:
            self.dropped_at, self.low_booked_mj = (drop_s, low_reads + 1), self.low_booked_mj + raw_mj - last

    def plausible_w(self, power_w: float) -> float | None:
        """A power read the GPU can draw, else None (left out, logged): 0 W, or over twice its
        highest power limit (65,535 W reads come from a GPU in trouble). Integrated where
        the GPU has no energy counter, such a read made 125x the energy."""
        top = 2.0 * (self.power_limit_max_w or 1500.0)
        if 0.0 < power_w <= top:
            return power_w
        line = self.should_log("power", f"gpu{self.index} power read {power_w:g} W, not a GPU's draw (0 or over "
                               f"{top:g} W): left out", time.monotonic())  # fmt: skip
        if line is not None:
            log.warning("%s", line)
        return None

    def should_log(self, key: str, message: str, now_s: float) -> str | None:
        """The text to log for an error of ``key`` (a call, or "sample"), or None where the
        same error (its numbers aside) was logged less than :data:`LOG_AGAIN_S` ago; the
        repeats in between are counted into the next line."""
        return self.repeats.line(key, message, now_s)

    def account_energy(
        self,
        read: Callable[[], int],
        what: str,
        power_w: float | None,
        now_s: float,
        real: bool,
        since_s: float | None = None,
    ) -> None:
        """One tick's energy: from the counter (``read()``, mJ), else from ``power_w``
        integrated. A counter that reads NOT_SUPPORTED after it worked hands over to
        power at once and is tried again every :data:`COUNTER_RETRY_S`; where it
        answers, it is taken back from a new baseline (the energy up to now was
        integrated). ``real``: real NVML (its reads are checked against the clock: the
        tick's time plus how late the counter was read after the read was handed to its
        worker at ``since_s``, monotonic; a read that stalled 10 s took 10 s of the GPU's
        energy with it, and was dropped as more than the GPU can draw)."""

        def read_at() -> float:
            return now_s if since_s is None else now_s + max(0.0, time.monotonic() - since_s)

        if self.energy_method != "counter":
            self.integrate_power(power_w, now_s)
            if self.counter_retry_s is None or now_s < self.counter_retry_s:
                return
            try:
                raw = int(read())
            except Exception as e:  # (NOT_SUPPORTED still, or another fault: the power reads tell)
                log.debug("%s: energy counter still not working: %s", what, e)
                self.counter_retry_s = now_s + COUNTER_RETRY_S
                return
            if raw == self.frozen_mj:
                log.debug("%s: energy counter still frozen at %d mJ", what, raw)
                self.counter_retry_s = now_s + COUNTER_RETRY_S
                return
            log.warning("%s: energy counter works again; power integration ends", what)
            self.energy_method, self.counter_retry_s, self.last_power = "counter", None, None
            self.last_counter_mj, self.last_counter_s, self.counter_dropped = None, None, None
            self.counter_moved_s, self.frozen_mj = None, None
            self.book_counter(raw, what, read_at() if real else None)  # the new baseline
            return
        try:
            raw = int(read())
        except NotSupported:
            log.warning("%s: energy counter stopped working; integrating power instead (the counter is tried "
                        "again every %g s)", what, COUNTER_RETRY_S)  # fmt: skip
            self.energy_method, self.counter_retry_s = "power_integration", now_s + COUNTER_RETRY_S
            self.integrate_power(power_w, now_s)
            return
        at = read_at() if real else None
        self.book_counter(raw, what, at)  # (sim: its own clock)
        if at is not None and self.counter_moved_s is not None:
            self._check_frozen(what, at, now_s)

    def _check_frozen(self, what: str, at_s: float, now_s: float) -> None:
        """A counter that has not moved for :data:`FROZEN_S` while the GPU draws power
        (its last power read) is frozen: its span is booked from that power, and the
        energy is integrated from power until the counter leaves the value it froze at
        (tried every :data:`COUNTER_RETRY_S`). Booked as 0 J, it hid the GPU's draw."""
        assert self.counter_moved_s is not None
        still_s, power_w = at_s - self.counter_moved_s, self.power_w
        if still_s < FROZEN_S or power_w is None or power_w < FROZEN_MIN_W:
            return
        log.warning(
            "%s: energy counter has not moved for %.0f s while the GPU draws %.0f W: integrating power instead "
            "(the counter is tried again every %g s)",
            what,
            still_s,
            power_w,
            COUNTER_RETRY_S,
        )
        # The frozen span, from the power read, up to this tick (power integration goes on
        # from it: the read's lateness is not counted twice).
        self.energy_j += power_w * max(0.0, still_s - (at_s - now_s))
        self.frozen_mj = self.last_counter_mj
        self.energy_method, self.counter_retry_s = "power_integration", now_s + COUNTER_RETRY_S
        self.last_power = (now_s, power_w)

    def _book(self, mj: int) -> None:
        self.energy_j += mj_to_j(mj)
        self._booked_mj = mj

    def _most_mj(self, since_s: float | None, now_s: float | None) -> float:
        """The most energy (mJ) the GPU can plausibly draw between two reads: twice its
        highest power limit (1,500 W where that is unknown) over the time between them
        plus a second; unbounded where the times are unknown."""
        if since_s is None or now_s is None:
            return float("inf")
        peak_w = 2.0 * (self.power_limit_max_w or 1500.0)
        return peak_w * (max(0.0, now_s - since_s) + 1.0) * 1000.0

    def integrate_power(self, power_w: float | None, now_s: float) -> None:
        """Trapezoid rule over the tick times; a tick without power leaves a gap that the
        next two known points bridge."""
        if power_w is None:
            return
        if self.last_power is not None:
            t0, p0 = self.last_power
            if now_s <= t0:
                return  # same or earlier tick time: nothing to integrate
            self.energy_j += 0.5 * (p0 + power_w) * (now_s - t0)
        self.last_power = (now_s, power_w)


@dataclass
class Look:
    """What a recovery's driver calls found: the GPU count, each ``"gpuI"``'s
    (handle, UUID) or error, the GPUs never seen before, opened (or the error), and
    whether NVML was initialised again first (after a driver reload)."""

    count: int
    looked: dict[str, Outcome]
    fresh: dict[int, Outcome]
    reinit: bool = False


class Looks:
    """Recoveries on a thread of their own, one at a time.

    ``look(reinit)`` makes the driver calls and returns a :class:`Look` (None: nothing
    to apply, NVML could not be initialised or counted). :meth:`start` starts one unless
    one runs (a re-initialisation asked meanwhile is remembered for the next);
    :meth:`take` hands over a finished look once."""

    def __init__(self, look: Callable[[bool], Look | None]) -> None:
        self._look = look
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._reinit = False  # the running look initialises NVML again
        self._reinit_next = False  # asked while a look ran
        self._done: Look | None = None

    def start(self, reinit: bool) -> None:
        with self._lock:
            if self._thread is not None:
                self._reinit_next |= reinit
                return
            self._reinit = reinit or self._reinit_next
            self._reinit_next = False
            self._thread = threading.Thread(target=self._run, args=(self._reinit,), name="nvml-look", daemon=True)
            self._thread.start()

    def _run(self, reinit: bool) -> None:
        look: Look | None = None
        try:
            look = self._look(reinit)
        except Exception:  # a bug here must not stop the next look
            log.exception("looking for the GPUs again failed")
        with self._lock:
            self._done, self._thread, self._reinit = look, None, False

    def take(self) -> Look | None:
        """The look that finished since the last call, once (None: none)."""
        with self._lock:
            done, self._done = self._done, None
        return done

    @property
    def running(self) -> bool:
        return self._thread is not None

    @property
    def reinitialising(self) -> bool:
        """A look that initialises NVML again is running."""
        return self._thread is not None and self._reinit

    def join(self, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` for a running look (tests, and close)."""
        t = self._thread
        if t is not None:
            t.join(timeout_s)


def as_text(value: Any) -> str:
    """Old pynvml versions return bytes for names and UUIDs."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
