"""A node's simulated GPUs: open (or create) the devices 0..n-1 of a state directory.

Each workload parameter of :func:`open_sim_gpus` is a scalar for every GPU or one value
per GPU; :func:`discover_sim_gpus` counts the devices a directory already holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ._sim_device import SimGpu
from ._sim_model import H100, SPECS, SimSpec


def _per_gpu(value: Any, i: int, name: str) -> Any:
    if isinstance(value, (list, tuple)):
        if i >= len(value):
            raise ValueError(f"{name} has {len(value)} values, need one per GPU (gpu{i} missing)")
        return value[i]
    return value


def open_sim_gpus(
    state_dir: Path | str,
    n: int,
    *,
    spec: SimSpec | str = H100,
    clock: Callable[[], float] = time.time,
    background_load: float | Sequence[float] | None = None,
    mem_share: float | Sequence[float] | None = None,
    speed_factor: float | Sequence[float] | None = None,
    initial_energy_mj: float = 0.0,
    refresh_s: float = 0.0,
) -> list[SimGpu]:
    """Open (creating where needed) simulated GPUs 0..n-1 in ``state_dir``.

    Each workload parameter is a scalar for all GPUs or one value per GPU.
    """
    if isinstance(spec, str):
        if spec not in SPECS:
            raise ValueError(f"unknown sim spec {spec!r}; allowed: {', '.join(SPECS)}")
        spec = SPECS[spec]
    return [
        SimGpu(
            state_dir,
            i,
            spec,
            clock,
            background_load=_per_gpu(background_load, i, "background_load"),
            mem_share=_per_gpu(mem_share, i, "mem_share"),
            speed_factor=_per_gpu(speed_factor, i, "speed_factor"),
            initial_energy_mj=initial_energy_mj,
            refresh_s=refresh_s,
        )
        for i in range(n)
    ]


def discover_sim_gpus(state_dir: Path | str) -> int:
    """How many consecutive ``gpu<i>.json`` files (from 0) exist in ``state_dir``."""
    n = 0
    while (Path(state_dir) / f"gpu{n}.json").exists():
        n += 1
    return n
