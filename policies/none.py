"""The default policy: measure and report, decide nothing.

Copy this file to start a new policy: a class with ``name``, ``help``, ``PARAMS``,
``params()``, ``new_state()`` and a pure ``decide(snapshot, state)``.
"""

from __future__ import annotations

from typing import Any

from .base import Decision, Snapshot
from .params import Param, validate_params

__all__ = ["NonePolicy"]


class NonePolicy:
    """Leaves every GPU at whatever is in force (greend only measures)."""

    name = "none"
    help = "measure and report only; never sets a clock, a power limit or a precision"
    PARAMS: tuple[Param, ...] = ()

    def __init__(self, **params: Any) -> None:
        self._params = validate_params(self.name, self.PARAMS, params)

    def params(self) -> dict[str, Any]:
        return dict(self._params)

    def new_state(self) -> None:
        return None

    def decide(self, snap: Snapshot, state: Any) -> Decision:
        return Decision(reason="policy none: measuring only")
