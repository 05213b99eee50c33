"""Which registration continues a job's record and which starts a new one."""

from __future__ import annotations

from pathlib import Path

import pytest

from greend.cli.render import render_report
from greend.errors import ProtocolError, StateError
from greend.jobs.history import stored_jobs, stored_report
from greend.jobs.ledger import Ledger
from greend.jobs.records import Caller
from greend.jobs.registry import JobRegistry
from greend.protocol import Registration
from greend.stores.sqlite import SqliteStore


def test_a_run_that_reconnects_with_its_run_id_continues_its_record() -> None:
    """A client that gave up on a stalled daemon (SIGSTOP) and reconnected registers again
    with its run id, having sent steps before: the same record goes on, not a second one
    for the same run. A new run (another run id) under the id gets a fresh record, and so
    do new processes given the same run id (a rerun or an elastic restart under a launcher
    whose environment names every run alike: they sent no step before)."""
    reg = JobRegistry(Ledger(), hostname="h")

    def register(run: str, session: int, steps_before: int = 0) -> None:
        r = Registration(job="train", run=run, rank=0, local_rank=0, world_size=1, gpus=(), host=None,
                         precisions=("fp32",), mem_share=None, reference_every=None,
                         steps_before=steps_before)  # fmt: skip
        reg.register(r, Caller(session=session, pid=0, uid=1000))

    register("run-a", 1)
    first = reg.jobs["train"]
    reg.disconnected(1)
    assert first.state == "ending" and first.end_reason == "client disconnected"
    register("run-a", 2, steps_before=40)
    assert reg.jobs["train"] is first and first.state == "running" and first.end_reason is None
    reg.disconnected(2)
    register("run-a", 3)  # the same run id, from a process that never sent a step: a rerun
    rerun = reg.jobs["train"]
    assert rerun is not first and rerun.run == "run-a" and rerun.state == "running"
    reg.disconnected(3)
    register("run-b", 4, steps_before=40)
    assert reg.jobs["train"] is not rerun and reg.jobs["train"].run == "run-b"


def test_the_jobs_running_when_the_daemon_stops_end_and_are_kept() -> None:
    """A daemon stopped under a running job ended nothing: the part of the run before a
    restart was in no archive and no store row. Now it ends, 'interrupted', and every
    job-end hook (the archive's) sees it."""
    reg = JobRegistry(Ledger(), hostname="h")
    ended: list[str] = []
    reg.on_job_end.append(lambda job: ended.append(f"{job.job}:{job.end_reason}"))
    r = Registration(job="train", run="run-a", rank=0, local_rank=0, world_size=1, gpus=(), host=None,
                     precisions=("fp32",), mem_share=None, reference_every=None)  # fmt: skip
    reg.register(r, Caller(session=1, pid=0, uid=1000))
    points = reg.interrupt_all()
    assert reg.jobs["train"].state == "ended" and not reg.sessions
    assert ended == ["train:interrupted: the daemon stopped"]
    assert any(p.measurement == "greend_job" for p in points)
    with pytest.raises(StateError, match="the daemon is stopping"):  # (its record would never be kept)
        reg.register(r, Caller(session=2, pid=0, uid=1000))


def test_a_callback_from_before_steps_before_still_resumes_its_record() -> None:
    """A callback that does not say what it sent before (an older one) reconnecting with
    its run id after a lost connection: its record goes on, as it did for it before."""
    reg = JobRegistry(Ledger(), hostname="h")

    def register(session: int) -> None:
        r = Registration(job="train", run="run-a", rank=0, local_rank=0, world_size=1, gpus=(), host=None,
                         precisions=("fp32",), mem_share=None, reference_every=None)  # fmt: skip
        assert r.steps_before is None
        reg.register(r, Caller(session=session, pid=0, uid=1000))

    register(1)
    first = reg.jobs["train"]
    reg.disconnected(1)
    register(2)
    assert reg.jobs["train"] is first and first.state == "running"


def test_a_client_that_says_neither_run_nor_steps_before_resumes_only_from_its_own_process() -> None:
    """A client that says neither its run nor what it sent before (an older one, a client
    of another tool): a record its heartbeats let expire goes on only when the process that
    left comes back (a daemon stall). Another process under the id minutes later is another
    run: a fresh record (it was merged into the old one, its steps 0-99 counted twice and
    the idle gap in the record's span and energy)."""
    clock = [1000.0]
    reg = JobRegistry(Ledger(), hostname="h", monotonic=lambda: clock[0], heartbeat_timeout_s=15.0)

    def register(session: int, pid: int) -> None:
        r = Registration(job="control", run=None, rank=0, local_rank=0, world_size=1, gpus=(), host=None,
                         precisions=("bf16",), mem_share=None, reference_every=None)  # fmt: skip
        reg.register(r, Caller(session=session, pid=pid, uid=1000))

    def wait(s: float) -> None:  # (the daemon ticks on: no stall of its own)
        for _ in range(int(s)):
            clock[0] += 1.0
            reg.tick(clock[0])

    register(1, pid=100)
    first = reg.jobs["control"]
    wait(20)  # (its heartbeats stopped)
    assert first.end_reason is not None and first.end_reason.startswith("no heartbeat")
    register(2, pid=100)  # the same process, back
    assert reg.jobs["control"] is first and first.state == "running"
    wait(160)
    assert first.end_reason is not None and first.end_reason.startswith("no heartbeat")
    register(3, pid=200)  # another process, later
    assert reg.jobs["control"] is not first and reg.jobs["control"].state == "running"


