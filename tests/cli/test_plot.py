"""report --plot: every cap and precision change is marked and labelled (a golden list of
the annotations, not pixels), with honest axes."""

from __future__ import annotations

from pathlib import Path

import pytest

from greend.cli.render import plot_annotations, plot_report

pytest.importorskip("matplotlib")

T0 = 1_700_000_000.0


def report() -> dict:
    series = [
        {"t_s": i * 1.0, "power_w": 600.0 - 20 * i, "gflops_per_w": 40.0 + 10 * i, "flop_per_s": 1e13}
        for i in range(12)
    ]
    return {
        "job": "j",
        "gpu_source": "sim",
        "gpu_energy_j": 5000.0,
        "gflops_per_w": 80.0,
        "gpu_energy_per_step_j": 12.5,
        "first_step_at": T0,
        "series": series,
        "savings": {"saved_pct": 42.0},
        "decisions": [
            {"t": T0 + 2.0, "setting": {"clock_cap_mhz": 1560, "power_limit_w": None}, "reason": "searching"},
            {"t": T0 + 5.0, "setting": {"clock_cap_mhz": 990, "power_limit_w": None}, "reason": "settled"},
            {"t": T0 + 9.0, "setting": {"clock_cap_mhz": None, "power_limit_w": None}, "reason": "re-check"},
        ],
        "precision_log": [{"t": T0 + 3.5, "kind": "switch", "from": "fp32", "to": "bf16", "reason": "loss stable"}],
    }


GOLDEN = ["cap: clock cap 1560 MHz", "switch: fp32 -> bf16", "cap: clock cap 990 MHz", "cap: uncapped"]


def test_every_change_is_annotated_in_time_order(tmp_path: Path) -> None:
    assert [x for x, _ in plot_annotations(report())] == [2.0, 3.5, 5.0, 9.0]
    out = tmp_path / "j.png"
    assert plot_report(report(), out) == GOLDEN
    assert out.stat().st_size > 10_000


def test_the_power_axis_starts_at_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib.figure

    seen = {}
    real = matplotlib.figure.Figure.savefig

    def spy(self, *a, **k):  # type: ignore[no-untyped-def]
        ax = self.axes[0]
        seen["ylim"] = ax.get_ylim()
        seen["legend"] = [t.get_text() for t in ax.get_legend().get_texts()]
        return real(self, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    plot_report(report(), tmp_path / "j.png")
    assert seen["ylim"][0] == 0
    assert "GPU power (sim) (W)" in seen["legend"] and any("clock cap" in s for s in seen["legend"])


def test_a_report_without_series_says_why(tmp_path: Path) -> None:
    r = report()
    r["series"] = []
    r["from_store"] = "/x.db"
    with pytest.raises(RuntimeError, match="from the store has no time series"):
        plot_report(r, tmp_path / "j.png")
