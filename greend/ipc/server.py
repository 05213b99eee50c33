"""The daemon's local API: JSON lines over a Unix stream socket.

Protocol version 1
------------------
Every message is one JSON object on one line (UTF-8, ``\\n``-terminated), at most
``MAX_MESSAGE_BYTES`` long including the newline.

Request (client -> daemon)::

    {"v": 1, "id": 7, "op": "status", ...op-specific fields...}

``v`` is the protocol version (the daemon answers ``unsupported_version`` to any
other), ``id`` an optional integer or string echoed in the reply, ``op`` the
operation. Reply (daemon -> client)::

    {"v": 1, "id": 7, "ok": true, "result": {...}}
    {"v": 1, "id": 7, "ok": false, "error": {"code": "bad_request", "field": "op", "message": "..."}}

Error codes: ``bad_json``, ``too_large``, ``bad_request`` (``field`` names the
field), ``unknown_op``, ``unsupported_version``, ``forbidden`` (the message says
what is needed), ``refused`` (a well-formed request the node could not carry out:
a setting a device refused, an untrustworthy state file; the message says why),
``unavailable``, ``internal``. A handler's greend error maps to its code in
:func:`error_reply`. The daemon may also push events
that are not replies, e.g. ``{"v": 1, "event": "directive", ...}``; a client
tells them apart by the ``event`` key.

A bad message never closes the connection (except an oversized line, after which
the stream resynchronises at the next newline) and never affects other clients.
The peer's pid, uid and gid come from ``SO_PEERCRED``, never from the message.

Operations are registered by the daemon (``server.route(...)``) with the schema
:mod:`greend.protocol` gives each; see :mod:`greend.daemon.routes` for the list.
"""

from __future__ import annotations

import grp
import json
import logging
import os
import socket
import stat
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from greend.errors import ActuatorError, ConfigError, ProtocolError, StateError
from greend.protocol import (
    ADMIN_OPS,
    MAX_CONNECTIONS,
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    SCHEMAS,
    Field,
    encode,
    validate,
)

__all__ = ["Connection", "Handler", "IpcServer", "NO_REPLY", "Peer", "Route", "error_reply"]

log = logging.getLogger(__name__)

# Peers and connections -----------------------------------------------------------


