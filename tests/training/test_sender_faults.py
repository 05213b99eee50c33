"""The sender thread against odd step values and its own bugs: a value the wire cannot
hold is cleaned or dropped alone, and nothing ends the reporting for good."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from greend.testing.fake_daemon import FakeDaemon
from greend.training.callback import GreenCallback
from greend.training.rows import clean
from tests.support import wait_for

FAST = dict(flush_interval_s=0.02, heartbeat_s=0.2, close_timeout_s=2.0, connect_timeout_s=1.0)


def record(index: object = 3, flops: object = 2.0, samples: object = 8, tokens: object = None) -> tuple[object, ...]:
    return (index, 1.0, 1.5, flops, samples, tokens, 0.25, False, "fp32")


def test_clean_makes_user_values_what_the_wire_holds() -> None:
    assert clean(record()) == record()  # greend's own: unchanged
    got = clean(record(index=np.int64(7), flops=np.float32(4.0), samples=np.int64(8), tokens=torch.tensor(12)))
    assert got is not None and got[0] == 7 and type(got[0]) is int
    assert got[3] == 4.0 and type(got[3]) is float and got[4] == 8 and type(got[4]) is int and got[5] == 12
    assert clean(record(index=torch.tensor(9)))[0] == 9  # type: ignore[index]  # (not None here)
    for bad in (math.nan, math.inf, -1, -0.5, "many", object()):
        c = clean(record(samples=bad, tokens=bad))
        assert c is not None and c[4] is None and c[5] is None  # not counted
    for bad in (math.nan, math.inf, -1.0, "x"):
        c = clean(record(flops=bad))
        assert c is not None and c[3] is None
    assert clean(record(index=3.5)) is None and clean(record(index="3")) is None  # no whole number: dropped


def test_odd_step_values_never_stop_the_reporting(daemon: FakeDaemon, sock_path: Path) -> None:
    """index= as numpy integers, one NaN samples= and one infinite flops= ended the sender
    thread: nothing more was reported for the rest of the run."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with GreenCallback(job="odd", socket=sock_path, flops_per_step=1.0, **FAST) as cb:
            assert wait_for(lambda: cb.connected)
            for i in np.arange(40):
                samples = math.nan if i == 5 else 8
                flops = math.inf if i == 6 else None
                with cb.step(index=i, samples=samples, flops=flops) as st:
                    st.loss(0.5)
            cb.flush()
            assert wait_for(lambda: daemon.received() == 40)
    assert wait_for(lambda: len(daemon.ends) == 1)
    assert cb.stats.last_error is None


def test_a_bug_in_the_sender_thread_pauses_the_reporting_and_it_goes_on(
    daemon: FakeDaemon, sock_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with GreenCallback(job="bug", socket=sock_path, flops_per_step=1.0, **FAST) as cb:
            assert wait_for(lambda: cb.connected)
            sender = cb._sender
            real, calls = sender._run_once, {"n": 0}

            def once_broken() -> None:
                calls["n"] += 1
                if calls["n"] == 1:
                    raise RuntimeError("a bug in a round")
                real()

            sender._run_once = once_broken  # type: ignore[method-assign]  # a fault in one round
            for _ in range(20):
                with cb.step(samples=8) as st:
                    st.loss(0.5)
            cb.flush()
            assert wait_for(lambda: daemon.received() == 20, 10)  # after the pause, reconnected
            assert calls["n"] > 1 and sender._thread.is_alive() and len(daemon.registers) == 2
    assert wait_for(lambda: len(daemon.ends) == 1)
    assert any("sender thread failed; it starts again" in r.getMessage() for r in caplog.records)
