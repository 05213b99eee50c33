"""The re-checks a job over several nodes runs with its other nodes when its step falls
at the setting each node holds (policies/_recheck.py), on plain values."""

from __future__ import annotations

import pytest

from greend.policies._evidence import Evidence
from greend.policies._recheck import (
    FASTER,
    asked,
    judge_slot,
    pace_fell,
    slot_due,
    slot_steps,
    slots,
    sped_up,
    waits_more,
)
from greend.policies.base import UNCAPPED, JobView
from greend.policies.efficient_state import JobSearch

FLOPS = 1e12  # per step


def _steps(n: int, step_s: float, noise: float = 0.0, seed: int = 0, step_j: float | None = None) -> Evidence:
    """``n`` steps of ``step_s`` each (relative noise ``noise``), 300 W (or ``step_j`` a step)."""
    import random

    rng = random.Random(seed)
    ts = [step_s * (1.0 + rng.gauss(0.0, noise)) for _ in range(n)]
    es = [300.0 * t if step_j is None else step_j * (1.0 + rng.gauss(0.0, noise)) for t in ts]
    return Evidence(
        steps=n,
        flops=n * FLOPS,
        time_s=sum(ts),
        energy_j=sum(es),
        time_sq_s2=sum(t * t for t in ts),
        energy_sq_j2=sum(e * e for e in es),
    )


def _settled(
    before_step_s: float,
    now_step_s: float,
    noise: float = 0.0,
    before_j: float | None = None,
    now_j: float | None = None,
) -> JobSearch:
    """A job settled for 32 steps of ``before_step_s`` (``before_j`` each), then 32 steps
    of ``now_step_s`` (``now_j``), a sample of its live measure every 8; what its search
    banked at the setting reads ``before_step_s`` too."""
    job = JobSearch(gpus=(0,), start_steps=0)
    job.ref = _steps(32, before_step_s, noise, seed=1, step_j=before_j)
    live = Evidence()
    for k in range(8):
        job.samples.append(live)
        then = (before_step_s, before_j) if k < 4 else (now_step_s, now_j)
        live = live.plus(_steps(8, then[0], noise, seed=10 + k, step_j=then[1]))
    job.live = live
    return job


def test_nodes_that_see_the_fall_less_than_a_slot_apart_share_a_slot() -> None:
    every = slot_steps(32)
    assert every == 64
    for d in range(900, 1200):
        for e in range(d, d + every):
            assert set(slots(d, every)) & set(slots(e, every)), (d, e)
    first, second = slots(1100, every)
    assert first % every == 0 and first >= 1100 + 8 and second == first + every


def test_a_slot_is_taken_once_and_one_long_past_is_dropped() -> None:
    job = JobSearch(gpus=(0,), start_steps=0, slots=(1152, 1216))
    assert slot_due(job, 1151, 64) is None and job.slots == (1152, 1216)
    assert slot_due(job, 1153, 64) == 1152 and job.slots == (1216,)
    assert slot_due(job, 1160, 64) is None
    job.slots = (1152, 1216)
    assert slot_due(job, 1230, 64) == 1216 and job.slots == ()  # (1152 is a spacing past: dropped)


@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_a_step_that_fell_at_the_setting_held_is_seen_and_noise_is_not(noise: float) -> None:
    fell = sped_up(_settled(0.068, 0.060, noise), 8, 0.02)
    assert fell is not None and 0.060 / 0.068 - 1.0 - 0.01 <= fell < -FASTER  # (against steps partly after it)
    assert sped_up(_settled(0.068, 0.068 * (1 - FASTER / 2), noise), 8, 0.02) is None
    assert sped_up(_settled(0.060, 0.068, noise), 8, 0.02) is None  # (slower: the pace's business)


def test_a_fall_seen_against_the_banked_steps_once_and_not_again_after_slots_that_found_nothing() -> None:
    """A node that settles again after its re-checks: what its search banked at the
    setting reads the old step, its live steps all the new one. The fall shows against
    the banked steps (a fall during a search or a re-check is seen), until slots booked on
    it found nothing (``step_quiet``): then only its live steps are read."""
    job = JobSearch(gpus=(0,), start_steps=0)
    job.ref = _steps(64, 0.068, 0.01, seed=1)
    live = Evidence()
    for k in range(8):
        job.samples.append(live)
        live = live.plus(_steps(8, 0.060, 0.01, seed=20 + k))
    job.live = live
    assert sped_up(job, 8, 0.02) is not None
    job.step_quiet = True
    assert sped_up(job, 8, 0.02) is None


def test_a_slot_that_reads_faster_re_tunes_from_it_and_one_that_reads_slower_is_not_taken() -> None:
    base = _steps(32, 0.065, 0.01, seed=3)
    calls: list[tuple[str, Evidence | None]] = []

    def retune(job: JobSearch, why: str, baseline: Evidence | None = None) -> None:
        calls.append((why, baseline))

    job = JobSearch(gpus=(0,), start_steps=0, cache={UNCAPPED: base})
    faster = _steps(32, 0.050, 0.01, seed=4)
    assert judge_slot(job, base, faster, 0.02, retune, 1300)
    assert len(calls) == 1 and calls[0][1] is faster and "faster" in calls[0][0]
    slower = _steps(32, 0.060 * 1.2, 0.01, seed=5)  # (another node capped then)
    assert judge_slot(job, base, slower, 0.02, retune, 1300)
    assert len(calls) == 1 and job.cache[UNCAPPED] is base and "not taken" in job.last_event
    same = _steps(32, 0.065, 0.01, seed=6)
    assert not judge_slot(job, base, same, 0.02, retune, 1300)  # (judged as any re-check is)
    assert job.ask == 0  # (slots no reading of this node's booked: nothing to ask)


