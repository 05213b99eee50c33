"""The sender's options and counters (:class:`greend.training.sender.Sender`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SenderOptions", "SenderStats"]


@dataclass
class SenderStats:
    """Counters of the callback's reporting, for tests, benchmarks and curious users."""

    recorded: int = 0  # steps recorded by the training thread
    sent: int = 0  # step records handed to the socket
    dropped: int = 0  # step records lost (queue full, or unsent when a connection died)
    connects: int = 0  # successful registrations (1 + reconnects)
    connected: bool = False
    messages: int = 0  # messages written (steps, heartbeat, register, end)
    malformed: int = 0  # unreadable lines from the daemon
    last_error: str | None = None


@dataclass(frozen=True)
class SenderOptions:
    """The sender's timings, in seconds (the ``GreenCallback`` arguments of the same names).

    ``heartbeat_s``: how often to heartbeat when no steps flow (the daemon's
    register reply may ask for another figure). ``flush_interval_s``: how often
    queued steps go out. ``connect_timeout_s``: for ``connect()``, and how long the
    callback's constructor waits for the first registration. ``reply_timeout_s``:
    for any reply. ``stall_timeout_s``: a daemon that reads nothing this long is
    gone. ``reconnect_min_s``/``reconnect_max_s``: the back-off between attempts.
    ``close_timeout_s``: how long closing may take to flush and say ``end``.
    """

    heartbeat_s: float = 5.0
    flush_interval_s: float = 0.1
    connect_timeout_s: float = 1.0
    reply_timeout_s: float = 5.0
    stall_timeout_s: float = 10.0
    reconnect_min_s: float = 2.0
    reconnect_max_s: float = 5.0
    close_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        for name in (
            "heartbeat_s",
            "flush_interval_s",
            "connect_timeout_s",
            "reply_timeout_s",
            "stall_timeout_s",
            "reconnect_min_s",
            "reconnect_max_s",
            "close_timeout_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}={value!r}: must be a number > 0 (seconds)")
        if self.reconnect_max_s < self.reconnect_min_s:
            raise ValueError(f"reconnect_max_s={self.reconnect_max_s} is below reconnect_min_s={self.reconnect_min_s}")
