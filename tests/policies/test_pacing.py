"""Pacing within a node (policies/_pacing.py): the GPUs of one job that wait for a slower
one are slowed to its pace, through the harness on simulated H100s (figures: source=sim)."""

from __future__ import annotations

import pytest

from greend.policies import get_policy
from greend.policies._evidence import Evidence
from greend.policies._pacing import Pacer, PaceState
from greend.policies.base import UNCAPPED, GpuView, Setting
from greend.probes.sim import H100
from greend.testing.harness import HarnessResult, SimJob, Straggle, make_sim_gpus, run_policy
from greend.testing.nodes import NodesResult

FLOPS = 1e12
N = 8


def run(
    policy: str, steps: int, straggles=(), work=None, util_noise: float = 0.0, **params
) -> tuple[HarnessResult, list[float]]:
    gpus, _ = make_sim_gpus(N)
    job = SimJob("j", tuple(range(N)), FLOPS, 0.4, straggles=tuple(straggles), work=dict(work or {}))
    pol = get_policy(policy, **params) if params else get_policy(policy)
    r = run_policy(pol, gpus, steps=steps, jobs=[job], settle_steps=1, util_noise=util_noise)
    return r, [g.energy_j() for g in gpus]


def paced(r: HarnessResult, at: int) -> dict[str, str]:
    return r.decisions[at][1].details["jobs"]["j"]["paced"]


@pytest.mark.parametrize("how", ["slower GPU", "uneven stage"])
def test_gpus_off_the_critical_path_are_paced_without_slowing_the_job(how: str) -> None:
    kw = {"straggles": [Straggle(7, 1.2)]} if how == "slower GPU" else {"work": {7: 1.2}}
    none, e_none = run("none", 400, **kw)
    eff, e_eff = run("efficient", 400, max_slowdown=0.0, **kw)
    held = paced(eff, -1)
    assert set(held) == {str(i) for i in range(7)}, held  # every GPU but the slow one
    assert "7" not in held
    # Settled and paced, the job steps exactly at the slow GPU's pace (sim: no noise).
    last_none = [x.duration_s for x in none.trace[-100:]]
    last_eff = [x.duration_s for x in eff.trace[-100:]]
    assert sum(last_eff) / sum(last_none) - 1 < 0.002
    assert eff.total_time_s / none.total_time_s - 1 < 0.01  # the search included
    saved_fast = 1 - sum(e_eff[:7]) / sum(e_none[:7])
    assert saved_fast > 0.15, saved_fast
    assert abs(e_eff[7] / e_none[7] - 1) < 0.05  # the critical GPU keeps the job's setting


def test_a_straggler_that_comes_and_goes_is_followed() -> None:
    straggle = Straggle(7, 1.3, start_step=150, stop_step=400)
    eff, _ = run("efficient", 600, straggles=[straggle], max_slowdown=0.0)
    assert paced(eff, 140) == {}  # no straggler yet: nothing to pace
    # Its coming and its healing are no change of the job's work: the job keeps its
    # setting and what its search measured (no re-tune), and the others are paced within
    # a few checks (min_steps = 8 steps each) of its coming.
    assert all(d.details["jobs"]["j"]["phase"] == "settled" for _, d in eff.decisions[140:])
    assert not [d.reason for _, d in eff.decisions if "re-tune" in d.reason or "phase change" in d.reason]
    assert len(paced(eff, 150 + 3 * 8)) == 7
    assert len(paced(eff, 380)) == 7  # while it lasts: the others keep its pace
    # It heals at the job's step 400: the paced GPUs are the critical path then, and get
    # the job's setting back within one period (every step here).
    after = next(k for k in range(400, 600) if paced(eff, k) == {})
    assert after <= 401
    assert "back on the critical path" in eff.decisions[after][1].reason
    # Never left slower than policy none would run it, once the straggler is gone.
    none, _ = run("none", 600, straggles=[straggle])
    heal_eff = [x.duration_s for x in eff.trace[402:]]
    heal_none = [x.duration_s for x in none.trace[402:]]
    paced_slower = [a for a, b in zip(heal_eff, heal_none) if a > b * 1.001]
    settled = [x for x in eff.trace[402:] if x.phase == "settled"]
    assert settled and not [x for x in settled if x.duration_s > heal_none[0] * 1.001], paced_slower[:3]


