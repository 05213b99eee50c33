"""The jobs' socket ops at the edge (greend.jobs.ops): each message decoded once and the
registry called with typed values; a connection is anything shaped like one."""

from __future__ import annotations

import difflib
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from greend.daemon.routes import _job_route
from greend.errors import ProtocolError
from greend.ipc.server import NO_REPLY, LimitExceeded
from greend.jobs.ledger import Ledger
from greend.jobs.ops import JobOps
from greend.jobs.registry import JobRegistry, QuotaExceeded
from greend.protocol import encode
from greend.settings import Setting


@dataclass(frozen=True)
class _Peer:
    pid: int
    uid: int


@dataclass
class _Conn:
    id: int
    peer: _Peer
    state: dict[str, Any] = field(default_factory=dict)
    sent: list[dict[str, Any]] = field(default_factory=list)

    def send(self, obj: dict[str, Any], timeout_s: float = 1.0) -> bool:
        encode(obj)  # as the socket's Connection: a message that cannot be encoded raises, unsent
        self.sent.append(obj)
        return True


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _ops(**kw: Any) -> tuple[JobOps, _Clock]:
    clock = _Clock()
    return JobOps(JobRegistry(Ledger(), hostname="h", monotonic=clock, wall=lambda: 1.7e9, **kw)), clock


def _row(t0: float, t1: float) -> dict[str, Any]:
    return {"first_step": 0, "last_step": 1, "steps": 2, "t0_s": t0, "t1_s": t1, "busy_s": 0.5,
            "busy_sq_s2": 0.125, "flops": 2e12, "precision": "bf16"}  # fmt: skip


def test_register_book_and_end_through_the_ops() -> None:
    ops, clock = _ops(heartbeat_timeout_s=9.0, rows_every_s=0.25)
    conn = _Conn(3, _Peer(pid=0, uid=1000))
    h = ops.handlers()
    reply = h["register"]({"job": "j1", "gpus": [1, 0, 1], "precisions": ["fp32", "bf16"]}, conn)
    assert reply["job"] == "j1" and reply["session"] == 3 and reply["heartbeat_s"] == 3.0
    # No level of its own given (an older client): no directive, its first steps tell.
    assert "directive" not in reply and reply["report"] == "intervals"
    assert reply["rows_every_s"] == 0.25 and len(reply["run"]) == 12
    assert ops.registered(conn)
    rs = ops.jobs.sessions[3]
    assert rs.gpus == [0, 1] and rs.channel is conn and rs.host == "h"
    with pytest.raises(ProtocolError, match="already registered"):
        h["register"]({"job": "j2"}, conn)
    assert h["intervals"]({"rows": [_row(998.0, 999.0)]}, conn) is None
    job = ops.jobs.jobs["j1"]
    assert job.steps == 2 and job.flops == 2e12 and job.gpu_flops == {0: 1e12, 1: 1e12}
    # A message with a row that ends in the future books nothing.
    with pytest.raises(ProtocolError) as e:
        h["intervals"]({"rows": [_row(998.0, 999.0), _row(999.0, clock.t + 2.0)]}, conn)
    assert e.value.field == "rows[1].t1_s" and job.steps == 2
    # One entry per step: each a row of one step.
    h["steps"]({"steps": [{"step": 2, "t0_s": 999.0, "t1_s": 999.5, "flops": 1e12, "loss": 2.0}]}, conn)
    assert job.steps == 3 and job.last_loss == 2.0
    assert h["pace"]({"step_s": 0.4}, conn) == {"ok": True} and job.pace_s == 0.4
    assert ops.jobs.push("j1", {"event": "directive", "precision": "bf16"}) == 1
    assert conn.sent == [{"v": 1, "job": "j1", "event": "directive", "precision": "bf16"}]
    # A push that cannot be encoded (a NaN pace) is logged and sent to no one; nothing raises.
    assert ops.jobs.push("j1", {"event": "local_pace", "step_s": math.nan}) == 0
    assert len(conn.sent) == 1
    report = h["end"]({"reason": "done"}, conn)
    assert report["job"] == "j1" and report["steps"] == 3
    assert not ops.registered(conn) and job.state == "ending" and job.end_reason == "done"
    with pytest.raises(ProtocolError, match="register a job on this connection first"):
        h["heartbeat"]({}, conn)


