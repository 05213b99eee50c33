"""What a fleet of greend nodes costs a shared VictoriaMetrics or InfluxDB: ingest, series,
disk, memory and the cluster report's latency, for N simulated nodes.

    python bench/bench_fleet.py [--nodes 10 50 100] [--minutes 10] [--reports 40] [--engine vm|influxdb]

For each N, a fresh engine (``vm``: Debian's ``/usr/bin/victoria-metrics``; ``influxdb``:
Debian's ``/usr/bin/influxd``, InfluxDB 1.6, TSI index; each with its own port and data
dir) receives what N nodes' ``influx://`` stores would send over ``--minutes`` of
simulated time, at the default ``[store] interval_s`` of 1 s: the real points
(``greend.points`` constructors) in the real line protocol (the InfluxDB store's encoder),
with the real label sets. Each node has 8 GPUs and 2 RAPL zones, 3 probes, and runs one
8-rank job at a time, 2-10 simulated minutes long with up to a minute between jobs (far
more churn than real training: every job start is new series); per interval it writes
8 ``greend_gpu``, 2 ``greend_cpu``, 1 ``greend_host``, 3 ``greend_probe``, 1
``greend_efficiency`` and 8 ``greend_job_steps`` points, and at each job's end one
``greend_job`` summary and one ``greend_decision`` note. The points are made beforehand
in chunks of a simulated minute and POSTed to ``/write``; the ingest rate is the points
over the POSTs' wall time (what the server accepted; victoria-metrics indexes in the
background).

Measured per N: points/s and samples/s (a sample is one field of a point), the active
series (``/api/v1/series/count``), disk per day (the data dir after a flush, scaled from
the simulated minutes to a day: an estimate, compression improves on longer runs), the
engine's RSS, and the cluster report's latency: ``greenctl report JOB --store URL``'s
reads (:func:`greend.jobs.history.whole_job_report`, one random ended job each) and
``greenctl jobs --store URL``'s (:func:`greend.jobs.history.shared_jobs`, the last day),
p50 and p99. InfluxDB 1.6 takes the same line protocol on its ``/write`` (it has no
``/api/v2/write``, so the ``influx://`` store's client cannot talk to it; the bytes are the
same) and has no export API for greenctl: its rows time the InfluxQL that reads the same
rows (``SELECT last(*) FROM greend_job WHERE job = ... GROUP BY host, run`` over 30 days, and
the day's listing grouped by job), and its series are ``SHOW SERIES EXACT CARDINALITY``.
Prints; asserts nothing. docs/scale.md holds the figures and the
extrapolation to 1,000 and 10,000 nodes.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from greend.jobs.history import shared_jobs, whole_job_report  # noqa: E402
from greend.points import (  # noqa: E402
    Point,
    cpu_point,
    decision_point,
    efficiency_point,
    gpu_point,
    host_point,
    job_point,
    job_steps_point,
    probe_point,
)
from greend.probes.base import CpuReading, GpuReading, HostReading  # noqa: E402
from greend.stores.influx import encode_points  # noqa: E402
from tests import vmserver  # noqa: E402

GPUS, ZONES, PROBES = 8, (("package-0", "intel-rapl:0"), ("dram", "intel-rapl:0:0")), ("nvml", "rapl", "host")


class Node:
    """One simulated node: its GPUs' energy counters and its job, advanced a second at a time."""

    def __init__(self, i: int, rng: random.Random, t0_s: float) -> None:
        self.host, self.rng = f"node-{i:05d}", rng
        self.energy = [0.0] * GPUS
        self.job: dict[str, Any] | None = None
        self.next_start_s = t0_s + rng.uniform(0, 60)
        self.n_jobs = 0
        self.ended: list[str] = []

    def tick(self, t_s: float) -> list[Point]:
        ts, rng, host = int(t_s * 1e9), self.rng, self.host
        if self.job is None and t_s >= self.next_start_s:
            self.n_jobs += 1
            name = f"{self.host}-job-{self.n_jobs}"
            self.job = {"job": name, "end_s": t_s + rng.uniform(120, 600), "start_s": t_s, "flops": 0.0, "e": 0.0}
        busy = self.job is not None
        pts: list[Point] = []
        power = 0.0
        for g in range(GPUS):
            p = rng.gauss(620.0, 15.0) if busy else 70.0
            power += p
            self.energy[g] += p
            r = GpuReading(
                index=g,
                name="NVIDIA H100 80GB HBM3",
                uuid=f"GPU-{host}-{g}",
                source="nvml",
                energy_j=self.energy[g],
                energy_method="counter",
                power_w=p,
                sm_clock_mhz=1980.0,
                mem_clock_mhz=2619.0,
                util_gpu_pct=97.0 if busy else 0.0,
                temperature_c=60.0,
                power_limit_w=700.0,
                sm_clock_max_mhz=1980.0,
            )
            pts.append(gpu_point(ts, host, r, self.energy[g]))
        for zone, path in ZONES:
            c = CpuReading(zone=zone, path=path, source="rapl", energy_j=0.0, power_w=120.0)
            pts.append(cpu_point(ts, host, c, 120.0 * t_s % 1e6))
        pts.append(
            host_point(
                ts,
                host,
                HostReading(
                    cpu_util_pct=40.0, cpu_count=64, mem_used_bytes=1 << 36, mem_total_bytes=1 << 40, load_1m=12.0
                ),
            )
        )
        pts += [probe_point(ts, host, p, success=True, duration_s=0.0004) for p in PROBES]
        j = self.job
        if j is not None:
            flops = 8 * 4e14
            j["flops"] += flops
            j["e"] += power
            window = {
                "window_s": 10.0,
                "flops": flops * 10,
                "gpu_energy_j": power * 10,
                "gflops_per_w": flops / power / 1e9,
                "flop_per_s": flops,
                "gpu_power_w": power,
            }
            life = {
                "flops": j["flops"],
                "gpu_energy_j": j["e"],
                "gflops_per_w": j["flops"] / j["e"] / 1e9,
                "steps": int(t_s - j["start_s"]) * 4,
            }
            pts.append(efficiency_point(ts, host, job=j["job"], precision="bf16", window=window, life=life))
            fields = {
                "steps": 4,
                "first_step": 0,
                "last_step": 3,
                "duration_s": 1.0,
                "duration_sq_s2": 0.25,
                "flops": flops / 8,
                "samples": 128,
                "tokens": 0,
                "nonfinite": 0,
                "loss_mean": 2.0,
                "loss_min": 1.9,
                "loss_max": 2.1,
                "loss_n": 4,
            }
            pts += [job_steps_point(ts, host, job=j["job"], rank=r, precision="bf16", fields=fields) for r in range(8)]
            if t_s >= j["end_s"]:
                summary = {
                    "world_size": 8,
                    "ranks_here": 8,
                    "steps": life["steps"],
                    "flops": j["flops"],
                    "duration_s": t_s - j["start_s"],
                    "gpu_energy_j": j["e"],
                    "energy_j": j["e"] * 1.1,
                    "gflops_per_w": life["gflops_per_w"],
                    "avg_power_w": power,
                }
                pts.append(job_point(ts, host, job=j["job"], precision="bf16", end_reason="finished", summary=summary))
                pts.append(
                    decision_point(
                        ts, host, kind="note", reason="policy none: measuring only", policy="none", job=j["job"]
                    )
                )
                self.ended.append(j["job"])
                self.job, self.next_start_s = None, t_s + rng.uniform(0, 60)
        return pts


