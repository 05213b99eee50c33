"""Test doubles that ship with greend, for users' tests and ours:
:class:`FakeDaemon` (a socket that answers like the daemon) and, in
:mod:`greend.testing.harness`, a harness that replays a policy against
simulated GPUs without a daemon."""

from __future__ import annotations

from greend.testing.fake_daemon import FakeDaemon, SilentDaemon

__all__ = ["FakeDaemon", "SilentDaemon"]
