from __future__ import annotations

import pytest

from greend.jobs.ledger import Ledger


def test_totals_since_first_reading_and_windows() -> None:
    led = Ledger(history_s=100, hz=10)
    for i in range(11):  # 100 W for 1 s, starting from an arbitrary counter origin
        led.record("gpu0", i * 0.1, 5000.0 + 10.0 * i)
    assert led.total_j("gpu0") == pytest.approx(100.0)
    assert led.energy_between("gpu0", 0.25, 0.75) == pytest.approx(50.0)
    assert led.power_w("gpu0", window_s=0.5) == pytest.approx(100.0)
    assert led.energy_between("gpu0", -1.0, 0.5) is None  # before the history: unknown, not 0


@pytest.mark.parametrize("source", [None, "GPU-A"])
def test_probe_restart_never_loses_energy(source: str | None) -> None:
    led = Ledger()
    led.record("gpu0", 0.0, 0.0, source=source)
    led.record("gpu0", 1.0, 300.0, source=source)
    led.record("gpu0", 2.0, 20.0, source=source)  # the probe reopened: its counter starts again
    led.record("gpu0", 3.0, 120.0, source=source)
    assert led.total_j("gpu0") == pytest.approx(420.0)


def test_a_count_the_probe_takes_back_within_one_opening_is_owed_not_a_restart() -> None:
    """The NVML probe booked a counter read 500 J ahead, then took it back (the reads
    around it showed a glitch): its count fell within one opening of the GPU (the same
    epoch). That fall was read as a restart and the whole count so far was booked again
    (9,300 -> 19,436 J in a second in a red-team's run). Now the 500 J are owed: the series
    holds, never falls (a store or Prometheus reads a fall as a counter reset), and the next
    readings pay it off; a fall with a new epoch (the GPU opened again) is a restart."""
    led = Ledger()
    for t, e in ((0.0, 0.0), (1.0, 300.0), (2.0, 1100.0), (3.0, 900.0), (4.0, 1200.0), (5.0, 1500.0)):
        led.record("gpu0", t, e, source="GPU-A", epoch=7)  # 2.0: 500 J ahead; 3.0: taken back
    series = [led.energy_between("gpu0", 0.0, t) for t in (1.0, 2.0, 3.0, 4.0, 5.0)]
    assert series == pytest.approx([300.0, 1100.0, 1100.0, 1200.0, 1500.0])  # (never falls)
    assert led.total_j("gpu0") == pytest.approx(1500.0)  # the probe's count, once paid off
    led.record("gpu0", 6.0, 40.0, source="GPU-A", epoch=8)  # opened again: from 0
    assert led.total_j("gpu0") == pytest.approx(1540.0)
    old = Ledger()  # a probe that says no epoch: a fall is a restart, as before
    for t, e in ((0.0, 0.0), (1.0, 300.0), (2.0, 100.0)):
        old.record("gpu0", t, e, source="GPU-A")
    assert old.total_j("gpu0") == pytest.approx(400.0)


def test_a_key_that_another_gpu_reads_under_books_no_jump() -> None:
    """GPU A (300 W) falls off the bus and NVML renumbers: gpu0 is now GPU B (70 W, its
    own count 700 J), gpu1 GPU C (its count 3000 J). gpu0's fall was read as a counter
    restart and B's whole count added to A's; gpu1's rise from B's count to C's was
    booked in full: more energy than the node could draw. Each key goes on from where
    it was with what its device drew since its own last reading (B's from t=10, under
    gpu1 then; C was never read: nothing before its first reading). And back: once NVML
    numbers as before, B's rise since it last read as gpu1 is not booked to gpu1 again."""
    led = Ledger()
    for t in range(11):  # 10 s: A 300 W on gpu0, B 70 W on gpu1
        led.record("gpu0", float(t), 300.0 * t, source="GPU-A")
        led.record("gpu1", float(t), 70.0 * t, source="GPU-B")
    for t in range(11, 16):  # renumbered: B on gpu0, C (300 W, counted 3000 J so far) on gpu1
        led.record("gpu0", float(t), 70.0 * t, source="GPU-B")
        led.record("gpu1", float(t), 300.0 * t, source="GPU-C")
    assert led.total_j("gpu0") == pytest.approx(3000.0 + 70.0 * 5)  # A's 10 s, then B's 5 s
    assert led.total_j("gpu1") == pytest.approx(700.0 + 300.0 * 4)  # B's 10 s, then C's 4 s after its first reading
    assert led.energy_between("gpu1", 10.0, 11.0) == pytest.approx(0.0)  # C's count before: not this node's to book
    for t in range(16, 21):  # numbered as before: A (back, counted on) on gpu0, B on gpu1
        led.record("gpu0", float(t), 300.0 * t, source="GPU-A")
        led.record("gpu1", float(t), 70.0 * t, source="GPU-B")
    # gpu0: B to t=15, then A's draw since its own last reading (t=10: lost meanwhile, counted on).
    assert led.total_j("gpu0") == pytest.approx(3000.0 + 70.0 * 5 + 300.0 * 10)
    assert led.total_j("gpu1") == pytest.approx(700.0 + 300.0 * 4 + 70.0 * 5)  # B's t=15-20, once


