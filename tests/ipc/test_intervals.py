"""Steps summed at the source ("intervals" rows) against one entry per step ("steps",
what older clients send): the daemon books both alike, a bad row is refused by name,
and the callback sends rows to a daemon that offers them and steps to one that does not."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from greend.daemon.core import Daemon
from greend.ipc.client import Client
from greend.ipc.server import encode
from greend.jobs.report import ROW_FIELDS
from greend.training.rows import Row as _Row
from tests.daemon.test_daemon import make_config
from tests.support import wait_for


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    cfg = make_config(tmp_path, hz=20.0, sim_gpus=2)
    d = Daemon(cfg)
    d.start()
    t = threading.Thread(target=d.run, daemon=True)
    t.start()
    assert wait_for(lambda: d.ledger.last_time("gpu1") is not None, 5)
    try:
        yield d
    finally:
        d.stop()
        t.join(5)
        d.close()


class Raw:
    """A client on the raw socket: register, then fire-and-forget messages."""

    def __init__(self, path: Path, job: str, gpu: int, precisions: list[str]) -> None:
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.connect(str(path))
        self.buf = b""
        self.register = self.ask({"v": 1, "id": 1, "op": "register", "job": job, "gpus": [gpu],
                                  "precisions": precisions})  # fmt: skip

    def send(self, msg: dict[str, Any]) -> None:
        self.s.sendall(encode(msg))

    def ask(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.s.sendall(encode(msg))
        return self.read()

    def read(self) -> dict[str, Any]:
        while b"\n" not in self.buf:
            chunk = self.s.recv(65536)
            assert chunk, "the daemon closed the connection"
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        self.s.close()


def records(n: int, seed: int) -> list[tuple[Any, ...]]:
    """n step records as the training thread queues them (index, t0, t1, flops, samples,
    tokens, loss, nonfinite, precision): uneven times, a noisy loss, two non-finite
    steps, a precision change at 60 %, ending just now."""
    rng = random.Random(seed)
    out = []
    t = time.monotonic() - n * 0.002  # (well within the 30 s a rank's first rows are modelled over)
    for i in range(n):
        d = rng.uniform(0.001, 0.002)
        nonfinite = i in (17, 1203)
        loss = None if nonfinite else 2.0 * (0.999**i) + rng.gauss(0, 0.05)
        out.append((i, t, t + d, 3e10 * rng.uniform(0.9, 1.1), 64, 0, loss, nonfinite,
                    "fp32" if i < 0.6 * n else "bf16"))  # fmt: skip
        t += d + 0.0005
    return out


def as_rows(recs: list[tuple[Any, ...]], keep_losses: bool, per_row: int) -> list[dict[str, Any]]:
    """The sender's own aggregation (_Row), in rows of at most per_row steps."""
    rows: list[dict[str, Any]] = []
    row: _Row | None = None
    for r in recs:
        if row is not None and (row.precision != r[8] or row.steps >= per_row):
            rows.append(row.fields())
            row = None
        if row is None:
            row = _Row(r, keep_losses)
        else:
            row.add(r)
    assert row is not None
    return [*rows, row.fields()]


