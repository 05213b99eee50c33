"""bench/bench_dvfs.py runs and prints every row it promises (its figures are not
asserted: they are measurements, printed for people to read)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import REPO, load_bench


def _bench():  # type: ignore[no-untyped-def]
    return load_bench("bench_dvfs")


def test_prints_the_table_and_the_seed_summary(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    assert bench.main(["--steps", "300", "--seeds", "2", "--no-traces"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for knob, noise in (("clock", "0%"), ("power", "0%"), ("clock", "2%")):
        for workload in ("compute-bound", "mixed", "memory-bound"):
            assert any(ln.split()[:3] == [knob, noise, workload] for ln in lines), (knob, noise, workload)
    summary = lines[lines.index(next(ln for ln in lines if ln.startswith("clock knob, 2% noise, seeds 1..2"))) :]
    assert [ln.split()[0] for ln in summary[2:5]] == ["compute-bound", "mixed", "memory-bound"]
    for ln in summary[2:5]:  # how many of the 2 seeds met each target
        m = re.search(r"gap (\d+), x (\d+), bound (\d+)$", ln)
        assert m and all(0 <= int(n) <= 2 for n in m.groups()), ln


def test_replays_a_measured_profile(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    trace = str(REPO / "probes" / "traces" / "zeus-gplo-a40" / "A40+resnet50+gpu0.csv")
    assert (
        bench.main(
            [
                "--steps",
                "100",
                "--seeds",
                "1",
                "--noise",
                "0",
                "--trace",
                trace,
                "--trace-steps",
                "300",
                "--trace-seeds",
                "1",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    for objective in (
        ["bound", "5%"],
        ["bound", "10%"],
        ["cost", "eta=0.25"],
        ["cost", "eta=0.5"],
        ["cost", "eta=0.75"],
    ):
        for noise in ("0%", "1%", "2%"):
            assert any(ln.split()[:4] == ["A40+resnet50+gpu0", *objective, noise] for ln in lines), (objective, noise)
    assert sum(ln.startswith("summary (A40 profiles)") for ln in lines) == 4


def test_a_remeasured_profile_moves_each_limit_by_about_a_percent(tmp_path: Path) -> None:
    from greend.probes.trace import TRACE_DIR, load_trace

    bench = _bench()
    src = TRACE_DIR / "zeus-gplo-a40" / "A40+resnet50+gpu0.csv"
    a, b = load_trace(src), load_trace(bench.remeasured(src, 0, tmp_path))
    assert a.limits_w == b.limits_w
    moved = [
        b.time_ratio(w) * b.points[-1].step_time_s / (a.time_ratio(w) * a.points[-1].step_time_s) - 1
        for w in a.limits_w
    ]
    assert all(abs(m) < 0.05 for m in moved) and any(abs(m) > 1e-4 for m in moved)
    assert bench.remeasured(src, 0, tmp_path).read_text() == bench.remeasured(src, 0, tmp_path).read_text()  # seeded
    assert bench.remeasured(src, 1, tmp_path).read_text() != bench.remeasured(src, 0, tmp_path).read_text()


def test_a_zeus_summary_becomes_one_profile_per_job(tmp_path: Path) -> None:
    """Zeus's summary_power_<gpu>.csv (one row per job and limit: time per epoch, average
    power) becomes one per-limit profile per job, energy = time x power, the top limit
    first; a file of another shape is refused with the columns it needs."""
    from greend.probes.trace import load_trace

    bench = _bench()
    src = tmp_path / "summary_power_v100.csv"
    src.write_text(
        "dataset,network,batch_size,optimizer,power_limit,time_per_epoch,average_power\n"
        "cifar100,shufflenetv2,128,adam,100,12.0,90.0\n"
        "cifar100,shufflenetv2,128,adam,250,10.0,200.0\n"
        "cifar100,shufflenetv2,128,adam,175,10.5,160.0\n"
        "imagenet,resnet50,64,adamw,250,100.0,240.0\n"
        "imagenet,resnet50,64,adamw,150,130.0,140.0\n"
    )
    out = tmp_path / "out"
    out.mkdir()
    paths = bench.zeus_summary_profiles(src, out)
    assert [p.name for p in paths] == [
        "V100+cifar100-shufflenetv2-128-adam+gpu0.csv",
        "V100+imagenet-resnet50-64-adamw+gpu0.csv",
    ]
    prof = load_trace(paths[0])
    assert list(prof.limits_w) == [100.0, 175.0, 250.0]
    assert abs(prof.time_ratio(100) - 1.2) < 1e-9 and abs(prof.time_ratio(175) - 1.05) < 1e-9
    assert abs(prof.energy_ratio(100) - 12.0 * 90.0 / 2000.0) < 1e-9
    bad = tmp_path / "other.csv"
    bad.write_text("power_limit,time\n100,1\n")
    with pytest.raises(SystemExit, match="not a Zeus summary_power file"):
        bench.zeus_summary_profiles(bad, out)
