"""Command lines: ``greend`` (the daemon) and ``greenctl`` (show and steer it)."""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from greend import __version__
from greend.daemon import sdnotify
from greend.errors import RequestRefused
from greend.ipc.client import Client
from greend.config import apply_overrides, default_socket_path, load_config
from greend.errors import ConfigError, DaemonUnavailable, GreendError, StateError, StoreError

__all__ = ["ctl_app", "ctl_main", "daemon_app", "daemon_main"]

log = logging.getLogger("greend")

daemon_app = typer.Typer(add_completion=False, no_args_is_help=True,
                         help="greend: the per-node energy controller daemon.")
ctl_app = typer.Typer(add_completion=False, no_args_is_help=True,
                      help="greenctl: show and steer the greend daemon on this node.")


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


# greend ----------------------------------------------------------------------------


@daemon_app.callback()
def _daemon_root() -> None:
    """greend: the per-node energy controller daemon."""


@daemon_app.command("run")
def daemon_run(
    config: Optional[Path] = typer.Option(None, "--config", help="TOML config (default /etc/greend/greend.toml if present)"),
    sim: Optional[int] = typer.Option(None, "--sim", help="run on N simulated GPUs instead of NVML"),
    sim_dir: Optional[Path] = typer.Option(None, "--sim-dir", help="where simulated devices keep their state"),
    sim_trace: Optional[str] = typer.Option(
        None, "--sim-trace", help="simulated GPUs follow this measured power-limit profile (a CSV, or a bundled name)"),
    sysfs_root: Optional[Path] = typer.Option(None, "--sysfs-root", help="root of sysfs (a fixture tree in tests)"),
    socket: Optional[Path] = typer.Option(None, "--socket", help="Unix socket path"),
    state_dir: Optional[Path] = typer.Option(None, "--state-dir", help="saved settings, sim devices, default store"),
    store: Optional[list[str]] = typer.Option(None, "--store", help="store URL (repeatable)"),
    hz: Optional[float] = typer.Option(None, "--hz", help="sampling rate"),
    dry_run: Optional[bool] = typer.Option(None, "--dry-run/--no-dry-run", help="record settings, touch nothing"),
    log_level: Optional[str] = typer.Option(None, "--log-level", help="debug, info, warning, error"),
) -> None:
    """Run the daemon in the foreground until SIGTERM or SIGINT."""
    from greend.daemon.core import Daemon

    try:
        cfg = load_config(config)
        cfg = apply_overrides(cfg, sim=sim, sim_dir=sim_dir, sysfs_root=sysfs_root, socket=socket,
                              state_dir=state_dir, store=store, hz=hz, dry_run=dry_run, sim_trace=sim_trace)
        if cfg.sim.gpus > 0:
            from greend.probes.trace import install_trace

            install_trace(cfg.sim_dir, cfg.sim.trace or None)  # the sim probe reads <sim dir>/trace.csv
        if log_level is not None:
            cfg.daemon.log_level = log_level
            from greend.config import validate

            validate(cfg)
    except ConfigError as e:
        _fail(str(e))
        return
    setup_logging(cfg.daemon.log_level)
    daemon = Daemon(cfg)

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %s: stopping", signal.Signals(signum).name)
        sdnotify.stopping()
        daemon.stop()

    faulthandler.enable()  # a watchdog SIGABRT puts the Python traceback in the journal

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        daemon.start()
    except (ConfigError, StateError, StoreError) as e:
        daemon.close()
        _fail(str(e))
    except OSError as e:
        daemon.close()
        _fail(f"cannot start: {e}")
    log.info("greend %s running: %d probes, %d stores, socket %s",
             __version__, len(daemon.probes), len(daemon.sinks), cfg.daemon.socket)
    sdnotify.ready()  # probes are open and the socket listens
    sdnotify.status(f"{len(daemon.probes)} probes, {len(daemon.sinks)} stores, socket {cfg.daemon.socket}")
    try:
        daemon.run()
    finally:
        daemon.close()
    log.info("stopped")


