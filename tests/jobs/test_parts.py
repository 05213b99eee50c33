"""One run across daemon restarts: its parts joined (greend.jobs.parts)."""

from __future__ import annotations

from typing import Any

import pytest

from greend.jobs.parts import join_reports, join_rows, runs_of
from greend.jobs.records import INTERRUPTED


def part(**over: Any) -> dict[str, Any]:
    """A report as the daemon gives it, cut to what the join reads."""
    base: dict[str, Any] = {
        "job": "train", "run_id": "r1", "state": "ended", "end_reason": INTERRUPTED, "started_at": 100.0,
        "first_step_at": 100.5, "steps": 100, "step_reports": 100, "flops": 1e15, "samples": 6400, "tokens": 0,
        "duration_s": 50.0, "gpu_energy_j": 10_000.0, "cpu_energy_j": 1_000.0, "energy_j": 11_000.0,
        "energy_kwh": 11_000.0 / 3.6e6, "co2_g": 1.0, "avg_power_w": 220.0, "avg_gpu_power_w": 200.0,
        "flop_per_s": 2e13, "gflops_per_w": 100.0, "gflops_per_w_with_cpu": 1e15 / 11_000.0 / 1e9,
        "gpu_energy_per_step_j": 100.0, "samples_per_j": 6400 / 11_000.0, "tokens_per_j": 0.0,
        "step_time_s": 45.0, "nonfinite_steps": 0, "probe_steps": 0, "cap_changes": 1,
        "per_gpu": [{"gpu": 0, "flops": 1e15, "energy_j": 10_000.0, "gflops_per_w": 100.0}],
        "gpus": [0], "ranks": 0, "ranks_gone": [{"rank": 0, "pid": 7, "reason": INTERRUPTED, "steps": 100}],
        "decisions": [{"t": 101.0, "setting": {"clock_cap_mhz": 1500}, "reason": "first"}],
        "precision_log": [], "series": [{"t": 101.0}], "precision": "fp32",
        "savings": {
            "saved_j": 1_000.0, "saved_pct": 1_000.0 / 11_000.0 * 100, "slowdown_pct": 2.0,
            "reference": {"time_s": 50.0 / 1.02, "actual_time_s": 50.0},
            "confidence": {"level": "high", "rel_stderr": 0.01, "saved_j_95": [900.0, 1100.0]},
            "controlled": True, "note": None,
        },
        "saved_gpu_energy_j": 1_000.0, "saved_pct": 1_000.0 / 11_000.0 * 100, "slowdown_pct": 2.0,
    }  # fmt: skip
    base.update(over)
    return base


def test_the_parts_of_a_run_sum_and_their_rates_are_computed_again() -> None:
    first = part()
    second = part(
        state="running", end_reason=None, started_at=160.0, first_step_at=155.0, steps=300, step_reports=300,
        flops=2e15, samples=19200, duration_s=100.0, gpu_energy_j=30_000.0, cpu_energy_j=2_000.0, energy_j=32_000.0,
        ranks=1, ranks_gone=[], decisions=[{"t": 170.0, "setting": {"clock_cap_mhz": 1400}, "reason": "again"}],
        series=[{"t": 170.0}], precision="bf16",
        per_gpu=[{"gpu": 0, "flops": 2e15, "energy_j": 30_000.0, "gflops_per_w": 2e15 / 30_000 / 1e9}],
        savings={**part()["savings"], "saved_j": 5_000.0, "reference": {"time_s": 100.0, "actual_time_s": 100.0},
                 "confidence": {"level": "medium", "rel_stderr": 0.03, "saved_j_95": [4_000.0, 6_000.0]}},
        saved_gpu_energy_j=5_000.0,
    )  # fmt: skip
    whole = join_reports([first, second])
    # What adds up is summed; what the run is now is the latest part's.
    assert (whole["steps"], whole["flops"], whole["samples"]) == (400, 3e15, 25_600)
    assert isinstance(whole["samples"], int)
    assert whole["duration_s"] == 150.0 and whole["gpu_energy_j"] == 40_000.0 and whole["energy_j"] == 43_000.0
    assert (whole["state"], whole["precision"], whole["ranks"]) == ("running", "bf16", 1)
    assert (whole["started_at"], whole["first_step_at"]) == (100.0, 100.5)
    # Rates from the sums, never a mean of the parts' quotients (100 and 66.7 GFLOPS/W).
    assert whole["gflops_per_w"] == pytest.approx(3e15 / 40_000.0 / 1e9)
    assert whole["avg_gpu_power_w"] == pytest.approx(40_000.0 / 150.0)
    assert whole["gpu_energy_per_step_j"] == pytest.approx(100.0)
    assert whole["per_gpu"][0]["energy_j"] == 40_000.0 and whole["per_gpu"][0]["flops"] == 3e15
    # The saving: each part's against its own baseline, summed, its share of the whole.
    assert whole["saved_gpu_energy_j"] == 6_000.0 and whole["savings"]["saved_j"] == 6_000.0
    assert whole["saved_pct"] == pytest.approx(100.0 * 6_000.0 / 46_000.0)
    assert whole["savings"]["slowdown_pct"] == pytest.approx(100.0 * (150.0 / (50.0 / 1.02 + 100.0) - 1.0))
    assert whole["savings"]["confidence"]["level"] == "medium"  # the least sure part's
    assert whole["savings"]["confidence"]["saved_j_95"] == [4_900.0, 7_100.0]
    # The logs run on; the rank the daemon's stop "ended" went on into the next part.
    assert [d["reason"] for d in whole["decisions"]] == ["first", "again"]
    assert len(whole["series"]) == 2 and whole["ranks_gone"] == []
    assert [p["steps"] for p in whole["parts"]] == [100, 300]
    assert whole["parts"][0]["end_reason"] == INTERRUPTED


