"""The second look of ``efficient``: a power limit between two grid levels where the
slowdown bound falls between them (policies/_finer.py), on the simulator and on a
measured A40 profile."""

from __future__ import annotations

import math
from pathlib import Path

from greend.policies import get_policy
from greend.policies._evidence import Evidence
from greend.policies._finer import GAIN_MIN, Bracket, Lines, finer_limit
from greend.policies.base import UNCAPPED, Setting
from greend.policies.efficient_state import JobSearch
from greend.probes.sim import H100
from greend.probes.trace import TRACE_DIR, trace_spec
from greend.testing.harness import make_sim_gpus, run_policy
from tests.support import load_bench

# A40 ResNet-50 (measured): 225 W runs 1.0223x the uncapped step, 200 W 1.0489x, and
# 225 W costs 9.6 % more energy per step than 200 W.
A40_225_200 = Bracket(hi_w=225, lo_w=200, hi_ratio=1.0223, lo_ratio=1.0489, hi_energy=1.096, lo_energy=1.0)


def _replay(spec, bound: float, seed: int):  # type: ignore[no-untyped-def]
    """``efficient`` (power knob) on one simulated GPU following ``spec``'s profile,
    1,000 steps at 2 % step noise."""
    gpus, _ = make_sim_gpus(1, spec=spec)
    pol = get_policy("efficient", knob="power", min_steps=8, max_slowdown=bound)
    return run_policy(pol, gpus, 1e12, 0.0, steps=1000, settle_steps=1, noise=0.02, seed=seed)


def test_the_finer_limit_is_the_lowest_one_the_line_puts_under_the_bound_by_the_margin() -> None:
    w = finer_limit(A40_225_200, allowed=1.05, se_new=0.002, z=2.6)
    assert w is not None and w == int(w) and 200 < w < 225

    def ratio(v: float) -> float:  # the line through the two measured levels
        return 1.0223 + (225 - v) / 25 * (1.0489 - 1.0223)

    assert ratio(w) + 2.6 * 0.002 <= 1.05 < ratio(w - 1) + 2.6 * 0.002


def test_no_finer_limit_where_the_margin_leaves_no_room_or_nothing_to_win() -> None:
    assert finer_limit(A40_225_200, allowed=1.05, se_new=0.02, z=2.6) is None  # too noisy to confirm any
    flat = Bracket(225, 200, 1.0223, 1.0489, 1.0 + GAIN_MIN / 2, 1.0)  # the level below saves too little
    assert finer_limit(flat, allowed=1.05, se_new=0.001, z=2.6) is None
    faster = Bracket(225, 200, 1.03, 1.02, 1.096, 1.0)  # the level below is not slower: no line
    assert finer_limit(faster, allowed=1.05, se_new=0.001, z=2.6) is None
    close = Bracket(202, 200, 1.04, 1.06, 1.096, 1.0)  # no whole watt a watt away from both
    assert finer_limit(close, allowed=1.05, se_new=0.0, z=2.6) is None


def test_a_limit_between_grid_levels_beats_the_grid_within_the_bound_on_the_simulator() -> None:
    """Memory-bound work on the simulated H100, power knob, no noise: the grid's best
    within a 5 % bound is 400 W; the policy ends below it, off the 25 W grid, still
    within the bound, with less energy per step than 400 W."""
    gpus, _ = make_sim_gpus(1)
    pol = get_policy("efficient", knob="power", min_steps=8, max_slowdown=0.05)
    r = run_policy(pol, gpus, 1e12, 0.8, steps=600, settle_steps=1)
    w = r.final_setting.power_limit_w
    assert w is not None and w % 25 != 0
    base = H100.step_cost(1e12, 0.8)
    got, grid = H100.step_cost(1e12, 0.8, power_limit_w=w), H100.step_cost(1e12, 0.8, power_limit_w=400)
    assert grid.duration_s <= 1.05 * base.duration_s  # 400 W is within the bound...
    assert H100.step_cost(1e12, 0.8, power_limit_w=375).duration_s > 1.05 * base.duration_s  # ...375 W is not
    assert got.duration_s <= 1.05 * base.duration_s
    assert got.energy_j < grid.energy_j
    assert any(d.details["jobs"]["job0"]["measured_steps"].get(f"{w:g} W") for _, d in r.decisions)


