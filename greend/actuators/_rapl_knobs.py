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
from greend.actuators.rapl import RaplBackend, RaplConstraint, RaplZoneRef
from greend.actuators.report import RestoreFailure, RestoreReport
from greend.actuators.state import POWER_KNOB, CpuConstraintState, CpuEntry
from greend.errors import ActuatorError, GreendError, KnobError, NoData, StateError
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

    def _entry(self, rapl: RaplBackend, ref: RaplZoneRef) -> CpuEntry | None:
        """The saved entry of the zone ``ref``: the one saved at its path under its name; else
        the one saved under its name elsewhere (the zones were numbered anew: a reboot, a
        module reload), which then moves to its path. An entry at its path under another
        name is another zone's."""
        mine = [e for e in self.book.state.cpus if str(Path(e.sysfs_root).resolve()) == rapl.key]
        for e in mine:
            if e.zone_path == ref.rel_path and (not e.name or ref.named(e.name)):
                return e
        named = [e for e in mine if e.name == ref.label]
        if len(named) == 1 and _find_named(rapl, ref.label, ref.zone_id) is not None:
            e = named[0]
            log.warning("%s was saved at %s and is at %s now", ref.label, e.zone_path, ref.rel_path)
            e.zone_path, e.zone_id = ref.rel_path, ref.zone_id
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
            entry = self._entry(rapl, ref)
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
            if watts is not None and rapl.disabled(ref):  # (a dry run says so too)
                raise KnobError(
                    f"{dev} {POWER_KNOB}: the zone's power limiting is off ({ref.dir / 'enabled'} reads 0: the "
                    "firmware locked it, or it was turned off); a limit written there is not enforced, so greend "
                    "sets none (write 1 to that file as root, where the platform allows it)",
                    device=dev,
                    knob=POWER_KNOB,
                    reason="not_supported",
                )
            if self.book.dry_run:
                if watts is None:
                    if self.book.dry_cpu.pop(ref.rel_path, None) is not None:
                        log.info("dry-run: would restore %s", dev)
                    return None
                if self.book.dry_cpu.get(ref.rel_path) != (watts, owner):
                    log.info("dry-run: would set %s power limit %g W (owner %s)", dev, watts, owner)
                self.book.dry_cpu[ref.rel_path] = (float(watts), owner)
                return float(watts)
            entry = self._entry(rapl, ref)
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
                    name=ref.label,
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
            written: list[tuple[CpuConstraintState, int]] = []  # (constraint, its value before this call)
            try:
                long_w = self._write_all(rapl, ref, dev, cons, entry, watts, written)
            except GreendError:
                # One constraint refused after others took: those go back, so a refusal
                # leaves the zone as it was (an admin told "refused" assumes so).
                for st, before in reversed(written):
                    try:
                        rapl.restore_limit_uw(ref, st.index, before)
                        st.set_uw = None if before == st.original_uw else before
                    except GreendError as e:
                        log.error("%s: cannot put constraint %d back to %d uW: %s", dev, st.index, before, e)
                self.book.save()
                raise
            entry.set_w, entry.owner, entry.updated_at = long_w, owner, time.time()
            self.book.save()
            return long_w

    def _write_all(
        self,
        rapl: RaplBackend,
        ref: RaplZoneRef,
        dev: str,
        cons: list[RaplConstraint],
        entry: CpuEntry,
        watts: float,
        written: list[tuple[CpuConstraintState, int]],
    ) -> float | None:
        """Every constraint of the zone to ``watts`` (short_term never above its original);
        each one written goes to ``written`` with its value before. The long-term limit in force."""
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
            before = st.set_uw if st.set_uw is not None else st.original_uw
            in_force = guarded(
                dev,
                POWER_KNOB,
                f"set constraint {c.index} ({c.name})",
                partial(rapl.write_limit_uw, ref, c.index, target),
            )
            written.append((st, before))
            st.set_uw = in_force
            if c.name == "long_term" or long_w is None:
                long_w = uw_to_w(in_force)
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
            if entry.name and not ref.named(entry.name):
                raise NoData(f"the zone at {entry.zone_path} is {ref.label} now")
        except GreendError as e:
            moved = _find_named(rapl, entry.name, entry.zone_id) if entry.name else None
            if moved is None:
                why = f"cannot restore: {e}; " + (
                    f"{entry.name} is not found by its name (or the name is not unique): put its original "
                    + ", ".join(f"constraint_{c.index}_power_limit_uw = {c.original_uw}" for c in entry.constraints)
                    + " back by hand"
                )
                report.failed.append(RestoreFailure(entry.device, POWER_KNOB, why))
                return
            log.warning("%s was saved at %s and is at %s now: restored there", entry.name, entry.zone_path,
                        moved.rel_path)  # fmt: skip
            ref = moved
            entry.zone_path, entry.zone_id = moved.rel_path, moved.zone_id
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
            entry = self._entry(rapl, rapl.resolve(zone_path))
            return None if entry is None else entry.set_w


def _zones_named(rapl: RaplBackend, name: str, like: str) -> list[RaplZoneRef]:
    """The zones under the root's class/powercap whose ``name`` is ``name``, of the control
    type of the zone id ``like`` (``intel-rapl``: never its ``intel-rapl-mmio`` duplicate)."""
    base = rapl.sysfs_root / "class" / "powercap"
    control = like.split(":", 1)[0] + ":"
    out = []
    try:
        ids = sorted(p.name for p in base.iterdir() if p.name.startswith(control))
    except OSError:
        return []
    for zid in ids:
        try:
            ref = rapl.resolve(zid)
        except GreendError:
            continue
        if ref.label == name:
            out.append(ref)
    return out


def _find_named(rapl: RaplBackend, name: str, like: str) -> RaplZoneRef | None:
    """The one zone named ``name`` (a package's name is unique; a "dram" is not: None)."""
    found = _zones_named(rapl, name, like)
    return found[0] if len(found) == 1 else None
