"""The daemon side: the tick loop, its probes and stores, the socket's routes and
the status views (``greend run``).

Read :mod:`greend.daemon.core` first: it wires probes, the ledger, the job
registry, the control loop, the IPC server and the stores together.
"""

from __future__ import annotations

from greend.daemon.core import Daemon

__all__ = ["Daemon"]
