"""A small synchronous client of the daemon's socket, used by ``greenctl``."""

from __future__ import annotations

import itertools
import json
import socket
import time
from pathlib import Path
from typing import Any

from greend.errors import DaemonUnavailable, RequestRefused
from greend.protocol import MAX_MESSAGE_BYTES, PROTOCOL_VERSION, encode

__all__ = ["Client"]


def _connect_retrying(s: socket.socket, path: str, timeout_s: float) -> None:
    """connect(), retrying EAGAIN: a Unix socket whose backlog is full refuses at once
    instead of queueing, which a burst of clients can cause."""
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        try:
            s.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(0.1, delay * 2)


class Client:
    def __init__(self, path: Path, timeout_s: float = 5.0) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._buf = b""
        self._ids = itertools.count(1)

    def __enter__(self) -> Client:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout_s)
        try:
            _connect_retrying(s, str(self.path), self.timeout_s)
        except FileNotFoundError:
            s.close()
            raise DaemonUnavailable(
                f"no greend socket at {self.path}: is the daemon running? "
                "(systemctl status greend, or start one: greend run --sim 2 --socket PATH; "
                "point greenctl at it with --socket or $GREEND_SOCKET)"
            ) from None
        except PermissionError:
            s.close()
            raise DaemonUnavailable(
                f"permission denied on {self.path}: join the socket's group "
                "(usermod -aG greend $USER, then log in again) or use sudo"
            ) from None
        except OSError as e:
            s.close()
            raise DaemonUnavailable(f"cannot connect to {self.path}: {e.strerror or e}") from None
        self._sock = s

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def request(self, op: str, **fields: Any) -> Any:
        """Send one request and return its result; raise RequestRefused on an error reply."""
        if self._sock is None:
            self.connect()
        assert self._sock is not None
        mid = next(self._ids)
        msg = {"v": PROTOCOL_VERSION, "id": mid, "op": op, **fields}
        try:
            self._sock.sendall(encode(msg))
            while True:
                reply = self._read_message()
                if "event" in reply:
                    continue  # pushed events are not for a request/response client
                if reply.get("id") not in (mid, None):
                    continue
                break
        except (socket.timeout, TimeoutError):
            raise DaemonUnavailable(f"greend at {self.path} did not answer within {self.timeout_s} s") from None
        except OSError as e:
            raise DaemonUnavailable(f"lost the connection to greend at {self.path}: {e}") from None
        if reply.get("ok"):
            return reply.get("result")
        err = reply.get("error") or {}
        raise RequestRefused(err.get("code", "error"), err.get("message", "request refused"), err.get("field"))

    def _read_message(self) -> dict[str, Any]:
        assert self._sock is not None
        while b"\n" not in self._buf:
            chunk = self._sock.recv(65536)
            if not chunk:
                raise DaemonUnavailable(f"greend at {self.path} closed the connection")
            self._buf += chunk
            if len(self._buf) > 64 * MAX_MESSAGE_BYTES:
                raise DaemonUnavailable("reply too large")
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)
