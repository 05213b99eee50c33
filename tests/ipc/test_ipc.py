from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from greend.errors import (
    ActuatorError,
    ConfigError,
    DaemonUnavailable,
    KnobError,
    PolicyError,
    ProtocolError,
    RequestRefused,
    StateError,
)
from greend.ipc.client import Client
from greend.ipc.server import MAX_MESSAGE_BYTES, Connection, Field, IpcServer, Limits, Peer
from tests.support import wait_for


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[IpcServer]:
    srv = IpcServer(tmp_path / "g.sock", mode=0o660, group=None)
    seen: list[Peer] = []

    def whoami(msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
        seen.append(conn.peer)
        return {"pid": conn.peer.pid, "uid": conn.peer.uid}

    srv.route("whoami", whoami)
    srv.route(
        "add",
        lambda m, c: {"sum": m["a"] + m.get("b", 0)},
        {"a": Field((int,), required=True, min=0, max=100), "b": Field((int,))},
    )
    srv.route("admin_only", lambda m, c: {"ok": True}, admin=True)
    srv.is_admin = lambda p: False
    srv.start()
    yield srv
    srv.stop()


def raw(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(str(path))
    return s


def read_reply(s: socket.socket) -> dict[str, Any]:
    buf = b""
    while b"\n" not in buf:
        chunk = s.recv(65536)
        assert chunk, "server closed the connection"
        buf += chunk
    return json.loads(buf.split(b"\n", 1)[0])


def test_peer_credentials_come_from_the_kernel(server: IpcServer) -> None:
    with Client(server.path) as c:
        r = c.request("whoami")
    assert r == {"pid": os.getpid(), "uid": os.getuid()}


def test_socket_mode_is_applied(server: IpcServer) -> None:
    assert (os.stat(server.path).st_mode & 0o777) == 0o660


@pytest.mark.parametrize(
    "payload, code, field",
    [
        (b"not json\n", "bad_json", None),
        (b"[1,2]\n", "bad_json", None),
        (b'{"op":"add","a":1}\n', "unsupported_version", "v"),
        (b'{"v":2,"op":"add","a":1}\n', "unsupported_version", "v"),
        (b'{"v":1}\n', "bad_request", "op"),
        (b'{"v":1,"op":"nope"}\n', "unknown_op", "op"),
        (b'{"v":1,"op":"add"}\n', "bad_request", "a"),
        (b'{"v":1,"op":"add","a":"3"}\n', "bad_request", "a"),
        (b'{"v":1,"op":"add","a":true}\n', "bad_request", "a"),
        (b'{"v":1,"op":"add","a":1000}\n', "bad_request", "a"),
        (b'{"v":1,"op":"add","a":1,"c":2}\n', "bad_request", "c"),
        (b'{"v":1,"op":"add","a":1,"id":[1]}\n', "bad_request", "id"),
        (b'{"v":1,"op":"admin_only"}\n', "forbidden", None),
        (b"\xff\xfe\n", "bad_json", None),
        (b'{"v":1,"op":"add","a":' + b"9" * 5000 + b"}\n", "bad_json", None),  # > int_max_str_digits
        (b"[" * 5000 + b"]" * 5000 + b"\n", "bad_json", None),  # deeper than the recursion limit
        (b'{"v":1,"op":"add","a":1,"id":"\\udcff"}\n', "bad_json", None),  # a lone surrogate: no text
        (b'{"v":1,"op":"add","a":1,"\\ud800":1}\n', "bad_json", None),  # (in a key too)
    ],
)
def test_bad_messages_get_error_replies_naming_the_field(
    server: IpcServer, payload: bytes, code: str, field: str | None
) -> None:
    s = raw(server.path)
    s.sendall(payload)
    r = read_reply(s)
    assert r["ok"] is False
    assert r["error"]["code"] == code
    assert r["error"].get("field") == field
    assert r["error"]["message"]
    # The same connection still works afterwards.
    s.sendall(b'{"v":1,"id":9,"op":"add","a":2,"b":3}\n')
    assert read_reply(s) == {"v": 1, "id": 9, "ok": True, "result": {"sum": 5}}
    s.close()


def test_oversized_message_is_refused_and_stream_resynchronises(server: IpcServer) -> None:
    s = raw(server.path)
    s.sendall(b'{"v":1,"op":"add","a":1,"pad":"' + b"x" * (2 * MAX_MESSAGE_BYTES) + b'"}\n')
    r = read_reply(s)
    assert r["error"]["code"] == "too_large"
    s.sendall(b'{"v":1,"id":"next","op":"add","a":4}\n')
    assert read_reply(s)["result"] == {"sum": 4}
    s.close()


def test_a_truncated_message_from_a_dead_client_does_not_affect_others(server: IpcServer) -> None:
    dead = raw(server.path)
    dead.sendall(b'{"v":1,"op":"ad')
    dead.close()
    with Client(server.path) as c:
        assert c.request("add", a=1, b=1) == {"sum": 2}


def test_forbidden_reply_says_what_is_needed(server: IpcServer) -> None:
    with Client(server.path) as c, pytest.raises(RequestRefused) as e:
        c.request("admin_only")
    assert e.value.code == "forbidden"
    assert "needs root" in str(e.value)


@pytest.mark.parametrize(
    "error, code, field",
    [
        (ProtocolError("no GPU 7 on this node", field="gpu"), "bad_request", "gpu"),
        (ConfigError("[policy] name 'x': unknown"), "bad_request", None),
        (PolicyError("policy 'x': no parameter 'y'"), "bad_request", None),
        (ActuatorError("gpu0: the driver refused the clock"), "refused", None),
        (
            KnobError("gpu0: no permission", device="gpu0", knob="clock_cap_mhz", reason="no_permission"),
            "refused",
            None,
        ),
        (StateError("saved-settings.json is corrupt"), "refused", None),
        (ZeroDivisionError("a bug"), "internal", None),
    ],
)
def test_a_handlers_greend_error_reaches_the_client_with_its_code(
    server: IpcServer, error: Exception, code: str, field: str | None
) -> None:
    def fail(msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
        raise error

    server.route("fail", fail)
    with Client(server.path) as c, pytest.raises(RequestRefused) as e:
        c.request("fail")
    assert e.value.code == code and e.value.field == field
    assert str(error) in str(e.value)
    with Client(server.path) as c:  # and the server goes on answering
        assert c.request("add", a=1) == {"sum": 1}


def test_stale_socket_of_a_crashed_daemon_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "g.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()  # bound but nobody listens: what a SIGKILLed daemon leaves
    srv = IpcServer(path)
    srv.route("ping", lambda m, c: {"pong": True})
    srv.start()
    try:
        with Client(path) as c:
            assert c.request("ping") == {"pong": True}
        with pytest.raises(OSError, match="already listening"):
            IpcServer(path).start()
    finally:
        srv.stop()


def test_client_without_daemon_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(DaemonUnavailable, match="is the daemon running"):
        Client(tmp_path / "absent.sock").connect()


def test_an_idle_connection_is_closed_and_a_push_does_not_shorten_its_wait(tmp_path: Path) -> None:
    """A connection that registered no job and says nothing for idle_timeout_s is closed
    with a reason; messages pushed to it meanwhile (which set the socket's timeout for their
    own write, here 0.25 s) do not shorten that wait."""
    srv = IpcServer(tmp_path / "g.sock", limits=Limits(idle_timeout_s=0.8))
    srv.route("add", lambda m, c: {"sum": m["a"] + m.get("b", 0)}, {"a": Field((int,), required=True)})
    srv.start()
    try:
        s = raw(tmp_path / "g.sock")
        s.sendall(b'{"v":1,"id":1,"op":"add","a":1}\n')
        assert read_reply(s)["result"] == {"sum": 1}
        pushes = 0
        t_end = time.monotonic() + 0.4  # pushes for 0.4 s of the client's silence
        while time.monotonic() < t_end:
            for conn in srv.connections():
                assert conn.send({"event": "ping", "n": pushes}, timeout_s=0.25)
            pushes += 1
            assert s.recv(65536)  # (the client reads its pushes, and sends nothing)
            time.sleep(0.01)
        s.sendall(b'{"v":1,"id":2,"op":"add","a":2}\n')  # 0.4 s silent: still open
        buf = b""
        while b'"id":2' not in buf:
            chunk = s.recv(65536)
            assert chunk, f"closed after {pushes} pushes and 0.4 s of silence"
            buf += chunk
        t0 = time.monotonic()
        rest = buf.split(b'"id":2', 1)[1]
        while b"idle_timeout_s" not in rest:  # then silent: closed, with the reason
            chunk = s.recv(65536)
            assert chunk, "closed without a reason"
            rest += chunk
        assert 0.6 < time.monotonic() - t0 < 5.0
        assert s.recv(65536) == b""
        assert srv.idle_closed == 1
        s.close()
    finally:
        srv.stop()


def test_escaped_text_and_surrogate_pairs_are_text(server: IpcServer) -> None:
    s = raw(server.path)
    s.sendall(b'{"v":1,"id":"\\u00e9\\ud83d\\ude00","op":"add","a":2,"b":3}\n')  # e-acute and an emoji
    assert read_reply(s) == {"v": 1, "id": "\u00e9\U0001f600", "ok": True, "result": {"sum": 5}}
    s.close()


def _adder(path: Path, limits: Limits, users_only: bool = True) -> IpcServer:
    """A started server with one op, ``add`` (``a`` back as ``sum``); ``users_only``: its
    clients are not admins (the per-uid limits hold for them)."""
    srv = IpcServer(path, limits=limits)
    srv.route("add", lambda m, c: {"sum": m["a"]}, {"a": Field((int,), required=True)})
    if users_only:
        srv.is_admin = lambda p: False
    srv.start()
    return srv


def test_a_flood_of_empty_lines_is_read_in_linear_time_and_counts_against_the_rate(tmp_path: Path) -> None:
    """Empty lines are answered by nothing; they were neither rate-limited nor cheap (each
    one copied the rest of the buffer): 8 MiB of them held a reply up for seconds."""
    srv = _adder(tmp_path / "g.sock", Limits(messages_per_s=1e9))
    try:
        s = raw(srv.path)
        s.settimeout(30)
        t0 = time.monotonic()
        s.sendall(b"\n" * (8 << 20) + b'{"v":1,"op":"add","a":3}\n')
        assert read_reply(s)["result"] == {"sum": 3}
        took = time.monotonic() - t0
        assert took < 3.0, took  # (over 20 s when each line copied the rest of the buffer)
        s.close()
    finally:
        srv.stop()
    srv = _adder(tmp_path / "h.sock", Limits(messages_per_s=200.0))
    try:
        s = raw(srv.path)
        s.sendall(b"\n" * 2000)  # ten seconds' worth of messages at 200/s
        assert wait_for(lambda: srv.throttled_s > 0.5)
        s.close()
    finally:
        srv.stop()


def test_a_long_message_costs_its_size_against_the_rate(tmp_path: Path) -> None:
    """One user's 64-row messages, each under the message rate, booked 56,000 rows a second
    and the daemon's ticks nearly stopped. A message costs one, and one more a KiB after
    its first: 40 messages of 20 KiB at 200 tokens a second take about 3 s to read,
    where 100 short ones go at once."""
    srv = _adder(tmp_path / "g.sock", Limits(messages_per_s=200.0))
    try:
        s = raw(srv.path)
        s.settimeout(30)
        replies = s.makefile("rb")
        short = b'{"v":1,"op":"add","a":1}\n' * 100
        s.sendall(short)
        for _ in range(100):
            replies.readline()
        assert srv.throttled_s < 0.5, srv.throttled_s
        pad = "x" * (20 << 10)
        s.sendall(b"".join(b'{"v":1,"op":"add","a":2,"pad":"%s"}\n' % pad.encode() for _ in range(40)))
        for _ in range(40):
            replies.readline()  # (each refused for its unknown field, once read)
        assert srv.throttled_s > 2.0, srv.throttled_s
        s.close()
    finally:
        srv.stop()


def test_a_client_refused_for_too_many_clients_is_told_why(tmp_path: Path) -> None:
    """The daemon answers a connection past max_connections with one line and closes it;
    a request whose send found it closed still reads that line (it said "broken pipe")."""
    srv = _adder(tmp_path / "g.sock", Limits(max_connections=4, reserved_admin=0), users_only=False)
    srv.registered = lambda conn: True  # (jobs' ranks: never closed to make room)
    held = [raw(srv.path) for _ in range(4)]
    try:
        assert wait_for(lambda: len(srv._conns) == 4)
        for _ in range(20):
            c = Client(srv.path, timeout_s=5.0)
            with pytest.raises(RequestRefused) as e:
                c.request("add", a=1, pad="x" * 300_000)  # (a send too big for the buffer: it meets the close)
            assert e.value.code == "unavailable" and "too many clients" in str(e.value)
            c.close()
    finally:
        for s in held:
            s.close()
        srv.stop()


def test_a_full_socket_closes_its_longest_idle_connection_that_is_no_rank_for_a_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Root (whom no per-uid limit holds) left 300 connections idle: every new client,
    a rank registering and greenctl included, was refused for a minute, until the idle
    timeout closed them. A new connection now takes the place of the longest idle one
    that is no job's rank (idle over EVICT_IDLE_S), which is told why; ranks stay."""
    import greend.ipc.server as server_mod

    monkeypatch.setattr(server_mod, "EVICT_IDLE_S", 0.2)
    srv = _adder(tmp_path / "g.sock", Limits(max_connections=4, reserved_admin=0), users_only=False)
    ranks: set[int] = set()
    srv.registered = lambda conn: conn.id in ranks
    held = []
    for n in range(1, 5):  # (one at a time: their ids in that order)
        held.append(raw(srv.path))
        assert wait_for(lambda n=n: len(srv._conns) == n)
    ranks.update(sorted(srv._conns)[:2])  # (the first two registered jobs)
    time.sleep(0.3)
    c = Client(srv.path, timeout_s=5.0)
    try:
        assert c.request("add", a=1) == {"sum": 1}
        reply = read_reply(held[2])  # (the longest idle of the two that are no rank)
        assert reply["error"]["code"] == "unavailable" and "socket was full" in reply["error"]["message"]
        for s in held[:2]:
            s.sendall(b'{"v":1,"id":1,"op":"add","a":2}\n')
            assert read_reply(s)["result"] == {"sum": 2}
        assert srv.evicted == 1
        ranks.update(srv._conns)  # every connection a rank now: a new one is refused
        time.sleep(0.3)
        with pytest.raises(RequestRefused, match="too many clients"):
            Client(srv.path, timeout_s=5.0).request("add", a=1)
    finally:
        c.close()
        for s in held:
            s.close()
        srv.stop()


def test_a_user_never_closes_an_admins_idle_connection_nor_one_that_would_not_make_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's connection to a socket full of an admin's idle ones: refused, and none of
    them closed (it closed one of root's, then was refused all the same, at each try)."""
    import greend.ipc.server as server_mod

    monkeypatch.setattr(server_mod, "EVICT_IDLE_S", 0.2)
    srv = _adder(tmp_path / "g.sock", Limits(max_connections=4, reserved_admin=2), users_only=False)
    held = []
    try:
        for n in range(1, 5):
            held.append(raw(srv.path))
            assert wait_for(lambda n=n: len(srv._conns) == n and all("_admin" in c.state for c in srv._conns.values()))
        time.sleep(0.3)
        srv.is_admin = lambda p: False  # (the next client: a user)
        for _ in range(3):
            with pytest.raises(RequestRefused, match="too many clients"):
                Client(srv.path, timeout_s=5.0).request("add", a=1)
        assert srv.evicted == 0 and len(srv._conns) == 4
    finally:
        for s in held:
            s.close()
        srv.stop()


@pytest.mark.parametrize("v", ["true", "1.0", '"1"'])
def test_a_version_that_only_python_calls_1_is_refused(server: IpcServer, v: str) -> None:
    s = raw(server.path)
    s.sendall(b'{"v":' + v.encode() + b',"id":"x","op":"add","a":1}\n')
    assert read_reply(s)["error"]["code"] == "unsupported_version"
    s.close()


def test_a_burst_of_empty_lines_holds_its_uid_s_next_request_back_a_second_at_most(tmp_path: Path) -> None:
    srv = _adder(tmp_path / "g.sock", Limits(messages_per_s=2000.0))
    try:
        s = raw(srv.path)
        s.sendall(b"\n" * 200_000)  # 100 s of messages at 2000/s
        time.sleep(0.5)
        s.close()
        c = Client(srv.path, timeout_s=30)
        for _ in range(3):
            t0 = time.monotonic()
            assert c.request("add", a=1) == {"sum": 1}
            assert time.monotonic() - t0 < 2.0  # (5 s each, over and over, with the debt unbounded)
        c.close()
    finally:
        srv.stop()


def test_what_a_client_sent_before_the_stop_is_handled_before_stop_returns(tmp_path: Path) -> None:
    """A daemon stopping under a running job reads its ranks' last messages (their steps)
    before it ends the job: sent before the stop, they were dropped unread, and the
    callback had counted them as sent. The connections' own leaving is not reported then
    (the daemon ends its jobs itself: its ranks did not leave)."""
    got: list[int] = []
    left: list[int] = []
    srv = IpcServer(tmp_path / "g.sock", limits=Limits(messages_per_s=1e9))

    def slow_add(m: dict[str, Any], c: Connection) -> dict[str, Any]:
        time.sleep(0.002)  # (a handler slower than the client: messages wait in the socket)
        got.append(m["a"])
        return {"sum": m["a"]}

    srv.route("add", slow_add, {"a": Field((int,), required=True)})
    srv.on_disconnect = lambda conn: left.append(conn.id)
    srv.start()
    s = raw(srv.path)
    s.sendall(b"".join(b'{"v":1,"op":"add","a":%d}\n' % i for i in range(300)))
    assert wait_for(lambda: len(got) > 0)
    srv.stop()
    assert got == list(range(300))
    assert left == []
    s.close()


def test_a_push_never_waits_on_a_peer_that_reads_nothing() -> None:
    """The tick thread pushes paces and directives to every rank of a job. A rank whose
    process reads nothing of what it is sent (its buffer full) held each push 0.2 s: 64
    such connections of one user stopped the tick for 13 s. A push with timeout 0 finds
    it cannot write, cuts the connection off and goes on; a reader is sent to as ever."""
    stuck, stuck_peer = socket.socketpair()
    ok, ok_peer = socket.socketpair()
    try:
        stuck.setblocking(False)
        with pytest.raises(BlockingIOError):
            while True:  # the peer reads nothing: fill what the kernel holds for it
                stuck.send(b"x" * 65536)
        stuck.setblocking(True)
        conns = [Connection(stuck, Peer(1, 1, 1), i) for i in range(64)] + [Connection(ok, Peer(2, 1, 1), 99)]
        t0 = time.monotonic()
        sent = [c.send({"v": 1, "op": "pace", "pace_s": 0.1}, timeout_s=0.0) for c in conns]
        took = time.monotonic() - t0
        assert sent == [False] * 64 + [True] and took < 0.2, took
        assert all(c.closed for c in conns[:64]) and not conns[64].closed
        assert json.loads(ok_peer.recv(4096).split(b"\n")[0])["pace_s"] == 0.1
        # A connection busy sending (its lock held) is skipped, not waited on, nor closed.
        busy = Connection(ok, Peer(2, 1, 1), 100)
        with busy._send_lock:
            assert busy.send({"v": 1}, timeout_s=0.0) is False and not busy.closed
    finally:
        for s in (stuck, stuck_peer, ok, ok_peer):
            s.close()


def test_a_message_nested_near_the_parsers_limit_with_an_escape_gets_a_reply(server: IpcServer) -> None:
    # json.loads takes it, the check that every string is text nests deeper: at one depth
    # near the limit that check raised RecursionError, which killed the connection's thread.
    s = raw(server.path)
    for depth in range(900, 1100, 5):
        s.sendall(b'{"v":1,"op":"add","a":1,"id":"\\u0041","x":' + b"[" * depth + b"]" * depth + b"}\n")
        r = read_reply(s)
        assert r["ok"] is False and r["error"]["code"] in ("bad_json", "bad_request"), (depth, r)
    for depth in range(980, 1000):  # every depth where it matters
        s.sendall(b'{"v":1,"op":"add","a":1,"id":"\\u0041","x":' + b"[" * depth + b"]" * depth + b"}\n")
        assert read_reply(s)["ok"] is False
