"""What a policy sees and what it decides.

A policy is pure: ``decide(snapshot, state) -> Decision``. The daemon builds the
:class:`Snapshot` each decision period (default 1 s) from its ledger, probes and
jobs, passes the policy's own ``state`` object back every call (the policy keeps
its search there), and applies the :class:`Decision` through the actuators.
Policies never touch devices, files, clocks or sockets, so they are tested by
replaying traces or by driving the simulator directly (see ``greend/testing/harness.py``).

Settings are per job: all ranks of a job on a node get the same cap, since the
slowest GPU sets the pace of a synchronous job. A policy that paces a job's GPUs
(gives those off its critical path a deeper cap) names them in
``Decision.job_gpu_settings``; they stay the job's settings, lifted when it ends.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from greend.settings import UNCAPPED, Setting

__all__ = [
    "Decision",
    "GpuView",
    "JobMeasure",
    "JobView",
    "Policy",
    "Setting",
    "Snapshot",
    "UNCAPPED",
]


@dataclass(frozen=True)
class GpuView:
    index: int
    source: str  # "nvml" | "sim"
    power_w: float | None
    sm_clock_mhz: float | None
    clock_cap_mhz: int | None  # in force now (None = uncapped)
    power_limit_w: float | None  # in force now
    supported_sm_clocks_mhz: tuple[int, ...]  # descending, as NVML lists them
    power_limit_min_w: float | None
    power_limit_max_w: float | None
    power_limit_default_w: float | None
    # Knobs this GPU refused ("clock_cap_mhz", "power_limit_w") -> why ("not_supported",
    # "mig", "no_permission"): greend will not write them; a policy uses the other knob.
    refused_knobs: Mapping[str, str] = field(default_factory=dict)
    # The clock cap greend asked for where the GPU holds another one (``clock_cap_mhz``,
    # read back: a driver that clamps a lock); None where it holds what was asked.
    clock_cap_asked_mhz: float | None = None
    # Percent of the last sample period a kernel ran (NVML utilization.gpu; the simulator:
    # its busy time). Within a synchronous job a GPU that waits for a slower one shows
    # less: the slack that pacing (policies/_pacing.py) turns into a deeper cap.
    util_pct: float | None = None
    # Percent of the SMs busy over the last second (NVML GPM SM_UTIL, Hopper and newer; the
    # simulator: its busy share); None where the GPU has no GPM. A GPU that only waits in an
    # NCCL collective reads low here while util_pct stays near 100 %.
    sm_active_pct: float | None = None


@dataclass(frozen=True)
class JobMeasure:
    """What the job's steps showed at one setting, since that setting took effect.

    ``time_per_flop_s`` and ``energy_per_flop_j`` are normalised by FLOPs so that
    steps of different sizes compare; ``steps`` says how much evidence there is.
    On real GPUs time is the measured step time and energy the ledger's over the
    steps' windows; on simulated GPUs both come from the simulator's model.
    """

    setting: Setting
    steps: int
    flops: float
    time_s: float  # sum of step times
    energy_j: float  # GPU energy of those steps (all the job's GPUs on this node)
    power_w: float | None = None  # mean GPU power over the steps
    # Optional noise evidence: sums of squared per-step time and energy. With them
    # a policy knows how noisy the steps are (None: unknown, the policy assumes).
    time_sq_s2: float | None = None
    energy_sq_j2: float | None = None
    # When this measure started (the daemon's clock). A new value says the daemon measures
    # afresh (after a setting changed), even where the new measure already holds more
    # steps than the old one did. None: unknown (a policy falls back on the step count).
    since_s: float | None = None

    @property
    def time_per_flop_s(self) -> float:
        return self.time_s / self.flops if self.flops > 0 else float("inf")

    @property
    def energy_per_flop_j(self) -> float:
        return self.energy_j / self.flops if self.flops > 0 else float("inf")

    @property
    def flop_per_s(self) -> float:
        return self.flops / self.time_s if self.time_s > 0 else 0.0


@dataclass(frozen=True)
class JobView:
    job: str
    gpus: tuple[int, ...]
    state: str  # running | ending | ended
    steps: int
    precision: str
    precisions: tuple[str, ...]  # levels the job can run, none above its own level
    measure: JobMeasure | None  # steps at the setting now in force, since it took effect
    setting: Setting  # the setting now in force for this job's GPUs
    pace_s: float | None = None  # the job's agreed uncapped step time across nodes, if any
    pace_count: int = 0  # agreements on pace_s received so far (each reads the nodes' paces one agreement late)
    held_pace_s: float | None = None  # this node's pace as its ranks hold it (the daemon's last push), if any
    run_steps: int | None = None  # the job's step in its run, as its ranks number them (None: as steps)
    floor_s: float | None = None  # spanning nodes: its fastest uncapped step a node measured, agreed like pace_s
    recheck_at: int = 0  # spanning nodes: the latest job step a node asked all to re-check from (a MAX; 0: none)
    loss_recent: tuple[float, ...] = ()  # recent losses, oldest first (for the precision policy)
    nonfinite_recent: int = 0  # non-finite steps among the recent ones
    # Precision switches and rollbacks so far, oldest first: dicts with kind ("switch",
    # "rollback", "refused"), from, to, reason, step, loss. A rollback the callback made
    # on its own (a non-finite loss or gradient) shows up here.
    precision_events: tuple[dict[str, Any], ...] = ()
    # Steps between the reference checks every rank makes after a downgrade (the loss of a
    # fixed batch at the level against fp32, same weights; a failing level comes back as
    # a rollback event), or None where some rank makes none.
    reference_every: int | None = None
    # Steps between the probe blocks every rank runs at the level above while the job is
    # below its own level (greend.training.probe: the level against the level above at
    # the same steps; a failing level comes back as a rollback event), or None where
    # some rank runs none. ``probe_steps``: the probe steps so far (they carry no loss
    # in ``loss_recent``).
    probe_every: int | None = None
    probe_steps: int = 0
    # The job's own level (where it started), the top of its ladder; None while not known.
    top_precision: str | None = None
    # A level the daemon proposed that the job's ranks have not applied yet (None: none
    # stands). ``precision`` is the level the ranks report running, never a proposal.
    proposed_precision: str | None = None
    # The job's steps when ``precision`` took effect (None: not known; its steps since are that level's).
    precision_since_step: int | None = None


@dataclass(frozen=True)
class Snapshot:
    t_s: float  # monotonic seconds
    gpus: tuple[GpuView, ...]
    jobs: tuple[JobView, ...]
    cpu_power_w: float | None = None  # counted CPU zones (packages + dram), now
    cpu_zones: Mapping[str, float] = field(default_factory=dict)  # zone path -> power W


@dataclass
class Decision:
    """What to set. Jobs or GPUs not named keep their current setting.

    ``settings``: job id -> Setting for all that job's GPUs on this node.
    ``gpu_settings``: GPU index -> Setting, for node-level policies (static, budget)
    that act on GPUs regardless of jobs. ``job_gpu_settings``: job id -> GPU index ->
    Setting, for some of that job's GPUs (pacing: a GPU off the critical path held
    below the job's setting, or given the job's setting back); applied after
    ``settings`` and owned by the job like them. ``cpu_power_limit_w``: RAPL zone path -> W
    (None: restore the zone's original limit). ``precision``: job -> level.
    ``reason``: one line a human can read in ``greenctl status``.
    """

    settings: dict[str, Setting] = field(default_factory=dict)
    gpu_settings: dict[int, Setting] = field(default_factory=dict)
    job_gpu_settings: dict[str, dict[int, Setting]] = field(default_factory=dict)
    cpu_power_limit_w: dict[str, float | None] = field(default_factory=dict)
    precision: dict[str, str] = field(default_factory=dict)
    reason: str = ""
    details: dict[str, Any] = field(default_factory=dict)


class Policy(Protocol):
    name: str

    def params(self) -> dict[str, Any]: ...

    def new_state(self) -> Any: ...

    def decide(self, snap: Snapshot, state: Any) -> Decision: ...
