"""The Prometheus store: serves ``/metrics`` for a Prometheus server to scrape.

URL: ``prometheus://HOST:PORT`` (port 0 picks a free one; see :attr:`PrometheusStore.port`);
``prometheus://:PORT`` listens on 127.0.0.1 only. Query options (the exporter-toolkit's
web config, as a URL): ``basic_auth_file=PATH`` (``user:password`` lines, the file
mode 0600), ``tls_cert=PATH&tls_key=PATH``, and the bounds ``max_connections`` (8),
``read_timeout_s`` (5), ``max_scrapes_per_s`` (10; 0: none): see
:mod:`greend.stores._http`. A store URL's password never reaches a label.

Nothing is pushed: at every scrape a custom collector reads the daemon's current
status (``store.attach(daemon.status)``, the same dict ``greenctl status --json``
shows) and turns it into metrics, node_exporter / dcgm-exporter style, in base
units (joules, watts, hertz, seconds, ratios 0..1)::

    greend_up                                  1 if the status could be read
    greend_gpu_energy_joules_total{gpu,name,uuid,source}   counter, since the daemon started
    greend_gpu_power_watts{...}  greend_gpu_sm_clock_hertz{...}  greend_gpu_clock_cap_hertz{...}
    greend_gpu_power_limit_watts{...}  greend_gpu_temperature_celsius{...}
    greend_gpu_utilization_ratio{...}  greend_gpu_memory_clock_hertz{...}
    greend_cpu_energy_joules_total{zone,path,source}  greend_cpu_power_watts{...}
    greend_probe_success{probe}  greend_probe_duration_seconds{probe}
    greend_job_gflops_per_watt{job}  greend_job_energy_joules_total{job}  greend_job_flops_total{job}
    greend_store_points_*{url}  greend_ticks_total  greend_ticks_skipped_total  greend_tick_errors_total ...

The full list, with label names, is ``tests/golden/prometheus_names.txt``.

Bounded series: a node exports a fixed number of series whatever its job history
(:func:`series_bound`). A job's series are on ``/metrics`` while it runs and for
``JOB_GRACE_S`` after it ends (long enough for a scrape or two to see its end and its
totals); after that its totals live in the stores as rows (``greend_job``), not as live
series. At most ``MAX_JOBS_EXPORTED`` jobs are exported at once (running ones first, then
the most recently ended); ``greend_jobs_not_exported`` counts the ones left out
(:func:`exported_jobs`).

A status function that raises gives a valid scrape holding ``greend_up 0``.
``write()`` is a no-op: the scrape always shows the latest state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult, parse_qs, urlsplit

from greend.errors import ConfigError, StoreError
from greend.points import Point
from greend.protocol import PRECISIONS
from greend.stores import StoreOptions, StoreStatus, check_url, redact_url, register_store
from greend.stores._http import MetricsHttpOptions, MetricsServer, read_basic_auth_file

__all__ = ["GreendCollector", "PrometheusStore"]

log = logging.getLogger(__name__)

StatusFn = Callable[[], dict[str, Any]]

MHZ = 1e6
GPU_LABELS = ("gpu", "name", "uuid", "source")
CPU_LABELS = ("zone", "path", "source")

# (status key, metric suffix, help, scale) for GPU gauges.
_GPU_GAUGES: tuple[tuple[str, str, str, float], ...] = (
    ("power_w", "power_watts", "GPU board power draw in watts.", 1.0),
    ("sm_clock_mhz", "sm_clock_hertz", "Current SM clock in hertz.", MHZ),
    ("mem_clock_mhz", "memory_clock_hertz", "Current memory clock in hertz.", MHZ),
    ("clock_cap_mhz", "clock_cap_hertz", "Locked SM clock ceiling set by greend in hertz (absent: no cap).", MHZ),
    ("sm_clock_max_mhz", "sm_clock_max_hertz", "Highest supported SM clock in hertz.", MHZ),
    ("power_limit_w", "power_limit_watts", "Power limit in force in watts.", 1.0),
    ("temperature_c", "temperature_celsius", "GPU temperature in degrees Celsius.", 1.0),
    ("util_gpu_pct", "utilization_ratio", "GPU utilisation, 0 to 1.", 0.01),
    (
        "sm_active_pct",
        "sm_active_ratio",
        "Share of the SMs busy (NVML GPM SM_UTIL, Hopper and newer; absent elsewhere), 0 to 1.",
        0.01,
    ),
)


# How long an ended job's series stay on /metrics: two scrapes at the usual 15-60 s
# intervals see its end; after it the job's totals are rows in the stores.
JOB_GRACE_S = 120.0
# At most this many jobs' series at once, whatever the churn within the grace.
MAX_JOBS_EXPORTED = 32
# Series per GPU (energy and the gauges), per CPU zone, per probe, per store, per job.
SERIES_PER_GPU = 1 + len(_GPU_GAUGES)
SERIES_PER_ZONE = 3
SERIES_PER_PROBE = 2
SERIES_PER_STORE = 4
SERIES_PER_JOB = 11 + len(PRECISIONS)  # (the precision: one series per level, 1 for the job's, kube-state style)
# greend_up, build_info, start time, uptime, tick duration, tick rate, ticks, ticks
# skipped, tick errors, jobs not exported.
SERIES_PER_NODE = 10


def series_bound(gpus: int, cpu_zones: int, probes: int, stores: int, max_jobs: int = MAX_JOBS_EXPORTED) -> int:
    """The most series one node's ``/metrics`` holds, whatever its job history."""
    return (
        SERIES_PER_NODE
        + SERIES_PER_GPU * gpus
        + SERIES_PER_ZONE * cpu_zones
        + SERIES_PER_PROBE * probes
        + SERIES_PER_STORE * stores
        + SERIES_PER_JOB * max_jobs
    )


