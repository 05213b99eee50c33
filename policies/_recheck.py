"""Re-checks of the uncapped baseline: judging one, and the re-checks a job over several
nodes runs together when its step falls at the setting each node holds.

Every node of a synchronous job times the job's step (a rank's step waits for the slowest
node in the collective), and each holds its GPUs to the pace the nodes agreed from their
uncapped steps. When a slow node heals, the others stay capped to its old step and the
healed node's uncapped step reads theirs: no node measures the job uncapped while every
node is uncapped, so the agreed pace never falls by itself (sim: a job 20 % over `none`
until the next re-check every node runs at the same power of two of its steps).

What every node does see is the job's step falling at the setting it holds, or the
agreed pace falling once a node measured its step again. A node that sees either fall
by more than :data:`FASTER` (the step also by ``DRIFT_Z`` standard errors: :func:`sped_up`,
:func:`pace_fell`) re-checks its baseline at two job steps (:func:`slots`): the first
multiple of :func:`slot_steps` at least :data:`LEAD` steps ahead, and the next one,
whatever it is doing then (a search included). The nodes see the same steps, each within
a policy period or two; nodes that see the fall less than one slot apart share a slot,
where all of them run uncapped at once. A slot's re-check that reads the job faster than
the baseline re-tunes from it (what the other settings measured was the old pace); one
that reads it slower measured another node's capped steps and is not taken; one within
the noise is judged as any re-check is (:func:`judge_recheck`). A job's slots never move
its power-of-two re-checks, so those stay at the same steps on every node.

A straggler the other nodes were paced to exactly (one 5-15 % slower; sim,
``bench/bench_heal.py --slower 1.1``) heals without either: their capped step is the
job's step before and after, and no node's uncapped step moves the pace. Only the healed
node can tell: its GPUs use less energy per FLOP at the same step (they finish their part
sooner and wait for the others in the collective, :func:`waits_more`). It asks every node
to re-check from its step (``recheck_at``, agreed by the ranks with the pace as a MAX,
docs/protocol.md); every node, reading a larger agreed ask (:func:`asked`), books the
slots as for a fall of the pace. On a real GPU a rank waiting in a collective still draws
power (NCCL's kernels poll), so its energy falls by less than its compute time: a heal
of a few percent may stay under :data:`FASTER` there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from ._drift import DRIFT_Z, windows
from ._evidence import Evidence
from .base import UNCAPPED, JobView
from .efficient_state import JobSearch, step_flops

__all__ = [
    "FASTER",
    "LEAD",
    "ask_pending",
    "asked",
    "judge_recheck",
    "judge_slot",
    "pace_fell",
    "place_ask",
    "slot_due",
    "slot_steps",
    "slots",
    "sped_up",
    "waits_more",
]

FASTER = 0.03  # the job's step at the setting held fell by more than this share: re-check together
LEAD = 8  # a slot comes at least this many job steps after the fall is seen


def slot_steps(baseline_steps: int) -> int:
    """The spacing of the slots, in job steps: the power of two at or above two
    baselines' worth (64 at the defaults), the same on every node of the job."""
    return 1 << (2 * baseline_steps - 1).bit_length()


