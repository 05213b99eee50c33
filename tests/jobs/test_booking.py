"""Booking a rank's rows onto its job (greend.jobs.booking), with plain values: no
daemon, no socket, no clock, no device model. The figures booked are checked by hand."""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest

from greend.errors import ProtocolError
from greend.jobs.booking import (
    NOT_TAKEN_STEPS,
    TRIAL_STEPS,
    append_bounded,
    book_cap_change,
    book_host_cpu,
    book_precision_event,
    book_process_cpu,
    book_proposal,
    book_proposals_not_taken,
    book_row,
    book_withdrawal,
    shed_step_records,
    thinned,
)
from greend.jobs.execution import ExecutedRow
from greend.jobs.records import EfficiencySample, Job, Measure, RankSession
from greend.protocol import PrecisionEventEntry, StepEntry, StepsRow, decode_rows, decode_steps


def _job(*gpus: int, precision: str = "fp32") -> tuple[Job, RankSession]:
    job = Job("j", 1000, 0.0, 1.7e9, run="r1", precision=precision)
    rs = RankSession(7, "j", 0, 0, 1, list(gpus), 4242, 1000, "h", ["fp32", "bf16"], None, None, 0.0)
    job.ranks[rs.session] = rs
    job.gpus.update(gpus)
    return job, rs


def _row(t0_s: float, n: int = 4, *, step_s: float = 0.5, flops: float = 8e12, **kw: Any) -> StepsRow:
    """``n`` steps of ``step_s`` each from ``t0_s`` (busy the whole time), ``flops`` in all."""
    return StepsRow(
        first_step=10,
        last_step=10 + n - 1,
        steps=n,
        t0_s=t0_s,
        t1_s=t0_s + n * step_s,
        busy_s=n * step_s,
        busy_sq_s2=n * step_s * step_s,
        flops=flops,
        **kw,
    )


def test_a_measured_row_books_totals_measure_baseline_and_aggregate() -> None:
    job, rs = _job(0, 1)
    row = _row(
        100.0, samples=256, tokens=4096, loss_n=4, loss_sum=10.0, loss_min=2.0, loss_max=3.0, loss_last=2.25,
        losses=(3.0, 2.5, 2.25, 2.25),
    )  # fmt: skip
    book_row(job, rs, row, None, now_s=500.0)
    # The job's totals.
    assert (job.steps, job.step_reports, rs.steps) == (4, 4, 4)
    assert job.flops == 8e12 and job.samples == 256 and job.tokens == 4096
    assert job.step_time_s == pytest.approx(2.0)
    assert job.gpu_flops == {0: 4e12, 1: 4e12}  # split evenly over the rank's GPUs
    assert (job.t_start_s, job.last_step_t1_s) == (100.0, 102.0)
    assert job.modelled_time_s == 0.0 and job.modelled_energy_j == 0.0
    # The losses, step by step, and the last one.
    assert list(job.losses) == [3.0, 2.5, 2.25, 2.25] and job.last_loss == 2.25
    # The policy's measure: measured time; the energy comes from the ledger later.
    m = job.measure
    assert (m.steps, m.flops) == (4, 8e12)
    assert m.time_s == pytest.approx(2.0) and m.time_sq_s2 == pytest.approx(1.0)
    assert m.modelled_energy_j == 0.0 and m.energy_sq_j2 == 0.0
    assert (m.t0_s, m.t1_s) == (100.0, 102.0)
    # The baseline: uncapped at the first row's level; seconds per FLOP per step.
    b = job.baseline
    assert (b.precision, b.steps, b.flops, b.time_s) == ("fp32", 4, 8e12, pytest.approx(2.0))
    assert b.x_n == 4 and b.x_sum == pytest.approx(2.0 / 2e12) and b.x_sq == pytest.approx(1.0 / 4e24)
    assert b.spans == [[100.0, 102.0]] and b.span_open
    # The window's record and the stores' aggregate.
    assert job.recent[-1].flops == 8e12 and job.recent[-1].modelled_time_s is None
    agg = rs.aggs["fp32"]
    assert list(rs.aggs) == ["fp32"] and agg.precision == "fp32" and agg.since_s == 500.0
    assert agg.fields() == {
        "steps": 4, "first_step": 10, "last_step": 13, "duration_s": 2.0, "duration_sq_s2": 1.0, "flops": 8e12,
        "samples": 256, "tokens": 4096, "nonfinite": 0, "loss_mean": 2.5, "loss_min": 2.0, "loss_max": 3.0,
        "loss_n": 4,
    }  # fmt: skip


