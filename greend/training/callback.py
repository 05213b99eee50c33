"""The training side's entry point: :class:`GreenCallback`.

A training process creates one callback per rank and wraps each training step
in :meth:`GreenCallback.step` (usage: the README's "The training callback" and
"Precision" sections). The pieces it is made of:

* :mod:`greend.training.identity`: the job id, ranks, GPUs and socket it registers with;
* :mod:`greend.training.step`: :class:`Step`, the hot path, and loss scaling;
* :mod:`greend.training.sender`: the background thread that owns the socket
  (non-blocking, fail-open, reconnecting);
* :mod:`greend.training.mixed_precision`: the precision levels, fp8 conversion
  and the accuracy guard; :mod:`greend.training.flops`: FLOP counting.

Only a bad constructor argument raises (``ValueError``); nothing else the
callback does raises into the training loop.

FLOPs (forward + backward) per step
-----------------------------------
Chosen in this order:

1. ``flops_per_step=`` given: used as is, no counting.
2. ``model_flops=True``: ``6 * params * tokens`` (the transformer rule; params
   are the model's trainable parameters, tokens come from ``step(tokens=...)``).
3. Otherwise the first step is **counted** with
   :class:`torch.utils.flop_counter.FlopCounterMode`, entered in the step's
   ``__enter__`` and read in its ``__exit__``, so everything the ``with`` block
   runs (forward and backward) is measured exactly; CPU attention is counted too
   (:mod:`greend.training.flops`). The count is cached per **shape key**: the
   ``shape_key=`` you pass to :meth:`GreenCallback.step` (any hashable, e.g. the
   sequence-length bucket), else a cheap signature of ``batch=`` (tensor shapes
   and dtypes, one level deep, :func:`greend.training.flops.batch_signature`), else, with
   ``model=``, the same signature of the model's inputs, which a forward pre-hook
   sees during the step (a new shape's first step keeps the previous count, and
   its next step is counted), else one key for the whole run. A new key is
   counted once, up to ``max_flop_counts`` distinct keys; beyond that new keys
   reuse the mean of the known counts.

Precision
---------
``cb.precision`` is the level steps run at (``fp32`` at start; the levels are in
:mod:`greend.training.mixed_precision`). ``step.autocast()`` returns the matching
context: ``fp32`` a null context with TF32 off, ``tf32`` a null context with
TF32 matmuls on, ``bf16``/``fp16`` ``torch.autocast(device_type, dtype)``, ``fp8``
and ``fp8-emulated`` bf16 autocast around a model whose large linears were
converted to torchao ``Float8Linear`` (same Parameter objects: the optimizer
and its state carry on). A directive from the daemon is applied at the next step
boundary; a level this process cannot run
(:meth:`GreenCallback.supported_precisions` says why), a level barred after a
rollback, or fp16 without loss scaling (see :mod:`greend.training.step`) is
never applied: the callback keeps the level it runs, reports a ``refused``
precision event with the reason, and logs it. The accuracy guard's rollbacks
(a non-finite loss or gradient, or a loss more than ``spike_tolerance`` above
the trend before a downgrade) are reported as ``rollback`` events.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import logging
import math
import os
import sys
import threading
import warnings
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from greend.errors import GreendWarning
from greend.protocol import FP8_LEVELS, PRECISIONS
from greend.training.flops import FlopCounter, batch_signature, model_params
from greend.training.identity import (
    DEFAULT_SOCKET,
    model_device,
    resolve_gpus,
    resolve_job,
    resolve_ranks,
    resolve_run,
    resolve_socket,
    socket_hostname,
)
from greend.training.loss_reader import LossReader
from greend.training.mixed_precision import (
    DEFAULT_FP8_MIN_FEATURES,
    Fp8Converter,
    PrecisionEvent,
    PrecisionOptions,
    fp8_targets,
    has_te_modules,
    precision_support,
    start_torchao_warm_up,
)
from greend.training.peers import JobPeers, default_store
from greend.training.reference import ReferenceJudge, excess
from greend.training.sender import Sender, SenderOptions, SenderStats
from greend.training.step import Step, _new_step

__all__ = ["DEFAULT_SOCKET", "GreenCallback", "SenderStats", "Step"]

# Steps whose loss may be in flight at once before the oldest is waited for: a GPU
# queue this deep behind the CPU is already the user's own back-pressure.
_MAX_UNJUDGED = 8
# Steps whose losses are read together, in one pass at the end of the last of them,
# while the guard is not watching for spikes. Python that runs right after a step's
# torch work finds its caches cold and runs several times slower than in a loop:
# reading and recording 16 steps at once costs a fraction of 16 single passes
# (bench/bench_callback.py). A non-finite loss then rolls back up to this many steps
# later; during the spike window after a downgrade every step is read at its end.
_JUDGE_BATCH = 16
# ... or when the oldest of them ended this long ago (slow steps are read one by one;
# the daemon hears of a step at most this much later than it would have).
_JUDGE_WITHIN_S = 0.05

log = logging.getLogger(__name__)

# fp8 levels run the layers that stay out of fp8 (head, norms, small linears) in bf16.
_AUTOCAST_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.bfloat16,
    "fp8-emulated": torch.bfloat16,
}
_NULL_CONTEXT = contextlib.nullcontext()
_FLOPS_FROM_TOKENS = -1.0  # a Step's flops placeholder under model_flops=True (compared with `is`)
_Tensor = torch.Tensor


class GreenCallback:
    """Reports a training process's steps to greend and applies its precision directives.

    Args:
        job: job id shared by all ranks (fallbacks: :mod:`greend.training.identity`).
        model: the model (its device picks GPUs and the autocast device; its
            parameters feed ``model_flops``). Optional.
        socket: the daemon's socket; else ``$GREEND_SOCKET``; else
            ``/run/greend/greend.sock``.
        gpus: node-local GPU indices this rank uses (overrides the model's device).
        device: the autocast device when there is no model (default: the model's, or cpu).
        flops_per_step: FLOPs of one step, if known: no counting.
        model_flops: estimate FLOPs as ``6 * params * tokens`` (``step(tokens=...)``).
        precisions: levels the caller allows the daemon to choose (default: all that run
            here, except ``fp8-emulated``, which is offered only when listed here).
        manage_precision: False for adapters whose framework owns autocast: the
            callback then only reports ``initial_precision`` and changes no torch flag.
        initial_precision: the level at start (default fp32).
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
        mem_share: memory-bound share of a step, for simulated GPUs (0..0.95).
        max_pending: step records kept while the daemon is slow or gone.
        max_flop_counts: distinct shape keys counted with FlopCounterMode.
        heartbeat_s, flush_interval_s, connect_timeout_s, reply_timeout_s,
        stall_timeout_s, reconnect_min_s, reconnect_max_s, close_timeout_s: timings (seconds,
            :class:`greend.training.sender.SenderOptions`).
        sync_every: every this many steps, ranks of a distributed job agree on its pace
            (the slowest node's uncapped step time) through the job's rendezvous store,
            never a collective (see ``_sync_pace``).
        reference_loss: a function of no arguments returning the loss (a one-element
            tensor) of a batch kept aside, e.g. ``lambda: loss_fn(model(x_ref), y_ref)``.
            With it, after a downgrade the callback compares that loss at the level in
            force with fp32's on the same weights every ``reference_every`` steps, for
            the rest of the run, and rolls back a level that is surely more than
            ``reference_tolerance`` worse (:mod:`greend.training.reference`).
        reference_every: steps between reference checks (default 50).
        reference_tolerance: the mean excess over fp32 a level may have (default 0.02).
    """

    def __init__(
        self,
        job: str | None = None,
        model: torch.nn.Module | None = None,
        *,
        socket: str | os.PathLike[str] | None = None,
        gpus: Sequence[int] | None = None,
        device: str | torch.device | None = None,
        flops_per_step: float | None = None,
        model_flops: bool = False,
        precisions: Iterable[str] | None = None,
        manage_precision: bool = True,
        initial_precision: str = "fp32",
        precision_owner: str | None = None,
        loss_scaling: bool | None = None,
        fp8_min_features: int = DEFAULT_FP8_MIN_FEATURES,
        guard_window: int = 32,
        cooldown_steps: int = 500,
        spike_tolerance: float | None = 0.5,
        spike_steps: int = 200,
        mem_share: float | None = None,
        max_pending: int = 10_000,
        max_flop_counts: int = 8,
        heartbeat_s: float = 5.0,
        flush_interval_s: float = 0.1,
        connect_timeout_s: float = 1.0,
        reply_timeout_s: float = 5.0,
        stall_timeout_s: float = 10.0,
        reconnect_min_s: float = 2.0,
        reconnect_max_s: float = 5.0,
        close_timeout_s: float = 2.0,
        sync_every: int = 100,
        reference_loss: Callable[[], torch.Tensor] | None = None,
        reference_every: int = 50,
        reference_tolerance: float = 0.02,
    ) -> None:
        # Every argument is checked before anything starts (the records check their own).
        sender_options = SenderOptions(
            heartbeat_s=heartbeat_s,
            flush_interval_s=flush_interval_s,
            connect_timeout_s=connect_timeout_s,
            reply_timeout_s=reply_timeout_s,
            stall_timeout_s=stall_timeout_s,
            reconnect_min_s=reconnect_min_s,
            reconnect_max_s=reconnect_max_s,
            close_timeout_s=close_timeout_s,
        )
        _check_flops_arguments(flops_per_step, model_flops, model)
        if mem_share is not None and not (0.0 <= mem_share <= 0.95):
            raise ValueError(f"mem_share={mem_share!r}: must be between 0 and 0.95")
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every={sync_every!r}: must be a whole number of steps >= 1")
        if reference_loss is not None and not callable(reference_loss):
            raise ValueError("reference_loss must be a function of no arguments that returns a loss tensor")
        if not isinstance(reference_every, int) or isinstance(reference_every, bool) or reference_every < 1:
            raise ValueError(f"reference_every={reference_every!r}: must be a whole number of steps >= 1")
        if not (
            isinstance(reference_tolerance, (int, float))
            and math.isfinite(reference_tolerance)
            and reference_tolerance > 0
        ):
            raise ValueError(f"reference_tolerance={reference_tolerance!r}: must be a number > 0 (a fraction)")
        if max_pending < 1 or max_flop_counts < 1:
            raise ValueError("max_pending and max_flop_counts must be >= 1")
        precision_options = PrecisionOptions(
            fp8_min_features=fp8_min_features,
            guard_window=guard_window,
            cooldown_steps=cooldown_steps,
            spike_tolerance=spike_tolerance,
            spike_steps=spike_steps,
        )
        allowed = _check_levels(precisions, initial_precision)

        # Who this process is.
        self.job = resolve_job(job)
        self.rank, self.local_rank, self.world_size = resolve_ranks()
        try:
            store = default_store()
        except Exception as e:
            log.debug("no rendezvous store for the run id: %s", e)
            store = None
        self.run = resolve_run(self.job, self.world_size, store)
        self._register_omit: set[str] = set()
        self.device = model_device(model, device)
        self.gpus = resolve_gpus(self.device, gpus)
        self.host = socket_hostname()
        self.socket_path = resolve_socket(socket)
        self.manage_precision = manage_precision
        self._mem_share = mem_share
        self._model = model

        self._init_precision(precision_options, allowed, initial_precision, precision_owner, loss_scaling)
        # The reference check (greend.training.reference): fixed-batch losses in flight
        # (step, level, fp32 handle, level handle), judged once they have landed.
        self._reference = reference_loss if self.manage_precision else None
        self._reference_every = reference_every
        self._reference_judge = ReferenceJudge(tolerance=float(reference_tolerance))
        self._reference_pending: deque[tuple[int, str, Any, Any]] = deque()
        self._init_flops(flops_per_step, model_flops, max_flop_counts)

        # Pace agreement across nodes (see _sync_pace): the daemon's local figure, written
        # by the sender; the agreed one, written by the training thread for the sender.
        self.sync_every = sync_every
        self._local_pace_s: float | None = None
        self._agreed_pace_s: float | None = None
        self.agreed_pace_s: float | None = None  # the last figure all ranks agreed on
        self._peers: JobPeers | None = None  # the job's rendezvous store, once reached
        # Precision is one decision per job: in a job of several ranks a directive is a
        # proposal, and every sync_every steps the ranks agree (through the same store)
        # on the most precise level any of them wants, which all apply at the same step
        # (see _agree_precision). _entered counts the steps entered: the agreement's clock.
        self._agreeing = self.world_size > 1 and self.manage_precision
        self._proposal: str | None = None
        self._entered = 0

        # Hot-path state: the training thread appends records, the sender takes them.
        self._queue: deque[tuple[Any, ...]] = deque(maxlen=max_pending)
        self._next_index = 0
        self.stats = SenderStats()
        self._warned: set[str] = set()
        self._warn_lock = threading.Lock()
        self._first_warning_done = False
        self._closed = False

        self._sender = Sender(self, sender_options)
        self._close_timeout_s = close_timeout_s
        if self._fixed_flops is None and not model_flops and "torch._dynamo" not in sys.modules:
            threading.Thread(target=_warm_up_flop_counter, name="greend-warmup", daemon=True).start()
        self._sender.start()
        # Give the first registration a moment, so a directive in its reply applies from step 0.
        self._sender.first_attempt.wait(connect_timeout_s)
        atexit.register(self._atexit)

    def _init_precision(
        self,
        options: PrecisionOptions,
        allowed: list[str] | None,
        initial_precision: str,
        precision_owner: str | None,
        loss_scaling: bool | None,
    ) -> None:
        """The precision state (written by the training thread only) and the level at start."""
        model = self._model
        self._guard = options.guard()
        self._losses = LossReader()  # reads step losses without a stream sync
        self._ended: list[Step] = []  # ended steps whose loss has not been read yet
        self._judge_every = _JUDGE_BATCH  # read the ended steps when this many have gathered
        self._judge_by = 0.0  # ... or when a step ends after this (monotonic seconds)
        self._judge_within_s = _JUDGE_WITHIN_S
        self._max_unjudged = _MAX_UNJUDGED
        self._unjudged: deque[Step] = deque()  # ended steps whose loss is still in flight
        self._events: deque[dict[str, Any]] = deque(maxlen=64)  # precision events for the sender
        self._loss_scaling = loss_scaling
        self._scaling_seen = bool(loss_scaling)
        self._scaler: Any = None  # torch.amp.GradScaler, made on the first fp16 step
        self._fp8: Fp8Converter | None = None
        self._fp8_te = False  # fp8 through Transformer Engine's fp8_autocast (no conversion)
        if self.manage_precision:
            self._support = precision_support(
                self.device, allowed, model=model, fp8_min_features=options.fp8_min_features
            )
            if loss_scaling is False and self._support.get("fp16") is None:
                self._support["fp16"] = "loss_scaling=False: fp16 needs a GradScaler"
            fp8_ok = [level for level in FP8_LEVELS if self._support.get(level) is None]
            if fp8_ok and model is not None:
                if "fp8" in fp8_ok and has_te_modules(model):
                    self._fp8_te = True
                else:
                    self._fp8 = Fp8Converter(model, fp8_targets(model, options.fp8_min_features), emulate=False)
                    start_torchao_warm_up()
        else:
            owner = precision_owner or "the training framework owns autocast; see greend.integrations"
            self._support = {
                level: (None if level == initial_precision else f"not switched here: {owner}") for level in PRECISIONS
            }
        if self._support.get(initial_precision) is not None:
            raise ValueError(
                f"initial_precision={initial_precision!r} cannot run here: {self._support[initial_precision]}"
            )
        self._autocast_device = self.device.type if self.device.type in ("cuda", "cpu", "xpu", "mps") else "cpu"
        self._saved_tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        self._precision = "fp32"
        self.refused: dict[str, str] = {}  # level -> why the callback did not apply it
        self._event_log: deque[dict[str, Any]] = deque(maxlen=256)
        self._apply_level(initial_precision)
        # The sender writes _requested (a str); the training thread compares it to _seen_request.
        self._requested: str | None = None
        self._seen_request: str | None = None

    def _init_flops(self, flops_per_step: float | None, model_flops: bool, max_flop_counts: int) -> None:
        """The FLOPs state: a fixed figure, 6 * params * tokens, or counted per shape key."""
        model = self._model
        self._fixed_flops: float | None = float(flops_per_step) if flops_per_step is not None else None
        self._params = model_params(model) if model_flops and model is not None else 0
        self._model_flops = model_flops
        # A step's FLOPs unless it says: the fixed figure, 6 * params * tokens once the step
        # ends (tokens may be set late), or None: counted per shape.
        self._default_flops: Any = (
            self._fixed_flops if self._fixed_flops is not None else _FLOPS_FROM_TOKENS if model_flops else None
        )
        self._flop_cache: dict[Hashable, int] = {}
        self._max_flop_counts = max_flop_counts
        self._counter = FlopCounter()
        # With a model and counted FLOPs, and steps given neither batch= nor shape_key=,
        # a forward pre-hook sees each step's input shapes, so a shape change is re-counted.
        # It is put on the model by the first such step, never before: a module with a
        # hook takes torch's slower call path on every forward (a few microseconds).
        self._current: Step | None = None
        self._last_forward_signature: Hashable | None = None
        self._forward_hook: Any = None
        self._hook_failed = False

    def _register_fields(self) -> dict[str, Any]:
        """The ``register`` request's fields (made at each connect: a level that failed since is left out)."""
        fields: dict[str, Any] = {
            "job": self.job,
            "run": self.run,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "gpus": self.gpus,
            "host": self.host,
            "precisions": [level for level in PRECISIONS if self._support.get(level) is None],
        }
        if self._mem_share is not None:
            fields["mem_share"] = self._mem_share
        if self._fixed_flops is not None:
            fields["flops_per_step"] = self._fixed_flops
        if self._reference is not None:
            fields["reference_every"] = self._reference_every
        for name in self._register_omit:  # fields an older daemon does not know
            fields.pop(name, None)
        return fields

    # Public API --------------------------------------------------------------------
    def step(
        self,
        *,
        samples: int | None = None,
        tokens: int | None = None,
        batch: Any = None,
        shape_key: Hashable | None = None,
        index: int | None = None,
        flops: float | None = None,
    ) -> Step:
        """A context manager around one training step (forward, backward, optimizer).

        ``samples``/``tokens``: throughput counts. ``batch``: the step's input,
        used only for a cheap shape signature (FLOPs are re-counted when it
        changes). ``shape_key``: your own cache key instead (wins over
        ``batch``). ``index``: the step number (default: a counter from 0).
        ``flops``: this step's FLOPs, overriding everything else.
        """
        if flops is None:
            flops = self._default_flops
            if flops is None and shape_key is None and batch is not None:
                # The key FLOPs are cached under: a tensor's shape (its dtype does not
                # change the model's FLOPs), else the batch's signature.
                shape_key = batch.shape if type(batch) is _Tensor else _signature_or_none(batch)
        if _new_step is not None:
            return _new_step(Step, self, index, samples, tokens, shape_key, flops)
        return Step(self, index, samples, tokens, shape_key, flops)

    def _enter_agreeing(self) -> None:
        """At each step's start while the ranks agree on their level: every
        ``sync_every``-th step, the agreement (:meth:`_agree_precision`)."""
        n = self._entered
        self._entered = n + 1
        if n % self.sync_every == 0:
            self._agree_precision(n // self.sync_every)

    @property
    def precision(self) -> str:
        """The level the next step runs at (after pending directives are applied)."""
        requested = self._requested
        if requested is not self._seen_request:
            self._take_request(requested)
        return self._precision

    @property
    def requested_precision(self) -> str | None:
        """The level the daemon last asked for (None before any directive)."""
        return self._requested

    def supported_precisions(self) -> dict[str, str | None]:
        """Every level -> ``None`` if it can run here, else the reason it cannot."""
        return dict(self._support)

    @property
    def scaler(self) -> Any:
        """The :class:`torch.amp.GradScaler` while the current level needs one (fp16), else None.

        For loops that do their own backward: ``cb.scaler.scale(loss).backward()``,
        ``cb.scaler.step(opt)``, ``cb.scaler.update()`` when it is not None.
        ``step.backward``/``step.optimizer_step`` do this for you.
        """
        self._scaling_seen = True
        if self.precision != "fp16" or not self.manage_precision:
            return None
        return self._get_scaler()

    @property
    def reference_checks(self) -> list[dict[str, Any]]:
        """The reference checks made (step, level, fp32 and level losses, excess), oldest first."""
        return list(self._reference_judge.log)

    @property
    def precision_events(self) -> list[dict[str, Any]]:
        """Rollbacks and refusals this callback made (as sent to the daemon), oldest first."""
        return list(self._event_log)

    def autocast(self) -> AbstractContextManager[Any]:
        """The context for the current precision (same as ``step.autocast()``)."""
        return self._autocast_for(self.precision)

    @property
    def connected(self) -> bool:
        return self.stats.connected

    def flush(self) -> None:
        """Read the losses of the steps that have ended and hand the steps to the sender
        now, never waiting for the GPU (a loss still in flight goes with a later step).

        The callback reads ended steps in batches (up to 16 steps or 50 ms), so the last
        few steps before a pause in training reach the daemon only when the next step
        ends. Call this before a long pause (an evaluation, a checkpoint) for the daemon
        to hear of them now; the Lightning and Hugging Face adapters do. From the
        training thread only, between steps. Never raises (a failure is logged once)."""
        if self._closed or not (self._ended or self._unjudged):
            return
        try:
            self._drain()  # never waits
        except Exception as e:  # never the training's problem
            self._warn_once("flush", f"reading the ended steps failed: {type(e).__name__}: {e}")

    def close(self, reason: str = "finished") -> None:
        """Flush the remaining steps, send ``end``, stop the sender. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            atexit.unregister(self._atexit)
        except Exception:
            pass
        try:
            self._drain(keep=0)  # training is over: waiting for the last losses costs nothing
            self._read_reference(wait=True)
        except Exception as e:
            log.debug("reading the last losses failed: %s", e)
        try:
            self._sender.stop(reason, self._close_timeout_s)
        except Exception as e:
            log.debug("closing the sender failed: %s", e)
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        if self.manage_precision:
            self._restore_tf32()
            if self._fp8 is not None and self._fp8.active:
                try:
                    self._fp8.revert()  # the user gets back the model they gave us
                except Exception as e:
                    log.warning("greend: could not undo the fp8 conversion: %s", e)

    def __enter__(self) -> GreenCallback:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close("finished" if exc_type is None else "error")

    def _atexit(self) -> None:
        self.close("exit")

    # Hot-path helpers ----------------------------------------------------------------

    def _drain(self, keep: int | None = None) -> None:
        """Start reading the ended steps' losses, then record the steps whose loss has
        landed, oldest first. ``keep``: wait for the oldest while more than this many are
        in flight (None: never wait; 0 at the end, where a wait costs nothing)."""
        q = self._unjudged
        ended = self._ended
        if ended:
            self._ended = []
            start = self._losses.start
            for step in ended:
                raw = step._raw
                if raw is not None:
                    step._raw = None
                    if type(raw) is float:
                        step._pending = (raw, None)  # a number: known already
                    else:
                        try:
                            step._pending = start(raw)
                        except Exception as e:
                            self._warn_once("loss", f"step.loss() cannot read this tensor ({e}): ignored")
                q.append(step)
        value_of = self._losses.value
        while q:
            step = q[0]
            if step._pending is not None:
                value = value_of(step._pending, wait=keep is not None and len(q) > keep)
                if value is None:
                    break
                step._pending = None
                step._judge(value)
            q.popleft()
            self._judged(step)
        # Every step at its end while the spike rule holds (a spike rolls back from the
        # next step), else in batches.
        guard = self._guard
        spiking = (
            guard.stack
            and guard.spike_tolerance is not None
            and self._next_index - guard.stack[-1].step < guard.spike_steps
        )
        self._judge_every = 1 if spiking else _JUDGE_BATCH

    def _judged(self, step: Step) -> None:
        self._record(step)
        if step._spike_reason and not step._nonfinite and self._reference is not None:
            step._spike_reason = self._confirm_spike(step._spike_reason)
        if (step._nonfinite or step._spike_reason) and step.precision == self._precision:
            # the next step runs at the level we came down from
            self._roll_back(step, None if step._nonfinite else step._spike_reason)
        elif self._reference is not None:
            if self._reference_pending:
                self._read_reference()
            index = self._next_index - 1  # this step's (set by _record)
            if self._guard.armed and (index + 1) % self._reference_every == 0 and not self._reference_pending:
                self._start_reference(index)
                self._read_reference()  # landed already on the CPU; on a GPU, judged a step or two later

    def _record(self, step: Step) -> None:
        index = step.index
        if index is None:
            index = self._next_index
        self._next_index = index + 1
        if step.flops is _FLOPS_FROM_TOKENS:
            if step.tokens is None:
                self._warn_once("tokens", "model_flops=True needs step(tokens=...): reporting 0 FLOPs")
                step.flops = 0.0
            else:
                step.flops = 6.0 * self._params * step.tokens
        q = self._queue
        if len(q) == q.maxlen:
            self.stats.dropped += 1  # the append below pushes out the oldest record
        q.append(
            (
                index,
                step.t0_s,
                step.t1_s,
                step.flops,
                step.samples,
                step.tokens,
                step._loss,
                step._nonfinite,
                step.precision,
            )
        )
        self.stats.recorded += 1
        if self.world_size > 1 and (index + 1) % self.sync_every == 0:
            self._sync_pace(index)

    def _sync_pace(self, index: int) -> None:
        """Agree on the job's pace with the other ranks, at a decision point.

        Each node's daemon measures this rank's uncapped step time and pushes it
        (event ``local_pace``). Every ``sync_every`` steps each rank writes it to the
        job's rendezvous store and reads the MAX the ranks wrote one period earlier
        (:class:`greend.training.peers.JobPeers`): the slowest node sets a synchronous
        job's pace, so a faster node's daemon may cap its GPUs down to that pace (plus
        its bound) without making any node the straggler. No collective on the job's
        process group, so ranks without a callback or at other steps are never waited
        for; a failure here is logged once and never raised.
        """
        try:
            if self._peers is None:
                self._peers = JobPeers.of_process_group(self.job, self.rank)
                if self._peers is None:
                    return
            agreed = self._peers.agree_max("pace", (index + 1) // self.sync_every, self._local_pace_s)
        except Exception as e:
            self._warn_once("pace", f"greend could not agree the job's pace across ranks: {e}")
            return
        if agreed is not None and agreed > 0:
            self.agreed_pace_s = agreed
            self._agreed_pace_s = agreed  # the sender sends it as op "pace"

    def _plan_flops(self, step: Step) -> None:
        key = step._shape_key
        if key is not None:
            try:
                hash(key)
            except TypeError:
                key = step._shape_key = repr(key)
        elif self._forward_hook is not None or self._hook_forward():
            # Neither batch= nor shape_key=: the model's forward pre-hook tells the shape,
            # but only once the step runs. Guess the last step's; the step's end corrects it.
            key = step._shape_key = self._last_forward_signature
            step._shape_guessed = True
            self._current = step
        cached = self._flop_cache.get(key)
        if cached is not None:
            step.flops = cached
            return
        if len(self._flop_cache) >= self._max_flop_counts:
            if "flopcache" not in self._warned:
                self._warn_once(
                    "flopcache",
                    f"more than {self._max_flop_counts} distinct input shapes: "
                    "new shapes reuse the mean FLOP count (pass shape_key= buckets or "
                    "flops_per_step=)",
                    level=logging.INFO,
                )
            step.flops = sum(self._flop_cache.values()) / len(self._flop_cache)
            return
        if self._counter.active:  # a nested step: let the outer one count
            step.flops = 0
            return
        step._counting = self._counter.start()
        if not step._counting:
            step.flops = 0

    def _hook_forward(self) -> bool:
        """Put the forward pre-hook on the model (once); whether it is there."""
        model = self._model
        if model is None or self._hook_failed:
            return False
        try:
            self._forward_hook = model.register_forward_pre_hook(self._on_forward, with_kwargs=True)
        except Exception as e:
            self._hook_failed = True
            log.debug("no forward pre-hook on the model: %s", e)
            return False
        return True

    def _on_forward(self, module: Any, args: Any, kwargs: Any) -> None:
        """The model's forward pre-hook: the signature of the step's first forward inputs."""
        step = self._current
        if step is not None and step._shape_guessed and step._forward_signature is None:
            try:
                step._forward_signature = batch_signature((*args, *kwargs.values()))
            except Exception:
                pass

    def _store_count(self, key: Hashable | None, counted: int | None) -> int:
        if counted is None:
            return 0
        self._flop_cache[key] = counted
        log.debug("counted %d FLOPs per step for shape key %r", counted, key)
        return counted

    def _take_request(self, level: str | None) -> None:
        """Take the daemon's latest directive at a step boundary: apply it (or, in a job
        of several ranks, propose it to the others), or refuse it with a reason."""
        self._seen_request = level
        self.flush()  # the guard decides on every loss that is in
        if level is None or level == self._precision:
            self._proposal = None  # the daemon no longer asks for another level
            return
        step = self._next_index
        reason = self._support.get(level, f"unknown precision level {level!r}")
        if reason is None:
            reason = self._guard.barred_reason(level, step)
        if reason is None and level == "fp16" and self.manage_precision and not self._scaling_seen:
            reason = (
                "fp16 needs loss scaling: run the step's backward and optimizer step through "
                "step.backward(loss) and step.optimizer_step(opt), or cb.scaler, or pass "
                "loss_scaling=True"
            )
        if reason is None:
            if self._agreeing:
                self._proposal = level
                log.info("precision %s proposed to the job's ranks (greend directive)", level)
                return
            reason = self._switch(level, "greend directive")
            if reason is None:
                return
        self.refused[level] = reason
        self._warn_once(
            f"refuse:{level}",
            f"greend asked for precision {level}; staying at {self._precision}: {reason}",
            level=logging.WARNING,
        )
        self._send_event(
            PrecisionEvent(
                "refused",
                self._precision,
                level,
                reason,
                step=step,
                loss=self._guard.losses[-1] if self._guard.losses else None,
                trend=self._guard.trend(),
            )
        )

    def _switch(self, level: str, why: str) -> str | None:
        """Run the next steps at ``level``; the reason it could not, or None."""
        old = self._precision
        try:
            self._apply_level(level)
        except Exception as e:
            reason = f"switching to {level} failed: {type(e).__name__}: {e}"
            self._support[level] = reason  # never again in this process
            return reason
        log.info("precision %s -> %s (%s)", old, level, why)
        if self.manage_precision:
            self._guard.on_switch(old, level, self._next_index)
            self._judge_every = 1  # read each step from now on while the spike rule holds
        return None

    def _agree_precision(self, epoch: int) -> None:
        """At the start of every ``sync_every``-th step: the job's ranks agree on its level.

        Each rank writes the level it wants (its daemon's directive where it can run it,
        else the level it runs) for this epoch, and reads what the ranks wrote one epoch
        ago: the most precise of those levels (a MAX, as for the pace). Ranks in step read
        the same key at the same step, so they switch together: down only when every
        rank's daemon asks for it, up (a rollback on any rank) for all. Where the ranks
        have no store to meet in, a rank applies its own directives, as a single process
        does; a failure is logged once and never raised."""
        try:
            if self._peers is None:
                self._peers = JobPeers.of_process_group(self.job, self.rank)
            peers = self._peers
            if peers is not None:
                wanted = self._proposal or self._precision
                agreed = peers.agree_max("precision", epoch, float(len(PRECISIONS) - PRECISIONS.index(wanted)))
        except Exception as e:
            self._warn_once("agree", f"greend could not agree the job's precision across ranks: {e}")
            peers = None
        if peers is None:
            self._agreeing = False
            if self._proposal is not None:
                self._proposal = None
                self._seen_request = None  # the directive is taken again, alone, at the next step
            return
        if agreed is None:
            return
        level = PRECISIONS[max(0, min(len(PRECISIONS) - 1, len(PRECISIONS) - int(agreed)))]
        if level == self._proposal:
            self._proposal = None
        self.flush()  # a rollback among the losses already in goes first
        old = self._precision
        if level == old or self._support.get(level) is not None:
            return
        step = self._next_index
        if self._switch(level, f"agreed by the job's ranks at step {step}") is None and (
            PRECISIONS.index(level) < PRECISIONS.index(old)
        ):
            # Up: another rank rolled back. This rank's daemon hears it as a rollback.
            self._send_event(
                PrecisionEvent(
                    "rollback",
                    old,
                    level,
                    f"another rank of the job went back to {level}; the ranks agreed at step {step}",
                    step=step,
                    loss=self._guard.losses[-1] if self._guard.losses else None,
                    trend=self._guard.trend(),
                )
            )

    def _start_reference(self, index: int) -> None:
        """Evaluate the reference batch in fp32 and at the level in force, on the same
        weights; the values are read (never waited for) by :meth:`_read_reference`."""
        level = self._precision
        model = self._model
        modes = [(m, m.training) for m in model.modules()] if model is not None else []
        try:
            with torch.no_grad():
                if model is not None:
                    model.eval()  # dropout off: the two passes differ only by the precision
                try:
                    with self._full_precision():
                        fp32 = self._reference()  # type: ignore[misc]
                    with self._autocast_for(level):
                        low = self._reference()  # type: ignore[misc]
                finally:
                    for m, training in modes:
                        m.training = training
            handles = (self._losses.start(fp32), self._losses.start(low))
        except Exception as e:
            self._reference = None
            self._warn_once("reference", f"reference_loss failed ({type(e).__name__}: {e}); no more reference checks")
            if self._fp8 is not None and level in FP8_LEVELS and not self._fp8.active:
                self._rollback_now(index, "fp8 could not be put back after the reference check", None)
            return
        self._reference_pending.append((index, level, *handles))

    def _confirm_spike(self, spike: str) -> str | None:
        """A loss spike, looked at on the reference batch (waiting for the values: a
        spike is rare): the precision's doing only if the level is worse than fp32 there
        by more than the reference tolerance; else the data changed, and nothing rolls back."""
        index = self._next_index - 1
        self._read_reference(wait=True)
        self._start_reference(index)
        if not self._reference_pending:
            return spike  # the reference failed: the spike rule stands alone
        _, level, h_fp32, h_low = self._reference_pending.pop()
        low, fp32 = self._losses.value(h_low, wait=True), self._losses.value(h_fp32, wait=True)
        if low is None or fp32 is None:
            return spike
        self._reference_judge.log.append(
            {"step": index, "level": level, "fp32": fp32, "loss": low, "excess": None, "spike": True}
        )
        worse = excess(fp32, low) if math.isfinite(low) and math.isfinite(fp32) else math.inf
        if worse > self._reference_judge.tolerance:
            return f"{spike}; on the reference batch {level} is {worse:+.1%} over fp32"
        self._guard.data_changed()  # the trend before the switch no longer says anything
        log.info(
            "greend: loss spike at step %d not confirmed on the reference batch (%s %+.2f%% over fp32): "
            "a change in the data, not the precision; staying at %s",
            index,
            level,
            100 * worse,
            level,
        )
        return None

    @contextlib.contextmanager
    def _full_precision(self) -> Any:
        """fp32 for the reference pass: no autocast, no TF32, fp8 linears swapped back."""
        fp8 = self._fp8 if self._fp8 is not None and self._fp8.active else None
        flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        if fp8 is not None:
            fp8.revert()
        try:
            with torch.autocast(self._autocast_device, enabled=False):
                yield
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
            if fp8 is not None:
                fp8.convert()

    def _read_reference(self, wait: bool = False) -> None:
        """Judge the reference checks whose values have landed (``wait``: all of them)."""
        q = self._reference_pending
        while q:
            index, level, h_fp32, h_low = q[0]
            low = self._losses.value(h_low, wait=wait)  # queued last: when it is in, both are
            if low is None:
                return
            fp32 = self._losses.value(h_fp32, wait=True)
            q.popleft()
            if fp32 is None or level != self._precision:
                continue  # the level changed while the values were in flight
            why = self._reference_judge.judge(index, level, fp32, low)
            if why is not None:
                self._rollback_now(self._next_index - 1, f"reference check at step {index}: {why}", low, fp32)

    def _roll_back(self, step: Step, spike: str | None = None) -> None:
        """The guard's fast rules: a non-finite step, or a loss spike, below a level we
        came down from."""
        index = step.index if step.index is not None else self._next_index - 1
        ev = self._guard.rollback(self._precision, index, step._nonfinite_cause, step._loss, spike)
        self._apply_rollback(ev, index)

    def _rollback_now(self, index: int, cause: str, loss: float | None, trend: float | None = None) -> None:
        """Roll the latest downgrade back for ``cause`` (the reference check's rule)."""
        ev = self._guard.rollback(self._precision, index, "loss", loss, cause=cause)
        if ev is not None and trend is not None:
            ev.trend = trend
        self._apply_rollback(ev, index)

    def _apply_rollback(self, ev: PrecisionEvent | None, index: int) -> None:
        if ev is None:
            return
        try:
            self._apply_level(ev.to_level)
        except Exception as e:
            log.error("greend: rolling back to %s failed: %s", ev.to_level, e)
            return
        self._guard.on_switch(ev.from_level, ev.to_level, index + 1)
        log.warning("greend: precision rollback %s -> %s: %s", ev.from_level, ev.to_level, ev.reason)
        self._send_event(ev)

    def _send_event(self, ev: PrecisionEvent) -> None:
        fields = ev.fields()
        self._event_log.append(fields)
        self._events.append(fields)  # the sender thread sends it as op "precision_event"

    def _get_scaler(self) -> Any:
        if self._scaler is None:
            try:
                self._scaler = torch.amp.GradScaler(self._autocast_device)
            except Exception as e:
                self._warn_once("scaler", f"cannot make a GradScaler for {self._autocast_device}: {e}")
                return None
        return self._scaler

    def _apply_level(self, level: str) -> None:
        if self.manage_precision:
            fp8 = self._fp8
            if level in FP8_LEVELS and fp8 is not None:
                emulate = level == "fp8-emulated"
                if fp8.active and fp8.emulate != emulate:
                    fp8.revert()
                fp8.emulate = emulate
                n = fp8.convert()  # raises (model unchanged) if torchao cannot
                log.info("greend: %d linear layer(s) run in %s", n, level)
            elif fp8 is not None and fp8.active:
                fp8.revert()
            if level == "tf32":
                torch.backends.cuda.matmul.allow_tf32 = True
                torch.backends.cudnn.allow_tf32 = True
            elif level == "fp32":
                torch.backends.cuda.matmul.allow_tf32 = False
                torch.backends.cudnn.allow_tf32 = False
            else:
                self._restore_tf32()
        self._precision = level

    def _restore_tf32(self) -> None:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self._saved_tf32

    def _autocast_for(self, level: str) -> AbstractContextManager[Any]:
        if not self.manage_precision:
            return _NULL_CONTEXT
        dtype = _AUTOCAST_DTYPES.get(level)
        if dtype is None:
            return _NULL_CONTEXT
        ctx = torch.autocast(self._autocast_device, dtype=dtype)
        if self._fp8_te and level == "fp8":
            return _te_fp8_context(ctx)
        return ctx

    # Warnings ------------------------------------------------------------------------
    def _warn_once(self, key: str, message: str, *, level: int = logging.WARNING) -> None:
        """Log ``message`` once per key; the very first problem is also a GreendWarning."""
        with self._warn_lock:
            if key in self._warned:
                log.debug("%s", message)
                return
            self._warned.add(key)
            first = not self._first_warning_done and level >= logging.WARNING
            if first:
                self._first_warning_done = True
        log.log(level, "greend: %s", message)
        if first:
            warnings.warn(f"greend: {message} (training continues unchanged)", GreendWarning, stacklevel=3)


@contextlib.contextmanager
def _te_fp8_context(autocast: AbstractContextManager[Any]) -> Any:
    """bf16 autocast plus Transformer Engine's fp8_autocast (models built from TE modules)."""
    import transformer_engine.pytorch as te  # only reached when TE was found

    with autocast, te.fp8_autocast(enabled=True):
        yield


def _signature_or_none(batch: Any) -> Hashable | None:
    try:
        return batch_signature(batch)
    except Exception:
        return None


def _warm_up_flop_counter() -> None:
    """Import what FlopCounterMode needs (torch._dynamo: seconds on a small CPU) off the training thread."""
    try:
        importlib.import_module("torch._dynamo")
    except Exception as e:
        log.debug("warming up torch._dynamo failed: %s", e)


def _check_flops_arguments(flops_per_step: float | None, model_flops: bool, model: torch.nn.Module | None) -> None:
    if flops_per_step is not None and (
        not isinstance(flops_per_step, (int, float)) or not math.isfinite(flops_per_step) or flops_per_step < 0
    ):
        raise ValueError(f"flops_per_step={flops_per_step!r}: must be a finite number >= 0")
    if flops_per_step is not None and model_flops:
        raise ValueError("give flops_per_step= or model_flops=True, not both")
    if model_flops and model is None:
        raise ValueError("model_flops=True counts the model's parameters: pass model=")


def _check_levels(precisions: Iterable[str] | None, initial_precision: str) -> list[str] | None:
    """The levels the caller allows (None: every level that runs here), checked."""
    allowed = None if precisions is None else list(precisions)
    if allowed is not None:
        bad = [p for p in allowed if p not in PRECISIONS]
        if bad:
            raise ValueError(f"precisions: unknown level(s) {bad}; known: {', '.join(PRECISIONS)}")
    if initial_precision not in PRECISIONS:
        raise ValueError(f"initial_precision={initial_precision!r}: one of {', '.join(PRECISIONS)}")
    return allowed
