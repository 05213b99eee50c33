"""Every op of the protocol, fuzzed field by field from its own schema against a real
daemon (``greend run --sim 2`` in a subprocess, on a real Unix socket): values inside
each field's range, at its edges, just past them, and hostile ones (integers of 310
digits, 5e-324, 1e308, NaN written as text, wrong types). The property: whatever comes
in, the daemon lives, answers every request (never ``internal``), ``status`` answers
throughout, and a victim job on the same node books exactly the steps it sent.

The generator is seeded (the failing seed and message are printed), so a failure
replays exactly."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from greend.ipc.client import _connect_retrying
from greend.protocol import INTERVAL_FIELDS, SCHEMAS, STEP_FIELDS, Field
from tests.support import DaemonProc, start_daemon

pytestmark = pytest.mark.e2e

SEED = 27
MESSAGES = 10_000
HUGE = 10**309  # a double's range, one digit past it
HOSTILE: list[Any] = [HUGE, -HUGE, (1 << 53) + 1, 5e-324, -5e-324, 1e308, -1e308, 1.7976931348623157e308,
                      0, -0.0, -1, "x", "", None, True, [], {}, [HUGE], "a" * 300]  # fmt: skip
RAW = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1" + "0" * 400]  # what json.dumps cannot write


class Fuzzer:
    """Messages of every op, each field drawn from its schema's range and around it."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.raws: dict[str, str] = {}

    def value(self, spec: Field) -> Any:
        rng = self.rng
        r = rng.random()
        if r < 0.25:
            return rng.choice(HOSTILE)
        if r < 0.30:  # a value only raw text can carry
            token = f"@@RAW{len(self.raws)}@@"
            self.raws[json.dumps(token)] = rng.choice(RAW)
            return token
        if spec.choices:
            return rng.choice(spec.choices) if r < 0.9 else "nope"
        t = spec.types[0]
        if t in (int, float):
            lo = spec.min if spec.min is not None else -1e6
            hi = spec.max if spec.max is not None else 1e6
            edge = rng.random()
            if edge < 0.15:
                v = rng.choice([lo, hi])
            elif edge < 0.3:
                v = rng.choice([lo - 1, hi + 1, lo * 2 - 1, hi * 2 + 1])
            else:
                v = rng.uniform(lo, min(hi, lo + 1e6)) if rng.random() < 0.7 else rng.uniform(lo, hi)
            return int(v) if t is int else float(v)
        if t is str:
            return "".join(rng.choice("ab.-_:/é€") for _ in range(rng.randint(0, (spec.max_len or 20) + 2)))
        if t is bool:
            return rng.random() < 0.5
        if t is list:
            n = rng.randint(0, min(8, (spec.max_len or 8) + 1))
            if spec.item_types == (int,):
                return [rng.choice([rng.randint(0, 3), -1, 1023, 1024, HUGE]) for _ in range(n)]
            return [self.value(Field((float,), min=-3.0, max=3.0)) for _ in range(n)]
        if t is dict:
            return {rng.choice(["clock_cap_mhz", "power_limit_w", "x", "max_slowdown"]): self.value(Field((float,)))}
        return None

    def fields(self, schema: dict[str, Field], valid: dict[str, Any]) -> dict[str, Any]:
        """``valid`` with one to three of the schema's fields drawn afresh (or dropped),
        now and then an unknown field added."""
        msg = dict(valid)
        for _ in range(self.rng.randint(1, 3)):
            name = self.rng.choice(list(schema))
            if self.rng.random() < 0.1:
                msg.pop(name, None)
            else:
                msg[name] = self.value(schema[name])
        if self.rng.random() < 0.03:
            msg["extra"] = 1
        return msg

    def row(self) -> dict[str, Any]:
        now = time.monotonic()
        n = self.rng.randint(1, 50)
        valid = {"first_step": 0, "last_step": n - 1, "steps": n, "t0_s": now - 1.0, "t1_s": now - 0.5,
                 "busy_s": 0.4, "busy_sq_s2": 0.16 / n, "flops": 1e12 * n, "samples": 32 * n, "tokens": 0,
                 "loss_n": 2, "loss_sum": 4.0, "losses": [2.0, 2.0], "precision": "fp32"}  # fmt: skip
        return valid if self.rng.random() < 0.2 else self.fields(INTERVAL_FIELDS, valid)

    def message(self, op: str) -> dict[str, Any]:
        rng = self.rng
        if op == "intervals":
            body: dict[str, Any] = {"rows": [self.row() for _ in range(rng.randint(1, 4))]}
        elif op == "steps":
            now = time.monotonic()
            valid = {"step": 0, "t0_s": now - 0.2, "t1_s": now - 0.1, "flops": 1e9, "loss": 2.0}
            body = {"steps": [self.fields(STEP_FIELDS, valid) for _ in range(rng.randint(1, 4))]}
        elif op == "policy_set" and rng.random() < 0.5:
            # A real policy with fuzzed parameters; "none" half the time (the node's default).
            name = rng.choice(["none", "none", "static", "efficient", "budget"])
            body = {"name": name, "params": self.value(Field((dict,)))}
        elif op == "register":
            body = self.fields(SCHEMAS[op], {"job": f"fz-{rng.randrange(10**6)}", "gpus": [rng.randint(0, 1)]})
            if body.get("job") == "victim":
                body["job"] = "not-victim"
        else:
            body = self.fields(SCHEMAS[op], {}) if SCHEMAS[op] else {}
        return {"v": 1, "op": op, **body}

    def line(self, msg: dict[str, Any], mid: int) -> bytes:
        text = json.dumps({**msg, "id": mid})
        for token, raw in self.raws.items():
            text = text.replace(token, raw)
        self.raws.clear()
        return text.encode() + b"\n"


