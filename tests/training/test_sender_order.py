"""The order of what the sender writes: a precision event never goes out before the
step records queued ahead of it, not even when the outbox is full (a slow daemon)."""

from __future__ import annotations

import json
import socket
import time
from collections import deque

from greend.training.sender import OUTBOX_MAX_BYTES, Channel, Sender, SenderOptions
from greend.training.warn import OnceWarnings


def _record(i: int, level: str) -> tuple[object, ...]:
    t0 = 100.0 + i * 0.01
    return (i, t0, t0 + 0.009, 1e9, 8, 0, 0.5, False, level)


def _lines(sock: socket.socket) -> list[dict[str, object]]:
    data = b""
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    return [json.loads(line) for line in data.split(b"\n") if line.strip()]


def test_an_event_waits_for_the_steps_a_full_outbox_left_behind() -> None:
    ch = Channel(queue=deque(maxlen=10_000))
    sender = Sender(
        ch,
        SenderOptions(flush_interval_s=0.01),
        job="j",
        socket_path="/nonexistent",
        register_fields=dict,
        warnings=OnceWarnings(),
    )
    mine, daemon = socket.socketpair()
    mine.setblocking(False)
    daemon.setblocking(False)
    try:
        sender._sock = mine
        sender._form = "intervals"
        sender._rows_every_s = 5.0  # rows held for the daemon's cadence
        sender._last_rows_s = time.monotonic()
        sender._last_send_s = sender._last_progress_s = time.monotonic()  # (connected just now)
        # The outbox full of earlier messages (blank lines: nothing for the daemon to read).
        sender._enqueue(b"\n" * OUTBOX_MAX_BYTES, 0)
        for i in range(8):
            ch.queue.append(_record(i, "bf16"))
        ch.events.append({"kind": "rollback", "from": "bf16", "to": "fp32", "step": 7, "reason": "non-finite loss"})
        sender._run_once()
        # Nothing new could be queued behind the full outbox: the event waits with the steps.
        assert len(ch.events) == 1 and len(ch.queue) == 8
        sent: list[dict[str, object]] = []
        for _ in range(200):
            sent += _lines(daemon)  # the daemon reads
            if not ch.events and not sender._outbox:
                break
            sender._run_once()
        sent += _lines(daemon)
        ops = [m["op"] for m in sent]
        assert ops == ["intervals", "precision_event"], ops
        rows = sent[0]["rows"]
        assert isinstance(rows, list) and rows[-1]["last_step"] == 7
    finally:
        mine.close()
        daemon.close()