def test_rows_give_the_same_report_as_steps_within_half_a_pct(daemon: Daemon) -> None:
    """The same 3000 steps, one entry per step on GPU 0 and summed in rows on GPU 1:
    FLOPs, steps, samples, losses, non-finite steps and the simulated energy agree;
    GPU energy and GFLOPS/W from the ledger within 0.5 % (0.1 % or less on an idle
    machine; a CI run read 0.18 %: the two GPUs' ledger readings around the spans' ends
    fall at different moments of the sampling loop)."""

    # The simulated GPUs run the steps when they are booked, after they ended: the ledger
    # prices the jobs' spans at what it read by then. So the spans end once it has read a
    # second of both GPUs, and nothing is sent until it has read both after the spans'
    # end: a booking landing between the two readings around that end would price the
    # two jobs apart (as it did on a loaded machine, by 2 %).
    def read_a_second() -> bool:
        now = time.monotonic()
        return all(daemon.ledger.energy_between(f"gpu{g}", now - 1.0, now) is not None for g in (0, 1))

    assert wait_for(read_a_second, 10)
    recs = records(3000, seed=1)
    end = recs[-1][2]
    assert wait_for(lambda: all((daemon.ledger.last_time(f"gpu{g}") or 0.0) > end for g in (0, 1)), 5)
    path = daemon.cfg.daemon.socket
    a = Raw(path, "per-step", 0, ["fp32", "bf16"])
    b = Raw(path, "rows", 1, ["fp32", "bf16"])
    assert b.register["result"]["report"] == "intervals" and b.register["result"]["rows_every_s"] == 0.5
    from greend.training.sender import step_fields

    for k in range(0, len(recs), 500):  # as two clients would, at the same time
        chunk = recs[k : k + 500]
        for j in range(0, len(chunk), 250):
            a.send({"v": 1, "op": "steps", "steps": [step_fields(r) for r in chunk[j : j + 250]]})
        b.send({"v": 1, "op": "intervals", "rows": as_rows(chunk, True, 100)})
    time.sleep(0.3)  # a tick after the last step
    for c in (a, b):  # a reply after the last report: the daemon has booked everything sent before
        assert c.ask({"v": 1, "id": 3, "op": "heartbeat"})["ok"] is True
    # The jobs' losses as the precision policy reads them: the same, step by step (read
    # before the jobs end, which clears them).
    ja, jb = daemon.jobs.jobs["per-step"], daemon.jobs.jobs["rows"]
    assert len(ja.losses) == ja.losses.maxlen and list(jb.losses) == pytest.approx(list(ja.losses))
    reps = []
    for c in (a, b):
        assert c.ask({"v": 1, "id": 2, "op": "end", "reason": "finished"})["ok"] is True
        c.close()
    with Client(path) as cl:
        for job in ("per-step", "rows"):
            reps.append(cl.request("report", job=job))
    steps, rows = reps
    for key in ("steps", "step_reports", "samples", "nonfinite_steps"):
        assert rows[key] == steps[key], key
    assert rows["steps"] == 3000 and rows["nonfinite_steps"] == 2
    assert rows["flops"] == pytest.approx(steps["flops"], rel=1e-12)
    assert rows["last_loss"] == pytest.approx(steps["last_loss"], rel=1e-12)
    assert rows["gpu_energy_j"] == pytest.approx(steps["gpu_energy_j"], rel=5e-3)
    assert rows["gflops_per_w"] == pytest.approx(steps["gflops_per_w"], rel=5e-3)
    sr, ss = rows["savings"], steps["savings"]
    assert sr["baseline"]["steps"] == ss["baseline"]["steps"] > 0
    # The saving is the simulated steps' (the same either way); the energy it is a share of,
    # and so the energy expected without greend, are the job's GPU energy from the ledger
    # (within 0.5 %, as above: a CI run read 0.13 %).
    assert sr["expected_gpu_energy_j"] == pytest.approx(ss["expected_gpu_energy_j"], rel=5e-3)
    assert sr["saved_j"] == pytest.approx(ss["saved_j"], rel=1e-9)
    assert sr["gpu_energy_j"] == pytest.approx(ss["gpu_energy_j"], rel=5e-3)