def test_a_rank_that_registers_gets_this_nodes_pace_as_last_pushed() -> None:
    """A rank that joins a running job, or comes back to a restarted daemon, gets the pace
    this daemon last pushed to the job's ranks (null: none yet), so it never writes one an
    earlier daemon measured, and one that joins late still adds this node's."""
    ops, _ = _ops()
    h = ops.handlers()
    first = h["register"]({"job": "j1", "rank": 0, "world_size": 2, "gpus": [0]}, _Conn(1, _Peer(pid=0, uid=1000)))
    assert "local_pace" in first and first["local_pace"] is None
    assert ops.jobs.views(lambda gpu: Setting())[0].held_pace_s is None
    assert ops.jobs.push("j1", {"event": "local_pace", "step_s": 0.2, "floor_s": 0.19}) == 1
    assert ops.jobs.push("j1", {"event": "local_pace", "step_s": math.inf}) == 0  # (not kept: cannot be sent)
    late = h["register"]({"job": "j1", "rank": 1, "world_size": 2}, _Conn(2, _Peer(pid=0, uid=1000)))
    assert late["local_pace"] == {"step_s": 0.2, "floor_s": 0.19}
    encode(late)  # (the reply goes out as it is)
    # The policy sees the pace the ranks hold (a new search of the job knows what they write).
    (view,) = ops.jobs.views(lambda gpu: Setting())
    assert view.held_pace_s == 0.2


def test_a_quota_refuses_as_the_servers_limit_and_fire_and_forget_sends_nothing() -> None:
    ops, _ = _ops(max_jobs_per_uid=1)
    h = ops.handlers()
    register = _job_route(h["register"], silent=False)
    first = _Conn(1, _Peer(0, 1000))
    register({"job": "a"}, first)
    with pytest.raises(QuotaExceeded):
        h["register"]({"job": "b"}, _Conn(2, _Peer(0, 1000)))
    with pytest.raises(LimitExceeded, match="max_jobs_per_uid = 1"):
        register({"job": "b"}, _Conn(2, _Peer(0, 1000)))
    register({"job": "b"}, _Conn(3, _Peer(0, 1000), state={"_admin": True}))  # an admin is not limited
    intervals = _job_route(h["intervals"], silent=True)
    assert intervals({"rows": [_row(998.0, 999.0)]}, first) is NO_REPLY
    assert ops.jobs.jobs["a"].steps == 2


def test_a_rank_that_registers_again_while_a_proposal_stands_is_told_the_proposal() -> None:
    """The daemon asked bf16 of a job whose ranks probe: they run its trial at fp32 first
    (the job's level in force stays fp32 meanwhile). A rank that reconnects then is told
    bf16, the level asked, so it goes on with the trial instead of being taken back up;
    once the proposal is gone, the level in force again."""
    from greend.jobs.booking import book_proposal, book_withdrawal

    ops, _ = _ops()
    h = ops.handlers()
    a = _Conn(1, _Peer(pid=0, uid=1000))
    assert h["register"]({"job": "t", "precision": "fp32"}, a)["directive"] == {"precision": "fp32"}
    job = ops.jobs.jobs["t"]
    book_proposal(job, "bf16", "loss stable", kind="switch", trend=None, t_wall_s=1.0, max_entries=10)
    again = _Conn(2, _Peer(pid=0, uid=1000))
    assert h["register"]({"job": "t", "precision": "fp32"}, again)["directive"] == {"precision": "bf16"}
    assert job.precision == "fp32"  # (the level in force moves only when the ranks' rows run bf16)
    book_withdrawal(job, "loss moved", t_wall_s=2.0, max_entries=10)
    third = _Conn(3, _Peer(pid=0, uid=1000))
    assert h["register"]({"job": "t", "precision": "fp32"}, third)["directive"] == {"precision": "fp32"}


