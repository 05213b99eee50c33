"""Claims follow real GPU use (greend.jobs.claims): a claim on a GPU that shows none of
the job's processes is pending, steers nothing and keeps no one off; it becomes active
once the job's process computes there; where the device cannot list processes, claims
are trusted but never exclusive. The registry runs with real processes (their pids and
children from /proc) and a GPU process list given as NVML would list it."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from greend.jobs import claims
from greend.jobs.ledger import Ledger
from greend.jobs.records import Caller
from greend.jobs.registry import JobRegistry
from greend.protocol import Registration
from greend.settings import Setting


def _reg(job: str, gpus: list[int]) -> Registration:
    return Registration(
        job=job, run=None, rank=0, local_rank=0, world_size=1, gpus=tuple(gpus), host=None,
        precisions=("fp32",), mem_share=None, reference_every=None,
    )  # fmt: skip


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Two live processes (two users' ranks, as far as the registry knows), the second
    with a child (a rank's worker that computes on its behalf)."""
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"  # noqa: E501  # one line of code to run
    ps = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]),
        subprocess.Popen([sys.executable, "-c", child]),
    ]
    yield ps
    for p in ps:
        for c in claims.process_tree(p.pid) - {p.pid}:
            subprocess.run(["kill", str(c)], check=False)
        p.kill()
        p.wait(10)


class _Gpus:
    """The node's GPU process lists (None: the device cannot say)."""

    def __init__(self) -> None:
        self.listed: dict[int, set[int] | None] = {0: set(), 1: set()}

    def __call__(self, index: int) -> set[int] | None:
        return self.listed[index]


def _registry(gpus: _Gpus) -> JobRegistry:
    return JobRegistry(Ledger(), hostname="h", gpu_indices=lambda: [0, 1], gpu_processes=gpus)


def _steered(reg: JobRegistry) -> dict[str, list[int]]:
    return {v.job: list(v.gpus) for v in reg.views(lambda g: Setting())}


def test_a_claim_without_use_is_pending_and_steers_nothing(procs: list[subprocess.Popen[bytes]]) -> None:
    gpus = _Gpus()
    reg = _registry(gpus)
    idle, trainer = procs
    reg.register(_reg("squat", [0, 1]), Caller(session=1, pid=idle.pid, uid=1001))
    assert reg.jobs["squat"].claims == {0: "pending", 1: "pending"}
    assert _steered(reg) == {} and reg.steered_gpus("squat") == []
    # Another user's rank that will train on GPU 1 is registered beside the pending claim.
    reg.register(_reg("train", [1]), Caller(session=2, pid=trainer.pid, uid=1002))
    assert reg.jobs["train"].claims == {1: "pending"}
    # Its worker (a child of the rank) computes on GPU 1: the claim becomes active on
    # the next look, and the GPU is steered for it alone.
    deadline = time.monotonic() + 20
    while not (worker := sorted(claims.process_tree(trainer.pid) - {trainer.pid})) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker, "the rank's child did not start"
    gpus.listed[1] = {worker[0]}
    reg.refresh_claims()
    assert reg.jobs["train"].claims == {1: "active"}
    assert reg.jobs["squat"].claims == {0: "pending", 1: "pending"}  # stale: stays pending
    assert _steered(reg) == {"train": [1]} and reg.steered_gpus("train") == [1]
    report = reg.report(reg.jobs["squat"])
    assert report["gpu_claims"] == {"0": "pending", "1": "pending"}


