"""The callback's precision: the level steps run at, and every way it changes.

:class:`PrecisionControl` holds the level in force and applies the daemon's directives at step
boundaries (or, in a job of several ranks, agrees on one level with the other ranks through the
job's rendezvous store), refuses what cannot run here, rolls back on the accuracy guard's word (a
non-finite or spiking loss) and on the reference check's (:mod:`greend.training.reference`), and
owns the GradScaler, the fp8 conversion and the autocast contexts. The rules themselves (levels, the
guard) are :mod:`greend.training.mixed_precision`'s. Written by the training thread only; the events
it reports go to the sender through the callback's channel.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import warnings
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from greend.errors import GreendWarning
from greend.protocol import FP8_LEVELS, PRECISIONS, may_run, not_above
from greend.training._level_agreement import LevelAgreement
from greend.training.fp8 import Fp8Converter, warm_up_torchao
from greend.training.loss_reader import LossReader
from greend.training.mixed_precision import (
    DTYPE_LEVELS,
    PrecisionEvent,
    PrecisionOptions,
    fp8_targets,
    has_te_modules,
    precision_support,
    weights_level,
)
from greend.training.peers import JobPeers
from greend.training.probe import Prober
from greend.training.reference import REFERENCE_TOLERANCE, ReferenceJudge, excess
from greend.training.warn import OnceWarnings, log

__all__ = ["PrecisionControl", "StepCount"]


# fp8 levels run the layers that stay out of fp8 (head, norms, small linears) in bf16.
_AUTOCAST_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.bfloat16,
    "fp8-emulated": torch.bfloat16,
}
_UNSEEN = object()  # a value not looked at yet
_NULL_CONTEXT = contextlib.nullcontext()
_PROBED = frozenset({"bf16", "fp16"})  # levels probed against the level above (an autocast apart)


class StepCount(Protocol):
    """What the precision needs of the callback's steps (:class:`greend.training.book.StepBook`)."""

    next_index: int  # the index of the next step recorded

    def flush(self) -> None:
        """Judge the losses that are in (a rollback among them goes first)."""

    def switched(self, level: str, managed: bool) -> None:
        """The level in force is now ``level`` (``managed``: by this callback's own switch)."""


