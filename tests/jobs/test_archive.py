"""The ended runs' archive (greend/jobs/archive.py): whose history one user's churn may
evict, and what a ``jobs`` request reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from greend.jobs.archive import JobArchive, evict_fairly
from greend.jobs.ledger import Ledger
from greend.jobs.ops import JobOps
from greend.jobs.registry import JobRegistry


def _save(archive: JobArchive, job: str, uid: int, t: int) -> None:
    row = {"job": job, "run_id": f"r-{job}", "uid": uid, "state": "ended"}
    archive.save(row, {"job": job, "steps": t}, t)


def test_one_user_s_churn_never_evicts_another_user_s_runs(tmp_path: Path) -> None:
    archive = JobArchive(tmp_path, keep=10)
    _save(archive, "victim-a", 1, 1)
    _save(archive, "victim-b", 1, 2)
    for k in range(50):
        _save(archive, f"churn-{k}", 65534, 10 + k)
    assert len(list(tmp_path.glob("*.json"))) == 10
    assert [d["row"]["job"] for d in archive.runs("victim-a")] == ["victim-a"]
    assert archive.report("victim-b") is not None
    kept = [r["job"] for r in archive.rows()]
    assert kept[:2] == ["victim-a", "victim-b"] and kept[2:] == [f"churn-{k}" for k in range(42, 50)]


def test_a_job_name_inside_another_s_is_not_its_run(tmp_path: Path) -> None:
    archive = JobArchive(tmp_path)
    _save(archive, "fat", 0, 1)
    _save(archive, "a-fat-1", 0, 2)
    assert [d["row"]["job"] for d in archive.runs("fat")] == ["fat"]
    assert [d["row"]["job"] for d in archive.runs("a-fat-1")] == ["a-fat-1"]


def test_rows_are_read_from_disk_once(tmp_path: Path, monkeypatch: Any) -> None:
    archive = JobArchive(tmp_path)
    for k in range(5):
        _save(archive, f"j{k}", 0, k)
    reads: list[str] = []
    real = archive._read

    def counted(name: str) -> Any:
        reads.append(name)
        return real(name)

    monkeypatch.setattr(archive, "_read", counted)
    assert len(archive.rows()) == 5 and len(reads) == 5
    assert len(archive.rows()) == 5 and len(reads) == 5  # (cached)
    _save(archive, "j5", 0, 9)
    assert [r["job"] for r in archive.rows()][-1] == "j5" and len(reads) == 6


def test_older_file_names_are_still_read(tmp_path: Path) -> None:
    """Files named before the uid was in the name (``<ns>-<job>-<run>.json``)."""
    doc = {"row": {"job": "old-job", "run_id": "r1", "uid": 5, "state": "ended"}, "report": {"job": "old-job"}}
    (tmp_path / f"{1:020d}-old-job-r1.json").write_text(json.dumps(doc))
    archive = JobArchive(tmp_path)
    assert [d["row"]["job"] for d in archive.runs("old-job")] == ["old-job"]
    assert [r["job"] for r in archive.rows()] == ["old-job"]


def test_evict_fairly_takes_from_whoever_holds_the_most() -> None:
    items = [("a", 1), ("b", 1), ("c", 2), ("d", 2), ("e", 2), ("f", 3)]
    assert evict_fairly(items, lambda i: i[1], 2) == [("c", 2), ("a", 1)]
    assert evict_fairly(items, lambda i: i[1], 0) == []


def test_the_daemon_keeps_ended_jobs_in_memory_fairly_too() -> None:
    from tests.jobs.test_ops import _Conn, _Peer

    t = [1000.0]
    ops = JobOps(JobRegistry(Ledger(), hostname="h", monotonic=lambda: t[0], wall=lambda: 1.7e9, keep_ended=5))
    h = ops.handlers()
    n = 0
    for uid, jobs in ((1, 2), (2, 20)):
        for k in range(jobs):
            n += 1
            conn = _Conn(n, _Peer(pid=n, uid=uid))
            h["register"]({"job": f"u{uid}-{k}"}, conn)
            h["end"]({"reason": "finished"}, conn)
            t[0] += 100.0
            ops.jobs.tick(t[0])  # (its window complete: ended)
    h["register"]({"job": "next"}, _Conn(99, _Peer(pid=99, uid=3)))  # (the ended are trimmed at a register)
    ended = [j for j in ops.jobs.jobs.values() if j.state == "ended"]
    assert len(ended) == 5
    assert sorted(j.job for j in ended if j.uid == 1) == ["u1-0", "u1-1"]


def test_a_user_over_the_quota_is_refused_before_the_owner_check() -> None:
    """The owner check may ask Slurm (a scontrol process each); a uid at its quota of jobs
    is refused first, for nothing."""
    from greend.jobs.registry import QuotaExceeded
    from tests.jobs.test_ops import _Conn, _Peer

    reg = JobRegistry(Ledger(), hostname="h", monotonic=lambda: 1000.0, wall=lambda: 1.7e9, max_jobs_per_uid=2)
    asked: list[str] = []
    reg.check_owner = lambda job, uid: asked.append(job)  # type: ignore[method-assign]  # records the calls only
    h = JobOps(reg).handlers()
    for k in range(2):
        h["register"]({"job": str(7000 + k)}, _Conn(k, _Peer(pid=k, uid=5)))
    assert asked == ["7000", "7001"]
    for k in range(2, 6):
        with pytest.raises(QuotaExceeded):
            h["register"]({"job": str(7000 + k)}, _Conn(k, _Peer(pid=k, uid=5)))
    assert asked == ["7000", "7001"]
    second_rank = {"job": "7000", "rank": 1, "world_size": 2}  # a second rank of a job it runs
    h["register"](second_rank, _Conn(9, _Peer(pid=9, uid=5)))
    assert asked[-1] == "7000"


def test_a_report_that_cannot_be_kept_names_the_folder_as_configured(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The daemon reaches its state dir through a held descriptor (/proc/self/fd/N): a full
    disk's warning named /proc/self/fd/3/jobs, a path no operator knows. It names the
    folder as configured."""
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the folder should be")
    archive = JobArchive(lambda: blocked / "jobs", shown=Path("/var/lib/greend/jobs"))
    with caplog.at_level("WARNING", logger="greend.jobs.archive"):
        archive.save({"job": "j", "run_id": "r", "uid": 0}, {"job": "j"}, 1)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "cannot keep job j's report in /var/lib/greend/jobs:" in line and "not-a-dir" not in line, line