def test_a_second_process_as_a_rank_already_registered_is_refused_by_name() -> None:
    """Two processes of one job that both say rank 0 (a launcher that set no RANK): the
    second was booked beside the first and the rank's steps were summed (200 for a job
    that ran 100). It is refused, naming the rank, the pid that holds it and what to set;
    it joins once that process has left. One process may register its rank again (a
    callback made anew in a notebook while the first one lives)."""
    reg = JobRegistry(Ledger(), hostname="h")

    def register(session: int, pid: int, rank: int) -> None:
        r = Registration(job="train", run="run-a", rank=rank, local_rank=rank, world_size=2, gpus=(), host=None,
                         precisions=("bf16",), mem_share=None, reference_every=None)  # fmt: skip
        reg.register(r, Caller(session=session, pid=pid, uid=1000))

    register(1, pid=100, rank=0)
    with pytest.raises(ProtocolError, match=r"rank 0 of job 'train' is already registered by pid 100.*RANK") as e:
        register(2, pid=200, rank=0)
    assert e.value.field == "rank" and 2 not in reg.sessions
    register(3, pid=200, rank=1)
    register(4, pid=100, rank=0)  # the same process again
    assert sorted((s.pid, s.rank) for s in reg.jobs["train"].ranks.values()) == [(100, 0), (100, 0), (200, 1)]
    reg.disconnected(1)
    reg.disconnected(4)
    register(5, pid=300, rank=0)  # the first process has left: its rank is free
    assert sorted((s.pid, s.rank) for s in reg.jobs["train"].ranks.values()) == [(200, 1), (300, 0)]


def test_a_measured_command_is_stored_as_one_and_read_back_so(tmp_path: Path) -> None:
    """``greenctl measure``'s job from the store read as an fp32 training job with 0 steps
    (its summary carried the default level and no kind). It is stored tagged
    ``kind=measure`` without a precision, and read back with windows, not steps."""
    reg = JobRegistry(Ledger(), hostname="h")
    for kind, job in (("measure", "cmd"), ("training", "train")):
        r = Registration(job=job, run=None, rank=0, local_rank=0, world_size=1, gpus=(), host=None,
                         precisions=(), mem_share=None, reference_every=None, kind=kind)  # fmt: skip
        reg.register(r, Caller(session=len(reg.sessions) + 1, pid=0, uid=1000))
    reg.jobs["cmd"].steps = 3  # (the windows it reported its time in)
    points = [p for p in reg.interrupt_all() if p.measurement == "greend_job"]
    store = SqliteStore(tmp_path / "g.db")
    store.write(points)
    assert store.flush(5)
    store.close()
    rows = {r["job"]: r for r in stored_jobs(tmp_path / "g.db")}
    assert rows["cmd"]["kind"] == "measure" and rows["cmd"]["precision"] is None
    assert rows["cmd"]["windows"] == 3 and rows["cmd"]["steps"] is None
    assert rows["train"]["kind"] == "training" and rows["train"]["precision"] == "fp32"
    rep = stored_report(tmp_path / "g.db", "cmd")
    assert rep is not None and rep["kind"] == "measure" and rep["measured_whole"] is True
    assert rep["precision"] is None and rep["steps"] is None and rep["windows"] == 3
    assert "windows" in render_report(rep) and "fp32" not in render_report(rep)


def test_a_rank_is_never_asked_a_level_above_the_jobs_own() -> None:
    """A bf16 job whose record followed a rank up to fp32 (a client that ran a step above
    its own level): a rank registering again is asked the job's own level, not fp32."""
    reg = JobRegistry(Ledger(), hostname="h")

    def register(session: int, rank: int) -> str | None:
        r = Registration(job="train", run="run-a", rank=rank, local_rank=rank, world_size=2, gpus=(), host=None,
                         precisions=("fp32", "bf16"), mem_share=None, reference_every=None,
                         precision="bf16")  # fmt: skip
        return reg.register(r, Caller(session=session, pid=rank, uid=1000)).precision

    assert register(1, 0) == "bf16"
    job = reg.jobs["train"]
    assert job.top_precision == "bf16"
    job.precision = "fp32"  # as follow_ranks sets it from such a rank's rows
    assert register(2, 1) == "bf16"


def test_a_job_s_span_starts_no_earlier_than_the_daemon() -> None:
    """A daemon restarted under a running job: the rank registers again and sends the rows
    it queued meanwhile, run before this daemon started. The job's span began at the first
    of them, before any reading (a 1.5 s record reported 1,000 s at 4 W on a 70 W-idle GPU):
    it starts no earlier than the daemon. Their steps and FLOPs are the run's and are booked
    (their energy was not measured: noted in the README)."""
    from greend.protocol import StepsRow

    now = [1000.0]
    reg = JobRegistry(Ledger(), hostname="h", monotonic=lambda: now[0])
    reg.started_s = now[0]  # (as the daemon sets it)
    now[0] = 1001.0
    r = Registration(job="train", run="run-a", rank=0, local_rank=0, world_size=1, gpus=(), host=None,
                     precisions=("fp32",), mem_share=None, reference_every=None, steps_before=500)  # fmt: skip
    reg.register(r, Caller(session=1, pid=0, uid=1000))
    old = [StepsRow(500 + 10 * k, 509 + 10 * k, 10, 100.0 + k, 101.0 + k, 1.0, 0.1, 1e14) for k in range(10)]
    reg.book(1, [*old, StepsRow(600, 609, 10, 1001.0, 1002.0, 1.0, 0.1, 1e14)])
    job = reg.jobs["train"]
    assert job.t_start_s == 1000.0 and job.steps == 110 and job.steps_before == 500
