"""What the command lines share: failing with a message (never a traceback), the log
format, and the daemon that greenctl's commands talk to (set once by greenctl's root
options, read by every subcommand module), and where a command reads ended jobs from (the
SQLite file a --store names, else the daemon's)."""

from __future__ import annotations

import errno
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import typer
from typer.core import TyperGroup

from greend.errors import DaemonUnavailable, GreendError, RequestRefused
from greend.ipc.client import Client

__all__ = [
    "DaemonTarget",
    "ReplyShapeGroup",
    "fail",
    "request",
    "setup_logging",
    "store_file",
    "store_path",
    "target",
    "try_request",
]


@dataclass
class DaemonTarget:
    """Where greenctl's requests go: the socket, whether the user named it (``--socket``
    or ``$GREEND_SOCKET``, so ``doctor`` checks that one), and how long to wait."""

    socket: Path | None = None
    named: bool = False
    timeout_s: float = 5.0
    replied: bool = False  # a reply came back in this command (see ReplyShapeGroup)

    def path(self) -> Path:
        if self.socket is None:
            raise RuntimeError("greenctl's root options were not parsed (no socket set)")
        return self.socket

    def client(self) -> Client:
        return Client(self.path(), timeout_s=self.timeout_s)


# greenctl's root callback fills this in before any subcommand runs.
target = DaemonTarget()


def fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


_WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # (a full disk or quota: never a read's)


@contextmanager
def output_errors_in_one_line() -> Iterator[None]:
    """Output greenctl could not write (a full disk, a quota) said in one line and exit 2,
    not a traceback; stdout is left behind so that exiting does not flush it again."""
    try:
        yield
    except OSError as e:
        if e.errno not in _WRITE_ERRORS:
            raise
        where = f" to {e.filename}" if e.filename else ""
        sys.stdout = open(os.devnull, "w")  # (kept open until exit)
        typer.echo(f"error: cannot write greenctl's output{where}: {e.strerror or e}", err=True)
        raise SystemExit(2) from None


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def request(op: str, **fields: Any) -> Any:
    """One request to the daemon; an absent daemon or a refusal ends the command with a
    message and greenctl's exit code (3: no daemon, 4: forbidden, 2: refused)."""
    try:
        with target.client() as c:
            result = c.request(op, **fields)
            target.replied = True
            return result
    except DaemonUnavailable as e:
        fail(str(e), code=3)
    except RequestRefused as e:
        fail(f"{e} [{e.code}]", code=4 if e.code == "forbidden" else 2)


class ReplyShapeGroup(TyperGroup):
    """greenctl's command group: a reply of a shape a command does not expect (a greend of
    another version, or not greend) ends the command with a message, not a traceback."""

    def invoke(self, ctx: Any) -> Any:  # (a typer Context: typer vendors its own click)
        target.replied = False
        try:
            return super().invoke(ctx)
        except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:
            if not target.replied:
                raise  # greenctl's own bug: its traceback helps
            typer.echo(
                f"error: unexpected reply from the daemon ({type(e).__name__}: {e}): a greend of another "
                "version? compare `greenctl --version` with `greend --version`",
                err=True,
            )
            raise typer.Exit(2) from None


def try_request(op: str, **fields: Any) -> Any:
    """Like :func:`greend.cli.common.request`, but the daemon being away is the caller's to handle."""
    try:
        with target.client() as c:
            return c.request(op, **fields)
    except RequestRefused as e:
        if e.field == "job":
            raise
        fail(f"{e} [{e.code}]", code=4 if e.code == "forbidden" else 2)


def store_file(store: str) -> Path:
    """A ``--store`` that is not a shared store's URL: the SQLite file it names (a path, or
    ``sqlite:///PATH``); any other URL is refused, naming the ones greenctl reads."""
    from greend.jobs.history import sqlite_path

    if store.startswith("sqlite:"):
        path = sqlite_path([store])
        if path is None:
            fail(f"--store {store!r}: a SQLite store is sqlite:///PATH")
        return path
    if "://" in store:
        fail(
            f"--store {store!r}: not a store greenctl reads: a SQLite file (a path, or sqlite:///PATH), "
            "influx://HOST:PORT?org=..&bucket=.., http://HOST:PORT (VictoriaMetrics) or prom://HOST:PORT"
        )
    return Path(store)


def store_path(store: Path | None) -> Path | None:
    """The SQLite store to read ended jobs from: --store, else the daemon's, else the config's."""
    from greend.config import load_config
    from greend.jobs.history import sqlite_path

    if store is not None:
        return store
    try:
        urls = [s["url"] for s in try_request("status").get("stores") or []]
    except (DaemonUnavailable, RequestRefused):
        try:
            urls = list(load_config(None).store_urls)
        except GreendError:
            return None
    path = sqlite_path(urls)
    try:
        return path if path is not None and path.exists() else None
    except PermissionError:  # the daemon's state dir is its uid's alone: it is asked instead
        return path
