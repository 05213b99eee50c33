"""Whether a level greend switched a job to is in effect: bf16 and fp16 are autocasts, in
effect only where the loop runs its forward under ``step.autocast()`` (Lightning:
``trainer.greend.autocast()``). A loop that does not (a LightningModule on
``precision="32-true"`` that does not wrap its forward) went on at fp32 while greend booked
and reported it at bf16, savings and all.

After such a switch, in a callback given the model, forward pre-hooks on the model's
layers that hold weights look at the first step that runs at the level: a layer computing
under an autocast shows the level in effect; layers computing, none of them under one,
show it was not (:meth:`PrecisionControl.not_in_effect` then takes the job back to the
level before, told to the daemon as refused). Only layers with trainable weights are
looked at (a frozen encoder may run outside the autocast on purpose). A step with no
forward (a loop without a model, or a step that raised first) shows nothing, and the
level stays. Nothing on a step's common path: the hooks are on until the first step at
the level has ended (the first, or under a trial the first of its blocks), and the check
looks at step boundaries only while armed; a level left before then disarms it.
"""

from __future__ import annotations

from typing import Any

import torch

from greend.training.mixed_precision import weight_layers

__all__ = ["AUTOCAST_ONLY", "AutocastCheck"]

# The levels that are an autocast and nothing else (fp8 converts the model's linears too;
# fp32 and tf32 need none).
AUTOCAST_ONLY = frozenset({"bf16", "fp16"})


class AutocastCheck:
    """One switch's check (``level`` None: nothing to check)."""

    def __init__(self, model: Any, device: str) -> None:
        self._model = model
        self._device = device
        self.level: str | None = None
        self._hooks: list[Any] = []
        self._step: Any = None  # the first step at the level (set where it begins)
        self._under = 0  # its layers' forwards under an autocast ...
        self._outside = 0  # ... and outside any

    def switched(self, level: str, managed: bool) -> bool:
        """The run's level is ``level`` now (``managed``: a switch greend made, to check);
        whether the steps must look at their boundaries for it."""
        if managed:
            return self.arm(level)
        if self.level not in (None, level):
            self.disarm()  # (left before a step at it ended: a rollback)
        return False

    def arm(self, level: str) -> bool:
        """After a switch greend made to ``level``: whether there is something to check."""
        self.disarm()
        if level not in AUTOCAST_ONLY or self._model is None:
            return False
        try:
            torch.is_autocast_enabled(self._device)  # (torch 2.3 has no device argument: no check)
            # The layers that train: a frozen part (an encoder, a teacher) may run outside
            # the autocast on purpose, and says nothing of the level the training runs at.
            for m in weight_layers(self._model):
                if any(p.requires_grad for p in m.parameters(recurse=False)):
                    self._hooks.append(m.register_forward_pre_hook(self._on_forward))
        except Exception:
            self.disarm()
            return False
        self.level, self._step, self._under, self._outside = level, None, 0, 0
        return bool(self._hooks)

    def disarm(self) -> None:
        hooks, self._hooks, self.level = self._hooks, [], None
        for h in hooks:
            h.remove()

    def _on_forward(self, module: Any, args: Any) -> None:
        step = self._step
        if step is None or step.t1_s or step.precision != self.level:  # (outside the step looked at)
            return
        try:
            if torch.is_autocast_enabled(self._device):
                self._under += 1
            else:
                self._outside += 1
        except Exception:  # (never into the user's forward)
            self._under += 1

    def begun(self, step: Any) -> None:
        """A step about to start: the first at the level is the one looked at."""
        if self.level is not None and self._step is None:
            self._step = step

    def verdict(self, step: Any) -> bool | None:
        """At the boundary of ``step`` (about to start): whether the level was in effect in
        the step looked at (None: no step at the level has ended yet, the check stays
        armed; a step without a forward shows nothing, and counts as in effect)."""
        last = self._step
        if last is None or last is step:
            return None
        if last.precision != self.level or not last.t1_s:
            # (a probe's step at another level, or one that raised: the next one is looked at)
            self._step, self._under, self._outside = None, 0, 0
            return None
        in_effect = self._under > 0 or self._outside == 0
        self.disarm()
        return in_effect