def test_register_carries_the_jobs_own_level_and_nothing_moves_it_above() -> None:
    ops, _ = _ops()
    h = ops.handlers()
    a = _Conn(1, _Peer(pid=0, uid=1000))
    reply = h["register"]({"job": "b", "precisions": ["fp32", "bf16", "fp8"], "precision": "bf16"}, a)
    assert reply["directive"] == {"precision": "bf16"}  # its own level, not fp32
    job = ops.jobs.jobs["b"]
    assert job.precision == job.top_precision == "bf16"
    # A second rank of the running job gets the job's level in force.
    b = _Conn(2, _Peer(pid=0, uid=1000))
    assert h["register"]({"job": "b", "precision": "bf16"}, b)["directive"] == {"precision": "bf16"}
    # The own level must be one the job runs.
    c = _Conn(3, _Peer(pid=0, uid=1000))
    with pytest.raises(ProtocolError, match="not among its 'precisions'") as e:
        h["register"]({"job": "c", "precisions": ["fp32"], "precision": "bf16"}, c)
    assert e.value.field == "precision"


def test_an_older_client_s_first_steps_set_its_own_level() -> None:
    ops, _ = _ops()
    h = ops.handlers()
    conn = _Conn(1, _Peer(pid=0, uid=1000))
    h["register"]({"job": "old", "precisions": ["fp32", "bf16"]}, conn)
    job = ops.jobs.jobs["old"]
    assert job.top_precision is None
    h["intervals"]({"rows": [{**_row(998.0, 999.0), "precision": "bf16"}]}, conn)
    assert job.precision == job.top_precision == "bf16"


def test_policies_see_no_level_above_the_jobs_own_and_no_switch_goes_there() -> None:
    from greend.policies.base import UNCAPPED

    ops, _ = _ops()
    h = ops.handlers()
    conn = _Conn(1, _Peer(pid=0, uid=1000))
    h["register"]({"job": "b", "gpus": [0], "precisions": ["fp32", "tf32", "bf16", "fp8"], "precision": "bf16"}, conn)
    (view,) = ops.jobs.views(lambda gpu: UNCAPPED)
    assert view.precisions == ("bf16", "fp8") and view.top_precision == "bf16"
    jobs = ops.jobs
    assert not jobs.switch_precision("b", "fp32", "up", policy="p")  # above: refused
    assert not jobs.switch_precision("b", "tf32", "up", policy="p")
    assert jobs.jobs["b"].precision == "bf16" and jobs.jobs["b"].precision_log == []
    assert jobs.switch_precision("b", "fp8", "down", policy="p")
    assert not jobs.switch_precision("b", "fp8", "down", policy="p")  # asked already
    # A proposal until the ranks run it; asking the level in force again withdraws it.
    assert jobs.jobs["b"].precision == "bf16" and jobs.jobs["b"].proposal is not None
    assert jobs.switch_precision("b", "bf16", "back", kind="rollback", policy="p")
    assert [(c.kind, c.from_level, c.to_level) for c in jobs.jobs["b"].precision_log] == [
        ("proposed", "bf16", "fp8"),
        ("withdrawn", "bf16", "fp8"),
    ]
    assert jobs.jobs["b"].proposal is None
    # A job whose level is not known yet (no level given, no steps): only its level in force.
    other = _Conn(2, _Peer(pid=0, uid=1000))
    h["register"]({"job": "u", "gpus": [1], "precisions": ["fp32", "bf16"]}, other)
    views = {v.job: v for v in ops.jobs.views(lambda gpu: UNCAPPED)}
    assert views["u"].precisions == ("fp32",) and views["u"].top_precision is None
    assert not jobs.switch_precision("u", "bf16", "down", policy="p")


