"""greenctl's command line itself: --version, completion, --timeout, doctor --json, and
a --plot path that cannot be written (refused before anything else, no traceback)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from greend import __version__
from greend.cli.greenctl import ctl_app
from greend.cli.greend_cmd import daemon_app


def run(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(ctl_app, list(args))
    return r.exit_code, r.output


def test_version_of_both_commands() -> None:
    assert run("--version") == (0, f"greenctl (greend) {__version__}\n")
    r = CliRunner().invoke(daemon_app, ["--version"])
    assert r.exit_code == 0 and r.output == f"greend {__version__}\n"


def test_shell_completion_is_offered() -> None:
    code, out = run("--help")
    assert code == 0 and "--install-completion" in out and "--show-completion" in out


@pytest.mark.parametrize("bad", ["-1", "0", "nan"])
def test_timeout_must_be_positive(bad: str, tmp_path: Path) -> None:
    code, out = run("--socket", str(tmp_path / "s.sock"), "--timeout", bad, "status")
    assert code == 2 and f"--timeout {bad}: expected seconds > 0" in out and "Traceback" not in out


def test_doctor_json(tmp_path: Path) -> None:
    code, out = run("--socket", str(tmp_path / "s.sock"), "doctor", "--json", "--sysfs-root", str(tmp_path))
    doc = json.loads(out)
    assert doc["exit"] == code
    assert doc["checks"] and all({"level", "name", "detail", "fix"} <= set(c) for c in doc["checks"])
    assert {c["level"] for c in doc["checks"]} <= {"ok", "info", "warn", "fail"}


@pytest.mark.parametrize(
    "plot, said",
    [("/no/such/dir/x.png", "no directory /no/such/dir"), ("x.txt", "give a file ending in .png")],
)
def test_a_bad_plot_path_is_refused_in_one_line(plot: str, said: str, tmp_path: Path) -> None:
    code, out = run("--socket", str(tmp_path / "s.sock"), "report", "j", "--plot", plot)
    assert code == 2 and said in out and "Traceback" not in out
    assert len(out.strip().splitlines()) == 1
