"""The RAPL knobs of the :class:`~greend.actuators.controller.Controller`: a powercap
zone's power limit, long and short term, applied and restored through a
:class:`~greend.actuators.rapl.RaplBackend`.

The long-term constraint is set to the limit and the short-term one to the lower of
the limit and its original, each within its ``max_power_uw``; the originals of every
constraint are saved in the :class:`~greend.actuators._book.SettingsBook` before
greend's first write. Sysfs writes are quick and run under the state lock.
"""

from __future__ import annotations

import logging
import math
import time
from functools import partial
from pathlib import Path

from greend.actuators._book import SettingsBook
from greend.actuators.knob_errors import guarded
from greend.actuators.rapl import RaplBackend
from greend.actuators.report import RestoreFailure, RestoreReport
from greend.actuators.state import POWER_KNOB, CpuConstraintState, CpuEntry
from greend.errors import ActuatorError, GreendError, KnobError, StateError
from greend.units import uw_to_w, w_to_uw

log = logging.getLogger(__name__)


class RaplKnobs:
    """The RAPL knobs: ``primary`` is the backend of this greend's sysfs root (None:
    no RAPL to write); :meth:`add_backend` adds one for each other root recorded in the
    state file."""

    def __init__(self, book: SettingsBook, primary: RaplBackend | None) -> None:
        self.book = book
        self.primary = primary
        self.backends: dict[str, RaplBackend] = {}
        self.unavailable: dict[str, str] = {}
        if primary is not None:
            self.add_backend(primary)

    def add_backend(self, backend: RaplBackend) -> None:
        self.backends[backend.key] = backend

    def backend_unavailable(self, sysfs_root: str, why: str) -> None:
        self.unavailable[str(Path(sysfs_root).resolve())] = why

    def _backend(self) -> RaplBackend:
        if self.primary is None:
            raise ActuatorError("no RAPL backend: this greend has no powercap sysfs to write")
        return self.primary

    def _entry(self, rapl: RaplBackend, rel_path: str) -> CpuEntry | None:
        for e in self.book.state.cpus:
            if str(Path(e.sysfs_root).resolve()) == rapl.key and e.zone_path == rel_path:
                return e
        return None

    def restore(self, zone_path: str | Path) -> RestoreReport:
        """One RAPL zone's saved constraints back, whoever set them."""
        with self.book.lock:
            report = RestoreReport(dry_run=self.book.dry_run)
            rapl = self._backend()
            ref = guarded(str(zone_path), POWER_KNOB, "find the zone", lambda: rapl.resolve(zone_path))
            if self.book.dry_run:
                if self.book.dry_cpu.pop(ref.rel_path, None) is not None:
                    report.restored.append(ref.rel_path)
                    log.info("dry-run: would restore %s", ref.device)
                return report
            entry = self._entry(rapl, ref.rel_path)
            if entry is not None:
                self.restore_entry(entry, report)
            self.book.finish(report)
            return report

    def apply(self, zone_path: str | Path, watts: float | None, owner: str) -> float | None:
        """:meth:`Controller.apply_cpu_limit <greend.actuators.controller.Controller.apply_cpu_limit>`,
        whose docstring says what it sets and returns."""
        if watts is not None and not (math.isfinite(watts) and watts > 0):
            raise KnobError(
                f"{zone_path} {POWER_KNOB}: {watts} W is not a power limit",
                device=str(zone_path),
                knob=POWER_KNOB,
                reason="invalid",
            )
        with self.book.lock:
            rapl = self._backend()
            ref = guarded(str(zone_path), POWER_KNOB, "find the zone", lambda: rapl.resolve(zone_path))
            dev = ref.device
            if self.book.dry_run:
                if watts is None:
                    if self.book.dry_cpu.pop(ref.rel_path, None) is not None:
                        log.info("dry-run: would restore %s", dev)
                    return None
                if self.book.dry_cpu.get(ref.rel_path) != (watts, owner):
                    log.info("dry-run: would set %s power limit %g W (owner %s)", dev, watts, owner)
                self.book.dry_cpu[ref.rel_path] = (float(watts), owner)
                return float(watts)
            entry = self._entry(rapl, ref.rel_path)
            if watts is None:
                if entry is not None:
                    report = RestoreReport()
                    self.restore_entry(entry, report)
                    self.book.finish(report)
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
                self.book.state.cpus.append(entry)
                try:
                    self.book.save()  # originals on disk BEFORE the first write
                except StateError:
                    self.book.state.cpus.remove(entry)
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
                    self.book.save()
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
            self.book.save()
            return long_w

    def restore_entry(self, entry: CpuEntry, report: RestoreReport) -> None:
        key = str(Path(entry.sysfs_root).resolve())
        rapl = self.backends.get(key)
        if rapl is None:
            why = self.unavailable.get(key) or (
                f"it was set under the sysfs root {entry.sysfs_root}, which this greend does "
                f"not drive; run `greend restore --state-dir {self.book.state_file.state_dir}`"
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

    def current_w(self, zone_path: str | Path) -> float | None:
        """The long-term RAPL limit greend has in force on a zone, or None."""
        with self.book.lock:
            rapl = self._backend()
            rel = rapl.resolve(zone_path).rel_path
            if self.book.dry_run:
                entry_w = self.book.dry_cpu.get(rel)
                return None if entry_w is None else entry_w[0]
            entry = self._entry(rapl, rel)
            return None if entry is None else entry.set_w
