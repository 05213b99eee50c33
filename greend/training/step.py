"""One training step: :class:`Step`, the context manager :meth:`GreenCallback.step` returns.

The hot path is :meth:`GreenCallback.step` (which makes the step without a call of
its own, the batch's shape looked up in the FLOP cache) and
``__enter__``/``__exit__``: ``time.monotonic()`` twice, and the ended step put on a
list; :meth:`Step.loss` holds the loss (a CPU tensor's value is taken at once, with
``item()``, only while its batch is judged on the training thread). Every 16 steps
(or 50 ms) the batch goes whole to the sender thread, which books it, or is judged
here in one pass (:class:`greend.training.book.StepBook`). No locks, no syscalls, no
stream sync. :meth:`Step.autocast` hands out one :class:`ReusedAutocast` per level.
A step sees its callback through :class:`StepHost` only: the few fields it reads on
every step and the functions of the rare paths. A step
whose FLOPs are being counted runs slower (FlopCounterMode costs 10-370% of a step);
its timing is reported as measured.

Inside the step: :meth:`Step.autocast` for the precision it runs at,
:meth:`Step.loss` to report the loss, and (recommended, needed for fp16)
:meth:`Step.backward` and :meth:`Step.optimizer_step`, which use loss scaling
when the level needs it and let the accuracy guard see the loss and the
gradients::

    with cb.step(batch=x) as step:
        with step.autocast():
            loss = model(x).loss
        step.backward(loss)          # scaler.scale(loss).backward() under fp16; reports the loss
        step.optimizer_step(opt)     # scaler.step(opt) + update() under fp16
        opt.zero_grad()

A step whose loss or gradient is non-finite, or whose loss spikes, while the run
is below a level it came down from, makes the callback roll back
(:mod:`greend.training.mixed_precision`, the accuracy guard): from the next step
during the spike window after a downgrade (each step is read at its end then), at
the end of the step's batch later.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from contextlib import AbstractContextManager
from typing import Any, Literal, Protocol

import torch

from greend.training.mixed_precision import grads_finite, optimizer_params

__all__ = ["ReusedAutocast", "Step", "StepHost"]

_monotonic = time.monotonic
_Tensor = torch.Tensor


class StepHost(Protocol):
    """The callback as its steps see it (:class:`greend.training.book.StepBook`).

    The fields are read on every step and written by the training thread only;
    ``boundary`` is set by whoever has something for the next step's start (the
    sender thread, when a directive comes)."""

    precision: str  # the level the next step runs at
    boundary: bool  # call at_boundary() at the next step's start
    flop_cache: dict[Hashable, Any]  # shape key -> FLOPs per step
    ended: list[Step]  # ended steps whose loss has not been read yet
    held: bool  # a step held a loss tensor (set by Step.loss): batches are read here
    hold_cpu: bool  # the batch goes to the sender thread: a CPU loss is held, read there
    judge_every: int  # read the ended steps when this many have gathered ...
    judge_by: float  # ... or when a step ends after this (monotonic seconds)
    judge_within_s: float
    shared_autocast: dict[str, AbstractContextManager[Any]]  # level -> its one null context
    scaling_noted: bool  # loss_scaler() or gradients_watched() was called: the loop scales its losses
    guard: Any  # the accuracy guard (its ``stack``: the downgrades in force; armed while not empty)

    def at_boundary(self, step: Step) -> None:
        """A directive or an agreement between ranks, applied before a step starts."""

    def plan_flops(self, step: Step) -> None:
        """Find the FLOPs of a step whose shape is not in the cache (count it, or guess)."""

    def end_flops(self, step: Step, ok: bool) -> None:
        """The FLOPs of a step that counted them or guessed its shape, at its end."""

    def read_ended(self) -> None:
        """Read the ended steps' losses, judge and record them (waits only for the
        oldest held loss while more than a few are still in flight)."""

    def autocast_for(self, level: str) -> AbstractContextManager[Any]:
        """The autocast context of a level (a null context where there is nothing to do)."""

    def warn_once(self, key: str, message: str) -> None:
        """Log a problem once per key (the first one also as a GreendWarning)."""

    def loss_scaler(self, level: str) -> Any:
        """The GradScaler a step at ``level`` scales its loss with, or None; notes that the
        loop scales its losses (fp16 may then run) and sets ``scaling_noted``."""

    def gradients_watched(self) -> bool:
        """Whether optimizer_step checks the gradients (the guard is armed); notes the
        loop's use of it as loss_scaler does."""


