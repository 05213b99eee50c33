"""The public surface: every name in a package's __all__ exists, and the training
side stays out of the daemon's imports."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from .support import REPO, env


@pytest.mark.parametrize(
    "module",
    [
        "greend",
        "greend.errors",
        "greend.config",
        "greend.ipc",
        "greend.ipc.client",
        "greend.ipc.server",
        "greend.jobs",
        "greend.jobs.ledger",
        "greend.jobs.registry",
        "greend.daemon",
        "greend.daemon.core",
        "greend.control",
        "greend.control.loop",
        "greend.actuators",
        "greend.actuators.controller",
        "greend.actuators.state",
        "greend.stores",
        "greend.testing",
        "greend.testing.harness",
        "greend.cli",
        "greend.probes",
        "greend.probes.base",
        "greend.probes.nvml",
        "greend.probes.rapl",
        "greend.probes.host",
        "greend.probes.sim",
        "greend.probes.fake_nvml",
        "greend.probes.fake_sysfs",
        "greend.policies",
        "greend.policies.base",
    ],
)
def test_all_names_exist_and_are_unique(module: str) -> None:
    mod = importlib.import_module(module)
    names = list(getattr(mod, "__all__", []))
    assert names, f"{module} has no __all__"
    assert len(names) == len(set(names))
    for name in names:
        assert hasattr(mod, name), f"{module}.__all__ names {name!r}, which does not exist"


def test_the_daemon_and_greenctl_never_import_torch() -> None:
    code = (
        "import sys; import greend.cli, greend.daemon, greend.control, greend.cli.doctor, greend.cli.demo; "
        "print('torch' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO, env=env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_error_tree() -> None:
    from greend import errors

    for name in errors.__all__:
        cls = getattr(errors, name)
        # Every error is a GreendError; the one warning (the callback's) is a UserWarning.
        assert issubclass(cls, errors.GreendError) or issubclass(cls, UserWarning) and name == "GreendWarning"
        assert name in (errors.__doc__ or ""), f"{name} is missing from the tree in the docstring"


def test_the_warning_class_comes_without_torch() -> None:
    """``from greend import GreendWarning`` (to filter it) must not pay for torch's import."""
    code = "import sys; from greend import GreendWarning; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO, env=env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