def test_a_jobs_row_is_its_reports_columns(daemon: Daemon) -> None:
    """``status`` and ``greenctl jobs`` list each job's row, computed apart from its report
    (a node's status lists every job): the same figures, while it runs and once it ended."""
    c = Raw(daemon.cfg.daemon.socket, "row", 0, ["fp32"])
    c.send({"v": 1, "op": "intervals", "rows": as_rows(records(300, seed=3), False, 100)})
    assert c.ask({"v": 1, "id": 2, "op": "heartbeat"})["ok"] is True
    time.sleep(0.3)  # a tick after the steps
    moving = ("duration_s", "gpu_energy_j", "energy_j", "gflops_per_w", "saved_pct")  # (ticks go on)

    def compare(final: bool) -> None:
        row = next(r for r in daemon.jobs.list_jobs() if r["job"] == "row")
        report = daemon.jobs.report(daemon.jobs.jobs["row"])
        assert set(row) == {*ROW_FIELDS, "ended_at"}
        for k in ROW_FIELDS:
            if final or k not in moving or report[k] is None:
                assert row[k] == report[k], k
            else:
                assert row[k] == pytest.approx(report[k], rel=0.05), k
        assert row["steps"] == 300 and row["gpu_energy_j"] > 0 and row["gpus"] == [0]

    compare(final=False)
    assert c.ask({"v": 1, "id": 3, "op": "end", "reason": "finished"})["ok"] is True
    c.close()
    assert wait_for(lambda: daemon.jobs.jobs["row"].state == "ended", timeout_s=10)
    compare(final=True)


def test_a_bad_row_is_refused_by_name_and_the_job_goes_on(daemon: Daemon) -> None:
    c = Raw(daemon.cfg.daemon.socket, "bad-rows", 0, ["fp32"])
    good = as_rows(records(10, seed=2), False, 100)[0]  # the 6 fp32 steps
    assert good["steps"] == 6
    cases = [
        ({"t1_s": good["t0_s"] - 1.0}, "rows[0].t1_s", "before"),
        ({"last_step": 0, "first_step": 5}, "rows[0].last_step", "before"),
        ({"loss_n": 7}, "rows[0].loss_n", "more than"),
        ({"losses": [1.0] * 7}, "rows[0].losses", "7 values"),
        ({"losses": [1.0, "x"]}, "rows[0].losses", "finite numbers"),
        ({"losses": [1.0, [2.0]]}, "rows[0].losses", "finite numbers"),
        ({"steps": 0}, "rows[0].steps", "minimum"),
        ({"busy_s": -1.0}, "rows[0].busy_s", "minimum"),
        ({"extra": 1}, "rows[0].extra", "unknown field"),
        ({"loss_sum": None}, "rows[0].loss_sum", "required"),
        ({"losses": [1.0, True]}, "rows[0].losses", "finite numbers"),
        ({"loss_n": 6, "loss_sum": 1e39}, "rows[0].loss_sum", "beyond"),
    ]
    for change, field, words in cases:
        row = {**good, **change}
        if change.get("loss_sum", 0) is None:
            del row["loss_sum"]
        r = c.ask({"v": 1, "id": 3, "op": "intervals", "rows": [row]})
        assert r["ok"] is False and r["error"]["field"] == field, (change, r)
        assert words in r["error"]["message"], (change, r)
    too_many = c.ask({"v": 1, "id": 4, "op": "intervals", "rows": [good] * 65})
    assert too_many["ok"] is False and "at most 64 rows" in too_many["error"]["message"]
    nan_row = json.dumps({**good, "losses": [1.0]}).replace('"losses": [1.0]', '"losses": [NaN]')
    c.s.sendall(b'{"v":1,"id":5,"op":"intervals","rows":[%s]}\n' % nan_row.encode())  # Python's json reads NaN
    r = c.read()
    assert r["ok"] is False and r["error"]["field"] == "rows[0].losses", r
    # Nothing of the refused rows was booked; a good row is.
    with Client(daemon.cfg.daemon.socket) as cl:
        assert cl.request("report", job="bad-rows")["steps"] == 0
        c.send({"v": 1, "op": "intervals", "rows": [good]})
        assert wait_for(lambda: cl.request("report", job="bad-rows")["steps"] == 6, 5)
    c.close()


