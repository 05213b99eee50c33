"""IPC fuzzing: thousands of random and mutated messages against the daemon's real
socket and real handlers (an in-process daemon on simulated GPUs), with no crash,
no hang and no leaked file descriptor; other clients are unaffected throughout."""

from __future__ import annotations

import json
import os
import random
import re
import socket
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from greend.config import Config
from greend.daemon.core import Daemon
from greend.ipc.client import Client, _connect_retrying
from greend.ipc.server import MAX_MESSAGE_BYTES
from tests.support import DaemonProc, start_daemon, wait_for

OPS = [
    "ping",
    "status",
    "probes",
    "jobs",
    "report",
    "register",
    "steps",
    "intervals",
    "heartbeat",
    "end",
    "pace",
    "precision_event",
    "energy",
    "cap_set",
    "cap_reset",
    "policy_show",
    "policy_set",
    "nope",
    "",
]
VALID = [
    {"v": 1, "op": "register", "job": "fuzz", "gpus": [0], "precisions": ["fp32", "bf16"]},
    {"v": 1, "op": "steps", "steps": [{"step": 0, "t0_s": 1.0, "t1_s": 1.5, "flops": 1e9, "loss": 1.0}]},
    {
        "v": 1,
        "op": "intervals",
        "rows": [
            {
                "first_step": 1,
                "last_step": 4,
                "steps": 4,
                "t0_s": 1.5,
                "t1_s": 3.5,
                "busy_s": 2.0,
                "busy_sq_s2": 1.0,
                "flops": 4e9,
                "loss_n": 2,
                "loss_sum": 2.0,
                "losses": [1.0, 1.0],
                "precision": "bf16",
            }
        ],
    },  # fmt: skip
    {"v": 1, "op": "heartbeat"},
    {"v": 1, "op": "report", "job": "fuzz"},
    {"v": 1, "op": "cap_set", "gpu": 0, "max_clock_mhz": 1200},
    {"v": 1, "op": "cap_set", "cpu_zone": "package-0", "power_limit_w": 100.0},
    {"v": 1, "op": "policy_set", "name": "static", "params": {"clock_cap_mhz": 1500}},
    {"v": 1, "op": "energy", "key": "gpu0", "t0_s": 0.0, "t1_s": 1.0},
    {"v": 1, "op": "precision_event", "kind": "rollback", "from": "bf16", "to": "fp32", "step": 3},
    {"v": 1, "op": "pace", "step_s": 0.1},
    {"v": 1, "op": "end", "reason": "done"},
]

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=40)
)
json_values = st.recursive(
    json_scalars,
    lambda kids: st.one_of(st.lists(kids, max_size=6), st.dictionaries(st.text(max_size=12), kids, max_size=6)),
    max_leaves=20,
)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    base = dict(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(0, 3))):
        action = draw(st.sampled_from(["drop", "retype", "add", "op"]))
        keys = list(base)
        if action == "drop" and keys:
            base.pop(draw(st.sampled_from(keys)))
        elif action == "retype" and keys:
            base[draw(st.sampled_from(keys))] = draw(json_values)
        elif action == "add":
            base[draw(st.text(max_size=10))] = draw(json_values)
        else:
            base["op"] = draw(st.sampled_from(OPS))
    line = json.dumps(base).encode()
    if draw(st.booleans()):  # byte-level damage too
        cut = draw(st.integers(0, len(line)))
        line = line[:cut] + draw(st.binary(max_size=8)) + line[cut:]
    return line + b"\n"


random_lines = st.one_of(
    st.binary(max_size=200).map(lambda b: b.replace(b"\n", b"") + b"\n"),
    json_values.map(lambda v: json.dumps(v).encode() + b"\n"),
    st.dictionaries(st.sampled_from(["v", "op", "id", "job", "steps", "gpu"]), json_values, max_size=5).map(
        lambda d: json.dumps(d).encode() + b"\n"
    ),
)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    import threading

    tmp = tmp_path_factory.mktemp("fuzz")
    cfg = Config()
    cfg.daemon.state_dir = tmp / "state"
    cfg.daemon.socket = tmp / "g.sock"
    cfg.daemon.socket_group = ""
    cfg.daemon.hz = 20.0
    cfg.sim.gpus = 1
    cfg.probes.enabled = ["host"]
    cfg.policy.period_s = 0.2
    d = Daemon(cfg)
    d.start()
    t = threading.Thread(target=d.run, daemon=True)
    t.start()
    yield d
    d.stop()
    t.join(5)
    d.close()


