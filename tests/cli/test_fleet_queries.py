"""The cluster report's reads of a shared store are bounded by labels and time, never a full
export: only the per-job summary series, the job's label, a start time; a listing reads the
last day unless told otherwise (``greenctl jobs --store URL --since``)."""

from __future__ import annotations

import time
from urllib.parse import parse_qs, urlsplit

import pytest
from typer.testing import CliRunner

from greend.cli.greenctl import ctl_app
from greend.jobs.history import (
    LIST_LOOKBACK_S,
    REPORT_LOOKBACK_S,
    parse_duration_s,
    shared_job_rows,
    shared_jobs,
)
from greend.points import JOB_SUMMARY_FIELDS
from tests.cli.test_shared_store_report import _Handler, server  # noqa: F401  # the fixture, by name


def _query(path: str) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(urlsplit(path).query).items()}


def test_a_jobs_rows_are_read_by_its_label_its_summary_series_and_a_start(server: tuple[str, type[_Handler]]) -> None:  # noqa: F811  # the fixture
    url, handler = server
    before = time.time()
    shared_job_rows(url, "j1")
    q = _query(handler.paths[-1])
    assert q["match[]"] == '{__name__=~"greend_job_(' + "|".join(JOB_SUMMARY_FIELDS) + ')",job="j1"}'
    assert "steps_" not in q["match[]"] and ".+" not in q["match[]"]  # not the per-interval step rows
    assert before - REPORT_LOOKBACK_S - 1 <= float(q["start"]) <= time.time() - REPORT_LOOKBACK_S + 1


def test_a_listing_reads_the_last_day_or_what_since_says(server: tuple[str, type[_Handler]]) -> None:  # noqa: F811  # the fixture
    url, handler = server
    shared_jobs(url)
    q = _query(handler.paths[-1])
    assert "job=" not in q["match[]"]
    assert float(q["start"]) == pytest.approx(time.time() - LIST_LOOKBACK_S, abs=5)
    r = CliRunner().invoke(ctl_app, ["jobs", "--store", url, "--since", "2h"])
    assert r.exit_code == 0, r.output
    assert float(_query(handler.paths[-1])["start"]) == pytest.approx(time.time() - 7200, abs=5)
    r = CliRunner().invoke(ctl_app, ["jobs", "--store", url, "--since", "soon"])
    assert r.exit_code == 2 and "--since: not a duration: 'soon'" in r.output


def test_durations() -> None:
    assert parse_duration_s("30m") == 1800 and parse_duration_s("12h") == 43200
    assert parse_duration_s("7d") == 7 * 86400 and parse_duration_s("2w") == 14 * 86400
    assert parse_duration_s("90") == 90
    for bad in ("", "d", "-1d", "0s", "1y", "nan", "inf"):
        with pytest.raises(ValueError, match="not a duration"):
            parse_duration_s(bad)
