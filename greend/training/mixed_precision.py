"""Precision levels on the training side: what runs here, how to switch, and the guard.

:class:`greend.GreenCallback` uses this module; it is separate so that a newcomer
finds every precision rule in one place and so that the pieces can be tested alone.

Levels
------
========== =====================================================================
``fp32``   true FP32 (TF32 off: torch's default)
``tf32``   FP32 with TF32 tensor-core matmuls (CUDA, compute capability >= 8.0)
``bf16``   ``torch.autocast(device, torch.bfloat16)``
``fp16``   ``torch.autocast(device, torch.float16)`` plus loss scaling
           (:class:`torch.amp.GradScaler`): the step must go through
           ``step.backward(loss)`` and ``step.optimizer_step(opt)`` (or
           ``cb.scaler``), else the level is refused
``fp8``    torchao float8 training (``convert_to_float8_training``) on a GPU of
           compute capability >= 8.9, the rest of the model under bf16 autocast;
           or NVIDIA Transformer Engine (``te.fp8_autocast``) for a model built
           from ``transformer_engine.pytorch`` modules
``fp8-emulated`` torchao's ``Float8LinearConfig(emulate=True)``: FP8 numerics on
           the CPU, for tests only. Offered only when listed explicitly in
           ``GreenCallback(precisions=[...])``; never on a real run by default.
========== =====================================================================

:func:`precision_support` says, for each level, ``None`` (runs here) or the
reason it cannot run.

Switching
---------
All switches happen between steps and are reversible. bf16/fp16 are an autocast
dtype. fp8 converts the model's eligible ``nn.Linear`` layers
(:func:`fp8_targets`: dims multiples of 16, at least ``min_features`` wide, not
the output head) to torchao ``Float8Linear`` in place; the Float8Linear shares
the original layer's ``weight`` and ``bias`` Parameter objects (the master
weights, in full precision), so the optimizer's state survives. Leaving fp8 puts
the original ``nn.Linear`` modules back (:class:`Fp8Converter`): same module
objects, same Parameters, hooks intact. Embeddings and norms are never
converted (they are not ``nn.Linear``), nor are small linears and the head
(fp8 is slower than bf16 on small layers, and the head carries the loss's
precision).

The guard (local rules)
-----------------------
:class:`Guard` remembers the levels the run came down from. A non-finite loss
(or gradient, when the step's ``backward``/``optimizer_step`` let the callback
see them) while running below a level it came down from rolls back to that
level from the very next step, bars the failed level for ``cooldown_steps``
steps, and yields a ``rollback`` precision event with the reason and the loss
figures (``trend``: the mean loss over the window before the downgrade). The
daemon's precision policy adds the slower rule (a finite loss worse than the
trend by more than a tolerance over the probation window).
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import logging
import math
import statistics
import sys
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from greend.protocol import PRECISION_BITS, PRECISIONS

__all__ = [
    "BITS",
    "DTYPE_LEVELS",
    "Guard",
    "PrecisionEvent",
    "PrecisionOptions",
    "fp8_targets",
    "grads_finite",
    "has_te_modules",
    "is_downgrade",
    "precision_support",
    "weight_layers",
    "weights_level",
]

log = logging.getLogger(__name__)

BITS = PRECISION_BITS  # mantissa-ish bits of each level: a switch to fewer bits is a downgrade
# Layer names that are an output head: kept out of fp8 (torchao reports fp8 slower on
# small and output layers; the head also carries the loss's precision).
_HEAD_NAMES = {"lm_head", "head", "output", "classifier", "score", "fc_out", "decoder"}
DEFAULT_FP8_MIN_FEATURES = 1024


def _poisson_tail(k: int, mean: float) -> float:
    """P(X >= k) for X Poisson with ``mean`` (its terms in logs: no underflow at large means)."""
    if k <= 0:
        return 1.0
    if mean <= 0:
        return 0.0
    log_mean = math.log(mean)
    below = sum(math.exp(j * log_mean - mean - math.lgamma(j + 1)) for j in range(k))
    return min(1.0, max(0.0, 1.0 - below))


def is_downgrade(old: str, new: str) -> bool:
    """True when ``new`` keeps fewer bits than ``old`` (fp32 -> bf16, bf16 -> fp8, ...)."""
    return BITS.get(new, 32) < BITS.get(old, 32)


# The level a job computes at from a dtype (its autocast's, or its weights').
DTYPE_LEVELS: dict[torch.dtype, str] = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def weights_level(model: torch.nn.Module | None) -> str | None:
    """bf16 or fp16 where the model computes in it without an autocast: sharded by FSDP
    with a mixed-precision policy of that ``param_dtype`` (its master weights stay fp32),
    or most of its floating-point weights in that dtype; else None."""
    if model is None:
        return None
    sharded = _fsdp_param_dtype(model)
    if sharded is not None:
        return DTYPE_LEVELS.get(sharded)
    counts: dict[torch.dtype, int] = {}
    try:
        for p in model.parameters():
            if p.is_floating_point():
                counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    except Exception:
        return None
    if not counts:
        return None
    dtype = max(counts, key=lambda d: counts[d])
    return DTYPE_LEVELS.get(dtype)


def _fsdp_param_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The ``param_dtype`` of the first FSDP module's mixed-precision policy in ``model``
    (FSDP2's ``fully_shard(mp_policy=...)``, FSDP1's ``mixed_precision=``), else None. Only
    where torch.distributed.fsdp is imported already (a job that shards has imported it)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return None
    fsdp2, fsdp1 = getattr(fsdp, "FSDPModule", None), getattr(fsdp, "FullyShardedDataParallel", None)
    try:
        for m in model.modules():
            if fsdp2 is not None and isinstance(m, fsdp2):
                dtype = m._get_fsdp_state()._mp_policy.param_dtype  # (FSDP2 keeps its policy there)
            elif fsdp1 is not None and isinstance(m, fsdp1):
                dtype = getattr(m.mixed_precision, "param_dtype", None)
            else:
                continue
            return dtype if isinstance(dtype, torch.dtype) else None
    except Exception as e:  # another torch's internals: no level found here
        log.debug("cannot read the FSDP mixed-precision policy: %s", e)
    return None


# Support detection -------------------------------------------------------------------


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def has_te_modules(model: nn.Module | None) -> bool:
    """Does the model contain Transformer Engine modules (the TE fp8 path)?"""
    if model is None:
        return False
    return any(type(m).__module__.startswith("transformer_engine") for m in model.modules())


def fp8_targets(model: nn.Module | None, min_features: int = DEFAULT_FP8_MIN_FEATURES) -> list[str]:
    """Qualified names of the ``nn.Linear`` layers fp8 would convert.

    Eligible: both dims multiples of 16 (torchao's requirement), both at least
    ``min_features``, not named like an output head (``lm_head``, ``head``,
    ``classifier``, ...) and not the model's last Linear (the head of a plain
    ``nn.Sequential``). Embeddings and norms are not ``nn.Linear`` and stay as they are.
    """
    if model is None:
        return []
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear and name]
    if not linears:
        return []
    last = linears[-1][0]
    out = []
    for name, m in linears:
        if name == last or name.rsplit(".", 1)[-1] in _HEAD_NAMES:
            continue
        if m.in_features % 16 or m.out_features % 16:
            continue
        if min(m.in_features, m.out_features) < min_features:
            continue
        out.append(name)
    return out


def precision_support(
    dev: torch.device,
    allowed: Iterable[str] | None = None,
    *,
    model: nn.Module | None = None,
    fp8_min_features: int = DEFAULT_FP8_MIN_FEATURES,
) -> dict[str, str | None]:
    """For each level, ``None`` if this process can run it, else the reason why not.

    ``allowed``: the levels the user lets greend choose (``precisions=``); None:
    every level that runs here except ``fp8-emulated``, which must be listed.
    ``model``: fp8 needs one, with at least one eligible linear (:func:`fp8_targets`).
    """
    out: dict[str, str | None] = {}
    cuda = dev.type == "cuda"
    cc: tuple[int, int] | None = None
    if cuda:
        try:
            cc = torch.cuda.get_device_capability(dev)
        except Exception as e:
            cc = None
            log.debug("cannot read the compute capability of %s: %s", dev, e)
    have_torchao = _has_module("torchao")
    have_te = _has_module("transformer_engine")
    where = f"the model is on {dev.type}"
    out["fp32"] = None
    if not cuda:
        out["tf32"] = f"TF32 is a CUDA tensor-core mode (compute capability >= 8.0); {where}"
    elif cc is not None and cc < (8, 0):
        out["tf32"] = f"TF32 needs compute capability >= 8.0; this GPU has {cc[0]}.{cc[1]}"
    else:
        out["tf32"] = None
    if cuda:
        try:
            out["bf16"] = None if torch.cuda.is_bf16_supported() else "this GPU has no bf16 support"
        except Exception:
            out["bf16"] = None
    else:
        out["bf16"] = None if dev.type in ("cpu", "xpu", "mps") else f"no bf16 autocast on {dev.type}"
    out["fp16"] = None if dev.type in ("cuda", "cpu", "xpu", "mps") else f"no fp16 autocast on {dev.type}"

    targets = fp8_targets(model, fp8_min_features)
    no_targets = (
        f"no linear layer of the model is eligible for fp8 (dims multiples of 16, at least "
        f"{fp8_min_features} wide, not the output head; fp8_min_features= sets the width)"
    )
    if not cuda:
        out["fp8"] = f"fp8 needs a CUDA GPU with compute capability >= 8.9 (CPU autocast refuses fp8); {where}"
    elif cc is not None and cc < (8, 9):
        out["fp8"] = f"fp8 needs compute capability >= 8.9; this GPU has {cc[0]}.{cc[1]}"
    elif have_te and has_te_modules(model):
        out["fp8"] = None  # Transformer Engine: te.fp8_autocast around the forward
    elif not have_torchao:
        out["fp8"] = "fp8 needs torchao (pip install 'greend[fp8]') or a Transformer Engine model"
    elif model is None:
        out["fp8"] = "fp8 converts the model's linear layers: pass model= to GreenCallback"
    elif not targets:
        out["fp8"] = no_targets
    else:
        out["fp8"] = None
    listed = allowed is not None and "fp8-emulated" in set(allowed)
    if not listed:
        out["fp8-emulated"] = (
            "emulated fp8 is for CPU tests only: list it in GreenCallback(precisions=[...]) to offer it"
        )
    elif not have_torchao:
        out["fp8-emulated"] = "emulated fp8 needs torchao (pip install 'greend[fp8]')"
    elif model is None:
        out["fp8-emulated"] = "fp8 converts the model's linear layers: pass model= to GreenCallback"
    elif not targets:
        out["fp8-emulated"] = no_targets
    else:
        out["fp8-emulated"] = None
    if allowed is not None:
        allowed_set = set(allowed)
        for level in PRECISIONS:
            if level not in allowed_set and out.get(level) is None and level != "fp32":
                out[level] = "not in the precisions= this callback was given"
    return out


# Gradients ---------------------------------------------------------------------------


def grads_finite(params: Iterable[torch.Tensor]) -> bool:
    """True if every gradient is finite: one fused norm per device and dtype, one sync."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        if g is not None:
            groups.setdefault((g.device, g.dtype), []).append(g.detach() if g.requires_grad else g)
    for grads in groups.values():
        norms = torch._foreach_norm(grads)
        if not bool(torch.stack([n.float() for n in norms]).sum().isfinite()):
            return False
    return True


