"""Actuators: the knobs (GPU locked clocks and power limits through NVML, CPU
package limits through RAPL), the saved originals on disk, and restore."""

from __future__ import annotations

from greend.actuators.controller import Controller
from greend.actuators.gpu import GpuBackend, NvmlGpuBackend
from greend.actuators.rapl import RaplBackend
from greend.actuators.report import RestoreFailure, RestoreReport
from greend.actuators.state import StateFile

__all__ = ["Controller", "GpuBackend", "NvmlGpuBackend", "RaplBackend", "RestoreFailure", "RestoreReport", "StateFile"]