def test_the_store_hears_a_proposal_then_the_switch_when_the_ranks_run_it() -> None:
    points: list[Any] = []
    ops, _ = _ops(emit=points.extend)
    h = ops.handlers()
    conn = _Conn(1, _Peer(pid=0, uid=1000))
    h["register"]({"job": "p", "gpus": [0], "precisions": ["fp32", "bf16"], "precision": "fp32"}, conn)
    h["intervals"]({"rows": [{**_row(990.0, 991.0), "precision": "fp32"}]}, conn)
    jobs = ops.jobs
    assert jobs.switch_precision("p", "bf16", "loss stable", policy="precision")

    def decisions() -> list[tuple[str, str, str]]:
        return [
            (p.tags["kind"], p.tags["policy"], p.tags["precision"])
            for p in points
            if p.measurement == "greend_decision"
        ]

    assert decisions() == [("proposed", "precision", "bf16")]
    h["intervals"]({"rows": [{**_row(992.0, 993.0), "precision": "fp32"}]}, conn)  # not yet
    assert len(decisions()) == 1 and jobs.jobs["p"].precision == "fp32"
    h["intervals"]({"rows": [_row(994.0, 995.0)]}, conn)  # (bf16)
    assert decisions()[1:] == [("switch", "ranks", "bf16")] and jobs.jobs["p"].precision == "bf16"
    # A move the daemon did not ask (the rank reports it as an event): no point from the rows.
    h["intervals"]({"rows": [{**_row(996.0, 997.0), "precision": "fp32"}]}, conn)
    assert len(decisions()) == 2 and jobs.jobs["p"].precision == "fp32"


def test_register_tells_the_precision_policy_s_tolerance_where_one_runs() -> None:
    told: list[float | None] = [0.08]
    ops = JobOps(
        JobRegistry(Ledger(), hostname="h", monotonic=_Clock(), wall=lambda: 1.7e9),
        precision_tolerance=lambda: told[0],
    )
    reply = ops.handlers()["register"]({"job": "j1", "precisions": ["fp32", "bf16"]}, _Conn(1, _Peer(0, 1000)))
    assert reply["precision_tolerance"] == 0.08
    told[0] = None  # no precision policy (any more): the reply says nothing, the callback keeps its own
    reply = ops.handlers()["register"]({"job": "j2", "precisions": ["fp32", "bf16"]}, _Conn(2, _Peer(0, 1000)))
    assert "precision_tolerance" not in reply
    plain, _ = _ops()  # a daemon built without the hook: nothing either
    assert "precision_tolerance" not in plain.handlers()["register"]({"job": "j3"}, _Conn(3, _Peer(0, 1000)))


def test_a_rank_that_ran_before_a_restarted_daemon_s_record_is_asked_no_level_where_a_policy_runs() -> None:
    """A daemon restarted under a bf16 job that ran fp8: the new record knows no level but
    the job's own. Its register reply asked bf16 of the returning rank, which went back up
    (and a multi-rank job's ranks read it as a rollback, barring fp8). Where a precision
    policy runs, the returning rank is asked nothing (it keeps its level; its rows tell the
    record); the next rank, once the record has rows, is asked the level they ran; a new
    run (no steps before) and a daemon with no precision policy ask the job's own level."""
    told: list[float | None] = [0.05]
    clock = _Clock()
    ops = JobOps(
        JobRegistry(Ledger(), hostname="h", monotonic=clock, wall=lambda: 1.7e9), precision_tolerance=lambda: told[0]
    )
    register = ops.handlers()["register"]
    own = {"job": "j", "run": "r1", "precision": "bf16", "precisions": ["bf16", "fp8"], "world_size": 2}
    back = register({**own, "rank": 0, "steps_before": 500}, _Conn(1, _Peer(0, 1000)))
    assert "directive" not in back, back
    ops.handlers()["intervals"](
        {"rows": [{**_row(clock.t - 1.0, clock.t), "precision": "fp8"}]}, _Conn(1, _Peer(0, 1000))
    )
    second = register({**own, "rank": 1, "steps_before": 500}, _Conn(2, _Peer(1, 1000)))
    assert second["directive"] == {"precision": "fp8"}, second
    fresh = register({**own, "job": "k", "rank": 0, "steps_before": 0}, _Conn(3, _Peer(2, 1000)))
    assert fresh["directive"] == {"precision": "bf16"}
    told[0] = None
    plain = register({**own, "job": "m", "rank": 0, "steps_before": 500}, _Conn(4, _Peer(3, 1000)))
    assert plain["directive"] == {"precision": "bf16"}