class Conn:
    def __init__(self, path: Path) -> None:
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(5)
        _connect_retrying(self.s, str(path), 5.0)

    def roundtrip(self, line: bytes) -> None:
        """Send a line, then the fuzzed job's report (what a bad value kept would break)
        and a ping: the ping's answer proves the daemon is still there and the stream is
        in sync (every reply before it is drained)."""
        self.s.sendall(line + b'{"v":1,"op":"report","job":"fuzz"}\n{"v":1,"id":"probe","op":"ping"}\n')
        buf = b""
        deadline = time.monotonic() + 5
        while b'"id":"probe"' not in buf:
            assert time.monotonic() < deadline, f"no answer after {line[:200]!r}"
            chunk = self.s.recv(65536)
            assert chunk, f"the daemon closed the connection after {line[:200]!r}"
            buf += chunk
        for raw in buf.splitlines():
            msg = json.loads(raw)  # every reply is well-formed JSON
            assert "ok" in msg or "event" in msg


def exchange(c: Conn, line: bytes) -> dict:
    c.s.sendall(line + b"\n")
    buf = b""
    while b"\n" not in buf:
        chunk = c.s.recv(65536)
        assert chunk, f"the daemon closed the connection after {line!r}"
        buf += chunk
    return json.loads(buf)


