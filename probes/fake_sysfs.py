"""A fake powercap sysfs tree for machines without RAPL (tests, benchmarks, e2e runs).

:class:`FakePowercap` writes zones into a directory in the real kernel layout: real
directories under ``devices/virtual/powercap/<control>/`` (subzones nested in their
package) and relative symlinks from ``class/powercap/`` to each of them, the same
files with the same modes the kernel gives them (``energy_uj`` 0400 as since Linux
5.10), and an energy counter that wraps to 0 after ``max_energy_range_uj`` like the
hardware. Point ``RaplProbe`` (or ``greend run --sysfs-root``) at the root and "run"
the fake CPU with :meth:`FakePowercap.advance`::

    fake = FakePowercap(tmp_path)
    ids = fake.add_package(0, core=True, dram=True)   # {"package-0": "intel-rapl:0", ...}
    fake.advance(ids["package-0"], 12.5)              # 12.5 J more on the counter

Counter values are written atomically (temp file + rename), so a daemon reading the
tree from another process never sees a half-written number.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from greend.fsutil import write_atomic

__all__ = [
    "DEFAULT_DRAM_MAX_ENERGY_RANGE_UJ",
    "DEFAULT_MAX_ENERGY_RANGE_UJ",
    "FakePowercap",
    "FakeZone",
    "make_standard_tree",
]

#: What a Xeon or Core package reports (32-bit counter x 61 µJ energy units).
DEFAULT_MAX_ENERGY_RANGE_UJ = 262_143_328_850
#: Server DRAM domains use a 15.3 µJ unit: a smaller range.
DEFAULT_DRAM_MAX_ENERGY_RANGE_UJ = 65_532_610_987

#: Typical RAPL time windows (µs).
_LONG_TERM_WINDOW_US = 27_983_872
_SHORT_TERM_WINDOW_US = 2_440


@dataclass
class FakeZone:
    """One fake zone: its id (``intel-rapl:0:1``), kernel name and real directory."""

    id: str
    name: str
    dir: Path
    max_energy_range_uj: int
    initial_uj: int
    advanced_uj: float = 0.0  # the truth: energy added since creation, in µJ

    @property
    def raw_uj(self) -> int:
        """What ``energy_uj`` reads: the running total, wrapped like the hardware."""
        return int(self.initial_uj + self.advanced_uj) % (self.max_energy_range_uj + 1)


def _write_atomic(path: Path, text: str, mode: int) -> None:
    # Not durable: the fake tree must outlive a crashed process, not a power cut.
    write_atomic(path, text, mode=mode, exact_mode=True, durable=False)


def _mkdirs(path: Path) -> None:
    """Creates ``path`` and its missing parents 0755, as sysfs shows its directories,
    whatever the process umask (a daemon in the same process sets 077)."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir()
        os.chmod(d, 0o755)