def test_jobs_below_their_own_level_are_asked_back_when_the_precision_policy_goes() -> None:
    """A precision policy turned off (or replaced) takes back what it set: every running
    job below its own level, or with a move standing, is asked back to its own level."""
    ops, _ = _ops()
    h = ops.handlers()
    down, asked, own = (_Conn(k, _Peer(pid=k, uid=1000)) for k in (1, 2, 3))
    for job, conn in (("down", down), ("asked", asked), ("own", own)):
        h["register"]({"job": job, "precisions": ["fp32", "bf16", "fp8"], "precision": "bf16"}, conn)
        h["intervals"]({"rows": [_row(990.0, 991.0)]}, conn)
    jobs = ops.jobs
    assert jobs.switch_precision("down", "fp8", "cheaper", policy="precision")
    h["intervals"]({"rows": [{**_row(992.0, 993.0), "precision": "fp8"}]}, down)  # its ranks ran it
    assert jobs.switch_precision("asked", "fp8", "cheaper", policy="precision")  # not run yet
    assert jobs.jobs["down"].precision == "fp8" and jobs.jobs["asked"].proposal is not None
    for job in ("down", "asked", "own"):  # the policy's last word on each
        jobs.note(job, policy="precision", role="precision", reason=f"{job}: the ranks run fp8 from step 391")
    sent = {c.id: len(c.sent) for c in (down, asked, own)}
    assert sorted(jobs.back_to_own_levels("precision policy changed to none", policy="none")) == ["asked", "down"]
    # ...replaced: a report said "the ranks run fp8" of a job back at bf16 to its end.
    assert {j: jobs.jobs[j].notes["precision"]["reason"] for j in ("down", "asked", "own")} == dict.fromkeys(
        ("down", "asked", "own"), "precision policy changed to none"
    )
    assert [(m["event"], m["precision"], m["reason"]) for m in down.sent[sent[1] :]] == [
        ("directive", "bf16", "precision policy changed to none")
    ]
    assert [m.get("precision") for m in asked.sent[sent[2] :]] == ["bf16"]  # the standing move withdrawn
    assert jobs.jobs["asked"].proposal is None
    assert own.sent[sent[3] :] == []  # at its own level: nothing to say


def test_a_bf16_job_is_never_moved_sideways_to_fp16() -> None:
    """fp16 keeps bf16's bits with far less range, and the guard does not see bf16 -> fp16
    as a step down: a bf16 job is offered fp8 below it, never fp16 (nor an fp16 job bf16)."""
    from greend.protocol import PRECISIONS, not_above

    assert not_above(PRECISIONS, "bf16") == ("bf16", "fp8", "fp8-emulated")
    assert not_above(PRECISIONS, "fp16") == ("fp16", "fp8", "fp8-emulated")
    assert not_above(PRECISIONS, "fp32") == PRECISIONS
    ops, _ = _ops()
    h = ops.handlers()
    conn = _Conn(1, _Peer(pid=0, uid=1000))
    h["register"]({"job": "b", "precisions": ["fp32", "bf16", "fp16", "fp8"], "precision": "bf16"}, conn)
    h["intervals"]({"rows": [_row(990.0, 991.0)]}, conn)
    n = len(conn.sent)
    assert not ops.jobs.switch_precision("b", "fp16", "cheaper", policy="precision")
    assert conn.sent[n:] == []
    assert ops.jobs.switch_precision("b", "fp8", "cheaper", policy="precision")


def test_a_policy_turned_off_mid_send_leaves_every_job_at_its_own_level() -> None:
    """A decision being sent while the precision policy is turned off: the directive that
    takes it back reaches the ranks after the policy's own (never before it, leaving them
    at the lower level), and a decision whose policy is gone by then sends nothing."""
    ops, _ = _ops()
    h = ops.handlers()
    release, in_send = threading.Event(), threading.Event()

    class SlowConn(_Conn):
        def send(self, obj: dict[str, Any], timeout_s: float = 1.0) -> bool:
            if obj.get("precision") == "fp8":
                in_send.set()
                release.wait(5.0)  # a rank slow to take the policy's directive
            return super().send(obj, timeout_s)

    conn = SlowConn(1, _Peer(pid=1, uid=1000))
    h["register"]({"job": "j", "precisions": ["fp32", "bf16", "fp8"], "precision": "bf16"}, conn)
    jobs = ops.jobs
    policy = threading.Thread(target=lambda: jobs.switch_precision("j", "fp8", "cheaper", policy="precision"))
    policy.start()
    assert in_send.wait(5.0)
    back = threading.Thread(target=lambda: jobs.back_to_own_levels("precision policy changed to none", policy="none"))
    back.start()
    time.sleep(0.2)  # (back_to_own_levels would have sent its bf16 by now, were it not ordered)
    release.set()
    policy.join(5.0)
    back.join(5.0)
    assert [m["precision"] for m in conn.sent if m.get("event") == "directive"] == ["fp8", "bf16"]
    assert jobs.jobs["j"].proposal is None and jobs.jobs["j"].precision == "bf16"
    # The policy gone before its decision is booked: nothing is proposed, nothing sent.
    n = len(conn.sent)
    assert not jobs.switch_precision("j", "fp8", "cheaper", policy="precision", valid=lambda: False)
    assert len(conn.sent) == n and jobs.jobs["j"].proposal is None


