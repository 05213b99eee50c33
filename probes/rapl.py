"""CPU and DRAM energy from RAPL, read through the Linux powercap sysfs interface.

Kernel layout (``drivers/powercap/intel_rapl_common.c``, ``powercap_sys.c``)::

    <sysfs>/class/powercap/
        intel-rapl          -> ../../devices/virtual/powercap/intel-rapl   (control type, skipped)
        intel-rapl:0        -> ../../devices/virtual/powercap/intel-rapl/intel-rapl:0
        intel-rapl:0:0      -> ../../devices/virtual/powercap/intel-rapl/intel-rapl:0/intel-rapl:0:0
        intel-rapl:a        -> ...                  (ids are printed with %x: hex)
        intel-rapl-mmio:0   -> ../../devices/virtual/powercap/intel-rapl-mmio/intel-rapl-mmio:0

Every zone directory holds ``name`` (``package-N``, ``core``, ``uncore``, ``dram``,
``psys``), ``energy_uj``, ``max_energy_range_uj``, ``enabled`` and, per constraint
``N``, ``constraint_N_name`` (``long_term``, ``short_term``, ``peak_power``),
``constraint_N_power_limit_uw``, ``constraint_N_time_window_us`` and
``constraint_N_max_power_uw``. Subzones are also subdirectories of their parent.
AMD Zen (``intel_rapl_msr`` since Linux 5.8) shows the same names, without ``dram``.
``intel-rapl-mmio`` (newer Intel clients) duplicates the package zones for power
limiting: a mmio zone whose name an ``intel-rapl`` package already has is skipped.

Energy semantics:

- ``energy_uj`` is a counter in µJ that runs from 0 to ``max_energy_range_uj`` and then
  wraps to 0, so one tick's energy is ``(cur - prev) mod (max_energy_range_uj + 1)``.
  More than one wrap between two reads cannot be seen; at the 262,143 J range of a
  typical package that takes over 8 minutes at 500 W, far longer than a tick.
- ``core`` (PP0) and ``uncore`` (PP1, the client GPU) are parts of their package: they
  are reported with ``counted=False`` and ``parent`` set to the package's path.
  ``dram`` is energy outside the package: ``counted=True`` (its ``parent`` still names
  the package it belongs to). ``psys`` is the whole platform (SoC, DRAM and more):
  ``counted=False``, never added to the packages. Any other subzone is treated as part
  of its parent (not counted); any other top-level zone is not counted either.
- ``energy_uj`` is mode 0400 since Linux 5.10 (CVE-2020-8694, the PLATYPUS side
  channel): only root (or CAP_DAC_READ_SEARCH) can read it.

Every file is read through an injected ``read`` callable (``Path -> str``), so tests
can simulate failures without patching builtins, and the sysfs root is injected like
node_exporter's ``--path.sysfs``.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from greend.errors import ActuatorError, DeviceLost, NoData, NoPermission, NotSupported, ProbeError
from greend.units import uj_to_j, uw_to_w

from . import ProbeContext, register
from .base import CpuReading, Probe, ProbeInfo, Readings

__all__ = [
    "ENERGY_PERMISSION_FIX",
    "NO_RAPL_FIX",
    "RaplProbe",
    "RaplZone",
    "ReadText",
    "WriteText",
    "constraint_index",
    "discover_zones",
    "read_power_limit_uw",
    "read_text",
    "wrap_delta_uj",
    "write_power_limit_uw",
    "write_text",
]

log = logging.getLogger(__name__)

# A zone's power limit is re-read at most this often (energy is read every tick).
LIMIT_EVERY_S = 5.0

ReadText = Callable[[Path], str]
WriteText = Callable[[Path, str], None]

#: ``intel-rapl:0``, ``intel-rapl:0:1``, ``intel-rapl:a``, ``intel-rapl-mmio:0``.
_ZONE_RE = re.compile(r"^(?P<control>intel-rapl(?:-mmio)?):(?P<zone>[0-9a-f]+)(?::(?P<sub>[0-9a-f]+))?\Z")

#: Subzone names whose energy is outside their package (and so is added to it).
_SEPARATE_SUBZONES = frozenset({"dram"})

NO_RAPL_FIX = (
    "RAPL needs bare metal (or a VM that passes it through) and the intel_rapl_msr "
    "module (`modprobe intel_rapl_msr`; AMD Zen needs Linux 5.8+); in a container, mount "
    "the host's /sys and pass --sysfs-root; otherwise set `cpu_tdp_w` under [probes] "
    "in the config for a CPU estimate (source=estimate)"
)

ENERGY_PERMISSION_FIX = (
    "energy_uj is readable by root only since Linux 5.10 (CVE-2020-8694); run greend as "
    "root (its systemd unit does) or grant CAP_DAC_READ_SEARCH"
)


def read_text(path: Path) -> str:
    """Default reader: the whole file as text (sysfs attributes are one small value).

    Plain ``os.open``/``os.read``: three times cheaper than ``open()`` (27 -> 9 µs
    here), and the RAPL probe reads every zone's counter on every tick.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 4096).decode("ascii")
    finally:
        os.close(fd)


