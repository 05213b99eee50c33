"""Test doubles that ship with greend, for its own tests and for users' tests.

:class:`FakeDaemon` speaks docs/protocol.md on a real Unix socket (built on
:class:`greend.ipc.IpcServer`: register / steps / heartbeat / end), records what
it receives (``precision_events`` too) and can push directives, so training code that uses
:class:`greend.GreenCallback` can be tested without a greend daemon.
:class:`SilentDaemon` accepts connections and never reads, like a hung daemon.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from greend.ipc.server import NO_REPLY, Connection, IpcServer
from greend.protocol import MAX_ROWS_PER_MESSAGE, MAX_STEPS_PER_MESSAGE, check_entries, check_row, check_step

__all__ = ["FakeDaemon", "SilentDaemon"]


class FakeDaemon:
    """A tiny greend: a real IpcServer with the job routes, recording everything it gets."""

    def __init__(
        self,
        path: Path,
        *,
        heartbeat_s: float = 0.2,
        initial_precision: str | None = None,
        rows_every_s: float | None = None,
        precision_tolerance: float | None = None,
    ) -> None:
        """``rows_every_s``: offer "intervals" rows at that cadence, as the real daemon
        does (recorded in ``rows``); None: take one "steps" entry per step, as an older
        daemon (recorded in ``steps``, what most tests look at)."""
        self.path = path
        self.rows_every_s = rows_every_s
        self.precision_tolerance = precision_tolerance  # sent in the register reply where set
        self.register_extra: dict[str, Any] = {}  # more fields of the register reply (e.g. "local_pace")
        self.register_push: dict[str, Any] | None = None  # an event pushed just before the register reply
        self.rows: list[dict[str, Any]] = []
        self.booked_by_job: list[dict[str, Any]] = []  # one a steps/rows message: the job it booked
        self.heartbeat_s = heartbeat_s
        self.initial_precision = initial_precision
        self.lock = threading.Lock()
        self.registers: list[dict[str, Any]] = []
        self.steps: list[dict[str, Any]] = []
        self.heartbeats = 0
        self.ends: list[dict[str, Any]] = []
        self.precision_events: list[dict[str, Any]] = []
        self.paces: list[dict[str, Any]] = []  # the ops "pace" (step_s, floor_s), as the ranks sent them
        self.received_at_events: list[int] = []  # steps received when each precision event came
        self.step_messages = 0
        self.hang = threading.Event()  # set: the steps handler blocks, so nothing more is read
        self.unhang = threading.Event()
        self.server = IpcServer(path, mode=0o600)
        # The same schemas as the real daemon's (greend.protocol).
        self.server.route("register", self._register)
        self.server.route("steps", self._steps)
        self.server.route("intervals", self._intervals)
        self.server.route("heartbeat", self._heartbeat)
        self.server.route("end", self._end)
        self.server.route("precision_event", self._precision_event)
        self.server.route("pace", self._pace)

    def start(self) -> FakeDaemon:
        self.server.start()
        return self

    def stop(self) -> None:
        self.unhang.set()
        self.server.stop()

    def _register(self, msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
        with self.lock:
            self.registers.append(dict(msg))
        conn.state["job"] = msg["job"]
        reply: dict[str, Any] = {
            "job": msg["job"],
            "session": conn.id,
            "heartbeat_s": self.heartbeat_s,
        }
        # As the daemon: the job's own level back (or the level given here, for a job
        # that greend moved already); none where the client did not say its level, nor,
        # where a precision policy runs (a tolerance set), to a rank that sent steps before
        # while this daemon has none of its job's (a daemon restarted under the run: its
        # record knows no level but the job's own; greend.jobs.ops.register).
        level = self.initial_precision or msg.get("precision")
        fresh = not any(s.get("job", msg["job"]) == msg["job"] for s in self.booked_by_job)
        if msg.get("steps_before") and self.precision_tolerance is not None and fresh:
            level = None
        if level is not None:
            reply["directive"] = {"precision": level}
        if self.rows_every_s is not None:
            reply.update(report="intervals", rows_every_s=self.rows_every_s)
        if self.precision_tolerance is not None:
            reply["precision_tolerance"] = self.precision_tolerance
        reply.update(self.register_extra)
        if self.register_push is not None:  # (a push the daemon made while this rank registered)
            conn.send({"v": 1, "job": msg["job"], **self.register_push})
        return reply

    def _intervals(self, msg: dict[str, Any], conn: Connection) -> Any:
        return self._take(conn, "rows", msg["rows"], MAX_ROWS_PER_MESSAGE, check_row, self.rows)

    def _steps(self, msg: dict[str, Any], conn: Connection) -> Any:
        if self.hang.is_set():
            self.unhang.wait(30)
        return self._take(conn, "steps", msg["steps"], MAX_STEPS_PER_MESSAGE, check_step, self.steps)

    def _take(
        self,
        conn: Connection,
        name: str,
        entries: list[Any],
        limit: int,
        check: Callable[[dict[str, Any]], dict[str, Any]],
        into: list[dict[str, Any]],
    ) -> Any:
        """Record a registered connection's steps or rows, checked as the real daemon does."""
        from greend.errors import ProtocolError

        if "job" not in conn.state:
            raise ProtocolError("register first", field="op")
        check_entries(name, entries, limit, check)
        with self.lock:
            into.extend(entries)
            self.booked_by_job.append({"job": conn.state["job"]})
            self.step_messages += 1
        return NO_REPLY

    def received(self) -> int:
        """Steps received so far, as entries or in rows."""
        with self.lock:
            return self._received()

    def _received(self) -> int:  # under self.lock
        return len(self.steps) + sum(r["steps"] for r in self.rows)

    def _heartbeat(self, msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
        with self.lock:
            self.heartbeats += 1
        return {"ok": True}

    def _precision_event(self, msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
        with self.lock:
            self.precision_events.append({k: v for k, v in msg.items() if k not in ("v", "id", "op")})
            self.received_at_events.append(self._received())
        return {"ok": True}

    def _pace(self, msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
        with self.lock:
            self.paces.append({k: v for k, v in msg.items() if k not in ("v", "id", "op")})
        return {"ok": True}

    def _end(self, msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
        with self.lock:
            self.ends.append(dict(msg))
            n = self._received()
        return {"job": conn.state.get("job"), "steps": n}

    def push(self, **event: Any) -> int:
        """Send an event to every registered connection, each naming the connection's job
        as the daemon does (unless ``job=`` is given); return how many got it."""
        n = 0
        for c in self.server.connections():
            if "job" in c.state and c.send({"v": 1, "job": c.state["job"], **event}):
                n += 1
        return n

    def push_raw(self, data: bytes) -> None:
        for c in self.server.connections():
            if "job" in c.state:
                c.sock.sendall(data)

    def directive(self, precision: str, reason: str = "test") -> int:
        return self.push(event="directive", precision=precision, reason=reason)


class SilentDaemon:
    """Accepts connections and never reads or answers: a hung daemon."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.conns: list[socket.socket] = []
        self._stop = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)

    def stop(self) -> None:
        self._stop = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        for c in self.conns:
            c.close()
        self.path.unlink(missing_ok=True)