def _views(utils: list[float]) -> list[GpuView]:
    clocks = H100.supported_sm_clocks_mhz
    return [
        GpuView(i, "sim", 500.0, 1980.0, None, 700.0, clocks, 200.0, 700.0, 700.0, util_pct=u)
        for i, u in enumerate(utils)
    ]


def _ev(steps: int, time_s: float) -> Evidence:
    return Evidence(steps, steps * FLOPS, time_s, steps * 500.0, None, None)


def test_a_measured_slowdown_undoes_the_move_and_backs_off() -> None:
    clocks = sorted(set(H100.supported_sm_clocks_mhz))
    grid = tuple(Setting(clock_cap_mhz=f) for f in clocks[:-1]) + (UNCAPPED,)
    levels = tuple(float(f) for f in clocks)
    base = len(grid) - 1
    p, ps = Pacer(8, 1.64, 0.02), PaceState()
    before = _ev(16, 16.0)
    moved = p.step(ps, 10.0, grid, levels, base, _views([80.0, 100.0]), before)
    assert list(moved) == [0] and moved[0].clock_cap_mhz is not None and moved[0].clock_cap_mhz < 1980
    assert p.step(ps, 11.0, grid, levels, base, _views([95.0, 100.0]), before) == {}  # not measured yet
    assert p.step(ps, 12.0, grid, levels, base, _views([95.0, 100.0]), _ev(4, 4.0)) == {}  # too few steps
    undone = p.step(ps, 13.0, grid, levels, base, _views([95.0, 100.0]), _ev(16, 16.0 * 1.04))  # 4 % slower
    assert undone == {0: UNCAPPED} and ps.held == {} and ps.undos == 1
    assert "undone" in ps.last_event
    # It waits (30 s) before it tries again, then tries.
    assert p.step(ps, 20.0, grid, levels, base, _views([80.0, 100.0]), _ev(16, 16.0)) == {}
    assert list(p.step(ps, 44.0, grid, levels, base, _views([80.0, 100.0]), _ev(16, 16.0))) == [0]


def test_a_measure_that_restarted_with_more_steps_is_still_checked() -> None:
    """The daemon's measure restarts after a move; one policy period later it may already
    hold more steps than the old one did (16 before, 36 after). Its start time says it
    is new, so the move is checked and, 4 % slower, undone (a move that went too deep is
    never left standing)."""
    clocks = sorted(set(H100.supported_sm_clocks_mhz))
    grid = tuple(Setting(clock_cap_mhz=f) for f in clocks[:-1]) + (UNCAPPED,)
    levels = tuple(float(f) for f in clocks)
    base = len(grid) - 1
    p, ps = Pacer(8, 1.64, 0.02), PaceState()
    assert list(p.step(ps, 10.0, grid, levels, base, _views([80.0, 100.0]), _ev(16, 16.0), since_s=0.0)) == [0]
    undone = p.step(ps, 11.0, grid, levels, base, _views([95.0, 100.0]), _ev(36, 36.0 * 1.04), since_s=10.05)
    assert undone == {0: UNCAPPED} and ps.undos == 1, ps.last_event


def test_a_move_is_judged_against_the_measure_it_was_made_in() -> None:
    """The slack showed while the old measure ran (1 s a step); the daemon's measure then
    started again (faster steps, 0.5 s) and holds more steps than the old one did: the
    move's reference is the new measure alone, never the new one less the old one."""
    clocks = sorted(set(H100.supported_sm_clocks_mhz))
    grid = tuple(Setting(clock_cap_mhz=f) for f in clocks[:-1]) + (UNCAPPED,)
    levels = tuple(float(f) for f in clocks)
    p, ps = Pacer(20, 2.0, 0.05), PaceState()
    assert p.step(ps, 10.0, grid, levels, len(grid) - 1, _views([80.0, 100.0]), _ev(10, 10.0), since_s=100.0) == {}
    assert p.step(ps, 20.0, grid, levels, len(grid) - 1, _views([80.0, 100.0]), _ev(40, 20.0), since_s=115.0)
    assert ps.ref is not None and ps.ref.time_s / ps.ref.steps == pytest.approx(0.5)


def test_a_move_within_the_noise_stands() -> None:
    clocks = sorted(set(H100.supported_sm_clocks_mhz))
    grid = tuple(Setting(clock_cap_mhz=f) for f in clocks[:-1]) + (UNCAPPED,)
    levels = tuple(float(f) for f in clocks)
    p, ps = Pacer(8, 1.64, 0.02), PaceState()
    p.step(ps, 10.0, grid, levels, len(grid) - 1, _views([80.0, 100.0]), _ev(16, 16.0))
    assert p.step(ps, 12.0, grid, levels, len(grid) - 1, _views([97.0, 100.0]), _ev(16, 16.0 * 1.003)) == {}
    assert ps.held and ps.undos == 0


