"""One training step: :class:`Step`, the context manager :meth:`GreenCallback.step` returns.

The hot path is ``__enter__``/``__exit__``: it reads ``time.monotonic()`` twice,
looks the batch's shape up in the FLOP cache, and puts the ended step on the
callback's list; :meth:`Step.loss` only holds the tensor. Every 16 steps (or 50 ms)
the callback reads the losses and records the steps in one pass
(``GreenCallback._drain``). No locks, no syscalls, no stream sync. The hot path runs
in C (``_stepfast.c``, built by the install) where it is built, else in the
pure-Python class :class:`_PyStep` it mirrors; ``HOT_PATH`` says which
(``bench/bench_callback.py`` measures both). A step whose FLOPs are being counted
runs slower (FlopCounterMode costs 10-370% of a step); its timing is reported as
measured.

Inside the step: :meth:`Step.autocast` for the precision it runs at,
:meth:`Step.loss` to report the loss, and (recommended, needed for fp16)
:meth:`Step.backward` and :meth:`Step.optimizer_step`, which use loss scaling
when the level needs it and let the accuracy guard see the loss and the
gradients::

    with cb.step(samples=n) as step:
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

import math
import os
import time
from collections.abc import Hashable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Literal

import torch

from greend.training.mixed_precision import grads_finite, optimizer_params

if TYPE_CHECKING:
    from greend.training.callback import GreenCallback

__all__ = ["HOT_PATH", "Step"]

_monotonic = time.monotonic
_Tensor = torch.Tensor


class _PyStep:
    """The per-step hot path in Python: construction, ``__enter__``, :meth:`loss` and
    ``__exit__``. ``greend/training/_stepfast.c`` does the same in C (``StepBase``),
    about half the cost; this class is its reference, and :class:`Step`'s base where
    that module is not built (``GREEND_PURE_PYTHON=1`` chooses it too)."""

    __slots__ = (
        "_cb",
        "index",
        "samples",
        "tokens",
        "flops",
        "_shape_key",
        "t0_s",
        "t1_s",
        "_loss",
        "_nonfinite",
        "_nonfinite_cause",
        "_counting",
        "_scaled",
        "precision",
        "_shape_guessed",
        "_forward_signature",
        "_spike_reason",
        "_pending",
        "_raw",
    )

    def __init__(
        self,
        cb: GreenCallback,
        index: int | None,
        samples: int | None,
        tokens: int | None,
        shape_key: Hashable | None,
        flops: float | None,
    ) -> None:
        self._cb = cb
        self.index = index
        self.samples = samples
        self.tokens = tokens
        self._shape_key = shape_key
        self.flops = flops
        self.t0_s = 0.0
        self.t1_s = 0.0
        self._loss: float | None = None
        self._nonfinite = False
        self._nonfinite_cause = "loss"  # what was non-finite: "loss" or "gradient"
        self._counting = False  # FlopCounterMode is counting this step
        self._scaled = False  # backward() went through the GradScaler
        self.precision = "fp32"
        # The shape key is a guess (the last step's shape, see GreenCallback._plan_flops):
        # the model's forward pre-hook records the real one in _forward_signature.
        self._shape_guessed = False
        self._forward_signature: Hashable | None = None
        self._spike_reason: str | None = None  # why the reported loss is a spike (Guard.spike), if it is
        self._pending: Any = None  # a loss read still in flight (LossReader handle)
        self._raw: Any = None  # the reported loss, not read yet (a tensor, or a float)

    # (self is always a Step here: this class is only ever Step's base.)
    def __enter__(self) -> Step:
        self_step: Step = self  # type: ignore[assignment]
        cb = self._cb
        requested = cb._requested  # (written by the sender thread: read once)
        if requested is not cb._seen_request:
            cb._take_request(requested)
        if cb._agreeing:
            cb._enter_agreeing()
        self.precision = cb._precision
        if self.flops is None:
            # The common case inline (this runs every step): a shape counted already.
            key = self._shape_key
            try:
                flops = cb._flop_cache.get(key) if key is not None else None
            except TypeError:  # an unhashable shape_key=: _plan_flops makes it one
                flops = None
            if flops is None:
                cb._plan_flops(self_step)
            else:
                self.flops = flops
        self.t0_s = _monotonic()
        return self_step

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        t1 = _monotonic()
        if self._shape_guessed or self._counting:
            self._end_flops(exc_type is None)  # type: ignore[attr-defined]
        if exc_type is not None:
            return False  # the user's error: not ours to swallow, and no record
        self.t1_s = t1
        # Read, judged and recorded with the next batch of ended steps (GreenCallback._drain).
        cb = self._cb
        ended = cb._ended
        if not ended:
            cb._judge_by = t1 + cb._judge_within_s
        ended.append(self)  # type: ignore[arg-type]
        if len(ended) >= cb._judge_every or t1 >= cb._judge_by:
            cb._drain(keep=cb._max_unjudged)
        return False

    def loss(self, loss: Any) -> None:
        if type(loss) is _Tensor or isinstance(loss, torch.Tensor):
            self._raw = loss
            return
        self._loss_other(loss)  # type: ignore[attr-defined]


try:
    if os.environ.get("GREEND_PURE_PYTHON", "") not in ("", "0"):
        raise ImportError("GREEND_PURE_PYTHON is set")
    from greend.training import _stepfast

    _stepfast.set_hooks(_monotonic, _Tensor)
    _StepBase: type = _stepfast.StepBase
    _new_step: Any = _stepfast.new_step
except ImportError:  # not built (no compiler where greend was installed), or not wanted
    _StepBase = _PyStep
    _new_step = None
#: Which implementation runs the per-step hot path: "c" or "python".
HOT_PATH = "python" if _StepBase is _PyStep else "c"


if TYPE_CHECKING:
    _Base = _PyStep  # (what the type checker reads: the C class has the same fields)
else:
    _Base = _StepBase


class Step(_Base):
    """One training step: a context manager made by :meth:`GreenCallback.step`.

    Inside it: :meth:`autocast` for the precision this step runs at, :meth:`loss`
    to report the loss, and (recommended, needed for fp16) :meth:`backward` and
    :meth:`optimizer_step`, which use loss scaling when the level needs it and
    let the accuracy guard see the gradients. Attributes after the step:
    ``t0_s``, ``t1_s`` (monotonic seconds), ``flops``, ``precision``, ``index``.

    :meth:`loss`: report this step's loss (a tensor or a number). A tensor is only
    held there, never read: the callback reads the losses of several steps at once,
    later, in one pass (copied asynchronously on a GPU, and judged once the copy has
    landed; :mod:`greend.training.loss_reader`). greend never synchronises the stream
    for it. While the accuracy guard watches for spikes (the first ``spike_steps``
    after a downgrade) each step's loss is read at the step's end, so a spike rolls
    back from the next step or the one after. The tensor is held until then, not its
    activations (``backward`` frees those; a loss that never goes through ``backward``
    keeps its graph until it is read: report ``loss.detach()`` there). Do not change
    the tensor in place after reporting it.
    """

    __slots__ = ()

    def _end_flops(self, ok: bool) -> None:
        """The step's FLOPs, where the step had to find them out: from the shape the
        model's forward saw, or from the count it made."""
        cb = self._cb
        if self._shape_guessed:
            cb._current = None
            if self._forward_signature is not None:
                # The model's inputs say which shape this step really had.
                if self._forward_signature != self._shape_key and not self._counting:
                    cached = cb._flop_cache.get(self._forward_signature)
                    if cached is not None:
                        self.flops = cached
                    # else: a new shape, counted on the next step that has it (this one
                    # keeps the estimate it started with)
                self._shape_key = cb._last_forward_signature = self._forward_signature
        if self._counting:
            self._counting = False
            counted = cb._counter.stop()
            if ok:
                self.flops = cb._store_count(self._shape_key, counted)

    def _loss_other(self, loss: Any) -> None:
        """:meth:`loss` for anything but a tensor: a number, or a warning."""
        try:
            self._raw = float(loss)
        except Exception:
            self._cb._warn_once("loss", f"step.loss() got {type(loss).__name__}, not a number: ignored")

    def autocast(self) -> AbstractContextManager[Any]:
        """The context for this step's precision (a null context for fp32/tf32)."""
        return self._cb._autocast_for(self.precision)

    def _judge(self, value: float) -> None:
        """The guard's look at this step's loss, once its value is known (in step order)."""
        cb = self._cb
        if math.isfinite(value):
            self._loss = value  # (a gradient found non-finite meanwhile stays so)
            if self.precision != cb._precision:
                return  # read after a switch: not the trend of the level in force now
            guard = cb._guard
            if guard.stack:  # below a level it came down from: is it a spike?
                index = self.index if self.index is not None else cb._next_index  # judged in order
                self._spike_reason = guard.spike(value, index)
                if self._spike_reason is not None:
                    return  # a spike is not the new level's trend
            guard.losses.append(value)
        else:
            self._loss, self._nonfinite, self._nonfinite_cause, self._spike_reason = None, True, "loss", None

    def mark_nonfinite(self, what: str = "gradient") -> None:
        """Flag this step as non-finite (e.g. a gradient was inf/NaN) without a loss value."""
        if not self._nonfinite:
            self._nonfinite_cause = what  # the first cause is the one reported
        self._nonfinite = True

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, through the GradScaler when this step runs fp16.

        Reports the loss too (as :meth:`loss`) if the step has not reported one.
        """
        cb = self._cb
        cb._scaling_seen = True
        if self._raw is None and self._loss is None and self._pending is None and not self._nonfinite:
            self.loss(loss)
        if self.precision == "fp16" and cb.manage_precision:
            scaler = cb._get_scaler()
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
        cb = self._cb
        cb._scaling_seen = True
        if self._scaled and cb._scaler is not None:
            cb._scaler.step(optimizer)
            cb._scaler.update()
            return True
        if cb._guard.stack and cb.manage_precision:
            try:
                finite = grads_finite(optimizer_params(optimizer))
            except Exception as e:
                cb._warn_once("gradcheck", f"cannot check the gradients for inf/NaN: {e}")
                finite = True
            if not finite:
                self.mark_nonfinite("gradient")
                return False
        optimizer.step()
        return True
