"""Claims follow real GPU use, end to end (greend.jobs.claims): a real daemon on
simulated GPUs under the efficient policy, clients of two real unprivileged users
(root only). A process that computes nothing claims GPUs 0 and 1: neither is capped;
a second user who then trains on GPU 1 is registered beside the stale claim, and the
policy caps GPU 1 for that user's job. On simulated GPUs a rank uses a GPU once its
reported steps ran there; on NVML (the real pynvml on the C stand-in) once NVML lists
its process there, so a claimer that reports steps without computing caps nothing."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.test_e2e_shared_node import USER_PY, needs_root, shared_dir, user  # noqa: F401  # fixtures used by name
from tests.support import DaemonProc, efficient_config, start_client_as, start_daemon, stop_procs, wait_for

pytestmark = pytest.mark.e2e

CFG = efficient_config(0.05, daemon='socket_group = ""\nsocket_mode = "0666"\nadmin_group = ""\n')

# Registers the given GPUs and computes nothing; heartbeats until its stdin closes.
IDLE = """
import json, socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
f = s.makefile("rb")
s.sendall(json.dumps({"v": 1, "op": "register", "job": sys.argv[2], "gpus": json.loads(sys.argv[3])}).encode() + b"\\n")
print(f.readline().decode().strip(), flush=True)
while True:
    s.sendall(json.dumps({"v": 1, "op": "heartbeat"}).encode() + b"\\n")
    f.readline()
    time.sleep(1)
"""

# Registers the given GPUs (default [1]) and reports steps (4 ms each, 2 TFLOP) until killed.
TRAIN = """
import json, socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
f = s.makefile("rb")
job, gpus = (sys.argv[2], json.loads(sys.argv[3])) if len(sys.argv) > 3 else ("train", [1])
s.sendall(json.dumps({"v": 1, "op": "register", "job": job, "gpus": gpus, "mem_share": 0.3}).encode() + b"\\n")
print(f.readline().decode().strip(), flush=True)
step = 0
while True:
    now = time.monotonic()
    s.sendall(json.dumps({"v": 1, "op": "steps", "steps": [{"step": step, "t0_s": now - 0.004, "t1_s": now,
                                                             "flops": 2e12}]}).encode() + b"\\n")
    step += 1
    time.sleep(0.005)
"""


def _locks(d: DaemonProc) -> list[object]:
    return [g["clock_cap_mhz"] for g in d.status()["gpus"]]


@needs_root
def test_an_idle_claim_caps_nothing_and_keeps_no_user_off(
    tmp_path: Path,
    shared_dir: Path,  # noqa: F811  # the fixture
    user: str,  # noqa: F811  # the fixture
    daemons: list[DaemonProc],
) -> None:
    d = start_daemon(tmp_path, "--sim", "2", "--hz", "20", config=CFG, socket=shared_dir / "g.sock")
    daemons.append(d)
    squatter, reply = start_client_as("nobody", str(USER_PY), IDLE, str(d.socket), "squat", "[0, 1]")
    trainer: subprocess.Popen[bytes] | None = None
    try:
        assert reply["ok"], reply
        time.sleep(3.0)  # 15 policy periods
        assert _locks(d) == [None, None], "an idle claim was capped"
        squat = json.loads(d.ctl("report", "squat", "--json").stdout)
        assert squat["gpu_claims"] == {"0": "pending", "1": "pending"}

        # A second user trains on GPU 1: registered beside the stale claim, and capped.
        trainer, reply = start_client_as(user, str(USER_PY), TRAIN, str(d.socket))
        assert reply["ok"], reply
        assert wait_for(lambda: _locks(d)[1] is not None, 60), f"the trainer's GPU was never capped: {d.status()}"
        assert _locks(d)[0] is None, "the idle claim's other GPU was capped"
        train = json.loads(d.ctl("report", "train", "--json").stdout)
        assert train["gpu_claims"] == {"1": "active"}
        assert json.loads(d.ctl("report", "squat", "--json").stdout)["gpu_claims"] == {"0": "pending", "1": "pending"}
        assert "the claim of job squat (uid 65534) on it is pending" in d.log_text()
    finally:
        stop_procs(trainer, squatter)


def _start_on_stub(tmp: Path, sock: Path, **faults: object) -> DaemonProc:
    """``greend run`` on the real pynvml over the C stand-in of libnvidia-ml (2 GPUs)."""
    from greend.testing.daemon_proc import daemon_command
    from tests.nvml_stub import REPO, stub_env
    from tests.support import wait_for_socket

    state, log, cfg = tmp / "d-state", tmp / "d.log", tmp / "d.toml"
    cfg.write_text(CFG)
    args = daemon_command(cfg, sock, state, "--sysfs-root", str(tmp / "no-sysfs"), "--hz", "10")
    with open(log, "ab") as fh:
        proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env=stub_env(gpus=2, **faults))
    d = DaemonProc(proc, sock, state, state / "greend.db", log, args)
    wait_for_socket(d, timeout=40)
    return d


def _locked(gpu_file: Path, index: int) -> bool:
    """The stand-in's GPU ``index`` has its clocks locked (NVML has no getter)."""
    for line in gpu_file.read_text().splitlines() if gpu_file.exists() else ():
        i, _limit, lo, hi = (int(x) for x in line.split())
        if i == index:
            return (lo, hi) != (0, 0)
    return False


@needs_root
def test_on_nvml_a_claimer_that_only_reports_steps_caps_nothing(
    tmp_path: Path,
    shared_dir: Path,  # noqa: F811  # the fixture
    user: str,  # noqa: F811  # the fixture
    daemons: list[DaemonProc],
) -> None:
    gpu_file, table = tmp_path / "gpus.txt", tmp_path / "procs"
    table.write_text("")
    d = _start_on_stub(tmp_path, shared_dir / "g.sock", state=gpu_file, procs=table)
    daemons.append(d)
    # Reports steps on GPUs 0 and 1 as a trainer would, but has no process on either.
    squatter, reply = start_client_as("nobody", str(USER_PY), TRAIN, str(d.socket), "squat", "[0, 1]")
    trainer: subprocess.Popen[bytes] | None = None
    try:
        assert reply["ok"], reply
        trainer, reply = start_client_as(user, str(USER_PY), TRAIN, str(d.socket))
        assert reply["ok"], reply  # beside the squatter's claim on GPU 1
        table.write_text(f"1 {trainer.pid} compute 2048\n")  # its CUDA context: NVML lists it on GPU 1
        assert wait_for(lambda: _locked(gpu_file, 1), 60), f"the trainer's GPU was never capped: {d.log_text()[-3000:]}"
        assert not _locked(gpu_file, 0), "the squatter's GPU 0 was capped"
        assert json.loads(d.ctl("report", "train", "--json").stdout)["gpu_claims"] == {"1": "active"}
        assert json.loads(d.ctl("report", "squat", "--json").stdout)["gpu_claims"] == {"0": "pending", "1": "pending"}
    finally:
        stop_procs(trainer, squatter)
