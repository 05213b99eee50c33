"""Savings in a job's report: against its own measured baseline (uncapped, at the
precision it started at), with the slowdown it cost and how sure the figure is."""

from __future__ import annotations

from typing import Any

import pytest

from greend.cli.render import render_report, render_setting
from greend.jobs.booking import book_row
from greend.jobs.execution import ExecutedRow
from greend.jobs.ledger import Ledger
from greend.jobs.records import Job, PrecisionChange
from greend.jobs.registry import JobRegistry
from greend.points import job_point
from greend.protocol import StepEntry


def _registry(sim: bool, ledger: Ledger | None = None) -> JobRegistry:
    return JobRegistry(ledger or Ledger(), hostname="h", modelled_gpu=lambda i: sim)


def _step(reg: JobRegistry, job: Job, t0: float, dt: float, flops: float, precision: str, sim_e: float | None) -> None:
    rs = next(iter(job.ranks.values())) if job.ranks else None
    if rs is None:
        from greend.jobs.records import RankSession

        rs = RankSession(1, job.job, 0, 0, 1, [0], 1, 1, "h", ["fp32", "bf16"], 0.3, None, 0.0)
        job.ranks[1] = rs
        job.gpus.add(0)
    s = StepEntry(step=job.steps, t0_s=t0, t1_s=t0 + dt, flops=flops, precision=precision, loss=1.0)
    book_row(job, rs, s.as_row(), ExecutedRow(dt, sim_e) if sim_e is not None else None, 0.0)


def test_sim_job_saving_against_its_uncapped_fp32_steps() -> None:
    reg = _registry(sim=True)
    job = Job("j", 1, 0.0, 0.0)
    reg.jobs["j"] = job
    t = 0.0
    # 40 baseline steps: 1e12 FLOP, 0.1 s, 60 J each (with a little noise).
    for i in range(40):
        _step(reg, job, t, 0.1, 1e12, "fp32", 60.0 + (0.3 if i % 2 else -0.3))
        t += 0.1
    reg.record_cap_change("j", clock_cap_mhz=None, power_limit_w=None, reason="x")  # not a cap: still baseline
    assert job.capped is False
    job.cap_changes = 0
    reg.record_cap_change("j", clock_cap_mhz=1200, power_limit_w=None, reason="job j: settled at 1200 MHz")
    assert job.capped
    # 60 capped steps at bf16: 0.11 s and 20 J each.
    job.precision_log.append(PrecisionChange(0.0, "switch", "fp32", "bf16", "loss stable", 40, 1.0, None))
    for _ in range(60):
        _step(reg, job, t, 0.11, 1e12, "bf16", 20.0)
        t += 0.11
    r = reg.report(job)
    sv = r["savings"]
    assert sv["baseline"]["steps"] == 40 and sv["baseline"]["precision"] == "fp32"
    assert sv["expected_gpu_energy_j"] == pytest.approx(100 * 60.0)
    assert sv["gpu_energy_j"] == pytest.approx(40 * 60.0 + 60 * 20.0)
    assert sv["saved_j"] == pytest.approx(6000.0 - 3600.0)
    assert sv["saved_pct"] == pytest.approx(40.0)
    assert sv["slowdown_pct"] == pytest.approx(100 * ((4.0 + 6.6) / 10.0 - 1))
    conf = sv["confidence"]
    assert conf["level"] == "high" and 0 < conf["rel_stderr"] < 0.01
    lo, hi = conf["saved_j_95"]
    assert lo < sv["saved_j"] < hi
    # The flat copies go to the store's job summary.
    p = job_point(0, "h", job="j", precision="bf16", end_reason="", summary=r)
    assert p.fields["saved_gpu_energy_j"] == pytest.approx(2400.0)
    assert p.fields["saved_pct"] == pytest.approx(40.0)
    text = render_report(r)
    assert "saved (sim)" in text and "2400.0 J of GPU energy = 40.0 %" in text
    assert "40 steps uncapped at fp32" in text and "how sure     high" in text
    assert "clock cap 1200 MHz" in text and "{'clock_cap_mhz'" not in text


def test_no_baseline_is_said_not_guessed() -> None:
    reg = _registry(sim=True)
    job = Job("j", 1, 0.0, 0.0)
    reg.jobs["j"] = job
    job.capped = True  # capped from its first step (e.g. a static policy)
    for i in range(10):
        _step(reg, job, i * 0.1, 0.1, 1e12, "fp32", 50.0)
    sv = reg.report(job)["savings"]
    assert sv["saved_j"] is None and "no baseline" in sv["note"]
    assert sv["confidence"]["level"] == "none"
    assert "no baseline" in render_report(reg.report(job))


