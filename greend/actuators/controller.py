"""The Controller: the knobs greend turns, saved before the first write and restored.

Knobs: a GPU's locked SM clocks and power limit (:mod:`greend.actuators.gpu`) and a
RAPL zone's power limit, long and short term (:mod:`greend.actuators.rapl`).

Layers::

    Controller   what the daemon, the policies and greenctl call: snapping and
      |          clamping, read-before-write, save-before-first-write, owners,
      |          restore (per GPU, per owner, everything), dry-run
      +-- GpuBackend     (protocol) NvmlGpuBackend over the NVML device layer it shares
      |                  with the NVML probe: real NVML, or the simulator's FakeNvml
      +-- RaplBackend    powercap sysfs under an injected root
      +-- StateFile      <state_dir>/saved-settings.json (greend.actuators.state)

Rules the Controller keeps:

- The original of every device knob is saved to the state file (atomically)
  BEFORE greend's first write of that knob; a failing save means no write.
- Setters read before they write: an identical request makes no setter call.
- Clock caps snap to the highest supported clock <= the request (never below the
  lowest); power limits clamp to the GPU's constraints; RAPL limits to each
  constraint's ``max_power_uw``.
- A :class:`~greend.settings.Setting` field of None restores that knob to its
  original. Locked clocks have no NVML getter, so their original is "unlocked":
  a lock set outside greend before its first write cannot be known, and is
  replaced by "unlocked" on restore. A clock knob whose first write failed is
  never reset (nothing of greend's is there to undo).
- Restore puts each device in its own ``try``: one lost GPU or a missing
  permission is reported and never stops the others; entries that failed stay
  in the state file (a later ``greend restore`` retries), the restored ones are
  dropped, and the file is removed once empty.
- Dry-run logs "would set ..." and records the intended setting in memory (for
  ``greenctl status``) but touches no device and writes no state file.
- No lock is held across a call into the driver that other GPUs or readers need:
  the state lock (``_lock``: the saved settings, the dry-run maps, the file) is
  taken only around changes of the state; calls into NVML run under a lock of
  their GPU alone, which serialises the writes to that GPU and is waited for at
  most :func:`gpu_lock_wait_s` (a hung call there ends at its deadline,
  ``GREEND_NVML_DEADLINE_S``, and the GPU's later calls fail at once). A setter
  stuck in the driver thus holds its own GPU, never ``status``, the other GPUs
  or the daemon's stop.
- Saved GPU entries are matched by UUID: a GPU that comes back at another index
  (after a driver reload) keeps its entry, whose index follows it.

Every NVML or sysfs error arrives as a :class:`KnobError` (an
:class:`~greend.errors.ActuatorError`) raised ``from`` the greend probe error
(``NoPermission``, ``DeviceLost``, ``NotSupported``...) and naming the device,
the knob and the fix (:mod:`greend.actuators.knob_errors`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from greend.actuators.gpu import GpuBackend
from greend.actuators.knob_errors import guarded, knob_error
from greend.actuators.rapl import RaplBackend
from greend.actuators.report import RestoreFailure, RestoreReport
from greend.actuators.state import (
    CLOCK_KNOB,
    GPU_KNOBS,
    POWER_KNOB,
    CpuConstraintState,
    CpuEntry,
    GpuEntry,
    KnobState,
    SavedState,
    StateFile,
    backend_key,
)
from greend.errors import (
    ActuatorError,
    GreendError,
    KnobError,
    ProbeError,
    StateError,
)
from greend.settings import UNCAPPED, Setting
from greend.units import uw_to_w, w_to_mw, w_to_uw

__all__ = ["Controller", "gpu_lock_wait_s"]

log = logging.getLogger(__name__)


def _setting_text(value: float | None, unit: str) -> str:
    if value is None:
        return "unlocked" if unit == "MHz" else "original"
    return f"{value:g} {unit}"


@runtime_checkable
class _Closable(Protocol):
    def close(self) -> None: ...


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


class Controller:
    """Applies and restores settings; see the module docstring for the rules.

    ``state_dir``: where ``saved-settings.json`` lives; an existing file is loaded
    (strictly: :class:`~greend.errors.StateError` if corrupt) and its entries are
    kept, so originals saved by an earlier run are never overwritten.
    ``gpu_backend`` / ``rapl_backend``: the devices (None: no such knobs).
    Thread-safe: the tick loop and IPC handlers may call it. The state lock is never
    held across a driver call; each GPU's writes are serialised by a lock of its own.
    """

    def __init__(
        self,
        state_dir: Path | str,
        gpu_backend: GpuBackend | None = None,
        rapl_backend: RaplBackend | None = None,
        dry_run: bool = False,
    ) -> None:
        self.state_file = StateFile(state_dir)
        self.dry_run = dry_run
        self._lock = threading.RLock()  # the state only: never held across a driver call
        self._gpu_locks: dict[tuple[str, int], threading.RLock] = {}  # (backend key, index)
        self._state: SavedState = self.state_file.load()
        self.gpu_backend = gpu_backend
        self.rapl_backend = rapl_backend
        self._gpu_backends: dict[str, GpuBackend] = {}
        self._gpu_unavailable: dict[str, str] = {}
        self._rapl_backends: dict[str, RaplBackend] = {}
        self._rapl_unavailable: dict[str, str] = {}
        if gpu_backend is not None:
            self.add_gpu_backend(gpu_backend)
        if rapl_backend is not None:
            self.add_rapl_backend(rapl_backend)
        # dry-run: the intended settings, in memory only
        self._dry_gpu: dict[int, Setting] = {}
        self._dry_gpu_owner: dict[int, str] = {}
        self._dry_cpu: dict[str, tuple[float, str]] = {}  # zone rel path -> (W, owner)
        if self._state.gpus or self._state.cpus:
            log.info(
                "saved settings from an earlier run in %s: %d GPU(s), %d RAPL zone(s)",
                self.state_file.path,
                len(self._state.gpus),
                len(self._state.cpus),
            )

    def __repr__(self) -> str:
        return f"Controller({str(self.state_file.state_dir)!r}, dry_run={self.dry_run})"

    @property
    def state_path(self) -> Path:
        return self.state_file.path

    # ---- backends (restore.py adds one per kind recorded in the file)

    def add_gpu_backend(self, backend: GpuBackend) -> None:
        self._gpu_backends[backend_key(backend.kind, backend.sim_dir)] = backend

    def gpu_backend_unavailable(self, key: str, why: str) -> None:
        """Record why the backend for ``key`` could not be opened (restore reports it)."""
        self._gpu_unavailable[key] = why

    def add_rapl_backend(self, backend: RaplBackend) -> None:
        self._rapl_backends[backend.key] = backend

    def rapl_backend_unavailable(self, sysfs_root: str, why: str) -> None:
        self._rapl_unavailable[str(Path(sysfs_root).resolve())] = why

    def _primary_gpu(self) -> GpuBackend:
        if self.gpu_backend is None:
            raise ActuatorError("no GPU backend: this greend has no NVML and no --sim GPUs")
        return self.gpu_backend

    def _primary_rapl(self) -> RaplBackend:
        if self.rapl_backend is None:
            raise ActuatorError("no RAPL backend: this greend has no powercap sysfs to write")
        return self.rapl_backend

    # ---- state

    def _save(self) -> None:
        if not self.dry_run:
            self.state_file.save(self._state)

    def _gpu_entry(self, index: int) -> GpuEntry | None:
        """The saved entry of the GPU at ``index`` now, matched by its UUID where the
        backend knows it (from enumeration, no driver call): an entry whose GPU came
        back at another index follows it. Called with the state lock held."""
        if self.gpu_backend is None:
            return None
        key = backend_key(self.gpu_backend.kind, self.gpu_backend.sim_dir)
        uuid = self.gpu_backend.known_uuid(index)
        for e in self._state.gpus:
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

    def _acquire_gpu(self, backend: GpuBackend, index: int, wait_s: float | None = None) -> threading.RLock:
        """Take GPU ``index``'s own lock (its driver calls, one operation at a time),
        waiting for it at most ``wait_s`` (default :func:`gpu_lock_wait_s`);
        :class:`KnobError` past that. The caller releases it."""
        key = (backend_key(backend.kind, backend.sim_dir), index)
        with self._lock:
            lock = self._gpu_locks.setdefault(key, threading.RLock())
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
    def _gpu_guard(self, backend: GpuBackend, index: int) -> Iterator[None]:
        """:meth:`_acquire_gpu` for a ``with`` block."""
        lock = self._acquire_gpu(backend, index)
        try:
            yield
        finally:
            lock.release()

    def _cpu_entry(self, rapl: RaplBackend, rel_path: str) -> CpuEntry | None:
        for e in self._state.cpus:
            if str(Path(e.sysfs_root).resolve()) == rapl.key and e.zone_path == rel_path:
                return e
        return None

    def _drop_empty(self) -> None:
        self._state.gpus = [g for g in self._state.gpus if g.knobs]
        self._state.cpus = [c for c in self._state.cpus if c.constraints]

    # ---- GPUs

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

    def apply_gpu(self, index: int, setting: Setting, owner: str, keep: Iterable[str] = ()) -> Setting:
        """Put ``setting`` in force on GPU ``index`` for ``owner`` (a job id or "node").

        Returns the setting in force (snapped clock, clamped limit). A None field
        restores that knob to its original, unless the knob is in ``keep``: then it is
        left as it is, with its owner (an admin's cap under a policy's other knob).
        Raises :class:`KnobError` (after trying both knobs) when a knob could not be
        set, ``StateError`` when the original could not be saved (nothing is written then).
        """
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
        backend = self._primary_gpu()
        with self._gpu_guard(backend, index):
            lowest: int | None = None
            clock: int | None = None
            if setting.clock_cap_mhz is not None:
                clock, lowest = self._snap_clock(backend, index, int(setting.clock_cap_mhz))
            power = None
            if setting.power_limit_w is not None:
                power = self._clamp_power(backend, index, float(setting.power_limit_w))
            keep = frozenset(keep)
            if self.dry_run:
                with self._lock:
                    prev = self._dry_gpu.get(index, UNCAPPED)
                    target = Setting(
                        prev.clock_cap_mhz if CLOCK_KNOB in keep else clock,
                        prev.power_limit_w if POWER_KNOB in keep else power,
                    )
                    if prev != target or self._dry_gpu_owner.get(index) != owner:
                        log.info(
                            "dry-run: would set gpu%d clock cap %s, power limit %s (owner %s)",
                            index,
                            _setting_text(clock, "MHz"),
                            _setting_text(power, "W"),
                            owner,
                        )
                    if target.uncapped:
                        self._dry_gpu.pop(index, None)
                        self._dry_gpu_owner.pop(index, None)
                    else:
                        self._dry_gpu[index] = target
                        self._dry_gpu_owner[index] = owner
                    return target
            errors: list[GreendError] = []
            for knob, value in ((CLOCK_KNOB, clock), (POWER_KNOB, power)):
                if knob in keep:
                    continue
                try:
                    self._apply_gpu_knob(backend, index, knob, value, owner, lowest)
                except (ActuatorError, StateError) as e:
                    errors.append(e)
            if errors:
                for extra in errors[1:]:
                    log.error("%s", extra)
                raise errors[0]
            return self.current(index)

    def _apply_gpu_knob(
        self, backend: GpuBackend, index: int, knob: str, value: float | None, owner: str, lowest: int | None
    ) -> None:
        """One knob of one GPU; called with the GPU's own lock held. Driver calls run
        without the state lock, which is taken for each change of the state."""
        with self._lock:
            entry = self._gpu_entry(index)
            ks = entry.knobs.get(knob) if entry is not None else None
            dev = entry.device if entry is not None else f"gpu{index}"
        if value is None:
            if entry is None or ks is None:
                return  # greend never set it: nothing to restore
            self._restore_gpu_knob(backend, index, entry, knob, ks)
            with self._lock:
                entry.knobs.pop(knob, None)
                self._drop_empty()
                self._save()
            return
        current: float | None = None
        if knob == POWER_KNOB:
            current = guarded(dev, knob, "read the power limit", lambda: backend.power_limit_w(index))
        if ks is None:
            uuid = entry.uuid if entry is not None else guarded(dev, knob, "read the UUID", lambda: backend.uuid(index))
            with self._lock:
                if entry is None:
                    entry = GpuEntry(backend=backend.kind, sim_dir=backend.sim_dir, uuid=uuid, index=index)
                    self._state.gpus.append(entry)
                    dev = entry.device
                ks = KnobState(
                    original=current if knob == POWER_KNOB else None, set=None, owner=owner, updated_at=time.time()
                )
                entry.knobs[knob] = ks
                try:
                    self._save()  # the original is on disk BEFORE the first write
                except StateError:
                    del entry.knobs[knob]
                    self._drop_empty()
                    raise
            log.info(
                "%s %s: saved original %s before the first write",
                dev,
                knob,
                _setting_text(ks.original, "MHz" if knob == CLOCK_KNOB else "W"),
            )
        if knob == CLOCK_KNOB:
            in_force = ks.set == value
        else:
            assert current is not None
            in_force = w_to_mw(current) == w_to_mw(float(value))
        if in_force:
            if ks.set != value or ks.owner != owner:
                with self._lock:
                    ks.set, ks.owner, ks.updated_at = value, owner, time.time()
                    self._save()
            return
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
                dev, knob, f"set the power limit to {value:g} W", lambda: backend.set_power_limit_w(index, float(value))
            )
            log.info("%s: power limit %g -> %g W (owner %s)", dev, current, value, owner)
        with self._lock:
            ks.set, ks.owner, ks.updated_at = value, owner, time.time()
            self._save()

    def _restore_gpu_knob(self, backend: GpuBackend, index: int, entry: GpuEntry, knob: str, ks: KnobState) -> str:
        """Put one knob back to its original; returns a line for the report."""
        dev = f"gpu{index} ({entry.uuid})"
        if knob == CLOCK_KNOB and ks.set is None:
            # greend's own lock never took (its first write failed): whatever lock the
            # GPU has was made outside greend and cannot be read back; leave it.
            log.info("%s: greend never locked the clocks; any lock there is not greend's and stays", dev)
            return f"{dev} {knob}: left as it is (greend's lock never took)"
        if knob == CLOCK_KNOB:
            guarded(dev, knob, "reset the locked clocks", lambda: backend.reset_locked_clocks(index))
            log.info("%s: locked clocks reset (unlocked, as before greend)", dev)
            return f"{dev} {knob}: unlocked"
        original = ks.original
        assert original is not None
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

    def _restore_gpu_entry(self, entry: GpuEntry, knobs: Iterable[str], report: RestoreReport) -> None:
        """Restore the named knobs of one entry; failures go to ``report`` and stay."""
        wanted = set(knobs)
        knobs = [k for k in GPU_KNOBS if k in wanted and k in entry.knobs]
        if not knobs:
            return
        backend = self._gpu_backends.get(entry.backend_key)
        if backend is None:
            why = self._gpu_unavailable.get(entry.backend_key) or (
                f"it was set through the {entry.backend} backend"
                + (f" (sim dir {entry.sim_dir})" if entry.sim_dir else "")
                + ", which this greend does not drive; run "
                f"`greend restore --state-dir {self.state_file.state_dir}`"
            )
            for k in knobs:
                report.failed.append(RestoreFailure(entry.device, k, f"cannot restore: {why}"))
            return
        try:
            index = backend.index_of_uuid(entry.uuid)
        except (ProbeError, ActuatorError) as e:
            err = knob_error(entry.device, "/".join(knobs), "find the GPU by UUID", e)
            for k in knobs:
                report.failed.append(RestoreFailure(entry.device, k, str(err)))
            return
        if index is None:
            for k in knobs:
                report.failed.append(
                    RestoreFailure(
                        entry.device,
                        k,
                        f"no GPU with UUID {entry.uuid} on this node now (removed, or another node's "
                        f"or sim dir's state?); its original stays in {self.state_file.path}",
                    )
                )
            return
        try:
            lock = self._acquire_gpu(backend, index, RESTORE_WAIT_S)
        except KnobError as e:
            for k in knobs:
                report.failed.append(RestoreFailure(entry.device, k, f"not restored: {e}; it stays saved"))
            return
        try:
            with self._lock:
                if index != entry.index:
                    log.info("%s is gpu%d now", entry.device, index)
                    entry.index = index
                todo = [(k, entry.knobs[k]) for k in knobs if k in entry.knobs]
            for k, ks in todo:
                try:
                    line = self._restore_gpu_knob(backend, index, entry, k, ks)
                except GreendError as e:
                    log.error("restore: %s", e)
                    report.failed.append(RestoreFailure(entry.device, k, str(e)))
                else:
                    with self._lock:
                        if entry.knobs.get(k) is ks:
                            del entry.knobs[k]
                    report.restored.append(line)
        finally:
            lock.release()

    def restore_gpu(self, index: int) -> RestoreReport:
        """Both knobs of GPU ``index`` back to their originals."""
        report = RestoreReport(dry_run=self.dry_run)
        if self.dry_run:
            with self._lock:
                if self._dry_gpu.pop(index, None) is not None:
                    self._dry_gpu_owner.pop(index, None)
                    report.restored.append(f"gpu{index}")
                    log.info("dry-run: would restore gpu%d", index)
            return report
        backend = self._primary_gpu()
        with self._gpu_guard(backend, index):
            with self._lock:
                entry = self._gpu_entry(index)
            if entry is not None:
                self._restore_gpu_entry(entry, GPU_KNOBS, report)
        with self._lock:
            self._finish(report)
        return report

    # ---- RAPL

    def restore_cpu(self, zone_path: str | Path) -> RestoreReport:
        """One RAPL zone's saved constraints back, whoever set them."""
        with self._lock:
            report = RestoreReport(dry_run=self.dry_run)
            rapl = self._primary_rapl()
            ref = guarded(str(zone_path), POWER_KNOB, "find the zone", lambda: rapl.resolve(zone_path))
            if self.dry_run:
                if self._dry_cpu.pop(ref.rel_path, None) is not None:
                    report.restored.append(ref.rel_path)
                    log.info("dry-run: would restore %s", ref.device)
                return report
            entry = self._cpu_entry(rapl, ref.rel_path)
            if entry is not None:
                self._restore_cpu_entry(entry, report)
            self._finish(report)
            return report

    def apply_cpu_limit(self, zone_path: str | Path, watts: float | None, owner: str) -> float | None:
        """Limit a RAPL zone ("intel-rapl:0", or a path under the sysfs root) to ``watts``.

        Long term is set to ``watts`` and short term to ``min(watts, its original)``,
        each within its ``max_power_uw``. None restores the zone's originals.
        Returns the long-term limit now in force (W), None when restored.
        """
        if watts is not None and not (math.isfinite(watts) and watts > 0):
            raise KnobError(
                f"{zone_path} {POWER_KNOB}: {watts} W is not a power limit",
                device=str(zone_path),
                knob=POWER_KNOB,
                reason="invalid",
            )
        with self._lock:
            rapl = self._primary_rapl()
            ref = guarded(str(zone_path), POWER_KNOB, "find the zone", lambda: rapl.resolve(zone_path))
            dev = ref.device
            if self.dry_run:
                if watts is None:
                    if self._dry_cpu.pop(ref.rel_path, None) is not None:
                        log.info("dry-run: would restore %s", dev)
                    return None
                if self._dry_cpu.get(ref.rel_path) != (watts, owner):
                    log.info("dry-run: would set %s power limit %g W (owner %s)", dev, watts, owner)
                self._dry_cpu[ref.rel_path] = (float(watts), owner)
                return float(watts)
            entry = self._cpu_entry(rapl, ref.rel_path)
            if watts is None:
                if entry is not None:
                    report = RestoreReport()
                    self._restore_cpu_entry(entry, report)
                    self._finish(report)
                    if report.failed:
                        raise KnobError(report.failed[0].message, device=dev, knob=POWER_KNOB, reason="failed")
                return None
            cons = guarded(dev, POWER_KNOB, "list the constraints", lambda: rapl.constraints(ref))
            if not cons:
                raise KnobError(
                    f"{dev} {POWER_KNOB}: the zone has no long_term or short_term constraint to limit",
                    device=dev,
                    knob=POWER_KNOB,
                    reason="not_supported",
                )
            if entry is None:
                saved = [
                    CpuConstraintState(
                        c.index,
                        c.name,
                        guarded(
                            dev,
                            POWER_KNOB,
                            f"read constraint {c.index}",
                            partial(rapl.read_limit_uw, ref, c.index),
                        ),
                    )
                    for c in cons
                ]
                entry = CpuEntry(
                    sysfs_root=str(rapl.sysfs_root),
                    zone_path=ref.rel_path,
                    zone_id=ref.zone_id,
                    name=ref.name,
                    owner=owner,
                    updated_at=time.time(),
                    constraints=saved,
                )
                self._state.cpus.append(entry)
                try:
                    self._save()  # originals on disk BEFORE the first write
                except StateError:
                    self._state.cpus.remove(entry)
                    raise
                log.info(
                    "%s: saved original limits %s uW before the first write",
                    dev,
                    ", ".join(f"{c.name}={c.original_uw}" for c in saved),
                )
            by_index = {c.index: c for c in entry.constraints}
            long_w: float | None = None
            for c in cons:
                st = by_index.get(c.index)
                if st is None:  # a constraint the first write did not see
                    orig = guarded(
                        dev,
                        POWER_KNOB,
                        f"read constraint {c.index}",
                        partial(rapl.read_limit_uw, ref, c.index),
                    )
                    st = CpuConstraintState(c.index, c.name, orig)
                    entry.constraints.append(st)
                    self._save()
                target = w_to_uw(watts)
                if c.name == "short_term" and st.original_uw > 0:
                    target = min(target, st.original_uw)
                in_force = guarded(
                    dev,
                    POWER_KNOB,
                    f"set constraint {c.index} ({c.name})",
                    partial(rapl.write_limit_uw, ref, c.index, target),
                )
                st.set_uw = in_force
                if c.name == "long_term" or long_w is None:
                    long_w = uw_to_w(in_force)
            entry.set_w, entry.owner, entry.updated_at = long_w, owner, time.time()
            self._save()
            return long_w

    def _restore_cpu_entry(self, entry: CpuEntry, report: RestoreReport) -> None:
        key = str(Path(entry.sysfs_root).resolve())
        rapl = self._rapl_backends.get(key)
        if rapl is None:
            why = self._rapl_unavailable.get(key) or (
                f"it was set under the sysfs root {entry.sysfs_root}, which this greend does "
                f"not drive; run `greend restore --state-dir {self.state_file.state_dir}`"
            )
            report.failed.append(RestoreFailure(entry.device, POWER_KNOB, f"cannot restore: {why}"))
            return
        try:
            ref = rapl.resolve(entry.zone_path)
        except GreendError as e:
            report.failed.append(RestoreFailure(entry.device, POWER_KNOB, f"cannot restore: {e}"))
            return
        left: list[CpuConstraintState] = []
        for c in entry.constraints:
            try:
                guarded(
                    entry.device,
                    POWER_KNOB,
                    f"restore constraint {c.index} to {c.original_uw} uW",
                    partial(rapl.restore_limit_uw, ref, c.index, c.original_uw),
                )
            except GreendError as e:
                log.error("restore: %s", e)
                report.failed.append(RestoreFailure(entry.device, f"constraint_{c.index}", str(e)))
                left.append(c)
            else:
                report.restored.append(f"{entry.device} constraint_{c.index} ({c.name}): {c.original_uw} uW")
        entry.constraints = left

    # ---- restore everything / by owner

    def _finish(self, report: RestoreReport) -> None:
        self._drop_empty()
        try:
            self._save()
        except StateError as e:
            report.failed.append(RestoreFailure(str(self.state_file.path), "state", str(e)))

    def restore_owner(self, owner: str) -> RestoreReport:
        """Everything ``owner`` set (a job that ended, a client that stopped answering)."""
        report = RestoreReport(dry_run=self.dry_run)
        if self.dry_run:
            with self._lock:
                for i in [i for i, o in self._dry_gpu_owner.items() if o == owner]:
                    self._dry_gpu.pop(i, None)
                    self._dry_gpu_owner.pop(i, None)
                    report.restored.append(f"gpu{i}")
                for z in [z for z, (_, o) in self._dry_cpu.items() if o == owner]:
                    del self._dry_cpu[z]
                    report.restored.append(z)
                if report.restored:
                    log.info("dry-run: would restore %s for %s", ", ".join(report.restored), owner)
            return report
        self._restore_each(
            report, lambda e: [k for k, ks in e.knobs.items() if ks.owner == owner], lambda cpu: cpu.owner == owner
        )
        with self._lock:
            self._finish(report)
        return report

    def _restore_each(
        self, report: RestoreReport, gpu_knobs: Callable[[Any], list[str]], cpu_wanted: Callable[[Any], bool]
    ) -> None:
        """Restore the chosen knobs of every saved device, each on its own: an
        unexpected error on one device is reported and never stops the others.
        GPUs are restored without the state lock (each under its own GPU's lock);
        RAPL zones (sysfs writes) under it."""
        with self._lock:
            gpus = [(e, gpu_knobs(e)) for e in self._state.gpus]
        for entry, knobs in gpus:
            try:
                self._restore_gpu_entry(entry, knobs, report)
            except Exception as e:
                log.exception("restore of %s failed", entry.device)
                report.failed += [
                    RestoreFailure(entry.device, k, f"{type(e).__name__}: {e}") for k in knobs if k in entry.knobs
                ]
        with self._lock:
            for cpu in list(self._state.cpus):
                if not cpu_wanted(cpu):
                    continue
                try:
                    self._restore_cpu_entry(cpu, report)
                except Exception as e:
                    log.exception("restore of %s failed", cpu.device)
                    report.failed.append(RestoreFailure(cpu.device, POWER_KNOB, f"{type(e).__name__}: {e}"))

    def restore_all(self) -> RestoreReport:
        """Every saved device back to its original, each on its own: a failing device
        is reported and kept in the state file; the file is removed once empty."""
        report = RestoreReport(dry_run=self.dry_run)
        if self.dry_run:
            with self._lock:
                report.restored += [f"gpu{i}" for i in sorted(self._dry_gpu)] + sorted(self._dry_cpu)
                if report.restored:
                    log.info("dry-run: would restore %s", ", ".join(report.restored))
                self._dry_gpu.clear()
                self._dry_gpu_owner.clear()
                self._dry_cpu.clear()
            return report
        self._restore_each(report, lambda e: list(GPU_KNOBS), lambda cpu: True)
        with self._lock:
            self._finish(report)
        if report.failed:
            log.error(
                "restore: %d knob(s) could not be restored and stay in %s", len(report.failed), self.state_file.path
            )
        return report

    # ---- what is in force

    def current(self, index: int) -> Setting:
        """What greend has in force on GPU ``index`` (intended, under dry-run);
        None fields: greend has not changed that knob."""
        with self._lock:
            if self.dry_run:
                return self._dry_gpu.get(index, UNCAPPED)
            entry = self._gpu_entry(index)
            if entry is None:
                return UNCAPPED
            clock = entry.knobs.get(CLOCK_KNOB)
            power = entry.knobs.get(POWER_KNOB)
            return Setting(
                clock_cap_mhz=None if clock is None or clock.set is None else int(clock.set),
                power_limit_w=None if power is None or power.set is None else float(power.set),
            )

    def clock_cap_mhz(self, index: int) -> int | None:
        """For ``NvmlProbe(cap_lookup=...)``: the locked max clock greend set."""
        return self.current(index).clock_cap_mhz

    def current_cpu_limit_w(self, zone_path: str | Path) -> float | None:
        """The long-term RAPL limit greend has in force on a zone, or None."""
        with self._lock:
            rapl = self._primary_rapl()
            rel = rapl.resolve(zone_path).rel_path
            if self.dry_run:
                entry_w = self._dry_cpu.get(rel)
                return None if entry_w is None else entry_w[0]
            entry = self._cpu_entry(rapl, rel)
            return None if entry is None else entry.set_w

    def owners(self) -> dict[str, list[str]]:
        """Owner -> the knobs it holds ("gpu0.clock_cap_mhz", "package-0 (intel-rapl:0)")."""
        with self._lock:
            out: dict[str, list[str]] = {}
            if self.dry_run:
                for i, o in self._dry_gpu_owner.items():
                    s = self._dry_gpu[i]
                    if s.clock_cap_mhz is not None:
                        out.setdefault(o, []).append(f"gpu{i}.{CLOCK_KNOB}")
                    if s.power_limit_w is not None:
                        out.setdefault(o, []).append(f"gpu{i}.{POWER_KNOB}")
                for z, (_, o) in self._dry_cpu.items():
                    out.setdefault(o, []).append(z)
            else:
                for g in self._state.gpus:
                    for k, ks in g.knobs.items():
                        out.setdefault(ks.owner, []).append(f"gpu{g.index}.{k}")
                for c in self._state.cpus:
                    out.setdefault(c.owner, []).append(c.device)
            return {o: sorted(v) for o, v in sorted(out.items())}

    def snapshot(self) -> dict[str, Any]:
        """JSON for ``greenctl status``: what greend holds (or would hold, dry-run)."""
        with self._lock:
            gpus: dict[str, Any] = {}
            if self.dry_run:
                for i, s in sorted(self._dry_gpu.items()):
                    gpus[str(i)] = {
                        "clock_cap_mhz": s.clock_cap_mhz,
                        "power_limit_w": s.power_limit_w,
                        "owner": self._dry_gpu_owner.get(i),
                    }
                cpus = {z: {"power_limit_w": w, "owner": o} for z, (w, o) in sorted(self._dry_cpu.items())}
            else:
                for g in self._state.gpus:
                    gpus[str(g.index)] = {
                        "uuid": g.uuid,
                        **{k: ks.set for k, ks in g.knobs.items()},
                        "original": {k: ks.original for k, ks in g.knobs.items()},
                        "owners": {k: ks.owner for k, ks in g.knobs.items()},
                    }
                cpus = {
                    c.zone_id: {
                        "name": c.name,
                        "power_limit_w": c.set_w,
                        "owner": c.owner,
                        "original_uw": {str(x.index): x.original_uw for x in c.constraints},
                    }
                    for c in self._state.cpus
                }
            return {
                "dry_run": self.dry_run,
                "state_file": str(self.state_file.path),
                "gpus": gpus,
                # knobs NVML refused (NO_PERMISSION, NOT_SUPPORTED, MIG): not tried again
                "refused": {str(i): r for i, r in getattr(self.gpu_backend, "refused", {}).items()},
                "cpus": cpus,
                "owners": self.owners(),
            }

    def close(self) -> None:
        """Close backends that opened their own probes (restore's)."""
        for b in self._gpu_backends.values():
            if isinstance(b, _Closable):
                try:
                    b.close()
                except Exception as e:
                    log.debug("closing %r: %s", b, e)