def test_a_modelled_row_books_the_models_time_and_energy() -> None:
    job, rs = _job(0)
    book_row(job, rs, _row(100.0), ExecutedRow(duration_s=3.0, energy_j=1200.0), now_s=0.0)
    book_row(job, rs, _row(102.0), ExecutedRow(duration_s=3.0, energy_j=1000.0), now_s=0.0)
    assert job.modelled_time_s == 6.0 and job.modelled_energy_j == 2200.0
    assert job.step_time_s == pytest.approx(4.0)  # the measured time stays beside it
    m = job.measure
    assert m.time_s == 6.0 and m.modelled_energy_j == 2200.0
    # A modelled row's steps are equal: each 3/4 s and 300 J (then 250 J).
    assert m.time_sq_s2 == pytest.approx(2 * 4 * 0.75**2)
    assert m.energy_sq_j2 == pytest.approx(4 * 300.0**2 + 4 * 250.0**2)
    b = job.baseline
    assert b.time_s == 6.0 and b.modelled_energy_j == 2200.0
    # Joules per FLOP per step: 1200/8e12 for 4 steps, then 1000/8e12 for 4.
    assert b.x_n == 8 and b.x_sum == pytest.approx(4 * 1200 / 8e12 + 4 * 1000 / 8e12)
    assert b.spans == [[100.0, 104.0]]  # touching baseline rows: one span
    assert job.recent[-1].modelled_time_s == 3.0
    fields = rs.aggs["fp32"].fields()
    assert fields["sim_duration_s"] == 6.0 and fields["sim_energy_j"] == 2200.0  # the stores' names


def test_a_precision_change_starts_an_aggregate_of_its_level() -> None:
    job, rs = _job(0)
    book_row(job, rs, _row(100.0), None, now_s=1.0)
    book_row(job, rs, _row(102.0, precision="bf16"), None, now_s=2.0)
    assert rs.aggs["fp32"].steps == 4 and rs.aggs["fp32"].since_s == 1.0
    assert rs.aggs["bf16"].precision == "bf16" and rs.aggs["bf16"].since_s == 2.0 and rs.aggs["bf16"].steps == 4
    # The baseline stays at the first level: the bf16 steps are not in it.
    assert job.baseline.precision == "fp32" and job.baseline.steps == 4 and not job.baseline.span_open
    # Its one rank runs bf16: so does the job (a move the daemon did not ask: the rank
    # reports it itself, as an event, so the rows log nothing).
    assert job.precision == "bf16" and job.measure.since_s == 102.0 and job.measure.steps == 4
    assert job.precision_log == []
    # A row naming no level runs at the job's.
    book_row(job, rs, _row(104.0), None, now_s=3.0)
    assert rs.aggs["bf16"].steps == 8 and rs.aggs["fp32"].steps == 4


def test_rows_before_the_setting_settled_stay_out_of_the_measure() -> None:
    job, rs = _job(0)
    job.measure = Measure(since_s=101.0)
    book_row(job, rs, _row(100.0), None, now_s=0.0)  # began before: totals only
    assert job.steps == 4 and job.measure.steps == 0 and job.baseline.steps == 0
    book_row(job, rs, _row(102.0), None, now_s=0.0)
    assert job.steps == 8 and job.measure.steps == 4 and job.measure.t0_s == 102.0


def test_capped_steps_are_not_the_baseline() -> None:
    job, rs = _job(0)
    book_row(job, rs, _row(100.0), None, now_s=0.0)
    book_cap_change(job, t_wall_s=5.0, clock_cap_mhz=1200, power_limit_w=None, reason="r", max_entries=10)
    assert job.capped and job.cap_changes == 1 and job.decisions[-1].clock_cap_mhz == 1200
    book_row(job, rs, _row(102.0), None, now_s=0.0)
    assert job.baseline.steps == 4 and not job.baseline.span_open
    book_cap_change(job, t_wall_s=6.0, clock_cap_mhz=None, power_limit_w=None, reason="r", max_entries=10)
    book_row(job, rs, _row(110.0), None, now_s=0.0)  # uncapped again: a new span
    assert job.baseline.steps == 8 and job.baseline.spans == [[100.0, 102.0], [110.0, 112.0]]


