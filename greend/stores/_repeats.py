"""One log line for an error that repeats: a store that fails every second (a full disk,
a file gone read-only) logs its error once, then at most every :data:`LOG_AGAIN_S` with
how many times it happened meanwhile; its status shows every failure as it happens."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

__all__ = ["LOG_AGAIN_S", "RepeatedErrors"]

LOG_AGAIN_S = 300.0  # a repeated error is logged again after this long, with its count
_NUMBERS = re.compile(r"\d+")  # (a count of points or bytes in a message does not make it another error)


class RepeatedErrors:
    """Errors of one logger, each logged once per :data:`LOG_AGAIN_S` (thread-safe enough:
    a race logs a line twice at worst)."""

    def __init__(self, log: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.clock = clock
        self._seen: dict[str, tuple[float, int]] = {}  # shape of the message -> (when logged, repeats since)

    def error(self, fmt: str, *args: object) -> None:
        message = fmt % args if args else fmt
        shape = _NUMBERS.sub("#", message)
        now = self.clock()
        last = self._seen.get(shape)
        if last is not None and now - last[0] < LOG_AGAIN_S:
            self._seen[shape] = (last[0], last[1] + 1)
            return
        repeats = last[1] if last is not None else 0
        if len(self._seen) > 64:
            self._seen.clear()
        self._seen[shape] = (now, 0)
        again = f" (and {repeats} more like it in the last {LOG_AGAIN_S:g} s)" if repeats else ""
        self.log.error("%s%s", message, again)
