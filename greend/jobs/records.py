"""What greend keeps of a job: typed records, units in their field names.

They are changed under the lock of :class:`greend.jobs.registry.JobRegistry`, by its
methods and the booking functions it calls (:mod:`greend.jobs.booking`); other modules
read them (or the views the registry builds). ``to_json`` gives the form a job's report
carries (``greenctl report --json``).

Figures of steps that a device model executed (``greend run --sim``) are named
``modelled_*``; where they reach a report or a store they keep the names users know
(``sim_time_s``, ``sim_energy_j``, ``sim_duration_s``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from greend.errors import ProtocolError

# A job's claim on a GPU (greend.jobs.claims says what each means).
ClaimState = Literal["pending", "active", "trusted"]

__all__ = [
    "DISCONNECTED",
    "EXPIRED",
    "INTERRUPTED",
    "Baseline",
    "CapChange",
    "ClaimState",
    "Caller",
    "RankChannel",
    "EfficiencySample",
    "Job",
    "JobState",
    "Measure",
    "PrecisionChange",
    "Proposal",
    "RankLeft",
    "RankSession",
    "StepAggregate",
    "StepRecord",
]

JobState = Literal["running", "ending", "ended"]


class RankChannel(Protocol):
    """The way back to a rank's process (its connection): events pushed to it."""

    def send(self, obj: dict[str, Any], timeout_s: float = ...) -> bool:
        """Send one message; False if the process is gone or stuck; ValueError (nothing
        sent) if it cannot be encoded. ``timeout_s`` 0: never wait (the tick's pushes)."""
        ...


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a job op, as the socket's edge knows it: its connection (one rank per
    connection: ``session`` is the connection's id), the peer's credentials from the
    kernel, whether it is an admin, and the channel back to it."""

    session: int
    pid: int
    uid: int
    admin: bool = False
    channel: RankChannel | None = None


@dataclass
class StepAggregate:
    """A rank's reported steps over one store interval, at one precision: what the
    stores keep by default (``greend_job_steps``), whatever the step rate."""

    precision: str
    since_s: float  # monotonic: when the interval began
    steps: int = 0
    first_step: int = 0
    last_step: int = 0
    duration_s: float = 0.0
    duration_sq_s2: float = 0.0
    flops: float = 0.0
    samples: int = 0
    tokens: int = 0
    loss_sum: float = 0.0
    loss_n: int = 0
    loss_min: float = float("inf")
    loss_max: float = float("-inf")
    nonfinite: int = 0
    modelled_time_s: float = 0.0  # the steps a device model executed: their time and energy
    modelled_energy_j: float = 0.0
    modelled: bool = False

    def fields(self) -> dict[str, float | int]:
        """The ``greend_job_steps`` fields of this interval."""
        fields: dict[str, float | int] = {
            "steps": self.steps,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "duration_s": self.duration_s,
            "duration_sq_s2": self.duration_sq_s2,
            "flops": self.flops,
            "samples": self.samples,
            "tokens": self.tokens,
            "nonfinite": self.nonfinite,
        }
        if self.loss_n:
            fields.update(
                loss_mean=self.loss_sum / self.loss_n,
                loss_min=self.loss_min,
                loss_max=self.loss_max,
                loss_n=self.loss_n,
            )
        if self.modelled:  # (the stores' names for the model's figures)
            fields["sim_duration_s"] = self.modelled_time_s
            fields["sim_energy_j"] = self.modelled_energy_j
        return fields


@dataclass
class RankSession:
    """One rank (training process) of a job: its connection and what it reported."""

    session: int
    job: str
    rank: int
    local_rank: int
    world_size: int
    gpus: list[int]
    pid: int
    uid: int
    host: str
    precisions: list[str]
    mem_share: float | None
    channel: RankChannel | None  # to push events to the rank (None: nothing can reach it)
    last_seen_s: float
    steps: int = 0
    cpu_last_s: float | None = None  # the rank's process CPU time when last booked
    # Its steps since the last store interval, one aggregate per precision it ran (a rank
    # that changes level every row makes no more points than one that never does).
    aggs: dict[str, StepAggregate] = field(default_factory=dict)
    reference_every: int | None = None  # steps between its reference checks (None: it makes none)
    probe_every: int | None = None  # steps between its probe blocks (None: it runs none)
    sync_every: int | None = None  # steps between its ranks' agreements on the level (None: not said)
    precision: str | None = None  # the level its latest row ran at (None: no row said yet)
    precision_from_step: int = 0  # its rows of earlier steps are older than its own rollback to ``precision``


# How a record ends without its run's own end (the run may go on in a later record: greend.jobs.parts).
INTERRUPTED = "interrupted: the daemon stopped"  # the jobs running when the daemon stops
EXPIRED = "no heartbeat"  # how an expired rank's leaving reason starts
DISCONNECTED = "client disconnected"  # a rank whose connection closed without an end


@dataclass(frozen=True)
class RankLeft:
    """A rank that left the job, and why."""

    rank: int
    pid: int
    reason: str
    steps: int

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": self.pid, "reason": self.reason, "steps": self.steps}


@dataclass(frozen=True)
class StepRecord:
    """One reported step, kept for the sliding window."""

    t0_s: float
    t1_s: float
    flops: float
    samples: int
    tokens: int
    modelled_time_s: float | None  # where a device model executed the step


@dataclass(frozen=True, slots=True)
class EfficiencySample:
    """The job's sliding window at one store interval (its report's ``series``)."""

    t_s: float  # since the job's first step
    power_w: float
    gflops_per_w: float
    flop_per_s: float

    def to_json(self) -> dict[str, float]:
        return {
            "t_s": self.t_s,
            "power_w": self.power_w,
            "gflops_per_w": self.gflops_per_w,
            "flop_per_s": self.flop_per_s,
        }


@dataclass(frozen=True)
class PrecisionChange:
    """A precision level changed (``switch``, ``rollback``) or was refused (``refused``).

    ``rank`` is set for the events a rank's callback reported on its own; the daemon's
    directives concern every rank and leave it out.
    """

    t_wall_s: float
    kind: str
    from_level: str | None
    to_level: str | None
    reason: str
    step: int | None
    loss: float | None
    trend: float | None
    rank: int | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "t": self.t_wall_s,
            "kind": self.kind,
            "from": self.from_level,
            "to": self.to_level,
            "reason": self.reason,
            "step": self.step,
            "loss": self.loss,
            "trend": self.trend,
        }
        if self.rank is not None:
            d["rank"] = self.rank
        return d


@dataclass
class Proposal:
    """A level the daemon asked the job's ranks to run, not yet applied by them.

    A directive is a proposal: in a job of several ranks the ranks agree on one level
    (the most precise any of them asks), so a daemon's directive may never take. The
    job's level moves when its ranks' rows arrive at the level (then it is logged as
    ``kind``); a proposal the ranks ran ``NOT_TAKEN_STEPS`` steps past is logged once
    as not taken and stands (the ranks hold it until the daemon asks another level).
    """

    level: str
    from_level: str
    kind: str  # "switch" or "rollback": what it is logged as once the ranks apply it
    reason: str
    trend: float | None
    step: int  # the job's steps when it was made
    t_wall_s: float
    not_taken_logged: bool = False


@dataclass(frozen=True)
class CapChange:
    """The policy moved the job's GPU setting: what is in force now, and why."""

    t_wall_s: float
    clock_cap_mhz: int | None
    power_limit_w: float | None
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {
            "t": self.t_wall_s,
            "setting": {"clock_cap_mhz": self.clock_cap_mhz, "power_limit_w": self.power_limit_w},
            "reason": self.reason,
        }