def test_without_utilisation_nothing_is_paced() -> None:
    clocks = sorted(set(H100.supported_sm_clocks_mhz))
    grid = tuple(Setting(clock_cap_mhz=f) for f in clocks[:-1]) + (UNCAPPED,)
    views = [
        GpuView(i, "nvml", 500.0, 1980.0, None, 700.0, H100.supported_sm_clocks_mhz, 200.0, 700.0, 700.0)
        for i in range(2)
    ]
    p, ps = Pacer(8, 1.64, 0.02), PaceState()
    assert p.step(ps, 10.0, grid, [float(f) for f in clocks], len(grid) - 1, views, _ev(16, 16.0)) == {}


def test_straggle_checks_its_span() -> None:
    with pytest.raises(ValueError, match="factor"):
        Straggle(0, 0.0)
    with pytest.raises(ValueError, match="stop_step"):
        Straggle(0, 1.2, start_step=10, stop_step=10)
    job = SimJob("j", (0, 1), FLOPS, 0.4, straggles=(Straggle(1, 1.3, 5, 9),))
    assert [job.speed_of(1, s) for s in (4, 5, 8, 9)] == [1.0, 1.3, 1.3, 1.0]
    assert job.speed_of(0, 6) == 1.0


@pytest.mark.parametrize("factor", [1.1, 1.2, 1.3])
def test_the_fast_gpus_end_near_the_ideal_cap(factor: float) -> None:
    """One GPU ``factor`` times slower: the seven others end at a cap whose energy saving
    is at least 90 % of the ideal's (the best static cap that keeps the slow GPU's pace,
    from a sweep), and the job keeps that pace (sim: no noise)."""
    none, e_none = run("none", 300, straggles=[Straggle(7, factor)])
    eff, e_eff = run("efficient", 300, straggles=[Straggle(7, factor)], max_slowdown=0.0)
    slow = H100.step_cost(FLOPS, 0.4, speed_factor=factor).duration_s
    fits = [
        H100.step_cost(FLOPS, 0.4, locked_clocks_mhz=(H100.sm_clock_min_mhz, f))
        for f in sorted(set(H100.supported_sm_clocks_mhz))
    ]
    ideal = min((c for c in fits if c.duration_s <= slow * (1 + 1e-9)), key=lambda c: c.energy_j)
    base = H100.step_cost(FLOPS, 0.4)
    held = paced(eff, -1)
    assert len(held) == 7, held
    # the last 100 steps, settled: each fast GPU's energy a step against the ideal's
    tail = [x.duration_s for x in eff.trace[-100:]]
    assert max(tail) <= slow * 1.001  # the job keeps the slow GPU's pace
    saved = 1 - sum(e_eff[:7]) / sum(e_none[:7])
    assert saved > 0, saved
    clocks = {int(v.split()[0]) for v in held.values()}
    assert len(clocks) == 1, held  # alike GPUs, alike caps
    paced_e = H100.step_cost(FLOPS, 0.4, locked_clocks_mhz=(H100.sm_clock_min_mhz, clocks.pop())).energy_j
    assert (base.energy_j - paced_e) >= 0.9 * (base.energy_j - ideal.energy_j), (paced_e, ideal.energy_j)


