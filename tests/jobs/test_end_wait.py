"""A job that ends while one of its GPUs is not read (an NVML outage: its reads fail, the
ledger has no point for it) is priced once the reading after the outage bridges the gap,
not at once without that GPU's energy (greend.jobs.ledger.end_wait_s)."""

from __future__ import annotations

import pytest

from greend.jobs.ledger import CPU_END_WAIT_S, GPU_END_WAIT_S, Ledger, end_wait_s
from greend.jobs.ops import JobOps
from greend.jobs.registry import JobRegistry
from tests.jobs.test_ops import _Clock, _Conn, _Peer, _row


def test_end_wait_names_what_has_not_read_past_the_end() -> None:
    led = Ledger()
    led.record("gpu0", 10.0, 0.0)
    led.record("gpu1", 12.0, 0.0)
    led.record("cpu:package-0", 12.0, 0.0)
    assert end_wait_s(led, 11.0, [1]) == 0.0
    assert end_wait_s(led, 11.0, [0, 1]) == GPU_END_WAIT_S  # gpu0's reads stopped at 10 s
    assert end_wait_s(led, 11.0, [7]) == 0.0  # a GPU the ledger never read (no GPU probe): nothing to wait for
    led.record("cpu:package-1", 10.0, 0.0)
    assert end_wait_s(led, 11.0, [1]) == CPU_END_WAIT_S


def test_a_job_that_ends_in_a_gpu_s_outage_gets_its_share_of_the_gap() -> None:
    clock = _Clock()  # t = 1000
    led = Ledger()
    ops = JobOps(JobRegistry(led, hostname="h", monotonic=clock, wall=lambda: 1.7e9, heartbeat_timeout_s=60.0))
    conn = _Conn(3, _Peer(pid=0, uid=1000))
    h = ops.handlers()
    h["register"]({"job": "j1", "gpus": [0]}, conn)
    for t in range(990, 1001):  # 300 W until 1000 s, then its reads fail
        led.record("gpu0", float(t), 300.0 * (t - 990))
    h["intervals"]({"rows": [_row(995.0, 999.0)]}, conn)
    clock.t = 1006.0
    h["end"]({"reason": "done"}, conn)  # at 1006 s, 6 s into the outage
    job = ops.jobs.jobs["j1"]
    for t in (1007.0, 1010.0, 1020.0):
        ops.jobs.tick(t)
        assert job.state == "ending", t  # (before: ended at once, 1000-1006 s priced at 0 J)
    led.record("gpu0", 1030.0, 300.0 * 40)  # the reading after the outage: 300 W all along
    ops.jobs.tick(1030.0)
    assert job.state == "ended" and job.summary is not None
    t0 = 995.0  # (its first step's start)
    assert job.summary["gpu_energy_j"] == pytest.approx(300.0 * (1006.0 - t0), rel=1e-6)


def test_a_gpu_that_never_reads_again_holds_the_summary_back_a_bounded_time() -> None:
    clock = _Clock()
    led = Ledger()
    ops = JobOps(JobRegistry(led, hostname="h", monotonic=clock, wall=lambda: 1.7e9, heartbeat_timeout_s=60.0))
    conn = _Conn(3, _Peer(pid=0, uid=1000))
    h = ops.handlers()
    h["register"]({"job": "j1", "gpus": [0]}, conn)
    led.record("gpu0", 990.0, 0.0)
    led.record("gpu0", 1000.0, 3000.0)
    h["intervals"]({"rows": [_row(995.0, 999.0)]}, conn)
    clock.t = 1006.0
    h["end"]({"reason": "done"}, conn)
    job = ops.jobs.jobs["j1"]
    ops.jobs.tick(1006.0 + GPU_END_WAIT_S - 0.5)
    assert job.state == "ending"
    ops.jobs.tick(1006.0 + GPU_END_WAIT_S)
    assert job.state == "ended"