def test_the_second_look_closes_most_of_the_gap_on_a_measured_profile_under_noise() -> None:
    """A40 ResNet-50, 5 % bound, 2 % step noise: the optimum among the measured limits
    is 200 W (0.11 % under the bound), which no run this short can tell from "over";
    the grid's next level, 225 W, costs 9.6 % more. The policy ends between them,
    within the bound, on every seed."""
    spec = trace_spec(TRACE_DIR / "zeus-gplo-a40" / "A40+resnet50+gpu0.csv")
    prof = spec.profile
    for seed in (2, 3):  # seeds where the first settle is at 225 W
        r = _replay(spec, 0.05, seed)
        w = r.final_setting.power_limit_w
        assert w is not None and 200 <= w < 225
        assert prof.time_ratio(w) <= 1.05
        assert prof.energy_ratio(w) / prof.energy_ratio(200) - 1 < 0.05  # 225 W: +9.6 %
        settled = r.settled_steps()
        assert all(prof.time_ratio(s.setting.power_limit_w or prof.max_w) <= 1.05 for s in settled)


def test_a_limit_in_a_dip_of_a_zigzag_profile_is_found_below_limits_over_the_bound() -> None:
    """A40 ResNet-18 on 4 GPUs (measured): at 100-250 W the step runs 1.09-1.15x,
    zig-zagging; under a 10 % bound the best measured limit is 125 W (1.092x), below 150
    and 200 W (1.147x, 1.119x: over). With the power knob a setting rules the ones below
    it out only when two neighbours are over by their own steps, so the search goes on
    down past a lone one. (Before, seeds 2 and 4 stopped above 200 W and held 300 W:
    7.8 % more energy.) In seeds 6 and 14 the second look's 128 steps at 125 W read it
    within the bound but not by 2.6 standard errors (1.0965x against 1.0961x needed), and
    it held 175 W (1.094x, 6 % more energy): a level read within the bound is measured as
    long again and judged again, once."""
    spec = trace_spec(TRACE_DIR / "zeus-gplo-a40" / "A40+resnet18+gpu0,1,2,3.csv")
    prof = spec.profile
    for seed in (2, 4, 6, 14):
        r = _replay(spec, 0.10, seed)
        w = r.final_setting.power_limit_w
        assert w is not None and w <= 125
        assert prof.time_ratio(w) <= 1.10
        assert all(prof.time_ratio(s.setting.power_limit_w or prof.max_w) <= 1.10 for s in r.settled_steps())


def test_a_phase_change_during_a_second_look_is_caught_by_the_re_check_after_it() -> None:
    """The simulated H100, power knob, 2 % noise: the job turns compute-bound (memory share
    0.4 -> 0) at step 300, while a second look runs. The look's own measures span the
    change; the baseline is checked again once the look ends, so the job does not stay
    settled over the bound. (Before: it held 475 W at +13.8 %, 1159 settled steps over.)"""
    gpus, _ = make_sim_gpus(1)
    pol = get_policy("efficient", knob="power", min_steps=8, max_slowdown=0.05)
    r = run_policy(pol, gpus, 1e12, 0.4, steps=1500, settle_steps=1, noise=0.02, seed=2,
                   phase_change_at=300, phase_mem_share=0.0)  # fmt: skip

    def ratio(mem: float, w: float | None) -> float:
        return H100.step_cost(1e12, mem, power_limit_w=w).duration_s / H100.step_cost(1e12, mem).duration_s

    over = [s for s in r.settled_steps() if s.iteration >= 300 and ratio(s.mem_share, s.setting.power_limit_w) > 1.05]
    assert len(over) < 50, len(over)  # (a re-check's worth at most)
    assert ratio(0.0, r.final_setting.power_limit_w) <= 1.05


