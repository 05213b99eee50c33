"""The jobs' socket ops: ``register``, ``intervals``, ``steps``, ``heartbeat``, ``pace``,
``precision_event`` and ``end`` (a training process, one connection per rank), and
``jobs`` and ``report`` (anyone). Their schemas are in :mod:`greend.protocol`, the wire
format in ``docs/protocol.md``; the daemon routes them (:mod:`greend.daemon.routes`).

This is the only jobs code that knows connections and message dicts: each message is
decoded once here into the typed values of :mod:`greend.protocol` (a
:class:`~greend.protocol.Registration`, :class:`~greend.protocol.StepsRow` rows, ...)
and the connection into a :class:`~greend.jobs.records.Caller`, and the registry is
called with those. A connection comes in as anything shaped like
:class:`JobConnection` (the IPC server's connections are).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from greend.errors import ProtocolError
from greend.jobs.archive import JobArchive
from greend.jobs.parts import join_rows, runs_of
from greend.jobs.records import Caller, Job
from greend.jobs.registry import JobRegistry
from greend.jobs.report import ROW_FIELDS
from greend.protocol import (
    decode_precision_event,
    decode_register,
    decode_rows,
    decode_steps,
)

__all__ = ["FUTURE_SLACK_S", "JobConnection", "JobHandler", "JobOps", "PeerCredentials"]

FUTURE_SLACK_S = 1.0  # a reported step may end at most this far past the daemon's now


class PeerCredentials(Protocol):
    """Who is on the other end of a connection, from the kernel (SO_PEERCRED)."""

    @property
    def pid(self) -> int: ...

    @property
    def uid(self) -> int: ...


class JobConnection(Protocol):
    """What the job ops use of a connection: its id (a rank's session), its peer, the
    server's per-connection notes (``_admin``: the peer passed the admin check) and a
    way to push events to the peer."""

    @property
    def id(self) -> int: ...

    @property
    def peer(self) -> PeerCredentials: ...

    @property
    def state(self) -> dict[str, Any]: ...

    def send(self, obj: dict[str, Any], timeout_s: float = ...) -> bool: ...


JobHandler = Callable[[dict[str, Any], JobConnection], Any]


class JobOps:
    """The socket ops of one :class:`JobRegistry`.

    ``steps`` and ``intervals`` are fire-and-forget: their handlers return None and the
    router sends no reply (:attr:`SILENT`) unless the message is refused. A per-user
    limit refuses with :class:`~greend.jobs.registry.QuotaExceeded`."""

    SILENT = frozenset({"steps", "intervals"})

    def __init__(
        self,
        jobs: JobRegistry,
        archive: JobArchive | None = None,
        precision_tolerance: Callable[[], float | None] | None = None,
    ) -> None:
        self.jobs = jobs
        self.archive = archive  # ended runs kept across restarts (history for everyone)
        # The precision policy's tolerance, told to each rank at registration (its probes
        # judge a level against it); None: no precision policy runs.
        self.precision_tolerance = precision_tolerance
        if archive is not None:
            jobs.on_job_end.append(self._keep)

    def handlers(self) -> dict[str, JobHandler]:
        return {
            "register": self.register,
            "steps": self.steps,
            "intervals": self.intervals,
            "heartbeat": self.heartbeat,
            "end": self.end,
            "jobs": self.list_jobs,
            "report": self.report,
            "pace": self.pace,
            "precision_event": self.precision_event,
        }

    @staticmethod
    def caller(conn: JobConnection) -> Caller:
        """The connection as the registry knows a caller."""
        return Caller(
            session=conn.id,
            pid=conn.peer.pid,
            uid=conn.peer.uid,
            admin=bool(conn.state.get("_admin")),
            channel=conn,
        )

    def registered(self, conn: JobConnection) -> bool:
        """The connection registered a rank that is still there (the server does not
        close it for idleness: its heartbeats are the registry's to judge)."""
        return self.jobs.has_session(conn.id)

    def disconnected(self, conn: JobConnection) -> None:
        self.jobs.disconnected(conn.id)

    # The ops -------------------------------------------------------------------------
    def register(self, msg: dict[str, Any], conn: JobConnection) -> dict[str, Any]:
        reg = decode_register(msg)
        booked = self.jobs.register(reg, self.caller(conn))
        reply: dict[str, Any] = {
            "job": booked.job,
            "run": booked.run,
            "session": conn.id,
            "heartbeat_s": max(0.5, self.jobs.heartbeat_timeout_s / 3.0),
            # How to send steps: rows summed at the source, or (with [store]
            # step_detail, which stores each step) one entry per step.
            "report": "steps" if self.jobs.step_detail else "intervals",
            "rows_every_s": self.jobs.rows_every_s,
        }
        tolerance = self.precision_tolerance() if self.precision_tolerance is not None else None
        # The level asked, else the one in force (a new job: its own). Not to a rank that ran
        # before this record began (a daemon restarted under the run) while a precision policy
        # runs here: the record knows no level but the job's own, and the rank keeps the one
        # it runs (its rows tell the record; as the job's own level asked, a job taken below
        # it went back up, and its ranks read that as a rollback). No policy: its own level.
        if booked.precision is not None and (booked.known or tolerance is None):
            reply["directive"] = {"precision": booked.precision}
        if tolerance is not None:
            reply["precision_tolerance"] = tolerance
        # This node's pace for the job as last pushed (null: none yet): a rank that joins late,
        # or comes back to a restarted daemon, writes no pace this daemon did not measure.
        reply["local_pace"] = booked.local_pace
        here = self.jobs.gpu_indices() if not reg.gpus and reg.kind == "training" else None
        if here:  # (the callback warns with it: a report with no GPU figures, and nothing said why)
            reply["warning"] = (
                f"job {booked.job} registered no GPUs (torch saw no CUDA device it could name, and no gpus= was "
                f"given), so its report has no GPU figures; this node has GPU(s) {sorted(here)}: pass "
                "GreenCallback(..., gpus=[...])"
            )
        return reply

    # Two forms reach one booking path: "intervals" rows, a rank's steps summed at the
    # source (what the callback sends), and the older per-step "steps" entries, each
    # booked as a row of one step (old clients, and the callback when [store]
    # step_detail asks for a row per step). Nothing of a message with a bad entry is
    # booked, nor of one that ends in the future.
    def intervals(self, msg: dict[str, Any], conn: JobConnection) -> None:
        rows = decode_rows(msg["rows"])
        self._not_future("rows", (r.t1_s for r in rows))
        self.jobs.book(conn.id, rows)

    def steps(self, msg: dict[str, Any], conn: JobConnection) -> None:
        steps = decode_steps(msg["steps"])
        self._not_future("steps", (s.t1_s for s in steps))
        self.jobs.book(conn.id, [s.as_row() for s in steps], detail=steps)

    def _not_future(self, name: str, ends_s: Iterable[float]) -> None:
        """Refuse a message whose ``name`` entries end (``ends_s``) in the future."""
        now = self.jobs.monotonic()
        for i, t1_s in enumerate(ends_s):
            if t1_s > now + FUTURE_SLACK_S:
                raise ProtocolError(
                    f"{name}[{i}]: t1_s = {t1_s} is in the future (send time.monotonic() seconds)",
                    field=f"{name}[{i}].t1_s",
                )

    def heartbeat(self, msg: dict[str, Any], conn: JobConnection) -> dict[str, Any]:
        self.jobs.heartbeat(conn.id)
        return {"ok": True}

    def pace(self, msg: dict[str, Any], conn: JobConnection) -> dict[str, Any]:
        """The ranks agreed on the job's pace (the slowest node's uncapped step time), floor
        and latest re-check asked."""
        floor = msg.get("floor_s")
        self.jobs.pace(
            conn.id, float(msg["step_s"]), None if floor is None else float(floor), msg.get("recheck_at") or 0
        )
        return {"ok": True}

    def precision_event(self, msg: dict[str, Any], conn: JobConnection) -> dict[str, Any]:
        self.jobs.precision_event(self.caller(conn), decode_precision_event(msg))
        return {"ok": True}

    def end(self, msg: dict[str, Any], conn: JobConnection) -> dict[str, Any]:
        return self.jobs.end(conn.id, msg.get("reason"))

    def report(self, msg: dict[str, Any], conn: JobConnection) -> dict[str, Any]:
        job = self.jobs.get(msg["job"])
        if job is None:
            kept = self.archive.report(msg["job"]) if self.archive is not None else None
            if kept is not None:
                return kept
            hint = _did_you_mean(msg["job"], [*self.jobs.jobs, *(r["job"] for r in self.archive.rows())]
                                 if self.archive else list(self.jobs.jobs))  # fmt: skip
            known = ", ".join(sorted(self.jobs.jobs)) or "none yet"
            raise ProtocolError(f"no job {msg['job']!r} on this node (known: {known}){hint}", field="job")
        report = self.jobs.report_with_series(job)
        # A run the daemon restarted under: its parts before, kept in the archive.
        return self.archive.with_parts(report) if self.archive is not None else report

    def live_rows(self) -> list[dict[str, Any]]:
        """The jobs the daemon holds, each joined with the kept parts of its run that came
        before it (the daemon restarted under it): what status, ``greenctl top`` and the
        Prometheus series show, so a run's counters go on across a restart, never back to
        the part since it."""
        live = self.jobs.list_jobs()
        runs = {(j["job"], j["run_id"]) for j in live if j.get("run_id")}
        before = [r for r in self._kept(live) if (r["job"], r.get("run_id")) in runs] if runs else []
        if not before:
            return live
        live_ids = {id(j) for j in live}
        return [
            join_rows(parts) if len(parts) > 1 else parts[-1]
            for parts in runs_of(before + live, key=_run_key)
            if id(parts[-1]) in live_ids  # (a kept run this live one does not go on from: not shown here)
        ]

    def list_jobs(self, msg: dict[str, Any], conn: JobConnection) -> dict[str, Any]:
        """The jobs the daemon holds, after the ended runs it kept from before (a restart
        does not empty ``greenctl jobs``); the parts of a run the daemon restarted under are
        joined into one row."""
        live = self.jobs.list_jobs()
        if self.archive is None:
            return {"jobs": live}
        return {"jobs": [join_rows(parts) for parts in runs_of(self._kept(live) + live, key=_run_key)]}

    def _kept(self, live: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The ended runs' rows the archive kept, but those still held (an ended job is
        listed once, as held); none without an archive."""
        if self.archive is None:
            return []
        held = {(j["job"], j.get("run_id"), j.get("started_at")) for j in live}
        return [
            r
            for r in self.archive.rows(self.jobs.keep_ended)
            if (r["job"], r.get("run_id"), r.get("started_at")) not in held
        ]

    def _keep(self, job: Job) -> None:
        """At a job's end (the registry's hook, outside its lock): its report to the archive."""
        assert self.archive is not None
        report = self.jobs.report_with_series(job)
        row = {k: report.get(k) for k in ROW_FIELDS}
        row["state"] = "ended"
        t_end = job.t_end_s
        ended_at = job.registered_wall_s + (t_end - job.registered_s) if t_end is not None else self.jobs.wall()
        row["ended_at"] = ended_at
        self.archive.save(row, report, int(ended_at * 1e9))


def _run_key(row: dict[str, Any]) -> tuple[str, str] | None:
    """A row's run (job id, run id); None where it has no run id (a run of its own)."""
    return (row["job"], row["run_id"]) if row.get("run_id") else None


# A "did you mean" compares the unknown id with this many known ones, each cut to this many
# characters: difflib's ratio costs the square of the length, and 400 crafted 128-character
# ids made one unknown id's report cost 0.8 s of the daemon's CPU (pipelined, the ticks stopped).
HINT_IDS, HINT_CHARS = 32, 48


def _did_you_mean(job: str, ids: list[str]) -> str:
    """The hint for an unknown job id: the closest of the first :data:`HINT_IDS` known ids
    (in-memory jobs first, then the archive's; duplicates once), or nothing."""
    known = list(dict.fromkeys(ids))[:HINT_IDS]
    cut = {k[:HINT_CHARS]: k for k in known}
    close = difflib.get_close_matches(job[:HINT_CHARS], list(cut), n=1)
    return f"; did you mean {cut[close[0]]!r}?" if close else ""