@daemon_app.command("restore")
def daemon_restore(
    state_dir: Path = typer.Option(Path("/var/lib/greend"), "--state-dir", help="where saved-settings.json lives"),
    force_defaults: bool = typer.Option(False, "--force-defaults",
                                        help="state file unreadable: reset every GPU to its default clocks and limit"),
    sim_dir: Optional[Path] = typer.Option(None, "--sim-dir", help="simulated devices, if not the recorded dir"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable report"),
) -> None:
    """Put back every setting greend changed (systemd runs this as ExecStopPost).

    Exit 0: nothing to restore, or all restored; 1: some device failed (kept in the
    file for the next try); 2: the state file is corrupt (see the message).
    """
    from greend.actuators.restore import main as restore_main

    argv = ["--state-dir", str(state_dir)]
    if force_defaults:
        argv.append("--force-defaults")
    if sim_dir is not None:
        argv += ["--sim-dir", str(sim_dir)]
    if as_json:
        argv.append("--json")
    raise typer.Exit(restore_main(argv))


def daemon_main() -> None:
    daemon_app()


# greenctl --------------------------------------------------------------------------

_state: dict[str, Any] = {}


@ctl_app.callback()
def _ctl_root(
    socket: Optional[Path] = typer.Option(None, "--socket", help="daemon socket (default $GREEND_SOCKET or /run/greend/greend.sock)"),
    timeout: float = typer.Option(5.0, "--timeout", help="seconds to wait for the daemon"),
) -> None:
    _state["socket"] = socket or default_socket_path()
    _state["socket_named"] = socket is not None or bool(os.environ.get("GREEND_SOCKET"))
    _state["timeout"] = timeout


def _request(op: str, **fields: Any) -> Any:
    try:
        with Client(_state["socket"], timeout_s=_state["timeout"]) as c:
            return c.request(op, **fields)
    except DaemonUnavailable as e:
        _fail(str(e), code=3)
    except RequestRefused as e:
        _fail(f"{e} [{e.code}]", code=4 if e.code == "forbidden" else 2)


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def render_table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
    for r in cells:
        lines.append("  ".join(c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(r, widths)))
    return "\n".join(lines)


def _numeric(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return s == "-"


def render_status(st: dict[str, Any]) -> str:
    out = [
        f"greend {st['version']} on {st['host']}  pid {st['pid']}  up {st['uptime_s']:.1f} s  "
        f"{st['hz']:g} Hz  ticks {st['ticks']} (skipped {st['ticks_skipped']})"
        + ("  DRY RUN" if st.get("dry_run") else ""),
        "",
    ]
    if st["gpus"]:
        out.append(render_table(
            ["GPU", "NAME", "SOURCE", "POWER_W", "ENERGY_J", "SM_MHZ", "CAP_MHZ", "LIMIT_W", "METHOD"],
            [[g["index"], g["name"], g["source"], g["power_w"], g["energy_j"], g["sm_clock_mhz"],
              g["clock_cap_mhz"], g["power_limit_w"], g.get("energy_method")] for g in st["gpus"]],
        ))
    else:
        out.append("no GPUs (see: greenctl probes)")
    out.append("")
    if st["cpus"]:
        out.append(render_table(
            ["ZONE", "PATH", "SOURCE", "POWER_W", "ENERGY_J", "COUNTED"],
            [[c["zone"], c["path"], c["source"], c["power_w"], c["energy_j"],
              "yes" if c["counted"] else f"no (in {c['parent'] or 'platform'})"] for c in st["cpus"]],
        ))
    else:
        out.append("no CPU energy zones (see: greenctl probes)")
    t = st["totals"]
    out += ["", f"energy since start: GPUs {t['gpu_energy_j']:.1f} J, CPU {t['cpu_energy_j']:.1f} J"]
    pol = st.get("policy") or {}
    prec = (pol.get("precision") or {}).get("name")
    out.append(f"policy: {pol.get('name', 'none')}" + (f" + {prec}" if prec else "")
               + f"   jobs: {len(st.get('jobs') or [])}")
    last = pol.get("last_decision") or {}
    if last.get("reason"):
        out.append(f"  last decision: {last['reason']}")
    if pol.get("disabled"):
        out.append(f"  {pol['disabled']}")
    for owner, knobs in (pol.get("owners") or {}).items():
        out.append(f"  set by {owner}: {', '.join(knobs)}")
    for s in st.get("stores", []):
        state = "ok" if s.get("ok") else f"FAILING: {s.get('last_error')}"
        out.append(f"store {s['url']}: {state} (written {s.get('written', 0)}, pending {s.get('pending', 0)},"
                   f" dropped {s.get('dropped', 0)})")
    return "\n".join(out)


@ctl_app.command("status")
def ctl_status(as_json: bool = typer.Option(False, "--json", help="machine-readable")) -> None:
    """GPUs, CPU zones, jobs and policy, live."""
    st = _request("status")
    typer.echo(json.dumps(st, indent=2) if as_json else render_status(st))


@ctl_app.command("probes")
def ctl_probes(as_json: bool = typer.Option(False, "--json", help="machine-readable")) -> None:
    """What was detected, what is missing and why."""
    res = _request("probes")
    if as_json:
        typer.echo(json.dumps(res, indent=2))
        return
    for p in res["probes"]:
        mark = "ok  " if p["open"] else "--  "
        typer.echo(f"{mark}{p['name']:6} {p.get('detail') or p.get('last_error') or ''}")
        for d in p.get("devices") or []:
            typer.echo(f"        {d}")
        if not p["open"] and p.get("fix"):
            typer.echo(f"        fix: {p['fix']}")
        if p["open"] and not p["success"] and p.get("last_error"):
            typer.echo(f"        failing: {p['last_error']}")


@ctl_app.command("jobs")
def ctl_jobs(as_json: bool = typer.Option(False, "--json", help="machine-readable")) -> None:
    """Jobs on this node: running, and recently ended."""
    from greend.cli.report import render_jobs

    res = _request("jobs")
    typer.echo(json.dumps(res, indent=2) if as_json else render_jobs(res["jobs"]))


@ctl_app.command("report")
def ctl_report(
    job: str = typer.Argument(..., help="job id (see greenctl jobs)"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="write power and GFLOPS/W over time to FILE.png"),
) -> None:
    """A job's energy, power, FLOPs, GFLOPS/W, samples or tokens per joule and CO2."""
    from greend.cli.report import plot_report, render_report

    r = _request("report", job=job)
    if as_json:
        out = dict(r)
        out.pop("series", None)
        typer.echo(json.dumps(out, indent=2))
    else:
        typer.echo(render_report(r))
    if plot is not None:
        try:
            plot_report(r, plot)
        except RuntimeError as e:
            _fail(str(e))
        typer.echo(f"plot written to {plot}", err=True)


@ctl_app.command("demo")
def ctl_demo(
    seconds: float = typer.Option(30.0, "--seconds", help="how long to train"),
    gpus: str = typer.Option("auto", "--gpus", help="sim, real, or auto (real GPUs if NVML and CUDA work)"),
    keep: Optional[Path] = typer.Option(None, "--keep", help="keep the daemon's state dir and store here"),
) -> None:
    """Start a daemon on simulated GPUs, train a small real torch model with the callback, print the report."""
    from greend.cli.demo import run_demo

    try:
        code = run_demo(seconds=seconds, gpus=gpus, keep=keep)
    except GreendError as e:
        _fail(str(e))
        return
    raise typer.Exit(code)


cap_app = typer.Typer(add_completion=False, no_args_is_help=True, help="GPU clock caps and power limits (admin).")
policy_app = typer.Typer(add_completion=False, no_args_is_help=True, help="The control policy.")
ctl_app.add_typer(cap_app, name="cap")
ctl_app.add_typer(policy_app, name="policy")


@cap_app.command("set")
def ctl_cap_set(
    gpu: Optional[int] = typer.Option(None, "--gpu", help="GPU index"),
    cpu: Optional[str] = typer.Option(None, "--cpu", help="RAPL zone: package-0 or intel-rapl:0 (power limit only)"),
    max_clock: Optional[int] = typer.Option(None, "--max-clock", help="lock the SM clock at most this (MHz)"),
    power_limit: Optional[float] = typer.Option(None, "--power-limit", help="power limit (W)"),
) -> None:
    """Cap one GPU (snapped to a supported clock, clamped to the limit range) or one CPU
    package (RAPL long- and short-term limits, within the zone's maximum). Needs root or
    the admin group."""
    if (gpu is None) == (cpu is None):
        _fail("give exactly one of --gpu I and --cpu ZONE")
    if cpu is not None:
        if max_clock is not None or power_limit is None:
            _fail("a CPU zone takes --power-limit W only")
        r = _request("cap_set", cpu_zone=cpu, power_limit_w=power_limit)
        typer.echo(f"{r['cpu_zone']} ({r['path']}): power limit {_fmt(r['in_force']['power_limit_w'])} W"
                   f"{'  (dry run: nothing was touched)' if r.get('dry_run') else ''}")
        return
    if (max_clock is None) == (power_limit is None):
        _fail("give exactly one of --max-clock MHZ and --power-limit W")
    fields: dict[str, Any] = {"gpu": gpu}
    if max_clock is not None:
        fields["max_clock_mhz"] = max_clock
    if power_limit is not None:
        fields["power_limit_w"] = power_limit
    r = _request("cap_set", **fields)
    f = r["in_force"]
    typer.echo(f"gpu{r['gpu']}: clock cap {_fmt(f['clock_cap_mhz'])} MHz, power limit "
               f"{_fmt(f['power_limit_w'])} W{'  (dry run: nothing was touched)' if r.get('dry_run') else ''}")


@cap_app.command("reset")
def ctl_cap_reset(gpu: Optional[int] = typer.Option(None, "--gpu", help="one GPU (default: every device)"),
                  cpu: Optional[str] = typer.Option(None, "--cpu", help="one RAPL zone (package-0 or intel-rapl:0)")
                  ) -> None:
    """Put the saved originals back. Needs root or the admin group."""
    if gpu is not None and cpu is not None:
        _fail("give at most one of --gpu I and --cpu ZONE")
    fields: dict[str, Any] = {"gpu": gpu} if gpu is not None else {"cpu_zone": cpu} if cpu is not None else {}
    r = _request("cap_reset", **fields)
    for line in r["lines"]:
        typer.echo(line)
    if r.get("failed"):
        raise typer.Exit(1)


def _parse_param(text: str) -> tuple[str, Any]:
    if "=" not in text:
        _fail(f"--param {text!r}: expected KEY=VALUE")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw  # a bare string
    return key.strip(), value


@policy_app.command("show")
def ctl_policy_show(as_json: bool = typer.Option(False, "--json", help="machine-readable")) -> None:
    """The policy in force, its parameters and its last decision."""
    r = _request("policy_show")
    if as_json:
        typer.echo(json.dumps(r, indent=2))
        return
    typer.echo(f"policy {r['name']}  {json.dumps(r['params'])}  every {r['period_s']:g} s"
               + ("  DRY RUN" if r.get("dry_run") else ""))
    typer.echo(f"available: {', '.join(r['available'])}")
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
    name: str = typer.Argument(..., help="none, static, efficient, budget"),
    param: Optional[list[str]] = typer.Option(None, "--param", help="KEY=VALUE (JSON values: 0.05, true, [0,1])"),
) -> None:
    """Switch the policy (what the old one set for jobs is restored). Needs root or the admin group."""
    params = dict(_parse_param(p) for p in (param or []))
    r = _request("policy_set", name=name, params=params)
    typer.echo(f"policy {r['name']} {json.dumps(r['params'])}")


@ctl_app.command("doctor")
def ctl_doctor(
    config: Optional[Path] = typer.Option(None, "--config", help="config file to check"),
    sysfs_root: Path = typer.Option(Path("/sys"), "--sysfs-root", help="sysfs root to check"),
) -> None:
    """Check permissions, NVML, RAPL, socket and store, and say what to fix."""
    from greend.cli.doctor import run_checks

    # The socket the user named (--socket or $GREEND_SOCKET), else the config's.
    named = _state["socket"] if _state.get("socket_named") else None
    checks = run_checks(config=config, socket=named, sysfs_root=sysfs_root, timeout_s=_state["timeout"])
    worst = 0
    for c in checks:
        typer.echo(f"[{c.level:4}] {c.name}: {c.detail}")
        if c.fix:
            typer.echo(f"       fix: {c.fix}")
        worst = max(worst, {"ok": 0, "info": 0, "warn": 1, "fail": 2}[c.level])
    raise typer.Exit(worst)


@ctl_app.command("install-systemd")
def ctl_install_systemd(
    prefix: Path = typer.Option(Path("/"), "--prefix", help="root of the OS tree to install into"),
    enable: bool = typer.Option(False, "--enable", help="also run systemctl enable --now greend"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print what would be done, touch nothing"),
    greend_bin: Optional[str] = typer.Option(None, "--greend-bin",
                                             help="greend for ExecStart= (default: beside this Python, else PATH)"),
) -> None:
    """Install greend.service, its sysusers/tmpfiles snippets, /etc/default/greend and an example config."""
    from greend.cli.install import default_greend_bin, install_systemd

    binary = greend_bin or default_greend_bin()
    if binary is None:
        _fail("cannot find the greend executable: give --greend-bin /path/to/greend")
        return
    try:
        actions = install_systemd(prefix, greend_bin=binary, enable=enable, dry_run=dry_run)
    except GreendError as e:
        _fail(str(e))
        return
    for a in actions:
        typer.echo(("would " if dry_run and not a.startswith(("skip", "keep")) else "") + a)


def ctl_main() -> None:
    ctl_app()