def test_a_resumed_record_counts_its_rank_s_steps_over_both_sessions() -> None:
    """A rank whose connection was lost comes back with its run id: the record goes on,
    and its steps go on from where they were (the new session's own count restarts at 0;
    the record kept the larger of the two, 10 steps where 15 ran, beside 15 steps' FLOPs)."""
    ops, _ = _ops()
    h = ops.handlers()
    first = _Conn(1, _Peer(pid=5, uid=1000))
    h["register"]({"job": "j", "run": "r1", "precisions": ["fp32", "bf16"]}, first)
    for i in range(5):  # 10 steps
        h["intervals"]({"rows": [{**_row(990.0 + i, 990.5 + i), "first_step": 2 * i, "last_step": 2 * i + 1}]}, first)
    ops.disconnected(first)
    again = _Conn(2, _Peer(pid=5, uid=1000))
    h["register"]({"job": "j", "run": "r1", "precisions": ["fp32", "bf16"], "steps_before": 10}, again)
    job = ops.jobs.jobs["j"]
    assert job.state == "running" and job.steps == 10  # the same record
    for i in range(3):  # 6 more steps, numbered on
        row = {**_row(996.0 + i, 996.5 + i), "first_step": 10 + 2 * i, "last_step": 11 + 2 * i}
        h["intervals"]({"rows": [row]}, again)
    assert job.steps == 16 and job.flops == 8 * 2e12 and job.step_reports == 16


def test_a_record_begun_after_a_restart_numbers_its_log_by_the_run_s_steps() -> None:
    """After a daemon restart the new record counted steps from 0 while the ranks number
    theirs from the run's start: the joined log read 1409, 1453, 324, 2109."""
    ops, _ = _ops()
    h = ops.handlers()
    conn = _Conn(1, _Peer(pid=5, uid=1000))
    h["register"]({"job": "j", "run": "r1", "precisions": ["fp32", "bf16"], "precision": "fp32",
                   "steps_before": 1400}, conn)  # fmt: skip
    h["intervals"]({"rows": [{**_row(990.0, 991.0), "first_step": 1400, "last_step": 1401, "precision": "fp32"}]}, conn)
    assert ops.jobs.switch_precision("j", "bf16", "cheaper", policy="precision")
    logged = ops.jobs.jobs["j"].precision_log[-1]
    assert logged.kind == "proposed" and logged.step == 1402


def test_a_push_to_a_jobs_ranks_never_waits_on_one_that_reads_nothing() -> None:
    """The tick thread pushes a job's pace and directives to its ranks. Ranks whose
    processes read nothing of what they are sent (their buffers full) held each push
    0.2 s a rank: 64 of them, registered by one user, stopped the tick for 13 s."""
    import socket
    import time

    from greend.ipc.server import Connection, Peer

    ops, _ = _ops()
    h = ops.handlers()
    socks: list[socket.socket] = []
    try:
        for i in range(16):
            a, b = socket.socketpair()
            socks += [a, b]
            h["register"](
                {"job": "stuck", "gpus": [0], "rank": i, "world_size": 16},
                Connection(a, Peer(100 + i, 1000, 1000), 10 + i),
            )
            a.setblocking(False)
            with pytest.raises(BlockingIOError):
                while True:  # its peer reads nothing: fill what the kernel holds for it
                    a.send(b"x" * 65536)
            a.setblocking(True)
        t0 = time.monotonic()
        sent = ops.jobs.push("stuck", {"op": "pace", "pace_s": 0.1})
        took = time.monotonic() - t0
        assert sent == 0 and took < 0.2, took
    finally:
        for s in socks:
            s.close()


