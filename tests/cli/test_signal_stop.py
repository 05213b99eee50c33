"""greend's SIGTERM/SIGINT handler never waits on the lock of the Event it sets: the
handler runs on the main thread, which may hold that lock (inside ``stop_event.wait()``)."""

from __future__ import annotations

import subprocess
import sys

from tests.support import REPO

SCRIPT = """
import signal, threading, time
from greend.cli.greend_cmd import signal_stopper

class D:
    def __init__(self):
        self.stop_event = threading.Event()
    def stop(self):
        self.stop_event.set()

d = D()
handler = signal_stopper(d)
# The main thread holds the Event's lock, as it does for an instant inside wait(), when
# the signal's handler runs (here: called in that instant).
with d.stop_event._cond:
    handler(signal.SIGTERM, None)
print("handler returned", flush=True)
assert d.stop_event.wait(5.0), "the daemon was never told to stop"
print("stopped")
"""


def test_the_signal_handler_returns_while_the_main_thread_holds_the_events_lock() -> None:
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=20)
    assert r.returncode == 0 and r.stdout.split() == ["handler", "returned", "stopped"], r.stdout + r.stderr