def test_a_figure_one_part_did_not_measure_is_unknown_for_the_run() -> None:
    """No sum of the parts that knew it: that would read as the whole run's."""
    first = part(
        saved_gpu_energy_j=None, saved_pct=None, savings={**part()["savings"], "saved_j": None}, gflops_per_w=None
    )
    whole = join_reports([first, part(started_at=200.0)])
    assert whole["saved_gpu_energy_j"] is None and whole["saved_pct"] is None
    assert "1 of its 2 parts" in whole["savings"]["note"]
    assert whole["gflops_per_w"] is None  # (FLOPs unknown in a part)
    unknown = join_rows([part(gpu_energy_j=None), part(started_at=200.0)])
    assert unknown["gpu_energy_j"] is None and unknown["steps"] == 200


def test_rows_join_and_a_single_part_is_unchanged() -> None:
    one = part()
    assert join_reports([one]) == {**one, "unseen_steps": 0} and join_rows([one]) == one
    # greenctl jobs' rows carry the saving as a share only: the joules come back from it.
    rows = [
        {"job": "train", "run_id": "r1", "steps": 10, "gpu_energy_j": 900.0, "saved_pct": 10.0, "duration_s": 5.0,
         "flops": 1e12, "gflops_per_w": 1.1, "slowdown_pct": 5.0},
        {"job": "train", "run_id": "r1", "steps": 30, "gpu_energy_j": 2_000.0, "saved_pct": 20.0, "duration_s": 10.0,
         "flops": 3e12, "gflops_per_w": 1.5, "slowdown_pct": 0.0},
    ]  # fmt: skip
    row = join_rows(rows)
    assert row["steps"] == 40 and row["gpu_energy_j"] == 2_900.0
    assert row["saved_pct"] == pytest.approx(100.0 * 600.0 / 3_500.0)  # 100 J + 500 J saved
    assert row["slowdown_pct"] == pytest.approx(100.0 * (15.0 / (5.0 / 1.05 + 10.0) - 1.0))
    assert row["gflops_per_w"] == pytest.approx(4e12 / 2_900.0 / 1e9)


def test_runs_are_grouped_by_run_id_in_the_order_of_their_latest_part() -> None:
    """A record after the daemon's stop is a part of its run; a record the daemon continued
    after its ranks' heartbeats or connections were lost (the same start) replaces its
    earlier copy, which it holds; after the run's own end, a record with its id is
    another run (GREEND_RUN set to the same value again)."""
    recs = [
        {"run_id": "a", "n": 1, "end_reason": INTERRUPTED, "started_at": 1.0},
        {"run_id": "b", "n": 2, "end_reason": "finished"},
        {"run_id": None, "n": 3, "end_reason": INTERRUPTED},
        {"run_id": "a", "n": 4, "end_reason": "client disconnected", "started_at": 4.0},
        {"run_id": "a", "n": 5, "end_reason": "finished", "started_at": 4.0},  # n=4 continued
        {"run_id": "b", "n": 6, "end_reason": "finished"},
        {"run_id": None, "n": 7, "end_reason": None},
        {"run_id": "c", "n": 8, "end_reason": "no heartbeat for 30 s", "started_at": 8.0},
        {"run_id": "c", "n": 9, "end_reason": None, "started_at": 9.0},  # (8 no longer held: a new record)
        {"run_id": "d", "n": 10, "end_reason": "no heartbeat for 30 s"},
        {"run_id": "d", "n": 11, "end_reason": "finished"},  # (no start known: continued)
        {"run_id": "e", "n": 12, "end_reason": INTERRUPTED, "started_at": 12.0},
        {"run_id": "e", "n": 13, "end_reason": "finished", "started_at": 13.0, "sent_before": 0},  # a rerun
        {"run_id": "f", "n": 14, "end_reason": INTERRUPTED, "started_at": 14.0},
        {"run_id": "f", "n": 15, "end_reason": "finished", "started_at": 15.0, "sent_before": 99},
        # A run's first record continued in place after a lost connection: both copies
        # say 0 sent before (its first registration's), and it is one record still.
        {"run_id": "g", "n": 16, "end_reason": "client disconnected", "started_at": 16.0, "sent_before": 0},
        {"run_id": "g", "n": 17, "end_reason": "finished", "started_at": 16.0, "sent_before": 0},
        # A record after a lost connection, from new processes (0 sent): another run.
        {"run_id": "h", "n": 18, "end_reason": "client disconnected", "started_at": 18.0, "sent_before": 0},
        {"run_id": "h", "n": 19, "end_reason": "finished", "started_at": 19.0, "sent_before": 0},
    ]
    grouped = [[r["n"] for r in run] for run in runs_of(recs)]
    assert grouped == [[2], [3], [1, 5], [6], [7], [8, 9], [11], [12], [13], [14, 15], [17], [18], [19]]


