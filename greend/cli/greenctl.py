"""``greenctl``: show and steer the greend daemon on this node."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import typer

from greend.cli.common import ReplyShapeGroup, fail, request, store_file, store_path, target, try_request
from greend.cli.profile import profile_app
from greend.cli.render import cap_notes, fmt, plot_report, render_jobs, render_report, render_status, render_whole_job
from greend.cli.shell import complete_clock_policy, complete_job, hoist_root_options
from greend.config import default_socket_path
from greend.errors import DaemonUnavailable, GreendError, RequestRefused

__all__ = ["ctl_app", "ctl_main"]

log = logging.getLogger("greend")

ctl_app = typer.Typer(
    add_completion=True,
    no_args_is_help=True,
    help="greenctl: show and steer the greend daemon on this node.",
    cls=ReplyShapeGroup,
)


def _print_version(value: bool) -> None:
    if value:
        from greend import __version__

        typer.echo(f"greenctl (greend) {__version__}")
        raise typer.Exit(0)


@ctl_app.callback()
def _ctl_root(
    socket: Path | None = typer.Option(
        None, "--socket", help="daemon socket (default $GREEND_SOCKET or /run/greend/greend.sock)"
    ),
    timeout: float = typer.Option(5.0, "--timeout", help="seconds to wait for the daemon (> 0)"),
    version: bool = typer.Option(
        False, "--version", metavar="", is_eager=True, callback=_print_version, help="print greenctl's version and exit"
    ),
) -> None:
    if not (math.isfinite(timeout) and 0 < timeout <= 86400):
        fail(f"--timeout {timeout:g}: expected seconds > 0 and at most a day (how long to wait for the daemon)")
    target.socket = socket or default_socket_path()
    target.named = socket is not None or bool(os.environ.get("GREEND_SOCKET"))
    target.timeout_s = timeout


@ctl_app.command("status")
def ctl_status(
    as_json: bool = typer.Option(False, "--json", metavar="", help="machine-readable"),
    fmt_: str | None = typer.Option(
        None, "--format", help="csv or json: one row per GPU and CPU zone (json: one object a line)"
    ),
    interval: float | None = typer.Option(
        None, "--interval", help="repeat every S seconds until Ctrl-C (as nvidia-smi -l); rows only"
    ),
    count: int | None = typer.Option(None, "--count", help="with --interval: stop after N readings"),
    output: Path | None = typer.Option(None, "--output", help="append the rows to FILE instead of printing them"),
) -> None:
    """GPUs, CPU zones, jobs and policy, live. --format/--interval/--output: device rows
    for scripts and logs (nvidia-smi --query-gpu ... --format=csv -l)."""
    if fmt_ is None and interval is None and output is None and count is None:
        st = request("status")
        typer.echo(json.dumps(st, indent=2) if as_json else render_status(st))
        return
    import sys
    import time

    from greend.cli.sample_log import SampleLog, status_rows

    if interval is not None and not (math.isfinite(interval) and interval >= 0.1):
        fail(f"--interval {interval:g}: expected seconds >= 0.1")
    if count is not None and (count < 1 or interval is None):
        fail(f"--count {count}: expected N >= 1, with --interval")
    try:
        log = SampleLog(fmt_ or ("json" if as_json else "csv"), out=sys.stdout, path=output)
    except (ValueError, OSError) as e:
        fail(str(e))
        return
    n = 0
    try:
        while True:
            log.write(status_rows(request("status")))
            n += 1
            if interval is None or (count is not None and n >= count):
                break
            time.sleep(interval)
    except KeyboardInterrupt:
        pass
    finally:
        log.close()


@ctl_app.command("top")
def ctl_top(
    interval: float = typer.Option(1.0, "--interval", help="seconds between refreshes (>= 0.1)"),
    once: bool = typer.Option(
        False, "--once", metavar="", help="print one frame (two readings an interval apart) and exit"
    ),
    sort: str = typer.Option(
        "job", "--sort", help="the jobs' order: job, energy, now (GFLOPS/W), run (GFLOPS/W), steps, rate"
    ),
) -> None:
    """GPUs, caps and jobs with their current GFLOPS/W, refreshed in place (Ctrl-C quits;
    on a terminal: q quits, s or < > change the jobs' sort, p pauses, ? explains)."""
    from greend.cli.top import run_top
    from greend.cli.top_keys import TerminalKeys

    if not (math.isfinite(interval) and interval >= 0.1):
        fail(f"--interval {interval:g}: expected seconds >= 0.1")

    def status() -> dict[str, Any]:
        with target.client() as c:
            return dict(c.request("status"))

    try:
        keys = None if once or not os.isatty(1) else TerminalKeys.for_stdin()  # (keys: a terminal both ways)
        run_top(status, socket=str(target.path()), interval_s=interval, once=once, sort=sort, keys=keys)
    except GreendError as e:
        fail(str(e), code=3)


@ctl_app.command("events")
def ctl_events(
    interval: float = typer.Option(0.5, "--interval", help="seconds between looks at the daemon (>= 0.1)"),
    count: int | None = typer.Option(None, "--count", help="stop after N events"),
    as_json: bool = typer.Option(False, "--json", metavar="", help="one JSON object a line"),
) -> None:
    """A live feed of the controller's decisions, jobs starting and ending, and policy
    changes, one line each (Ctrl-C quits)."""
    from greend.cli.events import run_events

    if not (math.isfinite(interval) and interval >= 0.1):
        fail(f"--interval {interval:g}: expected seconds >= 0.1")
    if count is not None and count < 1:
        fail(f"--count {count}: expected N >= 1")
    run_events(lambda: request("status"), typer.echo, interval_s=interval, as_json=as_json, count=count)


@ctl_app.command("probes")
def ctl_probes(as_json: bool = typer.Option(False, "--json", metavar="", help="machine-readable")) -> None:
    """What was detected, what is missing and why."""
    res = request("probes")
    if as_json:
        typer.echo(json.dumps(res, indent=2))
        return
    for p in res["probes"]:
        mark = "ok  " if p["open"] else "--  "
        typer.echo(f"{mark}{p['name']:6} {p.get('detail') or p.get('last_error') or ''}")
        for d in p.get("devices") or []:
            typer.echo(f"        {d}")
        if not p["open"] and p.get("fix") and p["fix"] not in (p.get("detail") or p.get("last_error") or ""):
            typer.echo(f"        fix: {p['fix']}")
        if p["open"] and not p["success"] and p.get("last_error"):
            typer.echo(f"        failing: {p['last_error']}")


@ctl_app.command("jobs")
def ctl_jobs(
    as_json: bool = typer.Option(False, "--json", metavar="", help="machine-readable"),
    all_jobs: bool = typer.Option(
        False, "--all", metavar="", help="also the ended jobs in the SQLite store (kept over restarts)"
    ),
    store: str | None = typer.Option(
        None,
        "--store",
        help="the SQLite store file (default: the daemon's); or a shared store the nodes write to "
        "(influx://HOST:PORT?... or http://HOST:PORT, victoria-metrics), or a Prometheus that "
        "scrapes every node (prom://HOST:PORT): every job there, summed across its nodes",
    ),
    since: str | None = typer.Option(
        None, "--since", help="the ended jobs that ended within this long (30m, 12h, 7d; a shared --store: 1d)"
    ),
) -> None:
    """Jobs on this node: running, and recently ended (--all: every ended job the store has;
    --store URL: every ended job of the cluster in a shared store, the last --since)."""
    from greend.jobs.history import is_shared_store, parse_duration_s, shared_jobs, stored_jobs

    try:
        since_s = parse_duration_s(since) if since is not None else None
    except ValueError as e:
        fail(f"--since: {e}")
    if store is not None and is_shared_store(store):
        try:
            cluster = shared_jobs(store, since_s or 86400.0)
        except GreendError as e:
            fail(str(e))
        typer.echo(json.dumps({"jobs": cluster}, indent=2) if as_json else render_jobs(cluster))
        return

    if store is not None:
        all_jobs = True  # a store file given: its ended jobs are what was asked for
    live: list[dict[str, Any]] = []
    daemon_down: str | None = None
    try:
        live = try_request("jobs")["jobs"]
    except DaemonUnavailable as e:
        if not all_jobs:
            fail(str(e), code=3)
        daemon_down = str(e)
    jobs = list(live)
    if all_jobs:
        path = store_path(store_file(store) if store is not None else None)
        if path is not None:
            try:
                stored = stored_jobs(path)
                # A run the daemon still lists (or kept from before a restart) is in the store
                # once it ended: listed once, as the daemon has it; so are the stored parts
                # of a run it lists joined (the daemon restarted under it), running or not.
                listed = {(j["job"], j.get("run_id")) for j in live if j["state"] == "ended"}
                begun = {(j["job"], j.get("run_id"), j.get("started_at")) for j in live if j.get("started_at")}
                jobs = [
                    k
                    for k in stored
                    if (k["job"], k.get("run_id")) not in listed
                    and (k["job"], k.get("run_id"), k.get("started_at")) not in begun
                ] + live
            except GreendError as e:
                if daemon_down or store is not None:
                    fail(str(e))
                typer.echo(f"note: {e}; the daemon's list follows (its latest ended runs)", err=True)
        elif daemon_down:
            fail(f"{daemon_down}; and no SQLite store to read: give --store FILE")
    if since_s is not None:  # (running jobs stay listed)
        cutoff = time.time() - since_s
        jobs = [j for j in jobs if j.get("state") != "ended" or (j.get("ended_at") or cutoff) >= cutoff]
    typer.echo(json.dumps({"jobs": jobs}, indent=2) if as_json else render_jobs(jobs))


@ctl_app.command("report")
def ctl_report(
    job: str = typer.Argument(..., help="job id (see greenctl jobs)", autocompletion=complete_job),
    as_json: bool = typer.Option(False, "--json", metavar="", help="machine-readable"),
    plot: Path | None = typer.Option(None, "--plot", help="write power and GFLOPS/W over time to FILE.png"),
    stores: list[str] | None = typer.Option(
        None,
        "--store",
        help="the SQLite store file, for jobs the daemon no longer knows (default: the daemon's); "
        "give it once per node (--store A.db --store B.db), or a shared store the nodes write to "
        "(--store influx://HOST:PORT?... or http://HOST:PORT, read through VictoriaMetrics' export "
        "API), or a Prometheus that scrapes every node (--store prom://HOST:PORT), for the whole "
        "job across nodes",
    ),
    run: str | None = typer.Option(
        None, "--run", help="with stores per node or a shared store: this run of the job (default: its latest)"
    ),
) -> None:
    """A job's energy, power, FLOPs, GFLOPS/W, samples or tokens per joule, CO2 and the energy greend saved; one
    the daemon no longer knows comes from the store; with a store per node (or one they share), the whole job."""
    from greend.jobs.history import is_shared_store, one_file_of_many_nodes, stored_report, whole_job_report

    if plot is not None:
        _check_plot_path(plot)
    one = stores[0] if stores is not None and len(stores) == 1 else None  # (one file that nodes share?)
    one_file = one is not None and not is_shared_store(one) and one_file_of_many_nodes(store_file(one), job)
    if stores and (len(stores) > 1 or any(is_shared_store(p) for p in stores) or one_file):  # (one file: shared)
        for p in stores:
            if not is_shared_store(p) and not store_file(p).is_file():
                fail(
                    f"--store {p}: no such file (give each node's SQLite store: a copy of its "
                    "/var/lib/greend/greend.db; or a shared store by URL: influx://HOST:PORT?... "
                    "or http://HOST:PORT)"
                )
        try:
            whole = whole_job_report([p if is_shared_store(p) else str(store_file(p)) for p in stores], job, run=run)
        except GreendError as e:
            fail(str(e))
        if whole is None:
            fail(f"job {job!r} is in none of the stores {', '.join(map(str, stores))}")
        typer.echo(json.dumps(whole, indent=2) if as_json else render_whole_job(whole))
        return
    if run is not None:
        fail("--run picks a run of the job across nodes: give the nodes' stores (--store A.db --store B.db) or a "
             "shared store")  # fmt: skip
    store = store_file(stores[0]) if stores else None
    r: dict[str, Any] | None = None
    why, down = "", False
    try:
        r = try_request("report", job=job)
    except (DaemonUnavailable, RequestRefused) as e:
        why, down = str(e), isinstance(e, DaemonUnavailable)
    path = store_path(store)
    if r is None:
        if path is not None:
            try:
                r = stored_report(path, job)
            except GreendError as e:
                fail(str(e))
        if r is None:
            where = f"; nor in the store {path}" if path is not None else "; and no SQLite store: give --store FILE"
            fail(f"{why}{where}", code=3 if down else 2)
        typer.echo(f"(from the store {r['from_store']}: the daemon no longer knows this job)", err=True)
    elif r.get("from_history"):
        typer.echo("(from the daemon's history: this run ended before the daemon last started)", err=True)
        if r.get("earlier_runs"):
            typer.echo(f"note: job id {job!r} ran {r['earlier_runs']} time(s) before this run", err=True)
    elif path is not None:
        try:
            from greend.jobs.history import stored_jobs

            runs = [j for j in stored_jobs(path) if j["job"] == job]
        except GreendError:
            runs = []
        before = sum(1 for j in runs if j.get("run_id") != r.get("run_id") or not r.get("run_id"))
        before -= 1 if r.get("state") == "ended" and not r.get("run_id") else 0
        if before > 0:
            typer.echo(
                f"note: job id {job!r} ran {before} time(s) before this run; greenctl jobs --all lists every run",
                err=True,
            )
    if as_json:
        out = dict(r)
        out.pop("series", None)
        typer.echo(json.dumps(out, indent=2))
    else:
        typer.echo(render_report(r))
    if plot is not None:
        try:
            plot_report(r, plot)
        except (RuntimeError, OSError, ValueError) as e:
            fail(f"--plot {plot}: {e}")
        typer.echo(f"plot written to {plot}", err=True)


def _check_plot_path(plot: Path) -> None:
    if plot.suffix.lower() not in (".png", ".svg", ".pdf"):
        fail(f"--plot {plot}: give a file ending in .png (or .svg, .pdf)")
    parent = plot.parent if str(plot.parent) else Path(".")
    if not parent.is_dir():
        fail(f"--plot {plot}: no directory {parent}")
    if not os.access(parent, os.W_OK):
        fail(f"--plot {plot}: cannot write in {parent}")


@ctl_app.command("demo")
def ctl_demo(
    seconds: float = typer.Option(45.0, "--seconds", help="about how long each of the two runs trains"),
    gpus: str = typer.Option("auto", "--gpus", help="sim, real, or auto (real GPUs if NVML and CUDA work)"),
    keep: Path | None = typer.Option(None, "--keep", help="keep the daemon's state dir and store here"),
    precision: str = typer.Option(
        "bf16", "--precision", help="the level the job trains at on its own: bf16 (most GPU training) or fp32"
    ),
) -> None:
    """Train a small real torch model twice at its own precision (bf16 by default), as it is and
    with greend's controller on (efficient clocks + one precision level down, bf16 -> fp8), on a
    simulated H100; print both side by side and the energy saved."""
    from greend.cli.demo import run_demo

    try:
        code = run_demo(seconds=seconds, gpus=gpus, keep=keep, precision=precision)
    except GreendError as e:
        fail(str(e))
        return
    raise typer.Exit(code)


@ctl_app.command("measure", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def ctl_measure(
    cmd: list[str] = typer.Argument(None, help="the command to run, after --"),
    job: str | None = typer.Option(None, "--job", help="job id (default measure-<pid>)"),
    gpus: str | None = typer.Option(
        None, "--gpus", help="GPU indices, e.g. 0,1 (default $CUDA_VISIBLE_DEVICES, else every GPU)"
    ),
    flops: float | None = typer.Option(None, "--flops", help="the FLOPs the whole command does, if known"),
    as_json: bool = typer.Option(False, "--json", metavar="", help="the report, machine-readable"),
    interval: float = typer.Option(1.0, "--interval", help="seconds between readings (>= 0.1)"),
    output: Path | None = typer.Option(
        None, "--output", help="append a reading of the command's devices every --interval to FILE"
    ),
    fmt_: str = typer.Option("csv", "--format", help="--output's format: csv or json (one object a line)"),
    local: bool = typer.Option(
        False, "--local", metavar="", help="measure in this process from NVML/RAPL even if a daemon answers"
    ),
    sysfs_root: Path = typer.Option(Path("/sys"), "--sysfs-root", help="where RAPL is read, in-process"),
) -> None:
    """Run a command as a greend job, no code change: its GPUs' energy, power, CO2 (and
    GFLOPS/W with --flops) over its life. Exits with the command's status. The command
    always runs: with no daemon answering it is measured in this process, from NVML and
    RAPL directly."""
    from greend.cli.measure import run_measure
    from greend.cli.measure_local import measure_locally, render_local
    from greend.cli.sample_log import SampleLog, status_rows

    if not cmd:
        fail("give the command after --: greenctl measure -- python train.py")
    if not (math.isfinite(interval) and interval >= 0.1):
        fail(f"--interval {interval:g}: expected seconds >= 0.1")
    if flops is not None and not (math.isfinite(flops) and 0 <= flops <= 1e26):
        fail(f"--flops {flops:g}: expected the command's FLOPs, a number from 0 to 1e26")
    gpu_list: list[int] | None = None
    if gpus is not None:
        try:
            gpu_list = [int(g) for g in gpus.split(",") if g.strip()]
        except ValueError:
            fail(f"--gpus {gpus!r}: expected GPU indices like 0,1")
    try:
        log = SampleLog(fmt_, path=output) if output is not None else None
    except (ValueError, OSError) as e:
        fail(f"--output {output}: {e}")
        return

    def on_sample(st: dict[str, Any]) -> None:
        if log is not None:
            log.write(status_rows(st, gpus=gpu_list))

    job_id = job or f"measure-{os.getpid()}"
    # Checked before the command starts: a typo found after a long run leaves it unmeasured.
    from greend.protocol import JOB_ID_RE, RESERVED_OWNERS

    if not JOB_ID_RE.match(job_id):
        fail(f"--job {job_id!r}: a job id is 1-128 characters of letters, digits and . _ : @ / - (no spaces)")
    if job_id in RESERVED_OWNERS:
        fail(f"--job {job_id!r} is reserved for greend's own settings: use another")
    report: dict[str, Any]
    try:
        res = None
        why_local = "--local"
        if not local:
            try:
                res = run_measure(
                    target.path(),
                    list(cmd),
                    job=job_id,
                    gpus=gpu_list,
                    flops=flops,
                    interval_s=interval,
                    timeout_s=target.timeout_s,
                    on_sample=on_sample if log is not None else None,
                )
            except DaemonUnavailable as e:
                why_local = f"no daemon ({e})"
        if res is None:
            lres = measure_locally(
                list(cmd),
                job=job_id,
                gpus=gpu_list,
                flops=flops,
                interval_s=interval,
                sysfs_root=sysfs_root,
                on_sample=on_sample if log is not None else None,
                why_local=why_local,
            )
            returncode, report, notes = lres.returncode, lres.report, lres.notes
            text = render_local(report)
        else:
            returncode, report, notes = res.returncode, res.report, res.notes
            text = render_report(report) if report else ""
    except GreendError as e:
        fail(str(e))
        return
    finally:
        if log is not None:
            log.close()
    for n in notes:
        typer.echo(f"note: {n}", err=True)
    if as_json:
        out = dict(report)
        out.pop("series", None)
        typer.echo(json.dumps(out, indent=2))
    elif text:
        typer.echo(text)
    raise typer.Exit(returncode if 0 <= returncode < 256 else 1)


cap_app = typer.Typer(add_completion=False, no_args_is_help=True, help="GPU clock caps and power limits (admin).")
policy_app = typer.Typer(add_completion=False, no_args_is_help=True, help="The control policy.")
ctl_app.add_typer(cap_app, name="cap")
ctl_app.add_typer(policy_app, name="policy")
ctl_app.add_typer(profile_app, name="profile")


@cap_app.command("set")
def ctl_cap_set(
    gpu: int | None = typer.Option(None, "--gpu", help="GPU index"),
    cpu: str | None = typer.Option(None, "--cpu", help="RAPL zone: package-0 or intel-rapl:0 (power limit only)"),
    max_clock: int | None = typer.Option(None, "--max-clock", help="lock the SM clock at most this (MHz)"),
    power_limit: float | None = typer.Option(None, "--power-limit", help="power limit (W)"),
) -> None:
    """Cap one GPU (snapped to a supported clock, clamped to the limit range) or one CPU
    package (RAPL long- and short-term limits, within the zone's maximum). Needs root or
    the admin group."""
    if (gpu is None) == (cpu is None):
        fail("give exactly one of --gpu I and --cpu ZONE")
    if cpu is not None:
        if max_clock is not None or power_limit is None:
            fail("a CPU zone takes --power-limit W only")
        r = request("cap_set", cpu_zone=cpu, power_limit_w=power_limit)
        typer.echo(
            f"{r['cpu_zone']} ({r['path']}): power limit {fmt(r['in_force']['power_limit_w'])} W"
            f"{'  (dry run: nothing was touched)' if r.get('dry_run') else ''}"
        )
        return
    if (max_clock is None) == (power_limit is None):
        fail("give exactly one of --max-clock MHZ and --power-limit W")
    fields: dict[str, Any] = {"gpu": gpu}
    if max_clock is not None:
        fields["max_clock_mhz"] = max_clock
    if power_limit is not None:
        fields["power_limit_w"] = power_limit
    r = request("cap_set", **fields)
    f = r["in_force"]
    clock = "none" if f["clock_cap_mhz"] is None else f"{f['clock_cap_mhz']} MHz"
    limit = "default" if f["power_limit_w"] is None else f"{f['power_limit_w']:.1f} W"
    typer.echo(
        f"gpu{r['gpu']}: clock cap {clock}, power limit {limit}"
        f"{'  (dry run: nothing was touched)' if r.get('dry_run') else ''}"
    )
    for note in cap_notes(r, max_clock, power_limit):
        typer.echo(f"note: {note}", err=True)


@cap_app.command("reset")
def ctl_cap_reset(
    gpu: int | None = typer.Option(None, "--gpu", help="one GPU (default: every device)"),
    cpu: str | None = typer.Option(None, "--cpu", help="one RAPL zone (package-0 or intel-rapl:0)"),
) -> None:
    """Put the saved originals back. Needs root or the admin group."""
    if gpu is not None and cpu is not None:
        fail("give at most one of --gpu I and --cpu ZONE")
    fields: dict[str, Any] = {"gpu": gpu} if gpu is not None else {"cpu_zone": cpu} if cpu is not None else {}
    r = request("cap_reset", **fields)  # (the daemon refuses a GPU it never enumerated)
    for line in r["lines"]:
        typer.echo(line)
    if r.get("failed"):
        raise typer.Exit(1)


def _parse_param(text: str) -> tuple[str, Any]:
    if "=" not in text:
        fail(f"--param {text!r}: expected KEY=VALUE")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw  # a bare string
    except (RecursionError, ValueError) as e:  # nested past the parser's depth; an integer of 4,300+ digits
        why = str(e)[:120]
        fail(f"--param {key.strip()[:80]!r}: not a value greenctl can send ({why}); give a plain number or string")
    if isinstance(value, float) and not math.isfinite(value):  # (NaN, Infinity, 1e309)
        fail(f"--param {text!r}: {key.strip()} must be a finite number")
    return key.strip(), value


@policy_app.command("show")
def ctl_policy_show(as_json: bool = typer.Option(False, "--json", metavar="", help="machine-readable")) -> None:
    """The policy in force, its parameters and its last decision."""
    r = request("policy_show")
    if as_json:
        typer.echo(json.dumps(r, indent=2))
        return
    typer.echo(
        f"policy {r['name']}  {json.dumps(r['params'])}  every {r['period_s']:g} s"
        + ("  DRY RUN" if r.get("dry_run") else "")
    )
    p = r.get("precision")
    typer.echo(f"precision {p['name']}  {json.dumps(p['params'])}" if p else "precision none")
    clock = [n for n in r["available"] if n != "precision"]
    beside = [n for n in r["available"] if n == "precision"]
    typer.echo(
        f"available: {', '.join(clock)}"
        + (f"; beside them ([policy] precision): {', '.join(beside)}" if beside else "")
    )
    if r.get("disabled"):
        typer.echo(f"control is off: {r['disabled']}")
    d = r.get("last_decision")
    if d:
        typer.echo(f"last decision: {d['reason'] or '(no change)'}")
    if r.get("last_error"):
        typer.echo(f"policy failing: {r['last_error']}")
    for owner, knobs in (r.get("owners") or {}).items():
        typer.echo(f"  {owner}: {', '.join(knobs)}")


@policy_app.command("set")
def ctl_policy_set(
    name: str = typer.Argument(
        ...,
        help="a clock policy: none, static, efficient, budget (the precision policy runs beside it: "
        "--precision precision, or the config's policy.precision key)",
        autocompletion=complete_clock_policy,
    ),
    param: list[str] | None = typer.Option(None, "--param", help="KEY=VALUE (JSON values: 0.05, true, [0,1])"),
    precision: str | None = typer.Option(
        None, "--precision", help="the precision policy beside it: precision, or none (default: unchanged)"
    ),
    precision_param: list[str] | None = typer.Option(
        None, "--precision-param", help="KEY=VALUE for the precision policy (e.g. tolerance=0.05)"
    ),
) -> None:
    """Switch the policy (what the old one set for jobs is restored), and with --precision the
    precision policy beside it. Needs root or the admin group."""
    params = dict(_parse_param(p) for p in (param or []))
    fields: dict[str, Any] = {"name": name, "params": params}
    if precision is not None:
        fields["precision"] = precision
        fields["precision_params"] = dict(_parse_param(p) for p in (precision_param or []))
    elif precision_param:
        fail("--precision-param needs --precision NAME")
    r = request("policy_set", **fields)
    typer.echo(f"policy {r['name']} {json.dumps(r['params'])}")
    if precision is not None:
        p = r.get("precision")
        typer.echo(f"precision {p['name']} {json.dumps(p['params'])}" if p else "precision none")


@ctl_app.command("doctor")
def ctl_doctor(
    config: Path | None = typer.Option(None, "--config", help="config file to check"),
    sysfs_root: Path = typer.Option(Path("/sys"), "--sysfs-root", help="sysfs root to check"),
    as_json: bool = typer.Option(
        False, "--json", metavar="", help="machine-readable: each check's level, name, detail, fix"
    ),
) -> None:
    """Check permissions, NVML, RAPL, socket and store, and say what to fix."""
    from greend.cli.doctor import run_checks

    # The socket the user named (--socket or $GREEND_SOCKET), else the config's.
    named = target.socket if target.named else None
    checks = run_checks(config=config, socket=named, sysfs_root=sysfs_root, timeout_s=target.timeout_s)
    worst = 0
    for c in checks:
        if not as_json:
            typer.echo(f"[{c.level:4}] {c.name}: {c.detail}")
            if c.fix:
                typer.echo(f"       fix: {c.fix}")
        worst = max(worst, {"ok": 0, "info": 0, "warn": 1, "fail": 2}[c.level])
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "exit": worst,
                    "checks": [{"level": c.level, "name": c.name, "detail": c.detail, "fix": c.fix} for c in checks],
                },
                indent=2,
            )
        )
    raise typer.Exit(worst)