def test_the_setting_held_when_a_second_look_begins_keeps_its_margin_at_the_bound() -> None:
    """A40 ResNet-50, 5 % bound, 2 % noise, seed 4: it settles on 200 W (+4.89 %, the best
    measured limit) and then looks below it; 200 W stays held through the look (before,
    the look judged it like any other setting and moved to 205 W, +1.9 % energy)."""
    spec = trace_spec(TRACE_DIR / "zeus-gplo-a40" / "A40+resnet50+gpu0.csv")
    r = _replay(spec, 0.05, 4)
    assert r.final_setting.power_limit_w == 200
    assert any("measuring uncapped" in d.reason for _, d in r.decisions)  # a look ran


def test_the_line_through_two_levels_carries_their_errors_and_the_baselines() -> None:
    """The line's value at a limit between the two, and its standard error: each level's
    own error weighted by its distance, and the baseline's (every ratio divides by it)
    on the whole value; where the upper level is the baseline itself it has no error of
    its own and lends none of the baseline's."""
    b = Bracket(225, 200, 1.0223, 1.0489, 1.096, 1.0, hi_se=0.003, lo_se=0.002, base_se=0.001)
    ratio, se = b.chord(205)
    assert abs(ratio - (1.0223 + 0.8 * (1.0489 - 1.0223))) < 1e-12
    assert abs(se - ((0.8 * 0.002) ** 2 + (0.2 * 0.003) ** 2 + (ratio * 0.001) ** 2) ** 0.5) < 1e-12
    top = Bracket(300, 275, 1.0, 1.02, 1.0, 0.97, hi_se=0.0, lo_se=0.002, base_se=0.001, hi_is_base=True)
    ratio, se = top.chord(280)
    t = (300 - 280) / 25
    assert abs(ratio - (1.0 + t * 0.02)) < 1e-12
    assert abs(se - ((t * 0.002) ** 2 + (t * 1.02 * 0.001) ** 2) ** 0.5) < 1e-12
    assert b.vouches(210, 1.05, 2.6) and not b.vouches(201, 1.05, 2.6)
    assert not b.vouches(200, 1.1, 2.6) and not b.vouches(225, 1.1, 2.6)  # only strictly between the two


def test_a_line_more_precise_than_one_try_lets_the_try_go_lower() -> None:
    """The first try is the lowest limit either its own measurement could confirm or the
    line through the two levels already vouches for: a line measured long reaches lower."""
    own_only = finer_limit(A40_225_200, allowed=1.05, se_new=0.003, z=2.6)
    line = Bracket(225, 200, 1.0223, 1.0489, 1.096, 1.0, hi_se=0.001, lo_se=0.0008, base_se=0.0008)
    with_line = finer_limit(A40_225_200, allowed=1.05, se_new=0.003, z=2.6, line=line)
    assert own_only is not None and with_line is not None and with_line < own_only
    assert line.vouches(with_line, 1.05, 2.6) and not line.vouches(with_line - 1, 1.05, 2.6)


def _profile(tmp_path, name: str, rows: list[tuple[int, float, float]]):  # type: ignore[no-untyped-def]
    """A Zeus-format profile: (limit W, step time ratio, energy ratio) per row, top first."""
    lines = ["start_time,window_name,elapsed_time,gpu0_energy"]
    for k, (w, t, e) in enumerate(rows):
        lines.append(f"{k * 30.0},__GlobalPowerLimitOptimizer_{w},{24.0 * t},{6000.0 * e}")
    path = tmp_path / f"{name}+gpu0.csv"
    path.write_text("\n".join(lines) + "\n")
    return trace_spec(path)


