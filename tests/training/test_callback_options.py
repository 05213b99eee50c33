"""GreenCallback's keyword arguments: CallbackOptions holds them, and the TypedDict a type
checker sees (CallbackKwargs) names the same ones with the same types."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from greend.training.callback import GreenCallback
from greend.training.options import CallbackKwargs, CallbackOptions


def test_the_typed_keywords_are_the_options_fields() -> None:
    # Both modules postpone their annotations: each type is compared as written.
    fields = {f.name: f.type for f in dataclasses.fields(CallbackOptions)}
    typed = {
        k: v.__forward_arg__ if isinstance(v, typing.ForwardRef) else v
        for k, v in CallbackKwargs.__annotations__.items()
    }
    assert typed == fields
    assert CallbackKwargs.__total__ is False


def test_an_unknown_keyword_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="no_such_option"):
        GreenCallback(job="x", no_such_option=1)  # type: ignore[call-arg]  # the refusal is the point


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"gpus": "01"}, "gpus='01': a list of node-local GPU indices"),  # (was GPUs 0 and 1)
        ({"gpus": [1.7]}, "1.7 is not"),  # (was GPU 1)
        ({"gpus": [True]}, "True is not"),  # (was GPU 1)
        ({"gpus": 0}, "gpus=0: a list of GPU indices, gpus=[0]"),  # (was a bare TypeError)
        ({"gpus": [-1]}, "-1 is not"),
        ({"manage_precision": "no"}, "manage_precision='no': True or False"),  # (was truthy: managed)
        ({"device": "gpu"}, "device='gpu': not a torch device"),
        ({"socket": 5}, "socket=5: the daemon's socket path"),
        ({"model": "resnet"}, "model='resnet': the torch.nn.Module you train"),
    ],
)
def test_the_identity_arguments_are_checked_by_name(kwargs: dict[str, object], says: str) -> None:
    """Wrong values were coerced into something else, or failed deep inside with an error
    that named no argument."""
    with pytest.raises(ValueError) as e:
        GreenCallback(job="x", **kwargs)  # type: ignore[arg-type]  # the wrong types are the point
    assert says in str(e.value)


def test_gpu_indices_may_be_numpy_integers_and_any_sequence() -> None:
    np = pytest.importorskip("numpy")
    for gpus in ([np.int64(0)], (0, 1), range(2)):
        CallbackOptions(gpus=gpus).checked(None)  # type: ignore[arg-type]  # (numpy's int is an index)


def test_a_count_a_failed_step_left_on_is_stopped_by_the_next_callback() -> None:
    """A Hugging Face Trainer's train() that raised inside its first (counted) step gives
    its callbacks no hook: the FlopCounterMode stayed on, and every torch op after it ran
    2-3x slower, in the next Trainer too. The next callback made stops it."""
    import torch
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    def counting() -> bool:
        return any(type(m).__name__.endswith("FlopCounterMode") for m in _get_current_dispatch_mode_stack())

    first = GreenCallback(job="x", model=torch.nn.Linear(4, 4), socket="/nonexistent/greend.sock",
                          connect_timeout_s=0.01)  # fmt: skip
    step = first.step(samples=1, batch=torch.zeros(2, 4))
    step.__enter__()  # the step is counted; its training raises, and nothing ends it
    assert counting()
    second = GreenCallback(job="y", socket="/nonexistent/greend.sock", connect_timeout_s=0.01)
    assert not counting()
    first.close()
    second.close()
