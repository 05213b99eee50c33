"""Which busy share pacing (policies/_pacing.py) compares: SM activity (NVML's GPM, Hopper
and newer) where every GPU of the job has it, else utilisation, never a mix."""

from __future__ import annotations

from greend.policies._evidence import Evidence
from greend.policies._pacing import Pacer, PaceState, busy_of
from greend.policies.base import UNCAPPED, GpuView, Setting
from greend.probes.sim import H100

FLOPS = 1e12
CLOCKS = sorted(set(H100.supported_sm_clocks_mhz))
GRID = tuple(Setting(clock_cap_mhz=f) for f in CLOCKS[:-1]) + (UNCAPPED,)
LEVELS = tuple(float(f) for f in CLOCKS)


def views(util: list[float | None], sm: list[float | None]) -> list[GpuView]:
    return [
        GpuView(
            i,
            "nvml",
            500.0,
            1980.0,
            None,
            700.0,
            H100.supported_sm_clocks_mhz,
            200.0,
            700.0,
            700.0,
            util_pct=u,
            sm_active_pct=s,
        )  # fmt: skip
        for i, (u, s) in enumerate(zip(util, sm, strict=True))
    ]


def step(vs: list[GpuView]) -> dict[int, Setting]:
    live = Evidence(16, 16 * FLOPS, 16.0, 16 * 500.0, None, None)
    return Pacer(8, 1.64, 0.02).step(PaceState(), 10.0, GRID, LEVELS, len(GRID) - 1, vs, live)


def test_sm_activity_is_used_where_every_gpu_has_it() -> None:
    assert busy_of(views([100.0, 100.0], [97.0, 40.0])) == {0: 97.0, 1: 40.0}


def test_utilisation_is_used_where_a_gpu_has_no_sm_activity() -> None:
    """One GPU without GPM (or whose read failed this tick): the job's utilisation,
    never SM activity on some GPUs against utilisation on others."""
    assert busy_of(views([100.0, 80.0, 100.0], [97.0, 40.0, None])) == {0: 100.0, 1: 80.0, 2: 100.0}
    assert busy_of([]) == {}


def test_a_gpu_that_only_waits_is_paced_on_its_sm_activity() -> None:
    """GPU 1 waits in NCCL: utilization.gpu reads 100 on all four GPUs (nothing to pace on
    it), SM activity 40 % on GPU 1: GPU 1 alone gets a lower cap."""
    util = [100.0, 100.0, 100.0, 100.0]
    assert step(views(util, [None] * 4)) == {}
    moved = step(views(util, [96.0, 40.0, 97.0, 96.5]))
    assert list(moved) == [1]
    assert moved[1].clock_cap_mhz is not None and moved[1].clock_cap_mhz < 1980


def test_without_sm_activity_pacing_is_as_before() -> None:
    moved = step(views([80.0, 100.0], [None, None]))
    assert list(moved) == [0]


def test_a_failed_sm_activity_read_holds_the_pacing() -> None:
    """A job whose GPUs all had SM activity: a period where one GPU's read failed is not
    read (utilisation, ~100 % on every GPU, would look like a healed straggler). The
    pacing holds (no release, no move) and goes on when SM activity is back; a job that
    never had it on every GPU reads utilisation as before."""
    from greend.policies._pacing import GPM_HOLD, straggle_shown

    p, ps = Pacer(8, 1.64, 0.02), PaceState()
    live = Evidence(16, 16 * FLOPS, 16.0, 16 * 500.0, None, None)
    base = len(GRID) - 1
    moved = p.step(ps, 10.0, GRID, LEVELS, base, views([100.0, 100.0], [60.0, 97.0]), live)
    assert list(moved) == [0]
    held = dict(ps.held)
    gap = views([100.0, 100.0], [None, 97.0])
    assert busy_of(gap, gpm_seen=True) is None
    assert straggle_shown(ps, gap, True) is None  # (the job keeps its straggler)
    for t in range(5):
        assert p.step(ps, 11.0 + t, GRID, LEVELS, base, gap, live) == {}
        assert ps.held == held
    assert ps.gpm_seen
    # Gone for good: after GPM_HOLD periods without it, utilisation is read.
    for t in range(GPM_HOLD):
        p.step(ps, 20.0 + t, GRID, LEVELS, base, gap, live)
    assert not ps.gpm_seen
    for t in range(3):  # (utilisation: every GPU as busy, on a new scale whose spread is learnt first)
        p.step(ps, 60.0 + t, GRID, LEVELS, base, gap, live)
    assert ps.held == {}, ps.last_event  # the pacing lifted
    # A job that never had SM activity everywhere reads utilisation.
    assert busy_of(gap) == {0: 100.0, 1: 100.0}
