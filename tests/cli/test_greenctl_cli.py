"""greenctl's command line itself: --version, completion, --timeout, doctor --json, and
a --plot path that cannot be written (refused before anything else, no traceback)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from greend import __version__
from greend.cli.greenctl import ctl_app
from greend.cli.greend_cmd import daemon_app


def run(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(ctl_app, list(args))
    return r.exit_code, r.output


def test_version_of_both_commands() -> None:
    assert run("--version") == (0, f"greenctl (greend) {__version__}\n")
    r = CliRunner().invoke(daemon_app, ["--version"])
    assert r.exit_code == 0 and r.output == f"greend {__version__}\n"


def test_shell_completion_is_offered() -> None:
    code, out = run("--help")
    assert code == 0 and "--install-completion" in out and "--show-completion" in out


@pytest.mark.parametrize("bad", ["-1", "0", "nan", "1e+308"])
def test_timeout_must_be_positive_and_at_most_a_day(bad: str, tmp_path: Path) -> None:
    """(1e308 s overflowed the socket's timeout: a traceback)"""
    code, out = run("--socket", str(tmp_path / "s.sock"), "--timeout", bad, "status")
    assert code == 2 and f"--timeout {bad}: expected seconds > 0 and at most a day" in out and "Traceback" not in out


def test_doctor_json(tmp_path: Path) -> None:
    code, out = run("--socket", str(tmp_path / "s.sock"), "doctor", "--json", "--sysfs-root", str(tmp_path))
    doc = json.loads(out)
    assert doc["exit"] == code
    assert doc["checks"] and all({"level", "name", "detail", "fix"} <= set(c) for c in doc["checks"])
    assert {c["level"] for c in doc["checks"]} <= {"ok", "info", "warn", "fail"}


@pytest.mark.parametrize(
    "plot, said",
    [("/no/such/dir/x.png", "no directory /no/such/dir"), ("x.txt", "give a file ending in .png")],
)
def test_a_bad_plot_path_is_refused_in_one_line(plot: str, said: str, tmp_path: Path) -> None:
    code, out = run("--socket", str(tmp_path / "s.sock"), "report", "j", "--plot", plot)
    assert code == 2 and said in out and "Traceback" not in out
    assert len(out.strip().splitlines()) == 1


@pytest.mark.parametrize("reply", [b"HTTP/1.1 200 OK\r\n\r\n", b"[1,2,3]\n"])
def test_a_socket_that_is_not_greends_is_said_so_not_a_traceback(tmp_path: Path, reply: bytes) -> None:
    import socket
    import threading

    path = tmp_path / "other.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(4)

    def serve() -> None:
        for _ in range(2):
            try:
                c, _ = srv.accept()
            except OSError:
                return
            c.recv(4096)
            c.sendall(reply)
            c.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        code, out = run("--socket", str(path), "--timeout", "2", "status", "--json")
    finally:
        srv.close()
    assert code == 3, out
    assert "does not speak greend's protocol" in out and "is it greend's socket?" in out


@pytest.mark.parametrize("value", ["NaN", "Infinity", "1e309"])
def test_a_policy_parameter_that_is_no_finite_number_is_refused_here(value: str) -> None:
    code, out = run("--socket", "/nonexistent/g.sock", "policy", "set", "efficient", "--param", f"max_slowdown={value}")
    assert code == 2 and "max_slowdown must be a finite number" in out, out


@pytest.mark.parametrize(("value", "why"), [("[" * 5000, "recursion"), ("9" * 5000, "digits")])
def test_a_policy_parameter_past_what_json_can_read_is_refused_in_one_line(value: str, why: str) -> None:
    code, out = run("--socket", "/nonexistent/g.sock", "policy", "set", "efficient", "--param", f"max_slowdown={value}")
    assert code == 2 and "--param 'max_slowdown': not a value greenctl can send" in out and why in out, out
    assert "Traceback" not in out


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_output_that_cannot_be_written_is_one_line_of_error_not_a_traceback() -> None:
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        r = subprocess.run([str(Path(sys.executable).parent / "greenctl"), "--version"], stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert r.stderr == "error: cannot write greenctl's output: No space left on device\n"


def _answering(path: Path, reply: bytes, times: int = 4) -> Any:
    """A socket at ``path`` that answers every request line with ``reply``."""
    import socket
    import threading

    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(4)

    def serve() -> None:
        for _ in range(times):
            try:
                c, _ = srv.accept()
            except OSError:
                return
            try:
                buf = b""
                while b"\n" not in buf:
                    chunk = c.recv(4096)
                    if not chunk:
                        break
                    buf += chunk
                if buf:
                    c.sendall(reply)
            except OSError:
                pass  # (a client that sent nothing and went: fine)
            finally:
                c.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv


@pytest.mark.parametrize(
    ("reply", "said"),
    [
        (b'{"v":1,"id":1,"ok":false,"error":"boom"}\n', "request refused: 'boom'"),
        (b'{"v":1,"id":1,"ok":true,"result":[]}\n', "unexpected reply from the daemon"),
        (b'{"v":1,"id":1,"ok":true,"result":{}}\n', "unexpected reply from the daemon"),
        (b'{"v":1,"id":1,"ok":true,"result":"x"}\n', "unexpected reply from the daemon"),
    ],
)
def test_a_reply_of_the_wrong_shape_is_said_so_not_a_traceback(tmp_path: Path, reply: bytes, said: str) -> None:
    path = tmp_path / "odd.sock"
    srv = _answering(path, reply)
    try:
        code, out = run("--socket", str(path), "--timeout", "2", "status")
    finally:
        srv.close()
    assert code == 2 and said in out and "Traceback" not in out, out


@pytest.mark.parametrize("value", ["nan", "inf", "1e400"])
def test_a_value_json_cannot_carry_is_refused_by_greenctl_not_a_traceback(tmp_path: Path, value: str) -> None:
    """cap set --power-limit nan (or inf, or 1e400 that reads as inf) could not even be
    sent: a ValueError traceback. It is refused, naming the value."""
    path = tmp_path / "odd.sock"
    srv = _answering(path, b'{"v":1,"id":1,"ok":true,"result":{}}\n')
    try:
        code, out = run("--socket", str(path), "--timeout", "2", "cap", "set", "--gpu", "0", "--power-limit", value)
    finally:
        srv.close()
    assert code == 2 and "Traceback" not in out, out
    assert "finite" in out, out


@pytest.mark.parametrize(
    "args",
    [["jobs", "--store", "prom://[::1"], ["jobs", "--store", "http://h:abc"], ["report", "J", "--store", "http://[x"]],
)
def test_a_malformed_store_url_is_said_so_not_a_traceback(args: list[str]) -> None:
    code, out = run(*args)
    assert code == 2 and "Traceback" not in out and "error:" in out, out


def test_a_refusal_of_the_whole_request_without_an_id_is_its_answer(tmp_path: Path) -> None:
    """The daemon answers a request too large, or a server full, without an id: that is the
    request's answer at once (it was waited for until the timeout, then 'no answer')."""
    path = tmp_path / "full.sock"
    srv = _answering(path, b'{"v":1,"ok":false,"error":{"code":"unavailable","message":"too many connections"}}\n')
    try:
        code, out = run("--socket", str(path), "--timeout", "5", "status")
    finally:
        srv.close()
    assert code == 2 and "too many connections [unavailable]" in out, out


def test_restore_from_a_state_dir_that_is_not_there_is_named(tmp_path: Path) -> None:
    """`greend restore --state-dir /mistyped` said "nothing to restore", rc 0: after a crash
    the caps stayed, looking restored. The default dir missing (a daemon that never
    started: the unit's ExecStopPost) is still nothing to restore."""
    from typer.testing import CliRunner

    from greend.cli import greend_cmd

    r = CliRunner().invoke(greend_cmd.daemon_app, ["restore", "--state-dir", str(tmp_path / "typo")])
    assert r.exit_code == 2 and "no state dir at" in r.output and "give the --state-dir greend ran with" in r.output
    (tmp_path / "state").mkdir()
    r = CliRunner().invoke(greend_cmd.daemon_app, ["restore", "--state-dir", str(tmp_path / "state")])
    assert r.exit_code == 0, r.output


def _stored_jobs(db: Path, rows: list[tuple[str, str, float, dict[str, Any]]], run_tag: str | None = None) -> Path:
    """A SQLite store at ``db`` holding one ``greend_job`` row per (host, job, seconds ago,
    summary), each tagged ``run_tag`` where given (as the daemon tags a job's rows)."""
    import time

    from greend.points import job_point
    from greend.stores.sqlite import SqliteStore

    now = time.time()
    points = [job_point(int((now - ago) * 1e9), host, job=job, precision="bf16", end_reason="finished",
                        summary=summary) for host, job, ago, summary in rows]  # fmt: skip
    if run_tag is not None:
        for p in points:
            p.tags["run"] = run_tag
    store = SqliteStore(db)
    store.write(points)
    assert store.flush(5)
    store.close()
    return db


def test_jobs_since_is_checked_and_applies_to_a_store_file_too(tmp_path: Path) -> None:
    """``--since`` was read only with a shared store: ``greenctl jobs --store X.db --since
    bogus`` exited 0 and listed everything. A bad value is refused by name, and a good one
    keeps the ended jobs that ended within it."""
    db = _stored_jobs(
        tmp_path / "g.db", [("n", job, ago, {"steps": 10}) for job, ago in (("old", 7200.0), ("new", 60.0))]
    )
    common = ("--socket", str(tmp_path / "none.sock"), "jobs", "--store", str(db), "--json")
    code, out = run(*common, "--since", "bogus")
    assert code == 2 and "--since: not a duration: 'bogus'" in out, out
    code, out = run(*common, "--since", "1h")
    assert code == 0 and [j["job"] for j in json.loads(out[out.index("{") :])["jobs"]] == ["new"], out
    code, out = run(*common)
    assert code == 0 and sorted(j["job"] for j in json.loads(out[out.index("{") :])["jobs"]) == ["new", "old"], out


def test_report_from_one_file_the_nodes_share_is_the_whole_job(tmp_path: Path) -> None:
    """Two nodes' daemons writing one shared SQLite file: ``report --store shared.db`` took
    the single-node path and showed one node's share as the job, with the other node's
    row as an earlier run. It sums the nodes, as ``--store A.db --store B.db`` does."""
    each = {"steps": 80, "world_size": 2, "ranks_here": 1, "gpu_energy_j": 8000.0, "flops": 8e13, "duration_s": 10.0}
    db = _stored_jobs(tmp_path / "shared.db", [("na", "j", 5.0, each), ("nb", "j", 4.0, each)], run_tag="r1")
    code, out = run("--socket", str(tmp_path / "none.sock"), "report", "j", "--store", str(db), "--json")
    assert code == 0, out
    whole = json.loads(out[out.index("{") :])
    assert [n["host"] for n in whole["nodes"]] == ["na", "nb"], whole
    assert whole["steps"] == 80 and whole["gpu_energy_j"] == 16000.0 and whole["complete"] is True, whole
    code, out = run("--socket", str(tmp_path / "none.sock"), "report", "j", "--store", f"sqlite:///{db}", "--json")
    assert code == 0 and json.loads(out[out.index("{") :])["steps"] == 80, out
    from greend.jobs.history import one_file_of_many_nodes

    assert not one_file_of_many_nodes(db, "other") and not one_file_of_many_nodes(tmp_path / "none.db", "j")


def test_a_node_whose_daemon_lost_steps_makes_the_whole_job_partial(tmp_path: Path) -> None:
    """A node's daemon killed mid-job: its own report said 212 steps were in no record,
    the whole-job report summed the rest and called itself complete. It names the node
    and the steps, and is partial."""
    rows = (("na", 600, 0, 5.0), ("nb", 388, 212, 4.0))  # nb's daemon killed after 212 steps: no row of them
    db = _stored_jobs(tmp_path / "shared.db", [(host, "j", ago, {"steps": steps, "world_size": 2, "ranks_here": 1,
                      "sent_before": before, "gpu_energy_j": float(steps), "duration_s": 10.0})
                      for host, steps, before, ago in rows], run_tag="r1")  # fmt: skip
    code, out = run("--socket", str(tmp_path / "none.sock"), "report", "j", "--store", str(db), "--json")
    whole = json.loads(out[out.index("{") :])
    assert code == 0 and whole["complete"] is False, whole
    assert whole["missing"] == ["nb: 212 steps its ranks sent are in no record of it"], whole
    code, out = run("--socket", str(tmp_path / "none.sock"), "report", "j", "--store", str(db))
    assert code == 0 and "partial          nb: 212 steps its ranks sent are in no record of it" in out, out


def test_a_whole_job_with_no_figures_in_the_stores_is_not_called_complete(tmp_path: Path) -> None:
    """A Prometheus query API that is no Prometheus scraping greend (victoria-metrics behind
    prom://) matched the job's rank counts and none of its figures: steps 0, FLOPs 0, 0 J,
    "complete". A whole job with no steps, FLOPs or energy in the stores is partial."""
    ranks_only = {"world_size": 2, "ranks_here": 1}
    db = _stored_jobs(
        tmp_path / "shared.db", [("na", "j", 5.0, ranks_only), ("nb", "j", 4.0, ranks_only)], run_tag="r1"
    )
    code, out = run("--socket", str(tmp_path / "none.sock"), "report", "j", "--store", str(db), "--json")
    whole = json.loads(out[out.index("{") :])
    assert code == 0 and whole["complete"] is False, whole
    assert whole["missing"] == ["these stores hold no steps, FLOPs or energy of the job"], whole


def test_a_report_from_the_store_says_what_the_live_one_said(tmp_path: Path) -> None:
    """Read back from a store file, a job on a node without RAPL said "CPU energy 0.0 J
    (stored)" where its live report said "not measured", "64 step reports from 0 rank(s)",
    and no average GPU power or FLOP rate, though the row holds what they come from."""
    summary = {"steps": 64, "ranks_here": 2, "world_size": 2, "flops": 6.4e13, "duration_s": 8.0,
               "gpu_energy_j": 1600.0, "cpu_energy_j": 0.0, "cpu_energy_method": "unmeasured",
               "energy_j": 1600.0}  # fmt: skip
    db = _stored_jobs(tmp_path / "g.db", [("n", "cpu-less", 5.0, summary)])
    code, out = run("--socket", str(tmp_path / "none.sock"), "report", "cpu-less", "--store", str(db))
    assert code == 0, out
    assert "CPU energy       not measured" in out and "64 step reports from 2 rank(s)" in out, out
    assert "avg 200.0 W" in out and "8e+12 FLOP/s" in out, out
    measured = dict(summary, cpu_energy_j=120.0, cpu_energy_method="rapl", energy_j=1720.0)
    db2 = _stored_jobs(tmp_path / "g2.db", [("n", "with-cpu", 5.0, measured)])
    code, out = run("--socket", str(tmp_path / "none.sock"), "report", "with-cpu", "--store", str(db2))
    assert code == 0 and "CPU energy       120.0 J   (stored)" in out and "(with CPU: 37.209)" in out, out


def test_the_whole_job_from_two_nodes_stores_tells_its_level_and_its_moves(tmp_path: Path) -> None:
    """Two nodes' stores of a 2-rank job that went to fp8 and rolled back: the whole-job
    report had no level and none of the moves (the single-store report had them). It says
    the level each node ended at and the moves, one line a move however many nodes logged
    it; a move of an earlier run of the id is not this run's."""
    import time

    from greend.points import decision_point
    from greend.stores.sqlite import SqliteStore

    each = {"steps": 80, "world_size": 2, "ranks_here": 1, "gpu_energy_j": 8000.0, "flops": 8e13, "duration_s": 10.0}
    dbs = []
    for host in ("na", "nb"):
        db = _stored_jobs(tmp_path / f"{host}.db", [(host, "j", 1.0, each)], run_tag="r1")
        now = int((time.time() - 5.0) * 1e9)
        moves = [("switch", "fp8", 200, "r1", "loss stable"), ("rollback", "bf16", 640, "r1", "probes: +9 %"),
                 ("rollback", "bf16", 90, "r0", "an earlier run's")]  # fmt: skip
        points = []
        for k, (kind, level, step, run_tag, why) in enumerate(moves):
            p = decision_point(now + k, host, kind=kind, reason=why, policy="callback", job="j", precision=level,
                               fields={"step": step})  # fmt: skip
            p.tags["run"] = run_tag
            points.append(p)
        store = SqliteStore(db)
        store.write(points)
        assert store.flush(5)
        store.close()
        dbs.append(db)
    args = ("--socket", str(tmp_path / "none.sock"), "report", "j", "--store", str(dbs[0]), "--store", str(dbs[1]))
    code, out = run(*args, "--json")
    whole = json.loads(out[out.index("{") :])
    assert [(m["kind"], m["to"], m["step"], m["hosts"]) for m in whole["precision_log"]] == [
        ("switch", "fp8", 200, ["na", "nb"]),
        ("rollback", "bf16", 640, ["na", "nb"]),
    ], whole["precision_log"]
    code, out = run(*args)
    assert code == 0 and "precision        bf16  (at the end, over the nodes)" in out, out
    assert "step 640     rollback -> bf16  (na, nb): probes: +9 %" in out, out