def exported_jobs(
    jobs: Iterable[Any], now_s: float, grace_s: float = JOB_GRACE_S, max_jobs: int = MAX_JOBS_EXPORTED
) -> tuple[list[dict[str, Any]], int]:
    """The jobs whose series a scrape at ``now_s`` (Unix time) shows, and how many jobs
    that would be shown were left out by ``max_jobs``: the running ones and those that
    ended within ``grace_s``, running first, then the most recently ended."""
    live: list[dict[str, Any]] = []
    for j in jobs:
        if not isinstance(j, dict):
            continue
        ended = _as_float(j.get("ended_at"))
        if ended is None or now_s - ended <= grace_s:
            live.append(j)
    live.sort(key=lambda j: (j.get("ended_at") is not None, -(_as_float(j.get("ended_at")) or 0.0)))
    return live[:max_jobs], max(0, len(live) - max_jobs)


def _as_float(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    return None


def _label_value(v: Any) -> str:
    return "" if v is None else str(v)


class GreendCollector:
    """A prometheus-client collector over ``status_fn()``; collects at scrape time."""

    def __init__(self, status_fn: StatusFn | None = None) -> None:
        self.status_fn = status_fn
        self.errors = 0
        self.clock: Callable[[], float] = time.time  # Unix time, for the ended jobs' grace
        self.job_grace_s = JOB_GRACE_S
        self.max_jobs = MAX_JOBS_EXPORTED

    def describe(self) -> Iterable[Any]:
        return []  # unchecked collector: families vary with the hardware found

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        status: dict[str, Any] | None = None
        if self.status_fn is not None:
            try:
                status = self.status_fn()
            except Exception as e:
                self.errors += 1
                log.warning("prometheus: status() failed: %s: %s", type(e).__name__, e)
                status = None
        up = GaugeMetricFamily("greend_up", "1 if greend's status could be read at this scrape, else 0.")
        up.add_metric([], 1.0 if isinstance(status, dict) else 0.0)
        yield up
        if not isinstance(status, dict):
            return
        try:
            yield from self._families(status)
        except Exception as e:
            self.errors += 1
            log.warning("prometheus: status dict not understood: %s: %s", type(e).__name__, e)

    def _families(self, st: dict[str, Any]) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return GaugeMetricFamily(name, doc, labels=list(labels))

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return CounterMetricFamily(name, doc, labels=list(labels))  # "_total" added by the client

        info = gauge("greend_build_info", "greend version; always 1.", ("version",))
        info.add_metric([_label_value(st.get("version"))], 1.0)
        yield info
        for key, name, doc in (
            ("started_at", "greend_start_time_seconds", "Unix time the daemon started."),
            ("uptime_s", "greend_uptime_seconds", "Seconds since the daemon started."),
            ("tick_duration_s", "greend_tick_duration_seconds", "Duration of the last tick in seconds."),
            ("hz", "greend_tick_rate_hertz", "Configured ticks per second."),
        ):
            v = _as_float(st.get(key))
            if v is not None:
                g = gauge(name, doc)
                g.add_metric([], v)
                yield g
        for key, name, doc in (
            ("ticks", "greend_ticks", "Ticks run since the daemon started."),
            ("ticks_skipped", "greend_ticks_skipped", "Ticks skipped because a tick overran its period."),
            ("tick_errors", "greend_tick_errors", "Ticks that raised an error (logged; the next tick ran as usual)."),
        ):
            v = _as_float(st.get(key))
            if v is not None:
                c = counter(name, doc)
                c.add_metric([], v)
                yield c

        # GPUs
        gpus = [g for g in st.get("gpus") or [] if isinstance(g, dict)]
        energy = counter("greend_gpu_energy_joules", "GPU energy in joules since the daemon started.", GPU_LABELS)
        gauges = {k: gauge(f"greend_gpu_{suffix}", doc, GPU_LABELS) for k, suffix, doc, _ in _GPU_GAUGES}
        for g in gpus:
            labels = [
                _label_value(g.get("index")),
                _label_value(g.get("name")),
                _label_value(g.get("uuid")),
                _label_value(g.get("source")),
            ]
            v = _as_float(g.get("energy_j"))
            if v is not None:
                energy.add_metric(labels, v)
            for key, _suffix, _doc, scale in _GPU_GAUGES:
                v = _as_float(g.get(key))
                if v is not None:
                    gauges[key].add_metric(labels, v * scale)
        if gpus:
            yield energy
            yield from (f for f in gauges.values() if f.samples)

        # CPU / DRAM zones
        cpus = [c for c in st.get("cpus") or [] if isinstance(c, dict)]
        cenergy = counter(
            "greend_cpu_energy_joules", "CPU/DRAM zone energy in joules since the daemon started.", CPU_LABELS
        )
        cpower = gauge("greend_cpu_power_watts", "CPU/DRAM zone power in watts.", CPU_LABELS)
        climit = gauge("greend_cpu_power_limit_watts", "RAPL power limit of the zone in watts.", CPU_LABELS)
        for c in cpus:
            labels = [_label_value(c.get("zone")), _label_value(c.get("path")), _label_value(c.get("source"))]
            for fam, key in ((cenergy, "energy_j"), (cpower, "power_w"), (climit, "power_limit_w")):
                v = _as_float(c.get(key))
                if v is not None:
                    fam.add_metric(labels, v)
        yield from (f for f in (cenergy, cpower, climit) if f.samples)

        # Probes (node_scrape_collector_* style)
        ok = gauge("greend_probe_success", "1 if the probe's last sample succeeded, else 0.", ("probe",))
        dur = gauge("greend_probe_duration_seconds", "Duration of the probe's last sample in seconds.", ("probe",))
        for p in st.get("probes") or []:
            if not isinstance(p, dict):
                continue
            name = _label_value(p.get("name"))
            ok.add_metric([name], 1.0 if p.get("success") else 0.0)
            v = _as_float(p.get("duration_s"))
            if v is not None:
                dur.add_metric([name], v)
        yield from (f for f in (ok, dur) if f.samples)

        yield from self._job_families(st)

        # Stores
        sup = gauge("greend_store_up", "1 if the store accepts points, else 0.", ("url",))
        swr = counter("greend_store_points_written", "Points the store accepted.", ("url",))
        sdr = counter("greend_store_points_dropped", "Points lost for good (spool bound, malformed).", ("url",))
        spe = gauge("greend_store_points_pending", "Points waiting in the queue or spool.", ("url",))
        srj = counter(
            "greend_store_points_rejected",
            "Points the store's server refused (400, 422): set aside in its spool's rejected/ folder, not written.",
            ("url",),
        )
        for s in st.get("stores") or []:
            if not isinstance(s, dict):
                continue
            url = redact_url(_label_value(s.get("url")))  # (a password never goes into a label)
            sup.add_metric([url], 1.0 if s.get("ok") else 0.0)
            for fam, key in ((swr, "written"), (sdr, "dropped"), (spe, "pending")):
                v = _as_float(s.get(key))
                if v is not None:
                    fam.add_metric([url], v)
            srj.add_metric([url], _as_float(s.get("rejected")) or 0.0)  # (a store no server answers: none)
        yield from (f for f in (sup, swr, sdr, spe, srj) if f.samples)

    def _job_families(self, st: dict[str, Any]) -> Iterator[Any]:
        """This node's share of each job shown (:func:`exported_jobs`: running, or ended within
        the grace). Labelled by job, run and host, so that a Prometheus scraping every node can
        sum one run of a job across nodes (greenctl report JOB --store prom://HOST:PORT)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return GaugeMetricFamily(name, doc, labels=list(labels))

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return CounterMetricFamily(name, doc, labels=list(labels))

        jobs, left_out = exported_jobs(st.get("jobs") or [], self.clock(), self.job_grace_s, self.max_jobs)
        nx = gauge("greend_jobs_not_exported", "Jobs running or just ended whose series the job cap left out.")
        nx.add_metric([], float(left_out))
        yield nx
        jl = ("job", "run", "host")
        jgf = gauge("greend_job_gflops_per_watt", "Job efficiency: GFLOP per joule over the job so far.", jl)
        jen = counter("greend_job_energy_joules", "Energy attributed to the job in joules (GPU and CPU).", jl)
        jge = counter("greend_job_gpu_energy_joules", "GPU energy attributed to the job in joules.", jl)
        jfl = counter("greend_job_flops", "Floating-point operations the job reported.", jl)
        jst = counter("greend_job_steps", "Training steps the job reported (each rank's).", jl)
        jws = gauge("greend_job_world_size", "The job's ranks on all nodes.", jl)
        jrh = gauge("greend_job_ranks_here", "The job's ranks that ran on this node.", jl)
        jend = gauge("greend_job_end_time_seconds", "Unix time the job ended on this node (absent while it runs).", jl)
        jdur = gauge("greend_job_duration_seconds", "The job's time on this node, first step to last.", jl)
        jsav = gauge(
            "greend_job_saved_gpu_energy_joules",
            "GPU energy greend saved the job on this node against its own uncapped steps (an estimate).",
            jl,
        )
        jsim = gauge("greend_job_gpu_simulated", "1 where the job's GPU figures are the simulator's.", jl)
        jpre = gauge(
            "greend_job_precision", "1 for the level the job runs at now, 0 for the others.", (*jl, "precision")
        )
        host = _label_value(st.get("host"))
        for j in jobs:
            labels = [_label_value(j.get("job")), _label_value(j.get("run_id")), host]
            for fam, v in (
                (jgf, j.get("gflops_per_w")),
                (jen, j.get("energy_j")),
                (jge, j.get("gpu_energy_j")),
                (jfl, j.get("flops")),
                (jst, j.get("steps")),
                (jws, j.get("world_size")),
                (jrh, j.get("ranks_here")),
                (jend, j.get("ended_at")),
                (jdur, j.get("duration_s")),
                (jsav, j.get("saved_gpu_energy_j")),
                (jsim, bool(j.get("sim"))),
            ):
                v = _as_float(v)
                if v is not None:
                    fam.add_metric(labels, v)
            if j.get("precision") in PRECISIONS:  # (a command measured whole has none)
                for level in PRECISIONS:
                    jpre.add_metric([*labels, level], 1.0 if level == j["precision"] else 0.0)
        yield from (f for f in (jgf, jen, jge, jfl, jst, jws, jrh, jend, jdur, jsav, jsim, jpre) if f.samples)


_OPTIONS = {"basic_auth_file", "tls_cert", "tls_key", "max_connections", "read_timeout_s", "max_scrapes_per_s"}


def _check_prometheus_url(url: str, parts: SplitResult) -> None:
    """``prometheus://[HOST]:PORT[?options]``: the options known, the bounds numbers."""
    if parts.port is None:
        raise ConfigError(
            f"store URL {redact_url(url)!r}: expected prometheus://HOST:PORT (e.g. prometheus://127.0.0.1:9464; "
            "an empty HOST is 127.0.0.1)"
        )
    _http_options(url, parts)


def _http_options(url: str, parts: SplitResult) -> MetricsHttpOptions:
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    unknown = sorted(set(query) - _OPTIONS)
    if unknown:
        raise ConfigError(
            f"store URL {redact_url(url)!r}: unknown option {unknown[0]!r}; known: {', '.join(sorted(_OPTIONS))}"
        )

    def number(key: str, default: float, lo: float, hi: float) -> float:
        if key not in query:
            return default
        try:
            v = float(query[key])
        except ValueError:
            v = float("nan")
        if not lo <= v <= hi:
            raise ConfigError(f"store URL {redact_url(url)!r}: {key} = {query[key]!r}; expected {lo:g}..{hi:g}")
        return v

    return MetricsHttpOptions(
        addr=parts.hostname or "127.0.0.1",
        port=parts.port or 0,
        max_connections=int(number("max_connections", 8, 1, 1024)),
        read_timeout_s=number("read_timeout_s", 5.0, 0.1, 300.0),
        max_scrapes_per_s=number("max_scrapes_per_s", 10.0, 0.0, 10_000.0),
        tls_cert=query.get("tls_cert") or None,
        tls_key=query.get("tls_key") or None,
    )


class PrometheusStore:
    """Serves ``/metrics`` from a bounded server of its own (:mod:`greend.stores._http`),
    on its own registry."""

    name = "prometheus"

    def __init__(self, url: str, status_fn: StatusFn | None = None) -> None:
        check_url(url)
        parts = urlsplit(url)
        self.url = url
        opts = _http_options(url, parts)
        auth_file = {k: v[-1] for k, v in parse_qs(parts.query).items()}.get("basic_auth_file")
        if auth_file:
            from dataclasses import replace

            opts = replace(opts, basic_auth=read_basic_auth_file(Path(auth_file)))
        self.addr = opts.addr
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

        self.collector = GreendCollector(status_fn)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        try:
            self._server = MetricsServer(opts, lambda: (generate_latest(self.registry), CONTENT_TYPE_LATEST))
        except OSError as e:
            raise StoreError(
                f"prometheus store: cannot listen on {self.addr}:{parts.port}: {e} (is another exporter on that port?)"
            ) from e
        self._server.thread.start()
        self._thread = self._server.thread
        self.port: int = self._server.server_address[1]
        self.scheme = "https" if self._server.ssl_context is not None else "http"
        self._lock = threading.Lock()
        self._last_points = 0
        log.info(
            "prometheus: serving /metrics on %s://%s:%d/metrics%s",
            self.scheme,
            self.addr,
            self.port,
            " (basic auth)" if opts.basic_auth else "",
        )

    def attach(self, status_fn: StatusFn) -> None:
        """Give the store the function it reads at every scrape (``Daemon.status``)."""
        self.collector.status_fn = status_fn

    def write(self, points: list[Point]) -> None:
        """No-op apart from a count: a scrape reads the latest status itself."""
        with self._lock:
            self._last_points = len(points)

    def flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        try:
            self._server.shutdown()
            self._server.server_close()
        except Exception as e:
            log.warning("prometheus: close failed: %s", e)
        self._thread.join(timeout_s)

    def status(self) -> StoreStatus:
        return StoreStatus(
            name=self.name,
            url=self.url,
            ok=self.collector.status_fn is not None,
            last_error=None if self.collector.status_fn is not None else "not attached to the daemon",
            extra={
                "listen": f"{self.scheme}://{self.addr}:{self.port}/metrics",
                "scrape_errors": self.collector.errors,
                **self._server.stats(),
            },
        )


@register_store("prometheus", form="prometheus://HOST:PORT", check=_check_prometheus_url)
def _open_prometheus(url: str, options: StoreOptions) -> PrometheusStore:
    return PrometheusStore(url)
