"""The loss is never read on the training thread in a way that waits for the GPU:
``step.loss(tensor)`` copies it and judges it once the copy has landed."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from greend.testing.fake_daemon import FakeDaemon
from greend.training.callback import GreenCallback
from greend.training.loss_reader import LossReader
from tests.support import wait_for

FAST = dict(flush_interval_s=0.02, heartbeat_s=0.2, close_timeout_s=2.0, connect_timeout_s=1.0)


class NoSync(torch.Tensor):
    """A loss whose every host read raises: on a GPU each of these syncs the stream."""

    def item(self) -> Any:  # type: ignore[override]
        raise AssertionError("loss.item() called on the training thread")

    def __float__(self) -> float:
        raise AssertionError("float(loss) called on the training thread")

    def tolist(self) -> Any:  # type: ignore[override]
        raise AssertionError("loss.tolist() called on the training thread")

    def __bool__(self) -> bool:
        raise AssertionError("bool(loss) called on the training thread")

    def cpu(self, *a: Any, **k: Any) -> Any:  # type: ignore[override]
        raise AssertionError("loss.cpu() called on the training thread")


def _train(cb: GreenCallback, model: nn.Module, n: int, wrap: Any = lambda t: t) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, 16, generator=g)
        with cb.step(samples=8, flops=1e6) as st:
            loss = model(x).pow(2).mean()
            st.loss(wrap(loss))
            losses.append(loss.detach().item())  # the test's own read, outside greend
            opt.zero_grad()
            loss.backward()
            opt.step()
    return losses


def test_the_hot_path_never_reads_the_loss_tensor(daemon: FakeDaemon, sock_path: Path) -> None:
    model = nn.Linear(16, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning would mean the loss was refused
        with GreenCallback(job="nosync", model=model, socket=sock_path, **FAST) as cb:
            assert wait_for(lambda: cb.connected)
            losses = _train(cb, model, 20, wrap=lambda t: t.as_subclass(NoSync))
    assert wait_for(lambda: len(daemon.steps) == 20)
    got = [s.get("loss") for s in sorted(daemon.steps, key=lambda s: s["step"])]
    assert got == pytest.approx(losses)


class InFlight(LossReader):
    """A reader whose copies land only after ``lag`` further reads (a GPU running behind)."""

    def __init__(self, lag: int) -> None:
        super().__init__()
        self.lag = lag
        self.calls = 0
        self.waited = 0

    def start(self, loss: torch.Tensor) -> tuple[Any, Any]:
        self.calls += 1
        value, _ = super().start(loss)
        return (value, self.calls + self.lag), "landed-later"

    def value(self, handle: tuple[Any, Any], wait: bool = False) -> float | None:
        (value, due), _ = handle
        if self.calls < due and not wait:
            return None
        if self.calls < due:
            self.waited += 1
        return float(value)


def test_losses_in_flight_are_recorded_in_order_once_they_land(daemon: FakeDaemon, sock_path: Path) -> None:
    model = nn.Linear(16, 4)
    reader = InFlight(lag=2)
    with GreenCallback(job="lagged", model=model, socket=sock_path, **FAST) as cb:
        assert wait_for(lambda: cb.connected)
        cb._losses = reader
        losses = _train(cb, model, 12)
        # The last two are still in flight while training runs: nobody waited for them.
        assert len(cb._unjudged) == 2 and reader.waited == 0
    assert reader.waited == 2  # close() takes the last ones (training is over)
    assert wait_for(lambda: len(daemon.steps) == 12)
    steps = sorted(daemon.steps, key=lambda s: s["step"])
    assert [s["step"] for s in steps] == list(range(12))
    assert [s.get("loss") for s in steps] == pytest.approx(losses)


def test_a_gpu_far_behind_is_waited_for_only_past_the_limit(daemon: FakeDaemon, sock_path: Path) -> None:
    model = nn.Linear(16, 4)
    reader = InFlight(lag=100)  # never lands on its own within the run
    with GreenCallback(job="far", model=model, socket=sock_path, **FAST) as cb:
        assert wait_for(lambda: cb.connected)
        cb._losses = reader
        _train(cb, model, 20)
        assert len(cb._unjudged) == 8  # the bound: older ones were taken, the rest stay in flight
    assert wait_for(lambda: len(daemon.steps) == 20)


def test_a_plain_cpu_loss_is_read_at_once_and_a_wrong_shape_refused_by_name() -> None:
    reader = LossReader()
    x = torch.tensor([1.5, 2.5], requires_grad=True)
    value, pending = reader.start((x * x).mean())
    assert pending is None and value == pytest.approx(4.25)
    assert reader.start(torch.tensor([[3.0]]))[0] == 3.0  # one element in any shape
    with pytest.raises(ValueError, match=r"a loss of shape \(2,\): expected one number"):
        reader.start(x * 2)
    # A subclass takes the copy, never its own item() (a DTensor's may gather across ranks).
    value, pending = reader.start(torch.tensor(2.0).as_subclass(NoSync))
    assert pending is None and value == 2.0