def test_a_second_look_between_a_prize_and_a_level_that_saves_little(tmp_path: Path) -> None:
    """A V100-like profile (the shape of Zeus's ShuffleNet-v2 batch 512 on a V100): 225 W
    runs 3.6 % slower and saves 0.4 %, so the best within a 5 % bound is "uncapped";
    200 W (+4.91 %, 0.09 % under the bound) saves 9.3 %, which no short run can confirm.
    The second look goes between 200 and 225 W though 225 W is not the setting held
    (before, only just below the held setting: it stayed uncapped, 10.3 % over the
    optimum, on 2 seeds of 3 of the real profile)."""
    spec = _profile(tmp_path, "V100+shufflenet-like", [
        (250, 1.0, 1.0), (225, 1.036, 1.0038), (200, 1.0491, 0.9066), (175, 1.0677, 0.8106),
        (150, 1.1121, 0.7433), (125, 1.1549, 0.6786), (100, 1.3999, 0.6884),
    ])  # fmt: skip
    prof = spec.profile
    for seed in (2, 3):
        r = _replay(spec, 0.05, seed)
        w = r.final_setting.power_limit_w
        assert w is not None and 200 < w < 225, w
        assert prof.energy_ratio(w) < 0.975  # uncapped: 1.0, 225 W: 1.0038; 206 W and 217 W here
        assert all(prof.time_ratio(s.setting.power_limit_w or prof.max_w) <= 1.05 for s in r.settled_steps())


def test_a_look_that_found_nothing_to_try_is_not_opened_again_late(tmp_path: Path) -> None:
    """A re-measured copy of the A40 ResNet-50 profile under a 10 % bound, seed 2: the
    search settles on 200 W (+8.2 %) and a look finds no limit below it to try. As 200 W's
    settled steps add up, a line from it would vouch for 197 W some 470 steps later;
    opened then, the look measured it and re-checked the baseline at the run's end (the
    run ended uncapped, 20 % over the optimum). One look a search: 200 W to the end."""
    src = TRACE_DIR / "zeus-gplo-a40" / "A40+resnet50+gpu0.csv"
    spec = trace_spec(load_bench("bench_dvfs").remeasured(src, 2, tmp_path))
    r = _replay(spec, 0.10, 2)
    assert r.final_setting.power_limit_w == 200
    late = {s.setting.power_limit_w for s in r.trace if s.iteration >= 600}
    assert late == {200.0}, late


def test_a_line_the_curve_contradicts_vouches_no_more() -> None:
    """Compute-bound work on the simulated H100, power knob, no noise: the grid's best
    within a 5 % bound is 600 W, 575 W is over. The line through them vouches for limits
    that their own steps put over (the simulator's curve is not convex there): once one
    is, the line is dropped and the tries go on by their own measurement, ending below
    600 W (with the line kept, the tries crept up a watt at a time, 581-583 W, and it
    held 600 W)."""
    gpus, _ = make_sim_gpus(1)
    pol = get_policy("efficient", knob="power", min_steps=8, max_slowdown=0.05)
    r = run_policy(pol, gpus, 1e12, 0.05, steps=600, settle_steps=1)
    w = r.final_setting.power_limit_w
    assert w is not None and 575 < w < 600, w
    base = H100.step_cost(1e12, 0.05)
    assert H100.step_cost(1e12, 0.05, power_limit_w=w).duration_s <= 1.05 * base.duration_s
    assert H100.step_cost(1e12, 0.05, power_limit_w=w).energy_j < H100.step_cost(1e12, 0.05, power_limit_w=600).energy_j


def _ev(steps: int, ratio: float, rel_sd: float) -> Evidence:
    """Evidence of ``steps`` steps at ``ratio`` x a 1 s step, with ``rel_sd`` step to step."""
    mean = ratio
    sq = steps * mean * mean * (1 + rel_sd * rel_sd * (steps - 1) / steps)
    return Evidence(steps, steps * 1e12, steps * mean, steps * 100.0, sq, steps * 1e4)


def _look(ratios: dict[float, tuple[int, float]], fine: tuple[float, ...] = (), allowed: float = 1.05) -> tuple:
    """A job whose grid holds ``ratios`` ({limit W: (steps, time ratio)}, 2 % step noise,
    the baseline 300 W measured 256 steps), the limits in ``fine`` a look's tries; and
    the :class:`Lines` of one plan over it."""
    levels = sorted(ratios) + [300.0]
    grid = tuple(Setting(power_limit_w=w) for w in levels[:-1]) + (UNCAPPED,)
    job = JobSearch(gpus=(0,), start_steps=0, knob="power", grid=grid, levels=tuple(levels), fine_w=fine)
    base = _ev(256, 1.0, 0.02)
    seen = {i: _ev(*ratios[w], 0.02) for i, w in enumerate(levels[:-1])}
    seen[len(levels) - 1] = base
    se_base = base.se_time(0.02)
    ratio = {i: e.time_s / e.steps for i, e in seen.items()}
    ratio_se = {i: math.hypot(e.se_time(0.02), se_base) * ratio[i] for i, e in seen.items()}
    ratio_se[len(levels) - 1] = 0.0
    return job, Lines(seen, ratio, ratio_se, se_base, allowed, 0.02, 25.0)


