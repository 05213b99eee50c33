"""Ended jobs read back from the SQLite store, for when the daemon no longer knows them
(it restarted, or trimmed its list of ended jobs).

The store holds each ended job's summary (``greend_job``: its figures and the saving
against its baseline) and every decision about it with its reason (``greend_decision``:
caps and precision switches, rollbacks and refusals). :func:`stored_report` puts them
back in the shape of a live report (``greenctl report``), marked ``from_store``; what
only the daemon kept (the time series, per-GPU figures) is absent. The file is opened
read-only: the daemon may be writing it.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from greend.errors import StoreError
from greend.jobs.parts import join_rows, runs_of
from greend.jobs.report import rates
from greend.points import JOB_SUMMARY_FIELDS
from greend.stores.sqlite import connect_readonly

# How far back a shared store is read: a job's report looks 30 days back (its label bounds
# the series), a listing of every job one day (greenctl jobs --store URL --since).
REPORT_LOOKBACK_S = 30 * 86400.0
LIST_LOOKBACK_S = 86400.0
_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


def parse_duration_s(text: str) -> float:
    """``30m``, ``12h``, ``7d``, ``2w`` or plain seconds, in seconds; ValueError naming the form."""
    t = text.strip().lower()
    unit = _DURATION_UNITS.get(t[-1:]) if t else None
    try:
        value = float(t[:-1]) * unit if unit is not None else float(t)
    except ValueError:
        value = -1.0
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"not a duration: {text!r} (a positive number with s, m, h, d or w: 30m, 12h, 7d)")
    return value


__all__ = [
    "is_shared_store",
    "shared_job_rows",
    "shared_jobs",
    "sqlite_path",
    "stored_jobs",
    "stored_report",
    "whole_job_report",
]


def sqlite_path(urls: list[str]) -> Path | None:
    """The file of the first ``sqlite:///`` store among ``urls``."""
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme == "sqlite" and parts.path:
            # sqlite:///ABS and sqlite:////ABS (an absolute path after the three slashes) alike.
            return Path("/" + parts.path.lstrip("/"))
    return None