def test_real_gpu_baseline_comes_from_the_ledger_over_its_steps() -> None:
    ledger = Ledger()
    # gpu0 draws 300 W for the first 10 s, then 200 W.
    e = 0.0
    for k in range(0, 201):
        t = k * 0.1
        ledger.record("gpu0", t, e)
        e += (300.0 if t < 10.0 else 200.0) * 0.1
    reg = _registry(sim=False, ledger=ledger)
    job = Job("j", 1, 0.0, 0.0)
    reg.jobs["j"] = job
    t = 0.0
    for _ in range(100):
        _step(reg, job, t, 0.1, 1e12, "fp32", None)
        t += 0.1
    reg.record_cap_change("j", clock_cap_mhz=None, power_limit_w=250.0, reason="limit")
    for _ in range(90):
        _step(reg, job, t, 0.1, 1e12, "fp32", None)
        t += 0.1
    job.t_end_s = t
    r: dict[str, Any] = reg.report(job)
    sv = r["savings"]
    assert sv["baseline"]["steps"] == 100
    # 30 J per 1e12 FLOP at the baseline; 190 steps expected 5700 J; spent 3000 + 1800.
    assert sv["expected_gpu_energy_j"] == pytest.approx(5700.0, rel=0.02)
    assert sv["saved_j"] == pytest.approx(5700.0 - r["gpu_energy_j"], rel=1e-9)
    assert sv["saved_j"] > 800
    assert "ledger" in sv["method"]


def test_render_setting_in_words() -> None:
    assert render_setting({"clock_cap_mhz": 1395, "power_limit_w": None}) == "clock cap 1395 MHz"
    assert render_setting({"clock_cap_mhz": None, "power_limit_w": 450.0}) == "power limit 450 W"
    assert render_setting({"clock_cap_mhz": None, "power_limit_w": None}) == "uncapped"


def test_a_saving_is_a_share_of_the_jobs_whole_gpu_energy() -> None:
    """Simulated steps that are ~1 % of the GPU's energy over the job (the rest: the GPU
    idle between CPU-paced steps) save at most ~1 % of it, not the steps' own 40 %."""
    ledger = Ledger()
    reg = _registry(sim=True, ledger=ledger)
    job = Job("j", 1, 0.0, 0.0)
    reg.jobs["j"] = job
    t = 0.0
    for _ in range(40):
        _step(reg, job, t, 0.1, 1e12, "fp32", 60.0)
        t += 0.1
    reg.record_cap_change("j", clock_cap_mhz=1200, power_limit_w=None, reason="settled")
    for _ in range(60):
        _step(reg, job, t, 0.11, 1e12, "bf16", 20.0)
        t += 0.11
    steps_j = 40 * 60.0 + 60 * 20.0
    ledger.record("gpu0", 0.0, 0.0)
    ledger.record("gpu0", t, 100 * steps_j)  # the job's GPU energy: 100x its steps' own
    r = reg.report(job)
    sv = r["savings"]
    assert sv["saved_j"] == pytest.approx(2400.0)  # the steps' saving, as before
    assert sv["gpu_energy_j"] == pytest.approx(100 * steps_j)
    assert sv["expected_gpu_energy_j"] == pytest.approx(100 * steps_j + 2400.0)
    assert sv["saved_pct"] == pytest.approx(100 * 2400.0 / (100 * steps_j + 2400.0))
    assert sv["saved_pct"] < 1.0  # the steps were 1-2 % of the energy: no more can be saved
    assert sv["confidence"]["saved_j_95"] is None and sv["confidence"]["level"] == "sim"  # no zero-width interval
    assert r["sim"] is True and reg.list_jobs()[0]["sim"] is True  # jobs and top label it (sim)


def _paced_job(pace_s: float | None) -> tuple[JobRegistry, Job]:
    """Node A of a 2-node job whose node B is 1.3x slower (pace 0.13 s/step, sim): 40
    uncapped steps of 0.1 s and 60 J, then 60 steps capped to 0.128 s and 40 J; every
    step waits for the pace (the steps start 0.13 s apart) and the GPU draws 50 W
    outside its steps."""
    ledger = Ledger()
    reg = _registry(sim=True, ledger=ledger)
    job = Job("j", 1, 0.0, 0.0)
    reg.jobs["j"] = job
    job.pace_s = pace_s
    t, e = 0.0, 0.0
    ledger.record("gpu0", 0.0, 0.0)
    for i in range(100):
        if i == 40:
            reg.record_cap_change("j", clock_cap_mhz=1200, power_limit_w=None, reason="paced")
        dt, joules = (0.1, 60.0) if i < 40 else (0.128, 40.0)
        _step(reg, job, t, dt, 1e12, "fp32", joules)
        t += 0.13
        e += joules + 50.0 * (0.13 - dt)
        ledger.record("gpu0", t, e)
    job.ranks_seen.add(0)
    job.t_end_s = t
    return reg, job


