"""Pacing within a node on a real daemon: two simulated GPUs of one job, GPU 1 slower
(``[sim] gpu_speed_factors``). The fast GPU waits for it at every step, reads less busy
than it, and the efficient policy gives it a deeper clock cap than the slow one, owned by
the job, lifted with the job's end."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from greend.ipc.client import Client
from greend.probes.sim import H100, SimGpu
from tests.e2e.test_e2e_jobs import wait_ended
from tests.support import DaemonProc, efficient_config, send_step, start_daemon, wait_for

pytestmark = pytest.mark.e2e

PACED = efficient_config(0.0, extra="[sim]\ngpu_speed_factors = { 1 = 1.3 }\n")
FLOPS = 1e11  # a step, split over the two GPUs: ~2.1 ms on the fast one, ~2.8 ms on the slow (sim)
PERIOD_S = 0.01  # the job's step on the wall clock: the GPUs compute, then wait (data, the host)


def test_the_gpu_that_waits_for_a_slower_one_gets_a_deeper_cap(
    tmp_path: Path, daemons: list[DaemonProc], figure: Callable[[str], None]
) -> None:
    d = start_daemon(tmp_path, "--sim", "2", "--hz", "50", config=PACED)
    daemons.append(d)
    gpus = [SimGpu(d.state_dir / "sim", i) for i in range(2)]
    assert [g.speed_factor() for g in gpus] == [1.0, 1.3]
    seen: dict[str, Any] = {}
    with Client(d.socket) as c, Client(d.socket) as ask:
        c.request("register", job="uneven", gpus=[0, 1], mem_share=0.3)
        deadline = time.monotonic() + 60
        step = 0
        while time.monotonic() < deadline:
            send_step(c, step, flops=FLOPS)
            step += 1
            time.sleep(PERIOD_S)
            if step % 25:
                continue
            st = ask.request("status")  # (a second connection: the job's steps go on)
            det = (st["policy"].get("last_decision") or {}).get("details", {}).get("jobs", {}).get("uneven", {})
            caps = [g["clock_cap_mhz"] for g in st["gpus"]]
            locks = [g.locked_clocks_mhz() for g in gpus]
            # Paced, and the devices hold what status shows (not mid-apply).
            if (
                det.get("paced")
                and locks[0] is not None
                and locks[0][1] == caps[0]
                and locks[1] == ((H100.sm_clock_min_mhz, caps[1]) if caps[1] is not None else None)
            ):
                utils = [g["util_gpu_pct"] for g in st["gpus"]]
                seen = {"caps": caps, "utils": utils, "details": det, "owners": st["policy"]["owners"], "steps": step}
                break
        assert seen, f"the job was never paced: {d.status()['policy']}"
        fast_cap, slow_cap = seen["caps"]
        det = seen["details"]
        assert det["phase"] == "settled", det
        assert set(det["paced"]) == {"0"}, det  # the fast GPU only: the slow one is the critical path
        assert fast_cap < (slow_cap or H100.sm_clock_max_mhz), seen
        # The caps are the job's: gpu0's own, and gpu1's where the job's setting is a cap.
        owned = {"gpu0.clock_cap_mhz"} | ({"gpu1.clock_cap_mhz"} if slow_cap is not None else set())
        assert seen["owners"] == {"uneven": sorted(owned)}, seen["owners"]
        figure(
            f"(sim) gpu1 1.3x slower: after {seen['steps']} steps gpu0 paced to {fast_cap:.0f} MHz "
            f"(util {seen['utils'][0]:.0f} % vs gpu1's {seen['utils'][1]:.0f} %), gpu1 "
            + (f"at {slow_cap:.0f} MHz" if slow_cap is not None else "uncapped")
        )
    # The job ends (its client closes): every cap it owned is lifted.
    assert wait_ended(d, "uneven")["end_reason"] == "client disconnected"
    assert wait_for(lambda: [g.locked_clocks_mhz() for g in gpus] == [None, None], 10), [
        g.locked_clocks_mhz() for g in gpus
    ]
    assert wait_for(lambda: not d.status()["policy"]["owners"], 5), d.status()["policy"]["owners"]
