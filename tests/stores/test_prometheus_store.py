"""PrometheusStore: a real HTTP scrape, promtool's linter, and a golden list of names."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from greend.stores import open_store
from greend.stores.prometheus import PrometheusStore
from tests.support import REPO

GOLDEN = REPO / "tests" / "golden" / "prometheus_names.txt"
PROMTOOL = shutil.which("promtool") or ("/usr/bin/promtool" if os.path.exists("/usr/bin/promtool") else None)


def fake_status() -> dict[str, Any]:
    """The shape of Daemon.status(), with every section filled."""
    return {
        "version": "0.1.0",
        "host": "node-1",
        "pid": 1,
        "uptime_s": 12.5,
        "started_at": 1.7e9,
        "hz": 10.0,
        "dry_run": False,
        "ticks": 125,
        "ticks_skipped": 2,
        "tick_errors": 1,
        "last_tick_error": "RuntimeError: a bug",
        "tick_duration_s": 0.0012,
        "gpus": [
            {
                "index": i,
                "name": "NVIDIA H100 80GB HBM3",
                "uuid": f"GPU-{i:04d}",
                "source": "sim",
                "power_w": 300.0 + i,
                "energy_j": 1234.5,
                "energy_method": "counter",
                "sm_clock_mhz": 1980,
                "mem_clock_mhz": 2619,
                "util_gpu_pct": 87.0,
                "sm_active_pct": 41.0 if i == 1 else None,  # gpu0: no GPM
                "temperature_c": 61.0,
                "clock_cap_mhz": 1500 if i == 0 else None,
                "power_limit_w": 700.0,
                "power_limit_range_w": [200.0, 700.0],
                "sm_clock_max_mhz": 1980,
            }
            for i in range(2)
        ],
        "cpus": [
            {
                "zone": "package-0",
                "path": "intel-rapl:0",
                "source": "rapl",
                "power_w": 95.0,
                "energy_j": 800.0,
                "counted": True,
                "parent": None,
                "power_limit_w": 165.0,
            },
            {
                "zone": "dram",
                "path": "intel-rapl:0:2",
                "source": "rapl",
                "power_w": 11.0,
                "energy_j": 80.0,
                "counted": True,
                "parent": "intel-rapl:0",
                "power_limit_w": None,
            },
        ],
        "host_load": None,
        "totals": {"gpu_energy_j": 2469.0, "cpu_energy_j": 880.0},
        "jobs": [
            {
                "job": "resnet-run-7",
                "run_id": "a1b2c3",
                "energy_j": 5000.0,
                "gpu_energy_j": 4200.0,
                "gflops_per_w": 42.5,
                "flops": 2.1e17,
                "steps": 10,
                "world_size": 8,
                "ranks_here": 4,
                "ended_at": 1.7e9,
                "duration_s": 812.5,
                "saved_pct": 13.64,  # (a paced job's: its saving over what it would have used)
                "saved_gpu_energy_j": 150.0,
                "precision": "bf16",
                "sim": False,
            },
        ],  # fmt: skip
        "policy": {"name": "none", "params": {}},
        "probes": [
            {"name": "sim", "open": True, "success": True, "duration_s": 0.0004},
            {"name": "rapl", "open": False, "success": False, "duration_s": 0.0},
        ],
        "stores": [
            {
                "name": "influx",
                "url": "influx://127.0.0.1:8086?org=o&bucket=b",
                "ok": False,
                "written": 10,
                "pending": 3,
                "dropped": 1,
                "rejected": 145,  # (refused by the server with a 400: set aside, not written)
            }
        ],
        "config": None,
    }


@pytest.fixture
def store() -> Iterator[PrometheusStore]:
    s = open_store("prometheus://127.0.0.1:0", state_dir=Path("/nonexistent"), host="h")
    assert isinstance(s, PrometheusStore)
    s.collector.clock = lambda: 1.7e9 + 30.0  # fake_status's job ended 30 s ago: within the grace
    yield s
    s.close()


def scrape(s: PrometheusStore) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{s.port}/metrics", timeout=5) as r:
        assert r.status == 200
        return r.read().decode()


def names_and_labels(text: str) -> list[str]:
    """``name type label,label`` per family, sorted: what the golden file holds."""
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    labels: dict[str, set[str]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? ", line)
        assert m, line
        labels.setdefault(m.group(1), set()).update(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', m.group(2) or ""))
    out = []
    for name, ls in labels.items():
        family = name if name in types else name.removesuffix("_total")
        out.append(f"{name} {types.get(family, types.get(name, '?'))} {','.join(sorted(ls))}".rstrip())
    return sorted(out)


def value(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_scrape_has_base_units_and_values(store: PrometheusStore) -> None:
    store.attach(fake_status)
    text = scrape(store)
    assert value(text, "greend_up") == 1
    assert value(text, "greend_gpu_sm_clock_hertz", gpu="0") == 1980e6
    assert value(text, "greend_gpu_clock_cap_hertz", gpu="0") == 1500e6
    assert 'greend_gpu_clock_cap_hertz{gpu="1"' not in text  # no cap: no sample
    assert value(text, "greend_gpu_utilization_ratio", gpu="1") == pytest.approx(0.87)
    assert value(text, "greend_gpu_sm_active_ratio", gpu="1") == pytest.approx(0.41)
    assert 'greend_gpu_sm_active_ratio{gpu="0"' not in text  # no GPM: no sample
    assert value(text, "greend_gpu_energy_joules_total", gpu="1", uuid="GPU-0001") == 1234.5
    assert value(text, "greend_cpu_energy_joules_total", zone="dram") == 80.0
    assert value(text, "greend_probe_success", probe="rapl") == 0
    assert value(text, "greend_job_gflops_per_watt", job="resnet-run-7") == 42.5
    assert value(text, "greend_job_energy_joules_total", job="resnet-run-7") == 5000.0
    assert value(text, "greend_job_duration_seconds", job="resnet-run-7") == 812.5
    assert value(text, "greend_job_saved_gpu_energy_joules", job="resnet-run-7") == 150.0  # as the stores keep it
    assert value(text, "greend_job_precision", job="resnet-run-7", precision="bf16") == 1
    assert value(text, "greend_job_precision", job="resnet-run-7", precision="fp8") == 0
    assert value(text, "greend_job_gpu_simulated", job="resnet-run-7") == 0
    assert value(text, "greend_store_points_dropped_total") == 1
    assert value(text, "greend_store_points_rejected_total") == 145  # an alert sees points a server refused
    assert value(text, "greend_ticks_skipped_total") == 2
    assert store.status().ok


def test_promtool_check_metrics_is_clean(store: PrometheusStore) -> None:
    if PROMTOOL is None:
        pytest.skip("promtool is absent (apt-get install prometheus)")
    store.attach(fake_status)
    text = scrape(store)
    r = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr  # no lint warnings either


def test_names_and_labels_match_the_golden_file(store: PrometheusStore) -> None:
    store.attach(fake_status)
    got = "\n".join(names_and_labels(scrape(store))) + "\n"
    if os.environ.get("GREEND_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(got)
    assert got == GOLDEN.read_text(), "run with GREEND_UPDATE_GOLDEN=1 to accept a deliberate change"


def test_failing_status_gives_a_valid_scrape_with_up_0(store: PrometheusStore) -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("daemon is confused")

    store.attach(broken)
    text = scrape(store)
    assert value(text, "greend_up") == 0
    assert [ln for ln in text.splitlines() if ln and not ln.startswith("#")] == ["greend_up 0.0"]
    if PROMTOOL:
        r = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=20)
        assert r.returncode == 0, r.stdout


def test_not_attached_and_malformed_status(store: PrometheusStore) -> None:
    assert value(scrape(store), "greend_up") == 0
    assert not store.status().ok
    store.attach(lambda: {"gpus": [{"index": 0, "power_w": "n/a"}], "jobs": "nonsense", "probes": [1, 2]})
    text = scrape(store)
    assert value(text, "greend_up") == 1
    store.write([])  # a no-op that never fails


def test_busy_port_is_a_store_error() -> None:
    from greend.errors import StoreError

    a = PrometheusStore("prometheus://127.0.0.1:0")
    try:
        with pytest.raises(StoreError, match="cannot listen"):
            PrometheusStore(f"prometheus://127.0.0.1:{a.port}")
    finally:
        a.close()
