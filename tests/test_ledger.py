from __future__ import annotations

import pytest

from greend.ledger import Ledger


def test_totals_since_first_reading_and_windows() -> None:
    led = Ledger(history_s=100, hz=10)
    for i in range(11):  # 100 W for 1 s, starting from an arbitrary counter origin
        led.record("gpu0", i * 0.1, 5000.0 + 10.0 * i)
    assert led.total_j("gpu0") == pytest.approx(100.0)
    assert led.energy_between("gpu0", 0.25, 0.75) == pytest.approx(50.0)
    assert led.power_w("gpu0", window_s=0.5) == pytest.approx(100.0)
    assert led.energy_between("gpu0", -1.0, 0.5) is None  # before the history: unknown, not 0


def test_probe_restart_never_loses_energy() -> None:
    led = Ledger()
    led.record("gpu0", 0.0, 0.0)
    led.record("gpu0", 1.0, 300.0)
    led.record("gpu0", 2.0, 20.0)  # the probe reopened: its counter starts again
    led.record("gpu0", 3.0, 120.0)
    assert led.total_j("gpu0") == pytest.approx(420.0)


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
    assert led.cumulative_at("k", 10.0) is None  # fell out of the window
    assert led.energy_between("k", 990.0, 995.0) == pytest.approx(5.0)
