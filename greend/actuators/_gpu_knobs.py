"""The GPU knobs of the :class:`~greend.actuators.controller.Controller`: a GPU's
locked SM clocks and power limit, applied and restored through a
:class:`~greend.actuators.gpu.GpuBackend`.

It keeps the Controller's GPU rules (see :mod:`greend.actuators.controller`): clock caps
snap to a supported clock and power limits clamp to the GPU's constraints; a knob's
original is saved in the :class:`~greend.actuators._book.SettingsBook` before greend's
first write; setters read before they write; dry-run records the intention only. Calls
into the driver run under a lock of their GPU alone, never under the state lock.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from greend.actuators._book import SettingsBook
from greend.actuators.gpu import GpuBackend
from greend.actuators.knob_errors import guarded, knob_error
from greend.actuators.report import RestoreFailure, RestoreReport
from greend.actuators.state import CLOCK_KNOB, GPU_KNOBS, POWER_KNOB, GpuEntry, KnobState, backend_key
from greend.errors import ActuatorError, GreendError, KnobError, ProbeError, StateError
from greend.settings import UNCAPPED, Setting
from greend.units import w_to_mw

log = logging.getLogger(__name__)


def gpu_lock_wait_s(deadline_s: float) -> float:
    """How long an operation waits for a GPU another operation is writing to: the
    holder's first call that hangs ends at ``deadline_s`` and its later calls on that
    GPU fail at once, so twice the deadline and a second is ample."""
    return 2.0 * deadline_s + 1.0


# How long a restore waits for a GPU another operation holds before it reports that
# GPU's knobs as not restored (they stay in the state file; ``greend restore``, run by
# the unit's ExecStopPost, tries again): a healthy write holds a GPU for milliseconds,
# one stuck in the driver until its deadline, and a stop must not wait on that.
RESTORE_WAIT_S = 2.0
# A restore that met a driver error that may pass is tried again after these pauses (s):
# 16 knobs failing at a stop take at most 12 s of the unit's 30 s TimeoutStopSec.
RESTORE_RETRY_S = (0.25, 0.5)


def restore_wait_s(deadline_s: float) -> float:
    """The longest a restore of every GPU (all at once) waits for one: the GPU's lock,
    then one call that may hang to its deadline, the others failing at once after it."""
    return RESTORE_WAIT_S + 2.0 * deadline_s + 1.0


def _setting_text(value: float | None, unit: str) -> str:
    if value is None:
        return "unlocked" if unit == "MHz" else "original"
    return f"{value:g} {unit}"


class GpuKnobs:
    """The GPU knobs: ``primary`` is the backend of this greend's GPUs (None: none);
    :meth:`add_backend` adds one for each other kind recorded in the state file, so
    that restore reaches every GPU greend set."""

    def __init__(self, book: SettingsBook, primary: GpuBackend | None) -> None:
        self.book = book
        self.primary = primary
        self.backends: dict[str, GpuBackend] = {}
        self.unavailable: dict[str, tuple[str, str]] = {}  # backend key -> (why, reason)
        self._locks: dict[tuple[str, int], threading.RLock] = {}  # (backend key, index)
        # (index, knob) -> (asked, held) of the primary's GPUs that hold another value
        # than greend asked for, as read back after the write
        self._held: dict[tuple[int, str], tuple[float, float]] = {}
        # (index, knob) -> asked, for writes whose value the GPU could not show yet (an
        # idle GPU, or one that power or heat hold below the lock): read back later
        self._unverified: dict[tuple[int, str], float] = {}
        # (index, knob) whose last write outlived its deadline: it may have landed, or not
        self._in_doubt: set[tuple[int, str]] = set()
        # (UUID, knob) -> the GPU's epoch (GpuBackend.epoch) when greend last wrote the knob
        self._epochs: dict[tuple[str, str], int] = {}
        self._failed: dict[tuple[str, str], str] = {}  # a write again that failed: why (logged once)
        if primary is not None:
            self.add_backend(primary)

    def deadline_s(self) -> float:
        """The longest call deadline of the backends (5 s when there are none)."""
        return max((b.deadline_s for b in self.backends.values()), default=5.0)

    def add_backend(self, backend: GpuBackend) -> None:
        self.backends[backend_key(backend.kind, backend.sim_dir)] = backend

    def backend_unavailable(self, key: str, why: str, reason: str = "failed") -> None:
        """Record why the backend for ``key`` could not be opened (restore reports it);
        ``reason``: "unresponsive" where NVML did not answer in time."""
        self.unavailable[key] = (why, reason)

    def _backend(self) -> GpuBackend:
        if self.primary is None:
            raise ActuatorError("no GPU backend: this greend has no NVML and no --sim GPUs")
        return self.primary

    def entry(self, index: int) -> GpuEntry | None:
        """The saved entry of the GPU at ``index`` now, matched by its UUID where the
        backend knows it (from enumeration, no driver call): an entry whose GPU came
        back at another index follows it. Called with the state lock held."""
        if self.primary is None:
            return None
        key = backend_key(self.primary.kind, self.primary.sim_dir)
        uuid = self.primary.known_uuid(index)
        for e in self.book.state.gpus:
            if e.backend_key != key:
                continue
            if uuid is not None and e.uuid == uuid:
                if e.index != index:
                    log.info("%s is gpu%d now", e.device, index)
                    e.index = index
                return e
            if uuid is None and e.index == index:
                return e
        return None

    def _acquire(self, backend: GpuBackend, index: int, wait_s: float | None = None) -> threading.RLock:
        """Take GPU ``index``'s own lock (its driver calls, one operation at a time),
        waiting for it at most ``wait_s`` (default :func:`gpu_lock_wait_s`);
        :class:`KnobError` past that. The caller releases it."""
        key = (backend_key(backend.kind, backend.sim_dir), index)
        with self.book.lock:
            lock = self._locks.setdefault(key, threading.RLock())
        if wait_s is None:
            wait_s = gpu_lock_wait_s(backend.deadline_s)
        if not lock.acquire(timeout=wait_s):
            raise KnobError(
                f"gpu{index}: busy: an earlier setting on this GPU has not returned within {wait_s:g} s "
                "(the driver may be hung; fix: check `nvidia-smi` and dmesg for Xid errors, then "
                "`greenctl probes` for unresponsive GPUs)",
                device=f"gpu{index}",
                knob="/".join(GPU_KNOBS),
                reason="failed",
            )
        return lock

    @contextmanager
    def _guard(self, backend: GpuBackend, index: int) -> Iterator[None]:
        """:meth:`_acquire` for a ``with`` block."""
        lock = self._acquire(backend, index)
        try:
            yield
        finally:
            lock.release()

    def _snap_clock(self, backend: GpuBackend, index: int, mhz: int) -> tuple[int, int | None]:
        """(clock to lock at, lowest supported clock or None if unknown)."""
        try:
            clocks = backend.supported_sm_clocks_mhz(index)
        except ProbeError as e:
            log.debug("gpu%d: supported clocks unknown (%s); using %d MHz as asked", index, e, mhz)
            return int(mhz), None
        if not clocks:
            return int(mhz), None
        below = [f for f in clocks if f <= mhz]
        snapped = max(below) if below else min(clocks)
        if snapped != mhz:
            log.debug("gpu%d: clock cap %d MHz snapped to %d MHz", index, mhz, snapped)
        return snapped, min(clocks)

    def _clamp_power(self, backend: GpuBackend, index: int, power_w: float) -> float:
        try:
            lo, hi = backend.power_limit_constraints_w(index)
        except ProbeError as e:
            log.debug("gpu%d: power limit constraints unknown (%s)", index, e)
            return float(power_w)
        clamped = min(max(float(power_w), lo), hi)
        if clamped != power_w:
            log.info("gpu%d: power limit %g W clamped to %g W (allowed %g..%g W)", index, power_w, clamped, lo, hi)
        return clamped

    def apply(self, index: int, setting: Setting, owner: str, keep: Iterable[str] = ()) -> Setting:
        """:meth:`Controller.apply_gpu <greend.actuators.controller.Controller.apply_gpu>`,
        whose docstring says what it returns and raises."""
        if setting.clock_cap_mhz is not None and setting.clock_cap_mhz <= 0:
            raise KnobError(
                f"gpu{index} {CLOCK_KNOB}: {setting.clock_cap_mhz} MHz is not a clock",
                device=f"gpu{index}",
                knob=CLOCK_KNOB,
                reason="invalid",
            )
        if setting.power_limit_w is not None and not (
            math.isfinite(setting.power_limit_w) and setting.power_limit_w > 0
        ):
            raise KnobError(
                f"gpu{index} {POWER_KNOB}: {setting.power_limit_w} W is not a power limit",
                device=f"gpu{index}",
                knob=POWER_KNOB,
                reason="invalid",
            )
        backend = self._backend()
        with self._guard(backend, index):
            lowest: int | None = None
            clock: int | None = None
            if setting.clock_cap_mhz is not None:
                clock, lowest = self._snap_clock(backend, index, int(setting.clock_cap_mhz))
            power = None
            if setting.power_limit_w is not None:
                power = self._clamp_power(backend, index, float(setting.power_limit_w))
            keep = frozenset(keep)
            if self.book.dry_run:
                with self.book.lock:
                    prev = self.book.dry_gpu.get(index, UNCAPPED)
                    target = Setting(
                        prev.clock_cap_mhz if CLOCK_KNOB in keep else clock,
                        prev.power_limit_w if POWER_KNOB in keep else power,
                    )
                    if prev != target or self.book.dry_gpu_owner.get(index) != owner:
                        log.info(
                            "dry-run: would set gpu%d clock cap %s, power limit %s (owner %s)",
                            index,
                            _setting_text(clock, "MHz"),
                            _setting_text(power, "W"),
                            owner,
                        )
                    if target.uncapped:
                        self.book.dry_gpu.pop(index, None)
                        self.book.dry_gpu_owner.pop(index, None)
                    else:
                        self.book.dry_gpu[index] = target
                        self.book.dry_gpu_owner[index] = owner
                    return target
            errors: list[GreendError] = []
            for knob, value in ((CLOCK_KNOB, clock), (POWER_KNOB, power)):
                if knob in keep:
                    continue
                try:
                    self._apply_knob(backend, index, knob, value, owner, lowest)
                except (ActuatorError, StateError) as e:
                    errors.append(e)
            if errors:
                for extra in errors[1:]:
                    log.error("%s", extra)
                raise errors[0]
            return self.current(index)

    def _apply_knob(
        self, backend: GpuBackend, index: int, knob: str, value: float | None, owner: str, lowest: int | None
    ) -> None:
        """One knob of one GPU; called with the GPU's own lock held. Driver calls run
        without the state lock, which is taken for each change of the state."""
        with self.book.lock:
            entry = self.entry(index)
            ks = entry.knobs.get(knob) if entry is not None else None
            dev = entry.device if entry is not None else f"gpu{index}"
        if value is None:
            if entry is None or ks is None:
                return  # greend never set it: nothing to restore
            self._restore_knob(backend, index, entry, knob, ks)
            self._held.pop((index, knob), None)
            self._unverified.pop((index, knob), None)
            self._in_doubt.discard((index, knob))
            with self.book.lock:
                entry.knobs.pop(knob, None)
                self.book.drop_empty()
                self.book.save()
            return
        current: float | None = None
        if knob == POWER_KNOB:
            current = guarded(dev, knob, "read the power limit", lambda: backend.power_limit_w(index))
        if ks is None:
            uuid = entry.uuid if entry is not None else guarded(dev, knob, "read the UUID", lambda: backend.uuid(index))
            with self.book.lock:
                if entry is None:
                    entry = GpuEntry(backend=backend.kind, sim_dir=backend.sim_dir, uuid=uuid, index=index)
                    self.book.state.gpus.append(entry)
                    dev = entry.device
                ks = KnobState(
                    original=current if knob == POWER_KNOB else None,
                    set=None,
                    owner=owner,
                    updated_at=time.time(),
                    pending=float(value),  # (see below: the first write)
                )
                entry.knobs[knob] = ks
                try:
                    self.book.save()  # the original is on disk BEFORE the first write
                except StateError:
                    del entry.knobs[knob]
                    self.book.drop_empty()
                    raise
            log.info(
                "%s %s: saved original %s before the first write",
                dev,
                knob,
                _setting_text(ks.original, "MHz" if knob == CLOCK_KNOB else "W"),
            )
        if (index, knob) in self._in_doubt:
            in_force = False  # the last write may not have landed: write it again
        elif knob == CLOCK_KNOB:
            in_force = ks.set == value
        else:
            assert current is not None
            # In force: the GPU holds what was asked, or what it answered the same request with.
            in_force = w_to_mw(current) == w_to_mw(float(value)) or (
                ks.set == value and self._held.get((index, knob)) == (float(value), current)
            )
        if in_force:
            if ks.set != value or ks.owner != owner:
                self._record_set(ks, value, owner)
            return
        self._held.pop((index, knob), None)
        self._unverified.pop((index, knob), None)
        if ks.set is None and ks.pending != value:
            # A first write: on disk before the driver call, so that a restore after a
            # crash in between undoes it where it landed (_restore_knob).
            with self.book.lock:
                ks.pending = float(value)
                self.book.save()
        try:
            if knob == CLOCK_KNOB:
                lo = lowest if lowest is not None else int(value)
                guarded(
                    dev,
                    knob,
                    f"lock the SM clock to {lo}..{int(value)} MHz",
                    lambda: backend.set_locked_clocks_mhz(index, lo, int(value)),
                )
                log.info("%s: SM clock locked to %d..%d MHz (owner %s)", dev, lo, int(value), owner)
            else:
                guarded(
                    dev,
                    knob,
                    f"set the power limit to {value:g} W",
                    lambda: backend.set_power_limit_w(index, float(value)),
                )
                log.info("%s: power limit %g -> %g W (owner %s)", dev, current, value, owner)
        except KnobError as e:
            if e.reason == "unresponsive":
                # The call outlived its deadline and may still land: recorded as set, so
                # that a restore undoes it (undoing a write that never landed changes
                # nothing), and written again at the next request.
                self._in_doubt.add((index, knob))
                self._unverified[(index, knob)] = float(value)
                self._record_set(ks, value, owner)
            elif ks.set is None:
                self._no_pending(ks)  # it did not land
            raise
        self._in_doubt.discard((index, knob))
        assert entry is not None  # (made above, before the first write)
        self._epochs[(entry.uuid, knob)] = backend.epoch(index)
        self._record_set(ks, value, owner)
        self._read_back(backend, index, dev, knob, float(value))

    def _record_set(self, ks: KnobState, value: float, owner: str) -> None:
        """What greend wrote to a knob (and who asked), on disk."""
        with self.book.lock:
            ks.set, ks.owner, ks.updated_at, ks.pending = value, owner, time.time(), None
            self.book.save()

    def _no_pending(self, ks: KnobState) -> None:
        """A first write that failed: no longer pending (on disk where it can be)."""
        with self.book.lock:
            ks.pending = None
            try:
                self.book.save()
            except StateError as e:
                log.warning("%s", e)

    def _read_back(self, backend: GpuBackend, index: int, dev: str, knob: str, asked: float) -> None:
        """After a write: what the GPU holds. A GPU that holds another value than asked
        (a driver that clamps a lock, a limit rounded) is reported with what it holds,
        flagged, logged once per value, and the policies measure against what it holds.
        A GPU that cannot show it now (idle, or held below the lock by power or heat; a
        read that fails) leaves the request in force, unverified: :meth:`verify` reads
        it back again. Called with the GPU's own lock held."""
        held: float | None
        try:
            if knob == CLOCK_KNOB:
                mhz = backend.held_clock_mhz(index)
                held = None if mhz is None else float(mhz)
            else:
                held = backend.power_limit_w(index)
        except (ProbeError, ActuatorError) as e:
            log.debug("%s %s: cannot read back what the GPU holds: %s", dev, knob, e)
            held = None
        if held is None:
            self._unverified[(index, knob)] = asked
            return
        self._unverified.pop((index, knob), None)
        if round(held * 1000) == round(asked * 1000):
            self._held.pop((index, knob), None)
            return
        unit = "MHz" if knob == CLOCK_KNOB else "W"
        if self._held.get((index, knob)) != (asked, held):
            log.warning(
                "%s %s: asked %g %s, the GPU holds %g %s (the driver changed the request); "
                "greend reports and measures %g %s",
                dev,
                knob,
                asked,
                unit,
                held,
                unit,
                held,
                unit,
            )
        self._held[(index, knob)] = (asked, held)

    def verify(self, index: int) -> bool:
        """Read back a setting of GPU ``index`` that the GPU could not show at its write
        (the control loop asks before a policy books a measurement of a job on it, when
        the GPU is busy). True when what greend reports as in force changed. Never waits
        for a GPU another operation holds."""
        pending = {k: a for (i, k), a in list(self._unverified.items()) if i == index}
        if not pending or self.primary is None or self.book.dry_run:
            return False
        backend = self.primary
        try:
            lock = self._acquire(backend, index, 0.0)
        except KnobError:
            return False  # a write runs on it now: it reads back itself
        try:
            before = self.current(index)
            for knob, asked in pending.items():
                if self._unverified.get((index, knob)) == asked:
                    self._read_back(backend, index, f"gpu{index}", knob, asked)
            return self.current(index) != before
        finally:
            lock.release()

    def reassert(self, index: int) -> list[str]:
        """Write greend's settings on GPU ``index`` again where the GPU was found again
        (after a loss, a reset or a driver reload, which drop a clock lock and a power
        limit) since greend wrote them; the knobs written, [] where none was due. A write
        that fails stays due: tried again at the next call (logged once a failure)."""
        backend = self.primary
        if backend is None or self.book.dry_run:
            return []
        with self.book.lock:
            entry = self.entry(index)
            uuid = entry.uuid if entry is not None else None
        if uuid is None:
            return []
        epoch = backend.epoch(index)
        done: list[str] = []
        for knob in GPU_KNOBS:
            if self._epochs.setdefault((uuid, knob), epoch) == epoch:
                continue
            try:
                with self._guard(backend, index):  # (a cap_set meanwhile is the value written)
                    with self.book.lock:
                        entry = self.entry(index)
                        ks = entry.knobs.get(knob) if entry is not None else None
                    if ks is None or ks.set is None:
                        self._epochs[(uuid, knob)] = epoch  # greend holds nothing there now
                        continue
                    value, owner = ks.set, ks.owner
                    log.warning(
                        "gpu%d (%s) was found again since greend set its %s: writing it again", index, uuid, knob
                    )
                    self._in_doubt.add((index, knob))  # (written again, not taken as in force)
                    lowest = self._snap_clock(backend, index, int(value))[1] if knob == CLOCK_KNOB else None
                    self._apply_knob(backend, index, knob, value, owner, lowest)
            except (GreendError, ProbeError) as e:
                if self._failed.get((uuid, knob)) != str(e):
                    log.warning("gpu%d %s: cannot write it again now (tried again each period): %s", index, knob, e)
                self._failed[(uuid, knob)] = str(e)
                continue
            self._failed.pop((uuid, knob), None)
            done.append(knob)
        return done

    def unverified(self, index: int) -> list[str]:
        """The knobs of GPU ``index`` whose value the GPU has not shown since greend wrote it."""
        return sorted(k for (i, k) in list(self._unverified) if i == index)

    def mismatches(self, index: int) -> dict[str, dict[str, float]]:
        """Knob -> {"asked", "held"} where GPU ``index`` holds another value than greend
        asked for (read back after the write)."""
        return {k: {"asked": a, "held": h} for (i, k), (a, h) in sorted(self._held.items()) if i == index}

    def _restore_knob_retried(self, backend: GpuBackend, index: int, entry: GpuEntry, knob: str, ks: KnobState) -> str:
        """:meth:`_restore_knob`, tried again after a driver error that may pass (NVML's
        UNKNOWN, TIMEOUT, IN_USE: reason "failed"), :data:`RESTORE_RETRY_S` apart: at a
        daemon's stop one such answer left the GPU capped until the next start."""
        for pause_s in RESTORE_RETRY_S:
            try:
                return self._restore_knob(backend, index, entry, knob, ks)
            except KnobError as e:
                if e.reason != "failed":
                    raise
                log.warning("restore: %s; trying again in %g s", e, pause_s)
                time.sleep(pause_s)
        return self._restore_knob(backend, index, entry, knob, ks)

    def _restore_knob(self, backend: GpuBackend, index: int, entry: GpuEntry, knob: str, ks: KnobState) -> str:
        """Put one knob back to its original; returns a line for the report."""
        dev = f"gpu{index} ({entry.uuid})"
        if knob == CLOCK_KNOB and ks.set is None and ks.pending is None:
            # greend's own lock never took (its first write failed): whatever lock the
            # GPU has was made outside greend and cannot be read back; leave it.
            log.info("%s: greend never locked the clocks; any lock there is not greend's and stays", dev)
            return f"{dev} {knob}: left as it is (greend's lock never took)"
        if knob == CLOCK_KNOB:
            guarded(dev, knob, "reset the locked clocks", lambda: backend.reset_locked_clocks(index))
            log.info("%s: locked clocks reset (unlocked, as before greend)", dev)
            return f"{dev} {knob}: unlocked"
        original = ks.original
        current, landed = None, False
        if ks.set is None and ks.pending is not None and original is not None:
            # greend stopped during its first write (a crash): undone where it landed.
            current = guarded(dev, knob, "read the power limit", lambda: backend.power_limit_w(index))
            landed = abs(current - ks.pending) < 0.5
        if ks.set is None and not landed:
            # greend's write never took (it failed, or greend stopped before it): the limit
            # the GPU has now is not greend's doing (an operator's, perhaps); leave it.
            log.info("%s: greend never changed the power limit; the limit there stays", dev)
            return f"{dev} {knob}: left as it is (greend's limit never took)"
        assert original is not None
        if current is None:
            current = guarded(dev, knob, "read the power limit", lambda: backend.power_limit_w(index))
        if w_to_mw(current) != w_to_mw(original):
            guarded(
                dev,
                knob,
                f"restore the power limit to {original:g} W",
                lambda: backend.set_power_limit_w(index, original),
            )
            log.info("%s: power limit %g -> %g W (restored)", dev, current, original)
        return f"{dev} {knob}: {original:g} W"

    def restore_entry(self, entry: GpuEntry, knobs: Iterable[str], report: RestoreReport) -> None:
        """Restore the named knobs of one entry; failures go to ``report`` and stay."""
        wanted = set(knobs)
        knobs = [k for k in GPU_KNOBS if k in wanted and k in entry.knobs]
        if not knobs:
            return
        backend = self.backends.get(entry.backend_key)
        if backend is None:
            why, reason = self.unavailable.get(entry.backend_key) or (
                f"it was set through the {entry.backend} backend"
                + (f" (sim dir {entry.sim_dir})" if entry.sim_dir else "")
                + ", which this greend does not drive; run "
                f"`greend restore --state-dir {self.book.state_file.state_dir}`",
                "failed",
            )
            for k in knobs:
                report.failed.append(RestoreFailure(entry.device, k, f"cannot restore: {why}", reason))
            return
        try:
            index = backend.index_of_uuid(entry.uuid, entry.index)
        except (ProbeError, ActuatorError) as e:
            err = knob_error(entry.device, "/".join(knobs), "find the GPU by UUID", e)
            for k in knobs:
                report.failed.append(RestoreFailure(entry.device, k, str(err), err.reason))
            return
        if index is None:
            for k in knobs:
                report.failed.append(
                    RestoreFailure(
                        entry.device,
                        k,
                        f"no GPU with UUID {entry.uuid} on this node now (removed, or another node's "
                        f"or sim dir's state?); its original stays in {self.book.state_file.path}",
                    )
                )
            return
        try:
            lock = self._acquire(backend, index, RESTORE_WAIT_S)
        except KnobError as e:
            for k in knobs:
                report.failed.append(RestoreFailure(entry.device, k, f"not restored: {e}; it stays saved"))
            return
        try:
            with self.book.lock:
                if index != entry.index:
                    log.info("%s is gpu%d now", entry.device, index)
                    entry.index = index
                todo = [(k, entry.knobs[k]) for k in knobs if k in entry.knobs]
            for k, ks in todo:
                try:
                    line = self._restore_knob_retried(backend, index, entry, k, ks)
                except GreendError as e:
                    log.error("restore: %s", e)
                    report.failed.append(RestoreFailure(entry.device, k, str(e), getattr(e, "reason", "failed")))
                else:
                    with self.book.lock:
                        if entry.knobs.get(k) is ks:
                            del entry.knobs[k]
                    self._held.pop((index, k), None)
                    self._unverified.pop((index, k), None)
                    report.restored.append(line)
        finally:
            lock.release()

    def restore(self, index: int) -> RestoreReport:
        """Both knobs of GPU ``index`` back to their originals."""
        report = RestoreReport(dry_run=self.book.dry_run)
        if self.book.dry_run:
            with self.book.lock:
                if self.book.dry_gpu.pop(index, None) is not None:
                    self.book.dry_gpu_owner.pop(index, None)
                    report.restored.append(f"gpu{index}")
                    log.info("dry-run: would restore gpu%d", index)
            return report
        backend = self._backend()
        with self._guard(backend, index):
            with self.book.lock:
                entry = self.entry(index)
            if entry is not None:
                self.restore_entry(entry, GPU_KNOBS, report)
        with self.book.lock:
            self.book.finish(report)
        return report

    def current(self, index: int) -> Setting:
        """What greend has in force on GPU ``index`` (intended, under dry-run);
        None fields: greend has not changed that knob."""
        with self.book.lock:
            if self.book.dry_run:
                return self.book.dry_gpu.get(index, UNCAPPED)
            entry = self.entry(index)
            if entry is None:
                return UNCAPPED
            clock = entry.knobs.get(CLOCK_KNOB)
            power = entry.knobs.get(POWER_KNOB)
            # What the GPU holds where it differs from the request (read back after the write).
            held_clock = self._held.get((index, CLOCK_KNOB))
            held_power = self._held.get((index, POWER_KNOB))
            return Setting(
                clock_cap_mhz=None
                if clock is None or clock.set is None
                else int(held_clock[1] if held_clock is not None and held_clock[0] == clock.set else clock.set),
                power_limit_w=None
                if power is None or power.set is None
                else float(held_power[1] if held_power is not None and held_power[0] == power.set else power.set),
            )
