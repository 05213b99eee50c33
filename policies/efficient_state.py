"""The ``efficient`` policy's memory per job, and how it follows a straggler.

What :mod:`greend.policies.efficient` keeps between decisions for each job (its grid,
the evidence per setting, the daemon's measure now, its phase, the pacing of its GPUs)
and the two steps that keep that evidence when a GPU of the job starts or stops
running slower than the others (:func:`follow_straggle`, :func:`rebase_waits`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ._evidence import Evidence
from ._pacing import PaceState, straggle_shown
from .base import UNCAPPED, GpuView, JobView, Setting
from .static import same_setting

FPS_STEPS = 8  # the job's FLOPs per step now: over this many steps at least (note_flops)
FPS_MOVED = 0.1  # FLOPs per step that moved by more than this share: the agreements read them late

__all__ = ["EfficientState", "JobSearch", "follow_straggle", "new_since", "pace_fresh", "rebase_waits"]

PUSH_SHARE = 0.01  # the daemon tells the ranks this node's pace again when it moves by more (control/loop.py)


@dataclass
class JobSearch:
    """One job's search: the grid, the evidence, and where we are."""

    gpus: tuple[int, ...]
    start_steps: int
    knob: str = "clock"  # what this job's search tunes: the policy's knob, or the other where refused
    phase: str = "baseline"  # baseline | search | settled | recheck
    grid: tuple[Setting, ...] = ()  # ascending; last = UNCAPPED (built after the baseline)
    levels: tuple[float, ...] = ()  # MHz or W of each grid point (top: fmax or uncapped draw)
    cache: dict[Setting, Evidence] = field(default_factory=dict)  # banked evidence per setting
    current: Setting = UNCAPPED  # the setting we want in force
    live: Evidence | None = None  # the daemon's measure for `current`, this visit
    live_since_s: float | None = None  # when the daemon's measure behind `live` started (its since_s)
    recheck: Evidence | None = None  # the baseline re-check being measured
    rechecked_once: bool = False
    next_recheck_s: float = math.inf
    settled: Setting | None = None
    settled_job_steps: int | None = None  # job steps before the first settle
    ref: Evidence | None = None  # the settled setting's evidence when watching began
    samples: list[Evidence] = field(default_factory=list)  # live cumulatives while settled
    allowed: float = 1.0  # the allowed time ratio to our uncapped baseline (last plan)
    held_allowed: float = 1.0  # and when we settled on the setting we hold
    need: int = 0  # steps the current candidate must have before the search moves on
    retunes: int = 0
    last_event: str = ""
    asked: tuple[Setting, Setting] | None = None  # (asked for, in force then) when last sent
    pace: PaceState = field(default_factory=PaceState)  # GPUs held below the job's setting
    live_paced: bool = False  # `live` ran with GPUs paced: not `current`'s evidence
    stale: Evidence | None = None  # a re-tune at the setting in force: the measure's steps before it
    stale_since_s: float | None = None  # when the measure behind `stale` started
    straggle: bool | None = None  # its GPUs ran at different paces last period (None: not read)
    rebase: bool = False  # a straggler came or healed: `cache` is re-based on the steps since
    fine: int = 0  # power limits put into the grid between two of its levels (policies/_finer.py)
    fine_w: tuple[float, ...] = ()  # those limits, W
    again_w: tuple[float, ...] = ()  # grid levels a second look measured on past LONG * max_steps for their own sake
    look_from: Setting | None = None  # a second look is under way: the setting settled on when it began
    looked: bool = False  # a second look found nothing more to try: no other one this search
    look_start: int = 0  # the job's steps when the second look under way began
    pace_tpf: float | None = None  # the baseline's time per FLOP when this node's pace last went out
    pace_mark: int = 0  # the agreements on the job's pace received by then (JobView.pace_count)
    low_tpf: float | None = None  # the lowest uncapped time per FLOP measured at low_level (the job's floor here)
    low_level: str | None = None  # the precision it was measured at
    spans_nodes: bool = False  # the job's ranks agree a floor across nodes (floor_share)
    rechecked_steps: int = 0  # the job's steps when the last baseline re-check ended (JobView.steps)
    fps: float | None = None  # the job's FLOPs per step now (note_flops)
    fps_mark: tuple[Any, int, float] | None = None  # ((its measure's start, setting), steps, FLOPs) then
    fps_before: float | None = None  # the FLOPs per step before they last moved by over FPS_MOVED
    fps_count: int = 0  # the agreements received then (JobView.pace_count)
    fps_seen: int = 0  # and at the last look
    low_skip: tuple[int, float] | None = None  # the baseline when the level changed (not taken into low_tpf)
    slots: tuple[int, ...] = ()  # job steps to re-check the baseline at with the other nodes (_recheck.py)
    slot_recheck: bool = False  # the re-check under way is one of those
    slots_by_step: bool = False  # those were booked on this node's own reading (sped_up, waits_more)
    slots_asked: bool = False  # those were booked on an agreed ask (JobView.recheck_at)
    step_quiet: bool = False  # such slots (sped_up's) found nothing: it reads live steps only, until a re-tune
    ask_quiet: bool = False  # the same for slots on its own ask (waits_more)
    pace_seen: tuple[int, float] | None = None  # (JobView.pace_count, the pace per FLOP) at the last agreement read
    ask: int = 0  # the job step this node asked every node to re-check from (its GPUs wait more: _recheck.waits_more)
    ask_seen: int | None = None  # the latest agreed ask read (JobView.recheck_at; None: none read yet)
    _index_memo: tuple[tuple[Setting, ...], Setting, int | None] | None = field(default=None, repr=False, compare=False)

    @property
    def looking(self) -> bool:
        """Whether a second look below the settled setting is under way (policies/_finer.py)."""
        return self.look_from is not None

    @property
    def settled_index(self) -> int | None:
        """Where in the grid the setting we settled on is (None: not settled)."""
        return self._index(self.settled)

    @property
    def held_index(self) -> int | None:
        """Where the setting we hold is: the settled one, or during a second look the one
        it began from (it keeps its margin at the bound and its place among equals)."""
        return self._index(self.settled if self.settled is not None else self.look_from)

    def _index(self, setting: Setting | None) -> int | None:
        if setting is None:
            return None
        # A policy period asks this a dozen times of a grid of up to a hundred settings;
        # the grid is a tuple (a change replaces it), so the last answer holds while both
        # the grid and the setting are the same objects.
        memo = self._index_memo
        if memo is not None and memo[0] is self.grid and memo[1] is setting:
            return memo[2]
        at = next((i for i, s in enumerate(self.grid) if same_setting(s, setting)), None)
        self._index_memo = (self.grid, setting, at)
        return at