def write_text(path: Path, text: str) -> None:
    """Default writer: one write() of the whole value, as sysfs expects."""
    with open(path, "w", encoding="ascii") as f:
        f.write(text)


# The most one RAPL zone draws (a server package today: under 500 W): a counter step that
# implies more over the time it took is not energy (a reset read as a wrap, a jump).
MAX_ZONE_W = 2000.0


def wrap_delta_uj(prev_uj: int, cur_uj: int, max_energy_range_uj: int) -> int:
    """Energy between two reads of a counter that wraps to 0 after ``max_energy_range_uj``.

    ``(cur - prev) mod (max + 1)``. With an unknown range (0), a backwards step cannot be
    interpreted and counts as 0.
    """
    if cur_uj >= prev_uj:
        return cur_uj - prev_uj
    if max_energy_range_uj <= 0:
        return 0
    return (cur_uj - prev_uj) % (max_energy_range_uj + 1)


def _zone_sort_key(zone_id: str) -> tuple[int, int, int]:
    m = _ZONE_RE.match(zone_id)
    assert m is not None
    sub = m.group("sub")
    return (
        1 if m.group("control").endswith("-mmio") else 0,
        int(m.group("zone"), 16),
        -1 if sub is None else int(sub, 16),
    )


def _parent_id(zone_id: str) -> str | None:
    m = _ZONE_RE.match(zone_id)
    if m is None or m.group("sub") is None:
        return None
    return f"{m.group('control')}:{m.group('zone')}"


@dataclass
class RaplZone:
    """One powercap zone and the probe's running state for it.

    ``id`` is the directory name (``intel-rapl:0:1``), ``name`` the kernel's name for it
    (``core``), ``dir`` the directory to read (under ``class/powercap``). Energy is kept
    in integer µJ so totals are exact however many ticks pass.
    """

    id: str
    name: str
    dir: Path
    parent: str | None
    counted: bool
    max_energy_range_uj: int
    long_term_index: int | None = None
    enabled: bool | None = None
    # running state
    prev_uj: int | None = None
    prev_now_s: float | None = None
    total_uj: int = 0
    power_w: float | None = None
    error: str | None = None
    permission_denied: bool = False
    energy_path: Path = field(init=False, repr=False, compare=False)  # dir/energy_uj, read every tick

    def __post_init__(self) -> None:
        self.energy_path = self.dir / "energy_uj"

    @property
    def energy_j(self) -> float:
        return uj_to_j(self.total_uj)

    def describe(self) -> str:
        if self.name == "psys":
            role = "platform, not added to packages"
        elif not self.counted:
            role = f"inside {self.parent}, not counted"
        else:
            role = "counted"
        text = f"{self.name} ({self.id}): {role}"
        if self.error:
            text += f"; FAILING: {self.error}"
        return text


