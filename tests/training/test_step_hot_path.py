"""The step's hot path in C (greend/training/_stepfast.c) and its pure-Python reference
(step._PyStep): the one in use, the same fields, nothing kept alive, and the callback's
tests passing on the Python one too."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from greend.testing.fake_daemon import FakeDaemon
from greend.training import step as step_module
from greend.training.callback import GreenCallback
from tests.support import REPO, wait_for

FAST = dict(flush_interval_s=0.02, heartbeat_s=0.2, close_timeout_s=2.0, connect_timeout_s=1.0)


def _built() -> bool:
    try:
        from greend.training import _stepfast  # noqa: F401
    except ImportError:
        return False
    return True


def test_the_c_hot_path_is_used_where_it_is_built() -> None:
    if os.environ.get("GREEND_PURE_PYTHON", "") not in ("", "0"):
        assert step_module.HOT_PATH == "python"
        return
    if not _built():
        pytest.skip("greend.training._stepfast is not built here (no C compiler at install)")
    from greend.training import _stepfast

    assert step_module.HOT_PATH == "c"
    assert step_module.Step.__mro__[1] is _stepfast.StepBase


def test_both_hot_paths_have_the_same_fields() -> None:
    if not _built():
        pytest.skip("greend.training._stepfast is not built here")
    from greend.training import _stepfast

    c_fields = {n for n, v in vars(_stepfast.StepBase).items() if type(v).__name__ == "member_descriptor"}
    assert c_fields == set(step_module._PyStep.__slots__)
    assert {"__enter__", "__exit__", "loss"} <= set(vars(_stepfast.StepBase))


def test_a_step_reads_as_the_python_one_does(daemon: FakeDaemon, sock_path: Path) -> None:
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


def test_odd_uses_get_python_errors_not_a_crash(daemon: FakeDaemon, sock_path: Path) -> None:
    """A deleted field, a step never constructed, a keyword loss, a non-dict FLOP cache
    with tuple keys: in a child process, so that a crash would show as one."""
    code = f"""
import collections, torch
from pathlib import Path
from greend.training.callback import GreenCallback
from greend.training.step import Step
cb = GreenCallback(job="odd", socket=Path({str(sock_path)!r}), flush_interval_s=0.02, connect_timeout_s=1.0)
for field in ("_cb", "_shape_key", "flops", "precision"):
    st = cb.step(samples=1)
    delattr(st, field)
    try:
        with st:
            pass
    except AttributeError as e:
        assert field in str(e), e
    else:
        assert field == "precision", field  # (__enter__ sets it again)
try:
    Step.__new__(Step).__enter__()
except AttributeError:
    pass
else:
    raise AssertionError("a step never constructed was entered")
with cb.step(samples=1, flops=1.0) as st:
    st.loss(loss=torch.tensor(2.0))
cb.flush()
assert st._loss == 2.0, st._loss
cb._flop_cache = collections.OrderedDict({{(8, 16): 5.0}})
with cb.step(samples=1, shape_key=(8, 16)) as st:
    pass
assert st.flops == 5.0, st.flops
cb.close()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.returncode, out.stdout, out.stderr[-2000:])


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
    assert not [o for o in gc.get_objects() if type(o) is step_module.Step]
    assert wait_for(lambda: len(daemon.steps) == 500)


def test_the_callback_tests_pass_on_the_pure_python_hot_path() -> None:
    if os.environ.get("GREEND_PURE_PYTHON", "") not in ("", "0"):
        pytest.skip("this run is the one on the pure-Python hot path")
    env = dict(os.environ, GREEND_PURE_PYTHON="1", PYTHONPATH=str(REPO))
    tests = ["tests/training/test_loss_reader.py", "tests/training/test_callback.py", __file__]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and " failed" not in out.stdout