def test_a_stale_claim_is_logged_when_another_job_uses_the_gpu(
    procs: list[subprocess.Popen[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    gpus = _Gpus()
    reg = _registry(gpus)
    idle, trainer = procs
    reg.register(_reg("squat", [1]), Caller(session=1, pid=idle.pid, uid=1001))
    gpus.listed[1] = {trainer.pid}  # already on the GPU when it registers
    with caplog.at_level(logging.WARNING, logger="greend.jobs.claims"):
        reg.register(_reg("train", [1]), Caller(session=2, pid=trainer.pid, uid=1002))
    assert reg.jobs["train"].claims == {1: "active"}
    line = next(r.getMessage() for r in caplog.records if "squat" in r.getMessage())
    assert "job train (uid 1002) computes there" in line and "stays so" in line


def test_a_gpu_that_runs_another_jobs_work_is_refused_to_a_job_not_on_it(
    procs: list[subprocess.Popen[bytes]],
) -> None:
    gpus = _Gpus()
    reg = _registry(gpus)
    idle, trainer = procs
    gpus.listed[0] = {trainer.pid}
    reg.register(_reg("train", [0]), Caller(session=1, pid=trainer.pid, uid=1002))
    with pytest.raises(PermissionError, match="none of this job's"):
        reg.register(_reg("squat", [0]), Caller(session=2, pid=idle.pid, uid=1001))
    # root is not refused; its claim without use is pending all the same.
    reg.register(_reg("roots", [0]), Caller(session=3, pid=idle.pid, uid=0))
    assert reg.jobs["roots"].claims == {0: "pending"}
    assert _steered(reg) == {"train": [0]}


def test_where_the_device_cannot_list_processes_claims_are_trusted_never_exclusive(
    procs: list[subprocess.Popen[bytes]],
) -> None:
    gpus = _Gpus()
    gpus.listed[0] = None  # NVML: NOT_SUPPORTED
    reg = _registry(gpus)
    a, b = procs
    reg.register(_reg("a", [0]), Caller(session=1, pid=a.pid, uid=1001))
    assert reg.jobs["a"].claims == {0: "trusted"} and _steered(reg) == {"a": [0]}
    # A second user's claim on it is registered, and the GPU, claimed by two jobs
    # neither of which can be told apart from an idle claim, is steered by neither.
    reg.register(_reg("b", [0]), Caller(session=2, pid=b.pid, uid=1002))
    assert reg.jobs["b"].claims == {0: "trusted"} and _steered(reg) == {}
    reg.end(2, "done")
    assert _steered(reg) == {"a": [0]}


def test_claim_states() -> None:
    visible = {10, 11, 20}.__contains__
    assert claims.claim_state(None, {10}, visible) == "trusted"  # the device cannot say
    assert claims.claim_state({10, 20}, {10}, visible) == "active"
    assert claims.claim_state({20}, {10, 11}, visible) == "pending"  # another's process
    assert claims.claim_state(set(), {10}, visible) == "pending"  # nobody computes there
    assert claims.claim_state({99}, {10}, visible) == "trusted"  # pids of another pid namespace
    assert claims.claim_state({20}, set(), visible) == "trusted"  # the rank's pid is unknown here
    assert claims.strangers({20}, {10}, visible) and not claims.strangers(set(), {10}, visible)
    assert not claims.strangers({99}, {10}, visible) and not claims.strangers(None, {10}, visible)
    assert claims.merge("pending", "active") == "active" and claims.merge("active", "pending") == "active"
    assert claims.merge(None, "pending") == "pending" and claims.merge("trusted", "active") == "active"


def test_the_tick_never_waits_on_a_gpu_whose_process_list_hangs(procs: list[subprocess.Popen[bytes]]) -> None:
    """NVML's process list on a GPU that hangs returns only at its deadline (5 s a GPU):
    the tick hands the look at pending claims to a thread of its own and goes on; the
    claim becomes active when the look returns, and a look still out is not doubled."""
    idle, trainer = procs
    gpus, calls = _Gpus(), []

    def slow(index: int) -> set[int] | None:
        calls.append(index)
        time.sleep(1.5)  # (a hung GPU's deadline, shortened)
        return gpus(index)

    reg = _registry(gpus)
    reg.register(_reg("train", [0, 1]), Caller(session=1, pid=trainer.pid, uid=1001))
    assert reg.jobs["train"].claims == {0: "pending", 1: "pending"}
    gpus.listed[0] = {trainer.pid}
    reg.gpu_processes = slow
    t0 = time.monotonic()
    reg.tick(1000.0)
    reg.tick(1001.5)  # the next look is due while the first is still out
    assert time.monotonic() - t0 < 0.5  # (waiting on it: 3 s and more)
    deadline = time.monotonic() + 20
    while reg.jobs["train"].claims.get(0) != "active" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reg.jobs["train"].claims == {0: "active", 1: "pending"}
    assert calls == [0, 1]  # one look (both GPUs), not two
