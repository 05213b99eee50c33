"""``samples=`` counts the step's samples: without it, the batch's rows (the first
dimension of ``batch`` or of its first tensor); ``len(x)`` given counts the same, and
``len()`` of the tuple itself (2) is caught with one warning."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from greend.errors import GreendWarning
from greend.testing.fake_daemon import FakeDaemon
from greend.training.callback import GreenCallback
from tests.support import wait_for
from tests.training.test_callback import FAST


def _loop(cb: GreenCallback, model: nn.Module, samples_of: str, steps: int = 3) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = [(torch.randn(16, 4), torch.randn(16, 1)) for _ in range(steps)]
    for batch in loader:
        x, y = batch
        n = len(batch) if samples_of == "tuple" else len(x)
        with cb.step(samples=n, batch=batch if samples_of == "tuple" else x) as step:
            with step.autocast():
                loss = nn.functional.mse_loss(model(x), y)
            step.loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()


def test_len_of_the_batch_tuple_is_warned_once(sock_path: Path, daemon: FakeDaemon) -> None:
    model = nn.Linear(4, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with GreenCallback(job="tuple-len", model=model, socket=sock_path, **FAST) as cb:
            _loop(cb, model, "tuple")
    ours = [w for w in caught if issubclass(w.category, GreendWarning) and "samples=2" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert "first part holds 16 rows: give samples=len(inputs)" in str(ours[0].message)


def test_the_readme_loop_counts_its_samples_without_a_warning(sock_path: Path, daemon: FakeDaemon) -> None:
    model = nn.Linear(4, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with GreenCallback(job="readme", model=model, socket=sock_path, **FAST) as cb:
            _loop(cb, model, "inputs")
    assert not [w for w in caught if "samples=" in str(w.message)]
    assert wait_for(lambda: len(daemon.ends) == 1)
    assert [s["samples"] for s in daemon.steps] == [16, 16, 16]


@pytest.mark.parametrize("batch", [(torch.zeros(2, 3), torch.zeros(2)), [[1, 2], [3, 4]]])
def test_a_batch_of_as_many_rows_as_parts_is_not_warned(sock_path: Path, batch: object) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cb = GreenCallback(job="small", socket=sock_path, **FAST)
        with cb.step(samples=2, batch=batch):
            pass
        cb.close()
    assert not [w for w in caught if "samples=2" in str(w.message)]


@pytest.mark.parametrize("samples", ["32", torch.Size([32]), torch.tensor([32, 32]), [32], 2.5])
def test_a_samples_value_that_is_no_count_never_raises_into_the_loop(
    sock_path: Path, daemon: FakeDaemon, samples: object
) -> None:
    """``cb.step(samples=...)`` compared any value with 4 (the tuple check): a string, a
    shape, a tensor or a list raised into the training loop. The step runs, is reported,
    and its samples are a whole count or none (a number in a string is taken, a list is not)."""
    model = nn.Linear(4, 1)
    x = torch.randn(16, 4)
    with GreenCallback(job="odd-samples", model=model, socket=sock_path, **FAST) as cb:
        with cb.step(samples=samples, batch=(x, x)) as step:  # type: ignore[arg-type]  # the mistake under test
            step.loss(model(x).sum())
    assert wait_for(lambda: len(daemon.ends) == 1)
    assert daemon.received() == 1
    (sent,) = [s.get("samples") for s in [*daemon.steps, *daemon.rows]]
    assert sent in (None, 0) or (type(sent) is int and str(sent) in str(samples)), sent


@pytest.mark.parametrize(
    ("own", "says"), [("none", True), ("initial", False), ("fp32", False), ("autocast", False), ("weights", False)]
)
def test_a_job_taken_for_fp32_says_so_at_the_default_log_level(
    sock_path: Path, daemon: FakeDaemon, caplog: pytest.LogCaptureFixture, own: str, says: bool
) -> None:
    """A bf16 user who swaps their torch.autocast for step.autocast() (the README's loop)
    without initial_precision= looks like an fp32 job: it trained at fp32 with an INFO
    line only. A WARNING says how to keep it at bf16; a job whose level is known (said,
    its own autocast seen, bf16 weights) gets none."""
    model = nn.Linear(4, 1)
    if own == "weights":
        model = model.to(torch.bfloat16)
    kw = {"initial_precision": "bf16"} if own == "initial" else {"initial_precision": "fp32"} if own == "fp32" else {}
    x = torch.randn(16, 4, dtype=next(model.parameters()).dtype)
    with caplog.at_level("WARNING", logger="greend"):
        with GreenCallback(job="own-level", model=model, socket=sock_path, **kw, **FAST) as cb:  # type: ignore[arg-type]
            for _ in range(3):
                with cb.step(samples=16, batch=x) as step:
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=own == "autocast"), step.autocast():
                        loss = model(x).float().pow(2).mean()
                    step.loss(loss)
            level = cb.precision
    said = [r.getMessage() for r in caplog.records if "initial_precision='bf16'" in r.getMessage()]
    assert len(said) == int(says), said
    assert level == ("fp32" if own in ("none", "fp32") else "bf16")


def test_len_of_the_batch_tuple_as_a_numpy_integer_is_warned_too(sock_path: Path, daemon: FakeDaemon) -> None:
    """``samples=np.int64(2)`` (a count from a numpy shape) with an ``(x, y)`` batch of 16
    rows is the same mistake as ``len(batch)``: one warning."""
    np = pytest.importorskip("numpy")
    model = nn.Linear(4, 1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with GreenCallback(job="np-tuple", model=model, socket=sock_path, **FAST) as cb:
            with cb.step(samples=np.int64(2), batch=(x, y)) as step:  # type: ignore[arg-type]  # the case under test
                step.loss(nn.functional.mse_loss(model(x), y))
    ours = [w for w in caught if issubclass(w.category, GreendWarning) and "samples=2" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]


@pytest.mark.parametrize(
    ("batch", "rows"),
    [
        (torch.zeros(12, 4), 12),  # a tensor: its first dimension
        ((torch.zeros(9, 4), torch.zeros(9, 1)), 9),  # (inputs, targets): the inputs' rows
        ([torch.zeros(5, 4), torch.zeros(5)], 5),
        ({"input_ids": torch.zeros(3, 8, dtype=torch.long), "mask": torch.zeros(3, 8)}, 3),  # its first field
        (torch.tensor(1.0), None),  # no dimension: no rows
        ("text", None),  # no tensor
    ],
)
def test_samples_are_the_batch_rows_when_not_given(
    sock_path: Path, daemon: FakeDaemon, batch: object, rows: int | None
) -> None:
    """``cb.step(batch=x)`` reports the batch's rows as its samples (no ``len(x)`` on the
    training thread: ``Tensor.__len__`` is Python code); where a batch has no rows, none."""
    with GreenCallback(job="rows", socket=sock_path, flops_per_step=1e9, **FAST) as cb:
        with cb.step(batch=batch):
            pass
        with cb.step(batch=batch, samples=7):  # given: it wins
            pass
    assert wait_for(lambda: len(daemon.ends) == 1)
    assert [s.get("samples") for s in [*daemon.steps, *daemon.rows]] == [rows, 7]


def test_the_rows_and_the_flops_key_come_from_one_shape_read(sock_path: Path, daemon: FakeDaemon) -> None:
    """A tensor batch without samples=: the rows are its shape's first dimension and its
    FLOPs are cached under that shape (a second shape counted apart); a user's shape_key=
    still wins for the FLOPs, the rows still come from the batch."""
    model = nn.Linear(4, 1)
    with GreenCallback(job="rows-flops", model=model, socket=sock_path, **FAST) as cb:
        for n in (8, 8, 4):
            x = torch.randn(n, 4)
            with cb.step(batch=x) as step:
                step.loss(model(x).sum())
        with cb.step(batch=torch.randn(6, 4), shape_key="mine") as step:
            step.loss(model(torch.randn(6, 4)).sum())
        cache = dict(cb._book.flop_cache)
    assert wait_for(lambda: len(daemon.ends) == 1)
    assert [s.get("samples") for s in [*daemon.steps, *daemon.rows]] == [8, 8, 4, 6]
    assert set(cache) == {torch.Size([8, 4]), torch.Size([4, 4]), "mine"}
    assert cache[torch.Size([8, 4])] == 2 * cache[torch.Size([4, 4])] > 0
