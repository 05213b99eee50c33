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
import select
import socket
import stat
import struct
import threading
import time
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

__all__ = ["Connection", "Handler", "IpcServer", "LimitExceeded", "Limits", "NO_REPLY", "Peer", "Route", "error_reply"]

log = logging.getLogger(__name__)

# At stop, each connection's unread messages are still handled: its thread reads until the
# client's data ends or nothing comes for DRAIN_POLL_S; stop() waits up to STOP_DRAIN_S.
DRAIN_POLL_S = 0.1
STOP_DRAIN_S = 2.0
THROTTLE_BYTES = 1024  # a message's cost in the per-uid rate: 1, and 1 more per KiB after the first
PUSH_SEND_S = 0.05  # a push to a writable connection (Connection.send_bytes with timeout_s 0)
PUSH_LOCK_WAIT_S = 0.005  # ... to one busy sending a reply: waited for this long, then skipped
# A socket full of connections makes room for a new one by closing the longest idle that is no
# job's rank and has sent nothing for this long (Server._make_room).
EVICT_IDLE_S = 5.0

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
    last_heard_s: float = field(default_factory=time.monotonic)  # when it connected, or its last lines were answered
    busy: bool = False  # what it sent is being read and answered

    def send(self, obj: dict[str, Any], timeout_s: float = 1.0) -> bool:
        """Send one message; False (and the connection marked closed) if the peer is gone or stuck.
        A message that cannot be encoded raises ValueError (and nothing is sent)."""
        return self.send_bytes(encode(obj), timeout_s)

    def send_bytes(self, data: bytes, timeout_s: float = 1.0) -> bool:
        """Send one encoded message (see :meth:`send`). ``timeout_s`` 0: only where it goes
        without waiting (the tick thread's pushes to ranks): a connection busy sending is
        waited for :data:`PUSH_LOCK_WAIT_S` at most, then skipped, and one whose peer has
        not read what it was sent (nothing can be written: its buffer is full) is marked
        closed at once. Waiting up to 0.2 s on each of 64 such connections stopped the
        tick for 13 s."""
        if timeout_s <= 0:
            # (a reply being sent to a reader takes microseconds: waited for, briefly)
            if not self._send_lock.acquire(timeout=PUSH_LOCK_WAIT_S):
                return False
            try:
                if self.closed:
                    return False
                poller = select.poll()
                poller.register(self.sock, select.POLLOUT)
                if not poller.poll(0):
                    self.closed = True
                    log.warning("connection %d (pid %d): its peer reads nothing of what it is sent; closed",
                                self.id, self.peer.pid)  # fmt: skip
                    return False
                # Writable: at least half the send buffer is free, far more than a message.
                return self._send_locked(data, PUSH_SEND_S)
            finally:
                self._send_lock.release()
        with self._send_lock:
            return self._send_locked(data, timeout_s)

    def _send_locked(self, data: bytes, timeout_s: float) -> bool:
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


@dataclass(frozen=True)
class Limits:
    """What one uid may take of the socket (root and the admin group are exempt from
    the per-uid limits and have ``reserved_admin`` connections kept for them). Each
    refusal names its ``[daemon]`` key, so an admin knows what to raise."""

    max_connections: int = MAX_CONNECTIONS
    reserved_admin: int = 16
    per_uid: int = 64
    idle_timeout_s: float = 60.0
    messages_per_s: float = 2000.0

    @classmethod
    def of(cls, d: Any) -> Limits:
        """From the ``[daemon]`` section of the configuration."""
        return cls(
            max_connections=d.max_connections,
            reserved_admin=d.reserved_admin_connections,
            per_uid=d.max_connections_per_uid,
            idle_timeout_s=d.idle_timeout_s,
            messages_per_s=d.max_messages_per_s_per_uid,
        )


class LimitExceeded(Exception):
    """A per-user limit refused a request; the message names the limit's config key."""