def test_a_part_with_no_steps_vetoes_none_of_the_run_s_rates() -> None:
    """Ranks registered again and the daemon stopped before their first row: that part has
    no rates of its own, and the run's, from the sums, stay known."""
    empty = part(started_at=200.0, steps=0, step_reports=0, flops=0.0, samples=0, duration_s=0.0,
                 gpu_energy_j=0.0, cpu_energy_j=0.0, energy_j=0.0, gflops_per_w=None, avg_power_w=None,
                 flop_per_s=None, gpu_energy_per_step_j=None, samples_per_j=None, per_gpu=[])  # fmt: skip
    whole = join_reports([part(), empty])
    assert whole["gflops_per_w"] == pytest.approx(100.0) and whole["avg_power_w"] == pytest.approx(220.0)


def test_steps_sent_to_a_daemon_that_kept_none_of_them_are_said_unseen() -> None:
    """A daemon killed (or crashed) under a run keeps no record of its part: the ranks'
    next registration says how many steps they had sent, and what no part holds is named."""
    after_kill = part(started_at=200.0, end_reason="finished", steps=300, sent_before=120)
    assert join_reports([after_kill])["unseen_steps"] == 120  # the first part: lost whole
    after_stop = part(started_at=200.0, end_reason="finished", steps=300, sent_before=105)
    assert join_reports([part(), after_stop])["unseen_steps"] == 5  # 100 kept of 105 sent
    assert join_reports([part(), {**after_stop, "sent_before": 100}])["unseen_steps"] == 0
    assert join_reports([part()])["unseen_steps"] == 0  # (a first record: nothing before)


def test_the_latest_run_across_nodes_is_not_decided_by_a_fast_clock() -> None:
    """Node B's clock runs 10 minutes fast: its row of run 1 looked newer than run 2's
    rows on A and C, and the requeued run was never shown. Node A ran both runs, and
    its own clock orders them. --run picks one."""
    from greend.errors import StoreError
    from greend.jobs.history import _whole

    def row(host: str, run: str, ts_s: float, steps: int) -> dict[str, Any]:
        return {"store": f"{host}.db", "host": host, "run": run, "ts_ns": int(ts_s * 1e9), "steps": steps,
                "duration_s": 10.0, "flops": 1e12, "gpu_energy_j": 100.0, "energy_j": 100.0, "world_size": 2,
                "ranks_here": 1, "end_reason": "finished"}  # fmt: skip

    rows = [
        row("A", "run1", 1000.0, 50),
        row("B", "run1", 1600.0, 50),  # (its clock: +600 s)
        row("A", "run2", 1200.0, 80),
        row("C", "run2", 1201.0, 80),
    ]
    whole = _whole("700.0", rows)
    assert whole["run_id"] == "run2" and sorted(n["host"] for n in whole["nodes"]) == ["A", "C"]
    assert whole["steps"] == 80 and whole["other_runs"] == 1
    assert _whole("700.0", rows, run="run1")["steps"] == 50
    with pytest.raises(StoreError, match="no run 'run9'"):
        _whole("700.0", rows, run="run9")


def test_the_seconds_between_a_runs_parts_are_said_unmeasured() -> None:
    """A daemon restarted under a run: the seconds between the part it stopped and the one
    it began after (no daemon measuring) are in none of the figures, and the report says
    so rather than "the figures are the whole run's" alone (a red-team's restart: 5.6 s
    missing, the node's GFLOPS/W 23 % over the other node's)."""
    from greend.cli.render import _parts_lines

    first = part(ended_at=150.0)
    second = part(started_at=155.6, state="ended", end_reason="finished")
    whole = join_reports([first, second])
    assert whole["unmeasured_s"] == pytest.approx(5.6)
    (line,) = [x for x in _parts_lines(whole) if "parts" in x]
    assert "but for 5.6 s between its parts, when no daemon measured it" in line, line
    row = {k: v for k, v in first.items() if k != "ended_at"}  # (a stored row: its time, no ended_at)
    rows = join_rows([{**row, "ts_ns": 150_000_000_000}, {**second, "ts_ns": 170_000_000_000}])
    assert rows["unmeasured_s"] == pytest.approx(5.6)  # (stored rows: a part's end is its row's time)
    back_to_back = join_reports([first, part(started_at=150.0, end_reason="finished")])
    assert back_to_back["unmeasured_s"] == 0.0 and "but for" not in " ".join(_parts_lines(back_to_back))
