"""The keys of ``greenctl top`` on a terminal, as htop and nvidia-smi users expect them:
``q`` quits, ``s`` or ``>`` sorts the jobs by the next column and ``<`` by the previous
one, ``p`` pauses and resumes the refreshes, ``?`` shows or hides a line that says so.

:class:`TerminalKeys` puts the terminal on ``fd`` in cbreak mode (keys arrive one at a
time, unechoed; Ctrl-C still interrupts) for as long as it is entered, and gives it back
as it found it on every way out: ``q``, Ctrl-C, an error. Only a TTY gets keys
(:meth:`TerminalKeys.for_stdin` is None otherwise): from a pipe ``top`` is as it was.
"""

from __future__ import annotations

import os
import select
import sys
import termios
import tty
from types import TracebackType
from typing import Any

__all__ = ["HELP_LINE", "KEYS_LINE", "TerminalKeys"]

# The frame's first line names the keys; "?" adds the line that explains them.
KEYS_LINE = "q quit  s/< > sort  p pause  ? help"
HELP_LINE = (
    "keys: q quit (Ctrl-C too); s or > sort the jobs by the next column, < by the previous one; "
    "p pause/resume the refreshes; ? hide this line"
)


class TerminalKeys:
    """Single keys from the terminal on ``fd`` (cbreak mode while entered)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._saved: list[Any] | None = None

    @classmethod
    def for_stdin(cls) -> TerminalKeys | None:
        """Keys from stdin when it is a terminal, else None (a pipe, a file, a job)."""
        try:
            fd = sys.stdin.fileno()
        except (AttributeError, OSError, ValueError):  # no stdin, or a stand-in without a descriptor
            return None
        return cls(fd) if os.isatty(fd) else None

    def __enter__(self) -> TerminalKeys:
        self._saved = termios.tcgetattr(self.fd)
        tty.setcbreak(self.fd, termios.TCSANOW)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.restore()

    def restore(self) -> None:
        """The terminal's settings back as they were when entered (once)."""
        saved, self._saved = self._saved, None
        if saved is not None:
            termios.tcsetattr(self.fd, termios.TCSADRAIN, saved)

    def wait(self, timeout_s: float) -> str:
        """The keys pressed within ``timeout_s`` (as soon as there is one; "" when none
        was). A terminal that went away (hung up) reads as ``q``."""
        ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout_s))
        if not ready:
            return ""
        try:
            data = os.read(self.fd, 64)
        except OSError:  # EIO: the terminal hung up
            return "q"
        return data.decode(errors="replace") if data else "q"
