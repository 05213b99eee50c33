"""A ``greend run`` subprocess for demos and tests: the command line, and the wait
until it answers (its first tick done)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from greend.errors import DaemonUnavailable, GreendError
from greend.ipc.client import Client

__all__ = ["daemon_command", "wait_until_up"]


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


def _tail(log: Path) -> str:
    try:
        return log.read_text(errors="replace")[-8000:]
    except OSError as e:
        return f"(no log: {e})"
