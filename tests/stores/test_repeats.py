"""A store's error that repeats every second is one log line per five minutes."""

from __future__ import annotations

import logging

import pytest

from greend.stores._repeats import LOG_AGAIN_S, RepeatedErrors


def test_an_error_every_second_is_logged_once_then_again_with_its_count(caplog: pytest.LogCaptureFixture) -> None:
    """A full disk failed every SQLite batch and every spool append: 7,200 lines an hour
    each. The same error (its counts aside) is logged once, then after LOG_AGAIN_S with how
    many more there were; another error is logged at once."""
    now = [0.0]
    errors = RepeatedErrors(logging.getLogger("greend.test.repeats"), clock=lambda: now[0])
    with caplog.at_level(logging.ERROR, logger="greend.test.repeats"):
        for k in range(600):
            now[0] = float(k)
            errors.error("sqlite store: %d of a batch of %d points lost: %s", k % 7 + 1, 64, "disk full")
        errors.error("sqlite store: %s", "database is locked")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "sqlite store: 1 of a batch of 64 points lost: disk full",
        f"sqlite store: {300 % 7 + 1} of a batch of 64 points lost: disk full "
        f"(and {int(LOG_AGAIN_S) - 1} more like it in the last {LOG_AGAIN_S:.0f} s)",
        "sqlite store: database is locked",
    ], lines