def discover_zones(sysfs_root: Path, read: ReadText = read_text) -> tuple[list[RaplZone], list[str]]:
    """Find the RAPL zones under ``<sysfs_root>/class/powercap``.

    Returns ``(zones, skipped)`` where ``skipped`` describes zones left out (mmio
    duplicates, unreadable names). Raises :class:`NoData` when there are none.
    Zone state (``prev_uj`` and so on) is not primed here.
    """
    base = sysfs_root / "class" / "powercap"
    no_zones = f"no RAPL powercap zones under {base} (a VM or container?)"
    try:
        entries = sorted(p.name for p in base.iterdir())
    except FileNotFoundError as e:
        raise NoData(f"{no_zones}; {NO_RAPL_FIX}") from e
    except NotADirectoryError as e:
        raise NoData(f"{no_zones}; {NO_RAPL_FIX}") from e
    except PermissionError as e:
        raise NoPermission(f"cannot list {base}: {e.strerror}; run greend as root") from e

    dirs: dict[str, Path] = {}
    for entry in entries:
        if _ZONE_RE.match(entry):
            dirs[entry] = base / entry
    # Subzones are subdirectories of their parent too; pick up any the class dir lacks.
    for zone_id, zone_dir in list(dirs.items()):
        if _parent_id(zone_id) is not None:
            continue
        try:
            children = [c for c in zone_dir.iterdir() if _ZONE_RE.match(c.name) and c.is_dir()]
        except OSError:
            continue
        for child in children:
            dirs.setdefault(child.name, child)

    zones: list[RaplZone] = []
    skipped: list[str] = []
    by_id: dict[str, RaplZone] = {}
    msr_package_names: set[str] = set()
    for zone_id in sorted(dirs, key=_zone_sort_key):
        zone_dir = dirs[zone_id]
        parent = _parent_id(zone_id)
        is_mmio = zone_id.startswith("intel-rapl-mmio:")
        if parent is not None and parent not in by_id:
            skipped.append(f"{zone_id}: parent {parent} skipped or absent")
            continue
        try:
            name = read(zone_dir / "name").strip()
        except OSError as e:
            skipped.append(f"{zone_id}: cannot read name ({e})")
            continue
        if parent is None and is_mmio and name in msr_package_names:
            skipped.append(f"{name} ({zone_id}): duplicates the intel-rapl {name} zone")
            continue
        if parent is None:
            counted = name.startswith("package") or name == "dram"
            if not is_mmio and name.startswith("package"):
                msr_package_names.add(name)
        else:
            counted = name in _SEPARATE_SUBZONES
        try:
            max_range_uj = int(read(zone_dir / "max_energy_range_uj").strip())
        except (OSError, ValueError):
            log.warning("%s: max_energy_range_uj unreadable; wraps will count as 0", zone_id)
            max_range_uj = 0
        zone = RaplZone(
            id=zone_id,
            name=name,
            dir=zone_dir,
            parent=parent,
            counted=counted,
            max_energy_range_uj=max_range_uj,
            long_term_index=constraint_index(zone_dir, "long_term", read=read),
            enabled=_read_enabled(zone_dir, read),
        )
        zones.append(zone)
        by_id[zone_id] = zone
    if not zones:
        raise NoData(f"{no_zones}; {NO_RAPL_FIX}")
    return zones, skipped


def _read_enabled(zone_dir: Path, read: ReadText) -> bool | None:
    try:
        return read(zone_dir / "enabled").strip() == "1"
    except OSError:
        return None


def constraint_index(zone_path: Path, constraint_name: str, *, read: ReadText = read_text) -> int | None:
    """The ``N`` of the ``constraint_N_name`` file that reads ``constraint_name``, or None."""
    n = 0
    while True:
        try:
            text = read(zone_path / f"constraint_{n}_name")
        except OSError:  # FileNotFoundError past the last constraint
            return None
        if text.strip() == constraint_name:
            return n
        n += 1
        if n > 16:  # the kernel has at most 3 (long_term, short_term, peak_power)
            return None