def test_a_move_too_deep_steps_back_one_move_and_is_not_tried_again() -> None:
    """A measured power-limit profile stretches little at first and much later, so a
    move sized from the first ones can go too deep: the GPU falls behind the pace. It
    goes back to where it kept the pace (not to the job's setting, to start over), and
    that depth is not tried again while the straggler lasts."""
    grid = tuple(Setting(power_limit_w=w) for w in (100.0, 125.0, 150.0, 175.0, 200.0, 225.0, 250.0, 275.0)) + (
        UNCAPPED,
    )
    levels = (100.0, 125.0, 150.0, 175.0, 200.0, 225.0, 250.0, 275.0, 300.0)
    base = len(grid) - 1
    stretch = {8: 1.0, 7: 1.002, 6: 1.006, 5: 1.022, 4: 1.049, 3: 1.164, 2: 1.535, 1: 2.35, 0: 2.89}  # A40 ResNet-50
    p, ps = Pacer(8, 1.64, 0.02), PaceState()
    at, t, since, steps, time_s = base, 0.0, 0.0, 0, 0.0
    history = []
    for _ in range(80):
        t += 1.0
        fast = stretch[at] / 1.1  # its busy time over the slow GPU's (index 1, 10 % slower)
        utils = [100.0 * min(1.0, fast), 100.0 * min(1.0, 1.0 / fast)]
        steps += 4
        time_s += 4 * max(1.0, fast)  # the job's step: the slower of the two
        out = p.step(ps, t, grid, levels, base, _views(utils), _ev(steps, time_s), since_s=since)
        if 0 in out:
            at = grid.index(out[0])
            history.append(levels[at])
            since, steps, time_s = t, 0, 0.0  # the daemon measures afresh at the new setting
    assert levels[at] == 200.0, history  # the deepest limit that keeps a 10 % slower pace
    assert history.count(300.0) == 0, history  # never back to the job's setting to start over
    assert len([w for w in history if w < 200.0]) <= 2, history  # each too-deep limit tried at most once


def _ev_at(steps: int, time_s: float) -> Evidence:
    return Evidence(steps, steps * FLOPS, time_s, steps * 500.0, None, None)


def test_a_straggler_shows_and_heals_without_flicker() -> None:
    """``straggle_shown``: a GPU at the job's setting 5 % less busy than the critical one
    is a straggler's sign; once shown it is gone only when every GPU is within 1.5 % of
    the pace, so a share near the 3 % line does not flip the answer period by period."""
    from greend.policies._pacing import straggle_shown

    ps = PaceState()
    assert straggle_shown(ps, _views([100.0, 100.0])) is False
    assert straggle_shown(ps, _views([95.0, 100.0])) is True
    assert straggle_shown(ps, _views([97.5, 100.0]), was=False) is False
    assert straggle_shown(ps, _views([97.5, 100.0]), was=True) is True
    assert straggle_shown(ps, _views([99.0, 100.0]), was=True) is False
    views = [GpuView(i, "nvml", 500.0, 1980.0, None, 700.0, (1980, 345), 200.0, 700.0, 700.0) for i in range(2)]
    assert straggle_shown(ps, views) is None  # utilisation not read: nothing known
    # A paced GPU under the pace keeps the straggler shown; one at the pace (no move of
    # its own just made) says it healed (the readings' spread learnt: noise-free).
    ps.held, ps.spread_n = {0: 50}, 10
    assert straggle_shown(ps, _views([98.0, 100.0])) is True
    assert straggle_shown(ps, _views([100.0, 100.0])) is False


def test_room_under_the_bound_is_taken_by_the_paced_gpus_never_by_the_critical_one() -> None:
    """A job whose setting runs faster than its bound allows (a power limit that is both
    cheaper and quicker than uncapped) leaves room: a GPU with slack is paced to it,
    deeper than to the critical GPU's pace alone; the critical GPU, and GPUs as busy as
    it, are never paced whatever the room."""
    clocks = sorted(set(H100.supported_sm_clocks_mhz))
    grid = tuple(Setting(clock_cap_mhz=f) for f in clocks[:-1]) + (UNCAPPED,)
    levels = tuple(float(f) for f in clocks)
    base = len(grid) - 1
    caps = {}
    for room in (1.0, 1.05):
        p, ps = Pacer(8, 1.64, 0.02), PaceState()
        moved = p.step(ps, 10.0, grid, levels, base, _views([80.0, 100.0, 99.0]), _ev(16, 16.0), room=room)
        assert set(moved) == {0}, moved  # gpu1 sets the pace, gpu2 has no slack to give
        caps[room] = moved[0].clock_cap_mhz
    assert caps[1.05] is not None and caps[1.0] is not None and caps[1.05] < caps[1.0], caps
    p, ps = Pacer(8, 1.64, 0.02), PaceState()
    assert p.step(ps, 10.0, grid, levels, base, _views([100.0, 100.0]), _ev(16, 16.0), room=1.3) == {}


