"""How long a real ``greend run`` takes to answer and to stop while NVML misbehaves.

Run:  python bench/bench_nvml_faults.py [--deadline 5]

The daemon runs the real ``pynvml`` on the C stand-in of ``libnvidia-ml.so.1``
(tests/nvml_stub, 8 GPUs; built on demand, needs gcc) under three faults, with the
NVML call deadline ``--deadline`` (``GREEND_NVML_DEADLINE_S``):

- every NVML call but ``nvmlInit`` hangs 3 s: when status first answers (the daemon's
  uptime then, and the seconds since the process was spawned), and what it says;
  when all eight GPUs are listed (as unresponsive); the stop;
- ``nvmlInit`` takes 4 s (as after a driver load): the same;
- gpu3 of 8 starts hanging (60 s a call) mid-run: how late the daemon's ticks run from
  2 s before to 8 s after (for each due time of the 10 Hz grid, the delay until a tick
  starts; p50, p99, max), with the tick waiting at most a quarter period for the GPUs'
  reads (greend now) and, for comparison, up to the call deadline
  (``GREEND_NVML_READ_WAIT_S`` = the deadline: the tick as it was);
- gpu3 of 8 starts hanging (60 s a call) after caps were set on gpu0 and gpu3: how
  long until status shows gpu3 unresponsive, how long SIGTERM takes, and whether gpu0
  was unlocked (and gpu3 left, named, for ``greend restore``);
- ``greend restore`` (the unit's ExecStopPost) after a SIGKILL left caps on gpu0 and
  gpu3, while gpu3 hangs, while every call but nvmlInit hangs, and while nvmlInit
  hangs: how long it takes, its exit status, what it restored and whom it named.

Targets: no tick waits on a GPU that starts hanging (lateness max about the read wait,
25 ms at 10 Hz, not a call deadline); status answers within 2 s of the daemon's start
whatever NVML does; the
stop and ``greend restore`` within the unit's TimeoutStopSec (30 s); gpu0 restored
while gpu3 hangs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from greend.errors import DaemonUnavailable, GreendError  # noqa: E402  # after the path above
from greend.ipc.client import Client  # noqa: E402  # after the path above
from greend.testing.daemon_proc import daemon_command  # noqa: E402  # after the path above
from tests.nvml_stub import stub_env  # noqa: E402  # after the path above

# The daemon with each tick's start (monotonic, the clock it ticks on) written to a file at exit.
TICK_TIMES = """
import atexit, json, sys
from greend.daemon.core import Daemon
starts, out = [], sys.argv.pop()
tick = Daemon.tick
Daemon.tick = lambda self, now_s: (starts.append(now_s), tick(self, now_s))[1]
atexit.register(lambda: open(out, "w").write(json.dumps(starts)))
from greend.cli.greend_cmd import daemon_main
daemon_main()
"""


def spawn(
    tmp: Path, deadline_s: str, env_extra: dict[str, str] | None = None, ticks_to: Path | None = None, **faults: object
) -> tuple[subprocess.Popen[bytes], Path, float]:
    cfg = tmp / "d.toml"
    cfg.write_text('[daemon]\nsocket_group = ""\n')
    sock = tmp / "d.sock"
    faults.setdefault("state", tmp / "gpus.txt")
    args = daemon_command(cfg, sock, tmp / "state", "--sysfs-root", str(tmp / "no-sysfs"), "--hz", "10")
    if ticks_to is not None:  # python -P -c TICK_TIMES run ... FILE
        args = [args[0], "-P", "-c", TICK_TIMES, *args[4:], str(ticks_to)]
    env = {**stub_env(**faults), "GREEND_NVML_DEADLINE_S": deadline_s, **(env_extra or {})}
    t0 = time.monotonic()
    with open(tmp / "d.log", "ab") as log:  # the daemon keeps its own copy of the descriptor
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    return proc, sock, t0


def status(sock: Path, timeout_s: float = 60.0) -> dict[str, Any]:
    end = time.monotonic() + timeout_s
    while True:
        try:
            with Client(sock, timeout_s=5.0) as c:
                st: dict[str, Any] = c.request("status")
                return st
        except (DaemonUnavailable, GreendError, OSError):
            if time.monotonic() > end:
                raise
            time.sleep(0.02)


def states(st: dict[str, Any]) -> dict[int, str]:
    return {g["index"]: g["state"] for g in (st.get("gpu_probe") or {}).get("gpus") or []}


def until(cond: Any, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def stop(proc: subprocess.Popen[bytes]) -> tuple[float, int]:
    t = time.monotonic()
    proc.terminate()
    rc = proc.wait(60)
    return time.monotonic() - t, rc


def locked(gpu_file: Path, index: int) -> tuple[int, int]:
    for line in gpu_file.read_text().splitlines():
        i, _, lo, hi = (int(x) for x in line.split())
        if i == index:
            return lo, hi
    return 0, 0


def ctl(sock: Path, *args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "greend.ctl", "--socket", str(sock), *args], check=True, capture_output=True, cwd=REPO
    )


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def tick_lateness(deadline_s: str, read_wait_s: str | None) -> str:
    """gpu3 starts hanging mid-run: the lateness of each due tick from 2 s before to 8 s after."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        hang, ticks = tmp / "hang-now", tmp / "ticks.json"
        env = {} if read_wait_s is None else {"GREEND_NVML_READ_WAIT_S": read_wait_s}
        proc, sock, _ = spawn(tmp, deadline_s, env, ticks, hang_gpus="3", hang_when=hang, hang_s=60)
        until(lambda: len(states(status(sock))) == 8, 60)
        time.sleep(3.0)
        hang.touch()
        t_hang = time.monotonic()
        time.sleep(8.5)
        skipped = status(sock)["ticks_skipped"]
        stop(proc)
        starts = json.loads(ticks.read_text())
    period = 0.1
    dues = [starts[0] + k * period for k in range(int((starts[-1] - starts[0]) / period))]
    late = [next(s for s in starts if s >= due) - due for due in dues if t_hang - 2.0 <= due <= t_hang + 8.0]
    return (
        f"p50 {pct(late, 0.5) * 1e3:.1f} ms, p99 {pct(late, 0.99) * 1e3:.0f} ms, max {max(late) * 1e3:.0f} ms "
        f"over {len(late)} due ticks; ticks skipped since start: {skipped}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deadline", default="5", help="GREEND_NVML_DEADLINE_S (s)")
    ap.add_argument("--only-ticks", action="store_true", help="only the tick lateness while a GPU starts hanging")
    a = ap.parse_args()
    for label, wait in (("up to the call deadline (as before)", a.deadline), ("a quarter period (now)", None)):
        print(f"gpu3 starts hanging mid-run, tick waits for reads {label}: {tick_lateness(a.deadline, wait)}")
    if a.only_ticks:
        return
    for name, faults in (
        ("every NVML call hangs 3 s", {"hang_gpus": "all", "hang_node": 1, "hang_s": 3}),
        ("nvmlInit takes 4 s", {"init_s": 4}),
    ):
        with tempfile.TemporaryDirectory() as d:
            proc, sock, t0 = spawn(Path(d), a.deadline, **faults)
            st = status(sock)
            first = time.monotonic() - t0
            listed = until(lambda s=sock: len(states(status(s))) == 8, 120)
            listed_s = time.monotonic() - t0
            stop_s, rc = stop(proc)
            print(
                f"{name}: status answered at uptime {st['uptime_s']:.2f} s ({first:.2f} s after spawn), "
                f"saying {st['gpu_probe']['state']!r}; 8 GPUs listed: {listed} at {listed_s:.1f} s "
                f"({sorted(set(states(st).values())) or 'none yet'} at first); SIGTERM -> exit {stop_s:.2f} s (rc {rc})"
            )
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        gpu_file, hang = tmp / "gpus.txt", tmp / "hang-now"
        proc, sock, _ = spawn(tmp, a.deadline, state=gpu_file, hang_gpus="3", hang_when=hang, hang_s=60)
        until(lambda: len(states(status(sock))) == 8, 60)
        ctl(sock, "cap", "set", "--gpu", "0", "--max-clock", "1200")
        ctl(sock, "cap", "set", "--gpu", "3", "--max-clock", "1200")
        hang.touch()
        t = time.monotonic()
        until(lambda: states(status(sock)).get(3) == "unresponsive", 60)
        seen_s = time.monotonic() - t
        stop_s, rc = stop(proc)
        log = (tmp / "d.log").read_text()
        print(
            f"gpu3 of 8 hangs mid-run: unresponsive in status after {seen_s:.1f} s; SIGTERM -> exit {stop_s:.2f} s "
            f"(rc {rc}; target < 30 s); gpu0 lock after stop {locked(gpu_file, 0)} (target (0, 0)), "
            f"gpu3 {locked(gpu_file, 3)}, named as not restored: {'FAILED gpu3' in log}"
        )

    for name, faults in (
        ("gpu3 hangs", {"hang_gpus": "3", "hang_s": 60}),
        ("every call but nvmlInit hangs", {"hang_gpus": "all", "hang_node": 1, "hang_s": 60}),
        ("nvmlInit hangs", {"init_s": 60}),
    ):
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            gpu_file = tmp / "gpus.txt"
            proc, sock, _ = spawn(tmp, a.deadline, state=gpu_file)
            until(lambda s=sock: len(states(status(s))) == 8, 60)
            ctl(sock, "cap", "set", "--gpu", "0", "--max-clock", "1200")
            ctl(sock, "cap", "set", "--gpu", "3", "--max-clock", "1200")
            proc.kill()
            proc.wait(10)
            env = {**stub_env(state=gpu_file, **faults), "GREEND_NVML_DEADLINE_S": a.deadline}
            args = [sys.executable, "-P", "-m", "greend.daemon_main", "restore", "--state-dir", str(tmp / "state")]
            t = time.monotonic()
            r = subprocess.run(args, capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
            took_s = time.monotonic() - t
            last = (r.stdout + r.stderr).strip().splitlines()[-1]
            named = last.split(": ", 1)[1].split(";")[0] if last.startswith("not restored") else "none"
            print(
                f"greend restore after SIGKILL, {name}: {took_s:.2f} s (target < 30 s), exit {r.returncode}; "
                f"gpu0 lock {locked(gpu_file, 0)}, gpu3 lock {locked(gpu_file, 3)}; named as not restored: {named}"
            )


if __name__ == "__main__":
    main()
