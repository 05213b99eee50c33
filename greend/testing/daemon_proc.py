"""A ``greend run`` subprocess for demos and tests: the command line, and the wait
until it answers (its first tick done)."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from greend.errors import DaemonUnavailable, GreendError
from greend.ipc.client import Client

__all__ = ["daemon_command", "running_daemon", "wait_until_up"]

PRECISION_SIM_CONFIG = '[daemon]\nsocket_group = ""\nlog_level = "warning"\n[policy]\nprecision = "precision"\n'
"""A daemon whose precision policy runs with its defaults (with ``--sim 1``: the benchmarks' trainings)."""


def daemon_command(config: Path, socket: Path, state_dir: Path, *extra: str) -> list[str]:
    """``python -P -m greend.daemon_main run`` with this config, socket and state dir.
    ``-P``: the current directory is not put on the daemon's path, so a folder named
    greend there (the checkout, run from the folder that holds it) is never imported
    in the package's place."""
    return [
        sys.executable,
        "-P",
        "-m",
        "greend.daemon_main",
        "run",
        "--config",
        str(config),
        "--socket",
        str(socket),
        "--state-dir",
        str(state_dir),
        *extra,
    ]


def wait_until_up(proc: subprocess.Popen[bytes], socket: Path, log: Path, timeout_s: float = 30.0) -> None:
    """Return once the daemon at ``socket`` has ticked; GreendError (with its log) if
    it exits first or does not answer in ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise GreendError(f"greend exited with {proc.returncode}:\n{_tail(log)}")
        try:
            with Client(socket, timeout_s=2.0) as c:
                if c.request("status")["ticks"] > 0:
                    return
        except (DaemonUnavailable, GreendError):
            pass
        time.sleep(0.05)
    raise GreendError(f"greend did not answer within {timeout_s:g} s:\n{_tail(log)}")


@contextmanager
def running_daemon(config: str, *extra: str, cwd: Path | None = None) -> Iterator[tuple[Path, Path]]:
    """A ``greend run`` subprocess with this configuration (TOML text) and ``extra``
    arguments, in a temporary directory, once it answers: (its socket, the directory).
    Stopped with SIGTERM on the way out."""
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        cfg = tmp / "cfg.toml"
        cfg.write_text(config)
        sock, log = tmp / "g.sock", tmp / "g.log"
        with log.open("wb") as fh:
            cmd = daemon_command(cfg, sock, tmp / "state", *extra)
            proc = subprocess.Popen(cmd, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT)
        try:
            wait_until_up(proc, sock, log)
            yield sock, tmp
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def _tail(log: Path) -> str:
    try:
        return log.read_text(errors="replace")[-8000:]
    except OSError as e:
        return f"(no log: {e})"
