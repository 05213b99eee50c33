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

import dataclasses
import difflib
import importlib.util
from typing import Any

__all__ = ["available", "check_callback_kwargs"]


def check_callback_kwargs(adapter: str, kwargs: dict[str, Any]) -> None:
    """Refuse, when the adapter is made, a keyword :class:`greend.GreenCallback` does not
    take (``gpu=`` for ``gpus=``): it raised only when training started, inside ``fit()``
    or ``train()``, on every rank. The message names the closest keyword."""
    from greend.training.options import CallbackOptions

    known = [f.name for f in dataclasses.fields(CallbackOptions)] + ["options"]
    for name in kwargs:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]}=?)" if close else ""
            raise TypeError(f"{adapter}: GreenCallback takes no argument {name}={hint}")


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
