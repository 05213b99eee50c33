"""``greend``: run the daemon (``greend run``) and put back what it changed
(``greend restore``, systemd's ``ExecStopPost``)."""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from greend import __version__
from greend.cli.common import fail, setup_logging
from greend.config import DEFAULT_STATE_DIR, apply_overrides, load_config
from greend.daemon import sdnotify
from greend.errors import ConfigError, StateError, StoreError

__all__ = ["daemon_app", "daemon_main"]

log = logging.getLogger("greend")

daemon_app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="greend: the per-node energy controller daemon."
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"greend {__version__}")
        raise typer.Exit(0)


@daemon_app.callback()
def _daemon_root(
    version: bool = typer.Option(
        False, "--version", metavar="", is_eager=True, callback=_print_version, help="print greend's version and exit"
    ),
) -> None:
    """greend: the per-node energy controller daemon."""


@daemon_app.command("run")
def daemon_run(
    config: Path | None = typer.Option(
        None, "--config", help="TOML config (default /etc/greend/greend.toml if present)"
    ),
    sim: int | None = typer.Option(None, "--sim", help="run on N simulated GPUs instead of NVML"),
    sim_dir: Path | None = typer.Option(None, "--sim-dir", help="where simulated devices keep their state"),
    sim_trace: str | None = typer.Option(
        None, "--sim-trace", help="simulated GPUs follow this measured power-limit profile (a CSV, or a bundled name)"
    ),
    sysfs_root: Path | None = typer.Option(None, "--sysfs-root", help="root of sysfs (a fixture tree in tests)"),
    socket: Path | None = typer.Option(None, "--socket", help="Unix socket path"),
    state_dir: Path | None = typer.Option(None, "--state-dir", help="saved settings, sim devices, default store"),
    store: list[str] | None = typer.Option(None, "--store", help="store URL (repeatable)"),
    hz: float | None = typer.Option(None, "--hz", help="sampling rate"),
    dry_run: bool | None = typer.Option(None, "--dry-run/--no-dry-run", help="record settings, touch nothing"),
    log_level: str | None = typer.Option(None, "--log-level", help="debug, info, warning, error"),
) -> None:
    """Run the daemon in the foreground until SIGTERM, SIGINT or SIGHUP."""
    from greend.daemon.core import Daemon

    try:
        cfg = load_config(config)
        cfg = apply_overrides(
            cfg,
            sim=sim,
            sim_dir=sim_dir,
            sysfs_root=sysfs_root,
            socket=socket,
            state_dir=state_dir,
            store=store,
            hz=hz,
            dry_run=dry_run,
            sim_trace=sim_trace,
        )
        if cfg.sim.gpus > 0:
            from greend.probes.trace import install_trace

            install_trace(cfg.sim_dir, cfg.sim.trace or None)  # the sim probe reads <sim dir>/trace.csv
        if log_level is not None:
            cfg.daemon.log_level = log_level
            from greend.config import validate

            validate(cfg)
    except ConfigError as e:
        fail(str(e))
        return
    setup_logging(cfg.daemon.log_level)
    # Outside systemd too, whatever greend creates is its own: 0600 files, 0700 dirs. Set
    # here, for the daemon's process, not in Daemon: a process embedding one keeps its umask.
    os.umask(0o077)
    daemon = Daemon(cfg)

    on_signal = signal_stopper(daemon)
    faulthandler.enable()  # a watchdog SIGABRT puts the Python traceback in the journal

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # SIGHUP (a closed terminal, or an admin's "reload"): the same clean stop, settings
    # restored and running jobs kept; its default killed the process with both undone.
    signal.signal(signal.SIGHUP, on_signal)
    try:
        daemon.start()
    except (ConfigError, StateError, StoreError) as e:
        daemon.close()
        fail(str(e))
    except OSError as e:
        daemon.close()
        fail(f"cannot start: {e}")
    log.info(
        "greend %s running: %d probes, %d stores, socket %s",
        __version__,
        len(daemon.probes),
        len(daemon.stores.opened),
        cfg.daemon.socket,
    )
    # What start-up made (modules, config, probes) lives as long as the process: out of
    # the cyclic collector's reach, so that its full collections, which hold the GIL,
    # scan only what the running daemon makes (they took 13-23 ms under 64 clients, a
    # late tick and a slow status each time; fewer objects, shorter pauses).
    gc.collect()
    gc.freeze()
    sdnotify.ready()  # probes are open and the socket listens
    sdnotify.status(f"{len(daemon.probes)} probes, {len(daemon.stores.opened)} stores, socket {cfg.daemon.socket}")
    try:
        daemon.run()
    finally:
        daemon.close()
        gc.unfreeze()  # (a process that embeds this command gets its collector back whole)
    log.info("stopped")