def test_the_baseline_is_the_jobs_own_level_not_the_level_its_record_began_at() -> None:
    """A bf16 job whose daemon restarted while it ran fp8: the new record's first rows are
    fp8. The baseline took their level and the saving was measured against fp8 (0 %);
    it waits for the job's own level."""
    job, rs = _job(0, precision="bf16")
    job.top_precision = "bf16"
    book_row(job, rs, _row(100.0, precision="fp8-emulated"), None, now_s=0.0)
    assert job.baseline.steps == 0 and job.baseline.precision == "bf16"
    book_row(job, rs, _row(110.0, precision="bf16"), None, now_s=0.0)
    assert job.baseline.steps == 4 and job.baseline.precision == "bf16"


def test_nonfinite_steps_and_a_rows_mean_loss() -> None:
    job, rs = _job(0)
    book_row(job, rs, _row(100.0, nonfinite=2, loss_n=2, loss_sum=5.0), None, now_s=0.0)
    assert job.nonfinite_steps == 2
    assert list(job.nonfinite_recent) == [13, 13]  # no indices sent: the row's last step stands
    assert list(job.losses) == [2.5] and job.last_loss == 2.5  # no losses sent: the mean stands
    agg = rs.aggs["fp32"]
    assert agg.loss_min == 2.5 and agg.loss_max == 2.5 and agg.nonfinite == 2
    book_row(job, rs, _row(102.0, nonfinite=1, nonfinite_steps=(11,)), None, now_s=0.0)
    assert list(job.nonfinite_recent) == [13, 13, 11]


def test_the_jobs_steps_are_its_busiest_ranks() -> None:
    job, rs = _job(0)
    other = RankSession(8, "j", 1, 1, 2, [1], 4343, 1000, "h", ["fp32"], None, None, 0.0)
    job.ranks[other.session] = other
    book_row(job, rs, _row(100.0, n=4), None, now_s=0.0)
    book_row(job, other, _row(100.0, n=3), None, now_s=0.0)
    assert job.steps == 4 and job.step_reports == 7 and (rs.steps, other.steps) == (4, 3)


def test_a_step_entry_is_a_row_of_one_step() -> None:
    s = StepEntry(step=5, t0_s=1.0, t1_s=1.25, flops=1e12, samples=8, loss=0.5, precision="bf16")
    r = s.as_row()
    assert (r.first_step, r.last_step, r.steps, r.busy_s, r.busy_sq_s2) == (5, 5, 1, 0.25, 0.0625)
    assert (r.loss_n, r.loss_sum, r.loss_last, r.losses, r.precision, r.samples) == (1, 0.5, 0.5, (0.5,), "bf16", 8)
    bad = StepEntry(step=6, t0_s=1.0, t1_s=1.5, flops=1e12, loss=None, nonfinite=True).as_row()
    assert (bad.nonfinite, bad.nonfinite_steps, bad.loss_n, bad.losses) == (1, (6,), 0, ())


def test_wire_entries_are_checked_and_decoded_once() -> None:
    (row,) = decode_rows(
        [{"first_step": 0, "last_step": 1, "steps": 2, "t0_s": 1, "t1_s": 2.0, "busy_s": 0.8, "busy_sq_s2": 0.32,
          "flops": 4, "losses": [1, 2], "loss_n": 2, "loss_sum": 3.0}]
    )  # fmt: skip
    assert row == StepsRow(0, 1, 2, 1.0, 2.0, 0.8, 0.32, 4.0, loss_n=2, loss_sum=3.0, losses=(1, 2))
    assert isinstance(row.t0_s, float) and isinstance(row.flops, float)
    (step,) = decode_steps([{"step": 3, "t0_s": 1.0, "t1_s": 1.5, "flops": 7, "nonfinite": True}])
    assert step == StepEntry(3, 1.0, 1.5, 7.0, nonfinite=True)
    with pytest.raises(ProtocolError) as e:
        decode_rows([{"first_step": 0, "last_step": 0, "steps": 1, "t0_s": 2.0, "t1_s": 1.0, "busy_s": 0.0,
                      "busy_sq_s2": 0.0, "flops": 0.0}])  # fmt: skip
    assert e.value.field == "rows[0].t1_s"


def test_cpu_seconds_are_booked_since_last_seen() -> None:
    job, rs = _job(0)
    book_process_cpu(job, rs, 10.0)  # first sight: the starting point only
    assert job.cpu_job_s == 0.0 and rs.cpu_last_s == 10.0
    book_host_cpu(job, {4242: 12.5, 1: 99.0}, node_cpu_busy_s=40.0)
    assert job.cpu_job_s == 2.5 and job.cpu_busy0_s == 40.0
    book_host_cpu(job, {4242: 12.0}, node_cpu_busy_s=50.0)  # never backwards
    assert job.cpu_job_s == 2.5 and job.cpu_busy0_s == 40.0
    other, _ = _job(1)
    book_host_cpu(other, {}, node_cpu_busy_s=60.0)  # its ranks unseen: its share not begun
    assert other.cpu_busy0_s is None