@dataclass(frozen=True)
class Peer:
    """Who is on the other end, from the kernel (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int

    @classmethod
    def of(cls, sock: socket.socket) -> Peer:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, gid = struct.unpack("3i", raw)
        return cls(pid, uid, gid)


@dataclass
class Connection:
    sock: socket.socket
    peer: Peer
    id: int
    state: dict[str, Any] = field(default_factory=dict)  # per-connection data for handlers
    _send_lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False

    def send(self, obj: dict[str, Any], timeout_s: float = 1.0) -> bool:
        """Send one message; False (and the connection marked closed) if the peer is gone or stuck."""
        data = encode(obj)
        with self._send_lock:
            if self.closed:
                return False
            try:
                self.sock.settimeout(timeout_s)
                self.sock.sendall(data)
                return True
            except OSError:
                self.closed = True
                return False
            finally:
                try:
                    self.sock.settimeout(None)
                except OSError:
                    pass


Handler = Callable[[dict[str, Any], Connection], Any]


@dataclass(frozen=True)
class Route:
    handler: Handler
    schema: dict[str, Field]
    admin: bool = False
    allow_extra: bool = False


# The server ----------------------------------------------------------------------


class IpcServer:
    """A threaded Unix-socket server. One thread accepts; one thread per client."""

    def __init__(
        self,
        path: Path,
        *,
        mode: int = 0o660,
        group: str | None = None,
        is_admin: Callable[[Peer], bool] = lambda p: p.uid == 0,
        admin_needs: str = "root",
        on_disconnect: Callable[[Connection], None] | None = None,
    ) -> None:
        self.path = path
        self.mode = mode
        self.group = group
        self.is_admin = is_admin
        self.admin_needs = admin_needs  # who passes is_admin, said in every refusal
        self.on_disconnect = on_disconnect
        self.routes: dict[str, Route] = {}
        self._sock: socket.socket | None = None
        self._conns: dict[int, Connection] = {}
        self._lock = threading.Lock()
        self._next_id = 0
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors_sent = 0
        self.requests = 0
        self.refused_full = 0  # connections turned away at MAX_CONNECTIONS

    def route(
        self,
        op: str,
        handler: Handler,
        schema: dict[str, Field] | None = None,
        *,
        admin: bool | None = None,
        allow_extra: bool = False,
    ) -> None:
        """Answer ``op`` with ``handler``. The schema and whether the op needs an admin
        come from :mod:`greend.protocol` unless given (test doubles add ops of their own)."""
        if schema is None:
            schema = SCHEMAS.get(op, {})
        if admin is None:
            admin = op in ADMIN_OPS
        self.routes[op] = Route(handler, schema, admin, allow_extra)

    # Lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._remove_stale()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # never world-accessible, not even for an instant
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old_umask)
        os.chmod(self.path, self.mode)
        if self.group:
            try:
                gid = grp.getgrnam(self.group).gr_gid
                os.chown(self.path, -1, gid)
            except KeyError:
                log.warning(
                    "socket group %r does not exist: only root can use %s (create it: groupadd --system %s)",
                    self.group,
                    self.path,
                    self.group,
                )
            except PermissionError:
                log.warning("cannot give %s to group %r (not root)", self.path, self.group)
        sock.listen(socket.SOMAXCONN)  # a burst of clients queues instead of getting EAGAIN
        self._sock = sock
        self._thread = threading.Thread(target=self._accept_loop, name="ipc-accept", daemon=True)
        self._thread.start()
        log.info("listening on %s (mode %o)", self.path, self.mode)

    def _remove_stale(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise OSError(f"{self.path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(0.5)
            probe.connect(str(self.path))
        except OSError:
            os.unlink(self.path)  # nobody listens: a leftover of a crashed daemon
            return
        finally:
            probe.close()
        raise OSError(f"another greend is already listening on {self.path}")

    def stop(self) -> None:
        self._stopping.set()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        with self._lock:
            conns = list(self._conns.values())
        for c in conns:
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread:
            self._thread.join(2.0)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def connections(self) -> list[Connection]:
        with self._lock:
            return list(self._conns.values())

    # Loops ---------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stopping.is_set():
            try:
                s, _ = self._sock.accept()
            except OSError:
                if self._stopping.is_set():
                    return
                continue
            with self._lock:
                if len(self._conns) >= MAX_CONNECTIONS:
                    full = True
                else:
                    full = False
                    self._next_id += 1
                    try:
                        conn = Connection(s, Peer.of(s), self._next_id)
                    except OSError:
                        s.close()
                        continue
                    self._conns[conn.id] = conn
            if full:
                self.refused_full += 1
                try:
                    s.sendall(encode(_error(None, "unavailable", f"too many clients (limit {MAX_CONNECTIONS})")))
                except OSError:
                    pass
                s.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name=f"ipc-{conn.id}", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        buf = b""
        discarding = False
        try:
            while not self._stopping.is_set() and not conn.closed:
                try:
                    chunk = conn.sock.recv(65536)
                except OSError:
                    break
                if not chunk:
                    break
                buf += chunk
                while True:
                    nl = buf.find(b"\n")
                    if nl < 0:
                        if len(buf) > MAX_MESSAGE_BYTES:
                            if not discarding:
                                self._reply(
                                    conn, _error(None, "too_large", f"message longer than {MAX_MESSAGE_BYTES} bytes")
                                )
                            discarding = True
                            buf = b""
                        break
                    line, buf = buf[:nl], buf[nl + 1 :]
                    if discarding:
                        discarding = False  # the tail of an oversized message
                        continue
                    if len(line) + 1 > MAX_MESSAGE_BYTES:
                        self._reply(conn, _error(None, "too_large", f"message longer than {MAX_MESSAGE_BYTES} bytes"))
                        continue
                    if line.strip():
                        self._reply(conn, self.dispatch(line, conn))
        finally:
            with self._lock:
                self._conns.pop(conn.id, None)
            conn.closed = True
            try:
                conn.sock.close()
            except OSError:
                pass
            if self.on_disconnect:
                try:
                    self.on_disconnect(conn)
                except Exception:
                    log.exception("on_disconnect handler failed")

    def _reply(self, conn: Connection, reply: dict[str, Any] | None) -> None:
        if reply is None:
            return
        if not reply.get("ok", True):
            self.errors_sent += 1
        conn.send(reply, timeout_s=2.0)

    def dispatch(self, line: bytes, conn: Connection) -> dict[str, Any] | None:
        """Parse, validate and run one request; always returns a reply, never raises."""
        self.requests += 1
        try:
            msg = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            return _error(None, "bad_json", f"not a JSON object on one line: {e}")
        except ValueError as e:  # an integer of more than 4300 digits (int_max_str_digits)
            return _error(None, "bad_json", f"a number in the message is too long: {e}")
        except RecursionError:
            return _error(None, "bad_json", "the message is nested too deeply")
        if not isinstance(msg, dict):
            return _error(None, "bad_json", f"expected a JSON object, got {type(msg).__name__}")
        mid = msg.get("id")
        if mid is not None and (isinstance(mid, bool) or not isinstance(mid, (int, str))):
            return _error(None, "bad_request", "'id' must be an integer or a string", field="id")
        if isinstance(mid, str) and len(mid) > 128:
            return _error(None, "bad_request", "'id' is longer than 128", field="id")
        v = msg.get("v")
        if v != PROTOCOL_VERSION:
            return _error(
                mid,
                "unsupported_version",
                f"'v' = {v!r}: this daemon speaks protocol version {PROTOCOL_VERSION}",
                field="v",
            )
        op = msg.get("op")
        if not isinstance(op, str):
            return _error(mid, "bad_request", "missing 'op' (a string)", field="op")
        route = self.routes.get(op)
        if route is None:
            return _error(
                mid, "unknown_op", f"unknown op {op[:64]!r}; known: {', '.join(sorted(self.routes))}", field="op"
            )
        if route.admin and not self.is_admin(conn.peer):
            return _error(
                mid,
                "forbidden",
                f"{op!r} changes the node's settings: it needs {self.admin_needs} (your uid is {conn.peer.uid})",
            )
        try:
            validate(msg, route.schema, allow_extra=route.allow_extra)
            result = route.handler(msg, conn)
        except Exception as e:
            return error_reply(mid, op, e)
        if result is _NO_REPLY:
            return None
        return {"v": PROTOCOL_VERSION, "id": mid, "ok": True, "result": result}


_NO_REPLY = object()
NO_REPLY: Any = _NO_REPLY  # a handler returns this for fire-and-forget messages


def error_reply(mid: Any, op: str, e: Exception) -> dict[str, Any]:
    """The error reply for what a handler raised: greend's errors map to the protocol's
    codes with their message; anything else is a bug, logged and answered ``internal``."""
    if isinstance(e, ProtocolError):
        return _error(mid, "bad_request", str(e), field=e.field)
    if isinstance(e, ConfigError):  # PolicyError included: a wrong name or parameter
        return _error(mid, "bad_request", str(e))
    if isinstance(e, (ActuatorError, StateError)):  # KnobError included
        log.warning("%r refused: %s", op, e)
        return _error(mid, "refused", str(e))
    if isinstance(e, PermissionError):
        return _error(mid, "forbidden", str(e))
    log.exception("handler for %r failed", op, exc_info=e)
    return _error(mid, "internal", f"{type(e).__name__}: {e}")


def _error(mid: Any, code: str, message: str, field: str | None = None) -> dict[str, Any]:
    err: dict[str, Any] = {"code": code, "message": message}
    if field is not None:
        err["field"] = field
    return {"v": PROTOCOL_VERSION, "id": mid, "ok": False, "error": err}