def optimizer_params(opt: Any) -> list[torch.Tensor]:
    return [p for group in getattr(opt, "param_groups", ()) for p in group.get("params", ())]


# The guard ---------------------------------------------------------------------------


@dataclass
class PrecisionEvent:
    """What the callback tells the daemon (op ``precision_event``, docs/protocol.md)."""

    kind: str  # rollback | refused | switch
    from_level: str
    to_level: str
    reason: str
    step: int | None = None
    loss: float | None = None
    trend: float | None = None

    def fields(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "kind": self.kind,
            "from": self.from_level,
            "to": self.to_level,
            "reason": self.reason[:512],
        }
        if self.step is not None:
            d["step"] = int(self.step)
        if self.loss is not None and math.isfinite(self.loss):
            d["loss"] = float(self.loss)
        if self.trend is not None and math.isfinite(self.trend):
            d["trend"] = float(self.trend)
        return d


@dataclass(frozen=True)
class PrecisionOptions:
    """The callback's precision tunables (the ``GreenCallback`` arguments of the same names).

    ``fp8_min_features``: linears narrower than this stay out of fp8.
    ``guard_window``, ``cooldown_steps``, ``spike_tolerance``, ``spike_steps``: the
    :class:`Guard`'s ``window``, ``cooldown_steps``, ``spike_tolerance`` and ``spike_steps``.
    """

    fp8_min_features: int = DEFAULT_FP8_MIN_FEATURES
    guard_window: int = 32
    cooldown_steps: int = 500
    spike_tolerance: float | None = 0.5
    spike_steps: int = 200

    def __post_init__(self) -> None:
        for name in ("fp8_min_features", "guard_window", "cooldown_steps", "spike_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a whole number >= 1")
        tolerance = self.spike_tolerance
        if tolerance is not None and not (
            isinstance(tolerance, (int, float)) and math.isfinite(tolerance) and tolerance > 0
        ):
            raise ValueError(f"spike_tolerance={tolerance!r}: must be a number > 0 (a fraction), or None")

    def guard(self) -> Guard:
        """A fresh :class:`Guard` with these settings."""
        return Guard(
            window=self.guard_window,
            cooldown_steps=self.cooldown_steps,
            spike_tolerance=self.spike_tolerance,
            spike_steps=self.spike_steps,
        )


