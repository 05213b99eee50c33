"""deploy/: the Kubernetes manifest's greend.toml is one greend loads, and its paths agree
(the config's socket is the one the training pods mount and name); the Slurm epilog is
valid sh. (Their behaviour: tests/e2e/test_e2e_slurm.py and, under a real Slurm,
tests/e2e/test_e2e_slurm_real.py.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from greend.config import load_config
from tests.support import REPO

yaml = pytest.importorskip("yaml")
DEPLOY = REPO / "deploy"


def docs() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "greend.yaml").read_text())}


def test_the_configmap_is_a_config_greend_loads_and_the_paths_agree(tmp_path: Path) -> None:
    k = docs()
    assert set(k) == {"Namespace", "ConfigMap", "DaemonSet", "Job"}
    toml = tmp_path / "greend.toml"
    toml.write_text(k["ConfigMap"]["data"]["greend.toml"])
    cfg = load_config(toml)
    sock = Path(cfg.daemon.socket)
    pod = k["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["hostPID"] is True  # SO_PEERCRED pids must be the host's, as NVML's are
    (c,) = pod["containers"]
    assert c["command"][-1] == "/etc/greend/greend.toml"
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts["/etc/greend"] == "config" and mounts[str(sock.parent)] == "run"
    assert mounts[str(cfg.daemon.state_dir)] == "state"
    host = {v["name"]: v.get("hostPath", {}).get("path") for v in pod["volumes"]}
    assert host["run"] == str(sock.parent) and host["state"] == str(cfg.daemon.state_dir)
    # The training pod mounts the same host dir and names the same socket.
    job = k["Job"]["spec"]["template"]["spec"]
    (t,) = job["containers"]
    env = {e["name"]: e for e in t["env"]}
    assert env["GREEND_SOCKET"]["value"] == str(sock)
    assert "GREEND_JOB" in env
    assert {v["name"]: v["hostPath"]["path"] for v in job["volumes"]}["greend"] == str(sock.parent)


@pytest.mark.parametrize("script", ["epilog.sh", "task-epilog.sh"])
def test_the_slurm_scripts_are_valid_executable_sh(script: str) -> None:
    path = DEPLOY / "slurm" / script
    assert os.access(path, os.X_OK), f"{path} is not executable"
    r = subprocess.run(["sh", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