@pytest.mark.parametrize("bad", [b"Infinity", b"-Infinity", b"NaN", b"1e999"])
def test_non_finite_numbers_are_refused_and_the_job_stays_readable(daemon: Daemon, bad: bytes) -> None:
    # Python's json reads these; a reply cannot carry them. Kept, one would break every
    # later report of the job, for every client.
    c = Conn(daemon.cfg.daemon.socket)
    job = f"nonfinite-{bad.decode().strip('-')}".encode()
    t = time.monotonic()  # (a step's times are this host's monotonic clock, as the callback's)
    span = b'"t0_s":%.3f,"t1_s":%.3f' % (t - 0.5, t)
    assert exchange(c, b'{"v":1,"op":"register","job":"%s","gpus":[0]}' % job)["ok"] is True
    r = exchange(c, b'{"v":1,"op":"steps","steps":[{"step":0,%s,"flops":1e9,"loss":%s}]}' % (span, bad))
    assert r["ok"] is False and r["error"]["field"] == "steps[0].loss", r
    assert "finite" in r["error"]["message"]
    r = exchange(c, b'{"v":1,"op":"steps","steps":[{"step":0,%s,"flops":%s}]}' % (span, bad))
    assert r["ok"] is False and r["error"]["field"] == "steps[0].flops", r
    # A good step gets no reply (steps are fire-and-forget); the report then shows it,
    # to this client and to another.
    c.s.sendall(b'{"v":1,"op":"steps","steps":[{"step":0,%s,"flops":1e9,"loss":2.5}]}\n' % span)
    mine = exchange(c, b'{"v":1,"op":"report","job":"%s"}' % job)
    assert mine["ok"] is True and mine["result"]["steps"] == 1, mine
    with Client(daemon.cfg.daemon.socket) as other:
        rep = other.request("report", job=job.decode())
    assert rep["steps"] == 1 and rep["flops"] == 1e9
    c.s.close()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@settings(
    max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@pytest.mark.slow
@given(lines=st.lists(st.one_of(mutated(), random_lines), min_size=1, max_size=4))
def test_mutated_and_random_messages(daemon: Daemon, lines: list[bytes]) -> None:
    c = Conn(daemon.cfg.daemon.socket)
    try:
        for line in lines:
            c.roundtrip(line)
    finally:
        c.s.close()


def test_no_leak_and_other_clients_unaffected(daemon: Daemon) -> None:
    import random

    rng = random.Random(7)
    watcher = Client(daemon.cfg.daemon.socket)
    watcher.connect()
    time.sleep(0.2)
    before = max(_fds() for _ in range(5))  # a file a probe opens for a moment is not a leak
    assert daemon.server is not None
    requests_before, refused_before = daemon.server.requests, daemon.server.refused_full
    whole_lines = 0
    for i in range(500):
        c = Conn(daemon.cfg.daemon.socket)
        base = dict(rng.choice(VALID))
        if rng.random() < 0.5:
            base[rng.choice(list(base))] = rng.choice([None, -1, "x" * 300, [1, 2], {"a": 1}, 1e308, True])
        line = json.dumps(base).encode()[: rng.randint(1, 400)]
        if rng.random() < 0.7:
            line += b"\n"
            whole_lines += 1
        c.s.sendall(line)
        c.s.close()
        if i % 50 == 0:
            assert watcher.request("ping")["pong"] is True
    # Every whole line is dispatched, even from a client that closed at once, unless a
    # loaded machine had MAX_CONNECTIONS open and the server turned the client away; plus
    # the watcher's 10 pings. Counted from this test's start. Wait for that first: a
    # connection still in the listen backlog holds no fd yet, so a settled fd count alone
    # could be read before the server has even accepted the last clients.
    srv = daemon.server

    def handled() -> int:
        return srv.requests - requests_before + srv.refused_full - refused_before

    assert wait_for(lambda: handled() >= whole_lines + 10, 20), (handled(), whole_lines)
    now = [0]

    def closed() -> bool:
        now[0] = _fds()
        return now[0] <= before

    assert wait_for(closed, 10), f"file descriptors leaked: {now[0]} open, {before} before"
    assert watcher.request("status")["ticks"] > 0
    watcher.close()


# The real daemon, as a user runs it -----------------------------------------------

_UNICODE = 'aé€𝄞中文\u200bمرحبا\U0001f600\x00\t"\\\u2028'


def _rand_json(rng: random.Random, depth: int = 0) -> object:
    """A random JSON value: huge numbers, long and unicode strings, nested containers."""
    kind = rng.randrange(12 if depth < 4 else 8)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.randint(-5, 5000)
    if kind == 3:
        return rng.choice([1, -1]) * rng.randint(2**62, 2**300)  # huge, but json.dumps can write it
    if kind == 4:
        return rng.choice([1e308, -1e308, 5e-324, -0.0, 1.7976931348623157e308, rng.uniform(-1e9, 1e9)])
    if kind == 5:
        return "".join(rng.choice(_UNICODE) for _ in range(rng.randint(0, 40)))
    if kind == 6:
        return rng.choice(["x", "a" * 3000]) * rng.randint(1, 4)  # long strings
    if kind == 7:
        return "".join(chr(rng.randint(0x20, 0x10FFFF)) for _ in range(rng.randint(1, 30)))
    if kind in (8, 9):
        return [_rand_json(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    return {_rand_key(rng): _rand_json(rng, depth + 1) for _ in range(rng.randint(0, 5))}


def _rand_key(rng: random.Random) -> str:
    return rng.choice(
        [
            "",
            "x",
            "id",
            "v",
            "op",
            "job",
            "gpu",
            "steps",
            "params",
            "__proto__",
            "\u00e9t\u00e9",
            "k" * 200,
            str(rng.random()),
        ]
    )


# Values that only raw text can carry (json.dumps cannot write them): numbers past
# Python's int digit limit or a float's range, non-finite literals, very deep nesting.
def _raw_value(rng: random.Random) -> str:
    choice = rng.randrange(6)
    if choice == 0:
        return rng.choice(["", "-"]) + "9" * rng.choice([400, 4300, 4301, 6000])
    if choice == 1:
        return rng.choice(["1e999", "-1e999", "1e-999", "123456789.123456789e308"])
    if choice == 2:
        return rng.choice(["NaN", "Infinity", "-Infinity"])
    depth = rng.choice([50, 500, 2000, 10000])
    if choice in (3, 4):
        return "[" * depth + "1" + "]" * depth
    return '{"a":' * depth + "1" + "}" * depth


def _mutate(rng: random.Random) -> tuple[bytes, bool]:
    """One message from VALID, mutated: (the bytes, whether it ends with a newline)."""
    base = dict(rng.choice(VALID))
    raws: dict[str, str] = {}
    for _ in range(rng.randint(1, 3)):
        action = rng.choice(["drop", "retype", "retype", "raw", "add", "op"])
        keys = list(base)
        if action == "drop" and keys:
            base.pop(rng.choice(keys))
        elif action == "retype" and keys:
            base[rng.choice(keys)] = _rand_json(rng)
        elif action == "raw" and keys:
            token = f"@@RAW{len(raws)}@@"
            raws[json.dumps(token)] = _raw_value(rng)
            base[rng.choice(keys)] = token
        elif action == "add":
            base[_rand_key(rng)] = _rand_json(rng)
        else:
            base["op"] = rng.choice(OPS)
    text = json.dumps(base, ensure_ascii=rng.random() < 0.5)
    for token, raw in raws.items():
        text = text.replace(token, raw)
    line = text.encode("utf-8", "surrogatepass")
    r = rng.random()
    if r < 0.15:  # splice random bytes in
        cut = rng.randint(0, len(line))
        line = line[:cut] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 8))) + line[cut:]
    elif r < 0.20:  # oversized: past MAX_MESSAGE_BYTES, still one line
        pad = "p" * (MAX_MESSAGE_BYTES + rng.randint(1, 40_000))
        line = json.dumps({**base, "pad": pad} if rng.random() < 0.5 else [pad]).encode()
    elif r < 0.23:  # exactly at and just past the limit, newline included
        size = MAX_MESSAGE_BYTES - 1 + rng.randint(0, 1)  # without the newline
        head = b'{"v":1,"op":"ping","pad":"'
        line = head + b"q" * (size - len(head) - 2) + b'"}'
    if rng.random() < 0.06:
        return line[: rng.randint(0, len(line))], False  # truncated, no newline
    return line, True


