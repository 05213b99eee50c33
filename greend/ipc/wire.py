"""The client side of the wire: what ``greenctl``'s :class:`greend.ipc.client.Client`
and the training callback's sender (:mod:`greend.training.sender`) both do on the
daemon's socket.

* :func:`connect_unix` opens the Unix stream socket (optionally retrying a full
  backlog, which refuses at once with EAGAIN instead of queueing);
* :func:`frame_request` / :func:`frame_message` put a message on the wire with
  :func:`greend.protocol.encode`;
* :class:`LineReader` splits what arrives into lines, bounded so a peer that never
  sends a newline cannot grow the buffer without end; :func:`read_line_blocking`
  waits for one line on a blocking socket;
* :func:`decode` turns a line into a message and :func:`is_event` tells a pushed
  event from a reply.

What each client does with a failure differs (``greenctl`` raises, the training
callback fails open), so these functions raise plain exceptions and leave the
wording to the caller. Nothing here imports the daemon or torch.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

from greend.protocol import PROTOCOL_VERSION, encode

__all__ = [
    "RECV_BYTES",
    "LineReader",
    "LineTooLong",
    "MalformedMessage",
    "PeerClosed",
    "connect_retrying",
    "connect_unix",
    "decode",
    "frame_message",
    "frame_request",
    "is_event",
    "positive",
    "read_line_blocking",
]

RECV_BYTES = 65536  # one recv() at most


def positive(v: Any, most: float) -> float | None:
    """A number the peer sent, where it is one in (0, most]; else None."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= most else None


class PeerClosed(EOFError):
    """The daemon closed the connection."""


class LineTooLong(ValueError):
    """More bytes than the reader's limit arrived without a newline."""


class MalformedMessage(ValueError):
    """A line that is not a JSON object; the message says what it was."""


def connect_retrying(s: socket.socket, path: str, timeout_s: float) -> None:
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


def connect_unix(path: str, timeout_s: float, *, retry_busy: bool) -> socket.socket:
    """A connected, blocking Unix stream socket with ``timeout_s`` as its timeout.

    ``retry_busy``: retry a full backlog within ``timeout_s`` (:func:`connect_retrying`);
    otherwise EAGAIN is raised at once. Raises what ``connect()`` raises
    (FileNotFoundError, PermissionError, other OSErrors), the socket closed.
    """
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    try:
        if retry_busy:
            connect_retrying(s, path, timeout_s)
        else:
            s.connect(path)
    except BaseException:
        s.close()
        raise
    return s


def frame_request(request_id: int, op: str, fields: dict[str, Any]) -> bytes:
    """A request that expects a reply carrying ``request_id``."""
    return encode({"v": PROTOCOL_VERSION, "id": request_id, "op": op, **fields})


def frame_message(op: str, fields: dict[str, Any]) -> bytes:
    """A message without an id: the daemon answers it only when it is malformed (``steps``)."""
    return encode({"v": PROTOCOL_VERSION, "op": op, **fields})


class LineReader:
    """Accumulates received bytes and hands out complete lines (without the newline).

    ``limit`` bounds what may pile up without a newline; the caller decides what an
    overlong line means (see :meth:`overflowing` and :func:`read_line_blocking`).
    """

    __slots__ = ("buffer", "limit")

    def __init__(self, limit: int) -> None:
        self.buffer = b""
        self.limit = limit

    def clear(self) -> None:
        self.buffer = b""

    def feed(self, chunk: bytes) -> None:
        self.buffer += chunk

    def has_line(self) -> bool:
        return b"\n" in self.buffer

    def pop_line(self) -> bytes | None:
        """The next complete line, or None when no newline has arrived yet."""
        nl = self.buffer.find(b"\n")
        if nl < 0:
            return None
        line, self.buffer = self.buffer[:nl], self.buffer[nl + 1 :]
        return line

    def overflowing(self) -> bool:
        """More than ``limit`` bytes are buffered."""
        return len(self.buffer) > self.limit


def read_line_blocking(sock: socket.socket, reader: LineReader) -> bytes:
    """The next line from a blocking socket (its timeout applies to each recv).

    Raises PeerClosed when the daemon closes the connection, LineTooLong (the buffer
    is kept: the caller clears it or gives up on the connection) when more than the
    reader's limit arrived without a newline, and the socket's own OSErrors.
    """
    while not reader.has_line():
        chunk = sock.recv(RECV_BYTES)
        if not chunk:
            raise PeerClosed("the daemon closed the connection")
        reader.feed(chunk)
        if reader.overflowing():
            raise LineTooLong(f"more than {reader.limit} bytes without a newline")
    line = reader.pop_line()
    assert line is not None
    return line


def decode(line: bytes) -> dict[str, Any]:
    """One received line as a message; MalformedMessage if it is not a JSON object."""
    try:
        msg = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # (not UTF-8 or JSON; an integer over Python's 4,300 digits; deep nesting)
        raise MalformedMessage(f"not JSON: {line[:80]!r}") from None
    if not isinstance(msg, dict):
        raise MalformedMessage(f"not a JSON object: {line[:80]!r}")
    return msg


def is_event(msg: dict[str, Any]) -> bool:
    """A message the daemon pushed on its own (``directive``, ``local_pace``), not a reply."""
    return "event" in msg
