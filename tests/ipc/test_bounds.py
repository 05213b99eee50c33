"""Every number that enters over the socket is bounded and finite, and what the daemon
derives from them stays so: each field's range is refused by name, a job's figures never
raise nor read inf/NaN, and a reply that cannot be encoded is an error for its request
alone (the connection and everyone else carry on)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from greend.errors import ProtocolError
from greend.ipc.server import IpcServer
from greend.jobs.booking import book_row
from greend.jobs.ledger import Ledger
from greend.jobs.ops import JobOps
from greend.jobs.records import Job, RankSession
from greend.jobs.registry import JobRegistry
from greend.protocol import MAX_INT, MAX_LOSS, SCHEMAS, StepsRow, check_row, check_step, validate
from greend.training.rows import Row, step_fields


def _row(**kw: Any) -> dict[str, Any]:
    row = {"first_step": 0, "last_step": 3, "steps": 4, "t0_s": 100.0, "t1_s": 102.0, "busy_s": 2.0,
           "busy_sq_s2": 1.0, "flops": 4e12, "samples": 64, "tokens": 4096}  # fmt: skip
    row.update(kw)
    return row


HUGE = 10**309  # one more digit than a double holds: int / float raises OverflowError


@pytest.mark.parametrize(
    ("fields", "bad"),
    [
        ({"tokens": HUGE}, "tokens"),  # the row that stopped the daemon
        ({"samples": HUGE}, "samples"),
        ({"tokens": MAX_INT + 1}, "tokens"),
        ({"flops": 5e-324}, "flops"),  # the row that put inf into every reply about its job
        ({"flops": 3.9}, "flops"),  # less than one FLOP a step: no count
        ({"t0_s": 1e300, "t1_s": 1e300}, "t0_s"),
        ({"t1_s": 1e300}, "t1_s"),
        ({"busy_s": 1e300}, "busy_s"),
        ({"busy_sq_s2": 1e300}, "busy_sq_s2"),
        ({"first_step": HUGE, "last_step": HUGE}, "first_step"),
        ({"steps": 4, "nonfinite": 1, "nonfinite_steps": [HUGE]}, "nonfinite_steps"),
        ({"nonfinite": 1, "nonfinite_steps": [-1]}, "nonfinite_steps"),
        ({"loss_n": 1, "loss_sum": 1e308}, "loss_sum"),
        ({"loss_n": 1, "loss_sum": 1.0, "loss_last": -1e300}, "loss_last"),
        ({"loss_n": 1, "loss_sum": 1.0, "loss_min": 1e31}, "loss_min"),
        ({"loss_n": 2, "loss_sum": 1.0, "losses": [1.0, 1e200]}, "losses"),
        ({"loss_n": 2, "loss_sum": 1.0, "losses": [1.0, HUGE]}, "losses"),
    ],
)
def test_an_intervals_row_out_of_range_is_refused_by_name(fields: dict[str, Any], bad: str) -> None:
    with pytest.raises(ProtocolError) as e:
        check_row(_row(**fields))
    assert e.value.field == bad, e.value
    assert len(str(e.value)) < 300  # a 310-digit integer is not quoted back


def test_rows_in_range_pass_and_zero_flops_is_unknown_flops() -> None:
    check_row(_row(flops=0.0))  # FLOPs not counted
    check_row(_row(flops=4.0))  # one a step
    check_row(_row(tokens=MAX_INT, samples=0, loss_n=4, loss_sum=4 * MAX_LOSS, losses=[MAX_LOSS, -MAX_LOSS]))


@pytest.mark.parametrize(
    ("fields", "bad"),
    [
        ({"flops": 5e-324}, "flops"),
        ({"tokens": HUGE}, "tokens"),
        ({"samples": -1}, "samples"),
        ({"loss": 1e300}, "loss"),
        ({"step": HUGE}, "step"),
        ({"t1_s": 1e11}, "t1_s"),
    ],
)
def test_a_steps_entry_out_of_range_is_refused_by_name(fields: dict[str, Any], bad: str) -> None:
    entry = {"step": 0, "t0_s": 1.0, "t1_s": 1.5, "flops": 1e9}
    entry.update(fields)
    with pytest.raises(ProtocolError) as e:
        check_step(entry)
    assert e.value.field == bad


@pytest.mark.parametrize(
    ("op", "msg", "bad"),
    [
        ("register", {"job": "j", "gpus": [HUGE]}, "gpus"),
        ("register", {"job": "j", "gpus": [1024]}, "gpus"),
        ("register", {"job": "j", "flops_per_step": 1e300}, "flops_per_step"),
        ("precision_event", {"kind": "rollback", "loss": 1e300}, "loss"),
        ("precision_event", {"kind": "rollback", "trend": -1e300}, "trend"),
        ("precision_event", {"kind": "rollback", "step": HUGE}, "step"),
        ("energy", {"key": "gpu0", "t0_s": -1e300, "t1_s": 1.0}, "t0_s"),
        ("energy", {"key": "gpu0", "t0_s": 0.0, "t1_s": 1e300}, "t1_s"),
    ],
)
def test_other_ops_bound_their_numbers(op: str, msg: dict[str, Any], bad: str) -> None:
    with pytest.raises(ProtocolError) as e:
        validate(dict(msg), SCHEMAS[op])
    assert e.value.field == bad


def test_register_kind_is_training_unless_a_measured_command_says_so() -> None:
    from greend.protocol import decode_register

    assert decode_register(validate({"job": "j"}, SCHEMAS["register"])).kind == "training"  # older clients
    assert decode_register(validate({"job": "j", "kind": "measure"}, SCHEMAS["register"])).kind == "measure"
    with pytest.raises(ProtocolError) as e:
        validate({"job": "j", "kind": "inference"}, SCHEMAS["register"])
    assert e.value.field == "kind" and "training, measure" in str(e.value)


@pytest.mark.parametrize("msg", [{"job": "evil\n"}, {"job": "j", "run": "r1\n"}], ids=["job", "run"])
def test_an_id_with_a_trailing_line_break_is_refused(msg: dict[str, str]) -> None:
    """A trailing newline passed a ``^...$`` match: written to InfluxDB it broke every
    point of the node while the job ran."""
    from greend.protocol import decode_register

    with pytest.raises(ProtocolError) as e:
        decode_register(validate(msg, SCHEMAS["register"]))
    assert e.value.field == ("run" if "run" in msg else "job")


def test_control_characters_in_a_text_field_become_spaces() -> None:
    """An end reason with a line break forged a daemon log line; with an escape sequence it
    reached an admin's terminal through greenctl report. The message is kept, its control
    characters made spaces."""
    msg = validate({"reason": "ok\n2026-12-05 WARNING cap set by uid 0\x1b]0;title\x07\x9b2J"}, SCHEMAS["end"])
    assert msg["reason"] == "ok 2026-12-05 WARNING cap set by uid 0 ]0;title  2J"


def test_every_number_field_of_every_op_has_a_range() -> None:
    """A new number field without bounds is the next break: integers get +-MAX_INT by
    default; a float field must say its own range."""
    from greend.protocol import INTERVAL_FIELDS, STEP_FIELDS

    unbounded = [
        f"{op}.{name}"
        for op, schema in [*SCHEMAS.items(), ("intervals row", INTERVAL_FIELDS), ("steps entry", STEP_FIELDS)]
        for name, spec in schema.items()
        if float in spec.types and (spec.min is None or spec.max is None)
    ]
    assert not unbounded, f"float fields without a range: {unbounded}"


def test_the_callback_sends_nothing_the_daemon_refuses() -> None:
    # A diverged loss beyond MAX_LOSS goes as a non-finite step; FLOPs under one a step as 0.
    rec = (5, 1.0, 1.5, 0.25, 8, 16, 1e35, False, "fp32")
    row = Row(rec, keep_losses=True)
    row.add((6, 1.5, 2.0, 0.25, 8, 16, 2.0, False, "fp32"))
    fields = row.fields()
    check_row(fields)
    assert fields["flops"] == 0.0 and fields["nonfinite"] == 1 and fields["nonfinite_steps"] == [5]
    assert fields["loss_n"] == 1 and fields["losses"] == [2.0]
    entry = step_fields(rec)
    check_step(entry)
    assert entry["flops"] == 0.0 and entry["nonfinite"] is True and entry["loss"] is None


# Derived figures ----------------------------------------------------------------------


def _registry() -> tuple[JobOps, Any]:
    class Clock:
        t = 1000.0

        def __call__(self) -> float:
            return self.t

    clock = Clock()
    return JobOps(JobRegistry(Ledger(), hostname="h", monotonic=clock, wall=lambda: 1.7e9)), clock


def _all_finite(value: Any, where: str = "") -> list[str]:
    if isinstance(value, float):
        return [] if value == value and abs(value) != float("inf") else [where]
    if isinstance(value, dict):
        return [w for k, v in value.items() for w in _all_finite(v, f"{where}.{k}")]
    if isinstance(value, (list, tuple)):
        return [w for i, v in enumerate(value) for w in _all_finite(v, f"{where}[{i}]")]
    return []


def test_a_baseline_of_denormal_step_times_neither_raises_nor_reads_inf() -> None:
    # busy_s of 5e-324 at 1 FLOP a step: the baseline's mean cost per FLOP underflows to
    # 0, which its relative standard error divided by (ZeroDivisionError, "internal").
    ops, _ = _registry()
    reg = ops.jobs
    for i in range(11):  # GPU 0 used 10 J a second
        reg.ledger.record("gpu0", 980.0 + i, 10.0 * i)
    job = Job("j", 1000, 0.0, 1.7e9, run="r1", precision="fp32")
    rs = RankSession(7, "j", 0, 0, 1, [0], 4242, 1000, "h", ["fp32"], None, None, 0.0)
    job.ranks[rs.session] = rs
    job.gpus.add(0)
    for t0 in (981.0, 983.0):
        row = StepsRow(first_step=0, last_step=3, steps=4, t0_s=t0, t1_s=t0 + 1.0, busy_s=5e-324, busy_sq_s2=0.0,
                       flops=4.0)  # fmt: skip
        book_row(job, rs, row, None, now_s=t0 + 1.0)
    reg.jobs["j"] = job
    report = reg.report(job)
    assert report["steps"] == 8 and report["savings"]["expected_gpu_energy_j"] is not None
    assert not _all_finite(report)
    row_fig = reg.list_jobs()[0]
    assert row_fig["steps"] == 8 and not _all_finite(row_fig)


def test_booking_a_row_of_under_one_flop_a_step_does_not_raise() -> None:
    # What the schema now refuses, booked anyway: per-step FLOPs of 0 (5e-324 / 4) were
    # squared and divided by (ZeroDivisionError).
    job = Job("j", 1000, 0.0, 1.7e9, run="r1", precision="fp32")
    rs = RankSession(7, "j", 0, 0, 1, [], 4242, 1000, "h", ["fp32"], None, None, 0.0)
    row = StepsRow(first_step=0, last_step=3, steps=4, t0_s=1.0, t1_s=2.0, busy_s=1.0, busy_sq_s2=0.25,
                   flops=5e-324)  # fmt: skip
    book_row(job, rs, row, None, now_s=2.0)
    assert job.steps == 4 and not _all_finite([job.baseline.x_sum, job.baseline.x_sq])


def test_a_figure_gone_infinite_reads_as_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    ops, _ = _registry()
    reg = ops.jobs
    job = Job("j", 1000, 0.0, 1.7e9, run="r1", precision="fp32")
    reg.jobs["j"] = job
    real = reg.figures.report
    monkeypatch.setattr(reg.figures, "report", lambda j: {**real(j), "gflops_per_w": float("inf"),
                                                           "savings": {"saved_pct": float("nan")}})  # fmt: skip
    r = reg.report(job)
    assert r["gflops_per_w"] is None and r["savings"] == {"saved_pct": None}
    json.dumps(r, allow_nan=False)


def test_one_jobs_failing_figures_do_not_stop_the_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    ops, clock = _registry()
    reg = ops.jobs
    for name in ("bad", "good"):
        job = Job(name, 1000, 0.0, 1.7e9, run="r1", precision="fp32")
        job.t_start_s = 990.0
        reg.jobs[name] = job
    real = reg.figures.report

    def report(j: Job) -> dict[str, Any]:
        if j.job == "bad":
            raise OverflowError("int too large to convert to float")
        return real(j)

    monkeypatch.setattr(reg.figures, "report", report)
    points = reg.efficiency_points(clock.t)
    assert [p.tags["job"] for p in points] == ["good"]


# A reply that cannot be encoded ----------------------------------------------------------


@pytest.fixture
def server(tmp_path: Path) -> Iterator[IpcServer]:
    srv = IpcServer(tmp_path / "s.sock", mode=0o600)
    srv.route("ping", lambda msg, conn: {"pong": True})
    srv.route("status", lambda msg, conn: {"power_w": float("inf")})
    srv.start()
    yield srv
    srv.stop()


def _ask(s: socket.socket, line: bytes) -> dict[str, Any]:
    s.sendall(line + b"\n")
    buf = b""
    while b"\n" not in buf:
        chunk = s.recv(65536)
        assert chunk, f"the server closed the connection after {line!r}"
        buf += chunk
    return json.loads(buf)  # type: ignore[no-any-return]


def test_a_reply_that_cannot_be_encoded_is_an_error_for_that_request_only(server: IpcServer) -> None:
    with socket.socket(socket.AF_UNIX) as s, socket.socket(socket.AF_UNIX) as other:
        s.settimeout(5)
        other.settimeout(5)
        s.connect(str(server.path))
        other.connect(str(server.path))
        bad = _ask(s, b'{"v":1,"id":9,"op":"status"}')
        assert bad["ok"] is False and bad["id"] == 9 and bad["error"]["code"] == "internal"
        assert "could not be encoded" in bad["error"]["message"]
        # The same connection, and another, carry on.
        assert _ask(s, b'{"v":1,"id":10,"op":"ping"}') == {"v": 1, "id": 10, "ok": True, "result": {"pong": True}}
        assert _ask(other, b'{"v":1,"id":1,"op":"ping"}')["ok"] is True


def test_a_count_past_2_to_53_is_refused() -> None:
    """(the protocol says every integer stays within 2^53; steps_before allowed 2^62)"""
    with pytest.raises(ProtocolError) as e:
        validate({"job": "j", "steps_before": 2**62}, SCHEMAS["register"])
    assert e.value.field == "steps_before"


def test_a_precision_event_above_the_jobs_own_level_is_refused_and_books_nothing() -> None:
    """A bf16 job's rank says it rolled back to fp32, or to tf32: greend never runs a job
    above its own level, and the record then said it did (its report 'precision tf32'). A
    refusal of a level asked above it is the callback's own answer, and is booked."""
    from greend.jobs.booking import book_precision_event
    from greend.jobs.records import Job
    from greend.protocol import PrecisionEventEntry

    job = Job("j", 0, 0.0, 0.0)
    job.precision, job.top_precision = "fp8", "bf16"
    for to in ("fp32", "tf32", "fp16"):
        with pytest.raises(ProtocolError, match="above the own level 'bf16' of job 'j'") as e:
            book_precision_event(job, PrecisionEventEntry("rollback", "fp8", to, "x", 3, None, None),
                                 rank=0, t_wall_s=0.0, now_s=0.0, max_entries=8)  # fmt: skip
        assert e.value.field == "to"
    assert job.precision == "fp8" and not job.precision_log
    book_precision_event(job, PrecisionEventEntry("refused", "fp8", "fp32", "x", 3, None, None),
                         rank=0, t_wall_s=0.0, now_s=0.0, max_entries=8)  # fmt: skip
    book_precision_event(job, PrecisionEventEntry("rollback", "fp8", "bf16", "x", 4, None, None),
                         rank=0, t_wall_s=0.0, now_s=0.0, max_entries=8)  # fmt: skip
    assert job.precision == "bf16" and len(job.precision_log) == 2


