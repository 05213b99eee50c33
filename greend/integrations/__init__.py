"""Adapters of :class:`greend.GreenCallback` for training frameworks.

Each adapter lives in its own module and imports its framework only when that
module is imported, so ``import greend.integrations`` never pulls in Lightning
or transformers:

* :mod:`greend.integrations.lightning`: ``GreenLightningCallback``, a PyTorch
  Lightning ``Callback`` (``lightning.pytorch`` or ``pytorch_lightning``).
* :mod:`greend.integrations.hf`: ``GreenHFCallback``, a Hugging Face
  ``transformers.TrainerCallback``.

Importing an adapter whose framework is missing raises ``ImportError`` with
the ``pip install`` line to fix it. :func:`available` says which are usable.
"""

from __future__ import annotations

import importlib.util

__all__ = ["available"]


def available() -> dict[str, bool]:
    """Which adapters' frameworks are installed (checked without importing them)."""

    def has(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            return False

    return {
        "lightning": has("lightning") or has("pytorch_lightning"),
        "hf": has("transformers"),
    }
