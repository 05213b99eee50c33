"""Fixtures the tests share, a "figures" section at the end of the run, and the
markers by folder (everything under tests/e2e/ is ``e2e``). Helpers are in
tests/support.py."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from .support import DaemonProc

if TYPE_CHECKING:
    from greend.testing.fake_daemon import FakeDaemon

# Figures that tests measure and the run should show (pytest hides a passing test's
# output): a test takes the ``figure`` fixture and calls it; the lines are printed in
# a "figures" section at the end of the run, passed or failed.
_FIGURES: list[str] = []


@pytest.fixture()
def figure(request: pytest.FixtureRequest) -> Callable[[str], None]:
    def add(text: str) -> None:
        _FIGURES.append(f"{request.node.nodeid}: {text}")

    return add


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _FIGURES:
        terminalreporter.section("figures")
        for line in _FIGURES:
            terminalreporter.write_line(line)


@pytest.fixture()
def daemons(tmp_path: Path) -> Iterator[list[DaemonProc]]:
    started: list[DaemonProc] = []
    yield started
    for d in started:
        d.stop(signal.SIGKILL if d.proc.poll() is None else signal.SIGTERM)


@pytest.fixture()
def sock_path(tmp_path: Path) -> Path:
    return tmp_path / "greend.sock"


@pytest.fixture()
def daemon(sock_path: Path) -> Iterator[FakeDaemon]:
    """greend.testing.FakeDaemon on a socket of the test's own (callback-side tests)."""
    from greend.testing.fake_daemon import FakeDaemon

    d = FakeDaemon(sock_path).start()
    yield d
    d.stop()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """torch in this process computes on one thread. The tests' models are small, and on a
    machine of few cores shared with daemons, trainers and other runs, torch's default
    thread per core spins at every op's barrier while the others hold the cores: a
    training loop of these tests took 2 s alone and 15 s beside other work. (The trainer
    scripts under tests/scripts set one thread for themselves.)"""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def _deselects_e2e(markexpr: str) -> bool:
    """Whether ``-m markexpr`` leaves out every e2e test whatever its other markers: a
    plain conjunction with ``not e2e`` among its terms ("not e2e and not slow")."""
    terms = [t.strip() for t in markexpr.split(" and ")]
    return "not e2e" in terms and not any(" or " in f" {t} " or "(" in t or ")" in t for t in terms)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``-m "not e2e ..."`` the tests/e2e folder is not even imported: its tests
    would all be deselected, and importing its modules (torch, torchao, their assertion
    rewriting) cost the fast tests about 4 s."""
    if collection_path.name == "e2e" and collection_path.parent == Path(__file__).parent:
        if _deselects_e2e(str(config.getoption("markexpr", "") or "")):
            return True
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/tests/e2e/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.e2e)
