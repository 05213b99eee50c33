"""The Unix socket between the daemon and its clients: the server the daemon
runs (:mod:`greend.ipc.server`), the client ``greenctl`` uses
(:mod:`greend.ipc.client`) and the wire layer that client shares with the
training callback's sender (:mod:`greend.ipc.wire`). The wire format is in
``docs/protocol.md``.

The names below load on first use, so a training process that imports
:mod:`greend.ipc.wire` never loads the server."""

from __future__ import annotations

from typing import Any

__all__ = ["Client", "IpcServer"]


def __getattr__(name: str) -> Any:
    if name == "Client":
        from greend.ipc.client import Client

        return Client
    if name == "IpcServer":
        from greend.ipc.server import IpcServer

        return IpcServer
    raise AttributeError(f"module 'greend.ipc' has no attribute {name!r}")