def test_the_callback_sends_rows_to_this_daemon_and_steps_to_an_older_one(daemon: Daemon) -> None:
    torch = pytest.importorskip("torch")
    from greend import GreenCallback

    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cb = GreenCallback(job="cb-rows", model=model, socket=daemon.cfg.daemon.socket, gpus=[0],
                       flush_interval_s=0.05, precisions=["fp32"])  # fmt: skip
    t0 = time.monotonic()
    try:
        for _ in range(300):  # over 0.6 s or more: a message per flush would be 12 or more
            time.sleep(0.002)
            x = torch.randn(4, 8)
            with cb.step(samples=4, batch=x) as st:
                loss = model(x).pow(2).mean()
                st.backward(loss)
                st.optimizer_step(opt)
                opt.zero_grad()
        assert cb._sender is not None and cb._sender._form == "intervals"
    finally:
        cb.close()
    rep = Client(daemon.cfg.daemon.socket).request("report", job="cb-rows")
    assert rep["steps"] == 300 and rep["samples"] == 1200 and rep["last_loss"] is not None
    # Rows every rows_every_s (0.5 s at this daemon's settings), not a line per step nor
    # one per flush_interval_s (0.05 s): register, the rows, end (and maybe a heartbeat).
    span = time.monotonic() - t0
    assert cb.stats.sent == 300
    assert cb.stats.messages <= span / 0.5 + 4, (cb.stats.messages, span)


