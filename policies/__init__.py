"""Policies: pure strategies that turn a snapshot of measurements into a decision.

No I/O, no clocks, no sockets: a policy is ``decide(snapshot, state) -> Decision``
and is tested by replaying traces or the simulator.
"""

from __future__ import annotations

__all__: list[str] = []