def test_a_paced_job_is_judged_against_the_jobs_pace_not_its_own_uncapped_step() -> None:
    """The slow node sets the job's pace: node A capped to it did not slow the job, and
    under `none` its GPU would have computed uncapped and waited for node B."""
    reg, job = _paced_job(0.13)
    r = reg.report(job)
    sv = r["savings"]
    ref = sv["reference"]
    assert ref["kind"] == "job_pace" and "a slower node sets it" in ref["label"]
    assert ref["node_uncapped_step_s"] == pytest.approx(0.1)
    assert ref["time_s"] == pytest.approx(100 * 0.13)
    # Its steps (11.68 s of compute) fit within the pace: the job lost nothing here.
    assert sv["slowdown_pct"] == pytest.approx(0.0, abs=1e-9)
    # Under none: 100 uncapped steps (6000 J) and 3 s of waiting at 50 W; paced: 4800 J
    # of steps and 1.32 s of waiting. The wait it no longer makes is saved too.
    assert ref["wait_j"] == pytest.approx(50.0 * (3.0 - 1.32))
    assert sv["saved_j"] == pytest.approx(1200.0 + 84.0)
    assert sv["gpu_energy_j"] == pytest.approx(4800.0 + 66.0)
    assert sv["saved_pct"] == pytest.approx(100 * 1284.0 / (4866.0 + 1284.0))
    # Its GPU's time against the pace: under it (it kept the pace with slack to spare).
    (g,) = r["per_gpu"]
    assert g["sim_time_s"] == pytest.approx(11.68) and g["slowdown_pct"] == pytest.approx(100 * (11.68 / 13 - 1))
    text = render_report(r)
    assert "slowdown +0.0 % against the job's pace (a slower node sets it)" in text
    assert "pace         the job's 0.13 s/step" in text and "this node uncapped 0.1 s/step" in text


def test_without_a_pace_the_same_job_reads_as_slowed_against_its_own_step() -> None:
    reg, job = _paced_job(None)
    sv = reg.report(job)["savings"]
    assert sv["reference"]["kind"] == "node_uncapped" and sv["reference"]["label"] == "this node's uncapped step"
    assert sv["slowdown_pct"] == pytest.approx(100 * (11.68 / 10.0 - 1))  # what a report said before: +16.8 %
    assert sv["saved_j"] == pytest.approx(1200.0) and sv["reference"]["wait_j"] is None
    assert "against this node's uncapped step" in render_report(reg.report(job))


def test_a_pace_this_node_sets_is_its_own_uncapped_step() -> None:
    reg, job = _paced_job(0.1005)  # within 1 %: this node's own step, pushed to the ranks
    sv = reg.report(job)["savings"]
    assert sv["reference"]["kind"] == "node_uncapped" and "this node sets it" in sv["reference"]["label"]
    assert sv["slowdown_pct"] == pytest.approx(16.8)


def test_within_a_node_a_gpu_paced_to_a_slower_one_is_not_a_slowdown() -> None:
    """Two ranks on one node: GPU 1 is 1.3x slower; GPU 0 is capped to its pace. The
    node's time is its slowest GPU's: the job did not slow, and GPU 0's time is judged
    against that pace."""
    from greend.jobs.records import RankSession

    reg = _registry(sim=True)
    job = Job("j", 1, 0.0, 0.0)
    reg.jobs["j"] = job
    for r in (0, 1):
        job.ranks[r + 1] = RankSession(r + 1, "j", r, r, 2, [r], 1, 1, "h", ["fp32"], 0.3, None, 0.0)
        job.gpus.add(r)
        job.ranks_seen.add(r)
    t = 0.0
    for i in range(100):
        if i == 40:
            reg.record_cap_change("j", clock_cap_mhz=1200, power_limit_w=None, reason="paced")
        for r in (0, 1):
            dt, joules = (0.13, 60.0) if r == 1 else ((0.1, 60.0) if i < 40 else (0.128, 40.0))
            s = StepEntry(step=i, t0_s=t, t1_s=t + dt, flops=1e12, precision="fp32", loss=1.0)
            book_row(job, job.ranks[r + 1], s.as_row(), ExecutedRow(dt, joules), 0.0)
        t += 0.13
    rep = reg.report(job)
    sv = rep["savings"]
    assert sv["reference"]["label"] == "this node's uncapped step (its slowest GPU's)"
    assert sv["reference"]["time_s"] == pytest.approx(13.0) and sv["slowdown_pct"] == pytest.approx(0.0, abs=1e-9)
    assert sv["saved_j"] == pytest.approx(60 * 20.0)
    by_gpu = {g["gpu"]: g for g in rep["per_gpu"]}
    assert by_gpu[1]["slowdown_pct"] == pytest.approx(0.0, abs=1e-9)
    assert by_gpu[0]["slowdown_pct"] == pytest.approx(100 * (11.68 / 13.0 - 1))
