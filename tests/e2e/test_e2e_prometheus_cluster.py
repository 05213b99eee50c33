"""One job across two nodes, read back from a real Prometheus server that scrapes both
daemons' /metrics (``greenctl report JOB --store prom://HOST:PORT``): the whole job's
energy is the sum of the nodes', its GFLOPS/W their summed FLOPs over their summed
joules, and a second run of the same job id is reported apart."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from greend.ipc.client import Client
from greend.ipc.server import encode
from tests import vmserver
from tests.support import DaemonProc, start_daemon

pytestmark = [pytest.mark.e2e]

PROMETHEUS = shutil.which("prometheus")
if PROMETHEUS is None:
    pytestmark.append(pytest.mark.skip(reason="the Prometheus server is absent (apt-get install prometheus)"))


def _run_job(d: DaemonProc, job: str, run: str, rank: int, steps: int, flops: float) -> None:
    """One rank of ``job`` on node ``d``: registered, ``steps`` steps of ``flops`` each, ended."""
    with Client(d.socket) as c:
        c.request("register", job=job, run=run, rank=rank, world_size=2, gpus=[0])
        for i in range(steps):
            now = time.monotonic()
            assert c._sock is not None
            c._sock.sendall(
                encode({"v": 1, "op": "steps", "steps": [{"step": i, "t0_s": now - 0.02, "t1_s": now, "flops": flops}]})
            )
            time.sleep(0.02)
        c.request("end")


def _scraped(port: int, selector: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    q = urllib.parse.urlencode({"query": selector})
    while time.monotonic() < deadline:
        try:
            body = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/query?{q}", timeout=5).read())
            if body["data"]["result"]:
                return
        except OSError:
            pass  # the server is still starting
        time.sleep(0.5)
    raise AssertionError(f"Prometheus never scraped {selector}")


def _report(d: DaemonProc, job: str) -> dict:
    deadline = time.monotonic() + 20
    while True:
        rep = json.loads(d.ctl("report", job, "--json").stdout)
        if rep["state"] == "ended" or time.monotonic() > deadline:
            return rep
        time.sleep(0.2)


def test_prometheus_gives_the_whole_job_across_nodes(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    ports = {name: vmserver.free_port() for name in ("n1", "n2")}
    nodes = {}
    for name, port in ports.items():
        config = (
            f'[daemon]\nsocket_group = ""\nhostname = "{name}"\n'
            f'[store]\nurls = ["sqlite:///{tmp_path / name}.db", "prometheus://127.0.0.1:{port}"]\n'
        )
        nodes[name] = start_daemon(tmp_path, "--sim", "1", "--hz", "20", name=name, config=config)
        daemons.append(nodes[name])
    prom_port = vmserver.free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s}\nscrape_configs:\n  - job_name: greend\n"
        "    honor_labels: true\n"  # greend's own job label, not the scrape job's name
        f"    static_configs: [{{targets: ['127.0.0.1:{ports['n1']}', '127.0.0.1:{ports['n2']}']}}]\n"
    )
    prom = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        # An earlier run of the same id on n1 only, then the run that spans both nodes.
        _run_job(nodes["n1"], "train", "old-run", 0, 10, 1e11)
        _report(nodes["n1"], "train")
        _scraped(prom_port, 'greend_job_end_time_seconds{run="old-run"}')  # before the id is reused
        _run_job(nodes["n1"], "train", "r2", 0, 30, 4e11)  # (2e13 FLOP/s: under the H100's fp32 peak)
        _run_job(nodes["n2"], "train", "r2", 1, 30, 2e11)
        reps = {name: _report(d, "train") for name, d in nodes.items()}
        assert all(r["state"] == "ended" and r["run_id"] == "r2" for r in reps.values()), reps

        url = f"prom://127.0.0.1:{prom_port}"
        deadline = time.monotonic() + 60
        while True:  # until Prometheus has scraped both nodes' ended run
            r = nodes["n1"].ctl("report", "train", "--store", url, "--json", check=False)
            whole = json.loads(r.stdout) if r.returncode == 0 else {}
            done = [n for n in whole.get("nodes") or [] if n.get("end_reason")]  # final figures scraped
            if len(done) == 2 and whole.get("run_id") == "r2":
                break
            if time.monotonic() > deadline:
                up = urllib.request.urlopen(f"http://127.0.0.1:{prom_port}/api/v1/targets", timeout=5).read()
                raise AssertionError(f"{r.stdout}{r.stderr}\ntargets: {up[:2000]!r}")
            time.sleep(1)
        text = nodes["n1"].ctl("report", "train", "--store", url).stdout
        jobs = json.loads(nodes["n1"].ctl("jobs", "--store", url, "--json").stdout)["jobs"]
    finally:
        prom.terminate()
        prom.wait(20)

    assert whole["other_runs"] == 1 and whole["complete"] and whole["world_size"] == 2
    assert whole["gpu_energy_j"] == pytest.approx(sum(r["gpu_energy_j"] for r in reps.values()), rel=1e-3)
    assert whole["flops"] == pytest.approx(30 * 4e11 + 30 * 2e11)
    assert whole["gflops_per_w"] == pytest.approx(whole["flops"] / whole["gpu_energy_j"] / 1e9)
    assert sorted(n["host"] for n in whole["nodes"]) == ["n1", "n2"]
    assert "across 2 node(s)" in text and "run r2" in text and "1 other run(s)" in text
    # What the rows stored in SQLite carry, read back from Prometheus too: each node's duration
    # (it read 0.0 s), whole counts (not 30.0), the level and the (sim) label.
    longest = max(r["duration_s"] for r in reps.values())
    assert longest > 0 and whole["duration_s"] == pytest.approx(longest, rel=0.05, abs=0.05), (whole, reps)
    assert whole["steps"] == 30 and isinstance(whole["steps"], int) and whole["nodes"][0]["ranks_here"] == 1
    assert whole["sim"] and "(sim)" in text and {n["gpu_source"] for n in whole["nodes"]} == {"sim"}
    r2 = next(j for j in jobs if j["run_id"] == "r2")
    assert r2["precision"] == reps["n1"]["precision"] and r2["duration_s"] == whole["duration_s"], r2
    assert sorted((j["job"], j["run_id"], j["nodes"]) for j in jobs) == [("train", "old-run", 1), ("train", "r2", 2)]
