"""Reading a step's loss without ever waiting for the GPU.

``float(loss)`` (or ``loss.item()``) on a CUDA tensor synchronises the stream: the
CPU waits until every queued kernel has run, and the GPU idles until the CPU queues
more. An energy tool must not add that to every step. So the loss is copied into a
pinned host buffer with ``non_blocking=True`` and a CUDA event is recorded behind the
copy; the value is read when that event has completed (``Event.query()``, which never
blocks), usually by the end of the next step. On the CPU the value is read at once
(``item()`` on a plain CPU tensor, which waits for nothing). Only the daemon-side
figures and the precision guard wait for the value, never the training loop (the guard
rolls back from the step after the value lands).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["LossReader"]


class LossReader:
    """Starts reads of loss tensors and answers them once they have landed."""

    def __init__(self) -> None:
        self._cpu = torch.empty((), dtype=torch.float64)
        self._pinned: list[torch.Tensor] = []  # free pinned buffers, reused

    def start(self, loss: torch.Tensor) -> tuple[Any, Any]:
        """Begin reading ``loss`` (one element); returns a handle for :meth:`value`."""
        if type(loss) is torch.Tensor and loss.is_cpu:
            # A plain CPU tensor's value is in host memory: reading it waits for nothing,
            # and item() is 20x cheaper than the copy below (0.4 against 9 us measured in
            # a training loop). Subclasses (a DTensor, whose item() may gather across
            # ranks) take the copy.
            try:
                return float(loss.item()), None
            except RuntimeError as e:
                raise ValueError(f"a loss of shape {tuple(loss.shape)}: expected one number") from e
            except TypeError as e:  # a complex value
                raise ValueError(f"a loss of dtype {loss.dtype}: expected a real number") from e
        t = loss.detach()
        if t.dim() != 0:
            if t.numel() != 1:
                raise ValueError(f"a loss of shape {tuple(t.shape)}: expected one number")
            t = t.reshape(())
        if t.device.type == "cuda":
            buf = self._pinned.pop() if self._pinned else torch.empty((), dtype=torch.float64, pin_memory=True)
            buf.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            return buf, event
        self._cpu.copy_(t)  # on the CPU (or a device that copies synchronously): done now
        return self._cpu.item(), None

    def value(self, handle: tuple[Any, Any], wait: bool = False) -> float | None:
        """The loss, or None while the copy is still in flight (``wait``: block for it,
        only where a wait costs nothing, as at the end of training)."""
        held, event = handle
        if event is None:
            return float(held)
        if not event.query():
            if not wait:
                return None
            event.synchronize()
        value = float(held.item())
        self._pinned.append(held)
        return value
