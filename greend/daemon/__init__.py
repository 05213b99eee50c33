"""The daemon side (``greend run``): :mod:`.core` wires probes, the ledger, the job
registry, the control loop, the stores and the socket together and runs the tick loop;
:mod:`.probing` opens and samples the probes, :mod:`.stores` opens, retries and lists
the stores, :mod:`.routes` answers the socket's ops, :mod:`.status` builds the status
document, :mod:`.tick` holds the latest tick (TickReadings), :mod:`.sdnotify` talks to systemd.

Routes and status get what they use as a small context (:class:`.routes.RouteContext`,
:class:`.status.StatusContext`), never the daemon; the modules here import each other
by their full names, never this package, which sits above them.
"""

from __future__ import annotations

from greend.daemon.core import Daemon

__all__ = ["Daemon"]