class FakePowercap:
    """Builds and drives a powercap tree under ``root`` (the fake ``/sys``).

    Zone arguments accept the zone id (``"intel-rapl:0:1"``). Constraints follow the
    kernel: ``constraint_0`` is ``long_term``, ``constraint_1`` ``short_term`` (packages
    and psys), with ``power_limit_uw`` 0644 and ``max_power_uw`` 0444.
    """

    def __init__(self, root: Path, *, energy_mode: int = 0o400) -> None:
        self.root = Path(root)
        self.energy_mode = energy_mode
        self.zones: dict[str, FakeZone] = {}
        _mkdirs(self.root / "class" / "powercap")

    # -- building -----------------------------------------------------------------

    def _control_dir(self, control: str) -> Path:
        d = self.root / "devices" / "virtual" / "powercap" / control
        if not d.is_dir():
            _mkdirs(d)
            _write_atomic(d / "enabled", "1\n", 0o644)
            self._link(control, d)
        return d

    def _link(self, name: str, target: Path) -> None:
        link = self.root / "class" / "powercap" / name
        rel = os.path.relpath(target, link.parent)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(rel)

    def _next_free(self, control: str, parent: str | None = None) -> int:
        prefix = f"{parent}:" if parent else f"{control}:"
        used = {int(z[len(prefix) :], 16) for z in self.zones if z.startswith(prefix) and ":" not in z[len(prefix) :]}
        n = 0
        while n in used:
            n += 1
        return n

    def add_zone(
        self,
        name: str,
        *,
        parent: str | None = None,
        zone_id: int | None = None,
        control: str = "intel-rapl",
        max_energy_range_uj: int = DEFAULT_MAX_ENERGY_RANGE_UJ,
        long_term_w: float | None = None,
        short_term_w: float | None = None,
        max_power_w: float | None = None,
        energy_uj: int = 0,
        enabled: bool = True,
    ) -> str:
        """Add one zone (top level, or a subzone of ``parent``); returns its id.

        ``zone_id`` defaults to the next free number; it is written in hex like the
        kernel's ``%x``. ``long_term_w`` / ``short_term_w`` add constraints;
        ``max_power_w`` (default: the long-term limit) becomes ``constraint_0_max_power_uw``.
        """
        if parent is not None:
            parent_zone = self.zones[parent]
            control = parent.split(":")[0]
            n = self._next_free(control, parent) if zone_id is None else zone_id
            zid = f"{parent}:{n:x}"
            zdir = parent_zone.dir / zid
        else:
            cdir = self._control_dir(control)
            n = self._next_free(control) if zone_id is None else zone_id
            zid = f"{control}:{n:x}"
            zdir = cdir / zid
        if zid in self.zones:
            raise ValueError(f"zone {zid} exists")
        _mkdirs(zdir)
        zone = FakeZone(zid, name, zdir, max_energy_range_uj, energy_uj % (max_energy_range_uj + 1))
        self.zones[zid] = zone
        _write_atomic(zdir / "name", f"{name}\n", 0o444)
        _write_atomic(zdir / "enabled", "1\n" if enabled else "0\n", 0o644)
        _write_atomic(zdir / "max_energy_range_uj", f"{max_energy_range_uj}\n", 0o444)
        self._write_energy(zone)
        constraints: list[tuple[str, float, int, float]] = []
        if long_term_w is not None:
            constraints.append(("long_term", long_term_w, _LONG_TERM_WINDOW_US, max_power_w or long_term_w))
        if short_term_w is not None:
            constraints.append(("short_term", short_term_w, _SHORT_TERM_WINDOW_US, 0.0))
        for i, (cname, limit_w, window_us, cmax_w) in enumerate(constraints):
            _write_atomic(zdir / f"constraint_{i}_name", f"{cname}\n", 0o444)
            _write_atomic(zdir / f"constraint_{i}_power_limit_uw", f"{int(limit_w * 1e6)}\n", 0o644)
            _write_atomic(zdir / f"constraint_{i}_time_window_us", f"{window_us}\n", 0o644)
            _write_atomic(zdir / f"constraint_{i}_max_power_uw", f"{int(cmax_w * 1e6)}\n", 0o444)
        self._link(zid, zdir)
        return zid

    def add_package(
        self,
        package: int,
        *,
        zone_id: int | None = None,
        core: bool = False,
        uncore: bool = False,
        dram: bool = False,
        tdp_w: float = 125.0,
        max_energy_range_uj: int = DEFAULT_MAX_ENERGY_RANGE_UJ,
        energy_uj: int = 0,
        control: str = "intel-rapl",
    ) -> dict[str, str]:
        """Add ``package-<package>`` and its subzones, in the kernel's order (core, uncore,
        dram). Returns kernel name -> zone id, e.g. ``{"package-0": "intel-rapl:0",
        "core": "intel-rapl:0:0"}``. AMD Zen: ``core=True`` only.
        """
        if zone_id is None and f"{control}:{package:x}" not in self.zones:
            zone_id = package
        pid = self.add_zone(
            f"package-{package}",
            zone_id=zone_id,
            control=control,
            max_energy_range_uj=max_energy_range_uj,
            long_term_w=tdp_w,
            short_term_w=tdp_w * 1.2,
            energy_uj=energy_uj,
        )
        ids = {f"package-{package}": pid}
        subs = [
            ("core", core, max_energy_range_uj),
            ("uncore", uncore, max_energy_range_uj),
            ("dram", dram, DEFAULT_DRAM_MAX_ENERGY_RANGE_UJ),
        ]
        for i, (sub, _wanted, rng) in enumerate(s for s in subs if s[1]):
            ids[sub] = self.add_zone(
                sub,
                parent=pid,
                max_energy_range_uj=rng,
                long_term_w=0.0,  # subzone limits read 0 (unset) on most parts
                energy_uj=(energy_uj // (i + 2)) % (rng + 1),
            )
        return ids

    def add_psys(
        self,
        *,
        zone_id: int | None = None,
        long_term_w: float = 280.0,
        energy_uj: int = 0,
        max_energy_range_uj: int = DEFAULT_MAX_ENERGY_RANGE_UJ,
    ) -> str:
        """Add the platform zone ``psys`` (top level, like the kernel registers it)."""
        return self.add_zone(
            "psys",
            zone_id=zone_id,
            max_energy_range_uj=max_energy_range_uj,
            long_term_w=long_term_w,
            short_term_w=long_term_w * 1.2,
            energy_uj=energy_uj,
        )

    # -- driving ------------------------------------------------------------------

    def _write_energy(self, zone: FakeZone) -> None:
        _write_atomic(zone.dir / "energy_uj", f"{zone.raw_uj}\n", self.energy_mode)

    def advance(self, zone_id: str, joules: float) -> int:
        """Add ``joules`` to the zone's counter (wrapping at ``max_energy_range_uj``);
        returns the new ``energy_uj``. Does not touch parents: advance a package and
        its subzones separately, as the hardware counts them separately."""
        if joules < 0:
            raise ValueError("energy counters only go up")
        zone = self.zones[zone_id]
        zone.advanced_uj += joules * 1e6
        self._write_energy(zone)
        return zone.raw_uj

    def advance_many(self, joules_by_zone: Mapping[str, float]) -> None:
        for zone_id, joules in joules_by_zone.items():
            self.advance(zone_id, joules)

    def set_energy_uj(self, zone_id: str, uj: int) -> None:
        """Put the raw counter at ``uj`` (the truth moves by the same amount, modulo wraps)."""
        zone = self.zones[zone_id]
        zone.initial_uj = uj - int(zone.advanced_uj)
        self._write_energy(zone)

    def energy_uj(self, zone_id: str) -> int:
        return self.zones[zone_id].raw_uj

    def true_energy_j(self, zone_id: str) -> float:
        """The energy advanced since the zone was made, in J: what a probe should report."""
        return self.zones[zone_id].advanced_uj / 1e6

    def dir_of(self, zone_id: str) -> Path:
        return self.zones[zone_id].dir

    def chmod(self, zone_id: str, filename: str, mode: int) -> None:
        os.chmod(self.zones[zone_id].dir / filename, mode)
        if filename == "energy_uj":
            self.energy_mode = mode

    def remove(self, zone_id: str) -> None:
        """Make the zone vanish (module unloaded, hot-unplug): its dir, link and subzones."""
        zone = self.zones.pop(zone_id)
        for sub in [z for z in self.zones if z.startswith(zone_id + ":")]:
            self.zones.pop(sub)
            (self.root / "class" / "powercap" / sub).unlink(missing_ok=True)
        (self.root / "class" / "powercap" / zone_id).unlink(missing_ok=True)
        shutil.rmtree(zone.dir)


def make_standard_tree(root: Path, *, mmio: bool = True) -> FakePowercap:
    """The tree of a two-socket server, as ``tests/fixtures/sys`` holds it::

        intel-rapl:0    package-0   (core intel-rapl:0:0, uncore :0:1, dram :0:2)
        intel-rapl:1    package-1   (core intel-rapl:1:0, uncore :1:1, dram :1:2)
        intel-rapl:a    psys        (a hex zone id)
        intel-rapl-mmio:0  package-0  (duplicates intel-rapl:0; a probe must skip it)

    Counters start at fixed non-zero values; package TDP 205 W, psys 500 W.
    """
    fake = FakePowercap(root)
    fake.add_package(0, core=True, uncore=True, dram=True, tdp_w=205.0, energy_uj=81_234_567_890)
    fake.add_package(1, core=True, uncore=True, dram=True, tdp_w=205.0, energy_uj=12_345_678_901)
    fake.add_psys(zone_id=0xA, long_term_w=500.0, energy_uj=200_000_000_000)
    if mmio:
        fake.add_package(0, control="intel-rapl-mmio", tdp_w=205.0, energy_uj=81_234_567_890)
    return fake