def test_a_directive_a_busy_rank_missed_is_sent_again_at_the_next_tick() -> None:
    """A push finds the rank's connection busy sending it a reply (its serve thread holds
    the send lock): the push skips it. The proposal stood ("asked already: the ranks hold
    it") and was never sent again (the policy waits on a standing proposal without asking
    it again); the rank never heard it. The next tick pushes it again; asked again, it is
    sent again too, quietly (one proposal booked)."""
    import socket
    import threading
    import time

    from greend.ipc.server import Connection, Peer

    ops, clock = _ops()
    h = ops.handlers()
    a, b = socket.socketpair()
    conn = Connection(a, Peer(100, 1000, 1000), 10)
    try:
        h["register"]({"job": "j", "precisions": ["fp32", "bf16"], "precision": "fp32"}, conn)
        held = threading.Event()

        def replying() -> None:  # the serve thread writing a long reply to this rank, 50 ms
            with conn._send_lock:
                held.set()
                time.sleep(0.05)

        t = threading.Thread(target=replying)
        t.start()
        held.wait()
        assert ops.jobs.switch_precision("j", "bf16", "policy", policy="test")
        t.join()
        b.settimeout(0.2)
        with pytest.raises(socket.timeout):
            b.recv(65536)  # skipped: nothing reached the rank
        clock.t += 0.1
        ops.jobs.tick(clock.t)
        assert b"directive" in b.recv(65536)  # the next tick's
        ops.jobs.tick(clock.t + 0.1)
        with pytest.raises(socket.timeout):
            b.recv(65536)  # once delivered, not again
        assert not ops.jobs.switch_precision("j", "bf16", "policy", policy="test")  # nothing new booked
        assert b"directive" in b.recv(65536)  # (asked again: sent again, quietly)
        assert len([e for e in ops.jobs.jobs["j"].precision_log if e.kind != "withdrawn"]) <= 1
    finally:
        a.close()
        b.close()


def test_a_job_is_offered_only_the_levels_every_rank_runs() -> None:
    # Rank 1 runs no fp8 (no torchao there): fp8 was offered to the job all the same, and
    # proposed to a rank that could only refuse it.
    from greend.policies.base import UNCAPPED

    ops, _ = _ops()
    h = ops.handlers()
    for session, (rank, levels) in enumerate([(0, ["bf16", "fp8"]), (1, ["fp32", "bf16"])], start=1):
        conn = _Conn(session, _Peer(pid=session, uid=1000))
        h["register"]({"job": "mixed", "gpus": [rank], "rank": rank, "world_size": 2, "precisions": levels,
                       "precision": "bf16"}, conn)  # fmt: skip
    (view,) = ops.jobs.views(lambda gpu: UNCAPPED)
    assert view.precisions == ("bf16",)


def test_the_policy_sees_how_many_agreements_on_the_pace_came_not_how_many_ranks_sent_each() -> None:
    from greend.policies.base import UNCAPPED

    ops, _ = _ops()
    h = ops.handlers()
    ranks = [_Conn(k, _Peer(pid=0, uid=1000)) for k in (1, 2, 3)]
    for k, conn in enumerate(ranks):
        h["register"]({"job": "p", "gpus": [k], "rank": k, "world_size": 3}, conn)
    for agreement, pace in enumerate((0.30, 0.31), start=1):
        for conn in ranks:  # (each rank sends each agreement)
            h["pace"]({"step_s": pace}, conn)
        (view,) = ops.jobs.views(lambda gpu: UNCAPPED)
        assert (view.pace_s, view.pace_count) == (pace, agreement)
    # A rank that reconnects counts on from its own ops, by its rank: its op for an agreement
    # the others already sent is not one more (nor, were every session new, would the next
    # agreement read as the first again).
    h["pace"]({"step_s": 0.33}, ranks[1])  # (agreement 3: ranks 1 and 2 first)
    h["pace"]({"step_s": 0.33}, ranks[2])
    ops.disconnected(ranks[0])
    again = _Conn(4, _Peer(pid=0, uid=1000))
    assert h["register"]({"job": "p", "gpus": [0], "rank": 0, "world_size": 3}, again)["job"] == "p"
    h["pace"]({"step_s": 0.33}, again)  # (rank 0's op for agreement 3, on its new connection)
    (view,) = ops.jobs.views(lambda gpu: UNCAPPED)
    assert (view.pace_s, view.pace_count) == (0.33, 3)


