"""The training side of greend: :class:`GreenCallback` and its :class:`Step`.

A training process creates one callback per rank and wraps each training step::

    from greend import GreenCallback

    cb = GreenCallback(job="resnet-run-7", model=model)
    for batch in loader:
        with cb.step(samples=len(batch), batch=batch) as step:
            with step.autocast():              # the precision the daemon asked for
                loss = model(batch).loss
            step.loss(loss)                    # the accuracy guard watches this
            loss.backward(); opt.step()
    cb.close()                                 # or ``with GreenCallback(...) as cb:``

What happens underneath
-----------------------
* **The hot path** (``step().__enter__``/``__exit__``) reads ``time.monotonic()``
  twice, appends one small tuple to a bounded :class:`collections.deque` and
  returns: a few microseconds, no locks, no syscalls. When the deque is full
  (the daemon is slow or gone) the oldest records are dropped and counted
  (:attr:`GreenCallback.stats`).
* **One sender thread** owns the Unix socket (``docs/protocol.md``): it
  registers the job, batches records into ``steps`` messages every
  ``flush_interval_s``, sends ``heartbeat`` when no steps flow, and reads the
  daemon's pushed ``directive`` events. Sends are non-blocking; a daemon that
  does not read for ``stall_timeout_s``, or does not answer a request within
  ``reply_timeout_s``, is treated as gone. Then the thread reconnects every
  2-5 s (back-off with jitter) and registers again when the daemon is back.
* **Fail-open**: nothing greend does raises into the training loop. The first
  problem is one :class:`GreendWarning` (and a log line); later outages are log
  lines, never one per step. Only a bad constructor argument raises
  (``ValueError``).

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
   counted once, up to ``max_flop_counts``
   distinct keys; beyond that new keys reuse the mean of the known counts. The
   counted step runs slower (FlopCounterMode costs 10-370% of a step); its
   timing is reported as measured.

Precision
---------
``cb.precision`` is the level steps run at (``fp32`` at start; levels and their
rules are in :mod:`greend.training.mixed_precision`). ``step.autocast()`` returns the matching
context: ``fp32`` a null context with TF32 off, ``tf32`` a null context with
TF32 matmuls on, ``bf16``/``fp16`` ``torch.autocast(device_type, dtype)``, ``fp8``
and ``fp8-emulated`` bf16 autocast around a model whose large linears were
converted to torchao ``Float8Linear`` (same Parameter objects: the optimizer
and its state carry on). A directive from the daemon is applied at the next step
boundary; a level this process cannot run
(:meth:`GreenCallback.supported_precisions` says why), a level barred after a
rollback, or fp16 without loss scaling is never applied: the callback keeps the
level it runs, reports a ``refused`` precision event with the reason, and logs it.

fp16 needs loss scaling. Let the step do the backward pass and the optimizer
step, and every level works (the scaler is used only when the level needs it)::

    with cb.step(samples=n) as step:
        with step.autocast():
            loss = model(x).loss
        step.backward(loss)          # scaler.scale(loss).backward() under fp16; reports the loss
        step.optimizer_step(opt)     # scaler.step(opt) + update() under fp16
        opt.zero_grad()

(or use ``cb.scaler``: the :class:`torch.amp.GradScaler` while fp16 runs, else
None). The accuracy guard: a non-finite loss (``step.loss``/``step.backward``), or
a non-finite gradient seen by ``step.optimizer_step`` (which then skips the
update, so the master weights stay clean), while running below a level the run
came down from, rolls back to that level from the next step, bars the failed
level for ``cooldown_steps`` steps and reports a ``rollback`` precision event with
the reason and the loss figures. So does a finite loss spike: a loss more than
``spike_tolerance`` (50 %) above the trend before the downgrade. The daemon's
``precision`` policy adds the rule for finite losses that drift above their trend
by a few percent over many steps.

Job identity
------------
``job=``, else ``$GREEND_JOB``, ``$TORCHELASTIC_RUN_ID``, ``$SLURM_JOB_ID``,
else ``<host>-<pid>-<unix time>``. Rank and world size from
``torch.distributed`` if initialised, else ``$RANK``/``$WORLD_SIZE``;
``$LOCAL_RANK`` for the local rank. GPUs: ``gpus=`` if given, else the model's
CUDA device (``cuda:N`` mapped through ``$CUDA_VISIBLE_DEVICES`` to the
node-local index). A model on the CPU with ``gpus=None`` reports no GPUs
(``[]``): pass ``gpus=[...]`` to attribute a CPU run to (simulated) GPUs, as
``greenctl demo`` does with ``gpus=[0]``.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import itertools
import json
import logging
import math
import os
import random
import re
import select
import socket
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager

import torch

from greend.training import flops as _flops
from greend.training import mixed_precision as _prec
from greend.errors import GreendWarning
from greend.protocol import FP8_LEVELS, JOB_ID_RE, MAX_MESSAGE_BYTES, MAX_STEPS_PER_MESSAGE, PRECISIONS, PROTOCOL_VERSION, encode
from greend.training.mixed_precision import Guard, PrecisionEvent, precision_support

__all__ = ["DEFAULT_SOCKET", "GreenCallback", "SenderStats", "Step"]

log = logging.getLogger(__name__)

DEFAULT_SOCKET = Path("/run/greend/greend.sock")
# fp8 levels run the layers that stay out of fp8 (head, norms, small linears) in bf16.
_AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16,
                                            "fp8": torch.bfloat16, "fp8-emulated": torch.bfloat16}
_OUTBUF_MAX_BYTES = 256 * 1024
_NULL = contextlib.nullcontext()
_FROM_TOKENS = -1.0  # a Step's flops placeholder under model_flops=True
_monotonic = time.monotonic


@dataclass
class SenderStats:
    """Counters of the callback's reporting, for tests, benchmarks and curious users."""

    recorded: int = 0  # steps recorded by the training thread
    sent: int = 0  # step records handed to the socket
    dropped: int = 0  # step records lost (queue full, or unsent when a connection died)
    connects: int = 0  # successful registrations (1 + reconnects)
    connected: bool = False
    messages: int = 0  # messages written (steps, heartbeat, register, end)
    malformed: int = 0  # unreadable lines from the daemon
    last_error: str | None = None


