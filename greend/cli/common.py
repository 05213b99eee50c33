"""What both command lines share: failing with a message (never a traceback) and
the log format."""

from __future__ import annotations

import logging
import sys

import typer

__all__ = ["fail", "setup_logging"]


def fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
