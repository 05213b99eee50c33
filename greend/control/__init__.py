"""Control: every ``[policy] period_s`` the loop builds a snapshot, asks the
policy for a decision and applies it through the actuators (:mod:`.loop`); an
admin's caps and policy changes come through its socket ops (:mod:`.ops`). The
loop sees the node through a context (:mod:`.context`) and runs the power-limit
sweeps of ``greenctl profile record`` (:mod:`.profile`)."""

from __future__ import annotations

from greend.control.loop import ControlContext, ControlLoop
from greend.control.ops import ControlOps

__all__ = ["ControlContext", "ControlLoop", "ControlOps"]
