"""Simulated GPUs: the ``sim`` probe, and the simulator's public names.

Machines without GPUs run the whole daemon on ``greend run --sim N``. The simulator
is a model, not a stub, so that policies see the slowdown and the savings a real
GPU would show. It sits *behind* a fake of the ``pynvml`` module
(:mod:`greend.probes.fake_nvml`), so the daemon drives simulated GPUs through the very
same NVML code path as real ones: the ``sim`` probe registered here is an
:class:`~greend.probes.nvml.NvmlProbe` given a :class:`~greend.probes.fake_nvml.FakeNvml`
as its NVML module, and labels everything it reads ``source="sim"``.

The simulator, one concept a module (each imports only those above it in this list):

- ``_sim_model``: the GPU model: power, clocks, step time and energy at each precision
  (:class:`SimSpec`, :data:`H100`, :class:`StepCost`, :class:`PeakFlops`), pure.
- ``_sim_files``: atomic JSON writes and the file lock that the on-disk state uses.
- ``_sim_procs``: a simulated GPU's process table (``gpu<i>.procs.json``).
- ``_sim_device``: one simulated GPU's state on disk (:class:`SimGpu`): its file, its
  lock, the energy counter, deferred step writes, ``run_steps``.
- ``_sim_fleet``: a node's simulated GPUs (:func:`open_sim_gpus`, :func:`discover_sim_gpus`).
- :mod:`greend.probes.fake_nvml` (with ``_fake_nvml_faults``): the ``pynvml`` API over
  a fleet; :mod:`greend.probes.trace`: specs that replay measured power-limit profiles.
- this module: the probe's factory, above all of them, and the names users import
  (``from greend.probes.sim import H100, SimGpu``).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from greend.errors import ConfigError

from . import ProbeContext, register
from ._sim_device import SimGpu, SimState
from ._sim_files import file_lock, write_json_atomic
from ._sim_fleet import discover_sim_gpus, open_sim_gpus
from ._sim_model import (
    H100,
    MAX_MEM_SHARE,
    PRECISION_ALIASES,
    PRECISIONS,
    SPECS,
    Optimum,
    PeakFlops,
    SimSpec,
    StepCost,
    SweepPoint,
)
from .base import Probe
from .trace import TRACE_FILE_NAME, install_trace, trace_spec

__all__ = [
    "H100",
    "MAX_MEM_SHARE",
    "PRECISIONS",
    "PRECISION_ALIASES",
    "SPECS",
    "SIM_PARAMS",
    "Optimum",
    "PeakFlops",
    "SimGpu",
    "SimSpec",
    "SimState",
    "StepCost",
    "SweepPoint",
    "discover_sim_gpus",
    "file_lock",
    "open_sim_gpus",
    "write_json_atomic",
]

log = logging.getLogger(__name__)

# How stale another process's changes to a device may be seen by the daemon's sim
# probe (SimGpu.refresh_s, FakeNvml.refresh_s); 0 elsewhere: always fresh.
DAEMON_REFRESH_S = 0.02

# Workload parameters a caller may pass (``ctx.sim_params``); each is a scalar or
# one value per GPU. They are environment, not hardware state, so an explicit value
# overrides what the state file holds; caps and the counter are never reset.
SIM_PARAMS: tuple[str, ...] = ("background_load", "mem_share", "speed_factor", "spec", "trace")


def sim_params_from_config(params: Mapping[str, Any]) -> dict[str, Any]:
    """Validate ``ctx.sim_params`` keys (a ConfigError names the bad one)."""
    unknown = sorted(set(params) - set(SIM_PARAMS))
    if unknown:
        raise ConfigError(f"unknown sim parameter(s) {', '.join(unknown)}; allowed: {', '.join(SIM_PARAMS)}")
    return dict(params)


@register(
    "sim",
    default=False,
    help="simulated GPUs (greend run --sim N): an H100 model behind a fake NVML, source=sim",
)
def _sim_probe(ctx: ProbeContext) -> Probe:
    # Imported when the probe is built, not with this module: the fake imports pynvml,
    # which greend imports only where NVML is used (a node without it still starts),
    # and the nvml probe must not register ahead of this one (the registry's order is
    # the sampling order).
    from .fake_nvml import FakeNvml
    from .nvml import NvmlProbe

    state_dir = ctx.sim_dir
    if state_dir is None:
        state_dir = Path(tempfile.mkdtemp(prefix="greend-sim-"))
        log.info("no --sim-dir given: simulated GPU state in %s", state_dir)
    params = sim_params_from_config(ctx.sim_params)
    trace = params.pop("trace", None)
    if trace:
        install_trace(state_dir, trace)
    # A fleet that follows a measured profile keeps a copy in its state dir
    # (greend run --sim-trace puts it there), like the model a device was made as.
    trace_file = Path(state_dir) / TRACE_FILE_NAME
    if trace_file.exists() and "spec" not in params:
        params["spec"] = trace_spec(trace_file)
        log.info("simulated GPUs follow the measured profile %s (source=sim)", trace_file)
    fake = FakeNvml(state_dir, n=ctx.sim_gpus or None, refresh_s=DAEMON_REFRESH_S, **params)
    return NvmlProbe(nvml=fake, source="sim")
