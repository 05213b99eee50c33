"""The GPU simulator: the power/time model, the energy counter, state on disk."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from greend.errors import StateError
from greend.probes import _sim_device as device_module
from greend.probes.sim import H100, MAX_MEM_SHARE, SimGpu, SimState, discover_sim_gpus, open_sim_gpus
from tests.support import REPO, ManualClock

BF16_STEP_FLOPS = 1e15  # ~2 s on a simulated H100 at 1980 MHz, bf16, compute bound


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1_000.0)


@pytest.fixture
def gpu(tmp_path: Path, clock: ManualClock) -> SimGpu:
    return SimGpu(tmp_path, 0, clock=clock)


# ---------------------------------------------------------------- the model


def test_h100_spec_is_like_the_datasheet() -> None:
    clocks = H100.supported_sm_clocks_mhz
    assert clocks[0] == 1980 and clocks[-1] == 345
    assert list(clocks) == sorted(clocks, reverse=True)
    assert all(a - b == 15 for a, b in zip(clocks, clocks[1:]))
    assert (H100.power_limit_min_w, H100.power_limit_max_w, H100.power_limit_default_w) == (200, 700, 700)
    assert H100.compute_capability == (9, 0)
    assert H100.peak_flops.for_precision("bf16") == 989e12
    assert H100.peak_flops.for_precision("fp8-emulated") == H100.peak_flops.fp8  # priced as the fp8 it stands in for
    with pytest.raises(ValueError, match="precision"):
        H100.peak_flops.for_precision("int4")


def test_power_grows_faster_than_linearly_with_clock() -> None:
    static = H100.static_w
    lo, mid, hi = 660, 1320, 1980
    # dynamic part doubles clock -> more than doubles power
    assert (H100.busy_power_w(hi) - static) / (H100.busy_power_w(lo) - static) > hi / lo
    # convex: the midpoint lies under the chord
    assert H100.busy_power_w(mid) < (H100.busy_power_w(lo) + H100.busy_power_w(hi)) / 2
    powers = [H100.busy_power_w(f) for f in reversed(H100.supported_sm_clocks_mhz)]
    assert powers == sorted(powers)


def test_compute_bound_job_draws_near_tdp_and_memory_bound_less() -> None:
    compute = H100.busy_power_w(1980, 0.0)
    memory = H100.busy_power_w(1980, 0.9)
    assert 650 <= compute <= 700
    assert memory < compute - 100
    assert H100.idle_w < H100.busy_power_w(345, 0.0)


def test_step_time_scales_with_clock_for_compute_and_barely_for_memory_bound() -> None:
    def ratio(m: float) -> float:
        return H100.step_time_s(1e14, 990, m, "bf16") / H100.step_time_s(1e14, 1980, m, "bf16")

    assert ratio(0.0) == pytest.approx(2.0, rel=1e-9)
    assert ratio(MAX_MEM_SHARE) < 1.06
    assert ratio(0.0) > ratio(0.5) > ratio(MAX_MEM_SHARE)
    # lower precision is faster, FLOP for FLOP
    assert H100.step_time_s(1e14, 1980, 0.0, "fp8") < H100.step_time_s(1e14, 1980, 0.0, "bf16")
    assert H100.step_time_s(1e14, 1980, 0.0, "bf16") < H100.step_time_s(1e14, 1980, 0.0, "fp32")
    with pytest.raises(ValueError):
        H100.step_time_s(1e14, 1980, 0.99, "bf16")


def test_speed_factor_makes_a_straggler(tmp_path: Path, clock: ManualClock) -> None:
    fast = SimGpu(tmp_path, 0, clock=clock)
    slow = SimGpu(tmp_path, 1, clock=clock, speed_factor=1.3)
    a = fast.step_cost(BF16_STEP_FLOPS, 0.2, "bf16")
    b = slow.step_cost(BF16_STEP_FLOPS, 0.2, "bf16")
    assert b.duration_s == pytest.approx(1.3 * a.duration_s)


def test_utilisation_is_the_busy_share_of_the_last_second(tmp_path: Path, clock: ManualClock) -> None:
    """As NVML's: the share of the sample period a step ran, so a GPU that waits at each
    step for a slower one (a synchronous job) reads less busy than it."""
    fast, slow = open_sim_gpus(tmp_path, 2, clock=clock, speed_factor=[1.0, 1.3])
    flops = 2e12  # ~5 ms on the fast GPU (fp32, compute bound)
    for _ in range(400):  # the job's step: both GPUs compute, then wait for the slower
        d = max(g.run_step(flops, 0.0, "fp32").duration_s for g in (fast, slow))
        clock.advance(2 * d)  # the step: the computing, then data, the host, the collective
        fast.utilization_pct(), slow.utilization_pct()  # (readings, as the daemon's ticks)
    u_fast, u_slow = fast.utilization_pct()[0], slow.utilization_pct()[0]
    assert u_slow == pytest.approx(50.0, rel=0.03)
    assert u_fast / u_slow == pytest.approx(1 / 1.3, rel=0.03)
    clock.advance(1.5)  # a second without steps: idle
    assert fast.utilization_pct() == (0.0, 0.0)


# ---------------------------------------------------------------- power limit and clocks


def test_power_limit_throttles_the_clock(gpu: SimGpu) -> None:
    free = gpu.step_cost(BF16_STEP_FLOPS, 0.0, "bf16")
    assert free.sm_clock_mhz == 1980
    gpu.set_power_limit_w(300)
    capped = gpu.run_step(BF16_STEP_FLOPS, 0.0, "bf16")
    assert capped.sm_clock_mhz < 1980
    assert capped.power_w <= 300
    assert capped.sm_clock_mhz in H100.supported_sm_clocks_mhz
    # the next clock up would not fit the limit
    up = H100.supported_sm_clocks_mhz[H100.supported_sm_clocks_mhz.index(capped.sm_clock_mhz) - 1]
    assert H100.busy_power_w(up, 0.0) > 300
    assert capped.duration_s > free.duration_s
    assert "power_cap" in gpu.throttle_reasons()
    # a memory-bound job fits the same limit at a higher clock than... none: it draws less
    assert gpu.step_cost(BF16_STEP_FLOPS, 0.9, "bf16").power_w <= 300


def test_power_limit_is_validated(gpu: SimGpu) -> None:
    for bad in (199.0, 701.0, -5.0):
        with pytest.raises(ValueError, match="power limit"):
            gpu.set_power_limit_w(bad)
    gpu.set_power_limit_w(200)
    assert gpu.power_limit_w() == 200


def test_unreachable_limit_duty_cycles_at_the_lowest_clock(gpu: SimGpu) -> None:
    gpu.set_power_limit_w(200)
    cost = gpu.step_cost(BF16_STEP_FLOPS, MAX_MEM_SHARE, "bf16")
    assert cost.sm_clock_mhz == 345
    assert cost.power_w == pytest.approx(200)
    assert cost.energy_j == pytest.approx(cost.power_w * cost.duration_s)


def test_locked_clocks_cap_the_step_clock(gpu: SimGpu) -> None:
    gpu.set_locked_clocks(345, 1400)
    cost = gpu.run_step(BF16_STEP_FLOPS, 0.0, "bf16")
    assert cost.sm_clock_mhz == 1395  # highest supported <= 1400
    assert gpu.sm_clock_mhz() == 1395  # reported while the step runs
    assert gpu.locked_clocks_mhz() == (345, 1400)
    assert "clock_lock" in gpu.throttle_reasons()
    gpu.reset_locked_clocks()
    assert gpu.locked_clocks_mhz() is None
    with pytest.raises(ValueError):
        gpu.set_locked_clocks(1500, 1000)
    gpu.set_locked_clocks(100, 5000)  # clamped into the supported range
    assert gpu.locked_clocks_mhz() == (345, 1980)


def test_idle_gpu_reports_idle(gpu: SimGpu, clock: ManualClock) -> None:
    assert gpu.power_w() == pytest.approx(H100.idle_w)
    assert gpu.sm_clock_mhz() == 345
    assert gpu.utilization_pct() == (0.0, 0.0)
    assert gpu.throttle_reasons() == frozenset({"idle"})
    assert gpu.temperature_c() < 40


def test_background_load_gives_non_idle_power(tmp_path: Path, clock: ManualClock) -> None:
    gpu = SimGpu(tmp_path, 0, clock=clock, background_load=0.5, mem_share=0.3)
    busy = H100.busy_power_w(1980, 0.3)
    expected = H100.idle_w + 0.5 * (busy - H100.idle_w)
    assert gpu.power_w() == pytest.approx(expected)
    e0 = gpu.energy_j()
    clock.advance(10.0)
    assert gpu.energy_j() - e0 == pytest.approx(10 * expected)
    assert gpu.power_w() == pytest.approx(expected)
    assert gpu.utilization_pct()[0] == pytest.approx(50.0)
    assert gpu.sm_clock_mhz() == 1980


# ---------------------------------------------------------------- the energy counter


def test_counter_is_an_int_in_mj_and_monotonic(gpu: SimGpu, clock: ManualClock) -> None:
    start = gpu.energy_mj()
    assert isinstance(start, int)
    clock.advance(10.0)
    assert gpu.energy_mj() - start == pytest.approx(10 * H100.idle_w * 1000, abs=1)  # mJ
    seen = [gpu.energy_mj()]
    for i in range(30):
        if i % 3 == 0:
            gpu.run_step(2e13, 0.1 * (i % 5), "bf16")
        if i % 7 == 0:
            gpu.set_locked_clocks(345, 900 + 30 * i)
        clock.advance(0.05 * (i % 4))
        seen.append(gpu.energy_mj())
    clock.advance(-5.0)  # a wall clock stepping back never makes the counter go back
    seen.append(gpu.energy_mj())
    assert seen == sorted(seen)


def test_step_energy_plus_idle_equals_counter_delta(gpu: SimGpu, clock: ManualClock) -> None:
    e0 = gpu.energy_j()
    steps_j = 0.0
    busy_s = 0.0
    wall_s = 0.0
    for i in range(40):
        cost = gpu.run_step(5e13, mem_share=0.05 * (i % 10), precision="bf16")
        steps_j += cost.energy_j
        busy_s += cost.duration_s
        gap = cost.duration_s + 0.02 * (i % 3)  # the job waits between steps
        clock.advance(gap)
        wall_s += gap
    idle_j = H100.idle_w * (wall_s - busy_s)
    delta = gpu.energy_j() - e0
    assert delta - idle_j == pytest.approx(steps_j, rel=1e-3)
    # and through the integer mJ counter too
    assert gpu.energy_mj() / 1000 == pytest.approx(gpu.energy_j(), abs=1e-3)


def test_busy_credit_avoids_double_counting(gpu: SimGpu, clock: ManualClock) -> None:
    e0 = gpu.energy_j()
    cost = gpu.run_step(BF16_STEP_FLOPS, 0.0, "bf16")
    assert gpu.energy_j() - e0 == pytest.approx(cost.energy_j)  # added at once
    assert gpu.busy()
    clock.advance(cost.duration_s / 2)
    assert gpu.energy_j() - e0 == pytest.approx(cost.energy_j)  # no idle on top while busy
    assert gpu.utilization_pct()[0] == 100.0
    clock.advance(cost.duration_s / 2 + 3.0)
    assert not gpu.busy()
    assert gpu.energy_j() - e0 == pytest.approx(cost.energy_j + 3.0 * H100.idle_w)


def test_deferred_steps_cost_the_same_and_reach_the_file_within_a_second(
    tmp_path: Path, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    now, later = SimGpu(tmp_path / "a", 0, clock=clock), SimGpu(tmp_path / "b", 0, clock=clock)
    other = SimGpu(tmp_path / "b", 0, clock=clock)  # another process's view of the file
    work = [(5e13, 0.1 * i, "bf16") for i in range(5)]
    file_before = json.loads(later.path.read_text())["energy_mj"]
    assert later.run_steps(work, defer=True) == now.run_steps(work)  # costed at the same settings
    # This object's readings have them at once, as if written ...
    assert later.energy_j() == pytest.approx(now.energy_j()) and later.busy()
    assert later.state().busy_credit_s == pytest.approx(now.state().busy_credit_s)
    # ... but the file waits (a daemon under load writes it once a second, not per report).
    assert json.loads(later.path.read_text())["energy_mj"] == file_before
    assert other.energy_j() < now.energy_j()
    monkeypatch.setattr(device_module, "_COMMIT_EVERY_S", 0.0)  # a second later
    clock.advance(0.5)
    assert later.energy_j() == pytest.approx(now.energy_j())
    assert other.energy_j() == pytest.approx(now.energy_j()) and other.busy()
    # A change of settings writes them first: they ran at the old settings.
    monkeypatch.setattr(device_module, "_COMMIT_EVERY_S", 3600.0)
    later.run_steps(work, defer=True)
    now.run_steps(work)
    later.set_power_limit_w(400)
    now.set_power_limit_w(400)
    clock.advance(30.0)
    assert other.energy_j() == pytest.approx(now.energy_j())
    # Another process's change of the file is taken in, the deferred steps booked on it.
    later.run_steps(work, defer=True)
    now.run_steps(work)
    other.set_background_load(0.5)
    now.set_background_load(0.5)
    clock.advance(2.0)
    assert later.energy_j() == pytest.approx(now.energy_j())
    assert later.background_load() == 0.5
    later.close()  # close() writes what is deferred
    assert other.energy_j() == pytest.approx(now.energy_j())


def test_a_reading_while_deferred_steps_are_written_still_counts_them(
    tmp_path: Path, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reading from another thread (the daemon's tick) while the deferred steps are
    being written (an IPC thread) sees them: were the deferred list cleared before the
    file held them, the reading would fall back by the steps' energy, and an energy
    ledger that skips a fall would count them twice."""
    g = SimGpu(tmp_path, 0, clock=clock)
    g.run_steps([(5e13, None, "bf16")] * 4, defer=True)
    before = g.energy_mj()
    seen: list[int] = []
    readers: list[threading.Thread] = []
    real_write = device_module.write_json_atomic

    def write_with_a_reading_inside(path: Path, data: object, **kw: bool) -> int | None:
        t = threading.Thread(target=lambda: seen.append(g.energy_mj()))
        t.start()
        t.join(0.2)  # it may wait for the write: then it reads once the write is done
        readers.append(t)
        return real_write(path, data, **kw)

    monkeypatch.setattr(device_module, "write_json_atomic", write_with_a_reading_inside)
    g.commit()
    for t in readers:
        t.join(5)
    assert readers and len(seen) == len(readers)
    assert min(seen) >= before
    assert g.energy_mj() >= before and json.loads(g.path.read_text())["energy_mj"] >= before