def signal_stopper(daemon: Any) -> Callable[[int, Any], None]:
    """The SIGTERM/SIGINT/SIGHUP handler: stop the daemon. A handler runs on the main thread
    between two bytecodes, which may be inside ``stop_event.wait()`` holding the Event's
    lock (not reentrant): setting the Event there could wait on itself for ever (a double
    SIGTERM did, now and then). A short thread of its own sets it."""

    def stop(signum: int) -> None:
        if signum == signal.SIGHUP:
            log.warning("signal SIGHUP: stopping (greend has no reload: a changed config is read when it starts "
                        "again; under systemd, systemctl restart greend)")  # fmt: skip
        else:
            log.info("signal %s: stopping", signal.Signals(signum).name)
        sdnotify.stopping()
        daemon.stop()

    def on_signal(signum: int, _frame: Any) -> None:
        threading.Thread(target=stop, args=(signum,), name="greend-stop", daemon=True).start()

    return on_signal


@daemon_app.command("restore")
def daemon_restore(
    state_dir: Path = typer.Option(DEFAULT_STATE_DIR, "--state-dir", help="where saved-settings.json lives"),
    force_defaults: bool = typer.Option(
        False,
        "--force-defaults",
        metavar="",
        help="state file unreadable: reset every GPU to its default clocks and limit",
    ),
    sim_dir: Path | None = typer.Option(None, "--sim-dir", help="simulated devices, if not the recorded dir"),
    as_json: bool = typer.Option(False, "--json", metavar="", help="machine-readable report"),
    force: bool = typer.Option(
        False,
        "--force",
        metavar="",
        help="restore even while the daemon that owns the state dir runs (it may set them again)",
    ),
) -> None:
    """Put back every setting greend changed (systemd runs this as ExecStopPost).

    Exit 0: nothing to restore, or all restored; 1: some device failed (kept in the
    file for the next try); 2: the state file is corrupt (see the message); 3: some
    GPU, or NVML, did not answer in time (a hung driver; each GPU has its own deadline,
    the others are restored, the last line names those left and what to do).
    """
    from greend.actuators.restore import main as restore_main

    if not state_dir.exists():
        # Nothing was ever recorded there. At the default that is "nothing to restore" (a
        # daemon that never started: the unit's ExecStopPost); a dir given that is not
        # there is most likely a typo, after which a crash's caps would stay unseen.
        msg = f"no state dir at {state_dir}: greend recorded nothing there"
        if state_dir != DEFAULT_STATE_DIR:
            fail(f"{msg}; give the --state-dir greend ran with (its unit's, or `greend run --state-dir`)")
        typer.echo(f"{msg}: nothing to restore", err=True)
        raise typer.Exit(0)
    argv = ["--state-dir", str(state_dir)]
    if force_defaults:
        argv.append("--force-defaults")
    if sim_dir is not None:
        argv += ["--sim-dir", str(sim_dir)]
    if as_json:
        argv.append("--json")
    if force:
        argv.append("--force")
    raise typer.Exit(restore_main(argv))


def daemon_main() -> None:
    daemon_app()
