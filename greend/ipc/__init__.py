"""The Unix socket between the daemon and its clients: the server the daemon
runs and the client that ``greenctl`` and the training callback use. The wire
format is in ``docs/protocol.md``."""

from __future__ import annotations

from greend.ipc.client import Client
from greend.ipc.server import IpcServer

__all__ = ["Client", "IpcServer"]
