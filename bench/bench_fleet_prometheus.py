"""What a fleet of greend nodes costs a real Prometheus that scrapes them: active series,
samples/s, scrape time, memory, disk and the cluster report's latency, for N simulated nodes.

    python bench/bench_fleet_prometheus.py [--nodes 10 100 300] [--seconds 180] [--scrape-interval 15]

The pull-side twin of ``bench/bench_fleet.py`` (which pushes into VictoriaMetrics). For
each N, a fresh Prometheus (Debian's ``/usr/bin/prometheus``, own port and TSDB dir,
``honor_labels: true`` as docs/stores.md says) scrapes N node endpoints for ``--seconds``
of real time. Every endpoint's body is rendered at scrape time by greend's own collector
(:class:`greend.stores.prometheus.GreendCollector`, the code behind ``prometheus://``)
over a status dict of the shape ``greenctl status --json`` gives: 8 GPUs, 2 RAPL zones, 3
probes, 2 stores, and one 8-rank job at a time whose series stay for the collector's
120 s grace after it ends. The jobs are short (30-90 s, up to 15 s between them) so that
a few minutes hold several job starts and ends a node: far more churn than real training,
where a job lasts hours. One Python HTTP server answers for all N nodes (one path each);
it is not greend's own server, whose per-node limits (10 scrapes/s) would refuse a fleet
behind one port.

Measured per N, from Prometheus' own metrics and API: active series
(``prometheus_tsdb_head_series``), samples appended a second, targets up, the scrape
duration p50/p99 (``scrape_duration_seconds``), the server's RSS, the TSDB dir's growth
scaled to a day (the WAL, before the 2 h head compaction: an upper bound, labelled an
estimate), and the cluster report's latency: ``greenctl report JOB --store prom://``'s
queries (:func:`greend.jobs.history.whole_job_report`, ended jobs) and ``greenctl jobs
--store prom://`` (:func:`greend.jobs.history.shared_jobs`, the last day), p50 and p99.
Prints; asserts nothing. docs/scale.md holds the figures.
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
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from greend.jobs.history import shared_jobs, whole_job_report  # noqa: E402
from greend.stores.prometheus import GreendCollector, series_bound  # noqa: E402
from tests.vmserver import free_port  # noqa: E402

PROMETHEUS = shutil.which("prometheus")
GPUS = 8
ZONES = (("package-0", "/sys/class/powercap/intel-rapl:0"), ("dram", "/sys/class/powercap/intel-rapl:0:0"))
PROBES = ("nvml", "rapl", "host")
STORES = ("sqlite:///var/lib/greend/greend.db", "prometheus://0.0.0.0:9464")


class Node:
    """One simulated node's daemon status, advanced to the wall clock at each scrape."""

    def __init__(self, i: int, rng: random.Random, t0_s: float, job_s: tuple[float, float] = (30.0, 90.0)) -> None:
        self.host, self.rng, self.t0_s, self.job_s = f"node-{i:05d}", rng, t0_s, job_s
        self.gap_s = job_s[0] / 2
        self.lock = threading.Lock()
        self.last_s = t0_s
        self.energy = [0.0] * GPUS
        self.jobs: list[dict[str, Any]] = []  # the daemon's recent jobs, running last
        self.running: dict[str, Any] | None = None
        self.next_start_s = t0_s + rng.uniform(0, self.gap_s)
        self.n_jobs = 0
        self.collector = GreendCollector(self.status)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)

    def advance(self, now_s: float) -> None:
        rng, dt = self.rng, max(0.0, now_s - self.last_s)
        self.last_s = now_s
        j = self.running
        if j is not None and now_s >= j["end_s"]:
            j["ended_at"] = j["end_s"]
            self.running = j = None
            self.next_start_s = now_s + rng.uniform(0, self.gap_s)
        if j is None and now_s >= self.next_start_s:
            self.n_jobs += 1
            j = {
                "job": f"{self.host}-job-{self.n_jobs}",
                "run_id": f"r{self.n_jobs}",
                "end_s": now_s + rng.uniform(*self.job_s),
                "ended_at": None,
                "world_size": 8,
                "ranks_here": 8,
                "flops": 0.0,
                "steps": 0,
                "energy_j": 0.0,
                "gpu_energy_j": 0.0,
                "gflops_per_w": None,
            }
            self.running = j
            self.jobs = [*self.jobs[-199:], j]  # the daemon keeps up to 200 jobs
        power = 620.0 if j is not None else 70.0
        for g in range(GPUS):
            self.energy[g] += power * dt
        if j is not None:
            j["flops"] += 8 * 4e14 * dt
            j["steps"] += int(4 * dt)
            j["gpu_energy_j"] += power * GPUS * dt
            j["energy_j"] = j["gpu_energy_j"] * 1.1
            j["gflops_per_w"] = j["flops"] / j["gpu_energy_j"] / 1e9

    def status(self) -> dict[str, Any]:
        now = time.time()
        busy = self.running is not None
        return {
            "version": "bench",
            "host": self.host,
            "started_at": self.t0_s,
            "uptime_s": now - self.t0_s,
            "tick_duration_s": 0.002,
            "hz": 10.0,
            "ticks": int((now - self.t0_s) * 10),
            "ticks_skipped": 0,
            "gpus": [
                {
                    "index": g,
                    "name": "NVIDIA H100 80GB HBM3",
                    "uuid": f"GPU-{self.host}-{g}",
                    "source": "nvml",
                    "energy_j": self.energy[g],
                    "power_w": 620.0 if busy else 70.0,
                    "sm_clock_mhz": 1980.0,
                    "mem_clock_mhz": 2619.0,
                    "clock_cap_mhz": 1410.0 if busy else None,
                    "sm_clock_max_mhz": 1980.0,
                    "power_limit_w": 700.0,
                    "temperature_c": 60.0,
                    "util_gpu_pct": 97.0 if busy else 0.0,
                }
                for g in range(GPUS)
            ],
            "cpus": [
                {
                    "zone": z,
                    "path": p,
                    "source": "rapl",
                    "energy_j": 120.0 * (now - self.t0_s),
                    "power_w": 120.0,
                    "power_limit_w": 280.0,
                }
                for z, p in ZONES
            ],  # fmt: skip
            "probes": [{"name": p, "success": True, "duration_s": 0.0004} for p in PROBES],
            "stores": [{"url": u, "ok": True, "written": 1000, "dropped": 0, "pending": 0} for u in STORES],
            "jobs": self.jobs,
        }

    def scrape(self) -> bytes:
        with self.lock:
            self.advance(time.time())
            return generate_latest(self.registry)

    def ended(self, before_s: float) -> list[dict[str, Any]]:
        return [j for j in self.jobs if j["ended_at"] is not None and j["ended_at"] < before_s]


