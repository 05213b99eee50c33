"""Run ids: every rank of one run shares one; a rerun or a reused job id gets another, and
the daemon never merges two runs, live or in the store."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from greend.daemon.core import Daemon
from greend.ipc.client import Client
from greend.ipc.server import encode
from tests.daemon.test_daemon import make_config
from tests.support import wait_for

torch = pytest.importorskip("torch")


def test_ranks_agree_on_the_run_through_the_rendezvous_store(monkeypatch: pytest.MonkeyPatch) -> None:
    from greend.training.identity import resolve_run

    for k in ("GREEND_RUN", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    store = torch.distributed.HashStore()  # torch's own store API, as the process group has it
    first, second = resolve_run("j", 2, store), resolve_run("j", 2, store)
    assert first == second and len(first) == 12
    assert resolve_run("j", 2, torch.distributed.HashStore()) != first  # another rendezvous: another run
    assert resolve_run("solo", 1) != resolve_run("solo", 1)  # a single process: a fresh id each run
    # Ranks without a store: a digest of what the launcher gave them all alike.
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert resolve_run("j", 2) == resolve_run("j", 2)
    monkeypatch.setenv("MASTER_PORT", "29501")
    assert resolve_run("j", 2) != first
    monkeypatch.setenv("GREEND_RUN", "nightly 2026/12/04")  # the launcher's own, made valid
    assert resolve_run("j", 2, store) == "nightly-2026-12-04"


def send_steps(c: Client, n: int, flops: float) -> None:
    now = time.monotonic()
    assert c._sock is not None
    steps = [
        {"step": i, "t0_s": now - 0.01 * (n - i), "t1_s": now - 0.01 * (n - i - 1), "flops": flops} for i in range(n)
    ]
    c._sock.sendall(encode({"v": 1, "op": "steps", "steps": steps}))


@contextlib.contextmanager
def running(tmp_path: Path, sim_gpus: int, store_interval_s: float | None = None) -> Iterator[Daemon]:
    """An in-process daemon with ``sim_gpus`` simulated GPUs, ticking in a thread (its
    store rows every ``store_interval_s``, default the config's)."""
    cfg = make_config(tmp_path, hz=20.0, sim_gpus=sim_gpus)
    if store_interval_s is not None:
        cfg.store.interval_s = store_interval_s
    d = Daemon(cfg)
    d.start()
    t = threading.Thread(target=d.run, daemon=True)
    t.start()
    try:
        yield d
    finally:
        d.stop()
        t.join(10)


def test_two_runs_under_one_job_id_are_never_merged(tmp_path: Path) -> None:
    """Two launches given one job id at once: the second run is booked as <id>.<run>, with
    its own steps; a rank of the first run joins the first. Every store row of a job is
    tagged with its run, and a rerun after the end is a fresh record with its own tag."""
    with running(tmp_path, 2, store_interval_s=0.25) as d:  # rows every 0.25 s: the last ones sooner
        cfg = d.cfg
        assert wait_for(lambda: d.ledger.last_time("gpu1") is not None, 5)
        with Client(cfg.daemon.socket) as a0, Client(cfg.daemon.socket) as a1, Client(cfg.daemon.socket) as b:
            ra = a0.request("register", job="exp", run="aaaa1111", gpus=[0], rank=0, world_size=2)
            assert ra["job"] == "exp" and ra["run"] == "aaaa1111"
            assert a1.request("register", job="exp", run="aaaa1111", gpus=[0], rank=1, world_size=2)["job"] == "exp"
            rb = b.request("register", job="exp", run="bbbb2222", gpus=[1])
            assert rb["job"] == "exp.bbbb2222" and rb["run"] == "bbbb2222"
            send_steps(a0, 10, 1e12)
            send_steps(a1, 10, 1e12)
            send_steps(b, 7, 1e12)
            assert wait_for(lambda: a0.request("report", job="exp")["steps"] == 10, 5)
            rep_b = b.request("report", job="exp.bbbb2222")
            assert rep_b["steps"] == 7 and rep_b["run_id"] == "bbbb2222" and rep_b["ranks"] == 1
            rep_a = a0.request("report", job="exp")
            assert rep_a["run_id"] == "aaaa1111" and rep_a["ranks"] == 2
            from greend.cli.render import render_report

            assert "  run aaaa1111" in render_report(rep_a).splitlines()[0]
            a0.request("end")
            a1.request("end")
            b.request("end")
        # A rerun of "exp" after its end: a fresh record (not resumed), another run tag.
        with Client(cfg.daemon.socket) as c:
            assert c.request("register", job="exp", run="cccc3333", gpus=[0])["run"] == "cccc3333"
            send_steps(c, 3, 1e12)
            assert wait_for(lambda: c.request("report", job="exp")["steps"] == 3, 5)
            c.request("end")
        time.sleep(cfg.store.interval_s + 0.5)  # the last rows written
    db = sqlite3.connect(tmp_path / "g.db")
    try:
        ended = db.execute("SELECT job, run, steps FROM greend_job ORDER BY ts_ns").fetchall()
        untagged = db.execute("SELECT COUNT(*) FROM greend_job_steps WHERE run IS NULL").fetchone()[0]
        runs = {r for (r,) in db.execute("SELECT DISTINCT run FROM greend_job_steps")}
    finally:
        db.close()
    assert sorted(ended) == sorted([("exp", "aaaa1111", 10), ("exp.bbbb2222", "bbbb2222", 7), ("exp", "cccc3333", 3)])
    assert untagged == 0 and runs == {"aaaa1111", "bbbb2222", "cccc3333"}


def test_a_bad_run_id_is_refused_by_name(tmp_path: Path) -> None:
    from greend.errors import GreendError

    with running(tmp_path, 1) as d, Client(d.cfg.daemon.socket) as c:
        with pytest.raises(GreendError, match="'run'"):
            c.request("register", job="x", run="no spaces")


def test_a_daemon_that_predates_run_ids_still_registers_the_job(
    monkeypatch: pytest.MonkeyPatch, sock_path: Path
) -> None:
    """An older daemon refuses register fields it does not know: the callback registers
    again without them and the job is reported, its run id unsent."""
    import greend.protocol as protocol
    from greend.testing.fake_daemon import FakeDaemon
    from greend.training.callback import GreenCallback
    from tests.training.test_precision import FAST

    old = {k: v for k, v in protocol.SCHEMAS["register"].items() if k not in ("run", "reference_every")}
    monkeypatch.setitem(protocol.SCHEMAS, "register", old)
    daemon = FakeDaemon(sock_path).start()
    try:
        with GreenCallback(job="older", socket=sock_path, **FAST) as cb:
            assert wait_for(lambda: cb.connected, 5)
            with cb.step(flops=1.0):
                pass
        assert [sorted(r) for r in daemon.registers] and all("run" not in r for r in daemon.registers)
        assert wait_for(lambda: len(daemon.steps) == 1, 5)
    finally:
        daemon.stop()