def test_a_job_with_ranks_on_other_nodes_gets_its_agreed_floor_one_on_this_node_alone_none() -> None:
    from greend.policies.base import UNCAPPED

    ops, _ = _ops()
    h = ops.handlers()
    for k, (job, world) in enumerate([("spans", 4), ("spans", 4), ("here", 2), ("here", 2)]):
        conn = _Conn(k + 1, _Peer(pid=0, uid=1000))
        h["register"]({"job": job, "gpus": [k], "rank": k % 2, "world_size": world}, conn)
        h["pace"]({"step_s": 0.30, "floor_s": 0.27}, conn)
    views = {v.job: v for v in ops.jobs.views(lambda gpu: UNCAPPED)}
    assert (views["spans"].pace_s, views["spans"].floor_s) == (0.30, 0.27)  # (2 of its 4 ranks here)
    assert (views["here"].pace_s, views["here"].floor_s) == (0.30, None)  # (its own rechecks rule)
    h["pace"]({"step_s": 0.31}, _Conn(1, _Peer(pid=0, uid=1000)))  # (ranks that agreed no floor)
    assert {v.job: v for v in ops.jobs.views(lambda gpu: UNCAPPED)}["spans"].floor_s is None


def test_a_re_check_a_node_asked_reaches_the_policy_as_the_latest_the_ranks_agreed() -> None:
    from greend.policies.base import UNCAPPED
    from greend.protocol import SCHEMAS, ProtocolError, validate

    ops, _ = _ops()
    h = ops.handlers()
    conns = [_Conn(k + 1, _Peer(pid=0, uid=1000)) for k in range(2)]
    for k, conn in enumerate(conns):
        h["register"]({"job": "spans", "gpus": [k], "rank": k, "world_size": 4}, conn)
    (view,) = ops.jobs.views(lambda gpu: UNCAPPED)
    assert view.recheck_at == 0  # (none asked)
    h["pace"]({"step_s": 0.30, "recheck_at": 2106}, conns[0])
    h["pace"]({"step_s": 0.30}, conns[1])  # (a rank whose agreement came before the ask: never back)
    (view,) = ops.jobs.views(lambda gpu: UNCAPPED)
    assert view.recheck_at == 2106
    for bad in (-1, "2106", 2.5, True):
        with pytest.raises(ProtocolError, match="recheck_at"):
            validate({"step_s": 0.3, "recheck_at": bad}, SCHEMAS["pace"])


def test_an_unknown_job_s_hint_reads_a_bounded_set_of_known_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """A report for an unknown id suggests the closest known one; it compares at most
    HINT_IDS of them (in-memory jobs first), each cut to HINT_CHARS: 400 crafted
    128-character ids made one such report cost 0.8 s of the daemon's CPU."""
    from greend.jobs.ops import HINT_CHARS, HINT_IDS, _did_you_mean

    assert _did_you_mean("resnet-run-8", ["bert-1", "resnet-run-7", "resnet-run-7"]) == "; did you mean 'resnet-run-7'?"
    crafted = ["a" * 120 + f"{i:08d}" for i in range(400)]
    seen: list[str] = []
    real = difflib.get_close_matches

    def spy(word: str, possibilities: list[str], n: int = 3) -> list[str]:
        seen.extend(possibilities)
        assert len(word) <= HINT_CHARS
        return real(word, possibilities, n)

    monkeypatch.setattr(difflib, "get_close_matches", spy)
    _did_you_mean("a" * 128, crafted + crafted)
    assert 0 < len(seen) <= HINT_IDS and all(len(p) <= HINT_CHARS for p in seen)
