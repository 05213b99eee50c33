"""PyTorch Lightning adapter: :class:`GreenLightningCallback`.

Usage::

    from greend.integrations.lightning import GreenLightningCallback

    class Module(L.LightningModule):
        def training_step(self, batch, batch_idx):
            with self.trainer.greend.autocast():     # the level greend asked for
                loss = self.net(batch).loss
            return loss

    trainer = L.Trainer(callbacks=[GreenLightningCallback(job="run-7", gpus=[0])])

How it maps onto Lightning
--------------------------
* ``on_train_batch_start`` opens a :class:`greend.training.step.Step`,
  ``on_train_batch_end`` closes it with the loss from ``outputs`` (a tensor, or
  the ``"loss"`` of a dict). Lightning runs forward, backward and the optimizer
  step between these two hooks, so the first batch's FLOPs are counted exactly
  (and re-counted when the batch's shapes change, as in GreenCallback).
* **Precision**: Lightning's precision plugin owns autocast, so a callback
  cannot switch it. The adapter exposes the level for the module to act on:
  ``trainer.greend_precision`` and ``pl_module.greend_precision`` (a string,
  updated at each batch start), and ``trainer.greend`` (this callback), whose
  :meth:`GreenLightningCallback.autocast` returns the matching context. With
  ``Trainer(precision="bf16-mixed")`` (or any non-32 setting) Lightning
  already runs mixed precision: the adapter then only reports that level and
  never switches.
* ``on_train_end`` (and ``on_exception``) close the callback (``end``).

Works with ``lightning`` (``lightning.pytorch``) or the older
``pytorch_lightning`` package; when both are installed, ``lightning.pytorch``
is used (a Trainer only accepts callbacks of its own package).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

try:
    import lightning.pytorch as pl
except ImportError:
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef, unused-ignore]  # the older name of the same package
    except ImportError as e:
        raise ImportError("greend.integrations.lightning needs PyTorch Lightning: pip install lightning") from e

from greend.integrations import check_callback_kwargs
from greend.training import GreenCallback, Step

__all__ = ["GreenLightningCallback"]

log = logging.getLogger(__name__)

# Lightning precision settings -> greend levels (anything else runs as fp32).
_LIGHTNING_LEVELS = {
    "bf16-mixed": "bf16",
    "bf16": "bf16",
    "bf16-true": "bf16",
    "16-mixed": "fp16",
    "16": "fp16",
    "16-true": "fp16",
    "transformer-engine": "fp8",
    "transformer-engine-float16": "fp8",
}


class _Skipped(Exception):
    """A batch Lightning skipped (GreenLightningCallback._drop_step)."""


class GreenLightningCallback(pl.Callback):
    """A Lightning ``Callback`` that reports each training batch to greend.

    Args:
        job: the job id (see :class:`greend.GreenCallback`).
        samples_of: the samples in a batch (``lambda b: b["x"].shape[1]`` for a time-major
            batch); default: its rows, the first dimension of its first tensor.
        **kwargs: passed to :class:`greend.GreenCallback` (``socket=``, ``gpus=``,
            ``flops_per_step=``, ...). The model is the LightningModule.
    """

    def __init__(self, job: str | None = None, samples_of: Callable[[Any], int] | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.samples_of = samples_of
        self._samples_of_failed = False  # (said once)
        if "model" in kwargs:
            raise ValueError("GreenLightningCallback takes its model from the Trainer: do not pass model=")
        check_callback_kwargs("GreenLightningCallback", kwargs)
        self.job = job
        self.kwargs = kwargs
        self.cb: GreenCallback | None = None
        self._step: Step | None = None
        self._published: str | None = None  # the level last set on the trainer and module

    # Public ----------------------------------------------------------------------
    @property
    def precision(self) -> str:
        """The level greend asks this rank to run (fp32 before training starts)."""
        return self.cb.precision if self.cb is not None else "fp32"

    def autocast(self) -> AbstractContextManager[Any]:
        """The autocast context for the current level; use it in ``training_step``."""
        if self._step is not None:
            return self._step.autocast()
        if self.cb is not None:
            return self.cb.autocast()
        import contextlib

        return contextlib.nullcontext()

    # Hooks -----------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.cb is None or self.cb.closed:  # (a second fit() is a new run: a new callback)
            kwargs = dict(self.kwargs)
            level = _LIGHTNING_LEVELS.get(str(getattr(trainer, "precision", "32-true")))
            if level is not None and "manage_precision" not in kwargs:
                kwargs.update(
                    manage_precision=False,
                    initial_precision=level,
                    precision_owner=f"Lightning runs precision={trainer.precision!r}",
                )
            self.cb = GreenCallback(job=self.job, model=pl_module, **kwargs)
        trainer.greend = self
        self._publish(trainer, pl_module, self.cb.precision)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.cb is None:
            return
        self._drop_step()  # (a batch begun that never ended: skipped)
        samples = None
        if self.samples_of is not None:
            try:
                samples = self.samples_of(batch)
            except Exception as e:  # (the user's function: never the training's problem)
                if not self._samples_of_failed:
                    log.warning(
                        "greend: samples_of(batch) raised %s: %s; the batch's rows counted", type(e).__name__, e
                    )
                self._samples_of_failed = True
        step = self.cb.step(batch=batch, samples=samples)  # (None: the batch's rows, flops.batch_rows)
        step.__enter__()
        self._step = step
        if step.precision != self._published:  # (an nn.Module's setattr costs microseconds: on a change only)
            self._publish(trainer, pl_module, step.precision)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs
        if isinstance(outputs, dict):
            loss = outputs.get("loss")
        n = getattr(trainer, "accumulate_grad_batches", 1)
        if loss is not None and isinstance(n, int) and n > 1 and getattr(pl_module, "automatic_optimization", False):
            # Lightning hands on the loss divided by accumulate_grad_batches (what backward
            # takes): the loss as the module computed it is n times that (a schedule that
            # changes n would otherwise read as a jump in the loss).
            try:
                loss = loss * n
            except Exception:
                loss = None
        self._close_step(loss)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._flush()  # a pause in training: the daemon hears of the last steps now

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._drop_step()
        self._flush()

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self._flush()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        step, self._step = self._step, None
        if step is not None:
            try:
                step.__exit__(type(exception), exception, exception.__traceback__)
            except Exception:
                pass
        if self.cb is not None:
            self.cb.close("error")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._drop_step()
        if self.cb is not None:
            self.cb.close("finished")

    # Helpers ---------------------------------------------------------------------
    def _flush(self) -> None:
        if self.cb is not None and self._step is None:  # between batches only
            self.cb.flush()

    def _close_step(self, loss: Any) -> None:
        step, self._step = self._step, None
        if step is None:
            return
        if loss is not None:
            step.loss(loss)
        step.__exit__(None, None, None)

    def _drop_step(self) -> None:
        """A batch begun and never ended: the module's ``on_train_batch_start`` returned -1
        (Lightning skips the rest of the epoch) or the training stopped. Not a step: no
        record (it was booked with the epoch's end in its time), its FLOP count stopped."""
        step, self._step = self._step, None
        if step is not None:
            step.__exit__(_Skipped, None, None)

    def _publish(self, trainer: Any, pl_module: Any, level: str) -> None:
        self._published = level
        for obj in (trainer, pl_module):
            try:
                obj.greend_precision = level
            except Exception:
                log.debug("cannot set greend_precision on %s", type(obj).__name__)