@dataclass
class EfficientState:
    jobs: dict[str, JobSearch] = field(default_factory=dict)


def new_since(since_s: float | None, before_s: float | None) -> bool:
    """Whether a measure that started at ``since_s`` is another one than the one that
    started at ``before_s`` (unknown start times: not known to be)."""
    return since_s is not None and before_s is not None and since_s != before_s


def pace_fresh(job: JobSearch, base_tpf: float, count: int, held_tpf: float | None = None) -> bool:
    """Whether the job's agreed pace, ``count`` agreements received, can be read against
    the baseline ``base_tpf``. This node's uncapped step time goes out to the ranks when
    its baseline moves (by more than :data:`PUSH_SHARE`); the ranks' next agreement
    still reads the paces they wrote before that, the one after it reads the new one.
    The pace is the MAX over the nodes, so only an older pace of this node's that was
    *longer* can leave room that is not there: once a slow node healed, or every node
    sped up, each node would cap its GPUs to a step the job no longer runs (synchronised
    steps: the job then ran about 20 % slower than ``none`` for two agreements;
    ``bench/bench_pacing.py``). So a baseline that fell is read against from the third
    agreement after it went out (one more than that: the count lags the ranks by the
    sender's flush, and the new pace reaches them a moment after it went out; with 10 ms
    steps the second agreement after the mark still read the old pace in 10 % of runs of
    a model of those delays). A baseline that rose is read against at once (unless a
    fall's wait still runs), and so is this node's first one where its ranks hold no
    longer pace of this node's (``held_tpf``: the daemon's last push, as the ranks hold
    it; None: none, and an agreement without this node's pace is the other nodes' MAX, no
    longer than the job's): waiting had left a node paced from the start without its
    room from the first agreement, at step 200, to step 400. The ranks do hold one after
    a policy change or a resumed record (a new search, the same pushes); a rank's register
    reply gives it this daemon's pace, null before its first, so a daemon restarted
    mid-job is not met with its predecessor's."""
    if job.pace_tpf is None:
        longer = held_tpf is not None and held_tpf > base_tpf * (1 + PUSH_SHARE)
        job.pace_tpf, job.pace_mark = base_tpf, count if longer else count - 2
    elif abs(base_tpf - job.pace_tpf) > PUSH_SHARE * job.pace_tpf:
        if base_tpf < job.pace_tpf:  # (quicker: its older, longer pace may still be the ranks' MAX)
            job.pace_mark = count
        job.pace_tpf = base_tpf
    return count >= job.pace_mark + 3


def note_flops(job: JobSearch, j: JobView) -> None:
    """Follow the job's FLOPs per step now (``job.fps``: over its last ``FPS_STEPS`` steps
    or more, from the measure in force). A step time agreed across nodes (its pace, its
    floor) goes out as this node's time per FLOP times its FLOPs per step now, and is
    read back the same way. The baseline's, or a measure's since its setting took effect,
    would misread them once the job's steps grew (a batch-size warm-up, a longer
    sequence): a floor read twice too high, and the job ran +9.5 % over ``none`` under a
    5 % bound (3 nodes, FLOPs x2 then x4: +19 % under 10 %; sim)."""
    m = j.measure
    if m is None or m.steps <= 0 or m.flops <= 0:
        return
    mark, key = job.fps_mark, (m.since_s, m.setting)
    if mark is None or mark[0] != key or m.since_s is None or m.steps < mark[1]:  # (a new measure)
        job.fps_mark = (key, m.steps, m.flops)
        fps = job.fps or m.flops / m.steps
    elif m.steps - mark[1] >= FPS_STEPS and m.flops > mark[2]:
        fps = (m.flops - mark[2]) / (m.steps - mark[1])
        job.fps_mark = (key, m.steps, m.flops)
    else:
        return
    if job.fps is not None and abs(fps - job.fps) > FPS_MOVED * job.fps:
        # The agreements still read the step times the nodes sent before: read them with the
        # larger of the two until the third agreement from now (too tight, never too loose).
        job.fps_before, job.fps_count = job.fps, j.pace_count
    job.fps = fps
    job.fps_seen = j.pace_count


