"""The socket protocol's constants and schemas, in one place both sides import.

The daemon (:mod:`greend.ipc.server`, the routes in :mod:`greend.daemon.routes`)
validates every request against :data:`SCHEMAS`; the clients
(:mod:`greend.ipc.client`, the training callback's sender) frame their
messages with :func:`encode` and stay within the same limits. The wire format
is described in ``docs/protocol.md``.

Beside each schema, its typed form: the daemon's ops decode a message's entries once
(:func:`decode_rows`, :func:`decode_steps`, :func:`decode_register`,
:func:`decode_precision_event`) into frozen records (:class:`StepsRow`,
:class:`StepEntry`, :class:`Registration`, :class:`PrecisionEventEntry`), and book those.

Nothing here does I/O, and nothing here imports the daemon or torch.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from greend.errors import ProtocolError

__all__ = [
    "ADMIN_OPS",
    "DEFAULT_SOCKET",
    "FP8_LEVELS",
    "PRECISION_BITS",
    "may_run",
    "not_above",
    "Field",
    "JOB_ID_RE",
    "JOB_KINDS",
    "MAX_CONNECTIONS",
    "MAX_FLOPS_PER_ROW",
    "MAX_FLOPS_PER_STEP",
    "MAX_INT",
    "MAX_STEP",
    "MAX_LOSS",
    "MAX_MESSAGE_BYTES",
    "MAX_STEPS_PER_MESSAGE",
    "MAX_TIME_S",
    "NODE_OWNER",
    "PACE_S_RANGE",
    "POLICY_OWNER",
    "PROFILE_OWNER",
    "PRECISIONS",
    "PROTOCOL_VERSION",
    "RESERVED_OWNERS",
    "SCHEMAS",
    "STEP_FIELDS",
    "INTERVAL_FIELDS",
    "MAX_ROWS_PER_MESSAGE",
    "PrecisionEventEntry",
    "Registration",
    "StepEntry",
    "StepsRow",
    "check_entries",
    "check_row",
    "check_step",
    "decode_precision_event",
    "decode_register",
    "decode_row",
    "decode_rows",
    "decode_step",
    "decode_steps",
    "encode",
    "is_step",
    "validate",
]

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024  # one JSON line, the newline included
MAX_CONNECTIONS = 256
MAX_STEPS_PER_MESSAGE = 1024
MAX_ROWS_PER_MESSAGE = 64  # "intervals" rows; a row carries at most MAX_STEPS_PER_MESSAGE losses

# The range of every number a message carries. What the daemon adds up and divides
# (a job's totals, its baseline, its GFLOPS/W) stays finite only if what comes in is
# bounded: one integer of 310 digits or a FLOP count of 5e-324 is enough otherwise to
# put inf into every later reply about the job (or to stop the daemon).
MAX_INT = 1 << 53  # any integer field (and list item), unless its schema says less: exact in a double
MAX_STEP = MAX_INT - 1  # a job step carried in the pace agreement (recheck_at): ranks and daemon alike


def is_step(value: Any) -> bool:
    """Whether ``value`` is a job step the pace agreement carries (an int, 0 .. MAX_STEP; no bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_STEP


MAX_TIME_S = 1e10  # a monotonic time or a duration, s (317 years)
# A pace's step time (s), as op "pace" takes it (and the daemon's "local_pace" pushes it).
PACE_S_RANGE = (1e-9, 1e6)
MAX_LOSS = 1e30  # a loss's magnitude; the callback counts a larger one as non-finite (diverged)
MAX_FLOPS_PER_STEP = 1e21  # a "steps" entry's FLOPs
MAX_FLOPS_PER_ROW = 1e24  # an "intervals" row's FLOPs (its steps' sum)

# Where the daemon listens unless told otherwise ($GREEND_SOCKET, --socket, [daemon] socket).
DEFAULT_SOCKET = Path("/run/greend/greend.sock")

# A job id: what `job=`, $GREEND_JOB or the scheduler gives, as the daemon accepts it.
JOB_ID_RE = re.compile(r"^[A-Za-z0-9._:@/\-]{1,128}\Z")
JOB_KINDS = ("training", "measure")  # register's "kind"
RUN_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}\Z")  # a run of a job id (register's "run")