class _Bucket:
    """A token bucket: ``rate`` per second, a burst of one second's worth."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.tokens = rate
        self.t = time.monotonic()
        self.lock = threading.Lock()

    def delay(self, n: int = 1) -> float:
        """Take ``n`` tokens; the seconds to wait first (0 within the rate)."""
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.rate, self.tokens + (now - self.t) * self.rate)
            self.t = now
            # A debt of at most 1 s: a run of empty lines (n at once, cheap to read) holds its
            # uid's next messages back 1 s at most, never for as long as it was long (the
            # replies the uid's jobs wait for time out after 5 s).
            self.tokens = max(self.tokens - n, -self.rate)
            return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


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
        limits: Limits | None = None,
        registered: Callable[[Connection], bool] = lambda conn: False,
    ) -> None:
        self.path = path
        self.mode = mode
        self.group = group
        self.is_admin = is_admin
        self.admin_needs = admin_needs  # who passes is_admin, said in every refusal
        self.on_disconnect = on_disconnect
        self.limits = limits or Limits()
        self.registered = registered  # a connection that registered a job is not idle
        self._buckets: dict[int, _Bucket] = {}
        self._bound: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket this server bound
        self.routes: dict[str, Route] = {}
        self._sock: socket.socket | None = None
        self._conns: dict[int, Connection] = {}
        self._serving: dict[int, threading.Thread] = {}  # connection id -> the thread that reads it
        self._lock = threading.Lock()
        self._next_id = 0
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors_sent = 0
        self.requests = 0
        self.refused_full = 0  # connections turned away at a connection limit
        self.evicted = 0  # idle connections closed to make room for a new one (_make_room)
        self.idle_closed = 0  # connections closed for never registering
        self.throttled_s = 0.0  # time spent holding back a uid's messages over its rate

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
        except OSError as e:  # (bind names no file: the operator is told which)
            sock.close()
            raise OSError(e.errno, f"cannot create the socket {self.path}: {e.strerror}") from e
        finally:
            os.umask(old_umask)
        st = os.lstat(self.path)
        self._bound = (st.st_dev, st.st_ino)
        os.chmod(self.path, self.mode)
        if self.group:
            try:
                gid = grp.getgrnam(self.group).gr_gid
                if st.st_gid != gid:  # bound as the unit's Group=: no chown (the unit forbids it)
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
            pid = Peer.of(probe).pid
        except OSError:
            os.unlink(self.path)  # nobody listens: a leftover of a crashed daemon
            return
        finally:
            probe.close()
        raise OSError(f"another greend (pid {pid}) is already listening on {self.path}; this one leaves it alone")

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
        # Each connection's thread reads what its client sent before the shutdown and ends:
        # waited for (a bounded time), so that all of it is handled before stop() returns.
        deadline = time.monotonic() + STOP_DRAIN_S
        with self._lock:
            serving = list(self._serving.values())
        for t in serving:
            t.join(max(0.0, deadline - time.monotonic()))
        # Only the socket this server bound: never another daemon's at the same path.
        try:
            st = os.lstat(self.path)
            if self._bound is not None and (st.st_dev, st.st_ino) == self._bound:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._bound = None

    def connections(self) -> list[Connection]:
        with self._lock:
            return list(self._conns.values())

    def _is_admin(self, peer: Peer) -> bool:
        try:
            return self.is_admin(peer)
        except Exception:
            return False

    def _full(self, peer: Peer, admin: bool) -> str | None:
        """Why a new connection of ``peer`` is refused (None: it is not). Under ``_lock``."""
        lim = self.limits
        n = len(self._conns)
        if n >= lim.max_connections:
            return f"too many clients (limit {lim.max_connections}, [daemon] max_connections)"
        if admin:
            return None
        if n >= lim.max_connections - lim.reserved_admin:
            return (
                f"too many clients: the last {lim.reserved_admin} of {lim.max_connections} connections are kept "
                f"for {self.admin_needs} ([daemon] reserved_admin_connections, max_connections)"
            )
        mine = sum(1 for c in self._conns.values() if c.peer.uid == peer.uid)
        if mine >= lim.per_uid:
            return (
                f"uid {peer.uid} has {mine} connections open, the limit per user "
                f"([daemon] max_connections_per_uid = {lim.per_uid}); close some"
            )
        return None

    def _make_room(self, admin: bool) -> Connection | None:
        """Under ``_lock``, for a connection the socket is too full for: the connection that
        is no job's rank, idle longest (over :data:`EVICT_IDLE_S`, nothing of it being
        handled) and no admin's unless the new one is an admin's, taken off the table (the
        caller closes it, or puts it back where that made no room), or None. Idle
        connections left open (by root too, whom no per-uid limit holds) otherwise kept
        every new client out until the idle timeout closed them: ranks could not register."""
        now = time.monotonic()
        idle = [
            c
            for c in self._conns.values()
            if now - c.last_heard_s > EVICT_IDLE_S
            and not c.busy
            and (admin or not c.state.get("_admin"))
            and not self._is_rank(c)
        ]
        if not idle:
            return None
        victim = min(idle, key=lambda c: c.last_heard_s)
        del self._conns[victim.id]
        return victim

    def _is_rank(self, conn: Connection) -> bool:
        try:
            return bool(self.registered(conn))
        except Exception:
            return True  # (not known: kept)

    def _throttle(self, conn: Connection, n: int = 1) -> None:
        """Hold back a non-admin uid's messages beyond its rate (the client's sends
        then block: backpressure, not refusals; the uid's other connections share it);
        ``n``: messages at once."""
        if conn.state.get("_admin"):
            return
        uid = conn.peer.uid
        with self._lock:
            bucket = self._buckets.get(uid)
            if bucket is None:
                bucket = self._buckets[uid] = _Bucket(self.limits.messages_per_s)
        wait_s = bucket.delay(n)
        if wait_s > 0:
            self.throttled_s += wait_s
            self._stopping.wait(min(wait_s, 5.0))

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
            try:
                peer = Peer.of(s)
            except OSError:
                s.close()
                continue
            admin = self._is_admin(peer)
            with self._lock:
                full = self._full(peer, admin)
                evicted = self._make_room(admin) if full is not None and not full.startswith("uid ") else None
                if evicted is not None:
                    full = self._full(peer, admin)
                    if full is not None:  # (no room for this one all the same: it stays)
                        self._conns[evicted.id], evicted = evicted, None
                if full is None:
                    self._next_id += 1
                    conn = Connection(s, peer, self._next_id)
                    self._conns[conn.id] = conn
            if evicted is not None:
                self.evicted += 1
                log.info("socket full: closed connection %d of uid %d, idle, for one of uid %d",
                         evicted.id, evicted.peer.uid, peer.uid)  # fmt: skip
                try:  # (no wait on a peer that reads nothing: the accept loop goes on)
                    evicted.send(_error(None, "unavailable", "closed: the socket was full and this connection idle"), 0)
                except ValueError:
                    pass
                try:
                    evicted.sock.shutdown(socket.SHUT_RDWR)  # (its thread ends and forgets it)
                except OSError:
                    pass
            if full is not None:
                self.refused_full += 1
                try:
                    s.settimeout(0.5)
                    s.sendall(encode(_error(None, "unavailable", full)))
                except OSError:
                    pass
                s.close()
                continue
            t = threading.Thread(target=self._serve, args=(conn,), name=f"ipc-{conn.id}", daemon=True)
            with self._lock:
                self._serving[conn.id] = t
            t.start()

    def _serve(self, conn: Connection) -> None:
        buf = b""
        discarding = False
        conn.state["_admin"] = self._is_admin(conn.peer)
        idle_s = self.limits.idle_timeout_s
        # Idleness is waited for with poll, not with the socket's timeout: send() (a push
        # from another thread) sets that timeout for its own write, and a read begun in
        # between took it over (1 s): a client silent for a second was closed as idle.
        waiter = select.poll()
        waiter.register(conn.sock, select.POLLIN)
        try:
            # At stop (stop() shut the socket down) what the client sent before is still read
            # and handled, to its end: a rank's last steps are booked before its job ends.
            while not conn.closed or self._stopping.is_set():
                stopping = self._stopping.is_set()
                try:
                    if not waiter.poll(DRAIN_POLL_S * 1000.0 if stopping else idle_s * 1000.0):
                        if stopping:
                            break  # nothing more came: drained
                        raise TimeoutError
                    chunk = conn.sock.recv(65536)  # (ready: it does not wait)
                except TimeoutError:
                    if self.registered(conn):
                        continue  # a job's rank: its heartbeats are the registry's to judge
                    self.idle_closed += 1
                    log.debug("closing connection %d of uid %d: idle %g s", conn.id, conn.peer.uid, idle_s)
                    self._reply(
                        conn,
                        _error(
                            None,
                            "unavailable",
                            f"closed after {idle_s:g} s without a message ([daemon] idle_timeout_s)",
                        ),
                    )
                    break
                except OSError:
                    break
                if not chunk:
                    break
                conn.busy = True  # (what it sent is being read and answered: never closed to make room)
                buf += chunk
                start = 0  # lines are read off the buffer by offset: no copy of its rest per line
                while not conn.closed or self._stopping.is_set() or self._is_rank(conn):  # (a gone peer: rest not run)
                    nl = buf.find(b"\n", start)
                    if nl < 0:
                        buf = buf[start:]
                        if len(buf) > MAX_MESSAGE_BYTES:
                            if not discarding:
                                self._reply(
                                    conn, _error(None, "too_large", f"message longer than {MAX_MESSAGE_BYTES} bytes")
                                )
                            discarding = True
                            buf = b""
                        break
                    if nl == start:  # empty lines: a run of them at once, at C speed
                        rest = buf[start:]
                        blank = len(rest) - len(rest.lstrip(b"\n"))
                        start += blank
                        self._throttle(conn, blank)  # (nothing to answer, but each counts)
                        discarding = False
                        continue
                    line, start = buf[start:nl], nl + 1
                    if discarding:
                        discarding = False  # the tail of an oversized message
                        continue
                    if len(line) + 1 > MAX_MESSAGE_BYTES:
                        self._reply(conn, _error(None, "too_large", f"message longer than {MAX_MESSAGE_BYTES} bytes"))
                        continue
                    # One token a message and one more for each KiB after its first: 64-row
                    # messages within the message rate booked 56,000 rows a second and the
                    # ticks nearly stopped; a job's usual message (a few rows) costs 1-2.
                    self._throttle(conn, 1 + max(0, len(line) - 1) // THROTTLE_BYTES)
                    if line.strip():
                        self._reply(conn, self.dispatch(line, conn))
                conn.busy, conn.last_heard_s = False, time.monotonic()
        finally:
            with self._lock:
                self._conns.pop(conn.id, None)
                self._serving.pop(conn.id, None)
            conn.closed = True
            try:
                conn.sock.close()
            except OSError:
                pass
            if self.on_disconnect and not self._stopping.is_set():
                # (at stop the daemon ends its jobs itself: their ranks did not leave)
                try:
                    self.on_disconnect(conn)
                except Exception:
                    log.exception("on_disconnect handler failed")

    def _reply(self, conn: Connection, reply: dict[str, Any] | None) -> None:
        if reply is None:
            return
        try:
            data = encode(reply)
        except (ValueError, TypeError, RecursionError) as e:
            # A result that JSON cannot carry (inf, NaN, a foreign object) is a bug of the
            # op's handler: answered as an error to this request alone, while the
            # connection, the daemon and every other client carry on.
            log.error("a reply could not be encoded (%s: %s); answering an error instead", type(e).__name__, e)
            reply = _error(
                reply.get("id"),
                "internal",
                f"the daemon's answer could not be encoded ({type(e).__name__}: {e}); please report it",
            )
            data = encode(reply)
        if not reply.get("ok", True):
            self.errors_sent += 1
        conn.send_bytes(data, timeout_s=2.0)

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
        try:
            text = b"\\u" not in line or _all_text(msg)
        except RecursionError:  # (json.dumps nests a few frames deeper than json.loads did)
            return _error(None, "bad_json", "the message is nested too deeply")
        if not text:
            # A "\\udcff" escape alone is valid JSON but no character: no store, log or
            # report could hold it (UTF-8 has no lone surrogates).
            return _error(None, "bad_json", "a string holds a lone surrogate escape (\\ud800-\\udfff without its pair)")
        mid = msg.get("id")
        if mid is not None and (isinstance(mid, bool) or not isinstance(mid, (int, str))):
            return _error(None, "bad_request", "'id' must be an integer or a string", field="id")
        if isinstance(mid, str) and len(mid) > 128:
            return _error(None, "bad_request", "'id' is longer than 128", field="id")
        v = msg.get("v")
        if type(v) is not int or v != PROTOCOL_VERSION:  # (true and 1.0 equal 1 in Python, not on the wire)
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
    if isinstance(e, LimitExceeded):
        return _error(mid, "refused", str(e))
    log.exception("handler for %r failed", op, exc_info=e)
    return _error(mid, "internal", f"{type(e).__name__}: {e}")


def _all_text(obj: Any) -> bool:
    """Whether every string in a decoded message (keys too) is text UTF-8 can hold."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _error(mid: Any, code: str, message: str, field: str | None = None) -> dict[str, Any]:
    err: dict[str, Any] = {"code": code, "message": message}
    if field is not None:
        err["field"] = field
    return {"v": PROTOCOL_VERSION, "id": mid, "ok": False, "error": err}
