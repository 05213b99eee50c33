"""``greenctl events``: a live feed of what the controller decides, one line each, as
``tail -f`` would show it: every policy decision (its reason, the jobs it changed), a
job starting or ending, and the policy changing.

It polls the daemon's ``status`` every ``interval_s`` (default 0.5 s, half the policy's
default period), so a decision is seen once; decisions made faster than the interval
show only the last of them (``--interval`` lower to see more), and a decision that says
what the last one said (a policy holding, measuring only) is not repeated.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

__all__ = ["EventFeed"]


class EventFeed:
    """What changed between two ``status`` documents, as event dicts."""

    def __init__(self) -> None:
        self._decision_t: float | None = None
        self._decision_text = ""
        self._jobs: dict[str, str] = {}
        self._policy: str | None = None
        self._primed = False

    def diff(self, st: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        pol = st.get("policy") or {}
        name = pol.get("name")
        if self._primed and name != self._policy:
            events.append({"t": time.time(), "kind": "policy", "text": f"policy {self._policy} -> {name}"})
        self._policy = name
        last = pol.get("last_decision") or {}
        t = last.get("t")
        if t is not None and t != self._decision_t:
            changed = last.get("changed_jobs") or []
            text = str(last.get("reason") or "") + (f"  [changed: {', '.join(changed)}]" if changed else "")
            # The policy decides every period: the same word again (measuring only, holding) is no news.
            if self._primed and (text != self._decision_text or changed):
                events.append({"t": t, "kind": "decision", "text": text})
            self._decision_t, self._decision_text = t, text
        jobs = {str(j["job"]): str(j.get("state")) for j in st.get("jobs") or []}
        if self._primed:
            for job, state in jobs.items():
                if self._jobs.get(job) != state:
                    events.append({"t": time.time(), "kind": "job", "text": f"job {job} {state}"})
        self._jobs = jobs
        self._primed = True
        return events


def run_events(
    request: Callable[[], dict[str, Any]],
    emit: Callable[[str], None],
    *,
    interval_s: float,
    as_json: bool = False,
    count: int | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Poll until Ctrl-C (or ``count`` events); each event is one line."""
    feed = EventFeed()
    shown = 0
    try:
        while True:
            for e in feed.diff(request()):
                stamp = time.strftime("%H:%M:%S", time.localtime(e["t"]))
                emit(json.dumps(e) if as_json else f"{stamp}  {e['kind']:8}  {e['text']}")
                shown += 1
                if count is not None and shown >= count:
                    return
            sleep(interval_s)
    except KeyboardInterrupt:
        return
