"""The training side: :class:`GreenCallback` and what it needs inside a
training process (FLOP counting, precision switching, the accuracy guard).
It imports torch; the daemon never imports this package, and ``greenctl`` only in ``greenctl demo``.
Framework adapters are in :mod:`greend.integrations`."""

from __future__ import annotations

from greend.errors import GreendWarning
from greend.training.callback import GreenCallback
from greend.training.step import Step

__all__ = ["GreenCallback", "GreendWarning", "Step"]
