"""greend: a per-node energy controller for GPU training.

The daemon (``greend run``) measures GPU and CPU energy, and reports it to
time-series stores; ``greenctl`` shows and steers it. Training processes import
:class:`GreenCallback` (it needs the ``train`` extra: torch).
"""

from __future__ import annotations

import logging
from typing import Any

from greend.errors import GreendWarning

__version__ = "0.1.0"

__all__ = ["GreenCallback", "GreendWarning", "__version__"]

logging.getLogger(__name__).addHandler(logging.NullHandler())


def __getattr__(name: str) -> Any:
    # The callback pulls in the training side lazily, so the daemon and greenctl
    # never import torch.
    if name == "GreenCallback":
        from greend.training import callback

        return getattr(callback, name)
    raise AttributeError(f"module 'greend' has no attribute {name!r}")
