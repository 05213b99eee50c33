"""Sources of readings, one module each, registered by name.

Adding a probe: copy a neighbour (``host.py`` is the smallest), implement the
:class:`~greend.probes.base.Probe` protocol, and decorate its factory with
``@register("name", default=True|False)``. The config's ``[probes] enabled``
list and ``--sim N`` choose which run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

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


def _load_all() -> None:
    # Import for the side effect of registration. Order is the sampling order.
    from . import sim, nvml, rapl, host  # noqa: F401  (rapl before host: host asks if RAPL is there)


def build(names: list[str], ctx: ProbeContext) -> list[Probe]:
    """Instantiate the named probes (unopened), in registry order."""
    _load_all()
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise KeyError(", ".join(unknown))
    return [REGISTRY[n].factory(ctx) for n in REGISTRY if n in names]


def available_names() -> list[str]:
    _load_all()
    return list(REGISTRY)


def default_names() -> list[str]:
    _load_all()
    return [n for n, r in REGISTRY.items() if r.default]