def read_power_limit_uw(zone_path: Path, n: int, *, read: ReadText = read_text) -> int:
    """The zone's ``constraint_<n>_power_limit_uw`` in µW.

    Raises :class:`NotSupported` when the constraint does not exist and
    :class:`NoPermission` when it cannot be read.
    """
    path = zone_path / f"constraint_{n}_power_limit_uw"
    try:
        return int(read(path).strip())
    except FileNotFoundError as e:
        raise NotSupported(f"{path} does not exist: zone has no constraint {n}") from e
    except PermissionError as e:
        raise NoPermission(f"cannot read {path}: run greend as root") from e
    except (OSError, ValueError) as e:
        raise NotSupported(f"cannot read {path}: {e}") from e


# The kernel holds a limit in the package's RAPL power units (MSR_RAPL_POWER_UNIT: 1/8 W on
# Intel and AMD parts), so it rounds a request to a step below this; a limit held within it
# of a request is that request.
ROUNDING_UW = 125_000


def write_power_limit_uw(
    zone_path: Path,
    n: int,
    uw: int,
    *,
    read: ReadText = read_text,
    write: WriteText = write_text,
) -> int:
    """Set ``constraint_<n>_power_limit_uw``, clamped to ``constraint_<n>_max_power_uw``.

    Idempotent: reads the current limit first and writes only if it differs. Returns the
    limit in µW now in force. A ``max_power_uw`` of 0 or an absent file means the kernel
    gives no maximum, and no clamping is done. Raises :class:`ValueError` for a
    non-positive request and :class:`ActuatorError` when the write fails.
    """
    if uw <= 0:
        raise ValueError(f"power limit must be positive, got {uw} uW")
    target = int(uw)
    try:
        max_uw = int(read(zone_path / f"constraint_{n}_max_power_uw").strip())
    except (OSError, ValueError):
        max_uw = 0
    if max_uw > 0 and target > max_uw:
        log.info("%s constraint %d: %d uW clamped to max %d uW", zone_path.name, n, target, max_uw)
        target = max_uw
    current = read_power_limit_uw(zone_path, n, read=read)
    if abs(current - target) < ROUNDING_UW:
        # What the kernel made of this same request last time (it holds a limit in the
        # package's power units): written again, it would round again, and warn again.
        return current
    write_limit_file(zone_path / f"constraint_{n}_power_limit_uw", target, write=write)
    try:
        held = read_power_limit_uw(zone_path, n, read=read)  # the kernel may clamp or round it
    except (OSError, ValueError, ActuatorError, ProbeError):  # (the write took: said as asked)
        held = target
    if abs(held - target) >= ROUNDING_UW:  # (within a power unit: the kernel's rounding, as asked)
        log.warning("%s constraint %d: %d uW asked, the kernel holds %d uW", zone_path.name, n, target, held)
    log.info("%s constraint %d: power limit %d -> %d uW", zone_path.name, n, current, held)
    return held


def write_limit_file(path: Path, uw: int, *, write: WriteText = write_text) -> None:
    """Write ``uw`` to a ``constraint_N_power_limit_uw`` file as it is (no clamping);
    every failure is an :class:`ActuatorError` that says the fix."""
    try:
        write(path, str(int(uw)))
    except PermissionError as e:
        if os.geteuid() == 0:
            raise ActuatorError(
                f"cannot write {path}: permission denied even as root: the limit is locked (by the "
                "firmware or BIOS, or an immutable file); see dmesg"
            ) from e
        raise ActuatorError(f"cannot write {path}: permission denied; run greend as root") from e
    except OSError as e:
        if e.errno == errno.EROFS:
            raise ActuatorError(
                f"cannot write {path}: /sys is read-only (systemd ProtectKernelTunables=yes); "
                "add ReadWritePaths=/sys/devices/virtual/powercap to the unit"
            ) from e
        raise ActuatorError(f"cannot write {path}: {e}") from e