def test_the_room_is_spent_once_over_all_moves() -> None:
    """Room 3 %: a first move that slows the job 2 % stands; a second that slows it 3 %
    more (5 % against the job before any pacing) is undone, though each alone is within
    the room."""
    clocks = sorted(set(H100.supported_sm_clocks_mhz))
    grid = tuple(Setting(clock_cap_mhz=f) for f in clocks[:-1]) + (UNCAPPED,)
    levels = tuple(float(f) for f in clocks)
    base = len(grid) - 1
    p, ps = Pacer(8, 1.64, 0.02), PaceState()
    first = p.step(ps, 10.0, grid, levels, base, _views([80.0, 100.0]), _ev(16, 16.0), 0.0, 1.03)
    assert list(first) == [0]
    second = p.step(ps, 11.0, grid, levels, base, _views([90.0, 100.0]), _ev(16, 16.0 * 1.02), 10.5, 1.03)
    assert list(second) == [0] and ps.undos == 0, ps.last_event  # checked, stands; the next move
    undone = p.step(ps, 12.0, grid, levels, base, _views([95.0, 100.0]), _ev(16, 16.0 * 1.05), 11.5, 1.03)
    assert ps.undos == 1 and "undone" in ps.last_event, ps.last_event
    assert undone == first  # back where the first move left it


def test_noisy_shares_at_the_pace_neither_release_nor_step_back() -> None:
    """Real busy shares vary by a percent or more from one period to the next. Seven
    GPUs paced just under a slower one's pace, each reading noisy (1 %, the critical
    GPU's too): a single period at or over ``NEAR`` by chance is no heal (the floors and
    the pacing stay) and no move too deep; the spread is learnt from the readings."""
    import random

    from greend.policies._pacing import NEAR

    clocks = sorted(set(H100.supported_sm_clocks_mhz))
    grid = tuple(Setting(clock_cap_mhz=f) for f in clocks[:-1]) + (UNCAPPED,)
    levels = tuple(float(f) for f in clocks)
    base = len(grid) - 1
    p, ps = Pacer(8, 1.64, 0.02), PaceState()
    ps.held = dict.fromkeys(range(7), base - 20)
    ps.floor = dict.fromkeys(range(7), base - 21)  # (one notch deeper was too deep: they stay)
    rng = random.Random(3)
    chance = 0
    for t in range(600):
        utils = [min(100.0, 98.5 * (1 + rng.gauss(0, 0.01))) for _ in range(7)]
        utils.append(min(100.0, 100.0 * (1 + rng.gauss(0, 0.01))))
        chance += any(u / utils[7] >= NEAR for u in utils[:7])
        out = p.step(ps, float(t), grid, levels, base, _views(utils), _ev(16 + 4 * t, 16.0 + 4 * t), since_s=0.0)
        assert out == {}, (t, ps.last_event)
    assert chance > 100  # (the old single-period test would have released that often)
    assert len(ps.held) == 7 and len(ps.floor) == 7
    assert 0.007 < ps.spread < 0.02, ps.spread
    # A heal (the slow GPU now as fast: the paced GPUs 20 % behind) shows at once.
    utils = [100.0] * 7 + [83.0]
    assert set(p.step(ps, 600.0, grid, levels, base, _views(utils), _ev(3000, 3000.0), since_s=0.0)) == set(range(7))
    assert "back on the critical path" in ps.last_event and ps.floor == {}


def test_a_job_paced_on_noisy_shares_stays_paced() -> None:
    """The harness's busy shares with 1 % noise each period (real GPUs' vary so): the
    fast GPUs are paced and stay paced (few releases, no re-tune), the job within 1 %
    of ``none``'s time, the saving as without noise (within a tenth)."""
    none, e_none = run("none", 800, [Straggle(7, 1.2)], util_noise=0.01)
    eff, e_eff = run("efficient", 800, [Straggle(7, 1.2)], util_noise=0.01, max_slowdown=0.0)
    sizes = [len(d.details["jobs"]["j"]["paced"]) for _, d in eff.decisions]
    releases = sum(b < a for a, b in zip(sizes, sizes[1:], strict=False))
    assert releases <= 3, releases
    assert not [d.reason for _, d in eff.decisions if "phase change" in d.reason or "re-tune" in d.reason]
    assert eff.total_time_s / none.total_time_s - 1 < 0.01
    assert 1 - sum(e_eff[:7]) / sum(e_none[:7]) > 0.9 * 0.295  # (noise-free: 29.5 %, bench_pacing_noise)