@ctl_app.command("install-systemd")
def ctl_install_systemd(
    prefix: Path = typer.Option(Path("/"), "--prefix", help="root of the OS tree to install into"),
    enable: bool = typer.Option(False, "--enable", metavar="", help="also run systemctl enable --now greend"),
    dry_run: bool = typer.Option(False, "--dry-run", metavar="", help="print what would be done, touch nothing"),
    greend_bin: str | None = typer.Option(
        None, "--greend-bin", help="greend for ExecStart= (default: beside this Python, else PATH)"
    ),
    force: bool = typer.Option(
        False, "--force", metavar="", help="install even where the unit's sandbox hides greend (/home, /root, /tmp)"
    ),
) -> None:
    """Install greend.service, its sysusers/tmpfiles snippets, /etc/default/greend and an example config."""
    from greend.cli.install import default_greend_bin, install_systemd

    binary = greend_bin or default_greend_bin()
    if binary is None:
        fail("cannot find the greend executable: give --greend-bin /path/to/greend")
        return
    try:
        actions = install_systemd(prefix, greend_bin=binary, enable=enable, dry_run=dry_run, hidden_ok=force)
    except GreendError as e:
        fail(str(e))
        return
    for a in actions:
        typer.echo(("would " if dry_run and not a.startswith(("skip", "keep")) else "") + a)
    if force:
        from greend.cli.install import hidden_from_unit

        for h in hidden_from_unit(binary):
            typer.echo(f"warning: the service cannot reach {h}: it will not start", err=True)


def ctl_main() -> None:
    import sys

    from greend.cli.common import output_errors_in_one_line

    with output_errors_in_one_line():
        ctl_app(args=hoist_root_options(sys.argv[1:]))