def test_bounded_logs_drop_the_oldest_and_count_them() -> None:
    job, _ = _job(0)
    for k in range(5):
        book_cap_change(job, t_wall_s=float(k), clock_cap_mhz=1000 + k, power_limit_w=None, reason="r", max_entries=3)
    assert [d.clock_cap_mhz for d in job.decisions] == [1002, 1003, 1004]
    assert job.decisions_dropped == 2 and job.cap_changes == 5
    append_bounded(job, "gone", object(), 1)
    append_bounded(job, "gone", object(), 1)
    assert len(job.gone) == 1 and job.gone_dropped == 1


def test_a_proposal_moves_the_jobs_level_only_once_its_ranks_run_it() -> None:
    job, rs = _job(0, precision="bf16")
    job.top_precision = "bf16"
    other = RankSession(8, "j", 1, 1, 2, [1], 4243, 1000, "h", ["fp32", "bf16", "fp8"], None, None, 0.0)
    job.ranks[other.session] = other
    job.steps, job.last_loss = 40, 1.5
    book_proposal(job, "fp8", "loss stable", kind="switch", trend=1.4, t_wall_s=9.0, max_entries=10)
    # Proposed: logged as such; the job's level and its measure stay.
    assert job.precision == "bf16" and job.proposal is not None and job.proposal.level == "fp8"
    assert job.precision_log[-1].to_json() == {
        "t": 9.0, "kind": "proposed", "from": "bf16", "to": "fp8", "reason": "switch: loss stable", "step": 40,
        "loss": 1.5, "trend": 1.4,
    }  # fmt: skip
    # Rows at the old level are its evidence still.
    book_row(job, rs, _row(100.0, precision="bf16"), None, now_s=0.0, t_wall_s=10.0)
    book_row(job, other, _row(100.0, precision="bf16"), None, now_s=0.0, t_wall_s=10.0)
    assert job.precision == "bf16" and job.measure.steps == 8
    # One rank of two runs fp8: the job is in transition; that row is no level's evidence.
    book_row(job, rs, _row(102.0, precision="fp8"), None, now_s=0.0, t_wall_s=11.0)
    book_row(job, other, _row(101.0, precision="bf16"), None, now_s=0.0, t_wall_s=11.0)
    assert job.precision == "bf16" and job.measure.steps == 12 and len(job.precision_log) == 1
    # Both run it: the switch, as proposed, and the measure starts with that row.
    book_row(job, other, _row(103.0, precision="fp8"), None, now_s=0.0, t_wall_s=12.0)
    assert job.precision == "fp8" and job.proposal is None
    assert (job.measure.since_s, job.measure.steps) == (103.0, 4)  # (rank 0's fp8 row came before it)
    change = job.precision_log[-1]
    assert (change.kind, change.from_level, change.to_level, change.reason, change.t_wall_s, change.trend) == (
        "switch", "bf16", "fp8", "loss stable", 12.0, 1.4,
    )  # fmt: skip


def _bf16_proposed(**rank: Any) -> tuple[Job, RankSession]:
    """A job at fp32 (its rank's attributes set from ``rank``) that has run one row, and
    the daemon's proposal of bf16 standing."""
    job, rs = _job(0)
    for name, value in rank.items():
        setattr(rs, name, value)
    job.top_precision = "fp32"
    book_row(job, rs, _row(100.0, precision="fp32"), None, now_s=0.0)
    book_proposal(job, "bf16", "loss stable", kind="switch", trend=None, t_wall_s=9.0, max_entries=10)
    return job, rs


