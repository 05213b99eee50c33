"""Reading a step's loss without ever waiting for the GPU.

``float(loss)`` (or ``loss.item()``) on a CUDA tensor synchronises the stream: the
CPU waits until every queued kernel has run, and the GPU idles until the CPU queues
more. An energy tool must not add that to every step. So the loss is copied into a
pinned host buffer with ``non_blocking=True`` and a CUDA event is recorded behind the
copy; the value is read when that event has completed (``Event.query()``, which never
blocks), usually by the end of the next step. The losses of a batch of steps on one
device go together (:meth:`LossReader.start_many`): stacked there, one copy and one
event for all of them, where each alone would take a copy and an event. On the CPU the
value is read at once (``item()`` on a plain CPU tensor, which waits for nothing). Only
the daemon-side figures and the precision guard wait for the value, never the training
loop (the guard rolls back from the step after the value lands).
"""

from __future__ import annotations

from typing import Any

import torch

from greend.training.warn import log

__all__ = ["LossReader"]

# A pinned buffer holds this many losses at least (a batch of steps: greend.training.book).
ROWS = 16


class _Landing:
    """Several losses stacked on their device and copied to the host in one go: ``buf``
    (its first ``n`` values), landed once ``event`` has completed (None: at once; the
    event of GPU ``device``)."""

    __slots__ = ("buf", "n", "event", "device", "values")

    def __init__(self, buf: torch.Tensor, n: int, event: Any, device: Any = None) -> None:
        self.buf, self.n, self.event, self.device = buf, n, event, device
        self.values: list[float] | None = None


class LossReader:
    """Starts reads of loss tensors and answers them once they have landed."""

    def __init__(self) -> None:
        self._cpu = torch.empty((), dtype=torch.float64)
        self._pinned_rows: list[torch.Tensor] = []  # free pinned buffers of ROWS values or more

    def batched(self, loss: Any) -> bool:
        """Whether ``loss`` is read with the others of its device and dtype (start_many):
        a plain CUDA tensor."""
        return type(loss) is torch.Tensor and loss.is_cuda

    def start_many(self, losses: list[torch.Tensor]) -> list[tuple[Any, Any] | Exception]:
        """Begin reading several losses (a batch of steps, oldest first): a handle for
        :meth:`value` each, or the error that names why that one cannot be read. The
        :meth:`batched` ones of one device and dtype are stacked there and copied in one
        go; any other goes through :meth:`start` alone."""
        n = len(losses)
        first = losses[0] if losses else None
        if n > 1 and self.batched(first):
            # The common case, a GPU job's losses: plain tensors of one number (0-dim), one
            # dtype, one device: one stack (any other mix is grouped below; a dtype apart is
            # never promoted into another's, nor a large tensor stacked before its size is seen).
            dtype = first.dtype  # type: ignore[union-attr]  # (batched: a tensor)
            if not dtype.is_complex and all(
                type(loss) is torch.Tensor and loss.dtype is dtype and loss.dim() == 0 for loss in losses
            ):
                try:
                    with torch.no_grad():
                        stacked = torch.stack(losses)  # (devices that differ raise: grouped below)
                    landing = self._land(stacked.to(torch.float64), stacked.device)
                    return [(landing, k) for k in range(n)]
                except Exception as e:  # each group tried below, its error on its losses
                    log.debug("reading a batch of losses at once failed: %s", e)
        handles: list[tuple[Any, Any] | Exception] = []
        groups: dict[tuple[Any, Any], list[int]] = {}
        for i, loss in enumerate(losses):
            handles.append(ValueError("not read"))
            if self.batched(loss):
                groups.setdefault((loss.device, loss.dtype), []).append(i)
                continue
            try:
                handles[i] = self.start(loss)
            except Exception as e:
                handles[i] = e
        for (device, dtype), idx in groups.items():
            try:
                if dtype.is_complex:
                    raise ValueError(f"a loss of dtype {dtype}: expected a real number")
                if len(idx) == 1:
                    handles[idx[0]] = self.start(losses[idx[0]])
                    continue
                # One op for the whole batch (losses of one number each, alike): no detach
                # or reshape per loss, each a torch call on the training thread.
                if all(losses[i].dim() == 0 for i in idx):
                    with torch.no_grad():
                        stacked = torch.stack([losses[i] for i in idx])
                else:  # each looked at: one of another shape is named, never stacked
                    stacked, idx = self._each_one_number([losses[i] for i in idx], idx, handles)
                    if not idx:
                        continue
                landing = self._land(stacked.reshape(-1).to(torch.float64), device)
            except Exception as e:
                for i in idx:
                    handles[i] = e
                continue
            for k, i in enumerate(idx):
                handles[i] = (landing, k)
        return handles

    @staticmethod
    def _each_one_number(
        losses: list[torch.Tensor], idx: list[int], handles: list[tuple[Any, Any] | Exception]
    ) -> tuple[torch.Tensor, list[int]]:
        """The losses of a group that hold one number each, stacked, and their places;
        each of the others gets the error that names its shape."""
        good: list[torch.Tensor] = []
        places: list[int] = []
        for loss, i in zip(losses, idx, strict=True):
            if loss.numel() != 1:
                handles[i] = ValueError(f"a loss of shape {tuple(loss.shape)}: expected one number")
            else:
                good.append(loss.detach().reshape(()))
                places.append(i)
        return (torch.stack(good) if good else torch.empty(0)), places

    def _land(self, stacked: torch.Tensor, device: torch.device) -> _Landing:
        """One copy of ``stacked`` (float64, on ``device``) to the host, with its event."""
        n = stacked.numel()
        if device.type != "cuda":  # a device that copies synchronously: landed now
            buf = torch.empty(n, dtype=torch.float64)
            buf.copy_(stacked)
            return _Landing(buf, n, None)
        free = self._pinned_rows
        if free and free[-1].numel() >= n:
            buf = free.pop()
        else:
            buf = torch.empty(max(n, ROWS), dtype=torch.float64, pin_memory=True)
        buf[:n].copy_(stacked, non_blocking=True)  # (on the stream the loss was made on)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))  # (that GPU's, whichever is current)
        return _Landing(buf, n, event, device)

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
            return self._land(t.reshape(1).to(torch.float64), t.device), 0
        self._cpu.copy_(t)  # on the CPU (or a device that copies synchronously): done now
        return self._cpu.item(), None

    @staticmethod
    def _landed(held: _Landing, wait: bool) -> bool:
        """Whether a landing's copy has completed (``wait``: once it has). Under its GPU
        as the current device: the sender thread asks too, and a CUDA call from a thread
        whose current device is another GPU (0, a new thread's) would open a context there."""
        with torch.cuda.device(held.device):
            if held.event.query():
                return True
            if wait:
                held.event.synchronize()
            return wait

    def value(self, handle: tuple[Any, Any], wait: bool = False) -> float | None:
        """The loss, or None while the copy is still in flight (``wait``: block for it,
        only where a wait costs nothing, as at the end of training)."""
        held, event = handle
        if type(held) is _Landing:  # a copy from the GPU: one loss, or several together (start_many)
            values = held.values
            if values is None:
                if held.event is not None and not self._landed(held, wait):
                    return None
                values = held.values = held.buf[: held.n].tolist()
                if held.event is not None:
                    self._pinned_rows.append(held.buf)  # (the values are kept: free to reuse)
            return values[event]
        return float(held)  # (read at once: start)
