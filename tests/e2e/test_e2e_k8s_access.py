"""Under the shipped Kubernetes config a training pod's root (uid 0 on the socket) may
report its own job and read status, but not set caps or the policy; the grant (the admin
group) gives it back. A real daemon with the ConfigMap's greend.toml, on simulated GPUs."""

from __future__ import annotations

import grp
import os
import sys
from pathlib import Path

import pytest

from tests.cli.test_container import docs
from tests.support import DaemonProc, start_daemon

pytestmark = pytest.mark.e2e


def shipped_config(**changes: str) -> str:
    text: str = docs()["ConfigMap"]["data"]["greend.toml"]
    for key, value in changes.items():
        text = "\n".join(f"{key} = {value}" if ln.split("=")[0].strip() == key else ln for ln in text.splitlines())
    return text.replace('urls = ["sqlite:///var/lib/greend/greend.db", "prometheus://0.0.0.0:9464"]', "urls = []")


@pytest.mark.skipif(os.geteuid() != 0, reason="the pod's root: needs uid 0")
def test_a_root_pod_reports_its_job_but_cannot_steer_the_node(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "--sim", "1", "--hz", "20", config=shipped_config())
    daemons.append(d)
    assert d.status()["ticks"] > 0
    r = d.ctl("measure", "--job", "pod-job", "--", sys.executable, "-c", "pass")  # its own job: fine
    assert "job pod-job" in r.stdout
    for cmd in (("cap", "set", "--gpu", "0", "--max-clock", "1400"), ("policy", "set", "efficient")):
        r = d.ctl(*cmd, check=False)
        assert r.returncode == 4, r.stdout + r.stderr
        assert "uid 0 alone is not an admin here" in r.stderr and "greend-admin" in r.stderr
    assert d.status()["gpus"][0]["clock_cap_mhz"] is None  # nothing was set


@pytest.mark.skipif(os.geteuid() != 0, reason="the pod's root: needs uid 0")
def test_the_operator_grants_steering_by_the_admin_group(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    mine = grp.getgrgid(os.getgid()).gr_name  # as a pod granted runAsGroup: the admin gid
    d = start_daemon(tmp_path, "--sim", "1", "--hz", "20", config=shipped_config(admin_group=f'"{mine}"'))
    daemons.append(d)
    r = d.ctl("cap", "set", "--gpu", "0", "--max-clock", "1400")
    assert r.returncode == 0
    assert d.status()["gpus"][0]["clock_cap_mhz"] is not None
    d.ctl("cap", "reset")