class _Session:
    """One fuzzing client: sends lines and reads replies until a ping of its own comes back."""

    def __init__(self, path: Path, replies: list[tuple[bytes, bytes]], problems: list[str]) -> None:
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(10)
        _connect_retrying(self.s, str(path), 5.0)
        self.replies, self.problems = replies, problems
        self.buf = b""
        self.n = 0

    def roundtrip(self, line: bytes) -> bool:
        self.n += 1
        probe = f"probe-{self.n}"
        try:
            self.s.sendall(line + b"\n" + b'{"v":1,"id":"%s","op":"ping"}\n' % probe.encode())
            while True:
                lines = self.buf.split(b"\n")
                self.buf = lines.pop()
                for raw in lines:
                    self.replies.append((line, raw))
                    try:
                        msg = json.loads(raw)
                    except ValueError:
                        continue  # reported with all the replies
                    if isinstance(msg, dict) and msg.get("id") == probe and msg.get("ok") is True:
                        return True
                chunk = self.s.recv(65536)
                if not chunk:
                    self.problems.append(
                        f"the daemon closed the connection after {line[:300]!r} (unanswered bytes {self.buf[:200]!r})"
                    )
                    return False
                self.buf += chunk
        except OSError as e:
            self.problems.append(f"{type(e).__name__}: {e} after sending {line[:300]!r}")
            return False

    def close(self) -> None:
        if self.buf:
            self.replies.append((b"<end of connection>", self.buf))  # a reply without its newline
        self.s.close()


def _ask(path: Path, op: str) -> dict:  # type: ignore[type-arg]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        _connect_retrying(s, str(path), 5.0)
        s.sendall(b'{"v":1,"id":"final","op":"%s"}\n' % op.encode())
        buf = b""
        while True:
            for raw in buf.split(b"\n")[:-1]:
                msg = json.loads(raw)
                if msg.get("id") == "final":
                    return msg
            chunk = s.recv(65536)
            if not chunk:
                raise ConnectionError(f"the daemon closed the connection before answering {op!r}")
            buf += chunk