class _Handler(BaseHTTPRequestHandler):
    nodes: list[Node] = []

    def do_GET(self) -> None:
        parts = self.path.strip("/").split("/")  # node/<i>/metrics
        try:
            body = self.nodes[int(parts[1])].scrape()
        except (IndexError, ValueError):
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _query(port: int, q: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
    with urllib.request.urlopen(url, timeout=30) as r:
        body = json.loads(r.read())
    return list(body["data"]["result"])


def _scalar(port: int, q: str) -> float:
    res = _query(port, q)
    return float(res[0]["value"][1]) if res else float("nan")


def _own(port: int, name: str) -> float:
    """A figure from Prometheus' own ``/metrics`` (summed over its label sets)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{")
    )


def _du(path: Path) -> int:
    """Bytes allocated on disk under ``path`` (sparse, preallocated files count what they hold)."""
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


def _p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]


def run(
    n: int, seconds: float, interval_s: float, reports: int, tmp: Path, job_s: tuple[float, float] = (30.0, 90.0)
) -> dict[str, Any]:
    assert PROMETHEUS is not None
    rng = random.Random(n)
    t0 = time.time()
    nodes = [Node(i, random.Random(rng.random()), t0, job_s) for i in range(n)]
    handler = type("H", (_Handler,), {"nodes": nodes})
    http = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    http.daemon_threads = True
    threading.Thread(target=http.serve_forever, daemon=True).start()
    port, prom_port = http.server_address[1], free_port()
    targets = [
        {"targets": [f"127.0.0.1:{port}"], "labels": {"__metrics_path__": f"/node/{i}/metrics", "node": node.host}}
        for i, node in enumerate(nodes)
    ]
    work = tmp / f"prom-{n}"
    work.mkdir()
    (work / "targets.json").write_text(json.dumps(targets))
    (work / "prometheus.yml").write_text(
        f"global: {{scrape_interval: {interval_s:g}s, scrape_timeout: {min(10.0, interval_s):g}s}}\n"
        "scrape_configs:\n  - job_name: greend\n    honor_labels: true\n"
        f"    file_sd_configs: [{{files: ['{work / 'targets.json'}']}}]\n"
    )
    tsdb = work / "tsdb"
    prom = subprocess.Popen(
        [PROMETHEUS, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={tsdb}",
         f"--web.listen-address=127.0.0.1:{prom_port}", "--storage.tsdb.retention.time=1d"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                _query(prom_port, "up")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        start_disk, start = _du(tsdb), time.monotonic()
        time.sleep(seconds / 2)
        appended0, mid = _own(prom_port, "prometheus_tsdb_head_samples_appended_total"), time.monotonic()
        time.sleep(seconds / 2)
        appended1 = _own(prom_port, "prometheus_tsdb_head_samples_appended_total")
        elapsed = time.monotonic() - start
        res = {
            "nodes": n,
            "up": _scalar(prom_port, 'sum(up{job="greend"})'),
            "series": _own(prom_port, "prometheus_tsdb_head_series"),
            "samples_s": (appended1 - appended0) / (time.monotonic() - mid),
            "scrape_p50_ms": _scalar(prom_port, 'quantile(0.5, scrape_duration_seconds{job="greend"})') * 1e3,
            "scrape_p99_ms": _scalar(prom_port, 'quantile(0.99, scrape_duration_seconds{job="greend"})') * 1e3,
            "series_per_scrape": _scalar(prom_port, 'avg(scrape_samples_scraped{job="greend"})'),
            "rss_mb": psutil.Process(prom.pid).memory_info().rss / 1e6,
            "disk_day_mb": (_du(tsdb) - start_disk) / 1e6 * 86400 / elapsed,
            "jobs_started": sum(node.n_jobs for node in nodes),
        }
        # Reports of jobs whose end a scrape has seen, and the day's listing.
        url = f"prom://127.0.0.1:{prom_port}"
        ended = [j["job"] for node in nodes for j in node.ended(time.time() - 2 * interval_s)]
        lat: list[float] = []
        complete = 0
        for job in rng.sample(ended, min(reports, len(ended))):
            a = time.perf_counter()
            rep = whole_job_report([url], job)
            lat.append(time.perf_counter() - a)
            complete += bool(rep and rep.get("nodes"))
        lst: list[float] = []
        listed = 0
        for _ in range(5):
            a = time.perf_counter()
            listed = len(shared_jobs(url))
            lst.append(time.perf_counter() - a)
        res.update(
            jobs_ended=len(ended),
            reports_found=f"{complete}/{len(lat)}",
            listed=listed,
            report_p50_ms=statistics.median(lat) * 1e3 if lat else None,
            report_p99_ms=_p99(lat) * 1e3 if lat else None,
            list_p50_ms=statistics.median(lst) * 1e3,
            list_p99_ms=_p99(lst) * 1e3,
        )
        return res
    finally:
        prom.terminate()
        prom.wait(30)
        http.shutdown()
        http.server_close()


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[10, 100, 300])
    ap.add_argument("--seconds", type=float, default=180.0, help="real seconds of scraping per N")
    ap.add_argument("--scrape-interval", type=float, default=15.0, help="Prometheus' scrape_interval, seconds")
    ap.add_argument("--reports", type=int, default=40, help="cluster reports timed per N")
    ap.add_argument(
        "--job-seconds", type=float, nargs=2, default=[30.0, 90.0], metavar=("MIN", "MAX"), help="a job's length"
    )
    a = ap.parse_args(argv)
    if PROMETHEUS is None:
        print("the Prometheus server is not installed: apt-get install prometheus")
        return 1
    version = subprocess.run([PROMETHEUS, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    print(
        f"{a.seconds:g} s of scraping per N every {a.scrape_interval:g} s; 8 GPUs a node (bound "
        f"{series_bound(GPUS, len(ZONES), len(PROBES), len(STORES))} series); {version} on {psutil.cpu_count()} CPUs"
    )
    head = (
        f"{'nodes':>6}{'up':>6}{'series':>9}{'series/node':>12}{'samples/s':>11}{'scrape p50/p99 ms':>19}"
        f"{'RSS MB':>8}{'WAL MB/day':>11}{'jobs':>6}{'report p50/p99 ms':>19}{'found':>8}{'list p50/p99 ms':>17}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for i, n in enumerate(a.nodes):
            r = run(n, a.seconds, a.scrape_interval, a.reports, Path(tmp), (a.job_seconds[0], a.job_seconds[1]))
            if i == 0:
                print(head)
            print(
                f"{n:>6}{r['up']:>6.0f}{r['series']:>9.0f}{r['series'] / n:>12.0f}{r['samples_s']:>11.0f}"
                f"{r['scrape_p50_ms']:>10.1f}/{r['scrape_p99_ms']:<8.1f}{r['rss_mb']:>8.0f}{r['disk_day_mb']:>11.0f}"
                f"{r['jobs_started']:>6}{_ms(r['report_p50_ms']):>10}/{_ms(r['report_p99_ms']):<8}"
                f"{r['reports_found']:>8}{r['list_p50_ms']:>8.0f}/{r['list_p99_ms']:<8.0f}",
                flush=True,
            )
    print(
        "(series: Prometheus' head series, the scrape's own up/scrape_* series included; samples/s: appended, over "
        "the run's second half; scrape: the node endpoint's render and transfer as Prometheus timed it; WAL MB/day: "
        "the TSDB dir's growth scaled to a day, before compaction: an estimate and an upper bound; jobs: started "
        "in the run; found: reports that found the job)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
