"""The socket's ops as the daemon answers them, and who counts as an admin.

The daemon's own ops (``ping``, ``status``, ``probes``, ``energy``) are here; each domain
brings its ops from its edge: the jobs' from :mod:`greend.jobs.ops`, the control loop's
from :mod:`greend.control.ops`. Each op's schema, and whether it needs an admin, come
from :mod:`greend.protocol`; the wire format is in ``docs/protocol.md``.
"""

from __future__ import annotations

import grp
import pwd
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from greend import __version__
from greend.control.ops import ControlOps
from greend.errors import ProtocolError
from greend.ipc.server import NO_REPLY, Connection, Handler, IpcServer, LimitExceeded, Peer
from greend.jobs.ledger import Ledger
from greend.jobs.ops import JobHandler, JobOps
from greend.jobs.registry import QuotaExceeded

__all__ = ["RouteContext", "admin_needs", "handlers", "is_admin", "route_all"]


@dataclass(frozen=True)
class RouteContext:
    """What the socket's ops reach of the daemon, given explicitly by the daemon."""

    status: Callable[[], dict[str, Any]]  # the status document
    probe_rows: Callable[[], list[dict[str, Any]]]  # what each probe found
    ledger: Ledger
    jobs: JobOps
    control: ControlOps


def is_admin(peer: Peer, admin_group: str, root_is_admin: bool = True) -> bool:
    """Root (unless ``root_is_admin`` is off), or a member of ``admin_group`` (its
    primary group or a listed member). Off where uid 0 means little: under Kubernetes
    every container's root is uid 0 on the socket, so the shipped manifests grant the
    node to the admin group's gid alone."""
    if peer.uid == 0 and root_is_admin:
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


def admin_needs(admin_group: str, root_is_admin: bool = True) -> str:
    """Who passes :func:`is_admin`, as a refusal says it."""
    if not root_is_admin:
        if admin_group:
            return (
                f"a member of the group {admin_group!r} ([daemon] admin_group; uid 0 alone is not "
                "an admin here: [daemon] root_is_admin = false)"
            )
        return "an admin, and none can be: [daemon] root_is_admin = false and no admin_group is set"
    if admin_group:
        return f"root or a member of the group {admin_group!r} ([daemon] admin_group)"
    return "root (no [daemon] admin_group is set)"


def handlers(ctx: RouteContext) -> dict[str, Handler]:
    """Every op the daemon answers."""

    def energy(msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
        if msg["t1_s"] < msg["t0_s"]:
            raise ProtocolError("t1_s is before t0_s (a span from t0_s to t1_s, monotonic seconds)", field="t1_s")
        return {"energy_j": ctx.ledger.energy_between(msg["key"], msg["t0_s"], msg["t1_s"])}

    return {
        "ping": lambda msg, conn: {"pong": True, "version": __version__},
        "status": lambda msg, conn: ctx.status(),
        "probes": lambda msg, conn: {"probes": ctx.probe_rows()},
        "energy": energy,
        **{op: _job_route(h, silent=op in JobOps.SILENT) for op, h in ctx.jobs.handlers().items()},
        **ctx.control.handlers(),
    }


def _job_route(handler: JobHandler, *, silent: bool) -> Handler:
    """A job op as the server calls it: a per-user limit of the registry refuses as the
    server's :class:`LimitExceeded` ("refused"), and a fire-and-forget op sends no reply."""

    def route(msg: dict[str, Any], conn: Connection) -> Any:
        try:
            result = handler(msg, conn)
        except QuotaExceeded as e:
            raise LimitExceeded(str(e)) from None
        return NO_REPLY if silent else result

    return route


def route_all(server: IpcServer, ctx: RouteContext) -> None:
    for op, handler in handlers(ctx).items():
        server.route(op, handler)