def _rows(db: sqlite3.Connection, table: str, where: str = "", params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if table not in tables:
        return []
    sql = f'SELECT * FROM "{table}"' + (f" WHERE {where}" if where else "") + " ORDER BY ts_ns"
    return [dict(r) for r in db.execute(sql, params)]


def _open(path: Path) -> sqlite3.Connection:
    if path.is_dir():
        raise StoreError(f"{path} is a directory: give the store's file (the daemon's is {path}/greend.db)")
    try:
        if path.exists() and not os.access(path, os.R_OK):
            raise PermissionError(path)
        db = connect_readonly(path)
        db.execute("SELECT 1 FROM sqlite_master LIMIT 1")  # opens the file now, not at the first query
        return db
    except PermissionError:
        raise StoreError(
            f"the store {path} is readable by greend's uid only (it holds every user's jobs): "
            "greenctl report JOB and greenctl jobs ask the daemon instead, or read it as root"
        ) from None
    except (sqlite3.Error, OSError) as e:
        raise StoreError(f"cannot read the store {path}: {e}") from e


def stored_jobs(path: Path) -> list[dict[str, Any]]:
    """Every ended job in the store, oldest first, in ``greenctl jobs``' shape. A job id
    that ran more than once appears once per run (``run``: 1, 2, ...)."""
    db = _open(path)
    try:
        rows = _rows(db, "greend_job")
    finally:
        db.close()
    seen: dict[str, int] = {}
    out = []
    # The parts of a run the daemon restarted under are one row (greend.jobs.parts).
    for parts in runs_of(rows, key=lambda r: (r["job"], r["run"]) if r.get("run") else None):
        r = join_rows(parts)
        seen[r["job"]] = seen.get(r["job"], 0) + 1
        out.append(
            {
                "job": r["job"],
                "run_id": r.get("run"),
                "state": "ended",
                "ranks": None,
                "gpus": [],
                "steps": r.get("steps"),
                "flops": r.get("flops"),
                "duration_s": r.get("duration_s"),
                "gpu_energy_j": r.get("gpu_energy_j"),
                "energy_j": r.get("energy_j"),
                "gflops_per_w": r.get("gflops_per_w"),
                "precision": r.get("precision"),
                "saved_pct": r.get("saved_pct"),
                "ended_at": r["ts_ns"] / 1e9,
                **_stored_kind(r),
                "started_at": r.get("started_at"),  # (its first part's, where it has parts)
                "run": seen[r["job"]],
                "from_store": str(path),
            }
        )
    return out


def _stored_kind(r: dict[str, Any]) -> dict[str, Any]:
    """A stored job's kind: a command measured whole (tagged ``kind=measure``) has windows,
    not steps, and no precision, as its live report says."""
    if r.get("kind") != "measure":
        return {"kind": "training", "windows": None}
    windows = r.get("windows")
    return {"kind": "measure", "measured_whole": True, "windows": windows, "steps": None, "step_reports": None,
            "precision": None}  # fmt: skip


def _cap_setting(d: dict[str, Any]) -> dict[str, Any]:
    clock = d.get("clock_cap_mhz")
    return {
        "clock_cap_mhz": int(clock) if clock is not None else None,
        "power_limit_w": d.get("power_limit_w"),
    }


def stored_report(path: Path, job: str) -> dict[str, Any] | None:
    """The job's last run as the store has it, in a report's shape, or None if the store
    never saw it end. ``earlier_runs``: how many runs of the same id came before."""
    db = _open(path)
    try:
        runs = runs_of(_rows(db, "greend_job", "job = ?", (job,)), key=lambda r: r.get("run") or None)
        if not runs:
            return None
        r = join_rows(runs[-1])  # its parts, where the daemon restarted under it
        prev_end = runs[-2][-1]["ts_ns"] if len(runs) > 1 else 0
        decisions = _rows(db, "greend_decision", "job = ? AND ts_ns > ? AND ts_ns <= ?", (job, prev_end, r["ts_ns"]))
    finally:
        db.close()
    caps: list[dict[str, Any]] = []
    precision_log: list[dict[str, Any]] = []
    notes: list[dict[str, Any]] = []
    for d in decisions:
        if d.get("kind") == "note":
            # Each policy's last word (a run the daemon restarted under has one per part).
            notes = [n for n in notes if n["policy"] != d.get("policy")]
            notes.append({"policy": d.get("policy"), "reason": d.get("reason"), "since": d["ts_ns"] / 1e9})
        elif d.get("kind") == "cap":
            if d.get("gpu") not in (None, "", "0") and caps and caps[-1]["t"] == d["ts_ns"] / 1e9:
                continue  # the same decision on the job's next GPU
            caps.append({"t": d["ts_ns"] / 1e9, "setting": _cap_setting(d), "reason": d.get("reason")})
        else:
            precision_log.append(
                {
                    "t": d["ts_ns"] / 1e9,
                    "kind": d.get("kind"),
                    "from": None,
                    "to": d.get("precision") or None,
                    "reason": d.get("reason"),
                    "step": d.get("step"),
                    "loss": d.get("loss"),
                    "trend": d.get("trend"),
                }
            )
    energy = r.get("energy_j")
    saved = r.get("saved_gpu_energy_j")
    flops, gpu_j, cpu_j, span = r.get("flops") or 0.0, r.get("gpu_energy_j"), r.get("cpu_energy_j"), r.get("duration_s")
    gpu_power, flop_per_s, _ = rates(flops, gpu_j, span or 0.0)  # (the live report's rates, from the row)
    return {
        "job": job,
        "run_id": r.get("run"),
        "state": "ended",
        "end_reason": r.get("end_reason") or None,
        "host": r.get("host"),
        "gpus": None,
        "gpu_source": r.get("gpu_source") or None,  # stored since greend_job carries it
        "steps": r.get("steps") or 0,
        "step_reports": r.get("steps") or 0,
        "ranks": int(r.get("ranks_here") or 0),  # (the ranks that ran here, all gone)
        "ranks_gone": [],
        "flops": flops,
        "samples": r.get("samples") or 0,
        "tokens": r.get("tokens") or 0,
        "duration_s": span,
        "gpu_energy_j": gpu_j,
        # A row without CPU energy: no RAPL zone or estimate measured it (stored before, as 0 J).
        "cpu_energy_j": cpu_j,
        "cpu_energy_method": "stored" if cpu_j is not None else "unmeasured",
        "energy_j": energy,
        "energy_kwh": r.get("energy_kwh"),
        "avg_power_w": r.get("avg_power_w"),
        "avg_gpu_power_w": gpu_power,
        "flop_per_s": flop_per_s,
        "gflops_per_w": r.get("gflops_per_w"),
        "gflops_per_w_with_cpu": rates(flops, energy, span or 0.0)[2] if cpu_j is not None else None,
        "co2_g": r.get("co2_g"),
        "co2_method": "from the store",
        "last_loss": r.get("last_loss"),
        "precision": r.get("precision"),
        **_stored_kind(r),
        "precision_log": precision_log,
        "decisions": caps,
        "notes": notes,
        "savings": {
            "baseline": None,
            "saved_j": saved,
            "saved_pct": r.get("saved_pct"),
            "slowdown_pct": r.get("slowdown_pct"),
            "confidence": None,
            "note": None if saved is not None else "no baseline was measured",
        },
        "ended_at": r["ts_ns"] / 1e9,
        "earlier_runs": len(runs) - 1,
        "parts": r.get("parts"),  # the run's parts, where the daemon restarted under it
        "unseen_steps": r.get("unseen_steps"),
        "from_store": str(path),
    }


# The whole job across nodes --------------------------------------------------------------
# Each node's daemon stores its own ranks' share of a job (greend_job, tagged host): the
# job's figures are their sums (energy, FLOPs, samples, tokens, the saving), its steps and
# duration the largest node's (every rank runs the same steps), and its GFLOPS/W the
# summed FLOPs over the summed joules, never the mean of the nodes' quotients.
_SUMMED = ("flops", "samples", "tokens", "gpu_energy_j", "cpu_energy_j", "energy_j", "co2_g")


PROMETHEUS_SCHEMES = ("prom", "prom+https")


def is_shared_store(store: str) -> bool:
    """A store given by URL (a shared time-series server), not a SQLite file."""
    return store.partition("://")[0] in ("http", "https", "influx", *PROMETHEUS_SCHEMES) and "://" in store


def _get(url: str, path: str, params: dict[str, str], timeout_s: float, api: str) -> str:
    """GET ``path`` with ``params`` from the server behind the store ``url`` (``influx://``,
    ``prom://`` and ``http://`` go over HTTP, their ``+https``/``https`` forms over TLS);
    a StoreError that names ``api`` when the server refuses it or cannot be reached."""
    import urllib.error
    import urllib.request
    from urllib.parse import urlencode

    try:
        parts = urlsplit(url)
        _ = parts.port  # (raises on a port that is no number)
    except ValueError as e:
        raise StoreError(f"store URL {url!r}: {e}; expected e.g. http://HOST:PORT or influx://HOST:PORT") from None
    base = f"{'https' if parts.scheme.endswith('https') else 'http'}://{parts.netloc}"
    try:
        with urllib.request.urlopen(f"{base}{path}?{urlencode(params)}", timeout=timeout_s) as r:
            return r.read().decode()
    except urllib.error.HTTPError as e:
        raise StoreError(f"{url}: the server answered {e.code} to {api}") from None
    except (OSError, urllib.error.URLError, ValueError) as e:  # (http.client.InvalidURL is a ValueError)
        raise StoreError(f"cannot reach the store {url}: {e}") from None


def _check_job_id(job: str | None) -> None:
    from greend.protocol import JOB_ID_RE

    if job is not None and not JOB_ID_RE.match(job):
        raise StoreError(f"job id {job!r} is not one greend accepts")


def _job_rows(url: str, job: str | None, since_s: float = REPORT_LOOKBACK_S) -> list[dict[str, Any]]:
    """The ``greend_job`` rows of a shared store from the last ``since_s``, whichever API it speaks."""
    if url.partition("://")[0] in PROMETHEUS_SCHEMES:
        return prometheus_job_rows(url, job, lookback=f"{max(1, round(since_s))}s")
    return shared_job_rows(url, job, since_s=since_s)


# greenctl's report field <- the series every node's Prometheus endpoint serves
# (greend/stores/prometheus.py), labelled job, run and host.
_PROM_FIELDS = {
    "energy_j": "greend_job_energy_joules_total",
    "gpu_energy_j": "greend_job_gpu_energy_joules_total",
    "flops": "greend_job_flops_total",
    "steps": "greend_job_steps_total",
    "world_size": "greend_job_world_size",
    "ranks_here": "greend_job_ranks_here",
    "ended_at": "greend_job_end_time_seconds",
    "gflops_per_w": "greend_job_gflops_per_watt",
    "duration_s": "greend_job_duration_seconds",
    "saved_gpu_energy_j": "greend_job_saved_gpu_energy_joules",
    "gpu_source": "greend_job_gpu_simulated",
    "precision": "greend_job_precision",
}
_PROM_COUNTS = ("steps", "world_size", "ranks_here")  # (whole numbers: read back as such)


def prometheus_job_rows(
    url: str, job: str | None, timeout_s: float = 10.0, lookback: str = "30d"
) -> list[dict[str, Any]]:
    """The job's rows (one per host and run; every job's where ``job`` is None) from a
    Prometheus that scrapes every node's ``prometheus://`` endpoint, through its HTTP query
    API: the last value of each job series over ``lookback``. ``url``: ``prom://HOST:PORT``
    (``prom+https://`` for TLS). A job that still runs has no end time: its row is dated now."""
    import json
    import time

    _check_job_id(job)
    selector = "" if job is None else '{job="' + job + '"}'
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    now_ns = int(time.time() * 1e9)
    for field, metric in _PROM_FIELDS.items():
        query = {"query": f"last_over_time({metric}{selector}[{lookback}])"}
        text = _get(url, "/api/v1/query", query, timeout_s, "Prometheus' /api/v1/query")
        try:
            body = json.loads(text)
        except ValueError as e:
            raise StoreError(f"{url}: not a Prometheus query API answer ({e})") from None
        if body.get("status") != "success":
            raise StoreError(f"{url}: the query failed: {body.get('error') or body}")
        for sample in body.get("data", {}).get("result", []):
            labels = sample.get("metric", {})
            name, run, host = str(labels.get("job", "")), str(labels.get("run", "")), str(labels.get("host", ""))
            row = rows.setdefault(
                (name, run, host), {"ts_ns": now_ns, "host": host, "job": name, "run": run or None, "precision": None}
            )
            value = float(sample["value"][1])
            if field == "precision":  # one series per level, 1 for the job's
                if value == 1.0:
                    row["precision"] = str(labels.get("precision") or "") or None
            elif field == "gpu_source":  # (as a greend_job row is tagged)
                row["gpu_source"] = "sim" if value == 1.0 else None
            else:
                row[field] = int(value) if field in _PROM_COUNTS and value.is_integer() else value
    for row in rows.values():
        if row.get("ended_at"):
            row["ts_ns"] = int(row["ended_at"] * 1e9)
            row["end_reason"] = "ended"
    return sorted(rows.values(), key=lambda r: int(r["ts_ns"]))


def shared_job_rows(
    url: str, job: str | None, timeout_s: float = 10.0, since_s: float | None = REPORT_LOOKBACK_S
) -> list[dict[str, Any]]:
    """The job's ``greend_job`` rows (one per node and run; every job's where ``job`` is
    None) from a shared store that every
    node's ``influx://`` store writes to, read through VictoriaMetrics' export API (each
    field is a series ``greend_job_<field>`` with the point's tags as labels). ``url``:
    the store's ``influx://HOST:PORT?...`` as the daemons have it, or ``http://HOST:PORT``.
    InfluxDB itself has no such API: docs/stores.md gives its Flux query.

    Bounded by labels and time, never a full export: only the ``greend_job`` summary's
    series (one point per node and run, written at the job's end; not the per-interval
    ``greend_job_steps`` rows), the job's label where given, from ``since_s`` ago."""
    import json
    import time

    _check_job_id(job)
    names = "|".join(JOB_SUMMARY_FIELDS)
    selector = f'__name__=~"greend_job_({names})"' + ("" if job is None else ',job="' + job + '"')
    params = {"match[]": "{" + selector + "}"}
    if since_s is not None:
        params["start"] = f"{time.time() - since_s:.3f}"
    body = _get(
        url,
        "/api/v1/export",
        params,
        timeout_s,
        "VictoriaMetrics' /api/v1/export; greenctl reads a shared store through that API (for "
        "InfluxDB, use the Flux query in docs/stores.md)",
    )
    rows: dict[tuple[str, str, int], dict[str, Any]] = {}
    for line in body.splitlines():
        if not line.strip():
            continue
        try:
            series = json.loads(line)
            labels = series["metric"]
            field = labels["__name__"].removeprefix("greend_job_")
            points = zip(series["timestamps"], series["values"], strict=True)
        except (ValueError, KeyError, TypeError) as e:
            raise StoreError(f"{url}: an unreadable line from /api/v1/export ({e})") from None
        host, name = str(labels.get("host", "")), str(labels.get("job", job or ""))
        for ts_ms, value in points:
            row = rows.setdefault(
                (name, host, int(ts_ms)),
                {"ts_ns": int(ts_ms) * 1_000_000, "host": host, "job": name, "precision": labels.get("precision"),
                 "end_reason": labels.get("end_reason"), "run": labels.get("run"),
                 "gpu_source": labels.get("gpu_source")},  # (the "(sim)" label: greend.points.job_point)
            )  # fmt: skip
            row[field] = value
    return sorted(rows.values(), key=lambda r: int(r["ts_ns"]))


def one_file_of_many_nodes(path: Path, job: str) -> bool:
    """Whether ``path`` is a SQLite file that holds ``job``'s rows from more than one host (a
    file the nodes share): its report is then the whole job's, summed across them. False
    for anything that is no such file (the single-file path says what is wrong with it)."""
    if not path.is_file():
        return False
    try:
        db = _open(path)
    except (StoreError, OSError):
        return False
    try:
        return len({r.get("host") for r in _rows(db, "greend_job", "job = ?", (job,))}) > 1
    except (StoreError, sqlite3.Error):
        return False
    finally:
        db.close()


def whole_job_report(stores: list[Path | str], job: str, run: str | None = None) -> dict[str, Any] | None:
    """``job`` across ``stores``: SQLite files (one per node, or one shared file) or shared
    stores by URL (VictoriaMetrics, :func:`shared_job_rows`; Prometheus,
    :func:`prometheus_job_rows`): the job's latest run, each host's row of it, and their
    totals (:func:`_whole`). None if no store has the job."""
    seen: dict[tuple[str, int], dict[str, Any]] = {}
    decisions: list[dict[str, Any]] = []  # the level's moves each node logged (SQLite stores)
    for store in stores:
        if isinstance(store, str) and is_shared_store(store):
            rows = _job_rows(store, job)
        else:
            db = _open(Path(store))
            try:
                rows = _rows(db, "greend_job", "job = ?", (job,))
                decisions += _rows(db, "greend_decision", "job = ? AND kind NOT IN ('cap', 'note')", (job,))
            finally:
                db.close()
        for r in rows:
            # The same row in two stores (a copy given twice) counts once. A shared
            # store keeps milliseconds: the key is the host and the millisecond.
            seen.setdefault((str(r.get("host")), int(r["ts_ns"]) // 1_000_000), {**r, "store": str(store)})
    if not seen:
        return None
    whole = _whole(job, list(seen.values()), run)
    whole["precision_log"] = _merged_moves(decisions, whole["run_id"])
    return whole


def _merged_moves(decisions: list[dict[str, Any]], run: str | None) -> list[dict[str, Any]]:
    """The job's level moves (proposals, switches, rollbacks, refusals) over its nodes, in
    time order: one entry a move, with the hosts that logged it (each node's daemon logs
    the job's moves, and each rank tells its own: the same move at the same step is one)."""
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for d in sorted(decisions, key=lambda d: int(d["ts_ns"])):
        if run and d.get("run") not in (run, None, ""):
            continue
        key = (d.get("kind"), d.get("precision"), d.get("step"))
        m = merged.get(key)
        if m is None:
            merged[key] = {
                "t": d["ts_ns"] / 1e9,
                "kind": d.get("kind"),
                "to": d.get("precision") or None,
                "step": d.get("step"),
                "reason": d.get("reason"),
                "hosts": [str(d.get("host"))],
            }
        elif str(d.get("host")) not in m["hosts"]:
            m["hosts"].append(str(d.get("host")))
    return list(merged.values())


def shared_jobs(url: str, since_s: float = LIST_LOOKBACK_S) -> list[dict[str, Any]]:
    """Every job a shared store holds that ended within ``since_s``, each summed across
    its nodes (as :func:`whole_job_report`), in ``greenctl jobs``' shape, oldest first."""
    by_run: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in _job_rows(url, None, since_s):
        by_run.setdefault((r["job"], r.get("run") or ""), []).append({**r, "store": url})
    out = []
    for (job, _), rows in by_run.items():
        w = _whole(job, rows)
        out.append(
            {
                "job": job,
                "run_id": w["run_id"],
                "state": "ended",
                "ranks": None,
                "gpus": [],
                "steps": w["steps"],
                "flops": w["flops"],
                "duration_s": w["duration_s"],
                "gpu_energy_j": w["gpu_energy_j"],
                "energy_j": w["energy_j"],
                "gflops_per_w": w["gflops_per_w"],
                "precision": w["nodes"][-1]["precision"],
                "saved_pct": w["saved_pct"],
                "sim": w["sim"],  # (its saving is the simulator's: labelled "(sim)")
                "ended_at": max(n["ended_at"] for n in w["nodes"]),
                "nodes": len(w["nodes"]),
                "world_size": w["world_size"],
                "ranks_found": w["ranks_found"],
                "complete": w["complete"],
                "from_store": url,
            }
        )
    return sorted(out, key=lambda j: j["ended_at"])


def _latest_run(ordered: list[dict[str, Any]]) -> str:
    """The latest run tag among ``ordered`` (rows sorted by their time). Each node stamps
    its rows with its own clock, and clocks differ: where one node holds rows of two runs,
    its own order says which came later, and a run some node saw end before another is
    never the latest (a node's clock 10 minutes fast made its old run look newest). Among
    the rest, the one that ended last."""
    span: dict[tuple[str, str, str], tuple[int, int]] = {}  # (store, host, run) -> (first, last) ts
    for r in ordered:
        key = (str(r.get("store")), str(r.get("host")), r.get("run") or "")
        ts = int(r["ts_ns"])
        first, last = span.get(key, (ts, ts))
        span[key] = (min(first, ts), max(last, ts))
    superseded: set[str] = set()
    for (store, host, run), (_, last) in span.items():
        for (store2, host2, run2), (first2, _) in span.items():
            if (store2, host2) == (store, host) and run2 != run and first2 > last:
                superseded.add(run)  # this node saw ``run`` end before ``run2``
    for r in reversed(ordered):
        if (r.get("run") or "") not in superseded:
            return str(r.get("run") or "")
    return str(ordered[-1].get("run") or "")


def _whole(job: str, rows: list[dict[str, Any]], run: str | None = None) -> dict[str, Any]:
    """The job from its rows (each with its ``store``): ``run``, else its latest run (by
    the run tag every rank shares, :func:`_latest_run`), each node's row of that run,
    summed. Rows stored before runs were tagged count as one run per node, the last."""
    ordered = sorted(rows, key=lambda r: int(r["ts_ns"]))
    runs = {r.get("run") or "" for r in ordered}
    if run is not None and run not in runs:
        raise StoreError(
            f"job {job!r} has no run {run!r} in these stores (its runs: {', '.join(sorted(r for r in runs if r))})"
        )
    run = run if run is not None else _latest_run(ordered)
    if run:
        ordered = [r for r in ordered if r.get("run") == run]
    # A node is a host in a store: its row of that run (its parts joined, where the daemon
    # restarted under it; the latest, for untagged rows).
    by_node: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in ordered:
        by_node.setdefault((r["store"], str(r.get("host"))), []).append(r)
    last = {
        node: join_rows(runs_of(rs, key=lambda r: r.get("run") or None)[-1]) if run else rs[-1]
        for node, rs in by_node.items()
    }
    nodes = []
    for (_, host), r in sorted(last.items()):
        nodes.append(
            {
                "host": host,
                "store": r["store"],
                "ranks_here": r.get("ranks_here"),
                "world_size": r.get("world_size"),
                "steps": r.get("steps"),
                "gpu_source": r.get("gpu_source") or None,  # "sim": the simulator's GPU figures
                "duration_s": r.get("duration_s"),
                "flops": r.get("flops"),
                "gpu_energy_j": r.get("gpu_energy_j"),
                "energy_j": r.get("energy_j"),
                "gflops_per_w": r.get("gflops_per_w"),
                "saved_gpu_energy_j": r.get("saved_gpu_energy_j"),
                "precision": r.get("precision"),
                "end_reason": r.get("end_reason") or None,
                "ended_at": r["ts_ns"] / 1e9,
                "unseen_steps": int(r.get("unseen_steps") or 0),
                "unmeasured_s": float(r.get("unmeasured_s") or 0.0),
            }
        )
    total: dict[str, Any] = {k: sum(float(r.get(k) or 0.0) for r in last.values()) for k in _SUMMED}
    world = max((int(r.get("world_size") or 0) for r in last.values()), default=0) or None
    ranks = sum(int(r.get("ranks_here") or 0) for r in last.values())
    gpu_e = total["gpu_energy_j"]
    saved_parts = [r.get("saved_gpu_energy_j") for r in last.values()]
    saved = sum(float(x) for x in saved_parts if x is not None) if all(x is not None for x in saved_parts) else None
    missing = [] if world is None or ranks >= world else [f"{world - ranks} of {world} ranks have no stored figures"]
    if saved is None and any(x is not None for x in saved_parts):
        missing.append("a node measured no baseline: no saving for the whole job")
    for n in nodes:  # (its daemon stopped without keeping them: its figures leave them out)
        if n["unseen_steps"]:
            missing.append(f"{n['host']}: {n['unseen_steps']} steps its ranks sent are in no record of it")
        if n["unmeasured_s"] >= 0.1:
            missing.append(f"{n['host']}: {n['unmeasured_s']:.1f} s with no daemon measuring (a restart): not counted")
    if not any(r.get(k) for r in last.values() for k in ("steps", "flops", "gpu_energy_j", "energy_j")):
        # (a Prometheus query API that is no Prometheus scraping greend's /metrics matches a
        # few names and none of the job's figures: no report is "complete" on nothing)
        missing.append("these stores hold no steps, FLOPs or energy of the job")
    return {
        "job": job,
        "run_id": run or None,
        "other_runs": len(runs) - 1,
        "nodes": nodes,
        "world_size": world,
        "ranks_found": ranks,
        "complete": not missing,
        "missing": missing,
        "steps": max(int(r.get("steps") or 0) for r in last.values()),
        "duration_s": max(float(r.get("duration_s") or 0.0) for r in last.values()),
        **total,
        "gflops_per_w": total["flops"] / gpu_e / 1e9 if gpu_e > 0 and total["flops"] > 0 else None,
        "saved_gpu_energy_j": saved,
        "saved_pct": 100.0 * saved / (gpu_e + saved) if saved is not None and gpu_e + saved > 0 else None,
        "sim": any(n.get("gpu_source") == "sim" for n in nodes),
    }