def test_a_slot_booked_on_its_own_reading_that_reads_slower_asks_every_node_to_re_check() -> None:
    """This node saw the job's step fall and re-checked alone: the other nodes, capped,
    did not see it. It asks them all to re-check from its step; not where the slot was
    booked on an ask already (every node re-checked then), nor twice before its ask
    comes back."""
    base = _steps(32, 0.065, 0.01, seed=3)
    slower = _steps(32, 0.060 * 1.2, 0.01, seed=5)
    job = JobSearch(gpus=(0,), start_steps=0, cache={UNCAPPED: base}, slots_by_step=True, ask_seen=0)
    assert judge_slot(job, base, slower, 0.02, lambda *a, **k: None, 1361)
    assert job.ask == 1361 and "asks every node to re-check from step 1361" in job.last_event
    assert judge_slot(job, base, slower, 0.02, lambda *a, **k: None, 1430) and job.ask == 1361  # (pending)
    answered = JobSearch(gpus=(0,), start_steps=0, slots_by_step=True, slots_asked=True, ask_seen=1361)
    assert judge_slot(answered, base, slower, 0.02, lambda *a, **k: None, 1700) and answered.ask == 0


def test_a_fall_of_the_agreed_pace_is_read_once_per_agreement_and_per_flop() -> None:
    from greend.policies.base import JobView

    job = JobSearch(gpus=(0,), start_steps=0, fps=2e12)

    def view(count: int, pace_s: float) -> JobView:
        return JobView("j", (0,), "running", 100 * count, "bf16", ("bf16",), None, UNCAPPED, pace_s, count)

    assert pace_fell(job, view(1, 0.070)) is None  # (the first: nothing to fall from)
    assert pace_fell(job, view(2, 0.069)) is None  # (-1.4 %: within FASTER)
    fell = pace_fell(job, view(3, 0.060))
    assert fell == pytest.approx(0.060 / 0.069 - 1.0)
    assert pace_fell(job, view(3, 0.050)) is None  # (the same agreement: read once)
    job.fps = 1e12  # (half the FLOPs a step: the same pace per FLOP is half the step)
    assert pace_fell(job, view(4, 0.030)) is None
    assert pace_fell(job, view(5, 0.025)) is not None


@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_gpus_that_wait_longer_at_the_same_step_are_seen_and_noise_is_not(noise: float) -> None:
    """A node that healed (or whose share of the work shrank) times the same job step
    (the collective waits for the others) at less energy per FLOP: its GPUs finish
    their part sooner and wait. Seen; a fall within the noise, a step that moved (the
    other checks' business) and more energy are not."""
    fell = waits_more(_settled(0.068, 0.068, noise, before_j=20.4, now_j=18.4), 8, 0.02)
    assert fell is not None and 18.4 / 20.4 - 1.0 - 0.01 <= fell < -FASTER
    assert waits_more(_settled(0.068, 0.068, noise, before_j=20.4, now_j=20.4 * (1 - FASTER / 2)), 8, 0.02) is None
    assert waits_more(_settled(0.068, 0.060, noise, before_j=20.4, now_j=18.4), 8, 0.02) is None  # (sped_up's)
    assert waits_more(_settled(0.068, 0.068, noise, before_j=20.4, now_j=22.4), 8, 0.02) is None


def test_an_ask_agreed_by_the_ranks_is_read_once_and_the_first_only_noted() -> None:
    """Every node books slots when the agreed ask grows (``JobView.recheck_at``, a MAX);
    a daemon that starts mid-run notes the ask it first reads (the other nodes have
    answered it) and answers only later ones."""
    job = JobSearch(gpus=(0,), start_steps=0)

    def view(at: int) -> JobView:
        return JobView("j", (0,), "running", 3000, "bf16", ("bf16",), None, UNCAPPED, recheck_at=at)

    assert asked(job, view(0)) is None and job.ask_seen == 0
    assert asked(job, view(2106)) == 2106
    assert asked(job, view(2106)) is None  # (the same agreement read again)
    assert asked(job, view(2500)) == 2500
    late = JobSearch(gpus=(0,), start_steps=0)
    assert asked(late, view(2106)) is None and asked(late, view(2106)) is None and late.ask_seen == 2106


def test_gpus_that_wait_longer_since_before_the_node_settled_are_seen_against_the_banked_steps() -> None:
    """A node that settled again just before it healed has no live steps from before:
    the fall shows against what its search banked at the setting (``job.ref``), until
    slots booked on its own ask found nothing (``ask_quiet``; sped_up's ``step_quiet`` aside)."""
    job = _settled(0.068, 0.068, before_j=18.4, now_j=18.4)
    job.ref = _steps(32, 0.068, seed=1, step_j=20.4)
    fell = waits_more(job, 8, 0.02)
    assert fell is not None and fell == pytest.approx(18.4 / 20.4 - 1.0, abs=0.005)
    job.step_quiet = True
    assert waits_more(job, 8, 0.02) is not None
    job.ask_quiet = True
    assert waits_more(job, 8, 0.02) is None
