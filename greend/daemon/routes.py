"""The socket's ops as the daemon answers them, and who counts as an admin.

Each op's schema, and whether it needs an admin, come from :mod:`greend.protocol`;
the wire format is in ``docs/protocol.md``.
"""

from __future__ import annotations

import grp
import pwd
from typing import TYPE_CHECKING, Any

from greend import __version__
from greend.control.ops import ControlOps
from greend.errors import ProtocolError
from greend.ipc.server import NO_REPLY, Connection, Handler, IpcServer, Peer

if TYPE_CHECKING:
    from greend.daemon.core import Daemon

__all__ = ["admin_needs", "handlers", "is_admin", "route_all"]


def is_admin(peer: Peer, admin_group: str) -> bool:
    """Root, or a member of ``admin_group`` (its primary group or a listed member)."""
    if peer.uid == 0:
        return True
    if not admin_group:
        return False
    try:
        group = grp.getgrnam(admin_group)
    except KeyError:
        return False
    if peer.gid == group.gr_gid:
        return True
    try:
        user = pwd.getpwuid(peer.uid).pw_name
    except KeyError:
        return False
    return user in group.gr_mem


def admin_needs(admin_group: str) -> str:
    """Who passes :func:`is_admin`, as a refusal says it."""
    if admin_group:
        return f"root or a member of the group {admin_group!r} ([daemon] admin_group)"
    return "root (no [daemon] admin_group is set)"


def handlers(d: Daemon) -> dict[str, Handler]:
    """Every op the daemon answers."""
    jobs = d.jobs

    def steps(msg: dict[str, Any], conn: Connection) -> Any:
        jobs.report_steps(msg, conn)
        return NO_REPLY

    def intervals(msg: dict[str, Any], conn: Connection) -> Any:
        jobs.report_intervals(msg, conn)
        return NO_REPLY

    def report(msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
        job = jobs.get(msg["job"])
        if job is None:
            known = ", ".join(sorted(jobs.jobs)) or "none yet"
            raise ProtocolError(f"no job {msg['job']!r} on this node (known: {known})", field="job")
        return jobs.report_with_series(job)

    def energy(msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
        return {"energy_j": d.ledger.energy_between(msg["key"], msg["t0_s"], msg["t1_s"])}

    return {
        "ping": lambda msg, conn: {"pong": True, "version": __version__},
        "status": lambda msg, conn: d.status(),
        "probes": lambda msg, conn: {"probes": d.probing.rows()},
        "energy": energy,
        "register": jobs.register,
        "steps": steps,
        "intervals": intervals,
        "heartbeat": jobs.heartbeat,
        "end": jobs.end,
        "jobs": lambda msg, conn: {"jobs": jobs.list_jobs()},
        "report": report,
        "pace": jobs.pace,
        "precision_event": jobs.precision_event,
        **ControlOps(d.control).handlers(),
    }


def route_all(server: IpcServer, d: Daemon) -> None:
    for op, handler in handlers(d).items():
        server.route(op, handler)
