"""Helpers the tests share: a real greend daemon in a subprocess on temp paths,
waiting for a condition, a manual clock. Fixtures are in conftest.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from greend.ipc.client import Client
from greend.protocol import encode
from greend.testing.daemon_proc import daemon_command, wait_until_up

__all__ = [
    "REPO",
    "DaemonProc",
    "ManualClock",
    "efficient_config",
    "env",
    "send_step",
    "start_client_as",
    "start_daemon",
    "stop_procs",
    "wait_for",
    "wait_for_socket",
    "wait_ready",
]

REPO = Path(__file__).resolve().parents[1]


class ManualClock:
    """A wall clock that only moves when told to (and may be stepped back, as NTP can)."""

    def __init__(self, t: float = 1_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt_s: float) -> None:
        self.t += dt_s


@dataclass
class DaemonProc:
    proc: subprocess.Popen[bytes]
    socket: Path
    state_dir: Path
    db: Path
    log: Path
    args: list[str] = field(default_factory=list)

    def ctl(self, *args: str, check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(
            [sys.executable, "-m", "greend.ctl", "--socket", str(self.socket), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
            env=env(),
        )
        if check and r.returncode != 0:
            raise AssertionError(
                f"greenctl {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
                f"\n--- daemon log ---\n{self.log_text()}"
            )
        return r

    def status(self) -> dict[str, Any]:
        return json.loads(self.ctl("status", "--json").stdout)

    def log_text(self) -> str:
        try:
            return self.log.read_text()
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def load_bench(name: str) -> ModuleType:
    """``bench/<name>.py`` as a module (registered under ``name``, so its worker
    processes can pickle what it defines)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[name] = bench
    spec.loader.exec_module(bench)
    return bench


def env() -> dict[str, str]:
    """The environment for a greend subprocess: this checkout first on the path, no
    inherited $GREEND_SOCKET."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("GREEND_SOCKET", None)
    return env


def start_daemon(
    tmp: Path,
    *extra: str,
    state_dir: Path | None = None,
    wait: bool = True,
    name: str = "d",
    config: str = "",
    socket: Path | None = None,
) -> DaemonProc:
    state = state_dir or tmp / f"{name}-state"
    sock = socket or tmp / f"{name}.sock"
    db = state / "greend.db"
    log = tmp / f"{name}.log"
    cfg = tmp / f"{name}.toml"
    cfg.write_text(config or '[daemon]\nsocket_group = ""\n')
    args = daemon_command(cfg, sock, state, *extra)
    with open(log, "ab") as fh:
        proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env=env())
    d = DaemonProc(proc, sock, state, db, log, args)
    if wait:
        wait_for_socket(d)
    return d


def wait_for_socket(d: DaemonProc, timeout: float = 20.0) -> None:
    from greend.errors import GreendError

    try:
        wait_until_up(d.proc, d.socket, d.log, timeout_s=timeout)
    except GreendError as e:
        raise AssertionError(str(e)) from None


def wait_for(cond: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """Poll ``cond`` until it holds or ``timeout_s`` passes; its last answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def wait_ready(path: Path, timeout_s: float = 60.0) -> None:
    """Wait for a trainer's --ready-file (its callback is set up and steps run)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear in {timeout_s} s"
        time.sleep(0.05)


def efficient_config(max_slowdown: float, *, daemon: str = 'socket_group = ""\n', extra: str = "") -> str:
    """A daemon config for end-to-end policy tests: the efficient policy deciding every
    0.2 s (settling 50 ms) once a job has 6 steps; ``daemon``: the ``[daemon]`` section's
    lines; ``extra``: sections after the policy's (``[sim]``)."""
    return (
        f'[daemon]\n{daemon}[policy]\nname = "efficient"\nperiod_s = 0.2\nsettle_s = 0.05\n'
        f"[policy.params]\nmax_slowdown = {max_slowdown!r}\nmin_steps = 6\n{extra}"
    )


def send_step(c: Client, step: int, *, flops: float = 1e11, took_s: float = 0.003) -> None:
    """One step row, ending now, on a registered client's connection, as a training rank
    sends it (steps have no reply)."""
    now = time.monotonic()
    assert c._sock is not None, "register the client first"
    row = {"step": step, "t0_s": now - took_s, "t1_s": now, "flops": flops}
    c._sock.sendall(encode({"v": 1, "op": "steps", "steps": [row]}))


def start_client_as(user: str, python: str, script: str, *args: str) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """``python -c script args`` as ``user`` (the tests run as root), a client that prints
    the daemon's reply to its register first: the process and that reply."""
    p = subprocess.Popen(
        [python, "-c", script, *args], user=user, env=env(), cwd="/", stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    assert p.stdout is not None
    line = p.stdout.readline()
    try:
        return p, dict(json.loads(line))
    except ValueError:
        stop_procs(p)
        raise AssertionError(f"{script.strip().splitlines()[0]}...: no register reply, got {line!r}") from None


def stop_procs(*procs: subprocess.Popen[bytes] | None) -> None:
    """Kill and reap the processes that were started (None: one that was not)."""
    for p in procs:
        if p is not None:
            p.kill()
            p.wait(10)