class RaplProbe:
    """CPU package, DRAM and platform energy from RAPL powercap zones.

    ``open()`` finds the zones and primes their counters; ``sample(now_s)`` returns one
    :class:`CpuReading` per readable zone with the energy since ``open()`` and the power
    over the last tick. A zone that fails mid-run is left out of that tick's readings and
    shown in :meth:`info`. When it reads again, the gap is booked where the counter ran on
    (a read that failed) and what it shows is plausible (:data:`MAX_ZONE_W`); a zone whose
    files were gone is re-primed (it may have restarted from 0), and so is a counter that
    went back without a wrap (a reset).
    """

    name = "rapl"

    def __init__(self, sysfs_root: Path, read: ReadText | None = None) -> None:
        self.sysfs_root = Path(sysfs_root)
        self._read: ReadText = read if read is not None else read_text
        self._zones: list[RaplZone] = []
        self._skipped: list[str] = []
        self._error: NoData | NoPermission | None = None
        self._opened = False
        self._limits: dict[str, tuple[float, float | None]] = {}  # zone id -> (read at, W)

    @property
    def zones(self) -> list[RaplZone]:
        """The zones found by ``open()`` (for actuators that cap package power)."""
        return list(self._zones)

    def open(self) -> None:
        try:
            zones, skipped = discover_zones(self.sysfs_root, self._read)
        except (NoData, NoPermission) as e:
            self._error = e
            raise
        denied: list[str] = []
        for zone in zones:
            try:
                zone.prev_uj = self._read_energy_uj(zone)
            except PermissionError:
                zone.permission_denied = True
                zone.error = f"cannot read {zone.dir / 'energy_uj'}: permission denied"
                denied.append(zone.id)
            except (OSError, ValueError) as e:
                zone.error = f"cannot read energy_uj: {e}"
        if denied and len(denied) == len(zones):
            err = NoPermission(
                f"cannot read {zones[0].dir / 'energy_uj'} (and {len(zones) - 1} more): {ENERGY_PERMISSION_FIX}"
            )
            self._error = err
            raise err
        self._zones = zones
        self._skipped = skipped
        self._opened = True
        log.debug("rapl: %d zones: %s", len(zones), ", ".join(z.describe() for z in zones))

    def _read_energy_uj(self, zone: RaplZone) -> int:
        return int(self._read(zone.energy_path).strip())

    def _power_limit_w(self, zone: RaplZone, now_s: float) -> float | None:
        """The long-term limit in W, re-read at most every LIMIT_EVERY_S (it changes
        only when someone writes it; call :meth:`refresh_limits` after a write)."""
        if zone.long_term_index is None:
            return None
        cached = self._limits.get(zone.id)
        if cached is not None and now_s - cached[0] < LIMIT_EVERY_S:
            return cached[1]
        try:
            limit_uw = read_power_limit_uw(zone.dir, zone.long_term_index, read=self._read)
        except (NoPermission, NotSupported):
            value = None
        else:
            value = uw_to_w(limit_uw) if limit_uw > 0 else None  # 0: no limit set (PP0, DRAM)
        self._limits[zone.id] = (now_s, value)
        return value

    def refresh_limits(self) -> None:
        self._limits.clear()

    def sample(self, now_s: float) -> Readings:
        out: list[CpuReading] = []
        failed: list[RaplZone] = []
        for zone in self._zones:
            try:
                cur_uj = self._read_energy_uj(zone)
            except (OSError, ValueError) as e:
                if zone.error is None:
                    log.warning("rapl zone %s (%s) failed: %s", zone.id, zone.name, e)
                zone.error = f"cannot read energy_uj: {e}"
                zone.permission_denied = isinstance(e, PermissionError)
                if isinstance(e, FileNotFoundError):
                    zone.prev_uj = None  # the zone is gone: one that comes back may count from 0
                # (else a read that failed: the counter runs on, and the next good read
                # books the gap where what it shows is plausible)
                zone.power_w = None
                failed.append(zone)
                continue
            if zone.error is not None:
                log.info("rapl zone %s (%s) reads again; counting resumes", zone.id, zone.name)
                zone.error, zone.permission_denied = None, False
            if zone.prev_uj is None:
                # The first read, or the first of a zone that was gone: start from here.
                zone.prev_uj, zone.prev_now_s, zone.power_w = cur_uj, now_s, None
            else:
                delta_uj = wrap_delta_uj(zone.prev_uj, cur_uj, zone.max_energy_range_uj)
                dt = now_s - zone.prev_now_s if zone.prev_now_s is not None else None
                if dt is not None and delta_uj > (MAX_ZONE_W * max(dt, 0.0) + 1.0) * 1e6:
                    # More than the zone can draw meanwhile: not a wrap (the counter went back:
                    # a reset, a resume, a migrated VM) nor a real step: a new baseline.
                    log.warning("rapl zone %s (%s): energy_uj went from %d to %d uJ in %.3g s, more than "
                                "%g W could draw: a new baseline, nothing booked", zone.id, zone.name,
                                zone.prev_uj, cur_uj, dt, MAX_ZONE_W)  # fmt: skip
                    zone.power_w = None
                else:
                    zone.total_uj += delta_uj
                    if dt is not None and dt > 0:
                        zone.power_w = uj_to_j(delta_uj) / dt
                zone.prev_uj = cur_uj
                zone.prev_now_s = now_s
            out.append(
                CpuReading(
                    zone=zone.name,
                    path=zone.id,
                    source="rapl",
                    energy_j=zone.energy_j,
                    power_w=zone.power_w,
                    counted=zone.counted,
                    parent=zone.parent,
                    power_limit_w=self._power_limit_w(zone, now_s),
                )
            )
        if self._zones and len(failed) == len(self._zones):
            if all(z.permission_denied for z in failed):
                raise NoPermission(f"every RAPL zone is unreadable: {ENERGY_PERMISSION_FIX}")
            raise DeviceLost("every RAPL zone failed: " + "; ".join(f"{z.id}: {z.error}" for z in failed))
        return Readings(cpus=out)

    def info(self) -> ProbeInfo:
        if self._error is not None:
            fix: str | None = ENERGY_PERMISSION_FIX if isinstance(self._error, NoPermission) else NO_RAPL_FIX
            return ProbeInfo(self.name, False, str(self._error), fix=fix)
        if not self._opened:
            return ProbeInfo(self.name, False, "not opened yet")
        counted = [z for z in self._zones if z.counted]
        failing = [z for z in self._zones if z.error is not None]
        detail = (
            f"{len(self._zones)} zones under {self.sysfs_root / 'class' / 'powercap'}; "
            f"counted in CPU energy: {', '.join(f'{z.name} ({z.id})' for z in counted) or 'none'}"
        )
        if failing:
            detail += "; failing: " + ", ".join(f"{z.id} ({z.error})" for z in failing)
        fix = None
        if any(z.permission_denied for z in failing):
            fix = ENERGY_PERMISSION_FIX
        elif failing:
            fix = "check that the intel_rapl_msr module is still loaded (`lsmod | grep rapl`)"
        devices = [z.describe() for z in self._zones] + [f"skipped {s}" for s in self._skipped]
        return ProbeInfo(self.name, True, detail, fix=fix, devices=devices)

    def close(self) -> None:
        self._opened = False


@register(
    "rapl",
    default=True,
    help="CPU package, DRAM and platform energy from RAPL powercap (<sysfs>/class/powercap)",
)
def _factory(ctx: ProbeContext) -> Probe:
    return RaplProbe(ctx.sysfs_root)
