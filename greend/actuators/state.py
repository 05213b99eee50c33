"""The saved-settings file: what greend changed, and what it was before.

``<state_dir>/saved-settings.json`` holds, for every device knob greend has
written, the ORIGINAL value read before greend's first write, the value greend
set (``set``; None until a write succeeded) and who asked for it (``owner``: a
job id or ``"node"``). It also records enough to rebuild the device backends
in a process of its own (``greend restore --state-dir DIR``, run by systemd's
``ExecStopPost`` and by a daemon starting after a crash): the GPU backend
(``"nvml"``, or ``"sim"`` with its ``sim_dir``), each GPU's UUID and index, and
each RAPL zone's path under its ``sysfs_root`` with the constraint index and
original ``power_limit_uw`` of every constraint greend may write.

Format (version 1)::

    {
      "format": "greend-saved-settings",
      "version": 1,
      "updated_at": "2024-05-01T12:00:00Z",
      "pid": 1234,
      "gpus": [
        {"backend": "sim", "sim_dir": "/var/lib/greend/sim",
         "uuid": "GPU-8d1c...", "index": 0,
         "knobs": {
           "clock_cap_mhz": {"original": null, "set": 1500, "owner": "job-7", "updated_at": 1714564800.0},
           "power_limit_w": {"original": 700.0, "set": 400.0, "owner": "node", "updated_at": 1714564800.0}
         }}
      ],
      "cpus": [
        {"sysfs_root": "/sys", "zone_path": "class/powercap/intel-rapl:0",
         "zone_id": "intel-rapl:0", "name": "package-0",
         "set_w": 150.0, "owner": "node", "updated_at": 1714564800.0,
         "constraints": [
           {"index": 0, "name": "long_term", "original_uw": 205000000, "set_uw": 150000000},
           {"index": 1, "name": "short_term", "original_uw": 246000000, "set_uw": 150000000}
         ]}
      ]
    }

The clock knob's ``original`` is always null: NVML has no getter for locked
clocks, so "before greend" means unlocked and restoring it is
``nvmlDeviceResetGpuLockedClocks``.

Writes are atomic (a temp file in the same directory, fsync, ``os.replace``,
fsync of the directory): a crash leaves the old file or the new one. Loading is
strict: a corrupt, truncated or wrong-version file raises
:class:`~greend.errors.StateError` naming the file, the problem and the fix;
greend never replaces it with a silent default, since that would lose the
originals. :meth:`StateFile.move_aside` (``--force-defaults``) keeps it as
``saved-settings.json.corrupt-<timestamp>``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from greend.errors import StateError
from greend.fsutil import StateDir, fsync_dir, write_atomic

__all__ = [
    "CLOCK_KNOB",
    "FORMAT",
    "GPU_BACKENDS",
    "GPU_KNOBS",
    "POWER_KNOB",
    "STATE_FILE",
    "STATE_VERSION",
    "CpuConstraintState",
    "CpuEntry",
    "GpuEntry",
    "KnobState",
    "SavedState",
    "StateFile",
    "backend_key",
    "parse_state",
]

log = logging.getLogger(__name__)

STATE_FILE = "saved-settings.json"
FORMAT = "greend-saved-settings"
STATE_VERSION = 1
CLOCK_KNOB = "clock_cap_mhz"
POWER_KNOB = "power_limit_w"
GPU_KNOBS: tuple[str, ...] = (CLOCK_KNOB, POWER_KNOB)
GPU_BACKENDS: tuple[str, ...] = ("nvml", "sim")


@dataclass
class KnobState:
    """One GPU knob greend touched: its value before greend, and greend's value.

    ``original``: MHz or W before greend's first write (None for clocks: unlocked).
    ``set``: what greend has in force (None until a write succeeded).
    ``pending``: greend's first write, on disk before the driver call and cleared
    once it is recorded: a crash in between leaves it, so a restore undoes a write
    that landed (written only while present).
    """

    original: float | None
    set: float | None
    owner: str
    updated_at: float = 0.0  # wall time of the last change, for humans
    pending: float | None = None

    def to_json(self) -> dict[str, Any]:
        d = {"original": self.original, "set": self.set, "owner": self.owner, "updated_at": self.updated_at}
        if self.pending is not None:
            d["pending"] = self.pending
        return d


@dataclass
class GpuEntry:
    """A GPU greend has written: how to find it again, and its touched knobs."""

    backend: str  # "nvml" | "sim"
    sim_dir: str | None
    uuid: str
    index: int
    knobs: dict[str, KnobState] = field(default_factory=dict)

    @property
    def backend_key(self) -> str:
        return backend_key(self.backend, self.sim_dir)

    @property
    def device(self) -> str:
        return f"gpu{self.index} ({self.uuid})"

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "sim_dir": self.sim_dir,
            "uuid": self.uuid,
            "index": self.index,
            "knobs": {k: v.to_json() for k, v in sorted(self.knobs.items())},
        }


@dataclass
class CpuConstraintState:
    """One RAPL constraint (``constraint_<index>_power_limit_uw``) of a zone."""

    index: int
    name: str  # long_term | short_term
    original_uw: int
    set_uw: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "original_uw": self.original_uw, "set_uw": self.set_uw}


@dataclass
class CpuEntry:
    """A RAPL zone greend has written. ``zone_path`` is relative to ``sysfs_root``."""

    sysfs_root: str
    zone_path: str  # "class/powercap/intel-rapl:0"
    zone_id: str  # "intel-rapl:0"
    name: str  # the kernel's name: "package-0"
    owner: str
    set_w: float | None = None
    updated_at: float = 0.0
    constraints: list[CpuConstraintState] = field(default_factory=list)

    @property
    def device(self) -> str:
        return f"{self.name} ({self.zone_id})"

    def to_json(self) -> dict[str, Any]:
        return {
            "sysfs_root": self.sysfs_root,
            "zone_path": self.zone_path,
            "zone_id": self.zone_id,
            "name": self.name,
            "owner": self.owner,
            "set_w": self.set_w,
            "updated_at": self.updated_at,
            "constraints": [c.to_json() for c in self.constraints],
        }


def backend_key(backend: str, sim_dir: str | None) -> str:
    """``"nvml"`` or ``"sim:<dir>"``: which backend instance an entry belongs to."""
    return "nvml" if backend == "nvml" else f"sim:{sim_dir}"


@dataclass
class SavedState:
    """Everything in the file; empty when greend has nothing to restore."""

    gpus: list[GpuEntry] = field(default_factory=list)
    cpus: list[CpuEntry] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.gpus and not self.cpus

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": STATE_VERSION,
            "updated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "pid": os.getpid(),
            "gpus": [g.to_json() for g in self.gpus],
            "cpus": [c.to_json() for c in self.cpus],
        }


# --------------------------------------------------------------------------- parsing


class _Bad(ValueError):
    """A field of the file is wrong; the message names it."""


def _get(d: Any, key: str, where: str) -> Any:
    if not isinstance(d, dict):
        raise _Bad(f"{where} is not an object")
    if key not in d:
        raise _Bad(f"{where} has no {key!r}")
    return d[key]


def _str(d: Any, key: str, where: str, *, optional: bool = False) -> str | None:
    v = _get(d, key, where)
    if v is None and optional:
        return None
    if not isinstance(v, str) or not v:
        raise _Bad(f"{where}.{key} must be a non-empty string, got {v!r}")
    return v


def _int(d: Any, key: str, where: str, *, optional: bool = False) -> int | None:
    v = _get(d, key, where)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise _Bad(f"{where}.{key} must be an integer >= 0, got {v!r}")
    return v


def _num(d: Any, key: str, where: str, *, optional: bool = False) -> float | None:
    v = _get(d, key, where)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise _Bad(f"{where}.{key} must be a finite number >= 0, got {v!r}")
    return float(v)


def _knob(d: Any, name: str, where: str) -> KnobState:
    return KnobState(
        original=_num(d, "original", where, optional=True),
        set=_num(d, "set", where, optional=True),
        owner=str(_str(d, "owner", where)),
        updated_at=float(_num(d, "updated_at", where) or 0.0),
        pending=_num(d, "pending", where, optional=True) if "pending" in d else None,
    )


def _gpu(d: Any, where: str) -> GpuEntry:
    backend = _str(d, "backend", where)
    if backend not in GPU_BACKENDS:
        raise _Bad(f"{where}.backend must be one of {', '.join(GPU_BACKENDS)}, got {backend!r}")
    sim_dir = _str(d, "sim_dir", where, optional=True)
    if backend == "sim" and sim_dir is None:
        raise _Bad(f"{where}: a sim GPU needs its sim_dir")
    knobs_raw = _get(d, "knobs", where)
    if not isinstance(knobs_raw, dict):
        raise _Bad(f"{where}.knobs is not an object")
    knobs: dict[str, KnobState] = {}
    for name, kd in knobs_raw.items():
        if name not in GPU_KNOBS:
            raise _Bad(f"{where}.knobs has unknown knob {name!r} (known: {', '.join(GPU_KNOBS)})")
        knobs[name] = _knob(kd, name, f"{where}.knobs.{name}")
    if POWER_KNOB in knobs and knobs[POWER_KNOB].original is None:
        raise _Bad(f"{where}.knobs.{POWER_KNOB}.original is missing: the original power limit is unknown")
    return GpuEntry(
        backend=str(backend),
        sim_dir=sim_dir,
        uuid=str(_str(d, "uuid", where)),
        index=int(_int(d, "index", where) or 0),
        knobs=knobs,
    )


def _cpu(d: Any, where: str) -> CpuEntry:
    raw = _get(d, "constraints", where)
    if not isinstance(raw, list):
        raise _Bad(f"{where}.constraints is not a list")
    constraints = []
    for i, c in enumerate(raw):
        w = f"{where}.constraints[{i}]"
        constraints.append(
            CpuConstraintState(
                index=int(_int(c, "index", w) or 0),
                name=str(_str(c, "name", w)),
                original_uw=int(_int(c, "original_uw", w) or 0),
                set_uw=_int(c, "set_uw", w, optional=True),
            )
        )
    return CpuEntry(
        sysfs_root=str(_str(d, "sysfs_root", where)),
        zone_path=str(_str(d, "zone_path", where)),
        zone_id=str(_str(d, "zone_id", where)),
        name=str(_str(d, "name", where)),
        owner=str(_str(d, "owner", where)),
        set_w=_num(d, "set_w", where, optional=True),
        updated_at=float(_num(d, "updated_at", where) or 0.0),
        constraints=constraints,
    )


def parse_state(data: Any) -> SavedState:
    """A :class:`SavedState` from decoded JSON; ``ValueError`` names the bad field."""
    if not isinstance(data, dict):
        raise _Bad("the top level is not an object")
    fmt = data.get("format")
    if fmt != FORMAT:
        raise _Bad(f"format is {fmt!r}, expected {FORMAT!r} (not a greend saved-settings file)")
    version = data.get("version")
    if version != STATE_VERSION:
        raise _Bad(
            f"version is {version!r}; this greend reads version {STATE_VERSION} only "
            "(written by another greend release?)"
        )
    gpus_raw, cpus_raw = _get(data, "gpus", "file"), _get(data, "cpus", "file")
    if not isinstance(gpus_raw, list) or not isinstance(cpus_raw, list):
        raise _Bad("gpus and cpus must be lists")
    return SavedState(
        gpus=[_gpu(g, f"gpus[{i}]") for i, g in enumerate(gpus_raw)],
        cpus=[_cpu(c, f"cpus[{i}]") for i, c in enumerate(cpus_raw)],
    )


# --------------------------------------------------------------------------- the file


class StateFile:
    """``<state_dir>/saved-settings.json``: strict load, atomic save, removal when empty."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        # A StateDir once open: the file is opened through its descriptor (fsutil.StateDir).
        self._dir = state_dir if isinstance(state_dir, StateDir) else None
        self.state_dir = Path(state_dir)
        self.path = self.state_dir / STATE_FILE

    def _at(self, name: str = STATE_FILE) -> tuple[str | Path, int | None]:
        """(what to open, the directory descriptor it is relative to, if any)."""
        fd = self._dir.fd if self._dir is not None else None
        return (name, fd) if fd is not None else (self.state_dir / name, None)

    def _exists(self, name: str = STATE_FILE) -> bool:
        where, fd = self._at(name)
        try:
            os.stat(where, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def __repr__(self) -> str:
        return f"StateFile({str(self.path)!r})"

    def _error(self, what: str) -> StateError:
        return StateError(
            f"saved-settings file {self.path}: {what}. greend will not guess the settings it "
            "saved (they are the values to restore), so it leaves the file in place. Inspect it; "
            f"`greend restore --state-dir {self.state_dir} --force-defaults` moves it aside "
            "(as .corrupt-<timestamp>) and resets every GPU to its default clocks and power "
            "limit (RAPL limits it held must then be checked by hand under "
            "/sys/class/powercap/*/constraint_*_power_limit_uw)"
        )

    def exists(self) -> bool:
        return self._exists()

    def load(self) -> SavedState:
        """The saved state; an empty one when there is no file. Raises :class:`StateError`."""
        try:
            where, dir_fd = self._at()
            fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)  # never through a symlink
            with os.fdopen(fd, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return SavedState()
        except OSError as e:
            raise StateError(
                f"saved-settings file {self.path} cannot be read: {e.strerror or e}; greend needs "
                "it to know the settings to restore: check the state dir's path and permissions "
                "(greend runs as root)"
            ) from e
        if not raw.strip():
            raise self._error("is empty (truncated by a crash or a full disk?)")
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise self._error(f"is not UTF-8 text ({e})") from e
        except json.JSONDecodeError as e:
            raise self._error(f"is not valid JSON, truncated or corrupt ({e})") from e
        except (ValueError, RecursionError) as e:  # a number of over 4300 digits; nesting too deep
            raise self._error(f"is not a saved-settings file greend wrote ({type(e).__name__}: {e})") from e
        try:
            return parse_state(data)
        except (ValueError, RecursionError) as e:
            raise self._error(str(e)) from e

    def save(self, state: SavedState) -> None:
        """Write atomically; remove the file when ``state`` is empty."""
        if state.empty:
            self.remove()
            return
        text = json.dumps(state.to_json(), indent=1, sort_keys=True) + "\n"
        try:
            where, dir_fd = self._at()
            if dir_fd is None:
                self.state_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(Path(where), text, mode=0o600, dir_fd=dir_fd)
        except OSError as e:
            raise StateError(
                f"cannot write the saved-settings file {self.path}: {e.strerror or e} "
                "(greend does not change a device whose original it cannot save; "
                "check the state dir's permissions and free space)"
            ) from e

    def remove(self) -> None:
        """Delete the file (nothing left to restore)."""
        where, dir_fd = self._at()
        try:
            os.unlink(where, dir_fd=dir_fd)
        except FileNotFoundError:
            return
        except OSError as e:
            raise StateError(f"cannot remove the saved-settings file {self.path}: {e}") from e
        fsync_dir(self.state_dir, dir_fd)

    def move_aside(self) -> Path | None:
        """Rename the file to ``<name>.corrupt-<timestamp>`` (only on the user's
        ``--force-defaults``); returns the new path, None if there was no file."""
        if not self._exists():
            return None
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        dest = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while self._exists(dest.name):
            dest = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
            n += 1
        (src, dir_fd), (dst, _) = self._at(), self._at(dest.name)
        os.replace(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        fsync_dir(self.state_dir, dir_fd)
        log.warning("moved the saved-settings file %s aside to %s", self.path, dest)
        return dest
