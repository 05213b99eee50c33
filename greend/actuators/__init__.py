"""Actuators: the knobs (GPU locked clocks and power limits through NVML, CPU
package limits through RAPL), the saved originals on disk, and restore."""

from __future__ import annotations

from greend.actuators.controller import Controller
from greend.actuators.state import StateFile

__all__ = ["Controller", "StateFile"]
