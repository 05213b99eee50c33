"""sd_notify(3) without libsystemd: readiness, status and the watchdog.

systemd passes a datagram socket in ``$NOTIFY_SOCKET`` to a ``Type=notify``
service: a filesystem path (``/run/systemd/notify``) or, with a leading ``@``, a
name in the abstract namespace. Each message is newline-separated
``KEY=VALUE`` assignments in one ``AF_UNIX``/``SOCK_DGRAM`` datagram::

    ready()        READY=1       startup finished: the socket is listening
    status(text)   STATUS=...    one line shown by ``systemctl status greend``
    watchdog()     WATCHDOG=1    "still alive", at least every WatchdogSec/2
    stopping()     STOPPING=1    shutdown began (restore runs next)

The unit has ``NotifyAccess=main``: send from the daemon's own process (any of
its threads), never from a child. Nothing here raises: outside systemd (no
``$NOTIFY_SOCKET``), or when the send fails, every call returns False, so
callers never need a guard.

``watchdog_interval_s()`` reads ``$WATCHDOG_USEC`` and honours ``$WATCHDOG_PID``
the way ``sd_watchdog_enabled(3)`` does: a pid other than ours means the
watchdog is meant for another process (we were started by the service, not as
it) and the answer is None. :class:`WatchdogPinger` turns that into "ping when
half the interval has passed", for a loop that ticks much faster.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

__all__ = [
    "WatchdogPinger",
    "notify",
    "ready",
    "status",
    "stopping",
    "watchdog",
    "watchdog_interval_s",
]

log = logging.getLogger(__name__)


def _address(raw: str) -> str | None:
    """The sendto() address for ``$NOTIFY_SOCKET``; None for kinds we cannot use."""
    if raw.startswith("@"):
        return "\0" + raw[1:]  # abstract namespace: leading NUL, no trailing NUL
    if raw.startswith("/"):
        return raw
    return None  # e.g. "vsock:CID:PORT" (systemd 253+, VMs): not supported here


def notify(state: str, *, environ: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``) to systemd; True when it was sent.

    False, never an exception, when ``$NOTIFY_SOCKET`` is unset or unusable, or
    the send fails (the failure is logged at debug level).
    """
    env = os.environ if environ is None else environ
    raw = env.get("NOTIFY_SOCKET", "")
    if not raw:
        return False
    addr = _address(raw)
    if addr is None or len(addr) < 2:
        log.debug("NOTIFY_SOCKET=%r: not a path or @abstract name, not notifying", raw)
        return False
    try:
        data = state.encode("utf-8")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sent = sock.sendto(data, addr)
        return sent == len(data)
    except Exception as e:
        log.debug("sd_notify %r to %r failed: %s", state, raw, e)
        return False


def ready() -> bool:
    """Startup is complete: systemd moves the unit from "activating" to "active"."""
    return notify("READY=1")


def stopping() -> bool:
    """Shutdown has begun (restore and store flushes follow)."""
    return notify("STOPPING=1")


def watchdog() -> bool:
    """Keep-alive for ``WatchdogSec=``."""
    return notify("WATCHDOG=1")


def status(text: str) -> bool:
    """One free-form line for ``systemctl status``; newlines become spaces."""
    return notify("STATUS=" + " ".join(text.splitlines()))


def watchdog_interval_s(*, environ: Mapping[str, str] | None = None) -> float | None:
    """The watchdog timeout in seconds, or None when no watchdog is meant for us.

    As ``sd_watchdog_enabled(3)``: ``$WATCHDOG_USEC`` must be a positive integer;
    if ``$WATCHDOG_PID`` is set it must be this process's pid. Ping at least every
    half of the returned interval.
    """
    env = os.environ if environ is None else environ
    usec = env.get("WATCHDOG_USEC", "")
    if not usec:
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    if value <= 0:
        return None
    pid = env.get("WATCHDOG_PID", "")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    return value / 1e6


class WatchdogPinger:
    """Send WATCHDOG=1 from a fast loop, but only once per half interval.

    ``interval_s``: the watchdog timeout (default: :func:`watchdog_interval_s`);
    None or 0 disables it, and :meth:`tick` then does nothing.
    """

    def __init__(
        self,
        interval_s: float | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        send: Callable[[], bool] = watchdog,
        from_env: bool = True,
    ) -> None:
        if interval_s is None and from_env:
            interval_s = watchdog_interval_s()
        self.interval_s = interval_s if interval_s and interval_s > 0 else None
        self._clock = clock
        self._send = send
        self._last_s: float | None = None
        self.pings = 0

    @property
    def enabled(self) -> bool:
        return self.interval_s is not None

    def tick(self) -> bool:
        """Ping if half the interval has passed since the last ping; True if sent."""
        if self.interval_s is None:
            return False
        now = self._clock()
        if self._last_s is not None and now - self._last_s < self.interval_s / 2:
            return False
        self._last_s = now
        sent = self._send()
        if sent:
            self.pings += 1
        return sent
