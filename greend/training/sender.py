"""The callback's sender thread: the one owner of the daemon's socket in a training process.

It registers the job (``docs/protocol.md``), batches the step records the
training thread queued into ``steps`` messages every ``flush_interval_s``,
sends ``heartbeat`` when no steps flow, sends the callback's precision events
and the agreed pace, and reads the daemon's pushed ``directive`` and
``local_pace`` events. The wire itself (connecting, framing, reading lines) is
:mod:`greend.ipc.wire`, shared with ``greenctl``'s client.

* **Non-blocking**: after registering, sends and reads go through ``select``
  and never block the thread for longer than ``flush_interval_s``; the training
  thread never waits for it at all (its records go to a bounded queue, whose
  oldest records are dropped and counted in :class:`SenderStats` when the
  daemon is slow or gone).
* **Gone or stuck**: a daemon that does not read for ``stall_timeout_s``, or
  does not answer a request within ``reply_timeout_s``, is treated as gone.
  Then the thread reconnects every ``reconnect_min_s``-``reconnect_max_s``
  (back-off with jitter) and registers again when the daemon is back.
* **Fail-open**: nothing here raises into the training loop. The first problem
  is one :class:`greend.GreendWarning` (and a log line); later outages are log
  lines, never one per step.
"""

from __future__ import annotations

import itertools
import random
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from greend.ipc.wire import (
    RECV_BYTES,
    LineReader,
    LineTooLong,
    MalformedMessage,
    PeerClosed,
    connect_unix,
    decode,
    frame_message,
    frame_request,
    is_event,
    positive,
    read_line_blocking,
)
from greend.protocol import MAX_MESSAGE_BYTES, MAX_ROWS_PER_MESSAGE, MAX_STEPS_PER_MESSAGE, PRECISIONS, is_step
from greend.training._sender_options import SenderOptions, SenderStats
from greend.training.rows import Row, clean, step_fields
from greend.training.warn import OnceWarnings, log

__all__ = ["Channel", "Sender", "SenderOptions", "SenderStats"]

# Encoded messages waiting for the socket; step records stay in the callback's queue beyond this.
OUTBOX_MAX_BYTES = 256 * 1024
# Register fields newer daemons know; one an older daemon refuses as unknown is left out.
NEWER_REGISTER_FIELDS = frozenset({"run", "reference_every", "probe_every", "steps_before"})
# A line from the daemon longer than this (without a newline) is dropped as malformed.
LINE_LIMIT_BYTES = 4 * MAX_MESSAGE_BYTES
# The heartbeat period a daemon's reply may set (its floor: 0.5 s; far below: a busy loop).
HEARTBEAT_MIN_S, HEARTBEAT_MAX_S = 0.1, 60.0

_monotonic = time.monotonic


@dataclass(eq=False)
class Channel:
    """What the training thread and the sender thread share, and nothing else.

    The training thread appends step records to ``queue`` (the sender takes them;
    the oldest are dropped when it is full: ``stats.dropped``) and precision events to
    ``events``, and sets ``agreed_pace_s``; the sender writes the daemon's directive
    into ``requested`` (then calls ``on_directive``) and its pace into ``local_pace_s``.
    ``register_omit``: register fields the daemon refused as unknown (an older daemon).
    ``handed``: batches of ended steps the training thread hands over whole; the sender
    calls ``book_handed`` at each round to turn them into records on ``queue``.
    """

    queue: deque[tuple[Any, ...]]
    stats: SenderStats = field(default_factory=SenderStats)
    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=64))
    agreed_pace_s: float | None = None
    agreed_floor_s: float | None = None  # (sent with the pace)
    agreed_recheck_at: int = 0  # (and the latest re-check a node asked)
    local_pace_s: float | None = None
    local_floor_s: float | None = None
    local_recheck_at: int | None = None  # (None: a daemon that pushes none, and takes none in op "pace")
    requested: str | None = None
    on_directive: Callable[[], None] = lambda: None
    # The daemon's precision tolerance from its register reply (None: it sent none).
    on_tolerance: Callable[[float | None], None] = lambda _: None
    register_omit: set[str] = field(default_factory=set)
    handed: deque[Any] = field(default_factory=deque)
    book_handed: Callable[[], None] = lambda: None


