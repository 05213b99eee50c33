"""What a new user meets first: a socket under /tmp, greenctl's options where a user puts
them, a socket path that is a directory, small figures, the systemd unit's sandbox, a
world-open socket mode, and greend run from the folder that holds its checkout."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from greend.cli.install import hidden_from_unit, install_systemd
from greend.cli.render import fmt
from greend.cli.shell import hoist_root_options
from greend.config import load_config
from greend.errors import ConfigError, DaemonUnavailable
from greend.fsutil import check_private_dir, check_socket_slot
from greend.ipc.client import Client
from greend.testing.daemon_proc import daemon_command
from tests.support import REPO

# The socket's directory ---------------------------------------------------------------


def test_a_sticky_shared_dir_is_accepted_for_the_socket_only(tmp_path: Path) -> None:
    shared = tmp_path / "tmp-like"
    shared.mkdir()
    shared.chmod(0o1777)  # what /tmp is
    check_private_dir(shared, "the socket's directory", shared_sticky=True)
    with pytest.raises(PermissionError, match="writable by its group or by others"):
        check_private_dir(shared, "the state dir")  # never for the state dir


def test_a_world_writable_dir_without_the_sticky_bit_is_refused(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)  # anyone may rename or remove greend's socket there
    with pytest.raises(PermissionError, match="a directory of greend's own"):
        check_private_dir(open_dir, "the socket's directory", shared_sticky=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another uid")
def test_a_socket_path_another_uid_owns_is_left_alone(tmp_path: Path) -> None:
    planted = tmp_path / "g.sock"
    planted.write_text("")
    os.chown(planted, 65534, 65534)
    with pytest.raises(PermissionError, match="belongs to uid 65534"):
        check_socket_slot(planted)
    assert planted.exists()
    check_socket_slot(tmp_path / "free.sock")  # nothing there: fine


def test_a_sticky_dir_owned_by_a_stranger_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give the directory to another uid")
    d = tmp_path / "theirs"
    d.mkdir()
    d.chmod(0o1777)
    os.chown(d, 65534, 65534)  # its owner could remove greend's socket from it
    with pytest.raises(PermissionError, match="owned by uid 65534"):
        check_private_dir(d, "the socket's directory", shared_sticky=True)


# greenctl's command line --------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["status", "--socket", "X"], ["--socket", "X", "status"]),
        (["status", "--json", "--socket=X"], ["--socket=X", "status", "--json"]),
        (["--socket", "X", "report", "J", "--timeout", "3"], ["--socket", "X", "--timeout", "3", "report", "J"]),
        (["measure", "--", "cmd", "--socket", "y"], ["measure", "--", "cmd", "--socket", "y"]),
    ],
)
def test_greenctl_options_after_the_command_are_greenctls(argv: list[str], expected: list[str]) -> None:
    assert hoist_root_options(argv) == expected


def test_status_with_socket_after_the_command_runs(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "greend.ctl", "status", "--socket", str(tmp_path / "none.sock")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert r.returncode == 3, r  # the daemon is absent: not "No such option"
    assert f"no greend socket at {tmp_path / 'none.sock'}" in r.stderr


def test_help_shows_no_bool_metavar_for_flags() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "greend.ctl", "--help"], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    version = next(ln for ln in r.stdout.splitlines() if "--version" in ln)
    assert "<bool>" not in version, version


def test_a_socket_path_that_is_a_directory_says_so(tmp_path: Path) -> None:
    with pytest.raises(DaemonUnavailable, match="it is a directory, not a socket"):
        Client(tmp_path, timeout_s=1.0).connect()


def test_a_socket_nobody_listens_on_says_so(tmp_path: Path) -> None:
    path = tmp_path / "dead.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()  # bound, never listening: what a daemon killed uncleanly leaves
    assert stat.S_ISSOCK(path.lstat().st_mode)
    with pytest.raises(DaemonUnavailable, match="no daemon listens"):
        Client(path, timeout_s=1.0).connect()


# Figures ------------------------------------------------------------------------------


def test_small_figures_keep_two_significant_digits() -> None:
    assert fmt(0.038) == "0.038"
    assert fmt(0.0) == "0.0"
    assert fmt(12.345) == "12.3"
    assert fmt(0.25) == "0.2"  # one place shows it already
    assert fmt(0.00123, 2) == "0.0012"


def test_a_small_gflops_per_watt_is_not_printed_as_zero() -> None:
    """The report and ``greenctl top`` printed 0.00015 GFLOPS/W (a tiny job's, a sim's) as
    0.000: their fixed-point figures keep two significant digits too."""
    from greend.cli.render import render_report
    from greend.cli.top import _num as top_num

    rep = {"job": "tiny", "state": "ended", "steps": 3, "duration_s": 1.0, "flops": 3e5, "gpu_energy_j": 2000.0,
           "cpu_energy_j": 0.0, "energy_j": 2000.0, "energy_kwh": 2000 / 3.6e6, "gflops_per_w": 0.00015}  # fmt: skip
    text = render_report(rep)
    assert "GFLOPS/W         0.00015" in text, text
    assert top_num(0.00015, ".2f") == "0.00015" and top_num(42.5, ".2f") == "42.50" and top_num(7.0) == "7"


# The systemd unit's sandbox -----------------------------------------------------------


def test_install_systemd_refuses_a_greend_the_unit_cannot_see(tmp_path: Path) -> None:
    assert hidden_from_unit("/home/alice/greend/.venv/bin/greend") == [
        "/home/alice/greend/.venv/bin/greend (under /home, hidden by ProtectHome=yes)"
    ]
    assert "PrivateTmp=yes" in hidden_from_unit("/tmp/venv/bin/greend")[0]
    assert hidden_from_unit("/opt/greend/bin/greend") == []
    with pytest.raises(ConfigError, match=r"ProtectHome=yes\)\. Install greend where the service can reach it"):
        install_systemd(tmp_path, greend_bin="/home/alice/.venv/bin/greend")
    assert not (tmp_path / "etc/systemd/system/greend.service").exists()  # nothing written
    install_systemd(tmp_path, greend_bin="/home/alice/.venv/bin/greend", hidden_ok=True)  # --force
    assert "ExecStart=/home/alice/.venv/bin/greend" in (tmp_path / "etc/systemd/system/greend.service").read_text()


def test_install_systemd_follows_the_script_to_its_interpreter(tmp_path: Path) -> None:
    script = tmp_path / "greend"
    script.write_text("#!/home/alice/venv/bin/python\nprint()\n")
    hidden = hidden_from_unit(str(script))
    assert any(h.startswith("/home/alice/venv/bin/python (under /home") for h in hidden), hidden


# The config ---------------------------------------------------------------------------


def test_a_world_open_socket_mode_beside_a_group_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "g.toml"
    cfg.write_text('[daemon]\nsocket_mode = "666"\n')
    with pytest.raises(ConfigError, match=r"socket_mode = '666' lets every local user use the socket"):
        load_config(cfg)
    cfg.write_text('[daemon]\nsocket_mode = "0666"\nsocket_group = ""\n')  # open on purpose
    assert load_config(cfg).daemon.socket_mode == "0666"


# Run from the folder that holds the checkout -----------------------------------------


def test_the_daemon_subprocess_never_imports_the_current_directory() -> None:
    cmd = daemon_command(Path("c.toml"), Path("s.sock"), Path("state"))
    assert cmd[1] == "-P", cmd


def test_import_from_the_folder_that_holds_the_checkout(tmp_path: Path) -> None:
    """``cd ..; python train.py`` with the checkout in ``./greend``: the package, not the
    checkout's folder as an empty namespace package."""
    import sysconfig

    if not (Path(sysconfig.get_paths()["purelib"]) / "greend-editable-first.pth").exists():
        pytest.skip("this venv was not made by `make venv` (it installs .ci/greend-editable-first.pth)")
    (tmp_path / "greend").symlink_to(REPO)
    (tmp_path / "train.py").write_text("import greend\nprint(greend.__version__)\n")
    for argv in ([sys.executable, "train.py"], [sys.executable, "-c", "import greend; print(greend.__version__)"]):
        r = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip()


# Completion and "did you mean" -------------------------------------------------------


def test_policy_names_complete_and_a_typo_is_answered_with_the_name() -> None:
    from greend.cli.shell import complete_clock_policy
    from greend.errors import PolicyError
    from greend.policies import get_policy

    assert complete_clock_policy("e") == ["efficient"]
    assert "precision" not in complete_clock_policy("")  # not a clock policy
    with pytest.raises(PolicyError, match=r"unknown policy 'efficent' \(did you mean 'efficient'\?\)"):
        get_policy("efficent")


def test_job_ids_complete_from_the_daemon(tmp_path: Path) -> None:
    from greend.cli.common import target
    from greend.cli.shell import complete_job
    from greend.testing.fake_daemon import FakeDaemon

    sock = tmp_path / "g.sock"
    target.socket = tmp_path / "nobody.sock"
    assert complete_job("") == []  # no daemon: nothing, quietly
    d = FakeDaemon(sock).start()
    try:
        d.server.route("jobs", lambda msg, conn: {"jobs": [{"job": "resnet-7"}, {"job": "resnet-8"}, {"job": "gpt"}]})
        target.socket = sock
        assert complete_job("res") == ["resnet-7", "resnet-8"]
    finally:
        d.stop()
        target.socket = None