def test_uncounted_zones_stay_out_of_totals() -> None:
    led = Ledger()
    for t, e in ((0.0, 0.0), (1.0, 50.0)):
        led.record("cpu:intel-rapl:0", t, e)
        led.record("cpu:intel-rapl:0:0", t, e * 0.6, counted=False)  # core, inside the package
    assert led.totals("cpu:") == pytest.approx(50.0)
    assert led.totals("cpu:", counted_only=False) == pytest.approx(80.0)


def test_history_is_bounded() -> None:
    led = Ledger(history_s=1, hz=10)
    for i in range(1000):
        led.record("k", float(i), float(i))
    assert led.total_j("k") == pytest.approx(999.0)
    assert len(led._entries["k"].times) == 16  # the fine history keeps its bound
    assert led.cumulative_at("k", 10.0) == pytest.approx(10.0)  # older: from the coarse one
    assert led.energy_between("k", 990.0, 995.0) == pytest.approx(5.0)


def test_windows_older_than_the_fine_history_come_from_the_coarse_one() -> None:
    # A training job of days: its window starts long before the fine history (here 60 s).
    # 10 Hz for 30 simulated hours at a power that changes every hour (200 W, 300 W, ...).
    led = Ledger(history_s=60, hz=10)
    hz, hours = 10, 30
    energy = 0.0
    truth_at: dict[int, float] = {}
    for i in range(hours * 3600 * hz + 1):
        t = i / hz
        if i % (3600 * hz) == 0:
            truth_at[i // (3600 * hz)] = energy
        led.record("gpu0", t, 1e6 + energy)  # a counter origin that is not 0
        energy += (200.0 + 100.0 * ((i // (3600 * hz)) % 3)) / hz
    e = led._entries["gpu0"]
    assert len(e.times) == 60 * hz + 1 and len(e.coarse_times) <= 8192  # both tiers bounded
    assert e.coarse_times[0] == 0.0  # the origin is never dropped
    for h0, h1 in ((0, 30), (0, 1), (5, 29), (29, 30)):
        got = led.energy_between("gpu0", h0 * 3600.0, h1 * 3600.0)
        assert got == pytest.approx(truth_at[h1] - truth_at[h0], rel=1e-3), (h0, h1)
    # Mid-hour, between coarse points: interpolated, within one coarse step's energy.
    got = led.energy_between("gpu0", 1800.0, 30 * 3600.0)
    assert got == pytest.approx(truth_at[30] - 1800.0 * 200.0, rel=1e-3)
    assert led.energy_between("gpu0", -1.0, 10.0) is None  # before the first reading


def test_a_coarse_step_longer_than_the_fine_history_still_prices_windows() -> None:
    led = Ledger(history_s=1, hz=10, coarse_step_s=5.0)
    for i in range(201):  # 100 W, 20 s
        led.record("k", i / 10, 10.0 * i)
    # 3.0 s lies after the coarse point at 0 s and before the next one at 5 s, which the
    # fine history (the last second) no longer holds.
    assert led.energy_between("k", 3.0, 20.0) == pytest.approx(1700.0)
    assert led.energy_between("k", 7.5, 19.5) == pytest.approx(1200.0)


def test_clamp_prices_a_window_from_the_first_reading() -> None:
    led = Ledger()
    for i in range(11):  # 100 W from t = 5 s
        led.record("gpu0", 5.0 + i * 0.1, 10.0 * i)
    assert led.energy_between("gpu0", 4.0, 6.0) is None
    assert led.energy_between("gpu0", 4.0, 6.0, clamp=True) == pytest.approx(100.0)
    assert led.energy_between("gpu0", 1.0, 2.0, clamp=True) is None  # wholly before it


def test_an_ended_jobs_series_is_thinned_for_its_plot() -> None:
    """Up to 200 ended jobs are kept: each keeps at most ENDED_SERIES_POINTS + 1 samples of
    its series (every k-th and the last), in order, not the 7200 a running job may hold."""
    from collections import deque

    from greend.jobs.booking import thinned
    from greend.jobs.records import EfficiencySample
    from greend.jobs.registry import ENDED_SERIES_POINTS

    full = deque((EfficiencySample(float(i), 1.0, 1.0, 1.0) for i in range(7200)), maxlen=7200)
    kept = thinned(full, ENDED_SERIES_POINTS)
    ts = [e.t_s for e in kept]
    assert len(kept) <= ENDED_SERIES_POINTS + 1 and ts == sorted(ts)
    assert ts[0] == 0.0 and ts[-1] == 7199.0
    short = deque((EfficiencySample(float(i), 1.0, 1.0, 1.0) for i in range(10)), maxlen=7200)
    assert thinned(short, ENDED_SERIES_POINTS) is short
