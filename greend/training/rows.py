"""The step records' wire forms: an "intervals" row (consecutive steps at one precision,
summed) and a ``steps`` entry (one step), as ``docs/protocol.md`` defines them. A
record is the tuple the callback queues for the sender: (index, t0_s, t1_s, flops,
samples, tokens, loss, nonfinite, precision)."""

from __future__ import annotations

import math
import operator
from typing import Any

from greend.protocol import MAX_LOSS
from greend.training.probe import probe_level

__all__ = ["Row", "clean", "step_fields"]


def _amount(v: Any) -> float | None:
    """``v`` as a float where it is a finite number >= 0 (a numpy or 0-d tensor one too), else None."""
    try:
        f = float(v)
    except (TypeError, ValueError, OverflowError):
        return None
    return f if 0 <= f < math.inf else None  # (NaN fails both compares)


def _count(v: Any) -> int | None:
    """A samples or tokens count as the wire takes it: a whole number >= 0, else None (not counted)."""
    f = _amount(v)
    return int(f) if f is not None and f < 2**63 else None


def clean(record: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """A record whose user-given fields the wire can hold: the step index as an int
    (``index=`` may be a numpy integer or a 0-d tensor), counts and FLOPs that are finite
    and not negative (else not counted); None where the index is no whole number. Records
    greend made itself pass unchanged."""
    index, t0, t1, flops, samples, tokens, loss, nonfinite, precision = record
    if type(index) is not int:
        try:
            index = operator.index(index)
        except TypeError:
            return None
    if flops is not None and not (type(flops) is float and 0 <= flops < math.inf):
        flops = _amount(flops)
    if samples is not None and (type(samples) is not int or samples < 0):
        samples = _count(samples)
    if tokens is not None and (type(tokens) is not int or tokens < 0):
        tokens = _count(tokens)
    return index, t0, t1, flops, samples, tokens, loss, nonfinite, precision


class Row:
    """Consecutive step records at one precision, summed: one "intervals" row."""

    __slots__ = ("first", "last", "steps", "t0", "t1", "busy", "busy_sq", "flops", "samples", "tokens",
                 "nonfinite", "nonfinite_steps", "loss_n", "loss_sum", "loss_min", "loss_max", "loss_last",
                 "losses", "precision")  # fmt: skip

    def __init__(self, record: tuple[Any, ...], keep_losses: bool) -> None:
        self.steps = 0
        self.first = record[0]
        self.t0 = record[1]
        self.busy = self.busy_sq = self.flops = self.loss_sum = 0.0
        self.samples = self.tokens = self.nonfinite = self.loss_n = 0
        self.nonfinite_steps: list[int] = []
        self.loss_min = math.inf
        self.loss_max = -math.inf
        self.loss_last = 0.0
        self.losses: list[float] | None = [] if keep_losses else None
        self.precision = record[8]
        self.add(record)

    def add(self, record: tuple[Any, ...]) -> None:
        index, t0, t1, flops, samples, tokens, loss, nonfinite, _ = record
        self.steps += 1
        self.last = index
        self.t1 = t1
        d = t1 - t0
        self.busy += d
        self.busy_sq += d * d
        if flops is not None:
            self.flops += float(flops)
        if samples is not None:
            self.samples += int(samples)
        if tokens is not None:
            self.tokens += int(tokens)
        if nonfinite or (loss is not None and not -MAX_LOSS <= loss <= MAX_LOSS):  # (a diverged loss)
            self.nonfinite += 1
            if len(self.nonfinite_steps) < 64:
                self.nonfinite_steps.append(index)
        elif loss is not None:
            self.loss_n += 1
            self.loss_sum += loss
            self.loss_last = loss
            if loss < self.loss_min:
                self.loss_min = loss
            if loss > self.loss_max:
                self.loss_max = loss
            if self.losses is not None:
                self.losses.append(loss)

    def fields(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "first_step": self.first,
            "last_step": self.last,
            "steps": self.steps,
            "t0_s": self.t0,
            "t1_s": self.t1,
            "busy_s": self.busy,
            "busy_sq_s2": self.busy_sq,
            "flops": self.flops if self.flops >= self.steps else 0.0,  # (less than 1 a step: not a count)
            "samples": self.samples,
            "tokens": self.tokens,
            "precision": self.precision,
        }
        level, probe = probe_level(self.precision)
        if probe:
            d["precision"] = level
            d["probe"] = True
        if self.nonfinite:
            d["nonfinite"] = self.nonfinite
            d["nonfinite_steps"] = self.nonfinite_steps
        if self.loss_n:
            d.update(loss_n=self.loss_n, loss_sum=self.loss_sum, loss_min=self.loss_min, loss_max=self.loss_max,
                     loss_last=self.loss_last)  # fmt: skip
            if self.losses:
                d["losses"] = self.losses
        return d


def step_fields(record: tuple[Any, ...]) -> dict[str, Any]:
    """One queued step record as the ``steps`` message carries it (``docs/protocol.md``)."""
    index, t0, t1, flops, samples, tokens, loss, nonfinite, precision = record
    level, probe = probe_level(precision)
    d: dict[str, Any] = {
        "step": index,
        "t0_s": t0,
        "t1_s": t1,
        "flops": float(flops) if flops is not None and flops >= 1 else 0.0,  # (less than 1: not a count)
        "precision": level,
    }
    if probe:
        d["probe"] = True
    if samples is not None:
        d["samples"] = int(samples)
    if tokens is not None:
        d["tokens"] = int(tokens)
    if nonfinite or (loss is not None and not -MAX_LOSS <= loss <= MAX_LOSS):  # (a diverged loss)
        d["loss"] = None
        d["nonfinite"] = True
    elif loss is not None:
        d["loss"] = loss
    return d
