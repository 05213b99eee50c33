"""The ended steps' booking on the sender thread: batches handed over whole, booked in
step order by whichever thread comes first, the guard's trend complete at a switch, the
training thread booking itself when the sender does not; and the hot path's helpers
(the step GreenCallback.step makes, the reused autocast)."""

from __future__ import annotations

import statistics
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from greend.testing.fake_daemon import FakeDaemon
from greend.training.book import MAX_HANDED
from greend.training.callback import GreenCallback
from greend.training.step import ReusedAutocast, Step
from tests.support import wait_for

FAST = dict(flush_interval_s=0.02, heartbeat_s=0.2, close_timeout_s=2.0, connect_timeout_s=1.0)


def test_a_batch_goes_to_the_sender_thread_whole_and_is_booked_there_in_order(
    daemon: FakeDaemon, sock_path: Path
) -> None:
    with GreenCallback(job="handed", socket=sock_path, flops_per_step=1.0, **FAST) as cb:
        assert wait_for(lambda: cb.connected)
        cb._book.judge_within_s = 3600.0  # batches by count only
        for i in range(48):
            with cb.step(samples=2) as st:
                # numbers and plain CPU tensors (held for the sender thread to read)
                st.loss(0.5 * i if i % 2 else torch.tensor(0.5 * i, requires_grad=True))
        assert cb.stats.recorded == 48 and not cb._book.ended  # three batches handed over
        # No flush: the sender thread books them on its own and sends them.
        assert wait_for(lambda: len(daemon.steps) == 48)
        assert not cb._book.handed
    got = sorted(daemon.steps, key=lambda s: s["step"])
    assert [s["step"] for s in got] == list(range(48))
    assert [s["loss"] for s in got] == [0.5 * i for i in range(48)]
    assert all(type(s["loss"]) is float for s in got)


@pytest.mark.parametrize("sender_books", [True, False], ids=["sender-books", "sender-idle"])
def test_the_trend_at_a_switch_holds_every_loss_handed_over(
    daemon: FakeDaemon, sock_path: Path, sender_books: bool
) -> None:
    model = nn.Linear(4, 2)
    losses = [2.0 + 0.01 * i for i in range(40)]
    with GreenCallback(
        probe_trial=False, job="trend", model=model, socket=sock_path, initial_precision="fp32", **FAST
    ) as cb:
        assert wait_for(lambda: cb.connected)
        if not sender_books:
            cb._channel.book_handed = lambda: None  # the sender never books: the training thread must
        cb._book.judge_within_s = 3600.0
        for v in losses:
            with cb.step(samples=1) as st:
                st.loss(v)
        assert cb._book.handed or sender_books  # (idle: the batches wait for the training thread)
        assert daemon.directive("bf16") == 1
        assert wait_for(lambda: cb.requested_precision == "bf16")
        with cb.step(samples=1) as st:  # its start takes the directive: the guard first books all
            assert st.precision == "bf16"
        assert not cb._book.handed
        downgrade = cb._control.guard.stack[-1]
        assert downgrade.step == 40
        assert downgrade.trend == pytest.approx(statistics.fmean(losses[-32:]), rel=1e-12)  # window 32
        assert downgrade.spread == pytest.approx(statistics.stdev(losses[-32:]), rel=1e-9)