def test_the_ranks_same_move_at_the_same_step_is_logged_once() -> None:
    """A 2-rank job's ranks roll back together (their verdict at one step) and each tells
    it: the report printed the one rollback twice. Logged once; a move of another step, or
    the same rank's next, is logged."""
    from greend.jobs.booking import book_precision_event
    from greend.jobs.records import Job
    from greend.protocol import PrecisionEventEntry

    job = Job("j", 0, 0.0, 0.0)
    job.precision, job.top_precision = "fp8", "bf16"
    ev = PrecisionEventEntry("rollback", "fp8", "bf16", "probes: +9 %", 640, None, None)
    kw: dict[str, Any] = {"t_wall_s": 0.0, "now_s": 0.0, "max_entries": 8}
    assert book_precision_event(job, ev, rank=0, **kw) is True
    assert book_precision_event(job, ev, rank=1, **kw) is False
    assert [(c.kind, c.step, c.rank) for c in job.precision_log] == [("rollback", 640, 0)]
    later = PrecisionEventEntry("rollback", "fp8", "bf16", "probes: +9 %", 1900, None, None)
    assert book_precision_event(job, later, rank=1, **kw) is True and len(job.precision_log) == 2


def test_what_a_gone_peer_sent_is_not_run_to_its_end(tmp_path: Path) -> None:
    """A client writes thousands of requests in one go and closes without reading: they
    were all run and answered into the dead socket (a red-team's 8 such clients kept the
    daemon at 94 % CPU for 90 s after they left). Once a reply finds the peer gone, the
    rest of what it sent is dropped, unless the connection is a job's rank (its last rows
    and its end are still booked)."""
    calls: list[int] = []
    srv = IpcServer(tmp_path / "s.sock", mode=0o600)

    def slow(msg: dict[str, Any], conn: Any) -> dict[str, Any]:
        calls.append(1)
        time.sleep(0.002)
        return {"pad": "x" * 2000}  # (the socket's buffer fills: the send then fails or times out)

    srv.route("slow", slow)
    srv.start()
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(srv.path))
            s.sendall(b'{"v":1,"op":"slow"}\n' * 2000)
        time.sleep(1.5)
        assert len(calls) < 200, len(calls)  # (2,000 at 2 ms: 4 s of work, were it all run)
    finally:
        srv.stop()
