"""What greenctl does for the shell: its own options wherever the user puts them, and
completion of job ids (asked from the daemon) and policy names."""

from __future__ import annotations

from greend.cli.common import target
from greend.config import default_socket_path
from greend.ipc.client import Client

__all__ = ["complete_clock_policy", "complete_job", "hoist_root_options"]


def complete_job(incomplete: str) -> list[str]:
    """Shell completion of a job id: the daemon's jobs (running, and ended runs it kept);
    nothing, quietly, when it does not answer within a second."""
    try:
        with Client(target.socket or default_socket_path(), timeout_s=1.0) as c:
            jobs = c.request("jobs")["jobs"]
    except Exception:  # completion never prints a traceback into the user's shell
        return []
    return sorted({str(j["job"]) for j in jobs if str(j["job"]).startswith(incomplete)})


def complete_clock_policy(incomplete: str) -> list[str]:
    """Shell completion of a clock policy's name (the registry's, less precision)."""
    from greend.policies import POLICIES

    return sorted(n for n in POLICIES if n != "precision" and n.startswith(incomplete))


_ROOT_OPTIONS = ("--socket", "--timeout")


def hoist_root_options(argv: list[str]) -> list[str]:
    """``greenctl status --socket X`` as ``greenctl --socket X status``: greenctl's own
    options (which take a value) are moved before the command wherever they stand, up to
    a ``--`` (what follows it is a measured command's, untouched)."""
    end = argv.index("--") if "--" in argv else len(argv)
    head, rest = argv[:end], argv[end:]
    hoisted: list[str] = []
    kept: list[str] = []
    i = 0
    while i < len(head):
        a = head[i]
        name = a.split("=", 1)[0]
        if name in _ROOT_OPTIONS and kept:  # after the command: move it
            if "=" in a:
                hoisted.append(a)
                i += 1
            else:
                hoisted += head[i : i + 2]
                i += 2
            continue
        if name in _ROOT_OPTIONS and "=" not in a:  # before the command: keep it with its value
            kept += head[i : i + 2]
            hoisted += kept[-2:]
            del kept[-2:]
            i += 2
            continue
        kept.append(a)
        i += 1
    return hoisted + kept + rest
