"""`greenctl jobs --all` beside a run the daemon restarted under: the store holds the part
before the restart, the daemon's live row already joins it (greend.jobs.parts)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import greend.cli.greenctl as greenctl
from greend.jobs.archive import JobArchive
from greend.jobs.ledger import Ledger
from greend.jobs.ops import JobOps
from greend.jobs.registry import JobRegistry
from greend.stores.sqlite import SqliteStore
from tests.jobs.test_ops import _Conn, _Peer, _row


def test_a_running_run_s_stored_part_is_listed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the run goes on after a restart, its part from before was listed twice: as
    the store's ended row and inside the daemon's joined running row (30 steps for 20)."""
    db = tmp_path / "greend.db"
    store = SqliteStore(db)
    archive = JobArchive(tmp_path / "jobs")
    now = time.time()
    t = [1000.0]

    def life(steps_before: int, first_step: int) -> tuple[JobRegistry, JobOps, _Conn]:
        reg = JobRegistry(Ledger(), hostname="h", monotonic=lambda: t[0], wall=lambda: now - 2000 + t[0])
        ops = JobOps(reg, archive)
        conn = _Conn(1, _Peer(pid=5, uid=1000))
        ops.handlers()["register"]({"job": "j", "run": "r1", "precisions": ["fp32"], "steps_before": steps_before},
                                   conn)  # fmt: skip
        for i in range(5):
            row = {**_row(t[0] - 10 + i, t[0] - 9.5 + i), "first_step": first_step + 2 * i,
                   "last_step": first_step + 2 * i + 1}  # fmt: skip
            ops.handlers()["intervals"]({"rows": [row]}, conn)
        return reg, ops, conn

    first, _, _ = life(0, 0)
    store.write(first.interrupt_all())  # the daemon stops: the first part (10 steps) stored
    store.flush(5.0)
    t[0] += 100
    _, ops, conn = life(10, 10)  # the restarted daemon: 10 more steps, running
    live: list[dict[str, Any]] = ops.handlers()["jobs"]({}, conn)["jobs"]
    assert [(r["job"], r["state"], r["steps"]) for r in live] == [("j", "running", 20)]
    monkeypatch.setattr(greenctl, "try_request", lambda op, **kw: {"jobs": live})
    out = CliRunner().invoke(greenctl.ctl_app, ["jobs", "--all", "--store", str(db), "--json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.stdout)["jobs"]
    assert [(r["job"], r["state"], r["steps"]) for r in rows] == [("j", "running", 20)]
    store.close()