def slots(run_steps: int, every: int) -> tuple[int, int]:
    """The two job steps a node that saw the job speed up at ``run_steps`` re-checks at."""
    first = -(-(run_steps + LEAD) // every) * every
    return first, first + every


def sped_up(job: JobSearch, min_steps: int, noise: float) -> float | None:
    """By how much the settled ``job``'s time per FLOP fell in its latest steps (the
    windows of ``_drift.py``), where it fell by more than :data:`FASTER` and ``DRIFT_Z``
    standard errors, a negative share; else None. Against its steps at the same setting
    before them since it settled, and against what the setting showed when it settled
    (``job.ref``: what the search banked there too, so a fall during a search or a
    re-check is seen), unless slots booked on such a fall found nothing
    (``job.step_quiet``): a node settled again on evidence from before the fall would
    see the same fall again and again."""
    for window, before in _against(job, min_steps, job.step_quiet):
        dt = window.time_per_flop_s / before.time_per_flop_s - 1.0
        if dt < -FASTER and -dt > DRIFT_Z * math.hypot(window.se_time(noise), before.se_time(noise)):
            return dt
    return None


def waits_more(job: JobSearch, min_steps: int, noise: float) -> float | None:
    """By how much the settled ``job``'s energy per FLOP fell in its latest steps (the
    windows of ``_drift.py``) while its time per FLOP held within :data:`FASTER`: its GPUs
    finish their part sooner and wait longer for the other nodes in the collective (this
    node healed, or its work shrank). Against what :func:`sped_up` reads: its steps at
    the same setting before them since it settled, and, unless slots on its own ask
    found nothing (``job.ask_quiet``), what the setting showed when it settled. A
    negative share, where it fell by more than :data:`FASTER` and ``DRIFT_Z`` standard
    errors; else None."""
    for window, before in _against(job, min_steps, job.ask_quiet):
        if before.energy_j <= 0:
            continue
        dt = window.time_per_flop_s / before.time_per_flop_s - 1.0
        de = window.energy_per_flop_j / before.energy_per_flop_j - 1.0
        se = math.hypot(window.se_energy(noise), before.se_energy(noise))
        if abs(dt) <= FASTER and de < -FASTER and -de > DRIFT_Z * se:
            return de
    return None


def _against(job: JobSearch, min_steps: int, quiet: bool) -> Iterator[tuple[Evidence, Evidence]]:
    """(a window of the settled job's latest steps, what it is read against) for each
    window of ``_drift.windows``, shortest first: its steps at the same setting before it
    since the job settled, then (unless ``quiet``) what the setting showed when it
    settled (``job.ref``); each with ``min_steps`` steps, FLOPs and time at least."""
    now = job.live
    if now is None or len(job.samples) < 2:
        return
    first, ref = job.samples[0], None if quiet else job.ref
    for start, window in windows(job, now, min_steps):
        for before in (start.minus(first), ref):
            if before is not None and before.steps >= min_steps and min(before.flops, before.time_s) > 0:
                yield window, before


def ask_pending(job: JobSearch) -> bool:
    """Whether this node's ask has not come back in an agreement yet (it asks no other)."""
    return job.ask > (job.ask_seen or 0)


def place_ask(job: JobSearch, step: int) -> int:
    """Ask every node to re-check from job step ``step`` (later than any ask read, so the
    agreed MAX grows): the step asked, which the daemon pushes with its pace."""
    job.ask = max(step, (job.ask_seen or 0) + 1)
    return job.ask


def asked(job: JobSearch, j: JobView) -> int | None:
    """The job step a node of the job asked every node to re-check from (the agreed
    ``JobView.recheck_at``, a MAX over the nodes' asks), where it is new since the last
    agreement read; else None. The first one read is only noted (a daemon that starts
    mid-run reads an ask the other nodes have answered)."""
    at, seen = j.recheck_at, job.ask_seen
    job.ask_seen = max(at, seen or 0)
    return at if seen is not None and at > seen else None


def pace_fell(job: JobSearch, j: JobView) -> float | None:
    """By how much the job's agreed pace, per FLOP, fell at the agreement just received
    against the one before it (a negative share), where by more than :data:`FASTER`;
    else None. The pace is the MAX of the nodes' uncapped steps, so it falls when the
    slowest node's baseline fell: a straggler healed, or that node measured its step
    again. Every node reads the same agreements, at the same job steps."""
    if not j.pace_s or j.pace_s <= 0 or not job.fps:
        return None
    seen = job.pace_seen
    if seen is not None and j.pace_count <= seen[0]:
        return None
    tpf = j.pace_s / step_flops(job, Evidence())  # (job.fps known: the evidence is not read)
    job.pace_seen = (j.pace_count, tpf)
    if seen is None:
        return None
    fell = tpf / seen[1] - 1.0
    return fell if fell < -FASTER else None


def slot_due(job: JobSearch, run_steps: int, every: int) -> int | None:
    """The slot due at ``run_steps`` (it is taken off the job's list), or None. A slot
    more than one spacing past is dropped: the other nodes have run theirs."""
    while job.slots and run_steps >= job.slots[0] + every:
        job.slots = job.slots[1:]
    if job.slots and run_steps >= job.slots[0]:
        at, job.slots = job.slots[0], job.slots[1:]
        return at
    return None


def judge_slot(
    job: JobSearch, base: Evidence, ev: Evidence, noise: float, retune: Callable[..., None], step: int
) -> bool:
    """A slot's re-check against the baseline: faster re-tunes from it, slower is not
    taken; True where that settled it, False where it is judged as any re-check. A slot
    this node booked on its own reading (not on an agreed ask) that reads slower ran
    uncapped while another node was capped: that node did not see what this one saw,
    so this one asks every node to re-check from ``step`` (a heal seen only here)."""
    dt = ev.time_per_flop_s / base.time_per_flop_s - 1.0
    margin = max(0.01, 3.0 * math.hypot(ev.se_time(noise), base.se_time(noise)))
    if dt < -margin:
        retune(job, f"the job ran {dt:+.0%} faster uncapped with its other nodes", baseline=ev)
        return True
    if dt > margin:
        job.last_event = f"re-check with the job's other nodes read {dt:+.0%} (a node was capped): not taken"
        if job.slots_by_step and not job.slots_asked and not ask_pending(job):
            job.last_event += f"; asks every node to re-check from step {place_ask(job, step)}"
        return True
    return False


def judge_recheck(
    job: JobSearch, base: Evidence, ev: Evidence, noise: float, retune_drift: float, retune: Callable[..., None]
) -> None:
    """A baseline re-check against the baseline: a move beyond ``retune_drift`` re-tunes
    the job from it; a clear one within it (warm-up) corrects the baseline; else the
    two are one measure."""
    dt = ev.time_per_flop_s / base.time_per_flop_s - 1.0
    dp = ev.power_w / base.power_w - 1.0 if base.power_w > 0 else 0.0
    if abs(dt) > retune_drift or abs(dp) > retune_drift:
        retune(job, f"baseline moved ({dt:+.0%} time, {dp:+.0%} power)", baseline=ev)
        job.rechecked_once = True
        return
    se = math.hypot(ev.se_time(noise), base.se_time(noise))
    if abs(dt) > max(0.02, 3.0 * se):  # clearly off (warm-up), not just noise
        job.cache[UNCAPPED] = ev  # the first baseline was off (warm-up): trust the new one
        job.last_event = f"baseline corrected by {dt:+.1%}"
    else:
        job.cache[UNCAPPED] = base.plus(ev)
        job.last_event = "baseline confirmed"