def test_a_parse_begun_before_a_write_does_not_install_the_older_state(
    tmp_path: Path, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reading thread parses the file another process wrote while this object's steps
    are written (another thread): the older state it parsed must not replace the newer
    one, or readings would fall back by the steps' energy until the next look at the
    file (and an energy ledger would take the fall for a counter reset)."""
    g = SimGpu(tmp_path, 0, clock=clock, refresh_s=60.0)
    SimGpu(tmp_path, 0, clock=clock).set_background_load(0.2)  # another process writes
    parsing, go = threading.Event(), threading.Event()
    real_from_json = SimState.from_json

    def slow_from_json(d: Any) -> SimState:
        if threading.current_thread().name == "reader":
            parsing.set()
            go.wait(5)
        return real_from_json(d)

    monkeypatch.setattr(SimState, "from_json", staticmethod(slow_from_json))
    g._cache_checked_s = -1e18  # (the reading looks at the file now)
    reader = threading.Thread(target=g.energy_mj, name="reader")
    reader.start()
    assert parsing.wait(5)

    def book_and_write() -> None:
        g.run_steps([(5e13, None, "bf16")] * 4, defer=True)
        g.commit()

    writer = threading.Thread(target=book_and_write)
    writer.start()
    writer.join(0.3)  # (it waits for the parse, where the lock is kept)
    go.set()
    reader.join(5)
    writer.join(5)
    assert not reader.is_alive() and not writer.is_alive()
    in_file = json.loads(g.path.read_text())["energy_mj"]
    assert g.energy_mj() >= int(in_file)  # the state this object wrote, not the older one


def test_step_cost_has_no_side_effects(gpu: SimGpu) -> None:
    before = gpu.energy_mj()
    a = gpu.step_cost(BF16_STEP_FLOPS, 0.3, "bf16")
    assert gpu.energy_mj() == before and not gpu.busy()
    b = gpu.run_step(BF16_STEP_FLOPS, 0.3, "bf16")
    assert a == b


def test_power_is_a_one_second_average_of_the_counter(gpu: SimGpu, clock: ManualClock) -> None:
    for _ in range(3):
        gpu.power_w()
        clock.advance(0.5)
    cost = gpu.run_step(2e14, 0.0, "bf16")  # ~0.4 s at 680 W
    assert cost.duration_s < 0.5
    clock.advance(0.5)
    avg = gpu.power_w()
    # the window [t-1, t] holds the step's energy and idle power for the rest
    expected = (cost.energy_j + H100.idle_w * (1.0 - cost.duration_s)) / 1.0
    assert avg == pytest.approx(expected, rel=1e-6)
    assert H100.idle_w < avg < cost.power_w


# ---------------------------------------------------------------- state on disk


def test_second_instance_sees_the_same_device(tmp_path: Path, clock: ManualClock) -> None:
    a = SimGpu(tmp_path, 0, clock=clock, initial_energy_mj=5_000_000)
    a.set_locked_clocks(345, 1500)
    a.set_power_limit_w(450)
    a.run_step(BF16_STEP_FLOPS, 0.2, "bf16")
    b = SimGpu(tmp_path, 0, clock=clock, initial_energy_mj=0)  # loads, does not reset
    assert b.locked_clocks_mhz() == (345, 1500)
    assert b.power_limit_w() == 450
    assert b.energy_mj() == a.energy_mj() > 5_000_000
    assert b.uuid == a.uuid
    b.reset_locked_clocks()
    assert a.locked_clocks_mhz() is None  # a sees b's write


def test_caps_survive_a_killed_process(tmp_path: Path) -> None:
    code = (
        "import os, signal\n"
        "from greend.probes.sim import SimGpu\n"
        f"g = SimGpu({str(tmp_path)!r}, 1)\n"
        "g.set_locked_clocks(900, 1200)\n"
        "g.set_power_limit_w(333)\n"
        "g.run_step(1e14, 0.0, 'bf16')\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    gpu = SimGpu(tmp_path, 1)
    assert gpu.locked_clocks_mhz() == (900, 1200)
    assert gpu.power_limit_w() == 333
    assert gpu.energy_mj() > 0
    assert not list(tmp_path.glob(".*.tmp"))


def test_state_file_is_json_written_atomically(gpu: SimGpu) -> None:
    gpu.set_power_limit_w(500)
    data = json.loads(gpu.path.read_text())
    assert data["power_limit_mw"] == 500_000
    assert data["index"] == 0
    assert not list(gpu.path.parent.glob(".*.tmp"))


def test_corrupt_state_is_a_state_error(tmp_path: Path) -> None:
    (tmp_path / "gpu0.json").write_text("{not json")
    with pytest.raises(StateError, match="corrupt"):
        SimGpu(tmp_path, 0)


def test_open_sim_gpus_and_per_gpu_params(tmp_path: Path, clock: ManualClock) -> None:
    gpus = open_sim_gpus(tmp_path, 3, clock=clock, speed_factor=[1.0, 1.0, 1.5], mem_share=0.4)
    assert [g.index for g in gpus] == [0, 1, 2]
    assert [g.speed_factor() for g in gpus] == [1.0, 1.0, 1.5]
    assert all(g.mem_share() == 0.4 for g in gpus)
    assert discover_sim_gpus(tmp_path) == 3
    assert len({g.uuid for g in gpus}) == 3
    with pytest.raises(ValueError, match="one per GPU"):
        open_sim_gpus(tmp_path, 3, speed_factor=[1.0])


# ---------------------------------------------------------------- ground truth


@pytest.mark.parametrize("mem_share", [0.0, 0.3, 0.6, 0.9])
def test_optimum_respects_the_slowdown_bound(mem_share: float) -> None:
    opt = H100.optimum(BF16_STEP_FLOPS, mem_share, "bf16", max_slowdown=0.05)
    assert opt.duration_s <= 1.05 * opt.baseline_duration_s * (1 + 1e-9)
    assert opt.energy_j <= opt.baseline_energy_j
    assert opt.clock_mhz in H100.supported_sm_clocks_mhz
    feasible = [
        r
        for r in H100.sweep(BF16_STEP_FLOPS, mem_share, "bf16")
        if r.duration_s <= 1.05 * opt.baseline_duration_s * (1 + 1e-9)
    ]
    assert opt.energy_j == pytest.approx(min(r.energy_j for r in feasible))


def test_optimum_differs_between_compute_and_memory_bound() -> None:
    compute = H100.optimum(BF16_STEP_FLOPS, 0.0, "bf16")
    memory = H100.optimum(BF16_STEP_FLOPS, 0.9, "bf16")
    assert memory.clock_mhz < compute.clock_mhz - 300
    assert memory.energy_saving > compute.energy_saving > 0.0
    assert 0 < compute.slowdown <= 0.05 + 1e-9
    assert H100.optimum(BF16_STEP_FLOPS, 0.0, "bf16", max_slowdown=0.0).clock_mhz == 1980


def test_sweep_lists_every_clock(gpu: SimGpu) -> None:
    rows = gpu.sweep(BF16_STEP_FLOPS, 0.5, "bf16")
    assert [r.clock_mhz for r in rows] == list(H100.supported_sm_clocks_mhz)
    times = [r.duration_s for r in rows]
    assert times == sorted(times)  # lower clock, longer step
    assert gpu.optimum(BF16_STEP_FLOPS, 0.5, "bf16").clock_mhz < 1980


def test_concurrent_writers_lose_no_step(tmp_path: Path) -> None:
    """Two processes running steps on one device: the lock keeps every step's energy."""
    gpu = SimGpu(tmp_path, 0)
    step = gpu.step_cost(1e12, 0.0, "bf16")
    e0, t0 = gpu.energy_j(), time.time()
    code = (
        "from greend.probes.sim import SimGpu\n"
        f"g = SimGpu({str(tmp_path)!r}, 0)\n"
        "for _ in range(40):\n"
        "    g.run_step(1e12, 0.0, 'bf16')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(2)]
    assert [p.wait(timeout=30) for p in procs] == [0, 0]
    delta = gpu.energy_j() - e0
    steps_j = 80 * step.energy_j
    assert steps_j <= delta <= steps_j + H100.idle_w * (time.time() - t0) + 1e-6


def test_lower_precision_shrinks_compute_by_peak_rate_and_memory_by_bytes() -> None:
    from greend.probes.sim import H100

    flops, m = 1e12, 0.3
    fp32_compute = flops / (H100.peak_flops.fp32 * H100.mfu)
    fp32_memory = fp32_compute * m / (1 - m)
    assert H100.mem_share_at(m, "fp32") == m
    t32 = H100.step_time_s(flops, H100.sm_clock_max_mhz, m, "fp32")
    assert t32 == pytest.approx(fp32_compute + fp32_memory)
    for level, bytes_ in (("bf16", 2), ("fp8", 2), ("fp8-emulated", 2)):
        compute = flops / (H100.compute_rate(level) * H100.mfu)
        memory = fp32_memory * bytes_ / 4
        t = H100.step_time_s(flops, H100.sm_clock_max_mhz, m, level)
        assert t == pytest.approx(compute + memory), level
        assert H100.mem_share_at(m, level) == pytest.approx(memory / (compute + memory))
    # So bf16 buys less on a memory-bound step than its peak rate says (sim).
    e = {lvl: H100.step_cost(flops, 0.8, lvl).energy_j for lvl in ("fp32", "bf16")}
    assert 0.2 < e["bf16"] / e["fp32"] < 0.5
    assert H100.mem_share_at(0.0, "bf16") == 0.0 and H100.mem_share_at(0.95, "fp8") == 0.95


def test_fp8_training_is_calibrated_to_published_runs_not_the_datasheet() -> None:
    """fp8 over bf16 at the same clock (sim): 1.25x on a workload 0.3 memory bound in
    bf16 (torchao float8, Llama3-8B on 8 H100s: 1.12-1.25x), little on a memory-bound
    one, and never the datasheet's 2x; the emulated level is priced as fp8."""
    from greend.probes.sim import H100

    f = H100.sm_clock_max_mhz
    lo = H100.fp32_mem_share(0.3, "bf16")  # the fp32 share of a workload 0.3 memory bound in bf16
    assert H100.mem_share_at(lo, "bf16") == pytest.approx(0.3)
    speedup = H100.step_time_s(1e15, f, lo, "bf16") / H100.step_time_s(1e15, f, lo, "fp8")
    assert speedup == pytest.approx(1.25, abs=0.01)
    memory_bound = H100.step_time_s(1e15, f, 0.3, "bf16") / H100.step_time_s(1e15, f, 0.3, "fp8")
    assert 1.0 < memory_bound < 1.1
    compute_bound = H100.step_time_s(1e15, f, 0.0, "bf16") / H100.step_time_s(1e15, f, 0.0, "fp8")
    assert compute_bound == pytest.approx(1.4) and compute_bound < 2.0
    assert H100.step_cost(1e15, 0.05, "fp8-emulated") == H100.step_cost(1e15, 0.05, "fp8")
