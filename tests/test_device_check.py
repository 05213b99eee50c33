"""bench/device_check.py: its figures' arithmetic, its read-only guard, and the script itself
on a machine without a GPU (every GPU part skipped by name, exit 0, the JSON written) and
on the NVML stand-in (the real pynvml over tests/nvml_stub) with the torch parts on the CPU."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from tests.nvml_stub import stub_env
from tests.support import REPO

SCRIPT = REPO / "bench" / "device_check.py"


def _dc() -> Any:
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["device_check"] = mod  # its dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def _run(tmp: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 240) -> tuple[int, dict, str]:
    out = tmp / "dc.json"
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(out), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=timeout,
    )
    return p.returncode, json.loads(out.read_text()), p.stdout + p.stderr


# ---- the arithmetic


def test_trapezoid_integrates_power_over_the_window() -> None:
    dc = _dc()
    samples = [(0.0, 100.0), (1.0, 200.0), (2.0, 200.0), (3.0, 0.0)]
    assert dc.trapezoid_j(samples) == pytest.approx(150 + 200 + 100)
    assert dc.trapezoid_j(samples, 1.0, 2.0) == pytest.approx(200.0)
    assert dc.trapezoid_j([(0.0, 5.0)]) == 0.0


def test_agreement_is_signed_percent_of_the_reference() -> None:
    dc = _dc()
    assert dc.agreement_pct(102.0, 100.0) == pytest.approx(2.0)
    assert dc.agreement_pct(97.0, 100.0) == pytest.approx(-3.0)
    assert dc.agreement_pct(0.0, 0.0) == 0.0 and math.isinf(dc.agreement_pct(1.0, 0.0))


def test_counter_update_period_is_the_median_gap_between_changes() -> None:
    dc = _dc()
    reads = [(0.00, 1), (0.01, 1), (0.02, 2), (0.03, 2), (0.12, 3), (0.13, 3), (0.22, 4)]
    assert dc.update_period_s(reads) == pytest.approx(0.10)
    assert dc.update_period_s([(0.0, 1), (1.0, 1)]) is None


def test_percentile_interpolates() -> None:
    dc = _dc()
    assert dc.pct([1, 2, 3, 4, 5], 50) == 3
    assert dc.pct([0, 10], 99) == pytest.approx(9.9)
    assert math.isnan(dc.pct([], 50))


def test_a_sync_is_greends_when_any_frame_lies_in_its_package(tmp_path: Path) -> None:
    dc = _dc()
    pkg = str(tmp_path / "greend")
    assert dc.attribute_sync(["/u/train.py", f"{pkg}/training/step.py", "/t/torch/x.py"], [pkg]) == "greend"
    assert dc.attribute_sync(["/u/train.py", "/t/torch/x.py", f"{pkg}-other/y.py"], [pkg]) == "workload"


def test_ratio_rows_put_the_gpus_ratio_beside_the_sims() -> None:
    dc = _dc()
    sim = {lvl: {"step_s": s, "energy_j": s * 500, "power_w": 500.0} for lvl, s in
           (("fp32", 1.0), ("tf32", 0.4), ("bf16", 0.2), ("fp8", 0.1))}  # fmt: skip
    gpu = {"fp32": {"step_s": 1.0, "energy_j": 600.0, "power_w": 600.0},
           "bf16": {"step_s": 0.4, "energy_j": 200.0, "power_w": 500.0}}  # fmt: skip
    rows = {r["ratio"]: r for r in dc.ratio_rows(gpu, sim)}
    assert rows["step_s bf16/fp32"]["gpu"] == pytest.approx(0.4)
    assert rows["step_s bf16/fp32"]["sim"] == pytest.approx(0.2)
    assert rows["step_s bf16/fp32"]["sim_over_gpu"] == pytest.approx(0.5)
    assert rows["energy_j bf16/fp32"]["gpu"] == pytest.approx(1 / 3)
    assert rows["step_s fp8/bf16"]["gpu"] is None and rows["step_s fp8/bf16"]["sim"] == pytest.approx(0.5)
    assert len(rows) == 12  # tf32, bf16, fp8 against fp32, fp8 against bf16; time, energy, power


def test_settings_diff_names_what_changed() -> None:
    dc = _dc()
    assert dc.settings_diff({"a": 1, "b": 2}, {"a": 1, "b": 2}) == []
    assert dc.settings_diff({"power_limit_mw": 700000}, {"power_limit_mw": 500000}) == [
        "power_limit_mw: 700000 -> 500000"
    ]


# ---- the read-only guard


def test_every_nvml_writer_greend_knows_is_refused_and_no_reader() -> None:
    dc = _dc()
    writers = ["nvmlDeviceSetGpuLockedClocks", "nvmlDeviceResetGpuLockedClocks", "nvmlDeviceSetPowerManagementLimit",
               "nvmlDeviceSetPersistenceMode", "nvmlDeviceSetMigMode", "nvmlDeviceSetApplicationsClocks",
               "nvmlDeviceResetApplicationsClocks", "nvmlDeviceClearEccErrorCounts", "nvmlDeviceSetComputeMode",
               "nvmlGpuInstanceCreateComputeInstance", "nvmlDeviceCreateGpuInstance", "nvmlUnitSetLedState",
               "nvmlDeviceModifyDrainState", "nvmlDeviceDiscoverGpus", "nvmlEventSetCreate",
               "nvmlGpmSetStreamingEnabled"]  # fmt: skip
    readers = ["nvmlInit", "nvmlShutdown", "nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetPowerUsage",
               "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetMigMode", "nvmlSystemGetDriverVersion",
               "nvmlDeviceGetPowerManagementLimitConstraints", "nvmlErrorString", "nvmlDeviceGetCount",
               # GPM (SM activity): host buffers filled from the counters, no setting changed
               "nvmlGpmQueryDeviceSupport", "nvmlGpmSampleAlloc", "nvmlGpmSampleGet", "nvmlGpmMetricsGet",
               "nvmlGpmSampleFree"]  # fmt: skip
    assert [w for w in writers if not dc.is_nvml_writer(w)] == []
    assert [r for r in readers if dc.is_nvml_writer(r)] == []


def test_the_guard_refuses_a_write_records_it_and_keeps_reads(tmp_path: Path) -> None:
    dc = _dc()
    calls: list[str] = []
    fake = types.SimpleNamespace(
        nvmlDeviceGetPowerUsage=lambda h: 300_000,
        nvmlDeviceSetPowerManagementLimit=lambda h, mw: calls.append("set"),
    )
    log = tmp_path / "writes.txt"
    assert dc.guard_nvml(fake, str(log)) == ["nvmlDeviceSetPowerManagementLimit"]
    assert dc.guard_nvml(fake, str(log)) == ["nvmlDeviceSetPowerManagementLimit"]  # idempotent
    assert fake.nvmlDeviceGetPowerUsage(None) == 300_000
    with pytest.raises(dc.ReadOnlyViolation, match="read-only"):
        fake.nvmlDeviceSetPowerManagementLimit(None, 200_000)
    assert calls == [] and log.read_text().splitlines() == [
        "# guarded 1",
        "# guarded 1",
        "nvmlDeviceSetPowerManagementLimit",
    ]
    assert dc.ATTEMPTS == ["nvmlDeviceSetPowerManagementLimit"]


def test_the_guard_covers_the_real_bindings_setters() -> None:
    pynvml = pytest.importorskip("pynvml")
    dc = _dc()
    mod = types.SimpleNamespace(**{k: getattr(pynvml, k) for k in dir(pynvml) if k.startswith("nvml")})
    guarded = set(dc.guard_nvml(mod))
    for name in (
        "nvmlDeviceSetGpuLockedClocks",
        "nvmlDeviceResetGpuLockedClocks",
        "nvmlDeviceSetPowerManagementLimit",
        "nvmlDeviceSetPersistenceMode",
        "nvmlDeviceSetMigMode",
        "nvmlDeviceSetApplicationsClocks",
    ):
        assert name in guarded
    assert not {n for n in guarded if n.startswith("nvmlDeviceGet")}


def test_a_write_attempt_makes_the_run_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dc = _dc()
    fake = types.SimpleNamespace(nvmlDeviceSetGpuLockedClocks=lambda *a: None)

    def writes(ctx: Any) -> list[Any]:
        dc.guard_nvml(fake)
        fake.nvmlDeviceSetGpuLockedClocks(None, 1000, 1000)
        return []

    monkeypatch.setitem(dc.PART_FNS, "sim", writes)
    out = tmp_path / "dc.json"
    assert dc.main(["--json", str(out), "--only", "sim"]) == 2
    rep = json.loads(out.read_text())
    assert rep["read_only"]["writes_refused"] == ["nvmlDeviceSetGpuLockedClocks"]
    assert rep["parts"]["sim"]["status"] == "failed" and "ReadOnlyViolation" in rep["parts"]["sim"]["why"]


# ---- the script


def test_without_a_gpu_every_gpu_part_is_skipped_by_name_and_the_json_written(tmp_path: Path) -> None:
    env = {k: v for k, v in stub_env().items() if k != "LD_LIBRARY_PATH"}  # no NVML at all
    rc, rep, out = _run(tmp_path, env=env, timeout=120)
    assert rc == 0, out
    parts = rep["parts"]
    assert list(parts) == ["nvml", "daemon", "hotpath", "precision", "sim"]
    for name in ("nvml", "daemon"):
        assert parts[name]["status"] == "skipped" and "no NVML" in parts[name]["why"], parts[name]
    for name in ("hotpath", "precision"):
        assert parts[name]["status"] == "skipped" and "no CUDA device" in parts[name]["why"], parts[name]
    assert parts["sim"]["status"] == "skipped" and "no GPU figures" in parts["sim"]["why"]
    assert parts["sim"]["figures"]["step_s bf16/fp32"]["value"] is None  # the GPU's side: none
    assert "sim 0.197x" in parts["sim"]["figures"]["step_s bf16/fp32"]["note"]
    assert rep["gpu"] is None and "no CUDA device" in rep["no_gpu"]
    assert rep["read_only"]["writes_refused"] == [] and rep["read_only"]["settings_changed"] == []
    for name in parts:
        assert f"{name:<10}SKIPPED: " in out


def test_a_spent_budget_skips_each_part_and_says_so(tmp_path: Path) -> None:
    rc, rep, _ = _run(tmp_path, "--budget-s", "0", "--only", "nvml", "sim")
    assert rc == 0
    assert [p["why"] for p in rep["parts"].values()] == ["the time budget (0 s) is spent"] * 2


@pytest.mark.slow
def test_the_nvml_part_on_the_stand_in_agrees_with_its_own_power(tmp_path: Path) -> None:
    env = stub_env(gpus=2, state=tmp_path / "gpus.txt")
    rc, rep, out = _run(tmp_path, "--only", "nvml", "--force-cpu", "--nvml-window-s", "1", env=env, timeout=120)
    assert rc == 0, out
    nv = rep["parts"]["nvml"]
    assert nv["status"] == "ok", nv["why"]
    f = {k: v["value"] for k, v in nv["figures"].items()}
    assert abs(f["counter vs integrated power"]) < 1.0  # the stand-in's counter is its power integrated
    assert f["energy, greend's probe (counter)"] > 0 and f["probe rate flat out"] > 10
    assert 0 < f["probe cost per tick, median"] <= f["probe cost per tick, p99"]
    assert rep["gpu"]["name"] == "NVIDIA H100 80GB HBM3" and rep["gpu"]["driver"]
    assert rep["read_only"]["settings_changed"] == [] and rep["read_only"]["settings_before"]["power_limit_mw"]


@pytest.mark.e2e
@pytest.mark.slow
def test_the_daemon_part_runs_a_job_through_a_dry_run_daemon_on_the_stand_in(tmp_path: Path) -> None:
    env = stub_env(gpus=2, state=tmp_path / "gpus.txt")
    rc, rep, out = _run(tmp_path, "--only", "daemon", "precision", "sim", "--force-cpu", "--job-s", "2", env=env)
    assert rc == 0, out
    d = rep["parts"]["daemon"]
    assert d["status"] == "ok", d["why"]
    f = {k: v["value"] for k, v in d["figures"].items()}
    assert f["daemon dry_run (status)"] is True and f["NVML writes the daemon attempted"] == 0
    assert f["NVML writers guarded in the daemon"] > 20  # the guard was in the daemon's process
    assert f["report GPU energy"] > 0 and abs(f["report vs script energy"]) < 15  # a 2 s job: the ends weigh
    assert f["report FLOPs vs FlopCounterMode"] == pytest.approx(1.0)
    p = rep["parts"]["precision"]
    assert p["status"] == "ok", p["why"]
    assert {"fp32 step", "bf16 step", "fp32 energy per step"} <= set(p["figures"])
    s = rep["parts"]["sim"]
    assert s["status"] == "ok" and s["figures"]["step_s bf16/fp32"]["value"] > 0
    assert rep["read_only"]["writes_refused"] == []