def test_a_line_starts_only_at_a_level_well_within_the_bound_and_never_at_a_try() -> None:
    """The line that may vouch for a try between 200 and 225 W: from 225 W measured long
    (2.2 % under a 5 % bound, over 5.2 standard errors) yes; from 225 W measured a few
    steps, or a level 0.1 % under the bound however long, no: it would lend the line its
    luck. A try is never an end of the line."""
    job, m = _look({200.0: (192, 1.0489), 205.0: (128, 1.043), 225.0: (128, 1.0223)}, fine=(205.0,))
    line = m.between(job, 0, 2)
    assert line is not None and (line.lo_w, line.hi_w) == (200.0, 225.0)
    assert m.vouched(job, 1)  # 205 W: the line's 1.0436 + 2.6 x its error is under 1.05
    job, m = _look({200.0: (192, 1.0489), 205.0: (128, 1.043), 225.0: (9, 1.0223)}, fine=(205.0,))
    assert m.between(job, 0, 2) is None and not m.vouched(job, 1)
    job, m = _look({175.0: (192, 1.0889), 198.0: (128, 1.046), 200.0: (1000, 1.0488)}, fine=(198.0,))
    assert m.between(job, 0, 2) is None and not m.vouched(job, 1)
    job, m = _look({200.0: (192, 1.0489), 210.0: (128, 1.038), 225.0: (128, 1.0223)}, fine=(210.0,))
    assert m.between(job, 1, 2) is not None  # between the try and 225 W: the line is 200-225 W still


def test_a_try_the_line_vouched_for_that_its_own_steps_put_over_drops_the_line() -> None:
    job, m = _look({200.0: (192, 1.0489), 205.0: (128, 1.043), 225.0: (128, 1.0223)}, fine=(205.0,))
    assert m.between(job, 0, 2) is not None
    job, m = _look({200.0: (192, 1.0489), 205.0: (128, 1.060), 225.0: (128, 1.0223)}, fine=(205.0,))
    assert m.between(job, 0, 2) is None and not m.vouched(job, 1)


def test_the_level_that_would_start_a_line_is_measured_where_that_would_let_it() -> None:
    """225 W measured 9 steps (1.4 % under the bound at 1.036) cannot start a line yet; at
    128 steps it could: it is the one to measure. Measured long already, or too near the
    bound for 128 steps to tell, or the baseline itself: none."""
    job, m = _look({200.0: (192, 1.0491), 225.0: (9, 1.036)})
    assert m.wants(job, 0, 1, 128) == 1
    job, m = _look({200.0: (192, 1.0491), 225.0: (128, 1.036)})
    assert m.wants(job, 0, 1, 128) is None  # (it starts a line already)
    job, m = _look({200.0: (192, 1.0491), 225.0: (9, 1.046)})
    assert m.wants(job, 0, 1, 128) is None  # 0.4 % under: 5.2 errors of 128 steps do not fit
    job, m = _look({275.0: (192, 1.06)})
    assert m.wants(job, 0, 1, 128) is None  # the baseline


def test_a_re_tune_forgets_the_look() -> None:
    pol = get_policy("efficient", knob="power", min_steps=8, max_slowdown=0.05)
    job, _ = _look({200.0: (192, 1.0489), 205.0: (128, 1.043), 225.0: (128, 1.0223)}, fine=(205.0,))
    job.fine, job.looked, job.look_from, job.again_w = 1, True, Setting(power_limit_w=205.0), (200.0,)
    pol._retune(job, "test")  # type: ignore[attr-defined]  # (the policy's own re-tune, called directly)
    assert (job.fine, job.fine_w, job.looked, job.look_from, job.again_w) == (0, (), False, None, ())