def test_a_proposal_the_ranks_never_run_is_logged_once_as_not_taken_and_stands() -> None:
    job, rs = _bf16_proposed()
    start = job.steps
    t = 102.0
    while job.steps - start < NOT_TAKEN_STEPS - 4:
        book_row(job, rs, _row(t, precision="fp32"), None, now_s=0.0)
        t += 2.0
        assert book_proposals_not_taken(job, t_wall_s=t, max_entries=10) is None
    book_row(job, rs, _row(t, precision="fp32"), None, now_s=0.0)
    change = book_proposals_not_taken(job, t_wall_s=50.0, max_entries=10)
    assert change is not None and (change.kind, change.from_level, change.to_level) == ("not taken", "fp32", "bf16")
    assert f"ran {NOT_TAKEN_STEPS} steps at fp32" in change.reason
    assert book_proposals_not_taken(job, t_wall_s=51.0, max_entries=10) is None  # once
    assert [c.kind for c in job.precision_log] == ["proposed", "not taken"]  # no switch, no rollback
    assert job.precision == "fp32" and job.proposal is not None  # it stands: the ranks may still agree on it
    # Asking the level in force again withdraws it.
    book_withdrawal(job, "loss moved", t_wall_s=52.0, max_entries=10)
    assert job.proposal is None and job.precision_log[-1].kind == "withdrawn"


def test_a_proposal_to_ranks_that_probe_waits_for_their_trial_before_it_is_not_taken() -> None:
    """Ranks that probe (they registered probe_every) start a step down with a trial: up to
    TRIAL_STEPS steps at the old level (but for its blocks, sent as probe rows) before they
    run the new one. The proposal is not "not taken" meanwhile; the trial's probe rows at
    the new level move no level; the switch is logged when the ranks' own rows run it."""
    job, rs = _bf16_proposed(probe_every=400)
    start, t = job.steps, 102.0
    while job.steps - start < NOT_TAKEN_STEPS + TRIAL_STEPS - 4:
        trial_block = job.steps - start == 28
        book_row(job, rs, _row(t, precision="bf16" if trial_block else "fp32", probe=trial_block), None, now_s=0.0)
        t += 2.0
        assert book_proposals_not_taken(job, t_wall_s=t, max_entries=10) is None, job.steps - start
        assert job.precision == "fp32" and [c.kind for c in job.precision_log] == ["proposed"]
    assert job.probe_steps == 4
    # The baseline's spans (the ledger's windows of its energy) leave the trial's block out.
    block = 102.0 + 2.0 * 7  # the trial block's row: 116-118 s
    assert not [s for s in job.baseline.spans if s[0] < block + 2.0 and s[1] > block], job.baseline.spans
    assert [s[1] for s in job.baseline.spans if s[1] <= block] == [block], job.baseline.spans
    book_row(job, rs, _row(t, precision="bf16"), None, now_s=0.0, t_wall_s=t)
    assert job.precision == "bf16" and job.precision_log[-1].kind == "switch"


def test_precision_events_move_the_jobs_level() -> None:
    job, rs = _job(0, precision="bf16")
    job.top_precision = "bf16"
    job.steps, job.last_loss = 40, 1.5
    book_proposal(job, "fp8", "loss stable", kind="switch", trend=-0.01, t_wall_s=9.0, max_entries=10)
    book_row(job, rs, _row(45.0, precision="fp8"), None, now_s=0.0, t_wall_s=9.5)
    assert job.precision == "fp8" and job.measure.since_s == 45.0
    rollback = PrecisionEventEntry("rollback", "fp8", "bf16", "non-finite loss", 41, None, None)
    book_precision_event(job, rollback, rank=0, t_wall_s=10.0, now_s=60.0, max_entries=10)
    assert job.precision == "bf16" and job.measure.since_s == 60.0 and rs.precision == "bf16"
    assert job.precision_log[-1].rank == 0 and job.precision_log[-1].reason == "non-finite loss"
    refused = PrecisionEventEntry("refused", "bf16", "fp8", None, 42, None, None)
    book_proposal(job, "fp8", "again", kind="switch", trend=None, t_wall_s=10.5, max_entries=10)
    book_precision_event(job, refused, rank=0, t_wall_s=11.0, now_s=70.0, max_entries=10)
    assert job.precision == "bf16" and job.measure.since_s == 60.0  # kept; measured on
    assert job.precision_log[-1].reason == "" and job.proposal is None  # the refused proposal is gone