# Owners of saved settings that are not jobs, so no job may take these ids:
# NODE_OWNER holds what an admin set (greenctl cap set; outlives policies),
# POLICY_OWNER what a node-level policy set (static, budget; lifted on a switch),
# PROFILE_OWNER the power limits of a running profile recording (greenctl profile record).
NODE_OWNER = "node"
POLICY_OWNER = "policy"
PROFILE_OWNER = "profile"
RESERVED_OWNERS = (NODE_OWNER, POLICY_OWNER, PROFILE_OWNER)

# The precision levels a training job can run, highest first. "fp8-emulated" is
# torchao's emulation of fp8 numerics for CPU tests; it stands in for "fp8".
PRECISIONS: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16", "fp8", "fp8-emulated")
FP8_LEVELS: tuple[str, ...] = ("fp8", "fp8-emulated")
# Mantissa-ish "bits" of each level: a switch to fewer bits is a downgrade.
PRECISION_BITS: dict[str, int] = {"fp32": 32, "tf32": 19, "bf16": 16, "fp16": 16, "fp8": 8, "fp8-emulated": 8}


def may_run(level: str, top: str) -> bool:
    """Whether greend may run a job whose own level is ``top`` at ``level``: its own level,
    or one with fewer bits. Never sideways: fp16 has bf16's bits but far less range, so a
    bf16 job is never moved to fp16 (nor an fp16 job to bf16)."""
    return level == top or PRECISION_BITS[level] < PRECISION_BITS[top]


def not_above(levels: Iterable[str], top: str) -> tuple[str, ...]:
    """The ``levels`` greend may run a job at whose own level is ``top`` (:func:`may_run`)."""
    return tuple(level for level in levels if may_run(level, top))


def encode(obj: dict[str, Any]) -> bytes:
    """One message as it goes on the wire: compact JSON, no NaN/Infinity, a newline."""
    return (json.dumps(obj, separators=(",", ":"), allow_nan=False) + "\n").encode()


@dataclass(frozen=True)
class Field:
    """One field of a message: its type(s), whether required, and bounds."""

    types: tuple[type, ...]
    required: bool = False
    min: float | None = None
    max: float | None = None
    max_len: int | None = None  # strings and lists
    item_types: tuple[type, ...] | None = None  # for lists
    item_min: float | None = None  # for lists of integers (default: -MAX_INT)
    item_max: float | None = None  # (default: MAX_INT)
    choices: tuple[Any, ...] | None = None

    def describe(self) -> str:
        names = {int: "integer", float: "number", str: "string", bool: "boolean", list: "list", dict: "object"}
        return " or ".join(names.get(t, t.__name__) for t in self.types)


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # C0, DEL and C1 control characters