class _ConnectionLost(Exception):
    """The connection is gone or stuck; the message says why."""


class Sender:
    """Owns the socket: registers, batches steps, heartbeats, reads directives, reconnects.
    It reads and writes the :class:`Channel` only; ``register_fields`` makes the ``register``
    request's fields at each connect, ``warnings`` reports problems."""

    def __init__(
        self,
        channel: Channel,
        options: SenderOptions,
        *,
        job: str,
        socket_path: str,
        register_fields: Callable[[], dict[str, Any]],
        warnings: OnceWarnings,
    ) -> None:
        self.ch = channel
        self.job = job
        self.socket_path = socket_path
        self._register_fields = register_fields
        self._warnings = warnings
        self.options = options
        self.heartbeat_s = options.heartbeat_s  # the daemon's register reply may change it
        self.booked_job: str | None = None  # the job id the daemon booked the session under
        self.first_attempt = threading.Event()
        self.session: int | None = None
        self.end_result: dict[str, Any] | None = None
        self._wake = threading.Event()
        self._stop_reason: str | None = None
        self._stop_deadline = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"greend-sender-{job}", daemon=True)
        self._sock: socket.socket | None = None
        self._reader = LineReader(LINE_LIMIT_BYTES)
        self._outbox: deque[list[Any]] = deque()  # [bytes not yet written, step records in them]
        self._outbox_bytes = 0
        self._request_ids = itertools.count(1)
        self._pending: dict[int, tuple[str, float]] = {}  # request id -> (op, sent at)
        self._last_send_s = 0.0
        self._last_progress_s = 0.0  # the last time the daemon took any bytes
        self._failures = 0  # connection attempts failed in a row
        self._ever_connected = False
        self._pace_heard = False  # a local_pace event came while registering
        # How steps go out: "intervals" (rows summed here) where the daemon's register
        # reply offers it, else a "steps" entry per step (an older daemon, or one whose
        # [store] step_detail keeps a row per step). Losses step by step in the rows only
        # where the daemon may change the job's precision (it registered more than one level).
        self._form = "steps"
        self._row_losses = False
        # Rows go out every rows_every_s (the daemon's register reply says; events and
        # requests at once), or sooner when a message's worth of steps is waiting.
        self._rows_every_s = options.flush_interval_s
        self._last_rows_s = 0.0

    # Control ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, reason: str, timeout_s: float) -> None:
        self._stop_deadline = _monotonic() + timeout_s
        self._stop_reason = reason
        self._wake.set()
        self._thread.join(timeout_s)  # (still blocked then, on a silent daemon: it ends on its own)

    # Main loop -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                try:
                    self._loop()
                    return
                except Exception as e:  # a bug here never ends the reporting for good
                    msg = f"{type(e).__name__}: {e}"
                    if msg != self.ch.stats.last_error:
                        log.exception("greend sender thread failed; it starts again in 1 s (training is unaffected)")
                    self._disconnect(msg)
                    if self._stop_reason is not None:
                        return
                    self._wake.wait(1.0)
        finally:
            self._close_sock()
            self.first_attempt.set()
            self._done.set()

    def _loop(self) -> None:
        """Connect, send and read until stopped (returns) or a bug raises."""
        opts = self.options
        next_connect = 0.0
        while True:
            self.ch.book_handed()  # the training thread's ended steps, as records
            if self._stop_reason is not None:
                self._finish()
                return
            if self._sock is None:
                now = _monotonic()
                if now >= next_connect:
                    if self._connect():
                        self._failures = 0
                    else:
                        self._failures += 1
                        delay = min(opts.reconnect_max_s, opts.reconnect_min_s * (2 ** (self._failures - 1)))
                        next_connect = _monotonic() + delay * random.uniform(0.8, 1.0)
                    self.first_attempt.set()
                    continue
                self._wake.wait(min(next_connect - now, 0.5))
                continue
            try:
                self._run_once()
            except _ConnectionLost as e:
                self._lost(str(e))
                next_connect = _monotonic() + opts.reconnect_min_s * random.uniform(0.8, 1.0)

    def _run_once(self) -> None:
        """One round: queue steps, events, pace, maybe a heartbeat; then wait for I/O up to flush_interval_s."""
        opts = self.options
        now = _monotonic()
        events = self.ch.events
        n_events = len(events)
        # The steps before the events go first, held rows too: the training thread queues
        # a step's record before the event it caused, and the daemon follows a rank's
        # level by its rows, so a rollback must never overtake the steps it rolls back.
        self._queue_steps(force=n_events > 0)
        if self.ch.queue and self._outbox_bytes >= OUTBOX_MAX_BYTES:
            n_events = 0  # steps left behind by a full outbox (a slow daemon): the events wait for them
        for _ in range(n_events):
            self._queue_request("precision_event", events.popleft())
        pace = self.ch.agreed_pace_s
        if pace is not None:
            # (the floor only to a daemon that sends its own: one before floors refuses the field)
            self.ch.agreed_pace_s, floor = None, self.ch.agreed_floor_s if self.ch.local_floor_s else None
            ask = self.ch.agreed_recheck_at if self.ch.local_recheck_at is not None else 0
            extra = ({} if floor is None else {"floor_s": floor}) | ({"recheck_at": ask} if ask > 0 else {})
            self._queue_request("pace", {"step_s": pace, **extra})
        if not self._outbox and now - self._last_send_s >= self.heartbeat_s and not self._has_pending("heartbeat"):
            self._queue_request("heartbeat", {})
        for op, sent in self._pending.values():
            if now - sent > opts.reply_timeout_s:
                raise _ConnectionLost(f"the daemon did not answer {op!r} within {opts.reply_timeout_s:g} s")
        if self._outbox and now - self._last_progress_s > opts.stall_timeout_s:
            raise _ConnectionLost(f"the daemon has not read anything for {opts.stall_timeout_s:g} s")
        assert self._sock is not None
        wlist = [self._sock] if self._outbox else []
        try:
            readable, writable, _ = select.select([self._sock], wlist, [], opts.flush_interval_s)
        except (OSError, ValueError) as e:
            raise _ConnectionLost(f"socket error: {e}") from None
        if readable:
            self._read_available()
        if writable:
            self._write_available()

    # Connecting --------------------------------------------------------------------
    def _connect(self) -> bool:
        ch = self.ch
        opts = self.options
        path = self.socket_path
        try:
            s = connect_unix(path, opts.connect_timeout_s, retry_busy=False)
        except FileNotFoundError:
            self._fail(
                f"no greend socket at {path} (is the daemon running? set $GREEND_SOCKET or socket= to point at it)"
            )
            return False
        except PermissionError:
            self._fail(f"permission denied on {path} (join the socket's group: sudo usermod -aG greend $USER)")
            return False
        except OSError as e:
            self._fail(f"cannot connect to {path}: {e.strerror or e}")
            return False
        self._sock = s
        self._reader.clear()
        self._outbox.clear()
        self._outbox_bytes = 0
        self._pending.clear()
        request_id = next(self._request_ids)
        fields = self._register_fields()
        self._pace_heard = False  # (a local_pace pushed before the reply is newer than the reply's)
        try:
            s.sendall(frame_request(request_id, "register", fields))
            ch.stats.messages += 1
            deadline = _monotonic() + opts.reply_timeout_s
            while True:
                remaining = deadline - _monotonic()
                if remaining <= 0:
                    raise _ConnectionLost(f"the daemon did not answer 'register' within {opts.reply_timeout_s:g} s")
                s.settimeout(remaining)
                reply = self._read_reply_blocking(s)
                if reply is None:
                    continue
                if is_event(reply):
                    self._on_event(reply)
                    continue
                if reply.get("id") != request_id:
                    continue
                break
        except (OSError, _ConnectionLost) as e:
            self._close_sock()
            msg = str(e) if isinstance(e, _ConnectionLost) else f"lost {path} while registering: {e}"
            if isinstance(e, (socket.timeout, TimeoutError)):
                msg = f"the daemon at {path} did not answer 'register' within {opts.reply_timeout_s:g} s"
            self._fail(msg)
            return False
        if not reply.get("ok"):
            error = reply.get("error")
            err: dict[str, Any] = error if isinstance(error, dict) else {"message": repr(error)}
            self._close_sock()
            field = err.get("field")
            if isinstance(field, str) and field in NEWER_REGISTER_FIELDS and "unknown field" in str(err.get("message")):
                # An older daemon: register again (at the next attempt) without what it lacks.
                ch.register_omit.add(field)
                log.info("greend: the daemon predates register field %r; registering without it", field)
                ch.stats.last_error = f"the daemon predates register field {field!r}: registering again without it"
                ch.stats.connected = False  # (no warning: nothing is wrong, the next attempt registers)
                return False
            code, message = err.get("code", "error"), err.get("message", "?")
            self._fail(f"the daemon refused to register job {self.job!r}: {code}: {message}")
            if self._ever_connected:  # (_fail warns at the first failure only)
                self._warnings.warn("refused", f"{ch.stats.last_error}; retrying")
            return False
        result = reply.get("result") or {}
        if isinstance(result, dict):
            heartbeat_s = positive(result.get("heartbeat_s"), float("inf"))
            if heartbeat_s is not None:
                self.heartbeat_s = min(max(heartbeat_s, HEARTBEAT_MIN_S), HEARTBEAT_MAX_S)
            self.booked_job = result["job"] if isinstance(result.get("job"), str) else None  # what its events name
            session = result.get("session")
            self.session = session if isinstance(session, int) else None
            # (absent: an older daemon, no precision policy: the callback's own tolerance)
            ch.on_tolerance(positive(result.get("precision_tolerance"), 10.0))
            directive = result.get("directive")
            if isinstance(directive, dict):
                self._on_directive(directive.get("precision"))
            # This daemon's pace for the job (null: none yet; absent: an older daemon, kept):
            # never a pace an earlier daemon measured, which may be out of date.
            pace = result.get("local_pace", ...)
            if pace is None and not self._pace_heard:
                ch.local_pace_s = ch.local_floor_s = ch.local_recheck_at = None
            elif isinstance(pace, dict) and not self._pace_heard:
                self._on_local_pace(pace, "a register reply's local_pace")
            self._form = "intervals" if result.get("report") == "intervals" else "steps"
            self._rows_every_s = max(opts.flush_interval_s, positive(result.get("rows_every_s"), 5.0) or 0.0)
            if isinstance(result.get("warning"), str):  # (what the daemon saw amiss: a job that named no GPUs)
                self._warnings.warn("daemon", result["warning"][:500])
        else:
            self._form = "steps"
        self._row_losses = len(fields.get("precisions") or ()) > 1
        s.setblocking(False)
        now = _monotonic()
        self._last_send_s = self._last_progress_s = now
        ch.stats.connects += 1
        ch.stats.connected = True
        if self._ever_connected:
            log.warning("greend: reconnected to %s; job %s registered again", path, self.job)
        else:
            log.info("greend: job %s registered with %s (session %s)", self.job, path, self.session)
        self._ever_connected = True
        return True

    def _read_reply_blocking(self, s: socket.socket) -> dict[str, Any] | None:
        """The next message while registering (None: a blank, malformed or overlong line)."""
        try:
            line = read_line_blocking(s, self._reader)
        except PeerClosed as e:
            raise _ConnectionLost(str(e)) from None
        except LineTooLong:
            self._reader.clear()
            self._malformed("a reply line longer than the protocol allows")
            return None
        return self._parse(line)

    def _fail(self, message: str) -> None:
        ch = self.ch
        ch.stats.last_error = message
        ch.stats.connected = False
        if self._failures == 0 and not self._ever_connected:
            self._warnings.warn(
                "connect",
                f"{message}; steps are not reported, retrying every "
                f"{self.options.reconnect_min_s:g}-{self.options.reconnect_max_s:g} s",
            )
        else:
            log.debug("greend: %s", message)

    def _disconnect(self, message: str) -> None:
        """Drop the connection: what its outbox held is counted dropped, and why is said."""
        stats = self.ch.stats
        stats.dropped += sum(n for _, n in self._outbox)
        self._close_sock()
        stats.last_error = message  # before "not connected": a reader of both sees why
        stats.connected = False

    def _lost(self, message: str) -> None:
        self._disconnect(message)
        self._failures = 1
        if not self._warnings.first_done:
            self._warnings.warn("lost", f"lost the daemon: {message}; training continues, reconnecting")
        else:
            opts = self.options
            log.warning("greend: lost the daemon: %s; training continues, reconnecting every %g-%g s",
                        message, opts.reconnect_min_s, opts.reconnect_max_s)  # fmt: skip

    def _close_sock(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
        self._outbox.clear()
        self._outbox_bytes = 0
        self._pending.clear()

    # Writing -----------------------------------------------------------------------
    def _queue_steps(self, force: bool = False) -> None:
        if self._form == "intervals":
            now = _monotonic()
            due = now - self._last_rows_s >= self._rows_every_s or len(self.ch.queue) >= MAX_STEPS_PER_MESSAGE
            if force or due:
                self._last_rows_s = now
                self._queue_rows()
            return
        queue = self.ch.queue
        while queue and self._outbox_bytes < OUTBOX_MAX_BYTES:
            batch: list[dict[str, Any]] = []
            while queue and len(batch) < MAX_STEPS_PER_MESSAGE:
                try:
                    raw = queue.popleft()
                except IndexError:
                    break
                record = self._clean(raw)
                if record is not None:
                    batch.append(step_fields(record))
            if batch:
                self._queue_message("steps", "steps", batch, [1] * len(batch))

    def _clean(self, record: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """The record as the wire can hold it (rows.clean); one whose index is no whole number: dropped, warned."""
        cleaned = clean(record)
        if cleaned is None:
            self.ch.stats.dropped += 1
            self._warnings.warn("index", f"step index={record[0]!r} is not a whole number: that step is not reported")
        return cleaned

    def _queue_message(self, op: str, key: str, items: list[dict[str, Any]], counts: list[int]) -> None:
        """``items`` (steps, or rows of ``counts`` steps each) as one ``op`` message, halved
        until each part fits MAX_MESSAGE_BYTES; an item that cannot be encoded is dropped
        alone (one warning), never the sender."""
        try:
            data = frame_message(op, {key: items})
        except (TypeError, ValueError) as e:  # (a value JSON cannot hold: found by halving)
            if len(items) > 1:
                half = len(items) // 2
                self._queue_message(op, key, items[:half], counts[:half])
                self._queue_message(op, key, items[half:], counts[half:])
                return
            self.ch.stats.dropped += sum(counts)
            self._warnings.warn("encode", f"a {op} entry cannot be sent ({e}): dropped, {items[0]!r:.300}")
            return
        if len(data) > MAX_MESSAGE_BYTES and len(items) > 1:
            half = len(items) // 2
            self._queue_message(op, key, items[:half], counts[:half])
            self._queue_message(op, key, items[half:], counts[half:])
            return
        self._enqueue(data, sum(counts))

    def _queue_rows(self) -> None:
        """The queued step records as "intervals" rows: consecutive steps at one precision summed into a
        row of at most MAX_STEPS_PER_MESSAGE steps, up to MAX_ROWS_PER_MESSAGE rows a message."""
        queue = self.ch.queue
        while queue and self._outbox_bytes < OUTBOX_MAX_BYTES:
            rows: list[dict[str, Any]] = []
            counts: list[int] = []
            row: Row | None = None
            while queue and len(rows) < MAX_ROWS_PER_MESSAGE:
                try:
                    raw = queue.popleft()
                except IndexError:
                    break
                record = self._clean(raw)
                if record is None:
                    continue
                if row is not None and (row.precision != record[8] or row.steps >= MAX_STEPS_PER_MESSAGE):
                    rows.append(row.fields())
                    counts.append(row.steps)
                    row = None
                if row is None:
                    if len(rows) >= MAX_ROWS_PER_MESSAGE:
                        queue.appendleft(record)
                        break
                    row = Row(record, self._row_losses)
                else:
                    row.add(record)
            if row is not None:
                rows.append(row.fields())
                counts.append(row.steps)
            if rows:
                self._queue_message("intervals", "rows", rows, counts)

    def _queue_request(self, op: str, fields: dict[str, Any]) -> int:
        request_id = next(self._request_ids)
        self._enqueue(frame_request(request_id, op, fields), 0)
        self._pending[request_id] = (op, _monotonic())
        return request_id

    def _has_pending(self, op: str) -> bool:
        return any(o == op for o, _ in self._pending.values())

    def _enqueue(self, data: bytes, records: int) -> None:
        self._outbox.append([data, records])
        self._outbox_bytes += len(data)

    def _write_available(self) -> None:
        assert self._sock is not None
        while self._outbox:
            item = self._outbox[0]
            data: bytes = item[0]
            try:
                n = self._sock.send(data)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                raise _ConnectionLost(f"cannot write to the daemon: {e.strerror or e}") from None
            now = _monotonic()
            self._last_progress_s = now
            self._outbox_bytes -= n
            if n < len(data):
                item[0] = data[n:]
                return
            self._outbox.popleft()
            self._last_send_s = now
            self.ch.stats.messages += 1
            self.ch.stats.sent += item[1]

    def _flush_blocking(self, deadline: float) -> bool:
        """Send everything queued (used when closing); False if the deadline passed."""
        while self._outbox and self._sock is not None:
            remaining = deadline - _monotonic()
            if remaining <= 0:
                return False
            try:
                _, writable, _ = select.select([], [self._sock], [], remaining)
            except (OSError, ValueError):
                return False
            if writable:
                self._write_available()
        return True

    # Reading -----------------------------------------------------------------------
    def _read_available(self) -> None:
        assert self._sock is not None
        try:
            chunk = self._sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            raise _ConnectionLost(f"cannot read from the daemon: {e.strerror or e}") from None
        if not chunk:
            raise _ConnectionLost("the daemon closed the connection")
        self._reader.feed(chunk)
        while True:
            line = self._reader.pop_line()
            if line is None:
                if self._reader.overflowing():
                    self._reader.clear()
                    self._malformed("a line longer than the protocol allows")
                return
            msg = self._parse(line)
            if msg is not None:
                self._on_message(msg)

    def _parse(self, line: bytes) -> dict[str, Any] | None:
        if not line.strip():
            return None
        try:
            return decode(line)
        except MalformedMessage as e:
            self._malformed(str(e))
            return None

    def _malformed(self, what: str) -> None:
        self.ch.stats.malformed += 1
        self._warnings.warn("malformed", f"ignoring a malformed message from the daemon ({what})")

    def _on_message(self, msg: dict[str, Any]) -> None:
        if is_event(msg):
            self._on_event(msg)
            return
        request_id = msg.get("id")
        op = None
        if isinstance(request_id, int) and request_id in self._pending:
            op = self._pending.pop(request_id)[0]
        if msg.get("ok") is False:
            error = msg.get("error")
            err: dict[str, Any] = error if isinstance(error, dict) else {}
            code, field = err.get("code"), err.get("field")
            if code == "bad_request" and field == "op" and op in (None, "heartbeat"):
                raise _ConnectionLost("the daemon no longer knows this session (it asks to register)")
            self._warnings.warn(
                f"refused:{code}:{field}",
                f"the daemon refused a message ({op or 'steps'}): {code}: {err.get('message', '?')}",
            )
        elif op == "end":
            result = msg.get("result")
            self.end_result = result if isinstance(result, dict) else None

    def _on_event(self, msg: dict[str, Any]) -> None:
        job = msg.get("job")
        if job is not None and self.booked_job is not None and job != self.booked_job:
            self._malformed(f"an event for another job ({job!r}, this is {self.booked_job!r})")
            return
        if msg.get("event") == "directive":
            if "precision" in msg:
                self._on_directive(msg.get("precision"), msg.get("reason"))
        elif msg.get("event") == "local_pace":
            self._pace_heard = True
            self._on_local_pace(msg, "a local_pace event")
        else:
            log.debug("greend: ignoring event %r", msg.get("event"))

    def _on_local_pace(self, msg: dict[str, Any], what: str) -> None:
        step_s, floor_s = positive(msg.get("step_s"), 1e6), positive(msg.get("floor_s"), 1e6)
        if step_s is None or (floor_s is None and "floor_s" in msg):  # (a daemon before floors sends none)
            self._malformed(f"{what} with step_s={msg.get('step_s')!r}, floor_s={msg.get('floor_s')!r}")
        ask = msg.get("recheck_at")
        if "recheck_at" in msg and not is_step(ask):
            self._malformed(f"{what} with recheck_at={ask!r}")
            ask = None
        if step_s is not None:
            self.ch.local_pace_s, self.ch.local_floor_s = step_s, floor_s
            self.ch.local_recheck_at = ask

    def _on_directive(self, level: Any, reason: Any = None) -> None:
        if not isinstance(level, str) or level not in PRECISIONS:
            self._malformed(f"a directive with an unknown precision {level!r}")
            return
        if level != self.ch.requested:
            log.info("greend: directive precision=%s (%s)", level, reason or "no reason given")
        self.ch.requested = level
        self.ch.on_directive()

    # Closing -----------------------------------------------------------------------
    def _finish(self) -> None:
        deadline = self._stop_deadline
        reason = self._stop_reason or "finished"
        if self._sock is None and (_monotonic() >= deadline or not self._connect()):  # (once, whatever the backoff)
            self.ch.stats.dropped += len(self.ch.queue)
            return
        assert self._sock is not None  # (connected, or connected just now)
        try:
            self._queue_steps(force=True)
            while self.ch.queue and _monotonic() < deadline:
                if not self._flush_blocking(deadline):
                    break
                self._queue_steps(force=True)
            events = self.ch.events  # (a rollback or a refusal since the last round: after its steps)
            while events:
                self._queue_request("precision_event", events.popleft())
            request_id = self._queue_request("end", {"reason": reason})
            if not self._flush_blocking(deadline):
                return
            while request_id in self._pending and _monotonic() < deadline:
                readable, _, _ = select.select([self._sock], [], [], max(0.0, deadline - _monotonic()))
                if readable:
                    self._read_available()
        except (_ConnectionLost, OSError) as e:
            log.debug("greend: closing: %s", e)
        finally:
            self.ch.stats.dropped += len(self.ch.queue) + sum(n for _, n in self._outbox)
            self.ch.stats.connected = False