def test_a_rollback_that_overtakes_its_rows_is_one_switch_and_one_rollback() -> None:
    """A rank's rollback event that reaches the daemon before its rows at the level it rolls
    back from: the switch is logged from the standing proposal, and the late rows move no level."""
    job, rs = _job(0)
    job.top_precision = "fp32"
    book_row(job, rs, _row(100.0, precision="fp32"), None, now_s=0.0)  # steps 10-13
    book_proposal(job, "bf16", "loss stable", kind="switch", trend=1.2, t_wall_s=9.0, max_entries=10)
    rollback = PrecisionEventEntry("rollback", "bf16", "fp32", "loss spike", 16, 3.0, 1.2)
    book_precision_event(job, rollback, rank=0, t_wall_s=10.0, now_s=110.0, max_entries=10)
    late = StepsRow(14, 16, 3, 102.0, 103.5, 1.5, 0.75, 6e12, precision="bf16")  # ran before the event
    book_row(job, rs, late, None, now_s=0.0, t_wall_s=11.0)
    after = StepsRow(17, 20, 4, 103.5, 105.5, 2.0, 1.0, 8e12, precision="fp32")
    book_row(job, rs, after, None, now_s=0.0, t_wall_s=12.0)
    moves = [(c.kind, c.from_level, c.to_level) for c in job.precision_log if c.kind != "proposed"]
    assert moves == [("switch", "fp32", "bf16"), ("rollback", "bf16", "fp32")]
    assert job.precision == "fp32" and rs.precision == "fp32" and job.proposal is None
    assert job.measure.since_s == 110.0 and job.measure.steps == 0  # (the fp32 row began before the rollback)


def test_an_ended_job_sheds_its_step_records() -> None:
    job, rs = _job(0)
    book_row(job, rs, _row(100.0, loss_n=1, loss_sum=1.0, nonfinite=1), None, now_s=0.0)
    job.series = deque((EfficiencySample(float(i), 1.0, 1.0, 1.0) for i in range(1000)), maxlen=7200)
    shed_step_records(job, 100)
    assert not job.recent and not job.losses and not job.nonfinite_recent
    assert len(job.series) == 101 and job.series[-1].t_s == 999.0 and job.series.maxlen == 7200
    short = deque([EfficiencySample(0.0, 1.0, 1.0, 1.0)])
    assert thinned(short, 100) is short


def test_a_proposal_waits_three_of_the_ranks_agreement_periods_before_not_taken() -> None:
    """Ranks that agree every 100 steps (the default) may take up to two periods to apply
    a level: 'not taken' comes after three, not after 100 steps."""
    job, rs = _bf16_proposed(sync_every=100)
    start, t = job.steps, 102.0
    while job.steps - start < 296:
        book_row(job, rs, _row(t, precision="fp32"), None, now_s=0.0)
        t += 2.0
        assert book_proposals_not_taken(job, t_wall_s=t, max_entries=10) is None
    book_row(job, rs, _row(t, precision="fp32"), None, now_s=0.0)
    change = book_proposals_not_taken(job, t_wall_s=t, max_entries=10)
    assert change is not None and change.kind == "not taken" and "ran 300 steps" in change.reason


def test_probe_rows_are_billed_at_their_level_and_never_move_the_jobs_level() -> None:
    """A rank below the job's own level runs a few steps at the level above to judge it
    (greend.training.probe): its probe row counts in the job's steps and FLOPs, is
    executed at its own level, but moves neither the job's level nor its measure, and its
    losses are not the level's."""
    job, rs = _job(0, precision="fp32")
    job.top_precision = "fp32"
    book_row(job, rs, _row(100.0, precision="bf16", loss_n=4, loss_sum=4.0, losses=(1.0,) * 4), None, now_s=0.0)
    assert job.precision == "bf16" and job.measure.steps == 4 and list(job.losses) == [1.0] * 4
    probe = _row(102.0, precision="fp32", probe=True, loss_n=4, loss_sum=3.6, losses=(0.9,) * 4)
    book_row(job, rs, probe, ExecutedRow(duration_s=2.0, energy_j=40.0), now_s=0.0, t_wall_s=5.0)
    assert job.precision == "bf16" and rs.precision == "bf16" and not job.precision_log
    assert job.probe_steps == 4 and job.steps == 8 and job.modelled_energy_j == 40.0
    assert job.measure.steps == 4 and list(job.losses) == [1.0] * 4  # neither the level's evidence
    book_row(job, rs, _row(104.0, precision="bf16"), None, now_s=0.0)
    assert job.precision == "bf16" and job.measure.steps == 8
    # On the wire: "probe" is a row's flag, checked and decoded.
    (decoded,) = decode_rows([{**_wire_row(), "precision": "fp32", "probe": True}])
    assert decoded.probe and decoded.precision == "fp32"
    with pytest.raises(ProtocolError, match="probe"):
        decode_rows([{**_wire_row(), "probe": "yes"}])


def _wire_row() -> dict[str, Any]:
    return {"first_step": 0, "last_step": 3, "steps": 4, "t0_s": 1.0, "t1_s": 2.0, "busy_s": 1.0, "busy_sq_s2": 0.25,
            "flops": 4e9}  # fmt: skip
