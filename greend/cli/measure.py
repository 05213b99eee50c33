"""``greenctl measure -- CMD ...``: run a command as a greend job, no code change needed.

The command's process is registered with the daemon as the job's rank: a Unix socket
is created here and connected *in the child* just before it executes the command
(``preexec_fn``), so the daemon's peer credentials name the command's own pid (its CPU
time is the job's); this process keeps the connection, sends a heartbeat and a
FLOP-less "step" every interval (the job's window: its GPUs' energy over the
command's life), and ends the job with the command's exit status. Then it prints the
job's report: energy, power, CO2, and GFLOPS/W where FLOPs are known (``--flops``:
the FLOPs the whole command does, if you know them).

The command always runs: with no daemon answering, :mod:`greend.cli.measure_local`
measures it in this process from the probes; a daemon lost or refusing mid-run leaves
it running to its end. Its time goes to the daemon in windows of ``interval_s``,
which the daemon books as steps; the report (``measured_whole``) says the command has
no steps nor a precision of its own.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from greend.errors import DaemonUnavailable, GreendError, RequestRefused
from greend.ipc.client import Client
from greend.ipc.wire import frame_message
from greend.protocol import MAX_FLOPS_PER_STEP, MAX_STEPS_PER_MESSAGE

__all__ = ["MeasureResult", "run_measure"]


class MeasureResult:
    def __init__(self, returncode: int, report: dict[str, Any], notes: list[str]) -> None:
        self.returncode = returncode
        self.report = report
        self.notes = notes


def _default_gpus(status: dict[str, Any]) -> tuple[list[int], str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip():
        try:
            return [int(x) for x in visible.split(",") if x.strip()], "from $CUDA_VISIBLE_DEVICES"
        except ValueError:
            pass  # UUIDs: fall through to every GPU
    gpus = [int(g["index"]) for g in status.get("gpus") or []]
    return gpus, "every GPU of this node; --gpus to choose"


def run_measure(
    sock_path: Path,
    cmd: list[str],
    *,
    job: str | None = None,
    gpus: list[int] | None = None,
    flops: float | None = None,
    interval_s: float = 1.0,
    timeout_s: float = 5.0,
    on_sample: Callable[[dict[str, Any]], None] | None = None,
) -> MeasureResult:
    """Run ``cmd`` as job ``job`` (default ``measure-<pid>``) on ``gpus``; its report.

    Raises :class:`DaemonUnavailable` only before the command starts (the caller then
    measures in-process); once it runs, a daemon that goes away or refuses the job
    leaves the command running to its end, and the result says why there is no
    report. ``on_sample`` gets the daemon's ``status`` at every interval (logging)."""
    if not cmd:
        raise GreendError("give the command after --: greenctl measure -- python train.py")
    notes: list[str] = []
    with Client(sock_path, timeout_s=timeout_s) as c:
        status = c.request("status")
    if gpus is None:
        gpus, why = _default_gpus(status)
        notes.append(f"GPUs {','.join(map(str, gpus)) or 'none'} ({why})")
    else:
        # Checked before the command starts (the daemon would refuse the job once it ran).
        present = {int(g["index"]) for g in status.get("gpus") or [] if isinstance(g.get("index"), int)}
        missing = sorted(set(gpus) - present)
        if missing and status.get("gpus") is not None:
            raise GreendError(
                f"--gpus {','.join(map(str, gpus))}: GPU {', '.join(map(str, missing))} not on this node "
                f"(it has {', '.join(map(str, sorted(present))) or 'none'}); nothing was run"
            )
    if not gpus:
        notes.append("no GPUs: the job's GPU energy is 0 J (this node has none, or --gpus named none)")
    job = job or f"measure-{os.getpid()}"

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def connect_in_child() -> None:
        try:
            s.connect(str(sock_path))
        except OSError:
            pass  # the parent sees an unconnected socket and connects itself

    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the command; we end the job
    try:
        try:
            proc = subprocess.Popen(cmd, preexec_fn=connect_in_child)  # before exec: the peer is the command
        except OSError as e:
            s.close()
            raise GreendError(f"cannot run {cmd[0]!r}: {e.strerror or e}") from None
        client = Client(sock_path, timeout_s=timeout_s)
        try:
            try:
                s.getpeername()
            except OSError:
                s.connect(str(sock_path))
                notes.append("registered from greenctl's own process: the job's CPU share is not the command's")
            s.settimeout(timeout_s)
            client._sock = s  # the connection the child made: the daemon sees the command's pid
            rc = _through_daemon(client, s, proc, job, gpus, flops, interval_s, on_sample)
        except (DaemonUnavailable, RequestRefused, OSError) as e:
            # The command runs on: a wrapped training never fails because of greend.
            notes.append(
                f"the daemon {'refused the job' if isinstance(e, RequestRefused) else 'went away'}: {e}; "
                "the command ran to its end, unmeasured"
            )
            return MeasureResult(proc.wait(), {}, notes)
        finally:
            client.close()
    finally:
        signal.signal(signal.SIGINT, old_int)
    report: dict[str, Any] = {}
    deadline = time.monotonic() + 15
    try:
        with Client(sock_path, timeout_s=timeout_s) as c:
            while time.monotonic() < deadline:
                report = c.request("report", job=job)
                if report["state"] == "ended":
                    break
                time.sleep(0.1)
    except (DaemonUnavailable, RequestRefused) as e:
        notes.append(f"the command ended (exit {rc}) but its report could not be read: {e}")
        return MeasureResult(rc, {}, notes)
    if not flops:
        notes.append("FLOPs unknown: GFLOPS/W needs --flops N or GreenCallback in the code")
    if report:
        # A command measured whole has no steps nor a precision of its own: the daemon's
        # windows are kept apart as "windows", never shown as steps (render_report).
        report["measured_whole"] = True
        report["windows"] = report.get("steps")
        report["steps"] = None
        report["precision"] = None
    return MeasureResult(rc, report, notes)