# Identity --------------------------------------------------------------------------


def _sanitize_job(name: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9._:@/-]", "-", name)[:128]
    return cleaned or "job"


def resolve_job(job: str | None) -> str:
    """The job id: ``job``, else the environment, else ``<host>-<pid>-<time>``."""
    if job is not None:
        if not isinstance(job, str) or not JOB_ID_RE.match(job):
            raise ValueError(
                f"job={job!r}: a job id is 1-128 characters of letters, digits and ._:@/-"
            )
        return job
    for var in ("GREEND_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = os.environ.get(var)
        if value:
            return _sanitize_job(value)
    return _sanitize_job(f"{socket.gethostname()}-{os.getpid()}-{int(time.time())}")


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def resolve_ranks() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torch.distributed or the launcher's env."""
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001 - identity is best effort
        pass
    local = _env_int("LOCAL_RANK", 0)
    return max(rank, 0), max(local, 0), max(world, 1)


def model_device(model: torch.nn.Module | None, device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if model is not None:
        for p in itertools.chain(model.parameters(), model.buffers()):
            return p.device
    return torch.device("cpu")


def resolve_gpus(dev: torch.device, gpus: Iterable[int] | None) -> list[int]:
    """Node-local GPU indices: ``gpus`` if given, else the CUDA device mapped through CUDA_VISIBLE_DEVICES."""
    if gpus is not None:
        out = [int(g) for g in gpus]
        if any(g < 0 for g in out):
            raise ValueError(f"gpus={out!r}: GPU indices are >= 0")
        return out
    if dev.type != "cuda":
        return []
    index = dev.index
    if index is None:
        try:
            index = torch.cuda.current_device()
        except Exception:  # noqa: BLE001
            index = 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return [index]
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if index < len(entries) and entries[index].isdigit():
        return [int(entries[index])]
    log.warning(
        "cannot map cuda:%d through CUDA_VISIBLE_DEVICES=%s to a node-local GPU index "
        "(UUIDs or MIG ids); reporting %d: pass gpus=[...] to be exact", index, visible, index,
    )
    return [index]


# Precision support lives in greend.training.mixed_precision (precision_support is re-exported here).


# The step ----------------------------------------------------------------------------


class Step:
    """One training step: a context manager made by :meth:`GreenCallback.step`.

    Inside it: :meth:`autocast` for the precision this step runs at, :meth:`loss`
    to report the loss, and (recommended, needed for fp16) :meth:`backward` and
    :meth:`optimizer_step`, which use loss scaling when the level needs it and
    let the accuracy guard see the gradients. Attributes after the step:
    ``t0_s``, ``t1_s`` (monotonic seconds), ``flops``, ``precision``, ``index``.
    """

    __slots__ = ("_cb", "index", "samples", "tokens", "flops", "_key", "_batch", "t0_s", "t1_s",
                 "_loss", "_nonfinite", "_what", "_counting", "_scaled", "precision", "_predicted",
                 "_fwd_sig", "_spike")

    def __init__(self, cb: GreenCallback, index: int | None, samples: int | None, tokens: int | None,
                 key: Hashable | None, batch: Any, flops: float | None) -> None:
        self._cb = cb
        self.index = index
        self.samples = samples
        self.tokens = tokens
        self._key = key
        self._batch = batch
        self.flops = flops
        self.t0_s = 0.0
        self.t1_s = 0.0
        self._loss: float | None = None
        self._nonfinite = False
        self._what = "loss"
        self._counting = False
        self._scaled = False
        self.precision = "fp32"
        self._predicted = False  # the shape key is the model hook's guess (see _plan_flops)
        self._fwd_sig: Hashable | None = None  # what the model hook saw this step
        self._spike: str | None = None  # why the reported loss is a spike (Guard.spike), if it is

    def __enter__(self) -> Step:
        cb = self._cb
        requested = cb._requested
        if requested is not cb._seen_request:
            cb._take_request(requested)
        self.precision = cb._precision
        if self.flops is None:
            cb._plan_flops(self)
        cb._current = self
        self.t0_s = _monotonic()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        t1 = _monotonic()
        cb = self._cb
        cb._current = None
        if self._predicted and self._fwd_sig is not None:
            # The model's inputs say which shape this step really had.
            if self._fwd_sig != self._key and not self._counting:
                cached = cb._flop_cache.get(self._fwd_sig)
                if cached is not None:
                    self.flops = cached
                # else: a new shape, counted on the next step that has it (this one keeps
                # the estimate it started with)
            self._key = cb._last_sig = self._fwd_sig
        if self._counting:
            self._counting = False
            counted = cb._counter.stop()
            if exc_type is None:
                self.flops = cb._store_count(self._key, counted)
        self._batch = None
        if exc_type is not None:
            return False  # the user's error: not ours to swallow, and no record
        self.t1_s = t1
        cb._record(self)
        if self._nonfinite or self._spike:  # the next step runs at the level we came down from
            cb._roll_back(self, None if self._nonfinite else self._spike)
        return False

    def autocast(self) -> ContextManager[Any]:
        """The context for this step's precision (a null context for fp32/tf32)."""
        return self._cb._autocast_for(self.precision)

    def loss(self, loss: Any) -> None:
        """Report this step's loss (a tensor or a number). On CUDA, float() syncs once."""
        try:
            if isinstance(loss, torch.Tensor):
                value = float(loss.detach())
            else:
                value = float(loss)
        except Exception:  # noqa: BLE001 - a strange loss object is not worth a crash
            self._cb._warn_once("loss", f"step.loss() got {type(loss).__name__}, not a number: ignored")
            return
        guard = self._cb._guard
        if math.isfinite(value):
            self._loss, self._nonfinite = value, False
            self._spike = guard.spike(value)
            if self._spike is None:  # a spike is not the new level's trend
                guard.losses.append(value)
        else:
            self._loss, self._nonfinite, self._what, self._spike = None, True, "loss", None

    def mark_nonfinite(self, what: str = "gradient") -> None:
        """Flag this step as non-finite (e.g. a gradient was inf/NaN) without a loss value."""
        if not self._nonfinite:
            self._what = what  # the first cause is the one reported
        self._nonfinite = True

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, through the GradScaler when this step runs fp16.

        Reports the loss too (as :meth:`loss`) if the step has not reported one.
        """
        cb = self._cb
        cb._scaling_seen = True
        if self._loss is None and not self._nonfinite:
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
                finite = _prec.grads_finite(_prec.optimizer_params(optimizer))
            except Exception as e:  # noqa: BLE001 - the guard never breaks the step
                cb._warn_once("gradcheck", f"cannot check the gradients for inf/NaN: {e}")
                finite = True
            if not finite:
                self.mark_nonfinite("gradient")
                return False
        optimizer.step()
        return True


# The callback ------------------------------------------------------------------------


class GreenCallback:
    """Reports a training process's steps to greend and applies its precision directives.

    Args:
        job: job id shared by all ranks (see the module docstring for the fallbacks).
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
            it rolls back at once (default 0.5; None: only non-finite steps do).
        mem_share: memory-bound share of a step, for simulated GPUs (0..0.95).
        max_pending: step records kept while the daemon is slow or gone.
        max_flop_counts: distinct shape keys counted with FlopCounterMode.
        heartbeat_s, flush_interval_s, connect_timeout_s, reply_timeout_s,
        stall_timeout_s, reconnect_min_s, reconnect_max_s, close_timeout_s: timings (seconds).
        sync_every: every this many steps, ranks of a distributed job agree on its pace
            (the slowest node's uncapped step time) with one all-reduce (see ``_sync_pace``).
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
        fp8_min_features: int = _prec.DEFAULT_FP8_MIN_FEATURES,
        guard_window: int = 32,
        cooldown_steps: int = 500,
        spike_tolerance: float | None = 0.5,
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
    ) -> None:
        for name, value in (("heartbeat_s", heartbeat_s), ("flush_interval_s", flush_interval_s),
                            ("connect_timeout_s", connect_timeout_s), ("reply_timeout_s", reply_timeout_s),
                            ("stall_timeout_s", stall_timeout_s), ("reconnect_min_s", reconnect_min_s),
                            ("reconnect_max_s", reconnect_max_s), ("close_timeout_s", close_timeout_s)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}={value!r}: must be a number > 0 (seconds)")
        if reconnect_max_s < reconnect_min_s:
            raise ValueError(f"reconnect_max_s={reconnect_max_s} is below reconnect_min_s={reconnect_min_s}")
        if flops_per_step is not None and (not isinstance(flops_per_step, (int, float))
                                           or not math.isfinite(flops_per_step) or flops_per_step < 0):
            raise ValueError(f"flops_per_step={flops_per_step!r}: must be a finite number >= 0")
        if flops_per_step is not None and model_flops:
            raise ValueError("give flops_per_step= or model_flops=True, not both")
        if model_flops and model is None:
            raise ValueError("model_flops=True counts the model's parameters: pass model=")
        if mem_share is not None and not (0.0 <= mem_share <= 0.95):
            raise ValueError(f"mem_share={mem_share!r}: must be between 0 and 0.95")
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every={sync_every!r}: must be a whole number of steps >= 1")
        if max_pending < 1 or max_flop_counts < 1:
            raise ValueError("max_pending and max_flop_counts must be >= 1")
        for name, ivalue in (("fp8_min_features", fp8_min_features), ("guard_window", guard_window),
                             ("cooldown_steps", cooldown_steps)):
            if not isinstance(ivalue, int) or isinstance(ivalue, bool) or ivalue < 1:
                raise ValueError(f"{name}={ivalue!r}: must be a whole number >= 1")
        if spike_tolerance is not None and not (isinstance(spike_tolerance, (int, float))
                                                and math.isfinite(spike_tolerance) and spike_tolerance > 0):
            raise ValueError(f"spike_tolerance={spike_tolerance!r}: must be a number > 0 (a fraction), or None")
        allowed = None if precisions is None else list(precisions)
        if allowed is not None:
            bad = [p for p in allowed if p not in PRECISIONS]
            if bad:
                raise ValueError(f"precisions: unknown level(s) {bad}; known: {', '.join(PRECISIONS)}")
        if initial_precision not in PRECISIONS:
            raise ValueError(f"initial_precision={initial_precision!r}: one of {', '.join(PRECISIONS)}")

        self.job = resolve_job(job)
        self.rank, self.local_rank, self.world_size = resolve_ranks()
        self.device = model_device(model, device)
        self.gpus = resolve_gpus(self.device, gpus)
        self.host = socket_hostname()
        path = socket if socket is not None else os.environ.get("GREEND_SOCKET") or DEFAULT_SOCKET
        self.socket_path = Path(path)
        self.manage_precision = manage_precision
        self._model = model

        # Precision state (written by the training thread only).
        self._guard = Guard(window=guard_window, cooldown_steps=cooldown_steps, spike_tolerance=spike_tolerance)
        self._events: deque[dict[str, Any]] = deque(maxlen=64)  # precision events for the sender
        self._loss_scaling = loss_scaling
        self._scaling_seen = bool(loss_scaling)
        self._scaler: Any = None  # torch.amp.GradScaler, made on the first fp16 step
        self._fp8: _prec.Fp8Converter | None = None
        self._fp8_te = False  # fp8 through Transformer Engine's fp8_autocast (no conversion)
        if manage_precision:
            self._support = precision_support(self.device, allowed, model=model,
                                              fp8_min_features=fp8_min_features)
            if loss_scaling is False and self._support.get("fp16") is None:
                self._support["fp16"] = "loss_scaling=False: fp16 needs a GradScaler"
            fp8_ok = [lvl for lvl in FP8_LEVELS if self._support.get(lvl) is None]
            if fp8_ok and model is not None:
                if "fp8" in fp8_ok and _prec._te_model(model):
                    self._fp8_te = True
                else:
                    self._fp8 = _prec.Fp8Converter(model, _prec.fp8_targets(model, fp8_min_features),
                                                   emulate=False)
                    _prec.start_torchao_warm_up()
        else:
            owner = precision_owner or "the training framework owns autocast; see greend.integrations"
            self._support = {lvl: (None if lvl == initial_precision else f"not switched here: {owner}")
                             for lvl in PRECISIONS}
        if self._support.get(initial_precision) is not None:
            raise ValueError(f"initial_precision={initial_precision!r} cannot run here: "
                             f"{self._support[initial_precision]}")
        self._autocast_device = self.device.type if self.device.type in ("cuda", "cpu", "xpu", "mps") else "cpu"
        self._saved_tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        self._precision = "fp32"
        self.refused: dict[str, str] = {}  # level -> why the callback did not apply it
        self._event_log: deque[dict[str, Any]] = deque(maxlen=256)
        self._apply_level(initial_precision)
        # The sender writes _requested (a str); the training thread compares it to _seen_request.
        self._requested: str | None = None
        self._seen_request: str | None = None

        # FLOPs state.
        self._fixed_flops: float | None = float(flops_per_step) if flops_per_step is not None else None
        self._params = _flops.model_params(model) if model_flops and model is not None else 0
        self._model_flops = model_flops
        self._flop_cache: dict[Hashable, int] = {}
        self._max_flop_counts = max_flop_counts
        self._counter = _flops.FlopCounter()
        # With a model and counted FLOPs, a forward pre-hook sees each step's input shapes,
        # so a shape change is re-counted even when step() is given no batch= (it costs a
        # microsecond or two per forward call).
        self._current: Step | None = None
        self._last_sig: Hashable | None = None
        self._fwd_hook: Any = None
        if model is not None and self._fixed_flops is None and not model_flops:
            try:
                self._fwd_hook = model.register_forward_pre_hook(self._on_forward, with_kwargs=True)
            except Exception as e:  # noqa: BLE001 - fail-open: batch=/shape_key= still work
                log.debug("no forward pre-hook on the model: %s", e)

        # Pace agreement across nodes (see _sync_pace): the daemon's local figure, written
        # by the sender; the agreed one, written by the training thread for the sender.
        self.sync_every = sync_every
        self._local_pace_s: float | None = None
        self._agreed_pace_s: float | None = None
        self.agreed_pace_s: float | None = None  # the last figure all ranks agreed on

        # Hot-path state.
        self._queue: deque[tuple[Any, ...]] = deque(maxlen=max_pending)
        self._next_index = 0
        self.stats = SenderStats()
        self._warned: set[str] = set()
        self._warn_lock = threading.Lock()
        self._first_warning_done = False
        self._closed = False

        self._sender = _Sender(
            self, heartbeat_s=heartbeat_s, flush_interval_s=flush_interval_s,
            connect_timeout_s=connect_timeout_s, reply_timeout_s=reply_timeout_s,
            stall_timeout_s=stall_timeout_s, reconnect_min_s=reconnect_min_s,
            reconnect_max_s=reconnect_max_s, mem_share=mem_share,
        )
        self._close_timeout_s = close_timeout_s
        if self._fixed_flops is None and not model_flops and "torch._dynamo" not in sys.modules:
            threading.Thread(target=_warm_up_flop_counter, name="greend-warmup", daemon=True).start()
        self._sender.start()
        # Give the first registration a moment, so a directive in its reply applies from step 0.
        self._sender.first_attempt.wait(connect_timeout_s)
        atexit.register(self._atexit)

    # Public API --------------------------------------------------------------------
    def step(self, *, samples: int | None = None, tokens: int | None = None, batch: Any = None,
             shape_key: Hashable | None = None, index: int | None = None,
             flops: float | None = None) -> Step:
        """A context manager around one training step (forward, backward, optimizer).

        ``samples``/``tokens``: throughput counts. ``batch``: the step's input,
        used only for a cheap shape signature (FLOPs are re-counted when it
        changes). ``shape_key``: your own cache key instead (wins over
        ``batch``). ``index``: the step number (default: a counter from 0).
        ``flops``: this step's FLOPs, overriding everything else.
        """
        if self._fixed_flops is not None and flops is None:
            flops = self._fixed_flops
        elif self._model_flops and flops is None:
            flops = _FROM_TOKENS  # 6 * params * tokens, once the step ends (tokens may be set late)
        return Step(self, index, samples, tokens, shape_key, batch, flops)

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
    def precision_events(self) -> list[dict[str, Any]]:
        """Rollbacks and refusals this callback made (as sent to the daemon), oldest first."""
        return list(self._event_log)

    def autocast(self) -> ContextManager[Any]:
        """The context for the current precision (same as ``step.autocast()``)."""
        return self._autocast_for(self.precision)

    @property
    def connected(self) -> bool:
        return self.stats.connected

    def close(self, reason: str = "finished") -> None:
        """Flush the remaining steps, send ``end``, stop the sender. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            atexit.unregister(self._atexit)
        except Exception:  # noqa: BLE001
            pass
        try:
            self._sender.stop(reason, self._close_timeout_s)
        except Exception as e:  # noqa: BLE001 - closing never raises into training
            log.debug("closing the sender failed: %s", e)
        if self._fwd_hook is not None:
            self._fwd_hook.remove()
            self._fwd_hook = None
        if self.manage_precision:
            self._restore_tf32()
            if self._fp8 is not None and self._fp8.active:
                try:
                    self._fp8.revert()  # the user gets back the model they gave us
                except Exception as e:  # noqa: BLE001
                    log.warning("greend: could not undo the fp8 conversion: %s", e)

    def __enter__(self) -> GreenCallback:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close("finished" if exc_type is None else "error")

    def _atexit(self) -> None:
        self.close("exit")

    # Hot-path helpers ----------------------------------------------------------------
    def _record(self, step: Step) -> None:
        index = step.index
        if index is None:
            index = self._next_index
        self._next_index = index + 1
        if step.flops is _FROM_TOKENS:
            if step.tokens is None:
                self._warn_once("tokens", "model_flops=True needs step(tokens=...): reporting 0 FLOPs")
                step.flops = 0.0
            else:
                step.flops = 6.0 * self._params * step.tokens
        q = self._queue
        if len(q) == q.maxlen:
            self.stats.dropped += 1  # the append below pushes out the oldest record
        q.append((index, step.t0_s, step.t1_s, step.flops, step.samples, step.tokens,
                  step._loss, step._nonfinite, step.precision))
        self.stats.recorded += 1
        if self.world_size > 1 and (index + 1) % self.sync_every == 0:
            self._sync_pace()

    def _sync_pace(self) -> None:
        """Agree on the job's pace with the other ranks, at a decision point.

        Each node's daemon measures this rank's uncapped step time and pushes it
        (event ``local_pace``). Every ``sync_every`` steps all ranks take the MAX over
        the job's own process group: the slowest node sets a synchronous job's pace,
        so a faster node's daemon may cap its GPUs down to that pace (plus its bound)
        without making any node the straggler. One all-reduce per ``sync_every`` steps,
        never per step; every rank calls it at the same step index. A failure here
        (no process group, a broken collective) is logged once and never raised.
        """
        try:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                return
            device = torch.device("cpu")
            if dist.get_backend() == "nccl" and torch.cuda.is_available():
                device = torch.device("cuda", torch.cuda.current_device())
            t = torch.tensor([self._local_pace_s or 0.0], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            agreed = float(t.item())
        except Exception as e:  # noqa: BLE001 - fail-open, as everywhere in the callback
            self._warn_once("pace", f"greend could not agree the job's pace across ranks: {e}")
            return
        if agreed > 0:
            self.agreed_pace_s = agreed
            self._agreed_pace_s = agreed  # the sender sends it as op "pace"

    def _plan_flops(self, step: Step) -> None:
        key = step._key
        if key is not None:
            try:
                hash(key)
            except TypeError:
                key = step._key = repr(key)
        elif step._batch is not None:
            try:
                key = _flops.batch_signature(step._batch)
            except Exception:  # noqa: BLE001
                key = None
            step._key = key
        elif self._fwd_hook is not None:
            # Neither batch= nor shape_key=: the model's forward pre-hook tells the shape,
            # but only once the step runs. Guess the last step's; the step's end corrects it.
            key = step._key = self._last_sig
            step._predicted = True
        cached = self._flop_cache.get(key)
        if cached is not None:
            step.flops = cached
            return
        if len(self._flop_cache) >= self._max_flop_counts:
            if "flopcache" not in self._warned:
                self._warn_once("flopcache", f"more than {self._max_flop_counts} distinct input shapes: "
                                "new shapes reuse the mean FLOP count (pass shape_key= buckets or "
                                "flops_per_step=)", level=logging.INFO)
            step.flops = sum(self._flop_cache.values()) / len(self._flop_cache)
            return
        if self._counter.active:  # a nested step: let the outer one count
            step.flops = 0
            return
        step._counting = self._counter.start()
        if not step._counting:
            step.flops = 0

    def _on_forward(self, module: Any, args: Any, kwargs: Any) -> None:
        """The model's forward pre-hook: the signature of the step's first forward inputs."""
        step = self._current
        if step is not None and step._predicted and step._fwd_sig is None:
            try:
                step._fwd_sig = _flops.batch_signature((*args, *kwargs.values()))
            except Exception:  # noqa: BLE001 - never break the forward pass
                pass

    def _store_count(self, key: Hashable | None, counted: int | None) -> int:
        if counted is None:
            return 0
        self._flop_cache[key] = counted
        log.debug("counted %d FLOPs per step for shape key %r", counted, key)
        return counted

    def _take_request(self, level: str | None) -> None:
        """Apply the daemon's latest directive at a step boundary, or refuse it with a reason."""
        self._seen_request = level
        if level is None or level == self._precision:
            return
        step = self._next_index
        reason = self._support.get(level, f"unknown precision level {level!r}")
        if reason is None:
            reason = self._guard.barred_reason(level, step)
        if reason is None and level == "fp16" and self.manage_precision and not self._scaling_seen:
            reason = ("fp16 needs loss scaling: run the step's backward and optimizer step through "
                      "step.backward(loss) and step.optimizer_step(opt), or cb.scaler, or pass "
                      "loss_scaling=True")
        if reason is None:
            old = self._precision
            try:
                self._apply_level(level)
            except Exception as e:  # noqa: BLE001 - a failed conversion must not break training
                reason = f"switching to {level} failed: {type(e).__name__}: {e}"
                self._support[level] = reason  # never again in this process
            else:
                log.info("precision %s -> %s (greend directive)", old, level)
                if self.manage_precision:
                    self._guard.on_switch(old, level, step)
                return
        self.refused[level] = reason
        self._warn_once(f"refuse:{level}",
                        f"greend asked for precision {level}; staying at {self._precision}: {reason}",
                        level=logging.WARNING)
        self._send_event(PrecisionEvent("refused", self._precision, level, reason, step=step,
                                        loss=self._guard.losses[-1] if self._guard.losses else None,
                                        trend=self._guard.trend()))

    def _roll_back(self, step: Step, spike: str | None = None) -> None:
        """The guard's fast rules: a non-finite step, or a loss spike, below a level we
        came down from."""
        index = step.index if step.index is not None else self._next_index - 1
        ev = self._guard.rollback(self._precision, index, step._what, step._loss, spike)
        if ev is None:
            return
        try:
            self._apply_level(ev.to_level)
        except Exception as e:  # noqa: BLE001 - going up never needs a conversion, but be safe
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
            except Exception as e:  # noqa: BLE001
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

    def _autocast_for(self, level: str) -> ContextManager[Any]:
        if not self.manage_precision:
            return _NULL
        dtype = _AUTOCAST_DTYPES.get(level)
        if dtype is None:
            return _NULL
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
def _te_fp8_context(autocast: ContextManager[Any]) -> Any:
    """bf16 autocast plus Transformer Engine's fp8_autocast (models built from TE modules)."""
    import transformer_engine.pytorch as te  # only reached when TE was found

    with autocast, te.fp8_autocast(enabled=True):
        yield


def _warm_up_flop_counter() -> None:
    """Import what FlopCounterMode needs (torch._dynamo: seconds on a small CPU) off the training thread."""
    try:
        importlib.import_module("torch._dynamo")
    except Exception as e:  # noqa: BLE001 - the first counted step imports it (or fails) itself
        log.debug("warming up torch._dynamo failed: %s", e)


def socket_hostname() -> str:
    try:
        return socket.gethostname()
    except OSError:
        return "localhost"


# The sender thread ---------------------------------------------------------------------


class _Dead(Exception):
    """The connection is gone or stuck; the message says why."""


class _Sender:
    """Owns the socket: registers, batches steps, heartbeats, reads directives, reconnects."""

    def __init__(self, cb: GreenCallback, *, heartbeat_s: float, flush_interval_s: float,
                 connect_timeout_s: float, reply_timeout_s: float, stall_timeout_s: float,
                 reconnect_min_s: float, reconnect_max_s: float, mem_share: float | None) -> None:
        self.cb = cb
        self.heartbeat_s = heartbeat_s
        self.flush_interval_s = flush_interval_s
        self.connect_timeout_s = connect_timeout_s
        self.reply_timeout_s = reply_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.reconnect_min_s = reconnect_min_s
        self.reconnect_max_s = reconnect_max_s
        self.mem_share = mem_share
        self.first_attempt = threading.Event()
        self.session: int | None = None
        self._wake = threading.Event()
        self._stop_reason: str | None = None
        self._stop_deadline = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"greend-sender-{cb.job}", daemon=True)
        self._sock: socket.socket | None = None
        self._inbuf = b""
        self._out: deque[list[Any]] = deque()  # [bytes, records in it]
        self._out_bytes = 0
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[str, float]] = {}  # request id -> (op, sent at)
        self._last_send_s = 0.0
        self._last_progress_s = 0.0
        self._failures = 0
        self._ever_connected = False
        self.end_result: dict[str, Any] | None = None

    # Control ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, reason: str, timeout_s: float) -> None:
        self._stop_deadline = _monotonic() + timeout_s
        self._stop_reason = reason
        self._wake.set()
        self._thread.join(timeout_s + 1.0)

    # Main loop -------------------------------------------------------------------
    def _run(self) -> None:
        next_connect = 0.0
        try:
            while True:
                if self._stop_reason is not None:
                    self._finish()
                    return
                if self._sock is None:
                    now = _monotonic()
                    if now >= next_connect:
                        if self._connect():
                            self._failures = 0
                        else:
                            self._failures += 1
                            delay = min(self.reconnect_max_s, self.reconnect_min_s * (2 ** (self._failures - 1)))
                            next_connect = _monotonic() + delay * random.uniform(0.8, 1.0)
                        self.first_attempt.set()
                        continue
                    self._wake.wait(min(next_connect - now, 0.5))
                    continue
                try:
                    self._pump()
                except _Dead as e:
                    self._lost(str(e))
                    next_connect = _monotonic() + self.reconnect_min_s * random.uniform(0.8, 1.0)
        except Exception as e:  # noqa: BLE001 - the sender must never take the process down
            log.exception("greend sender thread failed; reporting stops (training is unaffected)")
            self.cb.stats.last_error = f"{type(e).__name__}: {e}"
        finally:
            self._close_sock()
            self.first_attempt.set()
            self._done.set()

    def _pump(self) -> None:
        """One round: queue steps, maybe a heartbeat, then wait for I/O up to flush_interval_s."""
        now = _monotonic()
        self._queue_steps()
        events = self.cb._events
        while events:
            try:
                ev = events.popleft()
            except IndexError:
                break
            self._queue_request("precision_event", ev)
        pace = self.cb._agreed_pace_s
        if pace is not None:
            self.cb._agreed_pace_s = None
            self._queue_request("pace", {"step_s": pace})
        if not self._out and now - self._last_send_s >= self.heartbeat_s and not self._has_pending("heartbeat"):
            self._queue_request("heartbeat", {})
        for mid, (op, sent) in self._pending.items():
            if now - sent > self.reply_timeout_s:
                raise _Dead(f"the daemon did not answer {op!r} within {self.reply_timeout_s:g} s")
        if self._out and now - self._last_progress_s > self.stall_timeout_s:
            raise _Dead(f"the daemon has not read anything for {self.stall_timeout_s:g} s")
        assert self._sock is not None
        wlist = [self._sock] if self._out else []
        try:
            r, w, _ = select.select([self._sock], wlist, [], self.flush_interval_s)
        except (OSError, ValueError) as e:
            raise _Dead(f"socket error: {e}") from None
        if r:
            self._read_available()
        if w:
            self._write_available()

    # Connecting --------------------------------------------------------------------
    def _connect(self) -> bool:
        cb = self.cb
        path = str(cb.socket_path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.connect_timeout_s)
        try:
            s.connect(path)
        except FileNotFoundError:
            s.close()
            self._fail(f"no greend socket at {path} (is the daemon running? set $GREEND_SOCKET "
                       "or socket= to point at it)")
            return False
        except PermissionError:
            s.close()
            self._fail(f"permission denied on {path} (join the socket's group: usermod -aG greend $USER)")
            return False
        except OSError as e:
            s.close()
            self._fail(f"cannot connect to {path}: {e.strerror or e}")
            return False
        self._sock = s
        self._inbuf = b""
        self._out.clear()
        self._out_bytes = 0
        self._pending.clear()
        fields: dict[str, Any] = {
            "job": cb.job, "rank": cb.rank, "local_rank": cb.local_rank, "world_size": cb.world_size,
            "gpus": cb.gpus, "host": cb.host,
            "precisions": [lvl for lvl in PRECISIONS if cb._support.get(lvl) is None],
        }
        if self.mem_share is not None:
            fields["mem_share"] = self.mem_share
        if cb._fixed_flops is not None:
            fields["flops_per_step"] = cb._fixed_flops
        mid = next(self._ids)
        try:
            s.sendall(encode({"v": PROTOCOL_VERSION, "id": mid, "op": "register", **fields}))
            cb.stats.messages += 1
            deadline = _monotonic() + self.reply_timeout_s
            while True:
                remaining = deadline - _monotonic()
                if remaining <= 0:
                    raise _Dead(f"the daemon did not answer 'register' within {self.reply_timeout_s:g} s")
                s.settimeout(remaining)
                reply = self._read_line_blocking(s)
                if reply is None:
                    continue
                if "event" in reply:
                    self._on_event(reply)
                    continue
                if reply.get("id") != mid:
                    continue
                break
        except (OSError, _Dead) as e:
            self._close_sock()
            msg = str(e) if isinstance(e, _Dead) else f"lost {path} while registering: {e}"
            if isinstance(e, (socket.timeout, TimeoutError)):
                msg = f"the daemon at {path} did not answer 'register' within {self.reply_timeout_s:g} s"
            self._fail(msg)
            return False
        if not reply.get("ok"):
            err = reply.get("error") or {}
            self._close_sock()
            self._fail(f"the daemon refused to register job {cb.job!r}: "
                       f"{err.get('code', 'error')}: {err.get('message', '?')}")
            return False
        result = reply.get("result") or {}
        if isinstance(result, dict):
            hb = result.get("heartbeat_s")
            if isinstance(hb, (int, float)) and not isinstance(hb, bool) and hb > 0:
                self.heartbeat_s = float(hb)
            session = result.get("session")
            self.session = session if isinstance(session, int) else None
            directive = result.get("directive")
            if isinstance(directive, dict):
                self._on_directive(directive.get("precision"))
        s.setblocking(False)
        now = _monotonic()
        self._last_send_s = self._last_progress_s = now
        cb.stats.connects += 1
        cb.stats.connected = True
        if self._ever_connected:
            log.warning("greend: reconnected to %s; job %s registered again", path, cb.job)
        else:
            log.info("greend: job %s registered with %s (session %s)", cb.job, path, self.session)
        self._ever_connected = True
        return True

    def _read_line_blocking(self, s: socket.socket) -> dict[str, Any] | None:
        while b"\n" not in self._inbuf:
            chunk = s.recv(65536)
            if not chunk:
                raise _Dead("the daemon closed the connection")
            self._inbuf += chunk
            if len(self._inbuf) > 4 * MAX_MESSAGE_BYTES:
                self._inbuf = b""
                self._malformed("a reply line longer than the protocol allows")
                return None
        line, self._inbuf = self._inbuf.split(b"\n", 1)
        return self._parse(line)

    def _fail(self, message: str) -> None:
        cb = self.cb
        cb.stats.last_error = message
        cb.stats.connected = False
        if self._failures == 0 and not self._ever_connected:
            cb._warn_once("connect", f"{message}; steps are not reported, retrying every "
                          f"{self.reconnect_min_s:g}-{self.reconnect_max_s:g} s")
        else:
            log.debug("greend: %s", message)

    def _lost(self, message: str) -> None:
        cb = self.cb
        dropped = sum(n for _, n in self._out)
        cb.stats.dropped += dropped
        self._close_sock()
        cb.stats.last_error = message  # before "not connected": a reader of both sees why
        cb.stats.connected = False
        self._failures = 1
        if not cb._first_warning_done:
            cb._warn_once("lost", f"lost the daemon: {message}; training continues, reconnecting")
        else:
            log.warning("greend: lost the daemon: %s; training continues, reconnecting every %g-%g s",
                        message, self.reconnect_min_s, self.reconnect_max_s)

    def _close_sock(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
        self._out.clear()
        self._out_bytes = 0
        self._pending.clear()

    # Writing -----------------------------------------------------------------------
    def _queue_steps(self) -> None:
        q = self.cb._queue
        while q and self._out_bytes < _OUTBUF_MAX_BYTES:
            batch: list[dict[str, Any]] = []
            while q and len(batch) < MAX_STEPS_PER_MESSAGE:
                try:
                    rec = q.popleft()
                except IndexError:
                    break
                batch.append(_step_json(rec))
            if batch:
                self._queue_steps_message(batch)

    def _queue_steps_message(self, batch: list[dict[str, Any]]) -> None:
        data = encode({"v": PROTOCOL_VERSION, "op": "steps", "steps": batch})
        if len(data) > MAX_MESSAGE_BYTES and len(batch) > 1:
            half = len(batch) // 2
            self._queue_steps_message(batch[:half])
            self._queue_steps_message(batch[half:])
            return
        self._enqueue(data, len(batch))

    def _queue_request(self, op: str, fields: dict[str, Any]) -> int:
        mid = next(self._ids)
        self._enqueue(encode({"v": PROTOCOL_VERSION, "id": mid, "op": op, **fields}), 0)
        self._pending[mid] = (op, _monotonic())
        return mid

    def _has_pending(self, op: str) -> bool:
        return any(o == op for o, _ in self._pending.values())

    def _enqueue(self, data: bytes, records: int) -> None:
        self._out.append([data, records])
        self._out_bytes += len(data)

    def _write_available(self) -> None:
        assert self._sock is not None
        while self._out:
            item = self._out[0]
            data: bytes = item[0]
            try:
                n = self._sock.send(data)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                raise _Dead(f"cannot write to the daemon: {e.strerror or e}") from None
            now = _monotonic()
            self._last_progress_s = now
            self._out_bytes -= n
            if n < len(data):
                item[0] = data[n:]
                return
            self._out.popleft()
            self._last_send_s = now
            self.cb.stats.messages += 1
            self.cb.stats.sent += item[1]

    def _flush_blocking(self, deadline: float) -> bool:
        """Send everything queued (used when closing); False if the deadline passed."""
        while self._out and self._sock is not None:
            remaining = deadline - _monotonic()
            if remaining <= 0:
                return False
            try:
                _, w, _ = select.select([], [self._sock], [], remaining)
            except (OSError, ValueError):
                return False
            if w:
                self._write_available()
        return True

    # Reading -----------------------------------------------------------------------
    def _read_available(self) -> None:
        assert self._sock is not None
        try:
            chunk = self._sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            raise _Dead(f"cannot read from the daemon: {e.strerror or e}") from None
        if not chunk:
            raise _Dead("the daemon closed the connection")
        self._inbuf += chunk
        while True:
            nl = self._inbuf.find(b"\n")
            if nl < 0:
                if len(self._inbuf) > 4 * MAX_MESSAGE_BYTES:
                    self._inbuf = b""
                    self._malformed("a line longer than the protocol allows")
                return
            line, self._inbuf = self._inbuf[:nl], self._inbuf[nl + 1:]
            msg = self._parse(line)
            if msg is not None:
                self._on_message(msg)

    def _parse(self, line: bytes) -> dict[str, Any] | None:
        if not line.strip():
            return None
        try:
            msg = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            self._malformed(f"not JSON: {line[:80]!r}")
            return None
        if not isinstance(msg, dict):
            self._malformed(f"not a JSON object: {line[:80]!r}")
            return None
        return msg

    def _malformed(self, what: str) -> None:
        self.cb.stats.malformed += 1
        self.cb._warn_once("malformed", f"ignoring a malformed message from the daemon ({what})")

    def _on_message(self, msg: dict[str, Any]) -> None:
        if "event" in msg:
            self._on_event(msg)
            return
        mid = msg.get("id")
        op = None
        if isinstance(mid, int) and mid in self._pending:
            op = self._pending.pop(mid)[0]
        if msg.get("ok") is False:
            err = msg.get("error") if isinstance(msg.get("error"), dict) else {}
            code, field = err.get("code"), err.get("field")
            if code == "bad_request" and field == "op" and op in (None, "heartbeat"):
                raise _Dead("the daemon no longer knows this session (it asks to register)")
            self.cb._warn_once(f"refused:{code}:{field}",
                               f"the daemon refused a message ({op or 'steps'}): {code}: "
                               f"{err.get('message', '?')}")
        elif op == "end":
            result = msg.get("result")
            self.end_result = result if isinstance(result, dict) else None

    def _on_event(self, msg: dict[str, Any]) -> None:
        if msg.get("event") == "directive":
            if "precision" in msg:
                self._on_directive(msg.get("precision"), msg.get("reason"))
        elif msg.get("event") == "local_pace":
            step_s = msg.get("step_s")
            if isinstance(step_s, (int, float)) and not isinstance(step_s, bool) and step_s > 0:
                self.cb._local_pace_s = float(step_s)
            else:
                self._malformed(f"a local_pace event with step_s={step_s!r}")
        else:
            log.debug("greend: ignoring event %r", msg.get("event"))

    def _on_directive(self, level: Any, reason: Any = None) -> None:
        if not isinstance(level, str) or level not in PRECISIONS:
            self._malformed(f"a directive with an unknown precision {level!r}")
            return
        if level != self.cb._requested:
            log.info("greend: directive precision=%s (%s)", level, reason or "no reason given")
        self.cb._requested = level

    # Closing -----------------------------------------------------------------------
    def _finish(self) -> None:
        deadline = self._stop_deadline
        reason = self._stop_reason or "finished"
        if self._sock is None:
            self.cb.stats.dropped += len(self.cb._queue)
            return
        try:
            self._queue_steps()
            while self.cb._queue and _monotonic() < deadline:
                if not self._flush_blocking(deadline):
                    break
                self._queue_steps()
            mid = self._queue_request("end", {"reason": reason})
            if not self._flush_blocking(deadline):
                return
            while mid in self._pending and _monotonic() < deadline:
                r, _, _ = select.select([self._sock], [], [], max(0.0, deadline - _monotonic()))
                if r:
                    self._read_available()
        except (_Dead, OSError) as e:
            log.debug("greend: closing: %s", e)
        finally:
            self.cb.stats.dropped += len(self.cb._queue) + sum(n for _, n in self._out)
            self.cb.stats.connected = False


def _step_json(rec: tuple[Any, ...]) -> dict[str, Any]:
    index, t0, t1, flops, samples, tokens, loss, nonfinite, precision = rec
    d: dict[str, Any] = {"step": index, "t0_s": t0, "t1_s": t1,
                         "flops": float(flops) if flops is not None else 0.0, "precision": precision}
    if samples is not None:
        d["samples"] = int(samples)
    if tokens is not None:
        d["tokens"] = int(tokens)
    if nonfinite:
        d["loss"] = None
        d["nonfinite"] = True
    elif loss is not None:
        d["loss"] = loss
    return d