@pytest.mark.e2e
def test_real_daemon_survives_fuzzing(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "--sim", "1", "--hz", "20")
    daemons.append(d)
    pid = d.proc.pid

    def fds() -> int:
        return len(os.listdir(f"/proc/{pid}/fd"))

    time.sleep(0.3)
    before = max(fds() for _ in range(5))  # a file a probe opens for a moment is not a leak
    rng = random.Random(20240611)
    replies: list[tuple[bytes, bytes]] = []  # (what was sent, one reply line)
    problems: list[str] = []  # connections the daemon dropped or left unanswered
    sent = conns = vanished_jobs = cut_mid = 0
    while sent < 2200:
        conns += 1
        c = _Session(d.socket, replies, problems)
        kind = rng.random()
        try:
            if kind < 0.15:  # register a job, maybe send steps, then vanish without "end"
                job = f"fz-{conns}"
                c.s.sendall(b'{"v":1,"op":"register","job":"%s","gpus":[0]}\n' % job.encode())
                sent += 1
                for _ in range(rng.randint(0, 3)):
                    line, _nl = _mutate(rng)
                    c.s.sendall(line + b"\n")
                    sent += 1
                vanished_jobs += 1
                continue
            for _ in range(rng.randint(3, 14)):
                line, whole = _mutate(rng)
                sent += 1
                if not whole:  # close mid-message
                    c.s.sendall(line)
                    cut_mid += 1
                    break
                if not c.roundtrip(line):
                    break
            else:
                if kind < 0.30:  # close in the middle of a message
                    msg = json.dumps(rng.choice(VALID)).encode()
                    c.s.sendall(msg[: rng.randint(1, len(msg) - 1)])
                    sent += 1
                    cut_mid += 1
                elif kind < 0.35:  # half of an oversized line, then gone
                    c.s.sendall(b'{"v":1,"op":"ping","x":"' + b"z" * (MAX_MESSAGE_BYTES + rng.randint(1, 9999)))
                    sent += 1
                    cut_mid += 1
        except OSError as e:
            problems.append(f"{type(e).__name__}: {e} on connection {conns}")
        finally:
            c.close()

    # 1. The process lives.
    assert d.proc.poll() is None, f"greend exited ({d.proc.returncode}) under fuzzing:\n{d.log_text()[-5000:]}"

    # 2. It answers status on a fresh connection, and its loop still ticks.
    first = _ask(d.socket, "status")
    time.sleep(0.3)
    second = _ask(d.socket, "status")
    assert first.get("ok") and second.get("ok"), f"status failed after fuzzing: {first} / {second}"
    t1, t2 = first["result"]["ticks"], second["result"]["ticks"]
    assert t2 > t1, f"the tick loop stopped after fuzzing: ticks {t1} then {t2} 0.3 s later"

    # 3. Every connection is closed again. One still in the listen backlog holds no fd
    # yet, so wait for the count to settle AND a last ping to go through (the server
    # accepts in order: by then it has taken every fuzzing client).
    now = [0]

    def settled() -> bool:
        pong = _ask(d.socket, "ping")
        now[0] = fds()
        return pong.get("ok") is True and now[0] <= before + 2

    assert wait_for(settled, 15), (
        f"file descriptors leaked: greend holds {now[0]} after fuzzing, {before} before ({conns} connections)"
    )

    # 4. Every reply was a JSON object on a line, a reply or an event.
    bad = []
    for sent_line, raw in replies:
        try:
            msg = json.loads(raw)
            ok = isinstance(msg, dict) and ("ok" in msg or "event" in msg)
        except ValueError:
            ok = False
        if not ok:
            bad.append(f"{raw[:200]!r} (after {sent_line[:200]!r})")
    assert not bad, f"{len(bad)} malformed replies of {len(replies)}:\n" + "\n".join(bad[:10])

    # 5. No traceback in the log: not even a handler error that the server answered
    # with "internal" (a handler that crashes on client input is a bug).
    log_text = d.log_text()
    lines = log_text.splitlines()
    tracebacks = [i for i, ln in enumerate(lines) if "Traceback" in ln]
    internal = [f"{s[:300]!r} -> {r[:300]!r}" for s, r in replies if b'"code":"internal"' in r]
    excerpts = ["\n".join(lines[max(0, i - 1) : i + 25]) for i in tracebacks[:3]]
    kinds = Counter(ln for ln in lines if re.match(r"^\w+(Error|Exception): ", ln))
    assert not tracebacks, (
        f"greend logged {len(tracebacks)} traceback(s) while fuzzed (threads' output may interleave);"
        f" errors: {dict(kinds)}\nfirst ones:\n"
        + "\n-----\n".join(excerpts)
        + "\n-----\ninputs answered 'internal':\n"
        + "\n".join(internal[:5])
        + "\nconnections broken:\n"
        + "\n".join(problems[:5])
    )
    assert not internal, "handler errors answered 'internal':\n" + "\n".join(internal[:10])

    # 6. A bad message never closes the connection nor goes unanswered.
    assert not problems, f"{len(problems)} connections broken by fuzz input:\n" + "\n".join(problems[:10])
    assert sent >= 2000 and conns >= 100, (sent, conns)
    print(f"{sent} messages over {conns} connections ({vanished_jobs} jobs vanished, {cut_mid} cut mid-message)")
