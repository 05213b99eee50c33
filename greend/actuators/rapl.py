"""RAPL power limits, the CPU knob: a zone's ``constraint_N_power_limit_uw`` (long
and short term) under an injected sysfs root, clamped to ``constraint_N_max_power_uw``.

Errors are greend errors (``NoData`` for an absent zone, ``NoPermission`` or
``NotSupported`` for an unreadable limit, ``ActuatorError`` for a failed write);
the :class:`~greend.actuators.controller.Controller` names the knob and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from greend.errors import NoData
from greend.probes.rapl import (
    ReadText,
    WriteText,
    read_power_limit_uw,
    read_text,
    write_limit_file,
    write_power_limit_uw,
    write_text,
)

__all__ = ["RAPL_LIMIT_CONSTRAINTS", "RaplBackend", "RaplConstraint", "RaplZoneRef"]

RAPL_LIMIT_CONSTRAINTS: tuple[str, ...] = ("long_term", "short_term")


@dataclass(frozen=True)
class RaplZoneRef:
    """A powercap zone: ``zone_id`` ("intel-rapl:0"), the kernel ``name``
    ("package-0"), its directory and its path relative to the sysfs root."""

    zone_id: str
    name: str
    dir: Path
    rel_path: str
    parent: str = ""  # a subzone's package's name ("package-0" for its "core")

    @property
    def device(self) -> str:
        return f"{self.label} ({self.zone_id})"

    @property
    def label(self) -> str:
        """The name that tells the zone apart: ``package-0``, ``package-1/dram``."""
        return f"{self.parent}/{self.name}" if self.parent else self.name

    def named(self, saved: str) -> bool:
        """Whether this is the zone saved as ``saved`` (a label; older files: a plain name)."""
        return saved == self.label or ("/" not in saved and saved == self.name)


@dataclass(frozen=True)
class RaplConstraint:
    index: int
    name: str
    max_uw: int  # 0: the kernel gives no maximum


class RaplBackend:
    """RAPL power limits under ``<sysfs_root>/class/powercap`` (root injected).

    ``read``/``write`` are injectable like the RAPL probe's, for failure tests.
    """

    def __init__(self, sysfs_root: Path | str, *, read: ReadText = read_text, write: WriteText = write_text) -> None:
        self.sysfs_root = Path(sysfs_root).resolve()
        self._read = read
        self._write = write

    def __repr__(self) -> str:
        return f"RaplBackend({str(self.sysfs_root)!r})"

    @property
    def key(self) -> str:
        return str(self.sysfs_root)

    def resolve(self, zone: str | Path) -> RaplZoneRef:
        """``"intel-rapl:0"``, ``"class/powercap/intel-rapl:0"`` (relative to the root)
        or an absolute path under the root. Raises ``NoData`` for an absent zone."""
        text = str(zone)
        if Path(text).is_absolute():
            try:
                rel = str(Path(text).relative_to(self.sysfs_root))
            except ValueError:
                raise NoData(f"RAPL zone {text} is not under the sysfs root {self.sysfs_root}") from None
        elif "/" in text:
            rel = text.strip("/")
        else:
            rel = f"class/powercap/{text}"
        zdir = self.sysfs_root / rel
        if not zdir.is_dir():
            raise NoData(f"no RAPL zone {text!r} under {self.sysfs_root} ({zdir} does not exist)")
        try:
            name = self._read(zdir / "name").strip()
        except OSError:
            name = Path(rel).name
        parent = ""
        if Path(rel).name.count(":") >= 2:  # a subzone: its directory sits in its package's
            try:
                parent = self._read(zdir.resolve().parent / "name").strip()
            except OSError:
                parent = ""
        return RaplZoneRef(zone_id=Path(rel).name, name=name, dir=zdir, rel_path=rel, parent=parent)

    def constraints(self, ref: RaplZoneRef) -> list[RaplConstraint]:
        """The zone's long_term and short_term constraints, in index order."""
        out: list[RaplConstraint] = []
        for n in range(17):
            try:
                cname = self._read(ref.dir / f"constraint_{n}_name").strip()
            except OSError:
                break
            if cname not in RAPL_LIMIT_CONSTRAINTS:
                continue
            try:
                max_uw = int(self._read(ref.dir / f"constraint_{n}_max_power_uw").strip())
            except (OSError, ValueError):
                max_uw = 0
            out.append(RaplConstraint(n, cname, max_uw))
        return out

    def disabled(self, ref: RaplZoneRef) -> bool:
        """Whether the zone's ``enabled`` reads 0: its limit is not enforced (an absent or
        unreadable file: not known, taken as on)."""
        try:
            return self._read(ref.dir / "enabled").strip() == "0"
        except OSError:
            return False

    def read_limit_uw(self, ref: RaplZoneRef, n: int) -> int:
        return read_power_limit_uw(ref.dir, n, read=self._read)

    def write_limit_uw(self, ref: RaplZoneRef, n: int, uw: int) -> int:
        """Clamped to the constraint's max, idempotent; returns the µW in force."""
        return write_power_limit_uw(ref.dir, n, uw, read=self._read, write=self._write)

    def restore_limit_uw(self, ref: RaplZoneRef, n: int, uw: int) -> bool:
        """Write exactly ``uw`` (no clamping: it is the original); False if already so."""
        if self.read_limit_uw(ref, n) == uw:
            return False
        write_limit_file(ref.dir / f"constraint_{n}_power_limit_uw", uw, write=self._write)
        return True
