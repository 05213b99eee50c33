"""``greenctl events``: the controller's decisions, jobs starting and ending and policy
changes, one line each, from successive ``status`` documents."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from greend.cli.events import EventFeed, run_events
from tests.support import REPO, DaemonProc, env, start_daemon


def _st(policy: str = "none", t: float | None = None, reason: str = "", jobs: dict[str, str] | None = None) -> dict:
    last = {"t": t, "reason": reason, "changed_jobs": ["j1"]} if t is not None else None
    return {
        "policy": {"name": policy, "last_decision": last},
        "jobs": [{"job": k, "state": v} for k, v in (jobs or {}).items()],
    }


def test_each_change_is_one_event_and_the_first_look_is_not_one() -> None:
    feed = EventFeed()
    assert feed.diff(_st(t=1.0, reason="old", jobs={"j0": "running"})) == []  # what was there before
    assert feed.diff(_st(t=1.0, reason="old", jobs={"j0": "running"})) == []  # nothing new
    ev = feed.diff(
        _st(policy="efficient", t=2.0, reason="gpu0 capped at 1400 MHz", jobs={"j0": "ended", "j1": "running"})
    )
    texts = [(e["kind"], e["text"]) for e in ev]
    assert ("policy", "policy none -> efficient") in texts
    assert ("decision", "gpu0 capped at 1400 MHz  [changed: j1]") in texts
    assert ("job", "job j0 ended") in texts and ("job", "job j1 running") in texts
    quiet = EventFeed()
    quiet.diff({"policy": {"name": "none", "last_decision": {"t": 1.0, "reason": "measuring only"}}})
    again = {"policy": {"name": "none", "last_decision": {"t": 2.0, "reason": "measuring only"}}}
    assert quiet.diff(again) == []  # the same word every period is no news


def test_run_events_stops_after_count() -> None:
    docs = iter([_st(t=1.0), _st(t=2.0, reason="a"), _st(t=3.0, reason="b"), _st(t=4.0, reason="c")])
    out: list[str] = []
    run_events(lambda: next(docs), out.append, interval_s=0.0, as_json=True, count=2, sleep=lambda s: None)
    assert [json.loads(x)["text"] for x in out] == ["a  [changed: j1]", "b  [changed: j1]"]


@pytest.mark.e2e
def test_events_show_a_policy_change_on_a_real_daemon(tmp_path: Path, daemons: list[DaemonProc]) -> None:
    d = start_daemon(tmp_path, "--sim", "1", "--hz", "20")
    daemons.append(d)
    feed = subprocess.Popen(
        [sys.executable, "-m", "greend.ctl", "--socket", str(d.socket), "events", "--json", "--count", "1",
         "--interval", "0.1"],
        stdout=subprocess.PIPE, text=True, cwd=REPO, env=env(),
    )  # fmt: skip
    time.sleep(1.0)  # its first look taken
    d.ctl("policy", "set", "static", "--param", "clock_cap_mhz=1400")
    out, _ = feed.communicate(timeout=30)
    events: list[dict[str, Any]] = [json.loads(x) for x in out.splitlines()]
    assert events and events[0]["kind"] == "policy" and events[0]["text"] == "policy none -> static"