def _parts(body: bytes, size: int = 8 << 20) -> list[bytes]:
    """``body`` in pieces of about ``size`` bytes, each cut at a line's end."""
    out, start = [], 0
    while start < len(body):
        end = len(body) if start + size >= len(body) else body.rfind(b"\n", start, start + size) + 1
        end = end if end > start else len(body)
        out.append(body[start:end])
        start = end
    return out


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read().decode()


def _du(path: Path) -> int:
    """Bytes allocated on disk under ``path`` (sparse, preallocated files count what they hold)."""
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


INFLUXD = shutil.which("influxd")


class InfluxServer:
    """One InfluxDB 1.x process (``influxd``) with its own port, data dir and a ``greend``
    database; the VmServer's shape, so that :func:`run` drives either engine."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir, self.port = base_dir, vmserver.free_port()
        self.data_dir = base_dir / "influx"
        self.http = f"http://127.0.0.1:{self.port}"
        self.write_url = f"{self.http}/write?db=greend&precision=ns"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> InfluxServer:
        assert INFLUXD is not None
        self.data_dir.mkdir(parents=True)
        conf = self.base_dir / "influxdb.conf"
        conf.write_text(
            f'reporting-disabled = true\nbind-address = "127.0.0.1:{vmserver.free_port()}"\n'
            f'[meta]\n  dir = "{self.data_dir / "meta"}"\n'
            f'[data]\n  dir = "{self.data_dir / "data"}"\n  wal-dir = "{self.data_dir / "wal"}"\n'
            '  index-version = "tsi1"\n  max-series-per-database = 0\n  max-values-per-tag = 0\n'
            # the cache goes to compressed TSM files a second after the writes stop, so
            # that the disk figure is the stored data's, not the raw WAL's
            '  cache-snapshot-write-cold-duration = "1s"\n  compact-full-write-cold-duration = "1s"\n'
            f'[http]\n  bind-address = "127.0.0.1:{self.port}"\n  log-enabled = false\n'
            "  max-body-size = 0\n[monitor]\n  store-enabled = false\n"
        )
        log = open(self.base_dir / "influxd.log", "ab")
        self.proc = subprocess.Popen([INFLUXD, "-config", str(conf)], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 30
        while True:
            try:
                self.query("CREATE DATABASE greend")
                return self
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"influxd did not start on port {self.port}") from None
                time.sleep(0.3)

    def query(self, q: str) -> dict[str, Any]:
        data = urllib.parse.urlencode({"q": q, "db": "greend"}).encode()
        with urllib.request.urlopen(f"{self.http}/query", data=data, timeout=120) as r:
            body: dict[str, Any] = json.loads(r.read())
        return body

    def force_flush(self) -> None:
        """Wait (60 s at most) until the cold cache went to TSM files and the WAL emptied."""
        wal, deadline = self.data_dir / "wal", time.monotonic() + 60
        while time.monotonic() < deadline and _du(wal) > 1 << 20:
            time.sleep(1.0)

    def series(self) -> int:
        res = self.query("SHOW SERIES EXACT CARDINALITY")["results"][0]
        return sum(int(s["values"][0][0]) for s in res.get("series", []))

    def report(self, job: str) -> int:
        q = f"SELECT last(*) FROM greend_job WHERE job = '{job}' AND time > now() - 30d GROUP BY host, run"
        return len(self.query(q)["results"][0].get("series", []))

    def listing(self) -> int:
        q = "SELECT last(*) FROM greend_job WHERE time > now() - 1d GROUP BY job, host, run"
        return len(self.query(q)["results"][0].get("series", []))

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(30)


def run(n: int, minutes: float, reports: int, tmp: Path, engine: str = "vm") -> dict[str, Any]:
    vm: Any
    if engine == "influxdb":
        vm = InfluxServer(tmp / f"influx-{n}")
        vm.base_dir.mkdir()
        vm.start()
        write_url = vm.write_url
    else:
        vm = vmserver.VmServer(tmp / f"vm-{n}", dedup=False).start()
        write_url = f"{vm.http}/write"
    try:
        rng = random.Random(n)
        sim_s = int(minutes * 60)
        t0 = time.time() - sim_s - 5  # the simulated window ends now: "the last day" holds it
        nodes = [Node(i, random.Random(rng.random()), t0) for i in range(n)]
        points = samples = 0
        post_s = gen_s = 0.0
        for chunk in range(0, sim_s, 60):
            g0 = time.perf_counter()
            pts = [p for t in range(chunk, min(sim_s, chunk + 60)) for node in nodes for p in node.tick(t0 + t)]
            body = encode_points(pts)
            gen_s += time.perf_counter() - g0
            points += len(pts)
            samples += sum(len(p.fields) for p in pts)
            p0 = time.perf_counter()
            for part in _parts(body):
                req = urllib.request.Request(write_url, data=part, method="POST")
                with urllib.request.urlopen(req, timeout=120) as r:
                    r.read()
            post_s += time.perf_counter() - p0
        vm.force_flush()
        time.sleep(2.0)
        if engine == "influxdb":
            series = vm.series()
        else:
            series = int(json.loads(_get(f"{vm.http}/api/v1/series/count"))["data"][0])
        rss = psutil.Process(vm.proc.pid).memory_info().rss if vm.proc else 0
        disk = _du(vm.data_dir)
        ended = [j for node in nodes for j in node.ended]
        lat: list[float] = []
        for job in rng.sample(ended, min(reports, len(ended))):
            a = time.perf_counter()
            if engine == "influxdb":
                found = vm.report(job)
            else:
                rep = whole_job_report([vm.http], job)
                found = len(rep["nodes"]) if rep else 0
            lat.append(time.perf_counter() - a)
            assert found, job
        lst: list[float] = []
        listed = 0
        for _ in range(5):
            a = time.perf_counter()
            listed = vm.listing() if engine == "influxdb" else len(shared_jobs(vm.http))
            lst.append(time.perf_counter() - a)
        return {
            "nodes": n,
            "points": points,
            "points_s": points / post_s,
            "samples_s": samples / post_s,
            "gen_points_s": points / gen_s,
            "series": series,
            "disk_day_mb": disk / 1e6 * 86400 / sim_s,
            "rss_mb": rss / 1e6,
            "jobs_ended": len(ended),
            "listed": listed,
            "report_p50_ms": statistics.median(lat) * 1e3 if lat else None,
            "report_p99_ms": _p99(lat) * 1e3 if lat else None,
            "list_p50_ms": statistics.median(lst) * 1e3,
            "list_p99_ms": _p99(lst) * 1e3,
        }
    finally:
        vm.close()


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[10, 50, 100])
    ap.add_argument("--minutes", type=float, default=10.0, help="simulated minutes per N")
    ap.add_argument("--reports", type=int, default=40, help="cluster reports timed per N")
    ap.add_argument("--engine", choices=("vm", "influxdb"), default="vm", help="VictoriaMetrics or InfluxDB 1.x")
    a = ap.parse_args(argv)
    if a.engine == "influxdb" and INFLUXD is None:
        print("InfluxDB is not installed (influxd): apt-get install influxdb")
        return 1
    if a.engine == "vm" and not vmserver.available():
        print("victoria-metrics is not installed (/usr/bin/victoria-metrics): apt-get install victoria-metrics")
        return 1
    engine = (
        subprocess.run([INFLUXD, "version"], capture_output=True, text=True).stdout.strip()
        if a.engine == "influxdb" and INFLUXD
        else f"VictoriaMetrics ({vmserver.VM_BIN})"
    )
    print(f"{a.minutes:g} simulated minutes per N; 8 GPUs a node; one {engine} on {psutil.cpu_count()} CPUs")
    head = (
        f"{'nodes':>6}{'points':>10}{'points/s':>11}{'samples/s':>11}{'series':>9}{'series/node':>12}"
        f"{'disk MB/day':>12}{'RSS MB':>8}{'jobs':>6}{'report p50/p99 ms':>19}{'list p50/p99 ms':>17}"
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in a.nodes:
            r = run(n, a.minutes, a.reports, Path(tmp), a.engine)
            rows.append(r)
            if len(rows) == 1:
                print(head)
            print(
                f"{r['nodes']:>6}{r['points']:>10}{r['points_s']:>11.0f}{r['samples_s']:>11.0f}{r['series']:>9}"
                f"{r['series'] / n:>12.0f}{r['disk_day_mb']:>12.0f}{r['rss_mb']:>8.0f}{r['jobs_ended']:>6}"
                f"{_ms(r['report_p50_ms']):>10}/{_ms(r['report_p99_ms']):<8}{r['list_p50_ms']:>8.0f}/{r['list_p99_ms']:<8.0f}",
                flush=True,
            )
    print(
        "(points/s: accepted by the engine over the POSTs' wall time; the points were made beforehand at "
        f"{statistics.median(r['gen_points_s'] for r in rows):.0f} points/s by this script. disk/day: the data dir "
        "after a flush, scaled from the simulated minutes: an estimate. list: greenctl jobs --store, the last day)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