class Reader:
    """Reads one connection's replies into a dict by id."""

    def __init__(self, s: socket.socket) -> None:
        self.s, self.buf = s, b""

    def until(self, mid: Any, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        out = []
        deadline = time.monotonic() + timeout_s
        while True:
            *lines, self.buf = self.buf.split(b"\n")
            for raw in lines:
                msg = json.loads(raw)
                out.append(msg)
                if msg.get("id") == mid:
                    return out
            assert time.monotonic() < deadline, f"no reply to {mid!r} in {timeout_s} s"
            chunk = self.s.recv(1 << 16)
            assert chunk, f"the daemon closed the connection before answering {mid!r}"
            self.buf += chunk


def _conn(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    _connect_retrying(s, str(path), 5.0)
    return s


class Victim(threading.Thread):
    """A well-behaved job on GPU 0: rows of known steps, sent all through the fuzzing."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path, self.sent, self.error = path, 0, ""
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            with _conn(self.path) as s:
                r = Reader(s)
                s.sendall(b'{"v":1,"id":"reg","op":"register","job":"victim","gpus":[0]}\n')
                assert r.until("reg")[-1]["ok"] is True
                step = 0
                while not self.stop.is_set():
                    now = time.monotonic()
                    row = {"first_step": step, "last_step": step + 4, "steps": 5, "t0_s": now - 0.05,
                           "t1_s": now - 0.001, "busy_s": 0.045, "busy_sq_s2": 0.000405, "flops": 5e12,
                           "samples": 160, "tokens": 0, "loss_n": 5, "loss_sum": 10.0}  # fmt: skip
                    s.sendall(json.dumps({"v": 1, "op": "intervals", "rows": [row]}).encode() + b"\n")
                    step += 5
                    self.sent = step
                    self.stop.wait(0.02)
                s.sendall(b'{"v":1,"id":"last","op":"ping"}\n')
                replies = r.until("last")
                errors = [m for m in replies if m.get("ok") is False]
                assert not errors, f"the victim's rows were refused: {errors[:3]}"
                s.sendall(b'{"v":1,"id":"rep","op":"report","job":"victim"}\n')
                self.report = r.until("rep")[-1]
        except Exception as e:  # reported by the test
            self.error = f"{type(e).__name__}: {e}"


class Watcher(threading.Thread):
    """Asks ``status`` on a connection of its own every 50 ms; counts what failed."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path, self.asked, self.failed, self.worst_s = path, 0, [], 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        s = _conn(self.path)
        r = Reader(s)
        while not self.stop.is_set():
            self.asked += 1
            t = time.monotonic()
            try:
                s.sendall(b'{"v":1,"id":%d,"op":"status"}\n' % self.asked)
                reply = r.until(self.asked)[-1]
                if reply.get("ok") is not True:
                    self.failed.append(str(reply)[:300])
            except (OSError, AssertionError, ValueError) as e:
                self.failed.append(f"{type(e).__name__}: {e}")
                s.close()
                s = _conn(self.path)
                r = Reader(s)
            self.worst_s = max(self.worst_s, time.monotonic() - t)
            self.stop.wait(0.05)
        s.close()


def test_every_op_fuzzed_from_its_schema_leaves_the_daemon_whole(
    tmp_path: Path, daemons: list[DaemonProc], figure: Any
) -> None:
    d = start_daemon(tmp_path, "--sim", "2", "--hz", "20")
    daemons.append(d)
    victim, watcher = Victim(d.socket), Watcher(d.socket)
    victim.start()
    watcher.start()
    rng = random.Random(SEED)
    fz = Fuzzer(rng)
    # Job ops (the ones a member of the socket group sends) weigh most; every op is sent.
    ops = sorted(SCHEMAS)
    weights = [8 if op in ("intervals", "steps", "register", "precision_event", "pace", "heartbeat") else 1
               for op in ops]  # fmt: skip
    sent: dict[str, int] = dict.fromkeys(ops, 0)
    internal: list[str] = []
    codes: dict[str, int] = {}
    t0 = time.monotonic()
    mid = n = 0
    while n < MESSAGES:
        # A connection registers a job (or tries to) and sends a few batches, then goes.
        with _conn(d.socket) as s:
            r = Reader(s)
            for _ in range(rng.randint(1, 6)):
                batch: list[tuple[int, bytes]] = []
                for _ in range(rng.randint(5, 40)):
                    op = "register" if not batch and rng.random() < 0.5 else rng.choices(ops, weights)[0]
                    mid += 1
                    batch.append((mid, fz.line(fz.message(op), mid)))
                    sent[op] += 1
                mid += 1
                s.sendall(b"".join(line for _, line in batch) + b'{"v":1,"id":%d,"op":"ping"}\n' % mid)
                lines = dict(batch)
                for reply in r.until(mid):
                    if reply.get("ok") is False:
                        code = reply["error"]["code"]
                        codes[code] = codes.get(code, 0) + 1
                        if code == "internal":
                            internal.append(f"{lines.get(reply.get('id'), b'?')[:400]!r} -> {reply['error']}")
                n += len(batch)
                assert d.proc.poll() is None, f"greend exited under fuzzing:\n{d.log_text()[-4000:]}"
    elapsed = time.monotonic() - t0
    victim.stop.set()
    victim.join(15)
    watcher.stop.set()
    watcher.join(15)
    assert d.proc.poll() is None, f"greend exited under fuzzing:\n{d.log_text()[-4000:]}"
    assert not internal, f"{len(internal)} requests answered 'internal' (seed {SEED}):\n" + "\n".join(internal[:5])
    assert not victim.error, victim.error
    rep = victim.report
    assert rep["ok"] is True and rep["result"]["steps"] == victim.sent, (rep, victim.sent)
    assert rep["result"]["samples"] == 32 * victim.sent
    assert watcher.asked >= 10 and not watcher.failed, watcher.failed[:5]
    assert min(sent.values()) >= 30, sent  # every op, many times
    tracebacks = d.log_text().count("Traceback")
    assert tracebacks == 0, d.log_text()[-4000:]
    figure(
        f"{n} fuzzed messages of {len(ops)} ops in {elapsed:.1f} s ({n / elapsed:.0f}/s): 0 internal, "
        f"errors by code {codes}; status answered {watcher.asked}/{watcher.asked} (slowest "
        f"{watcher.worst_s * 1e3:.0f} ms); victim booked {victim.sent}/{victim.sent} steps"
    )


def test_the_issues_two_rows_are_refused_and_status_stays_up(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    # A 310-digit token count stopped the daemon (OverflowError in the tick); a row of
    # 5e-324 FLOPs put inf into the job's baseline and broke status and jobs for all.
    d = start_daemon(tmp_path, "--sim", "2", "--hz", "20")
    daemons.append(d)
    with _conn(d.socket) as s:
        r = Reader(s)
        s.sendall(b'{"v":1,"id":1,"op":"register","job":"evil","gpus":[1]}\n')
        assert r.until(1)[-1]["ok"] is True
        now = time.monotonic()
        head = '{"first_step":%d,"last_step":%d,"steps":1,"t0_s":%f,"t1_s":%f,"busy_s":0.1,"busy_sq_s2":0.01,'
        rows = [
            head % (0, 0, now - 0.2, now - 0.1) + '"flops":1e9,"tokens":1' + "0" * 309 + "}",
            head % (1, 1, now - 0.1, now - 0.01) + '"flops":5e-324}',
        ]
        for i, row in enumerate(rows):
            s.sendall(b'{"v":1,"id":%d,"op":"intervals","rows":[%s]}\n' % (10 + i, row.encode()))
            reply = r.until(10 + i)[-1]
            assert reply["ok"] is False and reply["error"]["code"] == "bad_request", reply
            assert reply["error"]["field"] == ("rows[0].tokens", "rows[0].flops")[i]
        time.sleep(1.0)  # a few ticks
        assert d.proc.poll() is None
        status = d.status()
        assert [j["job"] for j in status["jobs"]] == ["evil"]
        s.sendall(b'{"v":1,"id":3,"op":"report","job":"evil"}\n')
        assert r.until(3)[-1]["result"]["steps"] == 0
    assert "Traceback" not in d.log_text()