def _through_daemon(
    client: Client,
    s: socket.socket,
    proc: subprocess.Popen[bytes],
    job: str,
    gpus: list[int],
    flops: float | None,
    interval_s: float,
    on_sample: Callable[[dict[str, Any]], None] | None,
) -> int:
    """The job's life at the daemon while the command runs: its time in windows of
    ``interval_s`` (the daemon's steps; the report says they are not the command's),
    a heartbeat between them, the end with the command's exit status."""
    fields: dict[str, Any] = {"job": job, "gpus": gpus, "world_size": 1, "rank": 0, "local_rank": 0}
    try:  # a measured command: no training level, windows not steps (the daemon says so)
        reg = client.request("register", kind="measure", **fields)
    except RequestRefused as e:
        if e.code != "bad_request" or e.field != "kind":
            raise
        # An older daemon, without job kinds: a training job at fp32 (the report is corrected below).
        reg = client.request("register", precisions=["fp32"], **fields)
    interval = min(interval_s, float(reg.get("heartbeat_s") or interval_s))
    t_prev = time.monotonic()
    now = t_prev
    step = 0
    while True:
        try:
            rc = proc.wait(timeout=interval)
            done = True
        except subprocess.TimeoutExpired:
            rc, done = 0, False
        now = time.monotonic()
        if now > t_prev:
            s.sendall(frame_message("steps", {"steps": [{"step": step, "t0_s": t_prev, "t1_s": now, "flops": 0.0}]}))
            step += 1
            t_prev = now
        if on_sample is not None:
            on_sample(client.request("status"))
        if done:
            break
        client.request("heartbeat")
    if flops:
        # The whole command's FLOPs, as entries of at most a step's limit (a large run does
        # 1e22 and more), in messages of at most MAX_STEPS_PER_MESSAGE entries.
        n = math.ceil(flops / (0.999 * MAX_FLOPS_PER_STEP))  # (each share safely under the limit)
        per = min(MAX_STEPS_PER_MESSAGE, 256)  # ~100 bytes an entry: a message well under its size limit
        for k in range(0, n, per):
            entries = [
                {"step": step + i, "t0_s": now, "t1_s": now, "flops": flops / n} for i in range(k, min(n, k + per))
            ]
            s.sendall(frame_message("steps", {"steps": entries}))
    client.request("end", reason=f"command exited with {rc}")
    return rc
