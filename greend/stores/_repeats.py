"""A store's errors that repeat (a full disk, a file gone read-only, failing every batch)
logged once, then at most every :data:`LOG_AGAIN_S` with how many times they came
(greend._repeats); the store's status shows every failure as it happens."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from greend._repeats import LOG_AGAIN_S, Repeats

__all__ = ["LOG_AGAIN_S", "RepeatedErrors"]


class RepeatedErrors:
    """Errors of one logger, each shape of message logged once per :data:`LOG_AGAIN_S`."""

    def __init__(self, log: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.clock = clock
        self._repeats = Repeats()

    def error(self, fmt: str, *args: object) -> None:
        message = fmt % args if args else fmt
        line = self._repeats.line(Repeats.shape(message), message, self.clock())
        if line is not None:
            self.log.error("%s", line)