def _nodes(
    policy: str, steps: int, slow: Straggle | None, starts: tuple[int, ...], noise: float = 0.0, **params
) -> NodesResult:
    """Synchronised nodes of 2 simulated GPUs whose daemons start at the job steps
    ``starts`` (one node each); node B's GPUs straggle as ``slow`` says."""
    from greend.testing.nodes import Node, run_nodes

    nodes = []
    for k, start in enumerate(starts):
        gpus, clk = make_sim_gpus(2)
        st = tuple(Straggle(i, slow.factor, slow.start_step, slow.stop_step) for i in (0, 1)) if k == 1 and slow else ()
        job = SimJob("j", (0, 1), FLOPS, 0.4, straggles=st)
        nodes.append(Node(get_policy(policy, **params), gpus, job, clk, starts_at=start))
    return run_nodes(nodes, steps=steps, noise=noise)


def _two_nodes(policy: str, steps: int, slow: Straggle | None, b_starts_at: int = 0, noise: float = 0.0, **params):
    return _nodes(policy, steps, slow, (0, b_starts_at), noise, **params)


@pytest.mark.parametrize("n, heal", [(2, 1100), (3, 1050)])
def test_a_straggler_that_heals_between_aligned_rechecks_leaves_the_job_within_its_bound(n: int, heal: int) -> None:
    """Node B slow from the start heals after the re-check every node runs at job step
    1,024 (sim, synchronised steps, bound 5 %). The other nodes stay capped to its old
    step and its own baseline reads theirs; what the nodes see is the job's step falling
    at the setting they hold (2 nodes) or the agreed pace falling once B measured its
    step again (3 nodes: B was searching when it healed, and the others' capped step hid
    the heal). Each re-checks its baseline at the same two job steps then
    (policies/_recheck.py). Before, the job ran +20 % (2 nodes) and +31 % (3 nodes) over
    ``none`` from the heal to the next re-check, at step 2,048."""
    starts = (0, 50, 120)[:n]
    none = _nodes("none", 2000, Straggle(0, 1.3, 0, heal), starts)
    eff = _nodes("efficient", 2000, Straggle(0, 1.3, 0, heal), starts, max_slowdown=0.05)
    after = sum(eff.step_s[heal + 300 :]) / sum(none.step_s[heal + 300 :])
    assert after <= 1.055, after


@pytest.mark.parametrize("n", [2, 3])
def test_a_mild_straggler_that_heals_asks_every_node_to_re_check(n: int) -> None:
    """Node B 10 % slower from the start heals at job step 2,100, after the re-check every
    node runs at step 2,048 (sim, synchronised steps, bound 5 %). The other nodes are
    capped to its old step exactly: the job's step and its agreed pace stay where they
    were, and no node's step falls. What B sees is its GPUs using less energy per FLOP at
    the same step (they finish sooner and wait for the others); it asks every node to
    re-check from its step, in the pace the ranks agree (``recheck_at``). Before, the job
    ran +11 % (2 nodes) and +14 % (3 nodes) over ``none`` from 300 steps after the heal
    to the next re-check every node runs, at step 4,096."""
    heal, starts = 2100, (0, 50, 120)[:n]
    none = _nodes("none", 2900, Straggle(0, 1.1, 0, heal), starts)
    eff = _nodes("efficient", 2900, Straggle(0, 1.1, 0, heal), starts, max_slowdown=0.05)
    after = sum(eff.step_s[heal + 300 :]) / sum(none.step_s[heal + 300 :])
    assert after <= 1.055, after


def test_synchronised_nodes_all_measure_the_slowest_nodes_step() -> None:
    r = _two_nodes("none", 50, Straggle(0, 1.3))
    slow = H100.step_cost(FLOPS, 0.4, speed_factor=1.3).duration_s
    fast = H100.step_cost(FLOPS, 0.4)
    assert r.step_s == pytest.approx([slow] * 50)  # (node A, uncapped, waits for node B every step)
    assert r.energy_j[0] == pytest.approx(50 * 2 * fast.energy_j)  # (its steps' energy only)


