"""The fake NVML's faults: what each simulated GPU (and the node) does wrong, on disk.

Faults live in ``<state_dir>/faults.json`` beside the simulated GPUs, so a test can
inject one into a daemon running as another process;
:class:`greend.probes.fake_nvml.FakeNvml` re-reads the file whenever it changes and
edits it under a lock (``inject``, ``set_hang``...). Its module docstring lists what
each fault does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml

from ._sim_files import write_json_atomic

FAULTS_FILE = "faults.json"


@dataclass
class GpuFaults:
    lost: bool = False
    no_energy_counter: bool = False
    no_permission: bool = False
    no_locked_clocks: bool = False
    reset_required: bool = False
    mig: bool = False
    persistence_off: bool = False
    hung: bool = False  # every call on the GPU hangs (hang_s, or until cleared)


_NO_FAULTS = GpuFaults()  # shared by every GPU without faults; never mutated


@dataclass
class Faults:
    """The contents of ``faults.json``."""

    init_error: int | None = None  # an NVML_ERROR_* code nvmlInit raises
    gpus: dict[int, GpuFaults] = field(default_factory=dict)
    slow_ms: int = 0  # every call sleeps this long first
    hang: str = ""  # "fn" or "fn:gpu": that call sleeps hang_s (None: until cleared)
    hang_s: float | None = None
    uninit_serial: int = 0  # bumped by drop_init: each process drops its init count once
    order: list[int] = field(default_factory=list)  # NVML index -> simulated GPU ([]: the same)
    order_serial: int = 0  # bumped by reorder: handles of an older numbering are stale

    def gpu(self, index: int) -> GpuFaults:
        """The faults of GPU ``index`` (read-only: change faults with ``FakeNvml.inject``)."""
        return self.gpus.get(index) or _NO_FAULTS

    def to_json(self) -> dict[str, Any]:
        return {
            "init_error": self.init_error,
            "gpus": {str(i): vars(g).copy() for i, g in sorted(self.gpus.items())},
            "slow_ms": self.slow_ms,
            "hang": self.hang,
            "hang_s": self.hang_s,
            "uninit_serial": self.uninit_serial,
            "order": list(self.order),
            "order_serial": self.order_serial,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Faults:
        return cls(
            init_error=None if d.get("init_error") is None else int(d["init_error"]),
            gpus={int(i): GpuFaults(**g) for i, g in (d.get("gpus") or {}).items()},
            slow_ms=int(d.get("slow_ms") or 0),
            hang=str(d.get("hang") or ""),
            hang_s=None if d.get("hang_s") is None else float(d["hang_s"]),
            uninit_serial=int(d.get("uninit_serial") or 0),
            order=[int(i) for i in d.get("order") or []],
            order_serial=int(d.get("order_serial") or 0),
        )

    def hangs(self, fn: str, gpu: int | None) -> bool:
        """Whether the call ``fn`` on ``gpu`` (None: node-wide) hangs."""
        if gpu is not None and self.gpu(gpu).hung:
            return True
        if not self.hang:
            return False
        name, _, which = self.hang.partition(":")
        return name == fn and (not which or (gpu is not None and int(which) == gpu))


def error_code(code: int | str) -> int:
    """``12``, ``"LIBRARY_NOT_FOUND"`` or ``"NVML_ERROR_LIBRARY_NOT_FOUND"`` -> 12."""
    if isinstance(code, int):
        return code
    name = code if code.startswith("NVML_ERROR_") else f"NVML_ERROR_{code.upper()}"
    value = getattr(pynvml, name, None)
    if not isinstance(value, int):
        raise ValueError(f"unknown NVML error {code!r}")
    return value


def read_faults(state_dir: Path | str) -> Faults:
    path = Path(state_dir) / FAULTS_FILE
    try:
        return Faults.from_json(json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        return Faults()


def write_faults(state_dir: Path | str, faults: Faults) -> None:
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(state_dir) / FAULTS_FILE, faults.to_json())
