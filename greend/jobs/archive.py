"""Ended jobs' reports, kept by the daemon across its restarts and served through it.

When a job ends the daemon writes the report it would give live (figures, labels such as
``gpu_source``, the baseline and the saving, the decisions, the thinned series a plot
draws) to ``<state_dir>/jobs/``, one JSON file per run, mode 0600. After a restart the
``report`` op answers from there for a job the daemon no longer holds, and ``jobs``
lists the latest ended runs, so history reads the same before and after a restart for
everyone who may use the socket, while the files (like ``greend.db``) stay readable by
greend's uid only. At most ``keep`` runs are kept: past that, the oldest run of the uid
that holds the most goes, so one user's churn of jobs never evicts another user's history.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

from greend.fsutil import write_atomic
from greend.jobs.parts import join_reports, runs_of

__all__ = ["ARCHIVE_DIR", "JobArchive", "evict_fairly"]

log = logging.getLogger(__name__)

ARCHIVE_DIR = "jobs"
# <ended ns>-u<uid>-<job>-<run>.json, '-' quoted in the job and the run (older files: no uid,
# '-' unquoted).
_NAME = re.compile(r"\A(\d{20})-u(\d+)-([^-]*)-([^-]*)\.json\Z")

T = TypeVar("T")


def evict_fairly(items: list[T], owner: Callable[[T], Hashable], n: int) -> list[T]:
    """The ``n`` items to drop from ``items`` (oldest first): each time, the oldest of the
    owner that holds the most, so that one owner's churn evicts only its own."""
    by: dict[Hashable, list[T]] = {}
    for item in items:
        by.setdefault(owner(item), []).append(item)
    out: list[T] = []
    for _ in range(max(0, min(n, len(items)))):
        most = max(by.values(), key=len)
        out.append(most.pop(0))
    return out


def _quote(text: str) -> str:
    return quote(text, safe="").replace("-", "%2D")


class JobArchive:
    """``<state_dir>/jobs/<ended ns>-<job, quoted>-<run>.json``: ``{"row": the job's
    row in ``jobs``, "report": its report with its series}``."""

    def __init__(self, directory: Path | Callable[[], Path], *, keep: int = 1000, shown: Path | None = None) -> None:
        """``directory``: the folder, or what gives it at each use (the daemon's: through
        the state dir's held descriptor, so a state dir swapped after start is not
        followed); ``shown``: the folder as a person knows it, in messages."""
        self._where = directory
        self._shown = shown
        self.keep = keep
        self._rows: dict[str, dict[str, Any] | None] = {}  # file name -> its row (the files never change)

    @property
    def dir(self) -> Path:
        where = self._where
        return Path(where() if callable(where) else where)

    def save(self, row: dict[str, Any], report: dict[str, Any], ended_ns: int) -> None:
        """Write one ended run (never raises: a full disk costs history, not the tick)."""
        uid = row.get("uid")
        name = (
            f"{ended_ns:020d}-u{uid if isinstance(uid, int) and uid >= 0 else 0}-"
            f"{_quote(str(row['job']))}-{_quote(str(row.get('run_id') or ''))}.json"
        )
        try:
            self.dir.mkdir(mode=0o700, exist_ok=True)
            doc = json.dumps({"row": row, "report": report}, allow_nan=False, default=str)
            write_atomic(self.dir / name, doc, mode=0o600, exact_mode=True, durable=False)
            files = self._files()
            for old in evict_fairly(files, _owner, len(files) - self.keep):
                (self.dir / old).unlink(missing_ok=True)
                self._rows.pop(old, None)
        except (OSError, ValueError, TypeError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror and self._shown else e  # (its path: the fd's)
            log.warning("cannot keep job %s's report in %s: %s (its history after a restart is the store's)",
                        row.get("job"), self._shown or self.dir, why)  # fmt: skip

    def _files(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.dir) if n.endswith(".json") and not n.startswith("."))
        except OSError:
            return []

    def _read(self, name: str) -> dict[str, Any] | None:
        try:
            fd = os.open(self.dir / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as fh:
                doc = json.loads(fh.read())
            return doc if isinstance(doc, dict) else None
        except (OSError, ValueError) as e:
            log.warning("skipping %s: %s", (self._shown or self.dir) / name, e)
            return None

    def runs(self, job: str) -> list[dict[str, Any]]:
        """Every kept run of ``job``, oldest first (only its own files are read)."""
        mine, tag = _quote(job), f"-{quote(job, safe='')}-"
        out = []
        for name in self._files():
            m = _NAME.match(name)
            if (m.group(3) == mine) if m else (tag in name):
                doc = self._read(name)
                if doc is not None and doc.get("row", {}).get("job") == job:
                    out.append(doc)
        return out

    def report(self, job: str) -> dict[str, Any] | None:
        """The latest kept run's report, as the daemon gave it when the run ended: its
        parts joined where the daemon restarted under it (:mod:`greend.jobs.parts`)."""
        runs = runs_of(_ended(doc) for doc in self.runs(job))
        if not runs:
            return None
        rep = join_reports(runs[-1])
        rep["earlier_runs"] = len(runs) - 1
        rep["from_history"] = True  # the daemon's archive, not its live table
        return rep

    def with_parts(self, report: dict[str, Any]) -> dict[str, Any]:
        """``report`` (the record the daemon holds now) joined with the kept parts of its
        run that came before it: the run's life before the daemon restarted under it."""
        job, started = report.get("job"), report.get("started_at")
        if not report.get("run_id") or not isinstance(job, str) or not isinstance(started, (int, float)):
            return join_reports([report])
        before = [_ended(doc) for doc in self.runs(job) if (doc["report"].get("started_at") or 0.0) < started]
        run = runs_of([*before, report])[-1]
        return join_reports(run if run[-1] is report else [report])

    def rows(self, limit: int = 200) -> list[dict[str, Any]]:
        """The latest ``limit`` ended runs' rows, oldest first."""
        out = []
        files = self._files()
        cache = self._rows  # (several request threads at once: entries only set or popped)
        for gone in set(cache) - set(files):
            cache.pop(gone, None)
        for name in files[-limit:]:
            if name in cache:
                row = cache.get(name)
            else:
                doc = self._read(name)
                row = doc.get("row") if doc is not None else None
                row = cache[name] = row if isinstance(row, dict) else None
            if row is not None:
                out.append({**row, "from_history": True})
        return out


def _owner(name: str) -> str:
    """Whose run a file is, from its name (an older file's: not known)."""
    m = _NAME.match(name)
    return m.group(2) if m else ""


def _ended(doc: dict[str, Any]) -> dict[str, Any]:
    """A kept run's report with its row's end time (``ended_at``: the seconds between it and
    a later part of its run are none of the figures; greend.jobs.parts)."""
    ended = (doc.get("row") or {}).get("ended_at")
    return doc["report"] if ended is None else {**doc["report"], "ended_at": ended}