def validate(msg: dict[str, Any], schema: dict[str, Field], *, allow_extra: bool = False) -> dict[str, Any]:
    """Check ``msg`` against ``schema``; raise ProtocolError naming the field."""
    base = {"v", "id", "op"}
    for name, spec in schema.items():
        if name not in msg or msg[name] is None:
            if spec.required:
                raise ProtocolError(f"missing required field {name!r} ({spec.describe()})", field=name)
            continue
        value = msg[name]
        ok_types = spec.types
        # JSON has one number type: an integer is a fine float; a bool is not a number.
        if isinstance(value, bool) and bool not in ok_types:
            raise ProtocolError(f"{name!r} must be {spec.describe()}, not a boolean", field=name)
        if float in ok_types and isinstance(value, int) and not isinstance(value, bool):
            if int not in ok_types:
                try:
                    value = float(value)
                except OverflowError:
                    raise ProtocolError(
                        f"{name!r} = an integer of {len(str(value))} digits is out of range for a number", field=name
                    ) from None
        if not isinstance(value, ok_types):
            raise ProtocolError(f"{name!r} must be {spec.describe()}, not {type(value).__name__}", field=name)
        # Python's json reads NaN, Infinity and -Infinity; replies are written with
        # allow_nan=False, so one such value kept would break every later report.
        if isinstance(value, float) and not math.isfinite(value):
            raise ProtocolError(f"{name!r} must be a finite number, not {value!r}", field=name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            lo, hi = spec.min, spec.max
            if isinstance(value, int):  # every integer is within +-MAX_INT unless the schema says less
                lo = -MAX_INT if lo is None else lo
                hi = MAX_INT if hi is None else hi
            if lo is not None and value < lo:
                raise ProtocolError(f"{name!r} = {_short(value)} is below the minimum {lo:g}", field=name)
            if hi is not None and value > hi:
                raise ProtocolError(f"{name!r} = {_short(value)} is above the maximum {hi:g}", field=name)
        if isinstance(value, (str, list)) and spec.max_len is not None and len(value) > spec.max_len:
            raise ProtocolError(f"{name!r} is longer than {spec.max_len}", field=name)
        if isinstance(value, str) and _CONTROL.search(value):
            # A line break or an escape sequence in a reason would forge log lines and
            # reach an admin's terminal through greenctl: each becomes a space.
            value = _CONTROL.sub(" ", value)
        if isinstance(value, list) and spec.item_types is not None:
            lo = -MAX_INT if spec.item_min is None else spec.item_min
            hi = MAX_INT if spec.item_max is None else spec.item_max
            for i, item in enumerate(value):
                if isinstance(item, bool) and bool not in spec.item_types or not isinstance(item, spec.item_types):
                    raise ProtocolError(f"{name}[{i}] has the wrong type {type(item).__name__}", field=name)
                if isinstance(item, int) and not lo <= item <= hi:
                    raise ProtocolError(f"{name}[{i}] = {_short(item)} is outside {lo:g}..{hi:g}", field=name)
        if spec.choices is not None and value not in spec.choices:
            raise ProtocolError(f"{name!r} = {value!r} is not one of {', '.join(map(str, spec.choices))}", field=name)
        msg[name] = value
    if not allow_extra:
        extra = set(msg) - set(schema) - base
        if extra:
            first = sorted(extra)[0]
            raise ProtocolError(
                f"unknown field {first!r}; this op takes {', '.join(sorted(schema)) or 'no fields'}",
                field=first,
            )
    return msg


def _short(value: float) -> str:
    """A number as an error message quotes it: a huge integer by its digits' count."""
    text = repr(value)
    return text if len(text) <= 40 else f"an integer of {len(text.lstrip('-'))} digits"


_TIME = Field((float,), required=True, min=0.0, max=MAX_TIME_S)
_LOSS = Field((float,), min=-MAX_LOSS, max=MAX_LOSS)
_LOSS_SUM = Field((float,), min=-MAX_LOSS * (1 << 31), max=MAX_LOSS * (1 << 31))  # steps <= 2**31 losses

# One entry of a "steps" message (validated entry by entry, so one bad step names its index).
STEP_FIELDS: dict[str, Field] = {
    "step": Field((int,), required=True, min=0),
    "t0_s": _TIME,
    "t1_s": _TIME,
    "flops": Field((float,), required=True, min=0.0, max=MAX_FLOPS_PER_STEP),  # 0 (unknown) or >= 1
    "samples": Field((int,), min=0),
    "tokens": Field((int,), min=0),
    "loss": _LOSS,
    "nonfinite": Field((bool,)),
    "precision": Field((str,), choices=PRECISIONS),
    "probe": Field((bool,)),  # a probe step (see INTERVAL_FIELDS)
}

# One row of an "intervals" message: a rank's consecutive steps at one precision,
# summed at the source (the callback's sender thread) so the daemon's work per second
# does not grow with the step rate. ``losses`` (each finite loss, in order) only where
# the daemon may change the job's precision, whose policy judges losses step by step.
INTERVAL_FIELDS: dict[str, Field] = {
    "first_step": Field((int,), required=True, min=0),
    "last_step": Field((int,), required=True, min=0),
    "steps": Field((int,), required=True, min=1, max=1 << 31),
    "t0_s": _TIME,  # the first step's start
    "t1_s": _TIME,  # the last step's end
    "busy_s": Field((float,), required=True, min=0.0, max=MAX_TIME_S),  # sum of the steps' durations
    "busy_sq_s2": Field((float,), required=True, min=0.0, max=MAX_TIME_S * MAX_TIME_S),  # sum of their squares
    "flops": Field((float,), required=True, min=0.0, max=MAX_FLOPS_PER_ROW),  # 0 (unknown) or >= 1 a step
    "samples": Field((int,), min=0),
    "tokens": Field((int,), min=0),
    "nonfinite": Field((int,), min=0),  # steps whose loss or a gradient was inf/NaN
    "nonfinite_steps": Field((list,), max_len=64, item_types=(int,), item_min=0),  # their indices (the first 64)
    "loss_n": Field((int,), min=0),  # finite losses reported
    "loss_sum": _LOSS_SUM,
    "loss_min": _LOSS,
    "loss_max": _LOSS,
    "loss_last": _LOSS,
    "losses": Field((list,), max_len=MAX_STEPS_PER_MESSAGE),  # numbers: check_row checks them in one pass
    "precision": Field((str,), choices=PRECISIONS),
    # Probe steps: run at the level above the job's level to judge it (a client that
    # registered probe_every); booked as that level's energy, never as a switch.
    "probe": Field((bool,)),
}


def check_entries(
    name: str, entries: list[Any], limit: int, check: Callable[[dict[str, Any]], dict[str, Any]]
) -> list[dict[str, Any]]:
    """A message's ``steps`` or ``rows``: at most ``limit``, each an object that ``check``
    (:func:`check_step`, :func:`check_row`) accepts; a bad one is refused as
    ``name[i].field``, so nothing of the message is taken."""
    if len(entries) > limit:
        raise ProtocolError(f"at most {limit} {name} per message", field=name)
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise ProtocolError(f"{name}[{i}] must be an object", field=name)
        try:
            check(e)
        except ProtocolError as err:
            raise ProtocolError(f"{name}[{i}]: {err}", field=f"{name}[{i}].{err.field}") from None
    return entries


def check_step(s: dict[str, Any]) -> dict[str, Any]:
    """Validate one "steps" entry: its fields, and that it ends after it starts."""
    validate(s, STEP_FIELDS)
    if s["t1_s"] < s["t0_s"]:
        raise ProtocolError("t1_s is before t0_s", field="t1_s")
    _check_flops(s["flops"], 1)
    return s


def _check_flops(flops: float, steps: int) -> None:
    """FLOPs are 0 (not counted) or at least one a step: a count below that is no count
    (and a divisor that takes a job's joules per FLOP, and its report, to inf)."""
    if 0 < flops < steps:
        raise ProtocolError(
            f"'flops' = {flops!r} for {steps} step(s): send 0 where FLOPs are not counted, else at least 1 a step",
            field="flops",
        )


def check_row(r: dict[str, Any]) -> dict[str, Any]:
    """Validate one "intervals" row: its fields, and that its parts agree."""
    validate(r, INTERVAL_FIELDS)
    if r["t1_s"] < r["t0_s"]:
        raise ProtocolError("t1_s is before t0_s", field="t1_s")
    if r["last_step"] < r["first_step"]:
        raise ProtocolError("last_step is before first_step", field="last_step")
    n = r["steps"]
    _check_flops(r["flops"], n)
    for name in ("nonfinite", "loss_n"):
        if (r.get(name) or 0) > n:
            raise ProtocolError(f"{name!r} = {r[name]} is more than the row's {n} steps", field=name)
    if r.get("loss_n"):
        if r.get("loss_sum") is None:
            raise ProtocolError("'loss_sum' is required with 'loss_n'", field="loss_sum")
        if abs(r["loss_sum"]) > MAX_LOSS * r["loss_n"]:
            raise ProtocolError(
                f"'loss_sum' = {r['loss_sum']:g} is beyond {MAX_LOSS:g} a loss over 'loss_n' = {r['loss_n']}",
                field="loss_sum",
            )
    losses = r.get("losses")
    if losses:
        if len(losses) > n:
            raise ProtocolError(f"'losses' has {len(losses)} values for the row's {n} steps", field="losses")
        # C-speed passes instead of a check per value: sum() refuses a non-number, and
        # the sum is finite only if every value is (a sum beyond 1e308 is refused too);
        # max(map(abs)) finds the largest magnitude.
        try:
            if not math.isfinite(sum(losses)) or any(type(x) is bool for x in losses):
                raise TypeError
            biggest = max(map(abs, losses))
        except (TypeError, OverflowError):  # (an integer past a double's range: OverflowError)
            raise ProtocolError(
                "'losses' must be finite numbers (count the others in 'nonfinite')", field="losses"
            ) from None
        if biggest > MAX_LOSS:
            raise ProtocolError(
                f"'losses' has a value of magnitude {biggest:g}, beyond {MAX_LOSS:g} (count it in 'nonfinite')",
                field="losses",
            )
    return r


# Typed entries ----------------------------------------------------------------------
# Each wire entry is checked (above) and decoded once, here, into a typed row; the daemon
# books the rows, never the dicts.


@dataclass(frozen=True, slots=True)
class StepsRow:
    """One "intervals" row, decoded: a rank's consecutive steps at one precision (or one
    "steps" entry as a row of one step, :meth:`StepEntry.as_row`). The sums are the
    steps'; the loss figures are of the finite losses only."""

    first_step: int
    last_step: int
    steps: int
    t0_s: float  # monotonic: the first step's start
    t1_s: float  # monotonic: the last step's end
    busy_s: float  # sum of the steps' durations
    busy_sq_s2: float  # sum of their squares
    flops: float
    samples: int = 0
    tokens: int = 0
    nonfinite: int = 0  # steps whose loss or a gradient was inf/NaN
    nonfinite_steps: tuple[int, ...] = ()  # their indices (the first 64), where sent
    loss_n: int = 0
    loss_sum: float = 0.0
    loss_min: float | None = None
    loss_max: float | None = None
    loss_last: float | None = None
    losses: tuple[float, ...] = ()  # each finite loss in order, where sent
    precision: str | None = None  # None: the job's level in force
    probe: bool = False  # probe steps at the level above the job's (not a switch)


@dataclass(frozen=True, slots=True)
class StepEntry:
    """One "steps" entry, decoded: a single step as the client timed it."""

    step: int
    t0_s: float
    t1_s: float
    flops: float
    samples: int = 0
    tokens: int = 0
    loss: float | None = None
    nonfinite: bool = False
    precision: str | None = None
    probe: bool = False

    @property
    def duration_s(self) -> float:
        return self.t1_s - self.t0_s

    def as_row(self) -> StepsRow:
        """This step as a row of one step (the daemon books both forms alike)."""
        d = self.t1_s - self.t0_s
        if self.nonfinite:
            losses: dict[str, Any] = {"nonfinite": 1, "nonfinite_steps": (self.step,)}
        elif self.loss is not None:
            loss = self.loss
            losses = {"loss_n": 1, "loss_sum": loss, "loss_min": loss, "loss_max": loss, "loss_last": loss}
            losses["losses"] = (loss,)
        else:
            losses = {}
        return StepsRow(
            first_step=self.step,
            last_step=self.step,
            steps=1,
            t0_s=self.t0_s,
            t1_s=self.t1_s,
            busy_s=d,
            busy_sq_s2=d * d,
            flops=self.flops,
            samples=self.samples,
            tokens=self.tokens,
            precision=self.precision,
            probe=self.probe,
            **losses,
        )


def decode_row(r: dict[str, Any]) -> StepsRow:
    """A row that :func:`check_row` accepted, as a :class:`StepsRow`."""
    return StepsRow(
        first_step=r["first_step"],
        last_step=r["last_step"],
        steps=r["steps"],
        t0_s=float(r["t0_s"]),
        t1_s=float(r["t1_s"]),
        busy_s=float(r["busy_s"]),
        busy_sq_s2=float(r["busy_sq_s2"]),
        flops=float(r["flops"]),
        samples=r.get("samples") or 0,
        tokens=r.get("tokens") or 0,
        nonfinite=r.get("nonfinite") or 0,
        nonfinite_steps=tuple(r.get("nonfinite_steps") or ()),
        loss_n=r.get("loss_n") or 0,
        loss_sum=float(r.get("loss_sum") or 0.0),
        loss_min=r.get("loss_min"),
        loss_max=r.get("loss_max"),
        loss_last=r.get("loss_last"),
        losses=tuple(r.get("losses") or ()),
        precision=r.get("precision"),
        probe=bool(r.get("probe")),
    )


def decode_step(s: dict[str, Any]) -> StepEntry:
    """A "steps" entry that :func:`check_step` accepted, as a :class:`StepEntry`."""
    return StepEntry(
        step=s["step"],
        t0_s=float(s["t0_s"]),
        t1_s=float(s["t1_s"]),
        flops=float(s["flops"]),
        samples=s.get("samples") or 0,
        tokens=s.get("tokens") or 0,
        loss=s.get("loss"),
        nonfinite=bool(s.get("nonfinite")),
        precision=s.get("precision"),
        probe=bool(s.get("probe")),
    )


def decode_rows(entries: list[Any]) -> list[StepsRow]:
    """An "intervals" message's ``rows``, checked (:func:`check_entries`) and decoded."""
    return [decode_row(r) for r in check_entries("rows", entries, MAX_ROWS_PER_MESSAGE, check_row)]


def decode_steps(entries: list[Any]) -> list[StepEntry]:
    """A "steps" message's ``steps``, checked (:func:`check_entries`) and decoded."""
    return [decode_step(s) for s in check_entries("steps", entries, MAX_STEPS_PER_MESSAGE, check_step)]


@dataclass(frozen=True, slots=True)
class Registration:
    """A "register" message, decoded: one rank of a job introduces itself."""

    job: str
    run: str | None
    rank: int
    local_rank: int
    world_size: int
    gpus: tuple[int, ...]  # sorted, without repeats
    host: str | None
    precisions: tuple[str, ...]
    mem_share: float | None
    reference_every: int | None
    # Steps between the probe blocks the rank runs at the level above while below its own
    # level (it sends them as rows with "probe"); None: it runs none.
    probe_every: int | None = None
    # The level the job runs at on its own (its autocast, its framework's setting): the
    # top of its ladder. None from an older client: its first steps' level tells.
    precision: str | None = None
    # Steps between the job's ranks' agreements on its level (a job of several ranks).
    sync_every: int | None = None
    # "training" (a training process), or "measure": a command measured whole by
    # `greenctl measure`, with no training level and windows in place of steps.
    kind: str = "training"
    # Steps this rank had sent over earlier connections in its run (to this daemon, or to
    # one that stopped since): a new record's steps before that it never saw.
    steps_before: int | None = None  # (None: a callback from before it said)


def decode_register(msg: dict[str, Any]) -> Registration:
    """A "register" message that :data:`SCHEMAS` accepted, as a :class:`Registration`;
    the job id, run id, levels and GPU indices are checked here."""
    job_id = msg["job"]
    if not JOB_ID_RE.match(job_id):
        raise ProtocolError("'job' must be 1-128 characters of letters, digits and . _ : @ / -", field="job")
    if job_id in RESERVED_OWNERS:
        raise ProtocolError(
            f"job id {job_id!r} is reserved (greend's own settings go by "
            f"{' and '.join(map(repr, RESERVED_OWNERS))}): use another",
            field="job",
        )
    run = msg.get("run") or None
    if run is not None and not RUN_ID_RE.match(run):
        raise ProtocolError("'run' must be 1-64 characters of letters, digits and . _ -", field="run")
    precisions = msg.get("precisions") or ["fp32"]
    bad = [p for p in precisions if p not in PRECISIONS]
    if bad:
        raise ProtocolError(
            f"'precisions' has unknown level {bad[0]!r}; known: {', '.join(PRECISIONS)}", field="precisions"
        )
    gpus = sorted(set(msg.get("gpus") or []))
    if any(g < 0 for g in gpus):
        raise ProtocolError("'gpus' must be node-local indices >= 0", field="gpus")
    own = msg.get("precision")
    if own is not None and msg.get("precisions") and own not in precisions:
        raise ProtocolError(
            f"'precision' {own!r} (the job's own level) is not among its 'precisions' {precisions}",
            field="precision",
        )
    return Registration(
        job=job_id,
        run=run,
        rank=msg.get("rank") or 0,
        local_rank=msg.get("local_rank") or 0,
        world_size=msg.get("world_size") or 1,
        gpus=tuple(gpus),
        host=msg.get("host") or None,
        precisions=tuple(precisions),
        mem_share=msg.get("mem_share"),
        reference_every=msg.get("reference_every"),
        probe_every=msg.get("probe_every"),
        precision=own,
        sync_every=msg.get("sync_every"),
        kind=msg.get("kind") or "training",
        steps_before=msg.get("steps_before"),
    )


@dataclass(frozen=True, slots=True)
class PrecisionEventEntry:
    """A "precision_event" message, decoded: the callback changed or refused a level on
    its own (``kind``: "rollback", "refused" or "switch")."""

    kind: str
    from_level: str | None
    to_level: str | None
    reason: str | None
    step: int | None
    loss: float | None
    trend: float | None


def decode_precision_event(msg: dict[str, Any]) -> PrecisionEventEntry:
    """A "precision_event" message that :data:`SCHEMAS` accepted, as a :class:`PrecisionEventEntry`."""
    return PrecisionEventEntry(
        kind=msg["kind"],
        from_level=msg.get("from"),
        to_level=msg.get("to"),
        reason=msg.get("reason"),
        step=msg.get("step"),
        loss=msg.get("loss"),
        trend=msg.get("trend"),
    )


_GPU_INDEX = Field((int,), min=0, max=1023)
_CPU_ZONE = Field((str,), max_len=128)
_JOB = Field((str,), required=True, max_len=128)

# Every op the daemon answers, with the fields it takes (besides v, id, op).
SCHEMAS: dict[str, dict[str, Field]] = {
    "ping": {},
    "status": {},
    "probes": {},
    "energy": {
        "key": Field((str,), required=True, max_len=128),
        "t0_s": Field((float,), required=True, min=-MAX_TIME_S, max=MAX_TIME_S),
        "t1_s": Field((float,), required=True, min=-MAX_TIME_S, max=MAX_TIME_S),
    },
    "register": {
        "job": _JOB,
        "rank": Field((int,), min=0, max=1 << 20),
        "local_rank": Field((int,), min=0, max=1 << 16),
        "world_size": Field((int,), min=1, max=1 << 20),
        "gpus": Field((list,), max_len=64, item_types=(int,), item_min=0, item_max=_GPU_INDEX.max),
        "host": Field((str,), max_len=255),
        "precisions": Field((list,), max_len=len(PRECISIONS), item_types=(str,)),
        # The level the job runs at on its own: greend never moves it above this one.
        "precision": Field((str,), choices=PRECISIONS),
        "mem_share": Field((float,), min=0.0, max=0.95),
        "flops_per_step": Field((float,), min=0.0, max=MAX_FLOPS_PER_STEP),
        # The callback checks accuracy on a reference batch every this many steps after a
        # downgrade (GreenCallback(reference_loss=...)): its rollbacks are then the verdict.
        "reference_every": Field((int,), min=1, max=1 << 30),
        "probe_every": Field((int,), min=1, max=1 << 30),
        # A job of several ranks agrees on its precision every this many steps.
        "sync_every": Field((int,), min=1, max=1 << 30),
        # The run id every rank of one run shares (a rerun or a reused job id has another).
        "run": Field((str,), max_len=64),
        # "measure": a command measured whole (greenctl measure): no precision, windows
        # in place of steps. An older daemon refuses the field: greenctl registers again without.
        "kind": Field((str,), choices=JOB_KINDS),
        # Steps the rank sent over its earlier connections (0 or absent at its first).
        "steps_before": Field((int,), min=0, max=1 << 53),
    },
    "steps": {"steps": Field((list,), required=True)},
    "intervals": {"rows": Field((list,), required=True)},
    "heartbeat": {},
    "end": {"reason": Field((str,), max_len=256)},
    "jobs": {},
    "report": {"job": _JOB},
    "pace": {
        "step_s": Field((float,), required=True, min=PACE_S_RANGE[0], max=PACE_S_RANGE[1]),
        # The job's floor: the lowest uncapped step time any node measured (absent: none agreed).
        "floor_s": Field((float,), min=PACE_S_RANGE[0], max=PACE_S_RANGE[1]),
        # The latest job step a node asked every node to re-check its baseline from (a MAX; absent: none).
        "recheck_at": Field((int,), min=0, max=MAX_STEP),
    },
    "precision_event": {
        "kind": Field((str,), required=True, choices=("rollback", "refused", "switch")),
        "from": Field((str,), choices=PRECISIONS),
        "to": Field((str,), choices=PRECISIONS),
        "reason": Field((str,), max_len=512),
        "step": Field((int,), min=0),
        "loss": _LOSS,
        "trend": _LOSS,
    },
    "cap_set": {
        "gpu": _GPU_INDEX,
        "cpu_zone": _CPU_ZONE,
        "max_clock_mhz": Field((int,), min=1, max=100_000),
        "power_limit_w": Field((float,), min=1.0, max=100_000.0),
    },
    "cap_reset": {"gpu": _GPU_INDEX, "cpu_zone": _CPU_ZONE},
    "policy_show": {},
    "policy_set": {
        "name": Field((str,), required=True, max_len=64),
        "params": Field((dict,)),
        "precision": Field((str,), max_len=64),  # the precision policy beside it ("none": off)
        "precision_params": Field((dict,)),
    },
    # A power-limit sweep on one GPU while a job runs (greenctl profile record): start one,
    # ask how it goes (its rows so far), or abort it; see docs/protocol.md.
    "profile": {
        "action": Field((str,), required=True, choices=("start", "status", "abort")),
        "gpu": _GPU_INDEX,
        "job": Field((str,), max_len=128),
        "from_w": Field((float,), min=1.0, max=100_000.0),
        "to_w": Field((float,), min=1.0, max=100_000.0),
        "step_w": Field((float,), min=1.0, max=100_000.0),
        "steps_per_limit": Field((int,), min=2, max=100_000),
    },
}

# Ops that change the node's settings: root or the admin group only.
ADMIN_OPS = frozenset({"cap_set", "cap_reset", "policy_set", "profile"})