@pytest.mark.parametrize("room", [False, True], ids=["default", "pace_room"])
def test_a_node_that_heals_leaves_the_job_within_its_bound(room: bool) -> None:
    """Node B 30 % slower for steps 600-1200 of 1800, bound 5 %, each node measuring the
    job's step (synchronised, as real ranks do; sim). While B is slow node A caps to B's
    pace. Once B heals, both nodes see the job speed up and measure their baselines again;
    the pace the ranks agreed before that is B's old one, and read against the new
    baselines it would leave room that is not there (node A capped to B's old step: the
    job ran ~20 % slower than ``none`` until two agreements later). With ``pace_room`` it
    is read only from the third agreement after a node's baseline went out
    (policies.efficient_state.pace_fresh); by default it gives no room at all."""
    none = _two_nodes("none", 1800, Straggle(0, 1.3, 600, 1200))
    eff = _two_nodes("efficient", 1800, Straggle(0, 1.3, 600, 1200), max_slowdown=0.05, pace_room=room)
    ratio = [a / b for a, b in zip(eff.step_s, none.step_s, strict=True)]
    windows = [sum(ratio[k : k + 100]) / 100 for k in range(0, 1800, 100)]
    assert max(windows) <= 1.05 + 1e-3, [round(w, 3) for w in windows]  # (search steps over it included)
    assert all(
        p is not None and p > none.step_s[0] * 1.25 for i, p in eff.paces if 900 <= i < 1200
    )  # (the slow node's pace was agreed, and given to both)


def test_a_pace_is_read_from_the_third_agreement_after_the_nodes_step_fell() -> None:
    """A node's first pace: the ranks hold none of its own, so the next agreement it hears
    is read. Its step falling (a healed straggler: its older, longer pace may still be the
    ranks' MAX): from the third agreement on. Its step rising: its older pace is quicker and
    can only leave less room, so nothing waits."""
    from greend.policies.efficient_state import JobSearch, pace_fresh

    job = JobSearch(gpus=(0,), start_steps=0)
    assert not pace_fresh(job, 1e-12, 3)  # (this node's first pace goes out now: agreement 3 read none of it)
    assert pace_fresh(job, 1.004e-12, 4)  # (the next agreement heard; within the push threshold: no new pace)
    assert pace_fresh(job, 1.2e-12, 4)  # (slower: a new, longer pace goes out; the old one leaves less room)
    assert not pace_fresh(job, 1.0e-12, 5)  # (quicker: the old, longer pace may still be the ranks' MAX)
    assert not pace_fresh(job, 1.0e-12, 6)
    assert not pace_fresh(job, 1.0e-12, 7)  # (agreement 6 may have been on its way: the count lags)
    assert pace_fresh(job, 1.0e-12, 8)
    assert pace_fresh(job, 1.25e-12, 8)  # (slower again: read at once)
    assert not pace_fresh(job, 1.1e-12, 8)  # (quicker than the pace that went out last: wait again)
    assert pace_fresh(job, 1.1e-12, 11)
    # A first baseline where the ranks still hold a longer pace of this node's (a policy
    # change, a resumed record: a new search, the daemon's pushes as they were): it waits.
    held = JobSearch(gpus=(0,), start_steps=0)
    assert not pace_fresh(held, 1e-12, 3, held_tpf=1.05e-12)
    assert not pace_fresh(held, 1e-12, 5, held_tpf=1.05e-12)
    assert pace_fresh(held, 1e-12, 6, held_tpf=1e-12)
    same = JobSearch(gpus=(0,), start_steps=0)
    assert not pace_fresh(same, 1e-12, 3, held_tpf=1.005e-12) and pace_fresh(same, 1e-12, 4)  # (no longer one)


@pytest.mark.parametrize(
    ("bound", "factor", "b_starts_at", "noise"),
    [
        (0.05, None, 37, 0.0),
        (0.05, None, 150, 0.0),
        (0.10, None, 37, 0.01),
        (0.10, 1.3, 37, 0.0),
        (0.05, 1.3, 37, 0.01),
    ],
)
def test_nodes_whose_daemons_start_apart_keep_the_job_within_its_bound(
    bound: float, factor: float | None, b_starts_at: int, noise: float
) -> None:
    """Two nodes of a synchronous job (each timing the job's step; sim), node B's daemon
    starting ``b_starts_at`` steps after node A's: B measures its uncapped baseline while
    A is probing capped settings, so B's baseline has A's slowdown in it, and B's bound on
    top of that; A's next baseline then has B's. Before the job's floor (the lowest
    uncapped step any node measured, agreed like the pace) the job settled 13-21 % slower
    than ``none`` under a 5 or 10 % bound; held to its floor it keeps the bound."""
    slow = Straggle(0, factor) if factor else None
    none = _two_nodes("none", 1500, slow, noise=noise)
    eff = _two_nodes("efficient", 1500, slow, b_starts_at, noise=noise, max_slowdown=bound)
    last = sum(eff.step_s[1000:]) / sum(none.step_s[1000:])
    assert last <= 1 + bound + 0.005, last
    assert sum(eff.energy_j) < 0.95 * sum(none.energy_j)  # (and it still saves)


