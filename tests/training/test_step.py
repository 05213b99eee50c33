"""The step's hot path: its fields after a step, the user's errors going through,
and nothing kept alive once the losses are read."""

from __future__ import annotations

import gc
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from greend.errors import GreendWarning
from greend.testing.fake_daemon import FakeDaemon
from greend.training.callback import GreenCallback
from greend.training.step import Step
from tests.support import wait_for

FAST = dict(flush_interval_s=0.02, heartbeat_s=0.2, close_timeout_s=2.0, connect_timeout_s=1.0)


def test_a_step_reads_as_documented(daemon: FakeDaemon, sock_path: Path) -> None:
    with GreenCallback(job="fields", socket=sock_path, **FAST) as cb:
        with cb.step(samples=4, tokens=7, index=3, flops=2e6) as st:
            assert st.precision == "fp32" and st.flops == 2e6 and st.index == 3
            assert st.samples == 4 and st.tokens == 7 and st.t0_s > 0 and st.t1_s == 0.0
            st.loss(1.25)
            st.mark_nonfinite("gradient")
        assert st.t1_s >= st.t0_s and st._nonfinite is True and st._nonfinite_cause == "gradient"
        with pytest.raises(ZeroDivisionError):  # the user's error goes through, unrecorded
            with cb.step(samples=1, flops=1.0):
                raise ZeroDivisionError
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            with cb.step(samples=1, flops=1.0) as st2:
                st2.loss("not a number")
        assert any("not a number" in str(x.message) for x in w)
    assert wait_for(lambda: len(daemon.steps) == 2)


def test_steps_and_losses_are_freed(daemon: FakeDaemon, sock_path: Path) -> None:
    model = nn.Linear(16, 4)
    x = torch.randn(8, 16)
    loss = model(x).pow(2).mean().detach()
    refs = sys.getrefcount(loss)
    with GreenCallback(job="freed", model=model, socket=sock_path, **FAST) as cb:
        for _ in range(500):
            with cb.step(samples=8, batch=x) as st:
                st.loss(loss)
        cb.flush()
        del st
    gc.collect()
    assert sys.getrefcount(loss) == refs  # greend holds no reference to a read loss
    assert not [o for o in gc.get_objects() if type(o) is Step]
    assert wait_for(lambda: len(daemon.steps) == 500)


def test_cpu_losses_of_any_dtype_are_reported_as_floats_and_keywords_work(daemon: FakeDaemon, sock_path: Path) -> None:
    # A CPU tensor's value is taken at once: an int or bool tensor's as a float too (a bool
    # would be refused by the daemon's schema, and the whole message with it).
    losses = [torch.tensor(3), torch.tensor(True), torch.tensor([0.5]), torch.tensor(2.0, requires_grad=True)]
    with GreenCallback(job="dtypes", socket=sock_path, flops_per_step=1.0, **FAST) as cb:
        assert wait_for(lambda: cb.connected)
        for t in losses:
            with cb.step() as st:
                st.loss(loss=t)  # the keyword, as the signature names it
        cb.flush()
        assert wait_for(lambda: len(daemon.steps) == 4)
    got = [s.get("loss") for s in sorted(daemon.steps, key=lambda s: s["step"])]
    assert got == [3.0, 1.0, 0.5, 2.0] and all(type(v) is float for v in got)


def test_a_tuple_shape_key_is_counted_once_and_looked_up_after(daemon: FakeDaemon, sock_path: Path) -> None:
    model = nn.Linear(16, 4)
    x = torch.randn(8, 16)
    with GreenCallback(job="tuplekey", model=model, socket=sock_path, **FAST) as cb:
        for _ in range(3):
            with cb.step(shape_key=("bucket", 8)) as st:
                model(x).sum().backward()
        assert list(cb._book.flop_cache) == [("bucket", 8)]
        assert st.flops == cb._book.flop_cache[("bucket", 8)] > 0


def test_a_complex_loss_is_refused_by_name_and_training_goes_on(daemon: FakeDaemon, sock_path: Path) -> None:
    with GreenCallback(job="complex", socket=sock_path, flops_per_step=1.0, **FAST) as cb:
        assert wait_for(lambda: cb.connected)
        with pytest.warns(GreendWarning, match=r"a loss of dtype torch.complex64: expected a real number"):
            with cb.step() as st:
                st.loss(torch.tensor(1 + 2j))
            cb.flush()
        with cb.step() as st:
            st.loss(torch.tensor(0.5))
        cb.flush()
        assert wait_for(lambda: len(daemon.steps) == 2)
    assert [s.get("loss") for s in sorted(daemon.steps, key=lambda s: s["step"])] == [None, 0.5]
