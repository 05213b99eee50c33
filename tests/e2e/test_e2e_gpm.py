"""SM activity (NVML's GPM metrics) through a whole daemon on the real ``pynvml`` over the
C stand-in of ``libnvidia-ml.so.1``: ``greenctl status --json`` and ``greenctl top``."""

from __future__ import annotations

import json
from pathlib import Path

from tests.e2e.test_e2e_real_nvml import gpus_of, start_on_stub
from tests.support import DaemonProc, wait_for


def test_status_and_top_show_sm_activity_where_the_gpu_has_gpm(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    """GPU 1 waits (40 % of its SMs busy, utilization.gpu 97 %), GPU 2 is an A100 (no
    GPM): status shows 40 and None, top's "SMs %" column 40 and "-"."""
    d = start_on_stub(tmp_path, gpus=3, sm_active="1:40", pre_hopper="2")
    daemons.append(d)

    def sm() -> list[float | None]:
        return [g.get("sm_active_pct") for g in gpus_of(json.loads(d.ctl("status", "--json").stdout))]

    assert wait_for(lambda: sm()[1] is not None, 10), d.log_text()
    got = sm()
    assert round(got[0] or 0) == 97 and round(got[1] or 0) == 40 and got[2] is None, got
    util = [g["util_gpu_pct"] for g in gpus_of(d.status())]
    assert util == [97.0, 97.0, 97.0]  # utilisation sees no difference
    top = d.ctl("top", "--once").stdout
    assert "SMs" in top, top
    rows = {line.split()[0]: line.split() for line in top.splitlines() if line.strip().startswith("gpu")}
    assert rows["gpu1"][-3] == "40" and rows["gpu2"][-3] == "-", top