class PrecisionControl(LevelAgreement):
    """The level in force, directives, agreement between ranks, rollbacks, reference checks."""

    def __init__(
        self,
        *,
        model: torch.nn.Module | None,
        device: torch.device,
        manage: bool,
        allowed: list[str] | None,
        initial: str | None,
        owner: str | None,
        loss_scaling: bool | None,
        options: PrecisionOptions,
        reference_loss: Callable[[], torch.Tensor] | None,
        reference_every: int,
        reference_tolerance: float | None,
        probe_every: int | None,
        probe_tolerance: float | None,
        probe_trial: bool = True,
        job: str,
        rank: int,
        world_size: int,
        events: deque[dict[str, Any]],
        warnings: OnceWarnings,
    ) -> None:
        self.manage = manage
        self._model = model
        self._job, self._rank = job, rank
        self._events = events  # for the sender: sent as op "precision_event"
        self._warnings = warnings
        self._steps: StepCount | None = None
        self.guard = options.guard()
        self._losses = LossReader()  # the reference batch's losses, read without a stream sync
        self.scaling_seen = bool(loss_scaling)
        self.scaler: Any = None  # torch.amp.GradScaler, made on the first fp16 step
        self.fp8: Fp8Converter | None = None
        self._fp8_te = False  # fp8 through Transformer Engine's fp8_autocast (no conversion)
        # The job's own level: the top of its ladder, never left upwards. Given (initial_precision=,
        # an adapter from its framework's setting), or detected at the first step: the torch.autocast
        # the job runs around its step or its model's forward (else fp32, or tf32 where TF32 is on).
        self.detecting = initial is None
        self.own: str | None = initial
        self._weights: str | None | object = _UNSEEN  # the level the model's weights are in, once looked at
        if initial is None:
            tf32 = device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
            initial = "tf32" if tf32 else "fp32"
        if manage:
            self.support = precision_support(device, allowed, model=model, fp8_min_features=options.fp8_min_features)
            if loss_scaling is False and self.support.get("fp16") is None:
                self.support["fp16"] = "loss_scaling=False: fp16 needs a GradScaler"
            fp8_ok = [level for level in FP8_LEVELS if self.support.get(level) is None]
            if fp8_ok and model is not None:
                if "fp8" in fp8_ok and has_te_modules(model):
                    self._fp8_te = True
                else:
                    self.fp8 = Fp8Converter(model, fp8_targets(model, options.fp8_min_features), emulate=False)
                    warm_up_torchao()
        else:
            why = owner or "the training framework owns autocast; see greend.integrations"
            self.support = {level: (None if level == initial else f"not switched here: {why}") for level in PRECISIONS}
        self.autocast_device = device.type if device.type in ("cuda", "cpu", "xpu", "mps") else "cpu"
        # The job's TF32 flags, saved when greend first writes them (a tf32 or fp32 level it runs)
        # and put back when it leaves such a level; None while greend's write is not in force:
        # the flags are the job's own, never touched (the job may change them).
        self._saved_tf32: tuple[bool, bool] | None = None
        self._own_flags = not self.detecting  # a level given (not detected): its TF32 flags are greend's to set
        if self.detecting and self.support.get(initial) is not None:
            self.support[initial] = None  # the job's own flags: it runs this level itself
        if self.support.get(initial) is not None:
            raise ValueError(f"initial_precision={initial!r} cannot run here: {self.support[initial]}")
        self.level = "fp32"
        self.refused: dict[str, str] = {}  # level -> why the callback did not apply it
        self.event_log: deque[dict[str, Any]] = deque(maxlen=256)
        if self.detecting:
            self.level = initial  # the job's torch flags are its own: left as they are
        else:
            self._apply_level(initial)
        self.seen_request: str | None = None  # the last directive taken
        # Precision is one decision per job: in a job of several ranks a directive is a proposal, and
        # every sync_every steps the ranks agree (through the job's store) on the most precise level
        # any of them wants, which all apply at the same step.
        self.agreeing = world_size > 1 and manage
        # After a rollback while the ranks agree, the probes wait for the agreement that has this
        # rank's level (greend.training._level_agreement).
        self.rearm, self._worded, self._agree_failed = False, None, 0
        self.proposal: str | None = None
        self.peers: JobPeers | None = None  # the job's rendezvous store, once reached
        # The reference check: fixed-batch losses in flight (step, level, fp32 handle,
        # level handle), judged once they have landed.
        self.reference = reference_loss if manage else None
        self.reference_every = reference_every
        # (None: the daemon's tolerance, at most REFERENCE_TOLERANCE: follow_tolerance)
        self._reference_own = reference_tolerance is not None
        self.reference_judge = ReferenceJudge(
            tolerance=float(reference_tolerance) if reference_tolerance is not None else REFERENCE_TOLERANCE
        )
        self._reference_pending: deque[tuple[int, str, Any, Any]] = deque()
        # Probe blocks at the level above while the run is below its own level
        # (greend.training.probe); None: none (turned off, or they failed).
        self.prober = (
            Prober(tolerance=probe_tolerance, every=probe_every, trials=probe_trial, ranks=world_size)
            if manage and probe_every
            else None
        )

    def attach(self, steps: StepCount) -> None:
        self._steps = steps

    @property
    def _next_index(self) -> int:
        return self._steps.next_index if self._steps is not None else 0

    def job_peers(self) -> JobPeers | None:
        """The job's rendezvous store (None where the ranks have none); raises on failure."""
        if self.peers is None:
            self.peers = JobPeers.of_process_group(self._job, self._rank)
        return self.peers

    # Directives and agreement -------------------------------------------------------
    def take_request(self, level: str | None) -> None:
        """Take the daemon's latest directive at a step boundary: apply it (or, in a job
        of several ranks, propose it to the others), or refuse it with a reason. Not while
        the job's own level is not known yet: taken then, it would be taken from the fp32 a
        step starts at (its trials, probes and rollbacks run at fp32 for a bf16 job); it is
        taken at the first step start after that (the request stays unseen till then)."""
        if self.detecting:
            return
        self.seen_request = level
        if self._steps is not None:
            self._steps.flush()  # the guard decides on every loss that is in
        own = self.own
        if level is not None and own is not None and self.level != own and self.above_own(level) is not None:
            # More precision than the job's own asked of a job below it: as much as it has,
            # its own level (refused as above its own, the job kept the less it ran at).
            log.info("greend asked for precision %s; taken as the job's own level %s", level, own)
            level = own
        if level is None or level == self.level:
            self.proposal = None  # the daemon no longer asks for another level
            return
        step = self._next_index
        reason = self.support.get(level, f"unknown precision level {level!r}")
        if reason is None:
            reason = self.above_own(level)
        if reason is None:
            reason = self.guard.barred_reason(level, step)
        if reason is None and level == "fp16" and self.manage and not self.scaling_seen:
            reason = (
                "fp16 needs loss scaling: run the step's backward and optimizer step through "
                "step.backward(loss) and step.optimizer_step(opt), or cb.scaler, or pass "
                "loss_scaling=True"
            )
        if reason is None:
            if self.agreeing:
                self.proposal = level
                log.info("precision %s proposed to the job's ranks (greend directive)", level)
                return
            reason = self._switch(level, "greend directive")
            if reason is None:
                return
        self.refused[level] = reason
        self._warnings.warn(f"refuse:{level}", f"greend asked for precision {level}; staying at {self.level}: {reason}")
        self._send_event(PrecisionEvent("refused", self.level, level, reason, step=step, loss=self._last_loss(),
                                        trend=self.guard.trend()))  # fmt: skip

    def detect_own_level(self, final: bool) -> bool:
        """While the job's own level is not known: is an autocast on here (the job's own,
        around its step or its model's forward)? Its dtype is then the job's level, which
        greend runs it at from now; ``final``: else the level in force is. Whether the
        level changed."""
        if not self.detecting:
            return False
        level = None
        try:
            if torch.is_autocast_enabled(self.autocast_device):
                dtype = torch.get_autocast_dtype(self.autocast_device)
                level = DTYPE_LEVELS.get(dtype)
        except Exception as e:  # an older torch without the device argument
            log.debug("cannot read the autocast state: %s", e)
        if level is None:
            # A model whose weights are bf16 (or fp16) computes there with or without an autocast:
            # the job's level from its first step (looked at once; the weights keep their dtype).
            weights = self._weights
            if weights is _UNSEEN:
                weights = self._weights = weights_level(self._model)
            level = weights if isinstance(weights, str) else None
        if level is None:
            if final:
                self.detecting = False
                self.own = self.level
                log.info("greend: the job runs %s on its own (no autocast seen at its first step)", self.level)
                if self.manage and self.level in ("fp32", "tf32"):
                    # A bf16 job whose own torch.autocast step.autocast() replaced looks the same
                    # from here: say how to keep it at bf16, where the user sees it (a GreendWarning:
                    # greend's log lines reach no handler unless the job configures logging), and in the log.
                    message = (
                        f"greend: job {self._job} is taken for {self.level}: no autocast and no bf16/fp16 weights at "
                        "its first step, so step.autocast() runs it at full precision. If it trained in bf16 (or "
                        "fp16) before greend, pass GreenCallback(initial_precision='bf16') to keep it there (an "
                        "fp32 job: initial_precision='fp32' says so, without this warning)"
                    )
                    log.warning("%s", message)
                    warnings.warn(message, GreendWarning, stacklevel=4)  # (the user's `with cb.step()`)
            return False
        self.detecting = False
        self.own = level
        self.support[level] = None  # the job runs it itself
        changed = level != self.level
        self.level = level
        if changed and self._steps is not None:
            self._steps.switched(level, False)
        log.info("greend: the job runs %s on its own (its autocast or its weights): greend never goes above", level)
        return changed

    def offered(self) -> list[str]:
        """The levels this process offers the daemon: those that run here, none above the
        job's own level (while that is not known, the daemon takes the first steps' level
        as the job's own and offers nothing above it)."""
        levels = PRECISIONS if self.own is None else not_above(PRECISIONS, self.own)
        return [level for level in levels if self.support.get(level) is None]

    def above_own(self, level: str) -> str | None:
        """Why ``level`` may not run here because it is above the job's own level, or None."""
        own = self.own
        if own is not None and not may_run(level, own):
            return f"{level} is not below the job's own level {own}: greend only takes a job down from its own level"
        return None  # not known here: the daemon knows it (from the job's first steps) and asks nothing above

    def _last_loss(self) -> float | None:
        return self.guard.losses[-1] if self.guard.losses else None

    def _switch(self, level: str, why: str) -> str | None:
        """Run the next steps at ``level``; the reason it could not, or None."""
        old = self.level
        try:
            self._apply_level(level)
        except Exception as e:
            reason = f"switching to {level} failed: {type(e).__name__}: {e}"
            self.support[level] = reason  # never again in this process
            return reason
        log.info("precision %s -> %s (%s)", old, level, why)
        self.detecting = False  # a level greend set: an autocast seen from now on is greend's own
        if self.manage:
            self.guard.on_switch(old, level, self._next_index)
            if self._steps is not None:
                self._steps.switched(level, True)  # read each step from now on while the spike rule holds
        return None

    # Reference checks -----------------------------------------------------------------
    def reference_due(self, index: int) -> None:
        """After a recorded step: judge the reference checks that landed, start one when due."""
        if self._reference_pending:
            self.read_reference()
        if self._fp8_put_back:
            return  # (no fp8 to check)
        if self.guard.armed and (index + 1) % self.reference_every == 0 and not self._reference_pending:
            self._start_reference(index)
            self.read_reference()  # landed already on the CPU; on a GPU, judged a step or two later

    @property
    def _fp8_put_back(self) -> bool:
        """Whether the run is at an fp8 level with its fp8 linears put back to ``nn.Linear``
        (a probe or trial step at the level above): a reference pass "at fp8" now would run
        the plain linears."""
        fp8 = self.fp8
        return self.level in FP8_LEVELS and fp8 is not None and not fp8.active

    def _start_reference(self, index: int) -> None:
        """Evaluate the reference batch in fp32 and at the level in force, on the same
        weights; the values are read (never waited for) by :meth:`read_reference`."""
        level = self.level
        model = self._model
        modes = [(m, m.training) for m in model.modules()] if model is not None else []
        try:
            with torch.no_grad():
                if model is not None:
                    model.eval()  # dropout off: the two passes differ only by the precision
                try:
                    with self._full_precision():
                        fp32 = self.reference()  # type: ignore[misc]  # (only called while reference is set)
                    with self.autocast_for(level):
                        low = self.reference()  # type: ignore[misc]  # (as above)
                finally:
                    for m, training in modes:
                        m.training = training
            handles = (self._losses.start(fp32), self._losses.start(low))
        except Exception as e:
            self.reference = None
            self._warnings.warn(
                "reference", f"reference_loss failed ({type(e).__name__}: {e}); no more reference checks", loud=True
            )
            if self.fp8 is not None and level in FP8_LEVELS and not self.fp8.active:
                self._rollback_now(index, "fp8 could not be put back after the reference check", None)
            return
        self._reference_pending.append((index, level, *handles))

    def confirm_spike(self, spike: str) -> str | None:
        """A loss spike, looked at on the reference batch (waiting for the values: a
        spike is rare): the precision's doing only if the level is worse than fp32 there
        by more than the reference tolerance; else the data changed, and nothing rolls back."""
        index = self._next_index - 1
        self.read_reference(wait=True)
        # Where it cannot be looked at, the spike rule stands alone (a lone first spike excused).
        alone = None if self.guard.lone_first() else spike
        if self._fp8_put_back:
            return alone  # (no fp8 to check it on)
        self._start_reference(index)
        if not self._reference_pending:
            return alone  # the reference failed
        _, level, h_fp32, h_low = self._reference_pending.pop()
        low, fp32 = self._losses.value(h_low, wait=True), self._losses.value(h_fp32, wait=True)
        if low is None or fp32 is None:
            return alone
        self.reference_judge.log.append(
            {
                "step": index,
                "level": level,
                "fp32": fp32,
                "against": self.reference_level,
                "loss": low,
                "excess": None,
                "spike": True,
            }
        )
        worse = excess(fp32, low) if math.isfinite(low) and math.isfinite(fp32) else math.inf
        if worse > self.reference_judge.tolerance:
            return f"{spike}; on the reference batch {level} is {worse:+.1%} over {self.reference_level}"
        self.guard.data_changed()  # the trend before the switch no longer says anything
        log.info(
            "greend: loss spike at step %d not confirmed on the reference batch (%s %+.2f%% over %s): "
            "a change in the data, not the precision; staying at %s",
            index,
            level,
            100 * worse,
            self.reference_level,
            level,
        )
        return None

    @property
    def reference_level(self) -> str:
        """The level the reference batch is judged against: the job's own where it is
        below fp32 (a bf16 job taken to fp8 is judged against bf16, not against fp32,
        whose gap to bf16 is the job's own choice), else fp32."""
        own = self.own
        return own if own is not None and own not in ("fp32", "tf32") else "fp32"

    @contextlib.contextmanager
    def _full_precision(self) -> Any:
        """The reference pass at :attr:`reference_level`: fp32 (no autocast, no TF32), or
        the job's own autocast; fp8 linears swapped back either way."""
        fp8 = self.fp8 if self.fp8 is not None and self.fp8.active else None
        flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        upper = self.reference_level
        self.reference_judge.against = upper
        if fp8 is not None:
            fp8.revert()
        try:
            if upper == "fp32":
                with torch.autocast(self.autocast_device, enabled=False):
                    yield
            else:
                with self.autocast_for(upper):
                    yield
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
            if fp8 is not None:
                fp8.convert()

    def read_reference(self, wait: bool = False) -> None:
        """Judge the reference checks whose values have landed (``wait``: all of them)."""
        q = self._reference_pending
        while q:
            index, level, h_fp32, h_low = q[0]
            low = self._losses.value(h_low, wait=wait)  # queued last: when it is in, both are
            if low is None:
                return
            fp32 = self._losses.value(h_fp32, wait=True)
            q.popleft()
            if fp32 is None or level != self.level:
                continue  # the level changed while the values were in flight
            why = self.reference_judge.judge(index, level, fp32, low)
            if why is not None:
                self._rollback_now(self._next_index - 1, f"reference check at step {index}: {why}", low, fp32)

    # Probes -------------------------------------------------------------------------
    def probe_upper(self) -> str | None:
        """The level a probe block runs at: the level the latest downgrade in force came
        from (bf16, or the job's own, above an fp8 level: the fp8 linears go back to
        ``nn.Linear`` for the block, :meth:`probe_model`); None where there is nothing to
        probe."""
        stack = self.guard.stack
        if not stack or stack[-1].to_level != self.level:
            return None
        upper = stack[-1].from_level
        if upper in FP8_LEVELS or self.support.get(upper) is not None:
            return None
        if self.level in FP8_LEVELS:
            return upper if self.fp8 is not None or self._fp8_te else None
        return upper if self.level in _PROBED else None

    def probe_model(self, probing: bool, index: int) -> None:
        """At the start of step ``index`` near a probe block below an fp8 level converted
        by torchao: the fp8 linears back to ``nn.Linear`` for the block's steps
        (``probing``), converted again after it (the same Parameter objects, as for the
        reference check). Where they cannot be put back, the level rolls back."""
        fp8 = self.fp8
        if fp8 is None or self.level not in FP8_LEVELS:
            return
        if probing:
            if fp8.active:
                fp8.revert()
        elif not fp8.active:
            try:
                fp8.convert()
            except Exception as e:
                self._rollback_now(index - 1, f"fp8 could not be put back after a probe block: {type(e).__name__}: {e}",
                                   None)  # fmt: skip

    def follow_tolerance(self, tolerance: float | None) -> None:
        """The daemon's precision tolerance (its register reply; None: it sent none): the
        probes judge against it unless the job gave ``probe_tolerance`` itself, and the
        reference check against it, at most :data:`REFERENCE_TOLERANCE` (the check sees
        only what evaluating at the level costs, less than training there does), unless
        the job gave ``reference_tolerance``. Called from the sender's thread: one
        attribute each that the judges read."""
        if self.prober is not None:
            self.prober.policy_tolerance = tolerance
        if not self._reference_own:
            own = REFERENCE_TOLERANCE if tolerance is None else min(REFERENCE_TOLERANCE, tolerance)
            self.reference_judge.tolerance = own

    def probe_rollback(self, index: int, why: str, loss: float | None, together: bool = False) -> None:
        """Roll the latest downgrade back on the probes' evidence (``why`` names it;
        ``together``: the ranks' verdict, taken at this step on every rank)."""
        if together and self.prober is not None and self.prober.lower != self.level:
            return  # (it went back alone a few steps before: all the ranks are at its level now)
        self._rollback_now(index, why, loss)

    # Rollbacks ---------------------------------------------------------------------
    def roll_back(self, index: int, cause: str, loss: float | None, spike: str | None = None) -> None:
        """The guard's fast rules: a non-finite step, or a loss spike, below a level we
        came down from."""
        self._apply_rollback(self.guard.rollback(self.level, index, cause, loss, spike), index)

    def _rollback_now(self, index: int, cause: str, loss: float | None, trend: float | None = None) -> None:
        """Roll the latest downgrade back for ``cause`` (the reference check's rule)."""
        ev = self.guard.rollback(self.level, index, "loss", loss, cause=cause)
        if ev is not None and trend is not None:
            ev.trend = trend
        self._apply_rollback(ev, index)

    def _apply_rollback(self, ev: PrecisionEvent | None, index: int) -> None:
        if ev is None:
            return
        told = ev
        if self.prober is not None and self.prober.trial:
            # A step down turned down in its trial: the job never ran the level but for the
            # trial's blocks. Told the daemon as the level refused (as a rollback, it logged
            # a switch that never was, and the rollback "N steps after the switch").
            why = re.sub(r", \d+ steps? after the switch [^;,]*|; \S+ barred for \d+ steps", "", ev.reason)
            why += f"; turned down in its trial, {ev.from_level} barred for {self.guard.cooldown_steps} steps"
            told = PrecisionEvent("refused", ev.to_level, ev.from_level, why, ev.step, ev.loss, ev.trend)
        self.after_rollback()
        try:
            self._apply_level(ev.to_level)
        except Exception as e:
            self._warnings.warn(f"rollback:{ev.to_level}", f"rolling back to {ev.to_level} failed: {e}",
                                level=logging.ERROR, loud=True)  # fmt: skip
            return
        self.guard.on_switch(ev.from_level, ev.to_level, index + 1)
        log.warning("greend: precision rollback %s -> %s: %s", ev.from_level, ev.to_level, ev.reason)
        self._send_event(told)

    def not_in_effect(self, level: str, index: int) -> None:
        """A step after the switch to ``level`` ran without ``step.autocast()``: the level
        was never in effect (greend.training._autocast_check). Back to the level before it,
        told to the daemon as refused, the level barred for the guard's cooldown."""
        stack = self.guard.stack
        if self.level != level or not stack or stack[-1].to_level != level:
            return
        why = (
            "the training loop does not run its forward under step.autocast() (Lightning: "
            "trainer.greend.autocast()), so greend cannot change its precision"
        )
        guard = self.guard
        before = stack.pop().from_level  # (not a rollback: no penalty was seen)
        guard.barred[level] = (index + 1 + guard.cooldown_steps, "not in effect: no step.autocast()")
        self.refused[level] = why
        self.after_rollback()
        try:
            self._apply_level(before)
        except Exception as e:
            self._warnings.warn(f"rollback:{before}", f"going back to {before} failed: {e}", level=logging.ERROR,
                                loud=True)  # fmt: skip
            return
        guard.on_switch(level, before, index)
        self._warnings.warn(f"refuse:{level}", f"greend switched to {level}, but {why}; back at {before}")
        self._send_event(PrecisionEvent("refused", before, level, why, step=index, loss=self._last_loss()))

    def _send_event(self, ev: PrecisionEvent) -> None:
        fields = ev.fields()
        self.event_log.append(fields)
        self._events.append(fields)

    # Levels, scaler, autocast --------------------------------------------------------
    def loss_scaler(self, level: str) -> Any:
        """The GradScaler for a step at ``level`` (fp16 under this callback's management), or None."""
        self.scaling_seen = True
        if level != "fp16" or not self.manage:
            return None
        if self.scaler is None:
            try:
                self.scaler = torch.amp.GradScaler(self.autocast_device)
            except Exception as e:
                self._warnings.warn("scaler", f"cannot make a GradScaler for {self.autocast_device}: {e}", loud=True)
                return None
        return self.scaler

    def _apply_level(self, level: str) -> None:
        if self.manage:
            fp8 = self.fp8
            if level in FP8_LEVELS and fp8 is not None:
                emulate = level == "fp8-emulated"
                if fp8.active and fp8.emulate != emulate:
                    fp8.revert()
                fp8.emulate = emulate
                n = fp8.convert()  # raises (model unchanged) if torchao cannot
                log.info("greend: %d linear layer(s) run in %s", n, level)
            elif fp8 is not None and fp8.active:
                fp8.revert()
            if level in ("tf32", "fp32") and (level != self.own or self._own_flags):
                if self._saved_tf32 is None:
                    self._saved_tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
                torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = level == "tf32"
            else:
                self.restore_tf32()
        self.level = level
        if self._steps is not None:
            self._steps.switched(level, False)

    def restore_tf32(self) -> None:
        """The job's TF32 flags back, where greend's write of them is in force."""
        saved, self._saved_tf32 = self._saved_tf32, None
        if saved is not None:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved

    def shared_autocast(self) -> dict[str, AbstractContextManager[Any]]:
        """The levels whose autocast context is one shared null context (every level
        when greend does not manage precision; else fp32 and tf32), with it: a step at
        such a level takes it without a call (:meth:`Step.autocast`)."""
        return {level: _NULL_CONTEXT for level in PRECISIONS if not self.manage or level not in _AUTOCAST_DTYPES}

    def autocast_for(self, level: str) -> AbstractContextManager[Any]:
        if not self.manage:
            return _NULL_CONTEXT
        dtype = _AUTOCAST_DTYPES.get(level)
        if dtype is None:
            return _NULL_CONTEXT
        ctx = torch.autocast(self.autocast_device, dtype=dtype)
        if self._fp8_te and level == "fp8":
            return _te_fp8_context(ctx)
        return ctx

    def close(self) -> None:
        """Give back the torch flags and the model as they were before the callback."""
        if self.manage:
            self.restore_tf32()
            if self.fp8 is not None and self.fp8.active:
                try:
                    self.fp8.revert()  # the user gets back the model they gave us
                except Exception as e:
                    self._warnings.warn("fp8-undo", f"could not undo the fp8 conversion: {e}", loud=True)


@contextlib.contextmanager
def _te_fp8_context(autocast: AbstractContextManager[Any]) -> Any:
    """bf16 autocast plus Transformer Engine's fp8_autocast (models built from TE modules)."""
    import transformer_engine.pytorch as te  # only reached when TE was found

    with autocast, te.fp8_autocast(enabled=True):
        yield