def test_a_sender_that_never_books_leaves_the_batches_to_the_training_thread(sock_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no daemon: the one fail-open warning
        cb = GreenCallback(job="stalled", socket=sock_path, flops_per_step=1.0, max_pending=100_000, **FAST)
    cb._channel.book_handed = lambda: None
    cb._book.judge_within_s = 3600.0
    n = (MAX_HANDED + 3) * 16
    for i in range(n):
        with cb.step(samples=1) as st:
            st.loss(float(i))
    assert len(cb._book.handed) <= MAX_HANDED  # bounded: booked on the training thread beyond it
    assert len(cb._channel.queue) >= n - MAX_HANDED * 16
    cb.close()
    assert cb.stats.recorded == n


def test_an_unreadable_cpu_loss_handed_over_is_named_and_the_batch_booked(daemon: FakeDaemon, sock_path: Path) -> None:
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with GreenCallback(job="badshape", socket=sock_path, flops_per_step=1.0, **FAST) as cb:
            assert wait_for(lambda: cb.connected)
            cb._book.judge_within_s = 3600.0
            for i in range(16):
                with cb.step() as st:
                    st.loss(torch.tensor([1.0, 2.0]) if i == 3 else torch.tensor(float(i)))
            assert wait_for(lambda: len(daemon.steps) == 16)  # booked by the sender thread
    assert any("cannot read this tensor (a loss of shape (2,)" in str(x.message) for x in w)
    got = sorted(daemon.steps, key=lambda s: s["step"])
    assert [s.get("loss") for s in got] == [None if i == 3 else float(i) for i in range(16)]


def test_the_callbacks_step_sets_what_init_sets() -> None:
    """GreenCallback.step makes its Step without Step.__init__ (a frame fewer on every
    step): the same fields, the FLOPs looked up in the cache."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cb = GreenCallback(job="fields", socket="/nonexistent/greend.sock", connect_timeout_s=0.01)
    try:
        book = cb._book
        book.flop_cache["k"] = 7.0
        made, init = cb.step(index=3, samples=4, tokens=5, shape_key="k"), Step(book, 3, 4, 5, "k", 7.0)
        slots = [s for s in Step.__slots__ if s != "__dict__"]
        assert [getattr(made, s) for s in slots] == [getattr(init, s) for s in slots]
        assert made.flops == 7.0  # looked up in the cache
        assert cb.step(shape_key=["unhashable"]).flops is None  # planned at __enter__
        book.flop_cache[torch.Size([2, 3])] = 11.0
        assert cb.step(batch=torch.zeros(2, 3)).flops == 11.0  # a tensor batch: its shape is the key
        assert cb.step(batch=torch.zeros(2, 3), flops=5.0).flops == 5.0  # flops= wins
    finally:
        cb.close()


def test_the_reused_autocast_is_one_a_level_and_nests() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cb = GreenCallback(job="ac", socket="/nonexistent/greend.sock", connect_timeout_s=0.01,
                           initial_precision="bf16", flops_per_step=1.0)  # fmt: skip
    try:
        with cb.step() as a:
            ctx = a.autocast()
            assert isinstance(ctx, ReusedAutocast)
            with ctx:
                assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
                with a.autocast():  # the same object, entered again inside itself
                    with torch.autocast("cpu", enabled=False):
                        with a.autocast():
                            assert torch.is_autocast_enabled("cpu")
                        assert not torch.is_autocast_enabled("cpu")
                    assert torch.is_autocast_enabled("cpu")
                assert torch.is_autocast_enabled("cpu")
            assert not torch.is_autocast_enabled("cpu")
        with cb.step() as b:
            assert b.autocast() is ctx  # made once for the level
    finally:
        cb.close()
    assert not torch.is_autocast_enabled("cpu")


def test_a_switch_waits_for_the_batch_the_sender_is_booking() -> None:
    """The sender has taken the last handed batch off the queue and is still booking it
    when a directive arrives at the next step's start: the switch waits for that batch, so
    the old level's trend holds all 32 losses, the new level's holds none of them, and
    the records stay in step order."""
    import threading
    import time

    warnings.simplefilter("ignore")
    cb = GreenCallback(
        job="race", socket="/nonexistent/g.sock", connect_timeout_s=0.01, model=nn.Linear(4, 2),
        initial_precision="fp32",
    )  # fmt: skip
    try:
        book = cb._book
        cb._channel.book_handed = lambda: None  # the real sender thread stays out: the test plays it
        book.judge_within_s = 3600.0
        losses = [2.0 + 0.01 * i for i in range(32)]
        for v in losses:
            with cb.step(samples=1) as st:
                st.loss(v)
        assert len(book.handed) == 2
        real_book, started = book._book, threading.Event()

        def slow_book(steps: list[Step], first: int, level: str) -> int:
            if first == 16:
                started.set()
                time.sleep(0.3)  # mid-way through the last batch, still at the queue's head
            return real_book(steps, first, level)

        book._book = slow_book  # type: ignore[method-assign]  # the slow sender, for this test
        sender = threading.Thread(target=book.book_handed)
        sender.start()
        assert started.wait(5)
        cb._control.support["bf16"] = None
        cb._channel.requested, book.boundary = "bf16", True  # a directive at the next step
        with cb.step(samples=1):
            pass
        sender.join(5)
        came_from = cb._control.guard.stack[-1]
        assert cb._control.level == "bf16"
        assert came_from.trend == pytest.approx(statistics.fmean(losses))
        assert len(cb._control.guard.losses) == 0  # none of fp32's losses in bf16's trend
        assert [r[0] for r in cb._channel.queue] == list(range(33))
    finally:
        cb.close()


def test_backward_and_optimizer_step_ask_the_callback_only_where_it_matters() -> None:
    """step.backward/optimizer_step note once that the loop scales its losses, then ask
    for a GradScaler only at fp16 and check the gradients only while the guard is armed:
    two calls fewer on every other step."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        cb = GreenCallback(job="scaling", model=model, socket="/nonexistent/greend.sock", connect_timeout_s=0.01)
    try:
        book = cb._book
        calls: list[str] = []
        scaler, watched = book.loss_scaler, book.gradients_watched
        # Counting wrappers in place of the two methods (the step calls them through its host).
        book.loss_scaler = lambda level: calls.append(f"scaler {level}") or scaler(level)  # type: ignore[method-assign]  # counted
        book.gradients_watched = lambda: calls.append("watched") or watched()  # type: ignore[method-assign]  # counted
        x = torch.randn(8, 4)
        for _ in range(5):
            with cb.step(samples=8, batch=x) as st:
                loss = model(x).pow(2).mean()
                st.backward(loss)
                assert st.optimizer_step(opt)
                opt.zero_grad()
        assert calls == ["scaler fp32"]  # the first step's backward only (it noted the scaling)
        assert cb._control.scaling_seen  # noted: fp16 may run
        # Armed (as after a downgrade): the gradients checked on every step, the spike
        # window over or not (a NaN update would spoil the weights for good).
        book.guard.stack.append(SimpleNamespace(step=book.next_index + len(book.ended) - 10_000))
        try:
            for _ in range(4):
                with cb.step(samples=8, batch=x) as st:
                    st.backward(model(x).pow(2).mean())
                    st.optimizer_step(opt)
                assert watched()
        finally:
            book.guard.stack.clear()
        assert calls[1:] == ["watched"] * 4
    finally:
        cb.close()
