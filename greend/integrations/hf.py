"""Hugging Face adapter: :class:`GreenHFCallback`, a ``transformers.TrainerCallback``.

Usage::

    from greend.integrations.hf import GreenHFCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[GreenHFCallback(job="run-7", gpus=[0])])

How it maps onto the Trainer
----------------------------
* ``on_step_begin`` opens a :class:`greend.training.step.Step`, ``on_step_end``
  closes it: one optimizer step, including every micro-batch of gradient
  accumulation, forward, backward and the optimizer. The callback never sees the
  batch: a forward pre-hook on the model sees its inputs' shapes (the first
  micro-batch's), and each new shape is counted with FlopCounterMode, up to
  ``max_flop_counts`` shapes, then estimated by size from the counted ones
  (batches padded to their longest sequence, one draw of 40: the total within
  0.1 % of a count of each step, each step within 3.4 %); ``flops_per_step=`` or
  ``model_flops=True`` instead.
* ``samples`` = ``per_device_train_batch_size * gradient_accumulation_steps``;
  ``tokens`` = the growth of ``state.num_input_tokens_seen`` when the Trainer
  tracks it (``include_num_input_tokens_seen=True``), over the ranks (the Trainer
  counts every rank's: each reports its share).
* **Loss**: a TrainerCallback never sees the step's loss; the adapter reports the
  newest ``loss`` in ``state.log_history`` once, on the step that follows its
  logging (the Trainer logs after ``on_step_end``). With ``logging_steps=1``
  every step after the first carries the previous step's loss.
* **Precision**: Accelerate owns autocast and a TrainerCallback cannot change it.
  The adapter reports the level the Trainer runs (``bf16=True`` ->
  bf16, ``fp16=True`` -> fp16, ``tf32=True`` -> tf32, else fp32) and refuses
  every directive, logging why. Switching needs a model wrapper whose forward
  uses ``GreenCallback.autocast()``, or a Trainer subclass.
* ``on_train_end`` closes the callback (``end``).
"""

from __future__ import annotations

import logging
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as e:
    raise ImportError("greend.integrations.hf needs Hugging Face transformers: pip install transformers") from e

import torch

from greend.integrations import check_callback_kwargs
from greend.training import GreenCallback, Step
from greend.training.mixed_precision import weights_level

__all__ = ["GreenHFCallback"]

log = logging.getLogger(__name__)

# TrainerControl flags set by the time on_step_end runs: what follows is a pause in training.
_PAUSES = ("should_evaluate", "should_save", "should_epoch_stop", "should_training_stop")

_OWNER = (
    "the Hugging Face Trainer (Accelerate owns autocast): precision switching needs a "
    "model wrapper using GreenCallback.autocast() or a Trainer subclass"
)


def trainer_precision(args: Any, model: Any = None) -> str:
    """The greend level a TrainingArguments runs at; without ``bf16=``/``fp16=``, a model
    whose weights are bf16 or fp16 (``from_pretrained(torch_dtype=torch.bfloat16)``)
    computes at that level."""
    if getattr(args, "bf16", False):
        return "bf16"
    if getattr(args, "fp16", False):
        return "fp16"
    weights = weights_level(model) if isinstance(model, torch.nn.Module) else None
    if weights is not None:
        return weights
    if getattr(args, "tf32", None):
        return "tf32"
    return "fp32"


class GreenHFCallback(TrainerCallback):
    """Reports each optimizer step of a Hugging Face Trainer to greend.

    Args:
        job: the job id (see :class:`greend.GreenCallback`).
        **kwargs: passed to :class:`greend.GreenCallback` (``socket=``, ``gpus=``,
            ``flops_per_step=``, ``model_flops=``, ...). The model is the Trainer's.
    """

    def __init__(self, job: str | None = None, **kwargs: Any) -> None:
        for bad in ("model", "manage_precision", "initial_precision"):
            if bad in kwargs:
                raise ValueError(f"GreenHFCallback sets {bad}= itself from the Trainer")
        check_callback_kwargs("GreenHFCallback", kwargs)
        self.job = job
        self.kwargs = kwargs
        self.cb: GreenCallback | None = None
        self._step: Step | None = None
        self._samples: int | None = None
        self._tokens_seen = 0
        self._log_seen = 0

    @property
    def precision(self) -> str:
        return self.cb.precision if self.cb is not None else "fp32"

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self._step is not None:  # the last train() raised inside a step (no hook tells an adapter)
            step, self._step = self._step, None
            step.__exit__(RuntimeError, None, None)  # not a step: its FLOP count, if one ran, stops
        if self.cb is not None and not self.cb.closed:
            self.cb.close("error")  # that run ended there
        if self.cb is None or self.cb.closed:  # (a second train() is a new run: a new callback)
            self.cb = GreenCallback(
                job=self.job,
                model=model,
                manage_precision=False,
                initial_precision=trainer_precision(args, model),
                precision_owner=_OWNER,
                **self.kwargs,
            )
        self._samples = int(args.per_device_train_batch_size) * int(args.gradient_accumulation_steps)
        self._tokens_seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        self._log_seen = len(state.log_history)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.cb is None:
            return
        if self._step is not None:
            self._step.__exit__(None, None, None)
        step = self.cb.step(samples=self._samples)
        step.__enter__()
        self._step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step, self._step = self._step, None
        if step is None:
            return
        seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        if seen > self._tokens_seen:
            # The Trainer counts every rank's tokens (gathered): this rank's share, so that
            # the daemon's sum over the job's ranks is the count.
            step.tokens = (seen - self._tokens_seen) // max(1, int(getattr(args, "world_size", 1) or 1))
            self._tokens_seen = seen
        history = state.log_history
        if len(history) > self._log_seen:
            for entry in reversed(history[self._log_seen :]):
                if isinstance(entry, dict) and "loss" in entry:
                    step.loss(entry["loss"])
                    break
            self._log_seen = len(history)
        step.__exit__(None, None, None)
        if self.cb is not None and any(getattr(control, flag, False) for flag in _PAUSES):
            self.cb.flush()  # a pause in training follows: the daemon hears of the last steps now

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.cb is not None:
            self.cb.flush()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._step is not None:
            self._step.__exit__(None, None, None)
            self._step = None
        if self.cb is not None:
            self.cb.close("finished")
