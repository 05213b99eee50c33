"""The callback's options: :class:`CallbackOptions`, one field per ``GreenCallback``
keyword argument, checked before anything starts.

``GreenCallback(job, model, socket=..., initial_precision=..., ...)`` builds one
from its keyword arguments; ``GreenCallback(job, model, options=CallbackOptions(...))``
takes one made beforehand (keyword arguments given beside it override its fields).
The sender's timings and the accuracy guard's settings are handed on as
:class:`greend.training.sender.SenderOptions` and
:class:`greend.training.mixed_precision.PrecisionOptions`.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import os
from collections.abc import Callable, Iterable, Sequence, Set
from dataclasses import dataclass
from typing import Any, TypedDict

import torch

from greend.protocol import PRECISIONS
from greend.training.mixed_precision import DEFAULT_FP8_MIN_FEATURES, PrecisionOptions
from greend.training.sender import SenderOptions

__all__ = ["CallbackKwargs", "CallbackOptions"]


@dataclass
class CallbackOptions:
    """What :class:`greend.GreenCallback` takes besides ``job`` and ``model``.

    Where the daemon is and what this rank runs on:
        socket: the daemon's socket; else ``$GREEND_SOCKET``; else
            ``/run/greend/greend.sock``.
        gpus: node-local GPU indices this rank uses (overrides the model's device).
        device: the autocast device when there is no model (default: the model's, or cpu).

    FLOPs:
        flops_per_step: FLOPs of one step, if known: no counting.
        model_flops: estimate FLOPs as ``6 * params * tokens`` (``step(tokens=...)``).
        max_flop_counts: distinct shape keys counted with FlopCounterMode.

    Precision:
        precisions: levels the caller allows the daemon to choose (default: all that run
            here, except ``fp8-emulated``, which is offered only when listed here).
        manage_precision: False for adapters whose framework owns autocast: the
            callback then only reports ``initial_precision`` and changes no torch flag.
        initial_precision: the job's own level, where it starts (``"bf16"`` for a job that
            trains in bf16): the top of its ladder, which greend never goes above. Default:
            detected at the first step, the ``torch.autocast`` the job runs around its step
            or (with ``model=``) its model's forward, else fp32.
        precision_owner: with ``manage_precision=False``, who owns precision (for the
            reason a directive is refused).
        loss_scaling: True: the loop runs ``step.backward``/``step.optimizer_step`` (or
            ``cb.scaler``), so fp16 may run from step 0; False: fp16 is never applied;
            None (default): fp16 is applied once the loop has used one of them.
        fp8_min_features: linears narrower than this stay out of fp8 (default 1024).
        guard_window: finite losses kept for the guard's trend (default 32).
        cooldown_steps: steps a level stays barred after the guard rolled it back.
        spike_tolerance: after a downgrade, a loss this fraction above the trend before
            it rolls back at once (default 0.5; None: only non-finite steps do), within
            ``spike_steps`` steps of the downgrade (default 200: later jumps are the data's);
            with ``reference_loss``, only if the reference batch confirms it.
        reference_loss: a function of no arguments returning the loss (a one-element
            tensor) of a batch kept aside, e.g. ``lambda: loss_fn(model(x_ref), y_ref)``.
            With it, after a downgrade the callback compares that loss at the level in
            force with fp32's on the same weights every ``reference_every`` steps, for
            the rest of the run, and rolls back a level that is surely more than
            ``reference_tolerance`` worse (:mod:`greend.training.reference`).
        reference_every: steps between reference checks (default 50).
        reference_tolerance: the mean excess over fp32 a level may have (default None:
            the daemon precision policy's ``tolerance``, at most 0.02; 0.02 without one).
        probe_every: while the run is below its own level, every this many steps (after
            four blocks 50 steps apart right after the switch) a few steps run at the
            level above, and the level is rolled back when it is surely more than
            ``probe_tolerance`` worse than the level above at the same point in training
            (:mod:`greend.training.probe`; default 400; None: no probes). The probes run
            only where the daemon asks for them (it registers them).
        probe_tolerance: the penalty (relative training loss) a level may have against
            the level above (default None: the daemon precision policy's ``tolerance``,
            which its register reply tells, else 0.05, that policy's own default).
        probe_trial: where the probes run, a step down starts with a trial: the run stays
            at the level above but for two blocks of 5 steps at the new level, judged like
            the probes (turned round), and goes down once they pass, 116-148 steps later
            (default True; False: a directive applies at once, the probes after it).

    Reporting:
        mem_share: memory-bound share of a step, for simulated GPUs (0..0.95).
        max_pending: step records kept while the daemon is slow or gone.
        sync_every: every this many steps, ranks of a distributed job agree on its pace
            (the slowest node's uncapped step time) and precision through the job's
            rendezvous store, never a collective.
        heartbeat_s, flush_interval_s, connect_timeout_s, reply_timeout_s,
        stall_timeout_s, reconnect_min_s, reconnect_max_s, close_timeout_s: timings (seconds,
            :class:`greend.training.sender.SenderOptions`).
    """

    socket: str | os.PathLike[str] | None = None
    gpus: Sequence[int] | None = None
    device: str | torch.device | None = None
    flops_per_step: float | None = None
    model_flops: bool = False
    max_flop_counts: int = 8
    precisions: Iterable[str] | None = None
    manage_precision: bool = True
    initial_precision: str | None = None
    precision_owner: str | None = None
    loss_scaling: bool | None = None
    fp8_min_features: int = DEFAULT_FP8_MIN_FEATURES
    guard_window: int = 32
    cooldown_steps: int = 500
    spike_tolerance: float | None = 0.5
    spike_steps: int = 200
    reference_loss: Callable[[], torch.Tensor] | None = None
    reference_every: int = 50
    reference_tolerance: float | None = None
    probe_every: int | None = 400
    probe_tolerance: float | None = None
    probe_trial: bool = True
    mem_share: float | None = None
    max_pending: int = 10_000
    sync_every: int = 100
    # The sender's timings: their defaults are SenderOptions' own (one place for them).
    heartbeat_s: float = SenderOptions.heartbeat_s
    flush_interval_s: float = SenderOptions.flush_interval_s
    connect_timeout_s: float = SenderOptions.connect_timeout_s
    reply_timeout_s: float = SenderOptions.reply_timeout_s
    stall_timeout_s: float = SenderOptions.stall_timeout_s
    reconnect_min_s: float = SenderOptions.reconnect_min_s
    reconnect_max_s: float = SenderOptions.reconnect_max_s
    close_timeout_s: float = SenderOptions.close_timeout_s

    def checked(self, model: Any) -> tuple[SenderOptions, PrecisionOptions, list[str] | None]:
        """Every option checked (``ValueError`` names the first bad one): the sender's
        timings, the guard's settings, and the levels the caller allows (None: all)."""
        sender = SenderOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(SenderOptions)})
        _check_identity_arguments(self, model)
        _check_flops_arguments(self.flops_per_step, self.model_flops, model)
        if self.mem_share is not None and not (0.0 <= self.mem_share <= 0.95):
            raise ValueError(f"mem_share={self.mem_share!r}: must be between 0 and 0.95")
        if not isinstance(self.sync_every, int) or self.sync_every < 1:
            raise ValueError(f"sync_every={self.sync_every!r}: must be a whole number of steps >= 1")
        if self.reference_loss is not None and not callable(self.reference_loss):
            raise ValueError("reference_loss must be a function of no arguments that returns a loss tensor")
        every = self.reference_every
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"reference_every={every!r}: must be a whole number of steps >= 1")
        tolerance = self.reference_tolerance
        if tolerance is not None and not (
            isinstance(tolerance, (int, float)) and math.isfinite(tolerance) and tolerance > 0
        ):
            raise ValueError(f"reference_tolerance={tolerance!r}: must be a number > 0 (a fraction), or None")
        probe = self.probe_every
        if probe is not None and (not isinstance(probe, int) or isinstance(probe, bool) or probe < 1):
            raise ValueError(f"probe_every={probe!r}: must be a whole number of steps >= 1, or None (no probes)")
        probe_tol = self.probe_tolerance
        if probe_tol is not None and not (
            isinstance(probe_tol, (int, float)) and math.isfinite(probe_tol) and probe_tol > 0
        ):
            raise ValueError(f"probe_tolerance={probe_tol!r}: must be a number > 0 (a fraction), or None")
        if not isinstance(self.probe_trial, bool):
            raise ValueError(f"probe_trial={self.probe_trial!r}: must be True or False")
        if self.max_pending < 1 or self.max_flop_counts < 1:
            raise ValueError("max_pending and max_flop_counts must be >= 1")
        precision = PrecisionOptions(
            fp8_min_features=self.fp8_min_features,
            guard_window=self.guard_window,
            cooldown_steps=self.cooldown_steps,
            spike_tolerance=self.spike_tolerance,
            spike_steps=self.spike_steps,
        )
        return sender, precision, _check_levels(self.precisions, self.initial_precision)


def _is_index(value: Any) -> bool:
    """A whole number >= 0 (a numpy integer too), not a float, a string or a bool."""
    try:
        return operator.index(value) >= 0
    except TypeError:
        return False


def _check_identity_arguments(opts: CallbackOptions, model: Any) -> None:
    """What names the job's model, GPUs, device and socket: their types, said by name (a
    string of digits read as a list of GPUs, a float or a bool taken as an index, a truthy
    string taken for True went through)."""
    if model is not None and not isinstance(model, torch.nn.Module):
        raise ValueError(f"model={model!r}: the torch.nn.Module you train, or leave it out")
    gpus = opts.gpus
    if gpus is not None:
        if isinstance(gpus, int) and not isinstance(gpus, bool):
            raise ValueError(f"gpus={gpus!r}: a list of GPU indices, gpus=[{gpus}]")
        if isinstance(gpus, (str, bytes)) or not isinstance(gpus, Iterable):
            raise ValueError(f"gpus={gpus!r}: a list of node-local GPU indices, e.g. gpus=[0, 1]")
        # (an iterator is left to be read once, where the GPUs are resolved)
        seen = list(gpus) if isinstance(gpus, (Sequence, Set)) else []
        bad = [g for g in seen if isinstance(g, bool) or not _is_index(g)]
        if bad:
            raise ValueError(f"gpus={list(gpus)!r}: GPU indices are whole numbers >= 0 ({bad[0]!r} is not)")
    if opts.device is not None:
        try:
            torch.device(opts.device)
        except (RuntimeError, TypeError, ValueError) as e:
            raise ValueError(f"device={opts.device!r}: not a torch device ('cuda', 'cuda:1', 'cpu'): {e}") from None
    if opts.socket is not None and not isinstance(opts.socket, (str, os.PathLike)):
        raise ValueError(f"socket={opts.socket!r}: the daemon's socket path (a string or a Path)")
    for name in ("manage_precision", "model_flops"):
        value = getattr(opts, name)
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r}: True or False")
    if opts.precision_owner is not None and not isinstance(opts.precision_owner, str):
        raise ValueError(f"precision_owner={opts.precision_owner!r}: a name (a string), or None")


def _check_flops_arguments(flops_per_step: float | None, model_flops: bool, model: Any) -> None:
    if flops_per_step is not None and (
        not isinstance(flops_per_step, (int, float)) or not math.isfinite(flops_per_step) or flops_per_step < 0
    ):
        raise ValueError(f"flops_per_step={flops_per_step!r}: must be a finite number >= 0")
    if flops_per_step is not None and model_flops:
        raise ValueError("give flops_per_step= or model_flops=True, not both")
    if model_flops and model is None:
        raise ValueError("model_flops=True counts the model's parameters: pass model=")


def _check_levels(precisions: Iterable[str] | None, initial_precision: str | None) -> list[str] | None:
    """The levels the caller allows (None: every level that runs here), checked."""
    allowed = None if precisions is None else list(precisions)
    if allowed is not None:
        bad = [p for p in allowed if p not in PRECISIONS]
        if bad:
            raise ValueError(f"precisions: unknown level(s) {bad}; known: {', '.join(PRECISIONS)}")
    if initial_precision is not None and initial_precision not in PRECISIONS:
        raise ValueError(f"initial_precision={initial_precision!r}: one of {', '.join(PRECISIONS)}")
    return allowed


class CallbackKwargs(TypedDict, total=False):
    """``GreenCallback``'s keyword arguments as a type checker sees them: the fields of
    :class:`CallbackOptions` (``tests/training/test_callback_options.py`` holds the two
    to the same names and types)."""

    socket: str | os.PathLike[str] | None
    gpus: Sequence[int] | None
    device: str | torch.device | None
    flops_per_step: float | None
    model_flops: bool
    max_flop_counts: int
    precisions: Iterable[str] | None
    manage_precision: bool
    initial_precision: str | None
    precision_owner: str | None
    loss_scaling: bool | None
    fp8_min_features: int
    guard_window: int
    cooldown_steps: int
    spike_tolerance: float | None
    spike_steps: int
    reference_loss: Callable[[], torch.Tensor] | None
    reference_every: int
    reference_tolerance: float | None
    probe_every: int | None
    probe_tolerance: float | None
    probe_trial: bool
    mem_share: float | None
    max_pending: int
    sync_every: int
    heartbeat_s: float
    flush_interval_s: float
    connect_timeout_s: float
    reply_timeout_s: float
    stall_timeout_s: float
    reconnect_min_s: float
    reconnect_max_s: float
    close_timeout_s: float
