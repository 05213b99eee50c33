"""The second look of ``efficient``: a power limit between two grid levels where the
slowdown bound falls between them (policies/_finer.py), on the simulator and on a
measured A40 profile."""

from __future__ import annotations

from greend.policies import get_policy
from greend.policies._finer import GAIN_MIN, Bracket, finer_limit
from greend.probes.sim import H100
from greend.probes.trace import TRACE_DIR, trace_spec
from greend.testing.harness import make_sim_gpus, run_policy

# A40 ResNet-50 (measured): 225 W runs 1.0223x the uncapped step, 200 W 1.0489x, and
# 225 W costs 9.6 % more energy per step than 200 W.
A40_225_200 = Bracket(hi_w=225, lo_w=200, hi_ratio=1.0223, lo_ratio=1.0489, hi_energy=1.096, lo_energy=1.0)


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
        gpus, _ = make_sim_gpus(1, spec=spec)
        pol = get_policy("efficient", knob="power", min_steps=8, max_slowdown=0.05)
        r = run_policy(pol, gpus, 1e12, 0.0, steps=1000, settle_steps=1, noise=0.02, seed=seed)
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
    7.8 % more energy.)"""
    spec = trace_spec(TRACE_DIR / "zeus-gplo-a40" / "A40+resnet18+gpu0,1,2,3.csv")
    prof = spec.profile
    for seed in (2, 4):
        gpus, _ = make_sim_gpus(1, spec=spec)
        pol = get_policy("efficient", knob="power", min_steps=8, max_slowdown=0.10)
        r = run_policy(pol, gpus, 1e12, 0.0, steps=1000, settle_steps=1, noise=0.02, seed=seed)
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
    gpus, _ = make_sim_gpus(1, spec=spec)
    pol = get_policy("efficient", knob="power", min_steps=8, max_slowdown=0.05)
    r = run_policy(pol, gpus, 1e12, 0.0, steps=1000, settle_steps=1, noise=0.02, seed=4)
    assert r.final_setting.power_limit_w == 200
    assert any("measuring uncapped" in d.reason for _, d in r.decisions)  # a look ran
