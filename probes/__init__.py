"""Sources of readings, one module each, registered by name.

The registry (:data:`REGISTRY`) is the one list of the probes there are: the
config checks ``[probes] enabled`` against it. Adding a probe: copy a neighbour
(``host.py`` is the smallest), implement the :class:`~greend.probes.base.Probe`
protocol (and any of the optional abilities beside it), decorate its factory with
``@register("name", default=True|False)`` and put the module's name in
``_BUILTIN_PROBE_MODULES``. The config's ``[probes] enabled`` list and ``--sim N``
choose which run.

A module whose name starts with ``_`` is an internal of one probe, imported through
that probe's module: the simulator's (``_sim_*``, behind :mod:`greend.probes.sim`) and
its fake NVML's faults (``_fake_nvml_faults``, behind :mod:`greend.probes.fake_nvml`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from .base import (
    CpuReading,
    GpuReading,
    HostReading,
    MeasuresProcesses,
    Probe,
    ProbeInfo,
    Readings,
    SampledEvery,
    ShowsClockCaps,
    SimulatesGpus,
)

__all__ = [
    "CpuReading",
    "GpuReading",
    "HostReading",
    "MeasuresProcesses",
    "Probe",
    "ProbeContext",
    "ProbeInfo",
    "REGISTRY",
    "Readings",
    "SampledEvery",
    "ShowsClockCaps",
    "SimulatesGpus",
    "build",
    "register",
]


@dataclass
class ProbeContext:
    """Everything a probe may need from outside, injected (no module constants)."""

    sysfs_root: Path = Path("/sys")
    sim_gpus: int = 0
    sim_dir: Path | None = None
    sim_params: dict[str, Any] = field(default_factory=dict)
    cpu_tdp_w: float = 0.0
    nvml_module: ModuleType | Any | None = None  # None: import pynvml
    job_pids: Callable[[], list[int]] = lambda: []
    rapl_present: Callable[[], bool] = lambda: False
    tick_period_s: float = 0.1  # the daemon's tick period: how long its tick may wait for reads


ProbeFactory = Callable[[ProbeContext], Probe]


@dataclass(frozen=True)
class Registration:
    name: str
    factory: ProbeFactory
    default: bool
    help: str


REGISTRY: dict[str, Registration] = {}


def register(name: str, *, default: bool, help: str) -> Callable[[ProbeFactory], ProbeFactory]:
    def deco(factory: ProbeFactory) -> ProbeFactory:
        if name in REGISTRY:
            raise ValueError(f"probe {name!r} registered twice")
        REGISTRY[name] = Registration(name, factory, default, help)
        return factory

    return deco


# The modules of the probes greend ships, imported for their registrations. The
# order is the sampling order (rapl before host: host asks whether RAPL is there).
_BUILTIN_PROBE_MODULES = ("sim", "nvml", "rapl", "host")


def _load_all() -> None:
    for module in _BUILTIN_PROBE_MODULES:
        importlib.import_module(f"{__name__}.{module}")


def build(names: list[str], ctx: ProbeContext) -> list[Probe]:
    """Instantiate the named probes (unopened), in registry order."""
    _load_all()
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise KeyError(", ".join(unknown))
    return [REGISTRY[n].factory(ctx) for n in REGISTRY if n in names]


def available_names() -> list[str]:
    """Every registered probe, in sampling order."""
    _load_all()
    return list(REGISTRY)


def default_names() -> list[str]:
    _load_all()
    return [n for n, r in REGISTRY.items() if r.default]
