"""Control: every ``[policy] period_s`` the loop builds a snapshot, asks the
policy for a decision and applies it through the actuators."""

from __future__ import annotations

from greend.control.loop import ControlLoop

__all__ = ["ControlLoop"]
