"""Warning once: how every part of the training side reports a problem without
flooding the training's log. The first problem of a callback is also a
:class:`greend.GreendWarning`, and so is each one that takes some of the job's
protection away (``loud``: the accuracy checks off, a rollback that failed): greend's
log lines reach no handler unless the job configures logging, and the first warning is
often spent on something harmless (a daemon that starts late). A problem already
reported goes to the debug log."""

from __future__ import annotations

import logging
import threading
import warnings

from greend.errors import GreendWarning

__all__ = ["OnceWarnings"]

# The callback's log lines, wherever in greend.training they are made, go to one logger.
log = logging.getLogger("greend.training.callback")


class OnceWarnings:
    """One callback's warnings: each key logged once (both threads use it)."""

    def __init__(self) -> None:
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self.first_done = False  # the first warning (a GreendWarning) has been given

    def __contains__(self, key: str) -> bool:
        return key in self._warned

    def warn(self, key: str, message: str, *, level: int = logging.WARNING, loud: bool = False) -> None:
        """Log ``message`` once per key; the very first problem is also a GreendWarning, and
        a ``loud`` one (protection lost) whatever came before."""
        with self._lock:
            if key in self._warned:
                log.debug("%s", message)
                return
            self._warned.add(key)
            first = (loud or not self.first_done) and level >= logging.WARNING
            if first:
                self.first_done = True
        log.log(level, "greend: %s", message)
        if first:
            suffix = "training continues" if loud else "training continues unchanged"
            warnings.warn(f"greend: {message} ({suffix})", GreendWarning, stacklevel=4)
