"""The ``precision`` policy on synthetic jobs: pure decide() calls, no daemon.

:class:`FakeJob` plays the daemon's part: each period it runs some steps at the
level in force (energy per FLOP per level as given, losses from a function of the
step and the level), builds the :class:`JobView` the daemon would, and applies
the policy's decision as a rank does (from its next step; the daemon's record follows
the rows, so the policy sees the level in force at its next look, with the step it took
effect at; a ``switch`` entry goes to its precision log).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from greend.errors import PolicyError
from greend.policies import get_policy
from greend.policies.base import UNCAPPED, Decision, JobMeasure, JobView, Setting, Snapshot
from greend.policies.precision import PrecisionPolicy, loss_trend
from greend.policies.precision_state import PROBE_PROBATION_STEPS

EPF = {"fp32": 15e-12, "tf32": 2e-12, "bf16": 1e-12, "fp16": 1e-12, "fp8": 0.6e-12, "fp8-emulated": 1e-12}
FLOPS = 1e12


def flat(step: int, level: str) -> float:
    return 1.0 + 0.01 * math.sin(step)  # stable, a little noise


@dataclass
class FakeJob:
    precisions: tuple[str, ...] = ("fp32", "bf16", "fp16")
    loss: Callable[[int, str], float] = flat
    epf: dict[str, float] = field(default_factory=lambda: dict(EPF))
    steps_per_period: int = 10
    precision: str = "fp32"
    steps: int = 0
    losses: list[float] = field(default_factory=list)
    nonfinite: list[int] = field(default_factory=list)
    log: list[dict[str, Any]] = field(default_factory=list)
    m: list[float] = field(default_factory=lambda: [0, 0.0, 0.0, 0.0])  # steps, flops, time, energy
    levels: list[str] = field(default_factory=list)  # the level of every step run
    inject: Callable[[int, str], bool] = lambda step, level: False  # a non-finite step here?
    reference_every: int | None = None  # its ranks make reference checks (GreenCallback(reference_loss=))
    probe_every: int | None = None  # its ranks run probe blocks at the level above (greend.training.probe)
    probe_steps: int = 0  # probe steps so far (their losses are not the job's level's: not in losses)
    t: float = 0.0
    since: int = 0  # steps when the level in force took effect
    applies: Callable[[str], bool] = lambda level: True  # do its ranks apply a directive to this level?
    proposed: str | None = None  # a level asked for and not applied (the daemon's standing proposal)
    setting: Setting = UNCAPPED  # the GPU setting in force (a new one starts a new measure, as the daemon's)

    def run(self) -> None:
        for _ in range(self.steps_per_period):
            if self.probe_every is not None and self.precision != self.precisions[0] and self.steps % 50 == 0:
                self.probe_steps += 1  # a probe step at the level above: counted, its loss not the level's
                self.steps += 1
                continue
            self.levels.append(self.precision)
            if self.inject(self.steps, self.precision):
                self.nonfinite.append(self.steps)
            else:
                self.losses.append(self.loss(self.steps, self.precision))
            self.steps += 1
            self.m[0] += 1
            self.m[1] += FLOPS
            self.m[2] += 0.01
            self.m[3] += FLOPS * self.epf[self.precision]

    def view(self) -> JobView:
        measure = (
            JobMeasure(
                setting=self.setting, steps=int(self.m[0]), flops=self.m[1], time_s=self.m[2], energy_j=self.m[3]
            )
            if self.m[0]
            else None
        )
        return JobView(
            job="j",
            gpus=(0,),
            state="running",
            steps=self.steps,
            precision=self.precision,
            precisions=self.precisions,
            measure=measure,
            setting=self.setting,
            loss_recent=tuple(self.losses[-256:]),
            nonfinite_recent=len(self.nonfinite[-256:]),
            precision_events=tuple(self.log[-32:]),
            reference_every=self.reference_every,
            probe_every=self.probe_every,
            probe_steps=self.probe_steps,
            precision_since_step=self.since,
            proposed_precision=self.proposed,
        )

    def apply(self, d: Decision) -> None:
        level = d.precision.get("j")
        if level is not None and level != self.precision:
            assert level in self.precisions, f"the policy asked for {level}, which the job does not run"
            assert level != self.proposed, f"the policy asked for {level} again while it stands"
            if not self.applies(level):  # e.g. the other ranks' daemons do not ask it
                self.proposed = level
                self.log.append({"t": self.t, "kind": "proposed", "from": self.precision, "to": level,
                                 "reason": d.details["reasons"]["j"], "step": self.steps})  # fmt: skip
                return
            self.proposed = None
            self.log.append(
                {
                    "t": self.t,
                    "kind": "switch",
                    "from": self.precision,
                    "to": level,
                    "reason": d.details["reasons"]["j"],
                    "step": self.steps,
                }
            )
            self.precision = level
            self.since = self.steps


def drive(
    policy: PrecisionPolicy,
    job: FakeJob,
    periods: int,
    state: Any = None,
    hook: Callable[[int, FakeJob], None] | None = None,
) -> tuple[Any, list[Decision]]:
    state = state if state is not None else policy.new_state()
    decisions = []
    for k in range(periods):
        if hook is not None:
            hook(k, job)
        job.run()
        job.t += 1.0
        d = policy.decide(Snapshot(t_s=job.t, gpus=(), jobs=(job.view(),)), state)
        job.apply(d)
        decisions.append(d)
    return state, decisions


def policy(**kw: Any) -> PrecisionPolicy:
    base = dict(window=16, probation_steps=40, min_steps=8, cooldown_s=100.0)
    base.update(kw)
    return get_policy("precision", **base)


def switches(job: FakeJob) -> list[tuple[str, str]]:
    return [(e["from"], e["to"]) for e in job.log if e["kind"] == "switch"]


# Stepping down ------------------------------------------------------------------------------


def test_steps_down_once_stable_and_keeps_the_cheaper_level() -> None:
    job = FakeJob()
    state, ds = drive(policy(), job, 20)
    assert switches(job) == [("fp32", "bf16")]  # fp8 is not a level this job runs; fp16 not on the ladder
    first_bf16 = job.levels.index("bf16")
    assert first_bf16 >= 16  # a window of stable losses and the fp32 energy first
    details = ds[-1].details["jobs"]["j"]
    assert details["probation"] is None and "accepted" in details["last_event"]
    assert "93% less energy per FLOP" in details["last_event"]  # 1 vs 15 pJ/FLOP
    assert job.log[0]["reason"].startswith("loss stable")


def test_does_not_step_down_while_the_loss_still_falls() -> None:
    job = FakeJob(loss=lambda s, lv: 5.0 * math.exp(-s / 60.0) + 0.1)
    drive(policy(), job, 12)
    assert switches(job) == []
    _, ds = drive(policy(), FakeJob(loss=lambda s, lv: 5.0 * math.exp(-s / 60.0) + 0.1), 12)
    assert "not stable" in ds[-1].reason
    # ... and does once it has flattened.
    job2 = FakeJob(loss=lambda s, lv: 5.0 * math.exp(-s / 20.0) + 1.0)
    drive(policy(), job2, 40)
    assert switches(job2)[:1] == [("fp32", "bf16")] and job2.levels.index("bf16") > 60


def test_a_noisy_but_flat_loss_waits_for_history_then_switches() -> None:
    # +/-50 % from one batch to the next (small batches near convergence), no trend: one
    # window cannot tell this from a falling loss, eight can.
    job = FakeJob(loss=lambda s, lv: 1.0 + (0.5 if s % 2 else -0.5) * (1 + 0.3 * math.sin(s * 0.7)))
    _, ds = drive(policy(), job, 4)
    assert switches(job) == [] and "more steps will narrow it" in ds[-1].reason, ds[-1].reason
    _, ds = drive(policy(), job := FakeJob(loss=job.loss), 20)
    assert switches(job) == [("fp32", "bf16")], [d.reason for d in ds]
    first = job.levels.index("bf16")
    assert first > 3 * 16  # more than a few windows of losses were needed


def test_a_quiet_falling_loss_is_not_stable() -> None:
    # Falls 0.5 % a step (8 % a window of 16), with almost no noise: not a plateau.
    job = FakeJob(loss=lambda s, lv: 3.0 * math.exp(-0.005 * s) + 0.001 * math.sin(s))
    _, ds = drive(policy(), job, 15)
    assert switches(job) == [] and "not stable" in ds[-1].reason and "per 16 steps" in ds[-1].reason


def test_probation_holds_each_level_before_the_next() -> None:
    job = FakeJob(precisions=("fp32", "bf16", "fp8"))
    drive(policy(), job, 30)
    assert switches(job) == [("fp32", "bf16"), ("bf16", "fp8")]
    at_bf16 = job.levels.count("bf16")
    assert at_bf16 >= 40  # the probation first


def test_a_level_that_buys_nothing_is_left_and_not_retried() -> None:
    job = FakeJob(precisions=("fp32", "bf16", "fp8-emulated"))  # emulated fp8 runs at bf16's speed
    state, ds = drive(policy(), job, 40)
    assert switches(job) == [("fp32", "bf16"), ("bf16", "fp8-emulated"), ("fp8-emulated", "bf16")]
    assert "saves" in job.log[-1]["reason"] and "going back" in job.log[-1]["reason"]
    assert job.precision == "bf16"
    assert "fp8-emulated" in ds[-1].details["jobs"]["j"]["no_gain"]


def test_tf32_stands_in_for_bf16_and_unsupported_levels_are_never_asked() -> None:
    job = FakeJob(precisions=("fp32", "tf32", "fp16"))
    drive(policy(), job, 30)
    assert switches(job) == [("fp32", "tf32")]
    only = FakeJob(precisions=("fp32",))
    _, ds = drive(policy(), only, 20)
    assert switches(only) == [] and "lowest level" in ds[-1].reason
    assert all(not d.precision for d in ds)


def test_no_energy_measure_holds() -> None:
    job = FakeJob()
    p = policy()
    state = p.new_state()
    for k in range(10):
        job.run()
        v = job.view()
        v = JobView(**{**v.__dict__, "measure": None})
        d = p.decide(Snapshot(t_s=float(k), gpus=(), jobs=(v,)), state)
        assert not d.precision
    assert "no energy measure" in d.reason


# The guard -----------------------------------------------------------------------------------


def test_trend_rollback_beyond_tolerance_and_cooldown() -> None:
    def worse(s: int, lv: str) -> float:
        return 1.0 + (0.2 if lv == "bf16" else 0.0) + 0.005 * math.sin(s)

    job = FakeJob(loss=worse)
    p = policy(tolerance=0.1, cooldown_s=50.0)
    state, ds = drive(p, job, 10)
    assert switches(job) == [("fp32", "bf16"), ("bf16", "fp32")]
    rb = next(d for d in ds if d.precision.get("j") == "fp32")
    event = rb.details["jobs"]["j"]["event"]
    assert event["kind"] == "rollback" and event["from"] == "bf16" and event["to"] == "fp32"
    assert event["loss"] == pytest.approx(1.2, abs=0.01) and event["trend"] == pytest.approx(1.0, abs=0.01)
    assert "over the trend" in event["reason"]
    found = re.search(r"is \+([0-9.]+)% \(\+/- [0-9.]+%\) over the trend", event["reason"])
    assert found is not None
    pct = float(found.group(1))
    assert pct == pytest.approx(20.0, abs=0.5)
    # Rolled back within the check window (grace + window losses), not at the end of probation.
    assert job.levels.count("bf16") <= 2 + 16 + 10
    # Barred for cooldown_s: no retry for 50 s, then one retry (and another rollback).
    drive(p, job, 70, state)
    retries = [e for e in job.log if e["to"] == "bf16"]
    assert len(retries) == 2
    assert retries[1]["t"] - job.log[1]["t"] >= 50.0


def test_a_level_is_never_accepted_without_losses_to_judge_it_by() -> None:
    """grace_steps larger than the longest probation leaves no loss after the grace: the
    level three times worse was accepted 'loss n/a'. It is rolled back, saying why."""

    def worse(s: int, lv: str) -> float:
        return (3.0 if lv == "bf16" else 1.0) + 0.005 * math.sin(s)

    job = FakeJob(loss=worse)
    drive(policy(grace_steps=1000), job, 60)
    assert switches(job)[:2] == [("fp32", "bf16"), ("bf16", "fp32")]
    assert job.log[1]["reason"].startswith("rollback bf16 -> fp32") and "too few to judge it" in job.log[1]["reason"]


def test_within_tolerance_is_kept() -> None:
    def slightly(s: int, lv: str) -> float:
        return 1.0 + (0.03 if lv == "bf16" else 0.0) + 0.005 * math.sin(s)

    job = FakeJob(loss=slightly)
    drive(policy(tolerance=0.05), job, 20)
    assert switches(job) == [("fp32", "bf16")] and job.precision == "bf16"


def noisy(effect: float, seed: int, sd: float = 0.4) -> Callable[[int, str], float]:
    """Single-batch losses with a relative spread of ``sd`` (small batches near
    convergence), ``effect`` worse at bf16."""
    import random

    rng = random.Random(seed)
    return lambda s, lv: max(0.0, (1.0 + (effect if lv == "bf16" else 0.0)) * (1.0 + sd * rng.gauss(0.0, 1.0)))


def test_noisy_losses_at_a_harmless_level_are_not_rolled_back() -> None:
    """A 40 % spread between batches (a batch-32 classifier near convergence) and no
    real effect: the excess over the trend is judged with its standard error, so noise
    alone does not roll back."""
    kept = 0
    for seed in range(20):
        job = FakeJob(loss=noisy(0.0, seed))
        drive(policy(tolerance=0.05, window=32), job, 80)
        assert switches(job)[0] == ("fp32", "bf16"), seed
        kept += job.precision == "bf16" and [e for e in job.log if e["to"] == "fp32"] == []
    assert kept >= 19, kept


def test_a_real_penalty_under_noise_is_rolled_back_once_it_is_sure() -> None:
    """Loss 30 % worse at bf16 under the same noise: probation runs on while it cannot
    tell, then rolls back; the reason carries the excess and its uncertainty."""
    rolled = 0
    for seed in range(20):
        job = FakeJob(loss=noisy(0.3, seed))
        _, ds = drive(policy(tolerance=0.05, window=32), job, 80)
        back = [d for d in ds if d.precision.get("j") == "fp32"]
        if back:
            rolled += 1
            assert "+/-" in back[0].details["jobs"]["j"]["event"]["reason"]
    assert rolled >= 19, rolled


def test_an_undecided_probation_is_extended_and_says_so() -> None:
    job = FakeJob(loss=noisy(0.0, 3))
    _, ds = drive(policy(tolerance=0.05), job, 40)
    reasons = [d.reason for d in ds]
    assert any("extended" in r and "+/-" in r for r in reasons), reasons[-5:]


def test_nonfinite_during_probation_rolls_back_at_once() -> None:
    job = FakeJob(inject=lambda s, lv: lv == "bf16" and s % 7 == 0)
    state, ds = drive(policy(), job, 12)
    assert switches(job)[:2] == [("fp32", "bf16"), ("bf16", "fp32")]
    i = job.levels.index("bf16")
    assert job.levels[i : i + 10] == ["bf16"] * 10 and job.levels[i + 10] == "fp32"  # the next period
    assert "non-finite" in job.log[1]["reason"]


def test_a_proposal_the_ranks_do_not_apply_starts_no_probation_and_no_rollback() -> None:
    """A rank's daemon asks bf16, the job's ranks never agree (another rank's daemon does
    not ask it): the job runs fp32 throughout, so there is nothing to judge at bf16: no
    probation over fp32 steps, no rollback, no bar, even when the fp32 loss then moves
    10 % (what a probation over those steps read as bf16's penalty)."""

    def moving(step: int, level: str) -> float:
        return (1.0 if step < 300 else 1.1) + 0.01 * math.sin(step)

    job = FakeJob(loss=moving, applies=lambda level: False)
    p = policy()
    state, ds = drive(p, job, 80)
    assert [e["kind"] for e in job.log] == ["proposed"]  # asked once; it stands
    assert set(job.levels) == {"fp32"}
    details = ds[-1].details["jobs"]["j"]
    assert details["probation"] is None and details["barred"] == {} and details["level"] == "fp32"
    assert not any("rollback" in d.reason for d in ds)
    assert "bf16 proposed" in ds[-1].reason and "the ranks still run fp32" in ds[-1].reason
    # Its fp32 losses and energy stay fp32's, for when the ranks agree later: they do,
    # and the probation starts then, at the step they switched.
    job.applies = lambda level: True
    job.precision, job.since, job.proposed = "bf16", job.steps, None  # the other daemon asked too
    switched_at = job.steps
    _, ds2 = drive(p, job, 1, state)
    pb = ds2[-1].details["jobs"]["j"]["probation"]
    assert pb is not None and pb["to"] == "bf16" and pb["steps"] == 10 and pb["trend"] == pytest.approx(1.1, abs=0.02)
    assert switched_at + 10 == job.steps
    _, ds3 = drive(p, job, 10, state)
    assert not any("rollback" in d.reason for d in ds3)  # flat after the switch: kept
    assert "bf16 accepted" in ds3[-1].details["jobs"]["j"]["last_event"]


def test_a_rollback_waits_for_the_ranks_to_run_the_level_again() -> None:
    # bf16 is 20 % worse: rolled back; until the ranks run fp32 again the policy waits
    # (it does not ask again, and does not judge).
    job = FakeJob(loss=lambda s, lv: 1.2 if lv == "bf16" else 1.0, applies=lambda level: level != "fp32")
    p = policy()
    state, ds = drive(p, job, 12)
    assert [e["kind"] for e in job.log] == ["switch", "proposed"] and job.proposed == "fp32"
    assert "fp32 proposed" in ds[-1].reason and "bf16" in ds[-1].details["jobs"]["j"]["barred"]
    job.applies = lambda level: True
    job.precision, job.since, job.proposed = "fp32", job.steps, None
    _, ds = drive(p, job, 3, state)
    assert ds[0].details["jobs"]["j"]["level"] == "fp32" and "the ranks run fp32 again" in ds[0].reason


def test_callback_rollback_bars_the_level() -> None:
    job = FakeJob()
    p = policy(cooldown_s=30.0)

    def callback_rolls_back(k: int, j: FakeJob) -> None:
        if j.precision == "bf16" and j.levels.count("bf16") >= 5 and not any(e["kind"] == "rollback" for e in j.log):
            j.nonfinite.append(j.steps)
            j.log.append(
                {
                    "t": j.t,
                    "kind": "rollback",
                    "from": "bf16",
                    "to": "fp32",
                    "reason": "non-finite loss",
                    "step": j.steps,
                    "loss": None,
                    "trend": 1.0,
                    "rank": 0,
                }
            )
            j.precision = "fp32"

    state, ds = drive(p, job, 12, hook=callback_rolls_back)
    assert [e["kind"] for e in job.log] == ["switch", "rollback"]
    assert "bf16" in ds[-1].details["jobs"]["j"]["barred"] and not ds[-1].precision
    drive(p, job, 40, state, hook=callback_rolls_back)
    assert [e["kind"] for e in job.log][:3] == ["switch", "rollback", "switch"]
    retry = job.log[2]
    assert retry["to"] == "bf16" and retry["t"] - job.log[1]["t"] >= 30.0


def test_with_reference_checks_the_training_losses_do_not_judge_accuracy() -> None:
    """A job whose ranks check the level on a reference batch: a loss 20 % worse after the
    switch (the data changed, say) rolls nothing back, where without the checks it does;
    the probation lasts three checks, then the energy is judged and the level kept."""

    def jump(s: int, lv: str) -> float:
        return 1.0 + (0.2 if lv == "bf16" else 0.0) + 0.005 * math.sin(s)

    plain = FakeJob(loss=jump)
    drive(policy(tolerance=0.1), plain, 30)
    assert switches(plain) == [("fp32", "bf16"), ("bf16", "fp32")]

    job = FakeJob(loss=jump, reference_every=50)
    _, ds = drive(policy(tolerance=0.1), job, 30)
    assert switches(job) == [("fp32", "bf16")] and job.precision == "bf16"
    reasons = [d.reason for d in ds]
    waiting = [r for r in reasons if "reference checks every 50 steps" in r]
    assert waiting and "/150 steps" in waiting[0]  # max(probation 40, 3 checks of 50)
    accepted = next(r for r in reasons if "accepted" in r)
    assert "no rollback from the reference checks" in accepted
    assert job.levels.index("bf16") + 150 <= len(job.levels) - job.levels[::-1].index("bf16")


def test_with_probes_a_shift_after_the_switch_is_not_judged_as_the_level() -> None:
    """A job whose ranks probe the level against the level above: a loss 20 % worse after
    the switch (the data moved: the ranks' probes see it at both levels) rolls nothing
    back; the probation waits for the probes' first verdict, then judges the energy. The
    probe steps' losses are never booked as the level's."""

    def shift(s: int, lv: str) -> float:
        return 1.0 + (0.2 if s >= shift_at[0] else 0.0) + 0.005 * math.sin(s)

    shift_at = [10**9]
    job = FakeJob(loss=shift, probe_every=400, precisions=("fp32", "bf16"))

    def hook(k: int, j: FakeJob) -> None:
        if j.precision == "bf16" and shift_at[0] > j.steps:
            shift_at[0] = j.steps + 5  # 5 steps after the switch, both levels alike

    state, ds = drive(policy(tolerance=0.1), job, 40, hook=hook)
    assert switches(job) == [("fp32", "bf16")] and job.precision == "bf16"
    assert not [e for e in job.log if e["kind"] == "rollback"]
    reasons = [d.reason for d in ds]
    waiting = [r for r in reasons if "accuracy: the job's probes at fp32" in r]
    assert waiting and f"/{PROBE_PROBATION_STEPS} steps" in waiting[0]  # max(probation 40, the first two probe blocks)
    accepted = next(r for r in reasons if "accepted" in r)
    assert "no rollback from the probes at fp32" in accepted
    assert job.probe_steps > 0
    # Every loss the level has is one of its own steps' (the probe steps' are not taken).
    js = state.jobs["j"]
    own = [v for v, lv in zip(job.losses, job.levels, strict=True) if lv == "bf16"]
    assert js.level_losses == own[-len(js.level_losses) :]

    # Without probes the same shift reads as the level's penalty and rolls back.
    shift_at[0] = 10**9
    plain = FakeJob(loss=shift, precisions=("fp32", "bf16"))
    drive(policy(tolerance=0.1), plain, 40, hook=hook)
    assert switches(plain) == [("fp32", "bf16"), ("bf16", "fp32")]


def test_the_policy_waits_for_as_many_checks_as_the_callback_needs() -> None:
    from greend.policies.precision import REFERENCE_CHECKS
    from greend.training.reference import MIN_CHECKS

    assert REFERENCE_CHECKS == MIN_CHECKS


def test_refused_level_is_barred_and_the_job_resynced() -> None:
    job = FakeJob()
    p = policy()
    state = p.new_state()

    def refuse(k: int, j: FakeJob) -> None:
        if j.precision == "bf16" and not any(e["kind"] == "refused" for e in j.log):
            j.log.append(
                {
                    "t": j.t,
                    "kind": "refused",
                    "from": "fp32",
                    "to": "bf16",
                    "reason": "bf16 is barred",
                    "step": j.steps,
                    "rank": 0,
                }
            )
            # The callback stayed at fp32; the daemon still believes bf16 (it does not undo it).

    drive(p, job, 30, state, hook=refuse)
    assert switches(job)[:2] == [("fp32", "bf16"), ("bf16", "fp32")]
    assert "bf16" in state.jobs["j"].barred


def test_ended_jobs_are_forgotten_and_params_are_checked() -> None:
    p = policy()
    state, _ = drive(p, FakeJob(), 3)
    assert "j" in state.jobs
    p.decide(Snapshot(t_s=100.0, gpus=(), jobs=()), state)
    assert state.jobs == {}
    with pytest.raises(PolicyError, match="ladder"):
        get_policy("precision", ladder="fp32,fp7")
    with pytest.raises(PolicyError, match="tolerance"):
        get_policy("precision", tolerance=0)


def test_loss_trend() -> None:
    mean, slope, fitted, sd = loss_trend([1.0, 2.0, 3.0, 4.0])
    assert (mean, slope, fitted) == pytest.approx((2.5, 1.0, 4.0)) and sd == pytest.approx(0.0)


def test_decide_is_pure_given_the_state() -> None:
    """Same snapshots, same state: same decisions (no clock, no randomness)."""
    a, b = FakeJob(), FakeJob()
    _, da = drive(policy(), a, 20)
    _, db = drive(policy(), b, 20)
    assert [d.precision for d in da] == [d.precision for d in db] and a.levels == b.levels


def test_levels_are_compared_at_one_gpu_setting_never_across_a_clock_cap() -> None:
    """fp8 measured under a clock cap against bf16 measured uncapped would credit the cap's
    saving to fp8: the energy verdict takes both levels at one setting, or none."""
    from greend.policies.base import Setting
    from greend.policies.precision_state import Evidence as _Evidence
    from greend.policies.precision_state import JobMemory as _Job

    p = policy()
    capped = Setting(clock_cap_mhz=1485)
    js = _Job(level="fp8", level_since_steps=0)
    js.evidence[("bf16", UNCAPPED)] = _Evidence(steps=40, flops=40e12, time_s=4.0, energy_j=400.0)
    js.evidence[("fp8", capped)] = _Evidence(steps=40, flops=40e12, time_s=4.0, energy_j=220.0)
    assert p._shared_setting(js, "fp8", "bf16", capped) is None  # nothing to compare like for like
    js.evidence[("bf16", capped)] = _Evidence(steps=8, flops=8e12, time_s=0.8, energy_j=56.0)
    assert p._shared_setting(js, "fp8", "bf16", capped) == capped
    js.evidence[("fp8", UNCAPPED)] = _Evidence(steps=8, flops=8e12, time_s=0.8, energy_j=62.0)
    assert p._shared_setting(js, "fp8", "bf16", UNCAPPED) == UNCAPPED  # the setting in force first


def _caps_move_with_the_level(uncapped_at: Callable[[float], bool] = lambda t: False) -> Callable[[int, FakeJob], None]:
    """A clock policy beside: at bf16 the job runs under a cap of its own (a new measure),
    except where ``uncapped_at(t)`` (a baseline re-check); each period is 60 s."""

    def hook(k: int, job: FakeJob) -> None:
        job.t += 59.0
        want = Setting(clock_cap_mhz=1500) if job.precision == "bf16" and not uncapped_at(job.t) else UNCAPPED
        if want != job.setting:
            job.setting, job.m = want, [0, 0.0, 0.0, 0.0]

    return hook


def test_a_level_with_no_figure_to_compare_waits_for_one_then_goes_back() -> None:
    """The two levels never ran at one GPU setting (a clock policy moved the cap with the
    level): the saving is not shown, so the level is not accepted on trust: it waits for a
    figure, then goes back."""
    from greend.policies.precision_state import FIGURE_WAIT_S

    job = FakeJob(precisions=("fp32", "bf16"))
    _, ds = drive(policy(), job, 12, hook=_caps_move_with_the_level())
    assert switches(job) == [("fp32", "bf16")] and "waiting for a fp32 figure" in ds[-1].reason, ds[-1].reason
    _, ds = drive(policy(), job := FakeJob(precisions=("fp32", "bf16")), 12 + int(FIGURE_WAIT_S / 60) + 5,
                  hook=_caps_move_with_the_level())  # fmt: skip
    assert switches(job)[:2] == [("fp32", "bf16"), ("bf16", "fp32")]  # (tried again after cooldown_s)
    back = [e["reason"] for e in job.log if e["kind"] == "switch" and e["to"] == "fp32"][0]
    assert "no fp32 figure" in back and "going back" in back
    assert not any("accepted" in d.reason for d in ds)


def test_a_figure_that_comes_while_waiting_settles_it() -> None:
    """A baseline re-check at bf16 (uncapped, as fp32 ran) gives the figure: accepted with
    its saving."""
    job = FakeJob(precisions=("fp32", "bf16"))
    _, ds = drive(policy(), job, 40, hook=_caps_move_with_the_level(uncapped_at=lambda t: 1300 <= t < 1700))
    assert switches(job) == [("fp32", "bf16")]
    accepted = [d.reason for d in ds if "accepted" in d.reason]
    assert accepted and "less energy per FLOP than fp32" in accepted[0], [d.reason for d in ds[-5:]]


def test_a_job_with_no_flops_is_not_switched_back_and_forth(monkeypatch: pytest.MonkeyPatch) -> None:
    """No FLOPs counted (no energy per FLOP at any setting): nothing to wait for, the level
    is kept as before rather than going back every 30 minutes."""
    monkeypatch.setitem(globals(), "FLOPS", 0.0)
    job = FakeJob(precisions=("fp32", "bf16"))
    _, ds = drive(policy(cooldown_s=600.0), job, 120, hook=lambda k, job: setattr(job, "t", job.t + 59.0))
    assert switches(job) == [("fp32", "bf16")]
    assert any("accepted" in d.reason and "no energy per FLOP figure" in d.reason for d in ds)


def test_a_job_with_no_flops_is_judged_by_its_energy_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """No FLOPs counted but energy measured: the levels are compared by energy per step
    (the same work at each), so a level that buys nothing goes back as it would by FLOPs."""
    monkeypatch.setitem(globals(), "FLOPS", 0.0)
    job = FakeJob(precisions=("fp32", "bf16"))
    real_run = job.run

    def run() -> None:  # energy per step as the level's EPF says, with no FLOPs counted
        e0 = job.m[3]
        real_run()
        job.m[3] = e0 + job.steps_per_period * 1e12 * (EPF["fp32"] if job.precision == "fp32" else EPF["fp32"] * 0.99)

    job.run = run  # type: ignore[method-assign]  # bf16 saves 1 %: under min_saving
    _, ds = drive(policy(cooldown_s=600.0), job, 60)
    assert switches(job)[:2] == [("fp32", "bf16"), ("bf16", "fp32")], [d.reason for d in ds[-3:]]