@dataclass
class Measure:
    """The job's steps since the setting in force took effect (the policy's evidence,
    :class:`greend.policies.base.JobMeasure`); steps that began before ``since_s`` are
    left out."""

    since_s: float = 0.0
    steps: int = 0
    flops: float = 0.0
    time_s: float = 0.0
    modelled_energy_j: float = 0.0  # the steps' energy where a device model executed them
    time_sq_s2: float = 0.0  # sums of squares per step: the policy's noise estimate
    energy_sq_j2: float = 0.0  # (modelled steps only: real per-step energy is not known)
    t0_s: float | None = None
    t1_s: float | None = None


@dataclass
class Baseline:
    """The job's steps at its own baseline: uncapped, at its own precision (the one it
    registered with, else its first rows'), settled steps only, as the policies measure
    them. What the job would have cost without greend's controller is its FLOPs at the
    baseline's joules per FLOP
    (:meth:`greend.jobs.report.JobFigures.savings`).

    ``x_sum``/``x_sq``: sums of the per-step figure the noise is judged by (joules per
    FLOP where a device model executed the steps, seconds per FLOP on real GPUs, where
    a step's own energy is not known). ``spans``: the baseline steps' monotonic windows, merged where they
    touch (the ledger's joules over them, on real GPUs)."""

    precision: str | None = None
    steps: int = 0
    flops: float = 0.0
    time_s: float = 0.0
    modelled_energy_j: float = 0.0
    x_n: int = 0
    x_sum: float = 0.0
    x_sq: float = 0.0
    spans: list[list[float]] = field(default_factory=list)
    span_open: bool = False  # the last settled step was a baseline step (a new one extends its span)
    # Per GPU, where a device model executed the steps: each GPU's share of the FLOPs and
    # its rank's modelled seconds (the node's critical path is its slowest GPU's).
    gpu_flops: dict[int, float] = field(default_factory=dict)
    gpu_modelled_s: dict[int, float] = field(default_factory=dict)