def step_flops(job: JobSearch, base: Evidence) -> float:
    """The job's FLOPs per step now (note_flops; before any: the baseline's), for an
    agreed step time: while the agreements may still be the nodes' from before its steps
    changed size, the larger of the two."""
    fps = job.fps or base.flops / base.steps
    if job.fps_before is not None and job.fps_seen < job.fps_count + 3:
        return max(fps, job.fps_before)
    return fps


def floor_share(job: JobSearch, base: Evidence, j: JobView) -> float:
    """The share of the bound a job spanning nodes keeps of its local baseline ``base``
    (1: all of it): the job's floor (the fastest uncapped step any of its nodes measured,
    agreed by the ranks like the pace, ``JobView.floor_s``) over this node's baseline.

    Under synchronised steps every node times the job's step, the wait for the others
    included: a node that measures its uncapped baseline while another node is capped
    (searching, or settled at its bound) measures that node's slowdown too, and allows
    its bound on top of it; the other node's next baseline then has this one's in it
    (``bench/bench_pacing.py``: two identical nodes whose daemons started 37 steps
    apart ran the job 20 % slower than ``none`` under a 5 % bound). A node that starts
    first measures a clean baseline (no other node has capped yet), so the MIN over the
    nodes is; and each node offers the lowest baseline it measured at the job's level
    (a recheck while the others are capped reads high, and must not raise the floor).
    So the job is held to its bound over its fastest uncapped step; a job whose
    uncapped step truly got slower (a new phase on every node) is held to its old floor:
    capped less, never slower. A job on one node has no floor (None): its own rechecks
    rule. After a change of level the floor waits for a baseline measured at the new one
    (the search's, once the job's new speed re-tuned it)."""
    tpf = base.time_per_flop_s
    if job.low_level != j.precision:  # another level, another step time: from its own baseline on
        skip = (base.steps, base.time_s) if job.low_level is not None else None
        job.low_tpf, job.low_level, job.low_skip = None, j.precision, skip
    if job.low_skip != (base.steps, base.time_s):  # (the baseline measured at the level before: not this one's)
        job.low_tpf, job.low_skip = tpf if job.low_tpf is None else min(job.low_tpf, tpf), None
    job.spans_nodes = j.floor_s is not None
    if j.floor_s is None or j.floor_s <= 0 or job.low_tpf is None:
        return 1.0
    floor_tpf = min(job.low_tpf, j.floor_s / step_flops(job, base))  # (ours goes into the next agreement)
    return min(1.0, floor_tpf / tpf)


def follow_straggle(job: JobSearch, j: JobView, views: list[GpuView]) -> None:
    """A straggler that came or healed changes the job's step time, not its work: a
    settled job keeps its setting (the pacer follows the straggler) and what its search
    measured, re-based on the steps since (:func:`rebase_waits`), instead of a re-tune
    from scratch."""
    shown = straggle_shown(job.pace, views, job.straggle)
    changed = shown is not None and job.straggle is not None and shown != job.straggle
    job.straggle = shown if shown is not None else job.straggle
    m = j.measure
    if not changed or job.phase != "settled" or m is None or not same_setting(m.setting, job.current):
        return
    if job.live is not None and not job.live_paced and job.live.steps > 0:
        job.cache[job.current] = job.cache.get(job.current, Evidence()).plus(job.live)  # the steps before
    job.stale, job.stale_since_s = Evidence.of(m), m.since_s
    job.live, job.rebase = None, True
    job.ref, job.samples = None, []
    job.last_event = "a GPU's pace changed (a straggler " + ("came" if shown else "healed") + "): setting kept"


def rebase_waits(job: JobSearch, min_steps: int) -> bool:
    """After a straggler came or healed: once ``min_steps`` steps ran unpaced at the
    job's setting, every setting's evidence is scaled by what they show against the
    evidence before (the critical GPU's curve keeps its shape: a speed factor). True
    while it waits for them; a paced measure is never mixed with the evidence, so the
    job runs on meanwhile."""
    live = job.live
    if not job.rebase or job.live_paced:
        return False
    if live is None or live.steps < min_steps:
        return True
    old = job.cache.get(job.current)
    if old is not None and old.steps > 0 and old.time_s > 0 and old.energy_j > 0:
        kt = live.time_per_flop_s / old.time_per_flop_s
        ke = live.energy_per_flop_j / old.energy_per_flop_j
        job.cache = {s: e.scaled(kt, ke) for s, e in job.cache.items()}
    job.rebase = False
    job.ref, job.samples = None, []
    return False