def test_a_job_that_names_no_gpus_on_a_node_with_gpus_is_told_so(daemon: Daemon) -> None:
    """The README's loop on the CPU against `greend run --sim 1`, without gpus=: the report
    had no GPU figures and nothing said why. The register reply says so, and the callback
    warns once (a GreendWarning: the training goes on); a job that names its GPU is not told."""
    torch = pytest.importorskip("torch")
    from greend import GreenCallback
    from greend.errors import GreendWarning

    model = torch.nn.Linear(8, 1)
    for gpus, told in ((None, True), ([0], False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with GreenCallback(job=f"cpu-{told}", model=model, socket=daemon.cfg.daemon.socket, gpus=gpus) as cb:
                with cb.step(samples=4):
                    model(torch.randn(4, 8)).sum().backward()
                cb.flush()
                assert wait_for(lambda: cb.stats.connects == 1)
        said = [str(w.message) for w in caught if issubclass(w.category, GreendWarning)]
        assert any("registered no GPUs" in m and "gpus=[...]" in m for m in said) == told, said


def test_an_old_daemon_gets_steps(tmp_path: Path) -> None:
    """A daemon whose register reply does not offer "intervals" (an older greend) gets
    one "steps" entry per step from the callback."""
    torch = pytest.importorskip("torch")
    from greend import GreenCallback

    sock_path = tmp_path / "old.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(sock_path))
    srv.listen(1)
    got: list[dict[str, Any]] = []

    def serve() -> None:
        conn, _ = srv.accept()
        buf = b""
        while True:
            chunk = conn.recv(65536)
            if not chunk:
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = json.loads(line)
                got.append(msg)
                if "id" in msg:  # an older daemon's register reply: no "report" key
                    result = {"job": "old", "session": 1, "heartbeat_s": 5.0} if msg["op"] == "register" else {}
                    conn.sendall(encode({"v": 1, "id": msg["id"], "ok": True, "result": result}))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    model = torch.nn.Linear(4, 1)
    cb = GreenCallback(job="old", model=model, socket=sock_path, flush_interval_s=0.05)
    for _ in range(20):
        with cb.step(samples=2) as st:
            st.loss(model(torch.randn(2, 4)).sum())
    cb.close()
    ops = [m["op"] for m in got]
    assert "intervals" not in ops and "steps" in ops
    assert sum(len(m["steps"]) for m in got if m["op"] == "steps") == 20
    srv.close()


def test_a_rank_that_changes_level_every_row_makes_one_point_per_level_an_interval(daemon: Daemon) -> None:
    """64 one-step rows alternating fp32 and bf16 in one message: each row closed the
    rank's aggregate and became a store point (one unprivileged rank filled the store's
    queue, and the node's own points were dropped with its). Now one point per level per
    store interval."""
    seen: list[Any] = []
    emit = daemon.jobs.emit

    def spy(points: list[Any]) -> None:
        seen.extend(p for p in points if p.measurement == "greend_job_steps")
        emit(points)

    daemon.jobs.emit = spy  # type: ignore[method-assign]  # (the registry's hand-over to the stores, watched)
    c = Raw(daemon.cfg.daemon.socket, "flip", 0, ["fp32", "bf16"])
    recs = [(*r[:8], "fp32" if i % 2 else "bf16") for i, r in enumerate(records(64, seed=3))]
    rows = as_rows(recs, False, 64)
    assert len(rows) == 64
    c.send({"v": 1, "op": "intervals", "rows": rows})
    with Client(daemon.cfg.daemon.socket) as cl:
        assert wait_for(lambda: cl.request("report", job="flip")["steps"] == 64, 5)
    c.close()  # the rank leaves: its last interval's points are written
    assert wait_for(lambda: sum(p.fields["steps"] for p in seen) == 64, 5)
    assert len(seen) <= 4 and {p.tags["precision"] for p in seen} == {"fp32", "bf16"}, [p.tags for p in seen]


def test_a_row_asks_the_simulated_gpu_for_no_more_work_than_it_could_do_in_its_span(daemon: Daemon) -> None:
    """One unprivileged client's row of 1e24 FLOPs over a second (2**31 steps, each valid
    alone) made the simulated GPU's counter 4.4e12 J, for every job on it; one that claimed
    its work since boot (t0 0), 2.6e8 J, its device busy for days. The work a row asks is at
    most 1.5 times what the GPU could do at its peak over the row's span; the span is cut to the
    time since the rank's rows before it (its first rows: 30 s before now), so rows that
    each claim the same 600 s count them once."""
    before = daemon.ledger.total_j("gpu0")
    c = Raw(daemon.cfg.daemon.socket, "greedy", 0, ["fp32"])
    t = time.monotonic()

    def row(t0: float, t1: float) -> dict[str, object]:
        return {"first_step": 0, "last_step": 2**31 - 1, "steps": 2**31, "t0_s": t0, "t1_s": t1, "busy_s": 0.0,
                "busy_sq_s2": 0.0, "flops": 1e24, "precision": "fp32"}  # fmt: skip

    c.send({"v": 1, "op": "intervals", "rows": [row(0.0, t)]})
    c.send({"v": 1, "op": "intervals", "rows": [row(t - 600.0, t) for _ in range(64)]})
    assert c.ask({"v": 1, "id": 3, "op": "heartbeat"})["ok"] is True
    time.sleep(0.3)  # a tick after the rows
    # At most 45 s of the H100's fp32 peak (the first row's 30 s, 1.5 times), then nothing:
    # at half its peak less a memory share, a few minutes at its power (7.9e4 J measured
    # here), not 2.6e8 J.
    modelled = daemon.jobs.report(daemon.jobs.jobs["greedy"])["sim_energy_j"]
    assert 0 < modelled < 1.5e5, modelled
    assert daemon.ledger.total_j("gpu0") - before < 1.8e5
    c.close()


def test_rows_are_booked_when_the_simulated_gpus_cannot_write_their_files(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A full state dir: the simulated GPU's device file could not be written and every
    steps message was answered ``internal``. The rows are booked (steps, FLOPs), not
    modelled, and the failure logged once."""
    import errno

    gpu = daemon.probing.sim_gpu(0)

    def full(*a: object, **k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gpu, "attach_process", full)
    c = Raw(daemon.cfg.daemon.socket, "full-disk", 0, ["fp32"])
    with caplog.at_level("ERROR", logger="greend.daemon.probing"):
        for k in range(3):
            c.send({"v": 1, "op": "intervals", "rows": as_rows(records(100, seed=k), False, 100)})
        reply = c.ask({"v": 1, "id": 3, "op": "heartbeat"})  # (an error of a row's would be read first)
    assert reply["ok"] is True and reply["id"] == 3, reply
    job = daemon.jobs.jobs["full-disk"]
    assert job.steps == 300 and job.flops > 0
    assert len([r for r in caplog.records if "steps not modelled" in r.getMessage()]) == 1
    c.close()
