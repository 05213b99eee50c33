"""The training side's entry point: :class:`GreenCallback`.

A training process creates one callback per rank and wraps each training step
in :meth:`GreenCallback.step` (usage: the README's "The training callback" and
"Precision" sections). The pieces it is made of:

* :mod:`greend.training.options`: :class:`CallbackOptions`, its keyword arguments;
* :mod:`greend.training.identity`: the job id, ranks, GPUs and socket it registers with;
* :mod:`greend.training.step`: :class:`Step`, the hot path, and loss scaling;
* :mod:`greend.training.book`: what steps read, and their losses read, judged and
  recorded after they end;
* :mod:`greend.training.precision_control`: the level in force, directives, rollbacks
  and reference checks (the rules: :mod:`greend.training.mixed_precision`);
* :mod:`greend.training.sender`: the background thread that owns the socket
  (non-blocking, fail-open, reconnecting), fed through a :class:`Channel`;
* :mod:`greend.training.flops`: FLOP counting.

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
   sees during the step (a new shape's first step is estimated, and its next step
   is counted), else one key for the whole run. A new key is counted once, up to
   ``max_flop_counts`` distinct keys; beyond that a new key's FLOPs are estimated
   from the counted keys by their number of elements (a fit within their range of
   sizes, the nearest scaled by size outside it), else the counts' mean
   (:func:`greend.training.flops.estimate_new_shape`).

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
import dataclasses
import importlib
import logging
import sys
import weakref
from collections import deque
from collections.abc import Hashable
from contextlib import AbstractContextManager
from numbers import Integral
from typing import TYPE_CHECKING, Any

import torch

from greend.errors import GreendWarning
from greend.training.book import StepBook
from greend.training.flops import batch_rows, batch_signature, stop_leaked
from greend.training.identity import (
    DEFAULT_SOCKET,
    job_elsewhere,
    model_device,
    resolve_gpus,
    resolve_job,
    resolve_ranks,
    resolve_run,
    resolve_socket,
    socket_hostname,
)
from greend.training.options import CallbackKwargs, CallbackOptions
from greend.training.peers import default_store
from greend.training.precision_control import PrecisionControl
from greend.training.sender import Channel, Sender, SenderStats
from greend.training.step import Step
from greend.training.warn import OnceWarnings

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack takes **kwargs only from Python 3.12

__all__ = ["DEFAULT_SOCKET", "CallbackOptions", "GreenCallback", "GreendWarning", "SenderStats", "Step"]

log = logging.getLogger(__name__)
# The callbacks of this process (a second one for the same job is warned about).
_OPEN: weakref.WeakSet[GreenCallback] = weakref.WeakSet()

_Tensor = torch.Tensor
_new = object.__new__


class GreenCallback:
    """Reports a training process's steps to greend and applies its precision directives.

    ``GreenCallback(job, model, **options)``: ``job`` is the job id shared by all ranks
    (fallbacks: :mod:`greend.training.identity`); ``model`` the model (its device picks
    GPUs and the autocast device; its parameters feed ``model_flops``), optional. Every
    other argument is a keyword, one field of :class:`CallbackOptions` (documented
    there); ``options=`` takes a :class:`CallbackOptions` made beforehand, and keyword
    arguments beside it override its fields.
    """

    def __init__(
        self,
        job: str | None = None,
        model: torch.nn.Module | None = None,
        *,
        options: CallbackOptions | None = None,
        **kwargs: Unpack[CallbackKwargs],
    ) -> None:
        try:
            opts = dataclasses.replace(options, **kwargs) if options is not None else CallbackOptions(**kwargs)
        except TypeError as e:
            raise TypeError(f"GreenCallback: {e}") from None
        # Every argument is checked before anything starts.
        sender_options, precision_options, allowed = opts.checked(model)
        self.options = opts
        stop_leaked()  # a count an earlier callback's failed step left on (no step of ours runs yet)

        # Who this process is.
        self.job = resolve_job(job)
        self.rank, self.local_rank, self.world_size = resolve_ranks()
        try:
            store = default_store()
        except Exception as e:
            log.debug("no rendezvous store for the run id: %s", e)
            store = None
        self.run = resolve_run(self.job, self.world_size, store)
        other = job_elsewhere(self.job, self.rank, self.world_size, store)
        self.device = model_device(model, opts.device)
        self.gpus = resolve_gpus(self.device, opts.gpus)
        self.host = socket_hostname()
        self.socket_path = resolve_socket(opts.socket)
        self.manage_precision = opts.manage_precision

        self._warnings = OnceWarnings()
        if other is not None:  # (two jobs' halves in the reports, and nothing said why)
            self._warnings.warn("job-id", f"rank {self.rank} is job {self.job!r}, but another rank of this job "
                                f"is {other!r} (their environments differ: SLURM_JOB_ID or GREEND_JOB set on some "
                                "ranks only): each is booked as a job of its own; give every rank the same "
                                "job= or GREEND_JOB", loud=True)  # fmt: skip
        self._channel = Channel(queue=deque(maxlen=opts.max_pending))
        self._control = PrecisionControl(
            model=model,
            device=self.device,
            manage=opts.manage_precision,
            allowed=allowed,
            initial=opts.initial_precision,
            owner=opts.precision_owner,
            loss_scaling=opts.loss_scaling,
            options=precision_options,
            reference_loss=opts.reference_loss,
            reference_every=opts.reference_every,
            reference_tolerance=opts.reference_tolerance,
            probe_every=opts.probe_every,
            probe_tolerance=opts.probe_tolerance,
            probe_trial=opts.probe_trial,
            job=self.job,
            rank=self.rank,
            world_size=self.world_size,
            events=self._channel.events,
            warnings=self._warnings,
        )
        self._book = StepBook(
            control=self._control,
            channel=self._channel,
            warnings=self._warnings,
            model=model,
            flops_per_step=opts.flops_per_step,
            model_flops=opts.model_flops,
            max_flop_counts=opts.max_flop_counts,
            world_size=self.world_size,
            sync_every=opts.sync_every,
        )
        self._channel.on_directive = self._book.directive
        self._channel.on_tolerance = self._control.follow_tolerance
        self._channel.book_handed = self._book.book_handed
        self.sync_every = opts.sync_every
        self.stats = self._channel.stats
        self._closed = False
        twin = next((cb for cb in _OPEN if cb.job == self.job and not cb._closed), None)
        if twin is not None:  # (a Lightning or HF adapter beside a callback of the user's own)
            self._warnings.warn(
                "twice",
                f"a second GreenCallback for job {self.job!r} in this process: the daemon counts this rank "
                "twice and its steps twice; close the first (cb.close()) or use one",
            )
        _OPEN.add(self)

        self._sender = Sender(
            self._channel,
            sender_options,
            job=self.job,
            socket_path=str(self.socket_path),
            register_fields=self._register_fields,
            warnings=self._warnings,
        )
        if self._book.fixed_flops is None and not opts.model_flops and "torch._dynamo" not in sys.modules:
            # Here, on the caller's thread (about a second, once): on a thread of its own it
            # raced the user's torch.compile, which imports the same modules at once (a
            # half-initialised torch._inductor or a _DeadlockError: the script died).
            _warm_up_flop_counter()
        self._sender.start()
        # Give the first registration a moment, so a directive in its reply applies from step 0.
        self._sender.first_attempt.wait(opts.connect_timeout_s)
        atexit.register(self._atexit)

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
            "precisions": self._control.offered(),
        }
        own = self._control.own
        if own is not None:  # the job's own level: greend never moves it above
            fields["precision"] = own
        # What went out over earlier connections (0 at the first): a daemon that stopped may
        # have lost it, and a new process (0) is never taken for this one reconnecting.
        fields["steps_before"] = self._channel.stats.sent
        if self.options.mem_share is not None:
            fields["mem_share"] = self.options.mem_share
        if self._book.fixed_flops is not None:
            fields["flops_per_step"] = self._book.fixed_flops
        if self._control.reference is not None:
            fields["reference_every"] = self._control.reference_every
        if self._control.prober is not None:
            fields["probe_every"] = self._control.prober.every  # the daemon takes probe rows
        if self._control.agreeing:
            fields["sync_every"] = self.sync_every  # how long a directive may wait for the ranks
        for name in self._channel.register_omit:  # fields an older daemon does not know
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

        ``samples``/``tokens``: throughput counts (``samples``: by default the batch's
        rows, :func:`greend.training.flops.batch_rows`; give it where the batch is not
        batch-first). ``batch``: the step's input, used only for its
        rows and a cheap shape signature (FLOPs are re-counted when it changes).
        ``shape_key``: your own cache key instead (wins over ``batch``). ``index``: the
        step number (default: a counter from 0). ``flops``: this step's FLOPs, overriding
        everything else.
        """
        # The hot path: every step runs it. It makes the Step here, without a call of
        # its own (Step.__init__ sets the same fields; tests/training/test_handoff.py
        # holds the two alike): each Python frame costs about a microsecond of a real
        # step, caches cold after torch's work (bench/bench_callback.py).
        book = self._book
        if index is not None:
            book.indexed = True  # its batch is judged on the training thread, in step order
            book.hold_cpu = False
        if samples is None and batch is not None:
            # The batch's rows: a tensor's first dimension (the shape read once, for the
            # FLOPs too), else batch_rows'. Cheaper than the user's
            # len(x): Tensor.__len__ is Python code, a few microseconds of a real step.
            if type(batch) is _Tensor and shape_key is None:
                shape_key = batch.shape
                samples = shape_key[0] if shape_key else None
            else:
                samples = batch_rows(batch)
        elif type(batch) in (tuple, list) and (type(samples) is int or isinstance(samples, Integral)) and samples <= 4:
            self._check_samples(samples, batch)  # cheap tests on the hot path, then rarely here (else: rows.py)
        if flops is None:
            flops = book.default_flops
            if flops is None:
                if shape_key is None and batch is not None:
                    # The key FLOPs are cached under: a tensor's shape (its dtype does not
                    # change the model's FLOPs), else the batch's signature.
                    shape_key = batch.shape if type(batch) is _Tensor else _signature_or_none(batch)
                # A shape counted already (every step but the first of each shape); else
                # Step.__enter__ plans it (plan_flops: count it, or guess).
                try:
                    flops = book.flop_cache.get(shape_key)
                except TypeError:  # an unhashable shape_key=: plan_flops makes it one
                    pass
        step: Step = _new(Step)
        step._host = book
        step.index = index
        step.samples = samples
        step.tokens = tokens
        step._shape_key = shape_key
        step.flops = flops
        step.t0_s = step.t1_s = 0.0
        step.precision = "fp32"
        step._raw = None
        return step

    def _check_samples(self, samples: int, batch: tuple[Any, ...] | list[Any]) -> None:
        """``samples=len(batch)`` on an ``(inputs, targets)`` batch counts its parts, not
        its samples: warn once when ``samples`` is the tuple's length and its first part
        holds more rows."""
        if len(batch) != samples or "samples-tuple" in self._warnings or not batch:
            return
        first = batch[0]
        try:  # (a 0-d tensor or a scalar has no rows: nothing to warn about)
            shape = getattr(first, "shape", None)
            rows = shape[0] if shape else (len(first) if hasattr(first, "__len__") else None)
        except Exception:
            return
        if isinstance(rows, int) and rows > samples:
            self._warnings.warn(
                "samples-tuple",
                f"samples={samples} is the length of the batch's tuple of {len(batch)} parts, whose first "
                f"part holds {rows} rows: give samples=len(inputs) (e.g. for x, y in loader: "
                "cb.step(samples=len(x), batch=x), or leave samples= out: cb.step(batch=batch) counts "
                "the inputs' rows), or samples/J and throughput read low",
            )

    @property
    def precision(self) -> str:
        """The level the next step runs at (after pending directives are applied): the level
        in force, or in a probe's or a trial's block the level the block runs."""
        control = self._control
        requested = self._channel.requested
        if requested is not control.seen_request:
            control.take_request(requested)
        prober = control.prober
        if prober is not None and prober.block is not None:
            probe = prober.level_at(self._book.upcoming)
            if probe is not None:
                return probe
        return control.level

    @property
    def requested_precision(self) -> str | None:
        """The level the daemon last asked for (None before any directive)."""
        return self._channel.requested

    @property
    def refused(self) -> dict[str, str]:
        """Levels the daemon asked for and this callback did not apply -> why."""
        return self._control.refused

    @property
    def agreed_pace_s(self) -> float | None:
        """The last pace (the slowest node's uncapped step time) all ranks agreed on."""
        return self._book.agreed_pace_s

    def supported_precisions(self) -> dict[str, str | None]:
        """Every level -> ``None`` if it can run here, else the reason it cannot."""
        return dict(self._control.support)

    @property
    def scaler(self) -> Any:
        """The :class:`torch.amp.GradScaler` while the current level needs one (fp16), else None.

        For loops that do their own backward: ``cb.scaler.scale(loss).backward()``,
        ``cb.scaler.step(opt)``, ``cb.scaler.update()`` when it is not None.
        ``step.backward``/``step.optimizer_step`` do this for you.
        """
        self._control.scaling_seen = True
        return self._control.loss_scaler(self.precision)

    @property
    def reference_checks(self) -> list[dict[str, Any]]:
        """The reference checks made (step, level, fp32 and level losses, excess), oldest first."""
        return list(self._control.reference_judge.log)

    @property
    def probe_checks(self) -> list[dict[str, Any]]:
        """The probe blocks judged (start step, level, the level above, penalty, its
        standard error, whether the data moved across it), oldest first."""
        prober = self._control.prober
        return list(prober.log) if prober is not None else []

    @property
    def precision_events(self) -> list[dict[str, Any]]:
        """Rollbacks and refusals this callback made (as sent to the daemon), oldest first."""
        return list(self._control.event_log)

    def autocast(self) -> AbstractContextManager[Any]:
        """The context for the current precision (same as ``step.autocast()``)."""
        return self._control.autocast_for(self.precision)

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
        self._book.flush()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (the run's end was sent; steps are no longer reported)."""
        return self._closed

    def close(self, reason: str = "finished") -> None:
        """Flush the remaining steps, send ``end``, stop the sender. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            atexit.unregister(self._atexit)
        except Exception:
            pass
        self._book.close()  # training is over: waiting for the last losses costs nothing
        try:
            self._sender.stop(reason, self.options.close_timeout_s)
        except Exception as e:
            log.debug("closing the sender failed: %s", e)
        self._control.close()

    def __enter__(self) -> GreenCallback:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close("finished" if exc_type is None else "error")

    def _atexit(self) -> None:
        self.close("exit")


def _signature_or_none(batch: Any) -> Hashable | None:
    try:
        return batch_signature(batch)
    except Exception:
        return None


def _warm_up_flop_counter() -> None:
    """Import what FlopCounterMode needs (torch._dynamo: about a second on a small CPU), so the
    first step that counts its FLOPs does not pay for it."""
    try:
        importlib.import_module("torch._dynamo")
    except Exception as e:
        log.debug("warming up torch._dynamo failed: %s", e)