SPIKE_SIGMAS = 6.0  # a spike is also this many batch-to-batch standard deviations over the trend
SPIKE_HISTORY = 512  # the losses at the level above a downgrade whose own spikes are counted
# A jump over the trend that the latest steps at the level above show too (at least
# ABOVE_MIN of the last ABOVE_KEPT, within ABOVE_RECENT_STEPS) is a shift in the data.
ABOVE_MIN, ABOVE_KEPT, ABOVE_RECENT_STEPS = 3, 8, 64
SPIKE_P = 1e-3  # spikes after a downgrade are the level's doing when the level above's own rate
# of them makes so many this unlikely (a job that never spiked: the first one)


@dataclass
class _Downgrade:
    from_level: str
    to_level: str
    step: int  # the first step run at to_level
    trend: float | None  # mean finite loss over the window before the switch
    spread: float = 0.0  # the standard deviation of those losses (one batch's noise)
    own_spikes: int = 0  # spikes the level above had (by the same rule) ...
    own_steps: int = 0  # ... over this many of its steps before the switch
    seen: int = 0  # losses looked at after the switch ...
    spikes: int = 0  # ... and how many of them were spikes
    run: int = 0  # spikes in a row, up to the latest loss


@dataclass
class Guard:
    """The callback's accuracy guard: fast, local rules (the policy has the slow ones).

    ``window``: recent finite losses kept for the trend. ``cooldown_steps``: how
    long a level that failed stays barred. ``spike_tolerance``: a finite loss after
    a downgrade that exceeds the trend before it by more than this fraction of the
    trend (default 0.5: 50 % worse), and by more than ``SPIKE_SIGMAS`` times the
    spread of single-batch losses before the switch (small batches and rare labels
    are that noisy without anything wrong), is a spike and rolls back at once, like
    a non-finite one; None turns the rule off. A job that spikes on its own (a
    heavy-tailed loss: a rare batch far harder than the rest) is judged by its rate: the
    level above's spikes over its last ``SPIKE_HISTORY`` steps, counted by the same rule
    against a moving trend, give the rate to expect, and the spikes after the switch roll
    back when that rate makes so many, or so many in a row, less likely than ``SPIKE_P``
    (one that spiked 8 times in 480 steps: two in a row within the first 3 steps, else the
    third in a row, or 11 spikes within 200 steps). A job that never spiked rolls back at its
    second spike: one may be one bad batch (a corrupted record, a shard of noise), which any
    level meets alike; where a reference batch can tell, the first one is put to it
    (``spike(..., confirm=True)``). The spike rule holds for ``spike_steps``
    steps after the downgrade: a jump in the loss long after a switch is a change in the
    data far more often than the precision's doing (non-finite steps roll back at any
    time). (Slower drifts, a few percent over many steps, are the daemon's ``precision``
    policy's to judge, and the reference check's: one step is too noisy.)
    """

    window: int = 32
    cooldown_steps: int = 500
    spike_tolerance: float | None = 0.5
    spike_steps: int = 200
    losses: deque[float] = field(default_factory=deque)
    stack: list[_Downgrade] = field(default_factory=list)  # downgrades still in force, oldest first
    barred: dict[str, tuple[int, str]] = field(default_factory=dict)  # level -> (until step, why)
    rollbacks: int = 0
    # (step, loss) of the latest steps run at the level above since the downgrade (a trial's
    # steps between its blocks, probe blocks): a jump they show too is the data's.
    above: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=ABOVE_KEPT))
    excused: bool = False  # the latest loss :meth:`spike` looked at was a spike it let pass (not the trend)

    def __post_init__(self) -> None:
        # The trend is the latest ``window`` losses; the rest are the level's spike history.
        self.losses = deque(self.losses, maxlen=max(self.window, SPIKE_HISTORY))

    def note_above(self, loss: float, step: int) -> None:
        """A loss of a step run at the level the latest downgrade came from, after it."""
        self.above.append((step, loss))

    @property
    def armed(self) -> bool:
        """True while the run is below a level it came down from: a non-finite step rolls back."""
        return bool(self.stack)

    def _recent(self) -> list[float]:
        return list(itertools.islice(reversed(self.losses), self.window))

    def trend(self) -> float | None:
        recent = self._recent()
        return sum(recent) / len(recent) if recent else None

    def spread(self) -> float:
        """The standard deviation of the recent losses (0 with fewer than two)."""
        recent = self._recent()
        n = len(recent)
        if n < 2:
            return 0.0
        m = sum(recent) / n
        return math.sqrt(sum((v - m) ** 2 for v in recent) / (n - 1))

    def _is_spike(self, over: float, trend: float, spread: float) -> bool:
        """A loss ``over`` the ``trend`` is a spike: above it by more than ``spike_tolerance``
        of it and by more than ``SPIKE_SIGMAS`` times the ``spread``."""
        tol = self.spike_tolerance
        return tol is not None and over > tol * max(abs(trend), 1e-12) and over > SPIKE_SIGMAS * spread

    def _own_spikes(self) -> tuple[int, int]:
        """(spikes, steps looked at) in the losses kept: each against the mean and spread
        of the ``window`` losses before it, by :meth:`spike`'s rule."""
        h = list(self.losses)
        w = self.window
        if self.spike_tolerance is None or len(h) <= w or w < 2:
            return 0, 0
        s1 = sum(h[:w])
        s2 = sum(v * v for v in h[:w])
        spikes = 0
        for i in range(w, len(h)):
            m = s1 / w
            sd = math.sqrt(max(s2 - w * m * m, 0.0) / (w - 1))
            if self._is_spike(h[i] - m, m, sd):
                spikes += 1
            s1 += h[i] - h[i - w]
            s2 += h[i] * h[i] - h[i - w] * h[i - w]
        return spikes, len(h) - w

    def on_switch(self, old: str, new: str, step: int) -> None:
        """Record a level change (a directive, or a rollback) taking effect at ``step``."""
        if is_downgrade(old, new):
            own, looked = self._own_spikes()
            self.stack.append(_Downgrade(old, new, step, self.trend(), self.spread(), own, looked))
        else:
            bits = BITS.get(new, 32)
            self.stack = [d for d in self.stack if BITS.get(d.from_level, 32) > bits]
        self.losses.clear()  # the trend of the new level starts afresh
        self.above.clear()

    def _seen_above(self, loss: float, step: int | None, spread: float) -> float | None:
        """The level of the latest steps run at the level above (at least ``ABOVE_MIN`` of
        them, within ``ABOVE_RECENT_STEPS``), where ``loss`` is no spike against it: the
        loss moved at both levels alike (the data's doing), so that is the trend now."""
        recent = [v for s, v in self.above if step is None or step - s <= ABOVE_RECENT_STEPS]
        if len(recent) < ABOVE_MIN:
            return None
        level = statistics.median(recent)
        return None if self._is_spike(loss - level, level, spread) else level

    def spike(self, loss: float, step: int | None = None, confirm: bool = False) -> str | None:
        """Why ``loss`` (finite, that of ``step``) is a spike after the latest downgrade, or None.
        ``confirm``: a reference batch will confirm the spike or not (then even a first
        spike of a job that never spiked is a candidate)."""
        if self.spike_tolerance is None or not self.stack:
            return None
        d = self.stack[-1]
        self.excused = False
        if step is not None and step - d.step >= self.spike_steps:
            return None
        trend = d.trend
        if trend is None or not math.isfinite(trend):
            return None
        over = loss - trend
        d.seen += 1
        if not self._is_spike(over, trend, d.spread):
            d.run = 0
            return None
        moved = self._seen_above(loss, step, d.spread)
        if moved is not None:  # the level above saw the same jump: a shift in the data, no spike
            log.info("greend: loss %.6g at %s is over the trend before the switch (%.6g), as are the "
                     "latest steps at %s (%.6g): the data moved; that is the trend now", loss, d.to_level,
                     trend, d.from_level, moved)  # fmt: skip
            d.trend = moved
            d.run = 0
            return None
        d.spikes += 1
        d.run += 1
        why = (
            f"loss {loss:.6g} is {over / max(abs(trend), 1e-12):.0%} above the trend before the "
            f"switch (tolerance {self.spike_tolerance:.0%}, and {over / d.spread if d.spread else math.inf:.1f} "
            f"times the batch-to-batch spread {d.spread:.3g}; limit {SPIKE_SIGMAS:g})"
        )
        if not d.own_spikes:
            # A job that never spiked at the level above: one spike may be one bad batch (a
            # corrupted record, a shard of noise), which any level meets alike; a second one
            # after the switch, or spike after spike, is the level's. (A non-finite loss
            # rolls back at once, by its own rule.)
            if d.spikes < 2 and not confirm:
                self.excused = True
                log.info("greend: %s, %d step(s) after the switch to %s: one spike, where %s had none in %d "
                         "steps, may be one bad batch; a second one rolls back", why, step - d.step if step is
                         not None else d.seen, d.to_level, d.from_level, d.own_steps)  # fmt: skip
                return None
            before = f"none in {d.own_steps}" if d.own_steps else "too few steps kept to count its own"
            return (
                f"{why}: {d.spikes} spike{'s' if d.spikes != 1 else ''} in {d.seen} step{'s' if d.seen != 1 else ''} "
                f"at {d.to_level} ({d.run} in a row), where {d.from_level} had {before}"
            )
        rate = d.own_spikes / d.own_steps
        expected = d.seen * rate
        # More spikes than that rate makes likely, or spike after spike (a run that long
        # anywhere in the steps seen): a one-off spike lasts one batch.
        p = min(_poisson_tail(d.spikes, expected), d.seen * rate**d.run)
        if p >= SPIKE_P:
            return None  # as often as the level above spiked on its own: the data's
        return (
            f"{why}: {d.spikes} spike{'s' if d.spikes != 1 else ''} in {d.seen} steps at {d.to_level} "
            f"({d.run} in a row), where {d.from_level} had {d.own_spikes} in {d.own_steps} (expected "
            f"{expected:.2g}; p {p:.1g})"
        )

    def lone_first(self) -> bool:
        """Whether the latest spike was the first after the downgrade of a job that never
        spiked at the level above: excused unless a reference batch confirms it."""
        d = self.stack[-1] if self.stack else None
        return d is not None and not d.own_spikes and d.spikes < 2

    def data_changed(self) -> None:
        """The loss moved for a reason of the data's: the spike rule has no trend to go by
        until the next switch (non-finite steps still roll back)."""
        for d in self.stack:
            d.trend = None

    def barred_reason(self, level: str, step: int) -> str | None:
        entry = self.barred.get(level)
        if entry is None:
            return None
        until, why = entry
        if step >= until:
            del self.barred[level]
            return None
        return f"{level} is barred until step {until} after a rollback ({why})"

    def rollback(
        self,
        level: str,
        step: int,
        what: str,
        loss: float | None,
        spike: str | None = None,
        *,
        cause: str | None = None,
    ) -> PrecisionEvent | None:
        """A non-finite ``what`` ("loss" or "gradient") at ``step`` running ``level``,
        or, with ``spike`` (the reason :meth:`spike` gave), a finite loss spike, or,
        with ``cause``, another rule's reason (the reference check's).

        Returns the rollback to make (the event to report), or None when the run is
        not below a level it came down from (then it is the user's own problem).
        """
        if not self.stack:
            return None
        d = self.stack.pop()
        after = step - d.step
        if cause is not None:
            short = cause.split(":")[0]
        elif spike:
            cause, short = f"loss spike at step {step}: {spike}", f"loss spike at step {step}"
        else:
            cause = short = f"non-finite {what} at step {step}"
        why = f"{cause}, {after} step{'s' if after != 1 else ''} after the switch {d.from_level} -> {level}"
        if d.trend is not None and short.startswith("non-finite"):
            why += f"; loss trend before the switch {d.trend:.6g}"
        self.barred[level] = (step + 1 + self.cooldown_steps, short)
        self.rollbacks += 1
        self.losses.clear()
        return PrecisionEvent(
            "rollback",
            level,
            d.from_level,
            why + f"; {level} barred for {self.cooldown_steps} steps",
            step=step,
            loss=loss,
            trend=d.trend,
        )


MAX_DETECT_HOOKS = 64  # layers hooked (one step, then taken off) to see the job's own autocast


def weight_layers(model: Any) -> list[Any]:
    """The model's modules that hold weights of their own (the model's first ones, at most
    MAX_DETECT_HOOKS): where its forward computes (where a hook sees the job's own autocast)."""
    out = []
    for m in model.modules():
        if next(m.parameters(recurse=False), None) is not None:
            out.append(m)
            if len(out) >= MAX_DETECT_HOOKS:
                break
    return out or [model]
