"""The command line: ``greend`` (run the daemon, restore) and ``greenctl``
(show and steer it), with ``doctor``, ``install-systemd``, ``demo`` and the
report's rendering. The console scripts point at :func:`ctl_main` and
:func:`daemon_main`."""

from __future__ import annotations

from greend.cli.greenctl import ctl_main
from greend.cli.greend_cmd import daemon_main

__all__ = ["ctl_main", "daemon_main"]
