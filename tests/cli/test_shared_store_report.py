"""greenctl report JOB --store URL: a job's figures from a shared store every node writes
to, and clear errors where the URL is no such store. (The whole two-node job from a real
victoria-metrics: tests/e2e/test_e2e_distributed.py.)"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import pytest

from greend.errors import StoreError
from greend.jobs.history import is_shared_store, shared_job_rows, shared_jobs, whole_job_report
from tests import vmserver


class _Handler(http.server.BaseHTTPRequestHandler):
    body = b""
    status = 200
    paths: list[str] = []

    def do_GET(self) -> None:
        type(self).paths.append(self.path)
        self.send_response(self.status)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, type[_Handler]]]:
    handler = type("H", (_Handler,), {"paths": []})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, args=(0.02,), daemon=True)  # shutdown() within 20 ms
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", handler
    srv.shutdown()


def _series(
    field: str, host: str, ts: list[int], values: list[float], job: str = "j1", run: str = "", source: str = ""
) -> str:
    metric = {"__name__": f"greend_job_{field}", "host": host, "job": job, "precision": "bf16", "end_reason": "ok"}
    if run:
        metric["run"] = run
    if source:
        metric["gpu_source"] = source  # (as greend.points.job_point tags a summary)
    return json.dumps({"metric": metric, "values": values, "timestamps": ts})


def test_a_simulated_jobs_figures_stay_labelled_sim_from_the_shared_store(server: tuple[str, type[_Handler]]) -> None:
    """The summary's gpu_source label comes back from the shared store: its cross-node report
    and its jobs row say "(sim)" as the nodes' own files do (they printed none)."""
    url, handler = server
    lines = [
        _series(f, h, [1000 + k], [v], source="sim")
        for k, h in enumerate(("n1", "n2"))
        for f, v in (("gpu_energy_j", 10.0), ("flops", 1e12), ("ranks_here", 1), ("world_size", 2), ("saved_j", 5.0))
    ]
    handler.body = ("\n".join(lines) + "\n").encode()
    whole = whole_job_report([url], "j1")
    assert whole is not None and whole["sim"] and all(n["gpu_source"] == "sim" for n in whole["nodes"])
    from greend.cli.render import render_whole_job

    assert "(sim)" in render_whole_job(whole)
    (row,) = shared_jobs(url)
    assert row["sim"]


def test_two_runs_of_one_job_id_are_never_summed(server: tuple[str, type[_Handler]]) -> None:
    """A job id reused: run r1 on n1 and n2, then run r2 on n1 alone. The report is r2's,
    n1's row only, and says another run exists; r2 is not partial because of r1's n2."""
    url, handler = server
    lines = [
        _series("gpu_energy_j", "n1", [1000], [10.0], run="r1"),
        _series("flops", "n1", [1000], [1e12], run="r1"),
        _series("gpu_energy_j", "n2", [1001], [20.0], run="r1"),
        _series("flops", "n2", [1001], [2e12], run="r1"),
        _series("gpu_energy_j", "n1", [9000], [100.0], run="r2"),
        _series("flops", "n1", [9000], [4e12], run="r2"),
        _series("ranks_here", "n1", [9000], [1], run="r2"),
        _series("world_size", "n1", [9000], [1], run="r2"),
    ]
    handler.body = ("\n".join(lines) + "\n").encode()
    whole = whole_job_report([url], "j1")
    assert whole is not None and whole["run_id"] == "r2" and whole["other_runs"] == 1
    assert [n["host"] for n in whole["nodes"]] == ["n1"] and whole["gpu_energy_j"] == pytest.approx(100.0)
    assert whole["complete"]
    from greend.cli.render import render_whole_job

    assert "run r2  (1 other run(s) of this id not shown)" in render_whole_job(whole)
    jobs = shared_jobs(url)
    assert [(j["job"], j["run_id"], j["nodes"]) for j in jobs] == [("j1", "r1", 2), ("j1", "r2", 1)]
    assert jobs[0]["gpu_energy_j"] == pytest.approx(30.0)


def test_rows_come_back_per_host_and_run_and_sum_to_the_job(server: tuple[str, type[_Handler]]) -> None:
    url, handler = server
    lines = [
        _series("gpu_energy_j", "n1", [1000, 5000], [10.0, 100.0]),  # two runs of j1 on n1
        _series("flops", "n1", [1000, 5000], [1e12, 4e12]),
        _series("ranks_here", "n1", [5000], [1]),
        _series("world_size", "n1", [5000], [2]),
        _series("gpu_energy_j", "n2", [5001], [300.0]),
        _series("flops", "n2", [5001], [8e12]),
        _series("ranks_here", "n2", [5001], [1]),
        _series("world_size", "n2", [5001], [2]),
    ]
    handler.body = ("\n".join(lines) + "\n").encode()
    rows = shared_job_rows(f"influx://{url.split('//')[1]}?org=o&bucket=b", "j1")
    assert [(r["host"], r["ts_ns"]) for r in rows] == [
        ("n1", 1_000_000_000),
        ("n1", 5_000_000_000),
        ("n2", 5_001_000_000),
    ]
    assert handler.paths[0].startswith("/api/v1/export?match")
    whole = whole_job_report([url], "j1")
    assert whole is not None and whole["complete"] and whole["ranks_found"] == 2
    # Each host's last run: n1's second (100 J), n2's; GFLOPS/W is summed FLOPs over summed joules.
    assert whole["gpu_energy_j"] == pytest.approx(400.0)
    assert whole["gflops_per_w"] == pytest.approx((4e12 + 8e12) / 400.0 / 1e9)


def test_every_job_of_the_cluster_summed_across_its_nodes(server: tuple[str, type[_Handler]]) -> None:
    url, handler = server
    lines = [
        _series("gpu_energy_j", "n1", [1000], [10.0], job="a"),
        _series("flops", "n1", [1000], [1e12], job="a"),
        _series("gpu_energy_j", "n2", [1002], [30.0], job="a"),
        _series("flops", "n2", [1002], [3e12], job="a"),
        _series("gpu_energy_j", "n1", [900], [5.0], job="b"),
        _series("flops", "n1", [900], [1e12], job="b"),
    ]
    handler.body = ("\n".join(lines) + "\n").encode()
    jobs = shared_jobs(url)
    assert [(j["job"], j["nodes"]) for j in jobs] == [("b", 1), ("a", 2)]  # oldest first
    assert jobs[1]["gpu_energy_j"] == pytest.approx(40.0)
    assert jobs[1]["gflops_per_w"] == pytest.approx(4e12 / 40.0 / 1e9)
    assert "job=" not in handler.paths[-1].split("match", 1)[1]  # every job, not one


def test_a_url_that_is_no_such_store_says_so(server: tuple[str, type[_Handler]]) -> None:
    url, handler = server
    handler.status = 404
    with pytest.raises(StoreError, match="answered 404 to VictoriaMetrics' /api/v1/export"):
        shared_job_rows(url, "j1")
    with pytest.raises(StoreError, match="cannot reach the store"):
        shared_job_rows(f"http://127.0.0.1:{vmserver.free_port()}", "j1", timeout_s=2)
    with pytest.raises(StoreError, match="not one greend accepts"):
        shared_job_rows(url, 'j1"} or {x="')
    assert is_shared_store("influx://h:1?org=o&bucket=b") and is_shared_store("http://h:8428")
    assert not is_shared_store("/var/lib/greend/greend.db")
