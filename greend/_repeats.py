"""One log line for an error that repeats, wherever it repeats: a store that fails every
batch (a full disk), a GPU call that fails every tick or whose message counts the seconds
it has hung, simulated GPUs whose files cannot be written. The first is logged at once;
the same error again (its numbers aside) only after :data:`LOG_AGAIN_S`, with how many
times it came meanwhile; another error at once. Status and metrics show every failure as
it happens; only the log is spared."""

from __future__ import annotations

import re
from collections.abc import Hashable

__all__ = ["LOG_AGAIN_S", "Repeats"]

LOG_AGAIN_S = 300.0  # a repeated error is logged again after this long, with its count
_NUMBERS = re.compile(r"\d+")  # (a count of points or seconds does not make it another error)
_KEYS = 64  # errors remembered; past it, forgotten all at once (each then logged once more)


class Repeats:
    """The lines to log of errors that may repeat, one remembered error per key (a call, a
    store, or the message's own shape). Not locked: a race logs a line twice at worst."""

    def __init__(self, again_s: float = LOG_AGAIN_S) -> None:
        self.again_s = again_s
        self._last: dict[Hashable, tuple[str, float, int]] = {}  # key -> (shape, when logged, repeats since)

    @staticmethod
    def shape(message: str) -> str:
        """The message with its numbers blanked: a key for errors that have no other."""
        return _NUMBERS.sub("#", message)

    def line(self, key: Hashable, message: str, now_s: float) -> str | None:
        """The line to log for ``message`` under ``key`` at ``now_s`` (a monotonic clock),
        or None where the same error was logged under that key less than ``again_s`` ago."""
        shape = self.shape(message)
        last = self._last.get(key)
        if last is not None and last[0] == shape and now_s - last[1] < self.again_s:
            self._last[key] = (shape, last[1], last[2] + 1)
            return None
        if last is None and len(self._last) >= _KEYS:
            self._last.clear()
        self._last[key] = (shape, now_s, 0)
        if last is not None and last[0] == shape and last[2]:
            return f"{message} (and {last[2]} more like it in the last {now_s - last[1]:.0f} s)"
        return message