@dataclass
class Job:
    """A job on this node: its ranks, its GPUs and its running totals."""

    job: str
    uid: int
    registered_s: float
    registered_wall_s: float
    run: str = ""  # the run id its ranks share (tags every point of the job)
    # "training", or "measure": a command measured whole (greenctl measure), whose
    # "steps" are the windows it reports its time in; it has no precision of its own
    kind: str = "training"
    ranks: dict[int, RankSession] = field(default_factory=dict)
    gone: list[RankLeft] = field(default_factory=list)
    gpus: set[int] = field(default_factory=set)
    # Each claimed GPU's claim: "pending" (no process of the job's seen there: steers
    # nothing), "active" or "trusted" (greend.jobs.claims).
    claims: dict[int, ClaimState] = field(default_factory=dict)
    world_size: int = 1  # the job's ranks on all nodes, as its ranks registered it
    ranks_seen: set[int] = field(default_factory=set)  # rank ids that ran on this node
    state: JobState = "running"
    end_reason: str | None = None
    t_start_s: float | None = None
    t_end_s: float | None = None
    last_step_t1_s: float | None = None
    steps: int = 0  # the steps of its busiest rank (every rank runs the same steps)
    steps_by_rank: dict[int, int] = field(default_factory=dict)  # rank id -> its steps, over all its sessions
    # Steps its ranks had sent before this record began (to a daemon that stopped); None: no
    # rank said (callbacks from before they said it).
    steps_before: int | None = None
    step_reports: int = 0
    flops: float = 0.0
    samples: int = 0
    tokens: int = 0
    last_loss: float | None = None
    nonfinite_steps: int = 0
    probe_steps: int = 0  # steps its ranks ran at the level above the job's, as probes
    step_time_s: float = 0.0  # measured, summed over reports
    gpu_flops: dict[int, float] = field(default_factory=dict)  # each step's FLOPs split over its rank's GPUs
    modelled_time_s: float = 0.0  # the steps a device model executed (their report's sim_*)
    modelled_energy_j: float = 0.0
    gpu_modelled_s: dict[int, float] = field(default_factory=dict)  # each GPU's rank's modelled seconds
    precision: str = "fp32"  # the level in force: the level its ranks' rows report running
    proposal: Proposal | None = None  # a level the daemon asked for that the ranks have not applied yet
    precision_since_steps: int = 0  # the job's steps when its level in force took effect
    # The job's own level (where it started: its autocast or framework setting), the top
    # of its ladder: greend never moves it above. None until known (a client that did not
    # say registers without it; its first steps' level is then taken).
    top_precision: str | None = None
    precision_log: list[PrecisionChange] = field(default_factory=list)
    recent: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=4096))  # the registry sets the bound
    series: deque[EfficiencySample] = field(default_factory=lambda: deque(maxlen=7200))
    measure: Measure = field(default_factory=Measure)
    pace_s: float | None = None  # agreed across nodes by the ranks (op "pace")
    floor_s: float | None = None  # its floor, agreed with it: the lowest uncapped step time a node measured
    pace_count: int = 0  # agreements on it received: the most any one rank sent (each rank sends each)
    recheck_at: int = 0  # agreed with it: the latest job step a node asked all to re-check from (0: none)
    pace_ops: dict[int, int] = field(default_factory=dict)  # rank -> its ops "pace", over its sessions
    # This node's pace as last pushed to the ranks (event "local_pace", less "event"; None:
    # none yet): a rank that registers (joins late, or comes back to a restarted daemon) gets
    # it in the reply, so it never writes a pace this daemon did not measure.
    local_pace: dict[str, float] | None = None
    losses: deque[float] = field(default_factory=lambda: deque(maxlen=256))
    nonfinite_recent: deque[int] = field(default_factory=lambda: deque(maxlen=256))
    decisions: list[CapChange] = field(default_factory=list)
    cpu_job_s: float = 0.0  # job processes' CPU seconds over the life, from the host probe
    cpu_busy0_s: float | None = None  # the node's busy CPU seconds when the job's CPU accounting began
    summary: dict[str, Any] | None = None
    capped: bool = False  # a cap or limit is in force on the job's GPUs (its steps are not its baseline)
    baseline: Baseline = field(default_factory=Baseline)
    cap_changes: int = 0  # every cap change (decisions keeps the last 50)
    # Each policy's latest word on the job ({"policy", "role", "reason", "since"}), kept
    # after the end: why there was no cap, why no downgrade.
    notes: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Bounded logs: the oldest entries beyond [daemon] max_log_entries are dropped and counted.
    precision_log_dropped: int = 0
    decisions_dropped: int = 0
    gone_dropped: int = 0

    @property
    def running(self) -> bool:
        return self.state == "running"

    def rank_held(self, rank: int, pid: int) -> ProtocolError | None:
        """The refusal of a registration of ``rank`` by process ``pid`` where another process
        of this job holds it here (a launcher that set no RANK makes every process rank 0,
        and their steps were summed into one rank's); None where the rank is free to it.
        The callback warns and registers again, and joins once that process has left; the
        process that holds the rank may register it again (a callback made anew in a notebook)."""
        holder = next((r for r in self.ranks.values() if r.rank == rank and r.pid != pid), None)
        if holder is None:
            return None
        return ProtocolError(
            f"rank {rank} of job {self.job!r} is already registered by pid {holder.pid}; give each process "
            "its own rank (RANK and WORLD_SIZE, as torchrun sets them; srun sets SLURM_PROCID)",
            field="rank",
        )
