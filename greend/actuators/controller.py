"""The Controller: the knobs greend turns, saved before the first write and restored.

Knobs: a GPU's locked SM clocks and power limit (:mod:`greend.actuators.gpu`) and a
RAPL zone's power limit, long and short term (:mod:`greend.actuators.rapl`).

Layers::

    Controller   what the daemon, the policies and greenctl call; restore per
      |          owner and of everything, in order (GPUs, then RAPL zones)
      +-- GpuKnobs       snapping, clamping, read-before-write, save-before-first-
      |    |             write and dry-run for the GPU knobs (_gpu_knobs.py)
      |    +-- GpuBackend    (protocol) NvmlGpuBackend over the NVML device layer it
      |                      shares with the NVML probe: real NVML, or the simulator's FakeNvml
      +-- RaplKnobs      the same for RAPL zones (_rapl_knobs.py)
      |    +-- RaplBackend   powercap sysfs under an injected root
      +-- SettingsBook   who holds what: the saved originals, the dry-run
           |             intentions, the owners, the state lock (_book.py)
           +-- StateFile     <state_dir>/saved-settings.json (greend.actuators.state)

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
- Restore puts each device in its own ``try``, and each GPU on a thread of its
  own, found by the index and handle greend holds (no node-wide lookup): one lost
  or hung GPU or a missing permission is reported and never stops the others; entries that failed stay
  in the state file (a later ``greend restore`` retries), the restored ones are
  dropped, and the file is removed once empty.
- Dry-run logs "would set ..." and records the intended setting in memory (for
  ``greenctl status``) but touches no device and writes no state file.
- No lock is held across a call into the driver that other GPUs or readers need:
  the state lock (the book's ``lock``: the saved settings, the dry-run maps, the file) is
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
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from greend.actuators._book import SettingsBook
from greend.actuators._gpu_knobs import GpuKnobs, gpu_lock_wait_s, restore_wait_s
from greend.actuators._rapl_knobs import RaplKnobs
from greend.actuators.gpu import GpuBackend
from greend.actuators.rapl import RaplBackend
from greend.actuators.report import RestoreFailure, RestoreReport
from greend.actuators.state import GPU_KNOBS, POWER_KNOB, CpuEntry, GpuEntry, StateFile
from greend.settings import Setting

# gpu_lock_wait_s is defined in greend.actuators._gpu_knobs; it is named here too.
__all__ = ["Controller", "gpu_lock_wait_s"]

log = logging.getLogger(__name__)


@runtime_checkable
class _Closable(Protocol):
    def close(self) -> None: ...


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
        state_dir: str | os.PathLike[str],
        gpu_backend: GpuBackend | None = None,
        rapl_backend: RaplBackend | None = None,
        dry_run: bool = False,
    ) -> None:
        self._book = SettingsBook(state_dir, dry_run)
        self.state_file: StateFile = self._book.state_file
        self.gpu_backend = gpu_backend
        self.rapl_backend = rapl_backend
        self._gpus = GpuKnobs(self._book, gpu_backend)
        self._rapl = RaplKnobs(self._book, rapl_backend)
        state = self._book.state
        if state.gpus or state.cpus:
            log.info(
                "saved settings from an earlier run in %s: %d GPU(s), %d RAPL zone(s)",
                self.state_file.path,
                len(state.gpus),
                len(state.cpus),
            )

    def __repr__(self) -> str:
        return f"Controller({str(self.state_file.state_dir)!r}, dry_run={self.dry_run})"

    @property
    def dry_run(self) -> bool:
        return self._book.dry_run

    @property
    def state_path(self) -> Path:
        return self.state_file.path

    # ---- backends (restore.py adds one per kind recorded in the file)

    def add_gpu_backend(self, backend: GpuBackend) -> None:
        self._gpus.add_backend(backend)

    def set_gpu_backend(self, backend: GpuBackend) -> None:
        """Drive this node's GPUs through ``backend`` from now on (the daemon opens NVML
        in the background and hands its backend over once it is open)."""
        self._gpus.add_backend(backend)
        self._gpus.primary = backend
        self.gpu_backend = backend

    def leftover_gpu_keys(self) -> set[str]:
        """The backends (``"nvml"``, ``"sim:<dir>"``) of the GPUs the saved-settings file holds."""
        with self._book.lock:
            return {e.backend_key for e in self._book.state.gpus}

    def restore_saved(self, gpu_keys: Iterable[str], cpus: bool) -> RestoreReport:
        """Restore what the file holds for the GPUs of the backends ``gpu_keys`` (and every
        RAPL zone when ``cpus``): what an earlier run left (a crash, a SIGKILL), restored
        at start through the backends this greend holds, each device on its own."""
        keys = set(gpu_keys)
        book = self._book
        report = RestoreReport(dry_run=book.dry_run)
        if book.dry_run:
            return report
        self._restore_each(report, lambda e: list(GPU_KNOBS) if e.backend_key in keys else [], lambda cpu: cpus)
        with book.lock:
            book.finish(report)
        return report

    def gpu_backend_unavailable(self, key: str, why: str, reason: str = "failed") -> None:
        """Record why the backend for ``key`` could not be opened (restore reports it);
        ``reason``: "unresponsive" where NVML did not answer in time."""
        self._gpus.backend_unavailable(key, why, reason)

    def add_rapl_backend(self, backend: RaplBackend) -> None:
        self._rapl.add_backend(backend)

    def rapl_backend_unavailable(self, sysfs_root: str, why: str) -> None:
        self._rapl.backend_unavailable(sysfs_root, why)

    # ---- GPUs

    def apply_gpu(self, index: int, setting: Setting, owner: str, keep: Iterable[str] = ()) -> Setting:
        """Put ``setting`` in force on GPU ``index`` for ``owner`` (a job id or "node").

        Returns the setting in force (snapped clock, clamped limit). A None field
        restores that knob to its original, unless the knob is in ``keep``: then it is
        left as it is, with its owner (an admin's cap under a policy's other knob).
        Raises :class:`KnobError` (after trying both knobs) when a knob could not be
        set, ``StateError`` when the original could not be saved (nothing is written then).
        """
        return self._gpus.apply(index, setting, owner, keep)

    def restore_gpu(self, index: int) -> RestoreReport:
        """Both knobs of GPU ``index`` back to their originals."""
        return self._gpus.restore(index)

    # ---- RAPL

    def apply_cpu_limit(self, zone_path: str | Path, watts: float | None, owner: str) -> float | None:
        """Limit a RAPL zone ("intel-rapl:0", or a path under the sysfs root) to ``watts``.

        Long term is set to ``watts`` and short term to ``min(watts, its original)``,
        each within its ``max_power_uw``. None restores the zone's originals.
        Returns the long-term limit now in force (W), None when restored.
        """
        return self._rapl.apply(zone_path, watts, owner)

    def restore_cpu(self, zone_path: str | Path) -> RestoreReport:
        """One RAPL zone's saved constraints back, whoever set them."""
        return self._rapl.restore(zone_path)

    # ---- restore everything / by owner

    def restore_owner(self, owner: str, gpus: Iterable[int] | None = None) -> RestoreReport:
        """Everything ``owner`` set (a job that ended, a client that stopped answering);
        ``gpus``: only on these GPUs (and no RAPL zone), e.g. GPUs a job no longer steers."""
        book = self._book
        report = RestoreReport(dry_run=book.dry_run)
        only = None if gpus is None else set(gpus)
        if book.dry_run:
            with book.lock:
                for i in [i for i, o in book.dry_gpu_owner.items() if o == owner and (only is None or i in only)]:
                    book.dry_gpu.pop(i, None)
                    book.dry_gpu_owner.pop(i, None)
                    report.restored.append(f"gpu{i}")
                for z in [z for z, (_, o) in book.dry_cpu.items() if o == owner and only is None]:
                    del book.dry_cpu[z]
                    report.restored.append(z)
                if report.restored:
                    log.info("dry-run: would restore %s for %s", ", ".join(report.restored), owner)
            return report
        self._restore_each(
            report,
            lambda e: [k for k, ks in e.knobs.items() if ks.owner == owner] if only is None or e.index in only else [],
            lambda cpu: cpu.owner == owner and only is None,
        )
        with book.lock:
            book.finish(report)
        return report

    def _restore_each(
        self,
        report: RestoreReport,
        gpu_knobs: Callable[[GpuEntry], list[str]],
        cpu_wanted: Callable[[CpuEntry], bool],
    ) -> None:
        """Restore the chosen knobs of every saved device, each on its own: an
        unexpected error on one device is reported and never stops the others.
        GPUs are restored without the state lock (each under its own GPU's lock);
        RAPL zones (sysfs writes) under it."""
        book = self._book
        with book.lock:
            gpus = [(e, knobs) for e in book.state.gpus if (knobs := gpu_knobs(e))]
        # Each GPU on a thread of its own: a GPU whose driver calls hang holds only its
        # own restore (bounded by the call deadline), never another GPU's.
        parts = [RestoreReport(dry_run=book.dry_run) for _ in gpus]

        def one(entry: GpuEntry, knobs: list[str], part: RestoreReport) -> None:
            try:
                self._gpus.restore_entry(entry, knobs, part)
            except Exception as e:
                log.exception("restore of %s failed", entry.device)
                part.failed += [
                    RestoreFailure(entry.device, k, f"{type(e).__name__}: {e}") for k in knobs if k in entry.knobs
                ]

        threads = [
            threading.Thread(target=one, args=(e, k, part), name=f"restore-{e.device}", daemon=True)
            for (e, k), part in zip(gpus, parts, strict=True)
        ]
        for t in threads:
            t.start()
        end = time.monotonic() + restore_wait_s(self._gpus.deadline_s())
        for (entry, knobs), t, part in zip(gpus, threads, parts, strict=True):
            t.join(max(0.0, end - time.monotonic()))
            if t.is_alive():
                report.failed += [
                    RestoreFailure(
                        entry.device, k, "not restored: the GPU did not answer in time; it stays saved", "unresponsive"
                    )
                    for k in knobs
                ]
            else:
                report.extend(part)
        with book.lock:
            for cpu in list(book.state.cpus):
                if not cpu_wanted(cpu):
                    continue
                try:
                    self._rapl.restore_entry(cpu, report)
                except Exception as e:
                    log.exception("restore of %s failed", cpu.device)
                    report.failed.append(RestoreFailure(cpu.device, POWER_KNOB, f"{type(e).__name__}: {e}"))

    def restore_all(self) -> RestoreReport:
        """Every saved device back to its original, each on its own: a failing device
        is reported and kept in the state file; the file is removed once empty."""
        book = self._book
        report = RestoreReport(dry_run=book.dry_run)
        if book.dry_run:
            with book.lock:
                report.restored += [f"gpu{i}" for i in sorted(book.dry_gpu)] + sorted(book.dry_cpu)
                if report.restored:
                    log.info("dry-run: would restore %s", ", ".join(report.restored))
                book.dry_gpu.clear()
                book.dry_gpu_owner.clear()
                book.dry_cpu.clear()
            return report
        self._restore_each(report, lambda e: list(GPU_KNOBS), lambda cpu: True)
        with book.lock:
            book.finish(report)
        if report.failed:
            log.error(
                "restore: %d knob(s) could not be restored and stay in %s", len(report.failed), self.state_file.path
            )
        return report

    # ---- what is in force

    def current(self, index: int) -> Setting:
        """What greend has in force on GPU ``index`` (intended, under dry-run);
        None fields: greend has not changed that knob."""
        return self._gpus.current(index)

    def clock_cap_mhz(self, index: int) -> int | None:
        """For ``NvmlProbe(cap_lookup=...)``: the locked max clock greend set, as the GPU
        holds it (read back after the write)."""
        return self.current(index).clock_cap_mhz

    def mismatches(self, index: int) -> dict[str, dict[str, float]]:
        """Knob -> {"asked", "held"} where GPU ``index`` holds another value than asked."""
        return self._gpus.mismatches(index)

    def verify(self, index: int) -> bool:
        """Read back a setting GPU ``index`` could not show when it was written (idle,
        or held below it by power or heat); True when what is in force changed."""
        return self._gpus.verify(index)

    def reassert(self, index: int) -> list[str]:
        """Write greend's settings on GPU ``index`` again if the GPU was found again since
        (after a loss, a reset or a driver reload, which drop them); the knobs written."""
        return self._gpus.reassert(index)

    def unverified(self, index: int) -> list[str]:
        """Knobs of GPU ``index`` greend wrote whose value the GPU has not shown yet."""
        return self._gpus.unverified(index)

    def refused_knobs(self, index: int) -> dict[str, dict[str, str]]:
        """Knob -> {"reason", "message"} for the knobs GPU ``index`` refused (NOT_SUPPORTED,
        MIG mode, NO_PERMISSION): recorded once, never tried again."""
        backend = self.gpu_backend
        return backend.refused_knobs(index) if backend is not None else {}

    def current_cpu_limit_w(self, zone_path: str | Path) -> float | None:
        """The long-term RAPL limit greend has in force on a zone, or None."""
        return self._rapl.current_w(zone_path)

    def owners(self, in_force: bool = False) -> dict[str, list[str]]:
        """Owner -> the knobs it holds ("gpu0.clock_cap_mhz", "package-0 (intel-rapl:0)");
        ``in_force``: only those a write of greend's took or is making."""
        return self._book.owners(in_force)

    def snapshot(self) -> dict[str, Any]:
        """JSON for ``greenctl status``: what greend holds (or would hold, dry-run)."""
        return self._book.snapshot(getattr(self.gpu_backend, "refused", {}))

    def close(self) -> None:
        """Close backends that opened their own probes (restore's)."""
        for b in self._gpus.backends.values():
            if isinstance(b, _Closable):
                try:
                    b.close()
                except Exception as e:
                    log.debug("closing %r: %s", b, e)
