"""A small synchronous client of the daemon's socket, used by ``greenctl``.

One request at a time: :meth:`Client.request` sends it and waits for its reply,
skipping the events the daemon may push. Failures raise :class:`DaemonUnavailable`
(no daemon, no permission, no answer) or :class:`RequestRefused` (an error reply).
The wire itself (connecting, framing, reading lines) is :mod:`greend.ipc.wire`.
"""

from __future__ import annotations

import errno
import itertools
import os
import socket
import stat
from pathlib import Path
from typing import Any

from greend.errors import DaemonUnavailable, RequestRefused
from greend.ipc.wire import (
    LineReader,
    LineTooLong,
    MalformedMessage,
    PeerClosed,
    connect_retrying,
    connect_unix,
    decode,
    frame_request,
    is_event,
    read_line_blocking,
)
from greend.protocol import MAX_MESSAGE_BYTES

__all__ = ["Client"]

# A reply (a status or a report) may be far longer than a request may be.
REPLY_LIMIT_BYTES = 64 * MAX_MESSAGE_BYTES

_connect_retrying = connect_retrying  # the name tests/test_fuzz_ipc.py imports


class Client:
    def __init__(self, path: Path, timeout_s: float = 5.0) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._reader = LineReader(REPLY_LIMIT_BYTES)
        self._ids = itertools.count(1)

    def __enter__(self) -> Client:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self) -> None:
        try:
            s = connect_unix(str(self.path), self.timeout_s, retry_busy=True)
        except FileNotFoundError:
            raise DaemonUnavailable(
                f"no greend socket at {self.path}: is the daemon running? "
                "(systemctl status greend, or start one: greend run --sim 2 --socket PATH; "
                "point greenctl at it with --socket or $GREEND_SOCKET)"
            ) from None
        except PermissionError:
            raise DaemonUnavailable(
                f"permission denied on {self.path}: join the socket's group "
                "(sudo usermod -aG greend $USER, then log in again) or use sudo"
            ) from None
        except OSError as e:
            raise DaemonUnavailable(f"cannot connect to {self.path}: {_what_is_there(self.path, e)}") from None
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
        request_id = next(self._ids)
        try:
            frame = frame_request(request_id, op, fields)
        except ValueError as e:  # (a NaN or an infinity: JSON has no such number)
            raise RequestRefused("bad_request", f"{op}: a value cannot be sent ({e}): give a finite number") from None
        reply: dict[str, Any] | None = None
        try:
            try:
                self._sock.sendall(frame)
            except OSError:
                reply = self._said_before_closing()  # (the daemon refused the connection: why)
                if reply is None:
                    raise
            while reply is None:
                msg = self._read_message()
                if is_event(msg):
                    continue  # pushed events are not for a request/response client
                rid = msg.get("id")
                # A reply without an id answers this request where the daemon could not read
                # its id or refused it whole (bad_json, too_large, unavailable); any other
                # answers an earlier message that had no id.
                if rid != request_id and not (rid is None and _code(msg) in _WHOLE):
                    continue
                reply = msg
        except TimeoutError:
            raise DaemonUnavailable(f"greend at {self.path} did not answer within {self.timeout_s} s") from None
        except OSError as e:
            raise DaemonUnavailable(f"lost the connection to greend at {self.path}: {e}") from None
        if reply.get("ok"):
            return reply.get("result")
        err = reply.get("error")
        if not isinstance(err, dict):
            err = {"message": f"request refused: {err!r}" if err else "request refused"}
        raise RequestRefused(
            str(err.get("code", "error")), str(err.get("message", "request refused")), err.get("field")
        )

    def _said_before_closing(self) -> dict[str, Any] | None:
        """The refusal a daemon sent before it closed a connection it would not serve (too
        many clients: one ``unavailable`` line naming the config key), where a send found
        the connection closed; None where it said nothing."""
        assert self._sock is not None
        try:
            self._sock.settimeout(min(self.timeout_s, 1.0))
            msg = self._read_message()
        except Exception:
            return None
        return msg if msg.get("id") is None and _code(msg) in _WHOLE else None

    def _read_message(self) -> dict[str, Any]:
        assert self._sock is not None
        try:
            line = read_line_blocking(self._sock, self._reader)
        except PeerClosed:
            raise DaemonUnavailable(f"greend at {self.path} closed the connection") from None
        except LineTooLong:
            raise DaemonUnavailable("reply too large") from None
        try:
            return decode(line)
        except MalformedMessage as e:
            raise DaemonUnavailable(
                f"what answers at {self.path} does not speak greend's protocol ({e}): is it greend's socket?"
            ) from None


def _what_is_there(path: Path, e: OSError) -> str:
    """Why a connect failed, said by what is at the path: a directory or a plain file
    is not a daemon's socket, whatever errno the kernel gave."""
    try:
        st = os.stat(path)
    except OSError:
        return e.strerror or str(e)
    if stat.S_ISDIR(st.st_mode):
        return "it is a directory, not a socket (the socket is a file in it, e.g. greend.sock)"
    if not stat.S_ISSOCK(st.st_mode):
        return "it is not a socket (a regular file?); point --socket at the daemon's socket"
    if e.errno == errno.ECONNREFUSED:
        return "connection refused: a socket is there but no daemon listens (a daemon that stopped uncleanly?)"
    return e.strerror or str(e)


_WHOLE = ("bad_json", "too_large", "unavailable")  # id-less refusals of a whole request


def _code(reply: dict[str, Any]) -> Any:
    err = reply.get("error")
    return err.get("code") if isinstance(err, dict) else None
