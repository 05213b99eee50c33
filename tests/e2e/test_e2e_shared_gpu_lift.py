"""A job's cap does not outlive its hold on a GPU: job A is capped by the efficient
policy on simulated GPU 0; then job B starts working on GPU 0 too. A GPU that two running
jobs use is steered by neither (greend.jobs.claims), so A's cap there is lifted at once,
not when A ends: no job's setting slows another's work."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from greend.ipc.client import Client
from greend.probes.sim import SimGpu
from tests.support import DaemonProc, efficient_config, send_step, start_daemon, wait_for

pytestmark = pytest.mark.e2e

CONFIG = efficient_config(0.1)


def test_a_cap_is_lifted_when_a_second_job_works_on_the_gpu(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "--sim", "1", "--hz", "50", config=CONFIG)
    daemons.append(d)
    gpu = SimGpu(d.state_dir / "sim", 0)
    with Client(d.socket) as a, Client(d.socket) as b:
        a.request("register", job="a", gpus=[0], mem_share=0.3)
        i, deadline = 0, time.monotonic() + 60
        while gpu.locked_clocks_mhz() is None and time.monotonic() < deadline:
            send_step(a, i)
            i += 1
            time.sleep(0.01)
        assert gpu.locked_clocks_mhz() is not None, f"job a was never capped: {d.status()['policy']}"
        assert d.status()["policy"]["owners"] == {"a": ["gpu0.clock_cap_mhz"]}
        # Job b works on GPU 0 too (the simulator runs its steps there: its claim is active).
        b.request("register", job="b", gpus=[0], mem_share=0.3)
        for j in range(20):
            send_step(a, i + j)
            send_step(b, j)
            time.sleep(0.01)

        def lifted() -> bool:
            send_step(a, i + 100)
            send_step(b, 100)
            return gpu.locked_clocks_mhz() is None and not d.status()["policy"]["owners"]

        assert wait_for(lifted, 10), (gpu.locked_clocks_mhz(), d.status()["policy"]["owners"], d.log_text()[-2000:])
        assert "caps lifted on gpu0" in d.log_text()
        assert json.loads(d.ctl("report", "a", "--json").stdout)["state"] == "running"  # a runs on, uncapped
