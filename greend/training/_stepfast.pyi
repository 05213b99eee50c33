"""The per-step hot path of :class:`greend.training.step.Step` in C (``_stepfast.c``)."""

from collections.abc import Callable
from typing import Any

class StepBase:
    """Construction, ``__enter__``, ``loss`` and ``__exit__`` of a step (see step._PyStep)."""

    def __init__(self, cb: Any, index: Any, samples: Any, tokens: Any, shape_key: Any, flops: Any) -> None: ...

def new_step(cls: type[Any], cb: Any, index: Any, samples: Any, tokens: Any, shape_key: Any, flops: Any) -> Any:
    """``cls(cb, index, samples, tokens, shape_key, flops)`` without the generic type call."""

def set_hooks(clock: Callable[[], float], tensor_type: type[Any]) -> None:
    """The clock steps read (``time.monotonic``) and the tensor type ``loss()`` holds."""
