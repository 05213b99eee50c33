"""The loss is never read on the training thread in a way that waits for the GPU:
``step.loss(tensor)`` copies it and judges it once the copy has landed."""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from greend.errors import GreendWarning
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


class Held(torch.Tensor):
    """A loss that is not a plain CPU tensor: greend holds it and reads it in batches,
    as it does a GPU's (a plain CPU tensor's value is taken at once)."""


def _held(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(Held)


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
        with GreenCallback(initial_precision="fp32", job="nosync", model=model, socket=sock_path, **FAST) as cb:
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
        cb._book.losses = reader
        losses = _train(cb, model, 12, wrap=_held)
        # Twelve fast steps at fp32: held, not read yet (a batch is 16 steps or 50 ms).
        assert len(cb._book.ended) + len(cb._book.unjudged) == 12 and reader.calls <= 12
        cb.flush()  # read them now: the last two are still in flight, and nobody waited for them
        assert len(cb._book.unjudged) == 2 and reader.waited == 0
    assert reader.waited == 2  # close() takes the last ones (training is over)
    assert wait_for(lambda: len(daemon.steps) == 12)
    steps = sorted(daemon.steps, key=lambda s: s["step"])
    assert [s["step"] for s in steps] == list(range(12))
    assert [s.get("loss") for s in steps] == pytest.approx(losses)


def test_a_gpu_far_behind_is_waited_for_only_past_the_limit(
    daemon: FakeDaemon, sock_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = nn.Linear(16, 4)
    reader = InFlight(lag=1000)  # never lands on its own within the run
    with GreenCallback(job="far", model=model, socket=sock_path, **FAST) as cb:
        assert wait_for(lambda: cb.connected)
        cb._book.losses = reader
        cb._book.judge_within_s = 3600.0  # batches by count only
        _train(cb, model, 40, wrap=_held)
        # Two batches handed over, their reads started, waiting to land: nobody waits for them.
        assert len(cb._book.handed) == 2 and reader.calls == 32 and reader.waited == 0
        assert not cb._book.unjudged and len(cb._channel.queue) == 0
        # Past the bound on batches handed over, the training thread takes them back and
        # waits for the oldest only while more than max_unjudged are in flight beyond the
        # batch just ended (its copy just started: never waited for).
        monkeypatch.setattr("greend.training.book.MAX_HANDED", 1)
        _train(cb, model, 24, wrap=_held)
        assert not cb._book.handed and len(cb._book.unjudged) == cb._book.max_unjudged + 16
        assert reader.waited == 64 - cb._book.max_unjudged - 16
    assert wait_for(lambda: len(daemon.steps) == 64)
    assert [s["step"] for s in sorted(daemon.steps, key=lambda s: s["step"])] == list(range(64))


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


def _bf16_steps(cb: GreenCallback, model: nn.Module, n: int, poison_at: int | None = None) -> list[str]:
    """Steps through step.backward/optimizer_step; returns each step's level."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    levels = []
    for i in range(n):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
        with cb.step(samples=8, flops=1e6) as st:
            with st.autocast():
                loss = model(x).float().pow(2).mean()
            if i == poison_at:
                loss = loss * float("nan")
            st.backward(loss)
            st.optimizer_step(opt)
            opt.zero_grad()
        levels.append(st.precision)
    return levels


def test_losses_are_read_in_batches_and_every_step_while_the_spike_rule_holds(
    daemon: FakeDaemon, sock_path: Path
) -> None:
    model = nn.Linear(16, 4)
    # A CPU loss's value is taken at once (item() waits for nothing there); judging it and
    # recording the step wait for the batch: cb.stats.recorded counts the steps judged.
    with GreenCallback(probe_trial=False, job="batched", model=model, socket=sock_path, spike_steps=20, **FAST) as cb:
        assert wait_for(lambda: cb.connected)
        cb._book.judge_within_s = 3600.0  # the batch by count only, whatever this machine's speed
        _bf16_steps(cb, model, 15)
        assert cb.stats.recorded == 0 and len(cb._book.ended) == 15  # held, not judged: no work per step
        _bf16_steps(cb, model, 1)
        assert cb.stats.recorded == 16 and not cb._book.ended  # the 16th step judges the batch, in order
        assert len(cb.precision_events) == 0

        assert daemon.directive("bf16") == 1
        assert wait_for(lambda: cb.requested_precision == "bf16")
        for k in range(20):  # the spike window: each step is read at its own end
            assert _bf16_steps(cb, model, 1) == ["bf16"]
            assert cb.stats.recorded == 17 + k and not cb._book.ended
        _bf16_steps(cb, model, 3)  # past the window: batches again
        assert len(cb._book.ended) == 3 and cb.stats.recorded == 36
        # A NaN after the window still rolls back, at the end of its batch at the latest.
        levels = _bf16_steps(cb, model, 16, poison_at=0)
        assert levels[0] == "bf16" and levels[-1] == "fp32"
        assert cb.precision == "fp32"
    events = [e for e in cb.precision_events if e["kind"] == "rollback"]
    assert len(events) == 1 and "non-finite loss" in events[0]["reason"]


def test_a_loss_of_the_wrong_shape_is_refused_by_name_when_read(daemon: FakeDaemon, sock_path: Path) -> None:
    with GreenCallback(job="shape", socket=sock_path, flops_per_step=1.0, **FAST) as cb:
        assert wait_for(lambda: cb.connected)
        with pytest.warns(GreendWarning, match=r"cannot read this tensor \(a loss of shape \(2,\)"):
            with cb.step() as st:
                st.loss(torch.tensor([1.0, 2.0]))
            cb.flush()
        with cb.step() as st:
            st.loss(torch.tensor(0.25))
        cb.flush()
        assert wait_for(lambda: len(daemon.steps) == 2)
    assert [s.get("loss") for s in daemon.steps] == [None, 0.25]


def test_the_forward_hook_goes_on_the_model_only_when_steps_lack_batch(daemon: FakeDaemon, sock_path: Path) -> None:
    model = nn.Linear(16, 4)
    x = torch.randn(8, 16)
    with GreenCallback(job="hook", model=model, socket=sock_path, **FAST) as cb:
        for _ in range(3):
            with cb.step(batch=x):
                model(x).sum().backward()
        assert not model._forward_pre_hooks  # torch's fast call path stays
        with cb.step():
            model(x).sum().backward()
        assert len(model._forward_pre_hooks) == 1  # now the shapes come from the forward
    assert not model._forward_pre_hooks


def test_a_held_loss_is_not_read_on_every_step(daemon: FakeDaemon, sock_path: Path) -> None:
    # A loss that is not a plain CPU tensor (a GPU's) is held, and read only in the batch.
    class Counting(LossReader):
        calls = 0

        def start(self, loss: torch.Tensor) -> tuple[Any, Any]:
            self.calls += 1
            return super().start(loss)

    model = nn.Linear(16, 4)
    reader = Counting()
    with GreenCallback(job="held", model=model, socket=sock_path, **FAST) as cb:
        assert wait_for(lambda: cb.connected)
        cb._book.losses = reader
        cb._book.judge_within_s = 3600.0  # the batch by count only
        _train(cb, model, 15, wrap=_held)
        assert reader.calls == 0 and len(cb._book.ended) == 15
        _train(cb, model, 1, wrap=_held)
        assert reader.calls == 16 and not cb._book.ended
    assert wait_for(lambda: len(daemon.steps) == 16)


class Batching(LossReader):
    """A reader that batches CPU tensors as it batches a GPU's (stacked, one copy for
    all of them; on the CPU the copy lands at once): ``lands`` counts the copies."""

    def __init__(self, batched: Any) -> None:
        super().__init__()
        self._batched = batched
        self.lands = 0

    def batched(self, loss: Any) -> bool:
        return bool(self._batched(loss))

    def _land(self, stacked: torch.Tensor, device: torch.device) -> Any:
        self.lands += 1
        return super()._land(stacked, device)


def test_losses_of_one_device_and_dtype_are_read_in_one_copy_each_named_when_wrong() -> None:
    reader = Batching(lambda t: type(t) is torch.Tensor)
    losses = [
        torch.tensor(1.5),
        torch.tensor(2.5, dtype=torch.float64),
        torch.tensor([3.5]),
        torch.tensor([1.0, 2.0]),
        torch.tensor(4, dtype=torch.int64),
        torch.tensor(1 + 2j),
        torch.tensor(5.5, requires_grad=True),
        torch.tensor(6.5, dtype=torch.float64),
        torch.tensor(7.5).as_subclass(Held),  # not batched: read alone
    ]
    handles = reader.start_many(losses)
    assert reader.lands == 2  # float32 (three), float64 (two); the int64 alone goes through start()
    errors = {i: str(h) for i, h in enumerate(handles) if isinstance(h, Exception)}
    assert errors == {
        3: "a loss of shape (2,): expected one number",
        5: "a loss of dtype torch.complex64: expected a real number",
    }
    values = [reader.value(h) for h in handles if not isinstance(h, Exception)]  # type: ignore[arg-type]  # (filtered)
    assert values == [1.5, 2.5, 3.5, 4.0, 5.5, 6.5, 7.5]


def test_a_batch_of_held_losses_is_read_in_one_copy_through_the_callback(daemon: FakeDaemon, sock_path: Path) -> None:
    model = nn.Linear(16, 4)
    reader = Batching(lambda t: isinstance(t, Held))
    with GreenCallback(job="stacked", model=model, socket=sock_path, **FAST) as cb:
        assert wait_for(lambda: cb.connected)
        cb._book.losses = reader
        cb._book.judge_within_s = 3600.0  # batches by count only
        losses = _train(cb, model, 32, wrap=_held)
        assert reader.lands == 2  # one copy a batch of 16
    assert wait_for(lambda: len(daemon.steps) == 32)
    got = [s.get("loss") for s in sorted(daemon.steps, key=lambda s: s["step"])]
    assert got == pytest.approx(losses)


def test_losses_alike_are_stacked_in_one_op_and_read_in_step_order() -> None:
    # A GPU job's batch: plain tensors of one number on one device, most still in the
    # autograd graph. One stack (under no_grad: no graph grows from it), one copy.
    reader = Batching(lambda t: type(t) is torch.Tensor)
    w = torch.tensor(2.0, requires_grad=True)
    losses = [w * i for i in range(16)]
    handles = reader.start_many(losses)
    assert reader.lands == 1
    assert [reader.value(h) for h in handles] == [2.0 * i for i in range(16)]  # type: ignore[arg-type]  # (no errors)
    assert all(loss.grad_fn is not None for loss in losses)  # the job's tensors untouched
    # float32 first, a float64 among them: stacking would promote, so each dtype is read apart.
    mixed = [torch.tensor(1.5), torch.tensor(2.5, dtype=torch.float64), torch.tensor(3.5)]
    assert [reader.value(h) for h in reader.start_many(mixed)] == [1.5, 2.5, 3.5]  # type: ignore[arg-type]  # (no errors)
    assert reader.lands == 2  # the float32 pair in one copy; the float64 alone, read by itself


class Gate(LossReader):
    """A reader whose copies land when the test opens the gate (a GPU behind the CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.open = False
        self.waits = 0

    def start_many(self, losses: list[torch.Tensor]) -> list[tuple[Any, Any] | Exception]:
        return [(float(loss.detach().as_subclass(torch.Tensor)), "gated") for loss in losses]

    def value(self, handle: tuple[Any, Any], wait: bool = False) -> float | None:
        if wait:
            self.waits += 1
        return float(handle[0]) if self.open or wait else None


def test_a_gpu_batch_is_booked_off_the_training_thread_once_its_copy_lands(daemon: FakeDaemon, sock_path: Path) -> None:
    model = nn.Linear(16, 4)
    reader = Gate()
    with GreenCallback(job="gated", model=model, socket=sock_path, **FAST) as cb:
        assert wait_for(lambda: cb.connected)
        cb._book.losses = reader
        cb._book.judge_within_s = 3600.0  # batches by count only
        losses = _train(cb, model, 16, wrap=_held)
        # The batch's read started and it was handed over; the sender leaves it while in flight.
        time.sleep(0.3)
        assert len(cb._book.handed) == 1 and len(daemon.steps) == 0 and not cb._book.unjudged
        reader.open = True  # the copy lands: the sender books it at its next round
        assert wait_for(lambda: len(daemon.steps) == 16)
        assert reader.waits == 0  # nobody waited for it
    got = [s.get("loss") for s in sorted(daemon.steps, key=lambda s: s["step"])]
    assert got == pytest.approx(losses)


def test_the_batch_just_ended_is_never_waited_for_on_the_training_thread(daemon: FakeDaemon, sock_path: Path) -> None:
    # Judged on the training thread (index= given): each batch's copy had just started when
    # the training thread waited for it, while more than 8 steps were in flight: a full
    # sync of the GPU every 16 steps. Only a batch behind that one is waited for now.
    model = nn.Linear(16, 4)
    reader = InFlight(lag=1000)  # never lands on its own within the run
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with GreenCallback(job="nowait", model=model, socket=sock_path, initial_precision="fp32", **FAST) as cb:
        assert wait_for(lambda: cb.connected)
        cb._book.losses = reader
        cb._book.judge_within_s = 3600.0  # batches by count only
        for i in range(40):
            with cb.step(samples=8, flops=1e6, index=i) as st:
                loss = model(torch.randn(8, 16)).pow(2).mean()
                st.loss(loss.as_subclass(Held))
                loss.backward()
                opt.step()
                opt.zero_grad()
            if i == 15:
                assert reader.waited == 0 and len(cb._book.unjudged) == 16
        # The second batch ended with the first still in flight: the oldest 8 waited for.
        assert reader.waited == 32 - cb._book.max_unjudged - 16
    assert wait_for(lambda: len(daemon.steps) == 40)