class Step:
    """One training step: a context manager made by :meth:`GreenCallback.step`.

    Inside it: :meth:`autocast` for the precision this step runs at, :meth:`loss`
    to report the loss, and (recommended, needed for fp16) :meth:`backward` and
    :meth:`optimizer_step`, which use loss scaling when the level needs it and
    let the accuracy guard see the gradients. Attributes after the step:
    ``t0_s``, ``t1_s`` (monotonic seconds), ``flops``, ``precision``, ``index``.

    :meth:`loss`: report this step's loss (a tensor or a number). A plain CPU tensor's
    value is taken at once (``item()`` waits for nothing there); any other tensor is
    only held, never read there: the callback reads the losses of several steps at
    once, later, in one pass (copied asynchronously on a GPU, and judged once the copy
    has landed; :mod:`greend.training.loss_reader`). greend never synchronises the
    stream for it. The losses are judged in batches either way. While the accuracy
    guard watches for spikes (the first ``spike_steps`` after a downgrade) each step's
    loss is judged at the step's end, so a spike rolls back from the next step or the
    one after. A held tensor is held until then, not its
    activations (``backward`` frees those; a loss that never goes through ``backward``
    keeps its graph until it is read: report ``loss.detach()`` there). Do not change
    the tensor in place after reporting it.
    """

    # Set on every step; the rest are class defaults until a step sets its own.
    # Every field a step sets on its common path is a slot: a step then allocates no
    # __dict__, one object fewer for the cyclic collector to count and to walk.
    __slots__ = ("_host", "index", "samples", "tokens", "_shape_key", "flops", "t0_s", "t1_s", "precision",
                 "_raw", "__dict__")  # fmt: skip

    # What fewer steps set: read back from here until they do.
    _nonfinite = False
    _nonfinite_cause = "loss"  # what was non-finite: "loss" or "gradient"
    _counting = False  # FlopCounterMode is counting this step
    _scaled = False  # backward() went through the GradScaler
    # The shape key is a guess (the last step's shape, see StepBook.plan_flops): the
    # model's forward pre-hook records the real one in _forward_signature.
    _shape_guessed = False
    _forward_signature: Hashable | None = None
    _spike_reason: str | None = None  # why the reported loss is a spike (Guard.spike), if it is

    def __init__(
        self,
        host: StepHost,
        index: int | None,
        samples: int | None,
        tokens: int | None,
        shape_key: Hashable | None,
        flops: float | None,
    ) -> None:
        self._host = host
        self.index = index
        self.samples = samples
        self.tokens = tokens
        self._shape_key = shape_key
        self.flops = flops
        self.t0_s = 0.0
        self.t1_s = 0.0
        self.precision = "fp32"
        # The reported loss: a float, a tensor not read yet, or its read in flight (the
        # LossReader's handle, a tuple); None once judged.
        self._raw: Any = None

    def __enter__(self) -> Step:
        host = self._host
        if host.boundary:
            host.at_boundary(self)
        self.precision = host.precision
        if self.flops is None:  # (GreenCallback.step looked the shape up in the cache already)
            host.plan_flops(self)
        self.t0_s = _monotonic()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        t1 = _monotonic()
        host = self._host
        if self._shape_guessed or self._counting:
            host.end_flops(self, exc_type is None)
        if exc_type is not None:
            return False  # the user's error: not ours to swallow, and no record
        self.t1_s = t1
        ended = host.ended
        if not ended:
            host.judge_by = t1 + host.judge_within_s
        ended.append(self)
        if len(ended) >= host.judge_every or t1 >= host.judge_by:
            host.read_ended()
        return False

    def loss(self, loss: Any) -> None:
        """Report this step's loss: a number, or a tensor (held until its batched read;
        on the CPU, while the guard watches, read at once). Report the GPU tensor itself,
        not a ``non_blocking`` copy of it to the CPU: that copy's value is not there yet
        when it is read."""
        if type(loss) is _Tensor:
            if loss.is_cpu:
                if self._host.hold_cpu:
                    # Its batch goes to the sender thread, which reads it there (item(): a
                    # CPU tensor's value waits for nothing) and frees it and its graph:
                    # neither on the training thread (bench/bench_callback.py).
                    self._raw = loss
                    return
                # The batch is judged on the training thread: item() at once costs less
                # than holding the tensor, freeing it there later and the cyclic
                # collector's walks of it meanwhile.
                try:
                    self._raw = float(loss.item())  # (an int or bool tensor's too)
                    return
                except Exception:
                    pass  # not one real number: the batched read names the problem
            self._raw = loss
            self._host.held = True  # its batch is read on the training thread
            return
        if isinstance(loss, torch.Tensor):
            self._raw = loss
            self._host.held = True
            return
        try:
            self._raw = float(loss)
        except Exception:
            self._host.warn_once("loss", f"step.loss() got {type(loss).__name__}, not a number: ignored")

    def autocast(self) -> AbstractContextManager[Any]:
        """The context for this step's precision (a null context for fp32/tf32)."""
        ctx = self._host.shared_autocast.get(self.precision)
        return ctx if ctx is not None else self._host.autocast_for(self.precision)

    def mark_nonfinite(self, what: str = "gradient") -> None:
        """Flag this step as non-finite (e.g. a gradient was inf/NaN) without a loss value."""
        if not self._nonfinite:
            self._nonfinite_cause = what  # the first cause is the one reported
        self._nonfinite = True

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, through the GradScaler when this step runs fp16.

        Reports the loss too (as :meth:`loss`) if the step has not reported one.
        """
        if self._raw is None and not self._nonfinite:
            self.loss(loss)
        host = self._host
        # Only fp16 scales; the first call notes that the loop scales its losses.
        if self.precision == "fp16" or not host.scaling_noted:
            scaler = host.loss_scaler(self.precision)
            if scaler is not None:
                scaler.scale(loss).backward(**kwargs)
                self._scaled = True
                return
        loss.backward(**kwargs)

    def optimizer_step(self, optimizer: Any) -> bool:
        """``optimizer.step()``, through the GradScaler when :meth:`backward` scaled the loss.

        While the accuracy guard is armed (the run is below a level it came down
        from) the gradients are checked first (one fused norm, one sync): a
        non-finite gradient skips the update, so the master weights stay clean,
        and rolls the precision back after this step. Returns False when the
        update was skipped here (a scaler may also skip one on its own, as it does
        when it finds inf gradients and lowers its scale).
        """
        host = self._host
        if self._scaled:
            scaler = host.loss_scaler(self.precision)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
                return True
        # Checked only while the guard is armed (the first call notes the loop's use of it).
        if (host.guard.stack or not host.scaling_noted) and host.gradients_watched():
            try:
                finite = grads_finite(optimizer_params(optimizer))
            except Exception as e:
                host.warn_once("gradcheck", f"cannot check the gradients for inf/NaN: {e}")
                finite = True
            if not finite:
                self.mark_nonfinite("gradient")
                return False
        optimizer.step()
        return True


class ReusedAutocast(torch.autocast):
    """A ``torch.autocast`` made once per level and entered by step after step (making one
    costs about as much as entering it), nested too: the state an outer entry restores
    is kept aside while an inner one runs."""

    _depth = 0
    _outer: list[tuple[Any, Any, Any]]  # the outer entries' state to restore, innermost last

    def __enter__(self) -> ReusedAutocast:
        depth = self._depth
        if depth:
            self._outer.append((self.prev, self.prev_fastdtype, self.prev_cache_enabled))
        self._depth = depth + 1
        super().__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        super().__exit__(exc_type, exc, tb)
        depth = self._depth = self._depth - 1
        if depth:
            self.prev, self.prev_fastdtype, self.prev_cache_enabled = self._outer.pop()

    @classmethod
    def like(cls, ctx: torch.autocast) -> ReusedAutocast:
        """One entered again and again with ``ctx``'s settings."""
        reused = cls(ctx.device, dtype=ctx.fast_dtype, enabled=ctx._enabled, cache_enabled=ctx._cache_enabled)
        reused._outer = []
        return reused