def test_after_a_change_of_level_the_floor_waits_for_a_baseline_at_the_new_one() -> None:
    """A rollback (bf16 to fp32, the job 1.6x slower): the baseline the policy holds when
    the ranks' level changes is still the old level's, and must not become the new
    level's floor (the job, on every node through the MIN, would be held to a step it no
    longer runs: never capped again)."""
    from greend.policies.base import JobView
    from greend.policies.efficient_state import JobSearch, floor_share

    def view(level: str, floor_s: float) -> JobView:
        return JobView("j", (0,), "running", 100, level, (level,), None, UNCAPPED, floor_s=floor_s)

    def base(tpf: float) -> Evidence:
        return Evidence(steps=16, flops=16e12, time_s=16e12 * tpf, energy_j=1.0)

    job = JobSearch(gpus=(0,), start_steps=0)
    assert floor_share(job, base(1e-12), view("bf16", 1e-12 * 1e12)) == 1.0
    assert floor_share(job, base(1e-12), view("fp32", 1e-12 * 1e12)) == 1.0  # (the old baseline: no floor)
    assert job.low_tpf is None
    slow = base(1.6e-12)  # (re-tuned: the baseline at fp32)
    assert floor_share(job, slow, view("fp32", 1.6e-12 * 1e12)) == 1.0 and job.low_tpf == pytest.approx(1.6e-12)
    # (a node whose floor is lower at fp32 holds it to that; an inflated baseline later does not raise it)
    assert floor_share(job, base(1.8e-12), view("fp32", 1.5e-12 * 1e12)) == pytest.approx(1.5 / 1.8)
    assert job.low_tpf == pytest.approx(1.6e-12)


@pytest.mark.parametrize(("grow", "b_starts_at"), [(2.0, 400), (0.5, 400)])
def test_a_job_whose_steps_grow_keeps_its_bound_over_nodes_started_apart(grow: float, b_starts_at: int) -> None:
    """The job's FLOPs per step change at step 600 (a batch-size warm-up, a longer sequence;
    its time per FLOP unchanged), node B's daemon started at step 400 (sim). A step time
    agreed across nodes goes out as a node's time per FLOP times its FLOPs per step, and
    must be read back with the FLOPs per step now: read with the baseline's, node B took
    node A's floor as twice what it is, fell back on its own baseline (measured while A
    probed) and the job ran +9.5 % over ``none`` under a 5 % bound."""
    from greend.testing.harness import Phase
    from greend.testing.nodes import Node, run_nodes

    runs = {}
    for policy in ("none", "efficient"):
        nodes = []
        for k in range(2):
            gpus, clk = make_sim_gpus(2)
            job = SimJob("j", (0, 1), FLOPS, 0.4, phases=(Phase(600, FLOPS * grow, 0.4),))
            pol = get_policy(policy) if policy == "none" else get_policy("efficient", max_slowdown=0.05)
            nodes.append(Node(pol, gpus, job, clk, starts_at=b_starts_at if k and policy != "none" else 0))
        runs[policy] = run_nodes(nodes, steps=2400)
    last = sum(runs["efficient"].step_s[1600:]) / sum(runs["none"].step_s[1600:])
    assert last <= 1.055, last
    assert sum(runs["efficient"].energy_j) < 0.97 * sum(runs["none"].energy_j)


def test_a_node_slow_from_the_start_that_heals_leaves_the_job_within_its_bound() -> None:
    """Node B 30 % slower from the job's first step to step 1000 (a cold cache, a hot GPU
    in the first epoch; sim), its daemon 50 steps after node A's. Every baseline, and so
    the floor, was measured while B was slow; once B heals the job runs at node A's
    capped step, which nothing else shows (both nodes time that step). A job over several
    nodes also re-checks its baseline at the same job steps on every node (every node
    uncapped at once, RECHECK_SHARE): before, the job stayed 20 % over ``none`` under a 5 %
    bound until the 600 s re-check (and for good with 3 or more nodes, all capped)."""
    none = _two_nodes("none", 3000, Straggle(0, 1.3, 0, 1000))
    eff = _two_nodes("efficient", 3000, Straggle(0, 1.3, 0, 1000), b_starts_at=50, max_slowdown=0.05)
    last = sum(eff.step_s[2000:]) / sum(none.step_s[2000:])
    assert last <= 1.055, last
