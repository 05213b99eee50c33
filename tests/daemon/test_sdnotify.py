"""sd_notify over a real AF_UNIX datagram socket, as systemd sets it up."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from greend.daemon import sdnotify


def _recv_all(sock: socket.socket) -> list[str]:
    out = []
    sock.settimeout(1.0)
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except (TimeoutError, BlockingIOError):
            return out
        sock.settimeout(0.05)


@pytest.fixture(params=["path", "abstract"])
def notify_socket(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        path = tmp_path / "notify"
        sock.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    else:
        name = f"greend-test-{uuid.uuid4().hex}"
        sock.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    try:
        yield sock
    finally:
        sock.close()


def test_messages_arrive(notify_socket: socket.socket) -> None:
    assert sdnotify.ready() is True
    assert sdnotify.watchdog() is True
    assert sdnotify.status("3 GPUs, policy none") is True
    assert sdnotify.stopping() is True
    assert sdnotify.notify("EXTEND_TIMEOUT_USEC=5000000") is True
    assert _recv_all(notify_socket) == [
        "READY=1",
        "WATCHDOG=1",
        "STATUS=3 GPUs, policy none",
        "STOPPING=1",
        "EXTEND_TIMEOUT_USEC=5000000",
    ]


def test_status_is_one_line(notify_socket: socket.socket) -> None:
    assert sdnotify.status("line one\nline two\n")
    assert _recv_all(notify_socket) == ["STATUS=line one line two"]


def test_not_under_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.ready() is False
    assert sdnotify.watchdog() is False
    assert sdnotify.stopping() is False
    assert sdnotify.status("x") is False
    assert sdnotify.notify("READY=1", environ={}) is False


@pytest.mark.parametrize("value", ["", "relative/path", "@", "vsock:2:1234"])
def test_unusable_socket_values(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert sdnotify.ready() is False


def test_dead_socket_is_false_not_an_exception(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert sdnotify.ready() is False
    monkeypatch.setenv("NOTIFY_SOCKET", "@greend-test-nobody-" + uuid.uuid4().hex)
    assert sdnotify.watchdog() is False
    # A stream socket where a datagram one is expected (EPROTOTYPE).
    stream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stream.bind(str(tmp_path / "stream"))
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "stream"))
        assert sdnotify.ready() is False
    finally:
        stream.close()


def test_watchdog_interval() -> None:
    me = str(os.getpid())
    assert sdnotify.watchdog_interval_s(environ={}) is None
    assert sdnotify.watchdog_interval_s(environ={"WATCHDOG_USEC": "30000000"}) == 30.0
    assert sdnotify.watchdog_interval_s(environ={"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": me}) == 30.0
    # Meant for another process (e.g. we are a child of the service's main process).
    other = str(os.getpid() + 1)
    assert sdnotify.watchdog_interval_s(environ={"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": other}) is None
    for bad in ("0", "-5", "abc", "1.5"):
        assert sdnotify.watchdog_interval_s(environ={"WATCHDOG_USEC": bad}) is None
    assert sdnotify.watchdog_interval_s(environ={"WATCHDOG_USEC": "1000", "WATCHDOG_PID": "x"}) is None


def test_watchdog_interval_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "2500000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sdnotify.watchdog_interval_s() == 2.5
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert sdnotify.watchdog_interval_s() is None


def test_pinger_pings_once_per_half_interval() -> None:
    now = [100.0]
    sent: list[float] = []

    def send() -> bool:
        sent.append(now[0])
        return True

    p = sdnotify.WatchdogPinger(30.0, clock=lambda: now[0], send=send)
    assert p.enabled
    for _ in range(400):  # 40 s of 10 Hz ticks
        p.tick()
        now[0] += 0.1
    assert sent[0] == 100.0
    gaps = [b - a for a, b in zip(sent, sent[1:])]
    assert gaps and all(14.9 < g < 15.2 for g in gaps), gaps
    assert p.pings == len(sent) == 3


def test_pinger_disabled_without_watchdog(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    p = sdnotify.WatchdogPinger(send=lambda: pytest.fail("must not send"))  # type: ignore[arg-type]
    assert not p.enabled
    assert p.tick() is False


def test_pinger_end_to_end(notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "10000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    p = sdnotify.WatchdogPinger()
    assert p.interval_s == 10.0
    assert p.tick() is True
    assert p.tick() is False  # too soon
    assert _recv_all(notify_socket) == ["WATCHDOG=1"]
